"""The urllib3 hook's rules one by one (``otel_session.instrumentation.urllib3_client``): which header
classes take the fast path, what is read of and copied from the caller's headers, where a pool sends a
request (its own host, or a forwarded URL's), how a call's arguments are found and rebuilt, the
caller's headers put back in a call urllib3 makes itself, and which answers are evidence. Pure
functions on real urllib3 pools and requests' headers; the same hook end to end over loopback is
tests/test_requests_client.py."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import requests
import urllib3
from opentelemetry import propagate
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from requests.structures import CaseInsensitiveDict

import otel_session
from otel_session import PARENT_SESSION_HEADER, _evidence, _faults, _hop, _metrics
from otel_session._propagator import SessionPropagator
from otel_session.instrumentation import urllib3_client as hook
from tests import support
from tests.proxy import RecordingProxy
from tests.recorder import PATIENCE, Recorder
from tests.test_metrics_rules import Recording

NAMES = ("baggage", "traceparent", "x-dynamo-session-id")


@pytest.fixture(autouse=True)
def _urllib3_known() -> None:
    """The hook's view of urllib3 (its URL parser, its tunnelling rule), as instrumenting sets it."""
    hook.Urllib3SessionInstrumentor().targets(urllib3.connectionpool)


class _Shared(OrderedDict[str, Any]):
    def copy(self) -> _Shared:
        return self  # a "copy" that is the same store


def _case_sensitive_get(self: Any, key: str, default: Any = None) -> Any:
    return self._store[key][1] if key in self._store else default


@pytest.mark.parametrize(
    ("kind", "folded"),
    [
        (CaseInsensitiveDict, True),
        (dict, False),  # no ``_store``
        (
            type(
                "Extra",
                (CaseInsensitiveDict,),
                {"__init__": lambda s, d: (CaseInsensitiveDict.__init__(s, d), setattr(s, "x", 1))[0]},
            ),
            False,
        ),
        (
            type(
                "Lower",
                (CaseInsensitiveDict,),
                {"__setitem__": lambda s, k, v: s._store.__setitem__(k.lower(), (k.lower(), v))},
            ),
            False,
        ),
        (
            type(
                "Shared",
                (CaseInsensitiveDict,),
                {"__init__": lambda s, d: (setattr(s, "_store", _Shared()), s.update(d))[0]},
            ),
            False,
        ),
        (type("Sensitive", (CaseInsensitiveDict,), {"get": _case_sensitive_get}), False),
        (
            type(
                "SharedExact",
                (CaseInsensitiveDict,),
                {
                    "__init__": lambda s, d: (setattr(s, "_store", _Shared()), s.update(d))[0],
                    "__contains__": lambda s, k: k in s._store,
                },
            ),
            False,
        ),
        (
            type(
                "Sorted",
                (CaseInsensitiveDict,),
                {"__iter__": lambda s: iter(sorted(v[0] for v in s._store.values()))},
            ),
            False,
        ),
        (type("Refuses", (CaseInsensitiveDict,), {"__init__": lambda s, d: 1 / 0}), False),
    ],
)
def test_only_a_class_keeping_items_as_requests_does_is_copied_through_its_store(
    kind: type, folded: bool
) -> None:
    assert hook._is_folded(kind) is folded


def test_requests_headers_take_the_fast_path_and_a_look_alike_by_another_name_does_not() -> None:
    assert CaseInsensitiveDict in hook._FOLDED
    assert type("Lookalike", (CaseInsensitiveDict,), {}) not in hook._FOLDED


def test_what_the_callers_headers_hold_of_the_names_read() -> None:
    plan: Any = SimpleNamespace(names=NAMES)  # ``_held`` reads nothing of a plan but its names
    assert hook._held(None, plan) is hook._NOTHING
    assert hook._held(CaseInsensitiveDict({"Accept": "x"}), plan) is hook._NOTHING
    assert hook._held(CaseInsensitiveDict({"X-Dynamo-Session-ID": "mine"}), plan) == {
        "x-dynamo-session-id": "mine"
    }
    assert hook._held({"Baggage": "a=1", "Accept": "x"}, plan) == {"baggage": "a=1"}
    assert hook._held({"Accept": "x"}, plan) == {}


