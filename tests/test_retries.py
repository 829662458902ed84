"""Retries inside one model call keep the first try's session; a GRPO group gets one ID per sibling."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import aiohttp
import httpx
import openai

import otel_session
from otel_session import SESSION_HEADER
from tests.recorder import Recorder


def test_openai_sdk_retries_after_500_and_429_keep_the_id(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    dynamo.fail_next.extend([500, 429, 503])
    client = openai.OpenAI(base_url=dynamo.url + "/v1", api_key="k", max_retries=3)
    with otel_session.trajectory() as traj:
        client.with_options(timeout=10).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
    tries = [(r.get("x-stainless-retry-count"), r.get(SESSION_HEADER)) for r in dynamo.requests]
    assert tries == [(str(n), traj.session_id) for n in range(4)]


async def test_async_openai_retries_keep_the_id(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    dynamo.fail_next.extend([502, 408])
    async with (
        openai.AsyncOpenAI(base_url=dynamo.url + "/v1", api_key="k", max_retries=2) as client,
        otel_session.trajectory() as traj,
    ):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert [r.get(SESSION_HEADER) for r in dynamo.requests] == [traj.session_id] * 3


def test_httpx_transport_retries_on_connect_errors_keep_the_id() -> None:
    """The server is unreachable (connection refused) at first and comes up while httpx retries."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    port = sock.getsockname()[1]
    recorder = Recorder(port=port)
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{port}"])

    def come_up_later() -> None:
        time.sleep(0.3)
        sock.close()
        recorder.start()

    starter = threading.Thread(target=come_up_later)
    client = httpx.Client(transport=httpx.HTTPTransport(retries=6))
    with otel_session.trajectory() as traj:
        starter.start()
        response = client.get(f"http://127.0.0.1:{port}/v1/models")
    starter.join()
    try:
        assert response.status_code == 200
        assert [r.get(SESSION_HEADER) for r in recorder.requests] == [traj.session_id]
    finally:
        recorder.stop()


async def test_aiohttp_retry_loop_keeps_the_id(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    dynamo.fail_next.extend([500, 500])

    async def post_with_retries(session: aiohttp.ClientSession) -> int:
        for _ in range(5):  # the retry wrapper a Gym server would write around aiohttp
            async with session.post(dynamo.url + "/v1/chat/completions", json={"messages": []}) as response:
                if response.status < 500:
                    return response.status
        return 0

    async with aiohttp.ClientSession() as session, otel_session.trajectory() as traj:
        assert await post_with_retries(session) == 200
    assert [r.get(SESSION_HEADER) for r in dynamo.requests] == [traj.session_id] * 3


async def test_grpo_group_of_64_concurrent_siblings_has_64_distinct_ids(dynamo: Recorder) -> None:
    """One prompt, 64 generations in flight at once on one loop, 3 turns each, one shared client."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    client = openai.AsyncOpenAI(base_url=dynamo.url + "/v1", api_key="k", max_retries=0)

    @otel_session.trajectory(prompt_index=0)
    async def rollout(sibling: int) -> str:
        messages = [{"role": "user", "content": "same prompt for every sibling"}]
        for _ in range(3):
            reply = await client.chat.completions.create(
                model="m",
                messages=messages,
                extra_headers={"X-Sibling": str(sibling)},  # type: ignore[arg-type]
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            await asyncio.sleep(0)
        return otel_session.current_session_id() or ""

    ids = await asyncio.gather(*(rollout(i) for i in range(64)))
    await client.close()
    assert len(set(ids)) == 64
    assert len(dynamo.requests) == 64 * 3
    for request in dynamo.requests:
        assert request.get(SESSION_HEADER) == ids[int(request.get("X-Sibling") or "-1")]
