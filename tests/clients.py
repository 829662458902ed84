"""One way to send a request through each real client, so every test can run against all of them."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import httpx
import openai

CLIENTS = ["httpx", "httpx-async", "openai", "openai-async", "aiohttp"]


async def send(kind: str, base_url: str, *, headers: dict[str, str] | None = None, path: str = "/v1") -> None:
    """POST one chat completion to ``base_url + path`` with the named client (redirects followed)."""
    url = base_url + path
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if kind == "httpx":
        await asyncio.to_thread(_httpx_sync, url, body, headers)
    elif kind == "httpx-async":
        async with httpx.AsyncClient(follow_redirects=True) as client:
            (await client.post(url + "/chat/completions", json=body, headers=headers)).raise_for_status()
    elif kind == "openai":
        await asyncio.to_thread(_openai_sync, url, body, headers)
    elif kind == "openai-async":
        async with openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=3) as client:
            await client.chat.completions.create(**body, extra_headers=headers)
    elif kind == "aiohttp":
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/chat/completions", json=body, headers=headers) as response,
        ):
            response.raise_for_status()
    else:
        raise ValueError(kind)


def _httpx_sync(url: str, body: dict[str, Any], headers: dict[str, str] | None) -> None:
    with httpx.Client(follow_redirects=True) as client:
        client.post(url + "/chat/completions", json=body, headers=headers).raise_for_status()


def _openai_sync(url: str, body: dict[str, Any], headers: dict[str, str] | None) -> None:
    with openai.OpenAI(base_url=url, api_key="k", max_retries=3) as client:
        client.chat.completions.create(**body, extra_headers=headers)
