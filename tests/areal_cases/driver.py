"""AReaL 1.0.4's rollout path (``.venv-rl``, installed without its GPU-side dependencies) with no
otel-session code, started only as ``opentelemetry-instrument python driver.py ENGINE_ADDR MODEL_DIR``.

AReaL's ``RemoteSGLangEngine`` (``RemoteInfEngine`` with its SGLang backend) is initialized with one
server address, as ``AREAL_LLM_SERVER_ADDRS`` naming a single router would give it, and
``rollout_batch`` runs 2 prompts with ``group_size=2`` through AReaL's ``WorkflowExecutor``:
``GroupedRolloutWorkflow`` hands each prompt's ``data`` to 2 sibling episodes of AReaL's
``MultiTurnWorkflow``, whose every turn is one ``engine.agenerate`` (aiohttp, a fresh ``rid`` each
turn) and whose reward (AReaL's ``AsyncRewardWrapper``, a process pool) is 0 until the third turn, so
each episode runs ``MAX_TURNS`` turns. The engine is the real local Dynamo behind
tests/engine_adapter.py (whose docstring says why AReaL cannot post to Dynamo directly); the tokenizer
is the tiny local one (no model hub here).
"""

from __future__ import annotations

import json
import sys

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.workflow.multi_turn import MultiTurnWorkflow
from transformers import AutoTokenizer

MAX_TURNS = 3
AMENDED = "Your answer is either wrong"  # what MultiTurnWorkflow adds to the prompt after a turn rewarded 0


def reward(prompt: str, completion: str, prompt_ids: list, completion_ids: list, **data: object) -> float:
    return 1.0 if prompt.count(AMENDED) >= MAX_TURNS - 1 else 0.0


def main() -> None:
    addr, model_dir = sys.argv[1:3]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = InferenceEngineConfig(
        backend="sglang:d1", experiment_name="otel-session", trial_name="areal-case",
        max_concurrent_rollouts=4, consumer_batch_size=2, setup_timeout=30, request_timeout=30,
    )  # fmt: skip
    engine = RemoteSGLangEngine(config)
    engine.initialize(addr=addr)
    workflow = MultiTurnWorkflow(
        reward_fn=reward,
        gconfig=GenerationHyperparameters(n_samples=1, max_new_tokens=8, max_tokens=2048),
        tokenizer=tokenizer,
        max_turns=MAX_TURNS,
        turn_discount=0.9,
    )
    data = [
        {"messages": [{"role": "user", "content": f"prompt {p}: what is {p} + 1?"}], "answer": str(p + 1)}
        for p in (0, 1)
    ]
    try:
        results = engine.rollout_batch(data, workflow=workflow, group_size=2)
    finally:
        engine.destroy()
    report = [
        {"episodes": int(r["rewards"].shape[0]), "rewards": [float(x) for x in r["rewards"]]} for r in results
    ]
    print(json.dumps({"results": report}))


if __name__ == "__main__":
    main()
