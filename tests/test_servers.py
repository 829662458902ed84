"""Servers in the middle: the caller's session is current in the handler and forwarded to Dynamo.

Every server here is real (FastAPI on uvicorn, aiohttp web) on its own thread and event loop, calls
onward with a real client (httpx or aiohttp) to a recording Dynamo, and is reached over loopback.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.responses import Response
from starlette.routing import Router
from starlette.testclient import TestClient

import otel_session
import otel_session.servers
from otel_session.servers import (
    SessionMiddleware,
    aiohttp_session_middleware,
    cookie,
    make_aiohttp_session_middleware,
    starlette_session,
)
from tests.gym_servers import AiohttpServer, AsgiServer
from tests.recorder import Recorder, Seen

SESSION = "X-Dynamo-Session-ID"
PARENT = "X-Dynamo-Parent-Session-ID"
OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent"}


class Outbound:
    """The server's one shared client to Dynamo, httpx or aiohttp (Gym servers use aiohttp)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "httpx":
            self._httpx = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=None))
        else:
            self._aiohttp = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def post(self, url: str, headers: dict[str, str] | None = None, body: bytes = b"") -> int:
        if self.kind == "httpx":
            response = await self._httpx.post(url, headers=headers, content=body)
            return response.status_code
        async with self._aiohttp.post(url, headers=headers, data=body) as reply:
            await reply.read()
            return reply.status

    async def close(self) -> None:
        if self.kind == "httpx":
            await self._httpx.aclose()
        else:
            await self._aiohttp.close()


