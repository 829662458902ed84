"""An attempt's first request to a router waits here: in a process's first step for the step to
gather before its sibling groups are sized, and in every step for its parent's turn at the router.

``auto`` (the default) and ``fleet`` size sibling groups to the fleet from the shape of a step: how
many groups are open at once and how many siblings each has. Before any step has ended the only
shape is the one opening now, and a GRPO step opens it all at once: its trajectories are started
together (``asyncio.gather`` of one coroutine per attempt, or a pool of threads), so each reaches
its first request to the router before the others have. That request counts the attempt in its group
and waits: on an event loop it yields to the loop, so the step's other attempts reach theirs and
count themselves too, and one of them looks for all (``_Look.ended``); in a thread it sleeps, and
one of the step's threads looks for all (``_Look.ended_here``). The router's fleet size (``_fleet``)
is read meanwhile, from the first attempt counted. The wait ends once a look ``SETTLE`` seconds
after the last (``SETTLE_THREADS`` in a thread) finds no new attempt and the size known, or after
``WAIT`` seconds; then K is chosen from the step open now. Only the first step gathers (until a
group has ended). Then the attempt is decided, and waits for its parent's turn at the router
(``_pacing``), so the router places each new parent on a load that counts the last. Never on a
thread that runs an event loop (a blocking client called from async code), and a request that waits
here only ever waits, never fails. (Over 300 lines: one wait in its two forms, on an event loop and
in threads, side by side as ``_pacing`` has them, so the two cannot drift apart.)
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref

from otel_session import _faults, _fleet, _hop, _pacing, _prompts, _settings, _siblings, _waiting

Body = bytes | bytearray | memoryview | str | None  # a request's body, where it is held in memory

WAIT = 0.5  # seconds at most a first step's first requests wait for the step and the fleet's size
SETTLE = 0.005  # seconds between looks: a step's attempts arriving over the network count too
SETTLE_THREADS = 0.05  # ... between a thread's looks: threads reach their requests tens of ms apart


def may_wait(offered: _hop.Offered) -> bool:
    """Whether a request offered ``offered`` may wait here (what the hooks ask first, cheaply): its
    attempt's group is still to decide, or it names a parent whose turn has not come."""
    if offered.undecided is not None:
        return True
    if not offered.due:
        return False
    parent = offered.offer.parent
    if parent is not None and _pacing.waits(parent):
        return True
    offered.due = False  # its turn has come: no later request offered this asks again
    return False


def _eligible(offered: _hop.Offered, destination: _hop.Destination) -> bool:
    """A request to a router that takes a parent: an attempt's first, under a policy that names
    parents, not decided nor waiting yet; or one under a parent whose turn has not come."""
    holder = offered.undecided
    if holder is not None:
        if holder.decided or holder.key is not None or holder.policy.size is None:
            return False
    elif not may_wait(offered):
        return False
    if not destination[1]:
        return False
    try:
        profile = offered.plan(*destination).route.profile
    except Exception:  # the request's own planning meets the same fault next, and reports it once
        return False
    return profile is not None and profile.parent_header is not None


def gathers(offered: _hop.Offered, destination: _hop.Destination) -> bool:
    """Whether this request, an async client's, waits for its step (``gather``): in an asyncio task."""
    if not _eligible(offered, destination):
        return False
    try:
        return asyncio.current_task() is not None
    except RuntimeError:  # no asyncio loop running here (trio, or a loop of another kind)
        return False


async def gather(offered: _hop.Offered, body: Body, destination: _hop.Destination) -> None:
    """In a first step, count the attempt in its group (its prompt's, or its ``group=``) and wait for
    its step's other attempts and the router's fleet size; then decide it and wait for its parent's
    turn at the router. The request is planned and sent after."""
    origin = _origin(destination)
    try:
        if _counted(offered, body):
            await _shared(origin).ended()
        parent = _turn(offered, body, destination)[1]
        if parent is not None:
            await _pacing.wait(origin, parent, _pace(), _workers(origin))
    except Exception as exc:  # a bug of ours: the request goes on, decided as without waiting
        _faults.report("waiting for a first step or a parent's turn", exc)


