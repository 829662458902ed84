"""Named trajectory boundaries: every call of a named function is one trajectory attempt.

Every RL framework has a function that runs one sample's multi-turn rollout; naming it is all it
takes (``OTEL_SESSION_TRAJECTORY_FUNCTIONS=module:Qualified.name,...`` or ``configure(
trajectory_functions=...)``). Each name is applied when its module is imported (at once if it is
already): the attribute is wrapped in place, so callers that look it up at call time (a module
global, a method) reach the wrapper. Each call runs as ``trajectory()`` does for a decorated
function: a coroutine awaited, a generator iterated, all inside one new attempt; inside another
trajectory it is a nested one. A name may say where its siblings' group key is
(``module:name[group=uid|before_last(:)]``, read by ``_group_keys``). Frameworks are covered by
presets of the same mechanism (``NeMoRLInstrumentor`` here, the others in ``presets``). A name that
does not resolve once its module is imported, or whose module is never imported by the time the
process exits, is one warning naming it; the other names still apply.

One function reached under several names (a package's re-export, a method a subclass inherits, a
preset the user names too) is one boundary: a call is one attempt, opened by the innermost wrapper in
force, never two nested ones. Each wrapper asks at call time whether its name is in force, so a
reference taken while configured (``from rollouts import run_episode``) passes straight through
after ``unconfigure()``, and serves again if the name is configured again. A class, or a method
reached through an instance or a metaclass, is refused with one warning saying what to name instead.
(Over 300 lines: the wrappers must also pickle and copy as the functions they stand for, since
multiprocessing, Ray and deep-copied configs hand rollout functions around.)
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import importlib
import importlib.util
import inspect
import operator
import sys
import threading
from collections.abc import Callable, Collection, Hashable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, SupportsIndex

import wrapt

from otel_session import _faults, _group_keys, _hop, _settings
from otel_session._trajectory import as_attempt, trajectory
from otel_session.instrumentation._base import Patched, SessionInstrumentor, Wrapper
from otel_session.instrumentation._reloads import when_reloaded

# Arguments that name the sample a rollout function runs, recorded as the attempt's span attribute.
_SAMPLE_ARGUMENTS = {"sample_idx": "otel_session.sample_index", "traj_idx": "otel_session.sample_index"}
# Arguments holding the sample a rollout starts from, whose conversation its siblings share (NeMo-RL's
# ``run_sample_multi_turn_rollout`` and ``AsyncRolloutImpl._run_single_rollout``).
_PROMPT_ARGUMENTS = ("initial_sample_state", "input_sample")

# Code a boundary must never be made of: what otel-session itself runs while opening and ending an
# attempt (the standard library too: no rollout lives there, and ``inspect`` or ``uuid`` would recurse).
_OWN_MODULES = frozenset({"otel_session", "opentelemetry", "wrapt", "sniffio", "trio", "anyio", "idna"})

_LOCK = threading.RLock()  # one boundary per name, shared by every instrumentor that names it


class Unresolved(Exception):
    """Why a name cannot be made a trajectory boundary, in words for the one warning it costs."""


def _python_code(target: Any) -> bool:
    """Whether ``target`` (a function, method descriptor or callable object) runs Python code of its
    own: a builtin or C function is no rollout, and otel-session itself may call it."""
    if isinstance(target, (classmethod, staticmethod)):
        target = target.__func__
    if not inspect.isfunction(inspect.unwrap(target)) and not inspect.ismethod(target):
        target = inspect.getattr_static(type(target), "__call__", None)
    return inspect.isfunction(inspect.unwrap(target)) if target is not None else False


def _resolve(module: ModuleType, qualified: str) -> tuple[Any, str, Any]:
    """(owner, attribute, what the owner holds there) for ``qualified`` in ``module``; ``Unresolved``
    says why not, and what to name instead where there is a better name."""
    *path, name = qualified.split(".")
    owner: Any = module
    for part in path:
        if not hasattr(owner, part):
            raise Unresolved(f"{getattr(owner, '__name__', owner)!s} has no {part}")
        owner = getattr(owner, part)
    try:
        target = inspect.getattr_static(owner, name)
    except AttributeError:
        raise Unresolved(f"{getattr(owner, '__name__', owner)!s} has no {name}") from None
    kind = owner.__class__  # where such a method lives: an instance's class, a class's metaclass
    instead = f"{kind.__module__}:{kind.__qualname__}.{name}"
    if isinstance(owner, type) and not any(name in vars(base) for base in owner.__mro__):
        raise Unresolved(f"{qualified} is defined on the metaclass of {path[-1]}: name {instead} instead")
    if not isinstance(owner, (ModuleType, type)) and name not in getattr(owner, "__dict__", {}):
        raise Unresolved(
            f"{qualified} is a method reached through an instance: name its class's, {instead}, instead"
        )
    if inspect.isclass(target):
        raise Unresolved(
            f"{qualified} is a class, and constructing an object is not an attempt: name the function or "
            f"method that runs one attempt instead, e.g. {module.__name__}:{qualified}.run_episode"
        )
    if isinstance(target, property) or not callable(getattr(owner, name)):
        raise Unresolved(f"{qualified} is not a function, method or callable object")
    if getattr(getattr(owner, name), "__module__", None) in (None, "builtins") or not _python_code(target):
        raise Unresolved(f"{qualified} is not Python code of its own (a builtin, a C function, a partial)")
    origin = str(getattr(inspect.unwrap(getattr(owner, name)), "__module__", "") or "")
    top = origin.partition(".")[0]
    if top in _OWN_MODULES or top in sys.stdlib_module_names:
        raise Unresolved(f"{qualified} is code otel-session itself may run ({top}): name a rollout function")
    return owner, name, target


Read = Callable[[tuple[Any, ...], dict[str, Any], "_Boundary"], tuple[dict[str, Any], Hashable | None]]


def _nothing(
    args: tuple[Any, ...], kwargs: dict[str, Any], boundary: _Boundary
) -> tuple[dict[str, Any], Hashable | None]:
    return {}, None


def _prompt_of(state: Any) -> Hashable | None:
    """What the siblings of a sample share: its initial conversation (NeMo-RL repeats each prompt's
    sample for its siblings, so their message logs are identical), as a digest of the roles and
    texts; ``None`` where a message's content is not text (its identity cannot be read cheaply), or
    where reading it runs the application's own code and that raises (a lazy record)."""
    try:
        return _conversation_digest(state)
    except Exception:
        return None


