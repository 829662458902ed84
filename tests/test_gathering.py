"""A first step gathered before its groups are sized (``_gathering``, issue 33): a step's attempts
wait at their first request to a router for the step's other attempts and the router's fleet size,
bounded, and never fail for it. Over loopback to a recording server that lists its workers in
``/health`` as a Dynamo frontend does, through httpx (async and in threads), aiohttp and requests.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
import weakref
from collections import Counter
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import pytest

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER, _faults, _gathering, _siblings
from otel_session._policy import Offer
from otel_session._siblings import Siblings
from tests.recorder import PATIENCE, Recorder
from tests.support import forked_while_held


def _step(dynamo: Recorder, prompts: int, siblings: int, client: str = "httpx", named: bool = False) -> float:
    """``prompts`` x ``siblings`` attempts started at once on one client, one request each; seconds
    from the step's start to its last answer."""

    async def attempt(http: Any, prompt: int, sibling: int) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": f"task {prompt}"}]}
        url = f"{dynamo.url}/p{prompt}/s{sibling}/v1/chat/completions"
        async with otel_session.trajectory(group=f"g{prompt}" if named else None):
            if client == "httpx":
                await http.post(url, json=body, timeout=10)
            else:
                async with http.post(url, json=body) as answer:
                    await answer.read()

    async def run() -> float:
        opened = httpx.AsyncClient() if client == "httpx" else aiohttp.ClientSession()
        async with opened as http:
            began = time.monotonic()
            await asyncio.gather(*(attempt(http, p, s) for p in range(prompts) for s in range(siblings)))
            return time.monotonic() - began

    return asyncio.run(run())


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


