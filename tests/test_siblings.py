"""Siblings of one prompt and the parent session they name (issue 29, item 5): ``configure(siblings=
...)`` / ``OTEL_SESSION_SIBLINGS`` and ``trajectory(group=...)``, over loopback to a recording Dynamo
host. Every attempt keeps a session of its own whatever the policy; only the parent differs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from typing import Any

import httpx
import pytest

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER, _faults
from otel_session._siblings import Siblings, open_groups
from tests.recorder import Recorder


def _grpo_step(dynamo: Recorder, prompts: int, siblings: int, turns: int = 2) -> list[dict[str, Any]]:
    """``prompts`` x ``siblings`` attempts at once, each ``turns`` requests; what each carried."""

    async def attempt(prompt: int, sibling: int) -> None:
        async with otel_session.trajectory(group=f"prompt-{prompt}"), httpx.AsyncClient() as client:
            for turn in range(turns):
                await client.get(f"{dynamo.url}/p{prompt}/s{sibling}/t{turn}", timeout=10)
                await asyncio.sleep(0)

    async def step() -> None:
        await asyncio.gather(*(attempt(p, s) for p in range(prompts) for s in range(siblings)))

    asyncio.run(step())
    return _seen(dynamo)


def _seen(dynamo: Recorder) -> list[dict[str, Any]]:
    return [
        {
            "prompt": seen.path.split("/")[1],
            "sibling": seen.path.split("/")[2],
            "session": seen.get(SESSION_HEADER),
            "parent": seen.get(PARENT_SESSION_HEADER),
        }
        for seen in dynamo.requests
        if seen.path != "/health"
    ]


def _per_attempt(seen: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[str, str | None]]:
    attempts: dict[tuple[str, str], set[tuple[str, str | None]]] = {}
    for request in seen:
        attempts.setdefault((request["prompt"], request["sibling"]), set()).add(
            (request["session"], request["parent"])
        )
    assert all(len(carried) == 1 for carried in attempts.values()), attempts  # every turn the same
    return {key: next(iter(carried)) for key, carried in attempts.items()}


@pytest.mark.parametrize(
    ("policy", "per_parent"), [("groups:2", 2), ("groups:4", 4), ("prompt", 8), ("groups:3", 3)]
)
def test_siblings_open_at_once_share_a_parent_per_group_of_k(
    dynamo: Recorder, policy: str, per_parent: int
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings=policy)
    attempts = _per_attempt(_grpo_step(dynamo, prompts=3, siblings=8))
    sessions = [session for session, _ in attempts.values()]
    assert len(set(sessions)) == 24 and None not in sessions  # each attempt its own session
    for prompt in ("p0", "p1", "p2"):
        parents = Counter(parent for (p, _), (_, parent) in attempts.items() if p == prompt)
        assert None not in parents
        sizes = sorted(parents.values())
        expected = [per_parent] * (8 // per_parent) + ([8 % per_parent] if 8 % per_parent else [])
        assert sizes == sorted(expected)
    all_parents = {parent for _, parent in attempts.values()}
    by_prompt = {
        p: {parent for (q, _), (_, parent) in attempts.items() if q == p} for p in ("p0", "p1", "p2")
    }
    assert not (by_prompt["p0"] & by_prompt["p1"]) and not (by_prompt["p1"] & by_prompt["p2"])
    assert not all_parents & set(sessions)
    assert open_groups() == 0  # every group forgotten once its last attempt ended


def test_attempt_policy_names_no_parent(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="attempt")
    attempts = _per_attempt(_grpo_step(dynamo, prompts=2, siblings=4))
    assert {parent for _, parent in attempts.values()} == {None}
    assert len({session for session, _ in attempts.values()}) == 8


def test_the_default_sizes_a_gathered_first_step_to_the_fleet(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto``: an async step's attempts gather at their first request (``_gathering``), so the
    first step is already one group per worker (the recorder's /health lists 4 workers; 2 prompts x
    8 siblings: K = ceil(8 / (4 // 2)) = 4), and so is the next, by the step before."""
    monkeypatch.delenv("OTEL_SESSION_SIBLINGS", raising=False)
    dynamo.instances = 4
    settings = otel_session.configure(dynamo_hosts=[dynamo.url])
    assert str(settings.siblings) == "auto"
    for _ in range(2):
        dynamo.clear()
        attempts = _per_attempt(_grpo_step(dynamo, prompts=2, siblings=8))
        for prompt in ("p0", "p1"):
            per_parent = Counter(parent for (p, _), (_, parent) in attempts.items() if p == prompt)
            assert sorted(per_parent.values()) == [4, 4] and None not in per_parent
        assert None not in {session for session, _ in attempts.values()}  # the header on every request


