"""The crowding judgement (issue 33, item 6) on turns as ``_evidence`` hands them over: pure
functions of worker ids, sessions and latencies, so their thresholds are checked here exactly; the
same judgement against a real Dynamo is tests/test_crowding_dynamo.py."""

from __future__ import annotations

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
    assert other is not None and "--router-session-affinity-mode soft" in other


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
