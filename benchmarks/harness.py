"""The one harness of the Dynamo benchmarks: stacks, loads and figures (fleet, affinity, frontends,
capacity share it).

- **Stacks**: :func:`stack` starts a real Dynamo stack (frontend replicas and ONE mocker process
  hosting every worker, each worker's KV cache sized in blocks) and, for several frontends, a real
  nginx in front (:class:`Nginx`: round-robin, consistent hashing on ``X-Dynamo-Session-ID``, or on
  ``X-Dynamo-Parent-Session-ID`` where a request has one and the session header where not).
- **Loads**: :func:`run_load` drives a :class:`otel_session.dynamo.workload.Workload` (the one shape
  of a GRPO step, short or agentic) through the openai SDK while :class:`CpuWatch` samples the cores.
- **Figures**: :func:`step_figures` (makespan, tokens/s, TTFT percentiles, per-worker crowding) and
  :func:`percentile`, :func:`span`.

Why the CPU is watched: Dynamo's mocker times prefill and decode in wall-clock time, so a run that
saturated the 2 shared cores measured the machine, not the simulated fleet. A run whose cores were
busy more than :data:`SATURATED` of the time on average is marked saturated.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from otel_session.dynamo import LocalDynamo  # noqa: E402
from otel_session.dynamo.workload import TrajectoryResult, Turn, Workload, run_batch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16
#: Mean busy fraction of all cores above which a run is marked saturated. Below it the load
#: generator, frontend and mocker each got a core when they asked (a process waiting for a core adds
#: its wait to the simulated time); at 85 % mean, bursts already run at 100 % for a good part of the
#: run (the p90 sample sits at the ceiling), so the figure is the machine's.
SATURATED = 0.85
CPU_SAMPLE_SECONDS = 0.5
CROWDING_SAMPLE_SECONDS = 0.02

# --- stacks -------------------------------------------------------------------------------------

#: nginx in front of several frontends, as docs/integrations.md shows it (``{hash}`` is empty for
#: plain round-robin).
NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
{maps}
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    client_body_buffer_size 4m;
    client_max_body_size 64m;
    upstream dynamo_frontends {{
        {hash}
{servers}
        keepalive 64;
    }}
    server {{
        listen {listen};
        location / {{
            proxy_pass http://dynamo_frontends;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""
HASH_DIRECTIVE = "hash $http_x_dynamo_session_id consistent;"
#: Hashing siblings' common parent where a request names one, so a whole sibling group reaches one
#: frontend (which binds the parent once), and the session where it does not.
PARENT_MAP = """\
    map $http_x_dynamo_parent_session_id $otel_session_key {
        "" $http_x_dynamo_session_id;
        default $http_x_dynamo_parent_session_id;
    }
"""
PARENT_HASH_DIRECTIVE = "hash $otel_session_key consistent;"
HASH_DIRECTIVES = {"hash": HASH_DIRECTIVE, "parent": PARENT_HASH_DIRECTIVE}
Balancer = Literal["rr", "hash", "parent"]


def nginx_binary() -> str | None:
    """Debian's nginx, wherever PATH or /usr/sbin has it."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Nginx:
    """nginx on 127.0.0.1 in front of ``upstreams`` (``host:port``), hashing the session header
    consistently when ``hash_session`` is true (``balancer="parent"``: the parent session where a
    request names one), else round-robin; started and stopped by PID."""

    def __init__(self, upstreams: list[str], *, hash_session: bool, balancer: Balancer | None = None) -> None:
        self.upstreams = upstreams
        self.balancer: Balancer = balancer or ("hash" if hash_session else "rr")
        self.dir: Path | None = None
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}/v1"

    def config(self) -> str:
        assert self.dir is not None
        servers = "\n".join(f"        server {u};" for u in self.upstreams)
        return NGINX_CONF.format(
            dir=self.dir,
            maps=PARENT_MAP if self.balancer == "parent" else "",
            hash=HASH_DIRECTIVES.get(self.balancer, "# round-robin"),
            servers=servers,
            listen=self.host,
        )

    def start(self, timeout: float = 10.0) -> Nginx:
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light)")
        self.dir = Path(tempfile.mkdtemp(prefix="otel-session-nginx-"))
        os.chmod(self.dir, 0o755)
        for attempt in range(3):
            self.port = _free_port()
            (self.dir / "nginx.conf").write_text(self.config())
            conf = str(self.dir / "nginx.conf")
            with open(self.dir / "stderr.log", "ab") as log:
                self.proc = subprocess.Popen(
                    [binary, "-p", str(self.dir), "-c", conf, "-e", str(self.dir / "error.log")],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its workers join a group of ours alone
                )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                    return self
                time.sleep(0.05)
            self._stop_proc()
            if attempt == 2:
                break
        tail = (self.dir / "error.log").read_text(errors="replace")[-2000:] if self.dir else ""
        self.stop()
        raise RuntimeError(f"nginx did not start:\n{tail}")

    def _stop_proc(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)  # the master stops its workers
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group start_new_session made: ours alone
            proc.wait()

    def stop(self) -> None:
        self._stop_proc()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Deployment:
    """How a fleet is run: the router, session affinity at the frontend, frontend replicas and the
    balancer in front of them. ``affinity_ttl`` ``None``: affinity off (the header is ignored)."""

    router: str = "kv"
    affinity_ttl: int | None = 300
    mode: Literal["hard", "soft"] = "hard"
    frontends: int = 1
    balancer: Balancer = "rr"  # in front of several frontends: round-robin, hashing the header or the parent
    frontend_args: tuple[str, ...] = ()
    python: str | None = None  # another Dynamo's interpreter (e.g. 1.3.0.post1's venv)