def test_after_a_step_has_ended_nothing_gathers(dynamo: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next step's attempts wait only for their parent's turn (``_pacing``), not for a look."""
    dynamo.instances = 1  # one worker: the two siblings under one parent
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    _step(dynamo, prompts=1, siblings=2)
    assert _siblings.step_seen()
    looked: list[object] = []
    monkeypatch.setattr(_gathering._Look, "again", lambda self: looked.append(self) or False)
    dynamo.clear()
    _step(dynamo, prompts=1, siblings=2)
    assert looked == [] and len(dynamo.requests) == 2
    assert len({seen.get(PARENT_SESSION_HEADER) for seen in dynamo.requests} - {None}) == 1


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
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": f"task {prompt}"}]}
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
    said = "otel-session: waiting for a first step or a parent's turn failed (RuntimeError);"
    assert any(r.getMessage().startswith(said) for r in caplog.records)


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


# ---- the rules, one by one (in-process) ----------------------------------------------------------


def _offered(
    policy: str = "auto",
    key: object = None,
    parent: str | None = "X-Dynamo-Parent-Session-ID",
    fails: bool = False,
    decided: bool = False,
) -> Any:
    """What ``_hop.current()`` offers, as far as ``_gathering`` reads it: the undecided attempt and
    the route to a destination (a stand-in: these rules read nothing else of it)."""
    holder = SimpleNamespace(key=key, policy=Siblings.parse(policy), decided=decided)
    profile = None if parent == "none" else SimpleNamespace(parent_header=parent)

    def plan(*destination: object) -> Any:
        if fails:
            raise RuntimeError("a bug of ours")
        return SimpleNamespace(route=SimpleNamespace(profile=profile))

    return SimpleNamespace(undecided=holder, plan=plan, offer=Offer("s"))


def test_which_requests_wait_for_their_step() -> None:
    _siblings.forget_shape()
    here = ("http", "127.0.0.1", 8000)
    assert _gathering._eligible(_offered(), here)
    assert _gathering._eligible(_offered("fleet"), ("http", "127.0.0.1", None))  # a default port
    decided: Any = SimpleNamespace(undecided=None, offer=Offer("s"), due=False)
    assert not _gathering._eligible(decided, here)  # decided already, alone
    assert not _gathering._eligible(_offered(key="entered"), here)  # it waits already
    assert not _gathering._eligible(_offered(decided=True), here)  # it waited already
    assert _gathering._eligible(_offered("groups:2"), here)  # no gathering, but its parent's turn
    assert _gathering._eligible(_offered("prompt"), here)
    assert not _gathering._eligible(_offered("attempt"), here)  # no parent: nothing to wait for
    assert not _gathering._eligible(_offered(), ("unix", None, None))  # over a Unix socket
    assert not _gathering._eligible(_offered(parent=None), here)  # a router that takes no parent
    assert not _gathering._eligible(_offered(parent="none"), here)  # not a router
    assert not _gathering._eligible(_offered(fails=True), here)  # the request's own planning reports it
    joined = [_siblings.join("g", Siblings.parse("groups:2")) for _ in range(2)]
    for ticket in joined:
        assert ticket is not None
        _siblings.leave(ticket[1])  # a group of siblings ended: no step gathers from now on
    assert _siblings.step_seen() and _gathering._eligible(_offered(), here)
    assert not _gathering._counted(_offered(), b'{"messages": []}')
    _siblings.forget_shape()
    assert not _gathering._counted(_offered("groups:2"), b'{"messages": []}')  # K is fixed


def test_only_an_asyncio_task_gathers_asynchronously() -> None:
    _siblings.forget_shape()
    here = ("http", "127.0.0.1", 8000)
    assert not _gathering.gathers(_offered(), here)  # no loop running: a thread's wait instead

    async def inside() -> tuple[bool, bool]:
        return _gathering.gathers(_offered(), here), _gathering.gathers(_offered("attempt"), here)

    assert asyncio.run(inside()) == (True, False)


def test_a_lone_thread_attempt_waits_one_look_not_the_bound(dynamo: Recorder) -> None:
    """No other attempt arrives and /health answers at once: one 50 ms look, not half a second."""
    dynamo.instances = 4
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    began = time.monotonic()
    with otel_session.trajectory(group="g"):
        httpx.post(f"{dynamo.url}/p0/s0/v1/chat/completions", json={"messages": []}, timeout=10)
    assert time.monotonic() - began < 0.4


@pytest.mark.parametrize(("policy", "said"), [("fleet", 1), ("auto", 0)])
def test_a_router_listing_no_workers_is_said_once_under_fleet_only(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture, policy: str, said: int
) -> None:
    """The gathering's own read of /health tells what ``fleet`` tells (``auto`` pairs quietly)."""
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings=policy)
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _step(dynamo, prompts=2, siblings=2)
    lines = [r for r in caplog.records if "cannot be sized to the fleet" in r.getMessage()]
    assert len(lines) == said


