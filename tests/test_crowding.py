"""The crowding judgement (issue 33, item 6) on turns as ``_evidence`` hands them over: pure
functions of worker ids, sessions and latencies, so their thresholds are checked here exactly; the
same judgement against a real Dynamo is tests/test_crowding_dynamo.py."""

from __future__ import annotations

import time

import pytest

from otel_session import _crowding, _verdicts

ROUTER = ("dynamo", "127.0.0.1", 8000)


def _fleet(per_worker: dict[int, int], slow: float = 0.4, fast: float = 0.1) -> _crowding.Look | None:
    """Sessions spread as ``per_worker`` says, 2 turns each in one window; the last look."""
    fleet = _crowding.Fleet()
    look = None
    now = 100.0
    for turn in range(2):
        for worker, sessions in per_worker.items():
            for s in range(sessions):
                latency = slow if sessions >= _crowding.CROWDED_SESSIONS else fast
                look = fleet.turn(f"w{worker}s{s}", worker, latency, now + turn) or look
    return look


def _pinned() -> _verdicts.RouterEvidence:
    return _verdicts.RouterEvidence(pairs=40, switched=0)


def test_one_worker_crowded_while_others_serve_little_is_named_with_the_fix_once() -> None:
    look = _fleet({1: 12, 2: 1, 3: 1, 4: 2})
    assert look is not None and look.crowded == {1: 12} and look.slow == 0.4 and look.fast == 0.1
    seen = _pinned()
    line = _verdicts.crowding(ROUTER, seen, look, "prompt")
    assert line is not None and "worker(s) 1 (12 sessions)" in line and "siblings='groups:2'" in line
    assert _verdicts.crowding(ROUTER, seen, look, "prompt") is None  # once per router
    other = _verdicts.crowding(ROUTER, _pinned(), look, "groups:2")
    assert other is not None and "drop session affinity" in other


def test_a_balanced_fleet_is_silent() -> None:
    assert _fleet({1: 4, 2: 4, 3: 4, 4: 4}) is None  # four sessions each: nobody above a fair share


def test_crowded_but_no_slower_is_silent() -> None:
    look = _fleet({1: 12, 2: 1, 3: 1, 4: 2}, slow=0.1, fast=0.1)
    assert look is not None and not _crowding.costs_step_time(look)
    assert _verdicts.crowding(ROUTER, _pinned(), look, "prompt") is None


def test_sessions_that_move_are_not_pinning() -> None:
    look = _fleet({1: 12, 2: 1, 3: 1, 4: 2})
    assert look is not None
    moving = _verdicts.RouterEvidence(pairs=40, switched=30)
    assert _verdicts.crowding(ROUTER, moving, look, "prompt") is None


def test_without_latencies_an_idle_worker_is_what_speaks() -> None:
    fleet = _crowding.Fleet()
    for worker in (1, 2, 3, 4):
        fleet.turn("early", worker, None, 0.0)  # every worker seen once, long ago
    look = None
    for s in range(16):
        look = fleet.turn(f"s{s}", 1 if s < 12 else 2, None, 100.0) or look
    assert look is not None and look.idle == 3 and look.slow is None  # 2, 3 and 4 served nothing since
    assert _crowding.costs_step_time(look)


# ----------------------------------------------------------------------------- each threshold at its edge


def _look(**fields: object) -> _crowding.Look:
    base: dict[str, object] = dict(crowded={1: 4}, workers=4, idle=0, sessions=8, slow=None, fast=None)
    base.update(fields)
    return _crowding.Look(**base)  # type: ignore[arg-type]


def test_costs_step_time_at_each_edge() -> None:
    slower = _crowding.SLOWER
    assert _crowding.costs_step_time(_look(slow=slower * 0.2, fast=0.2))  # exactly SLOWER: it costs
    assert not _crowding.costs_step_time(_look(slow=slower * 0.2 - 1e-9, fast=0.2))
    assert not _crowding.costs_step_time(_look(slow=1.0, fast=None, idle=0))  # one side only: idle speaks
    assert not _crowding.costs_step_time(_look(slow=None, fast=1.0, idle=0))
    assert _crowding.costs_step_time(_look(idle=1))
    assert not _crowding.costs_step_time(_look(idle=0))
    assert not _crowding.costs_step_time(_look(slow=0.2, fast=0.2, idle=3))  # latencies win over idle


