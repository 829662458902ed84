"""Host patterns and the classification of a request's destination.

Every decision about what a request may carry is made here, from the destination alone, so that the
rule "Dynamo hosts get the session header, trusted hosts get baggage, every other host gets nothing"
has exactly one implementation. Matching errs towards sending nothing: a destination that cannot be
parsed, or whose port is unknown where a pattern names one, matches no pattern.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import idna

NOTHING = 0
DYNAMO = 1
TRUSTED = 2

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
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


def _parse_port(text: str, pattern: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
        raise ValueError(f"host pattern {pattern!r}: {text!r} is not a port number (1-65535)")
    return int(text)


@dataclass(frozen=True)
class HostPattern:
    """One configured destination: an exact host, or every subdomain of ``host`` when ``wildcard``."""

    host: str
    port: int | None = None
    wildcard: bool = False

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
        if host is None:
            raise ValueError(
                f"host pattern {pattern!r}: {host_text!r} is not a valid host name or IP address"
            )
        if wildcard and (":" in host or _normalize_ip(host) is not None):
            raise ValueError(f"host pattern {pattern!r}: a '*.' wildcard needs a domain name, not an address")
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
        if parts.scheme.lower() not in _DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"host pattern {pattern!r}: expected an http(s) URL with a host")
        if port is None:
            try:
                return cls.parse(parts.netloc)
            except ValueError as exc:
                raise ValueError(f"host pattern {pattern!r}: {exc}") from None
        host = normalize_host(parts.hostname)
        if host is None or port == 0:
            raise ValueError(f"host pattern {pattern!r}: {parts.netloc!r} is not a valid host and port")
        return cls(host, port)

    def matches(self, host: str, port: int | None) -> bool:
        """Whether a normalized destination matches; an unknown port never matches a pattern's port."""
        if self.port is not None and port != self.port:
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


class HostRules:
    """The configured Dynamo and trusted hosts, answering "what may this destination receive?".

    Answers are cached per (host, port) because a rollout sends thousands of requests to a handful of
    hosts; the cache is bounded so a crawler-like workload cannot grow it without limit. The client
    hooks look a request up in ``_cache`` themselves (``_clients._begin``), so its key must stay
    ``(host as the client reports it, port with the scheme's default filled in)``.
    """

    __slots__ = ("_cache", "dynamo", "trusted")

    def __init__(self, dynamo: Iterable[HostPattern] = (), trusted: Iterable[HostPattern] = ()) -> None:
        self.dynamo = tuple(dynamo)
        self.trusted = tuple(trusted)
        self._cache: dict[tuple[str, int | None], int] = {}

    def classify(self, host: str | None, port: int | None) -> int:
        """``DYNAMO | TRUSTED`` flags for a destination as a client reports it (raw host, port)."""
        if not host:
            return NOTHING
        key = (host, port)
        kind = self._cache.get(key)
        if kind is None:
            kind = self._classify(host, port)
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = kind
        return kind

    def _classify(self, host: str, port: int | None) -> int:
        normal = normalize_host(host)
        if normal is None:
            return NOTHING
        kind = NOTHING
        if any(p.matches(normal, port) for p in self.dynamo):
            kind |= DYNAMO
        if any(p.matches(normal, port) for p in self.trusted):
            kind |= TRUSTED
        return kind

    def classify_url(self, scheme: str, host: str | None, port: int | None) -> int:
        """Classify a URL's parts, filling in the scheme's default port when none is written."""
        if port is None:
            port = _DEFAULT_PORTS.get(scheme.lower())
        return self.classify(host, port)

    def classify_authority(self, authority: str | None) -> int:
        """Classify a ``Host`` header value; without a port the scheme, hence the port, is unknown."""
        if not authority:
            return NOTHING
        host, port = split_authority(authority)
        return self.classify(host, port) if host else NOTHING

    def __bool__(self) -> bool:
        return bool(self.dynamo or self.trusted)


def split_authority(authority: str) -> tuple[str | None, int | None]:
    """Split ``host[:port]`` / ``[v6][:port]``; ``(None, None)`` when it cannot be read."""
    authority = authority.strip()
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            return None, None
        host, rest = authority[1:end], authority[end + 1 :]
    elif authority.count(":") == 1:
        host, _, port_text = authority.partition(":")
        rest = ":" + port_text
    else:
        host, rest = authority, ""
    if not rest:
        return host, None
    digits = rest[1:]
    if rest[0] != ":" or not (digits.isascii() and digits.isdigit()) or not 0 < int(digits) < 65536:
        return None, None
    return host, int(digits)
