"""SessionPropagator as the OpenTelemetry machinery uses it: carriers, destinations, extract."""

from __future__ import annotations

import logging

import httpx
import pytest
from multidict import CIMultiDict
from opentelemetry import baggage, context, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagate import get_global_textmap, inject, set_global_textmap
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import otel_session
from otel_session import _faults, _hop, _stock, _w3c
from otel_session._context import HOP_KEY, with_session
from otel_session._hop import Hop
from otel_session._hosts import NOWHERE, Route
from otel_session._propagator import SessionPropagator, is_sole_global
from otel_session._routers import BUILTIN, DYNAMO
from tests.otlp_receiver import OtlpHttpReceiver

TO_DYNAMO = Hop(Route(DYNAMO), frozenset())
TO_GYM = Hop(Route(None, trusted=True), frozenset())
TO_TOOL = Hop(NOWHERE, frozenset())


def hop(where: Hop) -> context.Context:
    return context.set_value(HOP_KEY, where)


def test_a_host_header_is_never_the_destination() -> None:
    """Without a hop in the context the destination is unknown, whatever the carrier's Host says."""
    otel_session.configure(dynamo_hosts=["dynamo.internal"], trusted_hosts=["gym"])
    propagator = SessionPropagator()
    with otel_session.trajectory():
        for carrier in (
            httpx.Headers({"host": "dynamo.internal"}),
            {"Host": "dynamo.internal"},
            CIMultiDict({"Host": "gym"}),
            {},
        ):
            before = list(carrier.items())
            propagator.inject(carrier)
            assert list(carrier.items()) == before


def test_the_hop_in_the_context_decides() -> None:
    propagator = SessionPropagator()
    with otel_session.trajectory() as traj:
        to_gym: dict[str, str] = {"Host": "elsewhere"}
        propagator.inject(to_gym, hop(TO_GYM))
        to_dynamo: dict[str, str] = {}
        propagator.inject(to_dynamo, hop(TO_DYNAMO))
        to_tool: dict[str, str] = {}
        propagator.inject(to_tool, hop(TO_TOOL))
    assert to_gym == {"Host": "elsewhere", "baggage": f"session.id={traj.session_id}"}
    assert to_dynamo == {"X-Dynamo-Session-ID": traj.session_id}
    assert to_tool == {}


def test_each_profile_writes_only_its_own_header() -> None:
    propagator = SessionPropagator()
    with otel_session.trajectory() as traj:
        for profile in BUILTIN.values():
            carrier: dict[str, str] = {}
            propagator.inject(carrier, hop(Hop(Route(profile), frozenset())))
            assert carrier == {profile.session_header: traj.session_id}


def test_a_hand_set_session_header_is_left_alone_everywhere() -> None:
    propagator = SessionPropagator()
    with otel_session.trajectory() as traj:
        assert traj.session_id
        to_tool = httpx.Headers({"X-Dynamo-Session-ID": traj.session_id})
        to_dynamo = httpx.Headers({"X-Dynamo-Session-ID": "mine"})
        propagator.inject(to_tool, hop(TO_TOOL))
        propagator.inject(to_dynamo, hop(TO_DYNAMO))
    assert to_tool["x-dynamo-session-id"] == traj.session_id
    assert to_dynamo["x-dynamo-session-id"] == "mine"


def test_stock_baggage_copies_are_taken_back_however_encoded() -> None:
    """Composed after the stock baggage propagator, ours removes what it copied for another host."""
    composite = CompositePropagator([W3CBaggagePropagator(), SessionPropagator()])
    with otel_session.trajectory(session_id="episode:42/a%b+c,d;e"):
        ctx = baggage.set_baggage("tenant", "acme")
        to_tool: dict[str, str] = {}
        composite.inject(to_tool, context.set_value(HOP_KEY, TO_TOOL, ctx))
        to_gym: dict[str, str] = {}
        composite.inject(to_gym, context.set_value(HOP_KEY, TO_GYM, ctx))
    assert to_tool == {"baggage": "tenant=acme"}  # theirs stays, ours (session.id=episode%3A42...) goes
    extracted = W3CBaggagePropagator().extract(to_gym)
    assert baggage.get_all(extracted) == {"session.id": "episode:42/a%b+c,d;e", "tenant": "acme"}


