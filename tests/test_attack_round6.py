"""An outside attack on the sixth round's surfaces (issue 34, item 3): sibling group keys, named
boundaries' group specs, the run-time evidence read from router responses, and ``doctor --watch``.
Written from README.md and docs/ only, through the public API over loopback to real servers; each
test here failed before the fix committed with it (the commit message says what it showed)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import httpx

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER
from tests.recorder import Recorder


class HashRaises:
    """A group key whose ``__hash__`` raises something other than ``TypeError`` (a lazy record whose
    hash reads a field not loaded yet, say)."""

    def __hash__(self) -> int:
        raise RuntimeError("hash exploded")


class Shifting:
    """A group key hashed by a field the application changes while the attempt runs."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shifting) and other.name == self.name


def test_a_group_key_whose_hash_raises_still_opens_an_attempt_with_a_session(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="groups:2")
    with otel_session.trajectory(group=HashRaises()) as attempt, httpx.Client() as client:
        assert client.get(f"{dynamo.url}/h", timeout=10).status_code == 200
    assert dynamo.requests[0].get(SESSION_HEADER) == attempt.session_id
    assert dynamo.requests[0].get(PARENT_SESSION_HEADER) is None


class BreaksLater:
    """A group key whose ``__hash__`` works until the application flips ``broken``."""

    broken = False

    def __hash__(self) -> int:
        if BreaksLater.broken:
            raise RuntimeError("hash exploded later")
        return 11


def _traced_growth(attempts: Callable[[int], None], count: int) -> int:
    """Bytes still allocated after ``count`` attempts (and a warm-up), as tracemalloc counts them."""
    for index in range(200):
        attempts(index)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for index in range(count):
            attempts(index)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_group_keys_changed_or_broken_during_their_attempts_leave_no_state_behind() -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="groups:2")

    def shifting(index: int) -> None:
        key = Shifting(f"before-{index}")
        with otel_session.trajectory(group=key):
            key.name = f"after-{index}"  # its hash now differs from the one it joined under

    def breaking(index: int) -> None:
        with otel_session.trajectory(group=BreaksLater()):
            BreaksLater.broken = True
        BreaksLater.broken = False

    # measured on the unfixed code: ~430 bytes a shifted attempt (430 MB over a million attempts)
    grown = {"shifting": _traced_growth(shifting, 5000), "breaking": _traced_growth(breaking, 5000)}
    assert all(size < 200_000 for size in grown.values()), grown