def test_a_copy_with_only_additions_of_requests_headers_is_made_through_its_store() -> None:
    headers = CaseInsensitiveDict({"Accept": "x", "X-Dynamo-Session-ID": "old"})
    sent = hook._copy(headers, [("X-Dynamo-Session-ID", "s1"), ("Baggage", "session.id=s1")], True)
    assert type(sent) is CaseInsensitiveDict and sent is not headers
    assert list(sent.items()) == [
        ("Accept", "x"),
        ("X-Dynamo-Session-ID", "s1"),
        ("Baggage", "session.id=s1"),
    ]
    assert dict(headers) == {"Accept": "x", "X-Dynamo-Session-ID": "old"}  # the caller's, untouched


@pytest.mark.parametrize("added_only", [True, False])
def test_other_headers_are_copied_by_their_own_copy_or_as_a_dict(added_only: bool) -> None:
    edits = [("X-Dynamo-Session-ID", "s1"), ("Baggage", None)]
    caller = {"Accept": "x", "Baggage": "theirs"}
    sent = hook._copy(caller, edits, added_only)
    assert sent == {"Accept": "x", "X-Dynamo-Session-ID": "s1"} and caller == {
        "Accept": "x",
        "Baggage": "theirs",
    }
    folded = CaseInsensitiveDict(caller)
    if not added_only:  # a take-back: the public way, on the class's own copy
        taken = hook._copy(folded, edits, added_only)
        assert type(taken) is CaseInsensitiveDict and dict(taken) == {
            "Accept": "x",
            "X-Dynamo-Session-ID": "s1",
        }
        assert dict(folded) == caller

    class Headers(Mapping[str, str]):  # a mapping without copy()
        def __getitem__(self, key: str) -> str:
            return caller[key]

        def __iter__(self) -> Iterator[str]:
            return iter(caller)

        def __len__(self) -> int:
            return len(caller)

    assert hook._copy(Headers(), edits, added_only) == {"Accept": "x", "X-Dynamo-Session-ID": "s1"}


@pytest.mark.parametrize(
    ("host", "dialled"),
    [
        ("h.example.", "h.example"),
        ("h.example..", "h.example"),
        ("h", "h"),
        ("hX.", "hX"),
        ("", ""),
        (None, None),
    ],
)
def test_a_pool_dials_its_host_without_trailing_dots(host: str | None, dialled: str | None) -> None:
    pool = SimpleNamespace(scheme="https", host=host, port=8443)  # what ``_own`` reads of a pool
    assert hook._own(pool) == ("https", dialled, 8443)


FINAL = "http://127.0.0.1:8000/"


@pytest.mark.parametrize(
    ("url", "destination"),
    [
        ("/v1/models", ("http", "127.0.0.1", 3128)),  # a path: the pool's own host (the proxy)
        (b"http://other:81/", ("http", "127.0.0.1", 3128)),  # not text: the pool's own host
        ("HTTP://Other.Example:81/x", ("http", "other.example", 81)),  # forwarded: where the URL says
        ("http://other/x", ("http", "other", 80)),
        ("http://[::1]:81/", ("http", "::1", 81)),
        ("gopher://other/x", ("http", "127.0.0.1", 3128)),  # another scheme: tunnelled
        ("//other/x", ("http", "127.0.0.1", 3128)),  # no scheme: tunnelled, so the pool's host
    ],
)
def test_a_forwarding_pool_sends_to_the_urls_host(url: Any, destination: tuple[Any, ...]) -> None:
    pool = urllib3.ProxyManager("http://127.0.0.1:3128").connection_from_url(FINAL)
    assert hook._destination(pool, url) == destination


