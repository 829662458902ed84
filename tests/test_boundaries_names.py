"""Named boundaries reached under more than one name, or named as what they cannot be (outside attacks).

A function re-exported by its package, a method a subclass inherits, a reference taken while
configured: one attempt per call, never two nested ones, and nothing after ``unconfigure()``. A
class, a method reached through an instance or a metaclass: the user's call works unchanged and the
name costs one warning saying what to name instead. Named functions still pickle and copy (a process
pool, a deep-copied config). Real httpx requests to a loopback recording server configured as a
Dynamo host; the modules are written to a temporary folder per test and imported as a framework's.
"""

from __future__ import annotations

import copy
import importlib
import logging
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER
from otel_session.instrumentation.boundaries import TrajectoryFunctionsInstrumentor
from tests.recorder import Recorder

ROLLOUTS = """
import functools, httpx

URL = None

def post():
    httpx.post(URL + "/v1/chat/completions", json={})
    return "done"

def run_episode():
    return post()

def double(x):
    return 2 * x

class Base:
    def run(self):
        return post()

    def double(self, x):
        return 2 * x

    @classmethod
    def run_class(cls):
        post()
        return cls.__name__

    @staticmethod
    def run_static():
        return post()

class Sub(Base):
    pass

class Meta(type):
    def make(cls):
        post()
        return cls.__name__

    @classmethod
    def make_meta(mcls):
        post()
        return mcls.__name__

class Made(metaclass=Meta):
    pass

class Caller:
    def __init__(self):
        self.calls = []

    def __call__(self):
        self.calls.append(1)
        return post()

agent = Base()
caller = Caller()

def retried(func):
    @functools.wraps(func)
    def again(*args, **kwargs):
        return func(*args, **kwargs)
    return again

@retried
def decorated():
    return post()
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh package, not yet imported: ``PKG.rollouts`` holds the code above and ``PKG`` re-exports
    ``run_episode`` from it (``from PKG.rollouts import run_episode``), as frameworks do."""
    name = f"pkg_{tmp_path.name.replace('-', '_')}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text(f"from {name}.rollouts import run_episode\n")
    (tmp_path / name / "rollouts.py").write_text(ROLLOUTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> Callable[[str], list[str]]:
    """``warnings(text)``: the otel-session warnings logged so far that contain ``text``."""
    caplog.set_level(logging.WARNING, "otel_session")
    return lambda text: [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _load(package: str, dynamo: Recorder) -> tuple[ModuleType, ModuleType]:
    top = importlib.import_module(package)
    rollouts = importlib.import_module(f"{package}.rollouts")
    rollouts.URL = dynamo.url
    return top, rollouts


def _attempts(dynamo: Recorder) -> list[str | None]:
    """The session of each request so far; none may name a parent (nothing here is nested)."""
    assert [seen.get(PARENT_SESSION_HEADER) for seen in dynamo.requests] == [None] * len(dynamo.requests)
    return [seen.get(SESSION_HEADER) for seen in dynamo.requests]


@pytest.mark.parametrize("reexport_first", [False, True])
def test_a_function_named_also_as_its_packages_re_export_is_one_attempt_per_call(
    package: str, dynamo: Recorder, reexport_first: bool
) -> None:
    """Found by an outside attack: the package's ``from .rollouts import run_episode`` picked up the
    wrapped function and the package's own name wrapped it again: two nested attempts per call."""
    names = [f"{package}.rollouts:run_episode", f" {package}:run_episode "]  # the blank-padded twice
    otel_session.configure(
        dynamo_hosts=[dynamo.url], trajectory_functions=names[:: -1 if reexport_first else 1]
    )
    top, rollouts = _load(package, dynamo)
    assert top.run_episode() == rollouts.run_episode() == top.run_episode() == "done"
    sessions = _attempts(dynamo)
    assert len(sessions) == 3 and None not in sessions and len(set(sessions)) == 3
    otel_session.unconfigure()
    assert top.run_episode() == rollouts.run_episode() == "done"
    assert _attempts(dynamo)[3:] == [None, None]


@pytest.mark.parametrize("base_first", [True, False])
def test_a_method_named_on_a_base_and_on_its_subclass_is_one_attempt_in_either_order(
    package: str, dynamo: Recorder, base_first: bool
) -> None:
    """Found by an outside attack: naming ``Base.run`` then ``Sub.run`` (inherited) put the second
    wrapper inside the first one, shared by both classes: two nested attempts per call."""
    names = [f"{package}.rollouts:Base.run", f"{package}.rollouts:Sub.run"]
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=names[:: 1 if base_first else -1])
    _, rollouts = _load(package, dynamo)
    assert rollouts.Base().run() == rollouts.Sub().run() == "done"
    sessions = _attempts(dynamo)
    assert len(sessions) == 2 and None not in sessions and sessions[0] != sessions[1]
    otel_session.unconfigure()
    assert "run" not in vars(rollouts.Sub) and not hasattr(rollouts.Base.run, "__wrapped__")
    assert rollouts.Sub().run() == "done" and _attempts(dynamo)[2:] == [None]


def test_a_reference_taken_while_configured_passes_through_after_unconfigure_and_serves_again(
    package: str, dynamo: Recorder
) -> None:
    """Found by an outside attack: the package's re-export, taken while configured, kept opening an
    attempt on every call after ``unconfigure()``. Now every wrapper asks at call time whether its
    name is in force; the same name configured again serves again, one attempt per call whichever
    names are stacked on one function."""
    name = f"{package}.rollouts:run_episode"
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[name])
    top, rollouts = _load(package, dynamo)
    top.run_episode()
    otel_session.unconfigure()
    top.run_episode()
    otel_session.configure(dynamo_hosts=[dynamo.url])
    top.run_episode()
    assert _attempts(dynamo)[1:] == [None, None]
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[name])
    top.run_episode()
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{package}:run_episode"])
    top.run_episode()  # the re-export named on its own: one wrapper over the stale one, which passes

    class Preset(TrajectoryFunctionsInstrumentor):
        library = "otel_session"
        presets = (name,)  # and the original's name in force again, from another instrumentor

    Preset().instrument()
    try:
        top.run_episode()
        rollouts.run_episode()
    finally:
        Preset().uninstrument()
    sessions = _attempts(dynamo)
    assert len(sessions) == 7 and None not in sessions[3:] and len(set(sessions[3:])) == 4


