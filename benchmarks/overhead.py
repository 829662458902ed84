"""What otel-session costs a process as a whole: two processes side by side, configured and bare.

    python benchmarks/overhead.py             # 6 fresh sets of processes, 1-2 minutes on 2 cores
    python benchmarks/overhead.py --quick     # 3 sets, a third of the turns: a smoke check
    python benchmarks/overhead.py --library DIR   # the otel_session in DIR instead of the installed one
    python benchmarks/overhead.py --compare DIR   # one more side, configured, with the otel_session in DIR

This is the figure a user pays. Each pair is fresh processes (``overhead_worker.py``): one bare,
which never imports otel-session; one configured (``otel_session.configure(dynamo_hosts=[the
server])``, tracing off); and one that only imports otel-session and the clients ``configure()``
imported up front as of the baseline (httpx2, aiohttp), to tell the cost of imports from that of
the hooks; and one with no otel-session but the least hook that delivers a session header (a wrapt
wrapper on httpx's transport appending one fixed header, ``overhead_worker.install_least_hook``),
to show in the same run what the floor leaves for everything a real library must do besides.
``--compare`` adds a side configured the same way with another copy of otel-session
(the previous commit, say), for a before/after in one run. All send httpx sync requests over
loopback to one server in a process of its own (``_servers.py``), one keep-alive connection each.

A coordinator (this script) drives them in lock-step: in each turn every side runs one chunk of
requests (30 by default; the configured side opens one ``trajectory()`` per chunk), one side at
a time, the order alternating forward and backward (A B, B A, ...) so a drift in the machine's
load falls on every side alike, and rotating, so every side takes every position, and follows
itself (caches still warm from its last chunk), equally often: without that, the middle one of
three sides looked 3% slower than it is.

A chunk's figure is its wall time over the bare side's chunk of the same turn; the result is the
median of those ratios over all turns of all pairs, with a 95 % interval (resampling pairs, then
chunks within them: a fresh process moves its pair's figure by a few per cent, and a shared
machine's chunks scatter by ±15 %) and the spread of the pairs' own medians. The configured side is
also compared with the least hook chunk by chunk: what otel-session costs beyond a header.
CPU is each worker's own ``time.process_time`` (all its threads), per request; the GC column is
time in the garbage collector (``gc.callbacks``). What setting up cost (imports, configure) is
reported once per process: a configured process pays it at start.

Cases: "dynamo" in a trajectory to the configured Dynamo host (the session header is added),
"other" in a trajectory to a host that is not configured (nothing is added), "outside" to the
Dynamo host with no trajectory open. After the turns, each side sends a few marked requests the
server records, and the run checks the header went to Dynamo from the configured sides only.

The other two views measure something narrower, in one process: ``overhead_requests.py`` (one
client alternating requests through otel-session's hook and around it: the hook's own CPU per
request, in-process and over loopback) and ``overhead_configs.py`` (every configuration block by
block: tracing on, the upstream instrumentors).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # run as a script: `benchmarks.*` importable; PYTHONPATH still first

from benchmarks._servers import CHECK_PATH, LoopbackServer  # noqa: E402
from benchmarks.overhead_report import machine, quartiles, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "overhead_processes.json"
WORKER = Path(__file__).resolve().parent / "overhead_worker.py"
KINDS = ("bare", "imports", "least", "configured")
CASES = ("dynamo", "outside", "other")
LABELS = {
    "dynamo": "in a trajectory -> Dynamo",
    "outside": "no trajectory -> Dynamo",
    "other": "in a trajectory -> other host",
}
KIND_LABELS = {
    "imports": "imports only (by default otel_session, httpx2, aiohttp), nothing configured",
    "least": "no otel-session: the least hook that delivers the header (a wrapt hook, one fixed header)",
    "configured": "configured, tracing off",
    "compared": "configured likewise, otel_session from --compare",
}
FLOOR = 1.03  # wall ratio, configured / bare, in and outside a trajectory
SESSION_HEADER = "x-dynamo-session-id"
T = TypeVar("T")


@dataclass(frozen=True)
class Side:
    """One process of each pair: its name in the results, the worker kind, which otel_session."""

    name: str
    kind: str  # bare | imports | least | configured
    library: Path | None = None  # None: the one installed


class Worker:
    """One worker process; ``facts`` is what its setup cost, as it reported."""

    def __init__(self, side: Side, urls: Sequence[str], imports: str) -> None:
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith("OTEL_") and name.lower() not in ("http_proxy", "https_proxy", "all_proxy")
        }
        env.pop("PYTHONPATH", None)
        if side.library is not None:
            env["PYTHONPATH"] = str(side.library)
        self.side = side
        command = [sys.executable, str(WORKER), "--kind", side.kind, "--imports", imports]
        self._proc = subprocess.Popen(
            [*command, "--dynamo", urls[0], "--other", urls[1]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self.facts: dict[str, Any] = {}

    def ready(self) -> dict[str, Any]:
        self.facts = self._read()
        return self.facts

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.side.name} worker ended early (exit code {self._proc.poll()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def send(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@dataclass
class Pair:
    """One fresh set of processes and every chunk each ran: chunks[case][side] lists turns."""

    facts: dict[str, dict[str, Any]]
    chunks: dict[str, dict[str, list[dict[str, float]]]] = field(default_factory=dict)
    header_check: dict[str, bool] = field(default_factory=dict)


def run_pair(
    server: LoopbackServer,
    sides: Sequence[Side],
    rounds: int,
    n: int,
    warm: int,
    imports: str,
) -> Pair:
    workers = [Worker(side, server.urls, imports) for side in sides]
    try:
        pair = Pair({worker.side.name: worker.ready() for worker in workers})
        pair.chunks = {case: {side.name: [] for side in sides} for case in CASES}
        for case in CASES:
            for worker in workers:
                worker.send({"case": case, "n": warm})
        last = None
        for turn in range(rounds * len(CASES)):
            case = CASES[(turn + turn // len(CASES)) % len(CASES)]
            for worker in order_of_turn(workers, turn):
                chunk = worker.send({"case": case, "n": n})
                chunk["after_itself"] = worker is last
                pair.chunks[case][worker.side.name].append(chunk)
                last = worker
        server.records()  # forget anything recorded so far
        for worker in workers:
            worker.send({"check": f"{CHECK_PATH}/{worker.side.name}"})
        pair.header_check = check_headers(server.records(), sides)
        return pair
    finally:
        for worker in workers:
            worker.close()


def order_of_turn(workers: Sequence[T], turn: int) -> list[T]:
    """Who runs when in one turn: each rotation of the sides, forward then backward.

    Forward then backward (A B, B A) puts a drift of the machine's load on every side alike; the
    rotations make every side take every position equally often and follow itself (its caches
    still warm from its last chunk) equally often: once per ``2 * len(workers)`` turns. Without
    them the middle one of three would never follow itself and look slower. The default 48
    rounds of 3 cases (144 turns) is a whole number of such cycles for 2, 3 and 4 sides.
    """
    count = len(workers)
    start = (turn // 2) % count
    rotation = [*workers[start:], *workers[:start]]
    return rotation if turn % 2 == 0 else rotation[::-1]


def check_headers(records: list[dict[str, Any]], sides: Sequence[Side]) -> dict[str, bool]:
    """Per side: did the header go exactly where it should? A configured side's trajectory requests
    to Dynamo, the least hook's every request to Dynamo (it reads no trajectory), nothing else."""
    seen = {}
    for record in records:
        parts = record["path"].split("/")  # "", "__check", side, case
        if len(parts) >= 4:
            seen[(parts[2], parts[3])] = SESSION_HEADER in record
    ok = {}
    for side in sides:
        configured, least = side.kind == "configured", side.kind == "least"
        expected = {case: (configured and case == "dynamo") or (least and case != "other") for case in CASES}
        ok[side.name] = all(seen.get((side.name, case)) == want for case, want in expected.items())
    return ok


