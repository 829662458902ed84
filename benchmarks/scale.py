"""10,000 concurrent trajectories on one event loop: no cross-talk, and memory back where it was.

    python benchmarks/scale.py                      # 10,000 trajectories x 3 turns, httpx and aiohttp
    python benchmarks/scale.py --trajectories 1000 --clients aiohttp

Each trajectory opens ``otel_session.trajectory()``, sends its turns to a Dynamo host and one tool
call to a host that is not Dynamo, all over loopback to ``_servers.py`` in a separate process, which
records every request's path and session headers. The path names the trajectory and the turn, so
the server's record says which ID each trajectory's requests really carried: every turn must carry
its own trajectory's ID (no cross-talk), all IDs must differ, the tool host must see none.

All trajectories are open at once: each waits after its first turn until every one has sent it,
and the memory taken then, over the baseline, is reported per open trajectory (whole client
included: the task, its coroutine, the response). A second, request-free measurement gives
otel-session's own share in bytes: tasks parked inside ``trajectory()`` against the same tasks
parked without. After the run, memory must be back at the baseline: live allocated blocks and
gc-tracked objects are counted before and after (a leak of anything per session would show as
thousands); ``--tracemalloc`` also traces every allocation (about 10x slower) and names the lines
that grew. RSS is reported but judges nothing: an allocator rarely hands pages back. What stays
alive after a run is bounded by the client's connections, not the sessions: a pooled connection's
keep-alive timer holds the context of the task that last used it, as asyncio callbacks do.

Requests queue on the client's own connection limit (64), as a real rollout would; the
trajectories, not the sockets, are what is concurrent.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: make `benchmarks._servers` importable

import aiohttp  # noqa: E402
import httpx  # noqa: E402

import otel_session  # noqa: E402
from benchmarks._servers import LoopbackServer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "scale.json"
CONNECTIONS = 16
WARMUP_TRAJECTORIES = 300
UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
_PATH = re.compile(r"/t/(\d+)/(\d+)")


@dataclass
class ScaleResult:
    """What one run found; ``ok`` is what a test asserts (memory is judged by the caller)."""

    client: str
    trajectories: int
    turns: int
    seconds: float
    requests_per_second: float
    dynamo_requests: int
    tool_requests: int
    cross_talk: int  # Dynamo requests that did not carry their own trajectory's ID
    missing: int  # (trajectory, turn) pairs the server never saw
    duplicate_ids: int
    malformed_ids: int
    tool_requests_with_session: int
    # Memory. Blocks (``sys.getallocatedblocks``) and gc-tracked objects cost nothing to count, so
    # they are always taken; traced bytes only with ``trace_memory`` (tracemalloc slows a run ~10x).
    leaked_blocks: int  # after the run, over the baseline
    leaked_gc_objects: int
    peak_blocks_per_open_trajectory: float
    peak_rss_bytes_per_open_trajectory: float
    otel_session_bytes_per_open_trajectory: float  # trajectory(), its context and baggage
    rss_baseline_mb: float
    rss_at_peak_mb: float
    rss_after_mb: float
    traced: bool = False
    peak_traced_bytes_per_open_trajectory: float | None = None
    leaked_traced_bytes: int | None = None
    leaked_otel_session_bytes: int | None = None  # allocated by a line of otel_session
    leaked_under_otel_session_bytes: int | None = None  # otel_session anywhere in the last 4 frames
    top_growth: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.cross_talk == self.missing == self.duplicate_ids == self.malformed_ids == 0
            and self.tool_requests_with_session == 0
        )


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def _settle() -> None:
    """Let go of everything finished: yielding to the loop first, because the loop's handle that
    resumed us after ``gather()`` holds the gathered future, hence every task, until we yield.

    asyncio keeps a cancelled timer in its heap until its deadline or until more than 100 cancelled
    ones make up over half the heap. aiohttp sets one per read (``sock_read``) and cancels it when
    the data comes, and each holds a copy of the context it was set in, a trajectory's included: so
    anywhere from 0 to 100 of them (about 10 blocks each) were still there when a measurement was
    taken, which alone moved what a run seemed to leave by -590 to +540 blocks. Cancelling timers
    of our own past that threshold has the loop drop every cancelled one before each measurement.
    """
    loop = asyncio.get_running_loop()
    for _ in range(3):
        for handle in [loop.call_later(3600, _nothing) for _ in range(_PURGE_TIMERS)]:
            handle.cancel()
        await asyncio.sleep(0)
        gc.collect()


def _nothing() -> None:
    """A timer's callback that is never called (it is cancelled at once)."""


