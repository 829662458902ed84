"""Containment for our own bugs, and the one way otel-session logs.

A failure here must never fail or slow a user's request: each place that can fail reports at most
once per process, so a broken hook on a hot path costs one warning with a traceback instead of a log
line per request. A handler or filter of the application's may raise, or call back into otel-session
(``unconfigure()``, even from another thread it then waits for), so nothing is logged while
``configure()`` holds its lock: inside ``deferred()`` warnings wait until it ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

logger = logging.getLogger("otel_session")

_reported: set[str] = set()
_lock = threading.Lock()


def once(where: str) -> bool:
    """Whether this is the first time ``where`` has something to say in this process."""
    with _lock:
        if where in _reported:
            return False
        _reported.add(where)
        return True


def report(where: str, exc: BaseException) -> None:
    """Log ``exc`` from ``where`` the first time only; the caller then carries on without us."""
    if not once(where):
        return
    warn(
        "otel-session: %s failed (%s); the application goes on without it (a request is sent as it "
        "would be without otel-session). Further failures here are not logged.",
        where,
        type(exc).__name__,
        exc_info=exc,
    )


def one_line(text: str, limit: int = 200) -> str:
    """``text`` from a peer (a reason phrase, an error naming its bytes) as it may appear in one of
    our lines: control characters escaped (no line break, no terminal escape), at most ``limit``."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit * 4])
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def warn(message: str, *args: object, exc_info: BaseException | None = None) -> None:
    """Log one warning line now, or when the enclosing ``deferred()`` ends; never raises."""
    pending: list[_Warning] | None = getattr(_held, "pending", None)
    if pending is not None:
        pending.append((message, args, exc_info))
        return
    with contextlib.suppress(Exception):  # a raising handler or filter must not reach a request either
        logger.warning(message, *args, exc_info=exc_info)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold this thread's warnings until the block ends (the locks taken inside are released)."""
    if getattr(_held, "pending", None) is not None:
        yield  # nested: the outermost one logs
        return
    _held.pending = []
    try:
        yield
    finally:
        pending, _held.pending = _held.pending, None
        for message, args, exc_info in pending:
            warn(message, *args, exc_info=exc_info)


_held = threading.local()
_Warning = tuple[str, tuple[object, ...], "BaseException | None"]
