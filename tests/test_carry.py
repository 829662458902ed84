"""Where contextvars do not follow: thread pools, threads, executors, and Ray worker processes.

Each test makes real httpx calls to a recording Dynamo from the other thread or process, and checks
that they carry the trajectory's session. Thread pools and threads carry it without the helper too,
since ``configure()`` turns on upstream's threading instrumentation (tests/test_threads.py).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

import otel_session
from tests.recorder import Recorder

SESSION = "X-Dynamo-Session-ID"
PARENT = "X-Dynamo-Parent-Session-ID"


def _call(url: str) -> str | None:
    """A model call as rollout code makes it, returning the session current where it ran."""
    httpx.post(url, timeout=10).raise_for_status()
    return otel_session.current_session_id()


def _sessions(dynamo: Recorder, prefix: str) -> list[str | None]:
    return [seen.get(SESSION) for seen in dynamo.requests if seen.path.startswith(prefix)]


@pytest.fixture
def configured(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])


@pytest.mark.usefixtures("configured")
def test_thread_pool_calls_carry_the_trajectory_with_bind(dynamo: Recorder) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool, otel_session.trajectory() as traj:
        bound = otel_session.bind(_call)  # one bound function, many concurrent jobs
        in_pool = list(pool.map(bound, [f"{dynamo.url}/bound/{i}" for i in range(16)]))
        unbound = pool.submit(_call, f"{dynamo.url}/unbound").result()
    assert in_pool == [traj.session_id] * 16
    assert _sessions(dynamo, "/bound/") == [traj.session_id] * 16
    # configure() turned on upstream's threading instrumentation: submit carries the context too
    assert unbound == traj.session_id
    assert _sessions(dynamo, "/unbound") == [traj.session_id]


@pytest.mark.usefixtures("configured")
def test_sibling_trajectories_in_one_pool_stay_apart(dynamo: Recorder) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = {}
        for index in range(8):
            with otel_session.trajectory() as traj:
                futures[index] = (
                    traj.session_id,
                    pool.submit(otel_session.bind(_call), f"{dynamo.url}/s{index}"),
                )
        for index, (session, future) in futures.items():
            assert future.result() == session
            assert _sessions(dynamo, f"/s{index}") == [session]
    assert len({session for session, _ in futures.values()}) == 8


@pytest.mark.usefixtures("configured")
def test_thread_and_run_in_executor_with_bind(dynamo: Recorder) -> None:
    with otel_session.trajectory() as outer, otel_session.trajectory() as traj:
        thread = threading.Thread(target=otel_session.bind(_call), args=(f"{dynamo.url}/thread",))
        thread.start()
        thread.join()

        async def in_executor() -> str | None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, otel_session.bind(_call), f"{dynamo.url}/executor")

        assert asyncio.run(in_executor()) == traj.session_id
    for path in ("/thread", "/executor"):
        [seen] = [seen for seen in dynamo.requests if seen.path == path]
        assert (seen.get(SESSION), seen.get(PARENT)) == (traj.session_id, outer.session_id)


@pytest.mark.usefixtures("configured")
def test_carrier_resumes_the_trajectory_in_a_plain_thread(dynamo: Recorder) -> None:
    with otel_session.trajectory() as traj:
        carrier = pickle.loads(pickle.dumps(otel_session.session_carrier()))
    assert carrier == {"session.id": traj.session_id}

    def worker() -> None:
        with otel_session.resume(carrier) as session:
            assert session == traj.session_id
            _call(f"{dynamo.url}/resumed")
        _call(f"{dynamo.url}/after")

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert _sessions(dynamo, "/resumed") == [traj.session_id]
    assert _sessions(dynamo, "/after") == [None]


@pytest.mark.usefixtures("configured")
@pytest.mark.parametrize("carrier", [None, {}, {"session.id": "bad id"}, {"session.id": "x" * 257}, "nope"])
def test_unusable_carrier_changes_nothing(dynamo: Recorder, carrier: Any) -> None:
    with otel_session.resume(carrier) as session:
        assert session is None
        _call(f"{dynamo.url}/none")
    assert _sessions(dynamo, "/none") == [None]


# --- Ray -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local() -> Iterator[Any]:
    """A local Ray (2 CPUs) bound to loopback only, no dashboard, no usage reporting."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'otel-session[ray]')")
    # Read by Ray's Python side and inherited by the processes it starts: without it Ray listens on
    # every interface of the machine.
    saved = {
        key: os.environ.get(key) for key in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED")
    }
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray._private.ray_constants as ray_constants

    previous_cluster_flag = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            _node_ip_address="127.0.0.1",
        )
        yield ray
    finally:
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = previous_cluster_flag
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class RolloutWorker:
    """A rollout actor as NeMo-RL runs them: it configures otel-session itself, from its environment."""

    def __init__(self) -> None:
        otel_session.configure()  # OTEL_SESSION_DYNAMO_HOSTS from the actor's runtime_env

    def generate(self, carrier: dict[str, str], url: str, turns: int) -> list[str | None]:
        with otel_session.resume(carrier):
            return [_call(f"{url}/t{turn}") for turn in range(turns)]

    async def agenerate(self, carrier: dict[str, str], url: str) -> str | None:
        with otel_session.resume(carrier):
            async with httpx.AsyncClient() as http:
                (await http.post(url)).raise_for_status()
            return otel_session.current_session_id()

    def pid(self) -> int:
        return os.getpid()


