"""Real NeMo-Gym 0.7.0, unmodified and zero-code, in front of the real local Dynamo stack.

Gym's ``GymnasiumAgent`` drives ``ExampleMultiTurnEnv`` episodes (three model turns each) through
Gym's ``VLLMModel``, whose Starlette cookie session mints the episode UUID on the first turn. No Gym
process contains an otel-session line: three variables, as the README says (``OTEL_SESSION_AUTO``,
``OTEL_SESSION_DYNAMO_HOSTS``, ``OTEL_SESSION_ADOPT``; or ``opentelemetry-instrument`` with
``OTEL_PYTHON_DISTRO=otel_session`` instead of the first).
Checked from the wire (see ``tests/gym_harness.py`` for the recording proxies), on both Dynamo versions.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from otel_session.dynamo import LocalDynamo, worker_id_of
from tests.dynamo_fixtures import DYNAMO_PYTHONS
from tests.gym_harness import (
    AGENT,
    GYM_INSTRUMENT,
    MODEL,
    REQUIRE_ENV,
    RESOURCES,
    GymProcess,
    Ports,
    RecordingProxy,
    gym_config,
    run_episode,
    starlette_session_of,
)

OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent"}
ROW = {  # the first row of Gym's own example dataset for this environment: three model turns
    "responses_create_params": {"input": [{"role": "user", "content": "What is the capital of France?"}]},
    "follow_ups": ["What is the approximate population of that city?", "Name one famous landmark there."],
    "expected_answer": "Eiffel",
}
EPISODES = 3  # odd, concurrent: round-robin over 4 workers would move every unpinned episode
ADOPT = {"OTEL_SESSION_ADOPT": "session:session_id"}
# The two zero-code launches, one per Dynamo version so that both run without doubling the time:
# opentelemetry-instrument (and its distro), or plain python with OTEL_SESSION_AUTO (the .pth).
LAUNCH = {"1.6.1": "auto", "1.3.0.post1": "opentelemetry-instrument"}


@dataclass
class GymRun:
    dynamo: RecordingProxy  # in front of the Dynamo frontend
    model: RecordingProxy  # in front of the VLLMModel server (agent -> model)
    resources: RecordingProxy  # in front of the resources server (agent -> environment)
    agent_url: str


@pytest.fixture
def gym_run(versioned_dynamo_stack: LocalDynamo, dynamo_python: str, tmp_path: Path) -> Iterator[GymRun]:
    if not GYM_INSTRUMENT.exists():
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail("NeMo-Gym venv missing: run scripts/nemo_gym_venv")
        pytest.skip("NeMo-Gym venv missing (.venv-gym): run scripts/nemo_gym_venv")
    stack = versioned_dynamo_stack
    servers: list[GymProcess] = []
    ports = Ports(("head", MODEL, RESOURCES, AGENT))
    real = {name: ports.port(name) for name in ports.names}
    with (
        RecordingProxy(f"http://{stack.host}") as dynamo,
        RecordingProxy(f"http://127.0.0.1:{real[MODEL]}") as model,
        RecordingProxy(f"http://127.0.0.1:{real[RESOURCES]}") as resources,
    ):
        own = gym_config(real, f"http://{dynamo.authority}/v1", stack.model_name)
        seen_by_agent = gym_config(
            {**real, MODEL: model.port, RESOURCES: resources.port},
            f"http://{dynamo.authority}/v1",
            stack.model_name,
        )
        (version,) = [v for v, python in DYNAMO_PYTHONS.items() if python == dynamo_python]
        instrument = LAUNCH[version] == "opentelemetry-instrument"
        launch = {"OTEL_PYTHON_DISTRO": "otel_session"} if instrument else {"OTEL_SESSION_AUTO": "true"}
        env = {**ADOPT, **launch, "OTEL_SESSION_DYNAMO_HOSTS": dynamo.authority}
        try:
            for name in (MODEL, RESOURCES, AGENT):
                ports.release(name)
                config = seen_by_agent if name == AGENT else own
                servers.append(GymProcess(name, config, env, tmp_path, instrument=instrument))
            for server in servers:
                server.wait_ready()
            yield GymRun(dynamo, model, resources, f"http://127.0.0.1:{real[AGENT]}")
        finally:
            for server in servers:
                server.stop()
            ports.release("head")


async def _episodes(run: GymRun) -> list[dict[str, object]]:
    return await asyncio.gather(*(run_episode(run.agent_url, ROW) for _ in range(EPISODES)))


def test_gym_episodes_zero_code_gyms_own_uuid_one_worker_each_and_nothing_elsewhere(gym_run: GymRun) -> None:
    """The four checks: every Dynamo request of an episode carries Gym's own UUID; one worker per
    episode; distinct episodes, distinct IDs; the resources server (and the model server, called by
    the agent) receive nothing of the session."""
    results = asyncio.run(asyncio.wait_for(_episodes(gym_run), 300))
    assert all(result["terminated"] for result in results), results

    # Gym's own episode IDs: what VLLMModel's cookie session minted, read from its Set-Cookie.
    minted = set()
    for exchange in gym_run.model.exchanges:
        for name, value in exchange.response_headers:
            if name.lower() == "set-cookie" and value.startswith(f"VLLMModel___{MODEL}="):
                minted.add(starlette_session_of(value)["session_id"])
    assert len(minted) == EPISODES  # distinct episodes, distinct IDs

    chats = [e for e in gym_run.dynamo.exchanges if e.path.endswith("/chat/completions")]
    assert len(chats) == EPISODES * 3 and all(e.status == 200 for e in chats)
    by_session: dict[str | None, list[int | None]] = defaultdict(list)
    for exchange in chats:
        by_session[exchange.header("x-dynamo-session-id")].append(worker_id_of(exchange.json()))
    assert set(by_session) == minted  # every request carried a Gym UUID, and only Gym's
    for session, workers in by_session.items():
        assert str(uuid.UUID(str(session))) == session
        assert len(workers) == 3 and None not in workers
        assert len(set(workers)) == 1, (session, workers)  # one worker per episode
    for exchange in chats:  # Dynamo is not a trusted host: the header and nothing else of ours
        assert {name.lower() for name, _ in exchange.request_headers} & OURS == {"x-dynamo-session-id"}

    steps = [e for e in gym_run.resources.exchanges if e.path in ("/reset", "/step")]
    assert len(steps) == EPISODES * 4  # one reset and three steps per episode
    for exchange in steps + gym_run.model.exchanges:
        assert not {name.lower() for name, _ in exchange.request_headers} & OURS, exchange.request_headers
