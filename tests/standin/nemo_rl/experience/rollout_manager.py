"""Stand-in for ``nemo_rl/experience/rollout_manager.py``, NeMo-RL's single_controller path (NeMo-RL is not
installable from the package index).

``AsyncRolloutImpl.run_rollout`` gathers ``self._run_single_rollout(input_sample, traj_idx)`` over the
prompt group (the first failure cancels the siblings); ``_run_single_rollout`` runs one sample's whole
conversation. ``RolloutManager.generate_and_push`` retries the whole group on an exception, up to
``max_infra_attempts``, by calling ``run_rollout`` again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from nemo_rl.experience.rollouts import calculate_rewards


async def _gather_cancelling_siblings(coroutines: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class AsyncRolloutImpl:
    def __init__(
        self,
        tokenizer: Any,
        task_to_env: dict[str, Any],
        num_generations_per_prompt: int,
        max_seq_len: int,
        max_rollout_turns: int,
        policy_generation: Any,
        **kwargs: Any,
    ) -> None:
        self._task_to_env = task_to_env
        self._num_generations_per_prompt = num_generations_per_prompt
        self._max_rollout_turns = max_rollout_turns
        self._policy_generation = policy_generation

    async def run_rollout(self, input_sample: dict[str, Any]) -> dict[str, Any]:
        results = await _gather_cancelling_siblings(
            [
                self._run_single_rollout(input_sample, traj_idx)
                for traj_idx in range(self._num_generations_per_prompt)
            ]
        )
        return {"idx": input_sample["idx"], "trajectories": results}

    async def _run_single_rollout(self, input_sample: dict[str, Any], traj_idx: int) -> dict[str, Any]:
        message_log = list(input_sample["message_log"])
        workers = []
        for _turn in range(self._max_rollout_turns):
            output = await self._generate_response(message_log)
            workers.append(output["worker_id"])
            message_log.append({"role": "assistant", "content": output["text"]})
            sample_batch = {**input_sample, "message_log": message_log}
            env_output = await asyncio.to_thread(calculate_rewards, sample_batch, self._task_to_env)
            message_log.append(env_output["observation"])
            if env_output["terminated"]:
                break
        return {"traj_idx": traj_idx, "turn_count": len(workers), "workers": workers}

    async def _generate_response(self, message_log: list[dict[str, Any]]) -> dict[str, Any]:
        prompt = "".join(message["content"] for message in message_log)
        outputs = [out async for _idx, out in self._policy_generation.generate_async({"prompts": [prompt]})]
        return outputs[-1]


class RolloutManager:
    def __init__(
        self, impl: AsyncRolloutImpl, max_infra_attempts: int = 1, backoff_base_s: float = 0.0
    ) -> None:
        self._impl = impl
        self._max_infra_attempts = max_infra_attempts
        self._backoff_base_s = backoff_base_s

    async def run_rollout(self, input_sample: dict[str, Any]) -> dict[str, Any]:
        return await self._impl.run_rollout(input_sample)

    async def generate_and_push(
        self, input_sample: dict[str, Any], *, target_step: int | None = None, inflight_registry: Any = None
    ) -> dict[str, Any]:
        infra_attempts, errors = 0, []
        while infra_attempts < self._max_infra_attempts:
            try:
                record = await self.run_rollout(input_sample)
            except Exception as error:  # an infrastructure failure: the whole group again
                infra_attempts += 1
                errors.append(f"{type(error).__name__}: {error}")
                await asyncio.sleep(self._backoff_base_s * 2 ** (infra_attempts - 1))
                continue
            return {"status": "pushed", "record": record, "attempts": infra_attempts + 1, "errors": errors}
        return {"status": "failed", "attempts": infra_attempts, "errors": errors}
