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


class _Group:
    __slots__ = ("open", "parents", "started")

    def __init__(self) -> None:
        self.started = 0  # attempts of the group opened while it was known
        self.open = 0  # attempts of the group open now
        self.parents: list[str] = []  # one per sub-group, minted as the sub-group opens


_groups: dict[Hashable, _Group] = {}
_lock = threading.Lock()


def join(key: Hashable, policy: Siblings) -> str | None:
    """The parent session for one more attempt of group ``key`` under ``policy`` (``None``: none);
    every ``join`` that returned a parent is matched by one ``leave(key)``."""
    if policy.size is None:
        return None
    with _lock:
        try:  # the key's own __hash__ or __eq__ may raise: that attempt then names no parent
            group = _groups.get(key)
            if group is None:
                group = _groups[key] = _Group()
        except Exception as exc:
            _faults.report("comparing a trajectory(group=...) key", exc)
            return None
        sub = group.started // policy.size if policy.size else 0
        while len(group.parents) <= sub:
            group.parents.append(new_session_id())
        group.started += 1
        group.open += 1
        return group.parents[sub]


def leave(key: Hashable) -> None:
    """One attempt of group ``key`` ended; the last one open forgets the group."""
    with _lock, contextlib.suppress(Exception):  # a key that raised in join() has no group to leave
        group = _groups.get(key)
        if group is not None:
            group.open -= 1
            if group.open <= 0:
                del _groups[key]


class Inferred:
    """One attempt's group, still to be read from its first request to a router (``trajectory()``
    without ``group=``): decided once, by that request's prompt, then the same for every later request
    of the attempt, and left as the attempt ends."""

    __slots__ = ("decided", "key", "parent", "policy")

    def __init__(self, policy: Siblings) -> None:
        self.policy = policy
        self.decided = False
        self.key: Hashable | None = None  # the group joined, while the attempt is open in it
        self.parent: str | None = None

    def decide(self, key: Hashable | None) -> str | None:
        """The attempt's parent: joined under ``key`` (``None``: no group, no parent) by the first
        request to decide, kept for every later one."""
        with _decide_lock:
            if not self.decided:
                self.decided = True
                if key is not None:
                    self.parent = join(key, self.policy)
                    self.key = key if self.parent is not None else None
            return self.parent

    def release(self) -> None:
        """The attempt ended: its group forgets it (the group itself once its last attempt ends)."""
        with _decide_lock:
            key, self.key = self.key, None
            self.decided = True  # a request sent after the end (a straggler) joins nothing
        if key is not None:
            leave(key)


_decide_lock = threading.Lock()


def open_groups() -> int:
    """How many groups are known now (each with an attempt open): bounded by the attempts open."""
    return len(_groups)
