"""Stand-in for ``nemo_rl/models/generation/dynamo/http_client.py`` (NeMo-RL is not installable from the
package index): ``async_http_post_json`` as NeMo-RL writes it, a new aiohttp ``ClientSession`` per call."""

from __future__ import annotations

import json
from typing import Any

import aiohttp


def _decode_json_object(body: bytes) -> dict[str, Any]:
    try:
        decoded = json.loads(body)
    except ValueError:
        return {"status": "error", "json_decode_error": True, "raw": body.decode("utf-8", "replace")}
    return decoded if isinstance(decoded, dict) else {"status": "error", "json_decode_error": True}


async def async_http_post_json(url: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(url, json=payload) as response,
        ):
            body = await response.read()
            if response.status >= 400:
                return {
                    "status": "error",
                    "http_status": response.status,
                    "raw": body.decode("utf-8", "replace"),
                }
    except (aiohttp.ClientError, TimeoutError) as error:
        return {"status": "error", "transport_error": f"{type(error).__name__}: {error}"}
    return _decode_json_object(body)
