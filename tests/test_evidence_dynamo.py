"""Run-time evidence of affinity against the real Dynamo 1.6.1 (frontend + mocker workers on loopback).

Each setup is driven through otel-session only, with the openai SDK as the demo drives it, behind a
recording proxy (``DynamoProxy``): healthy (affinity on) must stay silent and its metrics, read back
through the OpenTelemetry SDK's ``InMemoryMetricReader``, must match what the proxy saw; affinity
off, a TTL shorter than the pauses inside a trajectory, and two frontends that keep their session
tables apart (behind one round-robin balancer) must each get the one warning. A full table (529) is
tested in tests/test_evidence.py against a stand-in: filling Dynamo's 65,536 bindings takes minutes
(``benchmarks/capacity.py``; see docs/tracing.md for how that was checked).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import logging
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from opentelemetry import trace

import otel_session
from otel_session import _evidence
from otel_session.dynamo import NVEXT_EXTRA_BODY, LocalDynamo
from otel_session.dynamo.watch import watch
from otel_session.dynamo.workload import Workload, run_batch, summarize
from tests.support import DynamoProxy, Forwarded, metric_delta, metric_points, metrics_reader, prometheus_url

WORKLOAD = Workload(prompts=7, siblings=1, turns=4, prompt_words=300, turn_words=60)  # odd: see dynamo-on-cpu
ALARM = "session affinity is not holding"


@pytest.fixture(autouse=True)
def _fresh(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    metrics_reader()
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    yield
    _evidence.forget()


def _alarms(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if ALARM in r.getMessage()]


def _chats(proxy: DynamoProxy) -> list[Forwarded]:
    return [r for r in proxy.requests if r.path.endswith("/chat/completions")]


def _usage(seen: Forwarded) -> tuple[int, int]:
    usage = json.loads(seen.answer)["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def _run_through(proxy: DynamoProxy, model: str, workload: Workload = WORKLOAD, concurrency: int = 7) -> Any:
    otel_session.configure(dynamo_hosts=[proxy.authority])
    results = asyncio.run(
        run_batch([f"http://{proxy.authority}/v1"], model, workload, concurrency=concurrency)
    )
    summary = summarize(results)
    assert summary.errors == 0, [r.error for r in results]
    return summary


def test_healthy_affinity_is_silent_and_the_metrics_match_the_wire(
    dynamo_stack: LocalDynamo, caplog: pytest.LogCaptureFixture
) -> None:
    before = metric_points()
    with DynamoProxy(f"http://{dynamo_stack.host}") as proxy:
        summary = _run_through(proxy, dynamo_stack.model_name)
        port = int(proxy.authority.rpartition(":")[2])
    assert summary.pinned == 7
    assert _alarms(caplog) == []
    chats = _chats(proxy)
    assert len(proxy.requests) == len(chats) == 28  # not one request of ours beside the application's
    sessions: dict[str, list[Forwarded]] = {}
    for seen in chats:
        sessions.setdefault(seen.header("x-dynamo-session-id") or "", []).append(seen)
    assert len(sessions) == 7 and "" not in sessions
    later = [turn for turns in sessions.values() for turn in turns[1:]]
    firsts = [turns[0] for turns in sessions.values()]
    router = {"server__address": "127.0.0.1", "server__port": port}
    assert metric_delta(before, "otel_session.requests", otel_session__session=True, **router) == 28
    assert metric_delta(before, "otel_session.requests", otel_session__retry=True) == 0
    assert metric_delta(before, "otel_session.trajectories", otel_session__trajectory__state="started") == 7
    assert metric_delta(before, "otel_session.trajectories", otel_session__trajectory__state="ended") == 7
    assert metric_delta(before, "otel_session.turns", otel_session__turn="first", **router) == 7
    assert metric_delta(before, "otel_session.turns", otel_session__turn="later", **router) == 21
    for name, index in (("otel_session.prompt_tokens", 0), ("otel_session.cached_tokens", 1)):
        for kind, turns in (("first", firsts), ("later", later)):
            wire = sum(_usage(seen)[index] for seen in turns)
            assert metric_delta(before, name, otel_session__turn=kind, **router) == wire, (name, kind)
    stayed = sum(a.worker == b.worker for turns in sessions.values() for a, b in itertools.pairwise(turns))
    assert stayed == 21
    assert metric_delta(before, "otel_session.worker_checks", otel_session__worker__switched=False) == 21
    assert metric_delta(before, "otel_session.worker_checks", otel_session__worker__switched=True) == 0
    assert not trace.get_current_span().get_span_context().is_valid  # tracing off stays off


def test_affinity_off_at_the_frontend_is_named(
    dynamo_stack_no_affinity: LocalDynamo, caplog: pytest.LogCaptureFixture
) -> None:
    before = metric_points()
    with DynamoProxy(f"http://{dynamo_stack_no_affinity.host}") as proxy:
        summary = _run_through(proxy, dynamo_stack_no_affinity.model_name)
    assert summary.pinned < 7  # the stack really scattered them
    alarms = _alarms(caplog)
    assert len(alarms) == 1, alarms
    assert "--router-session-affinity-ttl-secs" in alarms[0] and proxy.authority in alarms[0]
    switched = metric_delta(before, "otel_session.worker_checks", otel_session__worker__switched=True)
    wire = sum(
        a.worker != b.worker
        for session in {r.header("x-dynamo-session-id") for r in _chats(proxy)}
        for a, b in _pairs(proxy, session)
    )
    assert switched == wire > 0


def _pairs(proxy: DynamoProxy, session: str | None) -> list[tuple[Forwarded, Forwarded]]:
    turns = [r for r in _chats(proxy) if r.header("x-dynamo-session-id") == session]
    return list(itertools.pairwise(turns))


async def _paused_sessions(base_url: str, model: str, sessions: int, pauses: list[float]) -> None:
    """``sessions`` conversations at once, each turn re-sending the history, waiting ``pauses[i]``
    seconds (an environment step) before turn ``i + 2``."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)

    async def one(index: int) -> None:
        messages = [{"role": "user", "content": f"conversation {index}: " + "lorem ipsum dolor " * 80}]
        async with otel_session.trajectory():
            for turn, pause in enumerate([0.0, *pauses]):
                await asyncio.sleep(pause)
                if turn:
                    messages.append({"role": "user", "content": f"turn {turn}: " + "next step please " * 20})
                answer = await client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=8,
                    extra_body=NVEXT_EXTRA_BODY,  # type: ignore[arg-type]
                )
                messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})

    try:
        await asyncio.gather(*(one(i) for i in range(sessions)))
    finally:
        await client.close()