class Gate:
    """Holds every request until ``size`` of them are in the server at once (then all go on)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier: asyncio.Barrier | None = None

    async def wait(self) -> None:
        if self.size <= 1:
            return
        if self.barrier is None:
            self.barrier = asyncio.Barrier(self.size)
        async with asyncio.timeout(30):
            await self.barrier.wait()


def fastapi_server(dynamo: Recorder, client: str, gate: int = 1, **middleware: Any) -> AsgiServer:
    """``POST /forward/{token}`` calls Dynamo at ``/req/{token}``; ``/stream/{n}`` does so per chunk."""
    outbound: dict[str, Outbound] = {}
    waiting = Gate(gate)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        outbound["http"] = Outbound(client)
        yield
        await outbound["http"].close()

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(SessionMiddleware, **middleware)

    @app.post("/forward/{token}")
    async def forward(token: str) -> dict[str, Any]:
        await waiting.wait()
        status = await outbound["http"].post(f"{dynamo.url}/req/{token}")
        return {"session": otel_session.current_session_id(), "status": status}

    @app.get("/stream/{count}")
    async def stream(count: int) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for index in range(count):
                await outbound["http"].post(f"{dynamo.url}/req/chunk-{index}")
                yield f"{otel_session.current_session_id()}\n".encode()

        return StreamingResponse(chunks(), media_type="text/plain")

    return AsgiServer(app, lifespan="on")


def aiohttp_server(dynamo: Recorder, client: str, gate: int = 1, **middleware: Any) -> AiohttpServer:
    """The same routes as :func:`fastapi_server`, on aiohttp web."""
    outbound = web.AppKey("outbound", Outbound)
    waiting = Gate(gate)

    async def forward(request: web.Request) -> web.Response:
        await waiting.wait()
        status = await request.app[outbound].post(f"{dynamo.url}/req/{request.match_info['token']}")
        return web.json_response({"session": otel_session.current_session_id(), "status": status})

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for index in range(int(request.match_info["count"])):
            await request.app[outbound].post(f"{dynamo.url}/req/chunk-{index}")
            await response.write(f"{otel_session.current_session_id()}\n".encode())
        await response.write_eof()
        return response

    async def client_context(app: web.Application) -> AsyncIterator[None]:
        app[outbound] = Outbound(client)
        yield
        await app[outbound].close()

    middleware_list = [
        make_aiohttp_session_middleware(**middleware) if middleware else aiohttp_session_middleware
    ]
    app = web.Application(middlewares=middleware_list)
    app.cleanup_ctx.append(client_context)
    app.router.add_post("/forward/{token}", forward)
    app.router.add_get("/stream/{count}", stream)
    return AiohttpServer(app)


SERVERS = {"fastapi": fastapi_server, "aiohttp": aiohttp_server}


@pytest.fixture(params=["fastapi+httpx", "fastapi+aiohttp", "aiohttp+aiohttp", "aiohttp+httpx"])
def server(request: pytest.FixtureRequest, dynamo: Recorder) -> Iterator[AsgiServer | AiohttpServer]:
    """A server (kind+outgoing client) that forwards to ``dynamo``; configured as trusted, like Gym."""
    kind, client = request.param.split("+")
    with SERVERS[kind](dynamo, client) as running:
        otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[running.authority])
        yield running


def _requests_to(dynamo: Recorder, token: str) -> list[Seen]:
    return [seen for seen in dynamo.requests if seen.path == f"/req/{token}"]


def _one(dynamo: Recorder, token: str) -> Seen:
    [seen] = _requests_to(dynamo, token)
    return seen


async def test_trajectory_baggage_becomes_dynamo_header(server: AsgiServer, dynamo: Recorder) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        with otel_session.trajectory() as traj:
            reply = await client.post(f"{server.url}/forward/t1")
        assert reply.json()["session"] == traj.session_id
        plain = await client.post(f"{server.url}/forward/t2")  # outside any trajectory
    assert plain.json()["session"] is None
    seen = _one(dynamo, "t1")
    assert seen.get(SESSION) == traj.session_id
    assert not seen.names() & (OURS - {"x-dynamo-session-id"})  # Dynamo is not trusted: no baggage
    assert not _one(dynamo, "t2").names() & OURS


async def test_incoming_header_is_forwarded_and_wins_over_baggage(
    server: AsgiServer, dynamo: Recorder
) -> None:
    headers = {SESSION: "gym-episode-7", "baggage": "session.id=from-baggage,team=rl"}
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{server.url}/forward/h1", headers=headers)
        baggage_only = await client.post(f"{server.url}/forward/h2", headers={"baggage": "session.id=bag-9"})
    assert reply.json()["session"] == "gym-episode-7"
    assert _one(dynamo, "h1").get(SESSION) == "gym-episode-7"
    assert baggage_only.json()["session"] == "bag-9"
    assert _one(dynamo, "h2").get(SESSION) == "bag-9"


async def test_parent_session_crosses_the_server(server: AsgiServer, dynamo: Recorder) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        with otel_session.trajectory() as outer, otel_session.trajectory() as sub_agent:
            await client.post(f"{server.url}/forward/p1")
        await client.post(f"{server.url}/forward/p2", headers={SESSION: "child-1", PARENT: "root-1"})
    via_baggage = _one(dynamo, "p1")
    assert (via_baggage.get(SESSION), via_baggage.get(PARENT)) == (sub_agent.session_id, outer.session_id)
    via_headers = _one(dynamo, "p2")
    assert (via_headers.get(SESSION), via_headers.get(PARENT)) == ("child-1", "root-1")


async def test_streamed_response_body_keeps_the_session(server: AsgiServer, dynamo: Recorder) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        with otel_session.trajectory() as traj:
            reply = await client.get(f"{server.url}/stream/3")
    assert reply.text.split() == [traj.session_id] * 3
    assert [_one(dynamo, f"chunk-{i}").get(SESSION) for i in range(3)] == [traj.session_id] * 3


PROPERTIES = {
    "ttl": "session.id=sess-1;ttl=60",
    "spaces": "session.id = sess-1 ; ttl=60 ; flag",
    "parent-too": "session.id=sess-1;a=b,session.parent_id=root-1;c",
    "encoded-key": "session%2Eid=sess-1;x",
}


@pytest.mark.parametrize("baggage", PROPERTIES.values(), ids=PROPERTIES.keys())
async def test_a_baggage_members_properties_are_not_its_value(
    server: AsgiServer, dynamo: Recorder, baggage: str
) -> None:
    """W3C baggage ``session.id=V;ttl=60`` names the session V; ``;ttl=60`` is a property of the member."""
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{server.url}/forward/props", headers={"baggage": baggage})
    assert reply.json()["session"] == "sess-1"
    seen = _one(dynamo, "props")
    assert seen.get(SESSION) == "sess-1"
    assert seen.get(PARENT) == ("root-1" if "parent" in baggage else None)


_MANY = ",".join(f"k{i}=v" for i in range(100))  # 100 + 70: within W3C's 180 members in all
LINES = {
    "second-line": [("baggage", "tenant=acme"), ("baggage", "session.id=sess-2")],
    "member-171-on-a-third-line": [
        ("baggage", _MANY),
        ("baggage", ",".join(f"j{i}=v" for i in range(70))),
        ("baggage", "session.id=sess-2"),
    ],
    "parent-on-another-line": [("baggage", "session.id=sess-2"), ("baggage", "session.parent_id=root-2")],
}


@pytest.mark.parametrize("incoming", LINES.values(), ids=LINES.keys())
async def test_a_session_anywhere_in_the_baggage_lines_is_read(
    server: AsgiServer, dynamo: Recorder, incoming: list[tuple[str, str]]
) -> None:
    """W3C joins several baggage lines into one; the stock extractor reads only the first line (found
    by an outside attack: the session was lost). Beyond 180 members in all, W3C's limit, nothing is read."""
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{server.url}/forward/lines", headers=incoming)
    assert reply.json()["session"] == "sess-2"
    seen = _one(dynamo, "lines")
    assert seen.get(SESSION) == "sess-2"
    assert seen.get(PARENT) == ("root-2" if "parent" in str(incoming) else None)


