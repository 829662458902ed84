"""Where the session lives: OpenTelemetry baggage of the current context.

Baggage rides on ``contextvars``, so it follows ``await`` and ``asyncio.create_task`` for free and is
separate for every concurrent trajectory, which is exactly the isolation the session needs.
"""

from __future__ import annotations

from opentelemetry import baggage
from opentelemetry.context import Context, create_key

from otel_session._ids import _VISIBLE_ASCII

SESSION_KEY = "session.id"
PARENT_KEY = "session.parent_id"

# Set by the client hooks around a request so the propagator knows the exact destination even when
# its carrier (a header copy without a port, or a plain dict) cannot tell.
DESTINATION_KEY = create_key("otel_session.destination")


def session_ids(context: Context | None = None) -> tuple[str | None, str | None]:
    """The (session, parent session) IDs in ``context``; anything not a valid ID reads as absent."""
    values = baggage.get_all(context)
    if not values:
        return None, None
    session = values.get(SESSION_KEY)
    # ``is_valid_session_id`` spelled out: this runs on every request of a configured process.
    if not isinstance(session, str) or _VISIBLE_ASCII.fullmatch(session) is None:
        return None, None
    parent = values.get(PARENT_KEY)
    if parent is not None and (not isinstance(parent, str) or _VISIBLE_ASCII.fullmatch(parent) is None):
        parent = None
    return session, parent


def current_session_id() -> str | None:
    """The session ID of the trajectory running here, or ``None`` outside any trajectory."""
    return session_ids()[0]


def with_session(session_id: str, parent_id: str | None, context: Context | None = None) -> Context:
    """A context whose baggage names ``session_id`` (and its parent, or no parent at all)."""
    context = baggage.set_baggage(SESSION_KEY, session_id, context)
    if parent_id is None:
        return baggage.remove_baggage(PARENT_KEY, context)
    return baggage.set_baggage(PARENT_KEY, parent_id, context)
