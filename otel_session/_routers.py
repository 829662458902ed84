"""Router profiles: which header a session-aware router pins on, and how it is told a session ended.

Every router that keeps a conversation on one engine keys on a header of its own. A profile names
that header, so one trajectory's ID can reach Dynamo, vLLM's router, SGLang's gateway or LiteLLM, each
in the form it reads and never in another's. ``header:NAME`` covers any other router.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from otel_session._ids import MAX_SESSION_ID_BYTES, PARENT_SESSION_HEADER, SESSION_HEADER

# How a profile is told a session is over (see ``_session_end``): by name, so this module stays data.
END_DYNAMO_FINAL = "dynamo-final"
END_VLLM_FINISH = "vllm-finish"


@dataclass(frozen=True)
class Profile:
    """One router kind: the header it pins on, the parent header (if any) and its ID limit."""

    name: str
    session_header: str
    parent_header: str | None = None
    max_id_bytes: int = MAX_SESSION_ID_BYTES
    ends_by: str | None = None

    def accepts(self, session_id: str) -> bool:
        """Whether this router can take ``session_id`` as is (IDs are ASCII, so chars are bytes)."""
        return len(session_id) <= self.max_id_bytes


DYNAMO = Profile("dynamo", SESSION_HEADER, PARENT_SESSION_HEADER, ends_by=END_DYNAMO_FINAL)
BUILTIN: dict[str, Profile] = {
    profile.name: profile
    for profile in (
        DYNAMO,
        Profile("vllm-router", "X-Session-ID", ends_by=END_VLLM_FINISH),
        Profile("smg", "X-SMG-Routing-Key"),
        Profile("litellm", "x-litellm-session-id"),
    )
}
CUSTOM_PREFIX = "header:"

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")
# Headers with a meaning of their own to HTTP, to OpenTelemetry or to credentials: a session ID
# written into one of them would break the request or leak where it must not.
_RESERVED = frozenset(
    {
        "authorization", "baggage", "connection", "cookie", "date", "expect", "forwarded", "host",
        "keep-alive", "max-forwards", "origin", "pragma", "priority", "proxy-authorization",
        "proxy-connection", "range", "referer", "set-cookie", "te", "traceparent", "tracestate", "trailer",
        "transfer-encoding", "upgrade", "user-agent", "via", "cache-control",
        SESSION_HEADER.lower(), PARENT_SESSION_HEADER.lower(), "x-dynamo-session-final",
    }
)  # fmt: skip
# Whole families of headers HTTP, browsers and proxies give a meaning to.
_RESERVED_PREFIXES = ("accept", "content-", "if-", "sec-", "x-forwarded-", "proxy-", "access-control-")


def profile_named(name: str) -> Profile:
    """The profile called ``name``: a built-in one or ``header:NAME``; ``ValueError`` says which exist."""
    if not isinstance(name, str):
        raise TypeError(f"router profile must be a str, not {type(name).__name__}")
    text = name.strip()
    found = BUILTIN.get(text.lower())
    if found is not None:
        return found
    if text[: len(CUSTOM_PREFIX)].lower() == CUSTOM_PREFIX:
        header = text[len(CUSTOM_PREFIX) :].strip()
        if not _TOKEN.fullmatch(header):
            raise ValueError(f"router profile {name!r}: {header!r} is not a valid HTTP header name")
        if header.lower() in _RESERVED or header.lower().startswith(_RESERVED_PREFIXES):
            raise ValueError(f"router profile {name!r}: {header!r} is reserved; choose another header")
        return Profile(CUSTOM_PREFIX + header, header)
    known = ", ".join(BUILTIN)
    raise ValueError(f"unknown router profile {name!r}: use one of {known}, or header:NAME")