_HALF = ",".join(f"k{i}=v" for i in range(800))  # two of these: > 8192 bytes, each under servers' line limit
BAD_INCOMING: dict[str, list[tuple[str, str]]] = {
    "too-long": [(SESSION, "x" * 257)],
    "space": [(SESSION, "two words")],
    "empty": [(SESSION, "")],
    "non-ascii": [(SESSION, "caf\xe9")],
    "control": [(SESSION, "a\tb")],
    "baggage-too-long": [("baggage", "session.id=" + "y" * 300)],
    "baggage-not-ascii": [("baggage", "session.id=%C3%A9t%C3%A9")],
    "baggage-over-8192-bytes": [("baggage", "session.id=ok-1," + _HALF), ("baggage", _HALF)],
    "baggage-garbage": [("baggage", ";;==,,session.id")],
    "baggage-quoted": [("baggage", 'session.id="quoted"')],
    "baggage-member-181": [
        ("baggage", ",".join(f"k{i}=v" for i in range(180))),
        ("baggage", "session.id=s-181"),
    ],
    "baggage-self-parent-only": [("baggage", "session.parent_id=p-1")],
    "parent-without-session": [(PARENT, "orphan-parent")],
}


@pytest.mark.parametrize("incoming", BAD_INCOMING.values(), ids=BAD_INCOMING.keys())
async def test_invalid_incoming_session_is_ignored(
    server: AsgiServer, dynamo: Recorder, incoming: list[tuple[str, str]]
) -> None:
    headers = [(name, value.encode("latin-1")) for name, value in incoming]
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{server.url}/forward/bad", headers=headers)
    assert reply.status_code == 200
    assert reply.json() == {"session": None, "status": 200}
    assert not _one(dynamo, "bad").names() & OURS


