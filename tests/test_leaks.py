""" "Nobody else", attacked: every way our headers could reach a host they must not (issue 9).

Each test drives real clients over loopback at real servers: a recording tunnelling proxy, TLS
servers with a test CA (trustme), redirect targets, the upstream OpenTelemetry instrumentations.
"Ours" means ``X-Dynamo-Session-ID`` / ``X-Dynamo-Parent-Session-ID``, ``baggage`` and ``traceparent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import requests
import trustme
from aiohttp import web
from opentelemetry import baggage, propagate
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
from opentelemetry.instrumentation.httpx import HTTPX2ClientInstrumentor, HTTPXClientInstrumentor
from opentelemetry.instrumentation.requests import RequestsInstrumentor
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import otel_session
from benchmarks._servers import LoopbackServer
from otel_session import SESSION_HEADER, _hop
from otel_session.servers import SessionMiddleware, aiohttp_session_middleware
from tests.clients import CLIENTS, send
from tests.loopback import AsgiServer
from tests.proxy import RecordingProxy
from tests.recorder import Recorder

OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent"}


@pytest.fixture(autouse=True)
def _no_collector_to_wait_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """No collector listens here, and what is checked is the headers, never the spans: each export
    gives up after 0.1 s (a setting the library reads) instead of its 2 s, so unconfigure()'s flush
    of a tracing-on test takes no second of its own."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.1")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_files(ca: trustme.CA, tmp_path: Path) -> tuple[str, str]:
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    return str(cert_file), str(key_file)


