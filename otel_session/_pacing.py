"""New parent sessions, paced apart at each router.

Dynamo places a new session on the load it sees, and sessions that reach it within a few
milliseconds of each other are placed on a view that has not yet counted the ones just placed: a
GRPO step opens all its groups at once, and that burst of new parents lands unevenly (three groups
on one worker, one on another), so the step waits for the crowded worker. The first request under a
parent takes the parent's turn, a slot ``PACE`` after the last parent's at its router, and every
request under the parent waits for it; as the slot comes the parent leaves some time after the last
parent that left there (slots that passed while an event loop was busy would otherwise go together),
so the router counts each parent before it places the next. How long: a fixed pace where one is
configured (``OTEL_SESSION_PACE_MS``), else by the burst, the parents that asked there in the last
``SPREAD``: ``WIDE`` apart while they fit ``BURST`` seconds at that, down to ``PACE`` for a large
one (frontends that share their load views late need ``WIDE``, one frontend ``PACE``;
docs/performance.md, "New parents, paced"); ``PACE`` where the burst has more parents than the
router has workers, which must share workers: the router balances them only on a view that holds
them all, and ``WIDE`` apart the first groups' turns end in between, so a worker in a pause looks
free (groups of unlike sizes, a prompt split into a group and a smaller rest, are not balanced by
their count, and a worker's two pairs ``PACE`` apart prefill their prompts together: ``_gathering``
gives no fleet size for them, and they keep the burst's spacing). A
steady stream of new parents, once it has run for ``SPREAD``, is paced at three quarters of its own
interval (``BURST / SPREAD``), so the backlog of its first seconds drains. No request waits
more than ``SPREAD``: parents past it go together at its end, as a burst goes without pacing. Where
every request waiting at a router gave up (a cancelled step), the turns it held are handed back.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time

from otel_session._fleet import Origin
from otel_session._hosts import canonical_origin

PACE = 0.01  # seconds between two new parents' slots at one router, and at least between leaving
WIDE = 0.04  # seconds at most between two parents leaving, in a small burst (several frontends)
BURST = 3.0  # seconds a burst's parents spread over where WIDE would take longer (75 parents)
ENV_PACE_MS = "OTEL_SESSION_PACE_MS"  # a fixed pace in milliseconds, as configured
SPREAD = 4.0  # seconds a request waits at most (400 new parents a router paced at once)
ASKED_KEPT = round(BURST / PACE)  # parents counted in a burst at most: past it, PACE apart anyway
ORIGINS_KEPT = 64
TURNS_KEPT = 16_384  # parents whose turn is remembered; turns gone by are dropped beyond it


class _Turn:
    """A parent's turn: its slot, the latest it may leave, and when it left (``None`` until its slot
    has come)."""

    __slots__ = ("at", "latest", "left", "origin")

    def __init__(self, origin: Origin, at: float, latest: float) -> None:
        self.origin = origin
        self.at = at
        self.latest = latest
        self.left: float | None = None


class _Queue:
    """A router's new parents: the next free slot, when the last parent left (or is to leave), how
    many requests wait for a turn there, and when the latest parents asked for theirs (the burst)."""

    __slots__ = ("asked", "left", "next", "waiting")

    def __init__(self, now: float) -> None:
        self.next = now
        self.left = -float("inf")  # no parent has left yet: the first leaves at once
        self.waiting = 0
        self.asked: collections.deque[float] = collections.deque(maxlen=ASKED_KEPT)

    def burst(self, now: float) -> int:
        """The parents that asked here in the last ``SPREAD`` (any that asked before has left)."""
        while self.asked and self.asked[0] < now - SPREAD:
            self.asked.popleft()
        return len(self.asked)


_queues: dict[Origin, _Queue] = {}
_turns: dict[str, _Turn] = {}  # parent session -> its turn
_lock = threading.Lock()
_era = 0  # one more each time the turns are forgotten: the requests waiting then stop waiting


def waits(parent: str) -> bool:
    """Whether a request under ``parent`` may have to wait: its turn not taken yet, or still to come."""
    turn = _turns.get(parent)
    return turn is None or turn.left is None or turn.left > time.monotonic()


async def wait(origin: Origin, parent: str, pace: float | None = PACE, workers: int | None = None) -> None:
    """Wait for ``parent``'s turn at ``origin`` (an asyncio task), new parents ``pace`` seconds
    apart (``None``: by the burst, at a router of ``workers`` where known): cancelled, it gives its
    turn back where no other request waits there."""
    origin = canonical_origin(*origin)  # port None and 80, as clients spell them, are one router
    era, end = _era, time.monotonic() + SPREAD
    _count(origin, 1)
    try:
        while (pause := _pause(origin, parent, pace, era, end, workers)) > 0:
            await asyncio.sleep(pause)
    except BaseException:
        _gave_up(origin)
        raise
    _count(origin, -1)


def wait_here(
    origin: Origin, parent: str, sleep: bool, pace: float | None = PACE, workers: int | None = None
) -> None:
    """``wait`` for a blocking client; ``sleep`` false (a thread that runs an event loop) takes the
    turn and goes at once."""
    origin = canonical_origin(*origin)
    era, end = _era, time.monotonic() + SPREAD
    _count(origin, 1)
    try:
        while (pause := _pause(origin, parent, pace, era, end, workers)) > 0 and sleep:
            time.sleep(pause)
    except BaseException:
        _gave_up(origin)
        raise
    _count(origin, -1)


def _pause(
    origin: Origin, parent: str, pace: float | None, era: int, end: float, workers: int | None
) -> float:
    """How long a wait that began in ``era`` and ends by ``end`` at the latest sleeps next: none once
    the turns were forgotten (``unconfigure()``, another pace), whose table its turn was in."""
    if era != _era:
        return 0.0
    return min(_delay(origin, parent, pace, workers), end - time.monotonic())


def delay(origin: Origin, parent: str, pace: float | None = PACE, workers: int | None = None) -> float:
    """Seconds a request under ``parent`` to ``origin`` waits from now: until the parent's slot,
    taken now by the first request to ask; once the slot has come, until the parent leaves, ``pace``
    after the last to leave there (``apart``; siblings go with it)."""
    return _delay(canonical_origin(*origin), parent, pace, workers)


def _delay(origin: Origin, parent: str, pace: float | None, workers: int | None) -> float:
    """``delay`` at ``origin`` as ``canonical_origin`` spells it (what ``wait`` holds already)."""
    now = time.monotonic()
    with _lock:
        turn = _turns.get(parent)
        if turn is None:
            queue = _queue(origin, now)
            queue.asked.append(now)
            turn = _Turn(origin, min(max(now, queue.next), now + SPREAD), now + SPREAD)
            queue.next = turn.at + (PACE if pace is None else pace)
            if len(_turns) >= TURNS_KEPT:
                _forget_past(now)
            _turns[parent] = turn
        if turn.left is None:
            if turn.at > now:
                return turn.at - now
            queue = _queue(turn.origin, now)
            turn.left = min(max(now, queue.left + apart(pace, queue.burst(now), workers)), turn.latest)
            queue.left = max(queue.left, turn.left)
    return max(0.0, turn.left - now)


def apart(pace: float | None, burst: int, workers: int | None = None) -> float:
    """Seconds between two parents leaving a router: ``pace`` where configured, else ``WIDE`` for a
    burst of parents that fits ``BURST`` at that, closer for a larger one, never under ``PACE``, and
    ``PACE`` for a burst of more parents than the router's ``workers`` (where known). A stream of
    parents ``1 / r`` apart is a burst of ``SPREAD * r``: paced ``BURST / SPREAD`` of its interval,
    it does not back up (up to ``1 / PACE`` a second)."""
    if pace is not None:
        return pace
    if workers and burst > workers:
        return PACE
    return min(WIDE, max(PACE, BURST / max(burst, 1)))


def _queue(origin: Origin, now: float) -> _Queue:
    """``origin``'s queue, made where missing; a full table first drops an idle router's, the one
    whose slots are the oldest."""
    queue = _queues.get(origin)
    if queue is None:
        if len(_queues) >= ORIGINS_KEPT:
            del _queues[min(_queues, key=lambda seen: (_queues[seen].waiting > 0, _queues[seen].next))]
        queue = _queues[origin] = _Queue(now)
    return queue


def _count(origin: Origin, waiting: int) -> None:
    """One more (or one fewer) request waiting for a turn at ``origin``."""
    with _lock:
        queue = _queue(origin, time.monotonic())
        queue.waiting = max(0, queue.waiting + waiting)


def _gave_up(origin: Origin) -> None:
    """A request stopped waiting before its turn (cancelled): where it was the last waiting at
    ``origin``, the turns still to come there go back (kept, the next step's parents would wait
    behind slots nobody uses), and the next parent leaves a pace after the last that did."""
    with _lock:
        queue = _queues.get(origin)
        if queue is None:
            return
        queue.waiting = max(0, queue.waiting - 1)
        if queue.waiting:
            return
        now = time.monotonic()
        queue.next = min(queue.next, now)
        queue.left = min(queue.left, now)
        for parent in [p for p, turn in _turns.items() if turn.origin == origin and not _gone(turn, now)]:
            del _turns[parent]


def _gone(turn: _Turn, now: float) -> bool:
    """Whether ``turn``'s parent has left."""
    return turn.left is not None and turn.left <= now