def _fill(fleet: _crowding.Fleet, turns: list[tuple[str, int, float | None]], now: float) -> None:
    for session, worker, latency in turns:
        fleet.workers.add(worker)
        fleet.recent.append((now, session, worker, latency))


def test_a_worker_is_crowded_from_exactly_the_session_count_and_the_ratio() -> None:
    at = _crowding.CROWDED_SESSIONS
    fleet = _crowding.Fleet()
    # worker 1 holds exactly CROWDED_SESSIONS sessions; 9 other workers one each: share = (at + 9) / 10
    _fill(fleet, [(f"s{i}", 1, None) for i in range(at)] + [(f"o{w}", w, None) for w in range(2, 11)], 100.0)
    look = fleet.look(100.0)
    assert look is not None and look.crowded == {1: at} and look.workers == 10 and look.sessions == at + 9
    assert look.idle == 0 and fleet.crowded == frozenset({1})
    fleet = _crowding.Fleet()
    _fill(
        fleet, [(f"s{i}", 1, None) for i in range(at - 1)] + [(f"o{w}", w, None) for w in range(2, 11)], 100.0
    )
    assert fleet.look(100.0) is None  # one session short
    # under the ratio: 2 workers, worker 1 with 5 of 6 sessions: share 3, 5 < 2.0 x 3 = 6
    fleet = _crowding.Fleet()
    _fill(fleet, [(f"s{i}", 1, None) for i in range(5)] + [("o", 2, None)], 100.0)
    assert fleet.look(100.0) is None


def test_the_ratio_is_met_exactly_at_its_edge() -> None:
    fleet = _crowding.Fleet()  # 2 workers, 4 sessions: share 2; worker 1 holds 4 = 2.0 x 2
    _fill(fleet, [(f"s{i}", 1, None) for i in range(4)], 100.0)
    fleet.workers.add(2)
    look = fleet.look(100.0)
    assert look is not None and look.crowded == {1: 4} and look.idle == 1 and look.workers == 2


def test_two_groups_on_one_worker_of_a_one_group_per_worker_step_is_crowding() -> None:
    """The collision that doubled 256-worker steps behind three frontends (1.39x and 1.69x kv alone's,
    docs/performance.md): one group of 4 per worker but two on one and none on another, turns there
    twice as slow. At 2x a fair share, it is what the judgement must see."""
    fleet = _crowding.Fleet()
    look = None
    for turn in range(3):
        for worker in range(64):
            groups = 2 if worker == 0 else 0 if worker == 1 else 1
            for s in range(4 * groups):
                latency = 0.8 if groups == 2 else 0.4
                look = fleet.turn(f"w{worker}s{s}", worker, latency, 100.0 + turn) or look
        fleet.workers.add(1)  # the idle worker was seen in an earlier step
    assert look is not None and look.crowded == {0: 8} and look.idle == 1
    assert look.slow == 0.8 and look.fast == 0.4 and _crowding.costs_step_time(look)


def test_turns_leave_the_window_once_older_than_it() -> None:
    fleet = _crowding.Fleet()
    _fill(fleet, [(f"s{i}", 1, None) for i in range(8)], 100.0)
    fleet.workers.update(range(2, 11))  # nine idle workers: 8 sessions on one is crowded
    assert fleet.look(100.0 + _crowding.WINDOW) is not None  # exactly WINDOW old: still in
    assert fleet.look(100.0 + _crowding.WINDOW + 0.001) is None and not fleet.recent


def test_latencies_speak_from_exactly_min_latencies_and_the_median_is_the_upper_middle() -> None:
    least = _crowding.MIN_LATENCIES
    fleet = _crowding.Fleet()
    slow = [0.1 * (i + 1) for i in range(least)]  # 0.1 0.2 0.3 0.4: the upper middle is 0.3
    _fill(fleet, [(f"s{i}", 1, lat) for i, lat in enumerate(slow)], 100.0)
    _fill(fleet, [(f"o{i}", 2 + i, 0.05 * (i + 1)) for i in range(least - 1)], 100.0)
    fleet.workers.update(range(2, 13))
    look = fleet.look(100.0)
    assert look is not None and look.slow == pytest.approx(0.3) and look.fast is None
    assert look.sessions == 2 * least - 1 and look.idle == 12 - least  # 12 known, 1 + 3 served
    _fill(fleet, [("o9", 9, 0.2)], 100.0)
    look = fleet.look(100.0)
    assert look is not None and look.fast == pytest.approx(0.15)  # 0.05 0.1 0.15 0.2: the 3rd


