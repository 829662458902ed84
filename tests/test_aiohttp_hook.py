"""The aiohttp client hook's rules one by one (``otel_session.instrumentation.aiohttp_client``), then a
real ``aiohttp.ClientSession`` end to end over ONE loopback server started once for the module: which
header classes take the fast path, what one send carries and what the request holds after it, re-sends,
bodies read for an attempt's group and bodies never read, error answers and usage as evidence, a
proxy's CONNECT, a Unix socket, and faults of ours that must never reach the request. Quick enough to
judge every mutant of the hook (``bash scripts/mutate --module instrumentation.aiohttp_client``)."""

from __future__ import annotations

import asyncio
import http.server
import inspect
import io
import json
import logging
import os
import shutil
import socket
import socketserver
import ssl
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import multidict
import pytest
import trustme
from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from yarl import URL

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER, _evidence, _faults, _hop, _metrics
from otel_session._context import HOP_KEY
from otel_session._propagator import SessionPropagator
from otel_session.instrumentation import aiohttp_client as hook
from tests import support
from tests.proxy import RecordingProxy
from tests.recorder import Recorder
from tests.test_metrics_rules import Recording

NAMES = ("baggage", "traceparent", "x-dynamo-session-id")
OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent"}


@pytest.fixture(scope="module")
def served() -> Iterator[Recorder]:
    with Recorder() as server:
        yield server


@pytest.fixture
def server(served: Recorder) -> Iterator[Recorder]:
    """The module's one server, with nothing recorded and nothing set to fail."""
    served.clear()
    served.fail_next.clear()
    served.redirect_to = None
    yield served
    served.fail_next.clear()
    served.redirect_to = None


@pytest.fixture
def router(server: Recorder) -> Recorder:
    otel_session.configure(dynamo_hosts=[server.authority])
    return server


@pytest.fixture
def reports(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """What otel-session says, each fault reported afresh."""
    monkeypatch.setattr(_faults, "_reported", set())
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage().partition(";")[0])

    handler = Keep(logging.WARNING)
    logging.getLogger("otel_session").addHandler(handler)
    yield said
    logging.getLogger("otel_session").removeHandler(handler)


# --- the rules ------------------------------------------------------------------------------------


def test_multidicts_case_folding_class_takes_the_fast_path_and_look_alikes_do_not() -> None:
    assert hook._folds_case(multidict.CIMultiDict) is True
    assert hook._folds_case(multidict.MultiDict) is False  # compares names as spelled
    assert hook._folds_case(dict) is False
    assert multidict.CIMultiDict in hook._FOLDING
    assert type("CIMultiDict", (multidict.MultiDict,), {}) not in hook._FOLDING
    assert type("Other", (multidict.CIMultiDict,), {}) not in hook._FOLDING


class _KeepsAll(multidict.CIMultiDict):  # type: ignore[type-arg]
    def popall(self, key: Any, default: Any = None) -> Any:
        return default  # takes nothing out


class _AddsUpper(multidict.CIMultiDict):  # type: ignore[type-arg]
    def add(self, key: Any, value: Any) -> None:
        super().add(key.upper(), value)
        super().add("X-Extra", value)


def test_a_case_folding_class_that_adds_or_pops_otherwise_takes_the_public_path() -> None:
    assert hook._folds_case(_KeepsAll) is False
    assert hook._folds_case(_AddsUpper) is False


def test_what_the_callers_headers_hold_of_the_names_read() -> None:
    plan: Any = SimpleNamespace(names=NAMES)
    assert hook._held(multidict.CIMultiDict({"Accept": "x"}), plan) is hook._NOTHING
    assert hook._held(multidict.CIMultiDict({"X-Dynamo-Session-ID": "mine"}), plan) == {
        "x-dynamo-session-id": "mine"
    }
    assert hook._held({"Baggage": "a=1", "Accept": "x"}, plan) == {"baggage": "a=1"}
    assert hook._held({"Accept": "x"}, plan) == {}


def _conn(family: int | None) -> Any:
    """What ``send`` is handed: a connection whose transport knows its socket (aiohttp's shape)."""
    sock = None if family is None else SimpleNamespace(family=family)
    return SimpleNamespace(
        transport=SimpleNamespace(get_extra_info=lambda name: sock if name == "socket" else 0)
    )


