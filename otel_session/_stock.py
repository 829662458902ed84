"""Stock propagators beside ours: found wherever they can be set up, and warned about once.

OpenTelemetry's stock ``baggage`` and ``tracecontext`` propagators send ``session.id`` and
``traceparent`` to every host, through every client, instrumented by us or not. They can be put in
force by ``OTEL_PROPAGATORS``, either distro, or the application itself (``propagate.
set_global_textmap``, before or after ``configure()``), so every one of those paths checks here.
"""

from __future__ import annotations

from opentelemetry import propagate
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator

from otel_session import _faults

_STOCK = {"W3CBaggagePropagator": "baggage", "TraceContextTextMapPropagator": "tracecontext"}
_SENDS = {"baggage": "baggage (session.id)", "tracecontext": "traceparent"}


def stock_leaks(propagator: TextMapPropagator) -> list[str]:
    """The stock propagators in ``propagator`` that send our members or spans to every host.

    A stock ``baggage`` propagator sends ``session.id`` everywhere and ``tracecontext`` sends
    ``traceparent`` everywhere. Composed with ours, ours takes their copies back on the requests of
    the clients it instruments, but not on any other client's.
    """
    members = list(propagator._propagators) if isinstance(propagator, CompositePropagator) else [propagator]
    return [_STOCK[type(p).__name__] for p in members if type(p).__name__ in _STOCK]


_leak_warned: list[bool] = []
_leaks_checked: object = None  # the global propagator last checked for stock ones beside ours


def warn_stock_leaks(propagator: TextMapPropagator | None = None) -> None:
    """One warning per process when stock propagators are in force beside ours (``propagator``, by
    default the global one): on every path that can set them up, ``configure()`` (the propagator it
    replaces), either distro, and the propagator itself when loaded only from ``OTEL_PROPAGATORS``."""
    global _leaks_checked
    if propagator is None:
        propagator = _leaks_checked = propagate.get_global_textmap()
    if _leak_warned:
        return
    leaks = stock_leaks(propagator)
    if not leaks:
        return
    _leak_warned.append(True)
    _faults.warn(
        "otel-session: the global propagator includes the stock %s propagator(s) (from OTEL_PROPAGATORS "
        "or propagate.set_global_textmap), which send %s to every host through clients otel-session does "
        "not instrument; set OTEL_PROPAGATORS=dynamo_session (it sends traceparent and baggage itself, "
        "only to routers and trusted hosts), run with OTEL_PYTHON_DISTRO=otel_session, and do not replace "
        "the global propagator after configure()",
        " and ".join(leaks),
        " and ".join(_SENDS[name] for name in leaks),
    )


def check_global() -> None:
    """``warn_stock_leaks`` if the global propagator changed since it was last checked: the app may
    replace it after ``configure()`` (``propagate.set_global_textmap``), and then ours never runs."""
    if _leaks_checked is not propagate.get_global_textmap():
        warn_stock_leaks()
