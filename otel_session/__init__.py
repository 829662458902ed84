"""otel-session: one Dynamo session per RL trajectory attempt, delivered to Dynamo and nowhere else.

import otel_session
otel_session.configure(dynamo_hosts=["dynamo-frontend:8000"])
with otel_session.trajectory() as traj:
    ...  # every httpx / openai / aiohttp request to Dynamo carries X-Dynamo-Session-ID
"""

from typing import TYPE_CHECKING, Any

from otel_session._carry import bind, resume, session_carrier
from otel_session._config import add_dynamo_hosts, configure, unconfigure
from otel_session._context import current_session_id
from otel_session._ids import PARENT_SESSION_HEADER, SESSION_HEADER
from otel_session._propagator import SessionPropagator
from otel_session._settings import Settings
from otel_session._trajectory import trajectory

if TYPE_CHECKING:
    from otel_session._span_processor import SessionSpanProcessor

__all__ = [
    "PARENT_SESSION_HEADER",
    "SESSION_HEADER",
    "SessionPropagator",
    "SessionSpanProcessor",
    "Settings",
    "add_dynamo_hosts",
    "bind",
    "configure",
    "current_session_id",
    "resume",
    "session_carrier",
    "trajectory",
    "unconfigure",
]


if not TYPE_CHECKING:  # for type checkers the name is imported above, and no other name is made up

    def __getattr__(name: str) -> Any:
        """``SessionSpanProcessor`` on first use: it subclasses the OpenTelemetry SDK's
        ``SpanProcessor``, and a process with tracing off never loads the SDK."""
        if name == "SessionSpanProcessor":
            from otel_session import _span_processor

            return _span_processor.SessionSpanProcessor
        raise AttributeError(f"module 'otel_session' has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