def test_a_method_reached_through_an_instance_or_a_metaclass_is_refused_and_the_call_still_works(
    package: str, dynamo: Recorder, warnings: Callable[[str], list[str]]
) -> None:
    """Found by an outside attack: ``agent.run`` (a module-level instance's method) and ``Made.make``
    (a metaclass's method) were copied onto the instance or class as plain functions, so the user's
    own call raised TypeError (missing argument), and a metaclass classmethod got the wrong class."""
    module = f"{package}.rollouts"
    otel_session.configure(
        dynamo_hosts=[dynamo.url],
        trajectory_functions=[f"{module}:agent.run", f"{module}:Made.make", f"{module}:Made.make_meta"],
    )
    _, rollouts = _load(package, dynamo)
    assert rollouts.agent.run() == "done"
    assert rollouts.Made.make() == "Made" and rollouts.Made.make_meta() == "Meta"
    assert _attempts(dynamo) == [None, None, None]
    for named, instead in [
        ("agent.run", "Base.run"),
        ("Made.make", "Meta.make"),
        ("Made.make_meta", "Meta.make_meta"),
    ]:
        lines = warnings(f"{module}:{named} ")
        assert len(lines) == 1 and f"{module}:{instead}" in lines[0].partition(" does not resolve ")[2]
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{module}:Base.run"])
    assert rollouts.agent.run() == "done" and _attempts(dynamo)[3] is not None  # what it said to name


def test_a_class_is_refused_left_untouched_and_its_method_still_applies(
    package: str, dynamo: Recorder, warnings: Callable[[str], list[str]]
) -> None:
    """Found by an outside attack: a class named as a boundary became a wrapt proxy that neither it
    nor its instances could be pickled through, and naming the class then a method of it dropped the
    method with an internal error. Constructing an object is not an attempt: the class is refused as
    ``@trajectory`` refuses it, and the method named after it applies."""
    module = f"{package}.rollouts"
    otel_session.configure(
        dynamo_hosts=[dynamo.url], trajectory_functions=[f"{module}:Base", f"{module}:Base.run_static"]
    )
    _, rollouts = _load(package, dynamo)
    assert type(rollouts.Base) is type and pickle.loads(pickle.dumps(rollouts.Base)) is rollouts.Base
    assert type(pickle.loads(pickle.dumps(rollouts.Base()))) is rollouts.Base
    assert rollouts.Base.run_static() == "done" and _attempts(dynamo)[0] is not None
    lines = warnings(f"{module}:Base ")
    assert len(lines) == 1 and "is a class" in lines[0]
    assert (
        f"name the function or method that runs one attempt instead, e.g. {module}:Base.run_episode"
        in lines[0]
    )
    assert not warnings(f"{module}:Base.run_static")


def _pickled(value: object) -> object:
    return pickle.loads(pickle.dumps(value))