@pytest.fixture
def client_ssl(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


@pytest.fixture
def tls_dynamo(tls_files: tuple[str, str]) -> Iterator[Recorder]:
    with Recorder(tls=tls_files) as server:
        yield server


@pytest.fixture
def proxy() -> Iterator[RecordingProxy]:
    with RecordingProxy() as running:
        yield running


# ---- 1. an https proxy's CONNECT carries nothing of ours; the tunnelled request does ----------


@pytest.mark.parametrize("via", ["proxy=", "HTTPS_PROXY"])
async def test_aiohttp_connect_to_a_proxy_carries_nothing(
    via: str,
    tls_dynamo: Recorder,
    proxy: RecordingProxy,
    client_ssl: ssl.SSLContext,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    otel_session.configure(dynamo_hosts=[tls_dynamo.authority], trusted_hosts=[tls_dynamo.authority])
    kwargs: dict[str, Any] = {"proxy": proxy.url} if via == "proxy=" else {}
    if via == "HTTPS_PROXY":
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", "")
    with otel_session.trajectory() as traj:
        async with (
            aiohttp.ClientSession(trust_env=via == "HTTPS_PROXY") as session,
            session.get(f"{tls_dynamo.url}/v1/models", ssl=client_ssl, **kwargs) as response,
        ):
            response.raise_for_status()
    [connect] = proxy.seen
    assert connect.method == "CONNECT"
    assert not connect.names() & OURS, connect.headers
    [arrived] = tls_dynamo.requests
    assert arrived.get(SESSION_HEADER) == traj.session_id
    assert arrived.get("baggage") == f"session.id={traj.session_id}"


async def test_httpx_connect_to_a_proxy_carries_nothing(
    tls_dynamo: Recorder, proxy: RecordingProxy, client_ssl: ssl.SSLContext
) -> None:
    otel_session.configure(dynamo_hosts=[tls_dynamo.authority])
    with otel_session.trajectory() as traj, httpx.Client(proxy=proxy.url, verify=client_ssl) as client:
        client.get(f"{tls_dynamo.url}/v1/models").raise_for_status()
    [connect] = proxy.seen
    assert connect.method == "CONNECT" and not connect.names() & OURS
    assert tls_dynamo.requests[0].get(SESSION_HEADER) == traj.session_id


# ---- 2. re-sends, re-targets and shared Request objects ------------------------------------------


async def test_an_aiohttp_middleware_that_resends_elsewhere_delivers_nothing_there(
    gym: Recorder, other: Recorder
) -> None:
    """The same ClientRequest goes to a trusted host, fails, and is sent again to a tool host."""
    otel_session.configure(dynamo_hosts=["dynamo.invalid"], trusted_hosts=[gym.authority])
    gym.fail_next.append(503)

    async def fail_over(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
        response = await handler(request)
        if response.status == 503:
            request.url = request.url.with_host(other.host).with_port(other.port)
            response = await handler(request)
        return response

    with otel_session.trajectory(session_id="episode:42") as traj:
        async with (
            aiohttp.ClientSession(middlewares=(fail_over,)) as session,
            session.get(f"{gym.url}/step") as response,
        ):
            response.raise_for_status()
    assert gym.requests[0].get("baggage") == f"session.id={traj.session_id}"  # ':' needs no escape
    [elsewhere] = other.requests
    assert not elsewhere.names() & OURS, elsewhere.headers


@pytest.mark.parametrize("second", ["another host", "the same router"])
@pytest.mark.parametrize("finishing", ["the first send", "the second send"])
async def test_an_aiohttp_middleware_sending_one_request_twice_at_once_gives_each_send_its_own(
    second: str, finishing: str, dynamo: Recorder, other: Recorder
) -> None:
    """A hedging middleware sends the same ClientRequest again while the first send is under way
    (both held in an application's async trace callback, then let go in either order). The first
    send's headers were the caller's object, edited in place: the second found our session header
    there and took it for the caller's, so it sent it to a host that may receive nothing, or sent
    none to the router when the first had taken it back meanwhile."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    held = [asyncio.Event(), asyncio.Event()]
    let_go = [asyncio.Event(), asyncio.Event()]
    sends = 0
    target = other if second == "another host" else dynamo

    async def audit(*_: Any) -> None:
        nonlocal sends
        index, sends = sends, sends + 1
        held[index].set()
        await let_go[index].wait()

    async def hedge(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
        first = asyncio.ensure_future(handler(request))
        await held[0].wait()
        request.url = request.url.with_host(target.host).with_port(target.port).with_path("/hedged")
        again = asyncio.ensure_future(handler(request))
        await held[1].wait()
        order = [(0, first), (1, again)] if finishing == "the first send" else [(1, again), (0, first)]
        for index, pending in order:
            let_go[index].set()
            await pending
        (await first).release()
        return await again

    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(audit)
    with otel_session.trajectory() as traj:
        async with (
            aiohttp.ClientSession(trace_configs=[trace], middlewares=(hedge,)) as session,
            session.get(f"{dynamo.url}/v1/models") as response,
        ):
            response.raise_for_status()
            assert SESSION_HEADER not in response.request_info.headers  # taken back after the send
    [primary] = [seen for seen in dynamo.requests if seen.path == "/v1/models"]
    [hedged] = [seen for seen in target.requests if seen.path == "/hedged"]
    assert primary.get(SESSION_HEADER) == traj.session_id
    if second == "another host":
        assert not hedged.names() & OURS, hedged.headers
    else:
        sessions = [value for name, value in hedged.headers if name.lower() == SESSION_HEADER.lower()]
        assert sessions == [traj.session_id], hedged.headers


class Retarget(httpx.BaseTransport):
    """A custom transport that sends the very Request it is given to another host."""

    def __init__(self, to: Recorder) -> None:
        self.to, self.inner = to, httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(host=self.to.host, port=self.to.port)
        return self.inner.handle_request(request)


class UrllibTransport(httpx.BaseTransport):
    """A transport of the user's own that never reaches httpx's: it sends with urllib."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        sent = urllib.request.Request(str(request.url), headers=dict(request.headers), method=request.method)
        with urllib.request.urlopen(sent, timeout=10) as answer:
            return httpx.Response(answer.status, content=answer.read())


class RetargetTo(httpx.BaseTransport):
    """Like ``Retarget``, handing the moved request to a transport of the caller's choosing."""

    def __init__(self, to: Recorder, inner: httpx.BaseTransport) -> None:
        self.to, self.inner = to, inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(host=self.to.host, port=self.to.port)
        return self.inner.handle_request(request)


@pytest.mark.parametrize("defined", ["before configure()", "after configure()"])
def test_a_request_retargeted_onto_another_custom_transport_is_planned_again(
    defined: str, dynamo: Recorder, other: Recorder
) -> None:
    """Each transport class plans the hop it is handed: the inner one, which is not httpx's own,
    sees the copy moved and plans it again for where it now goes. Classes defined after configure()
    are found when a client is built, the inner one too though no client holds it."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    outer, inner = RetargetTo, UrllibTransport
    if defined == "after configure()":

        class LateUrllibTransport(httpx.BaseTransport):
            def handle_request(self, request: httpx.Request) -> httpx.Response:
                return UrllibTransport.handle_request(self, request)

        class LateRetargetTo(RetargetTo):
            def handle_request(self, request: httpx.Request) -> httpx.Response:
                request.url = request.url.copy_with(host=self.to.host, port=self.to.port)
                return self.inner.handle_request(request)

        outer, inner = LateRetargetTo, LateUrllibTransport
    with otel_session.trajectory() as traj:
        with httpx.Client(transport=outer(other, inner())) as client:
            client.get(f"{dynamo.url}/v1/models").raise_for_status()
        with httpx.Client(transport=outer(dynamo, inner())) as client:
            client.get(f"{other.url}/v1/models").raise_for_status()
    assert not other.requests[0].names() & OURS, other.requests[0].headers
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id


def test_a_request_one_hop_leaves_as_it_is_is_planned_afresh_by_another(dynamo: Recorder) -> None:
    """Sent through a custom transport from a context with nothing for Dynamo (baggage only), a
    ``Request`` goes as it is; the same object sent meanwhile from a trajectory carries its ID."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    seen: list[str] = []

    def from_a_trajectory(request: httpx.Request) -> None:
        def send() -> None:
            with otel_session.trajectory() as traj, httpx.Client() as stock:
                seen.append(traj.session_id)
                stock.send(request).raise_for_status()

        thread = threading.Thread(target=send)
        thread.start()
        thread.join(10)

    class Relay(httpx.BaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.HTTPTransport()

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            from_a_trajectory(request)  # while this hop of the same object is in flight
            return self.inner.handle_request(request)

    token = otel_context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with httpx.Client(transport=Relay()) as client:
            request = client.build_request("GET", f"{dynamo.url}/v1/models")
            client.send(request).raise_for_status()
    finally:
        otel_context.detach(token)
    assert [r.get(SESSION_HEADER) for r in dynamo.requests] == [seen[0], None]


def test_a_transport_called_with_the_request_by_name_plans_it() -> None:
    """``handle_request(request=...)``, as a wrapping transport of the user's may call it."""
    seen: list[str | None] = []
    otel_session.configure(dynamo_hosts=["dynamo.internal:8000"])
    mock = httpx.MockTransport(lambda r: seen.append(r.headers.get(SESSION_HEADER)) or httpx.Response(200))
    with otel_session.trajectory() as traj:
        mock.handle_request(request=httpx.Request("GET", "http://dynamo.internal:8000/v1/models"))
    assert seen == [traj.session_id]


def test_httpx_own_transport_called_with_the_request_by_name_plans_it(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory() as traj:
        transport = httpx.HTTPTransport()
        transport.handle_request(request=httpx.Request("GET", f"{dynamo.url}/v1/models")).close()
        transport.close()
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id


def test_a_transport_that_retargets_the_request_is_planned_again(dynamo: Recorder, other: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory() as traj:
        with httpx.Client(transport=Retarget(other)) as client:
            client.get(f"{dynamo.url}/v1/models").raise_for_status()  # planned for Dynamo, sent elsewhere
        with httpx.Client(transport=Retarget(dynamo)) as client:
            client.get(f"{other.url}/v1/models").raise_for_status()  # planned for a tool, sent to Dynamo
    assert not other.requests[0].names() & OURS
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id


class TagReadingTransport(httpx.HTTPTransport):
    """A transport that reads an attribute the caller's event hook put on the request."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert request.tag == "from the hook"  # type: ignore[attr-defined]
        return super().handle_request(request)


def test_a_hops_copy_keeps_what_the_caller_put_on_the_request(dynamo: Recorder) -> None:
    def tag(request: httpx.Request) -> None:
        request.tag = "from the hook"  # type: ignore[attr-defined]

    otel_session.configure(dynamo_hosts=[dynamo.authority])
    client = httpx.Client(transport=TagReadingTransport(), event_hooks={"request": [tag]})
    with otel_session.trajectory() as traj, client as c:
        c.post(f"{dynamo.url}/v1/chat/completions", json={"model": "m"}).raise_for_status()
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id


async def test_one_request_object_sent_by_two_trajectories_at_once(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    async with httpx.AsyncClient() as client:
        shared = client.build_request("GET", f"{dynamo.url}/v1/models")

        async def attempt() -> str:
            async with otel_session.trajectory() as traj:
                await asyncio.sleep(0)
                (await client.send(shared)).raise_for_status()
                assert traj.session_id is not None
                return traj.session_id

        ids = await asyncio.gather(*(attempt() for _ in range(5)))
    assert sorted(r.get(SESSION_HEADER) or "" for r in dynamo.requests) == sorted(ids)
    assert SESSION_HEADER not in shared.headers


def test_stock_propagators_composed_with_ours_are_taken_back_for_other_hosts(
    dynamo: Recorder, gym: Recorder, other: Recorder
) -> None:
    """``OTEL_PROPAGATORS=tracecontext,baggage,dynamo_session`` as the upstream distro builds it."""
    otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[gym.authority], tracing=True)
    propagate.set_global_textmap(
        CompositePropagator(
            [TraceContextTextMapPropagator(), W3CBaggagePropagator(), otel_session.SessionPropagator()]
        )
    )
    with otel_session.trajectory(session_id="episode:42") as traj, httpx.Client() as client:
        for server in (dynamo, gym, other):
            client.get(f"{server.url}/x").raise_for_status()
    assert traj.session_id == "episode:42"
    assert not other.requests[0].names() & OURS, other.requests[0].headers
    assert dynamo.requests[0].get(SESSION_HEADER) == "episode:42"
    assert "episode" in (gym.requests[0].get("baggage") or "")


# ---- 3. a Host header is not the destination -------------------------------------------------------


def test_a_host_header_naming_dynamo_does_not_make_a_request_go_there(
    dynamo: Recorder, other: Recorder
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    HTTPXClientInstrumentor().instrument()
    HTTPX2ClientInstrumentor().instrument()
    RequestsInstrumentor().instrument()
    try:
        import httpx2

        with otel_session.trajectory():
            forged = {"Host": dynamo.authority}
            httpx.get(f"{other.url}/httpx", headers=forged)
            httpx2.get(f"{other.url}/httpx2", headers=forged)
            requests.get(f"{other.url}/requests", headers=forged, timeout=10)
    finally:
        RequestsInstrumentor().uninstrument()
        HTTPX2ClientInstrumentor().uninstrument()
        HTTPXClientInstrumentor().uninstrument()
    assert len(other.requests) == 3
    for seen in other.requests:
        assert not seen.names() & OURS, (seen.path, seen.headers)
    assert dynamo.requests == []


# ---- 4. a URL pattern keeps its scheme ---------------------------------------------------------------


def test_an_https_pattern_never_matches_a_plain_http_downgrade(
    tls_dynamo: Recorder, client_ssl: ssl.SSLContext, tls_files: tuple[str, str]
) -> None:
    with Recorder(host="127.0.0.1") as plain:
        patterns = [f"https://localhost:{plain.port}/v1", f"https://localhost:{tls_dynamo.port}"]
        otel_session.configure(dynamo_hosts=patterns)
        with otel_session.trajectory() as traj:
            httpx.get(f"http://localhost:{plain.port}/v1/models").raise_for_status()
            httpx.get(f"https://localhost:{tls_dynamo.port}/v1/models", verify=client_ssl).raise_for_status()
        assert plain.requests[0].get(SESSION_HEADER) is None
    assert tls_dynamo.requests[0].get(SESSION_HEADER) == traj.session_id


# ---- 5 and 6. what a server in the middle forwards ---------------------------------------------------


def _forwarding_app(downstream: str) -> Starlette:
    async def forward(request: Request) -> JSONResponse:
        async with aiohttp.ClientSession() as session, session.get(downstream) as response:
            return JSONResponse({"status": response.status})

    app = Starlette(routes=[Route("/forward", forward)])
    app.add_middleware(SessionMiddleware)
    return app


async def _aiohttp_downstream() -> tuple[web.AppRunner, int, list[dict[str, str]]]:
    seen: list[dict[str, str]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[aiohttp_session_middleware])
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port, seen


@pytest.mark.parametrize("size", [2700, 7900, 20_000])
async def test_forwarded_baggage_stays_within_server_limits_and_keeps_the_session(size: int) -> None:
    runner, port, seen = await _aiohttp_downstream()
    try:
        otel_session.configure(dynamo_hosts=["dynamo.invalid"], trusted_hosts=[f"127.0.0.1:{port}"])
        with AsgiServer(_forwarding_app(f"http://127.0.0.1:{port}/")) as middle:
            # Values full of characters the stock propagator would percent-encode (':' and '/').
            members = [f"k{i}=http://a:b/{i:04}" for i in range(size // 20)]
            inbound = ",".join(["session.id=episode:7", *members])[: max(size, 40)].rsplit(",", 1)[0]
            async with httpx.AsyncClient() as client:
                response = await client.get(f"{middle.url}/forward", headers={"baggage": inbound})
        assert response.json() == {"status": 200}
    finally:
        await runner.cleanup()
    if size > 8192:  # too large to read at all: dropped on the way in, never an error
        assert "baggage" not in {k.lower() for k in seen[0]}
        return
    forwarded = next(v for k, v in seen[0].items() if k.lower() == "baggage")
    assert len(forwarded) <= min(len(inbound), 8192)  # never grown
    assert forwarded.startswith("session.id=episode:7")


@pytest.mark.parametrize("server", ["starlette", "aiohttp"])
async def test_with_tracing_off_a_server_does_not_forward_the_callers_traceparent(
    server: str, dynamo: Recorder
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    caller = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", SESSION_HEADER: "s-1"}

    async def call_dynamo() -> None:
        async with aiohttp.ClientSession() as session, session.get(f"{dynamo.url}/v1/models") as response:
            response.raise_for_status()

    if server == "starlette":

        async def endpoint(request: Request) -> JSONResponse:
            await call_dynamo()
            return JSONResponse({})

        app = Starlette(routes=[Route("/", endpoint)])
        app.add_middleware(SessionMiddleware)
        with AsgiServer(app) as middle:
            async with httpx.AsyncClient() as client:
                (await client.get(middle.url, headers=caller)).raise_for_status()
    else:

        async def handler(request: web.Request) -> web.Response:
            await call_dynamo()
            return web.json_response({})

        web_app = web.Application(middlewares=[aiohttp_session_middleware])
        web_app.router.add_get("/", handler)
        runner = web.AppRunner(web_app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with httpx.AsyncClient() as client:
                (await client.get(f"http://127.0.0.1:{port}/", headers=caller)).raise_for_status()
        finally:
            await runner.cleanup()
    [arrived] = dynamo.requests
    assert arrived.get(SESSION_HEADER) == "s-1"
    assert arrived.get("traceparent") is None


# ---- 7. hand-set headers are left as set ---------------------------------------------------------


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_hand_set_session_header_to_another_host_is_left_as_set(kind: str, other: Recorder) -> None:
    otel_session.configure(dynamo_hosts=["dynamo.invalid"])
    with otel_session.trajectory() as traj:
        assert traj.session_id is not None
        await send(kind, other.url, headers={SESSION_HEADER: traj.session_id})
    assert other.requests[-1].get(SESSION_HEADER) == traj.session_id


def test_a_hand_set_header_stays_on_the_callers_request_object(other: Recorder) -> None:
    otel_session.configure(dynamo_hosts=["dynamo.invalid"])
    with otel_session.trajectory() as traj, httpx.Client() as client:
        assert traj.session_id is not None
        request = client.build_request("GET", other.url, headers={SESSION_HEADER: traj.session_id})
        client.send(request).raise_for_status()
        client.send(request).raise_for_status()  # sent again: still as the caller set it
    assert request.headers[SESSION_HEADER] == traj.session_id
    assert [r.get(SESSION_HEADER) for r in other.requests] == [traj.session_id] * 2


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_hand_set_session_header_between_two_of_ours_is_left_as_set(
    kind: str, dynamo: Recorder
) -> None:
    """A trajectory's turns to one router are answered from the last one's plan: a turn that holds a
    header of its own in between is not, and is left as set, once."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory() as traj:
        await send(kind, dynamo.url)
        await send(kind, dynamo.url, headers={"x-DYNAMO-session-id": "mine"})
        await send(kind, dynamo.url)
    ours = [traj.session_id]
    assert [r.values(SESSION_HEADER) for r in dynamo.requests] == [ours, ["mine"], ours]


def test_configure_inside_a_trajectory_takes_effect_at_the_next_request(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory() as traj, httpx.Client() as client:
        client.get(dynamo.url).raise_for_status()
        otel_session.configure(dynamo_hosts=["dynamo.invalid"])
        client.get(dynamo.url).raise_for_status()
        otel_session.configure(dynamo_hosts=[dynamo.authority])
        client.get(dynamo.url).raise_for_status()
    assert [r.get(SESSION_HEADER) for r in dynamo.requests] == [traj.session_id, None, traj.session_id]


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_callers_baggage_to_a_trusted_host_is_merged(kind: str, gym: Recorder) -> None:
    otel_session.configure(dynamo_hosts=["dynamo.invalid"], trusted_hosts=[gym.authority])
    with otel_session.trajectory() as traj:
        await send(kind, gym.url, headers={"baggage": "tenant=acme"})
    assert gym.requests[-1].get("baggage") == f"tenant=acme,session.id={traj.session_id}"


@pytest.mark.parametrize("client", ["httpx", "aiohttp"])
@pytest.mark.parametrize("second", ["region=eu", "session.id=callers-own"])
async def test_a_callers_baggage_over_two_lines_is_read_whole(
    client: str, second: str, gym: Recorder
) -> None:
    """A list header may come as several lines. aiohttp's hop read only the first and wrote the merge
    over both: the caller's second line was lost, and with it the caller's own session.id."""
    otel_session.configure(dynamo_hosts=["dynamo.invalid"], trusted_hosts=[gym.authority])
    lines = [("baggage", "tenant=acme"), ("baggage", second)]
    with otel_session.trajectory() as traj:
        if client == "httpx":
            async with httpx.AsyncClient() as http:
                (await http.get(f"{gym.url}/x", headers=lines)).raise_for_status()
        else:
            url = f"{gym.url}/x"
            async with aiohttp.ClientSession() as session, session.get(url, headers=lines) as response:
                response.raise_for_status()
    received = ",".join(value for name, value in gym.requests[-1].headers if name.lower() == "baggage")
    members = {member.strip() for member in received.split(",")}
    expected = {"tenant=acme", second}
    if second == "region=eu":
        expected.add(f"session.id={traj.session_id}")
    assert members == expected, received


@pytest.mark.parametrize("kind", ["httpx", "httpx-async", "aiohttp"])
async def test_a_callers_traceparent_to_dynamo_is_kept_with_tracing_on(kind: str, dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority], tracing=True)
    mine = "00-11111111111111111111111111111111-2222222222222222-01"
    with otel_session.trajectory() as traj:
        await send(kind, dynamo.url, headers={"traceparent": mine})
    assert dynamo.requests[-1].get("traceparent") == mine
    assert dynamo.requests[-1].get(SESSION_HEADER) == traj.session_id


def test_the_callers_request_object_keeps_its_own_baggage_and_traceparent(gym: Recorder) -> None:
    otel_session.configure(dynamo_hosts=["dynamo.invalid"], trusted_hosts=[gym.authority], tracing=True)
    with otel_session.trajectory(), httpx.Client() as client:
        mine = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        own = {"baggage": "tenant=acme", "traceparent": mine}
        request = client.build_request("GET", gym.url, headers=own)
        client.send(request).raise_for_status()
    assert request.headers["baggage"] == "tenant=acme"
    assert request.headers["traceparent"] == mine


# ---- 8. stock propagators that would leak are named at startup -------------------------------------


@pytest.mark.parametrize(
    ("propagators", "warned"),
    [
        ("dynamo_session,baggage", "baggage"),
        ("dynamo_session,tracecontext", "tracecontext"),
        ("tracecontext,baggage,dynamo_session", "tracecontext and baggage"),
        ("dynamo_session", None),
    ],
)
def test_leaky_propagator_combinations_are_warned_about_once(
    tmp_path: Path, propagators: str, warned: str | None
) -> None:
    script = tmp_path / "rollout.py"
    script.write_text("import httpx\nprint('ran')\n")
    env = {
        "PATH": str(Path(sys.executable).parent),
        "OTEL_PROPAGATORS": propagators,
        "OTEL_PYTHON_DISTRO": "distro",  # opentelemetry-distro: the upstream one
        "OTEL_PYTHON_CONFIGURATOR": "configurator",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_SESSION_DYNAMO_HOSTS": "dynamo:8000",
    }
    done = subprocess.run(
        [str(Path(sys.executable).parent / "opentelemetry-instrument"), sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "ran" in done.stdout
    lines = [line for line in done.stderr.splitlines() if "OTEL_PROPAGATORS" in line]
    if warned is None:
        assert lines == [], done.stderr
    else:
        assert len(lines) == 1, done.stderr
        assert f"stock {warned} propagator" in lines[0] and "OTEL_PROPAGATORS=dynamo_session" in lines[0]
        assert "Traceback" not in done.stderr


# ---- what the mutation test found untested ----------------------------------------------------------


def test_configure_twice_then_unconfigure_restores_the_propagator_from_before() -> None:
    mine = CompositePropagator([TraceContextTextMapPropagator()])
    propagate.set_global_textmap(mine)
    try:
        otel_session.configure(dynamo_hosts=["a"])
        otel_session.configure(dynamo_hosts=["b"])
        assert isinstance(propagate.get_global_textmap(), otel_session.SessionPropagator)
        otel_session.unconfigure()
        assert propagate.get_global_textmap() is mine
    finally:
        stock = [TraceContextTextMapPropagator(), W3CBaggagePropagator()]
        propagate.set_global_textmap(CompositePropagator(stock))


def test_the_tracing_argument_false_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_TRACING", "true")
    settings = otel_session.configure(dynamo_hosts=["a"], tracing=False)
    assert settings.tracing is False
    with otel_session.trajectory() as traj:
        assert not traj.span.get_span_context().is_valid


def test_re_adopting_the_current_id_inside_a_nested_trajectory_is_not_nesting(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory() as outer, otel_session.trajectory(session_id=outer.session_id) as inner:
        assert inner.session_id == outer.session_id and inner.parent_session_id is None
        httpx.get(f"{dynamo.url}/x").raise_for_status()
    assert dynamo.requests[0].get(SESSION_HEADER) == outer.session_id
    assert dynamo.requests[0].get("x-dynamo-parent-session-id") is None


def test_re_entering_a_nested_session_keeps_its_parent(dynamo: Recorder) -> None:
    """The same session is the same session: re-entered, it still names the parent it was opened with."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory() as outer, otel_session.trajectory() as inner:
        httpx.get(f"{dynamo.url}/x").raise_for_status()
        with otel_session.trajectory(session_id=inner.session_id) as again:
            assert (again.session_id, again.parent_session_id) == (inner.session_id, outer.session_id)
            httpx.get(f"{dynamo.url}/x").raise_for_status()
    sent = [(r.get(SESSION_HEADER), r.get("x-dynamo-parent-session-id")) for r in dynamo.requests]
    assert sent == [(inner.session_id, outer.session_id)] * 2


# ---- what the attack on this version found ---------------------------------------------------------


def test_one_request_object_sent_from_many_threads_at_once(dynamo: Recorder) -> None:
    """Each thread its own trajectory, all sending one ``Request``: each its own ID, never an error."""
    import threading

    otel_session.configure(dynamo_hosts=[dynamo.authority])
    client = httpx.Client()
    shared = client.build_request("GET", f"{dynamo.url}/v1/models")
    sent: list[str] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with otel_session.trajectory() as traj:
                for _ in range(25):
                    client.send(shared).raise_for_status()
                    assert traj.session_id is not None
                    sent.append(traj.session_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    client.close()
    assert errors == []
    assert sorted(r.get(SESSION_HEADER) or "" for r in dynamo.requests) == sorted(sent)
    assert SESSION_HEADER not in shared.headers


def _redirect_everything_to(target: Recorder, seen: list[str] | None = None) -> Starlette:
    async def redirect(request: Request) -> Any:
        from starlette.responses import RedirectResponse

        if seen is not None:
            seen.append(request.url.path)
        return RedirectResponse(f"{target.url}/elsewhere", status_code=302)

    return Starlette(routes=[Route("/{path:path}", redirect, methods=["GET", "POST"])])


@pytest.mark.parametrize("kind", ["httpx", "httpx-async", "openai"])
async def test_with_tracing_on_a_redirect_outside_a_trajectory_carries_no_traceparent(
    kind: str, other: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: dropped
    with AsgiServer(_redirect_everything_to(other)) as dynamo:
        otel_session.configure(dynamo_hosts=[dynamo.authority], tracing=True)
        with contextlib.suppress(Exception):  # the redirect target answers what it answers
            await send(kind, dynamo.url)
    assert other.requests, "the redirect was followed"
    for seen in other.requests:
        assert not seen.names() & OURS, seen.headers


def test_with_tracing_on_the_callers_request_object_is_left_as_it_was(
    other: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    otel_session.configure(dynamo_hosts=[other.authority], tracing=True)
    with httpx.Client() as client:
        request = client.build_request("GET", f"{other.url}/x")
        before = list(request.headers.multi_items())
        client.send(request).raise_for_status()
    assert list(request.headers.multi_items()) == before


class AuditingTransport(httpx.HTTPTransport):
    """A transport that reports each request to an audit host (with ``requests``) before sending it."""

    def __init__(self, audit: Recorder) -> None:
        super().__init__()
        self.audit = audit

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        requests.post(f"{self.audit.url}/audit", data=b"", timeout=10)
        return super().handle_request(request)


def test_a_request_sent_from_inside_a_hop_is_not_that_hops(
    dynamo: Recorder, other: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    otel_session.configure(dynamo_hosts=[dynamo.authority], tracing=True)
    RequestsInstrumentor().instrument()
    try:
        with otel_session.trajectory() as traj, httpx.Client(transport=AuditingTransport(other)) as client:
            client.get(f"{dynamo.url}/v1/models").raise_for_status()
    finally:
        RequestsInstrumentor().uninstrument()
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id
    [audit] = other.requests
    assert not audit.names() & OURS, audit.headers


@pytest.mark.parametrize("inner", ["aiohttp", "httpx"])
@pytest.mark.parametrize("where", ["streamed body", "trace callback"])
@pytest.mark.parametrize("propagators", ["tracing on", "stock composed with ours"])
async def test_a_request_sent_from_inside_an_aiohttp_hop_is_not_that_hops(
    inner: str,
    where: str,
    propagators: str,
    dynamo: Recorder,
    other: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aiohttp runs its trace callbacks in the hop's context, and the task streaming a body keeps a
    copy of it: a request sent from there, injected by an upstream instrumentation through our
    propagator, went out with the hop's session header (and traceparent) to another host."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    composed = propagators == "stock composed with ours"
    if composed:
        AioHttpClientInstrumentor().instrument()
        HTTPXClientInstrumentor().instrument()
        otel_session.configure(dynamo_hosts=[dynamo.authority])
        propagate.set_global_textmap(
            CompositePropagator(
                [TraceContextTextMapPropagator(), W3CBaggagePropagator(), otel_session.SessionPropagator()]
            )
        )
    else:
        otel_session.configure(dynamo_hosts=[dynamo.authority], tracing=True)
    try:
        async with aiohttp.ClientSession() as fetcher, httpx.AsyncClient() as client:

            async def fetch(path: str) -> bytes:
                if inner == "httpx":
                    return (await client.get(f"{other.url}{path}")).content
                async with fetcher.get(f"{other.url}{path}") as response:
                    return await response.read()

            async def on_headers_sent(*_: Any) -> None:  # an application's audit hook, say
                await fetch("/audit")

            async def body() -> Any:  # an upload whose bytes come from another host
                yield await fetch("/chunk")

            audit = aiohttp.TraceConfig()
            if where == "trace callback":
                audit.on_request_headers_sent.append(on_headers_sent)
            async with aiohttp.ClientSession(trace_configs=[audit]) as session:
                with otel_session.trajectory() as traj:
                    data = body() if where == "streamed body" else b"payload"
                    async with session.post(f"{dynamo.url}/v1/upload", data=data) as response:
                        await response.read()
    finally:
        if composed:
            AioHttpClientInstrumentor().uninstrument()
            HTTPXClientInstrumentor().uninstrument()
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id
    [sent_from_inside] = other.requests
    assert not sent_from_inside.names() & OURS, sent_from_inside.headers


def test_an_end_of_session_notice_never_follows_a_redirect(other: Recorder) -> None:
    paths: list[str] = []
    with AsgiServer(_redirect_everything_to(other, paths)) as router:
        otel_session.configure(routers={"vllm-router": [router.authority]}, end_sessions=True)
        with otel_session.trajectory(), httpx.Client() as client:
            client.get(f"{router.url}/v1/models")  # the router answers 302: not followed by the client
        deadline = time.monotonic() + 5
        while "/finish_session" not in paths and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    assert paths == ["/v1/models", "/finish_session"]  # the notice reached the router, which redirected
    assert other.requests == []  # and it went no further


def test_one_router_reached_by_two_spellings_is_told_once() -> None:
    """``[::1]`` and ``[0:0:0:0:0:0:0:1]``, httpx and aiohttp: one router, one notice."""
    with Recorder(host="::1") as router:
        patterns = [f"[::1]:{router.port}"]
        otel_session.configure(routers={"vllm-router": patterns}, end_sessions=True)
        with otel_session.trajectory():
            httpx.get(f"http://[::1]:{router.port}/v1/models")
            httpx.get(f"http://[0:0:0:0:0:0:0:1]:{router.port}/v1/models")
            asyncio.run(_aiohttp_get(f"http://[::1]:{router.port}/v1/models"))
        deadline = time.monotonic() + 5
        while not any(r.path == "/finish_session" for r in router.requests) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # a second notice, were there one, would have arrived by now
        finished = [r for r in router.requests if r.path == "/finish_session"]
    assert len(finished) == 1, [r.path for r in router.requests]


async def _aiohttp_get(url: str) -> None:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        await response.read()


# ---- 8. remembered plans: one per context and destination ---------------------------------------


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_trajectory_alternating_destinations_gets_each_its_own_answer_every_time(
    kind: str, dynamo: Recorder, gym: Recorder, other: Recorder
) -> None:
    """The plans a trajectory's context remembers are per destination: turns that go back and forth
    between a router, a trusted host and any other host never take one another's answer."""
    otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[gym.authority])
    order = [dynamo, gym, other, dynamo, other, gym, dynamo, dynamo, other, other, gym]
    with otel_session.trajectory() as traj:
        for server in order:
            await send(kind, server.url)
    assert len(dynamo.requests) == 4 and len(gym.requests) == 3 and len(other.requests) == 4
    for seen in dynamo.requests:
        assert seen.values(SESSION_HEADER) == [traj.session_id] and seen.get("baggage") is None
    for seen in gym.requests:
        assert seen.get(SESSION_HEADER) is None
        assert seen.values("baggage") == [f"session.id={traj.session_id}"]
    for seen in other.requests:
        assert not OURS & seen.names(), seen.headers


def test_more_destinations_than_a_context_remembers_each_get_their_answer() -> None:
    """A context remembers a bounded number of destinations: past the bound it forgets them and plans
    afresh, and every request still gets exactly its destination's answer, also on the way back."""
    hosts = [f"127.0.0.{index}" for index in range(1, 81)]  # 80 loopback destinations
    with LoopbackServer(hosts, record=True) as server:
        routers = set(server.authorities[::3])
        otel_session.configure(dynamo_hosts=sorted(routers))
        with otel_session.trajectory() as traj, httpx.Client() as client:
            for turn in range(2):
                for index, url in enumerate(server.urls):
                    client.get(f"{url}/{turn}/{index}").raise_for_status()
                offered = _hop.current()
                assert offered is not None and 0 < len(offered._plans) <= _hop.PLANS_KEPT < len(hosts)
        seen = {record["path"]: record.get("x-dynamo-session-id") for record in server.records()}
    for turn in range(2):
        for index, authority in enumerate(server.authorities):
            expected = [traj.session_id] if authority in routers else None
            assert seen[f"/{turn}/{index}"] == expected, (turn, authority)
