"""CPU instructions per loopback httpx request, per configuration, counted under valgrind.

    python benchmarks/instructions.py             # 5 configurations x 5 layouts x 2 counts: 4-10 minutes
    python benchmarks/instructions.py --client requests  # the same for requests (upstream:
                                  # opentelemetry-instrumentation-requests)
    python benchmarks/instructions.py --client pool      # submit+result of a trivial task on a one-thread
                                  # ThreadPoolExecutor (outside, trajectory: configured, threading on)
    python benchmarks/instructions.py --quick     # 2 layouts, fewer requests: a smoke check, 1-3 minutes
    python benchmarks/instructions.py --library DIR   # the otel_session in DIR instead of the installed one

The deterministic view of what otel-session costs a request: instructions, where wall time on a shared
machine scatters by several per cent from one process to the next. Each configuration runs in fresh
Python processes under ``valgrind --tool=cachegrind --cache-sim=no`` (no cache model: the "I refs",
every instruction the process executed) and sends sequential httpx sync requests on one keep-alive
``httpx.Client`` over loopback to a server in a separate process (``_servers.py``, not under
valgrind), so the server's work is not counted, and no server thread competes for the interpreter.
Each runs twice, with N1 and N2 requests; everything else (interpreter start, imports,
``configure()``, the connection, a first chunk of warm-up requests, the final check) is the same in
both and cancels: the figure is ``(I(N2) - I(N1)) / (N2 - N1)``. Before the counted runs each
configuration runs once without valgrind, so no counted run compiles and writes ``.pyc`` files.

Counts repeat to a few instructions per request, but a count also depends on details that have
nothing to do with the code measured: the hash seed, and which types exist before httpx is imported
(CPython's attribute cache is indexed by type version tags, so a collision more or less moves a
figure by up to a couple of thousand instructions). So every configuration is counted in several layouts
(layout ``i``: ``PYTHONHASHSEED=i`` and ``7 i`` throwaway classes made before anything is imported),
each configuration is compared with bare in the same layout, and the table shows the median over
layouts with the lowest and highest. A full garbage collection precedes the counted requests; the
collections the requests trigger are part of their cost (the JSON has how many of each generation).

Configurations (``CONFIGS``):
  bare        httpx only; otel-session never imported, nothing instrumented
  least       the least hook that delivers a session header: a wrapt wrapper on
              ``httpx.HTTPTransport.handle_request`` appending one fixed header to a copy of the
              request's headers (``overhead_worker.install_least_hook``, the floor the process view
              uses); no context, no configuration, no check of what the caller set
  trajectory  ``otel_session.configure(dynamo_hosts=["127.0.0.1:PORT"], tracing=False)``; requests to
              that host inside ``otel_session.trajectory()``, one trajectory per 30 requests (so a
              trajectory's start is in the figure, paid once per 30 requests; ``--per-trajectory``)
  outside     configured the same way; requests to the Dynamo host with no trajectory open
  upstream    ``opentelemetry-instrumentation-httpx``'s ``HTTPXClientInstrumentor().instrument()`` with
              no SDK (the API's no-op tracer), for scale

Every configuration sends the same requests in the same loop (a ``nullcontext`` where no trajectory
is opened). After the counted requests each sends one request the server records, and the run checks
the session header reached the server from exactly the configurations that should send it (least,
trajectory). Workers import a copy of otel_session taken when the run starts, so edits made meanwhile
change nothing. Results go to ``benchmarks/results/instructions.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "instructions.json"
CONFIGS = ("bare", "least", "trajectory", "outside", "upstream")
CLIENTS = {  # the configurations each client's loop can run
    "httpx": CONFIGS,
    "requests": ("bare", "trajectory", "outside", "upstream"),
    "pool": ("bare", "trajectory", "outside"),
}
LABELS = {
    "bare": "a bare request, no otel-session",
    "least": "the least hook: a wrapt wrapper appending one fixed header",
    "trajectory": "otel-session, in a trajectory, to a Dynamo host",
    "outside": "otel-session configured, outside any trajectory",
    "upstream": "upstream opentelemetry-instrumentation-httpx, no SDK",
}
SENDS_HEADER = {"bare": False, "least": True, "trajectory": True, "outside": False, "upstream": False}
SESSION_HEADER = "x-dynamo-session-id"
PER_TRAJECTORY = 30  # requests per trajectory() (and per chunk in every configuration)
PAYLOAD = {"model": "bench", "messages": [{"role": "user", "content": "hello"}]}
CHECK = "/__check/instructions"
SHIFT_PER_LAYOUT = 7  # throwaway classes per layout index


# --- the worker: one configuration, one request count, run under valgrind ---------------------------


def install(config: str, authority: str, url: str, client: str = "httpx") -> Any:
    """Set the process up as ``config`` says; returns the opener of a chunk's context."""
    if config == "least":
        from overhead_worker import install_least_hook  # this script's directory is sys.path[0]

        install_least_hook(url)
    elif config in ("trajectory", "outside"):
        import otel_session

        otel_session.configure(dynamo_hosts=[authority], tracing=False)
        if config == "trajectory":
            return otel_session.trajectory
    elif config == "upstream" and client == "requests":
        from opentelemetry.instrumentation.requests import RequestsInstrumentor

        RequestsInstrumentor().instrument()
    elif config == "upstream":
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

        HTTPXClientInstrumentor().instrument()
    return contextlib.nullcontext


