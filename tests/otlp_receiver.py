"""Loopback servers for the tracing tests: OTLP trace receivers and an HTTP server that records headers.

No collector binary can be installed here, so the receivers stand in for one: real HTTP
(``POST /v1/traces``) and gRPC (``TraceService/Export``) servers on 127.0.0.1 that decode the real
opentelemetry-proto ``ExportTraceServiceRequest`` messages the SDK exporters send.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
import zlib
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived, with ids in hex like ``traceparent`` writes them."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str


class _Collected:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            requests = list(self.requests)
        found = []
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        found.append(
                            ReceivedSpan(
                                name=span.name,
                                trace_id=span.trace_id.hex(),
                                span_id=span.span_id.hex(),
                                parent_span_id=span.parent_span_id.hex(),
                                kind=span.kind,
                                attributes=_attributes(span.attributes),
                                resource=resource,
                                scope=scope_spans.scope.name,
                            )
                        )
        return found

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0
    ) -> list[ReceivedSpan]:
        """The spans received once ``predicate`` holds; the last ones seen if it never does."""
        deadline = time.monotonic() + timeout
        spans = self.spans()
        while not predicate(spans) and time.monotonic() < deadline:
            time.sleep(0.02)
            spans = self.spans()
        return spans


class OtlpHttpReceiver(_Collected):
    """OTLP/HTTP: ``POST /v1/traces`` with a protobuf body (optionally gzip or deflate)."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in two writes

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # a 50 ms poll: shutdown() waits up to one (0.5 s by default) for serve_forever to notice
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class OtlpGrpcReceiver(_Collected):
    """OTLP/gRPC: the ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` method."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(
                self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
            ) -> trace_service_pb2.ExportTraceServiceResponse:
                receiver.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            Service(), self._server
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=None)


@dataclass
class HeaderServer:
    """An HTTP server that records every request's headers and answers like a tiny OpenAI endpoint.

    ``fail_first`` makes the first N requests answer 503 (with ``retry-after-ms: 1`` so the openai SDK
    retries at once), to see client retries as separate spans.
    """

    fail_first: int = 0
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        server = self
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in two writes

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length", "0") or 0)
                if length:
                    self.rfile.read(length)
                with server._lock:
                    server.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                    # a Dynamo frontend's /health (read to size sibling groups) is never one of them
                    failing = self.path != "/health" and server.fail_first > 0
                    if failing:
                        server.fail_first -= 1
                if failing:
                    status, body, extra = 503, b'{"error": {"message": "busy"}}', {"retry-after-ms": "1"}
                else:
                    status, body, extra = 200, json.dumps(_COMPLETION).encode(), {}
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for key, value in extra.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self.authority = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.authority}"
        # a 50 ms poll, as above
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def headers(self, name: str) -> list[str | None]:
        """The value of header ``name`` on every request so far, ``None`` where it was absent (our
        own read of a Dynamo frontend's ``/health``, which carries nothing of a trajectory, left out)."""
        with self._lock:
            return [headers.get(name.lower()) for path, headers in self.seen if path != "/health"]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_COMPLETION = {
    "id": "chatcmpl-test",
    "object": "chat.completion",
    "created": 0,
    "model": "test-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
