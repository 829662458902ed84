"""The openai SDK's response parsing: the evidence of affinity its objects already carry.

Every object the SDK builds from a response, a whole completion or one streamed chunk, passes through
``BaseClient._process_response_data(data=..., cast_to=..., response=...)`` with the JSON the SDK has
just decoded. The hook calls it at once and then reads two fields of that same JSON (``usage`` and
Dynamo's ``nvext``) for ``_evidence``: no request, no body read the application did not ask for, and
the object returned is the SDK's own. A whole answer's latency (httpx's ``elapsed``) goes with it, for
the crowding evidence (``_crowding``). A stream gives its usage in its last chunk only when the request
asked for it (``stream_options={"include_usage": True}``); without it no turn of that stream is seen.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from otel_session import _evidence, _faults
from otel_session.instrumentation._base import SessionInstrumentor, Wrapper


def _process_response_data(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    data = kwargs.get("data")
    if isinstance(data, dict) and ("usage" in data or "nvext" in data) and _INSTRUMENTOR.active:
        try:
            response = kwargs["response"]
            url = response.request.url
            _evidence.parsed(data, url.scheme, url.host, url.port, _latency(response), response)
        except Exception as exc:  # a response we cannot read is evidence lost, never an error
            _faults.report("reading the usage of an openai response", exc)
    return result


def _latency(response: Any) -> float | None:
    """Seconds from sending the request to its whole answer, as httpx measured it (``None`` for a
    stream still open: its chunks are parsed before httpx knows)."""
    try:
        return float(response.elapsed.total_seconds())
    except Exception:  # httpx raises until the response is closed
        return None


class OpenAIResponsesInstrumentor(SessionInstrumentor):
    """Affinity evidence from the openai SDK's parsed responses (entry point ``otel_session_openai``)."""

    library = "openai"
    requirement = "openai >= 1.40"

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        base = sys.modules.get("openai._base_client")
        client = getattr(base, "BaseClient", None)
        if client is None or not callable(client.__dict__.get("_process_response_data")):
            _faults.warn(
                "otel-session: this openai SDK has no BaseClient._process_response_data, so the affinity "
                "evidence of its responses is not read (sessions are delivered as usual)"
            )
            return []
        return [(client, "_process_response_data", _process_response_data)]


_INSTRUMENTOR = OpenAIResponsesInstrumentor()
