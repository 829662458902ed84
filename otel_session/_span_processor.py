"""``SessionSpanProcessor``: ``session.id`` on every span a trajectory's context starts.

A module of its own because it subclasses the OpenTelemetry SDK's ``SpanProcessor``: it is imported
when tracing turns on, or when an application asks ``otel_session`` for the class, never by a process
with tracing off. Without the SDK it is a plain class with the same ``on_start``, for code that names it;
``sdk_based()`` tells the two apart (the SDK may be installed later in the same process).
"""

from __future__ import annotations

from opentelemetry.context import Context

from otel_session import _faults
from otel_session._context import SESSION_ATTRIBUTE, session_ids

try:
    from opentelemetry.sdk.trace import Span, SpanProcessor
except ImportError:  # the [tracing] extra is not installed: the class still exists, for code naming it
    Span = SpanProcessor = object  # type: ignore[misc,assignment]


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


def sdk_based() -> bool:
    """Whether ``SessionSpanProcessor`` is the SDK's kind of processor, not the stand-in made while the
    SDK could not be imported."""
    return SpanProcessor is not object
