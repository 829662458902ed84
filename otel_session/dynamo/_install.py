"""Make NVIDIA Dynamo's frontend and mocker importable, installing them on demand.

``pip install ai-dynamo==1.6.1`` cannot succeed: it depends on ``aisimulate``, a placeholder wheel that
downloads from an unreachable vendor index (and only the planner uses it). Pip extras cannot say
``--no-deps``, so the ``dynamo`` extra carries the runtime dependencies and this module installs the
``ai-dynamo`` wheel itself without dependencies.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import shlex
import subprocess
import sys

__all__ = [
    "DYNAMO_VERSION",
    "DynamoInstallError",
    "dynamo_install_commands",
    "ensure_dynamo_installed",
    "missing_dynamo_modules",
]

log = logging.getLogger(__name__)

DYNAMO_VERSION = "1.6.1"

#: importable module -> requirement that provides it (the wheel itself is installed separately).
_RUNTIME_REQUIREMENTS: dict[str, str] = {
    "dynamo._core": f"ai-dynamo-runtime=={DYNAMO_VERSION}",
    "packaging": "packaging",
    "yaml": "pyyaml",
    "msgspec": "msgspec",
    "zmq": "pyzmq",
    "tokenizers": "tokenizers",
}
_DYNAMO_MODULES = ("dynamo.frontend", "dynamo.mocker")


class DynamoInstallError(RuntimeError):
    """Dynamo is missing and could not be installed automatically; the message says how to do it."""


def _importable(module: str) -> bool:
    """``find_spec`` only locates the module; it does not run Dynamo's heavy import-time code."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_dynamo_modules() -> list[str]:
    """Modules the local stack needs that cannot be found in this interpreter."""
    return [m for m in (*_DYNAMO_MODULES, *_RUNTIME_REQUIREMENTS) if not _importable(m)]


def dynamo_install_commands(python: str | None = None) -> list[list[str]]:
    """The two pip commands that install a working Dynamo; shown to users when we cannot run them."""
    exe = python or sys.executable
    return [
        [exe, "-m", "pip", "install", "--no-deps", f"ai-dynamo=={DYNAMO_VERSION}"],
        [exe, "-m", "pip", "install", *_RUNTIME_REQUIREMENTS.values()],
    ]


def _manual_instructions() -> str:
    cmds = "\n".join("  " + shlex.join(c) for c in dynamo_install_commands())
    return (
        f"NVIDIA Dynamo {DYNAMO_VERSION} is needed for the local Dynamo stack. Install it with:\n{cmds}\n"
        "(plain `pip install ai-dynamo` fails: its `aisimulate` dependency cannot be installed, "
        "hence --no-deps)"
    )


def _run_pip(cmd: list[str]) -> None:
    """Announced, with pip's own progress on stderr: installing into someone's environment is never
    silent (and a slow download is visibly a download, not a hung start-up)."""
    print(f"otel-session: installing: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr, check=False)
    except OSError as exc:
        raise DynamoInstallError(f"could not run pip ({exc}).\n{_manual_instructions()}") from exc
    if proc.returncode != 0:
        raise DynamoInstallError(
            f"`{shlex.join(cmd)}` failed with exit code {proc.returncode} (its output is above).\n\n"
            + _manual_instructions()
        )


def ensure_dynamo_installed(auto_install: bool = True) -> None:
    """Install Dynamo's frontend/mocker (and runtime deps) into this interpreter if they are missing.

    Cheap when everything is present: only module specs are looked up. With ``auto_install=False`` a
    missing piece raises :class:`DynamoInstallError` carrying the exact commands instead.
    """
    missing = missing_dynamo_modules()
    if not missing:
        _warn_on_other_version()
        return
    if not auto_install:
        raise DynamoInstallError(f"missing modules: {', '.join(missing)}.\n{_manual_instructions()}")
    print(
        f"otel-session: NVIDIA Dynamo {DYNAMO_VERSION} (frontend and mocker) is not installed in "
        f"{sys.executable}; installing it now for the local Dynamo stack (first use only; "
        "`otel-session install-dynamo` does the same)",
        file=sys.stderr,
        flush=True,
    )
    wheel_cmd, deps_cmd = dynamo_install_commands()
    if any(m in missing for m in _DYNAMO_MODULES):
        _run_pip(wheel_cmd)
    missing_reqs = [req for mod, req in _RUNTIME_REQUIREMENTS.items() if not _importable(mod)]
    if missing_reqs:
        _run_pip([*deps_cmd[:4], *missing_reqs])
    importlib.invalidate_caches()
    still_missing = missing_dynamo_modules()
    if still_missing:
        raise DynamoInstallError(
            f"pip succeeded but {', '.join(still_missing)} still cannot be imported.\n"
            + _manual_instructions()
        )


def _warn_on_other_version() -> None:
    """Other versions may lack flags we pass (1.4.x has no session-affinity mode); say so, don't reinstall."""
    try:
        version = importlib.metadata.version("ai-dynamo")
    except importlib.metadata.PackageNotFoundError:
        return  # e.g. a source checkout on sys.path
    if version != DYNAMO_VERSION:
        log.warning("ai-dynamo %s is installed; otel-session is tested with %s", version, DYNAMO_VERSION)