async def test_request_without_session_forwards_none_even_from_a_session_context(dynamo: Recorder) -> None:
    """A server started inside a trajectory (here: in this very task) must not lend it to requests."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    outbound = Outbound("aiohttp")

    async def forward(request: web.Request) -> web.Response:
        await outbound.post(f"{dynamo.url}/req/ambient")
        return web.json_response({"session": otel_session.current_session_id()})

    app = web.Application(middlewares=[aiohttp_session_middleware])
    app.router.add_post("/", forward)
    runner = web.AppRunner(app)
    with otel_session.trajectory():  # the server's accept loop inherits this context
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
    port = runner.addresses[0][1]
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"http://127.0.0.1:{port}/")
    finally:
        await outbound.close()
        await runner.cleanup()
    assert reply.json() == {"session": None}
    assert not _one(dynamo, "ambient").names() & OURS


@pytest.mark.parametrize("kind", ["fastapi", "aiohttp"])
async def test_concurrent_requests_keep_their_sessions_apart(kind: str, dynamo: Recorder) -> None:
    in_flight = 200  # all held inside the server at once before any forwards
    with SERVERS[kind](dynamo, "aiohttp", gate=in_flight) as running:
        otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[running.authority])
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:

            async def one(index: int) -> tuple[str, str | None, str | None]:
                with otel_session.trajectory() as traj:
                    reply = await client.post(f"{running.url}/forward/c{index}")
                return f"c{index}", traj.session_id, reply.json()["session"]

            results = await asyncio.gather(*(one(i) for i in range(in_flight)))
    assert len({session for _, session, _ in results}) == in_flight
    for token, session, in_handler in results:
        assert in_handler == session
        assert _one(dynamo, token).get(SESSION) == session


# --- a server's own per-episode ID (NeMo-Gym keeps one in its cookie session) -------------------


def gym_style_app(dynamo: Recorder, *, ours_innermost: bool = True, ours: bool = True) -> FastAPI:
    """NeMo-Gym's setup: Starlette's signed cookie session, an ID minted on the first turn.

    ``ours=False`` adds no otel-session middleware (the zero-code case); otherwise it goes innermost
    or, wrongly, outermost.
    """
    pytest.importorskip(
        "itsdangerous", reason="Starlette's cookie sessions (as NeMo-Gym uses) need itsdangerous"
    )
    from starlette.middleware.sessions import SessionMiddleware as StarletteSessionMiddleware

    app = FastAPI()

    async def add_session_id(request: Request, call_next: RequestResponseEndpoint) -> Response:
        request.session["session_id"] = request.session.get("session_id", str(uuid.uuid4()))
        return await call_next(request)

    if ours and ours_innermost:  # registered first = runs last, after the ID exists
        app.add_middleware(SessionMiddleware, session_from=starlette_session("session_id"))
    app.add_middleware(BaseHTTPMiddleware, dispatch=add_session_id)
    app.add_middleware(StarletteSessionMiddleware, secret_key="gym-test", session_cookie="gym_session")
    if ours and not ours_innermost:
        app.add_middleware(SessionMiddleware, session_from=starlette_session("session_id"))

    @app.post("/v1/responses/{token}")
    async def responses(request: Request, token: str) -> JSONResponse:
        async with httpx.AsyncClient() as http:
            await http.post(f"{dynamo.url}/req/{token}")
        return JSONResponse(
            {"gym": request.session["session_id"], "current": otel_session.current_session_id()}
        )

    return app


@pytest.mark.parametrize("setup", ["by-hand", "zero-code"])
async def test_gym_cookie_session_is_adopted_from_the_first_turn(
    dynamo: Recorder, setup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By hand: our middleware registered inside the session. Zero-code: none registered, the app
    as NeMo-Gym builds it, ``servers=True`` and ``OTEL_SESSION_ADOPT`` put it innermost."""
    zero_code = setup == "zero-code"
    if zero_code:
        monkeypatch.setenv("OTEL_SESSION_ADOPT", "session:session_id")
    with AsgiServer(gym_style_app(dynamo, ours=not zero_code)) as gym:
        otel_session.configure(
            dynamo_hosts=[dynamo.authority], trusted_hosts=[gym.authority], servers=zero_code
        )
        episodes = []
        for episode in range(2):
            async with httpx.AsyncClient(timeout=30) as agent:  # one cookie jar per episode
                with otel_session.trajectory() as traj:  # the caller's session loses to the server's own
                    replies = [
                        (await agent.post(f"{gym.url}/v1/responses/e{episode}t{t}")).json() for t in range(3)
                    ]
            gym_id = replies[0]["gym"]
            assert [reply["gym"] for reply in replies] == [gym_id] * 3
            assert [reply["current"] for reply in replies] == [gym_id] * 3
            assert [_one(dynamo, f"e{episode}t{t}").get(SESSION) for t in range(3)] == [gym_id] * 3
            assert gym_id != traj.session_id
            episodes.append(gym_id)
    assert episodes[0] != episodes[1]


