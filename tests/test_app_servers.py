"""Real servers serve real apps with the session middleware on (issue 28, item 1).

Each server loads the app its own way: uvicorn probes an app object by calling it with no argument
(to tell it from a factory) and picks ASGI 2 or 3 from its ``__call__``; given an import string it
imports the module; hypercorn and gunicorn (with uvicorn workers, forked) probe on their own;
aiohttp's ``AppRunner`` and ``web.run_app`` freeze the app. Each app answers with the session it sees
(sent as W3C baggage), runs a lifespan handler and serves a websocket, which pass through untouched.
Servers started in their own process configure themselves as zero code does (``OTEL_SESSION_AUTO``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, Router, WebSocketRoute
from starlette.websockets import WebSocket

import otel_session
from otel_session.servers import SessionMiddleware
from tests.loopback import AsgiServer

STARLETTE_APP = """
from contextlib import asynccontextmanager
import otel_session
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute

STARTED = []

@asynccontextmanager
async def lifespan(app):
    STARTED.append(True)
    yield

async def who(request):
    return JSONResponse({"session": otel_session.current_session_id(), "started": bool(STARTED)})

async def ws(websocket):
    await websocket.accept()
    await websocket.send_json({"session": otel_session.current_session_id()})
    await websocket.close()

app = Starlette(routes=[Route("/who", who), WebSocketRoute("/ws", ws)], lifespan=lifespan)
"""

AIOHTTP_APP = """
import sys
import otel_session
from aiohttp import web

async def who(request):
    return web.json_response({"session": otel_session.current_session_id(), "started": True})

app = web.Application()
app.router.add_get("/who", who)
if __name__ == "__main__":
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ask(base: str) -> tuple[int, dict[str, Any]]:
    """GET /who as a caller inside a trajectory would (its session in W3C baggage)."""
    session = str(uuid.uuid4())
    response = httpx.get(f"{base}/who", headers={"baggage": f"session.id={session}"}, timeout=10)
    body = response.json() if response.status_code == 200 else {}
    return response.status_code, {**body, "sent": session}


def assert_served_with_the_middleware(base: str, *, lifespan: bool = True) -> None:
    status, body = ask(base)
    assert status == 200
    assert body["session"] == body["sent"]  # the middleware made the caller's session current
    assert body["started"] is lifespan


def assert_websocket_untouched(base: str) -> None:
    async def talk() -> Any:
        async with aiohttp.ClientSession() as http, http.ws_connect(f"{base}/ws") as ws:
            return await ws.receive_json(timeout=10)

    assert asyncio.run(talk()) == {"session": None}  # http only: a websocket is passed through


@contextmanager
def serving(argv: list[str], port: int, cwd: Path, **env: str) -> Iterator[str]:
    """A server in a process group of its own, configured from the environment; stopped by group."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environment |= {"OTEL_SESSION_AUTO": "true", "OTEL_SESSION_DYNAMO_HOSTS": "127.0.0.1:9", **env}
    environment["PYTHONPATH"] = os.pathsep.join([str(cwd), environment.get("PYTHONPATH", "")])
    process = subprocess.Popen(
        argv, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise AssertionError(process.stdout.read().decode() if process.stdout else "exited")
            try:
                httpx.get(f"{base}/who", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield base
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        log = process.stdout.read().decode() if process.stdout else ""
        assert "Traceback" not in log, log[-3000:]


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "plain_starlette_app.py").write_text(STARLETTE_APP)
    (tmp_path / "plain_aiohttp_app.py").write_text(AIOHTTP_APP)
    return tmp_path


def _plain_starlette(started: list[bool]) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        started.append(True)
        yield

    async def who(request: Request) -> JSONResponse:
        return JSONResponse({"session": otel_session.current_session_id(), "started": bool(started)})

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_json({"session": otel_session.current_session_id()})
        await websocket.close()

    return Starlette(routes=[Route("/who", who), WebSocketRoute("/ws", ws)], lifespan=lifespan)


def test_uvicorn_serves_a_plain_starlette_app_object(dynamo: Any) -> None:
    """The case that answered 500 to every request: uvicorn's factory probe calls ``app()``."""
    otel_session.configure(dynamo_hosts=[dynamo.url], servers=True)
    started: list[bool] = []
    app = _plain_starlette(started)
    with AsgiServer(app, lifespan="on") as server:
        assert_served_with_the_middleware(server.url)


