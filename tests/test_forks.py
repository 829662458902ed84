"""Processes as users expect them: a raw ``os.fork()`` child is a copy of its parent, trajectory
included; a multiprocessing worker (``Process``, ``Pool``, ``ProcessPoolExecutor``, every start
method) starts outside any trajectory unless it is handed one (``bind``, ``session_carrier`` and
``resume``). Each child sends a real request over loopback to a recording Dynamo host, and the
recorder says what it carried.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import otel_session
from otel_session import SESSION_HEADER
from tests.recorder import Recorder

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
METHODS = [m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()]


def _configured_in_child(url: str) -> None:
    """A spawned or forkserver child is a new interpreter: it configures itself, as a Ray worker or a
    process under OTEL_SESSION_AUTO would (a forked one inherits the configuration: the same again)."""
    otel_session.configure(dynamo_hosts=[url])


def _send(url: str, path: str) -> str | None:
    """In a child: configure if needed, send one request to the Dynamo host, report the session."""
    _configured_in_child(url)
    httpx.get(f"{url}{path}", timeout=10)
    return otel_session.current_session_id()


def _send_resumed(url: str, path: str, carrier: dict[str, str]) -> str | None:
    _configured_in_child(url)
    with otel_session.resume(carrier):
        return _send(url, path)


def _sessions(dynamo: Recorder, path: str) -> list[str | None]:
    return [seen.get(SESSION_HEADER) for seen in dynamo.requests if seen.path == path]


def _run_forked(work: Callable[[], Any]) -> int:
    """``work()`` in a raw ``os.fork()`` child; its exit status (0: it ran and returned)."""
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            work()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_raw_fork_child_keeps_the_trajectory_it_was_forked_in(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with otel_session.trajectory() as attempt:
        status = _run_forked(lambda: _send(dynamo.url, "/in-child"))
        httpx.get(f"{dynamo.url}/in-parent", timeout=10)
    assert status == 0
    assert _sessions(dynamo, "/in-child") == [attempt.session_id]
    assert _sessions(dynamo, "/in-parent") == [attempt.session_id]


def test_a_raw_fork_child_forked_outside_any_trajectory_sends_none(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with otel_session.trajectory():
        pass
    assert _run_forked(lambda: _send(dynamo.url, "/outside")) == 0
    assert _sessions(dynamo, "/outside") == [None]


def test_a_raw_fork_childs_own_trajectories_are_new_sessions(dynamo: Recorder) -> None:
    """Inside the copied trajectory the child's own attempt nests under it, with an ID of its own."""
    otel_session.configure(dynamo_hosts=[dynamo.url])

    def nested() -> None:
        with otel_session.trajectory():
            httpx.get(f"{dynamo.url}/nested", timeout=10)

    with otel_session.trajectory() as outer:
        assert _run_forked(nested) == 0
    (seen,) = [s for s in dynamo.requests if s.path == "/nested"]
    assert seen.get(SESSION_HEADER) not in (None, outer.session_id)
    assert seen.get("X-Dynamo-Parent-Session-ID") == outer.session_id


@pytest.mark.parametrize("method", METHODS)
def test_a_multiprocessing_process_starts_outside_the_trajectory(dynamo: Recorder, method: str) -> None:
    context = multiprocessing.get_context(method)
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with otel_session.trajectory():
        child = context.Process(target=_send, args=(dynamo.url, f"/process-{method}"))
        child.start()
        child.join(60)
    assert child.exitcode == 0
    assert _sessions(dynamo, f"/process-{method}") == [None]


@pytest.mark.parametrize("method", METHODS)
def test_a_process_handed_the_trajectory_continues_it(dynamo: Recorder, method: str) -> None:
    context = multiprocessing.get_context(method)
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with otel_session.trajectory() as attempt:
        carrier = otel_session.session_carrier()
        child = context.Process(target=_send_resumed, args=(dynamo.url, f"/handed-{method}", carrier))
        child.start()
        child.join(60)
    assert child.exitcode == 0
    assert _sessions(dynamo, f"/handed-{method}") == [attempt.session_id]


