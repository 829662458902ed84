"""``otel-session``: show, against a real Dynamo, that each trajectory keeps to one worker.

With no arguments it starts a local Dynamo 1.6.1 stack (frontend and mocker workers on loopback,
session affinity on), runs a GRPO-style batch through the openai SDK inside
``otel_session.trajectory()``, and prints per trajectory its session, the worker of every turn and
the share of prompt tokens served from cache. ``--base-url`` runs the same against a deployment you
already have; ``doctor`` tells whether that deployment pins sessions and, if not, what to change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import TextIO
from urllib.parse import urlsplit

from otel_session import _config
from otel_session.rollouts import TrajectoryResult, Workload, run_batch, summarize


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per quarter in a log file."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.done, self.stream, self.enabled = total, 0, stream, enabled
        self.live = enabled and stream.isatty()
        self._lock = threading.Lock()
        self._began = time.monotonic()

    def step(self) -> None:
        with self._lock:
            self.done += 1
            quarter = self.done * 4 // max(self.total, 1) != (self.done - 1) * 4 // max(self.total, 1)
            if self.enabled and (self.live or quarter):
                filled = int(30 * self.done / max(self.total, 1))
                elapsed = time.monotonic() - self._began
                bar = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} turns  {elapsed:5.1f}s"
                self.stream.write(("\r" + bar) if self.live else bar + "\n")
                self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()


def _host_of(base_url: str) -> str:
    parts = urlsplit(base_url)
    if not parts.hostname:
        raise SystemExit(f"otel-session: --base-url {base_url!r} is not a URL like http://host:8000/v1")
    return parts.netloc


def _first_model(base_url: str) -> str:
    import httpx

    models = httpx.get(base_url.rstrip("/") + "/models", timeout=10).json().get("data") or []
    if not models:
        raise SystemExit(f"otel-session: {base_url}/models lists no model; is a worker registered?")
    return str(models[0]["id"])


def _worker_label(worker: int | None, names: dict[int, str]) -> str:
    if worker is None:
        return "?"
    return names.setdefault(worker, f"w{len(names)}")


def render_table(
    results: Sequence[TrajectoryResult], out: TextIO, names: dict[int, str] | None = None
) -> None:
    """The human table: one row per trajectory, then the summary lines."""
    names = {} if names is None else names
    out.write(
        f"{'prompt':>6} {'sib':>3}  {'session id':36}  {'turns':>5}  {'workers by turn':24} {'cached':>7}\n"
    )
    for r in results:
        workers = " ".join(_worker_label(w, names) for w in r.workers)
        later = r.turns[1:]
        prompt = sum(t.prompt_tokens for t in later)
        cached = f"{sum(t.cached_tokens for t in later) / prompt:7.1%}" if prompt else f"{'-':>7}"
        line = f"{r.prompt_index:>6} {r.sibling_index:>3}  {r.session_id:36}  {len(r.turns):>5}  {workers:24}"
        line += f" {cached}"
        out.write(line + (f"  ERROR {r.error}" if r.error else "") + "\n")
    s = summarize(results)
    out.write("\n")
    out.write(f"trajectories pinned to one worker : {s.pinned}/{s.trajectories}\n")
    seen = len({worker for r in results for worker in r.workers if worker is not None})
    out.write(
        f"prompts whose siblings spread     : {s.prompts_spread}/{s.prompts} (over {seen} workers seen)\n"
    )
    out.write(f"prefix-cache hit rate, turns 2+   : {s.hit_rate:.1%}\n")
    if s.mean_ttft_ms is not None:
        out.write(f"TTFT turns 2+ mean / p90          : {s.mean_ttft_ms:.0f} ms / {s.p90_ttft_ms:.0f} ms\n")
    if s.errors:
        out.write(f"failed trajectories               : {s.errors}\n")


def _run(args: argparse.Namespace) -> int:
    workload = Workload(prompts=args.prompts, siblings=args.siblings, turns=args.turns)
    progress = Progress(workload.trajectories * workload.turns, sys.stderr, not args.json and not args.quiet)
    stack = None
    names: dict[int, str] = {}
    if args.base_url:
        base_urls, model = [args.base_url], args.model or _first_model(args.base_url)
    else:
        from otel_session.dynamo import LocalDynamo

        if not args.json:
            print(
                f"starting a local Dynamo 1.6.1: {args.workers} mocker workers, {args.router} router, "
                "session affinity on ...",
                file=sys.stderr,
            )
        stack = LocalDynamo(
            workers=args.workers, router_mode=args.router, affinity_ttl_secs=args.affinity_ttl
        )
        stack.start()
        base_urls, model = stack.base_urls, stack.model_name
        names = {
            worker.instance_id: f"w{worker.index}"
            for worker in stack.workers
            if worker.instance_id is not None
        }
    try:
        _config.configure(dynamo_hosts=[_host_of(url) for url in base_urls])
        results = asyncio.run(
            run_batch(base_urls, model, workload, concurrency=args.concurrency, on_turn=progress.step)
        )
        progress.close()
    finally:
        _config.unconfigure()
        if stack is not None:
            stack.stop()
    summary = summarize(results)
    if args.json:
        json.dump(
            {"summary": asdict(summary), "trajectories": [r.to_dict() for r in results]}, sys.stdout, indent=2
        )
        sys.stdout.write("\n")
    else:
        render_table(results, sys.stdout, names)
    return 1 if summary.errors else 0


def _doctor(args: argparse.Namespace) -> int:
    from otel_session.doctor import diagnose

    report = diagnose(args.base_url, model=args.model, requests=args.requests)
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        report.render(sys.stdout)
    return 0 if report.ok else 1


def _install(_: argparse.Namespace) -> int:
    from otel_session.dynamo import ensure_dynamo_installed

    ensure_dynamo_installed(auto_install=True)
    print("Dynamo 1.6.1 (frontend and mocker) is installed.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otel-session",
        description="Run GRPO-style multi-turn rollouts through otel-session and show that every trajectory "
        "stays on one Dynamo worker. With no arguments a local Dynamo stack is started for the run.",
    )
    parser.add_argument("--base-url", help="an existing Dynamo frontend, e.g. http://dynamo:8000/v1")
    parser.add_argument("--model", help="model name (default: the first one the frontend lists)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts in the batch (default 3)")
    parser.add_argument("--siblings", type=int, default=3, help="trajectories per prompt (default 3)")
    parser.add_argument("--turns", type=int, default=4, help="turns per trajectory (default 4)")
    parser.add_argument("--concurrency", type=int, default=16, help="trajectories in flight (default 16)")
    parser.add_argument("--workers", type=int, default=4, help="local stack: mocker workers (default 4)")
    parser.add_argument(
        "--router", default="round-robin", help="local stack: router mode (default round-robin)"
    )
    parser.add_argument("--affinity-ttl", type=int, default=300, help="local stack: affinity TTL seconds")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_run)
    sub = parser.add_subparsers(dest="command")
    doctor = sub.add_parser(
        "doctor", help="check that a Dynamo deployment pins sessions, and say how to fix it"
    )
    doctor.add_argument("--base-url", required=True, help="the Dynamo frontend, e.g. http://dynamo:8000/v1")
    doctor.add_argument("--model", help="model name (default: the first one the frontend lists)")
    doctor.add_argument("--requests", type=int, default=6, help="requests per probe session (default 6)")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.set_defaults(func=_doctor)
    install = sub.add_parser(
        "install-dynamo", help="install Dynamo 1.6.1 for the local stack (pip, --no-deps)"
    )
    install.set_defaults(func=_install)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("\notel-session: interrupted; every process it started has been stopped.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