def test_fastapi_with_a_plain_starlette_app_mounted_inside(dynamo: Any) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], servers=True)
    started: list[bool] = []
    app = FastAPI()
    app.mount("/sub", _plain_starlette(started))

    @app.get("/who")
    async def who() -> dict[str, Any]:
        return {"session": otel_session.current_session_id(), "started": False}

    with AsgiServer(app, lifespan="on") as server:
        assert_served_with_the_middleware(server.url, lifespan=False)
        status, body = ask(f"{server.url}/sub")
        assert status == 200 and body["session"] == body["sent"]


@pytest.mark.parametrize(
    "server",
    [
        "uvicorn-import-string",
        "hypercorn",
        "gunicorn-uvicorn-worker",
    ],
)
def test_asgi_servers_loading_an_app_by_import_string(server: str, app_dir: Path) -> None:
    port = free_port()
    argv = {
        "uvicorn-import-string": [sys.executable, "-m", "uvicorn", "plain_starlette_app:app",
                                  "--host", "127.0.0.1", "--port", str(port), "--lifespan", "on",
                                  "--ws", "wsproto"],
        "hypercorn": [sys.executable, "-m", "hypercorn", "plain_starlette_app:app",
                      "--bind", f"127.0.0.1:{port}"],
        "gunicorn-uvicorn-worker": [sys.executable, "-m", "gunicorn", "-k", "uvicorn_worker.UvicornWorker",
                                    "-w", "1", "-b", f"127.0.0.1:{port}", "plain_starlette_app:app"],
    }[server]  # fmt: skip
    with serving(argv, port, app_dir) as base:
        assert_served_with_the_middleware(base)
        assert_websocket_untouched(base)


def test_aiohttp_run_app(app_dir: Path) -> None:
    port = free_port()
    with serving([sys.executable, "plain_aiohttp_app.py", str(port)], port, app_dir) as base:
        assert_served_with_the_middleware(base)


async def test_aiohttp_app_runner(dynamo: Any) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], servers=True)

    async def who(request: web.Request) -> web.Response:
        return web.json_response({"session": otel_session.current_session_id(), "started": True})

    app = web.Application()
    app.router.add_get("/who", who)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        status, body = await asyncio.to_thread(ask, f"http://127.0.0.1:{port}")
        assert status == 200 and body["session"] == body["sent"]
    finally:
        await runner.cleanup()


def test_the_servers_serve_without_the_middleware_when_servers_are_off(app_dir: Path) -> None:
    """The same app under uvicorn with OTEL_SESSION_SERVERS=false: served, no session made current
    (so the checks above do see the middleware)."""
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "plain_starlette_app:app", "--host", "127.0.0.1"]
    argv += ["--port", str(port)]
    with serving(argv, port, app_dir, OTEL_SESSION_SERVERS="false") as base:
        status, body = ask(base)
        assert status == 200 and body["session"] is None


def test_a_bare_router_served_as_the_app_gets_no_middleware_unless_wrapped_by_hand(dynamo: Any) -> None:
    """docs/integrations.md, "Servers": the middleware goes in where an app assembles its middleware,
    which a bare ``starlette.routing.Router`` never does; ``SessionMiddleware(router)`` serves it."""
    otel_session.configure(dynamo_hosts=[dynamo.url], servers=True)

    async def who(request: Request) -> JSONResponse:
        return JSONResponse({"session": otel_session.current_session_id(), "started": False})

    router = Router(routes=[Route("/who", who)])
    with AsgiServer(router) as server:
        status, body = ask(server.url)
        assert status == 200 and body["session"] is None  # served as it is, without the session
    with AsgiServer(SessionMiddleware(router)) as server:
        assert_served_with_the_middleware(server.url, lifespan=False)
