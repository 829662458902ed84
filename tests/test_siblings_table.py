"""The sibling table (``otel_session._siblings``) on its own, in the fast tier: which parent each
join names, when a group is forgotten, what a key's own code may and may not do, and how a spelling
reads and prints. End to end over loopback: ``tests/test_siblings.py``.
"""

from __future__ import annotations

import heapq
import logging
import os
import select
from collections.abc import Iterator

import pytest

from otel_session import _faults, _pacing, _siblings
from otel_session._siblings import GroupKey, Inferred, Siblings, join, leave, open_groups, place


@pytest.fixture(autouse=True)
def _empty_table() -> Iterator[None]:
    """Each test starts with no group and leaves none behind for the tests after it."""
    _siblings._groups.clear()
    yield
    _siblings._groups.clear()


def test_k_siblings_share_each_parent_and_every_join_is_counted_open() -> None:
    pairs = Siblings(2)
    joined = [join("g", pairs) for _ in range(5)]
    parents = [j[0] for j in joined if j is not None]
    assert parents[0] == parents[1] != parents[2] == parents[3] != parents[4]
    (group,) = _siblings._groups.values()
    assert (group.started, group.open, len(group.parents)) == (5, 5, 3)
    for entry in joined:
        assert entry is not None
        leave(entry[1])
    assert open_groups() == 0


def test_prompt_puts_every_sibling_under_one_parent_and_attempt_names_none() -> None:
    assert len({j[0] for j in (join("g", Siblings(0)) for _ in range(4)) if j is not None}) == 1
    assert join("h", Siblings(None)) is None and open_groups() == 1


def test_a_group_is_forgotten_only_when_its_last_attempt_leaves() -> None:
    first, second = join("g", Siblings(2)), join("g", Siblings(2))
    assert first is not None and second is not None
    leave(first[1])
    assert open_groups() == 1 and next(iter(_siblings._groups.values())).open == 1
    leave(second[1])
    assert open_groups() == 0
    third = join("g", Siblings(2))
    assert third is not None and third[0] != first[0]  # a new step: a new parent


def test_leaving_with_a_stale_ticket_leaves_the_new_group_alone() -> None:
    old = join("g", Siblings(2))
    assert old is not None
    leave(old[1])
    new = join("g", Siblings(2))
    assert new is not None
    leave(old[1])  # the old group's ticket again: not this group's
    assert open_groups() == 1
    leave(GroupKey("never joined"))
    assert open_groups() == 1


class Unequal:
    """A key whose equality raises (an application's own ``__eq__``)."""

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing me")


def test_a_key_whose_equality_raises_names_no_parent_and_is_reported_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_faults, "_reported", set())
    assert join(Unequal(), Siblings(2)) is not None  # alone in its bucket: never compared
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        assert join(Unequal(), Siblings(2)) is None  # compared with the first: raises, no parent
        assert join(Unequal(), Siblings(2)) is None  # ... said once
    (said,) = [r for r in caplog.records if r.name == "otel_session"]
    assert said.getMessage() == (
        "otel-session: a trajectory(group=...) key of type Unequal cannot be compared (RuntimeError); "
        "its attempt runs under its own session but names no parent, so the router places it alone. "
        "Use a str, an int or a tuple of those. Logged once per process."
    )
    assert said.exc_info is None  # the key's own code failed: no traceback of it


class Unhashable:
    def __hash__(self) -> int:
        raise ValueError("no hash today")


def test_a_key_whose_hash_raises_names_no_parent_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_faults, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        assert join(Unhashable(), Siblings(2)) is None  # a prompt's key, hashed by join itself
        assert _siblings.key_of(Unhashable()) is None  # trajectory(group=...)'s, hashed as it is made
        assert _siblings.key_of(("ok", 1)) == GroupKey(("ok", 1))
    (said,) = [r.getMessage() for r in caplog.records if r.name == "otel_session"]
    assert "a trajectory(group=...) key of type Unhashable cannot be hashed (ValueError); its " in said
    monkeypatch.setattr(_faults, "_reported", set())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        assert _siblings.key_of(Unhashable()) is None  # trajectory(group=...)'s first: its own line
    (said,) = [r.getMessage() for r in caplog.records if r.name == "otel_session"]
    assert "a trajectory(group=...) key of type Unhashable cannot be hashed (ValueError); its " in said


