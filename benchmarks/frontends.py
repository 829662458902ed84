"""Two Dynamo frontends over one set of workers, behind a real nginx (issue 29, item 2).

Dynamo 1.3.0.post1's frontends keep their session bindings to themselves, so a balancer that sends
a session's turns to different frontends splits the session: the field puts nginx in front, hashing
``X-Dynamo-Session-ID`` consistently (srt-slurm #233). Dynamo 1.6.1 can also share state between
frontend replicas (``--router-replica-sync``). :class:`Nginx` runs Debian's nginx on loopback with
its own config, pid and log files in a temporary directory and stops it by PID; :func:`measure`
runs one GRPO-shaped batch through it and reports the pinned fraction and the hit rate.

    python benchmarks/frontends.py              # every setup, 1.6.1 and 1.3.0.post1, printed as a table
    python benchmarks/frontends.py --repeats 3

Which setups: nginx hashing the header or plain round-robin, over two frontends of either version,
each with and without sessions; 1.6.1 also with ``--router-replica-sync``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import otel_session  # noqa: E402
from otel_session.dynamo import LocalDynamo  # noqa: E402
from otel_session.dynamo.workload import Workload, run_batch, summarize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DYNAMO13 = os.environ.get("OTEL_SESSION_DYNAMO13_PYTHON", str(ROOT / ".venv-dynamo13" / "bin" / "python"))
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))

#: The recipe docs/integrations.md shows, filled in by :class:`Nginx` (``{hash}`` is empty for
#: plain round-robin).
NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
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


def nginx_binary() -> str | None:
    """Debian's nginx, wherever PATH or /usr/sbin has it."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Nginx:
    """nginx on 127.0.0.1 in front of ``upstreams`` (``host:port``), hashing the session header
    consistently when ``hash_session`` is true, else round-robin; started and stopped by PID."""

    def __init__(self, upstreams: list[str], *, hash_session: bool) -> None:
        self.upstreams = upstreams
        self.hash_session = hash_session
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
            hash=HASH_DIRECTIVE if self.hash_session else "# round-robin",
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

    @property
    def pinned_fraction(self) -> float:
        return self.pinned / self.trajectories if self.trajectories else 0.0


def measure(
    stack: LocalDynamo, *, hash_session: bool, sessions: bool, workload: Workload, concurrency: int
) -> FrontendsResult:
    """One batch through a fresh nginx over the stack's frontends."""
    with Nginx(stack.hosts, hash_session=hash_session) as nginx:
        if sessions:
            otel_session.configure(dynamo_hosts=[nginx.host])
        try:
            results = asyncio.run(
                run_batch([nginx.base_url], stack.model_name, workload, concurrency=concurrency)
            )
        finally:
            otel_session.unconfigure()
    summary = summarize(results, block_size=stack.block_size)
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
        f"{r.router} | {r.pinned}/{r.trajectories} | {hit} | {r.ceiling:.2f} | {ttft} | {r.errors} | "
        f"{load:.1f} |"
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
        "| errors | load |"
    )
    print("|" + "---|" * 11)
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