def summarize(
    pairs: list[Pair], names: Sequence[str], n: int, reference: str = "bare"
) -> list[dict[str, Any]]:
    """One row per (side, case): ratios to the ``reference`` side's chunk of the same turn."""
    rows = []
    for name in names:
        if name == reference:
            continue
        for case in CASES:
            ratios: list[float] = []
            added_cpu: list[float] = []
            per_pair: list[float] = []
            by_pair: list[list[float]] = []
            bare_wall: list[float] = []
            bare_cpu: list[float] = []
            gc_ms: list[float] = []
            bare_gc_ms: list[float] = []
            added_first: list[float] = []
            for pair in pairs:
                mine, base = pair.chunks[case][name], pair.chunks[case][reference]
                these = [a["wall"] / b["wall"] for a, b in zip(mine, base, strict=True)]
                ratios += these
                by_pair.append(these)
                per_pair.append(statistics.median(these))
                added_cpu += [(a["cpu"] - b["cpu"]) / n * 1e6 for a, b in zip(mine, base, strict=True)]
                bare_wall += [b["wall"] / n * 1e6 for b in base]
                bare_cpu += [b["cpu"] / n * 1e6 for b in base]
                gc_ms += [a["gc"] / n * 1e6 for a in mine]
                added_first += [(a["first"] - b["first"]) * 1e6 for a, b in zip(mine, base, strict=True)]
                bare_gc_ms += [b["gc"] / n * 1e6 for b in base]
            lo, hi = quartiles(ratios)
            rows.append(
                {
                    "side": name,
                    "reference": reference,
                    "case": case,
                    "wall_ratio": round(statistics.median(ratios), 4),
                    "wall_ratio_ci95": [round(value, 4) for value in interval(by_pair)],
                    "wall_ratio_iqr": [round(lo, 4), round(hi, 4)],
                    "wall_ratio_pair_medians": [round(value, 4) for value in per_pair],
                    "chunks": len(ratios),
                    "bare_wall_us": round(statistics.median(bare_wall), 1),
                    "bare_cpu_us": round(statistics.median(bare_cpu), 1),
                    "added_cpu_us": round(statistics.median(added_cpu), 1),
                    "added_cpu_us_iqr": [round(value, 1) for value in quartiles(added_cpu)],
                    "added_first_request_wall_us": round(statistics.median(added_first), 1),
                    "gc_us_per_request": round(statistics.median(gc_ms), 2),
                    "bare_gc_us_per_request": round(statistics.median(bare_gc_ms), 2),
                }
            )
    return rows


