"""A small GRPO-shaped batch, run as its own process by tests/test_phoenix.py, printing what it did as JSON.

Its own process because tracing is process-global (the tracer provider, once set, stays for the
process, and exit flushes the export queue): the test process keeps none of it, and the batch's exit
is the moment every span it would ever export has been sent.

2 prompts x 2 siblings x 3 turns through the openai SDK, every attempt inside
``otel_session.trajectory()``. Two requests go through a proxy that answers the first try of every
request with a 500: sibling (0, 0) sends its first turn there with ``max_retries=2`` (one request, two
HTTP attempts), and sibling (1, 1)'s first attempt sends its first turn there with ``max_retries=0``,
so that attempt fails and is run again as attempt 2, as a trainer re-runs a failed rollout. Every HTTP
attempt is counted per session by an event hook on the SDK's default HTTP client, independently of
tracing.

    python -m tests.phoenix_batch DYNAMO_BASE_URL PROXY_BASE_URL MODEL on|off
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import httpx2
import openai
from openai.types.chat import ChatCompletionMessageParam

import otel_session

PROMPTS, SIBLINGS, TURNS = 2, 2, 3
RETRIED = (0, 0)  # its first turn: a 500, then the SDK's retry succeeds
RERUN = (1, 1)  # its first attempt: a 500 with retries off, so the attempt fails and runs again


async def main(dynamo_url: str, proxy_url: str, model: str, tracing: bool) -> dict[str, Any]:
    otel_session.configure(
        dynamo_hosts=[urlsplit(dynamo_url).netloc, urlsplit(proxy_url).netloc], tracing=tracing
    )
    http_attempts: Counter[str] = Counter()

    async def count(request: httpx2.Request) -> None:
        http_attempts[otel_session.current_session_id() or "-"] += 1

    def client(base_url: str, max_retries: int) -> openai.AsyncOpenAI:
        hooks = {"request": [count]}
        return openai.AsyncOpenAI(
            base_url=base_url,
            api_key="unused",
            max_retries=max_retries,
            http_client=openai.DefaultAsyncHttpxClient(event_hooks=hooks),  # the SDK's own defaults
        )

    direct, retried, failing = client(dynamo_url, 2), client(proxy_url, 2), client(proxy_url, 0)
    attempts: list[dict[str, Any]] = []

    async def rollout(prompt: int, sibling: int, attempt: int) -> bool:
        first = retried if (prompt, sibling) == RETRIED else direct
        if (prompt, sibling) == RERUN and attempt == 1:
            first = failing
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": f"prompt {prompt}: " + "solve the task " * 40}
        ]
        async with otel_session.trajectory(
            prompt_index=prompt, sibling_index=sibling, attempt=attempt
        ) as traj:
            record: dict[str, Any] = {
                "prompt_index": prompt,
                "sibling_index": sibling,
                "attempt": attempt,
                "session_id": traj.session_id,
                "turns": 0,
                "error": None,
            }
            attempts.append(record)
            try:
                for turn in range(TURNS):
                    response = await (first if turn == 0 else direct).chat.completions.create(
                        model=model, messages=messages, max_tokens=8
                    )
                    answer = response.choices[0].message.content or ""
                    messages.append({"role": "assistant", "content": answer})
                    messages.append({"role": "user", "content": f"turn {turn + 1}: go on"})
                    record["turns"] += 1
            except openai.APIError as exc:
                record["error"] = type(exc).__name__
        return record["error"] is None

    async def sibling_line(prompt: int, sibling: int) -> None:
        attempt = 1
        while not await rollout(prompt, sibling, attempt) and attempt < 2:
            attempt += 1

    try:
        await asyncio.gather(*(sibling_line(p, s) for p in range(PROMPTS) for s in range(SIBLINGS)))
    finally:
        for each in (direct, retried, failing):
            await each.close()
    for record in attempts:
        record["http_attempts"] = http_attempts[record["session_id"]]
    otel_session.unconfigure()  # flushes the export queue (tracing on) before the report is printed
    return {"tracing": tracing, "attempts": attempts, "outside_trajectories": http_attempts["-"]}


if __name__ == "__main__":
    dynamo, proxy, model_name, switch = sys.argv[1:5]
    print(json.dumps(asyncio.run(main(dynamo, proxy, model_name, switch == "on"))))
