"""NeMo-RL's trajectory boundaries with zero code (issue 22, item 1 and its Floor), end to end.

NeMo-RL is not installable from the package index, so the rollout code is a stand-in with NeMo-RL's
names and call shapes (tests/standin/nemo_rl, read from NVIDIA-NeMo/RL at 7ea279a). The driver
(tests/standin/rollout_driver.py) has no otel-session code: it is started only as
``opentelemetry-instrument python rollout_driver.py`` with ``OTEL_PYTHON_DISTRO=otel_session``,
``OTEL_SESSION_DYNAMO_HOSTS`` and the stand-in on ``PYTHONPATH``. The NeMo-RL instrumentor
(``otel_session_nemo_rl``) makes each call of ``run_sample_multi_turn_rollout`` and of
``AsyncRolloutImpl._run_single_rollout`` one trajectory attempt.

Every test runs against the real local Dynamo (4 mocker workers, round-robin, session affinity on:
the session-scoped ``dynamo_stack``), through ``tests.support.DynamoProxy``, which forwards each
request unchanged, records its headers and the worker that served it, and can answer 503 itself, once,
to one chosen request (to drive ``DynamoGeneration._post_completion_request``'s retry); ``Request``
below reads the run, prompt and turn of each recorded request from its prompt text. The environment's
tool server is a recording loopback server (``tests.recorder.Recorder``) on another port, called from
the environment step (``asyncio.to_thread(calculate_rewards, ...)``) with aiohttp.
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_session.dynamo import LocalDynamo
from tests.recorder import Recorder
from tests.support import DynamoProxy, Forwarded, run_zero_code

STANDIN = Path(__file__).resolve().parent / "standin"
DRIVER = STANDIN / "rollout_driver.py"
LATE_DRIVER = Path(__file__).resolve().parent / "late_path_driver.py"
INSTRUMENT = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
NOTICE = "was sent outside any trajectory"
OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent", "tracestate"}
TURNS = {0: 3, 1: 4}  # turns per prompt, as the driver runs them
_PROMPT = re.compile(r"^run (\d+) prompt (\d+):")


@dataclass(frozen=True)
class Request:
    """One Dynamo request as the proxy recorded it, placed by its prompt text: the driver starts each
    prompt with ``run R prompt P:`` and the environment adds one ``<tool turn=`` observation per step,
    so the prompt alone says which run, prompt and turn a request belongs to."""

    seen: Forwarded
    run: int
    prompt: int
    turn: int  # the environment observations in the prompt so far
    text: str

    @classmethod
    def of(cls, seen: Forwarded) -> Request:
        text = str(seen.json().get("prompt", ""))
        matched = _PROMPT.match(text)
        assert matched, text
        return cls(seen, int(matched[1]), int(matched[2]), text.count("<tool turn="), text)

    @property
    def headers(self) -> list[tuple[str, str]]:
        return self.seen.headers

    @property
    def status(self) -> int:
        return self.seen.status

    @property
    def worker(self) -> int | None:
        return self.seen.worker

    @property
    def session(self) -> str | None:
        return self.seen.header("x-dynamo-session-id")

    @property
    def parent(self) -> str | None:
        return self.seen.header("x-dynamo-parent-session-id")


@dataclass
class Run:
    report: dict[str, Any]
    stderr: str
    requests: list[Request]
    tools: list[Any]
    dynamo: str  # the host:port the driver sent its Dynamo requests to


def run_driver(
    mode: str,
    stack: LocalDynamo,
    *,
    fail_once: Callable[[Request], bool] | None = None,
    tool_failures: int = 0,
    late: bool = False,
    **env: str,
) -> Run:
    """``opentelemetry-instrument python rollout_driver.py MODE ...``, environment variables only.
    ``fail_once``: the proxy answers the first request it picks 503 itself. ``tool_failures``: the tool
    server answers that many first requests 500. ``late``: NeMo-RL is not on ``PYTHONPATH``; the
    script puts it on ``sys.path`` itself after start (tests/late_path_driver.py)."""
    chosen = None if fail_once is None else (lambda seen: fail_once(Request.of(seen)))
    with DynamoProxy(f"http://{stack.host}", chosen) as proxy, Recorder() as tools:
        tools.fail_next.extend([500] * tool_failures)
        report, stderr = run_zero_code(
            [INSTRUMENT, sys.executable, str(LATE_DRIVER if late else DRIVER), mode,
             f"http://{proxy.authority}/v1", stack.model_name, f"{tools.url}/tool/step"],
            dynamo=proxy.authority,
            env=({} if late else {"PYTHONPATH": str(STANDIN)}) | env,
            timeout=120,
        )  # fmt: skip
    requests = [Request.of(seen) for seen in proxy.requests]  # each prompt names its run and prompt
    assert all(r.worker is not None for r in requests if r.status == 200), requests  # Dynamo says which
    return Run(report, stderr, requests, tools.requests, proxy.authority)


def attempts(requests: list[Request]) -> dict[str | None, list[Request]]:
    by_session: dict[str | None, list[Request]] = defaultdict(list)
    for request in requests:
        by_session[request.session].append(request)
    return by_session


def assert_one_attempt(session: str | None, requests: list[Request], *, retried: bool = False) -> None:
    """One sample's whole conversation in ``session``: one prompt, each turn once (the retried one
    twice: the 503 and the retry), every answered request from one worker."""
    assert session is not None
    (prompt,) = {r.prompt for r in requests}
    turns = sorted(r.turn for r in requests)
    failed = [r for r in requests if r.status == 503]
    assert len(failed) == retried, requests
    if retried:
        (retry,) = [r for r in requests if r.status == 200 and r.text == failed[0].text]
        turns.remove(retry.turn)
    assert turns == list(range(TURNS[prompt])), (session, turns)
    workers = {r.worker for r in requests if r.status != 503}
    assert len(workers) == 1 and None not in workers, (session, workers)


def assert_siblings_grouped(requests: list[Request]) -> None:
    """The default (``auto``) with 2 siblings a prompt, read by the preset from their identical
    initial message logs: K is sized to the fleet from the first run on (its attempts gather at their
    first request: ``_gathering``), ceil(2 / (4 workers // 2 prompts)) = 1: each sibling goes alone,
    under no parent, each with a session of its own."""
    parents: dict[tuple[int, int], set[str | None]] = defaultdict(set)
    sessions: dict[tuple[int, int], set[str | None]] = defaultdict(set)
    for request in requests:
        parents[(request.run, request.prompt)].add(request.parent)
        sessions[(request.run, request.prompt)].add(request.session)
    for key, found in parents.items():
        assert found == {None}, (key, found)
        assert len(sessions[key]) == 2, (key, sessions[key])


def assert_nothing_reached_the_tools(tools: list[Any], expected: int) -> None:
    assert len(tools) == expected
    for seen in tools:
        assert not seen.names() & OURS, seen.headers


def test_floor_native_rollout_twice_one_session_per_sample_attempt(dynamo_stack: LocalDynamo) -> None:
    """The issue's Floor: ``run_async_multi_turn_rollout`` twice, 2 prompts x 2 siblings, 3-4 turns,
    one retried 503 (run 0, prompt 1, turn 2)."""
    run = run_driver("native", dynamo_stack, fail_once=lambda r: (r.run, r.prompt, r.turn) == (0, 1, 2))
    per_run = [sample["turn_count"] for samples in run.report["runs"] for sample in samples]
    assert per_run == [3, 3, 4, 4] * 2, run.report
    assert len(run.requests) == 2 * (2 * 3 + 2 * 4) + 1  # 29, as in the issue
    assert all(r.session is not None for r in run.requests)
    sessions_of_run = []
    for number in range(2):
        by_session = attempts([r for r in run.requests if r.run == number])
        assert len(by_session) == 4, by_session.keys()  # one per sample attempt
        assert sorted(next(iter({r.prompt for r in rs})) for rs in by_session.values()) == [0, 0, 1, 1]
        for session, requests in by_session.items():
            assert_one_attempt(session, requests, retried=any(r.status == 503 for r in requests))
        sessions_of_run.append(set(by_session))
    assert not sessions_of_run[0] & sessions_of_run[1]  # none shared between runs
    assert sum(r.status == 503 for r in run.requests) == 1
    for request in run.requests:  # the session (each sibling alone: no parent) and nothing else
        assert {k.lower() for k, _ in request.headers} & OURS == {"x-dynamo-session-id"}, request.headers
    assert_siblings_grouped(run.requests)
    assert_nothing_reached_the_tools(run.tools, 2 * (2 * 3 + 2 * 4))
    assert NOTICE not in run.stderr  # every request was inside a boundary


def test_single_controller_group_retry_is_a_new_attempt_per_sample(dynamo_stack: LocalDynamo) -> None:
    """``RolloutManager.generate_and_push`` for one prompt group (2 siblings, 3 turns): the first group
    attempt fails in an environment step (the tool server answers 500 once) and is retried whole; each
    sibling of the retry runs in a new session, none the failed attempt's."""
    run = run_driver("manager", dynamo_stack, tool_failures=1)
    assert run.report["status"] == "pushed" and run.report["attempts"] == 2, run.report
    assert [t["turn_count"] for t in run.report["record"]["trajectories"]] == [3, 3]
    by_session = attempts(run.requests)
    assert None not in by_session
    layout = {s: sorted(r.turn for r in rs) for s, rs in by_session.items()}
    retry = {s for s, turns in layout.items() if turns == [0, 1, 2]}
    failed = set(by_session) - retry
    assert len(retry) == 2, layout
    for session in retry:  # each sibling of the retry: its whole conversation, one worker
        assert_one_attempt(session, by_session[session])
    # The failed attempt: one sibling failed in its first environment step, the other was cancelled
    # (after its first turn, or rarely its second); both in sessions of their own, not the retry's.
    assert 1 <= len(failed) <= 2, layout
    assert all(layout[s] in ([0], [0, 1]) for s in failed) and [0] in [layout[s] for s in failed], layout
    assert NOTICE not in run.stderr


def test_async_grpo_groups_one_session_per_sample(dynamo_stack: LocalDynamo) -> None:
    """``run_async_multi_turn_rollout_groups`` (async GRPO's collector path), consumed in a new thread
    with its own event loop as the collector does: one session per sample, as the Floor."""
    run = run_driver("groups", dynamo_stack)
    assert [g["group_index"] for g in run.report["groups"]] == [0, 1], run.report
    by_session = attempts(run.requests)
    assert len(by_session) == 4 and None not in by_session, by_session.keys()
    for session, requests in by_session.items():
        assert_one_attempt(session, requests)
    assert_nothing_reached_the_tools(run.tools, 2 * 3 + 2 * 4)
    assert NOTICE not in run.stderr


def test_disabled_nemo_rl_instrumentor_sends_no_session_and_says_so_once(dynamo_stack: LocalDynamo) -> None:
    """``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=otel_session_nemo_rl``: no boundary, so no Dynamo request
    carries a session, and the one-line notice is printed once for the whole process."""
    run = run_driver("native", dynamo_stack, OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="otel_session_nemo_rl")
    assert len(run.requests) == 2 * (2 * 3 + 2 * 4)
    for request in run.requests:
        assert not {k.lower() for k, _ in request.headers} & OURS, request.headers
    assert run.stderr.count(NOTICE) == 1, run.stderr[-3000:]
    (line,) = [line for line in run.stderr.splitlines() if NOTICE in line]
    assert run.dynamo in line and "OTEL_SESSION_TRAJECTORY_FUNCTIONS" in line, line


def test_nemo_rl_put_on_the_path_by_the_driver_after_start_is_instrumented(dynamo_stack: LocalDynamo) -> None:
    """Issue 28 item 2: NeMo-RL cannot be found when the distro configures otel-session; the driver
    adds it to ``sys.path`` itself. Its preset applies when its rollout module is imported: the Floor's
    run, one session per sample attempt, every request inside a boundary."""
    run = run_driver("native", dynamo_stack, late=True)
    assert len(run.requests) == 2 * (2 * 3 + 2 * 4)
    for number in range(2):
        by_session = attempts([r for r in run.requests if r.run == number])
        assert len(by_session) == 4 and None not in by_session, by_session.keys()
        for session, requests in by_session.items():
            assert_one_attempt(session, requests)
    assert NOTICE not in run.stderr
