"""What tracing on needs of the OpenTelemetry SDK: the export pipeline behind otel-session's provider.

Imported only when tracing turns on (``_tracing._start``): a process with tracing off never loads the
SDK, whose modules would otherwise add to every request's cost by making the process bigger (more
types and objects for the interpreter's caches and the collector to get through).

Export never slows or fails a request: spans are queued for a background thread, and each export
gives up after ``DEFAULT_EXPORT_TIMEOUT_S`` in all (or what ``OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT``
says, in seconds as the Python exporters read it). Shutdown, explicit or at process exit, drops what it
cannot send within ``SHUTDOWN_BUDGET_S`` and returns by then, so a collector that is down, or one that
answers a byte at a time, holds ``unconfigure()`` and process exit for at most that budget.
"""

from __future__ import annotations

import contextvars
import importlib
import math
import os
import threading
import time
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otel_session._faults import warn

ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_TIMEOUT = "OTEL_EXPORTER_OTLP_TIMEOUT"
ENV_TRACES_TIMEOUT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
# Seconds. The OTLP default (10 s) would let a dead collector hold up shutdown and process exit.
DEFAULT_EXPORT_TIMEOUT_S = 2.0
SHUTDOWN_BUDGET_S = 1.5


class DeadlineExporter(SpanExporter):
    """Bounds each export in total time, and drops batches once shutdown's budget is spent.

    The OTLP exporters' timeout bounds each read, not the export: a collector that drips a byte at a
    time holds an export for as long as it drips. So the inner export runs on a daemon thread and is
    given up (a ``FAILURE``) once its time is up; while it still hangs, later batches are dropped at once
    rather than each leaving another thread behind. The SDK's batch processor waits up to 30 s at
    shutdown and ignores its export timeout; these bounds need only the public exporter interface.
    """

    def __init__(self, inner: SpanExporter, timeout_s: float = DEFAULT_EXPORT_TIMEOUT_S) -> None:
        self._inner = inner
        self._timeout_s = timeout_s
        self._deadline = math.inf
        self._hanging: threading.Thread | None = None
        self._warned = False

    def expire_in(self, seconds: float) -> None:
        self._deadline = time.monotonic() + seconds

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        budget = min(self._timeout_s, self._deadline - time.monotonic())
        hanging = self._hanging
        if budget <= 0 or (hanging is not None and hanging.is_alive()):
            return SpanExportResult.FAILURE
        outcome: list[SpanExportResult | Exception] = []
        # The batch processor's context says "suppress instrumentation": the export's own HTTP request
        # must not become a span, so the thread runs in a copy of it.
        context = contextvars.copy_context()

        def run() -> None:
            try:
                outcome.append(context.run(self._inner.export, spans))
            except Exception as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run, name="otel-session-export", daemon=True)
        thread.start()
        thread.join(budget)
        if not outcome:
            self._hanging = thread
            self._warn_once(budget)
            return SpanExportResult.FAILURE
        result = outcome[0]
        if isinstance(result, Exception):
            raise result  # the batch processor logs it, as it would without us
        return result

    def _warn_once(self, budget: float) -> None:
        if self._warned:
            return
        self._warned = True
        warn(
            "otel-session: a trace export got no complete answer from the collector within %.1f s; it is "
            "given up, and batches are dropped while it hangs. Further ones are not logged.",
            budget,
        )

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class Outlet(SpanProcessor):
    """Hands ended spans to the current export pipeline, or drops them while tracing is off.

    The provider may be the global one, which cannot be replaced, so on/off swaps what is behind this.
    """

    def __init__(self) -> None:
        self._pipeline: tuple[BatchSpanProcessor, DeadlineExporter] | None = None

    def connect(self, exporter: SpanExporter) -> None:
        deadline_exporter = exporter if isinstance(exporter, DeadlineExporter) else DeadlineExporter(exporter)
        try:
            processor = BatchSpanProcessor(deadline_exporter)
        except Exception as exc:  # it reads the OTEL_BSP_* variables itself
            raise ValueError(
                f"the OTEL_BSP_* variables: the batch span processor cannot start ({exc})"
            ) from None
        self._pipeline = (processor, deadline_exporter)

    def on_end(self, span: ReadableSpan) -> None:
        pipeline = self._pipeline
        if pipeline is not None:
            pipeline[0].on_end(span)

    def shutdown(self) -> None:
        """Send what can be sent within ``SHUTDOWN_BUDGET_S``, then close the exporter; returns by then.

        The processor's shutdown runs on a daemon thread: whatever of it outlasts the budget (closing an
        exporter whose last request still hangs) carries on there and never holds the caller or exit.
        """
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            processor, exporter = pipeline
            exporter.expire_in(SHUTDOWN_BUDGET_S)
            _run_within(SHUTDOWN_BUDGET_S, processor.shutdown, "otel-session-export-shutdown")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        pipeline = self._pipeline
        return True if pipeline is None else pipeline[0].force_flush(timeout_millis)


