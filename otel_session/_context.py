"""Where the session lives: OpenTelemetry baggage of the current context.

Baggage rides on ``contextvars``, so it follows ``await`` and ``asyncio.create_task`` for free and is
separate for every concurrent trajectory, which is exactly the isolation the session needs.
"""

from __future__ import annotations

from opentelemetry import baggage
from opentelemetry.context import Context, create_key

from otel_session._ids import is_valid_session_id

SESSION_KEY = "session.id"
SESSION_ATTRIBUTE = "session.id"  # on spans, as OpenTelemetry's semantic conventions name it
PARENT_KEY = "session.parent_id"

# Set by the client instrumentors for the length of one hop: ``Hop`` (the destination's route and the
# headers they added), so a propagator called inside the hop by an upstream instrumentation knows
# exactly where the request goes. Without it a destination is unknown and receives nothing.
HOP_KEY = create_key("otel_session.hop")
# Set by ``trajectory()`` for an attempt with no group or parent given: ``_siblings.Inferred``, the
# group its first request to a router decides (and the parent it then names), for every request of it.
SIBLINGS_KEY = create_key("otel_session.siblings")
# Set by ``trajectory()`` when sessions are ended: a set the client instrumentors add
# ``(profile name, scheme, host, port)`` to for every router they delivered the session to.
ROUTER_VISITS_KEY = create_key("otel_session.router_visits")


def session_ids(context: Context | None = None) -> tuple[str | None, str | None]:
    """The (session, parent session) IDs in ``context``; anything not a valid ID reads as absent."""
    values = baggage.get_all(context)
    if not values:
        return None, None
    session = values.get(SESSION_KEY)
    if not is_valid_session_id(session):
        return None, None
    parent = values.get(PARENT_KEY)
    return session, parent if is_valid_session_id(parent) else None  # type: ignore[return-value]


def current_session_id() -> str | None:
    """The session ID of the trajectory running here, or ``None`` outside any trajectory."""
    return session_ids()[0]


def with_session(session_id: str, parent_id: str | None, context: Context | None = None) -> Context:
    """A context whose baggage names ``session_id`` (and its parent, or no parent at all)."""
    context = baggage.set_baggage(SESSION_KEY, session_id, context)
    if parent_id is None:
        if PARENT_KEY not in baggage.get_all(context):
            return context  # a trajectory's usual start: no parent to remove, one context fewer
        return baggage.remove_baggage(PARENT_KEY, context)
    return baggage.set_baggage(PARENT_KEY, parent_id, context)