@dataclass(frozen=True)
class Served:
    """A running deployment: where the load goes and which hosts the library treats as routers."""

    base_url: str
    hosts: list[str]
    stack: LocalDynamo


@contextlib.contextmanager
def stack(
    deployment: Deployment, workers: int, blocks: int | None = None, speedup: float = 1.0
) -> Iterator[Served]:
    """A fresh stack (cold caches) for ``deployment`` over ``workers`` mocker workers in one process,
    each with ``blocks`` KV blocks of :data:`BLOCK_SIZE` tokens (``None``: the mocker's default)."""
    worker_args = ["--num-gpu-blocks-override", str(blocks)] if blocks else []
    with LocalDynamo(
        workers=workers,
        workers_per_process=workers,
        router_mode=deployment.router,
        affinity_ttl_secs=deployment.affinity_ttl,
        affinity_mode=deployment.mode,
        block_size=BLOCK_SIZE,
        speedup_ratio=speedup,
        frontends=deployment.frontends,
        frontend_args=list(deployment.frontend_args),
        worker_args=worker_args,
        python=deployment.python,
        startup_timeout=120,
    ) as dynamo:
        if deployment.frontends <= 1:
            yield Served(dynamo.base_url, dynamo.hosts, dynamo)
            return
        with Nginx(dynamo.hosts, hash_session=False, balancer=deployment.balancer) as nginx:
            yield Served(nginx.base_url, [nginx.host], dynamo)