def gather_here(offered: _hop.Offered, body: Body, destination: _hop.Destination) -> _hop.Offered:
    """``gather`` for a blocking client: the thread sleeps while the step's other threads count their
    attempts, and for its parent's turn; what the context offers from then on (decided here, where
    it was). Never sleeps where this thread runs an event loop (it would hold every other task): a
    first step is not gathered there, and a turn is not waited for."""
    origin = _origin(destination)
    try:
        if not _eligible(offered, destination):
            return offered
        on_a_loop = _waiting.loop_running()
        if _gathers_first(offered):
            if on_a_loop:
                return offered
            if _counted(offered, body):
                _shared_here(origin).ended_here()
        offered, parent = _turn(offered, body, destination)
        if parent is not None:
            _pacing.wait_here(origin, parent, not on_a_loop, _pace(), _workers(origin))
    except Exception as exc:  # a bug of ours: the request goes on, decided as without waiting
        _faults.report("waiting for a first step or a parent's turn", exc)
    return offered


class _Look:
    """The wait's state: when it ends at the latest, and the attempts counted at the last look. One
    look per router is shared by the step's attempts on one event loop (``_shared``), or in the
    process's threads (``_shared_here``): the first looks, the others sleep until it is over, so a
    step of a thousand attempts wakes once per ``SETTLE``, not a thousand times (which starved the
    thread reading the fleet's size)."""

    __slots__ = ("__weakref__", "done", "end", "inside", "looking", "origin", "over", "seen", "waiting")

    def __init__(self, origin: _fleet.Origin) -> None:
        self.origin = origin
        self.end = time.monotonic() + WAIT
        self.seen = -1
        self.looking = False  # an attempt of the step looks for every other (``ended``)
        self.over = False
        self.waiting: list[asyncio.Future[None]] = []  # the attempts sleeping until it is over
        self.done = threading.Event()  # ... the threads sleeping until it is over
        self.inside = 0  # attempts in ``ended``
        _fleet.size_at(origin, False)  # the read starts now, while the step's other attempts arrive

    def again(self) -> bool:
        """Whether to look once more: an attempt arrived since the last look, or the size is unknown
        (at a router whose size a wait of this step already gave up on, it is not waited for again:
        the step is paired there). A read started here tells nothing: ``fleet``'s own request
        planning starts its read first, and says what ``fleet`` says of a router without a list."""
        now = _siblings.joined()
        known = _fleet.size_at(self.origin, False) is not None or self.origin in _gave_up
        if now == self.seen and known:
            return False
        if time.monotonic() >= self.end:
            if not known and len(_gave_up) < ORIGINS_KEPT:
                _gave_up.add(self.origin)
            return False
        self.seen = now
        return True

    async def ended(self) -> None:
        """Until the look is over: the first attempt here looks every ``SETTLE`` (after the step's
        other attempts, started with it, reach theirs); the others sleep until it is over, at most
        until its bound, as threads do. A looker cancelled (its step cancelled) wakes the others,
        and one of them looks on. The look is no longer shared once it is over or no attempt is
        inside it."""
        loop = asyncio.get_running_loop()
        self.inside += 1
        try:
            while not self.over and time.monotonic() < self.end + SETTLE_THREADS:
                if not self.looking:
                    await self._look()
                    return
                woken = loop.create_future()
                self.waiting.append(woken)
                await asyncio.wait((woken,), timeout=self.end + SETTLE_THREADS - time.monotonic())
        finally:
            self.inside -= 1
            key = (id(loop), self.origin)
            if (self.over or not self.inside) and _looks.get(key) is self:
                _looks.pop(key, None)  # this loop's key: only ``forget`` (another thread) may race

    async def _look(self) -> None:
        """Look every ``SETTLE`` until ``again`` says no, then wake the attempts sleeping on it."""
        self.looking = True
        try:
            await asyncio.sleep(0)  # the step's other attempts, started with this one, reach theirs
            while self.again():
                await asyncio.sleep(SETTLE)
            self.over = True
        finally:
            self.looking = False
            waiting, self.waiting = self.waiting, []
            for woken in waiting:  # each set here only (a sleeper's wait leaves it as it is), not
                if not woken.get_loop().is_closed():  # on a loop closed under it
                    woken.set_result(None)

    def ended_here(self) -> None:
        """``ended`` for a thread (counted inside by ``_shared_here``): the first thread here looks
        every ``SETTLE_THREADS``; the others sleep until it is over, at most until its bound. A
        looker that raised (interrupted) wakes the others, and one of them looks on."""
        try:
            while not self.over and time.monotonic() < self.end + SETTLE_THREADS:
                with _lock:
                    look, self.looking = not self.looking, True
                if not look:
                    self.done.wait(self.end + SETTLE_THREADS - time.monotonic())
                    continue
                self.done.clear()
                try:
                    while self.again():
                        time.sleep(SETTLE_THREADS)
                    self.over = True
                finally:
                    self.looking = False
                    self.done.set()
        finally:
            with _lock:
                self.inside -= 1
                if (self.over or not self.inside) and _looks.get((None, self.origin)) is self:
                    del _looks[None, self.origin]