def test_a_ttl_shorter_than_the_pauses_is_named(
    local_dynamo_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # random routing: a session the router forgot lands elsewhere 3 times in 4, whatever the order
    stack = local_dynamo_factory(workers=4, router_mode="random", affinity_ttl_secs=1)
    with DynamoProxy(f"http://{stack.host}") as proxy:
        otel_session.configure(dynamo_hosts=[proxy.authority])
        # turn 2 at once (still bound), turns 3-6 after a pause the 1 s TTL does not survive
        asyncio.run(
            _paused_sessions(f"http://{proxy.authority}/v1", stack.model_name, 7, [0.05, 2.5, 2.5, 2.5, 2.5])
        )
    assert all(r.status == 200 for r in proxy.requests)
    alarms = _alarms(caplog)
    assert len(alarms) == 1, alarms
    assert "Turns after a pause of" in alarms[0] and "--router-session-affinity-ttl-secs" in alarms[0]


def test_two_frontends_that_keep_their_tables_apart_are_named(
    local_dynamo_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    first = local_dynamo_factory(workers=2, router_mode="round-robin", affinity_ttl_secs=300)
    second = local_dynamo_factory(workers=2, router_mode="round-robin", affinity_ttl_secs=300)
    # one address, a round-robin balancer over two frontends, each with its own session table
    with DynamoProxy(f"http://{first.host}", balance=[f"http://{second.host}"]) as proxy:
        workload = Workload(prompts=5, siblings=1, turns=4, prompt_words=300, turn_words=60)
        _run_through(proxy, first.model_name, workload, concurrency=1)
    alarms = _alarms(caplog)
    assert len(alarms) == 1, alarms
    assert "several frontends" in alarms[0] and "ingress hash" in alarms[0]


@pytest.mark.parametrize("affinity", [True, False], ids=["healthy", "affinity-off"])
def test_doctor_watch_reads_the_running_figures_without_a_probe(
    affinity: bool, request: pytest.FixtureRequest
) -> None:
    stack: LocalDynamo = request.getfixturevalue("dynamo_stack" if affinity else "dynamo_stack_no_affinity")
    out = io.StringIO()
    with DynamoProxy(f"http://{stack.host}") as proxy:
        run = lambda _: _run_through(proxy, stack.model_name)  # noqa: E731 (the window's traffic)
        [app] = watch(prometheus_url(), out, interval=0, samples=1, sleep=run)
        otel_session.unconfigure()
        [frontend] = watch(f"http://{stack.host}/metrics", out, interval=0, samples=1, sleep=run)
    assert len(proxy.requests) == 56  # the two batches' requests, and not one more
    assert app.later_turns == 21 and app.worker_checks == 21
    assert (
        app.verdict() == "healthy" if affinity else app.verdict().startswith("BROKEN: turns of one session")
    )
    assert frontend.frontend_input > 0 and frontend.later_turns == 0
    assert frontend.verdict().startswith("(Dynamo's own figures only")
    assert "later turns 21" in out.getvalue()


def test_two_1_3_frontends_behind_a_round_robin_nginx_are_named_and_the_hashed_recipe_is_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Dynamo 1.3.0.post1's frontends keep their session tables apart (tests/test_two_frontends.py):
    behind a real nginx taking turns between them the sessions split and the warning fires; behind
    the documented hash on X-Dynamo-Session-ID they stay whole and nothing is said."""
    from benchmarks.frontends import measure, two_frontends
    from benchmarks.harness import nginx_binary
    from tests.dynamo_fixtures import dynamo_python_for

    if nginx_binary() is None:
        pytest.skip("nginx is not installed")
    python = dynamo_python_for("1.3.0.post1")
    workload = Workload(prompts=12, siblings=1, turns=4, prompt_words=200, turn_words=30)
    with two_frontends(python, "random", replica_sync=False, workers=8) as stack:
        hashed = measure(stack, hash_session=True, sessions=True, workload=workload, concurrency=3)
        assert hashed.errors == 0 and hashed.pinned == 12
        assert _alarms(caplog) == []
        spread = measure(stack, hash_session=False, sessions=True, workload=workload, concurrency=3)
    assert spread.errors == 0
    alarms = _alarms(caplog)
    assert len(alarms) == 1 and "moved to another worker" in alarms[0], alarms
    assert "several frontends behind one address" in alarms[0]  # one address: not "alternated"