# More than asyncio's threshold (100), and enough to be over half the heap with the few live timers.
_PURGE_TIMERS = 256


def _ours(snapshot: tracemalloc.Snapshot) -> tuple[int, int]:
    """Bytes allocated by a line of otel_session itself, and with otel_session anywhere on the stack."""
    direct = anywhere = 0
    for trace in snapshot.traces:
        frames = [frame.filename for frame in trace.traceback]
        if "otel_session" in frames[0]:
            direct += trace.size
        if any("otel_session" in name for name in frames):
            anywhere += trace.size
    return direct, anywhere


Send = Callable[[str, dict[str, Any]], Awaitable[None]]


class Clients:
    """One shared client for the whole run, as a rollout worker holds one (and its pool).

    Requests wait for one of ``CONNECTIONS`` slots before reaching the client: httpcore's pool
    rescans every queued request whenever a connection frees up, which with 10,000 waiters makes
    the client, not otel-session, the whole cost of the run. httpx's idle connections never expire
    here: with its default 5 s expiry the pool held 11 to 16 connections when a measurement was
    taken, about 80 blocks each, and that alone moved what a run seemed to leave by -190 to +280
    blocks; at a full pool of 16 it stays within +54 to +86.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._httpx: httpx.AsyncClient | None = None
        self._aiohttp: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Send:
        slots = asyncio.Semaphore(CONNECTIONS)
        if self.kind == "httpx":
            limits = httpx.Limits(
                max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS, keepalive_expiry=None
            )
            self._httpx = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300, pool=None))
            client = self._httpx

            async def send_httpx(url: str, body: dict[str, Any]) -> None:
                async with slots:
                    (await client.post(url, json=body)).raise_for_status()

            return send_httpx
        connector = aiohttp.TCPConnector(limit=CONNECTIONS)
        self._aiohttp = session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_read=300)
        )

        async def send_aiohttp(url: str, body: dict[str, Any]) -> None:
            async with slots, session.post(url, json=body) as response:
                response.raise_for_status()
                await response.read()

        return send_aiohttp

    async def __aexit__(self, *exc: object) -> None:
        if self._httpx is not None:
            await self._httpx.aclose()
        if self._aiohttp is not None:
            await self._aiohttp.close()


async def _trajectories(
    send: Send, dynamo: str, tool: str, count: int, turns: int, first: int, on_all_open: Callable[[], None]
) -> list[str]:
    """Run ``count`` trajectories at once; returns each one's session ID, by index."""
    ids = [""] * count
    opened = 0
    all_open = asyncio.Event()

    async def one(index: int) -> None:
        nonlocal opened
        tag = first + index
        async with otel_session.trajectory() as traj:
            assert traj.session_id is not None
            ids[index] = traj.session_id
            for turn in range(turns):
                await send(f"{dynamo}/t/{tag}/{turn}", {"trajectory": tag, "turn": turn})
                if turn == 0:
                    opened += 1
                    if opened == count:
                        on_all_open()
                        all_open.set()
                    await all_open.wait()
            await send(f"{tool}/tool/{tag}", {"trajectory": tag})

    await asyncio.gather(*(one(index) for index in range(count)))
    return ids


async def _parked(count: int, with_trajectory: bool, measure: Callable[[], int]) -> int:
    """Traced bytes with ``count`` tasks parked, inside ``trajectory()`` or not."""
    release = asyncio.Event()
    parked = 0
    full = asyncio.Event()

    async def park() -> None:
        nonlocal parked
        if with_trajectory:
            async with otel_session.trajectory():
                parked += 1
                if parked == count:
                    full.set()
                await release.wait()
        else:
            parked += 1
            if parked == count:
                full.set()
            await release.wait()

    tasks = [asyncio.create_task(park()) for _ in range(count)]
    await full.wait()
    taken = measure()
    release.set()
    await asyncio.gather(*tasks)
    return taken


