"""The TTL sizing rule that ``doctor`` and the README state: bindings ~= new trajectories/s x TTL."""

from __future__ import annotations

from otel_session.dynamo.sizing import TABLE_SIZE, bindings_held, largest_ttl, sizing_note


def test_bindings_are_rate_times_ttl() -> None:
    assert bindings_held(100, 600) == 60_000
    assert bindings_held(-1, 600) == 0


def test_largest_ttl_keeps_a_fifth_of_the_table_free() -> None:
    assert largest_ttl(100) == 524  # 65,536 x 0.8 / 100
    assert bindings_held(100, largest_ttl(100)) <= TABLE_SIZE * 0.8
    assert bindings_held(100, largest_ttl(100) + 1) > TABLE_SIZE * 0.8
    assert largest_ttl(0) == 31_536_000 and largest_ttl(1e9) == 1


def test_the_note_names_the_limit_the_log_line_and_a_verdict() -> None:
    generic = sizing_note()
    assert len(generic) == 2 and "65,536" in generic[0] and "529 Overloaded" in generic[0]
    assert sizing_note(100, 300)[-1].endswith("(fits).")
    assert "lower the TTL to 524 s" in sizing_note(100, 600)[-1]
    assert sizing_note(20)[-1] == "At 20 trajectories/s: a TTL of at most 2621 s."
