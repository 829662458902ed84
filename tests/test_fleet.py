"""benchmarks/fleet.py: its figures from hand-made requests, and its quick run on a real fleet."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.fleet import (
    ARMS,
    SHAPES,
    Cell,
    default_vs_kv,
    group_size,
    main,
    measure,
    siblings_of,
    speedup_check,
    step_table,
)
from benchmarks.harness import percentile, step_figures
from otel_session.dynamo.workload import TrajectoryResult, Turn, Workload


def _req(turn: int, worker: int, prompt: int, cached: int, start: float, end: float) -> Turn:
    return Turn(worker, prompt, cached, ttft_ms=10.0 * (turn + 1), seconds=end - start, start=start)


def _traj(prompt: int, sibling: int, turns: list[Turn]) -> TrajectoryResult:
    return TrajectoryResult(prompt, sibling, f"s{prompt}-{sibling}", turns)


def test_figures_of_a_hand_made_step() -> None:
    pinned = _traj(0, 0, [_req(0, 1, 100, 0, 0.0, 1.0), _req(1, 1, 150, 96, 1.0, 2.0)])
    moved = _traj(0, 1, [_req(0, 2, 100, 96, 0.0, 1.0), _req(1, 3, 150, 0, 1.0, 2.0)])
    fig = measure([pinned, moved], workers=4, wall=2.0)
    assert fig["hit_rate"] == pytest.approx(96 / 300)
    assert fig["ceiling"] == pytest.approx(192 / 300)  # the previous prompt, in whole blocks of 16
    assert fig["ceiling_all"] == pytest.approx((192 + 96) / 500)  # plus the sibling's shared prompt
    assert fig["hit_rate_all"] == pytest.approx(192 / 500)
    assert fig["pinned"] == 1 and fig["switches"] == pytest.approx(0.5)
    assert fig["workers_used"] == 3 and fig["turns_per_s"] == pytest.approx(2.0)
    # Two requests in flight on two of 4 workers at any instant: max 1 over a mean of 0.5.
    assert fig["balance"] == pytest.approx(2.0)
    assert fig["ttft_ms"] == pytest.approx(20.0) and fig["ttft_all_ms"] == pytest.approx(15.0)


def test_the_step_is_timed_from_the_first_request_to_the_last_response() -> None:
    early = Turn(1, 100, 0, ttft_ms=10.0, seconds=1.0, start=1.0, completion_tokens=10)
    late = Turn(1, 200, 96, ttft_ms=30.0, seconds=2.5, start=2.5, completion_tokens=10)
    other = Turn(2, 100, 0, ttft_ms=20.0, seconds=1.5, start=1.5, completion_tokens=10)
    fig = step_figures([early, late, other], workers=4)
    assert fig["makespan_s"] == pytest.approx(4.0)  # 1.0 to 5.0, whatever the wall clock around it
    assert fig["tokens_per_s"] == pytest.approx(430 / 4.0)
    assert fig["ttft_p50_ms"] == 20.0 and fig["ttft_p99_ms"] == 30.0
    assert fig["busiest_share"] == pytest.approx(2 / 3)  # worker 1 served two of the three turns
    assert fig["busiest_x_fair"] == pytest.approx(8 / 3)  # 4 workers: a fair share is a quarter
    assert fig["peak_in_flight"] == 1.0  # worker 1's two turns never overlap
    assert step_figures([], workers=4)["makespan_s"] == 0.0


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.9) == 90.0
    assert percentile(values, 0.99) == 99.0 and percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None


def _step_row(arm: str, makespan: float, rep: int = 0) -> dict[str, object]:
    return {
        "cell": "32w 256blk 16x8", "arm": arm, "speedup": 0.4, "makespan_s": makespan, "repeat": rep,
        "seed": rep,
        "tokens_per_s": 1000.0, "ttft_p50_ms": 10.0, "ttft_p90_ms": 20.0, "ttft_p99_ms": 30.0,
        "hit_rate": 0.5, "busiest_x_fair": 1.0, "cpu_busy": 0.5, "saturated": False,
    }  # fmt: skip


def test_the_step_table_judges_each_arm_by_both_spreads() -> None:
    rows = [
        _step_row("kv", 20.0), _step_row("kv", 22.0, 1), _step_row("rr", 30.0),
        _step_row("slow", 23.0), _step_row("slow", 24.0, 1),
        _step_row("same", 21.0), _step_row("same", 23.0, 1),
        _step_row("fast", 18.0), _step_row("fast", 19.0, 1),
    ]  # fmt: skip
    lines = {line.split(" | ")[2]: line for line in step_table(rows).splitlines()[2:]}
    assert lines["slow"].endswith("| slower |")
    assert "| 1.12 (1.09-1.15) | 0.78 |" in lines["slow"]  # mean 23.5 / 21; run by run 23/20, 24/22
    assert lines["same"].endswith("| within spread |")
    assert lines["fast"].endswith("| faster |")
    assert lines["kv"].endswith("| - |") and "21.0 (20.0-22.0)" in lines["kv"]


def test_one_busy_worker_is_unbalanced() -> None:
    both = [_traj(0, s, [_req(0, 7, 100, 0, 0.0, 1.0)]) for s in range(2)]
    fig = measure(both, workers=4, wall=1.0)
    assert fig["balance"] == pytest.approx(4.0) and fig["peak_in_flight"] == 2.0


def test_groups_placed_on_one_worker_are_counted() -> None:
    """Four groups of two: two of them placed on worker 5 (a collision), the others apart; a group
    split over workers is not placed."""
    first = {(0, 0): 5, (0, 1): 5, (0, 2): 5, (0, 3): 5, (1, 0): 6, (1, 1): 6, (1, 2): 7, (1, 3): 8}
    results = [_traj(p, s, [_req(0, w, 100, 0, 0.0, 1.0)]) for (p, s), w in first.items()]
    fig = measure(results, workers=8, wall=1.0, group=2)
    assert fig["groups_on_busiest_worker"] == 2 and fig["groups_together"] == pytest.approx(3 / 4)
    assert measure(results, workers=8, wall=1.0)["groups_on_busiest_worker"] is None  # no groups


def test_group_sizes_and_the_auto_arm() -> None:
    cell = Cell(workers=32, blocks=1024, prompts=16, siblings=8)
    assert group_size("auto", cell) == group_size("fleet", cell) == 4  # the first step gathered too
    assert group_size("none", cell) is None and group_size("attempt", cell) is None
    assert group_size("prompt", cell) == 8 and group_size("groups:2", cell) == 2
    assert group_size("groups:16", cell) == 8
    assert siblings_of("auto", cell) == "groups:4"  # 2 groups per prompt fill 32 workers with 16 prompts
    assert siblings_of("auto", Cell(64, 1024, 8, 16)) == "groups:2"
    assert siblings_of("auto", Cell(8, 1024, 16, 8)) == "prompt"  # more prompts than workers
    assert siblings_of("default", cell) is None and siblings_of("groups:4", cell) == "groups:4"
    assert {"kv", "kv+attempt", "kv+default", "kv+prompt", "kv+auto"} <= set(ARMS)


@pytest.mark.slow
def test_quick_run_on_a_real_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    rows: list[dict[str, object]] = []
    assert main(["--quick"], sink=rows) == 0
    out = capsys.readouterr().out
    assert "| cell | arm | runs |" in out and "kv+default" in out
    assert {r["arm"] for r in rows} == {"rr", "kv", "kv+attempt", "kv+default"}
    for r in rows:
        assert r["errors"] == 0, r["first_error"]
        for key in ("hit_rate", "ceiling", "hit_rate_all", "ceiling_all"):
            assert 0.0 <= r[key] <= 1.0, (key, r)  # type: ignore[operator]
        assert r["hit_rate"] <= r["ceiling"] + 1e-9  # type: ignore[operator]
        if r["keying"] != "none":
            assert r["pinned"] == r["trajectories"], r
        assert 0 < r["makespan_s"] <= r["wall_s"] + 1e-6, r  # type: ignore[operator]
        assert r["tokens_per_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0, r  # type: ignore[operator]
        assert r["cpu_busy"] is None or 0.0 <= r["cpu_busy"] <= 1.0, r  # type: ignore[operator]
    assert "| step s (spread) | x kv (paired) | x rr |" in out
    default = next(r for r in rows if r["arm"] == "kv+default")
    assert default["siblings_setting"] == "auto" and default["group_size"] == 2  # 8 workers, 4 prompts
    assert default["groups_together"] == 1.0  # each pair of siblings named one parent: one worker
    assert 1 <= default["groups_on_busiest_worker"] <= 8  # type: ignore[operator]
    kv = next(r for r in rows if r["arm"] == "kv+attempt")
    rr = next(r for r in rows if r["arm"] == "rr")
    assert kv["hit_rate"] > rr["hit_rate"]  # type: ignore[operator]


def _row(arm: str, hit: float, ttft: float, cell: str = "32w 256blk 16x8") -> dict[str, object]:
    return {"cell": cell, "arm": arm, "hit_rate": hit, "ttft_all_ms": ttft, "workers": 32, "blocks": 256}


def test_the_default_is_judged_against_kv_and_its_spread() -> None:
    rows = [
        _row("kv", 0.6, 100),
        _row("kv", 0.5, 150),
        _row("kv+groups:2", 0.7, 140),
        _row("kv+default", 0.7, 145),
    ]
    line = default_vs_kv(rows).splitlines()[-1]
    assert line == "| 32w 256blk 16x8 | 2, 2 | +0.15 | 1.14x | 1.50x | not worse |"  # groups:2 pooled
    slower = default_vs_kv([*rows[:2], _row("kv+default", 0.9, 151)]).splitlines()[-1]
    assert slower.endswith("| worse: TTFT |")
    lower = default_vs_kv([*rows[:2], _row("kv+default", 0.53, 90)]).splitlines()[-1]
    assert lower.endswith("| worse: hit |")


def test_workers_per_process_is_checked_before_anything_starts() -> None:
    from otel_session.dynamo import LocalDynamo

    with pytest.raises(ValueError, match=r"^workers_per_process: "):
        LocalDynamo(workers=8, workers_per_process=0)
    assert LocalDynamo(workers=8, workers_per_process=3).workers_per_process == 3


def test_the_agentic_shape_draws_turns_and_pauses_with_long_tails() -> None:
    shape = SHAPES["agentic"]
    turns = [shape.turns_of(p, s) for p in range(40) for s in range(25)]
    assert statistics.median(turns) == pytest.approx(7, abs=1)  # NeMo-RL #3663's p50 of 29, / 4
    assert sorted(turns)[int(0.9 * len(turns))] == pytest.approx(14, abs=2)  # its p90 of 56, / 4
    assert max(turns) <= 28 and min(turns) >= 1
    pauses = [x for p in range(20) for s in range(20) for x in shape.pauses(p, s)[1:]]
    assert statistics.fmean(pauses) == pytest.approx(1.0, rel=0.2)  # the mean is pause_secs
    assert statistics.median(pauses) == pytest.approx(math.exp(-(1.2**2) / 2), rel=0.2)
    assert max(pauses) > 8 * statistics.median(pauses)  # the long tail
    assert shape.pauses(3, 4) == shape.pauses(3, 4) and len(shape.pauses(3, 4)) == shape.turns_of(3, 4)
    plain = Workload(turns=4)
    assert plain.turns_of(0, 0) == 4 and plain.pauses(0, 0) == [0.0] * 4


def test_a_cell_names_its_shape_and_keeps_pauses_in_model_time() -> None:
    cell = Cell.parse("16:3360:8:8:agentic")
    assert cell == Cell(16, 3360, 8, 8, "agentic") and cell.label == "16w 3360blk 8x8 agentic"
    assert Cell.parse("32:256:16:8").label == "32w 256blk 16x8"  # grpo cells keep their old labels
    slow = cell.workload(seed=3, speedup=0.2, name_group=False)
    assert (slow.prompts, slow.siblings, slow.seed, slow.name_group) == (8, 8, 3, False)
    assert slow.pause_secs == pytest.approx(5.0)  # 1 s of model time at a fifth of the speed
    with pytest.raises(ValueError, match="shape one of"):
        Cell.parse("16:3360:8:8:chat")


def test_ratios_are_compared_across_speedups() -> None:
    rows = [
        {**_step_row("kv", 20.0), "speedup": 0.4}, {**_step_row("x", 30.0), "speedup": 0.4},
        {**_step_row("kv", 40.0), "speedup": 0.2}, {**_step_row("x", 62.0), "speedup": 0.2},
        {**_step_row("y", 1.0), "speedup": 0.2},
    ]  # fmt: skip
    lines = speedup_check(rows).splitlines()[2:]
    assert lines == ["| 32w 256blk 16x8 | x | 1.55 at 0.2 (1); 1.50 at 0.4 (1) |"]  # y: one speedup only
