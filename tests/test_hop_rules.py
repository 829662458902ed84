"""What ``otel_session._hop`` decides for one hop, rule by rule, in-process and quick: the plan a
destination gets (its headers, names, wire bytes, the router it is remembered under), what a context
offers (session, parent, baggage, the span passed on), the first request that decides an attempt's
group under ``auto`` and ``fleet`` (with each line said and each choice counted), the once-per-process
lines, and the sessions unpinned after their router refused them. No request is sent: the client
hooks' own files send them over loopback; here the hop's answers are read where the hooks read them.
Fleet sizes are read from a port nothing listens on (refused at once) or from a recording server on
loopback that lists its workers in ``/health`` as a Dynamo frontend does."""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from opentelemetry import baggage, trace
from opentelemetry.context import Context, get_current
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

import otel_session
from otel_session import _faults, _fleet, _hop, _settings, _siblings
from otel_session._context import PARENT_KEY, ROUTER_VISITS_KEY, SESSION_KEY
from otel_session._hosts import NOWHERE
from otel_session._policy import Offer
from tests import support
from tests.loopback import bind_loopback
from tests.recorder import Recorder

ROUTER = ("http", "127.0.0.9", 8000)  # a Dynamo frontend (no server: a /health read is refused at once)
VLLM = ("http", "10.0.0.2", 8000)  # a vLLM router: a session header, no parent header
GYM = ("http", "gym.internal", None)  # a trusted host: baggage only
ELSEWHERE = ("http", "example.com", None)  # anyone else: nothing
SESSION_HEADER = "X-Dynamo-Session-ID"
PARENT_HEADER = "X-Dynamo-Parent-Session-ID"
PARENT = "parent-session-0001"
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331
T = TypeVar("T")
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _configure(**kwargs: Any) -> otel_session.Settings:
    return otel_session.configure(
        dynamo_hosts=["127.0.0.9:8000"],
        trusted_hosts=["gym.internal"],
        routers={"vllm-router": "10.0.0.2:8000"},
        **kwargs,
    )


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with nothing told, nothing unpinned, no boundary in force, no K said."""
    monkeypatch.setattr(_hop, "untold", True)
    monkeypatch.setattr(_hop, "unconfigured_untold", True)
    monkeypatch.setattr(_hop, "unpinned", {})
    monkeypatch.setattr(_hop, "boundaries_in_force", set())
    monkeypatch.setattr(_hop, "_said", [])
    monkeypatch.setattr(_faults, "_reported", set())
    _hop.forget()
    yield
    while _open:
        _open.pop().end()
    _reads_done()
    _hop.forget()


@pytest.fixture
def refused() -> Iterator[int]:
    """A loopback port bound but not listening: a router whose ``/health`` is refused at once."""
    sock = bind_loopback()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.fixture
def slow() -> Iterator[Recorder]:
    """A router whose ``/health`` takes half a second and lists no workers: its size is still being
    read as an attempt's first request decides, then cannot be known."""
    with Recorder(health_delay=0.5) as server:
        yield server


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "otel_session"]


def _reads_done() -> None:
    """Wait for every read of a router's fleet size started so far (each on a thread of its own)."""
    for thread in threading.enumerate():
        if thread.name == "otel-session-fleet":
            thread.join(10)


def _span(remote: bool) -> NonRecordingSpan:
    return NonRecordingSpan(SpanContext(TRACE_ID, SPAN_ID, is_remote=remote, trace_flags=TraceFlags(1)))


def _tracing_on() -> None:
    """The configuration in force, with ``tracing`` on: what ``_hop`` reads of it, without starting the
    OTLP export pipeline ``configure(tracing=True)`` would (seconds, and exports to nowhere)."""
    assert _settings.current is not None
    _settings.set_active(dataclasses.replace(_settings.current, tracing=True))


