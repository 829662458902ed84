"""``configure()`` and ``unconfigure()``: install and remove everything otel-session does globally.

Configuration is checked completely before anything changes, so a bad pattern or variable raises
with the previous configuration still in force. Calling ``configure()`` again swaps the whole
configuration at once; ``unconfigure()`` puts back the propagator that was global before the first
``configure()`` and takes the client instrumentation off.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from opentelemetry import propagate
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator

from otel_session import _faults, _server_hooks, _settings, _tracing
from otel_session._propagator import SessionPropagator
from otel_session._settings import Settings

if TYPE_CHECKING:
    from otel_session._instrumentor import SessionInstrumentor

ENV_DISABLED_INSTRUMENTATIONS = "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"
# entry point name -> (module, instrumentor class), as in pyproject's opentelemetry_instrumentor group.
# Imported only when used: the propagator entry point imports this package while
# ``opentelemetry.instrumentation`` itself may still be importing.
INSTRUMENTORS: dict[str, tuple[str, str]] = {
    "otel_session_httpx": ("otel_session._httpx_instrumentor", "HTTPXSessionInstrumentor"),
    "otel_session_httpx2": ("otel_session._httpx_instrumentor", "HTTPX2SessionInstrumentor"),
    "otel_session_aiohttp": ("otel_session._aiohttp_instrumentor", "AioHttpSessionInstrumentor"),
}

_lock = threading.Lock()
_previous_textmap: TextMapPropagator | None = None
_arguments: dict[str, object] = {}


def configure(
    dynamo_hosts: Iterable[str] | str | None = None,
    trusted_hosts: Iterable[str] | str | None = None,
    tracing: bool | None = None,
    *,
    routers: Mapping[str, Iterable[str] | str] | None = None,
    end_sessions: bool | None = None,
    servers: bool | None = None,
) -> Settings:
    """Deliver each trajectory's session to its routers and its baggage to ``trusted_hosts``.

    Each argument left as ``None`` is read from its variable: ``OTEL_SESSION_DYNAMO_HOSTS``,
    ``OTEL_SESSION_TRUSTED_HOSTS``, ``OTEL_SESSION_TRACING`` (unset: off), ``OTEL_SESSION_ROUTERS``
    (``PROFILE=PATTERN[,PATTERN...]`` separated by ``;``) and ``OTEL_SESSION_END_SESSIONS``.
    ``dynamo_hosts`` are the ``dynamo`` profile's hosts; ``routers`` maps a profile (``dynamo``,
    ``vllm-router``, ``smg``, ``litellm``, ``header:NAME``) to its host patterns. Installs the
    destination-aware propagator globally and instruments httpx, httpx2 (the openai SDK) and aiohttp
    when each is imported. ``servers=True`` (or ``OTEL_SESSION_SERVERS``; on by default in zero-code
    mode) puts the session middleware into every Starlette/FastAPI and aiohttp app the process builds.
    Raises ``ValueError`` for a malformed pattern, profile or variable.
    """
    global _previous_textmap, _arguments
    called_with = dict(locals())  # every parameter, for add_dynamo_hosts() to configure again
    settings = _settings.build_settings(dynamo_hosts, trusted_hosts, tracing, routers, end_sessions)
    instrument_servers = _server_hooks.servers_setting(servers)
    if not settings.rules:
        _faults.logger.warning(
            "otel-session: no routers or trusted hosts configured, so no request will carry a session; "
            "pass dynamo_hosts=[...] or set %s (or %s)",
            _settings.ENV_DYNAMO_HOSTS,
            _settings.ENV_ROUTERS,
        )
    with _lock:
        previous = _settings.current
        _settings.set_active(settings)  # first: the instrumentors must see a configuration
        # Ours before upstream's: upstream's uninstrument takes off whatever wrapper is on top, so its
        # wrappers must sit above ours. A missing SDK or bad exporter variable then undoes all of this.
        already = {name for name in INSTRUMENTORS if _instrumented(name)}
        fresh = [name for name in instrument_clients() if name not in already]
        try:
            _tracing.apply(settings.tracing)
        except Exception:
            _settings.set_active(previous)
            for name in fresh:  # only what this call instrumented: uninstrumenting the rest would warn
                _instrumentor_class(name)().uninstrument()
            raise
        current = propagate.get_global_textmap()
        if not isinstance(current, SessionPropagator):
            _previous_textmap = current
            propagate.set_global_textmap(SessionPropagator())
        if instrument_servers:
            _server_hooks.install()
        else:
            _server_hooks.uninstall()
        _arguments = called_with
    return settings


def _instrumentor_class(name: str) -> type[SessionInstrumentor]:
    module, class_name = INSTRUMENTORS[name]
    found: type[SessionInstrumentor] = getattr(importlib.import_module(module), class_name)
    return found


def _instrumented(name: str) -> bool:
    return bool(_instrumentor_class(name)().is_instrumented_by_opentelemetry)


def _clients() -> list[SessionInstrumentor]:
    return [_instrumentor_class(name)() for name in INSTRUMENTORS]


def configured_arguments() -> dict[str, object]:
    """The arguments of the ``configure()`` now in force (``{}`` when none is)."""
    return dict(_arguments) if _settings.current is not None else {}


def instrument_clients() -> list[str]:
    """Instrument every installed client library not disabled; returns the entry point names used."""
    disabled = {
        name.strip() for name in os.environ.get(ENV_DISABLED_INSTRUMENTATIONS, "").split(",") if name.strip()
    }
    done = []
    for name in INSTRUMENTORS:
        instrumentor_class = _instrumentor_class(name)
        if name in disabled or not instrumentor_class.installed():
            continue
        instrumentor_class().instrument()
        done.append(name)
    return done


def unconfigure() -> None:
    """Undo ``configure()``: requests go out exactly as they would without otel-session.

    Trajectories still set their session in the context (so code keeps working), but nothing is sent.
    """
    global _previous_textmap
    with _lock:
        _settings.set_active(None)
        _tracing.apply(False)
        _server_hooks.uninstall()
        for instrumentor in _clients():
            if instrumentor.is_instrumented_by_opentelemetry:
                instrumentor.uninstrument()
        if _previous_textmap is not None:
            propagate.set_global_textmap(_previous_textmap)
            _previous_textmap = None


_STOCK = {"W3CBaggagePropagator": "baggage", "TraceContextTextMapPropagator": "tracecontext"}
_SENDS = {"baggage": "baggage (session.id)", "tracecontext": "traceparent"}


def stock_leaks(propagator: TextMapPropagator) -> list[str]:
    """The stock propagators in ``propagator`` that send our members or spans to every host.

    A stock ``baggage`` propagator sends ``session.id`` everywhere and ``tracecontext`` sends
    ``traceparent`` everywhere. Composed before ours, ours takes their copies back on the requests of
    the clients it instruments, but not on any other client's; after ours, or without ours, nothing does.
    """
    members = list(propagator._propagators) if isinstance(propagator, CompositePropagator) else [propagator]
    return [_STOCK[type(p).__name__] for p in members if type(p).__name__ in _STOCK]


def activate_environment() -> None:
    """Deliver by the ``OTEL_SESSION_*`` variables where no ``configure()`` ran (upstream's distro).

    Tracing stays with whoever installed the SDK. A variable that cannot be read is one warning line;
    a stock propagator that would leak (``OTEL_PROPAGATORS``) is another, saying what to set.
    """
    try:
        settings = _settings.build_settings(tracing=False)
    except ValueError as exc:
        _faults.logger.warning("otel-session: %s; no session is delivered until it is fixed", exc)
        return
    _settings.set_active(settings)
    leaks = stock_leaks(propagate.get_global_textmap())
    if leaks:
        _faults.logger.warning(
            "otel-session: OTEL_PROPAGATORS includes the stock %s propagator(s), which send %s to every "
            "host; set OTEL_PROPAGATORS=dynamo_session (it sends traceparent and baggage itself, only "
            "to routers and trusted hosts) or run with OTEL_PYTHON_DISTRO=otel_session",
            " and ".join(leaks),
            " and ".join(_SENDS[name] for name in leaks),
        )
