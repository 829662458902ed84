"""Replay a public trace on the live fleet: Mooncake's FAST'25 conversation trace, per arm.

The GRPO shapes of ``benchmarks/fleet.py`` are ours; this replays real chat traffic instead, so the
figures say what sessions are worth (or cost) where the arrivals, turn counts and pauses are a
production service's. The trace (``FAST25-release/traces/conversation_trace.jsonl`` in
github.com/kvcache-ai/Mooncake) holds 12,031 requests over 59 minutes, each a ``timestamp`` (ms),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``: one id per 512-token block of the
prompt, equal ids meaning equal blocks (the last block, partial, has an id of its own).

- **Conversations** (:func:`chain`): every request's first block is the same (a system prompt). A
  request continues the conversation of the earlier request it shares the longest prefix with beyond
  that block, if that request is still its conversation's latest turn; a branch off an older turn (an
  edited or regenerated message, or another user with the same opening) starts a conversation of its
  own, so each conversation is a sequence. The whole trace: 7,386 conversations, turns p50 1, p90 3,
  max 43, gaps between turns p50 123 s (``--stats``).
- **Text** (:func:`block_text`, :func:`prompt_text`): each block id becomes a fixed pseudo-random
  text of ``--block-tokens`` words, each word one token of the stock tiny model (so a block is exactly
  that many tokens), and a prompt is its blocks' texts in order (the last block cut to its partial
  length) as one user message. Requests that share block ids share a prefix of tokens: what the
  prefix cache and the kv router see. The default 32 tokens a block (512 / 16) keeps the mean prompt
  near 750 tokens (the trace's ~12k / 16) and the longest near 7.9k, so a window's load fits two
  cores and a worker's KV cache of ``--blocks`` blocks of 16 tokens holds several conversations.
- **Replay** (:func:`replay`): a window of the trace (``--start-min``, ``--minutes``), its times
  divided by ``--compress``; every conversation with a request in the window is one plain
  ``otel_session.trajectory()`` (one session per conversation: what a user who does nothing else
  gets), its turns sent through the openai SDK at max(the turn's compressed time, the previous
  turn's response). ``max_tokens`` is ``output_length`` scaled like the prompt, capped at
  ``--max-tokens`` (32) to keep the mocker's decode cheap. Turns before the window are not sent: a
  conversation's first turn in the window is its turn 1 here.

Each arm (``fleet.ARMS``: the frontend's configuration is fleet.py's) runs on a fresh stack (cold
caches, ``harness.stack``), each repeat with new text and the arms' order rotated. Per run: the
makespan (first request to last response), TTFT p50/p90/p99 (Dynamo's nvext timing), the
client's latency to the whole response and its part past TTFT (decode, and any wait before the
frontend saw the request) for first and later turns apart, the prefix hit rate of turns 2+ (``cached_tokens /
prompt_tokens``) against its ceiling (the whole KV blocks each turn shares with its previous turn),
the busiest worker's share of the requests, how late turns were sent against their trace times,
and the cores' busy fraction (``harness.CpuWatch``; "SAT" above 85 %). Then each arm over kv alone,
paired repeat by repeat (the same text).

    # the trace, once, where there is a network (the file is ~3 MB):
    #   git clone https://github.com/kvcache-ai/Mooncake and take
    #   FAST25-release/traces/conversation_trace.jsonl
    python benchmarks/trace.py --trace /tmp/conversation_trace.jsonl --stats
    python benchmarks/trace.py --trace /tmp/conversation_trace.jsonl --workers 8 --blocks 1024 \\
        --start-min 45 --minutes 2 --compress 5 --speedup 0.3 --repeats 1 \\
        --out benchmarks/results/trace-dev.json                                  # a minute or two
    python benchmarks/trace.py --trace /tmp/conversation_trace.jsonl --workers 32 --blocks 1024 \\
        --start-min 45 --minutes 10 --compress 5 --speedup 0.3 --arms kv,kv+default --repeats 2 \\
        --out benchmarks/results/trace-mooncake.json                             # the measurement
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import otel_session  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.fleet import ARMS, Arm, Cell, fmt, measure, siblings_of  # noqa: E402
from otel_session.dynamo import NVEXT_EXTRA_BODY, cached_tokens_of, ttft_ms_of, worker_id_of  # noqa: E402
from otel_session.dynamo.workload import TrajectoryResult, Turn  # noqa: E402

RESULTS = harness.RESULTS
TRACE_BLOCK_TOKENS = 512  # Mooncake hashes prompts in blocks of 512 tokens
SYSTEM_BLOCKS = 1  # the first block, common to every request of the trace
TRACE_FILE = "FAST25-release/traces/conversation_trace.jsonl"
FETCH_HINT = (
    "fetch it where there is a network: git clone https://github.com/kvcache-ai/Mooncake, "
    f"then pass --trace Mooncake/{TRACE_FILE}"
)
#: Words the stock tiny model (``otel_session.dynamo.ensure_model_dir``) tokenizes as ONE token each
#: after a space (checked with its tokenizer), so a block of N words is N tokens and a prompt's
#: length follows the trace's.
ONE_TOKEN_WORDS = (
    "session",
    "worker",
    "router",
    "prefix",
    "cache",
    "token",
    "model",
    "request",
    "response",
    "latency",
    "stream",
    "agent",
    "tool",
    "user",
    "batch",
    "decode",
    "prefill",
    "attention",
    "layer",
    "block",
    "memory",
    "transfer",
    "metric",
    "export",
    "python",
    "rust",
    "function",
    "method",
    "value",
    "string",
    "list",
    "file",
    "path",
)
#: Seconds between building the replay's tasks and its time zero, so the first requests are not late.
LEAD_SECONDS = 0.5


# --- the trace ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One line of the trace: ``index`` is its line number."""

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass
class Conversation:
    """Requests chained by shared prefixes, in time order; ``index`` numbers it in the whole trace."""

    index: int
    requests: list[Request] = field(default_factory=list)