def test_a_connection_over_a_unix_socket_is_told_apart_by_its_sockets_family() -> None:
    assert hook._over_unix_socket((_conn(socket.AF_UNIX),), {}) is True
    assert hook._over_unix_socket((), {"conn": _conn(socket.AF_UNIX)}) is True
    assert hook._over_unix_socket((_conn(socket.AF_INET),), {}) is False
    assert hook._over_unix_socket((_conn(None),), {}) is False
    assert hook._over_unix_socket((SimpleNamespace(transport=None),), {}) is False
    assert hook._over_unix_socket((), {}) is False


def test_edits_on_a_sends_headers_add_write_and_remove() -> None:
    headers = multidict.CIMultiDict([("Accept", "x"), ("Baggage", "theirs")])
    hook._edit(headers, [("X-Dynamo-Session-ID", "s1"), ("Baggage", None)], {})
    assert list(headers.items()) == [("Accept", "x"), ("X-Dynamo-Session-ID", "s1")]
    held = multidict.CIMultiDict([("x-dynamo-session-id", "old"), ("Accept", "x")])
    hook._edit(held, [("X-Dynamo-Session-ID", "s1")], {"x-dynamo-session-id": "old"})
    assert held.getall("x-dynamo-session-id") == ["s1"]
    plain = multidict.MultiDict([("x-dynamo-session-id", "old")])
    hook._edit(plain, [("X-Dynamo-Session-ID", "s1")], {})
    assert [v for k, v in plain.items() if k.lower() == "x-dynamo-session-id"] == ["s1"]


def test_after_a_send_ours_are_taken_out_and_the_callers_own_put_back_in_place() -> None:
    added = multidict.CIMultiDict([("Accept", "x"), ("X-Dynamo-Session-ID", "s1"), ("Connection", "k")])
    hook._restore(added, None, ["X-Dynamo-Session-ID"])
    assert list(added.items()) == [("Accept", "x"), ("Connection", "k")]
    saved = [("baggage", "theirs"), ("Accept", "x")]
    sent = multidict.CIMultiDict([("Accept", "x"), ("Baggage", "ours"), ("Host", "h"), ("Accept", "y")])
    hook._restore(sent, saved, ["Baggage"])
    assert list(sent.items()) == [("baggage", "theirs"), ("Accept", "x"), ("Host", "h"), ("Accept", "y")]


def test_instrumenting_finds_aiohttps_bytes_payloads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hook, "_BYTES_PAYLOADS", ())
    targets = hook._INSTRUMENTOR.targets(aiohttp)
    assert (aiohttp.payload.BytesPayload,) == hook._BYTES_PAYLOADS
    assert [(owner, name) for owner, name, _ in targets] == [
        (aiohttp.ClientSession, "_request"),
        (aiohttp.ClientRequest, "send"),
        (aiohttp.ClientResponse, "start"),
        (aiohttp.ClientResponse, "json"),
    ]
    bare = SimpleNamespace(
        ClientSession=aiohttp.ClientSession,
        ClientRequest=aiohttp.ClientRequest,
        ClientResponse=aiohttp.ClientResponse,
    )
    hook._INSTRUMENTOR.targets(bare)  # type: ignore[arg-type]
    assert hook._BYTES_PAYLOADS == ()
    hook._INSTRUMENTOR.targets(SimpleNamespace(**vars(bare), payload=SimpleNamespace(BytesPayload=1)))  # type: ignore[arg-type]
    assert hook._BYTES_PAYLOADS == ()


# --- end to end -----------------------------------------------------------------------------------


async def test_a_send_to_the_router_carries_the_session_and_the_request_keeps_none_after(
    router: Recorder,
) -> None:
    mine = {"X-Mine": "1"}
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory() as traj:
            async with http.post(f"{router.url}/v1/x", json={"a": 1}, headers=mine) as reply:
                assert reply.status == 200
                assert SESSION_HEADER not in reply.request_info.headers
                assert reply.request_info.headers.get("X-Mine") == "1"
    assert mine == {"X-Mine": "1"} and hook._in_flight == {}
    [seen] = router.requests
    assert seen.values(SESSION_HEADER) == [traj.session_id] and seen.get("X-Mine") == "1"


