"""rLLM with zero code (issue 35, item 1): the ``otel_session_rllm`` preset with rLLM's own code in the loop.

rLLM is not on the package index, so its rollout path runs from its own source files, copied unchanged
(tests/vendor/rllm, SOURCE.md there says which and the one file that is not rLLM's). The driver
(tests/rllm_cases/driver.py, no otel-session code) is started only as ``opentelemetry-instrument python
driver.py`` with ``OTEL_PYTHON_DISTRO=otel_session``, ``OTEL_SESSION_DYNAMO_HOSTS`` and the source on
``PYTHONPATH``: rLLM's ``AgentWorkflowEngine`` runs 2 tasks x 2 rollouts of 3 turns through its
``OpenAIEngine`` (the openai SDK) against the real local Dynamo (4 mocker workers, round-robin, session
affinity on), each environment step in rLLM's thread pool asking a tool server on 127.0.0.2 with
``requests``. The preset makes each ``Workflow.run_with_termination_handling`` one attempt, grouped by
``uid.rpartition(":")[0]``, the task id. ``tests.support.DynamoProxy`` forwards each request unchanged
and records its headers, body and the worker that served it. One more run goes through the real vLLM
router (``vllm-router`` 0.1.17, ``consistent_hash``) in front of 3 recording engine stand-ins
(``tests.routers.Backend``), configured only by ``OTEL_SESSION_ROUTERS``.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from otel_session.dynamo import LocalDynamo
from tests.gym_servers import ROOT
from tests.recorder import Recorder, Seen
from tests.routers import backends, router
from tests.support import DynamoProxy, Forwarded, run_zero_code

SOURCE = ROOT / "tests" / "vendor" / "rllm"
DRIVER = ROOT / "tests" / "rllm_cases" / "driver.py"
INSTRUMENT = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent", "tracestate"}
NOTICE = "was sent outside any trajectory"
TURNS = 3


@dataclass
class Run:
    report: dict[str, Any]
    stderr: str
    requests: list[Forwarded]
    tools: list[Seen]


def run_driver(stack: LocalDynamo, **env: str) -> Run:
    with DynamoProxy(f"http://{stack.host}") as proxy, Recorder(host="127.0.0.2") as tools:
        report, stderr = _zero_code(
            f"http://{proxy.authority}/v1", stack.model_name, tools, proxy.authority, env
        )
    return Run(report, stderr, list(proxy.requests), list(tools.requests))


def _zero_code(
    url: str, model: str, tools: Recorder, dynamo: str, env: dict[str, str]
) -> tuple[dict[str, Any], str]:
    return run_zero_code(
        [INSTRUMENT, sys.executable, str(DRIVER), url, model, f"{tools.url}/tool"],
        dynamo=dynamo,
        env={"PYTHONPATH": str(SOURCE)} | env,
        timeout=120,
    )


def task_of(request: Forwarded) -> str:
    return str(request.json()["messages"][0]["content"]).partition(":")[0]


def assert_rllm_ran(run: Run) -> None:
    episodes = run.report["episodes"]
    assert sorted(e["id"] for e in episodes) == ["task-0:0", "task-0:1", "task-1:0", "task-1:1"], episodes
    assert {e["termination"] for e in episodes} == {"env_done"}, episodes
    assert len(run.requests) == 4 * TURNS and all(
        r.status == 200 and r.worker is not None for r in run.requests
    )
    assert len(run.tools) == 4 * TURNS


def test_each_rollout_is_one_session_on_one_worker_and_each_task_one_parent(
    dynamo_stack: LocalDynamo,
) -> None:
    # K fixed at 2 (each task's two rollouts): the default sizes it to the fleet from the first step,
    # which on this stack's workers puts each rollout alone (tests/test_gathering.py)
    run = run_driver(dynamo_stack, OTEL_SESSION_SIBLINGS="groups:2")
    assert_rllm_ran(run)
    sessions: dict[str | None, list[Forwarded]] = defaultdict(list)
    for request in run.requests:
        sessions[request.header("x-dynamo-session-id")].append(request)
    assert None not in sessions and len(sessions) == 4, list(
        sessions
    )  # an ID on every request, one per attempt
    parents: dict[str, set[str | None]] = defaultdict(set)
    for session, requests in sessions.items():
        assert [len(r.json()["messages"]) for r in requests] == [1, 3, 5], (
            session
        )  # one conversation, in order
        (task,) = {task_of(r) for r in requests}
        assert len({r.worker for r in requests}) == 1, requests  # Dynamo pinned the attempt to one worker
        parents[task] |= {r.header("x-dynamo-parent-session-id") for r in requests}
    assert sorted(parents) == ["task 0", "task 1"], parents
    assert all(len(found) == 1 and None not in found for found in parents.values()), parents  # groups:2
    assert parents["task 0"] != parents["task 1"] and not set().union(*parents.values()) & set(sessions)
    for request in run.requests:  # the session and its parent, nothing else of ours
        assert {k.lower() for k, _ in request.headers} & OURS == {
            "x-dynamo-session-id",
            "x-dynamo-parent-session-id",
        }
    for seen in run.tools:  # from rLLM's thread pool, inside the attempt, to a host that is no router
        assert not seen.names() & OURS, seen.headers
    assert NOTICE not in run.stderr and "does not resolve" not in run.stderr, run.stderr[-3000:]


def test_without_the_preset_no_rollout_carries_a_session(dynamo_stack: LocalDynamo) -> None:
    """The control: ``otel_session_rllm`` turned off, the same run opens no attempt, so no session."""
    run = run_driver(dynamo_stack, OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="otel_session_rllm")
    assert_rllm_ran(run)
    assert not any(r.header("x-dynamo-session-id") for r in run.requests)
    assert NOTICE in run.stderr, run.stderr[-3000:]


def test_through_the_vllm_router_each_rollout_stays_on_one_engine() -> None:
    """``OTEL_SESSION_ROUTERS='vllm-router=...'`` alone: every turn of a rollout carries one
    ``X-Session-ID`` (the router's header; no Dynamo header, no parent: that router has none) and the
    router keeps the rollout on one engine; the 4 rollouts have 4 IDs."""
    with backends(3) as fleet, router("vllm-router", fleet, policy="consistent_hash") as vllm_router:
        with Recorder(host="127.0.0.2") as tools:
            report, stderr = _zero_code(
                f"{vllm_router.url}/v1",
                "m",
                tools,
                "",
                {"OTEL_SESSION_ROUTERS": f"vllm-router={vllm_router.authority}"},
            )
        served = [(backend.name, seen) for backend in fleet for seen in backend.completions()]
    assert sorted(e["id"] for e in report["episodes"]) == ["task-0:0", "task-0:1", "task-1:0", "task-1:1"], (
        report
    )
    assert len(served) == 4 * TURNS and len(tools.requests) == 4 * TURNS
    engines: dict[str | None, set[str]] = defaultdict(set)
    for name, seen in served:
        engines[seen.get("x-session-id")].add(name)
        assert seen.names() & OURS == set(), seen.headers
    assert None not in engines and len(engines) == 4, engines
    assert all(len(names) == 1 for names in engines.values()), engines  # each rollout on one engine
    assert all(not seen.names() & (OURS | {"x-session-id"}) for seen in tools.requests)
    assert NOTICE not in stderr, stderr[-3000:]
