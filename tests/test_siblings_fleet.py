"""``OTEL_SESSION_SIBLINGS=fleet`` (issue 33, item 4): K chosen at run time, one group of siblings per
worker, from the router's ``/health`` and the last step's shape, or an async first step's own
(``_gathering``); a first step that cannot be sized (a /health too slow) goes without the session
(the router places it as it would without otel-session). Over
loopback to a recording server that lists its workers in ``/health`` as a Dynamo frontend does.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from collections import Counter
from typing import Any

import aiohttp
import httpx
import pytest

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER, _fleet, _hop, _siblings
from otel_session._siblings import Siblings, open_groups
from tests import support
from tests.recorder import PATIENCE, Recorder


def _step(
    dynamo: Recorder, prompts: int, siblings: int, *, group: bool = True, client: str = "httpx"
) -> None:
    """``prompts`` x ``siblings`` attempts at once, two chat turns each (the first turn's prompt is
    the prompt's: siblings share it)."""
    # each attempt has its own client, but all share one TLS context: loading the CA bundle for each
    # of 128 clients (unused: plain http to loopback) took 14 of the test's 20 s
    tls = ssl.create_default_context()

    async def attempt(prompt: int, sibling: int) -> None:
        key = f"prompt-{prompt}" if group else None
        body = {"model": "m", "messages": [{"role": "user", "content": f"task {prompt}"}]}
        url = f"{dynamo.url}/p{prompt}/s{sibling}/v1/chat/completions"
        async with otel_session.trajectory(group=key):
            if client == "httpx":
                async with httpx.AsyncClient(verify=tls) as http:
                    for _ in range(2):
                        await http.post(url, json=body, timeout=10)
            else:
                async with aiohttp.ClientSession() as http:
                    for _ in range(2):
                        async with http.post(url, json=body) as answer:
                            await answer.read()

    async def run() -> None:
        await asyncio.gather(*(attempt(p, s) for p in range(prompts) for s in range(siblings)))

    asyncio.run(run())


def _held_step(dynamo: Recorder, prompts: int, siblings: int) -> None:
    """``_step`` with every attempt held open until all have made their first request: all its
    groups are open at once, as in a GRPO step on a real fleet (a loopback server answers so fast
    that a plain step's attempts can end before others start)."""
    together = asyncio.Barrier(prompts * siblings)

    async def attempt(prompt: int, sibling: int) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": f"held task {prompt}"}]}
        url = f"{dynamo.url}/p{prompt}/s{sibling}/v1/chat/completions"
        async with otel_session.trajectory(group=f"held-{prompt}"), httpx.AsyncClient() as http:
            await http.post(url, json=body, timeout=10)
            await together.wait()
            await http.post(url, json=body, timeout=10)

    async def run() -> None:
        await asyncio.gather(*(attempt(p, s) for p in range(prompts) for s in range(siblings)))

    asyncio.run(run())


def _two_held_steps(
    dynamo: Recorder, prompts: int, siblings: int
) -> list[dict[tuple[str, str], tuple[str | None, str | None]]]:
    """Two ``_held_step``s, one after the other (the first gathered, sized by itself; the second
    sized by the first), each one's ``_attempts``."""
    steps = []
    for _ in range(2):
        _held_step(dynamo, prompts=prompts, siblings=siblings)
        steps.append(_attempts(dynamo))
        dynamo.clear()
    return steps


def _attempts(dynamo: Recorder) -> dict[tuple[str, str], tuple[str | None, str | None]]:
    """(prompt, sibling) -> (session, parent) its requests carried, the same on every turn."""
    carried: dict[tuple[str, str], set[tuple[str | None, str | None]]] = {}
    for seen in dynamo.requests:
        if seen.path == "/health":
            continue
        _, prompt, sibling = seen.path.split("/")[:3]
        carried.setdefault((prompt, sibling), set()).add(
            (seen.get(SESSION_HEADER), seen.get(PARENT_SESSION_HEADER))
        )
    assert all(len(both) == 1 for both in carried.values()), carried
    return {key: next(iter(both)) for key, both in carried.items()}


def _wait_for_size(dynamo: Recorder) -> None:
    deadline = time.monotonic() + PATIENCE
    origin = ("http", dynamo.host, dynamo.port)
    while _fleet.size_at(origin) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _fleet.known(), "the router's /health was never read"


def test_fleet_is_spelled_and_shown() -> None:
    policy = Siblings.parse(" Fleet ")
    assert policy.sized and policy.withholds and str(policy) == "fleet"
    auto = Siblings.parse("AUTO")
    assert auto.sized and not auto.withholds and str(auto) == "auto"
    assert not Siblings.parse("groups:2").sized and not Siblings.parse("prompt").withholds


@pytest.mark.parametrize(
    ("workers", "prompts", "siblings", "size"),
    [
        (32, 16, 8, 4),  # doctor's rule: one group per worker, ceil(8 / (32 // 16))
        (64, 8, 16, 2),  # ceil(16 / 8)
        (8, 16, 8, 8),  # more groups than workers: all siblings of a prompt under one parent
        (16, 16, 4, 4),  # as many groups as workers: one each
        (1024, 4, 8, 1),  # a worker for every sibling: each alone
        (33, 16, 8, 4),  # 33 // 16 = 2
        (32, 12, 5, 3),  # ceil(5 / (32 // 12 = 2))
    ],
)
def test_k_follows_doctors_rule_from_the_last_step(
    workers: int, prompts: int, siblings: int, size: int
) -> None:
    policy = Siblings.parse("fleet")
    tickets = [
        _siblings.join((p, "step-1"), policy, workers) for p in range(prompts) for _ in range(siblings)
    ]
    assert all(ticket is not None and ticket[0] == _siblings.WITHHELD for ticket in tickets)  # no step seen
    for ticket in tickets:
        assert ticket is not None
        _siblings.leave(ticket[1])
    assert open_groups() == 0
    assert _siblings.fleet_size_of(workers, withhold=False) == size  # auto
    # fleet: the same K, a step with more groups than workers too (its new parents are paced)
    assert _siblings.fleet_size_of(workers) == size
    assert _siblings.fleet_size_of(None) is None  # the fleet's size not read yet: withheld
    assert _siblings.fleet_size_of(_siblings.UNREADABLE) == 2  # no /health: the default's K
    _siblings.forget_shape()
    assert _siblings.fleet_size_of(workers) is None


def test_a_gathered_first_step_is_grouped_per_worker_and_so_is_the_next(
    dynamo: Recorder, gym: Recorder
) -> None:
    """An async step's attempts gather at their first request (``_gathering``): the first step is
    sized by itself (16 x 8 on 32 workers: K = 4), not withheld; the next by the step before."""
    dynamo.instances = 32
    otel_session.configure(dynamo_hosts=[dynamo.url], trusted_hosts=[gym.url], siblings="fleet")
    before = support.metric_points()
    for step in range(2):
        dynamo.clear()
        _step(dynamo, prompts=16, siblings=8)
        carried = _attempts(dynamo)
        sessions = [session for session, _ in carried.values()]
        assert len(set(sessions)) == 128 and None not in sessions, step
        for prompt in {p for p, _ in carried}:
            parents = Counter(parent for (p, _), (_, parent) in carried.items() if p == prompt)
            assert sorted(parents.values()) == [4, 4] and None not in parents, step  # K = 4
    assert len(dynamo.health_reads) == 1 and not any(
        k.lower().startswith("x-dynamo") for k in dynamo.health_reads[0]
    )
    assert open_groups() == 0
    assert (
        support.metric_delta(before, "otel_session.sibling_choices", otel_session__siblings__choice="sized")
        == 256
    )
    assert not support.metric_delta(
        before, "otel_session.sibling_choices", otel_session__siblings__choice="withheld"
    )


def test_a_first_step_of_threads_is_grouped_per_worker_too(dynamo: Recorder, gym: Recorder) -> None:
    """Threads gather their first step by sleeping at their first request (``_gathering``): sized by
    itself (4 workers, 2 groups of 4: K = 2), as the next by the step before; trusted hosts still
    get the session in baggage."""
    dynamo.instances = 4
    otel_session.configure(dynamo_hosts=[dynamo.url], trusted_hosts=[gym.url], siblings="fleet")

    client = httpx.Client(timeout=10)  # one client for the step's threads, as a rollout pool shares one

    def step(tag: str) -> None:
        def attempt(prompt: int, sibling: int, ready: threading.Barrier) -> None:
            with otel_session.trajectory(group=f"prompt-{prompt}"):
                ready.wait(10)  # a step's threads reach their first request together
                client.post(f"{dynamo.url}/{tag}{prompt}/s{sibling}/v1/chat/completions", json={})
                ready.wait(10)  # every attempt joined before any ends: two groups of four

        ready = threading.Barrier(8)
        threads = [threading.Thread(target=attempt, args=(p, s, ready)) for p in range(2) for s in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

    for tag in ("a", "b"):
        dynamo.clear()
        step(tag)
        carried = _attempts(dynamo)
        assert len(carried) == 8 and None not in {session for session, _ in carried.values()}, tag
        for prompt in (f"{tag}0", f"{tag}1"):
            parents = Counter(parent for (p, _), (_, parent) in carried.items() if p == prompt)
            assert sorted(parents.values()) == [2, 2] and None not in parents, tag
    client.close()
    with otel_session.trajectory() as attempt:
        httpx.get(f"{gym.url}/episode", timeout=10)
    assert attempt.session_id is not None and attempt.session_id in (gym.requests[0].get("baggage") or "")


def test_siblings_found_by_prompt_are_sized_the_same_through_aiohttp(dynamo: Recorder) -> None:
    dynamo.instances = 16
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")
    _step(dynamo, prompts=4, siblings=8, group=False, client="aiohttp")
    _wait_for_size(dynamo)
    dynamo.clear()
    _step(dynamo, prompts=4, siblings=8, group=False, client="aiohttp")
    second = _attempts(dynamo)
    for prompt in {p for p, _ in second}:
        parents = Counter(parent for (p, _), (_, parent) in second.items() if p == prompt)
        assert sorted(parents.values()) == [2, 2, 2, 2]  # 16 workers, 4 prompts: 4 groups of 2 each


def test_a_fleet_as_large_as_the_step_sends_each_sibling_alone(dynamo: Recorder) -> None:
    dynamo.instances = 64
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")
    _step(dynamo, prompts=4, siblings=4)
    _wait_for_size(dynamo)
    dynamo.clear()
    _step(dynamo, prompts=4, siblings=4)
    second = _attempts(dynamo)
    assert {parent for _, parent in second.values()} == {None}
    assert len({session for session, _ in second.values()}) == 16


def test_a_router_without_a_fleet_list_is_one_line_and_the_default(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _step(dynamo, prompts=2, siblings=4)
        _wait_for_size(dynamo)
        _step(dynamo, prompts=2, siblings=4)
        dynamo.clear()
        _step(dynamo, prompts=2, siblings=4)
    lines = [
        r.getMessage() for r in caplog.records if "/health" in r.getMessage() and "lists no" in r.getMessage()
    ]
    assert len(lines) == 1 and "groups:2" in lines[0] and dynamo.url in lines[0]
    attempts = _attempts(dynamo)
    assert None not in {session for session, _ in attempts.values()}
    per_parent = Counter(parent for _, parent in attempts.values())
    assert set(per_parent.values()) == {2}


def test_a_router_that_takes_no_parent_always_gets_the_session(gym: Recorder) -> None:
    otel_session.configure(routers={"vllm-router": [gym.url]}, siblings="fleet")
    _step(gym, prompts=2, siblings=4)
    attempts = _attempts(gym)
    assert len(attempts) == 8
    sessions = {seen.get("X-Session-ID") for seen in gym.requests}
    assert None not in sessions and len(sessions) == 8
    assert not gym.health_reads  # no fleet size asked for


def test_unconfigure_forgets_the_steps_seen(dynamo: Recorder) -> None:
    """After ``unconfigure()`` no step is known: an attempt of a thread (which cannot gather its
    step) is withheld again, as in a process's first step."""
    dynamo.instances = 8
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")
    _step(dynamo, prompts=2, siblings=2)
    assert _siblings.step_seen()
    otel_session.unconfigure()
    assert not _siblings.step_seen()
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")
    dynamo.clear()
    with otel_session.trajectory(group="g"):
        httpx.post(f"{dynamo.url}/a/0/v1/chat/completions", json={"messages": []}, timeout=10)
    assert _attempts(dynamo) == {("a", "0"): (None, None)}


def test_an_attempt_keeps_its_choice_for_every_turn(dynamo: Recorder) -> None:
    """One attempt's turns never mix pinned and unpinned: the choice is made at its first request."""
    dynamo.instances = 4
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")
    with otel_session.trajectory(group="g") as withheld:
        httpx.post(f"{dynamo.url}/a/0/v1/chat/completions", json={"messages": []}, timeout=10)
        _wait_for_size(dynamo)
        httpx.post(f"{dynamo.url}/a/0/v1/chat/completions", json={"messages": []}, timeout=10)
    assert _attempts(dynamo) == {("a", "0"): (None, None)}
    assert withheld.parent_session_id is None  # withheld: no parent named anywhere
    dynamo.clear()
    with otel_session.trajectory(group="g"):
        for _ in range(3):
            httpx.post(f"{dynamo.url}/b/0/v1/chat/completions", json={"messages": []}, timeout=10)
    ((session, parent),) = _attempts(dynamo).values()
    assert session is not None and parent is None  # one sibling on a 4-worker fleet: alone


def test_turns_of_a_withheld_attempt_are_no_evidence_about_affinity(dynamo: Recorder) -> None:
    """A withheld attempt's turns land wherever the router alone puts them: that they switch workers
    must not read as affinity failing (the first real run printed "not holding" for them)."""
    from otel_session import _evidence

    dynamo.instances = 4  # listed: withheld for want of a step, however fast /health answers
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")
    host, port = dynamo.host, dynamo.port
    with otel_session.trajectory(group="g"):
        httpx.post(f"{dynamo.url}/a/0/v1/chat/completions", json={"messages": []}, timeout=10)
        for turn in range(12):
            answer = {
                "usage": {"prompt_tokens": 100 * (turn + 1), "prompt_tokens_details": {"cached_tokens": 0}},
                "nvext": {"worker_id": {"decode_worker_id": turn}},
            }
            _evidence.parsed(answer, "http", host, port)
    assert _attempts(dynamo) == {("a", "0"): (None, None)}
    assert _evidence.summaries() == {}


def test_requests_attempts_are_decided_at_their_first_request_too(dynamo: Recorder) -> None:
    """Through requests (urllib3 beneath): both steps grouped by prompt, the first as it gathers
    (its threads wait at their first request: ``_gathering``), the next by the first."""
    import threading

    import requests

    dynamo.instances = 2
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")

    def step() -> None:
        barrier = threading.Barrier(4)

        def attempt(sibling: int) -> None:
            with otel_session.trajectory():
                barrier.wait(timeout=10)  # all four open at once, as a step's siblings are
                body = {"model": "m", "messages": [{"role": "user", "content": "same task"}]}
                for _ in range(2):
                    requests.post(f"{dynamo.url}/p0/s{sibling}/v1/chat/completions", json=body, timeout=10)
                barrier.wait(timeout=10)

        threads = [threading.Thread(target=attempt, args=(s,)) for s in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)

    for _ in range(2):
        dynamo.clear()
        step()
        parents = Counter(parent for _, parent in _attempts(dynamo).values())
        assert sorted(parents.values()) == [2, 2] and None not in parents  # 1 group of 4, 2 workers: K = 2


def test_under_the_default_a_named_groups_parent_reaches_trusted_hosts_in_baggage(
    dynamo: Recorder, gym: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` decides a ``group=`` attempt's parent as it opens (sized to the largest fleet read so
    far), so a trusted host (a Gym server calling the router itself) gets it in baggage, as before."""
    monkeypatch.delenv("OTEL_SESSION_SIBLINGS", raising=False)
    otel_session.configure(dynamo_hosts=[dynamo.url], trusted_hosts=[gym.url])

    async def attempt(index: int) -> None:
        async with otel_session.trajectory(group="same"), httpx.AsyncClient() as client:
            await client.post(f"{gym.url}/run/{index}", json={}, timeout=10)
            await asyncio.sleep(0.05)

    async def run() -> None:
        await asyncio.gather(*(attempt(i) for i in range(2)))

    asyncio.run(run())
    parents = {
        member.split("=", 1)[1]
        for seen in gym.requests
        for member in (seen.get("baggage") or "").split(",")
        if member.strip().startswith("session.parent_id=")
    }
    assert len(parents) == 1 and len(gym.requests) == 2  # the pair's one parent, to both requests


def _open_close(groups: int, siblings: int, policy: Siblings, workers: int | None = None) -> list[Any]:
    tickets = [_siblings.join((g, "x"), policy, workers) for g in range(groups) for _ in range(siblings)]
    for ticket in tickets:
        assert ticket is not None
        _siblings.leave(ticket[1])
    return tickets


def test_the_shape_is_the_last_steps_whatever_the_running_step_opens() -> None:
    auto = Siblings.parse("auto")
    assert _siblings.last_shape() == (0, 0) and not _siblings.needs_fleet_size(auto)
    assert _siblings.needs_fleet_size(Siblings.parse("fleet"))  # fleet reads the size from the start
    assert not _siblings.needs_fleet_size(Siblings.parse("groups:2"))
    first = _siblings.join("a", auto)
    assert first is not None and not _siblings.needs_fleet_size(auto)  # one attempt: no siblings yet
    second = _siblings.join("a", auto)
    assert second is not None and _siblings.needs_fleet_size(auto)  # two: the size will be wanted
    other = _siblings.join("b", auto)
    assert other is not None
    _siblings.leave(first[1])
    _siblings.leave(second[1])
    assert _siblings.last_shape() == (2, 2)  # a group ended: its size, and the groups open at once
    _siblings.leave(other[1])
    assert _siblings.last_shape() == (2, 2)  # the step ended (no group open): kept as the last
    _open_close(1, 5, auto)
    assert _siblings.last_shape() == (1, 5)  # that step ended: 1 group of 5 is the last step now
    running = [_siblings.join(g, auto) for g in range(3)]  # a step under way: 3 groups open at once
    assert _siblings.last_shape() == (1, 5)  # the step before's alone: no K changes mid-step
    for ticket in running:
        assert ticket is not None
        _siblings.leave(ticket[1])
    assert _siblings.last_shape() == (1, 5)  # a step of lone attempts (an evaluation pass): kept
    paired = [_siblings.join(g, auto) for g in range(3) for _ in range(2)]  # a step with siblings
    assert _siblings.last_shape() == (1, 5)  # under way: still the step before's, not (3, 2)
    for ticket in paired:
        assert ticket is not None
        _siblings.leave(ticket[1])
    assert _siblings.last_shape() == (3, 2)  # the next step with siblings replaces it
    _open_close(4, 1, auto)
    assert _siblings.last_shape() == (3, 2)  # pairs too are siblings: a lone step after them is not
    _siblings.forget_shape()
    _open_close(6, 1, auto)
    _open_close(3, 1, auto)
    assert _siblings.last_shape() == (3, 1)  # lone after lone: the step before, as any step
    _siblings.forget_shape()


def test_a_first_step_is_sized_by_its_ended_groups_while_it_runs() -> None:
    """A lone group ended while another is open, in a process's first step: (2 groups, 1 sibling),
    each alone on 8 workers (not the default's pairs, as before any group has ended)."""
    auto = Siblings.parse("auto")
    lone, *pair = (_siblings.join(key, auto) for key in ("a", "b", "b"))
    assert lone is not None and _siblings.fleet_size_of(8, withhold=False) == 2  # nothing ended yet
    _siblings.leave(lone[1])
    assert _siblings.fleet_size_of(8, withhold=False) == 1
    for ticket in pair:
        assert ticket is not None
        _siblings.leave(ticket[1])
    _siblings.forget_shape()
    assert _siblings.last_shape() == (0, 0) and not _siblings.needs_fleet_size(auto)


def test_one_sibling_per_worker_names_no_parent_only_when_sized() -> None:
    _open_close(4, 2, Siblings.parse("auto"))  # last step: 4 groups of 2
    auto = _siblings.join("k", Siblings.parse("auto"), 8)  # 8 // 4 = 2 workers a group: K = 1
    fixed = _siblings.join("j", Siblings.parse("groups:1"))
    assert auto is not None and auto[0] is None and auto[1].size == 1 and auto[1].sized
    assert fixed is not None and fixed[0] is not None and fixed[1].size == 1 and not fixed[1].sized
    unread = _siblings.join("u", Siblings.parse("auto"), _siblings.UNREADABLE)
    assert unread is not None and unread[1].size == 2 and not unread[1].sized
    _siblings.forget_shape()
    unsized = _siblings.join("n", Siblings.parse("auto"), 8)  # no step seen: pairs, not sized
    assert unsized is not None and unsized[1].size == 2 and not unsized[1].sized and unsized[0]
    for ticket in (auto, fixed, unread, unsized):
        _siblings.leave(ticket[1])
    assert open_groups() == 0


def _crowd(dynamo: Recorder) -> None:
    """Turns as the evidence reads them from a router whose pinned sessions crowd one worker of four
    (12 sessions there, slower) while the others serve one or two each, two turns per session."""
    from otel_session import _evidence

    router = _evidence.router_for("http", dynamo.host, dynamo.port)
    assert router is not None
    for turn in range(2):
        for worker, sessions in {1: 12, 2: 1, 3: 1, 4: 2}.items():
            for s in range(sessions):
                latency = 0.4 if worker == 1 else 0.1
                prompt = 1000 * (turn + 1)
                _evidence.turn(f"w{worker}s{s}", router, prompt, prompt - 1000, worker, latency, "m")


@pytest.mark.parametrize("policy", ["fleet", "auto"])
def test_fleet_withholds_sessions_where_pinning_crowded_workers_and_auto_never_does(
    dynamo: Recorder, gym: Recorder, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Several frontends each bind parents on their own and crowd workers (docs/performance.md):
    once the evidence sees pinned sessions crowd a few workers while others idle, ``fleet`` sends
    the next attempts at that router without their session (kv routing alone places them), says
    so once and counts it; other routers keep theirs, the default keeps the header on every request,
    and unconfigure() forgets it."""
    dynamo.instances = gym.instances = 4
    otel_session.configure(dynamo_hosts=[dynamo.url, gym.url], siblings=policy)
    for router in (dynamo, gym):
        _step(router, prompts=2, siblings=4)
        _wait_for_size(router)
        router.clear()
        _step(router, prompts=2, siblings=4)
        assert None not in {session for session, _ in _attempts(router).values()}  # sized and pinned
        router.clear()
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _crowd(dynamo)
        before = support.metric_points()
        _step(dynamo, prompts=2, siblings=4)
        first = _attempts(dynamo)
        dynamo.clear()
        _step(dynamo, prompts=2, siblings=4)  # a second step: withheld again, said once
        _step(gym, prompts=1, siblings=2)
    assert set(first.values()) == set(_attempts(dynamo).values()) or policy == "auto"
    withheld = support.metric_delta(
        before, "otel_session.sibling_choices", otel_session__siblings__choice="withheld"
    )
    lines = [r.getMessage() for r in caplog.records if "crowded" in r.getMessage()]
    assert None not in {session for session, _ in _attempts(gym).values()}  # not that router's crowding
    if policy == "auto":
        assert None not in {session for session, _ in _attempts(dynamo).values()}
        assert withheld == 0
        assert len(lines) == 1 and "OTEL_SESSION_SIBLINGS=fleet" in lines[0]
        return
    assert set(_attempts(dynamo).values()) == {(None, None)}
    assert withheld == 16
    said = [line for line in lines if "from now on" in line]
    assert said == [
        f"otel-session: OTEL_SESSION_SIBLINGS=fleet sends new attempts to dynamo router {dynamo.host}:"
        f"{dynamo.port} without their session from now on: sessions pinned there crowded a few workers "
        "while others idled (a GRPO step waits for its slowest trajectory), so kv routing alone places "
        "them; unconfigure() and configure() again to try pinning anew"
    ]
    assert len(lines) == 2 and "fleet now sends" in lines[0]  # the crowding line, then fleet's
    otel_session.unconfigure()
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings=policy)
    _step(dynamo, prompts=2, siblings=4)  # a new configuration: the first step again, withheld ...
    _wait_for_size(dynamo)
    dynamo.clear()
    _step(dynamo, prompts=2, siblings=4)
    assert None not in {session for session, _ in _attempts(dynamo).values()}  # ... then pinned again


def test_more_prompts_than_workers_is_not_called_one_group_per_worker(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """8 prompts of 2 on 4 workers under the default: K is the whole group (2), 8 groups on 4
    workers; the line says so rather than "one group per worker" (found from outside); and a policy
    shows as its name."""
    dynamo.instances = 4
    settings = otel_session.configure(dynamo_hosts=[dynamo.url], siblings="auto")
    assert repr(settings.siblings) == "Siblings('auto')"
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _step(dynamo, prompts=8, siblings=2)  # gathered: sized by itself, said once
        dynamo.clear()
        _step(dynamo, prompts=8, siblings=2)  # the same K: not said again
    (line,) = [r.getMessage() for r in caplog.records if "sized to the fleet" in r.getMessage()]
    assert line == (
        "otel-session: siblings sized to the fleet: 2 per parent session (4 workers; this step has 8 "
        "groups of up to 2 siblings open at once: 8 groups: some share a worker)"
    )
    assert None not in {parent for _, parent in _attempts(dynamo).values()}  # the header always sent


@pytest.mark.parametrize(("prompts", "crowded"), [(6, True), (8, False)])
def test_the_default_says_so_where_it_pins_a_step_fleet_would_withhold(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture, prompts: int, crowded: bool
) -> None:
    """6 pairs on 4 workers: two pairs on two workers, 1.33x a fair share, past what a pair saves
    (``_siblings.unshared``; this step measured 1.35-1.38x kv routing alone's). The default still
    pins every attempt, and its one line says so and names ``fleet``; 8 pairs on 4 (even) do not."""
    dynamo.instances = 4
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _step(dynamo, prompts=prompts, siblings=2)
    (line,) = [r.getMessage() for r in caplog.records if "sized to the fleet" in r.getMessage()]
    assert line.endswith(f"{prompts} groups: some share a worker){_hop.CROWDS if crowded else ''}")
    assert "OTEL_SESSION_SIBLINGS=fleet sends such a step" in _hop.CROWDS
    assert None not in {parent for _, parent in _attempts(dynamo).values()}  # the header always sent


def test_fleet_pins_a_step_of_more_groups_than_workers_as_the_default_does(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """More groups open at once than workers (8 prompts on 4 workers): some workers must hold
    several groups. Unpaced, Dynamo placed such a burst of new parents unevenly in half the steps;
    paced (``_pacing``; pairs 40 ms apart) it placed them evenly and 16 pairs on 8 workers took
    0.72-0.78x kv routing alone's step (docs/performance.md), so ``fleet`` pins such a step as the
    default does, whole groups, every step, and withholds nothing."""
    dynamo.instances = 4
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")
    before = support.metric_points()
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        steps = _two_held_steps(dynamo, prompts=8, siblings=2)  # the first step itself has 8 groups
    for attempts in steps:
        assert None not in {session for session, _ in attempts.values()}
        assert sorted(Counter(parent for _, parent in attempts.values()).values()) == [2] * 8
    assert not [r for r in caplog.records if "without their session" in r.getMessage()]
    choices = "otel_session.sibling_choices"
    assert support.metric_delta(before, choices, otel_session__siblings__choice="sized") == 32


@pytest.mark.parametrize("policy", ["fleet", "auto"])
def test_fleet_withholds_a_step_whose_pairs_crowd_a_worker_and_the_default_pins_it(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    """6 prompts of 2 on 4 workers: whole pairs put two groups, 4 siblings, on two workers against a
    fair share of 3 (1.33x), more than a pair's shared prompt saves (this step measured 1.35-1.38x kv
    routing alone's step in its second step; a session per attempt 1.09-1.29x). ``fleet`` sends such a step
    without sessions, from its gathered first step, and says why once; the default keeps the header
    on every request and pins the pairs."""
    dynamo.instances = 4
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings=policy)
    before = support.metric_points()
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        steps = _two_held_steps(dynamo, prompts=6, siblings=2)  # the first step itself has 6 pairs
    lines = [r.getMessage() for r in caplog.records if "without their session" in r.getMessage()]
    choices = "otel_session.sibling_choices"
    for attempts in steps:
        assert len(attempts) == 12
        if policy == "fleet":
            assert set(attempts.values()) == {(None, None)}
        else:
            assert None not in {session for session, _ in attempts.values()}
            assert sorted(Counter(parent for _, parent in attempts.values()).values()) == [2] * 6
    if policy == "fleet":
        assert lines == [
            "otel-session: OTEL_SESSION_SIBLINGS=fleet sends this step's attempts without their session: 6 "
            "groups of 2 siblings on 4 workers would put more on the busiest worker than sharing a prompt "
            "saves (pinned, 6 pairs on 4 workers took 1.35-1.38x kv routing alone's step), so the router "
            "places them as it would without otel-session"
        ]
        assert support.metric_delta(before, choices, otel_session__siblings__choice="withheld") == 24
    else:
        assert lines == [] and not support.metric_delta(
            before, choices, otel_session__siblings__choice="withheld"
        )


def test_a_step_crowds_past_what_sharing_saves_only_where_groups_outnumber_workers() -> None:
    """``unshared``, on the cells measured (docs/performance.md): pairs crowded past 4/3 of a fair
    share (11 x 2 on 8: 1.45x) are, or past a fair share on 4 workers, and a prompt split into a
    pair and one (10 x 3 on 8, 16 x 3 on 12); pairs crowded up to 1.33x on 8 or 16 workers, groups
    of 4 or 8 crowded 1.33x, the split 10 x 4 (3 and 1), even steps and fewer groups than workers are
    not."""
    unshared = _siblings.unshared
    assert unshared(4, 6, 2, 2) and unshared(7, 10, 2, 2)  # busiest 4 against a fair 3 and 2.86 (1.4x)
    assert not unshared(8, 12, 2, 2) and not unshared(16, 24, 2, 2)  # 4 against 3, on 8 and 16 workers
    assert not unshared(8, 14, 2, 2) and unshared(8, 10, 2, 2)  # 4 against 3.5; 4 against 2.5 (1.6x)
    assert unshared(8, 11, 2, 2) and unshared(16, 22, 2, 2)  # 4 against 2.75 (1.45x)
    assert not unshared(12, 18, 2, 2) and not unshared(4, 13, 1, 1)  # 4 against 3: 4/3 exactly; lone
    assert not unshared(4, 8, 2, 2) and not unshared(2, 3, 2, 1)  # even; 6 siblings each alone on 2: 3 each
    assert not unshared(8, 12, 4, 4) and not unshared(8, 12, 8, 8)  # 1.33x, under 1.375 and 1.44
    assert unshared(8, 11, 8, 8)  # 16 against 11: 1.45x, past 1 + 7/16
    assert not unshared(8, 10, 4, 3)  # the split: 6 against 5
    assert unshared(8, 10, 3, 2) and unshared(12, 16, 3, 2)  # split into a pair and one, even or not
    assert not unshared(32, 16, 8, 2) and not unshared(16, 18, 4, 3)  # even pairs; groups of 3 and one
    assert not unshared(3, 2, 3, 1)  # 2 prompts' 3 siblings each alone on 3 workers: 2 each, even
    assert not unshared(8, 16, 4, 4) and not unshared(8, 16, 2, 2)  # even
    assert not unshared(16, 6, 5, 3) and not unshared(32, 16, 8, 4)  # a worker for each group
    assert unshared(8, 9, 2, 2)  # 4 against 2.25: one worker with two pairs, most with one
    assert unshared(3, 2, 2, 1)  # 2 prompts' 4 siblings each alone on 3 workers: 2 against 1.33
    assert unshared(2, 3, 3, 3)  # 6 against 4.5, exactly 1 + 2/6 times it
    assert not unshared(2, 1, 3, 2)  # groups of 2 and 1 on 2 workers: a worker for each
    assert not unshared(1, 1, 2, 1)  # one prompt on one worker: 2, its fair share
    assert not unshared(1, 2, 1, 1) and not unshared(4, 12, 1, 1)  # no siblings: nothing shared


def test_a_group_size_is_ascii_digits_only() -> None:
    with pytest.raises(ValueError, match="groups:K"):
        Siblings.parse("groups:\u0663")  # ARABIC-INDIC DIGIT THREE: str.isdigit() says yes


def test_more_prompts_than_workers_not_a_multiple_split_each_prompt_three_and_one(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """10 prompts of 4 on 8 workers under the default: whole groups put two prompts' 8 siblings on
    two workers (measured up to 1.28x kv routing alone's step, docs/performance.md); K = 3 puts 6
    there, each prompt's last sibling in a group of its own, placed by the router where there is
    room. From the gathered first step on, with the header on every request."""
    dynamo.instances = 8
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _step(dynamo, prompts=10, siblings=4)
        for step in (1, 2):
            attempts = _attempts(dynamo)
            assert len(attempts) == 40 and None not in {session for session, _ in attempts.values()}
            for prompt in range(10):
                parents = Counter(attempts[f"p{prompt}", f"s{sibling}"][1] for sibling in range(4))
                assert sorted(parents.values()) == [1, 3] and None not in parents, (step, prompt, parents)
            dynamo.clear()
            if step == 1:
                _step(dynamo, prompts=10, siblings=4)
    (line,) = [r.getMessage() for r in caplog.records if "sized to the fleet" in r.getMessage()]
    assert line == (
        "otel-session: siblings sized to the fleet: 3 per parent session (8 workers; this step has 10 "
        "groups of up to 4 siblings open at once: 20 groups: some share a worker (each prompt's 4 as 3 + 1))"
    )


def _split_of(dynamo: Recorder, prompts: int, siblings: int) -> set[tuple[int, ...]]:
    """How each prompt's attempts were grouped under parents in the step just sent (sizes, sorted)."""
    attempts = _attempts(dynamo)
    assert len(attempts) == prompts * siblings and None not in {session for session, _ in attempts.values()}
    grouped = set()
    for prompt in range(prompts):
        parents = Counter(attempts[f"p{prompt}", f"s{sibling}"][1] for sibling in range(siblings))
        assert None not in parents or siblings == 1, parents
        grouped.add(tuple(sorted(parents.values())))
    dynamo.clear()
    return grouped


def test_a_step_is_sized_by_the_step_before_alone_and_an_evaluation_pass_changes_nothing(
    dynamo: Recorder,
) -> None:
    """Found from outside: a step after a smaller one was sized by the groups it had opened so far,
    its first prompts in pairs, then whole, then split 3 + 1, all in one step (the split ones 10 ms
    apart, measured 1.34-1.66x); and a pass of lone attempts between GRPO steps (an evaluation) would
    size the next GRPO step one attempt per parent. Now each step follows the step with siblings
    before it, every prompt of a step grouped alike."""
    dynamo.instances = 8
    otel_session.configure(dynamo_hosts=[dynamo.url])
    _step(dynamo, prompts=10, siblings=4)  # gathered: sized by itself
    assert _split_of(dynamo, 10, 4) == {(1, 3)}
    _step(dynamo, prompts=12, siblings=1)  # an evaluation pass: one attempt a prompt
    _split_of(dynamo, 12, 1)
    _step(dynamo, prompts=4, siblings=4)  # sized by the 10 x 4 before the pass (a lag, documented)
    assert _split_of(dynamo, 4, 4) == {(1, 3)}
    _step(dynamo, prompts=10, siblings=4)  # sized by 4 x 4 alone: pairs for every prompt, none mixed
    assert _split_of(dynamo, 10, 4) == {(2, 2)}
    _step(dynamo, prompts=10, siblings=4)  # and by 10 x 4 again
    assert _split_of(dynamo, 10, 4) == {(1, 3)}


def test_an_evaluation_pass_as_the_first_step_sizes_nothing(dynamo: Recorder) -> None:
    """Found from outside: a pass of lone attempts as a process's first step (a baseline evaluation)
    became the shape, and the first GRPO step after it sent every sibling alone (``group=`` or not).
    Now the step after a lone first step gathers as a first step does, and is sized by itself; a run
    of lone attempts only is sized by them from its third step (each alone: no parent to pace)."""
    dynamo.instances = 8
    otel_session.configure(dynamo_hosts=[dynamo.url])
    for _ in range(2):  # two evaluation passes: lone attempts, each alone, gathered
        _step(dynamo, prompts=12, siblings=1)
        assert _split_of(dynamo, 12, 1) == {(1,)}
        assert _siblings.last_shape() == (12, 1) and not _siblings.step_seen()
    _step(dynamo, prompts=10, siblings=4)  # gathered too: sized by itself
    assert _split_of(dynamo, 10, 4) == {(1, 3)}
    assert _siblings.step_seen()
    _step(dynamo, prompts=10, siblings=4)  # sized by the step before
    assert _split_of(dynamo, 10, 4) == {(1, 3)}


def test_a_run_of_lone_attempts_sends_each_alone_and_every_step_may_gather() -> None:
    """Found from outside: a run of lone attempts whose groups are read from the prompt named a parent
    for every attempt (no fleet size is read without siblings, and the default's pairs gave each a
    parent of its own, paced). Each goes alone after a lone step now, whatever is known of the fleet;
    and until a step has had siblings any step may be a GRPO step's first, so it gathers."""
    auto = Siblings.parse("auto")
    _open_close(6, 1, auto, 8)
    assert _siblings.last_shape() == (6, 1) and not _siblings.step_seen()
    _open_close(6, 1, auto, 8)
    assert not _siblings.step_seen()  # two evaluation passes, then a GRPO step: it gathers too
    for workers in (8, None, _siblings.UNREADABLE):
        alone = _siblings.join("lone", auto, workers)
        assert alone is not None and alone[0] is None and alone[1].size == 1, workers  # no parent
        assert alone[1].sized is (workers == 8)  # sized to the fleet only where its size is known
        _siblings.leave(alone[1])
    withheld = _siblings.join("lone", Siblings.parse("fleet"), None)  # fleet: withheld until sized
    assert withheld is not None and withheld[0] == _siblings.WITHHELD
    _siblings.leave(withheld[1])
    _siblings.forget_shape()
