"""Two Dynamo frontends over one set of workers, behind a real nginx (issue 29, item 2).

Dynamo 1.3.0.post1's frontends keep their session bindings to themselves, so a balancer that sends
a session's turns to different frontends splits the session: the field puts nginx in front, hashing
``X-Dynamo-Session-ID`` consistently (srt-slurm #233). Dynamo 1.6.1 can also share state between
frontend replicas (``--router-replica-sync``). :class:`harness.Nginx` runs Debian's nginx on loopback with
its own config, pid and log files in a temporary directory and stops it by PID; :func:`measure`
runs one GRPO-shaped batch through it and reports the pinned fraction and the hit rate.

    python benchmarks/frontends.py              # every setup, 1.6.1 and 1.3.0.post1, printed as a table
    python benchmarks/frontends.py --repeats 3

Which setups: nginx hashing the header or plain round-robin, over two frontends of either version,
each with and without sessions; 1.6.1 also with ``--router-replica-sync``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import otel_session  # noqa: E402
from benchmarks import harness  # noqa: E402
from otel_session.dynamo import LocalDynamo  # noqa: E402
from otel_session.dynamo.workload import Workload, summarize  # noqa: E402

RESULTS = harness.RESULTS
DYNAMO13 = os.environ.get("OTEL_SESSION_DYNAMO13_PYTHON", str(ROOT / ".venv-dynamo13" / "bin" / "python"))


@dataclass
class FrontendsResult:
    version: str
    balancer: str  # "nginx-hash" or "nginx-rr"
    replica_sync: bool
    sessions: bool
    router: str
    trajectories: int
    pinned: int
    hit_rate: float | None
    ceiling: float
    mean_ttft_ms: float | None
    errors: int
    makespan_s: float = 0.0
    cpu_busy: float | None = None

    @property
    def pinned_fraction(self) -> float:
        return self.pinned / self.trajectories if self.trajectories else 0.0


def measure(
    stack: LocalDynamo, *, hash_session: bool, sessions: bool, workload: Workload, concurrency: int
) -> FrontendsResult:
    """One batch through a fresh nginx over the stack's frontends."""
    with harness.Nginx(stack.hosts, hash_session=hash_session) as nginx:
        if sessions:
            otel_session.configure(dynamo_hosts=[nginx.host])
        try:
            load = harness.run_load(
                [nginx.base_url],
                stack.model_name,
                workload,
                concurrency=concurrency,
                max_retries=2,
                timeout=60,
            )
        finally:
            otel_session.unconfigure()
    summary = summarize(load.results, block_size=stack.block_size)
    busy = load.cpu.get("cpu_busy")
    return FrontendsResult(
        version=stack.dynamo_version or "?",
        balancer="nginx-hash" if hash_session else "nginx-rr",
        replica_sync="--router-replica-sync" in stack.frontend_args,
        sessions=sessions,
        router=stack.router_mode,
        trajectories=summary.trajectories,
        pinned=summary.pinned,
        hit_rate=summary.hit_rate,
        ceiling=summary.ceiling,
        mean_ttft_ms=summary.mean_ttft_ms,
        errors=summary.errors,
        makespan_s=harness.step_figures(load.turns, len(stack.worker_ids) or 1)["makespan_s"],
        cpu_busy=busy if isinstance(busy, float) else None,
    )


def two_frontends(python: str | None, router: str, replica_sync: bool, workers: int = 4) -> LocalDynamo:
    return LocalDynamo(
        workers=workers,
        workers_per_process=workers,
        frontends=2,
        router_mode=router,
        affinity_ttl_secs=300,
        python=python,
        frontend_args=["--router-replica-sync"] if replica_sync else [],
        startup_timeout=120,
    )


def _row(version: str, sync: bool, r: FrontendsResult, hit: str, ttft: str, load: float) -> str:
    return (
        f"| {version} | {'on' if sync else 'off'} | {r.balancer} | {'yes' if r.sessions else 'no'} | "
        f"{r.router} | {r.pinned}/{r.trajectories} | {hit} | {r.ceiling:.2f} | {ttft} | {r.makespan_s:.1f} | "
        f"{r.errors} | {load:.1f} | {'-' if r.cpu_busy is None else format(r.cpu_busy, '.0%')} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--router", default="kv")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "fleet-frontends.json")
    args = parser.parse_args(argv)
    setups: list[tuple[str, str | None, bool]] = [("1.6.1", None, False), ("1.6.1", None, True)]
    if Path(DYNAMO13).exists():
        setups.append(("1.3.0.post1", DYNAMO13, False))
    rows: list[dict[str, Any]] = []
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    print(
        "| Dynamo | replica sync | balancer | sessions | router | pinned | hit 2+ | ceiling | TTFT ms "
        "| step s | errors | load | cpu busy |"
    )
    print("|" + "---|" * 13)
    for rep in range(args.repeats):
        for version, python, sync in setups:
            with two_frontends(python, args.router, sync, args.workers) as stack:
                for hash_session in (True, False):
                    for sessions in (True, False):
                        load = os.getloadavg()[0]
                        workload = Workload(
                            prompts=16,
                            siblings=1,
                            turns=4,
                            prompt_words=1300,
                            turn_words=100,
                            seed=100 * rep + len(rows),
                        )
                        r = measure(
                            stack,
                            hash_session=hash_session,
                            sessions=sessions,
                            workload=workload,
                            concurrency=16,
                        )
                        rows.append(
                            {**asdict(r), "pinned_fraction": r.pinned_fraction, "repeat": rep, "load": load}
                        )
                        hit = "-" if r.hit_rate is None else f"{r.hit_rate:.2f}"
                        ttft = "-" if r.mean_ttft_ms is None else f"{r.mean_ttft_ms:.0f}"
                        print(_row(version, sync, r, hit, ttft, load), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