async def test_gym_episodes_of_one_prompt_keep_their_groups_parent_beside_the_adopted_id(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/integrations.md, NeMo-Gym, Siblings: the driver opens ``trajectory(group=...)`` around each
    episode; the model server adopts its own episode ID and keeps the group's parent beside it."""
    monkeypatch.setenv("OTEL_SESSION_ADOPT", "session:session_id")
    with AsgiServer(gym_style_app(dynamo, ours=False)) as gym:
        otel_session.configure(
            dynamo_hosts=[dynamo.authority], trusted_hosts=[gym.authority], servers=True, siblings="groups:2"
        )
        all_open = asyncio.Event()
        opened: list[otel_session.trajectory] = []

        async def episode(number: int) -> str:
            async with httpx.AsyncClient(timeout=30) as agent, otel_session.trajectory(group="p") as traj:
                opened.append(traj)
                if len(opened) == 4:
                    all_open.set()
                await all_open.wait()
                reply = (await agent.post(f"{gym.url}/v1/responses/g{number}")).json()
                return str(reply["gym"])

        gym_ids = await asyncio.gather(*(episode(n) for n in range(4)))
    assert len(set(gym_ids)) == 4
    for number in range(4):
        assert _one(dynamo, f"g{number}").get(SESSION) in gym_ids  # the episode's own, adopted ID
    parents = [_one(dynamo, f"g{n}").get("X-Dynamo-Parent-Session-ID") for n in range(4)]
    assert None not in parents and sorted(Counter(parents).values()) == [2, 2]
    assert set(parents) == {traj.parent_session_id for traj in opened}


async def test_gym_cookie_session_in_the_wrong_place_warns_and_falls_back(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(otel_session.servers, "_order_warned", [])  # the warning is once per process
    with AsgiServer(gym_style_app(dynamo, ours_innermost=False)) as gym:
        otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[gym.authority])
        with caplog.at_level(logging.WARNING, logger="otel_session"):
            async with httpx.AsyncClient(timeout=30) as agent:
                with otel_session.trajectory() as traj:
                    reply = await agent.post(f"{gym.url}/v1/responses/w1")
    assert reply.status_code == 200
    assert _one(dynamo, "w1").get(SESSION) == traj.session_id
    assert any("cannot see scope['session']" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("kind", ["fastapi", "aiohttp"])
async def test_plain_cookie_session_is_adopted_and_validated(kind: str, dynamo: Recorder) -> None:
    with SERVERS[kind](dynamo, "aiohttp", session_from=cookie("session_id")) as running:
        otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[running.authority])
        async with httpx.AsyncClient(timeout=30) as client:
            own = await client.post(
                f"{running.url}/forward/k1",
                headers={"Cookie": "theme=dark; session_id=episode-42", SESSION: "caller"},
            )
            bad = await client.post(
                f"{running.url}/forward/k2", headers={"Cookie": f"session_id={'z' * 300}", SESSION: "caller"}
            )
    assert own.json()["session"] == "episode-42"
    assert _one(dynamo, "k1").get(SESSION) == "episode-42"
    assert bad.json()["session"] == "caller"  # an unusable own ID is ignored, the caller's still counts
    assert _one(dynamo, "k2").get(SESSION) == "caller"


@pytest.mark.parametrize("kind", ["fastapi", "aiohttp"])
async def test_broken_session_source_does_not_fail_the_request(kind: str, dynamo: Recorder) -> None:
    def broken(request: object) -> str:
        raise KeyError("no session here")

    with SERVERS[kind](dynamo, "httpx", session_from=broken) as running:
        otel_session.configure(dynamo_hosts=[dynamo.authority])
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{running.url}/forward/b1", headers={SESSION: "caller-2"})
    assert reply.status_code == 200
    assert _one(dynamo, "b1").get(SESSION) == "caller-2"


async def test_session_is_readable_without_configure(dynamo: Recorder) -> None:
    with fastapi_server(dynamo, "httpx") as running:
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{running.url}/forward/u1", headers={SESSION: "read-only"})
    assert reply.json()["session"] == "read-only"
    assert not _one(dynamo, "u1").names() & OURS  # unconfigured: nothing is forwarded


# --- a forwarding proxy (NeMo-RL's Dynamo token wrapper) -------------------------------------------


def token_wrapper(dynamo: Recorder, client: str) -> AsgiServer:
    """Forwards the body and Authorization to Dynamo, nothing else; the session comes from the hooks."""
    outbound: dict[str, Outbound] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        outbound["http"] = Outbound(client)
        yield
        await outbound["http"].close()

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(SessionMiddleware)

    @app.post("/v1/chat/completions")
    async def proxy(request: Request) -> Response:
        headers = {"Content-Type": "application/json"}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        status = await outbound["http"].post(
            f"{dynamo.url}/v1/chat/completions", headers, await request.body()
        )
        return Response(status_code=status)

    return AsgiServer(app, lifespan="on")


@pytest.mark.parametrize("client", ["httpx", "aiohttp"])
async def test_token_wrapper_forwards_session_unchanged_and_adds_none(client: str, dynamo: Recorder) -> None:
    body = b'{"model": "m", "messages": []}'
    auth = {"Authorization": "Bearer token-1"}
    with token_wrapper(dynamo, client) as wrapper:
        otel_session.configure(dynamo_hosts=[dynamo.authority])  # the wrapper is not trusted
        url = f"{wrapper.url}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=30) as rollout:
            forwarded = await rollout.post(
                url, headers={**auth, SESSION: "rollout-17", PARENT: "group-3"}, content=body
            )
            plain = await rollout.post(url, headers=auth, content=body)
    assert (forwarded.status_code, plain.status_code) == (200, 200)
    first, second = dynamo.requests
    assert first.get(SESSION) == "rollout-17"
    assert first.get(PARENT) == "group-3"
    assert first.get("authorization") == "Bearer token-1"
    assert second.get("authorization") == "Bearer token-1"
    assert not second.names() & OURS


# --- tracing: the caller's trace continues, an instrumentation's server span stays the parent -----


def _span_reporting_app() -> FastAPI:
    # FastAPI's own telemetry switches itself on once any test has set a global tracer provider (one
    # per process) and starts a span of its own for the request, which would then be the current one
    # instead of the instrumentation's: off here, so the result does not depend on earlier tests.
    app = FastAPI(telemetry={"tracing": False})
    app.add_middleware(SessionMiddleware)

    @app.get("/span")
    async def span() -> dict[str, Any]:
        context = trace.get_current_span().get_span_context()
        return {
            "trace": format(context.trace_id, "032x"),
            "span": format(context.span_id, "016x"),
            "session": otel_session.current_session_id(),
        }

    return app


TRACE_ID, CALLER_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


async def test_traceparent_is_extracted_and_an_instrumented_server_span_stays_current() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    headers = {"traceparent": TRACEPARENT, SESSION: "traced-1"}
    instrumented = OpenTelemetryMiddleware(_span_reporting_app(), tracer_provider=provider)
    with AsgiServer(_span_reporting_app()) as plain, AsgiServer(instrumented) as traced:
        async with httpx.AsyncClient(timeout=30) as client:
            bare = (await client.get(f"{plain.url}/span", headers=headers)).json()
            inside = (await client.get(f"{traced.url}/span", headers=headers)).json()
    assert bare == {"trace": TRACE_ID, "span": CALLER_SPAN, "session": "traced-1"}
    [server_span] = [span for span in exporter.get_finished_spans() if span.kind == trace.SpanKind.SERVER]
    assert server_span.parent is not None and format(server_span.parent.span_id, "016x") == CALLER_SPAN
    assert inside == {
        "trace": TRACE_ID,
        "span": format(server_span.context.span_id, "016x"),
        "session": "traced-1",
    }


# --- what the middleware leaves alone -------------------------------------------------------------


async def test_lifespan_passes_through(dynamo: Recorder) -> None:
    started: list[bool] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started.append(True)
        yield

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(SessionMiddleware)
    with AsgiServer(app, lifespan="on"):
        assert started == [True]


def test_websocket_passes_through_untouched() -> None:
    app = FastAPI()
    app.add_middleware(SessionMiddleware)

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_json({"session": otel_session.current_session_id()})
        await websocket.close()

    with TestClient(app) as client, client.websocket_connect("/ws", headers={SESSION: "ws-1"}) as socket:
        assert socket.receive_json() == {"session": None}  # http only, as documented


# --- zero-code servers: configure(servers=True) instruments every app the process builds ----------


def _session_middlewares(app: Any) -> int:
    """How many otel-session middlewares a built Starlette stack holds (each layer wraps ``.app``)."""
    count, layer = 0, app.middleware_stack
    while layer is not None and not isinstance(layer, Router):
        count += isinstance(layer, SessionMiddleware)
        layer = getattr(layer, "app", None)
    return count


class StartStyleWrapper:
    """NeMo-RL's token-wrapper shape: the FastAPI app exists only inside ``start()``."""

    def __init__(self, dynamo: Recorder) -> None:
        self.dynamo = dynamo
        self.server: AsgiServer | None = None
        self.app: FastAPI | None = None

    def start(self) -> AsgiServer:
        app = FastAPI()
        dynamo_url = self.dynamo.url

        @app.post("/v1/chat/completions")
        async def proxy(request: Request) -> JSONResponse:
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{dynamo_url}/v1/chat/completions", data=await request.body()) as reply,
            ):
                await reply.read()
            return JSONResponse({"session": otel_session.current_session_id()})

        self.app = app
        self.server = AsgiServer(app).__enter__()
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.__exit__(None, None, None)