def test_a_forwarded_url_without_a_host_has_none() -> None:
    pool = urllib3.ProxyManager("http://127.0.0.1:3128").connection_from_url(FINAL)
    assert hook._destination(pool, "http:///x") == ("http", None, 80)


def test_a_pool_without_a_proxy_or_tunnelling_sends_to_its_own_host() -> None:
    plain = urllib3.HTTPConnectionPool("127.0.0.1", 8000)
    assert hook._destination(plain, "http://other:81/") == ("http", "127.0.0.1", 8000)
    tunnel = urllib3.ProxyManager("http://127.0.0.1:3128").connection_from_url("https://127.0.0.1:8443/")
    assert hook._destination(tunnel, "https://other:9/") == ("https", "127.0.0.1", 8443)
    forwarding = urllib3.ProxyManager("https://127.0.0.1:3128", use_forwarding_for_https=True)
    pool = forwarding.connection_from_url("https://127.0.0.1:8443/")
    assert hook._destination(pool, "https://other/") == ("https", "other", 443)
    assert hook._destination(pool, "/v1/models") == ("https", "127.0.0.1", 8443)  # a path: its own


def test_a_calls_url_and_headers_are_found_and_replaced_by_position_or_by_name() -> None:
    mine = {"A": "1"}
    assert hook._called(("GET", "/u", None, mine, "more"), {}) == ("/u", mine)
    assert hook._called(("GET", "/u", None), {"headers": mine}) == ("/u", mine)
    assert hook._called(("GET",), {"url": "/u"}) == ("/u", None)
    assert hook._called(("GET", "/u", None, mine), {}) == ("/u", mine)
    assert hook._with_headers(("GET", "/u", None, mine, "more"), {"k": 1}, "ours") == (
        ("GET", "/u", None, "ours", "more"),
        {"k": 1},
    )
    assert hook._with_headers(("GET", "/u", None, mine), {}, "ours") == (("GET", "/u", None, "ours"), {})
    assert hook._with_headers(("GET", "/u", None), {"k": 1}, "ours") == (
        ("GET", "/u", None),
        {"k": 1, "headers": "ours"},
    )


def test_a_call_urllib3_makes_inside_ours_on_the_same_pool_starts_again_from_the_callers_headers() -> None:
    pool = SimpleNamespace(headers={"User-Agent": "pool"})
    other = SimpleNamespace(headers={})
    ours = {"X-Dynamo-Session-ID": "s1", "Accept": "x"}
    names = ("x-dynamo-session-id", "baggage")
    try:
        hook._sending.hop = None
        assert hook._callers_again(pool, ours) is ours  # no call of ours under way
        hook._sending.hop = (other, {"X-Dynamo-Session-ID": "c"}, names)
        assert hook._callers_again(pool, ours) is ours  # under way on another pool
        hook._sending.hop = (pool, {"X-Dynamo-Session-ID": "c", "Baggage": "b=1", "Other": "o"}, names)
        again = hook._callers_again(pool, ours)
        assert again == {"Accept": "x", "x-dynamo-session-id": "c", "baggage": "b=1"} and again is not ours
        assert hook._callers_again(pool, None) == {
            "User-Agent": "pool",
            "x-dynamo-session-id": "c",
            "baggage": "b=1",
        }
        hook._sending.hop = (pool, None, names)  # the caller gave no headers: ours taken back
        assert hook._callers_again(pool, ours) == {"Accept": "x"}
    finally:
        hook._sending.hop = None


def test_a_routers_error_answers_are_evidence_and_a_response_without_a_status_is_reported_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_faults, "_reported", set())
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    caplog.set_level(logging.WARNING, "otel_session")
    _evidence.forget()
    destination = ("http", "127.0.0.1", 8000)
    try:
        with otel_session.trajectory():
            for status in (200, 404, 428):
                hook._answered(SimpleNamespace(status=status), destination)
            assert _evidence.routers == {}
            for status in (429, 503):
                hook._answered(SimpleNamespace(status=status), destination)
            hook._answered(object(), destination)
            hook._answered(object(), destination)
        assert _evidence.routers[("dynamo", "127.0.0.1", 8000)].errors == 2
    finally:
        _evidence.forget()
    said = [r.getMessage() for r in caplog.records if r.name == "otel_session"]
    assert len(said) == 1 and said[0].startswith(
        "otel-session: reading a response's status failed (AttributeError)"
    )


