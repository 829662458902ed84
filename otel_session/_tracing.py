"""Optional trace export: otel-session's own SDK provider, exporting over OTLP while tracing is on.

"Off" (the default) means no SDK provider of ours at work, so otel-session's spans are non-recording
with an invalid context and no ``traceparent`` leaves the process; an SDK with its sampler turned off
would still send one to every host. If the application installed an SDK provider itself, our spans
record into that one instead and ``traceparent`` goes only where the propagator allows it.

OpenTelemetry's global tracer provider can be set once per process, yet ``configure()`` may run again
and ``unconfigure()`` must undo. So otel-session creates one provider per process, at the first
tracing-on, and makes it the global one only when nobody else has (so the application's own spans join
the same traces). Turning tracing off and on again swaps the export pipeline behind that provider
rather than the provider. While tracing is off, ``tracer()`` hands out no tracer of it, and the tracers
handed out before go quiet (see ``_quiet``). The resource (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``) is therefore read once, at the first tracing-on; the exporter settings
(``OTEL_EXPORTER_OTLP_*``) each time tracing turns on.

An SDK provider the application installed is left alone: we do not add our ``SessionSpanProcessor``
to it, because a processor cannot be removed again (``unconfigure()`` could not undo it) and it would
write session IDs into a pipeline that did not ask for them. One line does it for an application
that wants them: ``provider.add_span_processor(SessionSpanProcessor())``.

The SDK itself is imported at the first tracing-on (``_export``, ``_span_processor``), not before: a
process with tracing off never loads it. Its modules would make every request of that process dearer
(more types and objects for the interpreter's caches and the garbage collector to get through:
about 690 more memory cache misses per 30 httpx requests, measured with the caches cold).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from otel_session import _faults

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from otel_session._export import Outlet

INSTALL_HINT = (
    "install the tracing extra: from a clone, pip install '.[tracing]' "
    "(once published, pip install 'otel-session[tracing]')"
)

_TRACER_NAME = "otel_session"
_NOOP_TRACER = trace.NoOpTracer()
_lock = threading.RLock()  # re-entrant: a signal handler may unconfigure() while tracing starts
_provider: TracerProvider | None = None  # created at the first tracing-on, kept for the process
_outlet: Outlet | None = None
_tracer: trace.Tracer | None = None  # set only while tracing is on
_owns_global = False
_instrumented: list[Any] = []
_exit_hook_registered = False


def apply(enabled: bool, upstream: Sequence[tuple[str, str]] = ()) -> None:
    """Turn trace export on or off; turning it on while it is on keeps the running pipeline.

    ``upstream``: the (module, class) of each upstream client instrumentation to record client spans
    with our provider while on (those of the clients otel-session instruments).

    Raises ``ImportError`` (naming the extra to install) or ``ValueError`` (an unusable
    ``OTEL_EXPORTER_OTLP_*`` protocol) before anything changes.
    """
    with _lock:
        if enabled and _tracer is None:
            _start(upstream)
        elif not enabled and _tracer is not None:
            _stop()


def tracer() -> trace.Tracer:
    """The tracer for trajectory spans, looked up at each trajectory start since tracing can switch."""
    global _borrowed
    current = _tracer
    if current is not None:
        return current
    if _owns_global:
        return _NOOP_TRACER  # the global provider is our idle one: off must mean no valid spans
    borrowed = _borrowed
    if borrowed is None:  # asked once: a trajectory start pays no lookup
        borrowed = _borrowed = trace.get_tracer(_TRACER_NAME)
    return borrowed


# The global provider's tracer, when that provider is not ours. Kept for the process: the global
# provider is set at most once, and what the API's proxy provider hands out before that is a proxy
# tracer, which follows the provider set later.
_borrowed: trace.Tracer | None = None


def provider() -> TracerProvider | None:
    """otel-session's provider (whether or not tracing is on now), ``None`` before the first on."""
    return _provider


