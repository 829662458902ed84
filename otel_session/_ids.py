"""Session identifiers: minting fresh ones and vetting adopted ones.

Dynamo 1.6.1 treats a session value that is empty or holds anything but visible ASCII as absent, and
fails the request outright when the value is longer than 256 bytes while affinity is on. Checking the
same rule here means a bad ID is refused where it enters (an error at ``trajectory()``, or ignored at a
server), never emitted where it would break someone's request.
"""

from __future__ import annotations

import os
import re

SESSION_HEADER = "X-Dynamo-Session-ID"
PARENT_SESSION_HEADER = "X-Dynamo-Parent-Session-ID"
MAX_SESSION_ID_BYTES = 256

_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]{1,256}")


def new_session_id() -> str:
    """A fresh canonical UUID4: unguessable and unique per trajectory attempt.

    Exactly ``str(uuid.uuid4())`` (16 bytes from ``os.urandom``, version 4, RFC 4122 variant), but
    drawn ``_BATCH`` at a time: a trajectory starts with the caches cold from the requests before it,
    and there a system call and the formatting code cost more than all the rest of the start (about
    20 us of 100, measured). A batch serves only the process that drew it: its process ID is checked
    on every ID, because a process forked by C code (uWSGI forks its workers so by default) runs no
    Python fork hook, and a child Python forks drops it at once (``os.register_at_fork``), whatever
    its process ID. ``list.pop`` is atomic: two threads never take the same ID.
    """
    global _batch
    pid = os.getpid()
    batch = _batch
    if batch[0] == pid:
        try:
            return batch[1].pop()
        except IndexError:
            pass
    fresh = _draw(_BATCH)
    session = fresh.pop()
    _batch = (pid, fresh)
    return session


def _draw(count: int) -> list[str]:
    """``count`` fresh UUID4s, from one ``os.urandom`` call."""
    raw = bytearray(os.urandom(16 * count))
    drawn = []
    for start in range(0, len(raw), 16):
        raw[start + 6] = raw[start + 6] & 0x0F | 0x40  # version 4
        raw[start + 8] = raw[start + 8] & 0x3F | 0x80  # variant 10xx
        text = raw[start : start + 16].hex()
        drawn.append(f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}")
    return drawn


def _drop_batch() -> None:
    global _batch
    _batch = (0, [])


_BATCH = 64
_batch: tuple[int, list[str]] = (0, [])  # (the process that drew them, IDs not yet handed out)
if hasattr(os, "register_at_fork"):  # where processes fork (not on Windows)
    os.register_at_fork(after_in_child=_drop_batch)


def is_valid_session_id(value: object) -> bool:
    """True for 1..256 characters of visible ASCII (0x21-0x7E), the values Dynamo accepts as is."""
    return isinstance(value, str) and _VISIBLE_ASCII.fullmatch(value) is not None


def check_session_id(value: object) -> str:
    """Return ``value`` if it is a usable session ID, else raise a ``ValueError`` that says why."""
    if not isinstance(value, str):
        raise TypeError(f"session_id must be a str, not {type(value).__name__}")
    if not is_valid_session_id(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise ValueError(
            f"session_id {shown!r} is not usable: it must be 1 to {MAX_SESSION_ID_BYTES} characters of "
            "visible ASCII (no spaces, control characters or non-ASCII), as Dynamo requires"
        )
    return value
