"""What tracing on needs of the OpenTelemetry SDK: the export pipeline behind otel-session's provider.

Imported only when tracing turns on (``_tracing._start``): a process with tracing off never loads the
SDK, whose modules would otherwise add to every request's cost by making the process bigger (more
types and objects for the interpreter's caches and the collector to get through).

Export never slows or fails a request: spans are queued for a background thread, the OTLP exporter
gives up after ``DEFAULT_EXPORT_TIMEOUT_S`` (unless ``OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT`` says
otherwise), and shutdown, explicit or at process exit, drops what it cannot send within
``SHUTDOWN_BUDGET_S``, so a collector that is down costs at most budget + one export timeout.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otel_session import _tracing

ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_TIMEOUT = "OTEL_EXPORTER_OTLP_TIMEOUT"
ENV_TRACES_TIMEOUT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
# Seconds. The OTLP default (10 s) would let a dead collector hold up shutdown and process exit.
DEFAULT_EXPORT_TIMEOUT_S = 2.0
SHUTDOWN_BUDGET_S = 1.5


class DeadlineExporter(SpanExporter):
    """Drops batches once shutdown's budget is spent, so exit never waits for a collector that is down.

    The SDK's batch processor waits up to 30 s at shutdown and ignores its export timeout; this
    bound needs only the public exporter interface.
    """

    def __init__(self, inner: SpanExporter) -> None:
        self._inner = inner
        self._deadline = float("inf")

    def expire_in(self, seconds: float) -> None:
        self._deadline = time.monotonic() + seconds

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if time.monotonic() >= self._deadline:
            return SpanExportResult.FAILURE
        return self._inner.export(spans)

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
        deadline_exporter = DeadlineExporter(exporter)
        self._pipeline = (BatchSpanProcessor(deadline_exporter), deadline_exporter)

    def on_end(self, span: ReadableSpan) -> None:
        pipeline = self._pipeline
        if pipeline is not None:
            pipeline[0].on_end(span)

    def shutdown(self) -> None:
        """Send what can be sent within ``SHUTDOWN_BUDGET_S``, then close the exporter."""
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            processor, exporter = pipeline
            exporter.expire_in(SHUTDOWN_BUDGET_S)
            processor.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        pipeline = self._pipeline
        return True if pipeline is None else pipeline[0].force_flush(timeout_millis)


def otlp_exporter() -> SpanExporter:
    """The OTLP exporter the standard variables ask for (default ``http/protobuf``, as the spec says)."""
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
    except ImportError as exc:
        hint = _tracing.INSTALL_HINT
        raise ImportError(f"otel-session tracing over {protocol} needs {module}: {hint}") from exc
    timeout_set = os.environ.get(ENV_TRACES_TIMEOUT) or os.environ.get(ENV_TIMEOUT)
    exporter: SpanExporter = exporter_class(timeout=None if timeout_set else DEFAULT_EXPORT_TIMEOUT_S)
    return exporter
