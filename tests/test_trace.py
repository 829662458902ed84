"""benchmarks/trace.py: its pure parts on a tiny hand-made trace (never the real file, no Dynamo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.trace import (
    ONE_TOKEN_WORDS,
    Replayed,
    Request,
    block_text,
    chain,
    last_block_tokens,
    max_tokens_of,
    paired,
    parse_trace,
    prompt_text,
    read_trace,
    sent_at,
    shared_prefix,
    stats,
    trace_figures,
    window,
)
from otel_session.dynamo.workload import Turn

# Block 0 is every request's system prompt; a turn's last block is partial, so the next turn of the
# same conversation carries it under a new id (as Mooncake hashes a filled block anew).
LINES = [
    {"timestamp": 0, "input_length": 1200, "output_length": 100, "hash_ids": [0, 1, 2]},  # A1
    {"timestamp": 1000, "input_length": 1000, "output_length": 40, "hash_ids": [0, 5, 6]},  # B1
    {"timestamp": 60000, "input_length": 1900, "output_length": 700, "hash_ids": [0, 1, 7, 8]},  # A2
    {"timestamp": 61000, "input_length": 700, "output_length": 3, "hash_ids": [0, 9]},  # C1: system only
    {"timestamp": 90000, "input_length": 1800, "output_length": 10, "hash_ids": [0, 5, 6, 10]},  # B2
    {"timestamp": 120000, "input_length": 2000, "output_length": 9, "hash_ids": [0, 1, 7, 11]},  # A3
    {"timestamp": 130000, "input_length": 1500, "output_length": 9, "hash_ids": [0, 1, 2, 12]},  # D1: branch
    {"timestamp": 125000, "input_length": 400, "output_length": 1, "hash_ids": [0]},  # E1, out of order
]


def _trace() -> list[Request]:
    return parse_trace([json.dumps(x) for x in LINES[:4]] + ["", *(json.dumps(x) for x in LINES[4:])])


def _convs() -> dict[tuple[int, ...], list[int]]:
    """Each conversation's requests, by line number, keyed by its first request's line."""
    return {(c.requests[0].index,): [r.index for r in c.requests] for c in chain(_trace())}


def test_parse_sorts_by_time_and_skips_blank_lines() -> None:
    trace = _trace()
    assert len(trace) == 8
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)
    assert trace[0] == Request(0, 0, 1200, 100, (0, 1, 2))
    assert trace[-1].index == 6  # line 6 (130 s) comes after line 7 (125 s)


def test_read_trace_says_what_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="kvcache-ai/Mooncake"):
        read_trace(tmp_path / "absent.jsonl")
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in LINES))
    assert len(read_trace(path)) == 8


def test_chaining_by_shared_prefix_beyond_the_system_block() -> None:
    convs = _convs()
    assert convs == {
        (0,): [0, 2, 5],  # A: each turn shares more than block 0 with the one before
        (1,): [1, 4],  # B
        (3,): [3],  # C shares block 0 only: a conversation of its own
        (7,): [7],  # E: block 0 only
        (6,): [6],  # D branches off A's first turn (its longest match), not A's latest: new
    }
    numbers = [c.index for c in chain(_trace())]
    assert numbers == list(range(len(numbers)))


def test_a_conversation_is_a_sequence_in_time() -> None:
    for conv in chain(_trace()):
        times = [r.timestamp_ms for r in conv.requests]
        assert times == sorted(times)
        for before, now in zip(conv.requests, conv.requests[1:], strict=False):
            assert shared_prefix(before.hash_ids, now.hash_ids) > 1


def test_window_keeps_the_turns_inside_it() -> None:
    convs = chain(_trace())
    inside = window(convs, 50_000, 125_000)  # A2, C1, B2, A3; E1 at 125 s is out
    assert {c.index: [r.index for r in c.requests] for c in inside} == {0: [2, 5], 1: [4], 2: [3]}
    figures = stats(inside)
    assert figures["requests"] == 4 and figures["conversations"] == 3
    assert figures["multi_turn"] == 1 and figures["turns_2plus"] == 1
    assert figures["gap_p50_s"] == 60.0
    whole = stats(convs)
    assert (whole["conversations"], whole["turns_max"], whole["turns_2plus"]) == (5, 3, 3)


def test_block_text_is_fixed_per_id_and_seed() -> None:
    text = block_text(7, 32)
    assert text == block_text(7, 32)
    assert len(text.split(" ")) == 32 and set(text.split(" ")) <= set(ONE_TOKEN_WORDS)
    assert text != block_text(8, 32)
    assert text != block_text(7, 32, seed=1)  # a repeat's new text


def test_prompts_share_exactly_their_shared_blocks() -> None:
    trace = {r.index: r for r in _trace()}
    a1, a2, a3, d1 = trace[0], trace[2], trace[5], trace[6]
    cache: dict[int, str] = {}
    p1, p2, p3, pd = (prompt_text(r, 32, cache=cache) for r in (a1, a2, a3, d1))
    words = [p.split(" ") for p in (p1, p2, p3, pd)]
    assert words[1][: 2 * 32] == words[0][: 2 * 32]  # blocks 0 and 1
    assert words[2][: 3 * 32] == words[1][: 3 * 32]  # blocks 0, 1, 7
    assert words[3][: 2 * 32] == words[0][: 2 * 32]  # the branch shares A1's full blocks
    assert not p2.startswith(p1)  # A1's last block was partial: cut, A2 carries a full new block
    # the prompt's length follows input_length, 512 tokens a block scaled to 32
    assert len(words[0]) == 2 * 32 + last_block_tokens(1200, 3, 32) == 2 * 32 + 11
    assert len(words[1]) == 3 * 32 + last_block_tokens(1900, 4, 32) == 3 * 32 + 23


def test_compression_and_output_scaling() -> None:
    assert sent_at(600_000, 0, 20.0) == 30.0  # 10 minutes at 20x: 30 s
    assert sent_at(61_000, 1_000, 5.0) == 12.0
    assert max_tokens_of(700, 32, 32) == 32  # capped
    assert max_tokens_of(100, 32, 32) == 7  # 100 / 16, up
    assert max_tokens_of(0, 32, 32) == 1


def test_ceiling_and_pairing_from_hand_made_runs() -> None:
    trace = {r.index: r for r in _trace()}

    def turn(prompt: int, cached: int, start: float) -> Turn:
        return Turn(
            worker=1, prompt_tokens=prompt, cached_tokens=cached, ttft_ms=10.0, seconds=1.0, start=start
        )

    conv = Replayed(0, 0, "s", [turn(76, 0, 0.0), turn(120, 64, 12.0)], requests=[trace[0], trace[2]])
    conv.late = [0.0, 0.5]
    figures = trace_figures([conv], 32)
    assert figures["ceiling"] == pytest.approx(64 / 120)  # A2 shares 2 full blocks of A1
    assert figures["late_max_s"] == 0.5 and figures["turns_2plus"] == 1
    assert figures["after_ttft_first_p99_ms"] == figures["after_ttft_later_p50_ms"] == pytest.approx(990.0)
    assert figures["template_tokens"] == pytest.approx((76 + 120) / 2 - (75 + 119) / 2)
    base = {"repeat": 0, "arm": "kv", "makespan_s": 10.0, "ttft_p50_ms": 10.0, "ttft_all_p90_ms": 20.0}
    base |= {"ttft_p99_ms": 40.0, "latency_p99_ms": 100.0, "hit_rate": 0.5}
    ours = {**base, "arm": "kv+default", "makespan_s": 9.0, "ttft_p99_ms": 20.0, "hit_rate": 0.75}
    table = paired([base, ours])
    assert "| 0 | kv+default | 0.90 | 1.00 | 1.00 | 0.50 | 1.00 | +0.250 |" in table