def test_named_functions_and_methods_pickle_and_copy_as_what_they_stand_for(
    package: str, dynamo: Recorder
) -> None:
    """Found by checking the wrappers beyond the attack: a named function or method could not be
    pickled (wrapt's proxy refuses), so a process pool or Ray could not be handed one, nor could a
    config holding one be deep-copied. Classmethods and staticmethods are named through a subclass."""
    module = f"{package}.rollouts"
    names = ["run_episode", "double", "Base.double", "Sub.run_class", "Sub.run_static", "caller", "decorated"]
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{module}:{n}" for n in names])
    _, rollouts = _load(package, dynamo)
    assert _pickled(rollouts.run_episode) is rollouts.run_episode and _pickled(rollouts.decorated)() == "done"
    assert copy.deepcopy({"rollout": rollouts.run_episode})["rollout"] is rollouts.run_episode
    assert copy.copy(rollouts.run_episode) is rollouts.run_episode
    assert _pickled(rollouts.Sub.run_class)() == "Sub" and _pickled(rollouts.Sub().run_static)() == "done"
    assert rollouts.Base.run_class() == "Base" and rollouts.Base.run_static() == "done"
    assert _pickled(rollouts.Base().double)(4) == _pickled(rollouts.Base.double)(rollouts.Base(), 4) == 8
    assert copy.deepcopy(rollouts.Base().double)(5) == 10
    copied = copy.deepcopy(rollouts.caller)
    assert copied() == "done" and copied.calls == [1] and rollouts.caller.calls == []
    assert _pickled(rollouts.caller).calls == []
    sessions = _attempts(dynamo)
    assert len(sessions) == 6 and sessions[3:5] == [None, None] and len(set(sessions) - {None}) == 4
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(rollouts.double, 3).result(60) == 6
        assert pool.submit(rollouts.Base().double, 4).result(60) == 8


@pytest.mark.parametrize("how", ["path", "module"])
def test_the_exit_warning_says_why_a_named_module_was_never_imported(
    tmp_path: Path, dynamo: Recorder, how: str
) -> None:
    """From a newcomer: naming a function of the script being run said "its module was never
    imported" although it ran (as ``__main__``, which cannot be hooked); a module that does not exist
    at all said the same. Each now says what it is and what to do."""
    (tmp_path / "written_not_imported.py").write_text("def run():\n    pass\n")
    (tmp_path / "mainroll.py").write_text(
        textwrap.dedent(
            f"""
            import otel_session
            names = ["mainroll:run", "no_such_module_anywhere.sub:run", "written_not_imported:run"]
            otel_session.configure(dynamo_hosts=["{dynamo.url}"], trajectory_functions=names)

            def run():
                pass

            run()
            """
        )
    )
    argv = [sys.executable, "mainroll.py"] if how == "path" else [sys.executable, "-m", "mainroll"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    lines = {name: [line for line in done.stderr.splitlines() if f"{name}:run " in line] for name in
             ("mainroll", "no_such_module_anywhere.sub", "written_not_imported")}  # fmt: skip
    assert all(len(found) == 1 for found in lines.values()), done.stderr
    assert "mainroll ran as the script (__main__), whose functions cannot be hooked" in lines["mainroll"][0]
    assert "decorate it with @otel_session.trajectory" in lines["mainroll"][0]
    assert "no module named no_such_module_anywhere can be found" in lines["no_such_module_anywhere.sub"][0]
    assert "its module was never imported" in lines["written_not_imported"][0]


def test_a_reference_from_an_earlier_configure_still_pickles_and_runs_in_a_pool(
    package: str, dynamo: Recorder
) -> None:
    """From an outside attack: configuring again (interpreter start, then the application) wraps the
    function anew, and a reference taken before could no longer be pickled ("not the same object")."""
    names = [f"{package}.rollouts:double"]
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=names)
    _, rollouts = _load(package, dynamo)
    held = rollouts.double
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=names)
    assert held is not rollouts.double
    assert _pickled(held) is rollouts.double  # the receiving side looks the name up itself
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(held, 3).result(60) == 6


@pytest.mark.parametrize(
    "name", ["inspect:iscoroutinefunction", "uuid:uuid4", "functools:wraps", "contextlib:suppress.__enter__"]
)
def test_standard_library_code_is_refused_since_otel_session_itself_runs_it(
    name: str, dynamo: Recorder, warnings: Callable[[str], list[str]]
) -> None:
    """From an outside attack: ``inspect:iscoroutinefunction`` was accepted, and every call of it then
    recursed (opening an attempt calls it)."""
    import inspect

    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[name])
    assert inspect.iscoroutinefunction(_load) is False
    with otel_session.trajectory():
        pass
    [said] = warnings(name)
    assert "code otel-session itself may run" in said or "does not resolve" in said


def test_a_helper_process_says_only_what_cannot_be_right_anywhere(tmp_path: Path, dynamo: Recorder) -> None:
    """From an outside attack: under OTEL_SESSION_AUTO every helper process (multiprocessing's
    resource tracker, ``python -c``) said at exit that each name was never applied, though the
    processes running the rollouts applied them. A name no process can apply is still said."""
    (tmp_path / "real_rollouts.py").write_text("def run():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_SESSION_AUTO="true",
        OTEL_SESSION_DYNAMO_HOSTS=dynamo.authority,
        OTEL_SESSION_TRAJECTORY_FUNCTIONS="real_rollouts:run,no_such_module_anywhere:run",
        PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    done = subprocess.run(
        [sys.executable, "-c", "print('helper')"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "helper", done.stderr
    assert "real_rollouts:run" not in done.stderr
    assert "no module named no_such_module_anywhere can be found" in done.stderr
