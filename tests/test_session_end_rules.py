"""The rules of ending a session (``otel_session._session_end``), in the fast tier: which routers are
owed a notice, what each notice is on the wire, and how the slots, deadlines and warnings bound it.

The real routers' side (the vLLM router releasing its binding, Dynamo's terminal request) is in
``tests/test_session_end.py``; here a loopback Starlette server records what arrives.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trustme
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import otel_session
from otel_session import _bounded_http, _session_end
from otel_session._session_end import (
    BUDGET_SECONDS,
    FINAL_HEADER,
    NOTICE_DEADLINE_S,
    Notice,
    dynamo_final_headers,
    final_request_body,
    finish,
    in_flight,
    new_visits,
    notices,
)
from tests.loopback import AsgiServer
from tests.recorder import PATIENCE

SESSION = "6d3a1f0e-8a57-4b0e-9c55-0c7d1b2d3e4f"
PARENT = "0f3c2b1a-1111-4222-8333-444455556666"


@dataclass
class Recorded:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Router:
    """A loopback router that lists ``models`` and records every request; ``delay`` per answer."""

    models: list[object] | None = field(default_factory=lambda: ["m"])
    delay: float = 0.0
    seen: list[Recorded] = field(default_factory=list)
    status: int = 200
    padding: int = 0  # bytes of filler in every answer: an answer over a read's limit

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        self.seen.append(
            Recorded(request.method, request.url.path, request.url.query, dict(request.headers), body)
        )
        if self.delay:
            time.sleep(self.delay)  # the server's own thread: a router that is slow to answer
        filler = "x" * self.padding
        if request.url.path == "/v1/models":
            if self.models is None:
                return JSONResponse({"object": "list"})  # no "data" at all
            return JSONResponse({"data": [{"id": m} for m in self.models] + ["not a model"], "pad": filler})
        return JSONResponse({"status": "ok", "pad": filler}, status_code=self.status)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST"])])

    def posts(self) -> list[Recorded]:
        return [s for s in self.seen if s.method == "POST"]


@pytest.fixture
def served() -> Iterator[tuple[Router, AsgiServer]]:
    router = Router()
    with AsgiServer(router.app()) as server:
        yield router, server


def _visit(profile: str, server: AsgiServer) -> _session_end.Visit:
    return (profile, "http", "127.0.0.1", server.port)


def _wait_for(predicate: object, timeout: float = PATIENCE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _all_ended() -> None:
    """Until every notice has ended: each holds its slot until its router answered, so what it sent
    has arrived by then, and a notice that sent nothing fails the test at once, not after PATIENCE."""
    _wait_for(lambda: in_flight() == 0)


def test_visits_are_kept_only_while_sessions_are_ended() -> None:
    assert new_visits() is None  # not configured
    otel_session.configure(routers={"vllm-router": ["127.0.0.1:1"]})
    assert new_visits() is None  # configured, end_sessions off
    otel_session.configure(routers={"vllm-router": ["127.0.0.1:1"]}, end_sessions=True)
    assert new_visits() == set()


def test_notices_are_owed_once_per_session_and_router_and_only_to_routers_that_end_sessions() -> None:
    vllm = ("vllm-router", "http", "10.0.0.1", 8000)
    dynamo = ("dynamo", "https", "::1", None)
    plain = ("litellm", "http", "10.0.0.2", 30000)  # a router that ends no session, before vllm's
    bogus = ("no-such-profile", "http", "10.0.0.3", 1)
    session = "a-" + str(time.monotonic_ns())
    owed = notices(session, PARENT, [vllm, dynamo, plain, bogus, vllm])
    assert [(n.ends_by, n.base, n.visit) for n in owed] == [
        ("dynamo-final", "https://[::1]", dynamo),
        ("vllm-finish", "http://10.0.0.1:8000", vllm),
    ]
    assert all(n.session == session and n.parent == PARENT for n in owed)
    assert notices(session, None, [vllm, dynamo]) == []  # told already: never twice
    later = ("vllm-router", "http", "10.0.0.9", 8000)
    assert [n.visit for n in notices(session, None, [dynamo, later])] == [later]  # after one told
    assert len(notices(session + "-other", None, [vllm])) == 1  # another session is owed its own
    assert notices(session, None, [(None, "http", "h", 1)]) == []  # type: ignore[list-item]


def test_the_told_pairs_are_remembered_up_to_a_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_session_end, "_ENDED_CAP", 2)
    monkeypatch.setattr(_session_end, "_ended", type(_session_end._ended)())
    visit = ("vllm-router", "http", "h", 1)
    for session in ("s1", "s2", "s3"):
        assert len(notices(session, None, [visit])) == 1
    assert len(_session_end._ended) == 2
    assert len(notices("s1", None, [visit])) == 1  # the oldest was forgotten: owed again
    assert notices("s3", None, [visit]) == []


def test_a_base_url_brackets_an_ipv6_host_once_and_keeps_a_missing_port_out() -> None:
    owed = notices("b-" + str(time.monotonic_ns()), None, [("vllm-router", "http", "[::1]", 80)])
    assert owed[0].base == "http://[::1]:80"
    owed = notices("c-" + str(time.monotonic_ns()), None, [("vllm-router", "https", "example.org", None)])
    assert owed[0].base == "https://example.org"


def test_dynamos_terminal_request_is_exactly_its_headers_and_the_smallest_body() -> None:
    assert dynamo_final_headers(SESSION, None) == {
        "Content-Type": "application/json",
        "X-Dynamo-Session-ID": SESSION,
        FINAL_HEADER: "true",
    }
    assert dynamo_final_headers(SESSION, PARENT)["X-Dynamo-Parent-Session-ID"] == PARENT
    assert FINAL_HEADER == "X-Dynamo-Session-Final"
    body = json.loads(final_request_body("m"))
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "."}],
        "max_tokens": 1,
        "stream": False,
    }


def test_the_vllm_router_gets_one_finish_with_the_session_in_its_query(
    served: tuple[Router, AsgiServer],
) -> None:
    router, server = served
    finish(SESSION + "-v", None, {_visit("vllm-router", server)})
    _all_ended()
    (sent,) = router.posts()
    assert (sent.path, sent.query, sent.body) == ("/finish_session", f"session_id={SESSION}-v", b"")
    assert "x-dynamo-session-id" not in sent.headers and "baggage" not in sent.headers


def test_dynamo_gets_one_final_request_per_listed_model_up_to_the_cap(
    served: tuple[Router, AsgiServer],
) -> None:
    router, server = served
    router.models = ["a", "", 7, "b", "c", "d", "e", "f"]  # "" and 7 are not model ids
    finish(SESSION, PARENT, {_visit("dynamo", server)})
    _all_ended()
    posts = router.posts()
    assert [json.loads(p.body)["model"] for p in posts] == ["a", "b", "c", "d"]
    for post in posts:
        assert post.path == "/v1/chat/completions"
        assert post.headers["x-dynamo-session-id"] == SESSION
        assert post.headers["x-dynamo-parent-session-id"] == PARENT
        assert post.headers["x-dynamo-session-final"] == "true"
    assert [s.path for s in router.seen if s.method == "GET"] == ["/v1/models"]


def test_a_router_reached_over_https_is_told_over_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routers the application reached over https are told over TLS, the certificate checked (a test
    CA trusted as the system's through ``SSL_CERT_FILE``): Dynamo's model list and final request,
    the vLLM router's finish."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    monkeypatch.setattr(_bounded_http, "_tls", None)  # made afresh, reading SSL_CERT_FILE
    issued = ca.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    issued.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    router = Router()
    with AsgiServer(router.app(), tls=(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))) as server:
        finish(SESSION, PARENT, {("dynamo", "https", "127.0.0.1", server.port)})
        finish(SESSION + "-v", None, {("vllm-router", "https", "127.0.0.1", server.port)})
        _all_ended()
    assert sorted(p.path for p in router.posts()) == ["/finish_session", "/v1/chat/completions"]
    assert [s.path for s in router.seen if s.method == "GET"] == ["/v1/models"]


def test_an_exit_waits_for_its_notices_but_at_most_the_budget(served: tuple[Router, AsgiServer]) -> None:
    router, server = served
    router.delay = BUDGET_SECONDS * 0.4
    started = time.monotonic()
    finish(SESSION + "-w", None, {_visit("vllm-router", server)})
    waited = time.monotonic() - started
    assert (
        router.posts() and router.delay * 0.9 <= waited < BUDGET_SECONDS * 0.9
    )  # it waited for the answer ...
    router.delay = BUDGET_SECONDS + 0.5
    started = time.monotonic()
    finish(SESSION + "-x", None, {_visit("vllm-router", server)})
    waited = time.monotonic() - started
    assert BUDGET_SECONDS * 0.9 <= waited < BUDGET_SECONDS + 0.3  # ... and no longer than the budget
    _wait_for(lambda: in_flight() == 0, timeout=NOTICE_DEADLINE_S + 2)


def test_nothing_to_tell_returns_at_once_and_never_raises() -> None:
    started = time.monotonic()
    finish(SESSION, None, None)
    finish(SESSION, None, set())
    finish(SESSION, None, {("attempt", "http", "h", 1)})  # not a profile
    finish(SESSION, None, 42)  # type: ignore[arg-type]  # not visits at all: reported, not raised
    assert time.monotonic() - started < 0.1


def test_notices_beyond_the_slots_are_dropped_and_the_exit_does_not_wait_for_them(
    served: tuple[Router, AsgiServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    router, server = served
    monkeypatch.setattr(_session_end, "_MAX_IN_FLIGHT", 1)
    router.delay = 0.3
    first = threading.Thread(target=finish, args=(SESSION + "-s1", None, {_visit("vllm-router", server)}))
    first.start()
    _wait_for(lambda: in_flight() == 1)
    started = time.monotonic()
    two = {_visit("vllm-router", server), _visit("dynamo", server)}
    finish(SESSION + "-s2", None, two)  # no slot for either: both dropped, no wait
    assert time.monotonic() - started < 0.1
    first.join()
    _wait_for(lambda: in_flight() == 0)
    assert [p.query for p in router.posts()] == [f"session_id={SESSION}-s1"]


def test_a_failing_router_is_one_warning_per_router_and_configuration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = Router(models=[])
    with AsgiServer(router.app()) as server:
        port = server.port
    gone = ("vllm-router", "http", "127.0.0.1", port)  # nothing listens there any more
    otel_session.configure(routers={"vllm-router": [f"127.0.0.1:{port}"]}, end_sessions=True)
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        for index in range(3):
            finish(f"{SESSION}-f{index}", None, {gone})
        _wait_for(lambda: in_flight() == 0)
        lines = [r.getMessage() for r in caplog.records if "could not tell" in r.getMessage()]
        assert len(lines) == 1 and f"vllm-router at http://127.0.0.1:{port}" in lines[0], lines
        assert "idle out" in lines[0]
        otel_session.configure(routers={"vllm-router": [f"127.0.0.1:{port}"]}, end_sessions=True)
        finish(f"{SESSION}-f9", None, {gone})
        _wait_for(lambda: in_flight() == 0)
    lines = [r.getMessage() for r in caplog.records if "could not tell" in r.getMessage()]
    assert len(lines) == 2  # a new configuration may warn once again


def test_a_notice_is_a_plain_value() -> None:
    notice = Notice("finish", "http://h", ("vllm-router", "http", "h", None), "s", None)
    assert notice == Notice("finish", "http://h", ("vllm-router", "http", "h", None), "s", None)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "otel_session" and r.levelno >= logging.WARNING
    ]


def test_a_notice_goes_out_on_a_named_daemon_thread_and_slots_count_each(
    served: tuple[Router, AsgiServer],
) -> None:
    router, server = served
    router.delay = 0.3
    ends = [
        threading.Thread(target=finish, args=(f"{SESSION}-t{index}", None, {_visit("vllm-router", server)}))
        for index in range(2)
    ]
    for end in ends:
        end.start()
    _wait_for(lambda: in_flight() == 2)
    named = [t for t in threading.enumerate() if t.name == "otel-session-end"]
    assert len(named) == 2 and all(t.daemon for t in named)
    for end in ends:
        end.join()
    _wait_for(lambda: in_flight() == 0)


def test_a_finished_session_posts_an_empty_body_and_a_healthy_router_is_no_warning(
    served: tuple[Router, AsgiServer], caplog: pytest.LogCaptureFixture
) -> None:
    router, server = served
    router.padding = 40_000  # an answer under the 64 KiB a notice reads
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        finish(SESSION + "-e", None, {_visit("vllm-router", server)})
        finish(SESSION + "-e", PARENT, {_visit("dynamo", server)})
        _wait_for(lambda: in_flight() == 0)
    assert next(p.headers.get("content-length") for p in router.posts()) == "0"
    assert len(router.posts()) == 2 and _warnings(caplog) == []


def test_a_model_list_over_a_mib_is_a_failed_notice(caplog: pytest.LogCaptureFixture) -> None:
    """A notice reads at most 1 MiB of a model list (a Dynamo frontend's is a few hundred bytes)."""
    profile = "dynamo"
    router = Router(padding=1_500_000)
    otel_session.configure(routers={profile: ["127.0.0.1:1"]}, end_sessions=True)
    with AsgiServer(router.app()) as server, caplog.at_level(logging.WARNING, logger="otel_session"):
        finish(f"{SESSION}-{profile}-big", None, {_visit(profile, server)})
        _wait_for(lambda: in_flight() == 0)
    said = _warnings(caplog)
    assert len(said) == 1 and said[0].startswith(f"otel-session: could not tell {profile} at "), said
    assert [s.path for s in router.seen] == ["/v1/models"]


def test_a_model_list_without_data_tells_no_model_and_warns_nothing(
    served: tuple[Router, AsgiServer], caplog: pytest.LogCaptureFixture
) -> None:
    router, server = served
    router.models = None
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        finish(SESSION + "-nodata", None, {_visit("dynamo", server)})
        _wait_for(lambda: in_flight() == 0)
    assert router.posts() == [] and _warnings(caplog) == []


def test_the_warning_names_the_router_the_error_and_what_follows(caplog: pytest.LogCaptureFixture) -> None:
    router = Router(models=[])
    with AsgiServer(router.app()) as server:
        port = server.port
    otel_session.configure(routers={"vllm-router": [f"127.0.0.1:{port}"]}, end_sessions=True)
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        finish(SESSION + "-refused", None, {("vllm-router", "http", "127.0.0.1", port)})
        _wait_for(lambda: in_flight() == 0)
    (said,) = _warnings(caplog)
    assert said.startswith(
        f"otel-session: could not tell vllm-router at http://127.0.0.1:{port} that a session ended "
        "(ConnectionRefusedError: "
    ), said
    assert said.endswith(
        "); its binding will idle out instead. Further failures for this router are not logged."
    ), said
    assert "s after it started" not in said


def test_a_notice_past_its_deadline_says_how_long_it_had(
    served: tuple[Router, AsgiServer], caplog: pytest.LogCaptureFixture
) -> None:
    router, server = served
    router.delay = NOTICE_DEADLINE_S + 0.3
    otel_session.configure(routers={"vllm-router": [f"127.0.0.1:{server.port}"]}, end_sessions=True)
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        finish(SESSION + "-late", None, {_visit("vllm-router", server)})
        _wait_for(lambda: in_flight() == 0, timeout=NOTICE_DEADLINE_S + 2)
    (said,) = _warnings(caplog)
    assert "(TimeoutError: " in said and f"({NOTICE_DEADLINE_S} s after it started)" in said, said


def test_a_dropped_notice_says_so_at_debug(
    served: tuple[Router, AsgiServer], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    router, server = served
    monkeypatch.setattr(_session_end, "_MAX_IN_FLIGHT", 0)
    with caplog.at_level(logging.DEBUG, logger="otel_session"):
        finish(SESSION + "-drop", None, {_visit("vllm-router", server)})
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert said == [
        f"otel-session: too many session ends in flight; http://127.0.0.1:{server.port} left to its TTL"
    ]
    assert router.seen == [] and in_flight() == 0


def test_a_fault_while_ending_is_reported_once_and_raises_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from otel_session import _faults

    monkeypatch.setattr(_faults, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        finish(SESSION, None, set())  # nothing to tell: nothing to report either
        assert _warnings(caplog) == []
        finish(SESSION, None, 42)  # type: ignore[arg-type]
    (said,) = _warnings(caplog)
    assert said.startswith("otel-session: ending sessions failed (TypeError)"), said
    assert caplog.records[-1].exc_info is not None


def test_an_async_exit_awaits_its_notices_within_the_budget(served: tuple[Router, AsgiServer]) -> None:
    import asyncio

    router, server = served
    router.delay = BUDGET_SECONDS * 0.4

    async def end() -> float:
        started = time.monotonic()
        await _session_end.finish_async(SESSION + "-async", None, {_visit("vllm-router", server)})
        return time.monotonic() - started

    waited = asyncio.run(end())
    assert router.posts() and router.delay * 0.9 <= waited < BUDGET_SECONDS * 0.9
    router.delay = BUDGET_SECONDS + 0.5
    started = time.monotonic()
    asyncio.run(_session_end.finish_async(SESSION + "-async2", None, {_visit("vllm-router", server)}))
    assert BUDGET_SECONDS * 0.9 <= time.monotonic() - started < BUDGET_SECONDS + 0.3
    _wait_for(lambda: in_flight() == 0, timeout=NOTICE_DEADLINE_S + 2)


def test_visits_to_one_router_with_and_without_a_port_are_each_owed_a_notice() -> None:
    """The visits are ordered by their text, so a port that is ``None`` beside a number (the same
    router spelled two ways) never has to be compared with it."""
    session = "ports-" + str(time.monotonic_ns())
    bare, numbered = ("vllm-router", "http", "h", None), ("vllm-router", "http", "h", 8000)
    owed = notices(session, None, [numbered, bare])
    assert [n.base for n in owed] == ["http://h:8000", "http://h"]


def test_an_async_exit_tells_the_parent_and_reports_a_fault_as_the_sync_one_does(
    served: tuple[Router, AsgiServer], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    from otel_session import _faults

    router, server = served
    asyncio.run(_session_end.finish_async(SESSION + "-ap", PARENT, {_visit("dynamo", server)}))
    _all_ended()
    assert router.posts()[0].headers["x-dynamo-parent-session-id"] == PARENT
    monkeypatch.setattr(_faults, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        asyncio.run(_session_end.finish_async(SESSION, None, 42))  # type: ignore[arg-type]
    (said,) = _warnings(caplog)
    assert said.startswith("otel-session: ending sessions failed (TypeError)"), said
    assert caplog.records[-1].exc_info is not None


def test_the_vllm_routers_finish_says_its_body_is_empty(served: tuple[Router, AsgiServer]) -> None:
    """``Content-Length: 0``: a POST that says nothing of its length may be refused (411)."""
    router, server = served
    finish(SESSION + "-len", None, {_visit("vllm-router", server)})
    _all_ended()
    assert router.posts()[0].headers.get("content-length") == "0"
