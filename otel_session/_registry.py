"""The one registry of otel-session's instrumentors, and which of them a configuration wants.

They are found as ``opentelemetry-instrument`` finds them, through the ``opentelemetry_instrumentor``
entry points (ours are those whose module is in this package), so the set is written once, in
``pyproject.toml``, and ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names every hook of ours (``*``: all).
Each instrumentor says which switch governs it (``kind``) and which upstream instrumentation it stands
in for (``replaces``, ``upstream``).
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

from otel_session import _faults
from otel_session._settings import Settings

ENV_DISABLED_INSTRUMENTATIONS = "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"
ENTRY_POINT_GROUP = "opentelemetry_instrumentor"
_PACKAGE = "otel_session."
_found: dict[str, Any] | None = None  # entry point name -> instrumentor class, found once


def instrumentors() -> dict[str, Any]:
    """Our instrumentor classes by entry point name, as registered in ``pyproject.toml``."""
    global _found
    if _found is None:
        found: dict[str, Any] = {}
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry_point.value.startswith(_PACKAGE) and entry_point.name not in found:
                try:
                    found[entry_point.name] = entry_point.load()
                except Exception as exc:  # one broken instrumentor must not take the others down
                    _faults.report(f"loading the {entry_point.name} instrumentor", exc)
        if not found:
            _faults.warn(
                "otel-session: no instrumentors of ours are registered, so no request will carry a "
                "session: install the package (pip install .) rather than putting it on the path"
            )
        _found = found
    return _found


def disabled() -> set[str]:
    """``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` as upstream's loader reads it (``*``: all)."""
    return {
        name.strip() for name in os.environ.get(ENV_DISABLED_INSTRUMENTATIONS, "").split(",") if name.strip()
    }


def wanted(settings: Settings) -> list[str]:
    """The instrumentors ``settings`` ask for that are not disabled, whether or not their library can
    be found yet: each patches its library when it is imported, and a library put on ``sys.path``
    after start (a driver's ``sys.path.insert``, Ray's ``working_dir``) is imported after start too."""
    off = disabled()
    if "*" in off:
        return []
    switch = {"client": True, "server": settings.servers, "boundary": True}
    return [
        name for name, kind in instrumentors().items() if name not in off and switch.get(kind.kind, False)
    ]


def upstream_client_instrumentors() -> list[tuple[str, str]]:
    """(module, class) of the upstream instrumentations that record client spans while tracing is
    on, one per client instrumentor of ours that is not disabled."""
    off = disabled()
    if "*" in off:
        return []
    return [
        kind.upstream
        for name, kind in instrumentors().items()
        if kind.upstream is not None and name not in off and not off & set(kind.replaces) and kind.installed()
    ]


def instrumentor(name: str) -> Any:
    return instrumentors()[name]()
