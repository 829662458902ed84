"""The clients the two in-process overhead views drive, and the canned server answering them.

``overhead_requests.py`` and ``overhead_configs.py`` both measure inside one process, so they share
what a request is (the same chat completion, to the same two hosts) and how it is answered
without a socket: ``httpx.MockTransport`` / ``httpx2.MockTransport`` with a ``Canned`` answer, and
for aiohttp ``canned_aiohttp_connector`` from ``_servers.py``. Over loopback they use
``LoopbackServer`` (its own process, so its CPU is not counted).

The only thing they take from otel-session beyond its public API is ``__wrapped__`` on a patched
client method (the convention of ``functools.wraps`` and ``wrapt``), to send a request around the
hook on a configured process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import otel_session
from benchmarks._servers import COMPLETION

PAYLOAD = {"model": "bench", "messages": [{"role": "user", "content": "hello"}]}
MESSAGES: Any = PAYLOAD["messages"]
INPROC_DYNAMO = "http://dynamo.internal:8000"
INPROC_DYNAMO_AUTHORITY = "dynamo.internal:8000"
INPROC_OTHER = "http://tools.internal:8000"
INPROC_URLS = {"dynamo": INPROC_DYNAMO, "other": INPROC_OTHER}
SESSION_HEADER = "x-dynamo-session-id"

# name: (title, share of a block's requests: the openai SDK is ~7x slower per request)
CLIENTS: dict[str, tuple[str, float]] = {
    "httpx-sync": ("httpx sync", 1.0),
    "httpx-async": ("httpx async", 1.0),
    "openai-sync": ("openai SDK sync (httpx2)", 0.25),
    "aiohttp": ("aiohttp", 1.0),
}


@dataclass
class Canned:
    """The in-process server: a fixed chat completion; notes the session header while checking."""

    module: Any  # httpx or httpx2
    check: bool = True
    seen: list[str | None] = field(default_factory=list)

    def __call__(self, request: Any) -> Any:
        if self.check:
            self.seen.append(request.headers.get(SESSION_HEADER))
        return self.module.Response(200, content=COMPLETION, headers={"content-type": "application/json"})


def maybe_trajectory(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    return otel_session.trajectory() if enabled else contextlib.nullcontext()


def unhooked(cls: type, method: str) -> Any:
    """The client's own method under otel-session's hook (configure() must have run)."""
    hooked = cls.__dict__[method]
    original = getattr(hooked, "__wrapped__", None)
    if original is None:
        raise RuntimeError(f"{cls.__qualname__}.{method} is not hooked: is otel-session configured?")
    return original


def no_sdk_in_effect() -> bool:
    """Tracing-off figures are only honest if nothing left a recording provider in effect."""
    with otel_session.trajectory() as traj:
        return not traj.span.get_span_context().is_valid
