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

import sys

from otel_session import _config, _faults, _server_hooks, _settings

ENV_AUTO = "OTEL_SESSION_AUTO"

# variable -> (configure() argument that replaces it, the value used instead, what that means)
_FALLBACKS: dict[str, tuple[str, object, str]] = {
    _settings.ENV_TRACING: ("tracing", False, "tracing stays off"),
    _settings.ENV_END_SESSIONS: ("end_sessions", False, "sessions are not ended explicitly"),
    _settings.ENV_DYNAMO_HOSTS: ("dynamo_hosts", (), "no Dynamo host is configured from it"),
    _settings.ENV_TRUSTED_HOSTS: ("trusted_hosts", (), "no host is trusted with baggage"),
    _settings.ENV_ROUTERS: ("routers", {}, "no router is configured from it"),
    _server_hooks.ENV_SERVERS: ("servers", True, "servers are instrumented"),
}


def _warn(variable: str, problem: object, consequence: str) -> None:
    _faults.logger.warning(
        "otel-session: %s (%s); %s, the rest is delivered as usual", problem, variable, consequence
    )


def _arguments() -> dict[str, object]:
    """configure() arguments: each unreadable variable replaced by its fallback, with one warning."""
    arguments: dict[str, object] = {}
    try:
        arguments["servers"] = _server_hooks.servers_setting(None, default=True)
    except ValueError as exc:
        _warn(_server_hooks.ENV_SERVERS, exc, "servers are instrumented")
        arguments["servers"] = True
    for _ in range(len(_FALLBACKS)):
        try:
            _settings.build_settings(**{k: v for k, v in arguments.items() if k != "servers"})  # type: ignore[arg-type]
            return arguments
        except (ValueError, TypeError) as exc:
            named = [name for name in _FALLBACKS if name in str(exc) and _FALLBACKS[name][0] not in arguments]
            if not named:
                raise
            argument, value, consequence = _FALLBACKS[named[0]]
            _warn(named[0], exc, consequence)
            arguments[argument] = value
    return arguments


def configure_from_environment() -> None:
    """``configure()`` from the ``OTEL_SESSION_*`` variables, servers on by default; never raises."""
    try:
        arguments = _arguments()
        try:
            _config.configure(**arguments)  # type: ignore[arg-type]
        except (ImportError, ValueError) as exc:
            # Only tracing can still fail here (a missing SDK, an unusable OTLP exporter setting).
            if arguments.get("tracing") is False:
                raise
            _warn(_settings.ENV_TRACING, exc, "tracing stays off")
            _config.configure(**{**arguments, "tracing": False})  # type: ignore[arg-type]
    except Exception as exc:  # a bug of ours: the application must start regardless
        _faults.report("configuring otel-session from the environment", exc)


_autostarted: list[bool] = []


def autostart() -> None:
    """Run by ``otel_session_autostart.pth`` at interpreter start when ``OTEL_SESSION_AUTO`` is set.

    Once per process: some interpreters process a site directory twice (a venv's ``lib64`` link).
    """
    if _autostarted:
        return
    _autostarted.append(True)
    try:
        if not _settings.parse_bool_env(ENV_AUTO):
            return
    except ValueError as exc:
        print(f"otel-session: {exc}; otel-session is not started in this process", file=sys.stderr)
        return
    if _settings.current is None:
        configure_from_environment()