def _forget_past(now: float) -> None:
    """Drop the turns gone by (a request under such a parent takes a turn anew, at once where no
    burst is being paced), or every turn where none has gone by."""
    past = [parent for parent, turn in _turns.items() if _gone(turn, now)]
    for parent in past or list(_turns):
        del _turns[parent]


def release(parents: list[str] | tuple[str, ...]) -> None:
    """Attempts ended: the turns of the parents they named are forgotten (a group's, or an enclosing
    attempt's session that the attempts nested in it named; kept, a long run's table would fill and
    drop the turns of attempts still open, whose later requests would then wait as new parents)."""
    if not any(parent in _turns for parent in parents):  # most attempts end naming no parent here
        return
    with _lock:
        for parent in parents:
            _turns.pop(parent, None)


def forget() -> None:
    """Forget every router's and parent's turn (``unconfigure()``, or a new pace): the requests
    waiting for one go as their sleep ends."""
    global _era
    with _lock:
        _era += 1
        _queues.clear()
        _turns.clear()


def _forget_in_child() -> None:
    """``os.register_at_fork`` hook, in a forked child: a fresh lock (another thread of the parent may
    have held it as it forked, and the child has no such thread to release it) and no turns (the
    child paces its own parents)."""
    global _lock
    _lock = threading.Lock()
    _queues.clear()
    _turns.clear()


if hasattr(os, "register_at_fork"):  # where processes fork (not on Windows)
    os.register_at_fork(after_in_child=_forget_in_child)
