"""rLLM's workflow engine (its own source, tests/vendor/rllm) with no otel-session code, started only as
``opentelemetry-instrument python driver.py MODEL_V1_URL MODEL TOOL_URL`` with ``PYTHONPATH`` naming
the vendored source.

rLLM's ``AgentWorkflowEngine.execute_tasks`` runs 2 tasks x 2 rollouts (``task_ids`` repeated, so each
rollout's ``uid`` is ``f"{task_id}:{rollout_idx}"``), each through ``Workflow.run_with_termination_
handling``, with rLLM's ``OpenAIEngine`` (the openai SDK's ``AsyncOpenAI``, chat completions) as the
rollout engine. The workflow is user code, as rLLM's custom workflows are: ``TURNS`` model turns, each
followed by an environment step that rLLM's ``Workflow.run_in_executor`` runs in the engine's thread
pool, which asks a tool server with ``requests``.
"""

from __future__ import annotations

import asyncio
import json
import sys

import requests
from rllm.engine.agent_workflow_engine import AgentWorkflowEngine
from rllm.engine.rollout.openai_engine import OpenAIEngine
from rllm.workflows.workflow import TerminationEvent, TerminationReason, Workflow

TURNS = 3
NVEXT = {"nvext": {"extra_fields": ["worker_id", "timing"]}}  # Dynamo says which worker served each turn


def env_step(tool_url: str, task: str, turn: int) -> str:
    requests.post(tool_url, json={"task": task, "turn": turn}, timeout=30).raise_for_status()
    return f"observation {turn}"


class ToolWorkflow(Workflow):
    tool_url = ""

    async def run(self, task: dict, uid: str, **kwargs: object) -> None:
        self.reset(task, uid)
        messages = [{"role": "user", "content": f"{task['name']}: {task['question']}"}]
        for turn in range(TURNS):
            output = await self.rollout_engine.chat_completion(messages)
            messages.append({"role": "assistant", "content": output.text})
            observation = await self.run_in_executor(env_step, self.tool_url, task["name"], turn)
            messages.append({"role": "user", "content": observation})
        raise TerminationEvent(TerminationReason.ENV_DONE)


async def main() -> None:
    model_url, model, tool_url = sys.argv[1:4]
    ToolWorkflow.tool_url = tool_url
    engine = AgentWorkflowEngine(
        workflow_cls=ToolWorkflow,
        workflow_args={},
        rollout_engine=OpenAIEngine(
            model=model,
            base_url=model_url,
            api_key="unused",
            sampling_params={"max_tokens": 4, "extra_body": NVEXT},
        ),
        n_parallel_tasks=4,
    )
    tasks = [{"name": f"task {t}", "question": "take three steps"} for t in (0, 0, 1, 1)]
    episodes = await engine.execute_tasks(tasks, task_ids=["task-0", "task-0", "task-1", "task-1"])
    engine.shutdown()
    report = [{"id": e.id, "termination": str(e.termination_reason.value)} for e in episodes]
    print(json.dumps({"episodes": report}))


if __name__ == "__main__":
    asyncio.run(main())
