"""A bug inside otel-session never fails the user's request, and is logged once, not per request.

Each test forces a failure at one place in the propagation code (a host-rules lookup, the header
restore after a hop, the propagator inside the upstream instrumentation, extraction in a server),
sends many real requests over loopback through every client, and checks that every one of them
succeeded, that the place was reported exactly once, and that requests carry the session again once
the fault is gone. The two tests at the end force a failure halfway: after a header was added, and
while taking it back.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.propagators.composite import CompositePropagator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import otel_session
from otel_session import SESSION_HEADER, _carriers, _faults, _hop, _propagator, servers
from otel_session._hosts import HostRules
from otel_session._propagator import SessionPropagator
from otel_session.instrumentation import aiohttp_client as aiohttp_hook
from otel_session.instrumentation import httpx as httpx_hook
from tests.clients import CLIENTS, send
from tests.gym_servers import AsgiServer
from tests.recorder import Recorder, wait_until

REQUESTS = 12


class Boom(RuntimeError):
    """The forced failure: distinguishable from anything the clients could raise themselves."""


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise Boom("forced failure inside otel-session")


@pytest.fixture(autouse=True)
def _fresh_fault_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees the fault log of a fresh process: nothing reported yet."""
    monkeypatch.setattr(_faults, "_reported", set())
    yield


def _reports(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "otel_session" and "failed" in r.getMessage()]


