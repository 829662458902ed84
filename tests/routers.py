"""Real session-aware routers on loopback: vLLM's router and SGLang Model Gateway in front of backends.

The routers are the real Rust binaries from the package index (``vllm-router==0.1.17``,
``smg==1.13.0``, installed by ``scripts/test``). The backends are small recording OpenAI-style
servers (a Starlette app on uvicorn) that answer with their own name, so a test can tell which engine
served each turn, and record every header they received.

Process hygiene: each router starts in a process group of its own (``smg``'s router has been seen
outliving a killed launcher), always with its main and metrics ports on 127.0.0.1 -- both binaries
bind metrics on port 29000 by default, ``smg`` on every interface -- and is stopped by signalling that
group: SIGTERM, then SIGKILL after a grace period. The group leader is not reaped before the group is
swept, so the group id cannot have been reused by then. If the test process itself dies without
cleaning up (a ``timeout`` kill, SIGKILL), the kernel sends each router SIGTERM (Linux
``PR_SET_PDEATHSIG``); otherwise a killed pytest leaves the routers running.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.loopback import AsgiServer, Served
from tests.recorder import Seen
from tests.support import exited_unreaped

RouterKind = Literal["vllm-router", "smg"]
LOOPBACK = "127.0.0.1"
MODEL = "m"
# No proxy from the environment: everything here is on loopback.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Backend(Served):
    """A recording engine stand-in that says who it is: ``name`` in the completion and ``x-backend``."""

    name: str = "b"
    host: str = LOOPBACK
    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    _served: AsgiServer | None = None

    def completions(self) -> list[Seen]:
        """The generation requests it served (health checks and model probes left out)."""
        return [s for s in self.seen if s.method == "POST" and s.path.endswith("completions")]

    async def _handle(self, request: Request) -> Response:
        path = request.url.path
        self.seen.append(
            Seen(
                request.method,
                path,
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]],
            )
        )
        said = {"x-backend": self.name}
        if path.endswith("/chat/completions") or path.endswith("/completions"):
            body = json.loads(await request.body() or b"{}")
            chat = path.endswith("/chat/completions")
            return JSONResponse(_completion(self.name, body, chat), headers=said)
        if path == "/v1/models":
            models = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": self.name}]}
            return JSONResponse(models, headers=said)
        return JSONResponse({"ok": True, "backend": self.name, "model_path": MODEL}, headers=said)

    def start(self) -> Backend:
        app = Starlette(
            routes=[Route("/{path:path}", self._handle, methods=["GET", "POST", "PUT", "DELETE"])]
        )
        self._served = AsgiServer(app, host=self.host, port=self.port).__enter__()
        self.port = self._served.port
        return self

    def stop(self) -> None:
        if self._served is not None:
            self._served.__exit__()
            self._served = None


def _completion(name: str, body: dict[str, Any], chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    if chat:
        choice["message"] = {"role": "assistant", "content": name}
    else:
        choice["text"] = name
    return {
        "id": f"cmpl-{name}",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": body.get("model", MODEL),
        "choices": [choice],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


@contextlib.contextmanager
def backends(count: int) -> Iterator[list[Backend]]:
    """``count`` running backends named b0, b1, ...; all stopped afterwards, whatever happens."""
    started: list[Backend] = []
    try:
        for i in range(count):
            started.append(Backend(name=f"b{i}").start())
        yield started
    finally:
        for backend in started:
            backend.stop()


class RouterStartError(RuntimeError):
    """The router did not become ready; the message carries its log tail."""


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Any:
    """A ``preexec_fn``: SIGTERM when our parent dies (Linux), and exit if it already has."""

    def arm() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return arm if sys.platform.startswith("linux") else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid`` (Linux /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def listening_addresses(pids: Sequence[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the processes ``pids`` listen on, from /proc/net."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found: set[tuple[str, int]] = set()
    for pid in pids:
        for table, size in (("tcp", 4), ("tcp6", 16)):
            with contextlib.suppress(OSError):
                for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    cols = row.split()
                    if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                        addr, port = cols[1].rsplit(":", 1)
                        found.add((_proc_ip(addr, size), int(port, 16)))
    return found


def _proc_ip(hex_addr: str, size: int) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc/net prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
    family = socket.AF_INET if size == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words)


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in {"::1", "::ffff:127.0.0.1"}


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with _HTTP.open(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""


class RouterProcess(Served):
    """One real router binary in front of ``worker_urls``, in its own process group, on loopback.

    ``kind`` is ``"vllm-router"`` (policies ``consistent_hash``, ``sticky_least_loaded``, ...) or
    ``"smg"`` (``consistent_hashing``, ...). ``env`` is added to the router's environment.
    """

    def __init__(
        self,
        kind: RouterKind,
        worker_urls: Sequence[str],
        *,
        policy: str,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self.kind = kind
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.host = LOOPBACK
        self.port = 0
        self.metrics_port = 0
        self.popen: subprocess.Popen[bytes] | None = None
        self.run_dir: Path | None = None
        self.log_path: Path | None = None

    @property
    def pgid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def command(self) -> list[str]:
        exe = shutil.which(self.kind, path=os.path.dirname(sys.executable)) or shutil.which(self.kind)
        if exe is None:
            raise RouterStartError(f"{self.kind} is not installed (scripts/test installs it)")
        common = [
            "--worker-urls", *self.worker_urls,
            "--policy", self.policy,
            "--host", LOOPBACK,
            "--port", str(self.port),
            "--prometheus-host", LOOPBACK,
            "--prometheus-port", str(self.metrics_port),
            "--log-level", "info",
        ]  # fmt: skip
        if self.kind == "smg":
            # In-flight requests are the test's own; do not wait 180 s for them on stop.
            return [exe, "launch", *common, "--shutdown-grace-period-secs", "1", *self.extra_args]
        return [exe, *common, *self.extra_args]

    def log_text(self) -> str:
        if self.log_path is None:
            return ""
        try:
            return _ANSI.sub("", self.log_path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            return ""

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RouterProcess:
        """Start and wait until it routes to every worker; a port lost in the pick-bind gap is retried."""
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"otel-session-{self.kind}-"))
        try:
            for attempt in range(3):
                self.port, self.metrics_port = _free_port(), _free_port()
                self.log_path = self.run_dir / f"{self.kind}.{attempt}.log"
                self._spawn()
                if self._wait_ready():
                    return self
                lost_port = "in use" in self.log_text().lower()
                self._stop_group()
                if not lost_port:
                    break
            raise RouterStartError(f"{self.kind} did not become ready. Log tail:\n{self.log_text()[-3000:]}")
        except BaseException:
            self.stop()
            raise

    def _spawn(self) -> None:
        assert self.log_path is not None
        env = {**os.environ, "NO_COLOR": "1", **self.extra_env}
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.run_dir,
                env=env,
                close_fds=True,
                process_group=0,
                preexec_fn=_die_with_parent(os.getpid()),
            )

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        path = "/list_workers" if self.kind == "vllm-router" else "/workers"
        while time.monotonic() < deadline:
            if self.popen is None or self.popen.poll() is not None:
                return False
            with contextlib.suppress(OSError, ValueError):
                status, body = _get(self.url + path, timeout=1.0)
                if status == 200 and self._all_workers_ready(json.loads(body)):
                    return True
            time.sleep(0.05)
        return False

    def _all_workers_ready(self, listing: dict[str, Any]) -> bool:
        if self.kind == "vllm-router":
            return set(listing.get("urls", [])) == set(self.worker_urls)
        ready = {w.get("url") for w in listing.get("workers", []) if w.get("is_healthy")}
        return ready == set(self.worker_urls)

    def stop(self) -> None:
        """Stop the whole process group; idempotent. Removes the run directory."""
        try:
            self._stop_group()
        finally:
            if self.run_dir is not None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
                self.run_dir = None

    def _stop_group(self) -> None:
        popen = self.popen
        if popen is None or popen.returncode is not None:
            return
        pgid = popen.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while time.monotonic() < deadline and (not exited_unreaped(pgid) or group_members(pgid)):
            time.sleep(0.02)
        # The leader is still unreaped here, so ``pgid`` names only this router's group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        popen.wait()

    def listening(self) -> set[tuple[str, int]]:
        """Every address the router's process group listens on."""
        return listening_addresses(group_members(self.pgid))


