"""New parent sessions, paced apart at each router.

Dynamo places a new session on the load it sees, and sessions that reach it within a few
milliseconds of each other are placed on a view that has not yet counted the ones just placed: a
GRPO step opens all its groups at once, and that burst of new parents lands unevenly (three groups
on one worker, one on another), so the step waits for the crowded worker. The first request under a
parent takes the parent's turn, ``PACE`` after the last parent's at its router, and every request
under the parent waits for that turn, so the router counts each parent before it places the next
(docs/performance.md, "New parents, paced"). No request waits more than ``SPREAD``: parents past
it go together at its end, as a burst goes without pacing.
"""

from __future__ import annotations

import os
import threading
import time

from otel_session._fleet import Origin
from otel_session._hosts import canonical_origin

PACE = 0.01  # seconds between two new parents' first requests to one router (5 ms was too little)
SPREAD = 2.0  # seconds a request waits at most: 200 new parents a router paced at once
ORIGINS_KEPT = 64
TURNS_KEPT = 16_384  # parents whose turn is remembered; turns gone by are dropped beyond it

_next: dict[Origin, float] = {}  # router -> when its next new parent may go (time.monotonic)
_turns: dict[str, float] = {}  # parent session -> when requests under it may go
_lock = threading.Lock()


def waits(parent: str) -> bool:
    """Whether a request under ``parent`` may have to wait: its turn not taken yet, or still to come."""
    turn = _turns.get(parent)
    return turn is None or turn > time.monotonic()


def delay(origin: Origin, parent: str) -> float:
    """Seconds a request under ``parent`` to ``origin`` waits: until the parent's turn, taken now
    by the first request to ask."""
    origin = canonical_origin(*origin)  # port None and 80, as clients spell them, are one router
    now = time.monotonic()
    with _lock:
        turn = _turns.get(parent)
        if turn is None:
            turn = min(max(now, _next.get(origin, now)), now + SPREAD)
            if origin not in _next and len(_next) >= ORIGINS_KEPT:
                _next.clear()
            _next[origin] = turn + PACE
            if len(_turns) >= TURNS_KEPT:
                _forget_past(now)
            _turns[parent] = turn
    return max(0.0, turn - now)


def _forget_past(now: float) -> None:
    """Drop the turns gone by (a request under such a parent takes a turn anew, at once where no
    burst is being paced), or every turn where none has gone by."""
    past = [parent for parent, turn in _turns.items() if turn <= now]
    for parent in past or list(_turns):
        del _turns[parent]


def release(parents: list[str]) -> None:
    """A group ended: its parents' turns are forgotten (kept, a long run's table would fill and drop
    the turns of attempts still open, whose later requests would then wait as new parents)."""
    with _lock:
        for parent in parents:
            _turns.pop(parent, None)


def forget() -> None:
    """Forget every router's and parent's turn (``unconfigure()``)."""
    with _lock:
        _next.clear()
        _turns.clear()


def _forget_in_child() -> None:
    """``os.register_at_fork`` hook, in a forked child: a fresh lock (another thread of the parent may
    have held it as it forked, and the child has no such thread to release it) and no turns (the
    child paces its own parents)."""
    global _lock
    _lock = threading.Lock()
    _next.clear()
    _turns.clear()


if hasattr(os, "register_at_fork"):  # where processes fork (not on Windows)
    os.register_at_fork(after_in_child=_forget_in_child)