def test_ray_actor_calls_carry_the_trajectory(ray_local: Any, dynamo: Recorder) -> None:
    env = {"env_vars": {"OTEL_SESSION_DYNAMO_HOSTS": dynamo.authority}}
    worker = ray_local.remote(RolloutWorker).options(runtime_env=env).remote()
    assert ray_local.get(worker.pid.remote()) != os.getpid()
    sessions = []
    for index in range(2):  # two sibling trajectories through the same actor
        with otel_session.trajectory() as outer, otel_session.trajectory() as traj:
            carrier = otel_session.session_carrier()
            seen = ray_local.get(worker.generate.remote(carrier, f"{dynamo.url}/a{index}", 3))
        assert seen == [traj.session_id] * 3
        at_dynamo = [s for s in dynamo.requests if s.path.startswith(f"/a{index}/")]
        assert [(s.get(SESSION), s.get(PARENT)) for s in at_dynamo] == [
            (traj.session_id, outer.session_id)
        ] * 3
        sessions.append(traj.session_id)
    assert sessions[0] != sessions[1]
    ray_local.kill(worker)


def test_ray_async_actor_and_task_carry_the_trajectory(ray_local: Any, dynamo: Recorder) -> None:
    env = {"env_vars": {"OTEL_SESSION_DYNAMO_HOSTS": dynamo.authority}}
    worker = ray_local.remote(RolloutWorker).options(runtime_env=env).remote()

    def task(carrier: dict[str, str], url: str) -> str | None:
        otel_session.configure()
        with otel_session.resume(carrier):
            return _call(url)

    remote_task = ray_local.remote(task).options(runtime_env=env)
    with otel_session.trajectory() as traj:
        carrier = otel_session.session_carrier()
        results = ray_local.get(
            [
                worker.agenerate.remote(carrier, f"{dynamo.url}/async"),
                remote_task.remote(carrier, f"{dynamo.url}/task"),
            ]
        )
        without = ray_local.get(remote_task.remote({}, f"{dynamo.url}/no-carrier"))
    assert results == [traj.session_id] * 2
    assert _sessions(dynamo, "/async") == [traj.session_id]
    assert _sessions(dynamo, "/task") == [traj.session_id]
    assert without is None
    assert _sessions(dynamo, "/no-carrier") == [None]
    ray_local.kill(worker)