def _task() -> int:
    """The trivial task of ``--client pool``."""
    return 1


def worker(
    config: str, url: str, n: int, warm: int, chunk: int, shift: int, kind: str = "httpx"
) -> dict[str, Any]:
    """Send ``warm`` then ``n`` requests (or pool tasks; chunks of ``chunk``, each in a context) and
    one check request (for ``pool``, sent from a pool task)."""
    shifted = [type(f"Shift{index}", (), {}) for index in range(shift)]
    for cls in shifted:
        getattr(cls, "anything", None)  # gives each its version tag now, as a type in use has
    if kind == "httpx":
        import httpx

        client: Any = httpx.Client()
    else:
        import requests

        client = requests.Session()
    pool = ThreadPoolExecutor(max_workers=1) if kind == "pool" else None
    opener = install(config, url.split("//", 1)[1], url, kind)
    target = f"{url}/v1/chat/completions"
    with client:

        def chunks(count: int) -> None:
            for start in range(0, count, chunk):
                with opener():
                    for _ in range(min(chunk, count - start)):
                        if pool is not None:
                            pool.submit(_task).result()
                        else:
                            client.post(target, json=PAYLOAD).raise_for_status()

        chunks(warm)
        gc.collect()
        before = [stats["collections"] for stats in gc.get_stats()]
        chunks(n)
        after = [stats["collections"] for stats in gc.get_stats()]
        with opener():
            check = f"{url}{CHECK}/{config}"
            if pool is not None:
                pool.submit(lambda: client.post(check, json=PAYLOAD).raise_for_status()).result()
            else:
                client.post(check, json=PAYLOAD).raise_for_status()
    if pool is not None:
        pool.shutdown()
    return {
        "config": config,
        "n": n,
        "collections": [b - a for a, b in zip(before, after, strict=True)],
        "otel_session": getattr(sys.modules.get("otel_session"), "__file__", None),
        "modules": len(sys.modules),
    }


# --- the coordinator ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    config: str
    n: int
    layout: int


@dataclass(frozen=True)
class Run:
    job: Job
    instructions: int
    seconds: float
    facts: dict[str, Any]


@dataclass(frozen=True)
class Setup:
    url: str
    warm: int
    chunk: int
    library: Path | None
    scratch: Path
    client: str = "httpx"


def worker_env(layout: int, library: Path | None) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("OTEL_", "PYTHON")) and name.lower() not in ("http_proxy", "all_proxy")
    }
    env["PYTHONHASHSEED"] = str(layout)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    if library is not None:
        env["PYTHONPATH"] = str(library)
    return env