def test_a_callers_baggage_to_a_trusted_host_is_kept_and_ours_added() -> None:
    propagator = SessionPropagator()
    with otel_session.trajectory() as traj:
        carrier = {"baggage": "tenant=acme"}
        propagator.inject(carrier, hop(TO_GYM))
    assert carrier == {"baggage": f"tenant=acme,session.id={traj.session_id}"}


def test_configure_installs_it_globally() -> None:
    otel_session.configure(dynamo_hosts=["first"])
    assert isinstance(get_global_textmap(), SessionPropagator)
    with otel_session.trajectory() as traj:
        carrier: dict[str, str] = {}
        inject(carrier, hop(TO_DYNAMO))
    assert carrier == {"X-Dynamo-Session-ID": traj.session_id}


def test_extract_prefers_the_dynamo_header_and_drops_invalid_values() -> None:
    propagator = SessionPropagator()
    ctx = propagator.extract({"x-dynamo-session-id": "from-header", "baggage": "session.id=from-baggage,k=v"})
    assert baggage.get_baggage("session.id", ctx) == "from-header"
    assert baggage.get_baggage("k", ctx) == "v"
    ctx = propagator.extract({"x-dynamo-session-id": "bad value", "baggage": "session.id=ok"})
    assert baggage.get_baggage("session.id", ctx) == "ok"
    ctx = propagator.extract({"baggage": "session.id=" + "x" * 300})
    assert baggage.get_baggage("session.id", ctx) is None
    ctx = propagator.extract({"X-Dynamo-Session-ID": "canonical-spelling"})
    assert baggage.get_baggage("session.id", ctx) == "canonical-spelling"
    ctx = propagator.extract({"baggage": "k=" + "v" * 9000})
    assert baggage.get_all(ctx) == {}


def test_with_an_explicit_session_header_the_parent_never_comes_from_baggage() -> None:
    propagator = SessionPropagator()
    ctx = propagator.extract(
        {"x-dynamo-session-id": "child", "baggage": "session.id=other,session.parent_id=from-baggage"}
    )
    assert baggage.get_baggage("session.id", ctx) == "child"
    assert baggage.get_baggage("session.parent_id", ctx) is None
    ctx = propagator.extract({"x-dynamo-session-id": "child", "x-dynamo-parent-session-id": "outer"})
    assert baggage.get_baggage("session.parent_id", ctx) == "outer"


def test_fields_name_everything_it_may_write() -> None:
    assert SessionPropagator().fields >= {
        "x-dynamo-session-id",
        "x-dynamo-parent-session-id",
        "baggage",
        "traceparent",
    }


# ---- pinned by the mutation run (scripts/mutate): each test below fails on a mutant that survived ----

REMOTE_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
REMOTE_PARENT = f"00-{REMOTE_TRACE_ID}-00f067aa0ba902b7-01"
SESSION = "7d0a6f40-0b43-4c64-9b39-1f3c4fb2c001"
OUTER = "parent-7"


class PairsGetter(Getter[list[tuple[bytes, bytes]]]):
    """Reads header pairs as ASGI keeps them (lower-case bytes), which ``default_getter`` cannot."""

    def get(self, carrier: list[tuple[bytes, bytes]], key: str) -> list[str] | None:
        found = [value.decode("latin-1") for name, value in carrier if name == key.lower().encode()]
        return found or None

    def keys(self, carrier: list[tuple[bytes, bytes]]) -> list[str]:
        return [name.decode("latin-1") for name, _ in carrier]


class PairsSetter(Setter[list[tuple[bytes, bytes]]]):
    def set(self, carrier: list[tuple[bytes, bytes]], key: str, value: str) -> None:
        carrier.append((key.lower().encode(), value.encode()))


class FailingGetter(Getter[object]):
    def get(self, carrier: object, key: str) -> list[str] | None:
        raise RuntimeError("a getter of the application's fails")

    def keys(self, carrier: object) -> list[str]:
        return []


