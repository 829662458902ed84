"""Trajectory boundaries: named functions (every kind), the decorator on every kind, nesting, bad names,
unconfigure, and the one-line notice for a router request outside any trajectory.

Real httpx and aiohttp requests to a loopback recording server configured as a Dynamo host. The named
functions live in a module written to a temporary folder per test, imported after or before
``configure()`` as a framework's would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import aiohttp
import httpx
import pytest

import otel_session
from otel_session import SESSION_HEADER
from tests.recorder import Recorder

ROLLOUTS = """
import asyncio, httpx, aiohttp

URL = None

def sync_rollout(turns):
    with httpx.Client() as client:
        for _ in range(turns):
            client.post(URL + "/v1/chat/completions", json={})
    return "done"

async def async_rollout(turns):
    async with aiohttp.ClientSession() as session:
        for _ in range(turns):
            async with session.post(URL + "/v1/chat/completions", json={}) as response:
                await response.read()
    return "done"

def generator_rollout(turns):
    with httpx.Client() as client:
        for turn in range(turns):
            client.post(URL + "/v1/chat/completions", json={})
            yield turn

async def async_generator_rollout(turns):
    async with httpx.AsyncClient() as client:
        for turn in range(turns):
            await client.post(URL + "/v1/chat/completions", json={})
            yield turn

def returns_coroutine(turns):
    return async_rollout(turns)

class Agent:
    def run(self, turns):
        return sync_rollout(turns)

    @classmethod
    def run_class(cls, turns):
        return sync_rollout(turns)

    @staticmethod
    def run_static(turns):
        return sync_rollout(turns)

    async def __call__(self, turns):
        return await async_rollout(turns)

class Child(Agent):
    pass

agent = Agent()

def outer(turns):
    sync_rollout(1)
    return sync_rollout(turns)