# --- loads --------------------------------------------------------------------------------------


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat; (0, 0) where there is none."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class CpuWatch:
    """The machine's busy fraction (all cores, every process: other users of the machine count)
    over a run, sampled every :data:`CPU_SAMPLE_SECONDS`."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._load = 0.0

    def _run(self) -> None:
        last = _cpu_times()
        while not self._stop.wait(CPU_SAMPLE_SECONDS):
            now = _cpu_times()
            total = now[1] - last[1]
            if total > 0:
                self.samples.append((now[0] - last[0]) / total)
            last = now

    def __enter__(self) -> CpuWatch:
        self._load = os.getloadavg()[0]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def figures(self) -> dict[str, float | bool | None]:
        """Mean and p90 busy fraction, the headroom left (1 - mean), saturated or not, and the load
        average as the run began."""
        if not self.samples:
            return {
                "cpu_busy": None,
                "cpu_busy_p90": None,
                "headroom": None,
                "saturated": False,
                "load": self._load,
            }
        ordered = sorted(self.samples)
        mean = statistics.fmean(ordered)
        return {
            "cpu_busy": mean,
            "cpu_busy_p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "headroom": 1.0 - mean,
            "saturated": mean > SATURATED,
            "load": self._load,
        }


@dataclass
class Load:
    """What one load run gave: every attempt, the wall time, and the CPU over it."""

    results: list[TrajectoryResult]
    wall: float
    cpu: dict[str, float | bool | None] = field(default_factory=dict)

    @property
    def turns(self) -> list[Turn]:
        return [turn for result in self.results for turn in result.turns]


def run_load(
    base_urls: Sequence[str],
    model: str,
    workload: Workload,
    *,
    concurrency: int | None = None,
    max_retries: int = 0,
    timeout: float = 600.0,
) -> Load:
    """Run ``workload`` on a fresh event loop (``concurrency`` ``None``: every trajectory at once, as
    a GRPO step starts them) and watch the cores meanwhile."""
    watch = CpuWatch()
    with watch:
        began = time.perf_counter()
        results = asyncio.run(
            run_batch(
                base_urls,
                model,
                workload,
                concurrency=concurrency or workload.trajectories,
                max_retries=max_retries,
                timeout=timeout,
            )
        )
        wall = time.perf_counter() - began
    return Load(results, wall, watch.figures())


# --- figures ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0..1) of ``values``; ``None`` for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def span(values: Sequence[float], spec: str) -> str:
    """``lo-hi`` of ``values`` formatted with ``spec`` (one figure when they format the same)."""
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return format(lo, spec) if format(lo, spec) == format(hi, spec) else f"{lo:{spec}}-{hi:{spec}}"


def crowding(turns: Sequence[Turn], workers: int) -> dict[str, float]:
    """Requests in flight per worker over the step, sampled every 20 ms: the mean over samples of the
    busiest worker's count over the fleet's mean (``balance``: 1.0 is even), and the most ever in
    flight on one worker (``peak_in_flight``) against the most the fleet's mean ever was."""
    if not turns:
        return {"balance": 0.0, "peak_in_flight": 0.0, "peak_mean_in_flight": 0.0}
    t0 = min(t.start for t in turns)
    t1 = max(t.end for t in turns)
    ratios: list[float] = []
    peak = 0
    peak_mean = 0.0
    steps = max(1, math.ceil((t1 - t0) / CROWDING_SAMPLE_SECONDS))
    for i in range(steps):
        at = t0 + i * CROWDING_SAMPLE_SECONDS
        active: dict[int | None, int] = {}
        for t in turns:
            if t.start <= at < t.end:
                active[t.worker] = active.get(t.worker, 0) + 1
        total = sum(active.values())
        if total:
            ratios.append(max(active.values()) / (total / workers))
            peak = max(peak, max(active.values()))
            peak_mean = max(peak_mean, total / workers)
    return {
        "balance": statistics.fmean(ratios) if ratios else 0.0,
        "peak_in_flight": float(peak),
        "peak_mean_in_flight": peak_mean,
    }


def step_figures(turns: Sequence[Turn], workers: int) -> dict[str, Any]:
    """What a GRPO step costs: the makespan (first request sent to last response), tokens/s of the
    fleet over it, TTFT p50/p90/p99 of every turn, the busiest worker's share of the turns, and how
    crowded the busiest worker was over the step (:func:`crowding`)."""
    if not turns:
        return {
            "makespan_s": 0.0, "tokens_per_s": 0.0, "ttft_p50_ms": None, "ttft_p90_ms": None,
            "ttft_p99_ms": None, "busiest_share": 0.0, "busiest_x_fair": 0.0, **crowding(turns, workers),
        }  # fmt: skip
    makespan = max(t.end for t in turns) - min(t.start for t in turns)
    tokens = sum(t.prompt_tokens + t.completion_tokens for t in turns)
    ttfts = [t.ttft_ms for t in turns if t.ttft_ms is not None]
    per_worker: dict[int | None, int] = {}
    for t in turns:
        per_worker[t.worker] = per_worker.get(t.worker, 0) + 1
    busiest = max(per_worker.values()) / len(turns)
    return {
        "makespan_s": makespan,
        "tokens_per_s": tokens / makespan if makespan > 0 else 0.0,
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p90_ms": percentile(ttfts, 0.9),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "busiest_share": busiest,
        "busiest_x_fair": busiest * workers,  # 1.0: every worker served as many turns
        **crowding(turns, workers),
    }


def load_figures() -> dict[str, Any]:
    """The machine as a run starts: cores and load average, for the record beside every figure."""
    return {"cores": os.cpu_count(), "load_before": os.getloadavg()[0]}
