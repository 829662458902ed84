"""verifiers 0.4.0 (prime-rl's environments) against the real local Dynamo, zero code (issue 22, item 4).

verifiers' own rollout code runs unmodified from ``.venv-verifiers`` (``scripts/verifiers_venv``):
``tests/verifiers_cases/driver.py`` has no otel-session code and is started only as
``opentelemetry-instrument python driver.py`` with ``OTEL_PYTHON_DISTRO=otel_session`` and
``OTEL_SESSION_DYNAMO_HOSTS``. It runs envs the way verifiers' eval CLI and prime-rl's env server do
(``env.serving()`` + ``env.run_slot``), 2 tasks x 2 rollouts, every agent through verifiers' ``null``
harness in the local ``subprocess`` runtime.

Where verifiers sends the model's requests: the harness is a separate process (one per segment, a
uv script environment without otel-session) that talks to verifiers' interception server, an aiohttp
app in the driver process; that server's request handler sends each request on to the model endpoint
with ``X-Session-ID`` = the rollout's trace id (``verifiers/v1/interception/server.py``,
``session_id=session.trace.id``). No otel-session trajectory is current there, so otel-session adds
nothing and Dynamo pins each rollout attempt by verifiers' own header. These tests show that on the
wire and on Dynamo (``tests.support.DynamoProxy`` forwards each request unchanged and records its
headers, its body and the worker that served it; ``messages`` below reads each request's conversation
length from its body); docs/integrations.md ("verifiers (prime-rl)") says why our own session cannot
reach Dynamo from verifiers.

Every test runs against the session-scoped ``dynamo_stack``: 4 mocker workers, round-robin, session
affinity on.
"""

from __future__ import annotations

import os
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from otel_session.dynamo import NVEXT_EXTRA_BODY, LocalDynamo, worker_id_of
from tests.gym_servers import ROOT
from tests.support import DynamoProxy, Forwarded, run_zero_code

VENV = ROOT / ".venv-verifiers"
DRIVER = ROOT / "tests" / "verifiers_cases" / "driver.py"
REQUIRE_ENV = "OTEL_SESSION_REQUIRE_GYM"  # set by scripts/test: a missing venv fails, never skips
NOTICE = "was sent outside any trajectory"
OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent", "tracestate"}
TURNS = 3  # model turns per agent run in the driver's ``env`` mode (user-sim)
# A boundary a user might name for verifiers, with the interception server's loopback trusted.
BOUNDARY = {
    "OTEL_SESSION_TRAJECTORY_FUNCTIONS": "verifiers.v1.agent:Agent._run_once",
    "OTEL_SESSION_TRUSTED_HOSTS": "127.0.0.1",
}


def messages(request: Forwarded) -> int:
    """The conversation's length in a chat request: it grows turn by turn within one rollout."""
    return len(request.json().get("messages", [])) if request.body else 0


@dataclass
class Run:
    report: dict[str, Any]
    stderr: str
    requests: list[Forwarded]

    @property
    def traces(self) -> list[dict[str, Any]]:
        return [trace for episode in self.report["episodes"] for trace in episode["traces"]]


@pytest.fixture(scope="session")  # before the session-scoped Dynamo stack starts
def verifiers_venv() -> None:
    if not (VENV / "bin" / "opentelemetry-instrument").exists():
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail("the verifiers venv (.venv-verifiers) is missing: run scripts/verifiers_venv")
        pytest.skip("the verifiers venv (.venv-verifiers) is missing: run scripts/verifiers_venv")


def run_driver(mode: str, stack: LocalDynamo, **env: str) -> Run:
    """``opentelemetry-instrument python driver.py MODE ...`` in .venv-verifiers, environment variables
    only. The venv's bin goes first on PATH (verifiers runs the harness through the ``uv`` it finds
    there; without one it would ``pip install --user uv``), and HOME and uv's cache live in the venv:
    verifiers keeps its harness scripts under ``~/.cache/verifiers``, and uv builds the harness's
    script environment (openai, mcp, httpx, ...) once, from the package index, on the first run."""
    home = VENV / "home"
    home.mkdir(exist_ok=True)
    with DynamoProxy(f"http://{stack.host}") as proxy:
        report, stderr = run_zero_code(
            [str(VENV / "bin" / "opentelemetry-instrument"), str(VENV / "bin" / "python"), str(DRIVER), mode,
             f"http://{proxy.authority}/v1", stack.model_name],
            dynamo=proxy.authority,
            env={
                "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                "HOME": str(home),
                "UV_CACHE_DIR": str(VENV / "uv-cache"),
            }
            | env,
            timeout=180,
            drop=("OTEL_", "PYTHON", "VIRTUAL_ENV", "UV_"),
        )  # fmt: skip
    assert not (home / ".local").exists(), "verifiers installed something with pip --user"
    return Run(report, stderr, proxy.requests)


def by_session_header(requests: list[Forwarded]) -> dict[str | None, list[Forwarded]]:
    groups: dict[str | None, list[Forwarded]] = defaultdict(list)
    for request in requests:
        groups[request.header("X-Session-ID")].append(request)
    return groups