def check(records: list[dict[str, Any]], ids: list[str], turns: int, first: int) -> dict[str, Any]:
    """Compare what the server saw with what each trajectory was: counts of every kind of wrong."""
    seen: dict[tuple[int, int], list[str | None]] = {}
    tool_with_session = tool = 0
    for record in records:
        match = _PATH.fullmatch(record["path"])
        if match is None:
            tool += 1
            if record.get("x-dynamo-session-id") or record.get("baggage"):
                tool_with_session += 1
            continue
        session = record.get("x-dynamo-session-id")
        key = (int(match.group(1)) - first, int(match.group(2)))
        seen.setdefault(key, []).append(session[0] if session and len(session) == 1 else None)
    cross_talk = sum(
        1
        for (index, _), values in seen.items()
        for value in values
        if not 0 <= index < len(ids) or value != ids[index]
    )
    expected = {(index, turn) for index in range(len(ids)) for turn in range(turns)}
    return {
        "dynamo_requests": sum(len(values) for values in seen.values()),
        "tool_requests": tool,
        "cross_talk": cross_talk,
        "missing": len(expected - seen.keys()),
        "duplicate_ids": len(ids) - len(set(ids)),
        "malformed_ids": sum(1 for value in ids if not UUID4.fullmatch(value)),
        "tool_requests_with_session": tool_with_session,
    }


def run_scale(
    trajectories: int = 10_000, turns: int = 3, client: str = "httpx", trace_memory: bool = False
) -> ScaleResult:
    """One full run against a fresh recording server; otel-session is configured for it and undone."""
    with LoopbackServer(["127.0.0.1", "127.0.0.2"], record=True) as server:
        dynamo, tool = server.urls
        otel_session.configure(dynamo_hosts=[server.authorities[0]])
        try:
            return asyncio.run(_run(server, dynamo, tool, trajectories, turns, client, trace_memory))
        finally:
            otel_session.unconfigure()


def _memory() -> dict[str, float]:
    return {
        "blocks": sys.getallocatedblocks(),
        "objects": len(gc.get_objects()),
        "rss": _rss_mb(),
        "traced": tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0,
    }


async def _run(
    server: LoopbackServer,
    dynamo: str,
    tool: str,
    trajectories: int,
    turns: int,
    client: str,
    trace_memory: bool,
) -> ScaleResult:
    if trace_memory:
        tracemalloc.start(4)
    try:
        async with Clients(client) as send:
            # Warm-up: the pool's connections, every lazy import and cache; and asyncio's own tables
            # (its set of all tasks, the ready queue) grown to the run's size once, as any long-lived
            # loop's are, so that what is compared afterwards is what the run itself left behind.
            await _trajectories(send, dynamo, tool, WARMUP_TRAJECTORIES, turns, 10**9, lambda: None)
            await _parked(trajectories, True, lambda: 0)
            server.records()  # and forget them (synchronously: nothing else runs on the loop now)
            await _settle()
            baseline = _memory()
            baseline_snapshot = tracemalloc.take_snapshot() if trace_memory else None
            at_peak: dict[str, float] = {}

            def on_all_open() -> None:
                at_peak.update(_memory())

            began = time.perf_counter()
            ids = await _trajectories(send, dynamo, tool, trajectories, turns, 0, on_all_open)
            seconds = time.perf_counter() - began
            records = server.records()
            found = check(records, ids, turns, 0)
            del ids, records
            await _settle()
            after = _memory()
            traced: dict[str, Any] = {}
            if baseline_snapshot is not None:
                after_snapshot = tracemalloc.take_snapshot()
                growth = after_snapshot.compare_to(baseline_snapshot, "lineno")[:5]
                ours_after, under_after = _ours(after_snapshot)
                ours_before, under_before = _ours(baseline_snapshot)
                traced = {
                    "traced": True,
                    "peak_traced_bytes_per_open_trajectory": round(
                        (at_peak["traced"] - baseline["traced"]) / trajectories, 1
                    ),
                    "leaked_traced_bytes": int(after["traced"] - baseline["traced"]),
                    "leaked_otel_session_bytes": ours_after - ours_before,
                    "leaked_under_otel_session_bytes": under_after - under_before,
                    "top_growth": [str(stat) for stat in growth if stat.size_diff > 0],
                }
                del baseline_snapshot, after_snapshot
        await _settle()
        share = await _own_share(trajectories)
    finally:
        if trace_memory:
            tracemalloc.stop()
    total = trajectories * (turns + 1)
    return ScaleResult(
        client=client,
        trajectories=trajectories,
        turns=turns,
        seconds=round(seconds, 2),
        requests_per_second=round(total / seconds, 1),
        leaked_blocks=int(after["blocks"] - baseline["blocks"]),
        leaked_gc_objects=int(after["objects"] - baseline["objects"]),
        peak_blocks_per_open_trajectory=round((at_peak["blocks"] - baseline["blocks"]) / trajectories, 1),
        peak_rss_bytes_per_open_trajectory=round((at_peak["rss"] - baseline["rss"]) * 2**20 / trajectories),
        otel_session_bytes_per_open_trajectory=share,
        rss_baseline_mb=round(baseline["rss"], 1),
        rss_at_peak_mb=round(at_peak["rss"], 1),
        rss_after_mb=round(after["rss"], 1),
        **traced,
        **found,
    )