async def test_a_callers_own_values_are_kept_and_put_back_after_the_send(server: Recorder) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:1"], trusted_hosts=[server.authority])
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory() as traj:
            headers = [("Baggage", "k=v"), ("X-Mine", "1")]
            async with http.get(f"{server.url}/a", headers=headers) as reply:
                kept = [
                    item for item in reply.request_info.headers.items() if item[0] in ("Baggage", "X-Mine")
                ]
                assert kept == headers
            async with http.get(f"{server.url}/b") as reply:
                assert "baggage" not in reply.request_info.headers
    first, second = server.requests
    assert first.values("baggage") == [f"k=v,session.id={traj.session_id}"]
    assert second.values("baggage") == [f"session.id={traj.session_id}"]


async def test_nothing_goes_to_another_host_nor_outside_a_trajectory(server: Recorder) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:1"])
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory():
            async with http.get(f"{server.url}/a") as reply:
                assert reply.status == 200
        async with http.get(f"{server.url}/b") as reply:
            assert reply.status == 200
    assert not {name for seen in server.requests for name in seen.names()} & OURS


async def test_a_middleware_sending_the_same_request_twice_sends_one_session_each_time(
    router: Recorder,
) -> None:
    async def twice(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
        first = await handler(request)
        first.release()
        return await handler(request)

    async with aiohttp.ClientSession(middlewares=(twice,)) as http:
        with otel_session.trajectory() as traj:
            async with http.get(f"{router.url}/a") as reply:
                assert reply.status == 200
    assert [seen.values(SESSION_HEADER) for seen in router.requests] == [[traj.session_id]] * 2


async def test_concurrent_sends_of_one_request_each_start_from_the_callers_headers(router: Recorder) -> None:
    """A hedging middleware's second send starts while the first is under way."""

    async def hedged(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
        first, second = await asyncio.gather(handler(request), handler(request))
        first.release()
        return second

    async with aiohttp.ClientSession(middlewares=(hedged,)) as http:
        with otel_session.trajectory() as traj:
            async with http.get(f"{router.url}/a", headers={"X-Mine": "1"}) as reply:
                assert reply.status == 200
    assert [seen.values(SESSION_HEADER) for seen in router.requests] == [[traj.session_id]] * 2
    assert hook._in_flight == {}


async def test_error_answers_of_the_router_are_evidence_and_others_are_not(router: Recorder) -> None:
    _evidence.forget()
    router.fail_next.extend([428, 429, 503, 500])
    try:
        async with aiohttp.ClientSession() as http:
            with otel_session.trajectory():
                statuses = []
                for _ in range(3):
                    async with http.get(f"{router.url}/x") as reply:
                        statuses.append(reply.status)
            async with http.get(f"{router.url}/x") as reply:  # no session: no evidence
                statuses.append(reply.status)
        assert statuses == [428, 429, 503, 500]
        assert _evidence.routers[("dynamo", "127.0.0.1", router.port)].errors == 2
    finally:
        _evidence.forget()


async def test_usage_read_with_json_inside_a_trajectory_is_a_turn(
    router: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    turns = Recording()
    monkeypatch.setattr(_metrics, "turns", turns)
    _evidence.forget()
    try:
        async with aiohttp.ClientSession() as http:
            with otel_session.trajectory():
                async with http.post(f"{router.url}/v1/chat/completions", json=support.chat("p")) as reply:
                    body = await reply.json()
            async with http.post(f"{router.url}/v1/chat/completions", json=support.chat("p")) as reply:
                assert await reply.json() == body  # outside: the body as it is, no turn
    finally:
        _evidence.forget()
    assert body["usage"]["prompt_tokens"] == 1
    [(_, attributes)] = turns.added
    assert attributes["server.port"] == router.port


async def test_a_fault_reading_usage_costs_the_evidence_not_the_body(
    router: Recorder, reports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("ours")

    monkeypatch.setattr(_evidence, "parsed", broken)
    monkeypatch.setattr(_evidence, "answered_status", broken)
    router.fail_next.append(503)
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory():
            async with http.get(f"{router.url}/a") as reply:
                assert reply.status == 503 and (await reply.json())["error"] == "injected failure"
    assert reports == [
        "otel-session: reading a response's status failed (RuntimeError)",
        "otel-session: reading the usage of an aiohttp response failed (RuntimeError)",
    ]


async def test_a_whole_body_decides_the_attempts_group_and_a_streamed_one_does_not(router: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[router.authority], siblings="prompt")

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "m", '
        yield b'"messages": [{"role": "user", "content": "p"}]}'

    async with aiohttp.ClientSession() as http:
        for body in ("json", "bytes", "text", "stream"):
            with otel_session.trajectory():
                if body == "json":
                    sent = http.post(f"{router.url}/v1/chat/completions", json=support.chat("p"))
                elif body == "bytes":
                    sent = http.post(f"{router.url}/v1/chat/completions", data=b'{"messages": [1]}')
                elif body == "text":
                    sent = http.post(f"{router.url}/v1/chat/completions", data='{"messages": [2]}')
                else:
                    sent = http.post(f"{router.url}/v1/chat/completions", data=chunks())
                async with sent as reply:
                    assert reply.status == 200
    parents = [seen.get(PARENT_SESSION_HEADER) for seen in router.requests]
    assert None not in parents[:3] and parents[3] is None, parents
    assert all(seen.get(SESSION_HEADER) for seen in router.requests)


async def test_a_request_outside_a_trajectory_to_the_router_is_told_once_and_counted(
    router: Recorder, reports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = Recording()
    monkeypatch.setattr(_hop, "untold", True)
    monkeypatch.setattr(_metrics, "recording", lambda: True)
    monkeypatch.setattr(_metrics, "requests", counted)
    async with aiohttp.ClientSession() as http:
        for path in ("/a", "/b"):
            async with http.get(f"{router.url}{path}") as reply:
                assert reply.status == 200
        monkeypatch.setattr(_metrics, "recording", lambda: False)
        async with http.get(f"{router.url}/c") as reply:
            assert reply.status == 200
    assert len(reports) == 1 and reports[0].startswith(
        f"otel-session: a request to dynamo router {router.authority} was sent outside"
    )
    assert [(a["server.port"], a["otel_session.session"]) for _, a in counted.added] == [
        (router.port, False),
        (router.port, False),
    ]


async def test_a_fault_of_ours_sends_the_request_as_it_is_and_is_reported_once(
    router: Recorder, reports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> Any:
        raise RuntimeError("ours")

    monkeypatch.setattr(_hop, "current", broken)
    async with aiohttp.ClientSession() as http:
        for path in ("/a", "/b"):
            async with http.get(f"{router.url}{path}", headers={"X-Mine": "1"}) as reply:
                assert reply.status == 200
    assert reports == ["otel-session: adding session headers to a request failed (RuntimeError)"]
    assert [seen.get("X-Mine") for seen in router.requests] == ["1", "1"]


async def test_a_fault_of_ours_while_editing_sends_the_callers_headers(
    router: Recorder, reports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("ours")

    monkeypatch.setattr(hook, "_edit", broken)
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory():
            async with http.get(f"{router.url}/a", headers={"X-Mine": "1"}) as reply:
                assert reply.status == 200
                assert dict(reply.request_info.headers).get("X-Mine") == "1"
    assert reports == ["otel-session: adding session headers to a request failed (RuntimeError)"]
    [seen] = router.requests
    assert seen.get("X-Mine") == "1" and seen.get(SESSION_HEADER) is None
    assert hook._in_flight == {}


async def test_a_fault_of_ours_restoring_after_the_send_costs_nothing_but_a_report(
    router: Recorder, reports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("ours")

    monkeypatch.setattr(hook, "_restore", broken)
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory() as traj:
            async with http.get(f"{router.url}/a") as reply:
                assert reply.status == 200
    assert reports == ["otel-session: restoring request headers failed (RuntimeError)"]
    assert router.requests[0].get(SESSION_HEADER) == traj.session_id
    assert hook._in_flight == {}


async def test_with_tracing_a_hop_is_watched_and_the_trace_goes_only_where_it_may(
    router: Recorder,
) -> None:
    otel_session.configure(dynamo_hosts=[router.authority], tracing=True)
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([W3CBaggagePropagator(), SessionPropagator()]))
    try:
        async with aiohttp.ClientSession() as http:
            with otel_session.trajectory() as traj:
                carried = {"baggage": f"session.id={traj.session_id}", "X-Mine": "1"}
                async with http.get(f"{router.url}/a", headers=carried) as reply:
                    assert reply.status == 200
    finally:
        propagate.set_global_textmap(before)
    [seen] = router.requests
    assert seen.values(SESSION_HEADER) == [traj.session_id] and seen.get("baggage") is None
    assert seen.get("X-Mine") == "1"


async def test_an_https_proxys_connect_gets_nothing_of_ours(tmp_path: Any) -> None:
    """The one test here with servers of its own: a TLS router behind a recording proxy."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    with Recorder(tls=(str(cert_file), str(key_file))) as tls_router, RecordingProxy() as proxy:
        otel_session.configure(dynamo_hosts=[tls_router.authority])
        with otel_session.trajectory() as traj:
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"{tls_router.url}/a", ssl=context, proxy=proxy.url) as reply,
            ):
                assert reply.status == 200
        [connect] = proxy.seen
        assert connect.method == "CONNECT" and not connect.names() & OURS
        assert tls_router.requests[0].get(SESSION_HEADER) == traj.session_id


class _UnixRecorder(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    seen: list[dict[str, str]]


class _Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        self.server.seen.append({k.lower(): v for k, v in self.headers.items()})  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def unix_server() -> Iterator[_UnixRecorder]:
    """An HTTP server on a Unix socket: a local process, whatever host the URL names."""
    folder = tempfile.mkdtemp(dir="/tmp")
    served = _UnixRecorder(os.path.join(folder, "s"), _Answer)
    served.seen = []
    thread = threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield served
    served.shutdown()
    served.server_close()
    thread.join(5)
    shutil.rmtree(folder, ignore_errors=True)


async def test_a_request_over_a_unix_socket_carries_nothing_whatever_host_its_url_names(
    router: Recorder, unix_server: _UnixRecorder, reports: list[str]
) -> None:
    unix_server.seen.clear()
    connector = aiohttp.UnixConnector(path=str(unix_server.server_address))
    async with aiohttp.ClientSession(connector=connector) as http:
        with otel_session.trajectory():
            async with http.get(f"{router.url}/a") as reply:
                assert reply.status == 200
    [seen] = unix_server.seen
    assert not set(seen) & OURS and reports == []


# --- one send, rule by rule: _planned and _hop_send on a request's shape -------------------------


class _Answer_:
    """What the original's coroutine returns: a response, weakly referenced while watched."""


ANSWER = _Answer_()


def _request(url: str, headers: Any) -> Any:
    """What ``_planned`` and ``_hop_send`` read and set of a ``ClientRequest``."""
    return SimpleNamespace(method="GET", headers=headers, url=URL(url), body=None)


@pytest.fixture
def flying() -> Iterator[dict[int, tuple[Any, Any]]]:
    yield hook._in_flight
    hook._in_flight.clear()


async def test_a_send_of_another_sends_copy_starts_from_the_callers_headers(
    router: Recorder, flying: dict[int, tuple[Any, Any]], reports: list[str]
) -> None:
    callers = multidict.CIMultiDict({"X-Mine": "1"})
    other = multidict.CIMultiDict({"X-Mine": "1", SESSION_HEADER: "another"})
    flying[id(other)] = (other, callers)
    instance = _request(f"{router.url}/a", other)
    with otel_session.trajectory() as traj:
        planned = hook._planned(instance, (), {})
        assert planned is not None
        got, swap, plan, held, watched = planned
        assert got is callers and swap is True and held == {} and watched is False
        assert plan is not None and plan.edits == [(SESSION_HEADER, traj.session_id)]
        seen: list[tuple[Any, dict[int, Any], Any]] = []

        async def sending() -> Any:
            seen.append((instance.headers, dict(flying), otel_context.get_value(HOP_KEY)))
            return ANSWER

        assert await hook._hop_send(sending(), instance, *planned) is ANSWER
    [(headers, during, hop)] = seen
    assert headers is not callers and headers is not other and hop is None
    assert during[id(headers)] == (headers, callers)
    assert instance.headers is headers and list(headers.items()) == [("X-Mine", "1")]  # ours out after
    assert id(headers) not in flying and list(callers.items()) == [("X-Mine", "1")]
    flying[id(other)] = (object(), callers)  # an id reused by another object: not a copy of ours
    instance.headers = other
    with otel_session.trajectory():
        again = hook._planned(instance, (), {})
    assert again is None  # its own session header: nothing to add, nothing to swap
    assert reports == []


async def test_outside_a_trajectory_a_send_is_left_alone_unless_it_holds_another_sends_copy(
    router: Recorder, flying: dict[int, tuple[Any, Any]], reports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_hop, "untold", False)
    callers = multidict.CIMultiDict({"X-Mine": "1"})
    instance = _request(f"{router.url}/a", callers)
    assert hook._planned(instance, (), {}) is None
    flying[id(object())] = (object(), callers)  # some other send under way
    assert hook._planned(instance, (), {}) is None
    other = multidict.CIMultiDict({"X-Mine": "1", SESSION_HEADER: "another"})
    flying[id(other)] = (other, callers)
    instance.headers = other
    planned = hook._planned(instance, (), {})
    assert planned == (callers, True, None, hook._NOTHING, False)

    async def sending() -> Any:
        return ANSWER

    assert await hook._hop_send(sending(), instance, *planned) is ANSWER
    assert instance.headers is not callers and list(instance.headers.items()) == [("X-Mine", "1")]
    assert reports == [] and id(instance.headers) not in flying


async def test_a_watched_send_runs_in_a_context_naming_its_hop_for_its_own_headers(
    router: Recorder, flying: dict[int, tuple[Any, Any]]
) -> None:
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([W3CBaggagePropagator(), SessionPropagator()]))
    try:
        with otel_session.trajectory():
            elsewhere = _request("http://127.0.0.9:1/a", multidict.CIMultiDict())
            planned = hook._planned(elsewhere, (), {})
            assert planned is not None and planned[4] is True and planned[2] is not None
            assert planned[2].edits == []
            instance = _request(f"{router.url}/a", multidict.CIMultiDict({"X-Mine": "1"}))
            planned = hook._planned(instance, (), {})
            assert planned is not None and planned[4] is True
            hops: list[Any] = []

            async def sending() -> Any:
                hops.append(otel_context.get_value(HOP_KEY))
                return ANSWER

            assert await hook._hop_send(sending(), instance, *planned) is ANSWER
            assert otel_context.get_value(HOP_KEY) is None
    finally:
        propagate.set_global_textmap(before)
    [hop] = hops
    assert hop.carrier is instance.headers and hop.route.profile.name == "dynamo"
    assert hop.added == frozenset({"x-dynamo-session-id"})
    with otel_session.trajectory():
        assert hook._planned(_request("http://127.0.0.9:1/a", multidict.CIMultiDict()), (), {}) is None


async def test_a_fault_of_ours_after_the_copy_is_made_puts_the_callers_headers_back(
    router: Recorder, flying: dict[int, tuple[Any, Any]], reports: list[str]
) -> None:
    callers = multidict.CIMultiDict({"X-Mine": "1"})
    instance = _request(f"{router.url}/a", callers)
    with otel_session.trajectory():
        planned = hook._planned(instance, (), {})
        assert planned is not None
        got, swap, plan, held, _ = planned
        broken = SimpleNamespace(edits=plan.edits, delivered=plan.delivered, route=plan.route, hop=None)
        sent: list[Any] = []

        async def sending() -> Any:
            sent.append(instance.headers)
            return ANSWER

        assert await hook._hop_send(sending(), instance, got, swap, broken, held, True) is ANSWER
    assert sent == [callers] and instance.headers is callers and flying == {}
    assert list(callers.items()) == [("X-Mine", "1")]
    assert reports == ["otel-session: adding session headers to a request failed (AttributeError)"]
    other = multidict.CIMultiDict({SESSION_HEADER: "another"})
    instance.headers = other
    with otel_session.trajectory():
        assert await hook._hop_send(sending(), instance, callers, True, broken, {}, True) is ANSWER
    assert instance.headers is callers and flying == {}


def test_an_attempts_group_is_decided_from_a_body_held_as_bytes(router: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[router.authority], siblings="prompt")
    destination = ("http", "127.0.0.1", router.port)
    body = json.dumps(support.chat("p")).encode()
    with otel_session.trajectory():
        offered = _hop.current()
        assert offered is not None
        assert hook._decided(offered, SimpleNamespace(body=body), destination).offer.parent is not None
    with otel_session.trajectory():
        offered = _hop.current()
        assert offered is not None
        assert hook._decided(offered, SimpleNamespace(body=object()), destination).offer.parent is None


async def test_inside_a_trajectory_a_send_to_the_router_is_not_told_as_outside(
    router: Recorder, reports: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_hop, "untold", True)
    caplog.set_level(logging.ERROR, "opentelemetry.context")
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory():
            async with http.get(f"{router.url}/a") as reply:
                assert reply.status == 200
    assert reports == [] and not [r for r in caplog.records if r.name.startswith("opentelemetry")]


async def test_a_callers_own_baggage_to_another_host_is_kept_where_ours_is_the_only_propagator(
    server: Recorder,
) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:1"])
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(SessionPropagator())
    try:
        async with aiohttp.ClientSession() as http:
            with otel_session.trajectory() as traj:
                mine = {"baggage": f"session.id={traj.session_id}"}
                async with http.get(f"{server.url}/a", headers=mine) as reply:
                    assert reply.status == 200
    finally:
        propagate.set_global_textmap(before)
    assert server.requests[0].get("baggage") == f"session.id={traj.session_id}"


async def test_usage_read_twice_from_one_response_is_one_turn_and_json_elsewhere_is_aiohttps_own(
    router: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    turns = Recording()
    monkeypatch.setattr(_metrics, "turns", turns)
    _evidence.forget()
    try:
        async with aiohttp.ClientSession() as http:
            with otel_session.trajectory():
                async with http.post(f"{router.url}/v1/chat/completions", json=support.chat("p")) as reply:
                    await reply.json()
                    await reply.json()
            async with http.post(f"{router.url}/v1/chat/completions", json=support.chat("p")) as reply:
                reading = reply.json()
                assert reading.__qualname__ == "ClientResponse.json"
                await reading
    finally:
        _evidence.forget()
    assert len(turns.added) == 1


def test_a_keys_view_folding_stored_names_only_is_asked_with_lower_case_names() -> None:
    """The hook asks its keys view with lower-case names only: a class that lowers the names it
    stores (and compares the names asked as given) still folds for it."""

    class Lowered:
        def __init__(self, names: Any) -> None:
            self.names = {name.lower() for name in names}

        def isdisjoint(self, other: Any) -> bool:
            return self.names.isdisjoint(other)

    class StoresLower(multidict.CIMultiDict):  # type: ignore[type-arg]
        def keys(self) -> Any:
            return Lowered(super().keys())

    class ClaimsEverything(multidict.CIMultiDict):  # type: ignore[type-arg]
        def keys(self) -> Any:
            return SimpleNamespace(isdisjoint=lambda other: False)

    assert hook._folds_case(StoresLower) is True
    assert hook._folds_case(ClaimsEverything) is False


async def test_a_request_to_another_host_first_leaves_the_group_to_the_routers_request(
    server: Recorder,
) -> None:
    otel_session.configure(dynamo_hosts=[f"localhost:{server.port}"], siblings="prompt")
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory() as traj:
            async with http.post(f"{server.url}/tool", json={"a": 1}) as reply:
                assert reply.status == 200
            async with http.post(
                f"http://localhost:{server.port}/v1/chat/completions", json=support.chat("p")
            ) as reply:
                assert reply.status == 200
    tool, chat = server.requests
    assert not tool.names() & OURS
    assert chat.get(SESSION_HEADER) == traj.session_id and chat.get(PARENT_SESSION_HEADER) is not None


async def test_a_send_of_another_sends_copy_with_nothing_to_add_counts_no_request(
    router: Recorder, flying: dict[int, tuple[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = Recording()
    monkeypatch.setattr(_metrics, "recording", lambda: True)
    monkeypatch.setattr(_metrics, "requests", counted)
    callers = multidict.CIMultiDict({SESSION_HEADER: "mine"})
    other = multidict.CIMultiDict({SESSION_HEADER: "mine", "X-Other": "1"})
    flying[id(other)] = (other, callers)
    instance = _request(f"{router.url}/a", other)
    with otel_session.trajectory():
        planned = hook._planned(instance, (), {})
        assert planned is not None and planned[1] is True and planned[2] is not None
        assert planned[2].edits == []

        async def sending() -> Any:
            return ANSWER

        assert await hook._hop_send(sending(), instance, *planned) is ANSWER
    assert counted.added == [] and list(instance.headers.items()) == [(SESSION_HEADER, "mine")]


# --- what an attempt's first request is read for, before it gathers ---------------------------------


def test_only_aiohttps_bytes_payloads_are_read_for_a_prompt(router: Recorder) -> None:
    """``json=`` and ``data=`` bytes or text reach the request as aiohttp's ``BytesPayload`` (or
    its ``StringPayload`` and ``JsonPayload``): read for the prompt. A file, a stream, a look-alike
    holding bytes, or a payload holding something else never is."""
    held = b'{"messages": [1]}'
    assert hook._body_of(SimpleNamespace(body=aiohttp.payload.BytesPayload(held))) == held
    assert hook._body_of(SimpleNamespace(body=aiohttp.payload.StringPayload("h\u00e9"))) == "h\u00e9".encode()
    assert hook._body_of(SimpleNamespace(body=aiohttp.payload.JsonPayload({"a": 1}))) == b'{"a": 1}'
    assert hook._body_of(SimpleNamespace(body=bytearray(held))) == bytearray(held)
    assert hook._body_of(SimpleNamespace(body=aiohttp.payload.IOBasePayload(io.BytesIO(held)))) is None
    assert hook._body_of(SimpleNamespace(body=SimpleNamespace(_value=held))) is None  # not aiohttp's
    odd = aiohttp.payload.BytesPayload(held)
    odd._value = "text"  # type: ignore[assignment]
    assert hook._body_of(SimpleNamespace(body=odd)) is None


async def test_a_request_to_gather_names_its_router_and_its_body_held_in_memory(router: Recorder) -> None:
    """What ``ClientSession._request`` hands on to wait for its step: the router (the URL given by
    position or as ``str_or_url``, joined to the session's base URL) and the prompt's body
    (``json=`` dumped, ``data=`` bytes or text; nothing for a form); nothing at all for another
    host or outside any attempt."""
    otel_session.configure(dynamo_hosts=[router.authority], siblings="prompt")
    path = "/v1/chat/completions"
    url = f"{router.url}{path}"
    here = ("http", "127.0.0.1", router.port)
    async with aiohttp.ClientSession() as http, aiohttp.ClientSession(base_url=router.url) as based:
        with otel_session.trajectory():
            named = hook._to_gather(http, ("POST",), {"str_or_url": url, "json": support.chat("p")})
            assert named is not None and named[2] == here and json.loads(named[1] or "") == support.chat("p")
            assert hook._to_gather(http, ("POST", url), {"data": b"x"})[1:] == (b"x", here)  # type: ignore[index]
            assert hook._to_gather(http, ("POST", url), {"data": "x"})[1:] == ("x", here)  # type: ignore[index]
            assert hook._to_gather(based, ("POST", path), {"data": b"x"})[1:] == (b"x", here)  # type: ignore[index]
            form = aiohttp.FormData({"a": "b"})
            assert hook._to_gather(http, ("POST", url), {"data": form})[1:] == (None, here)  # type: ignore[index]
            assert hook._to_gather(http, ("POST", "http://127.0.0.2:9/v1"), {"data": b"x"}) is None
        assert hook._to_gather(http, ("POST", url), {"data": b"x"}) is None  # outside any attempt


async def test_a_hook_left_in_place_but_not_instrumented_never_holds_a_request(
    router: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the patch stays (another wrapper over it) after uninstrumenting, a call goes straight to
    aiohttp's own, never waiting for a step."""
    otel_session.configure(dynamo_hosts=[router.authority], siblings="prompt")
    sent = object()
    args = ("POST", f"{router.url}/v1/chat/completions")
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory():
            held = hook._request(lambda *a, **k: sent, http, args, {"json": support.chat("p")})
            assert inspect.iscoroutine(held)
            held.close()
            monkeypatch.setattr(hook._INSTRUMENTOR, "active", False)
            assert hook._request(lambda *a, **k: sent, http, args, {"json": support.chat("p")}) is sent
