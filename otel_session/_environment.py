"""Configuring a process from its environment alone, failing open: zero-code mode and interpreter start.

Processes that a framework starts (NeMo-Gym's servers, Ray actors, subprocesses) have no place for a
``configure()`` line; they inherit variables. Two entry points read them: the ``otel_session`` distro
under ``opentelemetry-instrument``, and ``otel_session_autostart.pth`` (installed with the package)
when ``OTEL_SESSION_AUTO`` is true, for processes that ``opentelemetry-instrument`` does not reach.

Here a variable that cannot be honoured must not switch the whole library off (the application runs
on either way, so a traceback would only hide that no session reaches Dynamo): it costs one warning
line naming it, and everything else is still delivered. Tracing that cannot start means tracing off.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from otel_session import _config, _faults, _settings

ENV_AUTO = "OTEL_SESSION_AUTO"


def configure_from_environment() -> None:
    """``configure()`` from the ``OTEL_SESSION_*`` variables, servers on by default; never raises."""
    try:
        settings, warnings = _settings.build(lenient=True, servers_default=True)
        try:
            _config.install(settings, warnings)
        except Exception as exc:
            # Only tracing can fail here (a missing SDK, an exporter or processor that cannot start
            # with the OTEL_* variables, whatever it raises): tracing off, the rest delivered.
            if not settings.tracing:
                raise
            _faults.warn(
                "otel-session: %s (%s); tracing stays off, the rest is delivered as usual",
                exc,
                _settings.ENV_TRACING,
            )
            _config.install(dataclasses.replace(settings, tracing=False))
    except Exception as exc:  # a bug of ours: the application must start regardless
        _faults.report("configuring otel-session from the environment", exc)


_autostarted: list[bool] = []


def _is_launcher() -> bool:
    """Whether this interpreter runs ``opentelemetry-instrument`` itself, which only starts the real
    program (that one configures itself, from the distro): configuring the launcher too would log
    every warning twice."""
    argv = getattr(sys, "argv", None) or [""]
    return os.path.basename(str(argv[0])).lower().startswith("opentelemetry-instrument")


def autostart() -> None:
    """Run by ``otel_session_autostart.pth`` at interpreter start when ``OTEL_SESSION_AUTO`` is set.

    Once per process: some interpreters process a site directory twice (a venv's ``lib64`` link).
    """
    if _autostarted or _is_launcher():
        return
    _autostarted.append(True)
    try:
        if not _settings.parse_bool_env(ENV_AUTO):
            return
    except ValueError as exc:
        print(f"otel-session: {exc}; nothing is started from it at interpreter start", file=sys.stderr)
        return
    if _settings.current is None:
        configure_from_environment()
