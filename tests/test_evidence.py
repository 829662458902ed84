"""Run-time evidence and metrics over loopback, against an OpenAI-style server of the test's own.

The server here is a stand-in for a router whose answers the test scripts: Dynamo's own 529 (its
body as ``benchmarks/capacity.py`` recorded it when the real table filled, which takes minutes),
usage and ``nvext`` fields that are garbage, a stream's final usage chunk. The healthy and broken
deployments themselves are the real Dynamo's, in tests/test_evidence_dynamo.py. Metrics are read
back through the OpenTelemetry SDK's ``InMemoryMetricReader``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web

import otel_session
from otel_session import _evidence, _metrics, _verdicts
from tests.gym_servers import AiohttpServer
from tests.support import metric_delta, metric_points, metrics_reader

OVERLOADED = {"message": "Service temporarily overloaded", "type": "Overloaded"}  # Dynamo 1.6.1's 529
TABLE_FULL = "answered 529"
ALARM = "session affinity is not holding"


class Router:
    """An OpenAI-style chat endpoint answering what ``answers`` holds, in order (then 200s), and
    recording every request's session header."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, Any]] = []
        self.sessions: list[str | None] = []
        self.usage: Any = {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102}
        self.server: AiohttpServer | None = None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.sessions.append(request.headers.get("x-dynamo-session-id"))
        if self.answers:
            status, payload = self.answers.pop(0)
            return web.json_response(payload, status=status)
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            first = {**chunk, "choices": [{"index": 0, "delta": {"content": "hi"}}], "nvext": _worker(7)}
            await response.write(f"data: {json.dumps(first)}\n\n".encode())
            if body.get("stream_options", {}).get("include_usage"):
                last = {**chunk, "choices": [], "usage": self.usage}
                await response.write(f"data: {json.dumps(last)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                ],
                "usage": self.usage,
                "nvext": _worker(7),
            }
        )

    @property
    def authority(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.authority}/v1"


def _worker(worker: Any) -> dict[str, Any]:
    return {"worker_id": {"decode_worker_id": worker}}


@pytest.fixture
def router(caplog: pytest.LogCaptureFixture) -> Iterator[Router]:
    metrics_reader()
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    served = Router()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", served.chat)
    with AiohttpServer(app) as server:
        served.server = server
        otel_session.configure(dynamo_hosts=[served.authority])
        yield served
    _evidence.forget()


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


MESSAGES: Any = [{"role": "user", "content": "hi"}]


def _ask_openai(router: Router, retries: int) -> Any:
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=retries)
    try:
        return client.chat.completions.create(model="m", messages=MESSAGES)
    finally:
        client.close()


async def _ask_openai_async(router: Router, retries: int) -> Any:
    client = openai.AsyncOpenAI(base_url=router.base_url, api_key="unused", max_retries=retries)
    try:
        return await client.chat.completions.create(model="m", messages=MESSAGES)
    finally:
        await client.close()


async def _ask_aiohttp(router: Router) -> tuple[int, Any]:
    url = f"{router.base_url}/chat/completions"
    async with aiohttp.ClientSession() as session, session.post(url, json={"messages": MESSAGES}) as reply:
        return reply.status, await reply.json()


def _ask_httpx(router: Router) -> int:
    with httpx.Client() as client:
        return client.post(f"{router.base_url}/chat/completions", json={"messages": MESSAGES}).status_code


async def _ask_httpx_async(router: Router) -> int:
    async with httpx.AsyncClient() as client:
        reply = await client.post(f"{router.base_url}/chat/completions", json={"messages": MESSAGES})
        return reply.status_code