async def test_servers_true_instruments_an_app_built_inside_start(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority], servers=True)
    wrapper = StartStyleWrapper(dynamo)
    running = wrapper.start()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            carried = await client.post(f"{running.url}/v1/chat/completions", headers={SESSION: "rl-1"})
            plain = await client.post(f"{running.url}/v1/chat/completions")
    finally:
        wrapper.stop()
    assert (carried.json(), plain.json()) == ({"session": "rl-1"}, {"session": None})
    first, second = dynamo.requests
    assert first.get(SESSION) == "rl-1"
    assert not second.names() & OURS
    assert wrapper.app is not None and _session_middlewares(wrapper.app) == 1


@pytest.mark.parametrize("kind", ["fastapi", "aiohttp"])
async def test_servers_true_never_doubles_a_hand_added_middleware(kind: str, dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority], servers=True)
    with SERVERS[kind](dynamo, "aiohttp") as running:  # both add ours by hand
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{running.url}/forward/d1", headers={SESSION: "hand-1"})
        if isinstance(running, AiohttpServer):
            ours = [m for m in running.app.middlewares if otel_session.servers.is_session_middleware(m)]
            assert len(ours) == 1
        else:
            assert _session_middlewares(running.app) == 1
    assert reply.json()["session"] == "hand-1"
    assert _one(dynamo, "d1").get(SESSION) == "hand-1"


