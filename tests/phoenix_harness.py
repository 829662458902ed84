"""A real Arize Phoenix on loopback for the tests: started, read back through its REST API, stopped.

Phoenix runs from its own virtual environment (``.venv-phoenix``, made by ``scripts/test``; or the
Python named by ``OTEL_SESSION_PHOENIX_PYTHON``), because its dependencies would move the dev venv's
OpenTelemetry and web-stack pins. The test process talks to it only over loopback sockets: OTLP/HTTP
in, REST out. It starts through ``scripts/phoenix_loopback.py``, which keeps Phoenix's OTLP/gRPC
receiver on 127.0.0.1 (Phoenix itself would bind ``[::]``), on free ports and in a temporary working
directory (its SQLite database), in a process group of its own that ``stop()`` ends on every path.

``listening_sockets()`` reads the kernel's socket tables for a process tree, so a test can check that
nothing Phoenix opened is reachable from beyond loopback.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support import exited_unreaped

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = REPO / "scripts" / "phoenix_loopback.py"
DEFAULT_PYTHON = REPO / ".venv-phoenix" / "bin" / "python"
ENV_PYTHON = "OTEL_SESSION_PHOENIX_PYTHON"
ENV_REQUIRE = "OTEL_SESSION_REQUIRE_PHOENIX"
LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 180.0  # about 20 s on 2 idle cores; far more while the rest of the suite runs


class PhoenixUnavailable(RuntimeError):
    """Phoenix is not installed for the Python we would run it with."""


class PhoenixStartError(RuntimeError):
    """Phoenix was found but did not come up; the message carries the end of its log."""


def phoenix_required() -> bool:
    """In CI (``CI=true``, or ``OTEL_SESSION_REQUIRE_PHOENIX=1`` as ``scripts/test`` sets) a missing
    Phoenix is a failure, never a skip."""
    return os.environ.get(ENV_REQUIRE) == "1" or os.environ.get("CI", "").lower() in {"1", "true"}


def phoenix_python() -> Path:
    """The Python that has arize-phoenix installed."""
    python = Path(os.environ.get(ENV_PYTHON) or DEFAULT_PYTHON)
    if not os.access(python, os.X_OK):
        raise PhoenixUnavailable(f"no Python at {python}: run `bash scripts/test` or set {ENV_PYTHON}")
    return python


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports, never Phoenix's defaults, so parallel runs do not collide."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class ListeningSocket:
    """A socket that accepts traffic: TCP in LISTEN, or a bound UDP socket."""

    protocol: str  # tcp, tcp6, udp, udp6
    address: str
    port: int
    pid: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return ip.ipv4_mapped.is_loopback  # ::ffff:127.0.0.1 (Python 3.11 calls it not loopback)
        return ip.is_loopback


def decode_proc_address(field: str) -> tuple[str, int]:
    """``/proc/net/tcp{,6}`` writes ``ADDRESS:PORT`` in hex, the address in host (little-endian) words."""
    address_hex, port_hex = field.split(":")
    raw = bytes.fromhex(address_hex)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(packed)), int(port_hex, 16)


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it, from ``/proc/<pid>/stat`` parent links."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree.extend(children)
        frontier = children
    return tree


def listening_sockets(root: int) -> list[ListeningSocket]:
    """Every listening TCP and bound UDP socket held open by ``root``'s process tree."""
    found = []
    for pid in process_tree(root):
        inodes: set[str] = set()
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
        for table in ("tcp", "tcp6", "udp", "udp6"):
            try:
                rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                cols = row.split()
                listening = cols[3] == "0A" if table.startswith("tcp") else True  # 0A: TCP LISTEN
                if len(cols) > 9 and cols[9] in inodes and listening:
                    address, port = decode_proc_address(cols[1])
                    found.append(ListeningSocket(table, address, port, pid))
    return found


