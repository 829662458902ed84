"""Siblings: attempts that share a prompt (a GRPO group), and the parent session each is sent under.

Every attempt keeps a session of its own; what this decides is whether siblings also name a common
parent (Dynamo's ``X-Dynamo-Parent-Session-ID``), which makes the router place them together. All
siblings under one parent share the prompt's cache on one worker but crowd it; each on its own
spreads them and recomputes the shared prompt on every worker. ``groups:K`` puts each K siblings
open at once under a parent of their own: the measured middle (docs/performance.md, "At fleet
scale"). A group is named by the caller (``trajectory(group=...)``) or, where it names none, by the
prompt of the attempt's first request to a router (``Inferred``, keyed by ``_prompts``). A group is
known only while one of its attempts is open, so nothing here outlives a step.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Hashable
from dataclasses import dataclass

from otel_session import _faults
from otel_session._ids import new_session_id

ENV_SIBLINGS = "OTEL_SESSION_SIBLINGS"


@dataclass(frozen=True)
class Siblings:
    """How attempts of one group are keyed: ``size`` siblings under each parent; ``None``: none
    under a parent (``attempt``); ``0``: all of them under one (``prompt``)."""

    size: int | None

    @classmethod
    def parse(cls, text: str) -> Siblings:
        """``attempt``, ``prompt`` or ``groups:K`` (K a whole number from 1); ``ValueError`` else."""
        value = text.strip().lower()
        if value == "attempt":
            return cls(None)
        if value == "prompt":
            return cls(0)
        kind, sep, size = value.partition(":")
        if kind == "groups" and sep and size.isdigit() and 1 <= int(size) <= 4096:
            return cls(int(size))
        raise ValueError(f"{text!r} is not attempt, prompt or groups:K (K from 1 to 4096, e.g. groups:2)")

    def __str__(self) -> str:
        return "attempt" if self.size is None else "prompt" if self.size == 0 else f"groups:{self.size}"


# The default, chosen from the fleet measurements (docs/performance.md, "At fleet scale").
DEFAULT = Siblings(2)


class GroupKey:
    """A group key as its group's first attempt joined: its hash taken once, so every attempt leaves
    the group by that hash and by identity, never running the key's own code again (a key the
    application changes while the attempt runs, or whose ``__hash__`` raises later, would otherwise
    stay in ``_groups`` for good)."""

    __slots__ = ("hash", "key")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.hash = hash(key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GroupKey) and (other.key is self.key or bool(other.key == self.key))


class _Group:
    __slots__ = ("key", "open", "parents", "started")

    def __init__(self, key: GroupKey) -> None:
        self.key = key  # as the group's first attempt joined: every attempt leaves with this one
        self.started = 0  # attempts of the group opened while it was known
        self.open = 0  # attempts of the group open now
        self.parents: list[str] = []  # one per sub-group, minted as the sub-group opens


_groups: dict[GroupKey, _Group] = {}
_lock = threading.Lock()


def join(key: Hashable, policy: Siblings) -> tuple[str, GroupKey] | None:
    """The parent session for one more attempt of group ``key`` under ``policy`` and the ticket to
    ``leave`` with once it ends (``None``: no parent, nothing to leave)."""
    if policy.size is None:
        return None
    with _lock:
        try:  # the key's own __hash__ or __eq__ may raise: that attempt then names no parent
            ticket = GroupKey(key)
            group = _groups.get(ticket)
            if group is None:
                group = _groups[ticket] = _Group(ticket)
        except Exception as exc:
            _faults.report("comparing a trajectory(group=...) key", exc)
            return None
        sub = group.started // policy.size if policy.size else 0
        while len(group.parents) <= sub:
            group.parents.append(new_session_id())
        group.started += 1
        group.open += 1
        return group.parents[sub], group.key


def leave(ticket: GroupKey) -> None:
    """One attempt ended (``ticket``: what its ``join`` returned); the last one open forgets the group."""
    with _lock, contextlib.suppress(Exception):  # found by identity: the key's own code is not run
        group = _groups.get(ticket)
        if group is not None and group.key is ticket:
            group.open -= 1
            if group.open <= 0:
                del _groups[ticket]


class Inferred:
    """One attempt's group, still to be read from its first request to a router (``trajectory()``
    without ``group=``): decided once, by that request's prompt, then the same for every later request
    of the attempt, and left as the attempt ends."""

    __slots__ = ("decided", "key", "parent", "policy")

    def __init__(self, policy: Siblings) -> None:
        self.policy = policy
        self.decided = False
        self.key: GroupKey | None = None  # the group joined, while the attempt is open in it
        self.parent: str | None = None

    def decide(self, key: Hashable | None) -> str | None:
        """The attempt's parent: joined under ``key`` (``None``: no group, no parent) by the first
        request to decide, kept for every later one."""
        with _decide_lock:
            if not self.decided:
                self.decided = True
                if key is not None:
                    joined = join(key, self.policy)
                    if joined is not None:
                        self.parent, self.key = joined
            return self.parent

    def release(self) -> None:
        """The attempt ended: its group forgets it (the group itself once its last attempt ends)."""
        with _decide_lock:
            key, self.key = self.key, None
            self.decided = True  # a request sent after the end (a straggler) joins nothing
        if key is not None:
            leave(key)


_decide_lock = threading.Lock()


def _forget_in_child() -> None:
    """``os.register_at_fork`` hook, in a forked child: the groups it inherits are its parent's open
    attempts, which the child never ends, so a worker forked mid-attempt groups its own siblings afresh
    (kept, they would pair its first sibling with an ended one and never forget the group)."""
    global _lock, _decide_lock
    _groups.clear()
    _lock = threading.Lock()  # other threads of the parent may have held them as it forked: the
    _decide_lock = threading.Lock()  # child has no such thread to release them


if hasattr(os, "register_at_fork"):  # where processes fork (not on Windows)
    os.register_at_fork(after_in_child=_forget_in_child)


def open_groups() -> int:
    """How many groups are known now (each with an attempt open): bounded by the attempts open."""
    return len(_groups)