# The step's look per event loop (its id) and router; ``None`` for the loop: the process's threads'.
# Weak: a loop closed with its attempts still inside a look (``loop.close()`` without cancelling its
# tasks) and dropped takes its look with it, where a strong table would keep both.
_looks: weakref.WeakValueDictionary[tuple[int | None, _fleet.Origin], _Look] = weakref.WeakValueDictionary()
_lock = threading.Lock()  # the threads' look: who looks, who is inside


def _shared(origin: _fleet.Origin) -> _Look:
    """This event loop's look at ``origin`` for the step gathering now; a new one where none is under
    way (a look over is no longer shared: a later group of the first step looks again, briefly, as
    a thread's would)."""
    key = (id(asyncio.get_running_loop()), origin)
    look = _looks.get(key)
    if look is None:
        look = _looks[key] = _Look(origin)
    return look


def _shared_here(origin: _fleet.Origin) -> _Look:
    """The threads' look at ``origin`` for the step gathering now, this thread counted inside it; a
    new one where none is under way."""
    with _lock:
        look = _looks.get((None, origin))
        if look is None or look.over:  # over, its looker not yet out: a later group looks again
            look = _looks[None, origin] = _Look(origin)
        look.inside += 1
        return look


ORIGINS_KEPT = 64
_gave_up: set[_fleet.Origin] = set()  # routers whose size a wait gave up on (until ``forget``)


def forget() -> None:
    """Forget the routers given up on and the looks under way (``unconfigure()``): the next
    configuration waits afresh."""
    _gave_up.clear()
    _looks.clear()


def _forget_in_child() -> None:
    """``os.register_at_fork`` hook, in a forked child: a fresh lock (another thread of the parent may
    have held it as it forked) and no looks (the parent's threads are not in the child)."""
    global _lock
    _lock = threading.Lock()
    _looks.clear()


if hasattr(os, "register_at_fork"):  # where processes fork (not on Windows)
    os.register_at_fork(after_in_child=_forget_in_child)


def _gathers_first(offered: _hop.Offered) -> bool:
    """Whether the attempt's first step is still to gather: undecided, under a sized policy, no
    step ended here yet."""
    holder = offered.undecided
    return holder is not None and holder.policy.sized and not _siblings.step_seen()


def _counted(offered: _hop.Offered, body: Body) -> bool:
    """In a first step still to gather, the attempt counted in its group: whether it was (not where
    it has no group: a body with no prompt, a key that cannot be hashed; nothing to size by)."""
    holder = offered.undecided
    if holder is None or not _gathers_first(offered):
        return False
    holder.enter(_prompts.key_of(body))
    return holder.key is not None


def _pace() -> float | None:
    """Seconds between new parents at a router, as configured (``None``: by the burst)."""
    settings = _settings.current
    return None if settings is None else settings.pace


def _workers(origin: _fleet.Origin) -> int | None:
    """The router's fleet size as ``_pacing`` paces by it: as last read, where the step's groups go
    close together (``_siblings.close``); ``None`` (paced by the burst alone) where they do not, or
    the size is unknown."""
    workers = _fleet.size_seen(origin)
    return workers if workers is not None and _siblings.close(workers) else None


def _origin(destination: _hop.Destination) -> _fleet.Origin:
    """The router a request goes to, as ``_fleet`` and ``_pacing`` key it (no host reads as "")."""
    scheme, host, port = destination
    return scheme, host or "", port


def _turn(
    offered: _hop.Offered, body: Body, destination: _hop.Destination
) -> tuple[_hop.Offered, str | None]:
    """The attempt decided (what the context offers from now on) and the parent whose turn at the
    router (``_pacing``) its request waits for: ``None`` where it names none, or sends none."""
    if offered.undecided is not None:
        offered = offered.decide(body, destination)
    parent = offered.offer.parent
    return offered, parent if parent is not None and offered.offer.pinned else None