@pytest.mark.parametrize("kind", CLIENTS)
async def test_failing_host_rules_fail_no_request_and_are_logged_once(
    kind: str, dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    monkeypatch.setattr(HostRules, "route", _boom)
    caplog.set_level(logging.WARNING, logger="otel_session")
    with otel_session.trajectory() as traj:
        for _ in range(REQUESTS):
            await send(kind, dynamo.url)  # raises if any request failed
        assert len(dynamo.requests) == REQUESTS
        [report] = _reports(caplog)
        assert report.exc_info is not None and report.exc_info[0] is Boom
        assert all(seen.get(SESSION_HEADER) is None for seen in dynamo.requests)  # it went without us

        monkeypatch.undo()  # the fault is gone: the very next request carries the session again
        await send(kind, dynamo.url)
    assert dynamo.requests[-1].get(SESSION_HEADER) == traj.session_id
    assert len(_reports(caplog)) == 1


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_failing_start_of_a_trajectory_fails_nothing_and_its_requests_carry_the_session(
    kind: str, dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What a trajectory offers is remembered as it starts; if that fails, the trajectory still runs
    and its first request reads the offer from the context itself."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    offered = _hop.Offered

    def failing_when_told(*args: Any) -> Any:
        # the trajectory starting, not a request (by name: a mutation run renames entered's code)
        if "entered" in sys._getframe(1).f_code.co_name:
            raise Boom("forced failure inside otel-session")
        return offered(*args)

    monkeypatch.setattr(_hop, "Offered", failing_when_told)
    caplog.set_level(logging.WARNING, logger="otel_session")
    sessions = []
    for _ in range(3):
        with otel_session.trajectory() as traj:
            sessions.append(traj.session_id)
            for _ in range(REQUESTS // 3):
                await send(kind, dynamo.url)
    assert [seen.get(SESSION_HEADER) for seen in dynamo.requests] == [
        session for session in sessions for _ in range(REQUESTS // 3)
    ]
    [report] = _reports(caplog)
    assert "remembering what a trajectory offers" in report.getMessage()
    assert otel_session.current_session_id() is None


class _RaisingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        raise Boom("the application's own log filter raised")


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_report_whose_logging_raises_still_fails_nothing(
    kind: str, dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An application's log filter (or handler) on ``otel_session`` that raises: a failure of ours
    reported through it still fails no trajectory and no request, and leaves no context behind."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    monkeypatch.setattr(_hop, "_passed_on", _boom)  # at the trajectory's start and at its first request
    raising = _RaisingFilter()
    logging.getLogger("otel_session").addFilter(raising)
    try:
        with otel_session.trajectory():
            for _ in range(3):
                await send(kind, dynamo.url)
        assert otel_session.current_session_id() is None
        assert len(dynamo.requests) == 3
    finally:
        logging.getLogger("otel_session").removeFilter(raising)
    monkeypatch.undo()
    with otel_session.trajectory() as traj:
        await send(kind, dynamo.url)
    earlier = {seen.get(SESSION_HEADER) for seen in dynamo.requests[:-1]}
    assert traj.parent_session_id not in earlier  # nothing left of the broken attempt's context
    assert dynamo.requests[-1].get(SESSION_HEADER) == traj.session_id


@pytest.mark.parametrize("kind", ["aiohttp"])
async def test_a_failing_header_restore_fails_no_request_and_is_logged_once(
    kind: str, dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The restore runs after the response arrived: the user still gets it, with the session sent.

    (httpx sends a copy of the request and has nothing to restore; aiohttp puts a copy of the
    headers with ours on its ``ClientRequest`` for the send, and takes ours out of it afterwards.)
    """
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    monkeypatch.setattr(aiohttp_hook, "_restore", _boom)
    caplog.set_level(logging.WARNING, logger="otel_session")
    with otel_session.trajectory() as traj:
        for _ in range(REQUESTS):
            await send(kind, dynamo.url)
    assert [seen.get(SESSION_HEADER) for seen in dynamo.requests] == [traj.session_id] * REQUESTS
    [report] = _reports(caplog)
    assert "restoring request headers" in report.getMessage()


async def test_a_failing_propagator_under_the_upstream_instrumentation_fails_nothing(
    dynamo: Recorder, other: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The instrumentor injects through the global propagator (ours, composed as ``OTEL_PROPAGATORS``
    builds it) on every hop, above our hook at httpx's transport: its failure is reported once and
    stays contained, and delivery, planned below it, is unaffected."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    propagate.set_global_textmap(CompositePropagator([SessionPropagator()]))
    monkeypatch.setattr(_propagator, "get_current", _boom)
    caplog.set_level(logging.WARNING, logger="otel_session")
    client = httpx.AsyncClient()
    HTTPXClientInstrumentor.instrument_client(client)
    try:
        with otel_session.trajectory() as traj:
            for _ in range(REQUESTS):
                (await client.get(f"{dynamo.url}/v1/models")).raise_for_status()
                (await client.get(f"{other.url}/v1/models")).raise_for_status()
    finally:
        HTTPXClientInstrumentor.uninstrument_client(client)
        await client.aclose()
    [report] = _reports(caplog)
    assert "injecting session headers" in report.getMessage()
    # The lean hooks do not go through the propagator: delivery is unaffected.
    assert [seen.get(SESSION_HEADER) for seen in dynamo.requests] == [traj.session_id] * REQUESTS
    assert all(seen.get(SESSION_HEADER) is None for seen in other.requests)


def test_a_failing_extraction_returns_the_context_and_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=["dynamo.internal:8000"])
    monkeypatch.setattr(_propagator, "extract_session", _boom)
    caplog.set_level(logging.WARNING, logger="otel_session")
    start = Context()
    for index in range(REQUESTS):
        assert propagate.extract({"x-dynamo-session-id": f"s-{index}"}, context=start) is start
    [report] = _reports(caplog)
    assert "extracting an incoming session" in report.getMessage()


async def test_a_failing_extraction_in_a_server_fails_no_request(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SessionMiddleware on uvicorn: the app still runs, without the caller's session."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    monkeypatch.setattr(servers, "extract_session", _boom)
    caplog.set_level(logging.WARNING, logger="otel_session")

    async def forward(request: Request) -> JSONResponse:
        async with httpx.AsyncClient() as client:
            (await client.get(f"{dynamo.url}/v1/models")).raise_for_status()
        return JSONResponse({"session": otel_session.current_session_id()})

    app = servers.SessionMiddleware(Starlette(routes=[Route("/forward", forward)]))
    with AsgiServer(app) as middle:
        async with httpx.AsyncClient() as client:
            for index in range(REQUESTS):
                response = await client.get(f"{middle.url}/forward", headers={SESSION_HEADER: f"s-{index}"})
                assert response.status_code == 200 and response.json() == {"session": None}
    await wait_until(lambda: len(dynamo.requests) == REQUESTS)
    assert all(seen.get(SESSION_HEADER) is None for seen in dynamo.requests)
    [report] = _reports(caplog)
    assert "extracting an incoming session" in report.getMessage()


async def test_each_failing_place_is_logged_once_whatever_the_volume(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two broken places, hundreds of requests through them: two warnings in all."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    monkeypatch.setattr(HostRules, "route", _boom)
    monkeypatch.setattr(_propagator, "extract_session", _boom)
    caplog.set_level(logging.WARNING, logger="otel_session")
    async with httpx.AsyncClient() as client:
        with otel_session.trajectory():
            for index in range(200):
                propagate.extract({"x-dynamo-session-id": f"s-{index}"})
                (await client.get(f"{dynamo.url}/v1/models")).raise_for_status()
    assert len(dynamo.requests) == 200
    assert sorted(r.getMessage().split(" failed")[0] for r in _reports(caplog)) == [
        "otel-session: adding session headers to a request",
        "otel-session: extracting an incoming session",
    ]


# ---- what a partial failure still gets wrong ------------------------------------------------------


def _fail_after_the_first_edit(original: Any) -> Any:
    def apply(carrier: Any, edits: list[tuple[str, str | None]], *args: Any, **kwargs: Any) -> None:
        original(carrier, edits[:1], *args, **kwargs)
        raise Boom("forced failure after the first header was added")

    return apply


def _fail_once_ours_are_in_a_copy(original: Any) -> Any:
    """Every httpx hop builds headers of its own with ours (``_copy_headers``), then the request
    around them: that fails, once the headers hold every header of ours."""

    def headers_with(*args: Any, **kwargs: Any) -> Any:
        original(*args, **kwargs)
        raise Boom("forced failure after the headers were copied with ours")

    return headers_with


def _fail_midway(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if where == "apply":  # httpx's copy of headers holding one of ours already; aiohttp's send
        monkeypatch.setattr(_carriers, "apply", _fail_after_the_first_edit(_carriers.apply))
        monkeypatch.setattr(aiohttp_hook, "_edit", _fail_after_the_first_edit(aiohttp_hook._edit))
    else:
        monkeypatch.setattr(
            httpx_hook, "_copy_headers", _fail_once_ours_are_in_a_copy(httpx_hook._copy_headers)
        )


@pytest.mark.parametrize("where", ["apply", "copy"])
@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_failure_midway_sends_the_callers_request_as_it_was(
    kind: str, where: str, dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Dynamo that is also trusted: the session header is added, then writing baggage fails (or, on
    httpx's usual hop, both are in the headers' copy and copying the request fails)."""
    otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[dynamo.authority])
    _fail_midway(where, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="otel_session"), otel_session.trajectory():
        await send(kind, dynamo.url)
    [seen] = dynamo.requests
    # aiohttp edits its send's headers (_edit); httpx's usual hop appends to a copy without apply, then
    # copies the request
    reached = {"apply": kind.startswith("aiohttp"), "copy": not kind.startswith("aiohttp")}[where]
    assert bool(_reports(caplog)) == reached
    ours = [seen.get(SESSION_HEADER), seen.get("baggage")]
    assert ours == [None, None] if reached else None not in ours  # all of ours, or none


@pytest.mark.parametrize("where", ["apply", "copy"])
def test_a_failure_midway_leaves_the_callers_request_object_as_it_was(
    where: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=["dynamo.internal:8000"], trusted_hosts=["dynamo.internal:8000"])
    _fail_midway(where, monkeypatch)
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200))) as client:
        request = client.build_request("GET", "http://dynamo.internal:8000/v1/models")
        request.headers["Traceparent"] = f"00-{'1' * 32}-{'2' * 16}-01"  # a held name: not the fast path
        before = list(request.headers.multi_items())
        with caplog.at_level(logging.WARNING, logger="otel_session"), otel_session.trajectory():
            client.send(request).raise_for_status()
            client.send(request).raise_for_status()
    assert list(request.headers.multi_items()) == before
    assert _reports(caplog)


async def test_a_failing_request_copy_does_not_leak_the_session_to_a_redirect_target(
    dynamo: Recorder, other: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    dynamo.redirect_to = other.url
    for name in ("_copy_request", "_stand_in"):
        monkeypatch.setattr(httpx_hook, name, _boom)
    async with httpx.AsyncClient(follow_redirects=True) as client:
        with otel_session.trajectory():
            (await client.get(f"{dynamo.url}/r/v1/models")).raise_for_status()
    assert len(dynamo.requests) == 1 and len(other.requests) == 1
    assert other.requests[0].get(SESSION_HEADER) is None