def test_a_full_table_is_named_once_with_the_ttl_rule_and_retries_are_counted(
    router: Router, caplog: pytest.LogCaptureFixture
) -> None:
    before = metric_points()
    router.answers = [(529, OVERLOADED)] * 3
    with otel_session.trajectory() as attempt, pytest.raises(openai.APIStatusError):
        _ask_openai(router, retries=2)  # the SDK retries 529 twice, then raises
    # load shedding answers every request 529: the retries, unpinned (tests/test_fallback.py), too
    assert router.sessions == [attempt.session_id, None, None]
    said = _said(caplog, TABLE_FULL)
    assert len(said) == 1
    assert (
        router.authority in said[0] and '"Capacity"' in said[0] and "trajectories per second x TTL" in said[0]
    )
    assert "--router-session-affinity-ttl-secs" in said[0] and attempt.session_id in said[0]
    # only the request that carried the session is an error answer to one; the unpinned tries are not
    assert metric_delta(before, "otel_session.error_responses", http__response__status_code=529) == 1
    assert metric_delta(before, "otel_session.requests", otel_session__retry=True) == 0
    assert metric_delta(before, "otel_session.requests", otel_session__retry=False) == 1
    router.answers = [(529, OVERLOADED)]
    with otel_session.trajectory(), pytest.raises(openai.APIStatusError):
        _ask_openai(router, retries=0)
    assert len(_said(caplog, TABLE_FULL)) == 1  # once per router per process
    assert _evidence.summaries()[f"dynamo {router.authority}"]["refused_full"] == 2


@pytest.mark.parametrize("client", ["httpx", "httpx-async", "aiohttp", "openai-async"])
def test_every_client_hook_sees_a_529(router: Router, caplog: pytest.LogCaptureFixture, client: str) -> None:
    router.answers = [(529, OVERLOADED)]

    async def in_trajectory() -> Any:
        async with otel_session.trajectory():
            if client == "httpx":
                return _ask_httpx(router)
            if client == "httpx-async":
                return await _ask_httpx_async(router)
            if client == "aiohttp":
                return (await _ask_aiohttp(router))[0]
            with pytest.raises(openai.APIStatusError) as raised:
                await _ask_openai_async(router, retries=0)
            return raised.value.status_code

    assert asyncio.run(in_trajectory()) == 529  # the application sees the answer as it was
    assert len(_said(caplog, TABLE_FULL)) == 1


def test_a_529_outside_any_trajectory_is_not_laid_on_sessions(
    router: Router, caplog: pytest.LogCaptureFixture
) -> None:
    before = metric_points()
    router.answers = [(529, OVERLOADED)]
    assert _ask_httpx(router) == 529
    assert _said(caplog, TABLE_FULL) == []
    assert metric_delta(before, "otel_session.requests", otel_session__session=False) == 1
    assert metric_delta(before, "otel_session.error_responses") == 0


def test_a_retry_after_a_503_is_counted_as_one(router: Router) -> None:
    before = metric_points()
    router.answers = [(503, {"error": "busy"})]
    with otel_session.trajectory():
        answer = _ask_openai(router, retries=1)
    assert answer.choices[0].message.content == "hi"
    assert metric_delta(before, "otel_session.requests", otel_session__retry=True) == 1
    assert metric_delta(before, "otel_session.requests", otel_session__retry=False) == 1
    assert metric_delta(before, "otel_session.error_responses", http__response__status_code=503) == 1


def test_turns_counted_from_what_the_sdk_parsed_the_object_unchanged(router: Router) -> None:
    before = metric_points()
    router.usage = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 96}}
    with otel_session.trajectory():
        answers = [_ask_openai(router, retries=0) for _ in range(3)]
    assert [a.usage.prompt_tokens_details.cached_tokens for a in answers] == [96] * 3
    assert answers[0].model_extra == {"nvext": _worker(7)}  # the SDK's object, as without us
    assert metric_delta(before, "otel_session.turns", otel_session__turn="first") == 1
    assert metric_delta(before, "otel_session.turns", otel_session__turn="later") == 2
    assert metric_delta(before, "otel_session.cached_tokens") == 288
    assert metric_delta(before, "otel_session.prompt_tokens") == 300
    assert metric_delta(before, "otel_session.worker_checks", otel_session__worker__switched=False) == 2