def worker_command(job: Job, setup: Setup) -> list[str]:
    options = [
        *("--url", setup.url, "--n", str(job.n), "--warm", str(setup.warm)),
        *("--per-trajectory", str(setup.chunk), "--shift", str(SHIFT_PER_LAYOUT * job.layout)),
    ]
    options += ["--client", setup.client]
    return [sys.executable, str(Path(__file__).resolve()), "--worker", job.config, *options]


def prime(config: str, setup: Setup) -> None:
    """Run ``config`` once without valgrind, so the counted runs find every module's bytecode
    cached (a first run that compiles and writes ``.pyc`` files would not cancel)."""
    job = Job(config, 0, 0)
    done = subprocess.run(
        worker_command(job, setup),
        env=worker_env(0, setup.library),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{config} failed without valgrind (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )


def count(job: Job, setup: Setup) -> Run:
    """One worker process under cachegrind; its total instruction count ("I refs")."""
    name = f"{job.config}.{job.n}.{job.layout}"
    out, log = setup.scratch / f"cachegrind.{name}", setup.scratch / f"valgrind.{name}.log"
    command = [
        *("valgrind", "--tool=cachegrind", "--cache-sim=no"),
        *(f"--cachegrind-out-file={out}", f"--log-file={log}"),
        *worker_command(job, setup),
    ]
    started = time.perf_counter()
    done = subprocess.run(
        command,
        env=worker_env(job.layout, setup.library),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(
            f"{name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}\n"
            f"{log.read_text()[-2000:] if log.exists() else ''}"
        )
    match = re.search(r"^summary:\s+(\d+)", out.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no summary line in {out}")
    return Run(job, int(match.group(1)), seconds, json.loads(done.stdout.strip().splitlines()[-1]))


def check_headers(records: list[dict[str, Any]], configs: Sequence[str]) -> dict[str, bool]:
    """Per configuration: did its check requests carry the session header exactly when they should?"""
    seen: dict[str, list[bool]] = {config: [] for config in configs}
    for record in records:
        config = record["path"].rsplit("/", 1)[-1]
        if config in seen:
            seen[config].append(SESSION_HEADER in record)
    return {
        config: bool(marks) and all(mark == SENDS_HEADER[config] for mark in marks)
        for config, marks in seen.items()
    }


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values)),
        "min": round(min(values)),
        "max": round(max(values)),
    }


def summarize(
    runs: list[Run], configs: Sequence[str], layouts: int, n1: int, n2: int
) -> list[dict[str, Any]]:
    """One row per configuration: per request in each layout, and against bare in the same layout."""
    by = {(run.job.config, run.job.n, run.job.layout): run for run in runs}
    per = {
        (config, layout): (by[config, n2, layout].instructions - by[config, n1, layout].instructions)
        / (n2 - n1)
        for config in configs
        for layout in range(layouts)
    }
    rows = []
    for config in configs:
        mine = [per[config, layout] for layout in range(layouts)]
        row: dict[str, Any] = {
            "config": config,
            "label": LABELS[config],
            "per_request": spread(mine),
            "per_request_by_layout": [round(value) for value in mine],
        }
        if "bare" in configs and config != "bare":
            row["over_bare"] = spread(
                [per[config, layout] - per["bare", layout] for layout in range(layouts)]
            )
            bare = statistics.median(per["bare", layout] for layout in range(layouts))
            row["percent_of_bare"] = round(100 * row["over_bare"]["median"] / bare, 2)
        if "least" in configs and config in ("trajectory", "outside"):
            beyond = [per[config, layout] - per["least", layout] for layout in range(layouts)]
            row["over_least_hook"] = spread(beyond)
        row["runs"] = [
            {
                "n": n,
                "layout": layout,
                "instructions": by[config, n, layout].instructions,
                "gc_collections": by[config, n, layout].facts["collections"],
                "seconds": round(by[config, n, layout].seconds, 1),
            }
            for layout in range(layouts)
            for n in (n1, n2)
        ]
        rows.append(row)
    return rows


