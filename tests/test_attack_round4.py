"""An outside attack on the fourth round's changes (issue 28, item 5), each case one way a user's own
code meets the patched methods, the fork rules or the import hooks, over loopback with real parts.

What held is summarised in the commit messages; every test here failed on main 22dbd7a.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import httpx
import pytest

import otel_session
from otel_session import _registry
from tests.recorder import Recorder

AGENT = """
import threading
LOCK = threading.Lock()  # a module global a method uses: by value, it cannot be pickled

class Agent:
    def run(self, x):
        with LOCK:
            return x
    @staticmethod
    def plain(x):
        with LOCK:
            return x
    @classmethod
    def build(cls, x):
        with LOCK:
            return x

def rollout(sample_idx, prompt):
    with LOCK:
        return prompt
"""


@pytest.fixture
def agent_module(new_module: Callable[[str, str], str]) -> Iterator[tuple[ModuleType, str]]:
    name = new_module("attack_agent", AGENT)
    yield importlib.import_module(name), name


def _by_reference(cloudpickle: Any, value: Any) -> bool:
    """Whether cloudpickle (what Ray ships functions with) saves ``value`` by name, as pickle does,
    rather than by value (a copy of its code and globals, which bypasses any patch and fails on an
    unpicklable global)."""
    try:
        data = cloudpickle.dumps(value)
    except Exception:
        return False
    return b"co_" not in data and b"_make_function" not in data and b"_builtin_type" not in data


def test_cloudpickle_ships_every_patched_target_by_name_as_it_does_the_original(
    agent_module: tuple[ModuleType, str],
) -> None:
    """Ray pickles with cloudpickle, which saves a function by name only when looking the name up
    gives the very same object; a method reached through its class (``Agent.run``, a staticmethod)
    must stay that object once patched, or Ray copies its code: the copy runs outside the boundary,
    and a method using an unpicklable global (a lock, a client) cannot be sent at all. Every target
    the instrumentors patched is walked, before (unconfigured) and after."""
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    import aiohttp
    import aiohttp.web
    import fastapi  # noqa: F401
    import starlette.applications  # noqa: F401

    module, name = agent_module
    otel_session.configure(
        dynamo_hosts=["127.0.0.1:9"],
        servers=True,
        trajectory_functions=[f"{name}:Agent.run", f"{name}:Agent.plain", f"{name}:rollout"],
    )
    targets = [(owner, attribute) for found in _targets() for owner, attribute in found]
    assert (module.Agent, "run") in targets and (httpx.HTTPTransport, "handle_request") in targets
    assert (aiohttp.ClientRequest, "send") in targets

    def seen() -> dict[tuple[Any, str], tuple[bool, bool]]:
        return {
            (owner, attribute): (
                getattr(owner, attribute) is getattr(owner, attribute),
                _by_reference(cloudpickle, getattr(owner, attribute)),
            )
            for owner, attribute in targets
        }

    after = seen()
    shipped = pickle.loads(cloudpickle.dumps(module.Agent.run))
    assert hasattr(shipped, "__wrapped__")  # the boundary itself, looked up again where it is loaded
    otel_session.unconfigure()
    before = seen()
    assert before[(module.Agent, "run")] == (True, True)  # what the walk compares can differ
    assert after == before


def _targets() -> list[list[tuple[Any, str]]]:
    return [_registry.instrumentor(name).patched() for name in _registry.instrumentors()]


class _ChildDone(Exception):
    """Raised in a fork child only, to unwind it through the ``with`` block as ``sys.exit`` would."""


def test_a_fork_child_leaving_the_trajectory_does_not_end_the_parents_session(dynamo: Recorder) -> None:
    """A raw fork child keeps the trajectory (a copy of its parent); when it leaves the ``with``
    block (``sys.exit`` in the child unwinds through it) the attempt is still the parent's: the
    child must not tell the router the session is over while the parent goes on using it."""
    otel_session.configure(routers={"vllm-router": [dynamo.authority]}, end_sessions=True)
    parent = os.getpid()
    try:
        with otel_session.trajectory() as attempt:
            httpx.get(f"{dynamo.url}/v1/before", timeout=10)
            pid = os.fork()
            if pid == 0:
                httpx.get(f"{dynamo.url}/v1/in-child", timeout=10)
                raise _ChildDone
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            finished_early = [s for s in dynamo.requests if s.path == "/finish_session"]
            httpx.get(f"{dynamo.url}/v1/after", timeout=10)
    except BaseException as exc:  # the child never goes back into pytest, whatever it raised
        if os.getpid() != parent:
            os._exit(0 if isinstance(exc, _ChildDone) else 1)
        raise
    assert status == 0
    assert finished_early == []
    in_child = [s.get("X-Session-ID") for s in dynamo.requests if s.path == "/v1/in-child"]
    assert in_child == [attempt.session_id]
    assert len([s for s in dynamo.requests if s.path == "/finish_session"]) == 1  # the parent's, at its end


def test_a_named_boundary_is_applied_again_when_its_module_is_reloaded(
    agent_module: tuple[ModuleType, str], dynamo: Recorder
) -> None:
    """``importlib.reload`` (IPython's autoreload, a notebook) runs the module anew: its functions and
    classes are new objects, which must be boundaries as the first ones were; the old ones are
    forgotten (unconfigure leaves the reloaded module's own functions in place)."""
    module, name = agent_module
    named = [f"{name}:rollout", f"{name}:Agent.run"]
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=named)
    assert hasattr(module.rollout, "__wrapped__")
    importlib.reload(module)
    assert hasattr(module.rollout, "__wrapped__") and hasattr(module.Agent.__dict__["run"], "__wrapped__")
    for call in (lambda: module.rollout(0, "p"), lambda: module.Agent().run(1)):
        with_session: list[str | None] = []
        module.LOCK = _Sending(dynamo.url, with_session)  # the functions send a request under it
        call()
        assert with_session and with_session[0] is not None
    reloaded = vars(module)["rollout"].__wrapped__
    otel_session.unconfigure()
    assert module.rollout is reloaded


class _Sending:
    """A stand-in for the module's lock: entering it sends one request and records its session."""

    def __init__(self, url: str, seen: list[str | None]) -> None:
        self.url, self.seen = url, seen

    def __enter__(self) -> None:
        httpx.get(f"{self.url}/v1/reloaded", timeout=10)
        self.seen.append(otel_session.current_session_id())

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture
def reloading(request: pytest.FixtureRequest) -> Iterator[Callable[[str], ModuleType]]:
    """``reload(name)``: importlib.reload of a library module, undone after the test (its namespace
    put back as it was, so the classes every other module holds are the module's again)."""
    saved: dict[str, dict[str, Any]] = {}

    def reload(name: str) -> ModuleType:
        module = importlib.import_module(name)
        saved.setdefault(name, dict(vars(module)))
        return importlib.reload(module)

    yield reload
    for name, namespace in saved.items():
        vars(sys.modules[name]).clear()
        vars(sys.modules[name]).update(namespace)


def test_apps_built_from_a_reloaded_starlette_get_the_middleware(
    dynamo: Recorder, reloading: Callable[[str], ModuleType]
) -> None:
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tests.loopback import AsgiServer

    otel_session.configure(dynamo_hosts=[dynamo.url], servers=True)
    applications = reloading("starlette.applications")

    async def who(request: Request) -> JSONResponse:
        return JSONResponse({"session": otel_session.current_session_id()})

    app = applications.Starlette(routes=[Route("/who", who)])
    with AsgiServer(app) as server:
        sent = "4a1c3f0e-8b2d-4c5e-9f6a-7b8c9d0e1f2a"
        seen = httpx.get(f"{server.url}/who", headers={"baggage": f"session.id={sent}"}, timeout=10).json()
    assert seen == {"session": sent}


ENVIRONMENTS = """
class Env:
    @classmethod
    def build(cls, x):
        return cls.__name__

class SubEnv(Env):
    pass
"""


def test_a_patched_classmethod_reached_through_a_subclass_pickles_bound_to_that_subclass(
    new_module: Callable[[str, str], str],
) -> None:
    """``pickle.dumps(SubEnv.build)`` saves the method bound to ``SubEnv``: once ``Env.build`` was a
    named boundary, the copy came back bound to ``Env`` (a factory building the base class)."""
    module = importlib.import_module(new_module("attack_envs", ENVIRONMENTS))
    named = [f"{module.__name__}:Env.build"]
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"], trajectory_functions=named)
    assert hasattr(module.Env.__dict__["build"], "__wrapped__")
    for reached in (module.SubEnv.build, module.SubEnv().build):
        assert pickle.loads(pickle.dumps(reached))(0) == "SubEnv"


RAY_ROLLOUTS = """
import threading
import httpx
import otel_session

LOCK = threading.Lock()  # a global cloudpickle cannot copy: the function must travel by name

class Agent:
    @staticmethod
    def episode(url):
        with LOCK:
            httpx.get(f"{url}/v1/shipped", timeout=10)
        return otel_session.current_session_id()

def run_episode(url):
    httpx.get(f"{url}/v1/working-dir", timeout=10)
    return otel_session.current_session_id()
"""


@pytest.mark.slow
def test_ray_workers_whose_code_arrives_by_working_dir(tmp_path: Any, dynamo: Recorder) -> None:
    """Ray workers configured from the environment (``OTEL_SESSION_AUTO``) whose rollout module only
    arrives by ``working_dir``, after they started: the named functions are boundaries there, called
    by name in a task and handed over by the driver as an argument (cloudpickle, by name)."""
    ray = pytest.importorskip("ray")
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "attack_ray_rollouts.py").write_text(RAY_ROLLOUTS)
    names = "attack_ray_rollouts:run_episode,attack_ray_rollouts:Agent.episode"
    env = {
        "OTEL_SESSION_AUTO": "true",
        "OTEL_SESSION_DYNAMO_HOSTS": dynamo.authority,
        "OTEL_SESSION_TRAJECTORY_FUNCTIONS": names,
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    sys.path.insert(0, str(tmp_path / "wd"))
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    try:
        otel_session.configure(dynamo_hosts=[dynamo.authority], trajectory_functions=names.split(","))
        rollouts = importlib.import_module("attack_ray_rollouts")
        ray.init(
            num_cpus=1,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"working_dir": str(tmp_path / "wd"), "env_vars": env},
        )

        @ray.remote
        def by_name(url: str) -> str | None:
            return importlib.import_module("attack_ray_rollouts").run_episode(url)  # type: ignore[no-any-return]

        @ray.remote
        def handed(episode: Callable[[str], str | None], url: str) -> str | None:
            return episode(url)

        sessions = ray.get([by_name.remote(dynamo.url), handed.remote(rollouts.Agent.episode, dynamo.url)])
    finally:
        ray.shutdown()
        sys.path.remove(str(tmp_path / "wd"))
        sys.modules.pop("attack_ray_rollouts", None)
    assert None not in sessions and len(set(sessions)) == 2
    sent = {s.path: s.get("X-Dynamo-Session-ID") for s in dynamo.requests}
    assert [sent["/v1/working-dir"], sent["/v1/shipped"]] == sessions
