"""The overhead benchmarks measure what they say: small runs of ``benchmarks/overhead*.py``.

The process-pair view (``benchmarks/overhead.py``) starts real worker processes against the
loopback benchmark server; here it runs a few turns of a few requests per side and checks what the
figures rest on: the bare side never imported otel-session, the session header reached Dynamo from
the configured side's trajectories and the least hook only, every side ran every chunk, and the
lock-step order is balanced. The request-by-request view runs a few hundred in-process requests
through the hooked client and around it (the hook's ``__wrapped__``), which only works while
configure() hooks httpx.
"""

from __future__ import annotations

import math
from collections import Counter

from benchmarks._servers import LoopbackServer
from benchmarks.overhead import CASES, Side, order_of_turn, run_pair, summarize, summarize_setup
from benchmarks.overhead_clients import INPROC_DYNAMO_AUTHORITY, INPROC_URLS
from benchmarks.overhead_requests import run_paired

SIDES = [Side(kind, kind) for kind in ("bare", "imports", "least", "configured")]


def test_process_pair_sides_each_pay_their_own_setup_and_only_configured_sends_the_header() -> None:
    with LoopbackServer(["127.0.0.1", "127.0.0.2"]) as server:
        pair = run_pair(server, SIDES, rounds=2, n=3, warm=2, imports="otel_session,httpx2,aiohttp")
    assert pair.header_check == {"bare": True, "imports": True, "least": True, "configured": True}
    bare, imports, least, configured = (set(pair.facts[name]["top_level_packages"]) for name in pair.facts)
    assert "otel_session" not in bare and "opentelemetry" not in bare
    assert {"otel_session", "httpx2", "aiohttp"} <= imports
    assert "otel_session" in configured
    assert "otel_session" not in least and "wrapt" in least  # the least hook: no otel-session at all
    assert pair.facts["configured"]["library"].endswith("otel_session")
    for case in CASES:
        for side in SIDES:
            chunks = pair.chunks[case][side.name]
            assert len(chunks) == 2 and all(chunk["wall"] > 0 and chunk["cpu"] > 0 for chunk in chunks)
            assert all(0 < chunk["first"] < chunk["wall"] for chunk in chunks)
    rows = summarize([pair], [side.name for side in SIDES], n=3)
    assert {(row["side"], row["case"]) for row in rows} == {
        (name, case) for name in ("imports", "least", "configured") for case in CASES
    }
    assert all(math.isfinite(row["wall_ratio"]) and row["wall_ratio"] > 0 for row in rows)
    assert all(row["wall_ratio_ci95"][0] <= row["wall_ratio"] <= row["wall_ratio_ci95"][1] for row in rows)
    setup = {row["side"]: row for row in summarize_setup([pair], [side.name for side in SIDES])}
    assert "otel_session" in setup["configured"]["packages_beyond_bare"]
    assert setup["bare"]["packages_beyond_bare"] == []


def test_lock_step_order_gives_every_side_each_position_and_self_follow_equally() -> None:
    for count in (2, 3, 4):
        sides = [Side(str(index), "bare") for index in range(count)]
        positions: Counter[tuple[str, int]] = Counter()
        follows_itself: Counter[str] = Counter()
        last = None
        for turn in range(4 * count * 3):
            for position, side in enumerate(order_of_turn(sides, turn)):
                positions[(side.name, position)] += 1
                follows_itself[side.name] += side is last
                last = side
        assert len(set(positions.values())) == 1, positions
        assert len(set(follows_itself.values())) == 1, follows_itself


def test_request_by_request_view_sends_hooked_bare_and_by_hand_requests() -> None:
    rows = run_paired("httpx-sync", "in-process", INPROC_URLS, INPROC_DYNAMO_AUTHORITY, 100)
    by_variant = {row["variant"]: row for row in rows}
    assert set(by_variant) == {"session:dynamo", "session:other", "session:outside"}
    assert by_variant["session:dynamo"]["cpu_us_header_by_hand"] is not None
    assert all(row["cpu_us_bare"] > 0 and row["cpu_us_hooked"] > 0 for row in rows)