def _body(prompt: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": f"task {prompt}"}]}).encode()


def _current() -> _hop.Offered:
    found = _hop.current()
    assert found is not None
    return found


class Attempt:
    """One trajectory attempt open in a context of its own (as concurrent rollouts each have); every
    attempt a test leaves open is ended after it, so no group outlives its test."""

    def __init__(self, group: str | None = None) -> None:
        _open.append(self)
        self.ended = False
        self.context = contextvars.Context()
        self.trajectory = otel_session.trajectory(group=group)
        self.context.run(self.trajectory.__enter__)
        session = self.trajectory.session_id
        assert session is not None
        self.session: str = session

    def run(self, function: Callable[..., T], *args: Any) -> T:
        return self.context.run(function, *args)

    def offered(self) -> _hop.Offered:
        return self.run(_current)

    def decide(self, prompt: str | None, destination: _hop.Destination) -> _hop.Offered:
        body = _body(prompt) if prompt is not None else None
        return self.run(lambda: _current().decide(body, destination))

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.run(self.trajectory.__exit__, None, None, None)


_open: list[Attempt] = []


def _counted(before: dict[Any, int], name: str) -> dict[frozenset[tuple[str, Any]], int]:
    """What metric ``name`` counted since ``before``, by its exact attribute set."""
    grown: dict[frozenset[tuple[str, Any]], int] = {}
    for (metric, attributes), value in support.metric_points().items():
        delta = value - before.get((metric, attributes), 0)
        if metric == name and delta:
            grown[attributes] = delta
    return grown


# --- Plan: what one hop to one destination carries -------------------------------------------------


def test_a_routers_plan_sets_its_headers_and_names_what_it_reads() -> None:
    settings = _configure()
    with otel_session.trajectory(group="prompt-1") as attempt:
        session, parent = attempt.session_id, attempt.parent_session_id
        assert session is not None and parent is not None
        offered = _hop.current()
        assert offered is not None
        plan = offered.plan(*ROUTER)
    route = settings.rules.route(*ROUTER)
    assert route.profile is not None and plan.route is route
    assert plan.destination == ROUTER
    names = ("baggage", "traceparent", "x-dynamo-session-id", "x-dynamo-parent-session-id")
    assert plan.names == names
    assert plan.raw_names == frozenset(name.encode() for name in names)
    assert plan.edits == [(SESSION_HEADER, session), (PARENT_HEADER, parent)]
    assert plan.added == frozenset({"x-dynamo-session-id", "x-dynamo-parent-session-id"})
    assert plan.hop == _hop.Hop(route, plan.added, None) and plan.hop.route is route
    assert plan.watched is False
    assert plan.wire == (
        (SESSION_HEADER.encode(), b"x-dynamo-session-id", session.encode()),
        (PARENT_HEADER.encode(), b"x-dynamo-parent-session-id", parent.encode()),
    )


def test_a_trusted_host_gets_baggage_another_router_its_own_header_anyone_else_nothing() -> None:
    _configure()
    with otel_session.trajectory() as attempt:
        session = attempt.session_id
        offered = _hop.current()
        assert offered is not None and session is not None
        gym, vllm, elsewhere = offered.plan(*GYM), offered.plan(*VLLM), offered.plan(*ELSEWHERE)
    assert gym.edits == [("baggage", f"session.id={session}")] and gym.names == ("baggage", "traceparent")
    assert gym.wire == ((b"baggage", b"baggage", f"session.id={session}".encode()),)
    assert vllm.edits == [("X-Session-ID", session)] and vllm.added == frozenset({"x-session-id"})
    assert vllm.names == ("baggage", "traceparent", "x-session-id")
    assert elsewhere.edits == [] and elsewhere.wire == () and elsewhere.added == frozenset()
    assert not elsewhere.route


def test_no_host_goes_nowhere() -> None:
    _configure()
    with otel_session.trajectory():
        offered = _hop.current()
        assert offered is not None
        for host in (None, ""):
            plan = offered.plan("unix", host, None)
            assert plan.route is NOWHERE and plan.edits == [] and plan.destination == ("unix", host, None)


def test_an_edit_that_takes_a_header_away_or_is_not_ascii_has_no_wire_form() -> None:
    _configure()
    with otel_session.trajectory() as attempt:
        session = attempt.session_id
        offered = _hop.current()
        assert offered is not None
        # a stock propagator copied our baggage into a request to a host that may not have it
        taken = offered.plan(*ELSEWHERE).given({"baggage": f"session.id={session}"}, callers_only=False)
        assert taken.edits == [("baggage", None)] and taken.wire is None and taken.added == frozenset()
        # the caller's own baggage, not ASCII, kept as written with ours appended
        theirs = offered.plan(*GYM).given({"baggage": "user.name=Jos\u00e9"}, callers_only=True)
        assert theirs.edits == [("baggage", f"user.name=Jos\u00e9,session.id={session}")]
        assert theirs.wire is None and theirs.added == frozenset({"baggage"})


def test_plans_are_remembered_per_destination_and_forgotten_past_the_bound() -> None:
    _configure()
    with otel_session.trajectory():
        offered = _hop.current()
        assert offered is not None
        first = offered.plan("http", "host-0.example", None)
        assert offered.plan("http", "host-0.example", None) is first
        assert _hop.current() is offered and _current().plan("http", "host-0.example", None) is first
        for index in range(1, _hop.PLANS_KEPT):
            offered.plan("http", f"host-{index}.example", None)
        assert offered.plan("http", "host-0.example", None) is first  # 64 kept
        offered.plan("http", "one-more.example", None)  # the 65th: the remembered ones are dropped
        again = offered.plan("http", "host-0.example", None)
        assert again is not first and again.edits == first.edits


def test_a_plan_given_what_the_request_holds() -> None:
    _configure()
    with otel_session.trajectory() as attempt:
        session = attempt.session_id
        offered = _hop.current()
        assert offered is not None and session is not None
        router = offered.plan(*ROUTER)
        assert router.given({}, callers_only=True) is router  # holds none of its names
        assert router.given({}, callers_only=False) is router
        # the caller set the session header: theirs is kept
        kept = router.given({"x-dynamo-session-id": "callers-own"}, callers_only=True)
        assert kept.edits == [] and kept.destination == ROUTER and kept.route is router.route
        assert kept.watched is False and kept.wire == ()
        # the caller's baggage names our session: kept as theirs where everything held is the caller's
        ours = {"baggage": f"session.id={session}"}
        assert router.given(ours, callers_only=True).edits == [(SESSION_HEADER, session)]
        # ... and taken back where a stock propagator may have put it there
        assert router.given(ours, callers_only=False).edits == [(SESSION_HEADER, session), ("baggage", None)]
        nowhere = offered.plan(*ELSEWHERE)
        assert nowhere.given(ours, callers_only=True) is nowhere  # goes nowhere: nothing to do
        back = nowhere.given(ours, callers_only=False)
        assert back is not nowhere and back.edits == [("baggage", None)] and back.destination == ELSEWHERE


def test_a_plan_delivered_to_a_router_is_counted_and_a_trusted_hosts_is_not() -> None:
    support.metrics_reader()
    _configure()
    before = support.metric_points()
    with otel_session.trajectory():
        offered = _hop.current()
        assert offered is not None
        offered.plan(*ROUTER).delivered()
        offered.plan(*GYM).delivered()  # not a router: not counted
    counted = _counted(before, "otel_session.requests")
    assert counted == {
        frozenset(
            {
                ("otel_session.router.profile", "dynamo"),
                ("server.address", "127.0.0.9"),
                ("server.port", 8000),
                ("otel_session.session", True),
                ("otel_session.retry", False),
            }
        ): 1
    }


# --- where sessions are ended: the routers a trajectory's session reached ---------------------------


def test_a_hop_that_delivers_the_session_records_its_router() -> None:
    otel_session.configure(
        dynamo_hosts=["127.0.0.9:8000", "router.internal"], trusted_hosts=["gym.internal"], end_sessions=True
    )
    with otel_session.trajectory(group="prompt-1"):  # with a parent: the session header comes first
        visits = get_current().get(ROUTER_VISITS_KEY)
        assert visits == set()
        offered = _hop.current()
        assert offered is not None
        offered.plan(*GYM).delivered()  # baggage only: no router reached
        assert visits == set()
        offered.plan(*ROUTER).delivered()
        offered.plan("http", "router.internal", None).delivered()  # the default port filled in
        offered.plan("HTTPS", "Router.Internal", 443).delivered()
        assert visits == {
            ("dynamo", "http", "127.0.0.9", 8000),
            ("dynamo", "http", "router.internal", 80),
            ("dynamo", "https", "router.internal", 443),
        }
        visits.clear()  # nothing to tell at the end: no router listens there


def test_a_hop_without_the_session_records_no_router() -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.9:8000"], end_sessions=True)
    with otel_session.trajectory() as attempt:
        visits = get_current().get(ROUTER_VISITS_KEY)
        assert attempt.session_id is not None and _hop.unpin(attempt.session_id)
        offered = _hop.current()
        assert offered is not None
        plan = offered.plan(*ROUTER)
        assert plan.edits == []  # unpinned: the router's header no longer goes
        plan.delivered()
        assert visits == set()
    # sessions ended while the trajectory started, not any more as it sends
    otel_session.configure(dynamo_hosts=["127.0.0.9:8000"], end_sessions=True)
    with otel_session.trajectory():
        visits = get_current().get(ROUTER_VISITS_KEY)
        otel_session.configure(dynamo_hosts=["127.0.0.9:8000"], end_sessions=False)
        offered = _hop.current()
        assert offered is not None
        offered.plan(*ROUTER).delivered()
        assert visits == set()
    # a context without the trajectory's set (one built by hand from its session)
    otel_session.configure(dynamo_hosts=["127.0.0.9:8000"], end_sessions=True)
    with otel_session.trajectory() as attempt:
        session = attempt.session_id
        assert session is not None
        bare = baggage.set_baggage(SESSION_KEY, session, Context())
        offered = _hop.current(bare)
        assert offered is not None
        offered.plan(*ROUTER).delivered()  # nowhere to record it, and no error
        assert get_current().get(ROUTER_VISITS_KEY) == set()


# --- what a context offers ----------------------------------------------------------------------------


def test_nothing_is_offered_unconfigured_or_outside_any_trajectory() -> None:
    assert _hop.current() is None
    with otel_session.trajectory():
        assert _hop.current() is None  # not configured
    _configure()
    assert _hop.current() is None  # no session, baggage or span
    assert _hop.current(Context()) is None


def test_a_trajectorys_context_offers_its_session_and_reads_its_group_from_its_first_request() -> None:
    settings = _configure()
    with otel_session.trajectory() as attempt:
        ctx = get_current()
        offered = _hop.current()
        assert offered is not None and _hop.current() is offered and _hop.current(ctx) is offered
        assert offered.settings is settings and offered.context is ctx
        assert offered.offer == Offer(attempt.session_id, None, baggage.get_all(ctx), None, pinned=True)
        assert offered.offer.pinned is True
        assert offered.undecided is not None and not offered.undecided.decided
        assert offered.watched is False and offered.offers is True
        assert _hop.offer_for(ctx, False) == offered.offer
    assert _hop.current() is None
    assert _hop.offer_for(ctx, False) == offered.offer  # read from the context given, not the current one


def test_a_context_holding_only_baggage_or_a_span_still_offers() -> None:
    _configure()
    with_baggage = baggage.set_baggage("user.id", "u1", Context())
    offered = _hop.current(with_baggage)
    assert offered is not None and offered.offer == Offer(None, None, {"user.id": "u1"}, None)
    assert offered.undecided is None and offered.watched is False and offered.offers is True
    assert offered.plan(*GYM).edits == [("baggage", "user.id=u1")]
    # a span recorded here is passed on even with tracing off; a caller's extracted one is not
    local = trace.set_span_in_context(_span(remote=False), Context())
    offered = _hop.current(local)
    assert offered is not None and offered.offer.traceparent == TRACEPARENT and offered.watched is True
    assert _hop.current(trace.set_span_in_context(_span(remote=True), Context())) is None
    assert _hop.current(trace.set_span_in_context(trace.INVALID_SPAN, Context())) is None


def test_with_tracing_on_a_callers_span_is_passed_on_and_watched() -> None:
    _configure()
    _tracing_on()
    remote = trace.set_span_in_context(_span(remote=True), Context())
    offered = _hop.current(remote)
    assert offered is not None and offered.offer == Offer(None, None, {}, TRACEPARENT)
    assert offered.watched is True and offered.offers is True
    empty = _hop.current(Context())
    assert empty is not None and empty.offer == Offer() and empty.watched is True  # tracing on: watched
    assert _hop.offer_for(trace.set_span_in_context(trace.INVALID_SPAN, Context()), True).traceparent is None


def test_a_new_context_or_configuration_is_asked_afresh() -> None:
    _configure()
    with otel_session.trajectory():
        outer = _hop.current()
        with otel_session.trajectory() as inner:
            nested = _hop.current()
            assert nested is not None and nested is not outer and nested.offer.session == inner.session_id
        assert outer is not None and _hop.current().offer == outer.offer  # type: ignore[union-attr]
        settings = _configure()
        again = _hop.current()
        assert again is not None and again is not outer and again.settings is settings
        assert outer is not None and again.offer == outer.offer


def test_a_parent_given_in_baggage_is_kept_and_no_group_is_read() -> None:
    _configure()
    with otel_session.trajectory() as attempt:
        ctx = baggage.set_baggage(PARENT_KEY, PARENT, get_current())
        offered = _hop.current(ctx)
        assert offered is not None and offered.offer.parent == PARENT and offered.undecided is None
        assert offered.decide(_body("p"), ROUTER) is offered
        assert offered.plan(*ROUTER).edits == [(SESSION_HEADER, attempt.session_id), (PARENT_HEADER, PARENT)]


def test_a_context_whose_session_was_taken_out_reads_no_group() -> None:
    _configure()
    with otel_session.trajectory():
        ctx = baggage.set_baggage("user.id", "u1", baggage.remove_baggage(SESSION_KEY, get_current()))
        offered = _hop.current(ctx)
        assert offered is not None and offered.offer.session is None and offered.undecided is None


def test_an_attempt_with_no_group_to_read_offers_none_undecided() -> None:
    _configure(siblings="attempt")
    with otel_session.trajectory() as attempt:
        offered = _hop.current()
        assert offered is not None and offered.undecided is None
        assert offered.decide(_body("p"), ROUTER) is offered
        assert offered.plan(*ROUTER).edits == [(SESSION_HEADER, attempt.session_id)]
    with otel_session.resume({SESSION_KEY: "resumed-session"}):
        offered = _hop.current()
        assert offered is not None and offered.offer.session == "resumed-session"
        assert offered.undecided is None
        assert _hop.sends_session(get_current(), "resumed-session")


# --- the first request to a router decides the attempt's group ------------------------------------------


def test_siblings_of_a_prompt_share_a_parent_two_by_two_under_the_default() -> None:
    support.metrics_reader()
    _configure()
    before = support.metric_points()
    first, second, third, other = Attempt(), Attempt(), Attempt(), Attempt()
    try:
        offered = first.offered()
        decided = first.decide("p", ROUTER)
        assert decided is not offered and decided.undecided is None
        parent = decided.offer.parent
        assert parent is not None and decided.offer.pinned is True
        assert decided.settings is offered.settings and decided.context is offered.context
        assert first.run(_hop.current) is decided  # what the context offers from now on
        assert decided.plan(*ROUTER).edits == [(SESSION_HEADER, first.session), (PARENT_HEADER, parent)]
        assert decided.decide(_body("p"), ROUTER) is decided  # decided once
        assert second.decide("p", ROUTER).offer.parent == parent
        assert third.decide("p", ROUTER).offer.parent not in (None, parent)  # the third: a new pair
        assert other.decide("q", ROUTER).offer.parent not in (None, parent)  # another prompt
        # read afresh from the context, the attempt's parent is the one decided
        first.run(_hop.forget)
        again = first.offered()
        assert again is not decided and again.offer == decided.offer and again.undecided is None
    finally:
        for attempt in (first, second, third, other):
            attempt.end()
    default = frozenset({("otel_session.siblings.choice", "default"), ("otel_session.siblings.size", 2)})
    assert _counted(before, "otel_session.sibling_choices") == {default: 4}


def test_a_streamed_body_names_no_group() -> None:
    _configure(siblings="fleet")
    attempt = Attempt()
    try:
        offered = attempt.offered()
        assert offered.decide(None, ROUTER) is offered and offered.undecided is None
        assert offered.offer.parent is None and offered.plan(*ROUTER).edits == [
            (SESSION_HEADER, attempt.session)
        ]
        attempt.run(_hop.forget)  # read afresh from the context: decided, nothing left to read
        again = attempt.offered()
        assert again is not offered and again.offer == offered.offer and again.undecided is None
    finally:
        attempt.end()


def test_decided_without_a_group_keeps_the_offer() -> None:
    _configure()
    with otel_session.trajectory() as attempt:
        offered = _hop.current()
        assert offered is not None and offered.undecided is not None
        assert offered.decided(None) is offered and offered.undecided is None
        found = offered.decided(PARENT)
        assert found.offer == offered.offer._replace(parent=PARENT) and found.offer.pinned is True
        assert _hop.current() is found
        withheld = offered.decided(None, withheld=True)
        assert withheld.offer.pinned is False and withheld.offer.parent is None
        assert withheld.plan(*ROUTER).edits == []
        assert attempt.session_id is not None


def test_an_unpinned_session_stays_unpinned_when_its_group_is_decided() -> None:
    _configure()
    with otel_session.trajectory() as attempt:
        session = attempt.session_id
        assert session is not None
        assert _hop.unpin(session)
        offered = _hop.current()
        assert offered is not None and offered.offer.pinned is False
        decided = offered.decide(_body("p"), ROUTER)
        assert decided.offer.parent is not None and decided.offer.pinned is False
        assert decided.plan(*ROUTER).edits == []


def test_after_a_step_of_lone_attempts_the_default_sends_each_alone_and_says_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Lone attempts (groups read from unique prompts) need no parent: each goes alone with its own
    session after a lone step, fleet size or not (a parent each, they were paced for nothing). A GRPO
    step after it gathers (``_siblings.step_seen`` stays false) and is sized by itself."""
    _configure()
    lone = [Attempt() for _ in range(3)]
    for index, attempt in enumerate(lone):
        attempt.decide(f"lone-{index}", ROUTER)
    for attempt in lone:
        attempt.end()
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        attempt = Attempt()
        try:
            decided = attempt.decide("next", ROUTER).offer
            assert decided.parent is None and decided.pinned and decided.session == attempt.session
        finally:
            attempt.end()
    assert _lines(caplog) == [] and not _siblings.step_seen()


# --- fleet: the session withheld until K can be sized ---------------------------------------------------


WITHHELD_LINE = (
    "otel-session: OTEL_SESSION_SIBLINGS=fleet sends attempts without their session until it can size "
    "sibling groups to the router's fleet ({}): the router places them as it would without otel-session"
)


def test_fleet_withholds_the_session_until_the_routers_size_is_read(
    slow: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    support.metrics_reader()
    otel_session.configure(dynamo_hosts=[slow.url], siblings="fleet")
    router = ("http", "127.0.0.1", slow.port)
    before = support.metric_points()
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        first = Attempt()
        withheld = first.decide("p", router)
        assert withheld.offer.parent is None and withheld.offer.pinned is False
        assert withheld.plan(*router).edits == []
        assert not _hop.sends_session(first.run(get_current), first.session)
        assert first.run(lambda: _hop.offer_for(get_current(), False)) == Offer(
            first.session, None, withheld.offer.baggage, None, pinned=False
        )
        assert _lines(caplog) == [WITHHELD_LINE.format("its /health is still being read")]
        sibling = Attempt()  # the same prompt: its group was opened withheld
        assert sibling.decide("p", router).offer.pinned is False
        _reads_done()
        assert _fleet.known() == {slow.url: _fleet.UNREADABLE}
        said = _lines(caplog)
        assert len(said) == 2 and said[1].startswith(
            f"otel-session: sibling groups cannot be sized to the fleet of the router at {slow.url}: its "
            "/health lists no workers (no instance serving generate)"
        )
        # read, and it lists no workers: the default's K, the session sent
        later = Attempt()
        grouped = later.decide("q", router)
        assert grouped.offer.parent is not None and grouped.offer.pinned is True
        assert grouped.plan(*router).edits == [
            (SESSION_HEADER, later.session),
            (PARENT_HEADER, grouped.offer.parent),
        ]
        for attempt in (first, sibling, later):
            attempt.end()
    assert len(_lines(caplog)) == 2  # the withheld line once, the unreadable router once
    assert _counted(before, "otel_session.sibling_choices") == {
        frozenset({("otel_session.siblings.choice", "withheld")}): 2,
        frozenset({("otel_session.siblings.choice", "default"), ("otel_session.siblings.size", 2)}): 1,
    }


def test_fleet_sends_the_session_where_the_router_takes_no_parent(caplog: pytest.LogCaptureFixture) -> None:
    _configure(siblings="fleet")
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        for destination, header in ((VLLM, "X-Session-ID"), (GYM, None)):
            attempt = Attempt()
            try:
                decided = attempt.decide("p", destination)
                assert decided.offer.pinned is True and decided.offer.parent is not None
                if header is not None:
                    assert decided.plan(*destination).edits == [(header, attempt.session)]
            finally:
                attempt.end()
    _reads_done()
    assert _fleet.known() == {} and _lines(caplog) == []  # no parent to send: no size wanted


def test_fleet_says_when_no_step_has_ended_then_sizes_groups_one_per_worker(
    slow: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    support.metrics_reader()
    with Recorder(instances=4) as four, Recorder(instances=8) as eight:
        otel_session.configure(dynamo_hosts=[four.url, eight.url, slow.url], siblings="fleet")
        at_four, at_eight = ("http", "127.0.0.1", four.port), ("http", "127.0.0.1", eight.port)
        before = support.metric_points()
        with caplog.at_level(logging.WARNING, logger="otel_session"):
            reader = Attempt()  # its first plans start the reads of both routers' sizes
            reader.offered().plan(*at_four)
            reader.offered().plan(*at_eight)
            _reads_done()
            reader.end()
            assert _fleet.known() == {four.url: 4, eight.url: 8}
            step = [Attempt() for _ in range(6)]  # two prompts, three siblings each, all open at once
            for index, attempt in enumerate(step):
                assert attempt.decide(f"p{index % 2}", at_four).offer.pinned is False
            assert _lines(caplog) == [WITHHELD_LINE.format("no step has ended here yet")]
            for attempt in step:
                attempt.end()
            # the last step: 2 groups of 3 siblings; 8 workers, 4 per group: each alone
            alone = Attempt()
            decided = alone.decide("p0", at_eight)
            assert decided.offer.parent is None and decided.offer.pinned is True
            # 4 workers, 2 per group: 2 per parent
            pair = [Attempt(), Attempt(), Attempt()]
            parents = [attempt.decide("p1", at_four).offer.parent for attempt in pair]
            assert parents[0] is not None and parents[0] == parents[1] != parents[2]
            # a sibling of the lone group sent to a router whose size is still being read: its group
            # keeps its K, and the line names no workers known
            elsewhere = Attempt()
            assert elsewhere.decide("p0", ("http", "127.0.0.1", slow.port)).offer.parent is None
            for attempt in (alone, *pair, elsewhere):
                attempt.end()
    shape = "the step before had 2 groups of up to 3 siblings open at once: one group per worker"
    sized = [line for line in _lines(caplog) if line.startswith("otel-session: siblings sized")]
    assert _lines(caplog)[1:3] == sized[:2] and sized == [
        f"otel-session: siblings sized to the fleet: each alone under its own session (8 workers; {shape})",
        f"otel-session: siblings sized to the fleet: 2 per parent session (4 workers; {shape} (each "
        "prompt's 3 as 2 + 1))",
        f"otel-session: siblings sized to the fleet: each alone under its own session (0 workers; {shape})",
    ]
    choice = "otel_session.siblings.choice"
    assert _counted(before, "otel_session.sibling_choices") == {
        frozenset({(choice, "withheld")}): 6,
        frozenset({(choice, "sized"), ("otel_session.siblings.size", 1)}): 2,
        frozenset({(choice, "sized"), ("otel_session.siblings.size", 2)}): 3,
    }


# --- auto: the fleet's size read once groups have siblings ------------------------------------------------


def test_auto_reads_the_fleets_size_once_a_group_has_two_attempts_and_never_says_so(
    refused: int, caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{refused}"])
    router = ("http", "127.0.0.1", refused)
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        early = Attempt()
        planned = early.offered()
        planned.plan(*router)  # no group has two attempts yet: no size wanted
        _reads_done()
        assert _fleet.known() == {}
        pair = [Attempt(), Attempt()]
        for attempt in pair:
            attempt.decide("p", router)
        # its plan was made before: deciding the attempt starts the read, quietly under auto
        decided = early.run(planned.decide, _body("q"), router)
        assert decided.offer.parent is not None
        _reads_done()
        assert _fleet.known() == {f"http://127.0.0.1:{refused}": _fleet.UNREADABLE}
        for attempt in (early, *pair):
            attempt.end()
    assert _lines(caplog) == []


def test_an_attempt_is_decided_under_the_policy_it_started_with(
    refused: int, caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{refused}"], siblings="fleet")
    router = ("http", "127.0.0.1", refused)
    attempt = Attempt()  # started under fleet
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{refused}"], siblings="auto")
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        decided = attempt.decide("p", router)  # auto plans it without a read; fleet decides it
        assert decided.offer.pinned is False and decided.offer.parent is None
        _reads_done()
    said = sorted(_lines(caplog))  # the refused read may be said before the withheld line or after it
    assert said[0] == WITHHELD_LINE.format("its /health is still being read")
    assert len(said) == 2 and said[1].startswith(
        f"otel-session: sibling groups cannot be sized to the fleet of the router at http://127.0.0.1:{refused}"
    )


def test_auto_starts_the_read_as_a_router_is_planned(refused: int, caplog: pytest.LogCaptureFixture) -> None:
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{refused}"], trusted_hosts=["gym.internal"])
    router = ("http", "127.0.0.1", refused)
    pair = [Attempt(), Attempt()]
    for attempt in pair:
        attempt.decide("p", router)
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        late = Attempt()
        late.offered().plan(*GYM)  # not a router: no size read
        _reads_done()
        assert _fleet.known() == {}
        late.offered().plan(*router)
        _reads_done()
        assert _fleet.known() == {f"http://127.0.0.1:{refused}": _fleet.UNREADABLE}
        for attempt in (late, *pair):
            attempt.end()
    assert _lines(caplog) == []


# --- who is told what, once --------------------------------------------------------------------------------


OUTSIDE_LINE = (
    "otel-session: a request to dynamo router {} was sent outside any trajectory, so it carries no "
    "session ({}); give its rollout a boundary: otel_session.trajectory(), "
    "OTEL_SESSION_TRAJECTORY_FUNCTIONS=module:function, or a framework instrumentor (NeMo-RL's "
    "applies when nemo_rl's rollout modules are imported); if it was sent from a thread or pool "
    "inside a trajectory, hand the work over with otel_session.bind(). Logged once per process."
)


def test_the_first_request_to_a_router_outside_any_trajectory_is_told_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _hop.outside(*ROUTER)  # not configured: nothing to tell
        _configure()
        _hop.outside(*GYM)  # not a router
        _hop.outside("http", None, None)
        assert _lines(caplog) == [] and _hop.untold
        _hop.outside(*ROUTER)
        _hop.outside(*ROUTER)
        _hop.outside(*VLLM)
    assert _lines(caplog) == [
        OUTSIDE_LINE.format("127.0.0.9:8000", "no named boundary is in force in this process")
    ]
    assert not _hop.untold


def test_the_line_names_the_boundaries_in_force_and_a_router_without_a_port(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=["router.internal"])
    monkeypatch.setattr(
        _hop, "boundaries_in_force", {"verifiers.envs:Env.rollout", "areal.workflow:arun_episode"}
    )
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _hop.outside("http", "router.internal", None)
    in_force = (
        "the boundaries in force in this process (areal.workflow:arun_episode, "
        "verifiers.envs:Env.rollout) did not enclose it"
    )
    assert _lines(caplog) == [OUTSIDE_LINE.format("router.internal", in_force)]


def test_a_line_that_cannot_be_made_never_fails_the_request(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _configure()
    monkeypatch.setattr(_hop, "boundaries_in_force", {"a:b", 1})  # cannot be sorted
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _hop.outside(*ROUTER)
    assert _lines(caplog) == [] and not _hop.untold


def test_a_request_planned_outside_any_trajectory_tells_so_and_one_inside_does_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _configure()
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        with otel_session.trajectory():
            offered = _hop.current()
            assert offered is not None
            offered.plan(*ROUTER)
        assert _lines(caplog) == [] and _hop.untold
        outside = _hop.current(baggage.set_baggage("user.id", "u1", Context()))
        assert outside is not None
        outside.plan(*GYM)
        assert _hop.untold
        assert outside.plan(*ROUTER).edits == []
    assert _lines(caplog) == [
        OUTSIDE_LINE.format("127.0.0.9:8000", "no named boundary is in force in this process")
    ]


UNCONFIGURED_LINE = (
    "otel-session: a trajectory started (or was resumed) but otel-session is not configured in this "
    "process, so no request carries its session; call otel_session.configure(dynamo_hosts=[...]), run "
    "under opentelemetry-instrument with OTEL_PYTHON_DISTRO=otel_session, or set OTEL_SESSION_AUTO=true "
    "(a Ray worker, a child process). Logged once per process."
)


def test_a_trajectory_where_nothing_is_configured_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        with otel_session.trajectory():
            pass
        with otel_session.trajectory():
            pass
    assert _lines(caplog) == [UNCONFIGURED_LINE]


def test_what_a_trajectory_offers_is_remembered_as_it_starts() -> None:
    _configure()
    ctx = baggage.set_baggage("user.id", "u1", Context())
    _hop.entered(ctx, "session-1", PARENT, _span(remote=False))
    offered = _hop.current(ctx)
    assert offered is not None and offered.context is ctx
    assert offered.offer == Offer("session-1", PARENT, {"user.id": "u1"}, TRACEPARENT)
    _hop.entered(ctx, "session-2", None, _span(remote=True))  # a caller's span: not with tracing off
    offered = _hop.current(ctx)
    assert offered is not None and offered.offer == Offer("session-2", None, {"user.id": "u1"}, None)
    _tracing_on()
    settings = _settings.current
    _hop.entered(ctx, "session-3", None, _span(remote=True))
    offered = _hop.current(ctx)
    assert offered is not None and offered.settings is settings
    assert offered.offer == Offer("session-3", None, {"user.id": "u1"}, TRACEPARENT)


def test_what_a_trajectory_offers_is_not_remembered_unconfigured_and_a_fault_costs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = baggage.set_baggage("user.id", "u1", Context())
    _hop.entered(ctx, "session-1", None, _span(remote=False))
    _configure()
    assert _hop.current(ctx) == _hop.current(ctx) and _hop.current(ctx).offer.session is None  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _hop.entered(object(), "session-1", None, _span(remote=False))  # type: ignore[arg-type]
        _hop.entered(object(), "session-1", None, _span(remote=False))  # type: ignore[arg-type]
    said = _lines(caplog)
    assert len(said) == 1 and said[0].startswith(
        "otel-session: remembering what a trajectory offers failed (AttributeError); the application "
        "goes on without it"
    )


# --- sessions unpinned after their router refused them ----------------------------------------------------


def test_an_unpinned_session_goes_without_its_routers_header() -> None:
    _configure()
    with otel_session.trajectory() as attempt:
        session = attempt.session_id
        assert session is not None
        ctx = get_current()
        offered = _hop.current()
        assert offered is not None and offered.plan(*ROUTER).edits == [(SESSION_HEADER, session)]
        assert _hop.sends_session(ctx, session)
        assert _hop.unpin("another-session")  # someone else's: ours still pinned
        assert _hop.current() is not offered
        assert _hop.current().offer.pinned is True  # type: ignore[union-attr]
        assert _hop.unpin(session) and not _hop.unpin(session)
        unpinned = _hop.current()
        assert unpinned is not None and unpinned.offer.pinned is False
        assert unpinned.plan(*ROUTER).edits == []
        assert unpinned.plan(*GYM).edits == [("baggage", f"session.id={session}")]  # baggage still goes
        assert not _hop.sends_session(ctx, session)


def test_unpinned_sessions_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    full = {f"s{index}": None for index in range(_hop.UNPINNED_KEPT - 1)}
    monkeypatch.setattr(_hop, "unpinned", full)
    assert _hop.unpin("last-room")
    assert len(_hop.unpinned) == _hop.UNPINNED_KEPT and "s0" in _hop.unpinned
    assert _hop.unpin("one-more")
    assert len(_hop.unpinned) == _hop.UNPINNED_KEPT and "s0" not in _hop.unpinned and "s1" in _hop.unpinned
    assert not _hop.unpin("one-more")


def test_a_fleet_withheld_attempt_does_not_send_its_session_to_any_router(slow: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[slow.url], siblings="fleet")
    attempt = Attempt()
    try:
        ctx = attempt.run(get_current)
        assert attempt.run(_hop.sends_session, ctx, attempt.session)
        attempt.decide("p", ("http", "127.0.0.1", slow.port))
        assert not _hop.sends_session(ctx, attempt.session)
        with_span = trace.set_span_in_context(_span(remote=True), ctx)
        assert _hop.offer_for(with_span, True) == Offer(
            attempt.session, None, baggage.get_all(ctx), TRACEPARENT, pinned=False
        )
        assert _hop.offer_for(with_span, False).traceparent is None
        local = trace.set_span_in_context(_span(remote=False), ctx)
        assert _hop.offer_for(local, False).traceparent == TRACEPARENT
    finally:
        attempt.end()


def test_offer_for_reads_the_span_of_the_context_it_is_given() -> None:
    _configure()
    with otel_session.trajectory() as attempt:
        ctx = get_current()
    remote = trace.set_span_in_context(_span(remote=True), ctx)
    assert _hop.offer_for(remote, True) == Offer(attempt.session_id, None, baggage.get_all(ctx), TRACEPARENT)
    assert _hop.offer_for(remote, False).traceparent is None
    local = trace.set_span_in_context(_span(remote=False), ctx)
    assert _hop.offer_for(local, False).traceparent == TRACEPARENT
    with_parent = baggage.set_baggage(PARENT_KEY, PARENT, Context())
    assert _hop.offer_for(baggage.set_baggage(SESSION_KEY, "s", with_parent), False) == Offer(
        "s", PARENT, {PARENT_KEY: PARENT, SESSION_KEY: "s"}, None
    )


def test_an_attempt_decided_while_it_waited_keeps_that_choice() -> None:
    """``_gathering`` decides an attempt while its first request waits for the step; that request
    (its offer made before the wait) then offers what was decided: the parent, pinned; and under
    ``fleet`` a withheld one goes unpinned, with no parent, its plan editing nothing."""
    otel_session.configure(dynamo_hosts=["127.0.0.9:8000"], siblings="auto")
    pair = [Attempt(), Attempt()]
    parents, decided = [], []
    for attempt in pair:
        offered = attempt.offered()  # the request's offer, made as it started
        holder = offered.undecided
        assert holder is not None
        holder.enter("p")
        parents.append(holder.decide("p", 8))  # decided while the request waited
        decided.append(attempt.run(offered.decide, _body("q"), ROUTER).offer)
    assert parents[0] is not None and [offer.parent for offer in decided] == parents
    assert all(offer.pinned for offer in decided)
    otel_session.configure(dynamo_hosts=["127.0.0.9:8000"], siblings="fleet")
    withheld = Attempt()
    offered = withheld.offered()
    holder = offered.undecided
    assert holder is not None
    holder.withhold()
    chosen = withheld.run(offered.decide, _body("p"), ROUTER)
    assert chosen.offer.parent is None and chosen.offer.pinned is False
    assert chosen.plan(*ROUTER).edits == []
    for attempt in (*pair, withheld):
        attempt.end()


def test_fleet_withholds_an_attempt_at_a_router_seen_crowded() -> None:
    """Where the evidence saw pinned sessions crowd a router's workers (``_hop.crowded``), ``fleet``
    sends a new attempt there without its session: no parent, unpinned, nothing edited."""
    otel_session.configure(dynamo_hosts=["127.0.0.9:8000"], siblings="fleet")
    _hop.crowded.add(("dynamo", "127.0.0.9", 8000))
    try:
        attempt = Attempt()
        chosen = attempt.decide("p", ROUTER)
        assert chosen.offer.parent is None and chosen.offer.pinned is False
        assert chosen.plan(*ROUTER).edits == []
        attempt.end()
    finally:
        _hop.crowded.discard(("dynamo", "127.0.0.9", 8000))
