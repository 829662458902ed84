"""The httpx hook's rules one by one (``otel_session.instrumentation.httpx``), then real httpx clients
end to end over ONE loopback server started once for the module: which classes take the fast paths
(header list, URL parts, stand-in requests), what a hop sends to httpx's own transport and to any
other transport class, sync and async, streamed and whole bodies, error answers as evidence, and
faults of ours that must never reach the request. Quick enough to judge every mutant of the hook
(``bash scripts/mutate --module instrumentation.httpx``)."""

from __future__ import annotations

import http.server
import json
import logging
import os
import shutil
import socketserver
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import httpx2
import pytest
from opentelemetry import propagate
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER, _evidence, _faults, _hop, _metrics
from otel_session._propagator import SessionPropagator
from otel_session.instrumentation import httpx as hook
from tests import support
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
    """The server configured as a Dynamo frontend."""
    otel_session.configure(dynamo_hosts=[server.authority])
    return server


@pytest.fixture
def reports(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What otel-session says, each fault reported afresh."""
    monkeypatch.setattr(_faults, "_reported", set())
    caplog.set_level(logging.WARNING, "otel_session")
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage().partition(";")[0])

    handler = Keep()
    logging.getLogger("otel_session").addHandler(handler)
    yield said  # type: ignore[misc]
    logging.getLogger("otel_session").removeHandler(handler)


# --- the probes: which classes take the fast paths ------------------------------------------------


@pytest.mark.parametrize("module", [httpx, httpx2])
def test_httpx_and_httpx2_take_every_fast_path(module: Any) -> None:
    assert hook._transport_reads_only_the_basics(module) is True
    assert hook._headers_are_listed(module.Headers) is True
    assert hook._url_keeps_its_parts(module) is True


def _module_with(**changes: Any) -> Any:
    """httpx's names, some replaced: a library version the hook must not trust."""
    names = {name: getattr(httpx, name) for name in ("Request", "HTTPTransport", "AsyncHTTPTransport", "URL")}
    return SimpleNamespace(**{**names, **changes})


class _ReadsContent(httpx.HTTPTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=request.content)


class _AsyncReadsContent(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=request.content)


def test_a_transport_reading_more_of_a_request_gets_the_callers_request_not_a_stand_in() -> None:
    assert hook._transport_reads_only_the_basics(_module_with(HTTPTransport=_ReadsContent)) is False
    assert hook._transport_reads_only_the_basics(_module_with(AsyncHTTPTransport=_AsyncReadsContent)) is False
    refusing = _module_with(Request=lambda *a: 1 / 0)
    assert hook._transport_reads_only_the_basics(refusing) is False


def test_a_request_attribute_set_on_the_instance_counts_as_read() -> None:
    """A ``Request`` whose instance holds an attribute the transport reads, beyond the basics."""

    class Extra(httpx.Request):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.timeout = 1

    class ReadsTimeout(httpx.HTTPTransport):
        def handle_request(self, request: Any) -> httpx.Response:
            return httpx.Response(200, content=str(request.timeout).encode())

    assert (
        hook._transport_reads_only_the_basics(_module_with(Request=Extra, HTTPTransport=ReadsTimeout))
        is False
    )
    assert hook._transport_reads_only_the_basics(_module_with(Request=Extra)) is True


def _headers_kind(name: str, **methods: Any) -> type:
    return type(name, (httpx.Headers,), methods)


def _extra_attribute(self: Any, *args: Any) -> None:
    httpx.Headers.__init__(self, *args)
    self.extra = 1


def _lowered_raw(self: Any, *args: Any) -> None:
    httpx.Headers.__init__(self, *args)
    self._list = [(lower, lower, value) for _, lower, value in self._list]


def _exact_delete(self: Any, key: str) -> None:
    self._list = [item for item in self._list if item[0] != key.encode()]


def _first_only(self: Any, key: str, default: Any = None) -> Any:
    for _, lower, value in self._list:
        if lower == key.lower().encode():
            return value.decode()
    return default


def _delete_as_given(self: Any, key: str) -> None:
    self._list = [item for item in self._list if item[1] != key.encode()]


def _get_as_given(self: Any, key: str, default: Any = None) -> Any:
    found = [value.decode() for _, lower, value in self._list if lower == key.encode()]
    return ", ".join(found) if found else default


def test_a_headers_class_whose_lookup_takes_lower_case_names_only_is_still_read_through_its_list() -> None:
    """The fast path reads ``_list`` itself; of the public lookups it needs only one by a lower-case
    name to join repeated values."""
    assert hook._headers_are_listed(_headers_kind("GetAsGiven", get=_get_as_given)) is True


def _lost_added(self: Any, key: str, default: Any = None) -> Any:
    return httpx.Headers.get(self, key, default) if key != "new" else default


@pytest.mark.parametrize(
    "kind",
    [
        _headers_kind("Extra", __init__=_extra_attribute),
        _headers_kind("Lowered", __init__=_lowered_raw),
        _headers_kind("ExactDelete", __delitem__=_exact_delete),
        _headers_kind("DeleteAsGiven", __delitem__=_delete_as_given),
        _headers_kind("FirstOnly", get=_first_only),
        _headers_kind("LostAdded", get=_lost_added),
        _headers_kind("Refuses", __init__=lambda self, *a: 1 / 0),
        dict,
    ],
)
def test_a_headers_class_keeping_another_layout_takes_the_public_path(kind: type) -> None:
    assert hook._headers_are_listed(kind) is False


def test_a_url_class_whose_parsed_parts_differ_from_its_properties_is_read_by_its_properties() -> None:
    class Upper(httpx.URL):
        @property
        def host(self) -> str:
            return super().host.upper()

    class Unparsed(httpx.URL):
        @property
        def _uri_reference(self) -> Any:
            raise AttributeError("no parsed parts")

    assert hook._url_keeps_its_parts(_module_with(URL=Upper)) is False
    assert hook._url_keeps_its_parts(_module_with(URL=Unparsed)) is False


def test_the_destination_is_read_from_the_parsed_parts_of_a_checked_url_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Fast(httpx.URL):
        """Its properties refuse: only the parsed parts can be read."""

        @property
        def host(self) -> str:
            raise AssertionError("the property was read")

    monkeypatch.setattr(hook, "_parsed_urls", {Fast})
    assert hook._destination(Fast("https://Router.EXAMPLE/x")) == ("https", "router.example", None)
    assert hook._destination(Fast("http://127.0.0.1:8000/v1")) == ("http", "127.0.0.1", 8000)
    with pytest.raises(AssertionError):  # an IDNA label: left to the property
        hook._destination(Fast("http://xn--bcher-kva.example/"))
    assert hook._destination(httpx.URL("http://xn--bcher-kva.example:81/")) == ("http", "bücher.example", 81)
    with pytest.raises(AssertionError):  # a class not checked: its properties
        hook._destination(type("Other", (Fast,), {})("http://h/"))


def test_a_transport_over_a_unix_socket_sends_to_no_urls_host(tmp_path: Any) -> None:
    uds = httpx.HTTPTransport(uds=str(tmp_path / "s"))
    assert hook._over_unix_socket(uds) is True
    assert hook._where(uds, httpx.Request("GET", "http://127.0.0.1:9/")) == ("unix", None, None)
    plain = httpx.HTTPTransport()
    assert hook._over_unix_socket(plain) is False
    assert hook._where(plain, httpx.Request("GET", "http://127.0.0.1:9/")) == ("http", "127.0.0.1", 9)
    assert hook._over_unix_socket(object()) is False


# --- headers and requests: read, copied, never the caller's ----------------------------------------


def test_what_a_requests_headers_hold_of_the_names_read() -> None:
    plan: Any = SimpleNamespace(names=NAMES, raw_names=frozenset(n.encode() for n in NAMES))
    assert hook._held(httpx.Headers({"Accept": "x"}), plan) is hook._NOTHING
    assert hook._held(httpx.Headers({"X-Dynamo-Session-ID": "mine", "Accept": "x"}), plan) == {
        "x-dynamo-session-id": "mine"
    }
    assert hook._held({"Baggage": "a=1"}, plan) == {"baggage": "a=1"}
    assert hook._held({"Accept": "x"}, plan) == {}


def test_a_listed_headers_copy_appends_the_wire_and_leaves_the_callers_as_they_were() -> None:
    caller = httpx.Headers({"Accept": "x"})
    wire = ((b"X-Dynamo-Session-ID", b"x-dynamo-session-id", b"s1"),)
    copy = hook._copy_headers(caller, [("X-Dynamo-Session-ID", "s1")], wire)
    assert type(copy) is httpx.Headers and copy is not caller
    assert copy.raw == [(b"Accept", b"x"), (b"X-Dynamo-Session-ID", b"s1")]
    assert copy.encoding == caller.encoding and copy["x-dynamo-session-id"] == "s1"
    assert caller.raw == [(b"Accept", b"x")]
    edited = hook._copy_headers(httpx.Headers({"Baggage": "mine", "Accept": "x"}), [("Baggage", None)])
    assert edited.raw == [(b"Accept", b"x")]
    plain = hook._copy_headers(caller)
    assert plain.raw == caller.raw and plain is not caller and plain._list is not caller._list


def test_other_headers_are_copied_by_their_own_copy_with_the_edits_made() -> None:
    kind = _headers_kind("Extra", __init__=_extra_attribute)
    caller = kind({"Baggage": "theirs", "Accept": "x"})
    copy = hook._copy_headers(caller, [("Baggage", None), ("X-Dynamo-Session-ID", "s1")], None)
    assert dict(copy) == {"accept": "x", "x-dynamo-session-id": "s1"}
    assert dict(caller) == {"baggage": "theirs", "accept": "x"}
    assert dict(hook._copy_headers(caller)) == dict(caller)
    mapping = {"Baggage": "theirs", "Accept": "x"}
    copied = hook._copy_headers(mapping, [("Baggage", None), ("X-Dynamo-Session-ID", "s1")])
    assert copied == {"Accept": "x", "X-Dynamo-Session-ID": "s1"} and mapping["Baggage"] == "theirs"


def test_a_listed_copy_reads_its_values_in_the_callers_encoding() -> None:
    caller = httpx.Headers({"A": b"\xc3\xa9"}, encoding="iso-8859-1")
    wire = ((b"X-Dynamo-Session-ID", b"x-dynamo-session-id", b"s1"),)
    for copy in (
        hook._copy_headers(caller),
        hook._copy_headers(caller, [("X-Dynamo-Session-ID", "s1")], wire),
    ):
        assert copy["a"] == caller["a"] == "\u00c3\u00a9"


def test_a_stand_in_holds_just_what_httpxs_transport_reads() -> None:
    request = httpx.Request("POST", "http://h/x", content=b"body", extensions={"timeout": {}})
    request.mine = 1  # type: ignore[attr-defined]
    headers = httpx.Headers({"A": "1"})
    clone = hook._stand_in(request, headers)
    assert type(clone) is httpx.Request
    assert (clone.method, clone.url, clone.stream, clone.extensions) == (
        request.method,
        request.url,
        request.stream,
        request.extensions,
    )
    assert clone.headers is headers and set(vars(clone)) == set(hook.TRANSPORT_READS)


def test_a_copied_request_keeps_every_attribute_in_order_with_new_headers() -> None:
    request = httpx.Request("POST", "http://h/x", content=b"body")
    request.mine = 1  # type: ignore[attr-defined]
    headers = httpx.Headers({"A": "1"})
    clone = hook._copy_request(request, headers)
    assert list(vars(clone)) == list(vars(request))
    assert clone.headers is headers and clone.mine == 1 and clone.content == b"body"  # type: ignore[attr-defined]
    assert request.headers is not headers

    class Bare:
        """A request object that holds no headers of its own."""

    bare = Bare()
    bare.method = "GET"  # type: ignore[attr-defined]
    assert vars(hook._copy_request(bare, headers)) == {"method": "GET", "headers": headers}


def test_a_calls_request_is_found_and_replaced_by_position_or_by_name() -> None:
    assert hook._request_of(("r", 1), {}) == "r"
    assert hook._request_of((), {"request": "r"}) == "r"
    assert hook._request_of((), {}) is None
    assert hook._with_request(("r", 1), {"k": 2}, "s") == (("s", 1), {"k": 2})
    assert hook._with_request((), {"request": "r", "k": 2}, "s") == ((), {"request": "s", "k": 2})


def test_a_copy_in_flight_is_ours_only_while_it_is_the_same_object() -> None:
    request = httpx.Request("GET", "http://h/")
    assert hook._registered(request) is None
    entry = (request, ("http", "h", 80), request.headers)
    hook._in_flight[id(request)] = entry
    try:
        assert hook._registered(request) is entry
        hook._in_flight[id(request)] = (object(), ("http", "h", 80), None)
        assert hook._registered(request) is None
    finally:
        hook._in_flight.pop(id(request), None)


# --- end to end: httpx's own transport ----------------------------------------------------------


def test_a_hop_to_the_router_carries_the_session_and_the_callers_request_stays_as_it_was(
    router: Recorder,
) -> None:
    with otel_session.trajectory() as traj, httpx.Client() as client:
        request = client.build_request("POST", f"{router.url}/v1/x", json={"a": 1}, headers={"X-Mine": "1"})
        before = list(request.headers.raw)
        response = client.send(request)
        assert response.status_code == 200
    assert list(request.headers.raw) == before
    [seen] = router.requests
    assert seen.get(SESSION_HEADER) == traj.session_id and seen.get("X-Mine") == "1"
    assert seen.values(SESSION_HEADER) == [traj.session_id]


def test_nothing_goes_to_another_host_nor_outside_a_trajectory(server: Recorder) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:1"], trusted_hosts=["127.0.0.1:2"])
    with httpx.Client() as client:
        with otel_session.trajectory():
            request = client.build_request("GET", f"{server.url}/a")
            assert client.send(request).request is request  # nothing of ours: the caller's, as it is
        assert client.get(f"{server.url}/b").status_code == 200
    assert not {name for seen in server.requests for name in seen.names()} & OURS


def test_baggage_goes_to_a_trusted_host(server: Recorder) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:1"], trusted_hosts=[server.authority])
    with otel_session.trajectory() as traj, httpx.Client() as client:
        client.get(f"{server.url}/a")
        client.get(f"{server.url}/b", headers={"baggage": "k=v"})
    assert server.requests[0].get("baggage") == f"session.id={traj.session_id}"
    assert server.requests[1].values("baggage") == [f"k=v,session.id={traj.session_id}"]


def test_a_callers_own_session_header_is_kept(router: Recorder) -> None:
    with otel_session.trajectory(), httpx.Client() as client:
        client.get(f"{router.url}/a", headers={"x-dynamo-session-id": "mine"})
    assert router.requests[0].values(SESSION_HEADER) == ["mine"]


def test_httpxs_request_goes_as_a_stand_in_and_another_class_as_a_whole_copy(router: Recorder) -> None:
    class Mine(httpx.Request):
        pass

    transport = httpx.HTTPTransport()
    with otel_session.trajectory() as traj:
        plain = httpx.Request("POST", f"{router.url}/a", content=b"body", headers={"X-Mine": "1"})
        sent = hook._at_transport(transport, plain)
        assert type(sent) is httpx.Request and set(vars(sent)) == set(hook.TRANSPORT_READS)
        assert sent.headers[SESSION_HEADER] == traj.session_id and sent.headers["X-Mine"] == "1"
        mine = Mine("POST", f"{router.url}/a", content=b"body")
        mine.tag = "t"  # type: ignore[attr-defined]
        copied = hook._at_transport(transport, mine)
        assert type(copied) is Mine and copied.tag == "t" and copied.content == b"body"
        assert copied.headers[SESSION_HEADER] == traj.session_id
        held = httpx.Request("GET", f"{router.url}/a", headers={"x-dynamo-session-id": "mine"})
        assert hook._at_transport(transport, held) is held  # the caller's own: nothing to edit
    assert SESSION_HEADER not in plain.headers and SESSION_HEADER not in mine.headers
    with otel_session.trajectory():
        composed = httpx.Request("GET", f"{router.url}/a", headers={"baggage": "k=v"})
        edited = hook._at_transport(transport, composed)
        assert edited.headers["baggage"] == "k=v" and edited.headers[SESSION_HEADER]


def test_a_retry_and_a_redirect_each_carry_the_session_once(router: Recorder) -> None:
    router.redirect_to = router.url
    with otel_session.trajectory() as traj:
        transport = httpx.HTTPTransport(retries=1)
        with httpx.Client(transport=transport, follow_redirects=True) as client:
            assert client.get(f"{router.url}/r/next").status_code == 200
    assert [(s.path, s.values(SESSION_HEADER)) for s in router.requests] == [
        ("/r/next", [traj.session_id]),
        ("/next", [traj.session_id]),
    ]


def test_an_async_hop_carries_the_session_and_an_error_answer_is_evidence(router: Recorder) -> None:
    import asyncio

    async def main() -> list[int]:
        statuses = []
        async with httpx.AsyncClient() as client:
            with otel_session.trajectory() as traj:
                for _ in range(4):
                    statuses.append((await client.post(f"{router.url}/v1/x", json={"a": 1})).status_code)
                statuses.append(
                    (await client.send(client.build_request("GET", f"{router.url}/y"))).status_code
                )
            sessions.append(traj.session_id)
        return statuses

    _evidence.forget()
    sessions: list[str | None] = []
    router.fail_next.extend([428, 429, 503])
    try:
        assert asyncio.run(main()) == [428, 429, 503, 200, 200]
        assert _evidence.routers[("dynamo", "127.0.0.1", router.port)].errors == 2
    finally:
        _evidence.forget()
    assert [seen.get(SESSION_HEADER) for seen in router.requests] == sessions * 5


def test_a_sync_error_answer_to_a_hop_of_ours_is_evidence_and_one_elsewhere_is_not(
    router: Recorder, server: Recorder
) -> None:
    _evidence.forget()
    router.fail_next.extend([428, 429, 500, 503])
    try:
        with otel_session.trajectory(), httpx.Client() as client:
            assert [client.get(f"{router.url}/x").status_code for _ in range(3)] == [428, 429, 500]
        with httpx.Client() as client:
            assert client.get(f"{router.url}/x").status_code == 503  # no session: no evidence
        assert _evidence.routers[("dynamo", "127.0.0.1", router.port)].errors == 2
    finally:
        _evidence.forget()


def test_a_response_without_a_status_costs_the_evidence_and_one_report(reports: list[str]) -> None:
    hook._answered(object(), httpx.Request("GET", "http://h/"))
    hook._answered(object(), httpx.Request("GET", "http://h/"))
    assert reports == ["otel-session: reading a response's status failed (AttributeError)"]


def test_a_streamed_body_is_sent_untouched_and_names_no_group(router: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[router.authority], siblings="prompt")
    body = json.dumps(support.chat("same")).encode()

    def chunks() -> Iterator[bytes]:
        yield body[:5]
        yield body[5:]

    with httpx.Client() as client:
        for whole in (True, True, False):
            with otel_session.trajectory():
                if whole:
                    client.post(f"{router.url}/v1/chat/completions", content=body)
                else:
                    client.post(f"{router.url}/v1/chat/completions", content=chunks())
    parents = [seen.get(PARENT_SESSION_HEADER) for seen in router.requests]
    assert parents[0] is not None and parents[1] is not None and parents[2] is None
    assert all(seen.get(SESSION_HEADER) for seen in router.requests)


def test_an_async_streamed_body_reaches_the_server_whole(router: Recorder) -> None:
    import asyncio

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"a":'
        yield b" 1}"

    async def main() -> Any:
        async with httpx.AsyncClient() as client:
            with otel_session.trajectory():
                reply = await client.post(f"{router.url}/v1/x", content=chunks())
                return reply.json()

    assert asyncio.run(main()) == {"ok": True}
    assert router.requests[0].get(SESSION_HEADER)


def test_a_request_outside_a_trajectory_to_the_router_is_told_once_and_counted(
    router: Recorder, reports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = Recording()
    monkeypatch.setattr(_hop, "untold", True)
    monkeypatch.setattr(_metrics, "recording", lambda: True)
    monkeypatch.setattr(_metrics, "requests", counted)
    with httpx.Client() as client:
        client.get(f"{router.url}/a")
        client.get(f"{router.url}/b")
    assert len(reports) == 1 and reports[0].startswith(
        f"otel-session: a request to dynamo router {router.authority} was sent outside"
    )
    assert [(a["server.port"], a["otel_session.session"]) for _, a in counted.added] == [
        (router.port, False),
        (router.port, False),
    ]
    monkeypatch.setattr(_metrics, "recording", lambda: False)
    monkeypatch.setattr(_hop, "untold", False)
    with httpx.Client() as client:
        client.get(f"{router.url}/c")
    assert len(counted.added) == 2 and len(reports) == 1


def test_a_fault_of_ours_sends_the_request_as_it_is_and_is_reported_once(
    router: Recorder, reports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> Any:
        raise RuntimeError("ours")

    monkeypatch.setattr(_hop, "current", broken)

    class Forward(httpx.BaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.HTTPTransport()

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return self.inner.handle_request(request)

    with httpx.Client() as client:
        assert client.get(f"{router.url}/a").status_code == 200
    with httpx.Client(transport=Forward()) as client:
        assert client.get(f"{router.url}/b").status_code == 200
    assert reports == ["otel-session: adding session headers to a request failed (RuntimeError)"]
    assert [seen.path for seen in router.requests] == ["/a", "/b"]


def test_a_stock_propagator_composed_with_ours_has_its_copy_taken_back_from_another_host(
    server: Recorder,
) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:1"])
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([W3CBaggagePropagator(), SessionPropagator()]))
    try:
        with otel_session.trajectory() as traj, httpx.Client() as client:
            client.get(f"{server.url}/a", headers={"baggage": f"session.id={traj.session_id}", "X-Mine": "1"})
    finally:
        propagate.set_global_textmap(before)
    [seen] = server.requests
    assert seen.get("X-Mine") == "1" and seen.get("baggage") is None


def test_a_callers_own_baggage_is_left_where_ours_is_the_only_propagator(server: Recorder) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:1"])
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(SessionPropagator())
    try:
        with otel_session.trajectory() as traj, httpx.Client() as client:
            client.get(f"{server.url}/a", headers={"baggage": f"session.id={traj.session_id}"})
    finally:
        propagate.set_global_textmap(before)
    assert server.requests[0].get("baggage") == f"session.id={traj.session_id}"


# --- end to end: transports of other classes --------------------------------------------------------


class Forward(httpx.BaseTransport):
    """A transport wrapping httpx's own, as a retrying or logging transport does."""

    def __init__(self, to: str | None = None) -> None:
        self.inner = httpx.HTTPTransport()
        self.to = to
        self.seen: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if self.to is not None:  # re-targeted on the way
            request.url = request.url.copy_with(host=self.to)
        return self.inner.handle_request(request)


class AsyncForward(httpx.AsyncBaseTransport):
    def __init__(self, to: str | None = None) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.to = to
        self.seen: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if self.to is not None:
            request.url = request.url.copy_with(host=self.to)
        return await self.inner.handle_async_request(request)


def test_a_wrapping_transport_sends_our_copy_once_and_the_in_flight_entry_is_gone_after(
    router: Recorder,
) -> None:
    forward = Forward()
    with otel_session.trajectory() as traj, httpx.Client(transport=forward) as client:
        request = client.build_request("GET", f"{router.url}/a", headers={"X-Mine": "1"})
        assert client.send(request).status_code == 200
        assert forward.seen[0] is not request and request.headers.get(SESSION_HEADER) is None
        assert forward.seen[0].headers.get(SESSION_HEADER) == traj.session_id
    assert hook._in_flight == {}
    assert router.requests[0].values(SESSION_HEADER) == [traj.session_id]
    assert router.requests[0].get("X-Mine") == "1"


def test_a_wrapping_transport_re_targeting_elsewhere_has_the_hop_planned_again(server: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[f"127.0.0.2:{server.port}"], trusted_hosts=[server.authority])
    forward = Forward(to="127.0.0.1")
    with otel_session.trajectory() as traj, httpx.Client(transport=forward) as client:
        assert client.get(f"http://127.0.0.2:{server.port}/a", headers={"X-Mine": "1"}).status_code == 200
    [seen] = server.requests
    assert seen.get(SESSION_HEADER) is None and seen.get("baggage") == f"session.id={traj.session_id}"
    assert seen.get("X-Mine") == "1"
    assert hook._in_flight == {}


def test_an_async_wrapping_transport_carries_the_session_and_re_targeting_is_planned_again(
    server: Recorder,
) -> None:
    import asyncio

    otel_session.configure(dynamo_hosts=[server.authority], trusted_hosts=[f"127.0.0.2:{server.port}"])

    async def main() -> str | None:
        with otel_session.trajectory() as traj:
            async with httpx.AsyncClient(transport=AsyncForward()) as client:
                assert (await client.get(f"{server.url}/a")).status_code == 200
            async with httpx.AsyncClient(transport=AsyncForward(to="127.0.0.1")) as client:
                assert (await client.get(f"http://127.0.0.2:{server.port}/b")).status_code == 200
            assert hook._in_flight == {}
        return traj.session_id

    session = asyncio.run(main())
    first, second = server.requests
    assert first.get(SESSION_HEADER) == session and first.get("baggage") is None
    assert second.values(SESSION_HEADER) == [session]  # planned again for where it really went
    assert second.get("baggage") is None


@pytest.mark.filterwarnings("ignore:coroutine 'AsyncForward.handle_async_request' was never awaited")
def test_a_coroutine_of_a_wrapping_transport_never_awaited_leaves_nothing_in_flight(router: Recorder) -> None:
    with otel_session.trajectory():
        transport = AsyncForward()
        sending = transport.handle_async_request(httpx.Request("GET", f"{router.url}/a"))
        sending.close()
    assert hook._in_flight == {}


def test_a_transport_called_by_name_plans_the_request_too(router: Recorder) -> None:
    import asyncio

    with otel_session.trajectory() as traj:
        reply = httpx.HTTPTransport().handle_request(request=httpx.Request("GET", f"{router.url}/a"))
        reply.read()
        reply = Forward().handle_request(request=httpx.Request("GET", f"{router.url}/b"))
        reply.read()

        async def main() -> None:
            transport = httpx.AsyncHTTPTransport()
            reply = await transport.handle_async_request(request=httpx.Request("GET", f"{router.url}/c"))
            await reply.aread()
            await transport.aclose()
            reply = await AsyncForward().handle_async_request(request=httpx.Request("GET", f"{router.url}/d"))
            await reply.aread()

        asyncio.run(main())
    assert [(s.path, s.get(SESSION_HEADER)) for s in router.requests] == [
        (p, traj.session_id) for p in ("/a", "/b", "/c", "/d")
    ]


def test_a_transport_class_defined_after_instrumenting_is_patched_as_a_client_is_built(
    router: Recorder,
) -> None:
    class Late(httpx.BaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.HTTPTransport()

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            self.inner.handle_request  # noqa: B018
            return httpx.Response(200, json={"session": request.headers.get(SESSION_HEADER)})

    class Mounted(Late):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json={"mounted": request.headers.get(SESSION_HEADER)})

    class NotASubclass:
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json={"plain": request.headers.get(SESSION_HEADER)})

        def close(self) -> None:
            pass

        def __enter__(self) -> NotASubclass:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    with otel_session.trajectory() as traj:
        with httpx.Client(transport=Late(), mounts={"http://127.0.0.2": Mounted()}) as client:
            assert client.get(f"{router.url}/a").json() == {"session": traj.session_id}
            assert client.get(f"http://127.0.0.2:{router.port}/a").json() == {"mounted": None}
        otel_session.configure(dynamo_hosts=[router.authority, f"127.0.0.2:{router.port}"])
    odd = NotASubclass()
    with (
        otel_session.trajectory() as traj,
        httpx.Client(transport=odd, mounts={"http://127.0.0.2": Mounted()}) as client,
    ):  # type: ignore[arg-type]
        assert client.get(f"{router.url}/a").json() == {"plain": traj.session_id}
        assert client.get(f"http://127.0.0.2:{router.port}/a").json() == {"mounted": traj.session_id}


def test_a_transport_subclass_defined_before_instrumenting_is_patched_with_the_rest(
    server: Recorder,
) -> None:
    class Base(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json={"base": request.headers.get(SESSION_HEADER)})

    class Deeper(Base):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json={"deeper": request.headers.get(SESSION_HEADER)})

    class AsyncDeeper(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json={"async": request.headers.get(SESSION_HEADER)})

    class Inherits(Deeper):
        pass

    otel_session.unconfigure()
    otel_session.configure(dynamo_hosts=[server.authority])
    import asyncio

    with otel_session.trajectory() as traj:
        request = httpx.Request("GET", f"{server.url}/a")
        assert json.loads(Deeper().handle_request(request).read()) == {"deeper": traj.session_id}
        assert json.loads(Inherits().handle_request(request).read()) == {"deeper": traj.session_id}
        reply = asyncio.run(AsyncDeeper().handle_async_request(request))
        assert json.loads(reply.read()) == {"async": traj.session_id}
    assert "handle_request" not in Inherits.__dict__
    for kind in (httpx.HTTPTransport, httpx.BaseTransport, httpx.AsyncBaseTransport):
        assert hook._elsewhere(kind, httpx) == []
    assert hook._elsewhere(Inherits, httpx) == []
    assert [name for _, name, _ in hook._elsewhere(AsyncDeeper, httpx)] == ["handle_async_request"]


def test_a_client_whose_transports_cannot_be_looked_into_is_built_and_sends_as_it_is(
    router: Recorder, reports: list[str]
) -> None:
    class Refusing(dict[Any, Any]):
        """Mounts whose values cannot be listed while the client is being built (the first call)."""

        refused = False

        def values(self) -> Any:
            if not Refusing.refused:
                Refusing.refused = True
                raise RuntimeError("no mounts")
            return super().values()

    class Odd(httpx.Client):
        @property  # type: ignore[override]
        def _mounts(self) -> Any:
            return self.__dict__["_held_mounts"]

        @_mounts.setter
        def _mounts(self, value: Any) -> None:
            self.__dict__["_held_mounts"] = Refusing(value)

    with otel_session.trajectory() as traj, Odd() as client:
        assert client.send(client.build_request("GET", f"{router.url}/a")).status_code == 200
    assert router.requests[0].get(SESSION_HEADER) == traj.session_id
    assert reports == ["otel-session: instrumenting a httpx transport failed (RuntimeError)"]


def test_instrumenting_finds_the_fast_paths_and_builds_one_client_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hook, "_stand_ins_for", set())
    monkeypatch.setattr(hook, "_parsed_urls", set())
    instrumentor = hook.HTTPXSessionInstrumentor()
    monkeypatch.setattr(instrumentor, "_client_hook", None)  # as first instrumented
    first = instrumentor.targets(httpx)
    assert hook._stand_ins_for == {httpx.Request} and hook._parsed_urls == {httpx.URL}
    again = instrumentor.targets(httpx)
    hooks = {
        id(wrapper) for targets in (first, again) for owner, name, wrapper in targets if name == "__init__"
    }
    assert len(hooks) == 1 and instrumentor._client_hook is not None
    assert {(owner, name) for owner, name, _ in first[:4]} == {
        (httpx.HTTPTransport, "handle_request"),
        (httpx.AsyncHTTPTransport, "handle_async_request"),
        (httpx.Client, "__init__"),
        (httpx.AsyncClient, "__init__"),
    }