"""


@pytest.fixture
def rollouts(new_module: Callable[[str, str], str]) -> str:
    """A fresh module name holding the rollout functions above, importable, not yet imported."""
    return new_module("rollouts", ROLLOUTS)


def _load(name: str, dynamo: Recorder) -> ModuleType:
    module = importlib.import_module(name)
    module.URL = dynamo.url
    return module


def _sessions(dynamo: Recorder) -> list[str | None]:
    return [seen.get(SESSION_HEADER) for seen in dynamo.requests]


def test_each_call_of_a_named_function_is_one_attempt_also_imported_before_configure(
    rollouts: str, dynamo: Recorder
) -> None:
    module = _load(rollouts, dynamo)  # imported before configure(): applied at once
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{rollouts}:sync_rollout"])
    assert module.sync_rollout(3) == "done"
    assert module.sync_rollout(2) == "done"
    sessions = _sessions(dynamo)
    assert len(sessions) == 5 and None not in sessions
    assert len(set(sessions[:3])) == 1 and len(set(sessions[3:])) == 1 and sessions[0] != sessions[3]
    assert otel_session.current_session_id() is None  # nothing left behind


@pytest.mark.parametrize(
    "qualified",
    ["async_rollout", "returns_coroutine", "Agent.__call__", "agent", "Agent.run", "Agent.run_class",
     "Agent.run_static", "Child.run"],
)  # fmt: skip
def test_every_kind_of_callable_is_a_boundary(rollouts: str, dynamo: Recorder, qualified: str) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=f"{rollouts}:{qualified}")
    module = _load(rollouts, dynamo)  # imported after configure(): applied by the import hook
    target = eval(f"module.{qualified}", {"module": module})
    if qualified.startswith("Agent.run") and qualified not in ("Agent.run_class", "Agent.run_static"):
        target = getattr(module.Agent(), qualified.split(".")[1])
    if qualified == "Agent.__call__":
        target = module.Agent()
    if qualified == "Child.run":
        target = module.Child().run

    def call() -> object:
        result = target(2)
        return asyncio.run(result) if asyncio.iscoroutine(result) else result

    assert call() == "done"
    assert call() == "done"
    sessions = _sessions(dynamo)
    assert len(sessions) == 4 and None not in sessions, qualified
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3], qualified
    if qualified == "Child.run":
        assert module.Agent().run(1) == "done"  # the base class is not a boundary: no session
        assert _sessions(dynamo)[-1] is None


def test_generators_are_one_attempt_for_as_long_as_they_are_iterated(rollouts: str, dynamo: Recorder) -> None:
    otel_session.configure(
        dynamo_hosts=[dynamo.url],
        trajectory_functions=[f"{rollouts}:generator_rollout", f"{rollouts}:async_generator_rollout"],
    )
    module = _load(rollouts, dynamo)
    seen_between = []
    for _ in module.generator_rollout(3):
        seen_between.append(otel_session.current_session_id())  # the consumer's code: no session

    async def consume() -> None:
        async for _ in module.async_generator_rollout(3):
            seen_between.append(otel_session.current_session_id())

    asyncio.run(consume())
    sessions = _sessions(dynamo)
    assert len(sessions) == 6 and None not in sessions
    assert len(set(sessions[:3])) == 1 and len(set(sessions[3:])) == 1 and sessions[0] != sessions[3]
    assert seen_between == [None] * 6


def test_a_named_boundary_inside_a_trajectory_is_nested(rollouts: str, dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{rollouts}:sync_rollout"])
    module = _load(rollouts, dynamo)
    with otel_session.trajectory() as outer:
        module.sync_rollout(1)
    seen = dynamo.requests[-1]
    assert seen.get(SESSION_HEADER) not in (None, outer.session_id)
    assert seen.get("X-Dynamo-Parent-Session-ID") == outer.session_id


def test_unconfigure_unwraps_and_a_new_configure_applies_new_names(rollouts: str, dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{rollouts}:sync_rollout"])
    module = _load(rollouts, dynamo)
    wrapped = module.sync_rollout
    otel_session.unconfigure()
    assert not hasattr(module.sync_rollout, "__wrapped__") and module.sync_rollout is not wrapped
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{rollouts}:outer"])
    assert not hasattr(module.sync_rollout, "__wrapped__")
    module.outer(1)
    sessions = _sessions(dynamo)
    assert len(sessions) == 2 and sessions[0] == sessions[1] is not None


def test_a_name_that_does_not_resolve_is_one_warning_and_the_others_still_apply(
    rollouts: str, dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "otel_session")
    otel_session.configure(
        dynamo_hosts=[dynamo.url],
        trajectory_functions=[f"{rollouts}:no_such_function", f"{rollouts}:sync_rollout"],
    )
    module = _load(rollouts, dynamo)
    module.sync_rollout(1)
    assert _sessions(dynamo) != [None]
    warnings = [r.getMessage() for r in caplog.records if "no_such_function" in r.getMessage()]
    assert len(warnings) == 1 and "does not resolve" in warnings[0]


def test_a_malformed_name_is_a_clear_error_as_an_argument_and_one_warning_as_a_variable(
    rollouts: str, dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match=r"module:Qualified\.name"):
        otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=["no colon here"])
    monkeypatch.setenv("OTEL_SESSION_TRAJECTORY_FUNCTIONS", f"bad name,{rollouts}:sync_rollout")
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", dynamo.url)
    caplog.set_level(logging.WARNING, "otel_session")
    from otel_session import _environment

    _environment.configure_from_environment()
    module = _load(rollouts, dynamo)
    module.sync_rollout(1)
    assert _sessions(dynamo) != [None]
    assert sum("'bad name'" in r.getMessage() for r in caplog.records) == 1


def test_a_module_never_imported_is_named_in_one_warning_at_exit(tmp_path: Path, dynamo: Recorder) -> None:
    script = textwrap.dedent(
        f"""
        import otel_session
        otel_session.configure(dynamo_hosts=["{dynamo.url}"], trajectory_functions=["never_imported_mod:run"])
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "never_imported_mod:run" in line]
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "never applied: no module named never_imported_mod can be found" in lines[0]  # not even there


def test_the_decorator_works_without_parentheses_and_on_every_kind(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url])

    @otel_session.trajectory
    def plain() -> str | None:
        httpx.post(dynamo.url + "/x")
        return otel_session.current_session_id()

    @otel_session.trajectory()
    def gen() -> Iterator[str | None]:
        yield otel_session.current_session_id()
        httpx.post(dynamo.url + "/x")
        yield otel_session.current_session_id()

    class Callable_:
        async def __call__(self) -> str | None:
            async with aiohttp.ClientSession() as session, session.post(dynamo.url + "/x") as response:
                await response.read()
            return otel_session.current_session_id()

    decorated = otel_session.trajectory()(Callable_())
    first, second = plain(), plain()
    assert first and second and first != second
    items = list(gen())
    assert items[0] == items[1] is not None and items[0] not in (first, second)
    assert asyncio.iscoroutinefunction(decorated)
    third = asyncio.run(decorated())
    assert third and third not in (first, second, items[0])
    assert _sessions(dynamo) == [first, second, items[0], third]


