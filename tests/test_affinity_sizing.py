"""The TTL sizing rule that ``doctor`` and the docs state: bindings ~= new trajectories/s x TTL.

What a full table does is stated once, in ``sizing.WHEN_FULL`` (529 for new sessions, measured on
Dynamo 1.6.1 with ``benchmarks/capacity.py``); the doctor prints it from there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from otel_session.dynamo import sizing
from otel_session.dynamo.sizing import (
    BUDGET,
    TABLE_SIZE,
    WHEN_FULL,
    bindings_held,
    largest_ttl,
    sizing_note,
)

PACKAGE = Path(sizing.__file__).resolve().parent


def test_bindings_are_rate_times_ttl() -> None:
    assert bindings_held(100, 600) == 60_000
    assert bindings_held(-1, 600) == 0


def test_largest_ttl_keeps_a_fifth_of_the_table_free() -> None:
    assert largest_ttl(100) == 524  # 52,428 / 100, rounded down
    assert bindings_held(100, largest_ttl(100)) <= TABLE_SIZE * 0.8
    assert bindings_held(100, largest_ttl(100) + 1) > TABLE_SIZE * 0.8
    assert largest_ttl(0) == 31_536_000 and largest_ttl(1e9) == 1


@pytest.mark.parametrize("rate", [0.5, 1, 3, 7, 20, 99.9, 100, 128, 1000, 52_428, 60_000])
def test_the_figure_the_note_prints_is_the_one_largest_ttl_divides(rate: float) -> None:
    """ "at most 52,428 / (new trajectories per second), rounded down" is exactly what is computed."""
    assert BUDGET == 52_428 == int(TABLE_SIZE * 0.8)
    said = re.search(
        r"at most ([\d,]+) / \(new trajectories per second\) seconds, rounded down", sizing_note()[1]
    )
    assert said and int(said[1].replace(",", "")) == BUDGET
    assert f"{BUDGET:,} is 80% of {TABLE_SIZE:,}" in sizing_note()[1]
    assert largest_ttl(rate) == max(1, int(BUDGET / rate))


def test_the_note_says_what_a_full_table_does_once_and_truly() -> None:
    generic = " ".join(sizing_note())
    assert len(sizing_note()) == 2 and "65,536" in generic
    assert generic.count(WHEN_FULL) == 1 and "529 Overloaded" in WHEN_FULL
    # The 1.6.1 binary's "Affinity table full; routing without session affinity" is the KV router's
    # selection service at debug level: the frontend never says it, nor routes a new session unpinned.
    assert "table full" not in generic.lower() and "without session affinity" not in generic


def test_only_sizing_holds_the_sentence() -> None:
    """Every other module of the tools uses sizing's words instead of its own copy."""
    for path in PACKAGE.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        if path.name != "sizing.py":
            for words in ("Service temporarily overloaded", "Affinity table full", "52,428", "65,536", "529"):
                assert words not in text, (path.name, words)


def test_the_note_names_a_verdict() -> None:
    assert sizing_note(100, 300)[-1].endswith("(fits).")
    assert "lower the TTL to 524 s" in sizing_note(100, 600)[-1]
    assert sizing_note(20)[-1] == "At 20 trajectories/s: a TTL of at most 2621 s."
