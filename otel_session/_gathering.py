"""An attempt's first request to a router waits here: in a process's first step for the step to
gather before its sibling groups are sized, and in every step for its parent's turn at the router.

``auto`` (the default) and ``fleet`` size sibling groups to the fleet from the shape of a step: how
many groups are open at once and how many siblings each has. Before any step has ended the only
shape is the one opening now, and a GRPO step opens it all at once: its trajectories are started
together (``asyncio.gather`` of one coroutine per attempt, or a pool of threads), so each reaches its
first request to the router before the others have. That request counts the attempt in its group and
waits: on an event loop it yields to the loop, so the step's other attempts reach theirs and count
themselves too; in a thread it sleeps, while the other threads do the same. The router's fleet size
(``_fleet``) is read meanwhile. The wait ends once a look ``SETTLE`` seconds after the last
(``SETTLE_THREADS`` in a thread) finds no new attempt and the size known, or after ``WAIT``
seconds; then K is chosen from the step open now. Only the first step gathers (until a group has
ended). Then the attempt is decided, and waits for its parent's turn at the router (``_pacing``), so
the router places each new parent on a load that counts the last.
Never on a thread that runs an event loop (a blocking client called from async code), and a request
that waits here only ever waits, never fails.
"""

from __future__ import annotations

import asyncio
import time

from otel_session import _faults, _fleet, _hop, _pacing, _prompts, _siblings, _waiting

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
    try:
        look = _entered(offered, body, destination)
        if look is not None:
            await asyncio.sleep(0)  # the step's other attempts, started with this one, reach theirs
            while look.again():
                await asyncio.sleep(SETTLE)
        parent = _turn(offered, body, destination)[1]
        if parent is not None:
            await _pacing.wait(_origin(destination), parent)
    except Exception as exc:  # a bug of ours: the request goes on, decided as without waiting
        _faults.report("waiting for a first step or a parent's turn", exc)


def gather_here(offered: _hop.Offered, body: Body, destination: _hop.Destination) -> _hop.Offered:
    """``gather`` for a blocking client: the thread sleeps while the step's other threads count their
    attempts, and for its parent's turn; what the context offers from then on (decided here, where
    it was). Never sleeps where this thread runs an event loop (it would hold every other task): a
    first step is not gathered there, and a turn is not waited for."""
    try:
        if not _eligible(offered, destination):
            return offered
        on_a_loop = _waiting.loop_running()
        if _gathers_first(offered):
            if on_a_loop:
                return offered
            look = _entered(offered, body, destination)
            while look is not None and look.again():
                time.sleep(SETTLE_THREADS)
        offered, parent = _turn(offered, body, destination)
        if parent is not None:
            _pacing.wait_here(_origin(destination), parent, sleep=not on_a_loop)
    except Exception as exc:  # a bug of ours: the request goes on, decided as without waiting
        _faults.report("waiting for a first step or a parent's turn", exc)
    return offered


class _Look:
    """The wait's state: when it ends at the latest, and the attempts counted at the last look."""

    __slots__ = ("end", "origin", "seen")

    def __init__(self, origin: _fleet.Origin) -> None:
        self.origin = origin
        self.end = time.monotonic() + WAIT
        self.seen = -1

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


ORIGINS_KEPT = 64
_gave_up: set[_fleet.Origin] = set()  # routers whose size a wait gave up on (until ``forget``)


def forget() -> None:
    """Forget the routers given up on (``unconfigure()``): the next configuration waits afresh."""
    _gave_up.clear()


def _gathers_first(offered: _hop.Offered) -> bool:
    """Whether the attempt's first step is still to gather: undecided, under a sized policy, no
    step ended here yet."""
    holder = offered.undecided
    return holder is not None and holder.policy.sized and not _siblings.step_seen()


def _entered(offered: _hop.Offered, body: Body, destination: _hop.Destination) -> _Look | None:
    """In a first step still to gather, the attempt counted in its group; ``None`` elsewhere or
    where it has none (a body with no prompt, a key that cannot be hashed): nothing to size,
    nothing to wait for."""
    holder = offered.undecided
    if holder is None or not _gathers_first(offered):
        return None
    holder.enter(_prompts.key_of(body))
    if holder.key is None:
        return None
    return _Look(_origin(destination))


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