def kilo(figure: dict[str, float]) -> str:
    return f"{figure['median'] / 1e3:+.1f} k"


def kilo_range(figure: dict[str, float]) -> str:
    return f"{figure['min'] / 1e3:+.1f}..{figure['max'] / 1e3:+.1f}"


def print_table(rows: list[dict[str, Any]], layouts: int, n1: int, n2: int, client: str = "httpx") -> None:
    what = "pool task (submit+result)" if client == "pool" else f"loopback {client} request"
    print(
        f"\n  Instructions per {what}, (I(N={n2}) - I(N={n1})) / {n2 - n1}, "
        f"median over {layouts} layouts [lowest..highest]:"
    )
    print(
        f"  {'config':11} {'per request':>12} {'over bare':>10} {'[range]':>14} {'% of bare':>9} "
        f"{'beyond least':>12} {'[range]':>14}  what"
    )
    for row in rows:
        over = kilo(row["over_bare"]) if "over_bare" in row else ""
        over_range = f"[{kilo_range(row['over_bare'])}]" if "over_bare" in row else ""
        percent = f"{row['percent_of_bare']:.2f} %" if "percent_of_bare" in row else ""
        beyond = kilo(row["over_least_hook"]) if "over_least_hook" in row else ""
        beyond_range = f"[{kilo_range(row['over_least_hook'])}]" if "over_least_hook" in row else ""
        print(
            f"  {row['config']:11} {row['per_request']['median'] / 1e6:10.3f} M {over:>10} {over_range:>14} "
            f"{percent:>9} {beyond:>12} {beyond_range:>14}  {row['label']}"
        )
    first = {row["config"]: row["runs"][:2] for row in rows}
    print(
        "  GC collections during the counted requests, layout 0 (gen0/gen1/gen2, N1 | N2): "
        + "; ".join(
            f"{config} {'/'.join(map(str, pair[0]['gc_collections']))} | "
            f"{'/'.join(map(str, pair[1]['gc_collections']))}"
            for config, pair in first.items()
        )
    )


