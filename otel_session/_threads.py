"""Context into threads and thread pools: upstream's ``ThreadingInstrumentor``, on while otel-session is.

An attempt's session lives in the context, and a framework that hands its client call to a
``ThreadPoolExecutor`` (``loop.run_in_executor`` submits to one) or a ``Thread`` would send it from a
thread whose context is empty. Upstream's instrumentation captures the context at ``submit``/``start``
and attaches it in the worker for that task only, detached after it, so a pool thread reused by
another attempt never keeps the old one. ``configure()`` turns it on unless
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names ``threading``; ``unconfigure()`` turns it off only
if otel-session turned it on (an application's own stays).
"""

from __future__ import annotations

from typing import Any

from otel_session import _faults, _registry

ENTRY_POINT = "threading"  # upstream's entry point name, as OTEL_PYTHON_DISABLED_INSTRUMENTATIONS names it
_ours: Any = None  # the instrumentor, while otel-session is the one that turned it on


def _instrumentor() -> Any:
    """Upstream's ``ThreadingInstrumentor`` (a singleton), or ``None`` where it is not installed."""
    try:
        from opentelemetry.instrumentation.threading import ThreadingInstrumentor
    except ImportError:
        return None
    return ThreadingInstrumentor()


def apply(on: bool) -> None:
    """Context follows work into threads while ``on`` (and not disabled); off again when not."""
    global _ours
    try:
        off = _registry.disabled()
        if on and "*" not in off and ENTRY_POINT not in off:
            instrumentor = _instrumentor()
            if instrumentor is None:
                _faults.warn(
                    "otel-session: opentelemetry-instrumentation-threading is not installed, so an "
                    "attempt's session does not follow work into thread pools; install it "
                    "(it is a dependency of otel-session)"
                )
            elif not instrumentor.is_instrumented_by_opentelemetry:
                instrumentor.instrument()
                _ours = instrumentor
        elif _ours is not None:
            if _ours.is_instrumented_by_opentelemetry:
                _ours.uninstrument()
            _ours = None
    except Exception as exc:  # threads go on without it, never broken
        _faults.report("instrumenting threading", exc)


def on() -> bool:
    """Whether upstream's threading instrumentation is on (ours or the application's)."""
    instrumentor = _instrumentor()
    return instrumentor is not None and bool(instrumentor.is_instrumented_by_opentelemetry)