def _run_within(seconds: float, work: Callable[[], object], name: str) -> None:
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    thread.join(seconds)


MIN_EXPORT_TIMEOUT_S, MAX_EXPORT_TIMEOUT_S = 0.01, 3600.0


def export_timeout() -> float:
    """Seconds each export may take in all: the variable's, or ``DEFAULT_EXPORT_TIMEOUT_S``.

    A value that is not a number of seconds from 0.01 to 3600 gets the default and one warning line
    naming the variable, where the exporters would fall back to their own 10 s, or fail every export
    (``-1``, ``1e-9``: no time to connect; ``1e10``: a deadline past what the platform's clock holds).
    """
    variable = ENV_TRACES_TIMEOUT if os.environ.get(ENV_TRACES_TIMEOUT) else ENV_TIMEOUT
    raw = os.environ.get(variable)
    if not raw:
        return DEFAULT_EXPORT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if MIN_EXPORT_TIMEOUT_S <= seconds <= MAX_EXPORT_TIMEOUT_S:
        return seconds
    warn(
        "otel-session: %s=%r is not a number of seconds from 0.01 to 3600; each trace export gives up "
        "after %s s",
        variable,
        raw,
        DEFAULT_EXPORT_TIMEOUT_S,
    )
    return DEFAULT_EXPORT_TIMEOUT_S


def otlp_exporter() -> SpanExporter:
    """The OTLP exporter the standard variables ask for (default ``http/protobuf``, as the spec says).

    It comes wrapped in a :class:`DeadlineExporter` holding the same timeout, so the timeout bounds
    each export in all, not each read.
    """
    variable = ENV_TRACES_PROTOCOL if os.environ.get(ENV_TRACES_PROTOCOL) else ENV_PROTOCOL
    raw = os.environ.get(variable) or "http/protobuf"
    protocol = raw.strip().lower()
    if protocol == "grpc":
        module = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
    elif protocol == "http/protobuf":
        module = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    else:
        raise ValueError(f"{variable}={raw!r}: otel-session exports traces over 'grpc' or 'http/protobuf'")
    try:
        exporter_class = importlib.import_module(module).OTLPSpanExporter
    except ImportError as exc:  # _tracing adds how to install it
        raise ImportError(f"otel-session tracing over {protocol} needs {module}") from exc
    traces_timeout = os.environ.get(ENV_TRACES_TIMEOUT)
    if protocol == "grpc" and traces_timeout and not _is_number(traces_timeout):
        # The gRPC exporter parses this variable itself, whatever timeout it is given, and fails.
        raise ValueError(
            f"{ENV_TRACES_TIMEOUT}={traces_timeout!r} is not a number of seconds, which the gRPC "
            f"exporter cannot start with; fix or unset it"
        )
    timeout = export_timeout()
    try:  # given explicitly, so neither exporter reads the variables again (with fallbacks of its own)
        exporter = exporter_class(timeout=timeout)
    except Exception as exc:  # e.g. OTEL_EXPORTER_OTLP_COMPRESSION=bogus, which the exporter reads itself
        raise ValueError(
            f"the OTEL_EXPORTER_OTLP_* variables: the {protocol} exporter cannot start "
            f"({type(exc).__name__}: {exc})"
        ) from None
    return DeadlineExporter(exporter, timeout)


def _is_number(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return True
