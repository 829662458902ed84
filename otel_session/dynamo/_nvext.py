"""Reading Dynamo's per-request ``nvext`` extras (serving worker, timing) from responses.

Dynamo only reports which worker served a request when asked to, via a request-body extension; the
OpenAI SDK keeps unknown response fields in ``model_extra``. These helpers hide both details and accept
SDK objects (streaming chunks included) as well as plain JSON dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["NVEXT_EXTRA_BODY", "cached_tokens_of", "nvext_of", "ttft_ms_of", "worker_id_of"]

#: Pass as ``extra_body=`` (OpenAI SDK) or merge into a JSON body to get worker id and timing back.
NVEXT_EXTRA_BODY: dict[str, Any] = {"nvext": {"extra_fields": ["worker_id", "timing"]}}


def _as_mapping(obj: object) -> Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    extra = getattr(obj, "model_extra", None)  # pydantic v2 models (openai>=1)
    if isinstance(extra, Mapping):
        return extra
    return {}


def nvext_of(response: object) -> Mapping[str, Any]:
    """The ``nvext`` object of a response or stream chunk, empty when Dynamo did not send one."""
    nvext = _as_mapping(response).get("nvext")
    return nvext if isinstance(nvext, Mapping) else {}


def worker_id_of(response: object) -> int | None:
    """Dynamo instance id of the decode worker that served the request (non-streaming or any chunk)."""
    worker = nvext_of(response).get("worker_id")
    if not isinstance(worker, Mapping):
        return None
    value = worker.get("decode_worker_id", worker.get("prefill_worker_id"))
    return int(value) if value is not None else None


def ttft_ms_of(response: object) -> float | None:
    """Time to first token as measured by the frontend; in a stream only the last chunk carries it."""
    timing = nvext_of(response).get("timing")
    if not isinstance(timing, Mapping) or timing.get("ttft_ms") is None:
        return None
    return float(timing["ttft_ms"])


def cached_tokens_of(response: object) -> int | None:
    """Prompt tokens served from the worker's prefix cache (needs usage; in streams, include_usage)."""
    usage = response.get("usage") if isinstance(response, Mapping) else getattr(response, "usage", None)
    if usage is None:
        return None
    details = (
        usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else usage.prompt_tokens_details
    )
    if details is None:
        return None
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else details.cached_tokens
    return int(cached) if cached is not None else None