class FailingSetter(Setter[object]):
    def set(self, carrier: object, key: str, value: str) -> None:
        raise RuntimeError("a setter of the application's fails")


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """otel-session's warnings from this test alone (each place reports once per process; the global
    propagator counts as checked, so an earlier test's stock one is no warning of this test's)."""
    monkeypatch.setattr(_faults, "_reported", set())
    monkeypatch.setattr(_stock, "_leaks_checked", get_global_textmap())
    monkeypatch.setattr(_hop, "unconfigured_untold", False)  # said by whichever test ran first
    caplog.set_level(logging.WARNING, logger="otel_session")
    return caplog


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name.startswith("otel_session")]


def _trace_id(ctx: context.Context) -> str:
    return f"{trace.get_current_span(ctx).get_span_context().trace_id:032x}"


def test_extract_builds_on_the_context_it_is_given(warnings: pytest.LogCaptureFixture) -> None:
    """What the caller's context holds stays, whatever the carrier brings (and the current context,
    which is not the one given, lends nothing)."""
    given = context.set_value("app.key", "kept", baggage.set_baggage("tenant", "acme", context.Context()))
    token = context.attach(baggage.set_baggage("ambient", "no", context.Context()))
    try:
        for carrier in (
            {},
            {"baggage": f"session.id={SESSION}"},
            {"x-dynamo-session-id": SESSION},
            {"traceparent": REMOTE_PARENT, "baggage": f"session.id={SESSION},k=v"},
        ):
            ctx = SessionPropagator().extract(carrier, given)
            assert context.get_value("app.key", ctx) == "kept", carrier
            assert baggage.get_baggage("tenant", ctx) == "acme", carrier
            assert baggage.get_baggage("ambient", ctx) is None, carrier
    finally:
        context.detach(token)
    assert _messages(warnings) == []


def test_a_session_in_baggage_keeps_the_traceparent_and_the_other_members(
    warnings: pytest.LogCaptureFixture,
) -> None:
    carrier = {"traceparent": REMOTE_PARENT, "baggage": f"k=v,session.id={SESSION},session.parent_id={OUTER}"}
    propagator = SessionPropagator()
    for ctx in (propagator.extract(carrier), propagator.extract(carrier, context.Context())):
        assert baggage.get_all(ctx) == {"k": "v", "session.id": SESSION, "session.parent_id": OUTER}
        assert _trace_id(ctx) == REMOTE_TRACE_ID
        assert trace.get_current_span(ctx).get_span_context().is_remote
    assert _messages(warnings) == []


def test_a_carrier_only_the_callers_getter_can_read(warnings: pytest.LogCaptureFixture) -> None:
    """Every header is read through the getter given: traceparent, baggage and the session header."""
    pairs = [
        (b"traceparent", REMOTE_PARENT.encode()),
        (b"baggage", f"k=v,session.id={SESSION},session.parent_id={OUTER}".encode()),
    ]
    ctx = SessionPropagator().extract(pairs, getter=PairsGetter())
    assert baggage.get_all(ctx) == {"k": "v", "session.id": SESSION, "session.parent_id": OUTER}
    assert _trace_id(ctx) == REMOTE_TRACE_ID
    ctx = SessionPropagator().extract([(b"x-dynamo-session-id", SESSION.encode())], getter=PairsGetter())
    assert baggage.get_baggage("session.id", ctx) == SESSION
    assert _messages(warnings) == []


@pytest.mark.parametrize(
    ("parent", "expected"),
    [
        (OUTER, OUTER),
        (SESSION, None),  # a session is not its own parent
        ("p" * 257, None),  # longer than Dynamo accepts
        ("", None),
        ("%20", None),  # decodes to white space
        ("a%22b", 'a"b'),  # percent-encoded, it is visible ASCII once decoded
    ],
)
def test_a_parent_session_in_baggage_is_taken_only_when_valid(
    parent: str, expected: str | None, warnings: pytest.LogCaptureFixture
) -> None:
    ctx = SessionPropagator().extract({"baggage": f"session.id={SESSION},session.parent_id={parent},k=v"})
    assert baggage.get_baggage("session.id", ctx) == SESSION
    assert baggage.get_baggage("session.parent_id", ctx) == expected
    assert baggage.get_baggage("k", ctx) == "v"
    assert _messages(warnings) == []


