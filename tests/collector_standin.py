"""collector-config.yaml's ``attributes`` processor, applied to real OTLP traffic on its way to a backend.

No collector binary can be installed here (see tests/test_collector_config.py), so this stands in for
the one processor whose effect on a backend's grouping matters: an OTLP/HTTP forwarder on loopback
that applies the config's ``hash`` and ``delete`` actions to every span's attributes and posts the
result on to the next hop (Phoenix in tests/test_phoenix.py). ``hash`` is what the contrib
collector's attributes processor does (``internal/coreinternal/attraction``, ``sha2Hasher``): a
string value becomes the lowercase hex SHA-256 of its UTF-8 bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import threading
import urllib.error
import urllib.request
import zlib
from collections.abc import MutableSequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

CONFIG = Path(__file__).resolve().parent.parent / "collector-config.yaml"
SESSION_PROCESSOR = "attributes/session_ids"
SUPPORTED = {"hash", "delete"}
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy


def load_actions(processor: str = SESSION_PROCESSOR, config: Path = CONFIG) -> list[tuple[str, str]]:
    """``(key, action)`` pairs of one attributes processor, in the config's order."""
    actions = yaml.safe_load(config.read_text())["processors"][processor]["actions"]
    pairs = [(str(action["key"]), str(action["action"])) for action in actions]
    unsupported = {action for _, action in pairs} - SUPPORTED
    assert not unsupported, f"{processor}: the stand-in applies only {SUPPORTED}, not {unsupported}"
    return pairs


def collector_hash(value: str) -> str:
    """The contrib ``hash`` action on a string attribute."""
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


def apply_actions(actions: list[tuple[str, str]], attributes: MutableSequence[KeyValue]) -> None:
    """Apply the actions to one span's OTLP attributes in place (a missing key is left alone)."""
    for key, action in actions:
        for index in reversed(range(len(attributes))):
            pair = attributes[index]
            if pair.key != key:
                continue
            if action == "delete":
                del attributes[index]
            elif pair.value.WhichOneof("value") == "string_value":
                pair.value.string_value = collector_hash(pair.value.string_value)


def apply_to_request(
    actions: list[tuple[str, str]], request: trace_service_pb2.ExportTraceServiceRequest
) -> None:
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                apply_actions(actions, span.attributes)


class AttributesForwarder:
    """OTLP/HTTP in (``POST /v1/traces``, protobuf), the actions applied, OTLP/HTTP out to ``upstream``."""

    def __init__(self, upstream: str, actions: list[tuple[str, str]] | None = None) -> None:
        self.upstream = upstream.rstrip("/") + "/v1/traces"
        self.actions = load_actions() if actions is None else actions
        forwarder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                apply_to_request(forwarder.actions, request)
                status, reply = forwarder.forward(request.SerializeToString())
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        # a 50 ms poll: shutdown() waits up to one (0.5 s by default) for serve_forever to notice
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def forward(self, body: bytes) -> tuple[int, bytes]:
        request = urllib.request.Request(
            self.upstream, data=body, headers={"Content-Type": "application/x-protobuf"}, method="POST"
        )
        try:
            with _DIRECT.open(request, timeout=10) as response:
                return int(response.status), bytes(response.read())
        except urllib.error.HTTPError as exc:  # the backend's refusal goes back to the exporter as it was
            return exc.code, exc.read()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> AttributesForwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