# --- a transport that answers itself, and one over a Unix socket ------------------------------------


class Echo(httpx.BaseTransport):
    """A transport of another class that answers in-process with the headers it was handed."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=[[k.decode(), v.decode()] for k, v in request.headers.raw])


class AsyncEcho(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=[[k.decode(), v.decode()] for k, v in request.headers.raw])


class Retarget(httpx.BaseTransport):
    """A transport wrapping another: sends to ``to`` (a host), adding a header of its own."""

    def __init__(self, inner: httpx.BaseTransport, to: str | None = None, port: int | None = None) -> None:
        self.inner, self.to, self.port = inner, to, port

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.to is not None:
            request.url = request.url.copy_with(host=self.to, port=self.port)
        request.headers["X-Forward"] = "1"
        return self.inner.handle_request(request)


def _echoed(response: httpx.Response) -> list[tuple[str, str]]:
    return [(name.lower(), value) for name, value in response.json()]


def test_a_transport_answering_itself_gets_our_copy_and_the_callers_request_is_left_alone(
    server: Recorder,
) -> None:
    otel_session.configure(dynamo_hosts=[server.authority], trusted_hosts=["127.0.0.3"])
    with otel_session.trajectory() as traj, httpx.Client(transport=Echo()) as client:
        request = client.build_request("GET", f"{server.url}/a", headers={"X-Mine": "1"})
        assert ("x-dynamo-session-id", traj.session_id) in _echoed(client.send(request))
        assert request.headers.get(SESSION_HEADER) is None
        mine = _echoed(client.get(f"{server.url}/a", headers={"X-Dynamo-Session-ID": "mine"}))
        assert [v for k, v in mine if k == "x-dynamo-session-id"] == ["mine"]
        trusted = _echoed(client.get("http://127.0.0.3/a", headers={"baggage": "k=v"}))
        assert [v for k, v in trusted if k == "baggage"] == [f"k=v,session.id={traj.session_id}"]
        assert hook._in_flight == {}


def test_a_wrapping_transport_re_targeting_to_a_transport_answering_itself_has_the_hop_planned_again(
    server: Recorder,
) -> None:
    otel_session.configure(dynamo_hosts=[server.authority], trusted_hosts=["127.0.0.3"])
    with otel_session.trajectory() as traj:
        with httpx.Client(transport=Retarget(Echo(), to="127.0.0.3")) as client:
            moved = _echoed(client.get(f"{server.url}/a"))
        with httpx.Client(transport=Retarget(Echo())) as client:
            stayed = _echoed(client.get(f"{server.url}/a"))
        with httpx.Client(transport=Retarget(Echo(), to="127.0.0.1", port=server.port)) as client:
            mine = _echoed(
                client.get("http://127.0.0.3/a", headers={"X-Dynamo-Session-ID": "mine", "Baggage": "k=v"})
            )
    names = {name for name, _ in moved}
    assert ("baggage", f"session.id={traj.session_id}") in moved and "x-dynamo-session-id" not in names
    assert ("x-forward", "1") in moved and ("x-forward", "1") in mine  # the wrapping transport's own
    assert ("x-dynamo-session-id", traj.session_id) in stayed and ("x-forward", "1") in stayed
    assert [v for k, v in mine if k == "x-dynamo-session-id"] == ["mine"]
    assert [v for k, v in mine if k == "baggage"] == ["k=v"]  # the caller's own, without ours


def test_a_wrapping_transport_keeps_what_it_added_on_the_way_to_httpxs_transport(router: Recorder) -> None:
    with otel_session.trajectory() as traj, httpx.Client(transport=Retarget(httpx.HTTPTransport())) as client:
        assert client.get(f"{router.url}/a").status_code == 200
    [seen] = router.requests
    assert seen.get("X-Forward") == "1" and seen.values(SESSION_HEADER) == [traj.session_id]


def test_a_stock_propagator_injecting_on_the_way_is_taken_back_at_the_router(router: Recorder) -> None:
    class Injecting(httpx.BaseTransport):
        """As an upstream instrumentation between two transports would: inject into the request."""

        def __init__(self) -> None:
            self.inner = httpx.HTTPTransport()

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            propagate.inject(request.headers)
            return self.inner.handle_request(request)

    before = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([W3CBaggagePropagator(), SessionPropagator()]))
    try:
        with otel_session.trajectory() as traj, httpx.Client(transport=Injecting()) as client:
            assert client.get(f"{router.url}/a", headers={"X-Mine": "1"}).status_code == 200
    finally:
        propagate.set_global_textmap(before)
    [seen] = router.requests
    assert seen.values(SESSION_HEADER) == [traj.session_id] and seen.get("baggage") is None
    assert seen.get("X-Mine") == "1"


def test_a_transport_answering_itself_decides_the_attempts_group_from_its_body(server: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[server.authority], siblings="prompt")
    with otel_session.trajectory() as traj, httpx.Client(transport=Echo()) as client:
        seen = dict(_echoed(client.post(f"{server.url}/v1/chat/completions", json=support.chat("p"))))
    assert seen["x-dynamo-session-id"] == traj.session_id
    assert seen["x-dynamo-parent-session-id"] == traj.parent_session_id is not None


def test_a_transport_called_without_a_request_refuses_as_without_us(
    router: Recorder, reports: list[str]
) -> None:
    import asyncio

    with otel_session.trajectory():
        with pytest.raises(TypeError):
            Echo().handle_request()  # type: ignore[call-arg]
        with pytest.raises(TypeError):
            asyncio.run(AsyncEcho().handle_async_request())  # type: ignore[call-arg]
        with pytest.raises(TypeError):
            httpx.HTTPTransport().handle_request()  # type: ignore[call-arg]
    assert reports == []


def test_a_fault_of_ours_in_a_transport_answering_itself_is_reported_and_the_request_answered(
    router: Recorder, reports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> Any:
        raise RuntimeError("ours")

    monkeypatch.setattr(_hop, "current", broken)
    with httpx.Client(transport=Echo()) as client:
        assert client.get(f"{router.url}/a", headers={"X-Mine": "1"}).status_code == 200
    assert reports == ["otel-session: adding session headers to a request failed (RuntimeError)"]


class _UnixRecorder(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    seen: list[dict[str, str]]


class _Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        self.server.seen.append({k.lower(): v for k, v in self.headers.items()})  # type: ignore[attr-defined]
        self.send_response(503 if self.path == "/fail" else 200)
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


def test_a_request_over_a_unix_socket_carries_nothing_whatever_host_its_url_names(
    router: Recorder, unix_server: _UnixRecorder
) -> None:
    import asyncio

    unix_server.seen.clear()
    path = str(unix_server.server_address)
    _evidence.forget()
    try:
        with otel_session.trajectory():
            with httpx.Client(transport=httpx.HTTPTransport(uds=path)) as client:
                assert client.get(f"{router.url}/a").status_code == 200
                assert client.get(f"{router.url}/fail").status_code == 503
            with httpx.Client(transport=Retarget(httpx.HTTPTransport(uds=path))) as client:
                assert client.get(f"{router.url}/b").status_code == 200
            by_name = httpx.HTTPTransport(uds=path)
            assert by_name.handle_request(request=httpx.Request("GET", f"{router.url}/d")).status_code == 200
            by_name.close()

            async def main() -> int:
                async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path)) as client:
                    return (await client.get(f"{router.url}/c")).status_code

            assert asyncio.run(main()) == 200
        assert _evidence.routers == {}
    finally:
        _evidence.forget()
    assert len(unix_server.seen) == 5
    assert unix_server.seen[2].get("x-forward") == "1"  # what the transport above added stays
    assert not {name for seen in unix_server.seen for name in seen} & OURS


# --- an attempt's group read from its first request, and a first step gathered, on every path ------


def _group_sizes(router: Recorder) -> dict[str, list[int]]:
    """How many attempts named each parent, by prompt (sorted; a request with no parent counts alone)."""
    counted: dict[str, dict[str | None, int]] = {}
    for seen in router.requests:
        if seen.path != "/health":
            assert seen.get(SESSION_HEADER) is not None, seen.path
            parents = counted.setdefault(seen.path.split("/")[1], {})
            parent = seen.get(PARENT_SESSION_HEADER) or seen.get(SESSION_HEADER)
            parents[parent] = parents.get(parent, 0) + 1
    return {prompt: sorted(parents.values()) for prompt, parents in counted.items()}


def _parents_by_prompt(router: Recorder) -> dict[str, set[str | None]]:
    """The parents the attempts' requests named, by the prompt in their path (/p/..., /q/...)."""
    named: dict[str, set[str | None]] = {}
    for seen in router.requests:
        if seen.path != "/health":
            assert seen.get(SESSION_HEADER) is not None, seen.path
            named.setdefault(seen.path.split("/")[1], set()).add(seen.get(PARENT_SESSION_HEADER))
    return named


