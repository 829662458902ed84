"""The active configuration: which hosts are Dynamo, which are trusted, whether tracing is on.

It is a single immutable value swapped atomically by ``configure()``, so hooks running on other
threads always see one whole configuration, never half of an old one and half of a new one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from otel_session._hosts import HostPattern, HostRules, parse_patterns

ENV_DYNAMO_HOSTS = "OTEL_SESSION_DYNAMO_HOSTS"
ENV_TRUSTED_HOSTS = "OTEL_SESSION_TRUSTED_HOSTS"
ENV_TRACING = "OTEL_SESSION_TRACING"

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@dataclass(frozen=True)
class Settings:
    """One complete configuration; ``rules`` answers what each destination may receive."""

    rules: HostRules = field(default_factory=HostRules)
    tracing: bool = False


def parse_bool_env(name: str, default: bool = False) -> bool:
    """Read a boolean variable; anything but the usual spellings is a ``ValueError`` naming it."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: use one of true/false, 1/0, yes/no, on/off")


def _patterns(value: Iterable[str] | str | None, env: str) -> tuple[HostPattern, ...]:
    if value is None:
        try:
            return parse_patterns(os.environ.get(env))
        except ValueError as exc:
            raise ValueError(f"{env}: {exc}") from None
    return parse_patterns(value)


def build_settings(
    dynamo_hosts: Iterable[str] | str | None = None,
    trusted_hosts: Iterable[str] | str | None = None,
    tracing: bool | None = None,
) -> Settings:
    """Settings from arguments, each missing one read from its ``OTEL_SESSION_*`` variable."""
    dynamo = _patterns(dynamo_hosts, ENV_DYNAMO_HOSTS)
    trusted = _patterns(trusted_hosts, ENV_TRUSTED_HOSTS)
    if tracing is None:
        tracing = parse_bool_env(ENV_TRACING)
    return Settings(HostRules(dynamo, trusted), bool(tracing))


_active: Settings | None = None


def active() -> Settings | None:
    """The configuration installed by ``configure()``, or ``None`` before it / after ``unconfigure()``."""
    return _active


def set_active(settings: Settings | None) -> None:
    global _active
    _active = settings