def test_a_forked_process_given_a_bound_target_continues_the_trajectory(dynamo: Recorder) -> None:
    """``bind`` carries the context itself; a forked child runs the target without pickling it."""
    context = multiprocessing.get_context("fork")
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with otel_session.trajectory() as attempt:
        child = context.Process(target=otel_session.bind(_send), args=(dynamo.url, "/bound"))
        child.start()
        child.join(60)
    assert child.exitcode == 0
    assert _sessions(dynamo, "/bound") == [attempt.session_id]


@pytest.mark.parametrize("method", METHODS)
def test_pool_workers_start_outside_any_trajectory_and_continue_only_what_they_are_handed(
    dynamo: Recorder, method: str
) -> None:
    context = multiprocessing.get_context(method)
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with otel_session.trajectory():
        pool = context.Pool(2)  # its workers start here, inside a trajectory
    try:
        with otel_session.trajectory():
            first = pool.apply(_send, (dynamo.url, f"/pool-{method}"))
        with otel_session.trajectory() as handed:
            carrier = otel_session.session_carrier()
            resumed = pool.apply(_send_resumed, (dynamo.url, f"/pool-handed-{method}", carrier))
    finally:
        pool.terminate()
        pool.join()
    assert first is None and _sessions(dynamo, f"/pool-{method}") == [None]
    assert resumed == handed.session_id
    assert _sessions(dynamo, f"/pool-handed-{method}") == [handed.session_id]


@pytest.mark.parametrize("method", METHODS)
def test_process_pool_executor_workers_start_outside_any_trajectory(dynamo: Recorder, method: str) -> None:
    context = multiprocessing.get_context(method)
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as pool:
        with otel_session.trajectory():  # the workers start here, inside a trajectory
            first = pool.submit(_send, dynamo.url, f"/executor-{method}").result(timeout=60)
        with otel_session.trajectory() as handed:
            carrier = otel_session.session_carrier()
            resumed = pool.submit(_send_resumed, dynamo.url, f"/executor-handed-{method}", carrier)
            resumed_session = resumed.result(timeout=60)
    assert first is None and _sessions(dynamo, f"/executor-{method}") == [None]
    assert resumed_session == handed.session_id


def test_a_worker_forked_before_multiprocessing_was_imported_by_us_still_starts_outside(
    dynamo: Recorder,
) -> None:
    """otel-session hooks multiprocessing when it is imported, whenever that is: in a process that
    imported otel-session first and multiprocessing only later, a fork worker starts outside too."""
    code = f"""
import otel_session, sys
assert "multiprocessing.util" not in sys.modules, "imported too early for this test"
otel_session.configure(dynamo_hosts=[{dynamo.url!r}])
import multiprocessing
def work(_):
    return otel_session.current_session_id()
if __name__ == "__main__":
    with otel_session.trajectory():
        with multiprocessing.get_context("fork").Pool(1) as pool:
            print(pool.map(work, [0])[0])
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


def test_the_outside_line_is_said_once_per_worker(dynamo: Recorder, tmp_path: Path) -> None:
    """docs/api.md, "Threads, pools and processes": each worker that sends to a router outside any
    trajectory says so once (it is its own process); a worker forked after its parent said it is a
    copy that has said it too."""
    code = f"""
        import multiprocessing, httpx, otel_session
        def send(path):
            httpx.get({dynamo.url!r} + path, timeout=10)
        def run(path):
            child = multiprocessing.get_context("fork").Process(target=send, args=(path,))
            child.start(); child.join(60)
            assert child.exitcode == 0
        if __name__ == "__main__":
            otel_session.configure(dynamo_hosts=[{dynamo.url!r}])
            run("/worker-1"); run("/worker-2")
            print("parent", flush=True)
            send("/parent")
            run("/worker-3")
    """
    script = tmp_path / "workers.py"
    script.write_text(textwrap.dedent(code))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "was sent outside any trajectory" in line]
    assert len(said) == 3, out.stderr  # worker 1, worker 2, the parent; worker 3 inherited the parent's
    assert {seen.path for seen in dynamo.requests} >= {"/worker-1", "/worker-2", "/parent", "/worker-3"}