@pytest.mark.parametrize("value", ['a"b', "x\\y", "bad value", "a\x01b"])
def test_a_session_member_that_is_not_well_formed_is_no_session(value: str) -> None:
    """Its decoded value would pass as visible ASCII, but as written it breaks W3C's grammar."""
    ctx = SessionPropagator().extract({"baggage": f"session.id={value},k=v"})
    assert baggage.get_baggage("session.id", ctx) is None
    assert baggage.get_baggage("k", ctx) == "v"


def test_a_baggage_header_without_a_session_ends_the_one_in_the_context(
    warnings: pytest.LogCaptureFixture,
) -> None:
    """Incoming baggage says whose request this is: a session the given context held is not carried
    into a request whose baggage names none; without a baggage header the context keeps its own."""
    for ambient in (with_session("ambient", None), with_session("ambient", "ambient-parent")):
        ctx = SessionPropagator().extract({"baggage": "tenant=acme"}, ambient)
        assert baggage.get_all(ctx) == {"tenant": "acme"}
        ctx = SessionPropagator().extract({}, ambient)
        assert baggage.get_all(ctx) == baggage.get_all(ambient)
    assert _messages(warnings) == []


def test_the_baggage_limit_is_8192_bytes_of_header() -> None:
    head = f"session.id={SESSION},k="
    exact = head + "v" * (_w3c.MAX_HEADER_BYTES - len(head))
    assert len(exact) == _w3c.MAX_HEADER_BYTES
    assert baggage.get_baggage("session.id", SessionPropagator().extract({"baggage": exact})) == SESSION
    over = SessionPropagator().extract({"baggage": exact + "v"})
    assert baggage.get_all(over) == {}


def test_a_session_header_that_is_not_text_is_ignored(warnings: pytest.LogCaptureFixture) -> None:
    """A getter may hand back bytes: no session from it, and baggage still counts."""
    ctx = SessionPropagator().extract({"x-dynamo-session-id": b"bytes", "baggage": f"session.id={SESSION}"})
    assert baggage.get_baggage("session.id", ctx) == SESSION
    assert _messages(warnings) == []


def test_extract_never_raises_and_answers_with_the_context_it_was_given(
    warnings: pytest.LogCaptureFixture,
) -> None:
    given = baggage.set_baggage("tenant", "acme", context.Context())
    assert SessionPropagator().extract({}, given, FailingGetter()) is given
    token = context.attach(baggage.set_baggage("current", "yes"))
    try:
        assert SessionPropagator().extract({}, getter=FailingGetter()) is context.get_current()
    finally:
        context.detach(token)
    assert _messages(warnings) == [
        "otel-session: extracting an incoming session failed (RuntimeError); the application goes on "
        "without it (a request is sent as it would be without otel-session). Further failures here are "
        "not logged."
    ]


def test_inject_never_raises_and_says_so_once(warnings: pytest.LogCaptureFixture) -> None:
    with otel_session.trajectory():
        for _ in range(2):
            SessionPropagator().inject({}, hop(TO_DYNAMO), FailingSetter())
    assert _messages(warnings) == [
        "otel-session: injecting session headers failed (RuntimeError); the application goes on "
        "without it (a request is sent as it would be without otel-session). Further failures here are "
        "not logged."
    ]


def test_inject_writes_through_the_callers_setter() -> None:
    pairs: list[tuple[bytes, bytes]] = []
    with otel_session.trajectory() as traj:
        SessionPropagator().inject(pairs, hop(TO_DYNAMO), PairsSetter())
    assert pairs == [(b"x-dynamo-session-id", (traj.session_id or "").encode())]


def test_inject_reads_the_current_context_when_given_none() -> None:
    with otel_session.trajectory() as traj:
        token = context.attach(hop(TO_DYNAMO))
        try:
            carrier: dict[str, str] = {}
            SessionPropagator().inject(carrier)
        finally:
            context.detach(token)
    assert carrier == {"X-Dynamo-Session-ID": traj.session_id}