def test_a_stream_counts_one_turn_from_its_usage_chunk_and_none_without(router: Router) -> None:
    before = metric_points()
    router.usage = {"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 48}}
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0)
    with otel_session.trajectory():
        for include in (True, True, False):
            options: Any = {"include_usage": True} if include else None
            chunks = list(
                client.chat.completions.create(
                    model="m",
                    messages=MESSAGES,
                    stream=True,
                    **({"stream_options": options} if options else {}),
                )
            )
            assert chunks[0].choices[0].delta.content == "hi"
    client.close()
    assert metric_delta(before, "otel_session.turns") == 2
    assert metric_delta(before, "otel_session.cached_tokens") == 96
    # the worker came in the first chunk, the usage in the last: one turn, its worker known
    assert metric_delta(before, "otel_session.worker_checks", otel_session__worker__switched=False) == 1


def test_aiohttp_bodies_read_as_json_are_seen_bodies_read_otherwise_are_not(router: Router) -> None:
    before = metric_points()
    router.usage = {"prompt_tokens": 80, "prompt_tokens_details": {"cached_tokens": 0}}

    async def run() -> list[Any]:
        async with otel_session.trajectory(), aiohttp.ClientSession() as session:
            url = f"{router.base_url}/chat/completions"
            async with session.post(url, json={"messages": MESSAGES}) as reply:
                parsed = await reply.json()
            async with session.post(url, json={"messages": MESSAGES}) as reply:
                raw = json.loads(await reply.read())  # read by the application itself: not seen
            return [parsed, raw]

    parsed, raw = asyncio.run(run())
    assert parsed == raw and parsed["usage"]["prompt_tokens"] == 80
    assert metric_delta(before, "otel_session.turns") == 1
    assert metric_delta(before, "otel_session.prompt_tokens") == 80


@pytest.mark.parametrize(
    "usage",
    [
        "lots",
        {"prompt_tokens": "100", "prompt_tokens_details": {"cached_tokens": 5}},
        {"prompt_tokens": -1},
        {"prompt_tokens": True},
        {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}},  # more cached than sent
        {"prompt_tokens": 10, "prompt_tokens_details": "none"},
        [1, 2],
    ],
)
def test_garbage_usage_is_evidence_lost_never_an_error(
    router: Router, caplog: pytest.LogCaptureFixture, usage: Any
) -> None:
    before = metric_points()
    router.usage = usage

    async def run() -> Any:
        async with otel_session.trajectory():
            return (await _ask_aiohttp(router))[1]

    assert asyncio.run(run())["usage"] == usage
    valid = _evidence.usage_of({"usage": usage})
    assert metric_delta(before, "otel_session.turns") == (1 if valid else 0)
    if valid:
        assert valid[1] is None  # a count it cannot trust is left out, not clipped
        assert metric_delta(before, "otel_session.cached_tokens") == 0
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("worker", ["abc", 1.5, True, None, {"x": 1}])
def test_a_worker_id_that_is_no_integer_is_unknown(worker: Any) -> None:
    assert _evidence.worker_of({"nvext": _worker(worker)}) is None
    assert _evidence.worker_of({"nvext": "x"}) is None
    assert _evidence.worker_of({"nvext": {"worker_id": {"prefill_worker_id": 3}}}) == 3


ROUTER: _metrics.Router = ("dynamo", "127.0.0.1", 8000)


def _sessions(count: int, turns: int, cached: Any, worker: Any, prefix: str = "s") -> None:
    """``count`` sessions of ``turns`` turns each, turn by turn, prompts growing by 100 tokens."""
    for turn in range(turns):
        for index in range(count):
            prompt = 200 + 100 * turn
            _evidence.turn(
                f"{prefix}{index}", ROUTER, prompt, cached(index, turn, prompt), worker(index, turn)
            )


