"""Named trajectory boundaries: every call of a named function is one trajectory attempt.

Every RL framework has a function that runs one sample's multi-turn rollout; naming it is all it
takes (``OTEL_SESSION_TRAJECTORY_FUNCTIONS=module:Qualified.name,...`` or ``configure(
trajectory_functions=...)``). Each name is applied when its module is imported (at once if it is
already): the attribute is wrapped in place, so callers that look it up at call time (a module
global, a method) reach the wrapper. Each call runs as ``trajectory()`` does for a decorated
function: a coroutine awaited, a generator iterated, all inside one new attempt; inside another
trajectory it is a nested one. Frameworks are covered by presets of the same mechanism
(``nemo_rl``). A name that does not resolve once its module is imported, or whose module is never
imported by the time the process exits, is one warning naming it; the other names still apply.
"""

from __future__ import annotations

import atexit
import inspect
import sys
import threading
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any, ClassVar

import wrapt

from otel_session import _faults, _settings
from otel_session._trajectory import as_attempt, trajectory
from otel_session.instrumentation._base import SessionInstrumentor, Wrapper

# Arguments that name the sample a rollout function runs, recorded as the attempt's span attribute.
_SAMPLE_ARGUMENTS = {"sample_idx": "otel_session.sample_index", "traj_idx": "otel_session.sample_index"}


# Code a boundary must never be made of: what otel-session itself runs while opening an attempt.
_OWN_MODULES = ("otel_session", "opentelemetry", "wrapt")


class Unresolved(Exception):
    """Why a name cannot be made a trajectory boundary, in words for the one warning it costs."""


def _python_code(target: Any) -> bool:
    """Whether ``target`` (a function, method descriptor, class or callable object) runs Python code
    of its own: a builtin or C function is no rollout, and otel-session itself may call it."""
    if isinstance(target, (classmethod, staticmethod)):
        target = target.__func__
    if inspect.isclass(target):
        return any(inspect.isfunction(getattr(target, method, None)) for method in ("__init__", "__new__"))
    if not inspect.isfunction(inspect.unwrap(target)) and not inspect.ismethod(target):
        target = inspect.getattr_static(type(target), "__call__", None)
    return inspect.isfunction(inspect.unwrap(target)) if target is not None else False


def _resolve(module: ModuleType, qualified: str) -> tuple[Any, str, bool]:
    """(owner, attribute, copied down) for ``qualified`` in ``module``; ``Unresolved`` says why not."""
    *path, name = qualified.split(".")
    owner: Any = module
    for part in [*path, name][:-1]:
        if not hasattr(owner, part):
            raise Unresolved(f"{getattr(owner, '__name__', owner)!s} has no {part}")
        owner = getattr(owner, part)
    try:
        target = inspect.getattr_static(owner, name)
    except AttributeError:
        raise Unresolved(f"{getattr(owner, '__name__', owner)!s} has no {name}") from None
    if isinstance(target, property) or not callable(getattr(owner, name)):
        raise Unresolved(f"{qualified} is not a function, method or callable object")
    if getattr(getattr(owner, name), "__module__", None) in (None, "builtins") or not _python_code(target):
        raise Unresolved(f"{qualified} is not Python code of its own (a builtin, a C function, a partial)")
    origin = str(getattr(inspect.unwrap(getattr(owner, name)), "__module__", "") or "")
    if origin.partition(".")[0] in _OWN_MODULES:
        raise Unresolved(f"{qualified} is code otel-session itself runs")
    copied = name not in vars(owner)
    if copied:  # inherited: wrapped on this class only, never on its base (taken away again on unwrap)
        setattr(owner, name, target)
    return owner, name, copied


def _sample_attributes(func: Any) -> Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]:
    """A reader of the sample index among a call's arguments, made once per function."""
    try:
        parameters = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return lambda args, kwargs: {}
    if parameters and parameters[0] in ("self", "cls"):
        parameters = parameters[1:]  # wrapt hands bound calls their arguments without the instance
    named = [(i, p, _SAMPLE_ARGUMENTS[p]) for i, p in enumerate(parameters) if p in _SAMPLE_ARGUMENTS]

    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        found = {}
        for index, parameter, attribute in named:
            value = kwargs[parameter] if parameter in kwargs else args[index] if index < len(args) else None
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                found[attribute] = value
        return found

    return read