async def _own_share(trajectories: int) -> float:
    """Traced bytes per task parked inside ``trajectory()`` over a task parked without one."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start(1)
    try:
        measure = lambda: tracemalloc.get_traced_memory()[0]  # noqa: E731
        await _parked(trajectories, True, measure)  # once for the loop's tables to grow
        await _settle()
        without = await _parked(trajectories, False, measure)
        await _settle()
        within = await _parked(trajectories, True, measure)
    finally:
        if not tracing:
            tracemalloc.stop()
    return round((within - without) / trajectories, 1)


def _print(result: ScaleResult) -> None:
    r = result
    print(f"\n{r.client}: {r.trajectories} concurrent trajectories x {r.turns} turns + a tool call each")
    tracing = "tracemalloc on" if r.traced else "tracemalloc off"
    print(f"  {r.seconds} s, {r.requests_per_second} requests/s ({CONNECTIONS} connections, {tracing})")
    print(
        f"  Dynamo requests {r.dynamo_requests}, tool requests {r.tool_requests}; cross-talk {r.cross_talk}, "
        f"missing {r.missing}, duplicate IDs {r.duplicate_ids}, malformed IDs {r.malformed_ids}, "
        f"tool requests with a session {r.tool_requests_with_session}"
    )
    peak = (
        f"{r.peak_rss_bytes_per_open_trajectory:.0f} B of RSS, {r.peak_blocks_per_open_trajectory:.0f} blocks"
    )
    if r.peak_traced_bytes_per_open_trajectory is not None:
        peak += f", {r.peak_traced_bytes_per_open_trajectory:.0f} B"
    print(
        f"  per open trajectory at the peak: {peak} (all of it: task, client, response); "
        f"otel-session's own share: {r.otel_session_bytes_per_open_trajectory:.0f} B"
    )
    blocks = "blocks (tracemalloc's own among them)" if r.traced else "blocks"
    print(
        f"  after the run, over the baseline: {r.leaked_blocks:+d} {blocks}, {r.leaked_gc_objects:+d} gc "
        f"objects; RSS {r.rss_baseline_mb} -> {r.rss_at_peak_mb} (peak) -> {r.rss_after_mb} MB"
    )
    if r.traced:
        print(
            f"  traced: {r.leaked_traced_bytes:+d} B ({r.leaked_otel_session_bytes:+d} B by otel_session "
            f"lines, {r.leaked_under_otel_session_bytes:+d} B with otel_session on the stack)"
        )
        for line in r.top_growth:
            print(f"    growth: {line}")
    print(f"  {'OK' if r.ok else 'FAILED'}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--clients", default="aiohttp,httpx", help="comma-separated: aiohttp, httpx")
    parser.add_argument("--tracemalloc", action="store_true", help="trace every allocation (~10x slower)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = []
    for client in args.clients.split(","):
        result = run_scale(args.trajectories, args.turns, client, args.tracemalloc)
        _print(result)
        results.append(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([{**asdict(r), "ok": r.ok} for r in results], indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0 if all(result.ok for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
