"""End to end with real processes: rollout client -> Gym agent -> Gym model server -> Dynamo.

The agent (FastAPI on uvicorn) and the model server (aiohttp web, calling Dynamo with aiohttp) are
separate processes configured only through ``OTEL_SESSION_*``, as deployed servers would be; the
agent also calls a third-party tool server. Dynamo is a recording server (which shows exactly what
each hop received) and the real local Dynamo stack (where affinity shows the session arrived: with
four round-robin workers, a session whose header is lost would move on every turn).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

import otel_session
from otel_session.dynamo import worker_id_of
from tests.gym_servers import ServerProcess
from tests.recorder import Recorder

TURNS = 4
SESSION_HEADERS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent"}


@dataclass
class DynamoTarget:
    base_url: str  # ends in /v1
    host: str
    model: str
    recorder: Recorder | None  # None for the real stack


@pytest.fixture(params=["recorder", "local_dynamo"])
def target(request: pytest.FixtureRequest) -> DynamoTarget:
    if request.param == "recorder":
        rec: Recorder = request.getfixturevalue("dynamo")
        return DynamoTarget(f"{rec.url}/v1", rec.authority, "recorder", rec)
    stack = request.getfixturevalue("dynamo_stack")
    return DynamoTarget(stack.base_url, stack.host, stack.model_name, None)


@dataclass
class Gym:
    agent: ServerProcess
    model: ServerProcess


@pytest.fixture
def gym_servers(target: DynamoTarget, other: Recorder) -> Iterator[Gym]:
    agent, model = ServerProcess("agent"), ServerProcess("model")
    common = {
        "OTEL_SESSION_DYNAMO_HOSTS": target.host,
        "OTEL_SESSION_TRUSTED_HOSTS": f"{agent.authority},{model.authority}",
    }
    try:
        model.start({**common, "DYNAMO_URL": target.base_url})
        agent.start({**common, "MODEL_URL": model.url, "TOOL_URL": other.url, "DYNAMO_MODEL": target.model})
        yield Gym(agent, model)
    finally:
        agent.stop()
        model.stop()


def _run_trajectory(client: httpx.Client, gym: Gym) -> tuple[str, list[int | None]]:
    """One rollout of TURNS turns with a growing conversation; returns its session and the workers."""
    workers: list[int | None] = []
    with otel_session.trajectory() as traj:
        messages: list[dict[str, str]] = []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"question {turn}: what is {turn} + {turn}?"})
            response = client.post(f"{gym.agent.url}/turn", json={"messages": messages})
            response.raise_for_status()
            body = response.json()
            workers.append(worker_id_of(body))
            messages.append(body["choices"][0]["message"])
    assert traj.session_id is not None
    return traj.session_id, workers


def test_session_crosses_agent_and_model_servers_to_dynamo(
    target: DynamoTarget, gym_servers: Gym, other: Recorder
) -> None:
    otel_session.configure(
        dynamo_hosts=[target.host], trusted_hosts=[gym_servers.agent.authority, gym_servers.model.authority]
    )
    with httpx.Client(timeout=30) as client:
        runs = [_run_trajectory(client, gym_servers) for _ in range(2)]
    sessions = [session for session, _ in runs]
    assert len(set(sessions)) == 2

    # The agent and the model server (trusted) receive the trajectory as baggage, and no header.
    for server in (gym_servers.agent, gym_servers.model):
        seen = server.seen()
        assert len(seen) == 2 * TURNS
        for index, headers in enumerate(seen):
            assert f"session.id={sessions[index // TURNS]}" in headers.get("baggage", ""), server.kind
            assert "x-dynamo-session-id" not in headers

    # The third-party tool server receives nothing of the session.
    tool_calls = [seen for seen in other.requests if seen.path == "/tool"]
    assert len(tool_calls) == 2 * TURNS
    for seen in tool_calls:
        assert not seen.names() & SESSION_HEADERS, seen.headers

    if target.recorder is not None:
        # Dynamo receives the session header on every turn, and only that.
        chats = [seen for seen in target.recorder.requests if seen.path == "/v1/chat/completions"]
        assert [seen.get("X-Dynamo-Session-ID") for seen in chats] == [
            s for s in sessions for _ in range(TURNS)
        ]
        for seen in chats:
            assert not seen.names() & (SESSION_HEADERS - {"x-dynamo-session-id"}), seen.headers
    else:
        # Real Dynamo: affinity keeps each trajectory on one of the four round-robin workers.
        for _, workers in runs:
            assert None not in workers
            assert len(set(workers)) == 1, workers