@pytest.mark.usefixtures("configured")
def test_bind_keeps_the_session_for_coroutines_and_generators_run_elsewhere(dynamo: Recorder) -> None:
    """A bound coroutine function awaited on another thread's own loop, and bound generators iterated
    there, run with the trajectory's session; the thread's own code between items does not."""

    async def turn(path: str) -> str | None:
        async with httpx.AsyncClient(timeout=10) as client:
            await client.post(f"{dynamo.url}{path}")
        return otel_session.current_session_id()

    def turns() -> Iterator[str | None]:
        for index in range(2):
            yield _call(f"{dynamo.url}/gen/{index}")

    async def aturns() -> Any:
        for index in range(2):
            yield await turn(f"/agen/{index}")

    with otel_session.trajectory() as traj:
        bound_turn, bound_turns, bound_aturns = (otel_session.bind(f) for f in (turn, turns, aturns))
    seen: dict[str, Any] = {}

    def elsewhere() -> None:
        seen["coroutine"] = asyncio.run(bound_turn("/coroutine"))
        seen["generator"] = []
        for item in bound_turns():
            seen["generator"].append(item)
            seen["between"] = otel_session.current_session_id()

        async def drain() -> list[Any]:
            return [item async for item in bound_aturns()]

        seen["async generator"] = asyncio.run(drain())
        seen["after"] = _call(f"{dynamo.url}/after")

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen["coroutine"] == traj.session_id
    assert seen["generator"] == seen["async generator"] == [traj.session_id] * 2
    assert seen["between"] is None and seen["after"] is None
    assert _sessions(dynamo, "/coroutine") == [traj.session_id]
    assert _sessions(dynamo, "/gen/") == _sessions(dynamo, "/agen/") == [traj.session_id] * 2
    assert _sessions(dynamo, "/after") == [None]
    assert asyncio.iscoroutinefunction(bound_turn)


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.usefixtures("configured")
@pytest.mark.parametrize(
    "extra",
    [
        {"traceparent": TRACEPARENT.encode()},
        {"traceparent": 7},
        {"traceparent": [TRACEPARENT]},
        {"traceparent": TRACEPARENT, "tracestate": 5},
        {"traceparent": TRACEPARENT, 3: "x"},
    ],
    ids=["bytes", "int", "list", "bad-tracestate", "non-str-key"],
)
def test_a_carrier_with_an_unreadable_trace_parent_still_continues_the_session(
    dynamo: Recorder, extra: dict[Any, Any]
) -> None:
    carrier = {"session.id": "sess-carried", **extra}
    with otel_session.resume(carrier) as session:
        assert session == "sess-carried"
        _call(f"{dynamo.url}/carried")
    assert _sessions(dynamo, "/carried") == ["sess-carried"]


def test_a_trajectory_or_resume_where_nothing_is_configured_says_so_once(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from otel_session import _hop

    monkeypatch.setattr(_hop, "unconfigured_untold", True)
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", dynamo.authority)  # set, but nothing read it
    with caplog.at_level("WARNING", logger="otel_session"):
        with otel_session.trajectory():
            _call(f"{dynamo.url}/unconfigured")
        with otel_session.trajectory(), otel_session.resume({"session.id": "s-1"}):
            pass
    told = [r.getMessage() for r in caplog.records if "not configured in this process" in r.getMessage()]
    assert len(told) == 1 and "OTEL_SESSION_AUTO=true" in told[0]
    assert _sessions(dynamo, "/unconfigured") == [None]
    caplog.clear()
    monkeypatch.setattr(_hop, "unconfigured_untold", True)
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with caplog.at_level("WARNING", logger="otel_session"), otel_session.trajectory():
        pass
    assert not [r for r in caplog.records if "not configured" in r.getMessage()]


@pytest.mark.usefixtures("configured")
def test_bind_of_a_plain_callable_returning_a_coroutine_keeps_the_session(dynamo: Recorder) -> None:
    async def turn() -> str | None:
        async with httpx.AsyncClient(timeout=10) as client:
            await client.post(f"{dynamo.url}/lambda")
        return otel_session.current_session_id()

    with otel_session.trajectory() as traj:
        bound = otel_session.bind(lambda: turn())
    seen: list[str | None] = []
    thread = threading.Thread(target=lambda: seen.append(asyncio.run(bound())))
    thread.start()
    thread.join()
    assert seen == [traj.session_id] and _sessions(dynamo, "/lambda") == [traj.session_id]


@pytest.mark.usefixtures("configured")
def test_a_carrier_naming_its_session_as_its_own_parent_has_no_parent(dynamo: Recorder) -> None:
    with otel_session.resume({"session.id": "s-self", "session.parent_id": "s-self"}):
        _call(f"{dynamo.url}/self")
        with otel_session.trajectory(session_id="s-self") as again:
            assert again.parent_session_id is None
    [seen] = [seen for seen in dynamo.requests if seen.path == "/self"]
    assert seen.get(SESSION) == "s-self" and seen.get(PARENT) is None
