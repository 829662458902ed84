"""What every client hook shares (``otel_session.instrumentation._base``), on a library of the test's
own: patched when it is imported (or at once if it is), again after a reload, never twice, not at all
when the installed version is refused or ``servers`` is off for a server hook; our wrapper innermost
under anyone else's and exactly ours taken off; a patched method that binds, pickles and deep-copies
as the original. Every real target of every instrumentor is compared with its original in
tests/test_transparent.py; here each rule is checked on its own."""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import logging
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import wrapt

import otel_session
from otel_session import _faults, _settings
from otel_session.instrumentation import _base, _reloads

SEEN: list[Any] = []  # the instance each call through ``_seen`` was bound to


def _seen(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    SEEN.append(instance)
    return wrapped(*args, **kwargs)


def _made_by(cls: type) -> type:
    return cls


class Base:
    """Methods of every binding; patched by the ``patched`` fixture, so pickle finds them by name."""

    def me(self, x: int) -> Any:
        return self

    @classmethod
    def made(cls) -> type:
        return cls

    made_too = classmethod(_made_by)  # the name it is reached by is not its function's

    @staticmethod
    def still() -> str:
        return "still"


class Derived(Base):
    pass


NAMES = ("me", "made", "made_too", "still")


@pytest.fixture
def patched() -> Iterator[None]:
    SEEN.clear()
    originals = {name: Base.__dict__[name] for name in NAMES}
    for name in NAMES:
        _base._wrap_innermost(Base, name, _seen)
    yield
    for name, original in originals.items():
        setattr(Base, name, original)


def _calls(order: list[str], name: str) -> Callable[..., Any]:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        order.append(name)
        return wrapped(*args, **kwargs)

    return wrapper


def test_ours_goes_innermost_under_other_wrappers_and_only_ours_is_taken_off() -> None:
    class Plain:
        def f(self, x: int) -> int:
            return x

    original = Plain.__dict__["f"]
    order: list[str] = []
    ours, theirs, other = _calls(order, "ours"), _calls(order, "theirs"), _calls(order, "other")
    wrapt.wrap_function_wrapper(Plain, "f", theirs)
    wrapt.wrap_function_wrapper(Plain, "f", other)
    _base._wrap_innermost(Plain, "f", ours)
    assert Plain().f(3) == 3 and order == ["other", "theirs", "ours"]
    top = Plain.__dict__["f"]
    assert _base._holds(top, ours) and _base._holds(top, theirs) and not _base._holds(top, _seen)
    innermost = top.__wrapped__.__wrapped__
    assert isinstance(innermost, _base.Patched) and innermost.__wrapped__ is original
    assert (innermost._self_owner_of, innermost._self_attribute) == (Plain, "f")

    _base._unwrap(Plain, "f", ours)  # two wrappers down
    assert Plain.__dict__["f"] is top and top.__wrapped__.__wrapped__ is original
    assert not _base._holds(top, ours)
    order.clear()
    assert Plain().f(4) == 4 and order == ["other", "theirs"]
    _base._unwrap(Plain, "f", ours)  # not there: nothing changes
    assert Plain.__dict__["f"] is top and top.__wrapped__.__wrapped__ is original
    _base._unwrap(Plain, "f", other)  # on top
    assert Plain.__dict__["f"] is top.__wrapped__


def test_a_bare_method_is_wrapped_in_place_and_put_back_as_it_was() -> None:
    class Plain:
        def f(self, x: int) -> int:
            return x

    original = Plain.__dict__["f"]
    order: list[str] = []
    ours = _calls(order, "ours")
    _base._unwrap(Plain, "f", ours)  # nothing patched: nothing to take
    _base._unwrap(Plain, "absent", ours)
    assert Plain.__dict__["f"] is original and not _base._holds(original, ours)
    _base._wrap_innermost(Plain, "f", ours)
    patched = Plain.__dict__["f"]
    assert isinstance(patched, _base.Patched) and patched.__wrapped__ is original
    assert (patched._self_owner_of, patched._self_attribute, patched._self_wrapper) == (Plain, "f", ours)
    assert Plain().f(5) == 5 and order == ["ours"]
    _base._unwrap(Plain, "f", ours)
    assert Plain.__dict__["f"] is original


def test_a_method_reached_through_its_class_is_one_object_bound_to_the_class_that_defines_it(
    patched: None,
) -> None:
    assert Derived.me is Derived.me is Base.me  # first reached through the subclass
    instance = Base()
    assert Base.me(instance, 1) is instance
    assert [instance] == SEEN  # the wrapper is told the instance, as for a call through it
    assert instance.me(2) is instance and SEEN[-1] is instance


def test_a_classmethod_is_bound_anew_to_the_class_it_is_reached_through(patched: None) -> None:
    assert Base.made is not Base.made  # as an unpatched classmethod
    assert Derived.made() is Derived and Base.made() is Base
    assert Derived().made() is Derived


def test_a_module_function_reached_through_a_class_binds_to_that_class(new_module: Any) -> None:
    module = importlib.import_module(new_module("hook_base_functions", "def send(x):\n    return x\n"))
    _base._wrap_innermost(module, "send", _seen)

    class Alias:
        send = module.__dict__["send"]

    assert Alias.send(7) == 7 and module.send(8) == 8
    assert pickle.loads(pickle.dumps(module.send)) is module.send  # by name, as the original


def test_classmethods_and_staticmethods_pickle_as_the_attribute_they_were_reached_by(patched: None) -> None:
    assert pickle.loads(pickle.dumps(Derived.made_too))() is Derived
    assert pickle.loads(pickle.dumps(Derived.made))() is Derived
    assert pickle.loads(pickle.dumps(vars(Base)["me"])) is Base.me  # the patch itself: by its class
    holder = Derived()
    holder.lock = threading.Lock()  # type: ignore[attr-defined]  # an instance that cannot pickle
    assert pickle.loads(pickle.dumps(holder.still))() == "still"  # the instance is not pickled


def test_a_bound_method_deep_copied_with_its_instance_stays_bound_to_the_copy(patched: None) -> None:
    instance = Base()
    twin, method = copy.deepcopy([instance, instance.me])
    assert twin is not instance and method(0) is twin
    assert copy.copy(instance.me)(0) is instance


def test_a_type_is_probed_once_and_no_more_types_than_the_limit() -> None:
    probed: list[type] = []

    def probe(kind: type) -> bool:
        probed.append(kind)
        return kind.__name__.startswith("good")

    types = _base.ProbedTypes(probe)  # the default limit
    good, bad = type("good", (), {}), type("bad", (), {})
    assert good in types and good in types and bad not in types and bad not in types
    assert probed == [good, bad]
    many = [type(f"good{index}", (), {}) for index in range(70)]
    assert sum(kind in types for kind in many) == 62  # 64 probed in all: the rest take the slow path
    assert len(probed) == 64
    small = _base.ProbedTypes(probe, limit=2)
    assert [kind in small for kind in many[:3]] == [True, True, False]


TOY = "class Client:\n    def send(self, x):\n        return x\n\n    def other(self, x):\n        return x\n"
MISSING = "otel-session-no-such-distribution >= 1"  # no metadata: imported from a source tree


def _instrumentor(library: str, kind: str = "client", requirement: str = MISSING) -> Any:
    """A new instrumentor class (each its own singleton) patching ``Client.send`` of ``library``."""

    class Toy(_base.SessionInstrumentor):
        def targets(self, module: ModuleType) -> list[tuple[Any, str, _base.Wrapper]]:
            return [(module.Client, "send", _seen)]

    Toy.library, Toy.kind, Toy.requirement = library, kind, requirement
    return Toy()


@pytest.fixture
def toys() -> Iterator[Callable[..., Any]]:
    """``toys(library, ...)``: a new instrumentor; each one uninstrumented after the test."""
    made: list[Any] = []
    SEEN.clear()

    def make(library: str, kind: str = "client", requirement: str = MISSING) -> Any:
        made.append(_instrumentor(library, kind, requirement))
        return made[-1]

    yield make
    for toy in made:
        toy.uninstrument()


def _is_patched(module: ModuleType) -> bool:
    SEEN.clear()
    module.Client().send(1)
    return bool(SEEN)


def test_a_library_is_patched_when_imported_again_after_a_reload_and_not_once_uninstrumented(
    new_module: Any, toys: Callable[..., Any]
) -> None:
    name = new_module("hook_base_toy", TOY)
    toy = toys(name)
    hooks = len(_reloads._RELOADS.hooks.get(name, ()))  # (a name of an earlier run in this process)
    assert toy.active is False and toy.patched() == []
    toy.instrument()
    assert toy.active is True and name not in sys.modules  # nothing imported for it
    assert type(toy)() is toy and type(toy)().active is True  # the one instance, left as it was
    module = importlib.import_module(name)
    assert _is_patched(module) and toy.patched() == [(module.Client, "send")]
    module = importlib.reload(module)  # new classes stand where the patched ones were
    assert _is_patched(module) and toy.patched()[-1] == (module.Client, "send")

    toy.uninstrument()
    assert toy.active is False and toy.patched() == [] and not _is_patched(module)
    module = importlib.reload(module)
    assert not _is_patched(module)  # the hooks stay, but do nothing while uninstrumented
    toy.instrument()  # imported already: patched at once
    assert _is_patched(module) and toy.patched() == [(module.Client, "send")]
    assert len(_reloads._RELOADS.hooks[name]) == hooks + 1  # one hook, however often instrumented


def test_a_library_imported_before_is_patched_at_once(new_module: Any, toys: Callable[..., Any]) -> None:
    module = importlib.import_module(new_module("hook_base_early", TOY))
    toy = toys(module.__name__)
    toy.instrument()
    assert _is_patched(module)


def test_patching_again_patches_nothing_twice(new_module: Any, toys: Callable[..., Any]) -> None:
    module = importlib.import_module(new_module("hook_base_twice", TOY))
    toy = toys(module.__name__)
    toy.patch(module.Client, "other", _seen)  # not instrumented: nothing
    assert toy.patched() == [] and not isinstance(module.Client.__dict__["other"], _base.Patched)
    toy.instrument()
    toy._imported(module)
    toy.patch(module.Client, "send", _seen)
    toy.patch(module.Client, "other", _seen)
    toy.patch(module.Client, "other", _seen)
    assert toy.patched() == [(module.Client, "send"), (module.Client, "other")]
    for name in ("send", "other"):
        assert not isinstance(module.Client.__dict__[name].__wrapped__, _base.Patched)
    SEEN.clear()
    module.Client().other(1)
    assert len(SEEN) == 1


@pytest.mark.parametrize(
    ("kind", "servers", "active"),
    [("server", False, False), ("server", True, True), ("client", False, True), ("boundary", False, True)],
)
def test_a_server_hook_is_inactive_while_servers_are_off(
    new_module: Any, toys: Callable[..., Any], kind: str, servers: bool, active: bool
) -> None:
    module = importlib.import_module(new_module("hook_base_kind", TOY))
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"], servers=servers)
    configured = _settings.current
    toy = toys(module.__name__, kind)
    toy.instrument()
    assert toy.is_instrumented_by_opentelemetry and toy.active is active
    assert _is_patched(module) is active
    assert _settings.current is configured


def test_unconfigured_a_hook_delivers_by_the_environment_as_upstreams_loader_expects(
    new_module: Any, toys: Callable[..., Any], clean_otel_env: None
) -> None:
    module = importlib.import_module(new_module("hook_base_env", TOY))
    assert _settings.current is None
    toy = toys(module.__name__, "server")
    toy.instrument()
    assert _settings.current is not None and _settings.current.servers  # servers on by default there
    assert toy.active and _is_patched(module)


@pytest.mark.parametrize(
    ("requirement", "refused"),
    [("pytest < 1", True), ("pytest >= 1", False), (MISSING, False)],
)
def test_an_installed_version_outside_the_requirement_is_left_unpatched_with_one_line(
    new_module: Any,
    toys: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    requirement: str,
    refused: bool,
) -> None:
    module = importlib.import_module(new_module("hook_base_versions", TOY))
    caplog.set_level(logging.WARNING, "otel_session")
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    toy = toys(module.__name__, requirement=requirement)
    toy.instrument()
    assert _is_patched(module) is not refused
    said = [r.getMessage() for r in caplog.records if r.name == "otel_session"]
    version = importlib.metadata.version("pytest")
    assert said == (
        [f"otel-session: {module.__name__} is left unpatched: pytest {version} is installed, but "
         "otel-session needs pytest < 1"]
        if refused
        else []
    )  # fmt: skip


def test_a_library_that_cannot_be_patched_goes_on_unpatched_with_one_report(
    new_module: Any,
    toys: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = importlib.import_module(new_module("hook_base_broken", TOY))
    monkeypatch.setattr(_faults, "_reported", set())
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    caplog.set_level(logging.WARNING, "otel_session")
    toy = toys(module.__name__)
    monkeypatch.setattr(type(toy), "targets", lambda self, module: [(module.Client, "absent", _seen)])
    toy.instrument()
    [record] = [r for r in caplog.records if r.name == "otel_session"]
    assert record.getMessage().startswith(f"otel-session: instrumenting {module.__name__} failed (KeyError)")
    assert isinstance(record.exc_info and record.exc_info[1], KeyError)
    assert toy.patched() == [] and not _is_patched(module)


@pytest.mark.parametrize(
    ("library", "installed"),
    [
        ("json", True),
        ("json.no_such_module", True),  # only its top-level package is looked for: nothing imported
        ("otel_session_no_such_package.sub", False),
        ("", False),
    ],
)
def test_installed_looks_for_the_top_level_package(library: str, installed: bool) -> None:
    assert type(_instrumentor(library)).installed() is installed