def interval(per_pair: list[list[float]], draws: int = 1000, seed: int = 11) -> tuple[float, float]:
    """A 95 % interval for the median of the pooled chunk ratios, by resampling what varies: the
    pairs (each fresh process is a new draw of heap layout and hash seed, which moves a pair's
    figure by a few per cent) and, within each, its chunks. Seeded: the same run, the same interval."""
    rng = random.Random(seed)
    medians = []
    for _ in range(draws):
        pooled = [
            ratio
            for chunks in rng.choices(per_pair, k=len(per_pair))
            for ratio in rng.choices(chunks, k=len(chunks))
        ]
        medians.append(statistics.median(pooled))
    medians.sort()
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def summarize_setup(pairs: list[Pair], names: Sequence[str]) -> list[dict[str, Any]]:
    """What each side's imports and configure() cost once, medians over the pairs."""
    bare_packages = set(pairs[0].facts["bare"]["top_level_packages"])
    rows = []
    for name in names:
        facts = [pair.facts[name] for pair in pairs]

        def median(key: str, facts: list[dict[str, Any]] = facts) -> float:
            return round(statistics.median(fact[key] for fact in facts), 2)

        rows.append(
            {
                "side": name,
                "library": facts[0]["library"],
                "setup_cpu_ms": median("setup_cpu_ms"),
                "setup_wall_ms": median("setup_wall_ms"),
                "import_httpx_cpu_ms": median("import_httpx_cpu_ms"),
                "process_cpu_ms_at_ready": median("process_cpu_ms_at_ready"),
                "max_rss_kb_at_ready": median("max_rss_kb_at_ready"),
                "modules": median("modules"),
                "gc_objects": median("gc_objects"),
                "packages_beyond_bare": sorted(set(facts[0]["top_level_packages"]) - bare_packages),
            }
        )
    return rows