@pytest.mark.parametrize("wrapped", [False, True], ids=["httpx's own transport", "a wrapping transport"])
def test_siblings_open_at_once_are_grouped_by_their_prompt_through_any_transport(
    router: Recorder, wrapped: bool
) -> None:
    """A thread's attempts, named by nothing but their first request's prompt: the two of prompt p
    share one parent, q's has another (``siblings="prompt"``)."""
    otel_session.configure(dynamo_hosts=[router.authority], siblings="prompt")
    together = threading.Barrier(3)

    def attempt(prompt: str) -> None:
        with otel_session.trajectory(), httpx.Client(transport=Forward() if wrapped else None) as client:
            together.wait(5)
            client.post(f"{router.url}/{prompt}/v1/chat/completions", json=support.chat(prompt))
            together.wait(5)  # all open until all have sent

    threads = [threading.Thread(target=attempt, args=(prompt,)) for prompt in ("p", "p", "q")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    named = _parents_by_prompt(router)
    assert len(named["p"]) == 1 and len(named["q"]) == 1 and None not in named["p"] | named["q"]
    assert named["p"] != named["q"]


def _step_in_threads(router: Recorder, prompts: tuple[str, ...]) -> None:
    together = threading.Barrier(len(prompts))

    def attempt(prompt: str) -> None:
        with otel_session.trajectory(), httpx.Client(transport=Forward()) as client:
            together.wait(5)
            client.post(f"{router.url}/{prompt}/v1/chat/completions", json=support.chat(prompt))
            together.wait(5)

    threads = [threading.Thread(target=attempt, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)


def _step_in_tasks(router: Recorder, prompts: tuple[str, ...]) -> None:
    import asyncio

    async def attempt(prompt: str) -> None:
        url = f"{router.url}/{prompt}/v1/chat/completions"
        with otel_session.trajectory():
            async with httpx.AsyncClient(transport=AsyncForward()) as client:
                await client.post(url, json=support.chat(prompt))

    async def step() -> None:
        await asyncio.gather(*(attempt(prompt) for prompt in prompts))

    asyncio.run(step())


@pytest.mark.parametrize("step", [_step_in_threads, _step_in_tasks], ids=["threads", "asyncio tasks"])
def test_a_first_step_through_a_wrapping_transport_gathers_and_is_sized_by_itself(
    router: Recorder, step: Any
) -> None:
    """2 prompts x 6 on 4 workers through wrapping transports: the first step gathers and is sized by
    itself, groups of 3 (not the unsized default's pairs, nor no group at all)."""
    from otel_session import _siblings

    _siblings.forget_shape()
    otel_session.configure(dynamo_hosts=[router.authority], siblings="auto")
    router.instances = 4
    try:
        step(router, ("p",) * 6 + ("q",) * 6)
        assert _group_sizes(router) == {"p": [3, 3], "q": [3, 3]}
    finally:
        router.instances = 0
        _siblings.forget_shape()


class ForwardOutsideAnyContext(httpx.BaseTransport):
    """A wrapping transport that re-targets the request and sends it in an empty context, where no
    trajectory is current (a pool whose workers do not carry the caller's context)."""

    def __init__(self, to: str) -> None:
        self.inner = httpx.HTTPTransport()
        self.to = to

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        import contextvars

        request.url = request.url.copy_with(host=self.to)
        return contextvars.Context().run(self.inner.handle_request, request)


def test_our_copy_re_targeted_outside_any_trajectory_goes_with_the_callers_headers(
    server: Recorder,
) -> None:
    """Planned for the router, sent elsewhere where nothing is current: the caller's own headers, not
    the router's session (it must not leak to the host it really reached)."""
    otel_session.configure(dynamo_hosts=[f"127.0.0.2:{server.port}"])
    with otel_session.trajectory(), httpx.Client(transport=ForwardOutsideAnyContext("127.0.0.1")) as client:
        assert client.get(f"http://127.0.0.2:{server.port}/a", headers={"X-Mine": "1"}).status_code == 200
    [seen] = server.requests
    assert seen.get(SESSION_HEADER) is None and seen.get("X-Mine") == "1"
    assert hook._in_flight == {}


def test_a_first_step_answered_by_an_async_transport_of_another_class_gathers_there(
    router: Recorder,
) -> None:
    """The openai SDK's aiohttp backend is such a transport: httpx's own never sees the request, so
    the gathering happens in the hook of the transport's class. 2 prompts x 6 on 4 workers: sized by
    the step, groups of 3, every request with its session."""
    import asyncio

    from otel_session import _siblings

    _siblings.forget_shape()
    otel_session.configure(dynamo_hosts=[router.authority], siblings="auto")
    router.instances = 4
    echoed: dict[str, list[dict[str, str]]] = {}

    async def attempt(prompt: str) -> None:
        with otel_session.trajectory():
            async with httpx.AsyncClient(transport=AsyncEcho()) as client:
                answer = await client.post(
                    f"{router.url}/{prompt}/v1/chat/completions", json=support.chat(prompt)
                )
                echoed.setdefault(prompt, []).append(dict(_echoed(answer)))

    async def step() -> None:
        await asyncio.gather(*(attempt(prompt) for prompt in ("p",) * 6 + ("q",) * 6))

    try:
        asyncio.run(step())
        for prompt in ("p", "q"):
            assert all("x-dynamo-session-id" in headers for headers in echoed[prompt]), echoed
            parents = [headers.get("x-dynamo-parent-session-id") for headers in echoed[prompt]]
            assert None not in parents and sorted(parents.count(p) for p in set(parents)) == [3, 3]
    finally:
        router.instances = 0
        _siblings.forget_shape()


@pytest.mark.parametrize("wrapped", [False, True], ids=["httpx's own transport", "a wrapping transport"])
def test_a_blocking_client_on_a_loops_thread_reads_the_group_from_the_body(
    router: Recorder, wrapped: bool
) -> None:
    """A sync client called from async code never waits (it would hold the loop): its first step is
    not gathered, and the attempt's group is read from the body as it goes (the default's pairs)."""
    import asyncio
    import contextvars

    from otel_session import _siblings

    _siblings.forget_shape()
    otel_session.configure(dynamo_hosts=[router.authority], siblings="auto")
    attempts = [(contextvars.copy_context(), otel_session.trajectory(), prompt) for prompt in ("p", "p", "q")]

    async def on_the_loop() -> None:
        with httpx.Client(transport=Forward() if wrapped else None) as client:
            for context, trajectory, _ in attempts:  # all open at once
                context.run(trajectory.__enter__)
            for context, _, prompt in attempts:
                url = f"{router.url}/{prompt}/v1/chat/completions"
                context.run(client.post, url, json=support.chat(prompt))
            for context, trajectory, _ in attempts:
                context.run(trajectory.__exit__, None, None, None)

    try:
        asyncio.run(on_the_loop())
        named = _parents_by_prompt(router)
        assert len(named["p"]) == 1 and None not in named["p"] and named["q"] != named["p"]
    finally:
        _siblings.forget_shape()
