"""An attempt's session follows its work into thread pools and threads (upstream's threading
instrumentation, turned on by ``configure()``), and a pool thread reused by another attempt, or by
work outside any attempt, never keeps the old one. Real requests over loopback to a recording server."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from opentelemetry.instrumentation.threading import ThreadingInstrumentor

import otel_session
from otel_session import SESSION_HEADER
from tests.recorder import Recorder


def _get(url: str) -> int:
    return requests.get(url, timeout=10).status_code


def _sessions(dynamo: Recorder) -> dict[str, str | None]:
    return {seen.path: seen.get(SESSION_HEADER) for seen in dynamo.requests}


def test_a_request_submitted_to_a_pool_carries_the_attempts_session(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with ThreadPoolExecutor(max_workers=2) as pool, otel_session.trajectory() as traj:
        assert pool.submit(_get, f"{dynamo.url}/submit").result() == 200
        assert list(pool.map(_get, [f"{dynamo.url}/map"])) == [200]
    assert _sessions(dynamo) == {"/submit": traj.session_id, "/map": traj.session_id}


def test_attempts_sharing_one_pool_thread_each_see_their_own(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    workers: set[int] = set()

    def task(url: str) -> int:
        workers.add(threading.get_ident())
        return _get(url)

    with ThreadPoolExecutor(max_workers=1) as pool:
        with otel_session.trajectory() as first:
            pool.submit(task, f"{dynamo.url}/first").result()
        with otel_session.trajectory() as second:
            pool.submit(task, f"{dynamo.url}/second").result()
        pool.submit(task, f"{dynamo.url}/outside").result()  # no attempt: nothing, not the last one's
    assert len(workers) == 1  # one thread ran all three
    assert _sessions(dynamo) == {"/first": first.session_id, "/second": second.session_id, "/outside": None}


def test_a_thread_outside_any_attempt_gets_none_and_one_started_inside_gets_its(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    outside = threading.Thread(target=_get, args=(f"{dynamo.url}/outside",))
    outside.start()
    outside.join(10)
    with otel_session.trajectory() as traj:
        inside = threading.Thread(target=_get, args=(f"{dynamo.url}/inside",))
        inside.start()
        inside.join(10)
    assert _sessions(dynamo) == {"/outside": None, "/inside": traj.session_id}


async def test_run_in_executor_and_to_thread_carry_the_attempts_session(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=1) as pool:
        with otel_session.trajectory() as traj:
            await loop.run_in_executor(None, _get, f"{dynamo.url}/default")
            await loop.run_in_executor(pool, _get, f"{dynamo.url}/pool")
            await asyncio.to_thread(_get, f"{dynamo.url}/to_thread")
        await loop.run_in_executor(pool, _get, f"{dynamo.url}/after")
    assert _sessions(dynamo) == {
        "/default": traj.session_id,
        "/pool": traj.session_id,
        "/to_thread": traj.session_id,
        "/after": None,
    }


async def test_to_thread_copies_the_context_without_the_instrumentation(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``asyncio.to_thread`` copies the context itself (``contextvars.copy_context``); the pool
    paths are the ones that need the instrumentation (they go without it when it is disabled)."""
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "threading")
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    assert not ThreadingInstrumentor().is_instrumented_by_opentelemetry
    loop = asyncio.get_running_loop()
    with otel_session.trajectory() as traj:
        await asyncio.to_thread(_get, f"{dynamo.url}/to_thread")
        await loop.run_in_executor(None, _get, f"{dynamo.url}/default")
    assert _sessions(dynamo) == {"/to_thread": traj.session_id, "/default": None}


def test_unconfigure_takes_off_only_what_configure_turned_on() -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"])
    assert ThreadingInstrumentor().is_instrumented_by_opentelemetry
    otel_session.unconfigure()
    assert not ThreadingInstrumentor().is_instrumented_by_opentelemetry
    ThreadingInstrumentor().instrument()  # the application's own
    try:
        otel_session.configure(dynamo_hosts=["127.0.0.1:9"])
        otel_session.unconfigure()
        assert ThreadingInstrumentor().is_instrumented_by_opentelemetry
    finally:
        ThreadingInstrumentor().uninstrument()
