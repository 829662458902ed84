"""``SessionSpanProcessor``: ``session.id`` on every span a trajectory's context starts.

A module of its own because it subclasses the OpenTelemetry SDK's ``SpanProcessor``: it is imported
when tracing turns on, or when an application asks ``otel_session`` for the class, never by a process
with tracing off. Without the SDK it is a plain class with the same ``on_start``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry.context import Context

from otel_session import _faults
from otel_session._context import session_ids

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import Span

try:
    from opentelemetry.sdk.trace import SpanProcessor
except ImportError:  # the [tracing] extra is not installed: the class still exists, for code naming it
    SpanProcessor = object  # type: ignore[misc,assignment]

SESSION_ATTRIBUTE = "session.id"


class SessionSpanProcessor(SpanProcessor):
    """Puts ``session.id`` on every span started inside a trajectory, read from the context's baggage.

    Client spans are started by instrumentations that know nothing of sessions; span start is the one
    place that sees every span, each retry's included, with the trajectory's context.
    """

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        try:
            session, _ = session_ids(parent_context)
            if session is not None:
                span.set_attribute(SESSION_ATTRIBUTE, session)
        except Exception as exc:  # a span without the attribute beats a failed request
            _faults.report("adding session.id to a span", exc)
