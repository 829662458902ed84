"""The active configuration: which routers sit where, which hosts are trusted, what is switched on.

It is a single immutable value swapped atomically by ``configure()``, so hooks running on other
threads always see one whole configuration, never half of an old one and half of a new one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from otel_session._hosts import HostPattern, HostRules, parse_patterns
from otel_session._routers import DYNAMO, Profile, profile_named

ENV_DYNAMO_HOSTS = "OTEL_SESSION_DYNAMO_HOSTS"
ENV_TRUSTED_HOSTS = "OTEL_SESSION_TRUSTED_HOSTS"
ENV_ROUTERS = "OTEL_SESSION_ROUTERS"
ENV_TRACING = "OTEL_SESSION_TRACING"
ENV_END_SESSIONS = "OTEL_SESSION_END_SESSIONS"

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}

Patterns = Iterable[str] | str
Routers = Mapping[str, Patterns]


@dataclass(frozen=True)
class Settings:
    """One complete configuration; ``rules`` answers what each destination may receive."""

    rules: HostRules = field(default_factory=HostRules)
    tracing: bool = False
    end_sessions: bool = False


def parse_bool(name: str, raw: str | None, default: bool = False, blank_is_unset: bool = True) -> bool:
    """Read a boolean setting; anything but the usual spellings is a ``ValueError`` naming it (a
    blank one too, unless ``blank_is_unset``: an empty variable is the variable unset)."""
    if raw is None or (blank_is_unset and not raw.strip()):
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: use one of true/false, 1/0, yes/no, on/off")


def parse_bool_env(name: str, default: bool = False) -> bool:
    """``parse_bool`` of the environment variable ``name``."""
    return parse_bool(name, os.environ.get(name), default)


def flag(argument: str, value: object, env: str, default: bool = False) -> bool:
    """A switch passed to ``configure()``: ``True``/``False``, or a string spelled as its variable
    accepts (an application passing on a config file's ``"false"`` must not switch a feature on, as
    ``bool("false")`` would); ``None`` reads the variable ``env``; 0 and 1 as the booleans they
    spell. Anything else is a ``TypeError``."""
    if value is None:
        return parse_bool_env(env, default)
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return parse_bool(argument, value, blank_is_unset=False)  # "" passed on says nothing: refused
    raise TypeError(f"{argument} must be True, False or None, not {value!r}")


def _patterns(value: Patterns | None, env: str) -> tuple[HostPattern, ...]:
    if value is None:
        try:
            return parse_patterns(os.environ.get(env))
        except ValueError as exc:
            raise ValueError(f"{env}: {exc}") from None
    return parse_patterns(value)


def parse_routers(text: str, name: str = ENV_ROUTERS) -> dict[str, str]:
    """``PROFILE=PATTERN[,PATTERN...]`` entries separated by ``;`` (blank entries skipped)."""
    routers: dict[str, str] = {}
    for entry in text.split(";"):
        if not entry.strip():
            continue
        profile, sep, patterns = entry.partition("=")
        if not sep or not profile.strip() or not patterns.strip():
            raise ValueError(
                f"{name}: {entry.strip()!r} is not PROFILE=PATTERN[,PATTERN...] "
                "(entries separated by ';', e.g. 'vllm-router=10.0.0.5:8000;smg=*.gateway.internal')"
            )
        key = profile.strip()
        routers[key] = f"{routers[key]},{patterns}" if key in routers else patterns
    return routers


def _routes(dynamo_hosts: Patterns | None, routers: Routers | None) -> list[tuple[Profile, HostPattern]]:
    routes = [(DYNAMO, pattern) for pattern in _patterns(dynamo_hosts, ENV_DYNAMO_HOSTS)]
    env_routers = routers is None
    if env_routers:
        routers = parse_routers(os.environ.get(ENV_ROUTERS, ""))
    assert routers is not None
    if not isinstance(routers, Mapping):
        raise TypeError(f"routers must be a mapping of profile -> patterns, not {type(routers).__name__}")
    for name, patterns in routers.items():
        try:
            profile = profile_named(name)
            routes.extend((profile, pattern) for pattern in parse_patterns(patterns))
        except ValueError as exc:
            raise ValueError(f"{ENV_ROUTERS}: {exc}" if env_routers else str(exc)) from None
    return routes


def build_settings(
    dynamo_hosts: Patterns | None = None,
    trusted_hosts: Patterns | None = None,
    tracing: bool | None = None,
    routers: Routers | None = None,
    end_sessions: bool | None = None,
) -> Settings:
    """Settings from arguments, each missing one read from its ``OTEL_SESSION_*`` variable."""
    routes = _routes(dynamo_hosts, routers)
    trusted = _patterns(trusted_hosts, ENV_TRUSTED_HOSTS)
    return Settings(
        HostRules(routes, trusted),
        flag("tracing", tracing, ENV_TRACING),
        flag("end_sessions", end_sessions, ENV_END_SESSIONS),
    )


# The configuration installed by ``configure()``, or ``None`` before it / after ``unconfigure()``.
# Read in place as ``_settings.current`` (every request reads it, and a call would cost more than
# the read); only ``set_active`` writes it, so a module never keeps a copy that goes stale.
current: Settings | None = None


def set_active(settings: Settings | None) -> None:
    """Install ``settings`` for every reader at once (``configure()``, ``unconfigure()``)."""
    global current
    current = settings