def test_requests_headers_sent_through_the_hook_reach_urllib3_as_requests_headers(dynamo: Any) -> None:
    """requests hands urllib3 its own header class: the copy sent is of that class, with ours added."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory() as traj, requests.Session() as session:
        assert session.get(f"{dynamo.url}/v1/models", headers={"X-Mine": "1"}, timeout=10).ok
    [arrived] = dynamo.requests
    assert arrived.get("x-dynamo-session-id") == traj.session_id and arrived.get("X-Mine") == "1"


@pytest.fixture
def proxy() -> Iterator[RecordingProxy]:
    with RecordingProxy() as running:
        yield running


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "otel_session"]


def test_a_forwarded_request_outside_a_trajectory_is_told_for_its_urls_router(
    dynamo: Recorder, proxy: RecordingProxy, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    monkeypatch.setattr(_hop, "untold", True)
    monkeypatch.setattr(_metrics, "recording", lambda: False)
    caplog.set_level(logging.WARNING, "otel_session")
    pool = urllib3.ProxyManager(proxy.url).connection_from_url(dynamo.url)
    assert pool.urlopen("GET", f"{dynamo.url}/x", assert_same_host=False).status == 200
    [said] = _said(caplog)
    assert said.startswith(f"otel-session: a request to dynamo router {dynamo.authority} was sent outside")
    assert not dynamo.requests[0].names() & {"x-dynamo-session-id", "baggage"}


def test_a_forwarded_request_outside_a_trajectory_is_counted_for_its_urls_router(
    dynamo: Recorder, proxy: RecordingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    counted = Recording()
    monkeypatch.setattr(_hop, "untold", False)
    monkeypatch.setattr(_metrics, "recording", lambda: True)
    monkeypatch.setattr(_metrics, "requests", counted)
    pool = urllib3.ProxyManager(proxy.url).connection_from_url(dynamo.url)
    assert (
        pool.urlopen("GET", f"{dynamo.url}/x", headers={"X-Mine": "1"}, assert_same_host=False).status == 200
    )
    [(_, attributes)] = counted.added
    assert (attributes["server.port"], attributes["otel_session.session"]) == (dynamo.port, False)


def test_a_url_urllib3_refuses_is_refused_as_without_us_and_our_failure_reported_once(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    monkeypatch.setattr(_faults, "_reported", set())
    monkeypatch.setattr(_hop, "untold", True)
    caplog.set_level(logging.WARNING, "otel_session")
    pool = urllib3.ProxyManager("http://127.0.0.1:3128").connection_from_url(dynamo.url)
    with pytest.raises(urllib3.exceptions.LocationParseError):
        pool.urlopen("GET", "http://[::1/", retries=False)
    with otel_session.trajectory(), pytest.raises(urllib3.exceptions.LocationParseError):
        pool.urlopen("GET", "http://[::1/", retries=False)
    assert [line.partition(";")[0] for line in _said(caplog)] == [
        "otel-session: reading a request's destination failed (LocationParseError)",
        "otel-session: adding session headers to a request failed (LocationParseError)",
    ]


def test_a_hop_puts_back_the_one_under_way_and_a_new_thread_starts_with_none(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    pool = urllib3.HTTPConnectionPool("127.0.0.1", dynamo.port, headers={"X-Pool": "1"})
    under_way = (object(), None, ())
    hook._sending.hop = under_way
    try:
        with otel_session.trajectory() as traj:
            assert pool.urlopen("GET", "/x").status == 200  # no headers of the call: the pool's
        assert hook._sending.hop is under_way
    finally:
        hook._sending.hop = None
    sessions: list[str | None] = []

    def in_a_thread() -> None:
        with otel_session.trajectory() as fresh:
            sessions.append(fresh.session_id)
            pool.urlopen("GET", "/y")

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(30)
    first, second = dynamo.requests
    assert first.get("x-dynamo-session-id") == traj.session_id and first.get("X-Pool") == "1"
    assert second.get("x-dynamo-session-id") == sessions[0] and second.get("X-Pool") == "1"


def test_a_callers_own_baggage_to_another_host_is_left_as_set_where_ours_is_the_only_propagator(
    dynamo: Recorder, other: Recorder
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(SessionPropagator())
    try:
        with otel_session.trajectory() as traj:
            mine = {"baggage": f"session.id={traj.session_id}"}
            assert (
                urllib3.HTTPConnectionPool("127.0.0.2", other.port).urlopen("GET", "/", headers=mine).status
                == 200
            )
    finally:
        propagate.set_global_textmap(before)
    assert other.requests[0].get("baggage") == f"session.id={traj.session_id}"


def test_our_values_a_stock_propagator_copied_into_requests_headers_are_taken_back_from_another_host(
    dynamo: Recorder, other: Recorder
) -> None:
    """Composed with stock propagators, ours is not the only one that may have written the session
    into the caller's headers: what is recognisably ours is taken back before another host sees it."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([W3CBaggagePropagator(), SessionPropagator()]))
    try:
        with otel_session.trajectory() as traj:
            copied = {"baggage": f"session.id={traj.session_id}", "X-Mine": "1"}
            assert requests.get(f"{other.url}/", headers=copied, timeout=10).ok
    finally:
        propagate.set_global_textmap(before)
    [arrived] = other.requests
    assert arrived.get("X-Mine") == "1" and arrived.get("baggage") is None, arrived.headers