def test_a_fault_of_ours_in_a_threads_wait_is_one_line(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dynamo.instances = 4

    def broken() -> int:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(_faults, "_reported", set())
    monkeypatch.setattr(_siblings, "joined", broken)
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    with caplog.at_level(logging.WARNING, logger="otel_session"), otel_session.trajectory(group="g"):
        answer = httpx.post(f"{dynamo.url}/p0/s0/v1/chat/completions", json={"messages": []}, timeout=10)
    assert answer.status_code == 200 and dynamo.requests[0].get(SESSION_HEADER) is not None
    (line,) = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert line.startswith("otel-session: waiting for a first step or a parent's turn failed (RuntimeError);")


def test_a_later_group_of_a_step_that_gave_up_on_health_does_not_wait_again(dynamo: Recorder) -> None:
    """/health hangs: the first group waits its half second and pairs; a group that starts later in
    the same step pairs at once (it was: another half second per group)."""
    dynamo.instances = 4
    dynamo.health_delay = 3.0
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    took: dict[int, float] = {}

    async def attempt(prompt: int, sibling: int, after: float) -> None:
        await asyncio.sleep(after)
        body = {"model": "m", "messages": [{"role": "user", "content": f"task {prompt}"}]}
        async with otel_session.trajectory(), httpx.AsyncClient() as http:
            began = time.monotonic()
            await http.post(f"{dynamo.url}/p{prompt}/s{sibling}/v1/chat/completions", json=body, timeout=10)
            took[prompt * 2 + sibling] = time.monotonic() - began
            await asyncio.sleep(1.2 - after)  # every attempt open at once: one step

    async def run() -> None:
        await asyncio.gather(*(attempt(p, s, 0.7 * p) for p in range(2) for s in range(2)))

    asyncio.run(run())
    assert min(took[0], took[1]) >= 0.45 and max(took[2], took[3]) < 0.35, took


def test_a_thread_at_a_router_listing_no_workers_says_nothing_under_auto(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    with caplog.at_level(logging.WARNING, logger="otel_session"), otel_session.trajectory(group="g"):
        httpx.post(f"{dynamo.url}/p0/s0/v1/chat/completions", json={"messages": []}, timeout=10)
    assert not [r for r in caplog.records if "cannot be sized" in r.getMessage()]


def test_a_look_past_its_bound_ends_with_attempts_still_arriving() -> None:
    """Half a second is the bound whatever arrives: a look after it ends the wait, and so does the
    next one (had it looked again, attempts joining meanwhile would keep it looking)."""
    look = _gathering._Look(("http", "127.0.0.1", 9))
    look.end = time.monotonic() - 1
    look.seen = _siblings.joined() - 1  # an attempt arrived since the last look
    assert not look.again()
    assert not look.again()


def test_a_thousand_attempts_on_one_loop_share_one_look(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """125 prompts x 8 siblings on one aiohttp session, ``/health`` answering in a quarter second: one
    attempt looks for the step every ``SETTLE`` and the others sleep until it is over. When each
    looked for itself the loop woke a thousand times every 5 ms, the thread reading ``/health`` got
    so little of the interpreter that a 0.3 s answer took 0.8 s, and the step's first prompts, past
    the half second, went paired (K=2) while the rest were sized (K=8) (a CI run on main). ``WAIT``
    is 2 s here: on a machine loaded by other tests a step of a thousand can outlast the half second
    whoever looks (it failed so once in a reversed run), and what this pins is one look, not the bound."""
    monkeypatch.setattr(_gathering, "WAIT", 2.0)
    dynamo.instances = 64
    dynamo.health_delay = 0.25
    looks: list[object] = []
    again = _gathering._Look.again
    monkeypatch.setattr(_gathering._Look, "again", lambda self: looks.append(self) or again(self))
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    _step(dynamo, prompts=125, siblings=8, client="aiohttp")
    assert len(looks) <= _gathering.WAIT / _gathering.SETTLE + 10, len(looks)  # each its own: >= 2,000
    parents = _parents(dynamo)
    assert len(parents) == 125 and len(dynamo.requests) == 1000
    assert all(len(named) == 1 and None not in named for named in parents.values()), parents  # K = 8
    assert _gathering._looks == {}


def _lookers(monkeypatch: pytest.MonkeyPatch) -> list[asyncio.Task[Any] | None]:
    """The task that took each glance of a look on an event loop (``_Look.again``), in order."""
    lookers: list[asyncio.Task[Any] | None] = []
    again = _gathering._Look.again
    monkeypatch.setattr(
        _gathering._Look, "again", lambda self: lookers.append(asyncio.current_task()) or again(self)
    )
    return lookers


def test_attempts_asleep_on_a_look_wake_as_it_ends_not_at_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five attempts of a step on one loop share one look; the fleet's size is known, so the look ends
    at its second glance, and the four asleep on it go on then (its bound, a minute here, is only
    for a looker that never wakes them)."""
    monkeypatch.setattr(_gathering, "WAIT", 60.0)
    monkeypatch.setattr(_gathering._fleet, "size_at", lambda origin, tell=True: 4)
    lookers = _lookers(monkeypatch)

    async def attempt() -> _gathering._Look:
        look = _gathering._shared(("http", "127.0.0.1", 9))
        await look.ended()
        return look

    async def step() -> tuple[set[_gathering._Look], float]:
        started = time.monotonic()
        looks = await asyncio.wait_for(asyncio.gather(*(attempt() for _ in range(5))), PATIENCE)
        return set(looks), time.monotonic() - started

    (look,), took = asyncio.run(step())  # one look for all five
    assert look.over and not look.looking and look.waiting == [] and look.inside == 0
    assert len(set(lookers)) == 1 and took < 30.0  # one attempt looked, and no one waited its bound


def test_an_attempt_cancelled_in_its_sleep_is_not_woken_and_the_look_ends_for_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One of the attempts asleep on a look is cancelled (its step's task was): the looker wakes the
    others as the look ends, leaves the cancelled one as it is, and nothing raises."""
    monkeypatch.setattr(_gathering, "WAIT", 60.0)
    monkeypatch.setattr(_gathering._fleet, "size_at", lambda origin, tell=True: 4)

    async def step() -> tuple[_gathering._Look, list[asyncio.Task[None]]]:
        look = _gathering._Look(("http", "127.0.0.1", 9))
        looker = asyncio.ensure_future(look.ended())
        await asyncio.sleep(0)  # the looker looks
        asleep = [asyncio.ensure_future(look.ended()) for _ in range(2)]
        await asyncio.sleep(0)  # they sleep on its look
        asleep[0].cancel()
        await asyncio.wait_for(asyncio.gather(looker, asleep[1]), PATIENCE)
        return look, asleep

    look, asleep = asyncio.run(step())
    assert asleep[0].cancelled() and asleep[1].done() and look.over and look.inside == 0


def test_a_look_past_its_bound_gives_up_only_on_a_size_still_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``WAIT`` a look ends; a router whose size it never learnt is not waited for again by a
    later group of the step (``_gave_up``), one whose size it learnt is."""
    monkeypatch.setattr(_gathering, "WAIT", 0.0)
    monkeypatch.setattr(_gathering, "_gave_up", set())
    unknown, known = ("http", "127.0.0.1", 9), ("http", "127.0.0.1", 10)
    monkeypatch.setattr(
        _gathering._fleet, "size_at", lambda origin, tell=True: 4 if origin == known else None
    )
    assert not _gathering._Look(unknown).again() and not _gathering._Look(known).again()
    assert _gathering._gave_up == {unknown}


def test_an_attempt_asleep_on_a_look_nobody_ends_goes_on_at_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A look whose looker is gone without waking the others (it cannot, but a wait here must never
    outlast its bound): an attempt asleep on it goes on ``SETTLE_THREADS`` after ``WAIT``, as a
    thread's does, woken once."""
    monkeypatch.setattr(_gathering, "WAIT", 0.03)
    monkeypatch.setattr(_gathering._fleet, "size_at", lambda origin, tell=True: 4)

    async def asleep() -> tuple[_gathering._Look, float]:
        look = _gathering._Look(("http", "127.0.0.1", 9))
        look.looking = True  # a looker elsewhere, never to wake it
        started = time.monotonic()
        await asyncio.wait_for(look.ended(), PATIENCE)
        return look, time.monotonic() - started

    look, took = asyncio.run(asleep())
    assert 0.03 <= took < PATIENCE and not look.over and look.inside == 0
    assert len(look.waiting) == 1  # slept once, until its bound


def test_a_looker_cancelled_hands_the_look_on(dynamo: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt looking for the step is cancelled mid-look: the sleeping attempts wake, one of them
    looks on in the same look (still the one a later attempt would join), and the step is sized as
    it would have been (4 prompts x 4 on 4 workers: K = 4)."""
    dynamo.instances = 4
    dynamo.health_delay = 0.2
    lookers = _lookers(monkeypatch)
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")

    async def attempt(http: httpx.AsyncClient, prompt: int, sibling: int) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": f"task {prompt}"}]}
        async with otel_session.trajectory():
            await http.post(f"{dynamo.url}/p{prompt}/s{sibling}/v1/chat/completions", json=body, timeout=10)

    async def run() -> list[asyncio.Task[None]]:
        async with httpx.AsyncClient() as http:
            tasks = [asyncio.create_task(attempt(http, p, s)) for p in range(4) for s in range(4)]
            await asyncio.sleep(0.05)
            shared = list(_gathering._looks.values())
            tasks[0].cancel()
            await asyncio.sleep(0.01)
            assert list(_gathering._looks.values()) == shared  # still the step's one look
            await asyncio.gather(*tasks, return_exceptions=True)
            return tasks

    tasks = asyncio.run(run())
    assert tasks[0].cancelled() and lookers[0] is tasks[0]
    assert set(lookers) - {tasks[0]}, "no attempt looked on"
    parents = _parents(dynamo)
    assert len(dynamo.requests) == 15
    assert all(len(named) == 1 and None not in named for named in parents.values()), parents
    assert _gathering._looks == {}


def test_a_whole_step_cancelled_mid_look_shares_nothing_after(dynamo: Recorder) -> None:
    """Three attempts (an odd count: a look that forgot to count one out would stay), cancelled while
    ``/health`` has not answered: the look is no longer shared, at once, though something still holds
    it (the table is weak, but the next step must not hinge on when the collector runs)."""
    dynamo.instances = 4
    dynamo.health_delay = 0.3
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    held: list[object] = []

    async def cancelled() -> None:
        async with httpx.AsyncClient() as http:

            async def attempt(sibling: int) -> None:
                async with otel_session.trajectory(group="g"):
                    await http.post(f"{dynamo.url}/p0/s{sibling}/v1/chat/completions", json={}, timeout=10)

            step = asyncio.gather(*(attempt(s) for s in range(3)))
            await asyncio.sleep(0.05)
            assert len(_gathering._looks) == 1
            held.extend(_gathering._looks.values())
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
            assert _gathering._looks == {}

    asyncio.run(cancelled())
    assert _gathering._looks == {} and not dynamo.requests and held[0].inside == 0  # type: ignore[attr-defined]


def test_an_attempt_leaving_a_look_over_leaves_the_next_look_shared() -> None:
    """An attempt of a look that is over leaves after a later group opened the next look on the same
    loop and router: the next stays shared (else the later group's own attempts would each open one)."""
    origin = ("http", "127.0.0.1", 9)

    async def run() -> None:
        key = (id(asyncio.get_running_loop()), origin)
        old, new = _gathering._Look(origin), _gathering._Look(origin)
        old.over = True
        _gathering._looks[key] = new
        await old.ended()
        assert _gathering._looks[key] is new
        _gathering._looks.clear()

    asyncio.run(run())


def test_a_look_starts_reading_the_fleet_size_as_it_is_made(dynamo: Recorder) -> None:
    """The read starts as the step's first attempt is counted, not after the step's other attempts
    have reached theirs (a thousand of them take a tenth of a second on this machine)."""
    dynamo.instances = 4
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    _gathering._Look(("http", "127.0.0.1", dynamo.port))
    deadline = time.monotonic() + 5
    while not dynamo.health_reads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(dynamo.health_reads) == 1


def _thread_step(dynamo: Recorder, prompts: int, siblings: int) -> None:
    """``prompts`` x ``siblings`` attempts, one thread each, reaching their first request together
    on one ``httpx.Client`` (a rollout pool's), one request each."""
    ready = threading.Barrier(prompts * siblings)
    with httpx.Client(timeout=30) as http:

        def attempt(prompt: int, sibling: int) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": f"task {prompt}"}]}
            with otel_session.trajectory():
                ready.wait(30)
                http.post(f"{dynamo.url}/p{prompt}/s{sibling}/v1/chat/completions", json=body)

        threads = [
            threading.Thread(target=attempt, args=(p, s)) for p in range(prompts) for s in range(siblings)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)


def test_a_steps_threads_share_one_look(dynamo: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """32 prompts x 8 siblings, a thread each, ``/health`` answering in a quarter second: one thread
    looks for the step every ``SETTLE_THREADS`` and the others sleep until it is over (each thread
    looking for itself woke the process 20,000 times a second for a thousand threads). ``WAIT`` is
    2 s, as for the loop's thousand: under another process's load (a reversed run beside the demo)
    the 256 threads outlasted the half second and some prompts went paired; this pins one look."""
    monkeypatch.setattr(_gathering, "WAIT", 2.0)
    dynamo.instances = 32
    dynamo.health_delay = 0.25
    looks: list[object] = []
    again = _gathering._Look.again
    monkeypatch.setattr(_gathering._Look, "again", lambda self: looks.append(self) or again(self))
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    _thread_step(dynamo, prompts=32, siblings=8)
    assert len(looks) <= _gathering.WAIT / _gathering.SETTLE_THREADS + 5, len(looks)  # each its own: >= 512
    assert len(set(map(id, looks))) <= 3, len(set(map(id, looks)))  # a straggler may open a second
    parents = _parents(dynamo)
    assert len(parents) == 32 and len(dynamo.requests) == 256
    assert all(len(named) == 1 and None not in named for named in parents.values()), parents  # K = 8
    assert _gathering._looks == {}


def test_a_thread_looking_for_the_step_that_fails_hands_the_look_on(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The thread looking for the step meets a fault of ours: its request goes on (one line), and a
    thread sleeping on the look wakes and looks on in the same look, so the others leave as the
    look ends, not at its bound."""
    dynamo.instances = 2
    dynamo.health_delay = 0.15
    calls: list[object] = []
    again = _gathering._Look.again

    def failing_once(self: Any) -> bool:
        calls.append(self)
        if len(calls) == 3:  # the step's threads have all arrived: the looker fails mid-look
            raise RuntimeError("a bug of ours")
        return again(self)

    monkeypatch.setattr(_gathering._Look, "again", failing_once)
    monkeypatch.setattr(_faults, "_reported", set())  # reported once per process: start afresh
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        began = time.monotonic()
        _thread_step(dynamo, prompts=2, siblings=4)
        took = time.monotonic() - began
    assert took < _gathering.WAIT - 0.1, took  # /health in 0.15 s: over by ~0.25 s
    assert len(calls) > 3  # looked on after the fault
    assert len(set(map(id, calls))) == 1  # in the same look
    fault = "otel-session: waiting for a first step or a parent's turn failed (RuntimeError);"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(fault)]
    assert len(said) == 1, said
    assert len(dynamo.requests) == 8 and _gathering._looks == {}
    assert None not in {seen.get(SESSION_HEADER) for seen in dynamo.requests}


def test_a_thread_of_a_look_over_opens_the_next() -> None:
    """A thread counted as the step's look ends (over, its looker not yet out) opens a new look
    rather than joining one over, and leaving the old look leaves the new one shared."""
    origin = ("http", "127.0.0.1", 9)
    old = _gathering._shared_here(origin)
    old.over = True
    new = _gathering._shared_here(origin)
    assert new is not old and new.inside == 1 and old.inside == 1
    old.ended_here()
    assert _gathering._looks[None, origin] is new and old.inside == 0
    new.ended_here()  # no fleet size read on a closed port: looks to its bound, alone
    assert _gathering._looks == {} and new.over and new.inside == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_thread_held_the_looks_lock_gathers_on() -> None:
    """A rollout worker forked while another thread entered the threads' look: the child's threads
    make a look of their own (the lock it inherited held is not its own, the look not its step's)."""
    origin = ("http", "127.0.0.1", 9)
    _gathering._shared_here(origin)
    forked_while_held(_gathering._lock, lambda: _gathering._shared_here(origin).inside == 1)
    _gathering.forget()


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no traceback either
def test_a_loop_closed_with_its_attempts_inside_a_look_takes_the_look_with_it(dynamo: Recorder) -> None:
    """An event loop closed without cancelling its tasks (``loop.close()``, not ``asyncio.run``) while
    a step's attempts are inside a look, then dropped: nothing of ours keeps the loop or its look."""
    dynamo.health_delay = 3.0  # the size unknown: the look runs on
    origin = ("http", "127.0.0.1", dynamo.port)

    async def attempt() -> None:
        await _gathering._shared(origin).ended()

    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(attempt()) for _ in range(3)]
    loop.run_until_complete(asyncio.sleep(0.02))  # all three inside: one looks, two sleep on it
    assert len(_gathering._looks) == 1 and not any(task.done() for task in tasks)
    dropped = weakref.ref(loop)
    loop.close()
    del loop, tasks
    gc.collect()
    assert dropped() is None
    assert _gathering._looks == {}


def test_threads_leaving_a_look_not_over_drop_it_as_the_last_leaves() -> None:
    """Two threads in a look that ended without being over (past its bound, nobody looking): the
    first to leave keeps it shared, the last drops it at once (held elsewhere, it is still no longer
    shared)."""
    origin = ("http", "127.0.0.1", 9)
    look = _gathering._shared_here(origin)
    assert _gathering._shared_here(origin) is look and look.inside == 2
    look.end = time.monotonic() - 1.0
    look.ended_here()
    assert _gathering._looks[None, origin] is look and look.inside == 1
    look.ended_here()
    assert (None, origin) not in _gathering._looks and look.inside == 0 and not look.over


class _CountedEvent(threading.Event):
    """An event that counts the waits on it."""

    waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_a_thread_whose_looker_vanished_waits_to_the_bound_once() -> None:
    """A thread sleeping on a look whose looker never wakes it (gone without a word) leaves at the
    look's bound (plus one look), in one wait, not before and never hanging."""
    origin = ("http", "127.0.0.1", 9)
    look = _gathering._shared_here(origin)
    look.looking = True  # someone else looks, and never says it is over
    look.done = _CountedEvent()
    look.end = time.monotonic() + _gathering.SETTLE_THREADS / 2  # within one look of its bound
    left: list[float] = []

    def sleep_on_it() -> None:
        look.ended_here()
        left.append(time.monotonic())

    thread = threading.Thread(target=sleep_on_it, daemon=True)  # a mutant that hangs must not hang pytest
    thread.start()
    thread.join(3)
    assert left, "the thread hung on a look nobody was looking for"
    assert look.end <= left[0] < look.end + _gathering.SETTLE_THREADS + 0.15, left[0] - look.end
    assert look.done.waits <= 2, look.done.waits
    _gathering.forget()


def test_unconfigured_while_a_first_step_gathers_its_requests_go_on_without_a_fault(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """``unconfigure()`` while a first step's attempts wait for it to gather (the router's /health
    slow): each request goes on as the wait ends, and nothing is reported as a fault of ours (no
    settings left to read a pace from is no pace, not an error)."""
    dynamo.instances = 4
    dynamo.health_delay = 0.3
    otel_session.configure(dynamo_hosts=[dynamo.url])

    async def run() -> None:
        async with httpx.AsyncClient() as http:

            async def attempt(sibling: int) -> None:
                async with otel_session.trajectory():
                    url = f"{dynamo.url}/p0/s{sibling}/v1/chat/completions"
                    await http.post(url, json={"model": "m", "messages": [{"role": "user", "content": "t"}]})

            step = asyncio.gather(*(attempt(s) for s in range(4)))
            await asyncio.sleep(0.1)
            otel_session.unconfigure()
            await step

    with caplog.at_level(logging.WARNING, logger="otel_session"):
        asyncio.run(run())
    assert len(dynamo.requests) == 4
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
