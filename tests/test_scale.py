"""Many concurrent trajectories on one event loop: no cross-talk, and nothing left behind per session.

The small variant of ``benchmarks/scale.py`` (run that for 10,000): 1,000 trajectories of 3 turns
and a tool call each, all open at once, over loopback to a recording server in its own process.
"""

from __future__ import annotations

import gc
import sys

import pytest
from opentelemetry import propagate

import otel_session
from benchmarks.scale import run_scale
from otel_session import _carriers, _faults, _settings
from otel_session._hosts import _CACHE_LIMIT

TRAJECTORIES = 1_000
# A leak of anything per session shows as at least one block (and usually one object) per
# trajectory; what a run legitimately leaves is bounded by the client's 16 connections.
LEAK_BOUND = TRAJECTORIES // 4


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_concurrent_trajectories_never_see_each_others_id_and_leave_nothing(client: str) -> None:
    result = run_scale(TRAJECTORIES, turns=3, client=client)
    assert result.dynamo_requests == 3 * TRAJECTORIES and result.tool_requests == TRAJECTORIES
    assert result.cross_talk == 0, "a request carried another trajectory's ID"
    assert result.missing == result.duplicate_ids == result.malformed_ids == 0
    assert result.tool_requests_with_session == 0
    assert result.leaked_blocks < LEAK_BOUND, result.leaked_blocks
    assert result.leaked_gc_objects < LEAK_BOUND, result.leaked_gc_objects
    assert result.otel_session_bytes_per_open_trajectory < 4096  # an open trajectory stays small


def test_traced_memory_is_back_at_the_baseline() -> None:
    """With every allocation traced: what otel_session allocated is not kept per session."""
    result = run_scale(TRAJECTORIES, turns=3, client="aiohttp", trace_memory=True)
    assert result.ok
    assert result.leaked_under_otel_session_bytes is not None and result.leaked_traced_bytes is not None
    # One trajectory's context is about 1 kB; the connections' timers may keep 16 of them.
    assert result.leaked_under_otel_session_bytes < 32 * 1024, result.top_growth
    assert result.leaked_traced_bytes < 100 * TRAJECTORIES, result.top_growth


def test_per_destination_and_per_carrier_state_is_bounded() -> None:
    """A crawler-like run over many hosts grows no table of ours without limit."""
    otel_session.configure(dynamo_hosts=["dynamo.internal:8000"], trusted_hosts=["*.gym.internal"])
    settings = _settings.current
    assert settings is not None
    reported = set(_faults._reported)
    with otel_session.trajectory():
        for index in range(3 * _CACHE_LIMIT):
            settings.rules.route("http", f"host-{index}.example", 8000 + index % 7)
            carrier: dict[str, str] = {"host": f"host-{index}.example"}  # through the propagator too
            propagate.inject(carrier)
            assert "X-Dynamo-Session-ID" not in carrier and "baggage" not in carrier
            if index < 4 * 64:  # carrier types too: a new one each time, past the bound
                _carriers.read(type(f"Carrier{index}", (dict,), {})(), ("baggage",))
    assert len(settings.rules._cache) <= _CACHE_LIMIT
    assert len(_carriers._case_insensitive) <= 64
    assert _faults._reported == reported
    gc.collect()
    blocks = sys.getallocatedblocks()
    with otel_session.trajectory():
        for index in range(3 * _CACHE_LIMIT, 6 * _CACHE_LIMIT):
            settings.rules.route("http", f"host-{index}.example", 8000)
    gc.collect()
    assert sys.getallocatedblocks() - blocks < _CACHE_LIMIT  # the cache was already full: no growth
