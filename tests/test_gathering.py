"""A first step gathered before its groups are sized (``_gathering``, issue 33): a step's attempts
wait at their first request to a router for the step's other attempts and the router's fleet size,
bounded, and never fail for it. Over loopback to a recording server that lists its workers in
``/health`` as a Dynamo frontend does, through httpx (async and in threads), aiohttp and requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter

import aiohttp
import httpx
import pytest

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER, _faults, _gathering, _siblings
from tests.recorder import Recorder


def _step(dynamo: Recorder, prompts: int, siblings: int, client: str = "httpx", named: bool = False) -> float:
    """``prompts`` x ``siblings`` attempts started at once, one request each; seconds it took."""

    async def attempt(prompt: int, sibling: int) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": f"task {prompt}"}]}
        url = f"{dynamo.url}/p{prompt}/s{sibling}/v1/chat/completions"
        async with otel_session.trajectory(group=f"g{prompt}" if named else None):
            if client == "httpx":
                async with httpx.AsyncClient() as http:
                    await http.post(url, json=body, timeout=10)
            else:
                async with aiohttp.ClientSession() as http, http.post(url, json=body) as answer:
                    await answer.read()

    async def run() -> None:
        await asyncio.gather(*(attempt(p, s) for p in range(prompts) for s in range(siblings)))

    began = time.monotonic()
    asyncio.run(run())
    return time.monotonic() - began


def _parents(dynamo: Recorder) -> dict[str, Counter[str | None]]:
    """Per prompt, how many of its attempts named each parent (every request carried a session)."""
    found: dict[str, Counter[str | None]] = {}
    for seen in dynamo.requests:
        assert seen.get(SESSION_HEADER) is not None, seen.path
        found.setdefault(seen.path.split("/")[1], Counter())[seen.get(PARENT_SESSION_HEADER)] += 1
    return found


@pytest.mark.parametrize("client", ["httpx", "aiohttp"])
@pytest.mark.parametrize("named", [False, True])
def test_a_first_step_is_sized_by_itself(dynamo: Recorder, client: str, named: bool) -> None:
    """3 prompts x 6 siblings on 3 workers: K = ceil(6 / (3 // 3)) = 6 (not the pairs of a step that
    cannot be sized), from the step's first request."""
    dynamo.instances = 3
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    took = _step(dynamo, prompts=3, siblings=6, client=client, named=named)
    assert took < 0.9  # one pass of the loop and a few 5 ms looks, not the half-second bound
    found = _parents(dynamo)
    assert sorted(found) == ["p0", "p1", "p2"]
    for parents in found.values():
        assert list(parents.values()) == [6] and None not in parents
    assert _siblings.step_seen()


def test_a_slow_health_is_waited_for_half_a_second_at_most(dynamo: Recorder) -> None:
    """/health answers in 3 s: the step goes after ``WAIT`` with the default's K (pairs), not later."""
    dynamo.instances = 6
    dynamo.health_delay = 3.0
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    took = _step(dynamo, prompts=2, siblings=4)
    assert _gathering.WAIT == 0.5 and 0.45 <= took < 1.4
    for parents in _parents(dynamo).values():
        assert sorted(parents.values()) == [2, 2]


def test_under_fleet_a_slow_health_withholds_the_first_step(dynamo: Recorder) -> None:
    dynamo.instances = 6
    dynamo.health_delay = 3.0
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")
    _step(dynamo, prompts=2, siblings=4)
    assert {seen.get(SESSION_HEADER) for seen in dynamo.requests} == {None}


def test_after_a_step_has_ended_nothing_waits(dynamo: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    dynamo.instances = 4
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    _step(dynamo, prompts=1, siblings=2)
    assert _siblings.step_seen()
    waited: list[object] = []
    monkeypatch.setattr(_gathering, "gather", lambda *args: waited.append(args))
    dynamo.clear()
    _step(dynamo, prompts=1, siblings=2)
    assert waited == [] and len(dynamo.requests) == 2


def test_a_thread_waits_for_a_slow_health_half_a_second_at_most(dynamo: Recorder) -> None:
    dynamo.instances = 4
    dynamo.health_delay = 3.0
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    began = time.monotonic()
    with otel_session.trajectory(group="g"):
        httpx.post(f"{dynamo.url}/p0/s0/v1/chat/completions", json={"messages": []}, timeout=10)
    assert 0.45 <= time.monotonic() - began < 1.4
    assert dynamo.requests[0].get(SESSION_HEADER) is not None


def test_a_blocking_client_on_an_event_loop_never_waits(dynamo: Recorder) -> None:
    """A sync client called from async code: sleeping there would hold every other task."""
    dynamo.instances = 4
    dynamo.health_delay = 3.0
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")

    async def run() -> float:
        began = time.monotonic()
        with otel_session.trajectory(group="g"):
            httpx.post(f"{dynamo.url}/p0/s0/v1/chat/completions", json={"messages": []}, timeout=10)
        return time.monotonic() - began

    assert asyncio.run(run()) < 0.4
    assert dynamo.requests[0].get(SESSION_HEADER) is not None


def test_requests_threads_gather_too(dynamo: Recorder) -> None:
    """Through requests (urllib3): 2 prompts x 4 siblings in threads on 4 workers, K = 2."""
    import requests

    dynamo.instances = 4
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    ready = threading.Barrier(8)
    session = requests.Session()  # one for the step's threads, as a rollout pool shares one

    def attempt(prompt: int, sibling: int) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": f"task {prompt}"}]}
        with otel_session.trajectory():
            ready.wait(10)  # a step's threads reach their first request together
            session.post(f"{dynamo.url}/p{prompt}/s{sibling}/v1/chat/completions", json=body, timeout=10)
            ready.wait(10)

    threads = [threading.Thread(target=attempt, args=(p, s)) for p in range(2) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    session.close()
    for parents in _parents(dynamo).values():
        assert sorted(parents.values()) == [2, 2] and None not in parents


def test_a_router_taking_no_parent_never_waits(gym: Recorder) -> None:
    gym.health_delay = 3.0
    otel_session.configure(routers={"vllm-router": [gym.url]}, siblings="auto")
    took = _step(gym, prompts=2, siblings=2)
    assert took < 2.0 and not gym.health_reads
    assert None not in {seen.get("X-Session-ID") for seen in gym.requests}


def test_a_fault_of_ours_while_gathering_never_fails_the_request(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dynamo.instances = 4

    def broken() -> int:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(_faults, "_reported", set())  # reported once per process: start afresh
    monkeypatch.setattr(_siblings, "joined", broken)
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _step(dynamo, prompts=1, siblings=2)
    assert len(dynamo.requests) == 2
    assert None not in {seen.get(SESSION_HEADER) for seen in dynamo.requests}
    assert any("gathering a first step" in r.getMessage() for r in caplog.records)


def test_an_attempt_cancelled_while_it_gathers_leaves_its_group(dynamo: Recorder) -> None:
    dynamo.instances = 4
    dynamo.health_delay = 3.0  # the gathering waits its whole half second
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")

    async def run() -> None:
        async def attempt() -> None:
            async with otel_session.trajectory(group="g"), httpx.AsyncClient() as http:
                await http.post(f"{dynamo.url}/p0/s0/v1/chat/completions", json={}, timeout=10)

        task = asyncio.create_task(attempt())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert _siblings.open_groups() == 0 and not dynamo.requests