def _bare_aiohttp_app(dynamo: Recorder) -> web.Application:
    """An aiohttp app that registers no middleware at all."""

    async def forward(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as http, http.post(f"{dynamo.url}/req/{request.match_info['t']}"):
            pass
        return web.json_response({"session": otel_session.current_session_id()})

    app = web.Application()
    app.router.add_post("/forward/{t}", forward)
    return app


async def test_servers_true_instruments_a_bare_aiohttp_app_and_adopts_a_cookie(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SESSION_ADOPT", "cookie:episode")
    otel_session.configure(dynamo_hosts=[dynamo.authority], servers=True)
    with AiohttpServer(_bare_aiohttp_app(dynamo)) as running:
        async with httpx.AsyncClient(timeout=30) as client:
            caller = await client.post(f"{running.url}/forward/a1", headers={SESSION: "caller-1"})
            own = await client.post(
                f"{running.url}/forward/a2", headers={SESSION: "caller-1", "Cookie": "episode=ep-9"}
            )
    assert (caller.json()["session"], own.json()["session"]) == ("caller-1", "ep-9")
    assert [_one(dynamo, t).get(SESSION) for t in ("a1", "a2")] == ["caller-1", "ep-9"]


async def test_servers_off_by_default_and_unconfigure_takes_the_hooks_away(dynamo: Recorder) -> None:
    def build() -> Any:
        # FastAPI's own telemetry, on once any test made an SDK provider global, extracts the caller's
        # context through the global propagator by itself: off, so only otel-session's hook is seen.
        app = FastAPI(telemetry={"tracing": False})

        @app.get("/s")
        async def current() -> dict[str, str | None]:
            return {"session": otel_session.current_session_id()}

        return app

    async def session_seen(app: Any) -> str | None:
        with AsgiServer(app) as running:
            async with httpx.AsyncClient(timeout=30) as client:
                reply = await client.get(f"{running.url}/s", headers={SESSION: "s-1"})
        found: str | None = reply.json()["session"]
        return found

    otel_session.configure(dynamo_hosts=[dynamo.authority])
    assert await session_seen(build()) is None
    otel_session.configure(dynamo_hosts=[dynamo.authority], servers=True)
    assert await session_seen(build()) == "s-1"
    otel_session.unconfigure()
    assert await session_seen(build()) is None
    assert "__init_subclass__" not in Starlette.__dict__
    assert not hasattr(web.Application.pre_freeze, "__otel_session_original__")


async def test_servers_true_covers_an_app_class_defined_after_configure(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority], servers=True)

    class GatewayApp(FastAPI):
        def build_middleware_stack(self) -> Any:  # its own override, calling FastAPI's
            return super().build_middleware_stack()

    app = GatewayApp()

    @app.get("/s")
    async def current() -> dict[str, str | None]:
        return {"session": otel_session.current_session_id()}

    with AsgiServer(app) as running:
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.get(f"{running.url}/s", headers={SESSION: "late-1"})
    assert reply.json() == {"session": "late-1"}
    assert _session_middlewares(app) == 1


@pytest.mark.parametrize("value", ["session", "session:", "cookie:two words", "header:x", "bogus"])
async def test_a_bad_adopt_value_is_one_warning_and_the_server_still_serves(
    value: str, dynamo: Recorder, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SESSION_ADOPT", value)
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        otel_session.configure(dynamo_hosts=[dynamo.authority], servers=True)
    with AsgiServer(gym_style_app(dynamo, ours=False)) as gym:
        async with httpx.AsyncClient(timeout=30) as agent:
            reply = await agent.post(f"{gym.url}/v1/responses/bad-adopt", headers={SESSION: "caller-3"})
    assert reply.status_code == 200
    assert reply.json()["current"] == "caller-3"  # nothing adopted, the caller's session still counts
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "OTEL_SESSION_ADOPT" in warning and "session:KEY" in warning and "cookie:NAME" in warning
    assert "\n" not in warning


async def test_servers_variable_is_read_when_the_argument_is_left_out(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SESSION_SERVERS", "sometimes")
    with pytest.raises(ValueError, match="OTEL_SESSION_SERVERS"):
        otel_session.configure(dynamo_hosts=[dynamo.authority])
    monkeypatch.setenv("OTEL_SESSION_SERVERS", "on")
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    app = FastAPI()

    @app.get("/s")
    async def current() -> dict[str, str | None]:
        return {"session": otel_session.current_session_id()}

    with AsgiServer(app) as running:
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.get(f"{running.url}/s", headers={SESSION: "env-1"})
    assert reply.json() == {"session": "env-1"}