def parse_trace(lines: Iterable[str]) -> list[Request]:
    """Requests of a trace's JSON lines (blank lines skipped), in time order."""
    requests: list[Request] = []
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        requests.append(
            Request(
                index=len(requests),
                timestamp_ms=int(row["timestamp"]),
                input_length=int(row["input_length"]),
                output_length=int(row["output_length"]),
                hash_ids=tuple(int(h) for h in row["hash_ids"]),
            )
        )
    return sorted(requests, key=lambda r: (r.timestamp_ms, r.index))


def read_trace(path: Path) -> list[Request]:
    """The trace at ``path``; never downloaded here (the machine may have no network)."""
    if not path.is_file():
        raise SystemExit(f"no trace at {path}: {FETCH_HINT}")
    with path.open() as lines:
        return parse_trace(lines)


def chain(requests: Sequence[Request]) -> list[Conversation]:
    """Conversations of ``requests`` (in time order), as the module docstring says: a request joins
    the conversation of the latest earlier request sharing its longest prefix of more than
    :data:`SYSTEM_BLOCKS` blocks, if that request ended its conversation so far; else it starts one.

    A trie of block ids makes it one pass over the blocks (12k requests, ~290k blocks)."""
    root: dict[Any, Any] = {}
    latest = "#"  # key of a trie node: the latest request through it (hash ids are ints)
    conversation_of: dict[int, Conversation] = {}
    conversations: list[Conversation] = []
    for request in requests:
        node, depth, best = root, 0, None
        for block in request.hash_ids:
            if block not in node:
                break
            node, depth = node[block], depth + 1
            if depth > SYSTEM_BLOCKS:
                best = node[latest]
        conv = conversation_of.get(best) if best is not None else None
        if conv is None or conv.requests[-1].index != best:
            conv = Conversation(len(conversations))
            conversations.append(conv)
        conv.requests.append(request)
        conversation_of[request.index] = conv
        node = root
        for block in request.hash_ids:
            node = node.setdefault(block, {})
            node[latest] = request.index
    return conversations


