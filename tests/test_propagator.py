"""SessionPropagator as the OpenTelemetry machinery uses it: carriers, destinations, extract."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry import baggage, context
from opentelemetry.propagate import get_global_textmap, inject

import otel_session
from otel_session._context import DESTINATION_KEY
from otel_session._hosts import HostRules, parse_patterns
from otel_session._propagator import SessionPropagator

RULES = HostRules(parse_patterns(["dynamo:8000"]), parse_patterns(["gym"]))


def test_destination_from_the_host_entry_of_an_httpx_header_copy() -> None:
    propagator = SessionPropagator(RULES)
    with otel_session.trajectory() as traj:
        to_dynamo = httpx.Headers({"host": "dynamo:8000"})
        to_other = httpx.Headers({"host": "dynamo:8001"})
        propagator.inject(to_dynamo)
        propagator.inject(to_other)
    assert to_dynamo["x-dynamo-session-id"] == traj.session_id
    assert dict(to_other) == {"host": "dynamo:8001"}


def test_unknown_destination_gets_nothing() -> None:
    """A plain dict (Ray's helper, a queue message) says nothing about where it goes."""
    propagator = SessionPropagator(RULES)
    carrier: dict[str, str] = {}
    with otel_session.trajectory():
        propagator.inject(carrier)
    assert carrier == {}


def test_destination_from_the_context_wins() -> None:
    propagator = SessionPropagator(RULES)
    with otel_session.trajectory() as traj:
        carrier: dict[str, str] = {"Host": "elsewhere"}
        ctx = context.set_value(DESTINATION_KEY, ("http", "gym", None))
        propagator.inject(carrier, ctx)
    assert carrier == {"Host": "elsewhere", "baggage": f"session.id={traj.session_id}"}  # gym is trusted
    with otel_session.trajectory() as traj:
        carrier = {}
        propagator.inject(carrier, context.set_value(DESTINATION_KEY, ("http", "dynamo", 8000)))
        assert carrier == {"X-Dynamo-Session-ID": traj.session_id}


def test_a_copied_session_header_is_taken_back_for_another_host() -> None:
    propagator = SessionPropagator(RULES)
    with otel_session.trajectory() as traj:
        assert traj.session_id
        leaked = httpx.Headers({"host": "evil.example", "X-Dynamo-Session-ID": traj.session_id})
        handset = httpx.Headers({"host": "evil.example", "X-Dynamo-Session-ID": "mine"})
        propagator.inject(leaked)
        propagator.inject(handset)
    assert "x-dynamo-session-id" not in leaked
    assert handset["x-dynamo-session-id"] == "mine"


def test_configure_installs_it_globally_and_it_follows_reconfiguration() -> None:
    otel_session.configure(dynamo_hosts=["first"])
    propagator = get_global_textmap()
    assert isinstance(propagator, SessionPropagator)
    otel_session.configure(dynamo_hosts=["second"])
    with otel_session.trajectory() as traj:
        first, second = {"host": "first"}, {"host": "second"}
        inject(first)
        inject(second)
    assert first == {"host": "first"}
    assert second["X-Dynamo-Session-ID"] == traj.session_id


def test_extract_prefers_the_dynamo_header_and_drops_invalid_values() -> None:
    propagator = SessionPropagator(RULES)
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


def test_env_rules_when_not_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "envhost")
    propagator = SessionPropagator()
    with otel_session.trajectory() as traj:
        carrier = {"host": "envhost"}
        propagator.inject(carrier)
    assert carrier["X-Dynamo-Session-ID"] == traj.session_id


def test_fields_name_everything_it_may_write() -> None:
    assert SessionPropagator().fields >= {
        "x-dynamo-session-id",
        "x-dynamo-parent-session-id",
        "baggage",
        "traceparent",
    }
