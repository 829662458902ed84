"""AReaL with zero code (issue 35, item 1): the ``otel_session_areal`` preset with AReaL's real code.

AReaL 1.0.4 runs from ``.venv-rl`` (``scripts/rl_venv``: installed without its GPU-side dependencies,
its rollout path's imports by name). The driver (tests/areal_cases/driver.py, no otel-session code) is
started only as ``opentelemetry-instrument python driver.py`` with ``OTEL_PYTHON_DISTRO=otel_session``
and ``OTEL_SESSION_DYNAMO_HOSTS``: AReaL's ``RemoteSGLangEngine.rollout_batch`` runs 2 prompts with
``group_size=2`` (``GroupedRolloutWorkflow``) of ``MultiTurnWorkflow`` episodes of 3 turns, every turn
an ``agenerate`` with a fresh ``rid``, all to the one server address it was given. The preset makes
each ``arun_episode`` one attempt, grouped by a digest of ``data["messages"]``.

The engine is the real local Dynamo (3 mocker workers, round-robin, session affinity on), serving
SGLang's ``/generate`` itself. AReaL cannot be pointed at it directly: it posts ``"stream": false`` and
Dynamo 1.6.1 serves ``/generate`` streamed only (501 "non-streaming SGLang generate requests are not
implemented; set stream=true"). So AReaL's address is tests/engine_adapter.py, configured as the Dynamo
host, which sends each request on streamed with the headers it came with and folds Dynamo's answer
(its tokens and logprobs, unchanged) into SGLang's non-streaming one; which worker served each turn
comes from the frontend's log.
"""

from __future__ import annotations

from collections import defaultdict

from otel_session.dynamo import LocalDynamo
from tests.engine_adapter import Turn
from tests.gym_servers import ROOT
from tests.rl_driver import NOTICE, OURS, Run, run_driver

DRIVER = ROOT / "tests" / "areal_cases" / "driver.py"
MAX_TURNS = 3
AMENDED = "Your answer is either wrong"  # what MultiTurnWorkflow adds to the prompt after each turn


def run_areal(stack: LocalDynamo, **env: str) -> Run:
    return run_driver(
        stack, DRIVER, address=lambda engine: engine.authority, env=env, marker=AMENDED, timeout=180
    )


def assert_areal_ran(run: Run) -> None:
    """AReaL's own loop did the work: 2 prompts x 2 episodes, each rewarded after its third turn."""
    results = run.report["results"]
    assert [r["episodes"] for r in results] == [2, 2], results
    assert {round(x, 2) for r in results for x in r["rewards"]} == {0.81}, results  # 0.9 ** 2: 3 turns
    assert len(run.turns) == 4 * MAX_TURNS
    assert all(t.request_id in run.workers for t in run.turns), (run.turns, run.workers)  # Dynamo served each


def test_each_episode_is_one_session_on_one_worker_and_each_prompts_siblings_one_parent(
    rl_venv: None, dynamo_stack_generate: LocalDynamo
) -> None:
    run = run_areal(dynamo_stack_generate)
    assert_areal_ran(run)
    sessions: dict[str | None, list[Turn]] = defaultdict(list)
    for turn in run.turns:
        sessions[turn.get("x-dynamo-session-id")].append(turn)
    assert None not in sessions and len(sessions) == 4, list(sessions)  # an ID on every turn, one per episode
    parents: dict[int, set[str | None]] = defaultdict(set)
    for session, turns in sessions.items():
        assert sorted(t.turn for t in turns) == list(range(MAX_TURNS)), (session, turns)  # one whole episode
        (prompt,) = {t.prompt for t in turns}
        assert len({run.workers[str(t.request_id)] for t in turns}) == 1, turns  # Dynamo pinned the episode
        parents[prompt] |= {t.get("x-dynamo-parent-session-id") for t in turns}
    assert sorted(parents) == [0, 1] and all(len(p) == 1 and None not in p for p in parents.values()), parents
    assert parents[0] != parents[1] and not (parents[0] | parents[1]) & set(sessions)
    for turn in run.turns:
        assert {k.lower() for k, _ in turn.headers} & OURS == {
            "x-dynamo-session-id",
            "x-dynamo-parent-session-id",
        }
    assert "does not resolve" not in run.stderr, run.stderr[-3000:]


def test_without_the_preset_no_episode_carries_a_session(
    rl_venv: None, dynamo_stack_generate: LocalDynamo
) -> None:
    """The control: ``otel_session_areal`` turned off, the same run opens no attempt, so no session, and
    Dynamo's round-robin spreads an episode's turns over its workers."""
    run = run_areal(dynamo_stack_generate, OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="otel_session_areal")
    assert_areal_ran(run)
    assert not any(t.get("x-dynamo-session-id") for t in run.turns)
    assert len({run.workers[str(t.request_id)] for t in run.turns}) > 1, run.workers
    assert NOTICE in run.stderr, run.stderr[-3000:]
