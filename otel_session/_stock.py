"""Stock propagators beside ours: found wherever they can be set up, and warned about once.

OpenTelemetry's stock ``baggage`` and ``tracecontext`` propagators send ``session.id`` and
``traceparent`` to every host, through every client, instrumented by us or not. They can be put in
force by ``OTEL_PROPAGATORS``, either distro, or the application itself (``propagate.
set_global_textmap``, before or after ``configure()``), so every one of those paths checks here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import propagate
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_session import _faults

_SENDS = {"baggage": "baggage (session.id)", "tracecontext": "traceparent"}


def stock_leaks(propagator: TextMapPropagator) -> list[str]:
    """The stock propagators in ``propagator`` that send our members or spans to every host: at any
    depth of composition, and their subclasses too.

    A stock ``baggage`` propagator sends ``session.id`` everywhere and ``tracecontext`` sends
    ``traceparent`` everywhere. Composed with ours, ours takes their copies back on the requests of
    the clients it instruments, but not on any other client's.
    """
    found: list[str] = []
    todo, seen = [propagator], 0
    while todo and seen < 64:  # a composite holding itself must not hang the check
        member, seen = todo.pop(0), seen + 1
        if isinstance(member, CompositePropagator):
            todo.extend(getattr(member, "_propagators", ()))
        elif isinstance(member, W3CBaggagePropagator):
            found.append("baggage")
        elif isinstance(member, TraceContextTextMapPropagator):
            found.append("tracecontext")
    return list(dict.fromkeys(found))


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


_settling = 0  # configure() or unconfigure() in progress: the global propagator is theirs to change


@contextlib.contextmanager
def settling() -> Iterator[None]:
    """While ``configure()`` or ``unconfigure()`` changes the global propagator, a trajectory starting
    on another thread must not take the propagator it replaces for one the application set."""
    global _settling
    _settling += 1
    try:
        yield
    finally:
        _settling -= 1


def check_global() -> None:
    """``warn_stock_leaks`` if the global propagator changed since it was last checked: the app may
    replace it after ``configure()`` (``propagate.set_global_textmap``), and then ours never runs."""
    if not _settling and _leaks_checked is not propagate.get_global_textmap():
        warn_stock_leaks()
