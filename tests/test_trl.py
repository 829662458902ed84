"""TRL's async GRPO with zero code (issue 35, item 1): the ``otel_session_trl`` preset, TRL's real code.

TRL 1.16.0 runs from ``.venv-rl`` (``scripts/rl_venv``: torch from the local CPU wheel). The driver
(tests/trl_cases/driver.py, no otel-session code) is started only as ``opentelemetry-instrument python
driver.py`` with ``OTEL_PYTHON_DISTRO=otel_session`` and ``OTEL_SESSION_DYNAMO_HOSTS``; it runs TRL's
``AsyncRolloutWorker``, whose spawned child runs ``_AsyncRolloutLoop``: 2 prompts x 2 generations, each
rollout 3 turns (2 tool calls, each tool asking a tool server on 127.0.0.2 from TRL's tool thread pool).
The preset makes each ``_generate_one`` one attempt, grouped by its ``group_id``.

The engine is the real local Dynamo (3 mocker workers, round-robin, session affinity on). TRL cannot be
pointed at it directly: its ``/v1/completions`` sends ``return_token_ids`` (Dynamo 1.6.1: 400
"Unsupported parameter(s)") and reads ``choices[0].token_ids`` and ``logprobs.token_logprobs``, which
Dynamo's completions answer lacks. So TRL's engine URL is tests/engine_adapter.py, configured as the
Dynamo host: it sends each turn to Dynamo's own ``/generate`` with the headers it came with, and answers
TRL with the scripted turn (a tool call, then an answer: the mocker's random tokens would never call a
tool) and Dynamo's logprobs; which worker served each turn comes from the frontend's log. Also replaced:
TRL's ``is_vllm_available`` check in the parent, answered True (the driver says why).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from otel_session.dynamo import LocalDynamo
from tests.engine_adapter import STEPS, Turn
from tests.gym_servers import ROOT
from tests.recorder import Recorder, Seen
from tests.rl_driver import NOTICE, OURS, Run, run_driver

DRIVER = ROOT / "tests" / "trl_cases" / "driver.py"
QUIET = {"TRL_EXPERIMENTAL_SILENCE": "1"}  # TRL's warning that trl.experimental may change


@dataclass
class TrlRun(Run):
    tools: list[Seen]  # what the tool server got


def run_trl(stack: LocalDynamo, **env: str) -> TrlRun:
    with Recorder(host="127.0.0.2") as tools:
        run = run_driver(stack, DRIVER, address=lambda engine: engine.url,
                         env={"TRL_CASE_TOOL_URL": f"{tools.url}/tool", **QUIET, **env})  # fmt: skip
        return TrlRun(run.report, run.stderr, run.turns, run.workers, list(tools.requests))


def assert_trl_ran(run: TrlRun) -> None:
    """TRL's own loop did the work: 2 whole groups of 2 scored samples, each rollout with its 2 tool calls."""
    samples = run.report["samples"]
    assert sorted(s["group_id"] for s in samples) == [0, 0, 1, 1], samples
    assert all(s["prompt"].startswith(f"prompt {s['group_id']}:") and s["tools"] == STEPS for s in samples), (
        samples
    )
    assert len(run.tools) >= 4 * STEPS


def assert_rollout_sessions(run: Run) -> None:
    """Each rollout one session on one worker, each group's siblings (groups:2) under one parent of their
    own, and nothing of ours on the engine's requests but Dynamo's two headers. The worker's loop keeps
    starting groups until it is stopped: the first 4 rollouts (2 groups, opened at once) are whole."""
    by_session: dict[str | None, list[Turn]] = defaultdict(list)
    for turn in run.turns:
        by_session[turn.get("x-dynamo-session-id")].append(turn)
    assert None not in by_session, [t.headers for t in by_session.get(None, [])]  # an ID on every request
    # The first 2 groups, opened at once: the first 4 opening turns (a fast rollout's second turn may come
    # before a slow one's first; no fifth rollout opens before one of them is done).
    first = {t.get("x-dynamo-session-id") for t in [t for t in run.turns if t.turn == 0][:4]}
    assert len(first) == 4, first
    parents: dict[str | None, set[tuple[str | None, int]]] = defaultdict(set)
    for session, turns in by_session.items():
        done = sorted(t.turn for t in turns)  # one conversation, whole for the scored ones
        assert done == list(range(STEPS + 1 if session in first else len(done))), (session, turns)
        served = {run.workers.get(str(t.request_id)) for t in turns}  # a turn cut off by stop() has none
        assert len(served - {None}) == 1 and (session not in first or None not in served), turns  # one worker
        (prompt,) = {t.prompt for t in turns}
        (parent,) = {t.get("x-dynamo-parent-session-id") for t in turns}
        parents[parent].add((session, prompt))
    assert None not in parents and not set(parents) & set(by_session), parents
    for siblings in parents.values():  # groups:2: never more than 2 under a parent, never of two prompts
        assert len(siblings) <= 2 and len({prompt for _, prompt in siblings}) == 1, parents
    for session in first:  # each of the first groups' two rollouts under one parent of their own
        (siblings,) = [found for found in parents.values() if any(s == session for s, _ in found)]
        assert len(siblings) == 2 and {s for s, _ in siblings} <= first, parents
    for turn in run.turns:
        assert {k.lower() for k, _ in turn.headers} & OURS <= {
            "x-dynamo-session-id",
            "x-dynamo-parent-session-id",
        }
    assert "does not resolve" not in run.stderr and NOTICE not in run.stderr, run.stderr[-3000:]


def test_each_rollout_is_one_session_on_one_worker_and_each_group_one_parent(
    rl_venv: None, dynamo_stack_generate: LocalDynamo
) -> None:
    run = run_trl(dynamo_stack_generate)
    assert_trl_ran(run)
    assert_rollout_sessions(run)
    for seen in run.tools:  # the tool server is no router and not trusted: nothing of ours
        assert not seen.names() & OURS, seen.headers


def test_without_the_preset_no_rollout_carries_a_session(
    rl_venv: None, dynamo_stack_generate: LocalDynamo
) -> None:
    """The control: the same run with ``otel_session_trl`` turned off has no attempt, so no session, and
    Dynamo's round-robin spreads the turns over its workers."""
    run = run_trl(dynamo_stack_generate, OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="otel_session_trl")
    assert_trl_ran(run)
    assert not any(t.get("x-dynamo-session-id") for t in run.turns)
    assert len(set(run.workers.values())) > 1, run.workers
    assert NOTICE in run.stderr, run.stderr[-3000:]
