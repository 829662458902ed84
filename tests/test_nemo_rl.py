"""NeMo-RL's shapes (tests/nemo_rl_shapes.py) with zero code, in front of the real local Dynamo stack.

As in a NeMo-RL run: the driver starts the token wrapper (a process under ``opentelemetry-instrument``
whose FastAPI app exists only inside ``start()``) and learns its random port, then adds the exact
``host:port`` of the wrapper and of the frontend with ``otel_session.add_dynamo_hosts``; the rollout
process started afterwards (as a Ray actor would be, with ``OTEL_SESSION_AUTO=true`` in its runtime
env) inherits them. Its only otel-session line is ``with otel_session.trajectory():``.

Harness parts (tests/gym_harness.py ``RecordingProxy``, forwarding byte for byte and recording): in
front of the frontend for the wrapper, adding the ``nvext.engine_data`` and ``logprobs`` that Dynamo's
mocker does not return (response bodies only: no header, no routing touched); and in front of the
frontend for the direct ``/completions`` path, failing the first request with 503 to drive the retry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import otel_session
from otel_session.dynamo import LocalDynamo
from tests.gym_harness import RecordingProxy
from tests.gym_servers import ROOT

INSTRUMENT = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent"}


def add_engine_data(body: Any) -> Any:
    """What the token wrapper needs from a real engine and the mocker lacks (values are placeholders)."""
    if isinstance(body, dict) and "choices" in body:
        body.setdefault("nvext", {})["engine_data"] = {"prompt_token_ids": [], "completion_token_ids": []}
        for choice in body["choices"]:
            choice["logprobs"] = choice.get("logprobs") or {"content": []}
    return body


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | {"PYTHONPATH": str(ROOT)}


@dataclass
class Wrapper:
    base_url: str
    proc: subprocess.Popen[str]


@pytest.fixture
def wrapper_process(request: pytest.FixtureRequest) -> Iterator[Any]:
    started: list[subprocess.Popen[str]] = []

    def start(frontend_v1: str, dynamo_host: str) -> Wrapper:
        env = _clean_env() | {"OTEL_PYTHON_DISTRO": "otel_session", "OTEL_SESSION_DYNAMO_HOSTS": dynamo_host}
        proc = subprocess.Popen(
            [INSTRUMENT, sys.executable, "-m", "tests.nemo_rl_shapes", "wrapper", frontend_v1],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the wrapper exited before it listened"
        return Wrapper(json.loads(line)["base_url"], proc)

    yield start
    for proc in started:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_nemo_rl_wrapper_and_retry_loop_carry_the_trajectory_with_zero_code(
    versioned_dynamo_stack: LocalDynamo, wrapper_process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = versioned_dynamo_stack
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "")  # what add_dynamo_hosts extends; put back after
    with (
        RecordingProxy(f"http://{stack.host}", adapt_body=add_engine_data) as for_wrapper,
        RecordingProxy(f"http://{stack.host}", fail_first=1) as frontend,
    ):
        wrapper = wrapper_process(f"http://{for_wrapper.authority}/v1", for_wrapper.authority)
        # The driver now knows the runtime ports: exact host:port, so node neighbours never match.
        otel_session.add_dynamo_hosts(wrapper.base_url, f"http://{frontend.authority}/v1")
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.nemo_rl_shapes",
                "rollout",
                wrapper.base_url,
                f"http://{frontend.authority}/v1",
                stack.model_name,
            ],
            cwd=ROOT,
            env=os.environ | {"PYTHONPATH": str(ROOT), "OTEL_SESSION_AUTO": "true"},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    sessions = [t["session"] for t in report["trajectories"]]
    assert len(set(sessions)) == 2 and report["outside_status"] == 200
    for trajectory in report["trajectories"]:  # both paths, every turn: one worker per trajectory
        assert len(trajectory["workers"]) == 6 and len(set(trajectory["workers"])) == 1, trajectory

    chats = [e for e in for_wrapper.exchanges if e.path.endswith("/chat/completions")]
    assert [e.header("x-dynamo-session-id") for e in chats] == [sessions[0]] * 3 + [sessions[1]] * 3 + [None]
    assert all(e.header("authorization") == "Bearer rl-key" for e in chats)  # still forwarded
    assert all(e.status == 200 for e in chats)

    completions = [e for e in frontend.exchanges if e.path.endswith("/completions")]
    assert [e.status for e in completions[:2]] == [503, 200]  # the retry of the first call
    assert [e.header("x-dynamo-session-id") for e in completions] == [sessions[0]] * 4 + [sessions[1]] * 3
    parents: dict[str, set[str | None]] = {}
    for exchange in chats + completions:
        names = {name.lower() for name, _ in exchange.request_headers}
        # the session, and the parent its first request's prompt grouped it under: nothing else of ours
        assert names & OURS <= {"x-dynamo-session-id", "x-dynamo-parent-session-id"}, exchange.request_headers
        session = exchange.header("x-dynamo-session-id")
        if session is not None:
            parents.setdefault(session, set()).add(exchange.header("x-dynamo-parent-session-id"))
    assert all(len(p) == 1 for p in parents.values()), parents  # one parent for all of an attempt's turns