def library_commit(library: Path | None) -> str | None:
    """The commit of the measured otel_session's repository, ``+dirty`` if its package has changes."""
    where = str(library or ROOT)
    try:
        head = subprocess.run(
            ["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", where, "status", "--porcelain", "--", "otel_session"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if changed else "")


def snapshot(library: Path | None, into: Path) -> Path:
    """A copy of the otel_session to measure (``library``'s, or the installed one), which every
    worker imports: a source file edited while the run goes on (others work in the same tree) would
    otherwise be recompiled by one of a configuration's runs and not the other, or measured half old."""
    if library is not None:
        package = library / "otel_session"
    else:
        spec = importlib.util.find_spec("otel_session")
        if spec is None or spec.origin is None:
            raise SystemExit("otel_session is not installed; pass --library DIR")
        package = Path(spec.origin).parent
    shutil.copytree(package, into / "otel_session", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def valgrind_version() -> str:
    try:
        done = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"valgrind is needed to count instructions: {exc}") from exc
    return done.stdout.strip()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layouts, N1=60, N2=300: a smoke check")
    parser.add_argument("--n1", type=int, help="the smaller request count (default 150)")
    parser.add_argument("--n2", type=int, help="the larger request count (default 750)")
    parser.add_argument(
        "--layouts", type=int, help="hash seeds and type-cache shifts to count in (default 5)"
    )
    parser.add_argument("--warm", type=int, default=PER_TRAJECTORY, help="warm-up requests, not counted")
    parser.add_argument(
        "--per-trajectory",
        type=int,
        default=PER_TRAJECTORY,
        help=f"requests per trajectory() (default {PER_TRAJECTORY}; 100000: one long trajectory per run)",
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {','.join(CONFIGS)} run")
    parser.add_argument("--client", choices=sorted(CLIENTS), default="httpx", help="what each request is")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind processes at once (default 2)")
    parser.add_argument("--library", type=Path, help="directory holding the otel_session to measure")
    parser.add_argument("--out", type=Path, help=f"default {RESULTS} (instructions-CLIENT.json but httpx)")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--shift", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        facts = worker(args.worker, args.url, args.n, args.warm, args.per_trajectory, args.shift, args.client)
        print(json.dumps(facts), flush=True)
        return 0

    n1 = args.n1 or (60 if args.quick else 150)
    n2 = args.n2 or (300 if args.quick else 750)
    layouts = args.layouts or (2 if args.quick else 5)
    configs = [config for config in CLIENTS[args.client] if config in args.configs.split(",")]
    out = args.out or (
        RESULTS if args.client == "httpx" else RESULTS.with_name(f"instructions-{args.client}.json")
    )
    if not configs or n2 <= n1 or layouts < 1:
        parser.error("need at least one known configuration, N2 > N1 and at least one layout")
    version = valgrind_version()
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # run as a script: `benchmarks.*` importable; PYTHONPATH still first
    from benchmarks._servers import LoopbackServer
    from benchmarks.overhead_report import machine, write_results

    library = args.library.resolve() if args.library else None
    print(
        f"Instructions: {len(configs)} configurations x {layouts} layouts x N={n1} and N={n2} {args.client} "
        f"requests over loopback, each a fresh process under {version} (cachegrind, no cache model), "
        f"{args.jobs} at a time",
        flush=True,
    )
    started = time.perf_counter()
    with LoopbackServer() as server, tempfile.TemporaryDirectory(prefix="instructions-") as scratch:
        commit = library_commit(library)
        copy = snapshot(library, Path(scratch) / "library")
        setup = Setup(server.urls[0], args.warm, args.per_trajectory, copy, Path(scratch), args.client)
        for config in configs:
            prime(config, setup)
        jobs = [Job(config, n, layout) for layout in range(layouts) for config in configs for n in (n1, n2)]
        runs = []
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for run in pool.map(lambda job: count(job, setup), jobs):
                print(
                    f"  layout {run.job.layout} {run.job.config:11} N={run.job.n:<5} "
                    f"{run.instructions:>15,} instructions ({run.seconds:.0f} s)",
                    flush=True,
                )
                loaded = run.facts["otel_session"]
                if loaded is not None and not Path(loaded).is_relative_to(copy):
                    raise RuntimeError(f"{run.job} imported {loaded}, not the copy in {copy}")
                runs.append(run)
        records = server.records()
    elapsed = time.perf_counter() - started
    checks = check_headers(records, configs)
    sent = {
        config: sorted(
            {name for record in records if record["path"].endswith(f"/{config}") for name in record}
            - {"path"}
        )
        for config in configs
    }
    rows = summarize(runs, configs, layouts, n1, n2)
    print_table(rows, layouts, n1, n2, args.client)
    failed = [config for config, ok in checks.items() if not ok]
    print(
        "  session header check: "
        + ("every configuration sent it exactly where expected" if not failed else f"WRONG for {failed}")
    )
    print(f"  {elapsed:.0f} s in all")
    meta = machine()
    meta.update(
        {
            "view": f"CPU instructions per {args.client} request (pool: task), under valgrind",
            "client": args.client,
            "date": time.strftime("%Y-%m-%d"),
            "valgrind": version,
            "tool": "cachegrind --cache-sim=no (I refs)",
            "n1": n1,
            "n2": n2,
            "layouts": layouts,
            "layout": f"PYTHONHASHSEED=i, {SHIFT_PER_LAYOUT} * i throwaway classes before importing httpx",
            "warm": args.warm,
            "per_trajectory": args.per_trajectory,
            "library": str(library) if library else "installed",
            "commit": commit,
            "seconds": round(elapsed, 1),
        }
    )
    document = {"meta": meta, "rows": rows, "header_check": checks, "headers_sent_to_dynamo": sent}
    write_results(out, document)
    print(f"  wrote {out}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