def test_a_ticket_equals_only_a_ticket_of_an_equal_key() -> None:
    assert GroupKey("a") == GroupKey("a") and GroupKey("a") != GroupKey("b")
    assert GroupKey("a") != "a" and hash(GroupKey("a")) == hash("a")
    nan = float("nan")
    assert GroupKey(nan) == GroupKey(nan)  # the same object: equal though nan != nan
    assert GroupKey(float("nan")) != GroupKey(float("nan"))


def test_an_inferred_attempt_decides_once_and_a_straggler_joins_nothing() -> None:
    attempt = Inferred(Siblings(2))
    assert attempt.decided is False and attempt.key is None
    parent = attempt.decide("g")
    assert parent is not None and attempt.decide("other") == parent and open_groups() == 1
    attempt.release()
    assert open_groups() == 0 and attempt.decided is True
    late = Inferred(Siblings(2))
    late.release()
    assert late.decide("g") is None and open_groups() == 0  # released before its first request


def test_an_inferred_attempt_without_a_prompt_names_no_parent_for_good() -> None:
    attempt = Inferred(Siblings(2))
    assert attempt.decide(None) is None and attempt.decide("g") is None and open_groups() == 0


@pytest.mark.parametrize(
    ("text", "shown"),
    [("attempt", "attempt"), ("PROMPT", "prompt"), ("groups:3", "groups:3"), ("groups:4096", "groups:4096")],
)
def test_a_spelling_prints_as_it_reads(text: str, shown: str) -> None:
    assert str(Siblings.parse(text)) == shown


@pytest.mark.parametrize("text", ["groups:4097", "groups:2:3", "x:groups:2"])
def test_spellings_out_of_range_or_with_two_colons_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not attempt, prompt, auto, fleet or groups:K"):
        Siblings.parse(text)


