"""Serving real apps on loopback for the Gym tests: ASGI on uvicorn, aiohttp web, and subprocesses.

In-process servers run on their own thread (and event loop), so they start from an empty context
like a separate server process would; subprocess servers get a socket already bound by the test, so
the port is known before they start and nothing races for it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from aiohttp import web

from tests.loopback import AsgiServer, Served, bind_loopback

__all__ = ["AiohttpServer", "AsgiServer", "ServerProcess"]

ROOT = Path(__file__).resolve().parent.parent


class AiohttpServer(Served):
    """An aiohttp ``web.Application`` on its own event loop in a background thread."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, access_log=None)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> AiohttpServer:
        sock = bind_loopback(self.host)
        self.port = sock.getsockname()[1]
        self._thread.start()

        async def start() -> None:
            await self._runner.setup()
            await web.SockSite(self._runner, sock, backlog=2048).start()

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


class ServerProcess(Served):
    """``python -m tests.gym_apps KIND`` serving on a socket bound here at construction; stopped by PID.

    The port is known before any process starts, so servers that must name each other (as trusted
    hosts, as upstreams) can all be configured up front.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._sock = bind_loopback(self.host)
        self.port = self._sock.getsockname()[1]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> ServerProcess:
        full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        with self._sock:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.gym_apps", self.kind, str(self._sock.fileno())],
                cwd=ROOT,
                env=full_env,
                pass_fds=[self._sock.fileno()],
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} server did not become ready")
            time.sleep(0.05)

    def seen(self) -> list[dict[str, str]]:
        """Headers of every request the server handled (besides health and this query)."""
        return httpx.get(f"{self.url}/seen", timeout=5).json()  # type: ignore[no-any-return]

    def stop(self) -> None:
        self._sock.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