class _Boundary:
    """The wrapt wrapper of one named function: each call a new attempt."""

    def __init__(self, name: str, original: Any) -> None:
        self.name = name
        self.template = trajectory(name=name.partition(":")[2], attributes={"otel_session.boundary": name})
        self.read = _sample_attributes(original)

    def __call__(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            template = self.template._fresh(self.read(args, kwargs))
        except Exception as exc:  # a bug of ours must not fail the rollout: it runs as it would
            _faults.report(f"opening a trajectory for {self.name}", exc)
            return wrapped(*args, **kwargs)
        return as_attempt(template, wrapped, args, kwargs)


_BOUNDARIES: dict[str, _Boundary] = {}
_WARNED: set[str] = set()  # names already warned about: once per process, however often configured


class TrajectoryFunctionsInstrumentor(SessionInstrumentor):
    """Named trajectory boundaries (entry point ``otel_session_boundaries``): the functions named in
    ``Settings.trajectory_functions``, plus a subclass's ``presets``."""

    library = "otel_session"
    requirement = "otel-session"
    kind = "boundary"
    presets: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        if hasattr(self, "_names"):
            return
        super().__init__()
        self._names: tuple[str, ...] = ()
        self._hooked: set[str] = set()  # modules with a post-import hook (cannot be removed)
        self._applied: set[str] = set()
        self._copied: list[tuple[Any, str]] = []
        self._exit_check = False
        self._names_lock = threading.RLock()

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()

    def names(self) -> tuple[str, ...]:
        """The functions this instrumentor makes boundaries of now."""
        if self.presets:
            return self.presets
        settings = _settings.current
        return settings.trajectory_functions if settings is not None else ()

    def _instrument(self, **kwargs: Any) -> None:
        super()._instrument(**kwargs)
        with self._names_lock:
            self._names = self.names()
            self._applied = set()
            for name in self._names:
                module = name.partition(":")[0]
                if module not in self._hooked:
                    self._hooked.add(module)
                    wrapt.register_post_import_hook(self._module_imported, module)
                elif module in sys.modules:
                    self._module_imported(sys.modules[module])
            if self._names and not self.presets and not self._exit_check:
                self._exit_check = True
                atexit.register(self._never_imported)

    def _imported(self, module: ModuleType) -> None:
        """The base class's hook on ``library``: nothing to patch there, the names have their own."""

    def _module_imported(self, module: ModuleType) -> None:
        with self._names_lock:
            if not self.active:
                return
            for name in self._names:
                if name.partition(":")[0] == module.__name__ and name not in self._applied:
                    self._applied.add(name)
                    self._apply(module, name)

    def _apply(self, module: ModuleType, name: str) -> None:
        qualified = name.partition(":")[2]
        try:
            if module.__name__ == "__main__":
                raise Unresolved(
                    "the script being run (__main__) cannot be hooked before its functions exist: name a "
                    "function in a module it imports, or decorate it with @otel_session.trajectory"
                )
            owner, attribute, copied = _resolve(module, qualified)
            boundary = _BOUNDARIES.get(name)
            if boundary is None:  # one wrapper per name, whichever instrumentor names it: never twice
                boundary = _BOUNDARIES[name] = _Boundary(name, getattr(owner, attribute))
            self.patch(owner, attribute, boundary)
            if copied:
                self._copied.append((owner, attribute))
        except Exception as exc:
            if not self.presets and name not in _WARNED:  # a preset names what a version may lack
                _WARNED.add(name)
                reason = str(exc) if isinstance(exc, Unresolved) else f"{type(exc).__name__}: {exc}"
                _faults.warn(
                    "otel-session: trajectory function %s does not resolve (%s); the other names still apply",
                    name,
                    reason,
                )

    def _uninstrument(self, **kwargs: Any) -> None:
        super()._uninstrument(**kwargs)
        for owner, attribute in self._copied:  # an inherited method copied down: inherited again
            if attribute in vars(owner) and not isinstance(vars(owner)[attribute], wrapt.FunctionWrapper):
                delattr(owner, attribute)
        self._copied = []

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        return []

    def _never_imported(self) -> None:
        """At exit: one warning per named function whose module was never imported."""
        if not self.active:
            return
        for name in self._names:
            if name.partition(":")[0] not in sys.modules:
                _faults.warn(
                    "otel-session: trajectory function %s was never applied: its module was never imported",
                    name,
                )


class NeMoRLInstrumentor(TrajectoryFunctionsInstrumentor):
    """NeMo-RL's rollout functions as trajectory boundaries (entry point ``otel_session_nemo_rl``).

    ``run_sample_multi_turn_rollout`` runs one sample's multi-turn rollout for the synchronous and
    async GRPO paths (looked up as a module global at call time); ``AsyncRolloutImpl.
    _run_single_rollout`` does the same for the single_controller ``RolloutManager``, which retries a
    whole prompt group by calling it again, so each retry is a new attempt. The HTTP retries inside
    one turn (``DynamoGeneration._post_completion_request``) stay inside the attempt.
    """

    library = "nemo_rl"
    requirement = "nemo_rl"
    presets = (
        "nemo_rl.experience.rollouts:run_sample_multi_turn_rollout",
        "nemo_rl.experience.rollout_manager:AsyncRolloutImpl._run_single_rollout",
    )