def _conversation_digest(state: Any) -> Hashable | None:
    log = state.get("message_log") if isinstance(state, Mapping) else None
    if not isinstance(log, (list, tuple)) or not log:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for message in log:
        role = message.get("role") if isinstance(message, Mapping) else None
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(role, str) or not isinstance(content, str):
            return None
        digest.update(f"{len(role)}:{role}{len(content)}:".encode())
        digest.update(content.encode(errors="surrogatepass"))
    return digest.hexdigest()


_ABSENT = object()


def _reader(func: Any) -> Read:
    """A reader of a call's arguments, made once per function: the sample index (a span attribute)
    and what the sample shares with its siblings (its group: where the boundary's ``group=`` says,
    else NeMo-RL's prompt)."""
    try:
        signature = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return _nothing
    parameters = list(signature)
    if parameters and parameters[0] in ("self", "cls"):
        parameters = parameters[1:]  # wrapt hands bound calls their arguments without the instance
    empty = inspect.Parameter.empty
    defaults = {p: signature[p].default for p in parameters if signature[p].default is not empty}
    named = [(i, p, _SAMPLE_ARGUMENTS[p]) for i, p in enumerate(parameters) if p in _SAMPLE_ARGUMENTS]
    prompts = [(i, p) for i, p in enumerate(parameters) if p in _PROMPT_ARGUMENTS]
    kinds = {p: signature[p].kind for p in parameters}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def argument(parameter: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if parameter in kwargs and kinds.get(parameter) != inspect.Parameter.POSITIONAL_ONLY:
            return kwargs[parameter]
        index = parameters.index(parameter) if parameter in kinds else len(args)
        if index < len(args) and kinds[parameter] in positional:
            return args[index]
        return defaults.get(parameter, _ABSENT)

    def group_of(key: _group_keys.GroupKey, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        value = argument(key.argument, args, kwargs)
        if value is _ABSENT:
            raise _group_keys.Unresolved(f"the call has no argument {key.argument}")
        return key.read(value)

    def read(
        args: tuple[Any, ...], kwargs: dict[str, Any], boundary: _Boundary
    ) -> tuple[dict[str, Any], Hashable | None]:
        found = {}
        for _, parameter, attribute in named:
            value = argument(parameter, args, kwargs)
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                found[attribute] = value
        key = boundary.key
        if key is not None:
            try:
                return found, (boundary.name, group_of(key, args, kwargs))
            except _group_keys.Unresolved as why:
                boundary.unresolved(key, str(why))
                return found, None
        group = None
        for _, parameter in prompts:
            state = argument(parameter, args, kwargs)
            group = _prompt_of(state) if state is not _ABSENT else None
            if group is not None:
                break
        return found, group

    return read


def _serving(value: Any) -> bool:
    """Whether a boundary in force wraps ``value``: one function wrapped under two names (a re-export,
    an inherited method, a preset the user names too) is one attempt a call, opened by the innermost."""
    while isinstance(value, (wrapt.FunctionWrapper, wrapt.BoundFunctionWrapper)):
        if isinstance(value._self_wrapper, _Boundary) and value._self_wrapper.holders:
            return True
        value = value.__wrapped__
    return False


class _Boundary:
    """The wrapt wrapper of one named function: each call a new attempt while the name is in force."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.template = trajectory(name=name.partition(":")[2], attributes={"otel_session.boundary": name})
        self.read: Read = _nothing  # reads nothing until applied to a function
        self.holders: dict[object, _group_keys.GroupKey | None] = {}  # who names it now, with which group=
        self.key: _group_keys.GroupKey | None = None  # the group= in force: the user's over a preset's
        self.warned = False  # a group= that did not resolve at a call is one warning per name

    def hold(self, holder: TrajectoryFunctionsInstrumentor, key: _group_keys.GroupKey | None) -> None:
        self.holders[holder] = key
        self._choose()

    def release(self, holder: object) -> None:
        self.holders.pop(holder, None)
        self._choose()

    def _choose(self) -> None:
        keys = sorted(
            ((bool(getattr(h, "presets", ())), k) for h, k in self.holders.items() if k is not None),
            key=lambda found: found[0],
        )
        key = keys[0][1] if keys else None
        self.warned = self.warned and key == self.key  # a new group= is told about anew
        self.key = key

    def unresolved(self, key: _group_keys.GroupKey, why: str) -> None:
        if not self.warned:
            self.warned = True
            _faults.warn(
                "otel-session: trajectory function %s: group=%s does not resolve at a call (%s), so its "
                "attempts run without a group (no parent for their siblings); told once",
                self.name,
                key.text,
                why,
            )

    def __call__(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.holders or _serving(wrapped):  # a stale reference, or one inside opens the attempt
            return wrapped(*args, **kwargs)
        try:
            attributes, group = self.read(args, kwargs, self)
            template = self.template._fresh(attributes, group)
        except Exception as exc:  # a bug of ours must not fail the rollout: it runs as it would
            _faults.report(f"opening a trajectory for {self.name}", exc)
            return wrapped(*args, **kwargs)
        return as_attempt(template, wrapped, args, kwargs)


class _Proxy(Patched):
    """A named function in place of the original: pickled by name, so the receiving process finds its
    own (a boundary there too if it names it), and a copy of a function is the function itself; a
    callable object it wraps pickles as the object, and copies as a boundary of the copy."""

    def __init__(self, wrapped: Any, boundary: _Boundary, owner: Any, attribute: str) -> None:
        super().__init__(wrapped, boundary, owner, attribute)
        self._self_boundary = boundary

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        if isinstance(self._self_owner_of, type):
            return super().__reduce_ex__(protocol)
        try:
            found: Any = sys.modules[self.__module__]
            for part in self.__qualname__.split("."):
                found = getattr(found, part)
        except Exception:
            found = None
        if found is self:
            return self.__qualname__  # pickle looks it up again, and finds this very wrapper
        if isinstance(found, _Proxy) and _innermost(found) is _innermost(self):
            # A reference kept from an earlier configure(): the name now holds a newer wrapper of the
            # same function, so the receiving process looks the name up itself.
            return _named, (self.__module__, self.__qualname__)
        return operator.itemgetter(0), ((self.__wrapped__,),)  # the original, pickled as it would be

    def __copy__(self) -> Any:
        return self if inspect.isroutine(self.__wrapped__) else self._copy(copy.copy(self.__wrapped__))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        wrapped = self.__wrapped__
        return self if inspect.isroutine(wrapped) else self._copy(copy.deepcopy(wrapped, memo))

    def _copy(self, wrapped: Any) -> _Proxy:
        return _Proxy(wrapped, self._self_boundary, self._self_owner_of, self._self_attribute)


def _innermost(value: Any) -> Any:
    while isinstance(value, (wrapt.FunctionWrapper, wrapt.BoundFunctionWrapper)):
        value = value.__wrapped__
    return value


def _named(module: str, qualname: str) -> Any:
    """Unpickling a named function: whatever the receiving process holds under that name."""
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


_BOUNDARIES: dict[str, _Boundary] = {}
# Every attribute wrapped, in order: (boundary, owner, attribute, proxy, copied down from a base).
_WRAPPED: list[tuple[_Boundary, Any, str, _Proxy, bool]] = []
_WARNED: set[str] = set()  # names already warned about: once per process, however often configured


def _never_imported(module: str) -> str:
    """Why ``module`` was never imported, as far as can be told at exit without importing anything."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(main, "__file__", None) or getattr(getattr(main, "__loader__", None), "path", None)
    script = getattr(spec, "name", None) or Path(str(path or "")).stem  # __file__ is gone once it ran
    if module == script:
        return (
            f"{module} ran as the script (__main__), whose functions cannot be hooked: move the function "
            "into a module the script imports, or decorate it with @otel_session.trajectory"
        )
    top = module.partition(".")[0]
    try:
        missing = importlib.util.find_spec(top) is None
    except Exception:  # a broken finder or package: say no more than what is known
        missing = False
    if missing:
        return f"no module named {top} can be found (is it installed, or on sys.path?)"
    return _NOT_IMPORTED


_NOT_IMPORTED = "its module was never imported"
_BY_PATH = (
    "its module was loaded without an import (by file path: importlib.util.spec_from_file_location and "
    "exec_module, runpy.run_path), which no import hook sees; import it by name, or decorate the "
    "function with @otel_session.trajectory"
)


def _a_helper_process() -> bool:
    """A process started for other work than the rollouts (a multiprocessing child or its resource
    tracker, ``python -c``, a Ray worker) that inherited the variables: not importing a named module
    is what it is expected to do, so only a name that cannot be right anywhere is worth a line."""
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is not None and multiprocessing.parent_process() is not None:
        return True
    first = str((getattr(sys, "argv", None) or [""])[0])
    return first in ("", "-c") or ("ray" in sys.modules and Path(first).name.startswith("default_worker"))


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
        self._keys: dict[str, _group_keys.GroupKey | None] = {}  # each name's group=, where it says one
        self._hooked: set[str] = set()  # modules with a post-import hook (cannot be removed)
        self._applied: set[str] = set()
        self._exit_check = False

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
        with _LOCK:
            self._keys = dict(_group_keys.entry(entry) for entry in self.names())
            self._names = tuple(self._keys)
            self._applied = set()
            for name, key in self._keys.items():  # in force from now on, also wrappers left from earlier
                _BOUNDARIES.setdefault(name, _Boundary(name)).hold(self, key)
            for name in self._names:
                module = name.partition(":")[0]
                if module not in self._hooked:
                    self._hooked.add(module)
                    wrapt.register_post_import_hook(self._module_imported, module)
                    when_reloaded(module, self._module_reloaded)
                elif module in sys.modules:
                    self._module_imported(sys.modules[module])
            if self._names and not self.presets and not self._exit_check:
                self._exit_check = True
                atexit.register(self._warn_never_imported)

    def _imported(self, module: ModuleType) -> None:
        """The base class's hook on ``library``: nothing to patch there, the names have their own."""

    def _module_imported(self, module: ModuleType) -> None:
        with _LOCK:
            if not self.active:
                return
            for name in self._names:
                if name.partition(":")[0] == module.__name__ and name not in self._applied:
                    self._applied.add(name)
                    self._apply(module, name)

    def _module_reloaded(self, module: ModuleType) -> None:
        """Reloaded: its functions and classes are new, so each name is applied afresh."""
        with _LOCK:
            self._applied.difference_update(n for n in self._names if n.partition(":")[0] == module.__name__)
        self._module_imported(module)

    def _apply(self, module: ModuleType, name: str) -> None:
        boundary = _BOUNDARIES[name]
        try:
            if module.__name__ == "__main__":
                raise Unresolved(
                    "the script being run (__main__) cannot be hooked before its functions exist: name a "
                    "function in a module it imports, or decorate it with @otel_session.trajectory"
                )
            owner, attribute, target = _resolve(module, name.partition(":")[2])
            boundary.read = _reader(getattr(owner, attribute))
            proxy = _Proxy(target, boundary, owner, attribute)
            copied = attribute not in vars(owner)  # inherited: wrapped on this class only, never its base
            setattr(owner, attribute, proxy)
            _WRAPPED.append((boundary, owner, attribute, proxy, copied))
            _hop.boundaries_in_force.add(name)
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
        with _LOCK:
            for boundary in _BOUNDARIES.values():
                boundary.release(self)
            for boundary, owner, attribute, proxy, copied in reversed(_WRAPPED):  # a wrapper on top first
                if boundary.holders:
                    continue  # still named by another instrumentor
                try:  # one wrapped over since is left, and passes straight through
                    if vars(owner).get(attribute) is proxy:
                        if copied:  # an inherited method copied down: inherited again
                            delattr(owner, attribute)
                        else:
                            setattr(owner, attribute, proxy.__wrapped__)
                except Exception as exc:  # left in place, it passes through: never a failed unconfigure
                    _faults.report(f"unwrapping {boundary.name}", exc)
            _WRAPPED[:] = [wrapped for wrapped in _WRAPPED if wrapped[0].holders]
            _hop.boundaries_in_force.intersection_update(wrapped[0].name for wrapped in _WRAPPED)

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        return []

    def patched(self) -> list[tuple[Any, str]]:
        with _LOCK:
            return [(owner, name) for boundary, owner, name, _, _ in _WRAPPED if self in boundary.holders]

    def _warn_never_imported(self) -> None:
        """At exit: one warning per named function whose module was never imported, saying why."""
        if not self.active:
            return
        helper = _a_helper_process()
        for name in self._names:
            module = name.partition(":")[0]
            if module in sys.modules and name not in self._applied:
                _faults.warn("otel-session: trajectory function %s was never applied: %s", name, _BY_PATH)
            elif module not in sys.modules:
                why = _never_imported(module)
                if helper and why == _NOT_IMPORTED:
                    continue  # the rollouts run elsewhere: this process imports only what it needs
                _faults.warn("otel-session: trajectory function %s was never applied: %s", name, why)


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
