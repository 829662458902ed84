"""``configure()``, ``unconfigure()`` and ``add_dynamo_hosts()``: install and remove what otel-session
does globally.

Settings are built completely before anything changes, so a bad one raises with the previous
configuration still in force; the instrumentors they ask for come from ``_registry``. Warnings are
logged after the lock is released: an application's log handler may call back into us.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from opentelemetry import propagate
from opentelemetry.propagators.textmap import TextMapPropagator

from otel_session import (
    _evidence,
    _faults,
    _fleet,
    _gathering,
    _pacing,
    _registry,
    _settings,
    _siblings,
    _stock,
    _threads,
    _tracing,
)
from otel_session._hosts import HostPattern
from otel_session._propagator import SessionPropagator
from otel_session._routers import DYNAMO
from otel_session._settings import Settings

# Re-entrant: a signal handler may call unconfigure() while configure() runs on the same thread.
_lock = threading.RLock()
_previous_textmap: TextMapPropagator | None = None
_told: set[str] = set()  # warnings logged since the last unconfigure()


def configure(
    dynamo_hosts: Iterable[str] | str | None = None,
    trusted_hosts: Iterable[str] | str | None = None,
    tracing: bool | None = None,
    *,
    routers: Mapping[str, Iterable[str] | str] | None = None,
    end_sessions: bool | None = None,
    servers: bool | None = None,
    trajectory_functions: Iterable[str] | str | None = None,
    siblings: str | None = None,
    strict_affinity: bool | None = None,
    pace_ms: float | None = None,
) -> Settings:
    """Deliver each trajectory's session to its routers and its baggage to ``trusted_hosts``.

    Each argument left as ``None`` is read from its variable: ``OTEL_SESSION_DYNAMO_HOSTS``,
    ``OTEL_SESSION_TRUSTED_HOSTS``, ``OTEL_SESSION_TRACING`` (unset: off), ``OTEL_SESSION_ROUTERS``
    (``PROFILE=PATTERN[,PATTERN...]`` separated by ``;``), ``OTEL_SESSION_END_SESSIONS``,
    ``OTEL_SESSION_SERVERS`` and ``OTEL_SESSION_TRAJECTORY_FUNCTIONS``. ``dynamo_hosts`` are the
    ``dynamo`` profile's hosts; ``routers`` maps a profile (``dynamo``, ``vllm-router``, ``smg``,
    ``litellm``, ``header:NAME``) to its host patterns. Installs the destination-aware propagator
    globally and instruments httpx, httpx2 (the openai SDK) and aiohttp when each is imported.
    ``servers=True`` puts the session middleware into every Starlette/FastAPI and aiohttp app the
    process builds. ``trajectory_functions`` (``module:Qualified.name``) makes every call of each
    named function a trajectory attempt. ``siblings`` (``OTEL_SESSION_SIBLINGS``: ``auto``, the
    default, ``fleet``, ``groups:K``, ``prompt`` or ``attempt``) says how attempts of one group
    (``trajectory(group=...)``, or the same first prompt) name a parent session. ``strict_affinity``
    (``OTEL_SESSION_STRICT_AFFINITY``, unset: off) keeps a session pinned after its router refused it
    for want of room (Dynamo's 529), so the client's retries get the same error. ``pace_ms``
    (``OTEL_SESSION_PACE_MS``; 0 to 1,000, 0: not paced) fixes the milliseconds between new parents'
    first requests at a router; unset, 40 while a burst of them fits 3 s (several frontends share
    their load views late), closer for a larger burst, 10 at least. Raises ``ValueError`` naming a
    bad argument or variable.
    """
    settings, warnings = _settings.build(
        dynamo_hosts,
        trusted_hosts,
        tracing,
        routers,
        end_sessions,
        servers,
        trajectory_functions,
        siblings,
        strict_affinity,
        pace_ms,
    )
    install(settings, warnings)
    return settings


def install(settings: Settings, warnings: list[str] | None = None) -> None:
    """Put ``settings`` in force with everything they ask for; on failure (tracing that cannot
    start) the previous configuration stays in force. Warnings are logged once the lock is released,
    each once until ``unconfigure()``."""
    with _faults.deferred():
        _warn_new(warnings or [])
        with _lock, _stock.settling():
            _install(settings)


def _warn_new(warnings: list[str]) -> None:
    """Log each warning not logged since the last ``unconfigure()``: configuring again from the same
    variables (interpreter start, then the application) says nothing new."""
    for warning in warnings:
        if warning not in _told:
            _told.add(warning)
            _faults.warn("%s", warning)


def _install(settings: Settings) -> None:
    global _previous_textmap
    previous = _settings.current
    _settings.set_active(settings)  # first: the instrumentors must see a configuration
    wanted = _registry.wanted(settings)
    # Ours before upstream's: upstream's uninstrument takes off whatever wrapper is on top, so its
    # wrappers must sit above ours. A missing SDK or bad exporter variable undoes all of this.
    for name in wanted:  # instrumented while its switch was off, or for other names: again
        instrumentor = _registry.instrumentor(name)
        if instrumentor.is_instrumented_by_opentelemetry and (
            not instrumentor.active or instrumentor.kind == "boundary"
        ):
            instrumentor.uninstrument()
    fresh = [name for name in wanted if not _registry.instrumentor(name).is_instrumented_by_opentelemetry]
    for name in fresh:
        _registry.instrumentor(name).instrument()
    try:
        _tracing.apply(settings.tracing, _registry.upstream_client_instrumentors())
    except Exception:
        _settings.set_active(previous)
        for name in fresh:  # only what this call instrumented: uninstrumenting the rest would warn
            _registry.instrumentor(name).uninstrument()
        for name in _registry.wanted(previous) if previous is not None else []:  # the boundaries it had
            if not _registry.instrumentor(name).is_instrumented_by_opentelemetry:
                _registry.instrumentor(name).instrument()
        raise
    for name in _registry.instrumentors():
        if name not in wanted and _registry.instrumentor(name).is_instrumented_by_opentelemetry:
            _registry.instrumentor(name).uninstrument()
    _threads.apply(True)
    if previous is not None and previous.pace != settings.pace:
        _pacing.forget()  # the turns taken at the old pace: the new one starts afresh
    current = propagate.get_global_textmap()
    if not isinstance(current, SessionPropagator):
        _previous_textmap = current
        propagate.set_global_textmap(SessionPropagator())


def unconfigure() -> None:
    """Undo ``configure()``: requests go out exactly as they would without otel-session.

    Trajectories still set their session in the context (so code keeps working), but nothing is sent.
    """
    global _previous_textmap
    with _faults.deferred(), _lock, _stock.settling():
        _settings.set_active(None)
        _told.clear()
        _evidence.forget()  # what the routers of this configuration showed, and who was unpinned
        _fleet.forget()  # the fleet sizes read and the step shape seen (``fleet``): the next
        _siblings.forget_shape()  # configuration may name other routers and run other steps
        _gathering.forget()
        _pacing.forget()  # every router's turn for new parents
        _tracing.apply(False)
        _threads.apply(False)
        for name in _registry.instrumentors():
            instrumentor = _registry.instrumentor(name)
            if instrumentor.is_instrumented_by_opentelemetry:
                instrumentor.uninstrument()
        if _previous_textmap is not None:
            propagate.set_global_textmap(_previous_textmap)
            _previous_textmap = None


def exact_host_port(address: str) -> str:
    """``host:port`` (or ``[v6]:port``) of ``address``, which must name one port; ``ValueError`` else.

    Accepts ``host:port``, ``[v6]:port`` or a URL with an explicit port (``http://10.0.0.5:3412/v1``).
    """
    text = address.strip() if isinstance(address, str) else ""
    try:
        parts = urlsplit(text if "://" in text else f"//{text}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or port is None or "*" in host or any(c.isspace() for c in text):
        raise ValueError(
            f"{address!r} is not an exact host:port: a runtime Dynamo host needs its port (e.g. "
            "10.0.0.5:3412 or http://10.0.0.5:3412/v1), so that other servers on the node do not match"
        )
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_dynamo_hosts(*addresses: str) -> list[str]:
    """Add exact ``host:port`` Dynamo hosts for this process and every process it starts afterwards.

    For a wrapper or frontend that picked a random port at runtime (NeMo-RL's, on the Ray node's
    address): ``otel_session.add_dynamo_hosts(f"{node_ip}:{port}")`` right after it listens. The
    active settings gain them, and ``OTEL_SESSION_DYNAMO_HOSTS`` in ``os.environ`` too (with the
    Dynamo hosts already in force, however they were configured), which every process started
    afterwards inherits (and a Ray ``runtime_env`` can copy). Returns that variable's new entries.
    Raises ``ValueError`` (changing nothing) for an address without a port.
    """
    added = [exact_host_port(address) for address in addresses]
    patterns = [HostPattern.parse(host) for host in added]
    name = _settings.ENV_DYNAMO_HOSTS
    entries = [entry.strip() for entry in os.environ.get(name, "").split(",") if entry.strip()]
    listed = set()
    for entry in entries:
        with contextlib.suppress(ValueError):  # a bad entry stays: each child warns about it, as here
            listed.add(HostPattern.parse(entry))
    with _lock:
        settings = _settings.current
        # Children inherit the variable, not this process's configure(): the Dynamo hosts in force
        # here (given in code, say) go into it too, or a child would know only the added ones.
        in_force = [p for profile, p in settings.rules.routes if profile is DYNAMO] if settings else []
        for pattern, text in [(p, str(p)) for p in in_force] + list(zip(patterns, added, strict=True)):
            if pattern not in listed:
                listed.add(pattern)
                entries.append(text)
        os.environ[name] = ",".join(entries)
        if settings is not None:
            known = {pattern for _, pattern in settings.rules.routes}
            _settings.set_active(settings.with_dynamo_hosts(p for p in patterns if p not in known))
    return entries


def activate_environment() -> None:
    """Deliver by the ``OTEL_SESSION_*`` variables where no ``configure()`` ran (upstream's distro).

    Tracing stays with whoever installed the SDK. A variable that cannot be read is one warning line
    and its fallback; a stock propagator that would leak is another warning, saying what to set.
    """
    settings, warnings = _settings.build(
        tracing=False, lenient=True, servers_default=True, say_if_empty=False
    )
    with _faults.deferred():
        _warn_new(warnings)
        with _lock:
            if _settings.current is None:
                _settings.set_active(settings)
    _stock.warn_stock_leaks()