def test_every_eighth_turn_looks_and_the_count_starts_again() -> None:
    fleet = _crowding.Fleet()
    fleet.workers.update(range(2, 11))
    looks = [fleet.turn(f"s{i}", 1, None, now=100.0) for i in range(2 * _crowding.EVERY)]
    assert [i for i, look in enumerate(looks) if look is not None] == [
        _crowding.EVERY - 1,
        2 * _crowding.EVERY - 1,
    ]
    assert fleet.since == 0


def test_a_turn_without_a_time_is_stamped_now() -> None:
    fleet = _crowding.Fleet()
    fleet.turn("s", 1, None)
    assert abs(fleet.recent[0][0] - time.monotonic()) < 5


def test_the_workers_kept_stop_at_their_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_crowding, "WORKERS_KEPT", 3)
    fleet = _crowding.Fleet()
    for worker in range(5):
        fleet.turn("s", worker, None, now=1.0)
    assert fleet.workers == {0, 1, 2}


def test_an_empty_window_is_no_look() -> None:
    assert _crowding.Fleet().look(1.0) is None


def test_a_steps_tail_on_a_few_workers_is_not_crowding() -> None:
    """256 workers, one group of 4 siblings on each (balanced: silent); 30 s later only the last
    group still takes turns, its 4 sessions on one worker while every other worker is done. Once
    read as crowding (4 sessions, 255 idle workers: the warning and ``fleet``'s withholding at the
    end of every step, found on a 256-worker run); a tail is a window under half the most sessions
    it held. At exactly half, it is judged."""
    fleet = _crowding.Fleet()
    for worker in range(256):
        for s in range(4):
            assert fleet.turn(f"w{worker}s{s}", worker, None, 100.0) is None
    assert fleet.peak == 1024
    for turn in range(2):
        for s in range(4):
            assert fleet.turn(f"w7s{s}", 7, None, 100.0 + _crowding.WINDOW + 1 + turn) is None
    assert fleet.crowded == frozenset()
    half = _crowding.Fleet(peak=16, peaked=100.0)
    _fill(half, [(f"s{i}", 1, None) for i in range(8)], 100.0)
    half.workers.update(range(2, 11))
    look = half.look(100.0)
    assert look is not None and look.crowded == {1: 8} and look.idle == 9
    half.peak = 17
    assert half.look(100.0) is None and half.crowded == frozenset()


def test_the_most_sessions_held_halves_every_minute_so_a_slower_step_of_the_same_size_is_judged() -> None:
    """Short balanced steps packed 448 sessions into one window; later steps of the same size, run
    slower because one worker is crowded, hold 64 a window (found by an outside attack: never judged
    again). The 448 count half as much a minute later, so such a step is judged 2.5 minutes on
    (448 / 2**2.5 = 79, under 2 x 64), not half a minute on, as a tail of those steps (317)."""
    crowded = [(f"c{i}", 0, None) for i in range(16)] + [(f"o{i}", 1 + i % 15, None) for i in range(48)]
    for since, decayed, judged in ((30.0, 448 * 0.5**0.5, False), (150.0, 448 * 0.5**2.5, True)):
        fleet = _crowding.Fleet(peak=448, peaked=100.0)
        fleet.workers.update(range(16))
        _fill(fleet, crowded, 100.0 + since)
        look = fleet.look(100.0 + since)
        assert (look is not None) is judged and fleet.peak == pytest.approx(decayed)
    assert look is not None and look.crowded == {0: 16}
    fleet = _crowding.Fleet(peak=100, peaked=100.0)
    _fill(fleet, crowded, 40.0)  # a clock gone back: the most held does not grow, nothing raises
    fleet.look(40.0)
    assert fleet.peak == 100 and fleet.peaked == 40.0
