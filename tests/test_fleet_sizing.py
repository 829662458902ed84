"""The affinity table at GRPO step rates: whole steps of bindings, counted at each step's start."""

from __future__ import annotations

import pytest

from otel_session.dynamo.sizing import BUDGET, largest_step_ttl, step_bindings, step_note


def test_a_step_holds_its_own_bindings_and_those_of_steps_still_inside_the_ttl() -> None:
    assert step_bindings(1000, 60, 0) == 1000  # a burst: the whole step at once
    assert step_bindings(1000, 60, 60) == 1000  # the previous step's bindings just expired
    assert step_bindings(1000, 60, 61) == 2000
    assert step_bindings(1000, 60, 300, trajectory_secs=30) == 6000  # 330 s of steps, 60 s apart
    assert step_bindings(0, 60, 300) == 0 and step_bindings(5, 0, 300) == 5


@pytest.mark.parametrize(
    ("per_step", "step_secs", "run_secs"),
    [(8192, 60, 30), (1024, 20, 5), (128, 3, 2), (52_428, 100, 10), (7, 0.5, 0.2)],
)
def test_the_largest_ttl_fits_and_one_second_more_does_not(
    per_step: int, step_secs: float, run_secs: float
) -> None:
    ttl = largest_step_ttl(per_step, step_secs, run_secs)
    assert ttl is not None
    assert step_bindings(per_step, step_secs, ttl, run_secs) <= BUDGET
    assert step_bindings(per_step, step_secs, ttl + 1, run_secs) > BUDGET


def test_a_step_bigger_than_the_budget_has_no_ttl_and_says_what_happens() -> None:
    assert largest_step_ttl(BUDGET + 1, 60) is None
    assert largest_step_ttl(BUDGET, 10, trajectory_secs=10) is None  # not even 1 s left
    note = step_note(60_000, 60)
    assert "no TTL fits" in note and "529" in note
    assert step_note(8192, 60, 600, 30).endswith("(too many: lower the TTL to 330 s or less).")
    assert step_note(8192, 60, 300, 30).endswith("(fits).")
    assert step_note(1024, 20) == "GRPO steps of 1,024 trajectories every 20 s: a TTL of at most 1020 s."