def assert_nothing_of_ours(requests: list[Forwarded]) -> None:
    for request in requests:
        assert not {k.lower() for k, _ in request.headers} & OURS, request.headers


def test_user_sim_one_session_per_rollout_attempt_on_one_worker(
    verifiers_venv: None, dynamo_stack: LocalDynamo
) -> None:
    """verifiers' user-sim env, 2 tasks x 2 rollouts: 4 episodes, each a user and an assistant run of
    3 turns, so 8 rollout attempts and 24 Dynamo requests. Each attempt's turns carry one
    ``X-Session-ID`` (its trace id, distinct per attempt) and stay on one worker; otel-session adds no
    header of its own and logs its one notice line."""
    run = run_driver("env", dynamo_stack)
    episodes = run.report["episodes"]
    assert [e["task"] for e in episodes] == [0, 0, 1, 1], run.report
    assert all(e["ok"] and not e["errors"] for e in episodes), run.report
    assert all(sorted(t["agent"] for t in e["traces"]) == ["assistant", "user"] for e in episodes), run.report
    assert all(t["turns"] == TURNS and not t["errors"] for t in run.traces), run.report

    assert len(run.requests) == len(run.traces) * TURNS == 24
    assert all(r.path == "/v1/chat/completions" and r.status == 200 for r in run.requests)
    assert_nothing_of_ours(run.requests)
    sessions = by_session_header(run.requests)
    assert set(sessions) == {t["id"] for t in run.traces}  # every request has one: its rollout's trace id
    for session, requests in sessions.items():
        assert len(requests) == TURNS, session
        lengths = [messages(r) for r in requests]
        assert lengths == sorted(set(lengths)), (session, lengths)  # one conversation, growing
        workers = {r.worker for r in requests}
        assert len(workers) == 1 and None not in workers, (session, workers)
    assert len({r.worker for r in run.requests}) > 1  # the attempts spread; each keeps its worker
    assert run.stderr.count(NOTICE) == 1, run.stderr[-3000:]


def test_a_named_boundary_adds_nothing_that_fights_verifiers_session(
    verifiers_venv: None, dynamo_stack: LocalDynamo
) -> None:
    """``OTEL_SESSION_TRAJECTORY_FUNCTIONS=verifiers.v1.agent:Agent._run_once`` (one attempt per call)
    and loopback trusted: still nothing of ours reaches Dynamo, even from an interception server
    started inside an attempt. The elastic pool (multiplex 2, 4 concurrent rollouts) brings up its
    second server inside a rollout, so that attempt's session is current where the server starts.
    otel-session's server middleware runs every request in its caller's session only (none here), so
    no attempt's session reaches another's requests, and Dynamo still pins by verifiers'
    ``X-Session-ID``."""
    run = run_driver("pool", dynamo_stack, **BOUNDARY)
    assert run.report["interception_servers"] >= 2, run.report  # one was started inside an attempt
    assert [len(e["traces"]) for e in run.report["episodes"]] == [1, 1, 1, 1], run.report
    assert all(t["turns"] == 1 and t["stop"] == "agent_completed" for t in run.traces), run.report
    assert len(run.requests) == 4 and all(r.status == 200 and r.worker is not None for r in run.requests)
    assert_nothing_of_ours(run.requests)
    sessions = by_session_header(run.requests)
    assert set(sessions) == {t["id"] for t in run.traces} and len(sessions) == 4
    assert "not resolve" not in run.stderr and "never imported" not in run.stderr, run.stderr[-3000:]


def test_dynamo_pins_by_x_dynamo_session_id_then_x_session_id(dynamo_stack: LocalDynamo) -> None:
    """Dynamo 1.6.1 on its own: ``X-Session-ID`` alone pins a session; with both headers,
    ``X-Dynamo-Session-ID`` decides the worker; with neither, round-robin spreads the requests."""

    def worker(headers: dict[str, str]) -> int:
        hi = [{"role": "user", "content": "hi"}]
        body = {"model": dynamo_stack.model_name, "messages": hi, "max_tokens": 1}
        url = f"{dynamo_stack.base_url}/chat/completions"
        response = httpx.post(url, json=body | NVEXT_EXTRA_BODY, headers=headers, timeout=30)
        response.raise_for_status()
        found = worker_id_of(response.json())
        assert found is not None
        return dynamo_stack.worker_index(found)

    assert len({worker({}) for _ in range(4)}) > 1
    theirs = uuid.uuid4().hex
    pinned = {worker({"X-Session-ID": theirs}) for _ in range(3)}
    assert len(pinned) == 1, pinned
    (their_worker,) = pinned
    for _ in range(8):  # a fresh session binds to the next worker round-robin: one that is not theirs
        ours = str(uuid.uuid4())
        our_worker = worker({"X-Dynamo-Session-ID": ours})
        if our_worker != their_worker:
            break
    assert our_worker != their_worker
    both = {"X-Dynamo-Session-ID": ours, "X-Session-ID": theirs}
    assert {worker(both) for _ in range(3)} == {our_worker}
    assert worker({"X-Session-ID": theirs}) == their_worker  # its own binding is untouched
