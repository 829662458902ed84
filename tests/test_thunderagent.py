"""The end of a session against Dynamo's real lifecycle-aware router, ThunderAgent (ai-dynamo 1.6.1).

A real local Dynamo stack (frontend + two mocker workers on loopback) with
``dynamo.thunderagent_router`` joined to it serving model ``ta-tiny``. Requests of a trajectory
become one ThunderAgent *program* named by the session ID (its route proof in
``nvext.engine_data.thunderagent`` says so); with ``end_sessions`` on, the trajectory's end sends the
terminal request and ThunderAgent logs that it released the program without running it.

What it needed here: nothing beyond the stack's own environment (file discovery, the loopback broker
and request plane), the locally built tokenizer directory as ``--model-path``, and a model name of
its own, so the frontend routes that model through ThunderAgent while the mockers keep serving theirs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

import otel_session
from otel_session.dynamo import LocalDynamo, ensure_model_dir
from tests.dynamo_fixtures import start_local_dynamo
from tests.routers import ThunderAgentProcess, is_loopback

ENGINE_DATA = {"nvext": {"extra_fields": ["worker_id", "engine_data"]}}


@pytest.fixture(scope="module")
def thunder() -> Iterator[ThunderAgentProcess]:
    stack: LocalDynamo = start_local_dynamo(workers=2, router_mode="round-robin", affinity_ttl_secs=None)
    agent = ThunderAgentProcess(stack)
    try:
        agent.start(str(ensure_model_dir()))
        yield agent
    finally:
        agent.stop()
        stack.stop()


def _proof(response: Any) -> dict[str, Any]:
    return response.model_dump()["nvext"]["engine_data"]["thunderagent"]  # type: ignore[no-any-return]


def _rollout(agent: ThunderAgentProcess, turns: int = 3) -> tuple[str, list[dict[str, Any]]]:
    with (
        openai.OpenAI(base_url=agent.stack.base_url, api_key="k") as client,
        otel_session.trajectory() as traj,
    ):
        proofs = [
            _proof(client.chat.completions.create(
                model=agent.model_name, messages=[{"role": "user", "content": f"turn {turn}"}], max_tokens=4,
                extra_body=ENGINE_DATA,
            ))
            for turn in range(turns)
        ]  # fmt: skip
    assert traj.session_id is not None
    return traj.session_id, proofs


def _wait_for(agent: ThunderAgentProcess, text: str, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (found := agent.log_text().count(text)) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_thunderagent_releases_the_program_when_the_trajectory_ends(thunder: ThunderAgentProcess) -> None:
    otel_session.configure(dynamo_hosts=thunder.stack.hosts, end_sessions=True)
    sid, proofs = _rollout(thunder)
    assert [p["program_id"] for p in proofs] == [sid] * 3
    assert {p["path"] for p in proofs} == {"program"} and not any(p["session_final"] for p in proofs)
    assert _wait_for(thunder, f"thunderagent.route path=session_final program={sid} released=True") == 1
    assert thunder.log_text().count(f"thunderagent.program terminated program={sid} ") == 1


def test_without_end_sessions_the_program_stays(thunder: ThunderAgentProcess) -> None:
    otel_session.configure(dynamo_hosts=thunder.stack.hosts)
    sid, proofs = _rollout(thunder, turns=2)
    assert [p["program_id"] for p in proofs] == [sid] * 2
    time.sleep(0.5)
    assert f"program={sid}" in thunder.log_text()
    assert f"session_final program={sid}" not in thunder.log_text()
    assert f"terminated program={sid}" not in thunder.log_text()


def test_thunderagent_listens_on_loopback_only(thunder: ThunderAgentProcess) -> None:
    listening = thunder.listening()
    assert listening and all(is_loopback(addr) for addr, _ in listening), listening
