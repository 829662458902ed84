"""Host patterns and the classification of a request's destination into a ``Route``.

A destination is the connection's scheme, host and port, as the client is about to dial them, never
a header the caller can set. It is classified once into a ``Route``: which router profile sits there
(if any) and whether it is trusted with baggage. Matching errs towards sending nothing: a destination
that cannot be parsed, or whose scheme or port differs from what a pattern names, matches nothing.

A URL pattern (``https://dynamo.internal/v1``) means that scheme, host and port (the scheme's default
port when none is written), so a plain-``http`` downgrade never matches it. A pattern without a
scheme (``dynamo.internal``, ``dynamo.internal:8000``) matches any scheme, on any port or the one named.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import idna

from otel_session._routers import Profile

_DEFAULT_PORTS = {"http": 80, "https": 443}
_SCHEME_FAMILY = {"http": "http", "https": "https", "ws": "http", "wss": "https"}
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
_CACHE_LIMIT = 4096


def _normalize_name(name: str) -> str | None:
    """Lower-case, drop one trailing dot, IDNA-encode; ``None`` if it is no valid host name."""
    name = name.lower()
    if name.endswith("."):
        name = name[:-1]
    if not name:
        return None
    if not name.isascii():
        # IDNA 2008 (UTS 46, non-transitional), as httpx and yarl resolve names: Python's own "idna"
        # codec is IDNA 2003, which maps "straße" to "strasse", a different host.
        try:
            name = idna.encode(name, uts46=True).decode("ascii")
        except (idna.IDNAError, UnicodeError, ValueError):
            return None
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        return None
    return name


def _normalize_ip(text: str) -> str | None:
    try:
        return ipaddress.ip_address(text).compressed
    except ValueError:
        return None


def normalize_host(host: str) -> str | None:
    """The canonical form of a destination host (name or IP literal, brackets allowed for IPv6)."""
    if host.startswith("[") and host.endswith("]"):
        return _normalize_ip(host[1:-1])
    if ":" in host:
        return _normalize_ip(host)
    return _normalize_ip(host) or _normalize_name(host)


@functools.lru_cache(maxsize=1024)
def canonical_origin(scheme: str, host: str, port: int | None) -> tuple[str, str, int | None]:
    """One spelling per origin (scheme family, normalized host, port with the default filled in):
    ``[::1]`` and ``[0:0:0:0:0:0:0:1]``, port ``None`` and 80, are one router to tell a session ended."""
    family = _SCHEME_FAMILY.get(scheme.lower(), scheme.lower())
    if port is None:
        port = _DEFAULT_PORTS.get(family)
    return family, normalize_host(host) or host.lower(), port


def _numeric_tail(host: str) -> bool:
    """Whether a wildcard's suffix is all numeric labels (``0.0.5``, ``1``): it would match the tail of
    IPv4 addresses (``127.0.0.5``), never a DNS name, since a top-level domain is never numeric."""
    return all(label.isdigit() for label in host.split("."))


def _parse_port(text: str, pattern: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
        raise ValueError(f"host pattern {pattern!r}: {text!r} is not a port number (1-65535)")
    return int(text)


# "http//host", "http:/host", "https:host": a URL's scheme with its "://" mistyped.
_SCHEME_TYPO = re.compile(r"(?i)(https?|wss?)(//|:/|:(?=[^/\d]))")


@dataclass(frozen=True)
class HostPattern:
    """One configured destination: an exact host, or every subdomain of ``host`` when ``wildcard``."""

    host: str
    port: int | None = None
    wildcard: bool = False
    scheme: str | None = None  # "http" or "https" for a URL pattern (ws/wss count as http/https)

    @classmethod
    def parse(cls, pattern: str) -> HostPattern:
        """Parse ``host``, ``host:port``, ``*.suffix[:port]``, IPv4, ``[IPv6][:port]`` or a URL.

        Raises ``ValueError`` naming the pattern, so a typo fails at ``configure()`` and not silently
        at the first request.
        """
        if not isinstance(pattern, str):
            raise TypeError(f"host pattern must be a str, not {type(pattern).__name__}")
        text = pattern.strip()
        if not text:
            raise ValueError("host pattern is empty")
        if "://" in text:
            return cls._parse_url(text, pattern)
        if _SCHEME_TYPO.match(text) or "//" in text:
            raise ValueError(f"host pattern {pattern!r}: a URL needs '://' (e.g. 'http://host:port')")
        if "/" in text:  # host:port/v1, copied from a base URL: the path says nothing...
            close = text.find("]") + 1 if text.startswith("[") else 0
            head, _, path = text[close:].partition("/")
            text = text[:close] + head
            if path[:1].isdigit() and all(label.isdigit() for label in text.split(".")):
                # ...but 10.0.0.0/8, 10/8 or 10.0.0.0/255.0.0.0 is a network, not its first address
                raise ValueError(
                    f"host pattern {pattern!r}: a network range is not a host pattern; name each address "
                    "(or the hosts' DNS names, with a '*.' wildcard)"
                )
        wildcard = text.startswith("*.")
        if wildcard:
            text = text[2:]
        port: int | None = None
        if text.startswith("["):
            end = text.find("]")
            if end < 0:
                raise ValueError(f"host pattern {pattern!r}: unclosed '[' in an IPv6 address")
            host_text, rest = text[: end + 1], text[end + 1 :]
            if rest:
                if not rest.startswith(":"):
                    raise ValueError(f"host pattern {pattern!r}: unexpected {rest!r} after the address")
                port = _parse_port(rest[1:], pattern)
        elif text.count(":") == 1:
            host_text, port_text = text.split(":")
            port = _parse_port(port_text, pattern)
        else:
            host_text = text  # a name, IPv4, or a bare IPv6 literal
        if "*" in host_text or "/" in host_text or "@" in host_text:
            raise ValueError(
                f"host pattern {pattern!r}: only a leading '*.' wildcard is allowed, and no path or userinfo"
            )
        host = normalize_host(host_text) if host_text else None
        if host is None or (not wildcard and _numeric_tail(host) and _normalize_ip(host) is None):
            raise ValueError(  # '10' or '192.168' is no name, and a resolver would read it as some address
                f"host pattern {pattern!r}: {host_text!r} is not a valid host name or IP address"
            )
        if wildcard and (":" in host or _normalize_ip(host) is not None or _numeric_tail(host)):
            raise ValueError(
                f"host pattern {pattern!r}: a '*.' wildcard is for DNS names; '{text}' would match IP "
                "addresses (name each address, or a whole network by its names)"
            )
        return cls(host, port, wildcard)

    @classmethod
    def _parse_url(cls, text: str, pattern: str) -> HostPattern:
        try:
            parts = urlsplit(text)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"host pattern {pattern!r}: not a valid URL ({exc})") from None
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"host pattern {pattern!r}: a URL pattern must not contain user information")
        scheme = _SCHEME_FAMILY.get(parts.scheme.lower())
        if scheme is None or not parts.hostname:
            raise ValueError(f"host pattern {pattern!r}: expected an http(s) URL with a host")
        try:
            bare = cls.parse(parts.netloc)
        except ValueError as exc:
            raise ValueError(f"host pattern {pattern!r}: {exc}") from None
        if port == 0:
            raise ValueError(f"host pattern {pattern!r}: {parts.netloc!r} is not a valid host and port")
        return cls(bare.host, bare.port or _DEFAULT_PORTS[scheme], bare.wildcard, scheme)

    def __str__(self) -> str:
        """The pattern as it was read, in the form it accepts (``http://[::1]:8000``, ``*.corp:443``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        text = ("*." if self.wildcard else "") + host + (f":{self.port}" if self.port is not None else "")
        return f"{self.scheme}://{text}" if self.scheme else text

    @property
    def specificity(self) -> int:
        """Higher for narrower patterns: where two profiles' patterns match one host, the narrower wins."""
        return (0 if self.wildcard else 4) + (2 if self.port is not None else 0) + (1 if self.scheme else 0)

    def matches(self, scheme: str | None, host: str, port: int | None) -> bool:
        """Whether a normalized destination matches; an unknown port or scheme never matches one named."""
        if self.port is not None and port != self.port:
            return False
        if self.scheme is not None and scheme != self.scheme:
            return False
        if self.wildcard:
            return host.endswith("." + self.host)
        return host == self.host


def parse_patterns(patterns: Iterable[str] | str | None) -> tuple[HostPattern, ...]:
    """Parse a list of patterns, or a comma-separated string where blank entries are skipped."""
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        items = [item for item in patterns.split(",") if item.strip()]
    else:
        items = list(patterns)
    return tuple(HostPattern.parse(item) for item in items)


@dataclass(frozen=True)
class Route:
    """What one destination may receive: its router profile's headers, and baggage if trusted."""

    profile: Profile | None = None
    trusted: bool = False

    def __bool__(self) -> bool:
        return self.profile is not None or self.trusted


NOWHERE = Route()


class HostRules:
    """The configured routers and trusted hosts, answering "what may this destination receive?".

    Answers are cached per (scheme, host, port) because a rollout sends thousands of requests to a
    handful of hosts; the cache is bounded so a crawler-like workload cannot grow it without limit.
    A host matched by two profiles' patterns gets the narrower pattern's profile (exact host before
    wildcard, a named port or scheme before none), and between equals the first configured: a
    destination only ever receives one profile's headers.
    """

    __slots__ = ("_cache", "routes", "trusted")

    def __init__(
        self, routes: Iterable[tuple[Profile, HostPattern]] = (), trusted: Iterable[HostPattern] = ()
    ) -> None:
        ordered = list(routes)
        self.routes = tuple(sorted(ordered, key=lambda item: -item[1].specificity))
        self.trusted = tuple(trusted)
        self._cache: dict[tuple[str, str | None, int | None], Route] = {}

    @property
    def profiles(self) -> tuple[Profile, ...]:
        """The profiles configured, each once, in configuration order."""
        return tuple(dict.fromkeys(profile for profile, _ in self.routes))

    def route(self, scheme: str, host: str | None, port: int | None) -> Route:
        """The route for a destination as a client dials it (scheme, raw host, port or ``None``)."""
        if not host:
            return NOWHERE
        key = (scheme, host, port)
        found = self._cache.get(key)
        if found is None:
            found = self._route(scheme, host, port)
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = found
        return found

    def _route(self, scheme: str, host: str, port: int | None) -> Route:
        normal = normalize_host(host)
        if normal is None:
            return NOWHERE
        family = _SCHEME_FAMILY.get(scheme.lower())
        if port is None and family is not None:
            port = _DEFAULT_PORTS[family]
        profile = next((p for p, pattern in self.routes if pattern.matches(family, normal, port)), None)
        trusted = any(pattern.matches(family, normal, port) for pattern in self.trusted)
        return Route(profile, trusted) if profile is not None or trusted else NOWHERE

    def __bool__(self) -> bool:
        return bool(self.routes or self.trusted)

    def __repr__(self) -> str:
        """The patterns as they were read, by profile: ``print(configure(...))`` shows what matches."""
        by_profile: dict[str, list[str]] = {}
        for profile, pattern in self.routes:
            by_profile.setdefault(profile.name, []).append(str(pattern))
        routers = ", ".join(f"{name}=[{', '.join(patterns)}]" for name, patterns in by_profile.items())
        trusted = ", ".join(str(pattern) for pattern in self.trusted)
        return f"HostRules(routers: {routers or 'none'}; trusted: [{trusted}])"