def print_results(rows: list[dict[str, Any]], setup: list[dict[str, Any]], pairs: int) -> None:
    print(
        f"\n  {'side':10} {'case':30} {'wall ratio':>10} {'[95% interval]':>16} {'pairs min..max':>14} "
        f"{'bare wall us':>12} {'bare CPU us':>11} {'added CPU us':>12} {'1st request':>11} "
        f"{'GC us side/bare':>15}"
    )
    for row in rows:
        lo, hi = row["wall_ratio_ci95"]
        pair_medians = row["wall_ratio_pair_medians"]
        gc_us = f"{row['gc_us_per_request']:.1f}/{row['bare_gc_us_per_request']:.1f}"
        print(
            f"  {row['side']:10} {LABELS[row['case']]:30} {row['wall_ratio']:10.3f} "
            f"{f'[{lo:.3f}, {hi:.3f}]':>16} {f'{min(pair_medians):.3f}..{max(pair_medians):.3f}':>14} "
            f"{row['bare_wall_us']:12.1f} {row['bare_cpu_us']:11.1f} {row['added_cpu_us']:+12.1f} "
            f"{row['added_first_request_wall_us']:+11.1f} {gc_us:>15}"
        )
    shown = {row["side"] for row in rows}
    print("  " + "; ".join(f"{name}: {label}" for name, label in KIND_LABELS.items() if name in shown))
    print(
        "  1st request: the wall time a chunk's first request adds (us, median over chunks), the "
        "trajectory's start included: what each new trajectory pays once, with the caches cold"
    )
    print(f"\n  Once per process (medians over {pairs} pairs):")
    print(
        f"  {'side':10} {'setup CPU ms':>12} {'setup wall ms':>13} {'CPU at ready ms':>15} "
        f"{'max RSS MB':>10} {'modules':>7} {'gc objects':>10}  top-level packages beyond bare"
    )
    for row in setup:
        extra = [name for name in row["packages_beyond_bare"] if not name.startswith("_")]
        print(
            f"  {row['side']:10} {row['setup_cpu_ms']:12.1f} {row['setup_wall_ms']:13.1f} "
            f"{row['process_cpu_ms_at_ready']:15.1f} {row['max_rss_kb_at_ready'] / 1024:10.1f} "
            f"{row['modules']:7.0f} {row['gc_objects']:10.0f}  {' '.join(extra)}"
        )


