"""TRL's OpenEnv variant with zero code (issue 35): the ``otel_session_trl`` preset, TRL's and openenv's
real code.

TRL 1.16.0 and openenv 0.10.0 run from ``.venv-rl`` (``scripts/rl_venv``). The driver
(tests/trl_cases/openenv_driver.py, no otel-session code) runs TRL's ``HarnessRolloutWorker``, whose
spawned child runs ``_HarnessRolloutLoop``: its ``_generate_one`` (the preset's boundary, grouped by
``group_id``) hands the whole rollout to a ``ThreadPoolExecutor`` (``harness-session``), where openenv's
``MCPHarnessAdapter`` drives the turns: each model turn is TRL's ``_sample_turn``, which posts
``/v1/completions`` with aiohttp back on the child's event loop (``run_coroutine_threadsafe``), and
each tool call goes to the environment over the session's WebSocket. So the session reaches the engine
only if the context follows ``_generate_one`` into the pool thread and from there back into the loop's
task (otel_session/_threads.py). The environment is the smallest one on openenv's public base classes,
served by openenv's own server on 127.0.0.2 (tests/trl_cases/openenv_step_env.py says why it is ours).

The engine is the real local Dynamo behind tests/engine_adapter.py, as in tests/test_trl.py, whose
assertions this reuses: 2 prompts x 2 generations, each rollout 3 turns (2 ``advance`` tool calls).
"""

from __future__ import annotations

import pytest

from otel_session.dynamo import LocalDynamo
from tests.engine_adapter import STEPS
from tests.gym_servers import ROOT
from tests.rl_driver import NOTICE, OURS, Run, require_in_rl_venv, run_driver
from tests.test_trl import QUIET, assert_rollout_sessions

DRIVER = ROOT / "tests" / "trl_cases" / "openenv_driver.py"


@pytest.fixture(scope="module")
def openenv_venv(rl_venv: None) -> None:
    require_in_rl_venv("openenv")


def run_openenv(stack: LocalDynamo, **env: str) -> Run:
    return run_driver(stack, DRIVER, address=lambda engine: engine.url, env={**QUIET, **env}, tool="advance")


def assert_harness_ran(run: Run) -> None:
    """TRL's harness loop did the work: 2 whole groups of 2 scored samples, each rollout with its 2
    tool calls answered by the environment, whose server was asked once for each rollout at least."""
    samples = run.report["samples"]
    assert sorted(s["group_id"] for s in samples) == [0, 0, 1, 1], samples
    assert all(s["prompt"].startswith(f"prompt {s['group_id']}:") and s["tools"] == STEPS for s in samples), (
        samples
    )
    assert len(run.report["env_headers"]) >= 4, run.report


def test_each_harness_rollout_is_one_session_on_one_worker_and_each_group_one_parent(
    openenv_venv: None, dynamo_stack_generate: LocalDynamo
) -> None:
    run = run_openenv(dynamo_stack_generate)
    assert_harness_ran(run)
    assert_rollout_sessions(run)
    for names in run.report["env_headers"]:  # the environment is no router and not trusted: nothing of ours
        assert not set(names) & OURS, names


def test_without_the_preset_no_harness_rollout_carries_a_session(
    openenv_venv: None, dynamo_stack_generate: LocalDynamo
) -> None:
    """The control: ``otel_session_trl`` turned off, the same run opens no attempt, so no session, and
    Dynamo's round-robin spreads the turns over its workers."""
    run = run_openenv(dynamo_stack_generate, OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="otel_session_trl")
    assert_harness_ran(run)
    assert not any(t.get("x-dynamo-session-id") for t in run.turns)
    assert len(set(run.workers.values())) > 1, run.workers
    assert NOTICE in run.stderr, run.stderr[-3000:]