@contextlib.contextmanager
def router(
    kind: RouterKind, fleet: Sequence[Backend], *, policy: str | None = None, **kwargs: Any
) -> Iterator[RouterProcess]:
    """A started router in front of ``fleet``, stopped afterwards on every path."""
    default = "consistent_hash" if kind == "vllm-router" else "consistent_hashing"
    process = RouterProcess(kind, [b.url for b in fleet], policy=policy or default, **kwargs)
    with process:
        yield process


class ThunderAgentProcess:
    """Dynamo's lifecycle-aware ThunderAgent router (``dynamo.thunderagent_router``, ai-dynamo 1.6.1)
    joined to a running :class:`otel_session.dynamo.LocalDynamo` stack.

    It serves its own model name (``model_name``) through the stack's frontend and schedules over the
    stack's mocker workers (``dynamo.backend.generate``); the mockers keep serving the stack's model
    directly. It runs with exactly the environment of the stack's first worker -- the file discovery
    directory, the loopback ZMQ broker and the loopback request plane -- read from that child's
    ``/proc/PID/environ``, because the stack has no public way to hand its environment out. It starts
    in a process group of its own and is stopped by signalling that group.
    """

    def __init__(self, stack: Any, model_name: str = "ta-tiny", startup_timeout: float = 60.0) -> None:
        self.stack = stack
        self.model_name = model_name
        self.startup_timeout = startup_timeout
        self.popen: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def _env(self) -> dict[str, str]:
        raw = Path(f"/proc/{self.stack.workers[0].pid}/environ").read_bytes()
        env = dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)
        home = Path(self.stack.run_dir) / "home" / "thunderagent"
        home.mkdir(parents=True, exist_ok=True)
        env.update({"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")})
        return env

    def start(self, model_dir: str) -> ThunderAgentProcess:
        self.log_path = Path(self.stack.run_dir) / "logs" / "thunderagent.log"
        args = [
            sys.executable, "-m", "dynamo.thunderagent_router",
            "--endpoint", f"{self.stack.namespace}.backend.generate",
            "--model-name", self.model_name,
            "--model-path", model_dir,
            "--router-block-size", str(self.stack.block_size),
        ]  # fmt: skip
        try:
            with open(self.log_path, "ab") as log:
                self.popen = subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.stack.run_dir,
                    env=self._env(),
                    close_fds=True,
                    process_group=0,
                    preexec_fn=_die_with_parent(os.getpid()),
                )
            self._wait_listed()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_listed(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.popen is None or self.popen.poll() is not None:
                break
            with contextlib.suppress(OSError, ValueError):
                status, body = _get(self.stack.base_url + "/models", timeout=1.0)
                if status == 200 and any(m.get("id") == self.model_name for m in json.loads(body)["data"]):
                    return
            time.sleep(0.1)
        raise RouterStartError(f"ThunderAgent did not register {self.model_name}:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        if self.log_path is None:
            return ""
        with contextlib.suppress(OSError):
            return _ANSI.sub("", self.log_path.read_text(encoding="utf-8", errors="replace"))
        return ""

    def listening(self) -> set[tuple[str, int]]:
        assert self.popen is not None
        return listening_addresses(group_members(self.popen.pid))

    def stop(self, timeout: float = 10.0) -> None:
        popen = self.popen
        if popen is None or popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (not exited_unreaped(popen.pid) or group_members(popen.pid)):
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()
