"""The configuration as a value: built from arguments and the environment, and the one in force.

A ``Settings`` is immutable and swapped whole by ``configure()``, so hooks running on other threads
always see one whole configuration, never half of an old one and half of a new one. It is built
field by field, each from its argument or else its variable, and a bad one is a ``SettingError``
naming that argument or variable. Zero-code mode builds it leniently: a variable that cannot be
read costs one warning and its fallback, and a pattern list keeps its good entries. (Over 300 lines:
eleven arguments and their variables, each read strictly and leniently, in one place.)
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from otel_session import _group_keys
from otel_session._hosts import HostPattern, HostRules
from otel_session._pacing import ENV_PACE_MS, PACE, WIDE
from otel_session._routers import DYNAMO, Profile, profile_named
from otel_session._siblings import DEFAULT as DEFAULT_SIBLINGS
from otel_session._siblings import ENV_SIBLINGS, Siblings

ENV_DYNAMO_HOSTS = "OTEL_SESSION_DYNAMO_HOSTS"
ENV_TRUSTED_HOSTS = "OTEL_SESSION_TRUSTED_HOSTS"
ENV_ROUTERS = "OTEL_SESSION_ROUTERS"
ENV_TRACING = "OTEL_SESSION_TRACING"
ENV_END_SESSIONS = "OTEL_SESSION_END_SESSIONS"
ENV_SERVERS = "OTEL_SESSION_SERVERS"
ENV_ADOPT = "OTEL_SESSION_ADOPT"
ENV_TRAJECTORY_FUNCTIONS = "OTEL_SESSION_TRAJECTORY_FUNCTIONS"
ENV_STRICT_AFFINITY = "OTEL_SESSION_STRICT_AFFINITY"

PACE_MS_MAX = 1000  # a second between new parents: 4 of them a router within the 4 s bound
PACE_WORDS = f"{PACE * 1000:g} to {WIDE * 1000:g} ms apart, by the burst"  # unset: ``_pacing.apart``
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}

Patterns = Iterable[str] | str
Routers = Mapping[str, Patterns]


@dataclass(frozen=True)
class Settings:
    """One complete configuration; ``rules`` answers what each destination may receive.

    ``adopt``: where servers keep their own session ID, ``("session", KEY)`` (Starlette's
    ``request.session[KEY]``) or ``("cookie", NAME)``. ``trajectory_functions``: the functions each
    call of which is a trajectory attempt, as ``module:Qualified.name``. ``siblings``: how attempts
    that share a group (``trajectory(group=...)``, NeMo-RL's samples of one prompt) name a parent.
    """

    rules: HostRules = field(default_factory=HostRules)
    tracing: bool = False
    end_sessions: bool = False
    servers: bool = False
    adopt: tuple[str, str] | None = None
    trajectory_functions: tuple[str, ...] = ()
    siblings: Siblings = DEFAULT_SIBLINGS
    strict_affinity: bool = False
    pace: float | None = None  # seconds between new parents at a router; None: by the burst

    def with_dynamo_hosts(self, patterns: Iterable[HostPattern]) -> Settings:
        """These settings with more Dynamo host patterns."""
        routes = [*self.rules.routes, *((DYNAMO, pattern) for pattern in patterns)]
        return replace(self, rules=HostRules(routes, self.rules.trusted))


class SettingError(ValueError):
    """A setting that cannot be honoured; ``name`` is the argument or variable it came from."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


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
    raise SettingError(name, f"{name}={raw!r} is not a boolean: use one of true/false, 1/0, yes/no, on/off")


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
    raise SettingError(argument, f"{argument} must be True, False or None, not {value!r}")


class _Reader:
    """Reads settings from arguments or, for each argument left ``None``, its variable.

    Strict (``configure()``): the first bad one raises a ``SettingError``. Lenient (zero-code mode):
    a bad variable, or a bad entry of a list variable, is one warning in ``warnings`` and is left out.
    """

    def __init__(self, lenient: bool) -> None:
        self.lenient = lenient
        self.warnings: list[str] = []
        self.failed: set[str] = set()  # the variables something was left out of (lenient)

    def _fail(self, name: str, message: str, consequence: str) -> None:
        if not self.lenient:
            raise SettingError(name, message)
        self.failed.add(name)
        named = message if name in message else f"{message} ({name})"  # the variable named once
        self.warnings.append(f"otel-session: {named}; {consequence}, the rest is delivered as usual")

    def _items(self, value: object, name: str) -> list[str]:
        if isinstance(value, str):
            return [item for item in value.split(",") if item.strip()]
        try:
            items: list[str] = list(value)  # type: ignore[call-overload]
        except TypeError:
            raise SettingError(
                name, f"{name} must be a list of strings, not {type(value).__name__}"
            ) from None
        return items

    def patterns(self, value: Patterns | None, argument: str, env: str) -> tuple[HostPattern, ...]:
        """Host patterns, entry by entry: a variable's bad entry is left out (lenient) or raises."""
        name = argument if value is not None else env
        items = self._items(value if value is not None else os.environ.get(env, ""), name)
        return tuple(self._each(items, name, name, strict=value is not None))

    def _each(
        self, items: list[str], name: str, label: str, *, strict: bool, routers: bool = False
    ) -> list[HostPattern]:
        """Each item as a host pattern. A bad one raises, naming the argument, where ``strict``, or is
        left out with one warning naming the variable (zero-code mode); ``label`` heads the message."""
        found = []
        for item in items:
            try:
                found.append(HostPattern.parse(item))
            except (TypeError, ValueError) as exc:
                if strict:
                    raise SettingError(name, f"{label}: {exc}") from None
                hint = " (separate routers with ';')" if routers and "=" in str(item) else ""
                self._fail(name, f"{label}: {exc}{hint}", "that entry is left out")
        return found

    def routes(
        self, dynamo_hosts: Patterns | None, routers: Routers | None
    ) -> list[tuple[Profile, HostPattern]]:
        routes = [(DYNAMO, p) for p in self.patterns(dynamo_hosts, "dynamo_hosts", ENV_DYNAMO_HOSTS)]
        if routers is None:
            routers, malformed = parse_routers(os.environ.get(ENV_ROUTERS, ""))
            for message in malformed:  # strict: the first raises; lenient: each left out, the rest read
                self._fail(ENV_ROUTERS, message, "that entry is left out")
            name = ENV_ROUTERS
        else:
            name = "routers"
        if not isinstance(routers, Mapping):
            raise SettingError(
                "routers", f"routers must be a mapping of profile -> patterns, not {type(routers).__name__}"
            )
        strict = name != ENV_ROUTERS
        for profile_name, patterns in routers.items():
            try:
                profile = profile_named(profile_name)
            except (TypeError, ValueError) as exc:
                if strict:
                    raise SettingError(name, f"routers: {exc}") from None
                self._fail(name, f"{ENV_ROUTERS}: {exc}", f"router {profile_name!r} is not configured")
                continue
            label = f"routers[{profile_name!r}]" if strict else f"{ENV_ROUTERS}: {profile_name}"
            items = [] if patterns is None else self._items(patterns, label)
            found = self._each(items, name, label, strict=strict, routers=True)
            routes += [(profile, pattern) for pattern in found]
        return self._one_profile_per_pattern(routes, name)

    def _one_profile_per_pattern(
        self, routes: list[tuple[Profile, HostPattern]], name: str
    ) -> list[tuple[Profile, HostPattern]]:
        """A pattern given to two profiles: a destination gets one profile's header, so the first keeps it."""
        kept: dict[HostPattern, Profile] = {}
        for profile, pattern in routes:
            first = kept.setdefault(pattern, profile)
            if first is not profile:
                self._fail(
                    name,
                    f"{name}: host pattern '{pattern}' is given to both {first.name} and {profile.name}, but "
                    f"a destination gets one router's header",
                    f"{first.name} keeps it",
                )
        return [(profile, pattern) for pattern, profile in kept.items()]

    def flag(
        self, argument: str, value: object, env: str, default: bool, fallback: bool, meaning: str
    ) -> bool:
        try:
            return flag(argument, value, env, default)
        except SettingError as exc:
            if value is not None:
                raise
            self._fail(env, str(exc), meaning)
            return fallback

    def adopt(self) -> tuple[str, str] | None:
        """``OTEL_SESSION_ADOPT``; a bad value is a warning and adopts nothing, even when strict: a
        server must keep serving whatever it says."""
        raw = os.environ.get(ENV_ADOPT, "")
        if not raw.strip():
            return None
        kind, sep, name = raw.strip().partition(":")
        kind, name = kind.strip().lower(), name.strip()
        if (
            sep
            and kind in ("session", "cookie")
            and name
            and not any(c.isspace() or c in ",;=" for c in name)
        ):
            return kind, name
        self.warnings.append(
            f"otel-session: {ENV_ADOPT}={raw!r} is not understood, so no server-side session ID is adopted; "
            "use session:KEY (request.session[KEY], e.g. session:session_id for NeMo-Gym) or cookie:NAME"
        )
        return None

    def siblings(self, value: object) -> Siblings:
        """``attempt``, ``prompt``, ``fleet`` or ``groups:K``; a bad variable keeps the default (lenient)."""
        name = "siblings" if value is not None else ENV_SIBLINGS
        raw = value if value is not None else os.environ.get(ENV_SIBLINGS, "")
        if isinstance(raw, Siblings):
            return raw
        if isinstance(raw, str) and not raw.strip() and value is None:
            return DEFAULT_SIBLINGS
        try:
            if not isinstance(raw, str):
                raise ValueError(f"must be a string such as 'groups:2', not {type(raw).__name__}")
            return Siblings.parse(raw)
        except ValueError as exc:
            if value is not None:
                raise SettingError(name, f"{name}: {exc}") from None
            self._fail(name, f"{name}: {exc}", f"siblings are keyed as {DEFAULT_SIBLINGS}")
            return DEFAULT_SIBLINGS

    def pace(self, value: object) -> float | None:
        """Milliseconds between new parents at a router, 0 to ``PACE_MS_MAX`` (0: not paced), as
        seconds; ``None`` where none is set (paced by the burst), as a bad variable (lenient)."""
        name = "pace_ms" if value is not None else ENV_PACE_MS
        raw = value if value is not None else os.environ.get(ENV_PACE_MS, "").strip()
        if raw == "" and value is None:
            return None
        try:
            if isinstance(raw, bool) or not isinstance(raw, numbers.Number | str):
                raise ValueError  # numpy's, Decimal and Fraction are Numbers; a bare __float__ is not read
            ms = float(raw)  # type: ignore[arg-type]  # a complex number: TypeError
            if not 0 <= ms <= PACE_MS_MAX:  # NaN too
                raise ValueError
        except (TypeError, ValueError):
            message = f"{name}: {raw!r} is not a number of milliseconds from 0 to {PACE_MS_MAX}"
            if value is not None:
                raise SettingError(name, message) from None
            self._fail(name, message, f"new parents are paced {PACE_WORDS}")
            return None
        return ms / 1000

    def functions(self, value: Iterable[str] | str | None) -> tuple[str, ...]:
        """``module:Qualified.name`` entries, each with its ``[group=...]`` if it has one; a bad one
        raises (an argument) or is left out (a variable; one whose only fault is its ``[...]`` applies
        without a group key, so a typo in a spec does not switch the boundary off)."""
        name = "trajectory_functions" if value is not None else ENV_TRAJECTORY_FUNCTIONS
        raw = value if value is not None else os.environ.get(name, "")
        found: list[str] = []
        for item in _group_keys.split(raw) if isinstance(raw, str) else self._items(raw, name):
            try:
                if not isinstance(item, str):
                    raise ValueError(f"{item!r} is not module:Qualified.name")
                found.append(_group_keys.canonical(*_group_keys.entry(item)))
            except ValueError as exc:
                if value is not None:
                    raise SettingError(name, f"{name}: {exc}") from None
                named = _group_keys.name_of(item) if isinstance(item, str) else None
                if named is None:
                    self._fail(name, f"{name}: {exc}", "that entry is left out")
                    continue
                # Only the group spec is bad: the boundary still opens attempts, grouped by prompt.
                self._fail(name, f"{name}: {exc}", f"{named} applies without a group key")
                found.append(named)
        return tuple(dict.fromkeys(found))


def build(
    dynamo_hosts: Patterns | None = None,
    trusted_hosts: Patterns | None = None,
    tracing: object = None,
    routers: Routers | None = None,
    end_sessions: object = None,
    servers: object = None,
    trajectory_functions: Iterable[str] | str | None = None,
    siblings: object = None,
    strict_affinity: object = None,
    pace_ms: object = None,
    *,
    lenient: bool = False,
    servers_default: bool = False,
    say_if_empty: bool = True,
) -> tuple[Settings, list[str]]:
    """Settings from arguments, each missing one read from its ``OTEL_SESSION_*`` variable, and the
    warnings to log (once no lock is held: a handler of the application's may call back into us).
    ``say_if_empty``: a configuration with no router or trusted host at all is a warning too."""
    reader = _Reader(lenient)
    routes = reader.routes(dynamo_hosts, routers)
    trusted = reader.patterns(trusted_hosts, "trusted_hosts", ENV_TRUSTED_HOSTS)
    settings = Settings(
        HostRules(routes, trusted),
        tracing=reader.flag("tracing", tracing, ENV_TRACING, False, False, "tracing stays off"),
        end_sessions=reader.flag(
            "end_sessions", end_sessions, ENV_END_SESSIONS, False, False, "sessions are not ended explicitly"
        ),
        servers=reader.flag(
            "servers",
            servers,
            ENV_SERVERS,
            servers_default,
            servers_default,
            "servers are instrumented" if servers_default else "servers are not instrumented",
        ),
        adopt=reader.adopt(),
        trajectory_functions=reader.functions(trajectory_functions),
        siblings=reader.siblings(siblings),
        strict_affinity=reader.flag(
            "strict_affinity",
            strict_affinity,
            ENV_STRICT_AFFINITY,
            False,
            False,
            "a session its router refuses for want of room goes on unpinned",
        ),
        pace=reader.pace(pace_ms),
    )
    if say_if_empty and not settings.rules:
        if reader.failed & {ENV_DYNAMO_HOSTS, ENV_TRUSTED_HOSTS, ENV_ROUTERS}:
            reader.warnings.append(
                "otel-session: no router or trusted host is left once the entries above are left out, "
                "so no request will carry a session"
            )
        else:
            reader.warnings.append(
                "otel-session: no routers or trusted hosts configured, so no request will carry a "
                f"session; pass dynamo_hosts=[...] or set {ENV_DYNAMO_HOSTS} (or {ENV_ROUTERS})"
            )
    return settings, reader.warnings


def parse_routers(text: str) -> tuple[dict[str, str], list[str]]:
    """``PROFILE=PATTERN[,PATTERN...]`` entries separated by ``;`` (blank entries skipped): the
    routers read, and a message for each malformed entry (left out; the others still read)."""
    routers: dict[str, str] = {}
    malformed = []
    for entry in text.split(";"):
        if not entry.strip():
            continue
        profile, sep, patterns = entry.partition("=")
        if not sep or not profile.strip() or not patterns.strip():
            malformed.append(
                f"{ENV_ROUTERS}: {entry.strip()!r} is not PROFILE=PATTERN[,PATTERN...] "
                "(entries separated by ';', e.g. 'vllm-router=10.0.0.5:8000;smg=*.gateway.internal')"
            )
            continue
        key = profile.strip()
        routers[key] = f"{routers[key]},{patterns}" if key in routers else patterns
    return routers, malformed


# The configuration installed by ``configure()``, or ``None`` before it / after ``unconfigure()``.
# Read in place as ``_settings.current`` (every request reads it, and a call would cost more than
# the read); only ``set_active`` writes it, so a module never keeps a copy that goes stale.
current: Settings | None = None


def set_active(settings: Settings | None) -> None:
    """Install ``settings`` for every reader at once (``configure()``, ``unconfigure()``)."""
    global current
    current = settings
