"""Serving a test's own app on loopback: an ASGI app on uvicorn in a background thread.

The server runs on its own thread and event loop, so a request it handles starts from an empty
context, as it would in a separate server process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any

import uvicorn


def bind_loopback(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A socket bound (not listening) on a loopback address; port 0 picks a free one."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class Served:
    """Where a server listens; ``port`` is known once it is bound."""

    host = "127.0.0.1"
    port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"


class PromptServer(uvicorn.Server):
    """uvicorn's server, stopping as soon as it is told to. Its main loop looks for ``should_exit``
    every 0.1 s and its shutdown pauses 0.1 s for open connections even when there are none: some
    0.2 s per server, and a test run starts and stops well over a thousand. :meth:`stop` wakes the
    loop at once; with no connection or request left, shutdown skips the pause. Everything else
    (connections still open, requests in flight, lifespan) goes through uvicorn's own shutdown."""

    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    def stop(self) -> None:
        """Ask the server to exit, from any thread."""
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                loop.call_soon_threadsafe(wake.set)

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)  # uvicorn's tick, cut short by stop()
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.server_state.connections or self.server_state.tasks:
            await super().shutdown(sockets)
            return
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()


class AsgiServer(Served):
    """An ASGI app on uvicorn in a background thread, for ``with AsgiServer(app) as server:``."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        lifespan: str = "off",
        log_level: str = "warning",
        tls: tuple[str, str] | None = None,
    ) -> None:
        self.app, self.host, self.port = app, host, port
        self.lifespan, self.log_level = lifespan, log_level
        self.tls = tls  # (certificate file, key file): serve https
        self._server: PromptServer | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> AsgiServer:
        sock = bind_loopback(self.host, self.port)
        self.port = sock.getsockname()[1]
        certfile, keyfile = self.tls or (None, None)
        config = uvicorn.Config(
            self.app,
            log_level=self.log_level,
            lifespan=self.lifespan,
            access_log=False,
            backlog=2048,
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
        )
        self._server = PromptServer(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None and self._thread is not None:
            self._server.stop()
            self._thread.join(timeout=10)