def test_the_default_sizes_a_first_step_of_threads_too(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads gather their first step by sleeping at their first request (``_gathering``): one
    prompt of 4 siblings on 8 workers is each alone (K = ceil(4 / 8) = 1), not paired."""
    monkeypatch.delenv("OTEL_SESSION_SIBLINGS", raising=False)
    dynamo.instances = 8
    otel_session.configure(dynamo_hosts=[dynamo.url])
    sent = threading.Barrier(4)
    client = httpx.Client(timeout=10)  # one client for the step's threads, as a rollout pool shares one

    def attempt(sibling: int) -> None:
        with otel_session.trajectory(group="prompt-0"):
            sent.wait(10)  # a step's threads reach their first request together
            client.get(f"{dynamo.url}/p0/s{sibling}/t0")
            sent.wait(10)  # all four joined before any ends: one group of four

    threads = [threading.Thread(target=attempt, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    client.close()
    attempts = _per_attempt(_seen(dynamo))
    assert len(attempts) == 4 and {parent for _, parent in attempts.values()} == {None}
    assert None not in {session for session, _ in attempts.values()}


def test_an_attempt_without_a_group_names_no_parent(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")
    with otel_session.trajectory():
        httpx.get(f"{dynamo.url}/alone", timeout=10)
    (seen,) = dynamo.requests
    assert seen.get(SESSION_HEADER) is not None and seen.get(PARENT_SESSION_HEADER) is None


def test_a_group_is_forgotten_when_its_last_attempt_ends(dynamo: Recorder) -> None:
    """The next step's siblings of the same prompt get a new parent: nothing outlives a step."""
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")
    parents = []
    for _ in range(2):
        with otel_session.trajectory(group="same") as attempt:
            parents.append(attempt.parent_session_id)
        assert open_groups() == 0
    assert None not in parents and parents[0] != parents[1]


def test_an_enclosing_trajectory_is_the_parent_whatever_the_group(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")
    with otel_session.trajectory() as outer, otel_session.trajectory(group="g") as inner:
        httpx.get(f"{dynamo.url}/nested", timeout=10)
    assert inner.parent_session_id == outer.session_id
    (seen,) = dynamo.requests
    assert seen.get(PARENT_SESSION_HEADER) == outer.session_id
    assert open_groups() == 0


def test_a_group_left_by_an_exception_is_forgotten_too(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="groups:2")
    with pytest.raises(RuntimeError), otel_session.trajectory(group="g"):
        raise RuntimeError("the attempt failed")
    assert open_groups() == 0


def test_a_group_that_cannot_be_hashed_is_one_line_and_no_parent(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list (or a tuple holding one) is the application's mistake, not a reason to end its rollout:
    the attempt runs under its own session and names no parent, not even one read from its prompt."""
    monkeypatch.setattr(_faults, "_reported", set())  # said once per process: maybe said already
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="prompt")
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        for key in (["not", "hashable"], ("task", ["msg"])):
            with otel_session.trajectory(group=key) as attempt:
                assert attempt.session_id is not None and attempt.parent_session_id is None
                assert otel_session.current_session_id() == attempt.session_id
    lines = [r for r in caplog.records if "cannot be hashed" in r.getMessage()]
    assert len(lines) == 1 and "type list" in lines[0].getMessage() and lines[0].exc_info is None


@pytest.mark.parametrize(
    "text", ["groups:0", "groups:", "group:2", "siblings", "groups:-1", "groups:9999", ""]
)
def test_a_bad_siblings_argument_raises_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="siblings"):
        otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings=text)


def test_a_bad_siblings_variable_is_one_warning_and_the_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_SESSION_SIBLINGS", "groups:zero")
    from otel_session import _environment

    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _environment.configure_from_environment()
    lines = [r.getMessage() for r in caplog.records if "OTEL_SESSION_SIBLINGS" in r.getMessage()]
    assert len(lines) == 1 and "groups:2" in lines[0], lines


@pytest.mark.parametrize(
    ("text", "size"), [("attempt", None), ("prompt", 0), ("groups:1", 1), (" Groups:16 ", 16)]
)
def test_siblings_spellings(text: str, size: int | None) -> None:
    assert Siblings.parse(text).size == size


def test_the_variable_is_read_when_the_argument_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_SIBLINGS", "prompt")
    assert str(otel_session.configure(dynamo_hosts=["127.0.0.1:9"]).siblings) == "prompt"


ROLLOUTS = """
import httpx

async def run_sample_multi_turn_rollout(sample_idx, initial_sample_state, url):
    async with httpx.AsyncClient() as client:
        for turn in range(2):
            await client.get(f"{url}/sample{sample_idx}/t{turn}", timeout=10)
"""


def test_a_named_rollout_groups_samples_by_their_initial_conversation(
    dynamo: Recorder, new_module: Any
) -> None:
    """As NeMo-RL's preset does: the siblings of a prompt are samples whose message logs are the
    same (GRPO repeats the prompt's sample); a log whose content is not text makes no group."""
    import importlib

    name = new_module("rollouts_grouped", ROLLOUTS)
    otel_session.configure(
        dynamo_hosts=[dynamo.url],
        siblings="groups:2",
        trajectory_functions=[f"{name}:run_sample_multi_turn_rollout"],
    )
    module = importlib.import_module(name)

    def state(text: Any) -> dict[str, Any]:
        return {"message_log": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]}

    prompts: list[Any] = ["two plus two?"] * 4 + ["name a color"] * 2 + [["not", "text"], ["not", "text"]]

    async def step() -> None:
        await asyncio.gather(
            *(module.run_sample_multi_turn_rollout(i, state(p), dynamo.url) for i, p in enumerate(prompts))
        )

    asyncio.run(step())
    parent = {int(seen.path.split("/")[1][6:]): seen.get(PARENT_SESSION_HEADER) for seen in dynamo.requests}
    session = {int(seen.path.split("/")[1][6:]): seen.get(SESSION_HEADER) for seen in dynamo.requests}
    assert len(set(session.values())) == 8
    first = Counter(parent[i] for i in range(4))
    assert None not in first and sorted(first.values()) == [2, 2]
    assert parent[4] == parent[5] and parent[4] is not None and parent[4] not in first
    assert parent[6] is None and parent[7] is None