def window(conversations: Sequence[Conversation], start_ms: int, end_ms: int) -> list[Conversation]:
    """Each conversation's requests sent in ``[start_ms, end_ms)``, those with any (index kept)."""
    kept = []
    for conv in conversations:
        inside = [r for r in conv.requests if start_ms <= r.timestamp_ms < end_ms]
        if inside:
            kept.append(Conversation(conv.index, inside))
    return kept


def stats(conversations: Sequence[Conversation]) -> dict[str, Any]:
    """Requests, conversations, turns per conversation (p50/p90/max), turns 2+ and the gaps between
    turns (p50 s): the figures that say whether a window has the multi-turn traffic sessions serve."""
    turns = [len(c.requests) for c in conversations]
    gaps = [
        (b.timestamp_ms - a.timestamp_ms) / 1000
        for c in conversations
        for a, b in zip(c.requests, c.requests[1:], strict=False)
    ]
    return {
        "requests": sum(turns),
        "conversations": len(conversations),
        "multi_turn": sum(t > 1 for t in turns),
        "turns_2plus": sum(t - 1 for t in turns),
        "turns_p50": harness.percentile(turns, 0.5),
        "turns_p90": harness.percentile(turns, 0.9),
        "turns_max": max(turns, default=0),
        "gap_p50_s": harness.percentile(gaps, 0.5),
        "input_mean": statistics.fmean(r.input_length for c in conversations for r in c.requests)
        if turns
        else 0.0,
    }


# --- text ---------------------------------------------------------------------------------------


def block_text(hash_id: int, tokens: int, seed: int = 0) -> str:
    """The fixed text of one block: ``tokens`` one-token words drawn from the block id (and the
    repeat's seed), the same wherever the id appears."""
    rng = random.Random(f"mooncake/{seed}/{hash_id}")
    return " ".join(rng.choice(ONE_TOKEN_WORDS) for _ in range(tokens))


def last_block_tokens(input_length: int, blocks: int, block_tokens: int) -> int:
    """Tokens of a request's last (partial) block, scaled from 512 to ``block_tokens``."""
    rest = input_length - TRACE_BLOCK_TOKENS * (blocks - 1)
    return max(1, min(block_tokens, math.ceil(rest * block_tokens / TRACE_BLOCK_TOKENS)))


def prompt_text(
    request: Request, block_tokens: int, seed: int = 0, cache: dict[int, str] | None = None
) -> str:
    """The request's prompt: its blocks' texts in order, the last cut to its partial length."""
    cache = {} if cache is None else cache
    parts = []
    last = len(request.hash_ids) - 1
    for i, hash_id in enumerate(request.hash_ids):
        text = cache.get(hash_id)
        if text is None:
            text = cache[hash_id] = block_text(hash_id, block_tokens, seed)
        if i == last:
            keep = last_block_tokens(request.input_length, len(request.hash_ids), block_tokens)
            text = " ".join(text.split(" ")[:keep])
        parts.append(text)
    return " ".join(parts)


def max_tokens_of(output_length: int, block_tokens: int, cap: int) -> int:
    """The trace's output length scaled like the prompt, between 1 and ``cap``."""
    return max(1, min(cap, math.ceil(output_length * block_tokens / TRACE_BLOCK_TOKENS)))


def sent_at(timestamp_ms: int, start_ms: int, compress: float) -> float:
    """Seconds after the replay's time zero at which a request of the trace is due."""
    return (timestamp_ms - start_ms) / 1000 / compress


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Blocks two requests share from their first."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --- the replay ---------------------------------------------------------------------------------


@dataclass
class Replayed(TrajectoryResult):
    """A conversation as replayed: each turn's delay past its trace time (``late``, s), and the
    trace's requests it sent, to read the prefix each turn shares with the one before."""

    late: list[float] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)