def test_healthy_sessions_never_warn(caplog: pytest.LogCaptureFixture) -> None:
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    _sessions(50, 6, lambda i, t, p: p - 100 - 15 if t else 0, lambda i, t: i % 4)
    assert _said(caplog, ALARM) == []
    assert _evidence.routers[ROUTER].judged == 250 and _evidence.routers[ROUTER].missed == 0


def test_a_pinned_worker_that_evicts_is_not_called_an_affinity_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    _sessions(20, 4, lambda i, t, p: 0, lambda i, t: i % 4)  # nothing cached, same worker every turn
    assert _said(caplog, ALARM) == []
    assert _evidence.routers[ROUTER].missed == 60


def test_misses_alone_warn_where_no_worker_is_known(caplog: pytest.LogCaptureFixture) -> None:
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    _sessions(3, 4, lambda i, t, p: 0, lambda i, t: None)  # 9 judged: too few to speak
    assert _said(caplog, ALARM) == []
    _sessions(3, 2, lambda i, t, p: 0, lambda i, t: None, prefix="t")  # 3 more: 12 judged, all missed
    said = _said(caplog, ALARM)
    assert len(said) == 1 and "later turns of sessions were served" in said[0]


def test_short_prompts_are_not_judged() -> None:
    _evidence.forget()
    for turn in range(5):
        _evidence.turn("s", ROUTER, 20 + turn, 0, None)
    assert _evidence.routers[ROUTER].judged == 0


def test_switches_after_long_pauses_only_name_the_ttl() -> None:
    seen = _verdicts.RouterEvidence()
    gaps = [(0.1, False)] * 6 + [(3.0, True)] * 5 + [(3.1, False)] * 3
    assert _verdicts.pause_that_breaks(gaps) == 3.0
    assert _verdicts.pause_that_breaks([(0.1, True), *gaps]) is None  # went wrong without a pause too
    assert _verdicts.pause_that_breaks([(0.1, False)] * 6 + [(0.4, True)] * 6) is None  # no real pause
    assert seen.summary()["warnings"] == []


def test_turns_alternating_between_two_addresses_name_the_frontends(caplog: pytest.LogCaptureFixture) -> None:
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    other: _metrics.Router = ("dynamo", "127.0.0.1", 8001)
    for turn in range(5):  # each session's turns go to 8000 and 8001 in turn; nothing cached there
        for index in range(8):  # 16 later turns judged at each address
            where = ROUTER if (turn + index) % 2 else other
            _evidence.turn(f"a{index}", where, 200 + 100 * turn, 0, None)
    said = _said(caplog, ALARM)  # one line per address, each naming the cause
    assert len(said) == 2 and all("alternated between addresses" in line for line in said)
    assert ":8000:" in said[0] + said[1] and ":8001:" in said[0] + said[1]
    assert sum(_evidence.routers[r].crossed for r in (ROUTER, other)) == 32


def test_a_404_is_no_error_answer_and_each_router_is_told_of_its_own_full_table(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    _evidence.answered_status(404, "http", "127.0.0.1", 8000)
    assert _evidence.routers == {}
    _evidence.answered(ROUTER, "s", 529)
    _evidence.answered(ROUTER, "s", 529)
    _evidence.answered(("dynamo", "127.0.0.1", 8001), "s", 529)
    assert len(_said(caplog, TABLE_FULL)) == 2


def test_requests_outside_trajectories_are_classified_only_once_a_meter_provider_is_set() -> None:
    code = (
        "from otel_session import _metrics\n"
        "from opentelemetry import metrics\n"
        "from opentelemetry.sdk.metrics import MeterProvider\n"
        "assert not _metrics.recording()\n"
        "metrics.set_meter_provider(MeterProvider())\n"
        "assert _metrics.recording()\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_worker_moves_at_one_address_are_not_blamed_on_alternate_addresses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    _sessions(4, 4, lambda i, t, p: None, lambda i, t: t)  # no cache figures; a new worker every turn
    [said] = _said(caplog, ALARM)
    assert "alternated" not in said and "several frontends behind one address" in said
