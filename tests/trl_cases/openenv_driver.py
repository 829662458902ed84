"""TRL's async GRPO rollout worker with an OpenEnv harness (trl 1.16.0, openenv 0.10.0, ``.venv-rl``),
run as a trainer runs it, with no otel-session code: started only as ``opentelemetry-instrument python
openenv_driver.py ENGINE_URL MODEL_DIR``.

``HarnessRolloutWorker`` (``trl.experimental.async_grpo.openenv_harness``) spawns its child, which runs
``_HarnessRolloutLoop``: each ``_generate_one`` hands ``_run_session`` to the loop's ``harness-session``
thread pool, where openenv's ``MCPHarnessAdapter.run_white_box`` asks TRL's ``_sample_turn`` for each
turn (it posts ``/v1/completions`` with aiohttp back on the child's event loop, through
``run_coroutine_threadsafe``) and calls the environment's ``advance`` tool over the session's WebSocket
(tests/trl_cases/openenv_step_env.py). 2 dataset rows x ``num_generations=2``, at most 4 sessions at
once; the driver takes the first 4 scored samples (2 whole groups) and stops the worker. Its report
adds the header names of every connection the environment's server got.

Replaced, as in tests/trl_cases/driver.py: ``async_rollout_worker.is_vllm_available`` answers True.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import sys

import trl
from accelerate.state import PartialState
from datasets import Dataset
from driver import SPECIAL
from openenv.core.harness import MCPHarnessAdapter
from openenv_step_env import Served, StepSessionFactory
from transformers import AutoTokenizer
from trl.experimental.async_grpo import async_rollout_worker, openenv_harness
from trl_tools import reward


def main() -> None:
    engine_url, model_dir = sys.argv[1:3]
    async_rollout_worker.is_vllm_available = lambda: True  # see the module docstring
    PartialState()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (importlib.resources.files(trl) / "chat_templates" / "qwen3.jinja").read_text()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    rows = [{"prompt": [{"role": "user", "content": f"prompt {p}: take two steps"}]} for p in range(2)]
    with Served() as env:
        worker = openenv_harness.HarnessRolloutWorker(
            harness_session_factory=functools.partial(StepSessionFactory, env.url),
            harness_adapter=MCPHarnessAdapter(),
            model_name="m",
            dataset=Dataset.from_list(rows),
            reward_funcs=[reward],
            processing_class=tokenizer,
            eos_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")],
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
    print(json.dumps({"samples": report, "env_headers": env.headers}))


if __name__ == "__main__":
    main()
