"""Siblings inferred from the prompt, and the evidence of what pinning costs, against the real Dynamo
1.6.1 (kv router with session affinity, 4 mocker workers on loopback, behind a recording proxy).

Plain ``trajectory()`` attempts through the openai SDK, no ``group=`` anywhere: siblings of one
prompt reach Dynamo under a common ``X-Dynamo-Parent-Session-ID`` (issue 33, item 5). Under
``siblings="prompt"`` twelve siblings pile onto one worker while the others serve a session or two:
the one line naming the crowding and its fix must come, once, with its metric; sixteen different
prompts under the default (a balanced step) must stay silent (item 6).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator

import openai
import pytest

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER, _evidence
from otel_session.dynamo import NVEXT_EXTRA_BODY, LocalDynamo
from tests.dynamo_fixtures import start_local_dynamo
from tests.support import DynamoProxy, Forwarded, metric_delta, metric_points, metrics_reader

ALARM = "pinning costs step time"


@pytest.fixture(scope="module")
def kv_stack() -> Iterator[LocalDynamo]:
    stack = start_local_dynamo(workers=4, router_mode="kv", affinity_ttl_secs=300)
    try:
        with openai.OpenAI(base_url=f"http://{stack.host}/v1", api_key="x", max_retries=0) as warm:
            for k in range(8):  # every worker past its first request, before anything is timed
                warm.chat.completions.create(
                    model=stack.model_name, messages=[{"role": "user", "content": f"warm {k}"}], max_tokens=4
                )
        yield stack
    finally:
        stack.stop()


@pytest.fixture(autouse=True)
def _fresh(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    metrics_reader()
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    yield
    _evidence.forget()


def _text(k: int) -> str:
    return f"prompt {k}: " + "lorem ipsum dolor sit amet " * 60


def _step(stack: LocalDynamo, siblings: str, prompts: list[str]) -> list[Forwarded]:
    """One step: a plain ``trajectory()`` per prompt, all at once, 4 turns each, through the proxy."""
    with DynamoProxy(f"http://{stack.host}") as proxy:
        otel_session.configure(dynamo_hosts=[proxy.authority], siblings=siblings)
        client = openai.AsyncOpenAI(base_url=f"http://{proxy.authority}/v1", api_key="x", max_retries=0)

        async def attempt(prompt: str) -> None:
            messages = [{"role": "user", "content": prompt}]
            async with otel_session.trajectory():
                for turn in range(4):
                    answer = await client.chat.completions.create(
                        model=stack.model_name,
                        messages=messages,  # type: ignore[arg-type]
                        max_tokens=16,
                        extra_body=NVEXT_EXTRA_BODY,
                    )
                    messages += [
                        {"role": "assistant", "content": answer.choices[0].message.content or ""},
                        {"role": "user", "content": f"turn {turn}: more please " * 20},
                    ]

        async def step() -> None:
            try:
                await asyncio.gather(*(attempt(p) for p in prompts))
            finally:
                await client.close()

        asyncio.run(step())
    assert all(seen.status == 200 for seen in proxy.requests)
    return proxy.requests


def _alarms(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if ALARM in r.getMessage()]


def test_siblings_of_one_prompt_crowd_one_worker_and_the_cost_is_named_once(
    kv_stack: LocalDynamo, caplog: pytest.LogCaptureFixture
) -> None:
    before = metric_points()
    prompts = [_text(0)] * 12 + [_text(k) for k in range(1, 5)]
    seen = _step(kv_stack, "prompt", prompts)
    by_prompt: dict[str, set[tuple[str | None, str | None]]] = {}
    for request in seen:
        first = request.json()["messages"][0]["content"]
        by_prompt.setdefault(first, set()).add(
            (request.header(SESSION_HEADER), request.header(PARENT_SESSION_HEADER))
        )
    siblings = by_prompt[_text(0)]
    assert len(siblings) == 12 and len({parent for _, parent in siblings}) == 1  # one parent, at Dynamo
    assert None not in {parent for pairs in by_prompt.values() for _, parent in pairs}
    crowded = Counter(r.worker for r in seen if r.json()["messages"][0]["content"] == _text(0))
    assert len(crowded) == 1 and sum(crowded.values()) == 48  # Dynamo bound the whole group to one worker
    alarms = _alarms(caplog)
    assert len(alarms) == 1, (alarms, _evidence.summaries())
    assert str(next(iter(crowded))) in alarms[0] and "siblings='groups:2'" in alarms[0]
    assert metric_delta(before, "otel_session.worker_crowding", otel_session__worker__crowded=True) > 0
    summary = next(iter(_evidence.summaries().values()))
    assert summary["crowded_workers"] == [next(iter(crowded))] and summary["warnings"] == ["crowded"]


def test_a_balanced_step_stays_silent(kv_stack: LocalDynamo, caplog: pytest.LogCaptureFixture) -> None:
    before = metric_points()
    seen = _step(kv_stack, "groups:2", [_text(100 + k) for k in range(16)])
    assert len(seen) == 64 and all(r.header(PARENT_SESSION_HEADER) for r in seen)
    assert _alarms(caplog) == []
    assert metric_delta(before, "otel_session.worker_crowding", otel_session__worker__crowded=True) == 0
    assert metric_delta(before, "otel_session.worker_crowding", otel_session__worker__crowded=False) == 64