def test_inject_offers_what_the_context_given_holds_not_the_current_one() -> None:
    """Configured or not, the session comes from the context passed in."""
    given = context.set_value(HOP_KEY, TO_DYNAMO, with_session(SESSION, OUTER))
    for configured in (False, True):
        if configured:
            otel_session.configure(dynamo_hosts=["unused.internal"])
        with otel_session.trajectory(session_id="the-current-one"):
            carrier: dict[str, str] = {}
            SessionPropagator().inject(carrier, given)
        assert carrier == {"X-Dynamo-Session-ID": SESSION, "X-Dynamo-Parent-Session-ID": OUTER}, configured


def test_a_hop_bound_to_its_carrier_writes_that_carrier_only() -> None:
    bound: dict[str, str] = {}
    other: dict[str, str] = {}
    with otel_session.trajectory() as traj:
        ctx = hop(Hop(Route(DYNAMO), frozenset(), bound))
        SessionPropagator().inject(other, ctx)
        SessionPropagator().inject(bound, ctx)
    assert bound == {"X-Dynamo-Session-ID": traj.session_id}
    assert other == {}


def test_inject_replaces_what_otel_session_added_earlier_in_the_hop() -> None:
    """The instrumentation wrote the hop's headers first; a stock propagator composed with ours runs
    later in the same hop and ours rewrites its own headers, never the caller's."""
    added = frozenset({"x-dynamo-session-id", "x-dynamo-parent-session-id", "traceparent"})
    local = SpanContext(int(REMOTE_TRACE_ID, 16), 0x1234, is_remote=False, trace_flags=TraceFlags(1))
    ours = trace.set_span_in_context(trace.NonRecordingSpan(local), with_session(SESSION, OUTER))
    given = context.set_value(HOP_KEY, Hop(Route(DYNAMO), added), ours)
    stale = {
        "X-Dynamo-Session-ID": "stale",
        "X-Dynamo-Parent-Session-ID": "stale-parent",
        "traceparent": REMOTE_PARENT,
    }
    carrier = dict(stale)
    SessionPropagator().inject(carrier, given)
    assert carrier == {
        "X-Dynamo-Session-ID": SESSION,
        "X-Dynamo-Parent-Session-ID": OUTER,
        "traceparent": f"00-{REMOTE_TRACE_ID}-0000000000001234-01",
    }
    callers = dict(stale)
    SessionPropagator().inject(callers, context.set_value(HOP_KEY, Hop(Route(DYNAMO), frozenset()), given))
    assert callers == stale


def test_a_remote_traceparent_passes_on_only_with_tracing_on(
    monkeypatch: pytest.MonkeyPatch, clean_otel_env: None
) -> None:
    """With tracing off, an extracted caller's span is not ours to pass on (unconfigured, or
    configured without tracing); with tracing on it is the parent of the request."""
    incoming = TraceContextTextMapPropagator().extract({"traceparent": REMOTE_PARENT})
    ctx = context.set_value(HOP_KEY, TO_DYNAMO, with_session(SESSION, None, incoming))
    for configure in ({}, {"dynamo_hosts": ["unused.internal"]}):
        if configure:
            otel_session.configure(**configure)  # type: ignore[arg-type]
        carrier: dict[str, str] = {}
        SessionPropagator().inject(carrier, ctx)
        assert carrier == {"X-Dynamo-Session-ID": SESSION}, configure
    receiver = OtlpHttpReceiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        otel_session.configure(dynamo_hosts=["unused.internal"], tracing=True)
        carrier = {}
        SessionPropagator().inject(carrier, ctx)
        assert carrier == {"X-Dynamo-Session-ID": SESSION, "traceparent": REMOTE_PARENT}
    finally:
        otel_session.unconfigure()
        receiver.close()


def test_is_sole_global_tells_ours_alone_from_a_composite() -> None:
    otel_session.configure(dynamo_hosts=["unused.internal"])
    assert is_sole_global()
    previous = get_global_textmap()
    set_global_textmap(CompositePropagator([TraceContextTextMapPropagator(), SessionPropagator()]))
    try:
        assert not is_sole_global()
    finally:
        set_global_textmap(previous)
