"""Siblings: attempts that share a prompt (a GRPO group), and the parent session each is sent under.

Every attempt keeps a session of its own; what this decides is whether siblings also name a common
parent (Dynamo's ``X-Dynamo-Parent-Session-ID``), which makes the router place them together. All
siblings under one parent share the prompt's cache on one worker but crowd it; each on its own
spreads them and recomputes the shared prompt on every worker. ``groups:K`` puts each K siblings
open at once under a parent of their own: the measured middle (docs/performance.md, "At fleet
scale"). ``auto`` and ``fleet`` pick K at run time, one group per worker as ``otel-session doctor``
sizes it, from the router's fleet size (``_fleet``) and the shape of the last step seen here (groups
open at once, siblings per group), or before any step has ended, of the step gathering now
(``_gathering``); until they have both ``auto`` pairs siblings and ``fleet`` withholds the
session, so the router places those attempts as it would without otel-session.
A group is named by the caller (``trajectory(group=...)``) or, where it names none, by the prompt
of the attempt's first request to a router (``Inferred``, keyed by ``_prompts``). A group is known
only while one of its attempts is open: nothing here outlives a step but its shape. (Over 300 lines:
the policy, the group table, the step's shape and the undecided attempt are one rule, K for this
attempt, read under one lock.)
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Hashable
from dataclasses import dataclass

from otel_session import _faults, _pacing
from otel_session._ids import new_session_id

ENV_SIBLINGS = "OTEL_SESSION_SIBLINGS"
FLEET = -1  # ``Siblings.size`` of ``fleet``: K chosen at run time, the session withheld until then
AUTO = -2  # ... of ``auto``: K chosen at run time, the default's K until then
WITHHELD = ""  # the parent ``join`` gives an attempt of ``fleet`` sent without its session
UNREADABLE = 0  # a fleet size that cannot be known (``_fleet.UNREADABLE``): the default's K


@dataclass(frozen=True)
class Siblings:
    """How attempts of one group are keyed: ``size`` siblings under each parent; ``None``: none
    under a parent (``attempt``); ``0``: all of them under one (``prompt``); ``AUTO`` and ``FLEET``:
    sized at run time (``auto``, ``fleet``)."""

    size: int | None

    @classmethod
    def parse(cls, text: str) -> Siblings:
        """``attempt``, ``prompt``, ``auto``, ``fleet`` or ``groups:K`` (K from 1), else ValueError."""
        value = text.strip().lower()
        if value == "attempt":
            return cls(None)
        if value == "prompt":
            return cls(0)
        if value == "fleet":
            return cls(FLEET)
        if value == "auto":
            return cls(AUTO)
        kind, sep, size = value.partition(":")
        if kind == "groups" and sep and size.isascii() and size.isdigit() and 1 <= int(size) <= 4096:
            return cls(int(size))
        raise ValueError(
            f"{text!r} is not attempt, prompt, auto, fleet or groups:K (K from 1 to 4096, e.g. groups:2)"
        )

    @property
    def sized(self) -> bool:
        """Whether K is chosen at run time (``auto``, ``fleet``)."""
        return self.size in (AUTO, FLEET)

    @property
    def withholds(self) -> bool:
        """Whether the session is withheld while K cannot be chosen yet (``fleet``)."""
        return self.size == FLEET

    def __repr__(self) -> str:
        return f"Siblings({str(self)!r})"

    def __str__(self) -> str:
        if self.size is None:
            return "attempt"
        names = {0: "prompt", FLEET: "fleet", AUTO: "auto"}
        return names.get(self.size, f"groups:{self.size}")


GROUPS_DEFAULT = 2  # K where it cannot be sized yet: the measured middle (docs/performance.md)
CROWDED = 1.5  # whole groups' busiest worker against a fair share, past kv routing alone's 1.1-1.4x
PAIRED_WORKERS = 8  # workers for crowded pairs 40 ms apart to start a worker's two 320 ms apart
# The default: sized to the fleet from the second step (docs/performance.md, "Step time").
DEFAULT = Siblings(AUTO)


class GroupKey:
    """A group key as its group's first attempt joined: its hash taken once, so its attempts find the
    group again (``_own``) by that hash and by identity, never running the key's own code again (a
    key the application changes while the attempt runs, or whose ``__hash__`` or ``__eq__`` raises
    later, would otherwise stay in ``_groups`` for good)."""

    __slots__ = ("alone", "hash", "key", "placed", "size", "sized")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.hash = hash(key)
        self.alone = False  # equal to itself alone, while its own group is looked up (``_own``)
        self.placed = False  # K chosen (by the group's first attempt to be placed)
        self.size: int | None = None  # the K its group was given (``None``: the session withheld)
        self.sized = False  # ... chosen from the fleet's size and a step's shape

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupKey) or self.alone or other.alone:
            return other is self
        return other.key is self.key or bool(other.key == self.key)


class _Group:
    __slots__ = ("key", "open", "parents", "started")

    def __init__(self, key: GroupKey) -> None:
        self.key = key  # as the group's first attempt joined (with its K): every attempt leaves with it
        self.started = 0  # attempts of the group opened while it was known
        self.open = 0  # attempts of the group open now
        self.parents: list[str] = []  # one per sub-group, minted as the sub-group opens


_groups: dict[GroupKey, _Group] = {}
_joins = [0]  # attempts that entered a group, ever (``joined``)
_lock = threading.RLock()  # re-entrant: a key's own __eq__ may open a trajectory on the same thread


class _Shape:
    """The last step's shape as seen here, for ``fleet``: the most groups open at once and the most
    attempts one group started. A step ends where no group is open (a GRPO step's siblings all end
    before the next step's start). A step is sized by the step before it alone, never by the groups
    it has opened so far (the first to open would get one K and the last another, mixed in one
    step); a step of lone attempts (an evaluation pass) after one with siblings leaves its shape for
    the next GRPO step, and where no step has had siblings, each step gathers as a first step does
    (a baseline evaluation, then the first GRPO step)."""

    __slots__ = ("last", "open", "siblings", "size")

    def __init__(self) -> None:
        self.siblings = False  # a group has had two attempts: the fleet's size will be wanted
        self.open = 0  # this step: most groups open at once
        self.size = 0  # this step: most attempts of a group that ended
        self.last = (0, 0)  # the step before: (groups open at once, siblings per group)

    def groups_siblings(self) -> tuple[int, int] | None:
        """(groups open at once, siblings per group): the step before's once one has ended, else this
        step's once one of its groups has; ``None`` before."""
        if self.last[1] > 0:
            return self.last
        return (max(self.open, 1), self.size) if self.size > 0 else None

    def opened(self, groups: int) -> None:
        self.open = max(self.open, groups)

    def ended(self, started: int, groups_left: int) -> None:
        self.size = max(self.size, started)
        if groups_left == 0:
            if self.size > 1 or self.last[1] <= 1:  # lone attempts after siblings: the shape stays
                self.last = (max(self.open, 1), self.size)
            self.open, self.size = 0, 0


_shape = _Shape()


def fleet_size_of(workers: int | None, withhold: bool = True, gathered: bool = False) -> int | None:
    """K for a fleet of ``workers`` as ``join`` (or a ``gathered`` attempt) would choose it now."""
    return _fleet_size(workers, withhold, gathered)[0]


def _fleet_size(workers: int | None, withhold: bool, gathered: bool) -> tuple[int | None, bool]:
    """Siblings per parent for a fleet of ``workers``, one group per worker as ``otel-session doctor``
    sizes it: ``ceil(G / max(1, workers // P))``, P groups of G siblings open at once (``shape``);
    and whether it was so sized. Where that cannot be known yet (``workers`` ``None``, or no step
    seen): ``None`` (withheld) if ``withhold``, else the default's K, as where the router lists no
    workers (``UNREADABLE``); after a step of lone attempts, 1 (each alone) unless withheld; and
    where ``withhold``, ``None`` for a step its groups would crowd (``unshared``)."""
    found = shape(gathered)
    if workers is not None and workers != UNREADABLE and found is not None:
        size = group_size(workers, *found)
        return (None if withhold and unshared(workers, *found, size) else size), True
    if found is not None and found[1] <= 1 and not withhold:
        return 1, False  # the step before had lone attempts only: each alone, no fleet size needed
    return (None if withhold and workers != UNREADABLE else GROUPS_DEFAULT), False


def group_size(workers: int, groups: int, siblings: int) -> int:
    """K for ``groups`` (at least 1) groups of ``siblings`` open at once on ``workers`` workers. Where
    the groups fit the workers, one group per worker: ``ceil(siblings / max(1, workers // groups))``
    (a sibling alone only where each then has a worker of its own: alone, each recomputes the
    prompt). Where they outnumber the workers, whole groups, some workers holding one more than
    others; but where that puts ``CROWDED`` times a fair share of siblings or more on the busiest
    (10 prompts on 8 workers: two groups on two workers, 1.6x), each prompt in a group and a
    smaller rest, the largest K whose busiest worker holds the fewest siblings (``busiest``), the
    rest placed by the router where there is room. ``otel-session doctor`` states the same rule."""
    fit = max(1, math.ceil(siblings / max(1, workers // groups)))
    fleet = max(1, workers)  # none listed: as one
    if fit == 1 or groups <= workers or math.ceil(groups / fleet) * fleet < CROWDED * groups:
        return fit
    shape = (workers, groups, siblings)
    size = _sized.get(shape)
    if size is None:  # worked out once per shape: every attempt's first request asks (``close``)
        halves = range(max(2, math.ceil(siblings / 2)), siblings + 1)  # a prompt in one group or two
        held = {size: busiest(workers, groups, siblings, size) for size in halves}
        fewest = min(held.values())
        size = max(size for size, most in held.items() if most == fewest)
        if len(_sized) >= SHAPES_KEPT:
            _sized.clear()
        _sized[shape] = size
    return size


SHAPES_KEPT = 64
_sized: dict[tuple[int, int, int], int] = {}  # (workers, groups, siblings) -> K, where it took work


def close(workers: int) -> bool:
    """Whether ``_pacing`` sends a burst of more of the step's groups (``shape``) than ``workers``
    workers close together (``paced_close``), or no shape is known yet."""
    found = shape(True)
    return found is None or paced_close(workers, *found)


def paced_close(workers: int, groups: int, siblings: int) -> bool:
    """Whether a burst of ``groups`` groups of ``siblings``, sized for ``workers`` workers, goes
    ``_pacing.PACE`` apart where it outnumbers the workers: all alike, so as many groups on each
    worker is as much load on each, and of 3 or more. A prompt split into a group and a smaller rest,
    and pairs, go at the burst's wider spacing: the router counts each group's siblings before it
    places the next, and a worker's two pairs do not prefill their prompts together in a cache that
    holds one (measured, docs/performance.md)."""
    return group_size(workers, groups, siblings) != 2 and not splits(workers, groups, siblings)


def splits(workers: int, groups: int, siblings: int) -> bool:
    """Whether ``group_size`` splits each prompt into a group and a smaller rest (unlike sizes)."""
    return siblings % group_size(workers, groups, siblings) != 0


def unshared(workers: int, groups: int, siblings: int, size: int) -> bool:
    """Whether groups of ``size`` crowd the busiest worker past what sharing a prompt saves: siblings
    to share it, more groups than workers, the busiest holding 1 + (G - 1) / 2G times a fair share
    of siblings or more (rising to the split rule's ``CROWDED``); where pairs are the largest groups
    (paced by the burst), a prompt split into a pair and one (the one recomputes the prompt in a
    crowded cache), or more than a fair share on the busiest worker where it passes 4/3 of one or
    the fleet has fewer than ``PAIRED_WORKERS`` (a worker's two pairs then start within a prefill of
    each other): where kv routing alone measured the shorter step (docs/performance.md). ``fleet``
    withholds such a step."""
    if siblings <= 1 or groups * math.ceil(siblings / max(1, size)) <= workers:
        return False  # nothing shared, or a worker for each group
    fair = groups * siblings / max(1, workers)
    most = busiest(workers, groups, siblings, size)
    if size <= 2:
        crowded = 3 * most * workers > 4 * groups * siblings or workers < PAIRED_WORKERS  # past 4/3
        return siblings % max(1, size) != 0 or (most > fair and crowded)
    return most >= fair * (1 + (siblings - 1) / (2 * siblings))


def busiest(workers: int, groups: int, siblings: int, size: int) -> int:
    """Siblings on the busiest of ``workers`` workers when ``groups`` groups of ``siblings``, each
    split in the order they open into groups of ``size`` and one of the rest, are dealt the largest
    first, each to the least loaded worker: the whole groups in turn, then the rest, a level at a
    time."""
    whole, rest = divmod(siblings, size)
    more, over = divmod(groups * whole, max(1, workers))
    low, high = [more * size, max(1, workers) - over], [(more + 1) * size, over]  # [level, workers]
    left = groups if rest else 0
    while left:
        least = low if not high[1] or low[0] <= high[0] else high  # ``low`` always has workers
        if left < least[1]:
            return max(least[0] + rest, high[0] if high[1] else 0)
        left -= least[1]
        least[0] += rest
    return max(low[0], high[0]) if high[1] else low[0]


def shape(gathered: bool = False) -> tuple[int, int] | None:
    """(groups open at once, siblings per group) to size by: the last step's; until a step with
    siblings has ended, for an attempt that waited for its step to gather (``_hop.gather``), the
    step open now, once a group in it has siblings (``None``: nothing to size by)."""
    found = _shape.groups_siblings()
    if gathered and _groups and not _follows(found):
        most = max(group.started for group in _groups.values())
        if most >= 2:
            return len(_groups), most
    return found


def step_seen() -> bool:
    """Whether K follows the step before (no gathering): once a group with siblings has ended here
    (until then any step may be a GRPO step's first, after evaluation passes of lone attempts)."""
    return _follows(_shape.groups_siblings())


def _follows(found: tuple[int, int] | None) -> bool:
    """Whether a shape found (``_Shape.groups_siblings``) is one a step follows: it has siblings."""
    return found is not None and found[1] > 1


def joined() -> int:
    """Attempts joined to groups so far (a count that only grows): a step still gathering grows it."""
    return _joins[0]


def last_shape() -> tuple[int, int]:
    """(groups open at once, siblings per group) as ``fleet`` sizes by now; (0, 0) before a step."""
    return shape(True) or (0, 0)


def needs_fleet_size(policy: Siblings) -> bool:
    """Whether deciding attempts under ``policy`` needs their router's fleet size: always under
    ``fleet``; under ``auto`` once a group had two attempts (a run without siblings never asks)."""
    return policy.withholds or (policy.sized and _shape.siblings)


def key_of(group: Hashable) -> GroupKey | None:
    """``trajectory(group=...)``'s key, hashed once as its attempt is made; ``None`` where it cannot be
    hashed (a tuple holding a list, a ``__hash__`` that raises): that attempt then names no parent, and
    one line says so (the first time), for a key the application got wrong must not end its rollout."""
    try:
        return GroupKey(group)
    except Exception as exc:
        _bad_key(group, "hashed", exc)
        return None


def _bad_key(key: object, done: str, exc: Exception) -> None:
    """One line, the first time, for a group key whose own code failed (no traceback: it is theirs)."""
    if _faults.once("a trajectory(group=...) key"):
        _faults.warn(
            "otel-session: a trajectory(group=...) key of type %s cannot be %s (%s); its attempt runs "
            "under its own session but names no parent, so the router places it alone. Use a str, an "
            "int or a tuple of those. Logged once per process.",
            type(key).__name__,
            done,
            type(exc).__name__,
        )


def join(
    key: Hashable | GroupKey, policy: Siblings, workers: int | None = None
) -> tuple[str | None, GroupKey] | None:
    """The parent session for one more attempt of group ``key`` (a :class:`GroupKey` from ``key_of``,
    or a prompt's digest) under ``policy`` and the ticket to ``leave`` with once it ends (``None``: no
    parent, nothing to leave). Under ``fleet`` the parent is ``None`` where each sibling goes alone and
    ``WITHHELD`` where the session is not to be sent; ``workers``: the router's fleet size
    (``_fleet.size_at``)."""
    if policy.size is None:
        return None
    entered = enter(key)
    if entered is None:
        return None
    ticket, index = entered
    return place(ticket, index, policy, workers), ticket


def enter(key: Hashable | GroupKey) -> tuple[GroupKey, int] | None:
    """One more attempt of group ``key`` counted, its K not chosen yet: (the ticket to ``place`` it
    and ``leave`` with, the attempt's place in its group); ``None`` where the key cannot be hashed."""
    try:  # hashed outside the lock: a key's own code never runs holding it
        ticket = key if isinstance(key, GroupKey) else GroupKey(key)
    except Exception as exc:
        _bad_key(key, "hashed", exc)
        return None
    with _lock:
        try:  # the key's own __eq__ may raise (re-entering here on this thread finds the lock its own)
            group = _groups.get(ticket)
            if group is None:
                group = _groups[ticket] = _Group(ticket)
                _shape.opened(len(_groups))
        except Exception as exc:
            _bad_key(ticket.key, "compared", exc)
            return None
        group.started += 1
        group.open += 1
        _joins[0] += 1
        if group.started == 2:
            _shape.siblings = True
        return group.key, group.started - 1


def place(
    ticket: GroupKey, index: int, policy: Siblings, workers: int | None, gathered: bool = False
) -> str | None:
    """The parent of the ``index``-th attempt of ``ticket``'s group: its group's K chosen by the first
    attempt placed (``gathered``: it waited for its step to gather, so a first step is sized by
    itself); ``WITHHELD`` where ``fleet`` withholds the session, ``None`` where it goes alone."""
    with _lock:
        if not ticket.placed:
            ticket.placed = True
            ticket.size, ticket.sized = (
                _fleet_size(workers, policy.withholds, gathered) if policy.sized else (policy.size, False)
            )
        size = ticket.size  # siblings per parent (0: all; None: the session withheld, ``fleet``)
        if size is None:
            return WITHHELD
        group = _own(ticket)
        if group is None or (size == 1 and policy.sized):
            return None  # forgotten (a fork, or the attempt ended first), or each sibling alone
        sub = index // size if size else 0
        while len(group.parents) <= sub:
            group.parents.append(new_session_id())
        return group.parents[sub]


def leave(ticket: GroupKey) -> None:
    """One attempt ended (``ticket``: what its ``join`` returned); the last one open forgets the group."""
    with _lock:
        group = _own(ticket)
        if group is not None:
            group.open -= 1
            if group.open <= 0:
                _own(ticket, forget=True)
                _shape.ended(group.started, len(_groups))
                _pacing.release(group.parents)  # their turns at the router are over


def _own(ticket: GroupKey, forget: bool = False) -> _Group | None:
    """``ticket``'s own group (``forget``: taken out of the table, where it is), found by identity
    alone, holding ``_lock``: the key's own code does not run again once its attempt has joined."""
    ticket.alone = True
    try:
        return _groups.pop(ticket) if forget else _groups.get(ticket)
    finally:
        ticket.alone = False


class Inferred:
    """One attempt's group, still to be read from its first request to a router (``trajectory()``
    without ``group=``, or any attempt under ``fleet``, whose K needs the router): decided once, by
    that request's prompt (or the ``group=`` given), then the same for every later request of the
    attempt, and left as the attempt ends."""

    __slots__ = ("decided", "given", "index", "key", "parent", "policy", "withheld")

    def __init__(self, policy: Siblings, given: Hashable | None = None) -> None:
        self.policy = policy
        self.given = given  # the trajectory(group=...) key, which wins over the prompt's
        self.decided = False
        self.withheld = False  # ``fleet`` chose to send this attempt without its session
        self.key: GroupKey | None = None  # the group joined, while the attempt is open in it
        self.index = 0  # its place in that group
        self.parent: str | None = None

    def enter(self, key: Hashable | None) -> None:
        """Count the attempt in its group (the given key, else ``key``) before deciding it, so that
        its siblings gathering now see it (``_hop.gather``); its K is chosen by ``decide``."""
        with _decide_lock:
            key = self.given if self.given is not None else key
            if not self.decided and self.key is None and key is not None:
                entered = enter(key)
                if entered is not None:
                    self.key, self.index = entered

    def decide(self, key: Hashable | None, workers: int | None = None) -> str | None:
        """The attempt's parent: joined under the given key or else ``key`` (``None``: no group, no
        parent) by the first request to decide, kept for every later one; ``workers``: the router's
        fleet size, for ``fleet``. An attempt that entered its group first (it gathered) is sized by
        the step open now where no step has ended yet."""
        with _decide_lock:
            if not self.decided:
                self.decided = True
                key = self.given if self.given is not None else key
                if self.key is not None:
                    parent: str | None = place(self.key, self.index, self.policy, workers, True)
                elif key is not None and (joined := join(key, self.policy, workers)) is not None:
                    parent, self.key = joined
                else:
                    return None
                self.withheld = parent == WITHHELD
                self.parent = None if self.withheld else parent
            return self.parent

    def withhold(self) -> None:
        """``fleet`` sends this attempt without its session whatever its group (pinning was seen to
        cost step time at its router): it joins no group, so no later sibling waits on it."""
        with _decide_lock:
            if not self.decided:
                self.decided = self.withheld = True

    def release(self) -> None:
        """The attempt ended: its group forgets it (the group itself once its last attempt ends)."""
        with _decide_lock:
            key, self.key = self.key, None
            self.decided = True  # a request sent after the end (a straggler) joins nothing
        if key is not None:
            leave(key)


_decide_lock = threading.RLock()


def _forget_in_child() -> None:
    """``os.register_at_fork`` hook, in a forked child: the groups it inherits are its parent's open
    attempts, which the child never ends, so a worker forked mid-attempt groups its own siblings afresh
    (kept, they would pair its first sibling with an ended one and never forget the group)."""
    global _lock, _decide_lock, _shape
    _groups.clear()
    _shape = _Shape()
    _lock = threading.RLock()  # other threads of the parent may have held them as it forked: the
    _decide_lock = threading.RLock()  # child has no such thread to release them


if hasattr(os, "register_at_fork"):  # where processes fork (not on Windows)
    os.register_at_fork(after_in_child=_forget_in_child)


def forget_shape() -> None:
    """Forget the steps seen (``unconfigure()``): groups still open keep their K."""
    global _shape
    with _lock:
        _shape = _Shape()


def open_groups() -> int:
    """How many groups are known now (each with an attempt open): bounded by the attempts open."""
    return len(_groups)
