"""Patching again after ``importlib.reload``: the hooks that patch a module when it is imported fire
once (wrapt's post-import hooks), but a reload (IPython's autoreload, a notebook's ``importlib.reload``)
runs the module anew in place, putting new, unpatched functions and classes where the patched ones were.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from otel_session import _faults

_LOCK = threading.Lock()


class _Reloads:
    """A ``sys.meta_path`` finder that acts only for ``importlib.reload`` (the one caller that passes
    ``target``) of a module something is hooked on: the module is found by the other finders, as
    usual, and the hooks run once it has been executed anew."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        hooks = self.hooks.get(fullname) if target is not None else None
        if not hooks:
            return None
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
    """Call ``hook(module)`` each time ``importlib.reload`` has run module ``name`` anew (the hooks
    check whether they are in force, as they cannot be removed)."""
    with _LOCK:
        _RELOADS.hooks.setdefault(name, []).append(hook)
        if _RELOADS not in sys.meta_path:
            sys.meta_path.insert(0, _RELOADS)
