"""TRL's async GRPO rollout worker (trl 1.16.0, ``.venv-rl``), run as a trainer runs it, with no
otel-session code: started only as ``opentelemetry-instrument python driver.py ENGINE_URL MODEL_DIR``.

``AsyncRolloutWorker.start()`` spawns its child process, which runs ``_AsyncRolloutLoop`` (the
generate loop, ``_generate_one`` per rollout, TRL's own aiohttp posts to ``/v1/completions``, its tool
calls in its tool thread pool, ``_score_group``). 2 dataset rows x ``num_generations=2``, at most 4
rollouts in flight; the driver takes the first 4 scored samples (2 whole groups) and stops the worker.

Replaced, because it cannot run here: ``async_rollout_worker.is_vllm_available`` answers True. The
parent-side controller refuses to start without vLLM installed, though neither process uses vLLM: the
child only talks HTTP to the engine (the real local Dynamo behind tests/engine_adapter.py). The
tokenizer is the tiny local one with TRL's shipped qwen3 chat template and its special tokens (no
model hub here).
"""

from __future__ import annotations

import importlib.resources
import json
import sys

import trl
from accelerate.state import PartialState
from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.async_grpo import async_rollout_worker
from trl_tools import reward, step

SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]  # fmt: skip  (tests/engine_adapter.py adds the same, in this order)


def main() -> None:
    engine_url, model_dir = sys.argv[1:3]
    async_rollout_worker.is_vllm_available = lambda: True  # see the module docstring
    PartialState()  # accelerate's state, which the trainer's process has set up by now (TRL logs through it)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (importlib.resources.files(trl) / "chat_templates" / "qwen3.jinja").read_text()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    rows = [{"prompt": [{"role": "user", "content": f"prompt {p}: take two steps"}]} for p in range(2)]
    worker = async_rollout_worker.AsyncRolloutWorker(
        model_name="m",
        dataset=Dataset.from_list(rows),
        reward_funcs=[reward],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")],
        tools=[step],
        num_generations=2,
        max_inflight_tasks=4,
        vllm_server_url=engine_url,
        max_tokens=32,
        request_timeout=30,
        child_ready_timeout=120,
    )
    worker.start()
    try:
        samples = [worker.rollout_buffer.get(timeout=60) for _ in range(4)]
    finally:
        worker.stop()
    report = [
        {
            "group_id": s.group_id,
            "prompt": s.prompt[0]["content"],
            "tools": sum(m["role"] == "tool" for m in s.completion),
        }
        for s in samples
    ]
    print(json.dumps({"samples": report}))


if __name__ == "__main__":
    main()