class Phoenix:
    """``with Phoenix() as phoenix:`` a running Phoenix; ``phoenix.endpoint`` takes OTLP/HTTP."""

    def __init__(self, python: Path | None = None) -> None:
        self.python = python or phoenix_python()
        self.port = 0
        self.grpc_port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._working_dir: Path | None = None
        self._http = httpx.Client(timeout=30, trust_env=False)  # loopback: no proxy

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    endpoint = url  # OTEL_EXPORTER_OTLP_ENDPOINT: the exporter appends /v1/traces

    @property
    def pid(self) -> int:
        assert self._process is not None, "Phoenix is not running"
        return self._process.pid

    def start(self) -> Phoenix:
        for tries_left in reversed(range(3)):  # a free port can be taken before Phoenix binds it
            try:
                self._start_once()
                return self
            except PhoenixStartError as exc:
                self.stop()
                taken = any(sign in str(exc).lower() for sign in ("address already in use", "failed to bind"))
                if tries_left == 0 or not taken:
                    raise
            except BaseException:  # unavailable, or interrupted while waiting: leave nothing running
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _start_once(self) -> None:
        self._working_dir = Path(tempfile.mkdtemp(prefix="otel-session-phoenix-"))
        self.port, self.grpc_port = _free_ports(2)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
        env.update(
            PHOENIX_HOST=LOOPBACK,
            PHOENIX_PORT=str(self.port),
            PHOENIX_GRPC_PORT=str(self.grpc_port),
            PHOENIX_WORKING_DIR=str(self._working_dir),
            PHOENIX_TELEMETRY_ENABLED="false",
            PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",  # offline: no fonts or scripts from elsewhere
            PHOENIX_DISABLE_AGENT_ASSISTANT="true",  # its assistant would reach out to model providers
            PHOENIX_LOOPBACK_PARENT_PID=str(os.getpid()),  # Phoenix stops if this process dies
        )
        log = (self._working_dir / "phoenix.log").open("wb")
        try:
            self._process = subprocess.Popen(
                [str(self.python), str(LAUNCHER)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, ended as a whole by stop()
            )
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            code = self._process.poll()
            if code is not None:
                if "arize-phoenix is not installed" in self.log_tail():
                    raise PhoenixUnavailable(f"arize-phoenix is not installed for {self.python}")
                raise PhoenixStartError(f"Phoenix exited with {code}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if self._http.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise PhoenixStartError(f"Phoenix not ready in {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        if self._working_dir is None:
            return ""
        with contextlib.suppress(OSError):
            text = (self._working_dir / "phoenix.log").read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """End Phoenix's process group (SIGTERM, then SIGKILL) and remove its working directory."""
        process, self._process = self._process, None
        if process is not None:
            # The group we created (pgid == its leader's pid). The leader is reaped only at the end, so
            # until then that id cannot pass to another process.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while not exited_unreaped(process.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the leader if it hung, and anything it left
            process.wait(timeout=10)
        if self._working_dir is not None:
            shutil.rmtree(self._working_dir, ignore_errors=True)
            self._working_dir = None

    def close(self) -> None:
        self.stop()
        self._http.close()

    def __enter__(self) -> Phoenix:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def listening_sockets(self) -> list[ListeningSocket]:
        return listening_sockets(self.pid)

    # Reading back through Phoenix's REST API (/v1), paginated with next_cursor.

    def _pages(self, path: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1000 if "/spans" in path else 100}
            if cursor:
                params["cursor"] = cursor
            response = self._http.get(f"{self.url}/v1/{path}", params=params)
            if response.status_code == 404:  # no such project: nothing was ever sent to it
                return []
            response.raise_for_status()
            body = response.json()
            items.extend(body["data"])
            cursor = body.get("next_cursor")
            if not cursor:
                return items

    def projects(self) -> list[str]:
        return [str(project["name"]) for project in self._pages("projects")]

    def spans(self, project: str) -> list[dict[str, Any]]:
        return self._pages(f"projects/{project}/spans")

    def sessions(self, project: str) -> list[dict[str, Any]]:
        return self._pages(f"projects/{project}/sessions")

    def traces(self, project: str) -> list[dict[str, Any]]:
        return self._pages(f"projects/{project}/traces")

    def wait_for_spans(self, project: str, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The project's spans once at least ``count`` are stored (Phoenix inserts them in batches),
        read again a second later so that any beyond ``count`` are there to be seen too."""
        deadline = time.monotonic() + timeout
        spans = self.spans(project)
        while len(spans) < count and time.monotonic() < deadline:
            time.sleep(0.25)
            spans = self.spans(project)
        time.sleep(1.0)
        return self.spans(project)
