"""What the demo and ``doctor`` let through of the library's own log, the ``otel_session`` logger.

The library logs with the standard :mod:`logging` module under that name, and a user of it can filter
there like anywhere else. The tools do so in two places only, each for as long as it lasts:

- around requests sent without a session *on purpose* (doctor's probes of how requests without a
  session are routed, the demo's batch with otel-session unconfigured), the library's "sent outside
  any trajectory" and "not configured" lines are about them and would only mislead, so they are
  dropped, for those requests' thread only;
- for one run of the command, a warning already shown is not shown again: the command calls
  ``configure()`` more than once (its up-front checks, then the run), and each call reads the same
  ``OTEL_SESSION_*`` variables and warns about the same mistake.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

__all__ = ["LIBRARY_LOGGER", "each_warning_once", "no_session_on_purpose"]

#: The logger the library writes every warning to.
LIBRARY_LOGGER = "otel_session"


@contextlib.contextmanager
def _filtering(keep: logging.Filter) -> Iterator[None]:
    logger = logging.getLogger(LIBRARY_LOGGER)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


class _NotAboutThisThreadsRequests(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread:
            return True
        message = record.getMessage()
        if message.startswith("otel-session: a request to") and "outside any trajectory" in message:
            return False
        return "not configured in this process" not in message  # the demo's batch without sessions


def no_session_on_purpose() -> contextlib.AbstractContextManager[None]:
    """While the block runs, requests this thread sends outside any trajectory are meant to be: the
    library's line saying such a request carries no session is dropped. Every other line, and that
    one from any other thread, still appears."""
    return _filtering(_NotAboutThisThreadsRequests())


class _Unseen(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[int, str]] = set()
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        with self.lock:
            if key in self.seen:
                return False
            self.seen.add(key)
        return True


def each_warning_once() -> contextlib.AbstractContextManager[None]:
    """While the block runs, a line of the library's already logged in it is not logged again."""
    return _filtering(_Unseen())