def _start(upstream: Sequence[tuple[str, str]]) -> None:
    global _provider, _outlet, _tracer, _owns_global, _exit_hook_registered
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        from otel_session import _span_processor
        from otel_session._export import Outlet, otlp_exporter

        if not _span_processor.sdk_based():  # made while the SDK was missing, which is installed now
            importlib.reload(_span_processor)
    except ImportError as exc:
        raise ImportError(f"otel-session tracing needs the OpenTelemetry SDK: {INSTALL_HINT}") from exc
    try:
        exporter = otlp_exporter()
    except ImportError as exc:
        raise ImportError(f"{exc}: {INSTALL_HINT}") from exc
    if _provider is None or _outlet is None:
        outlet = Outlet()
        outlet.connect(exporter)  # first: a pipeline that cannot start must leave the global provider alone
        _provider = TracerProvider(resource=Resource.create(), shutdown_on_exit=False)
        _provider.add_span_processor(_span_processor.SessionSpanProcessor())
        _provider.add_span_processor(outlet)
        _outlet = outlet
        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            trace.set_tracer_provider(_provider)
        _owns_global = trace.get_tracer_provider() is _provider
    else:
        _outlet.connect(exporter)
    _quiet(_provider, False)
    # An application with an SDK provider of its own instruments its clients itself, into its
    # provider, whenever it likes: instrumenting them here first would turn its own call into a no-op.
    _instrumented[:] = _instrument_clients(_provider, upstream) if _owns_global else []
    _tracer = _provider.get_tracer(_TRACER_NAME)
    if not _exit_hook_registered:
        atexit.register(_at_exit)
        _exit_hook_registered = True


def _stop() -> None:
    global _tracer
    _tracer = None
    for instrumentor in _instrumented:
        try:
            instrumentor.uninstrument()
        except Exception as exc:
            _faults.report("removing the client instrumentation", exc)
    _instrumented.clear()
    if _provider is not None:
        _quiet(_provider, True)
    if _outlet is not None:
        _outlet.shutdown()


def _quiet(tracer_provider: TracerProvider, quiet: bool) -> None:
    """Make every tracer of ours, including those already handed out, start no valid span while off.

    Tracers outlive ``off``: an aiohttp session created while tracing was on keeps the instrumentation's
    tracer, and the application keeps tracers from the global provider when that is ours. Quiet, they
    hand out non-recording spans that carry only their parent's context, so no new ``traceparent``
    appears. This uses the SDK's experimental tracer configurator (SDK 1.45); where that is missing,
    those tracers keep recording into the outlet, which drops everything.
    """
    try:
        from opentelemetry.sdk.trace import _default_tracer_configurator, _disable_tracer_configurator
    except ImportError:
        return
    try:
        tracer_provider._set_tracer_configurator(
            tracer_configurator=_disable_tracer_configurator if quiet else _default_tracer_configurator
        )
    except Exception as exc:
        _faults.report("switching otel-session's tracers on or off", exc)


def _at_exit() -> None:
    with _lock:
        if _tracer is not None:
            _stop()


_forkers_flush = False  # multiprocessing's children flush at their exit (our provider is made once)


def _flush_in_multiprocessing_children() -> None:
    """``os.register_at_fork`` hook, before a fork: a multiprocessing worker leaves through
    ``os._exit``, past ``atexit``, so while tracing is on its spans are flushed (bounded, as at exit) by
    multiprocessing's own finalizers, which it runs before leaving. Registered with multiprocessing's
    after-fork hooks, since a worker clears its finalizers as it starts."""
    global _forkers_flush
    if _tracer is None or _forkers_flush or "multiprocessing" not in sys.modules:
        return
    try:
        import multiprocessing.util

        multiprocessing.util.register_after_fork(_provider, _flush_at_worker_exit)
        _forkers_flush = True
    except Exception as exc:
        _faults.report("flushing forked workers' spans", exc)


def _flush_at_worker_exit(_: object) -> None:
    import multiprocessing.util

    multiprocessing.util.Finalize(None, _at_exit, exitpriority=0)


if hasattr(os, "register_at_fork"):  # where processes fork (not on Windows)
    os.register_at_fork(before=_flush_in_multiprocessing_children)


def _instrument_clients(tracer_provider: TracerProvider, upstream: Sequence[tuple[str, str]]) -> list[Any]:
    """Client spans from the upstream instrumentors, with our provider; returns those to undo later.

    One already instrumented by someone else (``opentelemetry-instrument``, the application) is left
    as it is, with its provider, and not undone by us.
    """
    done = []
    for module, class_name in upstream:
        try:
            instrumentor = getattr(importlib.import_module(module), class_name)()
        except (ImportError, AttributeError):
            continue  # that instrumentation is not installed: this client gets no spans, nothing else changes
        if instrumentor.is_instrumented_by_opentelemetry:
            continue
        try:
            instrumentor.instrument(tracer_provider=tracer_provider)
        except Exception as exc:
            _faults.report(f"instrumenting {class_name} for client spans", exc)
            continue
        if instrumentor.is_instrumented_by_opentelemetry:
            done.append(instrumentor)
    return done