def test_a_forked_child_starts_with_an_empty_table_and_fresh_locks() -> None:
    assert join("g", Siblings(2)) is not None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            fresh = _siblings._lock.acquire(blocking=False) and _siblings._decide_lock.acquire(blocking=False)
            groups, shape = open_groups(), _siblings.shape(True)  # the child's own: the parent's gone
            joined = join("h", Siblings(2)) is not None
            os.write(write_end, f"{groups} {fresh} {shape} {joined}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 10)
        assert ready, "the forked child sent nothing within 10 s"
        said = os.read(read_end, 100).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    assert said == "0 True None True" and open_groups() == 1


# ---- a first step gathered: enter now, K chosen at the first placement (``_gathering``) -------------


def test_entering_counts_each_attempt_once_and_keeps_its_place() -> None:
    _siblings.forget_shape()
    before = _siblings.joined()
    entered = [_siblings.enter("g") for _ in range(3)]
    assert _siblings.joined() == before + 3
    assert [e[1] for e in entered if e is not None] == [0, 1, 2]
    assert _siblings.open_groups() == 1


def test_the_step_open_now_sizes_only_a_gathered_attempt() -> None:
    """Before any step has ended, a group of two or more siblings open now is the shape a gathered
    attempt sizes by; an attempt that did not gather keeps the default's K."""
    _siblings.forget_shape()
    _siblings.enter("lone")
    assert _siblings.shape(True) is None  # one sibling open: nothing to size by
    _siblings.enter(("p", 1))
    _siblings.enter(("p", 1))
    assert _siblings.shape() is None and _siblings.shape(True) == (2, 2)  # two groups, two at most
    assert _siblings.fleet_size_of(4, withhold=False) == 2  # not gathered: the default's pairs
    assert _siblings.fleet_size_of(8, withhold=False, gathered=True) == 1  # ceil(2 / (8 // 2))
    assert _siblings.fleet_size_of(2, withhold=False, gathered=True) == 2  # ceil(2 / (2 // 2))
    assert not _siblings.step_seen() and _siblings.last_shape() == (2, 2)


def test_a_groups_k_is_chosen_by_its_first_placement_and_kept() -> None:
    _siblings.forget_shape()
    auto = Siblings.parse("auto")
    tickets = [_siblings.enter("g") for _ in range(4)]
    assert all(t is not None for t in tickets)
    first = [_siblings.place(t[0], t[1], auto, 4, True) for t in tickets[:2] if t is not None]
    assert first == [None, None]  # 1 group of 4 on 4 workers: each alone
    later = [_siblings.place(t[0], t[1], auto, 1, True) for t in tickets[2:] if t is not None]
    assert later == [None, None]  # the fleet read again as 1 worker: the group keeps its K
    group_key = tickets[0][0] if tickets[0] is not None else None
    assert group_key is not None and group_key.placed and group_key.sized and group_key.size == 1


def test_a_ticket_given_joins_the_group_of_its_key() -> None:
    """``trajectory(group=...)`` joins with the key hashed once (a GroupKey): the same group as the
    key itself, never a group of its own."""
    pairs = Siblings(2)
    first = join(_siblings.key_of("g"), pairs)
    second = join(_siblings.key_of("g"), pairs)
    third = join("g", pairs)
    assert first is not None and second is not None and third is not None
    assert first[0] == second[0] != third[0] and open_groups() == 1


def test_a_placement_after_its_group_was_forgotten_names_no_parent() -> None:
    pairs = Siblings(2)
    entered = _siblings.enter("g")
    assert entered is not None
    _siblings._groups.clear()  # as a forked child starts
    assert _siblings.place(entered[0], entered[1], pairs, None) is None


@pytest.mark.parametrize(
    ("workers", "groups", "siblings", "size"),
    [
        (32, 16, 8, 4),  # the groups fit: one group per worker (2 per prompt, 32 groups)
        (64, 8, 16, 2),
        (128, 64, 8, 4),
        (1024, 512, 16, 8),
        (8, 4, 8, 4),
        (8, 6, 4, 4),  # 6 groups of 4 on 8 workers: one each, two workers idle
        (8, 5, 8, 8),  # 5 on 8: one each (measured faster than kv routing alone)
        (128, 16, 8, 1),  # 8 workers per prompt: each sibling alone
        (8, 8, 1, 1),
        (8, 16, 4, 4),  # twice as many prompts as workers: two whole groups on each
        (4, 8, 2, 2),
        (8, 16, 8, 8),
        (8, 10, 4, 3),  # 10 groups of 4 on 8 workers put 8 siblings on two (1.6x a fair share of
        # 5): (3, 1) puts 6, and so would pairs, in smaller groups
        (8, 12, 4, 4),  # 8 where a fair share is 6 (1.33x): whole groups still
        (8, 12, 8, 8),  # 16 against 12: whole (measured faster than split (6, 2))
        (8, 9, 8, 5),  # 16 against 9 (1.8x): (5, 3)
        (32, 40, 8, 5),  # (5, 3): 11 against 16 (1.6x); pairs would make it 10, each prompt in 4
        (2, 3, 4, 4),  # 8 against 6: whole
        (2, 3, 2, 2),  # a group of 2 is never split
        (3, 4, 4, 3),  # 8 where a fair share is 5.33: exactly 1.5x, so split
        (0, 3, 4, 4),  # no worker listed (a /health that lists none): whole groups
        (0, 1, 4, 4),
    ],
)
def test_k_puts_the_fewest_siblings_on_the_busiest_worker_in_the_largest_groups(
    workers: int, groups: int, siblings: int, size: int
) -> None:
    assert _siblings.group_size(workers, groups, siblings) == size


def test_the_busiest_worker_holds_the_groups_dealt_largest_first_to_the_least_loaded() -> None:
    assert _siblings.busiest(8, 10, 4, 4) == 8  # 10 groups on 8 workers: two on some
    assert _siblings.busiest(8, 10, 4, 2) == 6  # 20 pairs: three on some
    assert _siblings.busiest(8, 10, 4, 3) == 6  # 10 of 3, then 10 of 1: 3+3 on two, 3+1+1 on the rest
    assert _siblings.busiest(8, 6, 4, 3) == 3  # 6 of 3 on six workers, six of 1 on the two idle ones
    assert _siblings.busiest(8, 5, 8, 3) == 6  # 10 of 3, then 5 of 2
    assert _siblings.busiest(8, 16, 4, 4) == 8 and _siblings.busiest(32, 16, 8, 4) == 4
    assert _siblings.busiest(3, 2, 5, 4) == 4  # 4 and 4, then both 1s on the idle worker
    assert _siblings.busiest(3, 4, 5, 4) == 8  # 4 of 4 (two on one worker), then 4 of 1
    assert _siblings.busiest(0, 2, 4, 4) == 8  # no worker listed: all of them on one


def test_k_is_never_larger_than_one_group_per_worker_and_alone_only_where_each_has_a_worker() -> None:
    """The rule's promises over a grid of fleets: K at most one group per worker, and exactly that
    where the groups fit the workers; 1 only where every sibling gets a worker of its own; where the
    groups outnumber the workers, whole groups unless those put 1.5x a fair share on the busiest,
    else a prompt in one group or two, the busiest worker never more crowded than with whole groups."""
    for workers in (1, 2, 3, 5, 8, 24, 32, 100):
        for groups in range(1, 40):
            for siblings in (1, 2, 3, 4, 5, 6, 8, 16, 32):
                size = _siblings.group_size(workers, groups, siblings)
                fit = -(-siblings // max(1, workers // groups))
                assert 1 <= size <= fit, (workers, groups, siblings)
                assert (size == 1) == (groups * siblings <= workers or siblings == 1)
                if groups <= workers:
                    assert size == fit
                elif -(-groups // workers) * workers < 1.5 * groups:  # whole groups crowd under 1.5x
                    assert size == siblings
                else:
                    assert size == siblings == 1 or 2 * size >= siblings  # one group or two
                    held = _siblings.busiest(workers, groups, siblings, size)
                    assert held <= _siblings.busiest(workers, groups, siblings, siblings)


def test_groups_go_close_unless_a_prompt_is_split_into_a_group_and_a_smaller_rest_or_they_are_pairs() -> None:
    """What ``_pacing`` is told: 10 prompts of 4 on 8 workers are split (3, 1), not sent close; on 5
    workers (two whole groups each), on 40 (one per sibling) or with no step known, close. 8 prompts
    of 2 on 4 workers are pairs, not close; on 16, each sibling alone, close."""
    _siblings.forget_shape()
    assert _siblings.close(8)  # nothing known: as before
    auto = Siblings.parse("auto")
    tickets = [_siblings.join(f"p{prompt}", auto) for prompt in range(10) for _ in range(4)]
    assert not _siblings.close(8) and _siblings.close(5) and _siblings.close(40)  # the step gathering
    for ticket in tickets:
        assert ticket is not None
        leave(ticket[1])
    assert _siblings.last_shape() == (10, 4)
    assert not _siblings.close(8) and _siblings.close(10) and _siblings.close(12)  # the last step's
    assert not _siblings.close(9) and _siblings.close(3)  # 10 on 9: (3, 1) again; on 3, whole (1.2x)
    assert _siblings.close(0)  # a router that lists no workers: whole groups, nothing to divide by
    _siblings.forget_shape()
    tickets = [_siblings.join(f"q{prompt}", auto) for prompt in range(8) for _ in range(2)]
    assert not _siblings.close(4) and not _siblings.close(8) and _siblings.close(16)  # pairs; alone
    for ticket in tickets:
        assert ticket is not None
        leave(ticket[1])
    assert _siblings.last_shape() == (8, 2) and not _siblings.close(4)
    _siblings.forget_shape()
    assert _siblings.close(8)


def test_the_busiest_worker_is_what_dealing_the_groups_one_by_one_gives() -> None:
    """``busiest`` against a plain deal, largest group first, each to the least loaded worker."""
    for workers in range(0, 7):
        for groups in range(1, 13):
            for siblings in range(1, 9):
                for size in range(1, siblings + 1):
                    sizes = [size] * (siblings // size) + ([siblings % size] if siblings % size else [])
                    loads = [0] * max(1, workers)
                    for group in sorted(sizes * groups, reverse=True):
                        heapq.heapreplace(loads, loads[0] + group)
                    assert _siblings.busiest(workers, groups, siblings, size) == max(loads), (
                        workers,
                        groups,
                        siblings,
                        size,
                    )


def test_a_split_is_worked_out_once_per_shape_and_a_few_shapes_are_kept() -> None:
    _siblings._sized.clear()
    assert _siblings.group_size(8, 10, 4) == 3 and _siblings._sized == {(8, 10, 4): 3}
    assert _siblings.group_size(8, 16, 4) == 4 and len(_siblings._sized) == 1  # whole: nothing to keep
    _siblings._sized.clear()
    for groups in range(100, 100 + _siblings.SHAPES_KEPT):
        _siblings.group_size(groups - 20, groups, 4)
    assert len(_siblings._sized) == _siblings.SHAPES_KEPT
    _siblings.group_size(8, 9, 4)
    assert len(_siblings._sized) == 1 and _siblings._sized[8, 9, 4] == _siblings.group_size(8, 9, 4)
    _siblings._sized[8, 9, 4] = 2  # what is kept is what is used
    assert _siblings.group_size(8, 9, 4) == 2


def test_a_groups_parents_turns_are_released_as_its_last_attempt_leaves() -> None:
    """Kept, a long run's table of turns would fill and drop those of attempts still open (whose
    later requests would then wait as new parents): the group's last attempt to end releases them."""
    origin = ("http", "127.0.0.1", 9)
    first, second = join("g", Siblings(2)), join("g", Siblings(2))
    assert first is not None and second is not None and first[0] == second[0] is not None
    _pacing.delay(origin, first[0])  # the parent takes its turn at the router
    leave(first[1])
    assert first[0] in _pacing._turns  # a sibling is still open under it
    leave(second[1])
    assert first[0] not in _pacing._turns and open_groups() == 0


class _Breaks:
    """A group key whose ``__eq__`` works while its attempts start and raises later (an application's
    object that changed), with every instance on one hash."""

    broken = False

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        if _Breaks.broken:
            raise RuntimeError("compared after it changed")
        return isinstance(other, _Breaks) and other.name == self.name


def test_an_attempt_leaves_its_group_though_its_keys_comparison_raises_by_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two groups on one hash whose keys' ``__eq__`` (the application's code) raises by the time their
    attempts end: each attempt still finds its own group, by identity, and the last one forgets it (a
    group left in the table would hold every later step's shape open), without raising into the
    user's ``with``; a sibling placed by then still gets its group's parent."""
    first, second = join(_Breaks("a"), Siblings(2)), join(_Breaks("b"), Siblings(2))
    third = join(_Breaks("b"), Siblings(2))
    assert first is not None and second is not None and third is not None and open_groups() == 2
    assert third[1] is second[1] and third[0] == second[0]
    monkeypatch.setattr(_Breaks, "broken", True)
    assert place(second[1], 1, Siblings(2), None) == second[0]
    leave(second[1])
    assert open_groups() == 2  # the group's other attempt is still open
    leave(third[1])
    leave(first[1])
    assert open_groups() == 0
