"""Patching again after ``importlib.reload`` or a fresh import: the hooks that patch a module when it
is imported fire once (wrapt's post-import hooks), but a reload (IPython's autoreload, a notebook's
``importlib.reload``) runs the module anew in place, and a module deleted from ``sys.modules`` and
imported again (a test isolating a library, a plugin system starting over) is a new module: either
way new, unpatched functions and classes stand where the patched ones were.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import wrapt

from otel_session import _faults

_LOCK = threading.Lock()


class _Reloads:
    """A ``sys.meta_path`` finder that acts only for a module something is hooked on, when it is
    executed anew: ``importlib.reload`` (the one caller that passes ``target``), or an import of it
    after its first (wrapt's hook ran at the first; ``seen``). The module is found by the other
    finders, as usual, and the hooks run once it has been executed."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable[[ModuleType], None]]] = {}
        self.seen: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        hooks = self.hooks.get(fullname)
        if not hooks:
            return None
        if target is None and fullname not in self.seen:
            return None  # its first import (wrapt's own finder asks here too): wrapt's hook patches it
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        ran = getattr(loader, "exec_module", None)
        if ran is None:
            return spec

        def exec_module(module: ModuleType) -> None:
            del loader.exec_module  # this reload only: the loader is left as it was
            ran(module)
            for hook in list(hooks):
                try:
                    hook(module)
                except Exception as exc:  # the reload itself has succeeded: never fail it
                    _faults.report(f"patching {fullname} again after a reload", exc)

        with contextlib.suppress(AttributeError, TypeError):  # a loader taking no attribute: left unpatched
            loader.exec_module = exec_module
        return spec


_RELOADS = _Reloads()


def when_reloaded(name: str, hook: Callable[[ModuleType], None]) -> None:
    """Call ``hook(module)`` each time module ``name`` has been run anew after its first import (a
    reload, or an import once it was deleted from ``sys.modules``); the hooks check whether they are
    in force, as they cannot be removed, and patch nothing twice."""
    with _LOCK:
        marked = name in _RELOADS.hooks
        _RELOADS.hooks.setdefault(name, []).append(hook)
        if _RELOADS not in sys.meta_path:
            sys.meta_path.insert(0, _RELOADS)
    if not marked:  # once imported (now, or at its first import) wrapt's hooks have run, and are spent
        wrapt.register_post_import_hook(lambda module: _RELOADS.seen.add(name), name)
