"""verifiers 0.4.0's own rollout code against an OpenAI-compatible endpoint, for tests/test_verifiers.py.

No otel-session code: the test starts it as ``opentelemetry-instrument python driver.py MODE BASE_URL
MODEL`` with environment variables only. It runs verifiers the way its eval CLI and prime-rl's env
server do (``cli/eval/runner.py``, ``serve/server.py``): ``async with env.serving()``, then
``env.run_slot(slot, ctx)`` for every slot of every task (``env.slots(task, n=2)``: 2 tasks x 2
rollouts), concurrently. Agents run verifiers' built-in ``null`` harness (its chat program, a
separate process per segment) in the local ``subprocess`` runtime. The sampling config asks Dynamo
to report its worker (``nvext.extra_fields``), which the test's proxy reads; verifiers passes
unknown sampling keys through into the request body.

MODE ``env``: verifiers' own ``user-sim`` env (``verifiers.v1.envs.user_sim``): per episode a
modeled user and the assistant converse, two agent runs (two traces, two rollout attempts) of
``TURNS`` model turns each.

MODE ``pool``: verifiers' ``SingleAgentEnv`` (one ``Agent.run`` per episode, one model turn) with
the default elastic interception pool at ``multiplex=2``: the pool warms one interception server
when serving starts and brings up more inside rollouts, when one needs a slot and every server is
full (``interception/pool.py``, ``ElasticInterceptionPool._server``).

Prints one JSON line: every episode's traces (id, agent, turns, stop, errors) and, for ``pool``, how
many interception servers the pool ran.
"""

import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # vf_tiny_taskset, loaded by id

import verifiers.v1 as vf
from verifiers.v1.envs.single_agent import SingleAgentEnv, SingleAgentEnvConfig
from verifiers.v1.envs.user_sim.env import UserSimEnv, UserSimEnvConfig
from verifiers.v1.interception import ElasticInterceptionPoolConfig

MODE, BASE_URL, MODEL = sys.argv[1:4]
TURNS = 3  # user-sim's length: the user's max_turns (the mock model never says it is done)
os.environ.setdefault("DRIVER_API_KEY", "-")


def agent(**extra) -> vf.AgentConfig:
    return vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), **extra)


def make_env():
    taskset = vf.TasksetConfig(id="vf_tiny_taskset")
    if MODE == "env":
        return UserSimEnv(UserSimEnvConfig(taskset=taskset, user=agent(max_turns=TURNS), assistant=agent()))
    return SingleAgentEnv(
        SingleAgentEnvConfig(
            taskset=taskset, agent=agent(), interception=ElasticInterceptionPoolConfig(multiplex=2)
        )
    )


def summary(trace) -> dict:
    return {
        "id": trace.id,
        "agent": trace.agent.name,
        "turns": trace.num_turns,
        "stop": trace.stop_condition,
        "errors": [f"{e.type}: {e.message[:300]}" for e in trace.errors],
    }


async def main() -> dict:
    env = make_env()
    ctx = vf.ModelContext(
        model=MODEL,
        client=vf.EvalClientConfig(base_url=BASE_URL, api_key_var="DRIVER_API_KEY"),
        sampling=vf.SamplingConfig(max_tokens=8, nvext={"extra_fields": ["worker_id"]}),
    )
    async with env.serving():
        slots = [slot for task in env.taskset for slot in env.slots(task, n=2)]
        episodes = await asyncio.gather(*(env.run_slot(slot, ctx) for slot in slots))
        servers = len(getattr(env._interception, "servers", ()))
    return {
        "mode": MODE,
        "interception_servers": servers,
        "episodes": [
            {
                "task": episode.task.data.idx,
                "ok": episode.ok,
                "errors": [e.message[:300] for e in episode.errors],
                "traces": [summary(trace) for trace in episode.traces],
            }
            for episode in episodes
        ],
    }


print(json.dumps(asyncio.run(main())))
