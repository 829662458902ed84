"""What every otel-session instrumentor shares: patching a library when it is imported, not before.

Each is an OpenTelemetry ``BaseInstrumentor`` (entry point group ``opentelemetry_instrumentor``, so
``opentelemetry-instrument`` and ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` treat it like any other),
but ``instrument()`` does not import its library: it patches the library now if the process has
imported it, else the moment it does. A process that never touches aiohttp never pays for importing it.
Patches are wrapt wrappers put innermost, so an upstream instrumentation's ``unwrap`` never takes ours.

A patched method must be indistinguishable from the original to code that calls or inspects it
(servers probe an app by calling it with no argument; frameworks ask ``iscoroutinefunction``): every
wrapper is synchronous and calls the original at once, so wrong arguments raise where they did, and
``Patched`` pickles and copies as the method it stands for (tests/test_transparent.py walks
``patched()`` of every instrumentor and compares each target before and after).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import threading
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any, ClassVar, SupportsIndex

import wrapt
from opentelemetry.instrumentation.dependencies import get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from otel_session import _config, _faults, _settings
from otel_session.instrumentation._reloads import when_reloaded

Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]
# Upstream's unwrap puts back ``getattr(cls, name).__wrapped__``: a bound wrapper, when ours was below.
_WRAPPERS = (wrapt.FunctionWrapper, wrapt.BoundFunctionWrapper)
_bind = wrapt.FunctionWrapper.__get__  # wrapt's own binding, called straight from ``Patched.__get__``


class BoundPatched(wrapt.BoundFunctionWrapper[..., Any]):
    """A patched method reached through its class or an instance: pickled as Python pickles a
    method (looked up again where it is loaded), copied as itself, deep-copied with its instance."""

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        parent = self._self_parent
        if self._self_binding == "classmethod":  # bound to the class it was reached through, a subclass too
            holder = getattr(self.__wrapped__, "__self__", None)
        else:
            instance = self._self_instance if self._self_binding != "staticmethod" else None
            holder = instance if instance is not None else getattr(parent, "_self_owner_of", None)
        if holder is None:
            return self.__wrapped__.__reduce_ex__(protocol)
        return getattr, (holder, parent._self_attribute)

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if self._self_instance is None:
            return self
        return getattr(copy.deepcopy(self._self_instance, memo), self._self_parent._self_attribute)


class Patched(wrapt.FunctionWrapper[..., Any]):
    """``owner.attribute`` wrapped by ``wrapper``: to pickle, copy and ``inspect`` it is the original,
    which is what code holding a reference to a library's method expects it to stay."""

    __bound_function_wrapper__ = BoundPatched

    def __init__(self, wrapped: Any, wrapper: Wrapper, owner: Any, attribute: str) -> None:
        super().__init__(wrapped, wrapper)
        self._self_owner_of = owner
        self._self_attribute = attribute
        self._self_through: Any = None

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """Through an instance, wrapt's binding; through a class, one object every time, as
        ``Class.method`` (a function or staticmethod) is for the original: cloudpickle, how Ray
        ships functions, sends one by name only when its name looks up that very object, and else
        copies its code, which runs unpatched there and fails on a global it cannot pickle (a lock)."""
        if instance is not None or owner is None or self._self_binding == "classmethod":
            return _bind(self, instance, owner)  # a classmethod is bound anew each time, as unpatched
        through = self._self_through
        if through is None:
            holder = self._self_owner_of if isinstance(self._self_owner_of, type) else owner
            through = self._self_through = _bind(self, None, holder)
        return through

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        owner = self._self_owner_of
        if isinstance(owner, type):
            return getattr, (owner, self._self_attribute)
        return self.__qualname__  # a module's function: by name, as pickle saves the original

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self


class SessionInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Patches ``library`` (a module name) once it is imported, while instrumented.

    ``kind`` says which ``configure()`` switch governs it: ``client`` (always on), ``server``
    (``servers``) or ``boundary`` (trajectory boundaries). ``replaces`` names the upstream
    instrumentations (entry point names) it does the propagation of, so zero-code mode skips them
    while tracing is off; ``upstream`` is the one (module, class) that records client spans while on.
    """

    library: ClassVar[str]
    requirement: ClassVar[str]
    kind: ClassVar[str] = "client"
    replaces: ClassVar[tuple[str, ...]] = ()
    upstream: ClassVar[tuple[str, str] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._instance = None  # upstream's singleton slot, else a subclass would get its parent's object

    def __init__(self) -> None:
        if hasattr(self, "_lock"):
            return  # BaseInstrumentor is a singleton per class: every call returns the same object
        self.active = False  # whether calls through the patched methods do anything (instrumented now)
        self._installed: list[tuple[Any, str, Wrapper]] = []
        self._hook_registered = False
        self._lock = threading.RLock()  # the import hook may fire inside _instrument

    def instrumentation_dependencies(self) -> Collection[str]:
        return (self.requirement,)

    @classmethod
    def installed(cls) -> bool:
        """Whether the client library is installed, found without importing it."""
        try:
            return importlib.util.find_spec(cls.library.partition(".")[0]) is not None
        except (ImportError, ValueError):
            return False

    def instrument(self, **kwargs: Any) -> None:
        """As upstream, but quiet when already instrumented (``configure()`` and a distro may both ask),
        and without upstream's check that the library is installed now: it is checked when the
        library is imported (``_imported``), which may be later."""
        if not self.is_instrumented_by_opentelemetry:
            super().instrument(**{**kwargs, "skip_dep_check": True})

    def _conflict(self) -> str | None:
        """Why the imported library cannot be patched (an installed version outside ``requirement``),
        or ``None``. A library imported from a source tree, with no installed metadata, is patched."""
        conflict = get_dependency_conflicts(list(self.instrumentation_dependencies()))
        if conflict is None or conflict.found is None:
            return None
        return f"{conflict.found} is installed, but otel-session needs {conflict.required}"

    def _instrument(self, **kwargs: Any) -> None:
        if _settings.current is None:
            # Loaded by a distro other than ours (``opentelemetry-instrument`` with upstream's), with no
            # configure(): deliver by the OTEL_SESSION_* variables all the same.
            _config.activate_environment()
        self.configure(**kwargs)
        settings = _settings.current
        if self.kind == "server" and settings is not None and not settings.servers:
            return  # loaded by upstream's loader with OTEL_SESSION_SERVERS off: instrumented, inactive
        with self._lock:
            self.active = True
            module = sys.modules.get(self.library)
            if not self._hook_registered:
                self._hook_registered = True
                # Runs at once if the library is imported already; the hook cannot be removed, so it
                # checks ``active`` whenever it fires.
                wrapt.register_post_import_hook(self._imported, self.library)
                when_reloaded(self.library, self._imported)
                return
        if module is not None:
            self._imported(module)

    def _imported(self, module: ModuleType) -> None:
        with self._lock:
            if not self.active:
                return
            try:
                conflict = self._conflict()
                if conflict is not None:
                    _faults.warn("otel-session: %s is left unpatched: %s", self.library, conflict)
                    return
                for owner, name, wrapper in self.targets(module):
                    if not _holds(owner.__dict__[name], wrapper):
                        _wrap_innermost(owner, name, wrapper)
                        self._installed.append((owner, name, wrapper))
            except Exception as exc:  # a library we cannot patch goes on unpatched, never broken
                _faults.report(f"instrumenting {self.library}", exc)

    def _uninstrument(self, **kwargs: Any) -> None:
        with self._lock:
            self.active = False
            for owner, name, wrapper in self._installed:
                _unwrap(owner, name, wrapper)
            self._installed = [t for t in self._installed if _holds(t[0].__dict__.get(t[1]), t[2])]

    def patch(self, owner: Any, name: str, wrapper: Wrapper) -> None:
        """Patch one more method now, while instrumented: one of a class that appeared after
        instrumenting (taken off with the others by ``uninstrument``)."""
        with self._lock:
            if self.active and not _holds(owner.__dict__[name], wrapper):
                _wrap_innermost(owner, name, wrapper)
                self._installed.append((owner, name, wrapper))

    def configure(self, **kwargs: Any) -> None:
        """Read what this instrumentor needs of the configuration, at each ``instrument()``."""

    def patched(self) -> list[tuple[Any, str]]:
        """(owner, attribute) of everything this instrumentor has patched and not taken off."""
        with self._lock:
            return [(owner, name) for owner, name, _ in self._installed]

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        """(class or module, attribute name, wrapt wrapper) for each callable to patch in ``module``."""
        raise NotImplementedError


class ProbedTypes:
    """The classes found to keep the layout an instrumentation's fast path relies on (a library's
    private header list, say): each probed once, the first time it is met, and at most ``limit``
    (classes are few; bounded all the same). Any other class takes the public, slower path."""

    __slots__ = ("_checked", "_good", "_limit", "_probe")

    def __init__(self, probe: Callable[[type], bool], limit: int = 64) -> None:
        self._probe = probe
        self._limit = limit
        self._good: set[type] = set()
        self._checked: set[type] = set()

    def __contains__(self, kind: type) -> bool:
        if kind in self._good:
            return True
        if kind in self._checked or len(self._checked) >= self._limit:
            return False
        self._checked.add(kind)
        if self._probe(kind):
            self._good.add(kind)
            return True
        return False


def _wrap_innermost(owner: Any, name: str, wrapper: Wrapper) -> None:
    """Wrap ``owner.name`` right around the original, under any wrapt wrappers already there.

    Upstream instrumentors take off whatever wrapper is on top when they uninstrument; sitting
    innermost, ours is never the one they take, nor above one of theirs that would then stay.
    """
    current = owner.__dict__[name]
    if not isinstance(current, wrapt.FunctionWrapper):
        setattr(owner, name, Patched(current, wrapper, owner, name))
        return
    while isinstance(current.__wrapped__, wrapt.FunctionWrapper):
        current = current.__wrapped__
    current.__wrapped__ = Patched(current.__wrapped__, wrapper, owner, name)


def _unwrap(owner: Any, name: str, wrapper: Wrapper) -> None:
    """Take ``wrapper`` out of ``owner.name``'s chain, wherever it is, leaving the others as they are."""
    current = owner.__dict__.get(name)
    if isinstance(current, _WRAPPERS) and current._self_wrapper is wrapper:
        setattr(owner, name, current.__wrapped__)
        return
    while isinstance(current, _WRAPPERS):
        inner = current.__wrapped__
        if isinstance(inner, _WRAPPERS) and inner._self_wrapper is wrapper:
            current.__wrapped__ = inner.__wrapped__
            return
        current = inner


def _holds(method: Any, wrapper: Wrapper) -> bool:
    """Whether ``wrapper`` is somewhere in ``method``'s chain of wrapt wrappers."""
    while isinstance(method, _WRAPPERS):
        if method._self_wrapper is wrapper:
            return True
        method = method.__wrapped__
    return False
