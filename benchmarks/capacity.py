"""How many sessions Dynamo 1.6.1 pins before its affinity table is full, and what requests see then.

    python benchmarks/capacity.py                       # hard mode (Dynamo's default), about 4 min
    python benchmarks/capacity.py --mode soft
    python benchmarks/capacity.py --time-cap 60         # bounded: measure the rate, extrapolate

A real local stack (``benchmarks/harness.py``: frontend + 3 mocker workers on loopback, round-robin,
affinity TTL 3600 s so no binding idles out during the run; the cores' busy fraction is recorded).
Every new trajectory (``otel_session.trajectory()``, aiohttp) sends one request, which binds its
session; bindings leave only by idle TTL, so the table only grows. Every ``--probe-every`` sessions:
a new 5-turn trajectory checks that a *new* session still stays on one worker (round-robin over 3
workers would move it), two early sessions check that *old* bindings still hold, and one request
without any session header checks the router itself. The frontend's log is searched for "Affinity
table full" and for failures. The run stops three probe rounds after the table is seen full (that
line, a failed session, or an unpinned new one), when all sessions are sent, or after ``--time-cap``
seconds of filling (then the time to 65,536 is extrapolated from the rate). Writes
``benchmarks/results/capacity-MODE.json``.

Measured (2 shared cores, both modes): exactly 65,536 sessions bind; from then on every request of a
*new* session is answered ``529 {"message":"Service temporarily overloaded","type":"Overloaded"}``
(logged as ERROR ``error_type=overload``; no "Affinity table full" line at the default log level),
old sessions stay pinned, and requests without a session header are served normally. The size is
compiled in (no flag or variable), so there is no smaller demonstration: the run fills it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

import otel_session  # noqa: E402
from benchmarks import harness  # noqa: E402
from otel_session.dynamo import LocalDynamo, worker_id_of  # noqa: E402

TABLE_SIZE = 65_536
FULL_LINE = "Affinity table full; routing without session affinity"
BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 1,
    "nvext": {"extra_fields": ["worker_id"]},
}


@dataclass
class Probe:
    """One probe: how many sessions were bound when it ran, and where its turns went."""

    sessions_before: int
    kind: str  # "new" (a fresh 5-turn trajectory), "old" (an early session's next turn), "none" (no header)
    workers: list[int | None]
    statuses: list[int]
    latency_ms: float

    @property
    def pinned(self) -> bool:
        return len(set(self.workers)) == 1 and None not in self.workers


@dataclass
class Result:
    sessions_sent: int = 0
    sessions_bound: int = 0  # sessions whose first request was served (and so bound)
    fill_errors: int = 0
    fill_seconds: float = 0.0
    rate_per_second: float = 0.0
    table_full_logged_after: int | None = None
    table_full_log_lines: int = 0
    first_unpinned_new_probe_after: int | None = None
    first_fill_error_after: int | None = None
    errors_seen: list[dict[str, Any]] = field(default_factory=list)
    frontend_log_lines: list[str] = field(default_factory=list)
    extrapolated_seconds_to_full: float | None = None
    probes: list[dict[str, Any]] = field(default_factory=list)
    after_full: dict[str, Any] = field(default_factory=dict)
    cpu: dict[str, Any] = field(default_factory=dict)  # the cores over the fill (harness.CpuWatch)


ERRORS: list[dict[str, Any]] = []  # the first few non-200 answers, as the client saw them


async def _post(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, int | None]:
    async with session.post(url, json={**BODY, "model": model}) as resp:
        if resp.status == 200:
            return resp.status, worker_id_of(await resp.json(content_type=None))
        if len(ERRORS) < 3:
            ERRORS.append({"status": resp.status, "body": (await resp.text())[:400]})
        return resp.status, None


async def _new_probe(session: aiohttp.ClientSession, url: str, model: str, bound: int) -> Probe:
    began = time.perf_counter()
    async with otel_session.trajectory():
        turns = [await _post(session, url, model) for _ in range(5)]
    latency = (time.perf_counter() - began) * 1000 / 5
    return Probe(bound, "new", [w for _, w in turns], [s for s, _ in turns], latency)


async def _plain_probe(session: aiohttp.ClientSession, url: str, model: str, bound: int) -> Probe:
    """A request outside any trajectory: no session header at all."""
    began = time.perf_counter()
    status, worker = await _post(session, url, model)
    return Probe(bound, "none", [worker], [status], (time.perf_counter() - began) * 1000)


async def _old_probe(
    session: aiohttp.ClientSession, url: str, model: str, bound: int, sid: str, first: int | None
) -> Probe:
    began = time.perf_counter()
    async with otel_session.trajectory(session_id=sid):
        status, worker = await _post(session, url, model)
    return Probe(bound, "old", [first, worker], [status], (time.perf_counter() - began) * 1000)


def _frontend_log(stack: LocalDynamo) -> str:
    return "".join(fe.log_path.read_text(errors="replace") for fe in stack.frontends)


def _full_lines(stack: LocalDynamo) -> int:
    return _frontend_log(stack).count(FULL_LINE)


def _telling_lines(stack: LocalDynamo) -> list[str]:
    """The first distinct frontend log lines about affinity or failures (timestamps cut)."""
    seen: dict[str, None] = {}
    for line in _frontend_log(stack).splitlines():
        low = line.lower()
        if any(word in low for word in ("table full", "status=529", "overloaded", "affinity table")):
            text = line.split(" ", 1)[-1][:300]
            seen.setdefault(text, None)
            if len(seen) >= 8:
                break
    return list(seen)


async def run(args: argparse.Namespace) -> Result:
    result = Result()
    watch = harness.CpuWatch()
    deployment = harness.Deployment(router="round-robin", affinity_ttl=3600, mode=args.mode)
    with harness.stack(deployment, workers=3, speedup=args.speedup) as served, watch:
        stack = served.stack
        otel_session.configure(dynamo_hosts=stack.hosts)
        url = stack.base_url + "/chat/completions"
        model = stack.model_name
        connector = aiohttp.TCPConnector(limit=args.concurrency)
        async with aiohttp.ClientSession(connector=connector) as http:
            early: list[tuple[str, int | None]] = []
            for _ in range(5):
                async with otel_session.trajectory() as traj:
                    _, worker = await _post(http, url, model)
                assert traj.session_id is not None
                early.append((traj.session_id, worker))
            result.sessions_sent = result.sessions_bound = 5
            began = time.monotonic()
            queue: asyncio.Queue[None] = asyncio.Queue()

            async def one() -> None:
                async with otel_session.trajectory():
                    status, _ = await _post(http, url, model)
                if status == 200:
                    result.sessions_bound += 1
                else:
                    result.fill_errors += 1
                    if result.first_fill_error_after is None:
                        result.first_fill_error_after = result.sessions_sent

            async def filler() -> None:
                while True:
                    await queue.get()
                    try:
                        await one()
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        result.fill_errors += 1
                    finally:
                        queue.task_done()

            workers = [asyncio.create_task(filler()) for _ in range(args.concurrency)]
            probes_after_full = 0
            try:
                while result.sessions_sent < args.sessions:
                    batch = min(args.probe_every, args.sessions - result.sessions_sent)
                    for _ in range(batch):
                        queue.put_nowait(None)
                    await queue.join()
                    result.sessions_sent += batch
                    elapsed = time.monotonic() - began
                    probes = [await _new_probe(http, url, model, result.sessions_sent)]
                    probes += [
                        await _old_probe(http, url, model, result.sessions_sent, sid, first)
                        for sid, first in early[:2]
                    ]
                    probes.append(await _plain_probe(http, url, model, result.sessions_sent))
                    result.sessions_sent += 1  # the new probe is a session too
                    result.sessions_bound += probes[0].statuses[0] == 200
                    for probe in probes:
                        result.probes.append({**asdict(probe), "pinned": probe.pinned})
                        first_unpinned = result.first_unpinned_new_probe_after
                        if probe.kind == "new" and not probe.pinned and first_unpinned is None:
                            result.first_unpinned_new_probe_after = probe.sessions_before
                    full = _full_lines(stack)
                    if full and result.table_full_logged_after is None:
                        result.table_full_logged_after = result.sessions_sent
                    rate = (result.sessions_sent - 5) / max(elapsed, 1e-9)
                    print(
                        f"{result.sessions_sent:>7} sessions  {rate:6.0f}/s  new pinned={probes[0].pinned} "
                        f"old pinned={all(p.pinned for p in probes[1:3])}  "
                        f"no header: {probes[3].statuses}  'table full' lines={full}",
                        flush=True,
                    )
                    if _full_at(result) is not None:
                        probes_after_full += 1
                        if probes_after_full >= 3:
                            break
                    if elapsed > args.time_cap:
                        print(f"time cap of {args.time_cap:.0f} s reached", flush=True)
                        break
            finally:
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
            result.fill_seconds = time.monotonic() - began
            result.rate_per_second = (result.sessions_sent - 5) / max(result.fill_seconds, 1e-9)
            result.table_full_log_lines = _full_lines(stack)
            result.frontend_log_lines = _telling_lines(stack)
            result.errors_seen = list(ERRORS)
            if _full_at(result) is None and result.rate_per_second > 0:
                result.extrapolated_seconds_to_full = TABLE_SIZE / result.rate_per_second
            result.after_full = _after_full(result)
        otel_session.unconfigure()
    result.cpu = watch.figures()
    return result


def _full_at(result: Result) -> int | None:
    """Where the table filled (in sessions sent): the log line if the router wrote one, else the first
    failed session or the first new session that did not stay on one worker."""
    marks = (
        result.table_full_logged_after,
        result.first_fill_error_after,
        result.first_unpinned_new_probe_after,
    )
    return next((n for n in marks if n is not None), None)


def _after_full(result: Result) -> dict[str, Any]:
    """What the probes saw once the table was full: who still pinned, which statuses."""
    full_at = _full_at(result)
    after = [p for p in result.probes if full_at is not None and p["sessions_before"] >= full_at]

    def of(kind: str) -> list[dict[str, Any]]:
        return [p for p in after if p["kind"] == kind]

    return {
        "full_at_about": full_at,
        "new_sessions_pinned": f"{sum(p['pinned'] for p in of('new'))}/{len(of('new'))}",
        "old_sessions_pinned": f"{sum(p['pinned'] for p in of('old'))}/{len(of('old'))}",
        "new_session_statuses": sorted({s for p in of("new") for s in p["statuses"]}),
        "no_header_statuses": sorted({s for p in of("none") for s in p["statuses"]}),
        "mean_latency_ms": (sum(p["latency_ms"] for p in after) / len(after)) if after else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=TABLE_SIZE + 3 * 2048)
    parser.add_argument("--time-cap", type=float, default=600.0, help="seconds of filling at most")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--probe-every", type=int, default=2048)
    parser.add_argument("--speedup", type=float, default=1000.0, help="mocker speedup ratio")
    parser.add_argument(
        "--mode", choices=["hard", "soft"], default="hard", help="--router-session-affinity-mode"
    )
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/capacity-MODE.json")
    args = parser.parse_args()
    if args.out is None:
        args.out = ROOT / "benchmarks" / "results" / f"capacity-{args.mode}.json"
    result = asyncio.run(run(args))
    summary = {k: v for k, v in asdict(result).items() if k != "probes"}
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, **asdict(result)}
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
