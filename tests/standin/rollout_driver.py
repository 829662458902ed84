"""A NeMo-RL user's script, with no otel-session code: run under ``opentelemetry-instrument`` with the
``otel_session`` distro and ``OTEL_SESSION_DYNAMO_HOSTS`` only (tests/test_nemo_rl_boundaries.py).

``python rollout_driver.py MODE FRONTEND_V1_URL MODEL TOOL_URL`` against the NeMo-RL stand-in in this
folder (NeMo-RL is not installable from the package index). Every batch is 2 prompts x 2 siblings in
``repeat_interleave`` order; prompt 0 runs 3 turns, prompt 1 runs 4. Prints one JSON line.

- ``native``: ``run_async_multi_turn_rollout`` twice (runs 0 and 1).
- ``groups``: ``run_async_multi_turn_rollout_groups`` consumed in a new thread with its own event loop,
  as NeMo-RL's ``AsyncTrajectoryCollector`` runs a batch.
- ``manager``: the single_controller ``RolloutManager.generate_and_push`` for prompt 0 (2 siblings),
  up to 2 whole-group attempts.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from typing import Any

from nemo_rl.experience.rollout_manager import AsyncRolloutImpl, RolloutManager
from nemo_rl.experience.rollouts import run_async_multi_turn_rollout, run_async_multi_turn_rollout_groups
from nemo_rl.models.generation.dynamo.dynamo_generation import DynamoGeneration

PROMPTS, SIBLINGS, TURNS = 2, 2, (3, 4)
TASK_TO_ENV = {"tool": object()}  # the stand-in's environment step calls its tool server itself


def sample(run: int, prompt: int, tool_url: str) -> dict[str, Any]:
    return {
        "message_log": [{"role": "user", "content": f"run {run} prompt {prompt}: count to three."}],
        "extra_env_info": {"tool_url": tool_url, "max_turns": TURNS[prompt]},
        "task_name": "tool",
        "idx": prompt,
    }


def repeated_batch(run: int, tool_url: str) -> dict[str, list[Any]]:
    """The batch of prompts with each repeated SIBLINGS times, siblings next to each other."""
    samples = [sample(run, prompt, tool_url) for prompt in range(PROMPTS) for _ in range(SIBLINGS)]
    return {key: [s[key] for s in samples] for key in samples[0]}


def main(mode: str, frontend_v1: str, model: str, tool_url: str) -> dict[str, Any]:
    generation = DynamoGeneration(frontend_v1, model)
    if mode == "native":
        runs = []
        for run in range(2):
            _, metrics = run_async_multi_turn_rollout(
                generation, repeated_batch(run, tool_url), None, TASK_TO_ENV, max_seq_len=1024
            )
            runs.append(metrics["per_sample"])
        return {"runs": runs}
    if mode == "groups":
        groups: list[Any] = []

        async def collect() -> None:
            async for result in run_async_multi_turn_rollout_groups(
                generation, repeated_batch(0, tool_url), None, TASK_TO_ENV, 1024, num_generations=SIBLINGS
            ):
                groups.append({"group_index": result.group_index, **result.rollout_metrics})

        worker = threading.Thread(target=lambda: asyncio.run(collect()), daemon=True)
        worker.start()
        worker.join()
        return {"groups": groups}
    if mode == "manager":
        impl = AsyncRolloutImpl(None, TASK_TO_ENV, SIBLINGS, 1024, max(TURNS), generation)
        manager = RolloutManager(impl, max_infra_attempts=2, backoff_base_s=0.2)
        return asyncio.run(manager.generate_and_push(sample(0, 0, tool_url)))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])), flush=True)
