"""Stand-in for ``nemo_rl/experience/rollouts.py`` (NeMo-RL is not installable from the package index).

The call shapes otel-session's preset depends on, as in NeMo-RL: ``run_sample_multi_turn_rollout`` runs
one sample's whole conversation (per turn: the generation, awaited through
``policy_generation.generate_async``, then the environment step in a thread, ``await
asyncio.to_thread(calculate_rewards, ...)``); ``_run_multi_turn_rollout_async`` calls it by its
module-global name, with keyword arguments, in one ``asyncio.gather`` over the (repeated) batch;
``run_async_multi_turn_rollout`` is the sync entry (``asyncio.run``) and
``run_async_multi_turn_rollout_groups`` the async GRPO one (an async generator yielding one result per
prompt group after the whole batch). Batches are plain dicts of lists instead of ``BatchedDataDict``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import aiohttp

TOOL_MARK = " <tool turn={}>"  # the environment's observation appended to the message log each turn


@dataclass
class RolloutGroupResult:
    group_index: int
    final_batch: list[dict[str, Any]]
    rollout_metrics: dict[str, Any]


def calculate_rewards(sample_batch: dict[str, Any], task_to_env: dict[str, Any]) -> dict[str, Any]:
    """The environment step (sync, run in a thread): one POST to the environment's tool server, whose
    URL is in the sample's ``extra_env_info``; a failed tool call raises."""
    assert sample_batch["task_name"] in task_to_env
    info = sample_batch["extra_env_info"]
    turn = sum(message["role"] == "environment" for message in sample_batch["message_log"])

    async def call_tool() -> Any:
        async with (
            aiohttp.ClientSession() as session,
            session.post(info["tool_url"], json={"turn": turn}) as reply,
        ):
            reply.raise_for_status()
            return await reply.json()

    asyncio.run(call_tool())
    return {
        "observation": {"role": "environment", "content": TOOL_MARK.format(turn)},
        "reward": 1.0,
        "terminated": turn + 1 >= info["max_turns"],
    }


async def async_generate_response_for_sample_turn(
    policy_generation: Any, message_log: list[dict[str, Any]], greedy: bool
) -> dict[str, Any]:
    prompt = "".join(message["content"] for message in message_log)
    outputs = [out async for _, out in policy_generation.generate_async({"prompts": [prompt]}, greedy=greedy)]
    return outputs[-1]


async def run_sample_multi_turn_rollout(
    sample_idx: int,
    initial_sample_state: dict[str, Any],
    policy_generation: Any,
    tokenizer: Any,
    task_to_env: dict[str, Any],
    max_seq_len: int,
    max_rollout_turns: int = 999999,
    greedy: bool = False,
    deduplicate_multimodal_data: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    message_log = list(initial_sample_state["message_log"])
    workers, total_reward = [], 0.0
    for _turn in range(max_rollout_turns):
        try:
            output = await async_generate_response_for_sample_turn(policy_generation, message_log, greedy)
        except Exception as error:  # as NeMo-RL: printed, and the sample's conversation ends
            print(f"Error generating response for sample {sample_idx}: {error}")
            break
        workers.append(output["worker_id"])
        message_log.append({"role": "assistant", "content": output["text"]})
        sample_batch = {**initial_sample_state, "message_log": message_log}
        env_output = await asyncio.to_thread(calculate_rewards, sample_batch, task_to_env)
        message_log.append(env_output["observation"])
        total_reward += env_output["reward"]
        if env_output["terminated"]:
            break
    final_sample_state = {**initial_sample_state, "message_log": message_log, "idx": sample_idx}
    return final_sample_state, {"turn_count": len(workers), "total_reward": total_reward, "workers": workers}


async def _run_multi_turn_rollout_async(
    policy_generation: Any,
    input_batch: dict[str, list[Any]],
    tokenizer: Any,
    task_to_env: dict[str, Any],
    max_seq_len: int,
    max_rollout_turns: int = 999999,
    greedy: bool = False,
    deduplicate_multimodal_data: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    batch_size = len(input_batch["message_log"])
    sample_initial_states = [
        {
            "message_log": input_batch["message_log"][i],
            "extra_env_info": input_batch["extra_env_info"][i],
            "task_name": input_batch["task_name"][i],
            "idx": input_batch.get("idx", list(range(batch_size)))[i],
        }
        for i in range(batch_size)
    ]

    async def run_single_sample_with_error_handling(i: int, sample_state: dict[str, Any]) -> Any:
        try:
            return await run_sample_multi_turn_rollout(
                sample_idx=i,
                initial_sample_state=sample_state,
                policy_generation=policy_generation,
                tokenizer=tokenizer,
                task_to_env=task_to_env,
                max_seq_len=max_seq_len,
                max_rollout_turns=max_rollout_turns,
                greedy=greedy,
                deduplicate_multimodal_data=deduplicate_multimodal_data,
            )
        except Exception as error:
            raise RuntimeError(f"Error in sample {i} rollout: {error}") from error

    sample_results = await asyncio.gather(
        *(run_single_sample_with_error_handling(i, state) for i, state in enumerate(sample_initial_states)),
        return_exceptions=False,
    )
    final_batch = [state for state, _ in sample_results]
    return final_batch, {"per_sample": [metrics for _, metrics in sample_results]}


def run_async_multi_turn_rollout(
    policy_generation: Any,
    input_batch: dict[str, list[Any]],
    tokenizer: Any,
    task_to_env: dict[str, Any],
    max_seq_len: int,
    max_rollout_turns: int = 999999,
    greedy: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return asyncio.run(
        _run_multi_turn_rollout_async(
            policy_generation, input_batch, tokenizer, task_to_env, max_seq_len, max_rollout_turns, greedy
        )
    )


async def run_async_multi_turn_rollout_groups(
    policy_generation: Any,
    input_batch: dict[str, list[Any]],
    tokenizer: Any,
    task_to_env: dict[str, Any],
    max_seq_len: int,
    num_generations: int,
    max_rollout_turns: int = 999999,
    greedy: bool = False,
    deduplicate_multimodal_data: bool = False,
) -> AsyncGenerator[RolloutGroupResult, None]:
    final_batch, metrics = await _run_multi_turn_rollout_async(  # the whole batch first, as NeMo-RL
        policy_generation, input_batch, tokenizer, task_to_env, max_seq_len, max_rollout_turns, greedy
    )
    for group_index, start in enumerate(range(0, len(final_batch), num_generations)):
        end = start + num_generations
        group_metrics = {"per_sample": metrics["per_sample"][start:end]}
        yield RolloutGroupResult(group_index, final_batch[start:end], group_metrics)
