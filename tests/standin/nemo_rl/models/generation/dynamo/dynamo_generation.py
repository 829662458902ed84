"""Stand-in for ``nemo_rl/models/generation/dynamo/dynamo_generation.py`` (NeMo-RL is not installable from
the package index).

``DynamoGeneration.generate_async`` (an async generator over one sample) awaits
``_post_completion_request``: a POST to ``{frontend}/completions`` through ``async_http_post_json`` (a
new aiohttp session per call), 3 attempts 1 s apart on transport errors, bad JSON, 408, 429 and 5xx.
NeMo-RL sends token ids as the prompt; the stand-in sends text (Dynamo's mocker takes either), and asks
for ``nvext.extra_fields: ["worker_id"]`` so the answer says which worker served it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from nemo_rl.models.generation.dynamo.http_client import async_http_post_json

_HTTP_MAX_ATTEMPTS = 3
_HTTP_RETRY_DELAY_S = 1.0
_RETRYABLE_HTTP_STATUS_CODES = {408, 429}


def _is_retryable_http_response(response: dict[str, Any]) -> bool:
    status = response.get("http_status")
    return (
        "transport_error" in response
        or response.get("json_decode_error") is True
        or status in _RETRYABLE_HTTP_STATUS_CODES
        or (isinstance(status, int) and 500 <= status < 600)
    )


class DynamoGeneration:
    def __init__(self, frontend_base_url: str, model_name: str, max_new_tokens: int = 4) -> None:
        self._dynamo_frontend_base_url = frontend_base_url
        self._model_name = model_name
        self._max_new_tokens = max_new_tokens

    def _completion_url(self) -> str:
        return f"{self._dynamo_frontend_base_url.rstrip('/')}/completions"

    def _build_completion_request(self, *, prompt: str, greedy: bool, max_new_tokens: int) -> dict[str, Any]:
        return {
            "model": self._model_name,
            "prompt": prompt,
            "max_tokens": max_new_tokens,
            "temperature": 0.0 if greedy else 1.0,
            "n": 1,
            "nvext": {"extra_fields": ["worker_id"]},
        }

    async def _post_completion_request(
        self, *, prompt: str, greedy: bool, max_new_tokens: int
    ) -> dict[str, Any]:
        request_url = self._completion_url()
        payload = self._build_completion_request(prompt=prompt, greedy=greedy, max_new_tokens=max_new_tokens)
        response: dict[str, Any] = {}
        for attempt in range(1, _HTTP_MAX_ATTEMPTS + 1):
            response = await async_http_post_json(request_url, payload, 60.0)
            if not _is_retryable_http_response(response) or attempt == _HTTP_MAX_ATTEMPTS:
                break
            await asyncio.sleep(_HTTP_RETRY_DELAY_S)
        if response.get("status") == "error" or not response.get("choices"):
            raise RuntimeError(f"Dynamo completion request to {request_url} failed: {response}")
        return response

    async def generate_async(
        self, data: dict[str, Any], greedy: bool = False
    ) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
        assert len(data["prompts"]) == 1, "DynamoGeneration.generate_async takes one sample"
        response = await self._post_completion_request(
            prompt=data["prompts"][0], greedy=greedy, max_new_tokens=self._max_new_tokens
        )
        worker = response.get("nvext", {}).get("worker_id", {}).get("decode_worker_id")
        yield (0, {"text": response["choices"][0].get("text", ""), "worker_id": worker})

    def generate(self, data: dict[str, Any], greedy: bool = False) -> Any:
        raise NotImplementedError("DynamoGeneration only generates asynchronously")
