"""Containment for our own bugs: a failure here must never fail or slow a user's request.

Each place that can fail reports at most once per process, so a broken hook on a hot path costs one
warning with a traceback instead of a log line per request.
"""

from __future__ import annotations

import contextlib
import logging
import threading

logger = logging.getLogger("otel_session")

_reported: set[str] = set()
_lock = threading.Lock()


def report(where: str, exc: BaseException) -> None:
    """Log ``exc`` from ``where`` the first time only; the caller then carries on without us."""
    with _lock:
        if where in _reported:
            return
        _reported.add(where)
    # A handler or filter of the application's may raise too: that must not reach its request either.
    with contextlib.suppress(Exception):
        logger.warning(
            "otel-session: %s failed (%s); the application goes on without it (a request is sent as "
            "it would be without otel-session). Further failures here are not logged.",
            where,
            type(exc).__name__,
            exc_info=exc,
        )