def _chat_body(prompt: str) -> bytes:
    return json.dumps(support.chat(prompt)).encode()


def _threads_step(
    dynamo: Recorder, prompts: list[str], send: Any, gym: Recorder | None = None, on_a_loop: bool = False
) -> dict[int, tuple[str | None, str | None]]:
    """A first step in threads, as a rollout pool runs one: a plain ``trajectory()`` per entry of
    ``prompts``, each sending its first request through ``send(pool, index, prompt)`` (after one to
    ``gym`` where given; from a coroutine, blocking its thread's event loop, where ``on_a_loop``) and
    staying open until every attempt has sent it; (session, parent) by attempt."""
    barrier = threading.Barrier(len(prompts))
    pool = urllib3.HTTPConnectionPool("127.0.0.1", dynamo.port, maxsize=len(prompts))
    failed: list[BaseException] = []

    def attempt(index: int, prompt: str) -> None:
        with otel_session.trajectory():
            if gym is not None:  # not a router: its body must not decide the attempt's group
                body = _chat_body(f"tool call {index}")
                urllib3.HTTPConnectionPool("127.0.0.1", gym.port).urlopen("POST", "/g", body=body)
            assert send(pool, index, prompt).status == 200
            barrier.wait(PATIENCE)

    async def attempt_on_a_loop(index: int, prompt: str) -> None:
        attempt(index, prompt)

    def run(index: int, prompt: str) -> None:
        try:
            asyncio.run(attempt_on_a_loop(index, prompt)) if on_a_loop else attempt(index, prompt)
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate(prompts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE * 3)
    assert not failed, failed
    return {
        int(s.path.split("/")[1][1:]): (s.get("x-dynamo-session-id"), s.get(PARENT_SESSION_HEADER))
        for s in dynamo.requests
    }


