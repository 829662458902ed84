"""SessionPropagator as the OpenTelemetry machinery uses it: carriers, destinations, extract."""

from __future__ import annotations

import httpx
from multidict import CIMultiDict
from opentelemetry import baggage, context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagate import get_global_textmap, inject
from opentelemetry.propagators.composite import CompositePropagator

import otel_session
from otel_session._context import HOP_KEY
from otel_session._hop import Hop
from otel_session._hosts import NOWHERE, Route
from otel_session._propagator import SessionPropagator
from otel_session._routers import BUILTIN, DYNAMO

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
