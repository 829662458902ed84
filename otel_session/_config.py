"""``configure()`` and ``unconfigure()``: install and remove everything otel-session does globally.

Configuration is checked completely before anything changes, so a bad pattern or variable raises
with the previous configuration still in force. Calling ``configure()`` again swaps the whole
configuration at once; ``unconfigure()`` puts back the propagator and client methods it replaced.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from opentelemetry import propagate
from opentelemetry.propagators.textmap import TextMapPropagator

from otel_session import _clients, _faults, _settings, _tracing
from otel_session._propagator import SessionPropagator
from otel_session._settings import Settings

_lock = threading.Lock()
_previous_textmap: TextMapPropagator | None = None


def configure(
    dynamo_hosts: Iterable[str] | str | None = None,
    trusted_hosts: Iterable[str] | str | None = None,
    tracing: bool | None = None,
) -> Settings:
    """Deliver each trajectory's session to ``dynamo_hosts`` and its baggage to ``trusted_hosts``.

    Each argument left as ``None`` is read from ``OTEL_SESSION_DYNAMO_HOSTS``,
    ``OTEL_SESSION_TRUSTED_HOSTS`` or ``OTEL_SESSION_TRACING`` (unset: tracing off). Patterns are
    ``host``, ``host:port``, ``*.domain``, IP addresses (IPv6 in brackets with a port) or URLs.
    Installs the destination-aware propagator globally and hooks httpx, httpx2 (the openai SDK) and
    aiohttp, whichever are installed. Raises ``ValueError`` for a malformed pattern or variable.
    """
    global _previous_textmap
    settings = _settings.build_settings(dynamo_hosts, trusted_hosts, tracing)
    if not settings.rules.dynamo:
        _faults.logger.warning(
            "otel-session: no Dynamo hosts configured, so no request will carry %s; pass "
            "dynamo_hosts=[...] or set %s",
            "X-Dynamo-Session-ID",
            _settings.ENV_DYNAMO_HOSTS,
        )
    with _lock:
        _tracing.apply(settings.tracing)  # first: a missing SDK or bad exporter variable changes nothing
        current = propagate.get_global_textmap()
        if not isinstance(current, SessionPropagator):
            _previous_textmap = current
            propagate.set_global_textmap(SessionPropagator())
        _clients.install()
        _settings.set_active(settings)
    return settings


def unconfigure() -> None:
    """Undo ``configure()``: requests go out exactly as they would without otel-session.

    Trajectories still set their session in the context (so code keeps working), but nothing is sent.
    """
    global _previous_textmap
    with _lock:
        _settings.set_active(None)
        _tracing.apply(False)
        _clients.uninstall()
        if _previous_textmap is not None:
            propagate.set_global_textmap(_previous_textmap)
            _previous_textmap = None
