"""Gym-shaped servers run as real processes: ``python -m tests.gym_apps {agent|model} FD``.

``agent``: FastAPI on uvicorn with ``SessionMiddleware``; ``POST /turn`` calls a third-party tool
(``TOOL_URL``) and the model server (``MODEL_URL``) with aiohttp, as NeMo-Gym's agents do.
``model``: aiohttp web with ``aiohttp_session_middleware``; ``POST /v1/chat/completions`` forwards the
body to Dynamo (``DYNAMO_URL``, a ``.../v1`` base) with aiohttp. Both configure otel-session from the
``OTEL_SESSION_*`` environment, as a server process would, and answer ``GET /seen`` with the headers
of every request they handled.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web
from fastapi import FastAPI, Request

import otel_session
from otel_session.servers import SessionMiddleware, aiohttp_session_middleware

_NVEXT = {"nvext": {"extra_fields": ["worker_id"]}}


def agent_app() -> FastAPI:
    seen: list[dict[str, str]] = []
    clients: dict[str, aiohttp.ClientSession] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        clients["http"] = aiohttp.ClientSession()
        yield
        await clients["http"].close()

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(SessionMiddleware)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/seen")
    async def get_seen() -> list[dict[str, str]]:
        return seen

    @app.post("/turn")
    async def turn(request: Request) -> Any:
        seen.append({name.lower(): value for name, value in request.headers.items()})
        body = await request.json()
        http = clients["http"]
        async with http.post(f"{os.environ['TOOL_URL']}/tool", json={"query": "weather"}) as tool:
            tool.raise_for_status()
        payload = {
            "model": os.environ["DYNAMO_MODEL"],
            "messages": body["messages"],
            "max_tokens": 5,
            **_NVEXT,
        }
        async with http.post(f"{os.environ['MODEL_URL']}/v1/chat/completions", json=payload) as model:
            model.raise_for_status()
            return await model.json()

    return app


def model_app() -> web.Application:
    seen: list[dict[str, str]] = []

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def get_seen(request: web.Request) -> web.Response:
        return web.json_response(seen)

    async def chat(request: web.Request) -> web.Response:
        seen.append({name.lower(): value for name, value in request.headers.items()})
        body = await request.json()
        http = request.app[CLIENT]
        async with http.post(f"{os.environ['DYNAMO_URL']}/chat/completions", json=body) as upstream:
            upstream.raise_for_status()
            return web.json_response(await upstream.json())

    async def client_context(app: web.Application) -> AsyncIterator[None]:
        app[CLIENT] = aiohttp.ClientSession()
        yield
        await app[CLIENT].close()

    app = web.Application(middlewares=[aiohttp_session_middleware])
    app.cleanup_ctx.append(client_context)
    app.router.add_get("/health", health)
    app.router.add_get("/seen", get_seen)
    app.router.add_post("/v1/chat/completions", chat)
    return app


CLIENT = web.AppKey("client", aiohttp.ClientSession)


def main(kind: str, fd: int) -> None:
    otel_session.configure()  # OTEL_SESSION_DYNAMO_HOSTS / OTEL_SESSION_TRUSTED_HOSTS
    sock = socket.socket(fileno=fd)
    if kind == "agent":
        import uvicorn

        config = uvicorn.Config(agent_app(), log_level="warning", access_log=False)
        uvicorn.Server(config).run(sockets=[sock])
    elif kind == "model":
        web.run_app(model_app(), sock=sock, print=None, access_log=None)
    else:
        raise SystemExit(f"unknown server kind {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