def print_direct(rows: list[dict[str, Any]]) -> None:
    """Rows of one side against another side (not bare), one line per case."""
    for row in rows:
        lo, hi = row["wall_ratio_ci95"]
        print(
            f"  {LABELS[row['case']]:30} wall ratio {row['wall_ratio']:.3f} (95% {lo:.3f}-{hi:.3f}), "
            f"CPU {row['added_cpu_us']:+.1f} us per request"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 pairs of 16 rounds: a smoke check")
    parser.add_argument("--pairs", type=int, help="fresh process pairs (default 6)")
    parser.add_argument("--rounds", type=int, help="rounds per pair, each a turn per case (default 48)")
    parser.add_argument("--requests", type=int, default=30, help="requests per chunk (default 30)")
    parser.add_argument("--warm", type=int, default=100, help="warm-up requests per case (default 100)")
    parser.add_argument("--sides", default=",".join(KINDS), help=f"which of {','.join(KINDS)} run")
    parser.add_argument(
        "--imports", default="otel_session,httpx2,aiohttp", help="what the imports side imports"
    )
    parser.add_argument("--library", type=Path, help="directory holding the otel_session to measure")
    parser.add_argument(
        "--compare", type=Path, help="add a side configured like the other, with otel_session from here"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    pairs_wanted = args.pairs or (3 if args.quick else 6)
    rounds = args.rounds or (16 if args.quick else 48)
    kinds = [kind for kind in args.sides.split(",") if kind]
    if "bare" not in kinds or not set(kinds) <= set(KINDS) or (len(kinds) < 2 and not args.compare):
        parser.error(f"--sides needs bare and at least one of {KINDS[1:]} (or --compare)")
    library = args.library.resolve() if args.library else None
    sides = [Side(kind, kind, library) for kind in KINDS if kind in kinds]
    if args.compare:
        sides.append(Side("compared", "configured", args.compare.resolve()))
    names = [side.name for side in sides]
    started = time.perf_counter()
    print(
        f"Process pairs: {pairs_wanted} fresh sets of processes ({', '.join(names)}), {rounds} rounds x "
        f"{len(CASES)} cases x {args.requests} httpx sync requests per chunk, over loopback, tracing off"
    )
    pairs: list[Pair] = []
    with LoopbackServer(["127.0.0.1", "127.0.0.2"]) as server:
        for index in range(pairs_wanted):
            pair = run_pair(server, sides, rounds, args.requests, args.warm, args.imports)
            pairs.append(pair)
            bad = [name for name, ok in pair.header_check.items() if not ok]
            print(f"  pair {index + 1}/{pairs_wanted} done" + (f"; HEADER WRONG for {bad}" if bad else ""))
    rows = summarize(pairs, names, args.requests)
    setup = summarize_setup(pairs, names)
    libraries = {row["side"]: row["library"] for row in setup if row["library"]}
    print("\n" + "; ".join(f"{name}: otel_session from {where}" for name, where in libraries.items()))
    print_results(rows, setup, len(pairs))
    beyond = summarize(pairs, ["configured", "least"], args.requests, "least") if "least" in names else []
    if beyond:
        print("\n  configured / least hook, chunk by chunk (otel-session's cost beyond delivering a header):")
        print_direct(beyond)
    direct = summarize(pairs, ["configured", "compared"], args.requests, "compared") if args.compare else []
    if direct:
        print("\n  configured / compared, chunk by chunk (below 1: the measured otel_session is cheaper):")
        print_direct(direct)
    headers_ok = all(all(pair.header_check.values()) for pair in pairs)
    floored = [row for row in rows if row["side"] == "configured" and row["case"] in ("dynamo", "outside")]
    floor = {row["case"]: row["wall_ratio"] <= FLOOR for row in floored}
    least = {row["case"]: row["wall_ratio"] for row in rows if row["side"] == "least"}
    seconds = round(time.perf_counter() - started, 1)
    print(
        f"\n  floor (configured / bare wall ratio <= {FLOOR} in and outside a trajectory): "
        + ", ".join(
            f"{row['case']} {row['wall_ratio']:.3f} {'ok' if floor[row['case']] else 'MISS'} "
            f"(95% interval {row['wall_ratio_ci95'][0]:.3f}-{row['wall_ratio_ci95'][1]:.3f})"
            for row in floored
        )
        + ("" if headers_ok else "; the session header was NOT where it should be")
    )
    if "dynamo" in least:
        print(f"  the least hook that delivers the header, to Dynamo: {least['dynamo']:.3f} of bare")
    meta = machine() | {
        "view": "process pairs: whole processes side by side, configured vs bare (what a user pays)",
        "method": (
            "fresh worker processes per pair, driven in lock-step, one chunk at a time, order alternating; "
            "figure = median over chunks of (side wall / bare wall, same turn and case)"
        ),
        "client": "httpx sync, one keep-alive connection per process, loopback",
        "server": "benchmarks/_servers.py: asyncio + uvloop in a separate process",
        "pairs": len(pairs),
        "rounds": rounds,
        "requests_per_chunk": args.requests,
        "warmup_requests_per_case": args.warm,
        "otel_session": libraries,
        "imports_side_imports": args.imports,
        "seconds": seconds,
    }
    document = {
        "meta": meta,
        "rows": rows,
        "configured_vs_least": beyond,
        "configured_vs_compared": direct,
        "setup": setup,
        "header_check_ok": headers_ok,
        "floor": {"wall_ratio": FLOOR, "met": floor},
        "pairs": [{"facts": pair.facts, "chunks": pair.chunks} for pair in pairs],
    }
    write_results(args.out, document)
    print(f"\nwrote {args.out} ({seconds} s)")
    return 0 if headers_ok else 1


if __name__ == "__main__":
    sys.exit(main())