async def replay(
    base_url: str,
    model: str,
    conversations: Sequence[Conversation],
    *,
    start_ms: int,
    compress: float,
    block_tokens: int,
    max_tokens: int,
    seed: int,
    timeout: float = 300.0,
) -> list[Replayed]:
    """Every conversation as one ``otel_session.trajectory()``, its turns at their compressed
    trace times or at the previous response, whichever is later (a user waits for the answer)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout)
    texts: dict[int, str] = {}
    zero = time.perf_counter() + LEAD_SECONDS

    async def one(conv: Conversation) -> Replayed:
        first = zero + sent_at(conv.requests[0].timestamp_ms, start_ms, compress)
        await asyncio.sleep(max(0.0, first - time.perf_counter()))
        async with otel_session.trajectory() as traj:
            result = Replayed(conv.index, 0, traj.session_id or "")
            try:
                for request in conv.requests:
                    due = zero + sent_at(request.timestamp_ms, start_ms, compress)
                    if due > time.perf_counter():
                        await asyncio.sleep(due - time.perf_counter())
                    prompt = prompt_text(request, block_tokens, seed, texts)
                    began = time.perf_counter()
                    response = await client.chat.completions.create(
                        model=model,
                        messages=[{"role": "user", "content": prompt}],
                        max_tokens=max_tokens_of(request.output_length, block_tokens, max_tokens),
                        extra_body=NVEXT_EXTRA_BODY,
                    )
                    usage = response.usage
                    result.turns.append(
                        Turn(
                            worker=worker_id_of(response),
                            prompt_tokens=usage.prompt_tokens if usage else 0,
                            cached_tokens=cached_tokens_of(response),
                            ttft_ms=ttft_ms_of(response),
                            seconds=time.perf_counter() - began,
                            start=began,
                            completion_tokens=usage.completion_tokens if usage else 0,
                        )
                    )
                    result.late.append(began - due)
                    result.requests.append(request)
            except Exception as exc:  # per conversation: one failure must not hide the others
                result.error = f"{type(exc).__name__}: {exc}"
        return result

    try:
        return list(await asyncio.gather(*(one(c) for c in conversations)))
    finally:
        await client.close()


def replay_load(
    base_url: str, model: str, conversations: Sequence[Conversation], **kwargs: Any
) -> harness.Load:
    """:func:`replay` on a fresh event loop while ``harness.CpuWatch`` samples the cores, as
    ``harness.run_load`` does for a GRPO step."""
    watch = harness.CpuWatch()
    with watch:
        began = time.perf_counter()
        results = asyncio.run(replay(base_url, model, conversations, **kwargs))
        wall = time.perf_counter() - began
    return harness.Load(list(results), wall, watch.figures())


# --- figures ------------------------------------------------------------------------------------


def trace_figures(results: Sequence[Replayed], block_tokens: int) -> dict[str, Any]:
    """What the trace adds to ``fleet.measure``: the ceiling of turns 2+ from the blocks each turn
    shares with its previous turn (whole KV blocks; a branch shares less than its prompt), the
    client's latency and how late turns went out (a slow answer delays the next turn)."""
    bs = harness.BLOCK_SIZE
    later_prompt = reach = 0
    for r in results:
        for (before, now), turn in zip(
            zip(r.requests, r.requests[1:], strict=False), r.turns[1:], strict=False
        ):
            shared = min(shared_prefix(before.hash_ids, now.hash_ids), len(before.hash_ids) - 1)
            reach += min(turn.prompt_tokens, shared * block_tokens // bs * bs)
            later_prompt += turn.prompt_tokens
    turns = [t for r in results for t in r.turns]
    latency = [t.seconds * 1000 for t in turns]
    # The client's wait past Dynamo's TTFT: decode, plus anything before the frontend saw the request
    # (the library's wait at a conversation's first request, see otel_session/_gathering.py).
    rest = {
        name: [t.seconds * 1000 - t.ttft_ms for t in chosen if t.ttft_ms is not None]
        for name, chosen in (
            ("first", [r.turns[0] for r in results if r.turns]),
            ("later", [t for r in results for t in r.turns[1:]]),
        )
    }
    late = [x for r in results for x in r.late]
    expected = [
        len(q.hash_ids[:-1]) * block_tokens + last_block_tokens(q.input_length, len(q.hash_ids), block_tokens)
        for r in results
        for q in r.requests
    ]
    return {
        "ceiling": reach / later_prompt if later_prompt else 0.0,
        "latency_p50_ms": harness.percentile(latency, 0.5),
        "latency_p90_ms": harness.percentile(latency, 0.9),
        "latency_p99_ms": harness.percentile(latency, 0.99),
        **{
            f"after_ttft_{name}_p{q}_ms": harness.percentile(values, q / 100)
            for name, values in rest.items()
            for q in (50, 99)
        },
        "late_p50_s": harness.percentile(late, 0.5),
        "late_p99_s": harness.percentile(late, 0.99),
        "late_max_s": max(late, default=0.0),
        "conversations": len(results),
        "requests": len(turns),
        "turns_2plus": sum(max(0, len(r.turns) - 1) for r in results),
        # the template's tokens per prompt on top of the blocks' (a check that a word is a token)
        "template_tokens": statistics.fmean(t.prompt_tokens for t in turns) - statistics.fmean(expected)
        if turns
        else None,
    }


def run_arm(
    arm: Arm,
    conversations: Sequence[Conversation],
    args: argparse.Namespace,
    start_ms: int,
    seed: int,
) -> dict[str, Any]:
    """One arm of one repeat on a fresh stack, configured as fleet.py's ``run_arm`` configures it."""
    with harness.stack(arm.deployment, args.workers, args.blocks, args.speedup) as served:
        setting = "none"
        if arm.keying != "none":
            cell = Cell(args.workers, args.blocks, len(conversations), 1)
            settings = otel_session.configure(
                dynamo_hosts=served.hosts, siblings=siblings_of(arm.keying, cell)
            )
            setting = str(settings.siblings)
        try:
            machine = harness.load_figures()
            load = replay_load(
                served.base_url,
                served.stack.model_name,
                conversations,
                start_ms=start_ms,
                compress=args.compress,
                block_tokens=args.block_tokens,
                max_tokens=args.max_tokens,
                seed=seed,
            )
        finally:
            otel_session.unconfigure()
    results: list[Replayed] = [r for r in load.results if isinstance(r, Replayed)]
    figures = measure(results, args.workers, load.wall)
    figures["ceiling_extends"] = figures.pop("ceiling")  # fleet's: the previous prompt, whole
    figures.pop("ceiling_all", None)  # fleet's counts siblings' shared prompts: none here
    return {
        "arm": arm.name,
        "router": arm.router,
        "keying": arm.keying,
        "affinity_ttl": arm.affinity_ttl,
        "siblings_setting": setting,
        "seed": seed,
        "workers": args.workers,
        "blocks": args.blocks,
        "speedup": args.speedup,
        "compress": args.compress,
        "block_tokens": args.block_tokens,
        "max_tokens": args.max_tokens,
        "start_min": args.start_min,
        "minutes": args.minutes,
        **machine,
        **figures,
        **trace_figures(results, args.block_tokens),
        **load.cpu,
        "load_after": harness.load_figures()["load_before"],
    }


HEADER = (
    "| rep | arm | makespan s | TTFT p50/p90/p99 ms | latency p50/p99 ms | hit 2+ | ceiling 2+ | "
    "busiest share | late p99 s | cpu busy | errors |\n|" + "---|" * 11
)


def line(r: dict[str, Any]) -> str:
    """One run as a table row."""
    return (
        f"| {r['repeat']} | {r['arm']} | {r['makespan_s']:.1f} | "
        f"{fmt(r['ttft_p50_ms'], '.0f')}/{fmt(r['ttft_all_p90_ms'], '.0f')}/"
        f"{fmt(r['ttft_p99_ms'], '.0f')} | "
        f"{fmt(r['latency_p50_ms'], '.0f')}/{fmt(r['latency_p99_ms'], '.0f')} | "
        f"{r['hit_rate']:.3f} | {r['ceiling']:.3f} | {r['busiest_share']:.3f} "
        f"({r['busiest_x_fair']:.1f}x fair) | {fmt(r['late_p99_s'], '.2f')} | "
        f"{fmt(r.get('cpu_busy'), '.0%')}{' SAT' if r.get('saturated') else ''} | {r['errors']} |"
    )


def paired(rows: Sequence[dict[str, Any]]) -> str:
    """Each arm over kv alone in the same repeat (the same text, the same window): makespan and TTFT
    as ratios, the hit rate of turns 2+ as a difference."""
    kv = {r["repeat"]: r for r in rows if r["arm"] == "kv"}
    lines = [
        "| rep | arm | makespan x kv | TTFT p50 x kv | p90 x kv | p99 x kv | latency p99 x kv "
        "| hit 2+ - kv |",
        "|" + "---|" * 8,
    ]

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}"

    for r in rows:
        base = kv.get(r["repeat"])
        if base is None or r["arm"] == "kv":
            continue
        lines.append(
            f"| {r['repeat']} | {r['arm']} | {ratio(r['makespan_s'], base['makespan_s'])} | "
            f"{ratio(r['ttft_p50_ms'], base['ttft_p50_ms'])} | "
            f"{ratio(r['ttft_all_p90_ms'], base['ttft_all_p90_ms'])} | "
            f"{ratio(r['ttft_p99_ms'], base['ttft_p99_ms'])} | "
            f"{ratio(r['latency_p99_ms'], base['latency_p99_ms'])} | "
            f"{r['hit_rate'] - base['hit_rate']:+.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=Path("/tmp/conversation_trace.jsonl"))
    parser.add_argument("--start-min", type=float, default=45.0, help="window start, trace minutes")
    parser.add_argument("--minutes", type=float, default=10.0, help="window length, trace minutes")
    parser.add_argument("--compress", type=float, default=5.0, help="trace seconds per wall second")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1024, help="KV blocks of 16 tokens per worker")
    parser.add_argument("--speedup", type=float, default=0.3, help="the mocker's --speedup-ratio")
    parser.add_argument("--block-tokens", type=int, default=32, help="tokens per 512-token trace block")
    parser.add_argument("--max-tokens", type=int, default=32, help="cap on each request's output")
    parser.add_argument("--arms", default="kv,kv+default", help="comma-separated names of fleet.py's ARMS")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "trace-mooncake.json")
    parser.add_argument("--stats", action="store_true", help="the trace's and window's figures, no run")
    args = parser.parse_args(argv)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        parser.error(f"no such arm: {', '.join(unknown)} (the arms: {', '.join(ARMS)})")
    if args.compress <= 0 or args.block_tokens < 1 or args.max_tokens < 1:
        parser.error("--compress, --block-tokens and --max-tokens must be positive")

    conversations = chain(read_trace(args.trace))
    start_ms = round(args.start_min * 60_000)
    chosen = window(conversations, start_ms, start_ms + round(args.minutes * 60_000))
    meta = {
        "trace": str(args.trace),
        "whole": stats(conversations),
        "window": stats(chosen),
        "window_min": [args.start_min, args.start_min + args.minutes],
        "wall_s": args.minutes * 60 / args.compress,
    }
    print(f"whole trace: {meta['whole']}")
    print(f"window {args.start_min:g}-{args.start_min + args.minutes:g} min: {meta['window']}")
    print(f"replayed in {meta['wall_s']:.0f} s of wall time ({args.compress:g}x)")
    if args.stats:
        return 0

    arms = [ARMS[a] for a in args.arms.split(",")]
    rows: list[dict[str, Any]] = []
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    print(HEADER, flush=True)
    for rep in range(args.repeats):
        order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
        for arm in order:
            row = run_arm(arm, chosen, args, start_ms, args.seed + rep)
            row["repeat"] = rep
            rows.append(row)
            print(line(row), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print()
    print(paired(rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