@pytest.mark.parametrize("given", ["by keyword", "by position"])
def test_siblings_found_by_the_prompt_of_a_pools_body_share_a_parent(
    dynamo: Recorder, given: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default (``auto``), no ``group=``: each attempt's group is read from the body of its first
    request to the router, given to ``urlopen`` by keyword (as requests gives it) or by position, and
    the step, gathered in its threads, is sized to the router's 2 workers: each prompt's siblings
    under one parent of their own."""
    monkeypatch.delenv("OTEL_SESSION_SIBLINGS", raising=False)
    dynamo.instances = 2
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    caplog.set_level(logging.WARNING, "otel_session")

    def send(pool: urllib3.HTTPConnectionPool, index: int, prompt: str) -> Any:
        if given == "by keyword":
            return pool.urlopen("POST", f"/a{index}/v1/chat/completions", body=_chat_body(prompt))
        return pool.urlopen("POST", f"/a{index}/v1/chat/completions", _chat_body(prompt))

    carried = _threads_step(dynamo, ["two plus two?"] * 3 + ["name a color"] * 3, send)
    sessions = {session for session, _ in carried.values()}
    assert len(carried) == 6 and len(sessions) == 6 and None not in sessions
    first, second = {carried[i][1] for i in range(3)}, {carried[i][1] for i in range(3, 6)}
    assert len(first) == len(second) == 1 and None not in first | second and first != second, carried
    (said,) = _said(caplog)  # the one line of a step sized, and no fault
    assert said.startswith("otel-session: siblings sized to the fleet: 3 per parent session (2 workers;")


def test_a_first_step_sent_from_event_loops_threads_is_grouped_by_prompt_without_gathering(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocking requests from coroutines (each thread runs an event loop, which a wait would hold):
    the first step does not gather there, yet each attempt's first request decides its group from
    its prompt, paired as the default pairs an unsized step."""
    monkeypatch.delenv("OTEL_SESSION_SIBLINGS", raising=False)
    dynamo.instances = 2
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    caplog.set_level(logging.WARNING, "otel_session")

    def send(pool: urllib3.HTTPConnectionPool, index: int, prompt: str) -> Any:
        return pool.urlopen("POST", f"/a{index}/v1/chat/completions", body=_chat_body(prompt))

    carried = _threads_step(dynamo, ["two plus two?"] * 2 + ["name a color"] * 2, send, on_a_loop=True)
    first, second = {carried[0][1], carried[1][1]}, {carried[2][1], carried[3][1]}
    assert len(first) == len(second) == 1 and None not in first | second and first != second, carried
    assert None not in {session for session, _ in carried.values()} and not _said(caplog)


def test_a_request_to_a_host_that_is_no_router_decides_no_group(dynamo: Recorder, gym: Recorder) -> None:
    """Each attempt first posts to a Gym server (a body of its own), then its prompt to the router:
    the router's request decides the group, so the two siblings still share a parent."""
    otel_session.configure(
        dynamo_hosts=[dynamo.authority], trusted_hosts=[gym.authority], siblings="groups:2"
    )

    def send(pool: urllib3.HTTPConnectionPool, index: int, prompt: str) -> Any:
        return pool.urlopen("POST", f"/a{index}/v1/chat/completions", body=_chat_body(prompt))

    carried = _threads_step(dynamo, ["two plus two?"] * 2, send, gym)
    parents = {parent for _, parent in carried.values()}
    assert len(gym.requests) == 2 and len(parents) == 1 and None not in parents, carried


def test_a_body_streamed_in_chunks_names_no_group_and_the_session_still_goes(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A body urllib3 streams (an iterator of chunks) cannot be read without consuming it: no group,
    no line, and the session on the request all the same."""
    otel_session.configure(dynamo_hosts=[dynamo.authority], siblings="prompt")
    caplog.set_level(logging.WARNING, "otel_session")
    pool = urllib3.HTTPConnectionPool("127.0.0.1", dynamo.port)
    with otel_session.trajectory() as traj:
        chunks = iter([b'{"model": "m", ', b'"messages": []}'])
        assert pool.urlopen("POST", "/v1/chat/completions", body=chunks, chunked=True).status == 200
    (seen,) = dynamo.requests
    assert seen.get("x-dynamo-session-id") == traj.session_id and seen.get(PARENT_SESSION_HEADER) is None
    assert not _said(caplog)