def test_a_router_request_outside_any_trajectory_is_told_once(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture, other: Recorder
) -> None:
    from otel_session import _hop

    _hop.untold = True
    caplog.set_level(logging.WARNING, "otel_session")
    otel_session.configure(dynamo_hosts=[dynamo.url])
    httpx.get(other.url + "/x")  # not a router: nothing to tell
    assert not [r for r in caplog.records if "outside any trajectory" in r.getMessage()]
    httpx.get(dynamo.url + "/x")
    httpx.get(dynamo.url + "/y")
    told = [r.getMessage() for r in caplog.records if "outside any trajectory" in r.getMessage()]
    assert (
        len(told) == 1
        and f"127.0.0.1:{dynamo.port}" in told[0]
        and "OTEL_SESSION_TRAJECTORY_FUNCTIONS" in told[0]
    )
    assert _sessions(dynamo) == [None, None]  # sent exactly as before


def test_a_named_coroutine_never_awaited_starts_no_attempt_and_warns_nothing(
    rollouts: str, dynamo: Recorder
) -> None:
    import gc
    import warnings

    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{rollouts}:async_rollout"])
    module = _load(rollouts, dynamo)
    started = []
    real_begin = otel_session.trajectory._begin

    def counting_begin(self: otel_session.trajectory) -> object:
        started.append(self)
        return real_begin(self)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setattr(otel_session.trajectory, "_begin", counting_begin)  # noqa: B010
        try:
            module.async_rollout(1).close()

            async def cancelled_before_start() -> None:
                task = asyncio.ensure_future(module.async_rollout(1))
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

            asyncio.run(cancelled_before_start())
            gc.collect()
        finally:
            setattr(otel_session.trajectory, "_begin", real_begin)  # noqa: B010
    assert started == [] and dynamo.requests == []
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_a_named_boundary_records_its_name_and_sample_index_on_its_span(
    new_module: Callable[[str, str], str], dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.otlp_receiver import OtlpHttpReceiver

    name = new_module(
        "samples",
        "async def run_sample(sample_idx, state):\n    return sample_idx\n\n"
        "class Impl:\n    async def run_single(self, sample, traj_idx):\n        return traj_idx\n",
    )
    receiver = OtlpHttpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    try:
        otel_session.configure(
            dynamo_hosts=[dynamo.url],
            tracing=True,
            trajectory_functions=[f"{name}:run_sample", f"{name}:Impl.run_single"],
        )
        module = importlib.import_module(name)

        async def run() -> None:
            await asyncio.gather(module.run_sample(sample_idx=3, state={}), module.Impl().run_single({}, 5))

        asyncio.run(run())
        otel_session.unconfigure()  # flushes the spans
        spans = {
            span.attributes.get("otel_session.boundary"): span
            for span in receiver.wait_for(lambda spans: len(spans) >= 2)
        }
        assert spans[f"{name}:run_sample"].attributes["otel_session.sample_index"] == 3
        assert spans[f"{name}:run_sample"].name == "run_sample"
        assert spans[f"{name}:Impl.run_single"].attributes["otel_session.sample_index"] == 5
        assert all(span.attributes.get("session.id") for span in spans.values())
    finally:
        otel_session.unconfigure()
        receiver.close()


def test_a_function_named_twice_a_preset_and_by_the_user_is_one_boundary(
    rollouts: str, dynamo: Recorder
) -> None:
    from otel_session.instrumentation.boundaries import TrajectoryFunctionsInstrumentor

    class Preset(TrajectoryFunctionsInstrumentor):
        library = "otel_session"
        presets = (f"{rollouts}:sync_rollout",)

    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{rollouts}:sync_rollout"])
    preset = Preset()
    preset.instrument()
    try:
        module = _load(rollouts, dynamo)
        module.sync_rollout(2)
        module.sync_rollout(1)
    finally:
        preset.uninstrument()
    sessions = _sessions(dynamo)
    assert sessions[0] == sessions[1] != sessions[2] and None not in sessions
    assert all(seen.get("X-Dynamo-Parent-Session-ID") is None for seen in dynamo.requests)  # not nested
    otel_session.unconfigure()
    assert not hasattr(module.sync_rollout, "__wrapped__")  # each wrapper taken off, the last one first


REFUSED = {
    "builtins:len": "not Python code of its own",
    "os:urandom": "not Python code of its own",
    "datetime:datetime.now": "not Python code of its own",
    "opentelemetry.context:attach": "code otel-session itself may run",
    "otel_session:current_session_id": "code otel-session itself may run",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_name_that_would_hook_what_otel_session_runs_is_one_warning_never_a_crash(
    name: str,
    rollouts: str,
    dynamo: Recorder,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an outside attack: ``builtins:len`` or ``os:urandom`` (which minting an ID calls) made
    every attempt open another, a RecursionError in the application; ``datetime:datetime.now`` a
    traceback. Each is one warning, asked for once however often configured, and the rest applies."""
    from otel_session.instrumentation import boundaries

    monkeypatch.setattr(boundaries, "_WARNED", set())
    caplog.set_level(logging.WARNING, "otel_session")
    names = [name, f"{rollouts}:sync_rollout"]
    for _ in range(2):
        otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=names)
    module = _load(rollouts, dynamo)
    assert module.sync_rollout(2) == "done" and len(b"abc") == 3
    sessions = _sessions(dynamo)
    assert len(sessions) == 2 and sessions[0] == sessions[1] is not None
    warned = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(warned) == 1 and REFUSED[name] in warned[0]
    assert not any(r.exc_info for r in caplog.records)


def test_a_property_or_a_plain_value_is_named_as_what_it_is(
    new_module: Callable[[str, str], str], dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    name = new_module("values", "URL = 'x'\nclass K:\n    @property\n    def p(self):\n        return 1\n")
    caplog.set_level(logging.WARNING, "otel_session")
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{name}:URL", f"{name}:K.p"])
    module = importlib.import_module(name)
    assert module.K().p == 1
    lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 2 and all("is not a function, method or callable object" in line for line in lines)


def test_unconfigure_gives_an_inherited_method_back_to_its_base(rollouts: str, dynamo: Recorder) -> None:
    """Found by an outside attack: naming ``Child.run`` (defined on ``Agent``) left a copy in
    ``Child`` after ``unconfigure()``, so a later change to ``Agent.run`` never reached ``Child``."""
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{rollouts}:Child.run"])
    module = _load(rollouts, dynamo)
    assert "run" in vars(module.Child)
    otel_session.unconfigure()
    assert "run" not in vars(module.Child) and module.Child.run is module.Agent.run


def test_the_script_itself_cannot_be_hooked_and_says_what_to_do_instead(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "otel_session")
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=["__main__:rollout"])
    lines = [r.getMessage() for r in caplog.records if "__main__:rollout" in r.getMessage()]
    assert len(lines) == 1 and "name a function in a module it imports" in lines[0]


def test_the_decorator_keeps_class_and_static_methods_and_refuses_what_it_cannot_serve() -> None:
    class Agent:
        @otel_session.trajectory
        @classmethod
        def of_class(cls) -> tuple[str, str | None]:
            return cls.__name__, otel_session.current_session_id()

        @otel_session.trajectory()
        @staticmethod
        def static(x: int) -> tuple[int, str | None]:
            return x, otel_session.current_session_id()

    class Base:
        async def __call__(self) -> str | None:
            return otel_session.current_session_id()

    class Inherits(Base):
        pass

    name, first = Agent.of_class()
    x, second = Agent().static(7)
    inherited = otel_session.trajectory()(Inherits())
    assert name == "Agent" and x == 7 and first and second and first != second
    assert asyncio.iscoroutinefunction(inherited) and asyncio.run(inherited()) not in (None, first, second)
    for refused in (property(lambda self: 1), Agent):
        with pytest.raises(TypeError, match=r"cannot decorate a (property|class)"):
            otel_session.trajectory()(refused)
    with pytest.raises(TypeError, match="cannot decorate a property"):
        otel_session.trajectory(property(lambda self: 1))
