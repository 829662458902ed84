"""A real NVIDIA Dynamo frontend + mocker workers on loopback, started and stopped from Python.

Tests, demos and benchmarks need a genuine Dynamo router (session affinity, KV routing, worker ids in
responses) without GPUs, etcd or NATS. :class:`LocalDynamo` runs Dynamo's own mock engine as workers,
file-based discovery in a fresh run directory, TCP request plane and a loopback ZMQ broker for events.
Dynamo may live in another interpreter (``python=``, or ``OTEL_SESSION_DYNAMO_PYTHON``): that is how
the stack runs the Dynamo a framework pins (NeMo-RL: 1.3.0.post1) next to this package's 1.6.1.

Why one module of some 700 lines: it is one class, :class:`LocalDynamo`, whose parts share its
state and only make sense together (spawning, readiness, stopping, fault injection), and most of it
is process hygiene: every process is started by us, into one process group led by our broker (so the
group holds only our processes), stopped by PID with SIGTERM then SIGKILL, and the broker doubles as
a watchdog that cleans up if this Python process dies abruptly.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from . import _checks
from ._install import DYNAMO_VERSION, DynamoInstallError, ensure_dynamo_installed
from ._model import ensure_model_dir
from ._ports import reserve_port

__all__ = ["ENV_DYNAMO_PYTHON", "DynamoProcess", "DynamoStartError", "LocalDynamo", "dynamo_version_of"]

LOOPBACK = "127.0.0.1"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# No proxy, ever: the stack is on loopback and a proxy from the environment would only break it.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
#: The interpreter whose Dynamo runs the frontend and workers, when ``python=`` is not given.
ENV_DYNAMO_PYTHON = "OTEL_SESSION_DYNAMO_PYTHON"
#: ``--router-session-affinity-mode`` appeared in Dynamo 1.5.0 (1.3.0.post1 and 1.4.2 lack it).
_AFFINITY_MODE_SINCE = (1, 5)

Role = Literal["broker", "worker", "frontend"]
_T = TypeVar("_T")


def _checked(name: str, check: Callable[..., _T], value: object, *args: Any) -> _T:
    """``check(value, *args)``, its :class:`ValueError` put as one line naming the argument."""
    try:
        return check(value, *args)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


class DynamoStartError(RuntimeError):
    """The stack did not become ready; the message carries the failing process's log tail."""


@dataclass
class DynamoProcess:
    """One process of the stack: kept so it can be signalled by PID and its log read after failure."""

    role: Role
    index: int
    popen: subprocess.Popen[bytes]
    log_path: Path
    #: Frontends: the HTTP port.
    port: int | None = None
    #: Workers: Dynamo's instance id, the value of ``nvext.worker_id.decode_worker_id`` in responses.
    instance_id: int | None = None
    #: Workers: how many Dynamo workers this process hosts (``--num-workers``), and their instance ids.
    hosts_workers: int = 1
    instance_ids: list[int] = field(default_factory=list)
    stopped: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def name(self) -> str:
        return self.role if self.role == "broker" else f"{self.role}{self.index}"

    def running(self) -> bool:
        if self.role == "broker":  # Never reap the group leader early: see LocalDynamo._stop_broker.
            return self.popen.returncode is None and not _exited_unreaped(self.pid)
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        tail = "\n".join(_ANSI.sub("", text).rstrip().splitlines()[-lines:])
        return tail or "(empty: the process has written nothing yet; a busy machine starts slowly)"


def _version_tuple(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def dynamo_version_of(python: str) -> str:
    """The ``ai-dynamo`` version installed for ``python``; raises :class:`DynamoInstallError` if none."""
    code = (
        "import importlib.metadata as m, importlib.util as u\n"
        "ok = all(u.find_spec(x) for x in ('dynamo.frontend', 'dynamo.mocker', 'dynamo._core'))\n"
        "print(m.version('ai-dynamo') if ok else '')"
    )
    try:
        proc = subprocess.run(
            [python, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DynamoInstallError(f"cannot run the Dynamo interpreter {python}: {exc}") from exc
    version = proc.stdout.strip() if proc.returncode == 0 else ""
    if not version:
        raise DynamoInstallError(
            f"{python} has no Dynamo frontend and mocker; install one there, e.g. "
            f"`{python} -m pip install ai-dynamo==1.3.0.post1` (versions before 1.5 install from the "
            "index with their dependencies)"
        )
    return version


def _instead(name: str) -> str:
    """What to do about a Dynamo interpreter that will not do, given as ``name``."""
    if name == ENV_DYNAMO_PYTHON:
        return f"point {name} at another, or unset it to run this interpreter's Dynamo"
    return "pass another, or leave python out to run this interpreter's Dynamo"


def dynamo_version_for(python: str, name: str) -> str:
    """:func:`dynamo_version_of` for an interpreter given as ``name`` (``python`` or
    ``OTEL_SESSION_DYNAMO_PYTHON``): its :class:`DynamoInstallError` names it and says what to do."""
    try:
        return dynamo_version_of(python)
    except DynamoInstallError as exc:
        raise DynamoInstallError(f"{name}: {exc}; or {_instead(name)}") from None


def _get_json(url: str, timeout: float = 2.0) -> Any:
    with _HTTP.open(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode("utf-8"))


def _listening_ports(pid: int) -> set[int]:
    """TCP ports a process listens on (Linux /proc), to match /health instances to worker processes."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _exited_unreaped(pid: int) -> bool:
    """Has ``pid`` exited? Leaves it a zombie, so its PID (our process group id) cannot be reused yet."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _still_our_child(pid: int) -> bool:
    """True while ``pid`` is our child, running or zombie: its PID cannot have been reused."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


class LocalDynamo:
    """A local Dynamo stack (1.6.1 unless ``python`` has another): loopback ZMQ broker, ``workers``
    mocker processes, ``frontends`` HTTP frontends over the same workers. Use as a context manager::

        with LocalDynamo(workers=4, affinity_ttl_secs=300) as dyn:
            client = openai.OpenAI(base_url=dyn.base_url, api_key="unused")

    ``affinity_ttl_secs=None`` leaves session affinity off (Dynamo's default); otherwise requests with an
    ``X-Dynamo-Session-ID`` header stick to one worker until idle for that many seconds
    (``affinity_mode="soft"`` fails over after one error when a worker dies abruptly).

    Less obvious parameters: ``port`` fixes the first frontend's port (others always get free ports);
    ``frontends > 1`` starts replicas over the same workers, which share session bindings through the
    event plane; ``frontend_args``/``worker_args`` are appended to the Dynamo command lines; ``env`` is
    added to every Dynamo process (e.g. ``DYN_LOG=debug`` or OTEL exporter settings); ``model_dir``
    replaces the generated tiny model; ``auto_install=False`` raises instead of pip-installing Dynamo.
    ``python`` is the interpreter that runs Dynamo (default ``$OTEL_SESSION_DYNAMO_PYTHON``, else this
    one); only this interpreter's Dynamo is ever installed automatically. Dynamo before 1.5 has no
    affinity mode flag: there ``affinity_mode`` must stay ``"hard"`` and is not passed.
    ``workers_per_process`` puts that many workers in each mocker process (``--num-workers``): a
    fleet of hundreds fits one process, and :attr:`worker_ids` lists every worker's instance id; the
    processes in :attr:`workers` then stand for groups of workers (``instance_id`` stays ``None``
    unless a process hosts exactly one). ``startup_timeout`` counts from the first process spawned:
    installing Dynamo and building the model directory come before it.

    Arguments are checked here, with the same checks as the ``otel-session`` command: ``router_mode``
    one of :data:`~otel_session.dynamo._checks.ROUTER_MODES`, ``affinity_mode`` ``"hard"`` or
    ``"soft"``, ``port`` 1-65535 or ``None``; a mistake is a one-line :class:`ValueError` naming the
    argument. So is a ``python`` (or ``$OTEL_SESSION_DYNAMO_PYTHON``) that is no executable file, named
    as whichever gave it. A ``port`` somebody already listens on is a :class:`DynamoStartError`, and a
    ``python`` without Dynamo a :class:`DynamoInstallError` naming it, from :meth:`start` before
    anything is spawned.
    """

    def __init__(
        self,
        workers: int = 4,
        *,
        router_mode: str = "round-robin",
        affinity_ttl_secs: int | None = 300,
        affinity_mode: Literal["hard", "soft"] = "hard",
        model_name: str = "otel-session-tiny",
        block_size: int = 16,
        speedup_ratio: float = 1.0,
        port: int | None = None,
        frontends: int = 1,
        frontend_args: Sequence[str] = (),
        worker_args: Sequence[str] = (),
        namespace: str = "dynamo",
        model_dir: str | os.PathLike[str] | None = None,
        model_cache_dir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 60.0,
        stop_timeout: float = 5.0,
        auto_install: bool = True,
        python: str | None = None,
        workers_per_process: int = 1,
    ) -> None:
        self.num_workers = _checked("workers", _checks.whole_number, workers, 1)
        self.workers_per_process = _checked(
            "workers_per_process", _checks.whole_number, workers_per_process, 1
        )
        self.num_frontends = _checked("frontends", _checks.whole_number, frontends, 1)
        self.router_mode = _checked("router_mode", _checks.router_mode, router_mode)
        self.affinity_ttl_secs = _checked("affinity_ttl_secs", _checks.affinity_ttl, affinity_ttl_secs)
        self.affinity_mode = _checked("affinity_mode", _checks.affinity_mode, affinity_mode)
        self.requested_port = _checked("port", _checks.port, port)
        self.model_name = model_name
        self.block_size = block_size
        self.speedup_ratio = speedup_ratio
        self.frontend_args = list(frontend_args)
        self.worker_args = list(worker_args)
        self.namespace = namespace
        self.model_dir: Path | None = Path(model_dir) if model_dir is not None else None
        self.model_cache_dir = model_cache_dir
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.auto_install = auto_install
        #: Where ``python`` came from, the name its mistakes are reported under (``None``: this one).
        self._python_from = (
            "python" if python else ENV_DYNAMO_PYTHON if os.environ.get(ENV_DYNAMO_PYTHON) else None
        )
        self.python = sys.executable
        if self._python_from is not None:
            try:
                self.python = _checks.interpreter(python or os.environ.get(ENV_DYNAMO_PYTHON))
            except ValueError as exc:
                raise ValueError(f"{self._python_from}: {exc}; {_instead(self._python_from)}") from None
        #: The ``ai-dynamo`` version that runs the stack, known once :meth:`start` has checked it.
        self.dynamo_version: str | None = None

        self.run_dir: Path | None = None
        self.startup_seconds: float | None = None
        self.broker: DynamoProcess | None = None
        self.workers: list[DynamoProcess] = []
        self.frontends: list[DynamoProcess] = []
        self._broker_url = ""
        self._lock = threading.RLock()
        self._started = False
        self._owner_pid = os.getpid()

    # ----------------------------------------------------------------- public properties

    @property
    def running(self) -> bool:
        return self._started

    @property
    def hosts(self) -> list[str]:
        """``127.0.0.1:PORT`` per frontend: what a host allow-list should contain."""
        return [f"{LOOPBACK}:{fe.port}" for fe in self.frontends]

    @property
    def host(self) -> str:
        return self._first(self.hosts)

    @property
    def base_urls(self) -> list[str]:
        """OpenAI-compatible base URL (ending in ``/v1``) per frontend."""
        return [f"http://{h}/v1" for h in self.hosts]

    @property
    def base_url(self) -> str:
        return self._first(self.base_urls)

    @property
    def port(self) -> int:
        return int(self.host.rsplit(":", 1)[1])

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    @property
    def worker_ids(self) -> list[int]:
        """Dynamo instance ids in worker order; compare with :func:`worker_id_of` on responses."""
        return [i for w in self.workers for i in w.instance_ids]

    @property
    def pids(self) -> list[int]:
        """Every process this stack started (broker, workers, frontends)."""
        return [p.pid for p in self._processes()]

    def worker_index(self, instance_id: int) -> int:
        """Which worker (index into :attr:`workers`) has this Dynamo instance id."""
        for w in self.workers:
            if instance_id in w.instance_ids:
                return w.index
        raise KeyError(f"no worker with instance id {instance_id}")

    def _first(self, items: list[str]) -> str:
        if not items:
            raise RuntimeError("LocalDynamo is not running; use `with LocalDynamo(...)` or call start()")
        return items[0]

    def _processes(self) -> list[DynamoProcess]:
        return [*self.frontends, *self.workers, *([self.broker] if self.broker else [])]

    def __repr__(self) -> str:
        state = f"running at {', '.join(self.hosts)}" if self._started else "stopped"
        return (
            f"<LocalDynamo {state} workers={self.num_workers} router={self.router_mode} "
            f"affinity_ttl={self.affinity_ttl_secs}>"
        )

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> LocalDynamo:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> LocalDynamo:
        """Start every process and block until each frontend lists the model and sees all workers.

        Any failure -- including KeyboardInterrupt -- stops whatever was already started.
        """
        with self._lock:
            if self._started:
                return self
            self._check_port()
            self.dynamo_version = self._check_dynamo()
            model_dir = self.model_dir or ensure_model_dir(self.model_cache_dir)
            began = time.monotonic()  # install and model build above do not count against the timeout
            self.broker, self.workers, self.frontends = None, [], []
            self._started = True
            self._owner_pid = os.getpid()
            atexit.register(self.stop)
            try:
                self.run_dir = Path(tempfile.mkdtemp(prefix="otel-session-dynamo-"))
                (self.run_dir / "logs").mkdir()
                (self.run_dir / "kv").mkdir()
                self._alias_model_in_hub_cache(model_dir)
                self._start_broker()
                per = self.workers_per_process
                self.workers = [
                    self._spawn_worker(i, model_dir, min(per, self.num_workers - first))
                    for i, first in enumerate(range(0, self.num_workers, per))
                ]
                self._start_frontends(began + self.startup_timeout)
                self._wait_ready(began + self.startup_timeout)
            except BaseException:
                self.stop()
                raise
            self.startup_seconds = time.monotonic() - began
            return self

    def _check_port(self) -> None:
        """A fixed port somebody already listens on is one line, before anything is installed or spawned
        (Dynamo's own answer comes only after the stack has started, in its log)."""
        if self.requested_port is None:
            return
        problem = _checks.port_unavailable(LOOPBACK, self.requested_port)
        if problem:
            raise DynamoStartError(f"port: {problem}; pass another port, or port=None for a free one")

    def _check_dynamo(self) -> str:
        """Which Dynamo will run, installing this interpreter's on first use; checked before any spawn."""
        if os.path.abspath(self.python) == os.path.abspath(sys.executable):  # venvs share one binary
            ensure_dynamo_installed(auto_install=self.auto_install)
            try:
                import importlib.metadata

                version = importlib.metadata.version("ai-dynamo")
            except importlib.metadata.PackageNotFoundError:
                version = DYNAMO_VERSION  # a source checkout on sys.path: ours
        else:
            version = dynamo_version_for(self.python, self._python_from or "python")
        if (
            self.affinity_ttl_secs is not None
            and self.affinity_mode != "hard"
            and _version_tuple(version) < _AFFINITY_MODE_SINCE
        ):
            raise ValueError(
                f"Dynamo {version} has no --router-session-affinity-mode; use affinity_mode='hard'"
            )
        return version

    def stop(self) -> None:
        """Stop every process we started (by PID: SIGTERM, then SIGKILL) and delete the run directory.

        Idempotent and safe to call from ``atexit``.
        """
        with self._lock:
            if not self._started or os.getpid() != self._owner_pid:
                return  # A forked child inherits our atexit hook but must not stop its parent's stack.
            atexit.unregister(self.stop)
            try:
                self._terminate([*self.frontends, *self.workers])
                if self.broker is not None:
                    self._stop_broker(self.broker)
            finally:
                if self.run_dir is not None:
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                self._started = False

    def _terminate(self, procs: Iterable[DynamoProcess], sig: int = signal.SIGTERM) -> None:
        live = [p for p in procs if p.popen.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(sig)
        deadline = time.monotonic() + self.stop_timeout
        for p in live:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.popen.kill()
                p.popen.wait()
            p.stopped = True

    def _stop_broker(self, broker: DynamoProcess) -> None:
        """Stop the group leader last; while it is an unreaped zombie its PID -- our process group id --
        cannot be reused, so a final SIGKILL to the group can only reach processes of this stack."""
        if broker.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(broker.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout
            while not _exited_unreaped(broker.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if not _exited_unreaped(broker.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(broker.pid, signal.SIGKILL)
            if _GROUPS_SUPPORTED and _still_our_child(broker.pid):
                # Descendants Dynamo might have spawned share our group: sweep them.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(broker.pid, signal.SIGKILL)
        broker.popen.wait()
        broker.stopped = True

    # ----------------------------------------------------------------- spawning

    def _alias_model_in_hub_cache(self, model_dir: Path) -> None:
        """Dynamo before 1.6 has the frontend load the model by *name* from the Hugging Face cache, not
        from the worker's ``--model-path``: so the run's own offline cache holds the name, pointing at
        the local model (a snapshot directory must be named like a commit hash)."""
        assert self.run_dir is not None
        commit = hashlib.sha1(str(model_dir).encode()).hexdigest()
        repo = self.run_dir / "hub" / f"models--{self.model_name.replace('/', '--')}"
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for item in model_dir.iterdir():
            (snapshot / item.name).symlink_to(item.resolve())
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit, encoding="utf-8")

    def _response_stream_host(self) -> str:
        """Dynamo before 1.6 reads this variable as a network *interface* name ("Interface not found:
        127.0.0.1" otherwise); loopback's is ``lo`` on Linux."""
        return LOOPBACK if _version_tuple(self.dynamo_version or "") >= (1, 6) else "lo"

    def _env(self, home: Path) -> dict[str, str]:
        """Hermetic env: inherited ``DYN_*`` settings are dropped so a user's shell cannot redirect us."""
        assert self.run_dir is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
        home.mkdir(parents=True, exist_ok=True)
        env.update(
            {
                "DYN_DISCOVERY_BACKEND": "file",
                "DYN_FILE_KV": str(self.run_dir / "kv"),
                "DYN_REQUEST_PLANE": "tcp",
                "DYN_EVENT_PLANE": "zmq",
                "DYN_ZMQ_BROKER_URL": self._broker_url,
                "DYN_TCP_RPC_HOST": LOOPBACK,
                "DYN_TCP_RESPONSE_STREAM_HOST": self._response_stream_host(),
                "DYN_EVENT_PLANE_HOST": LOOPBACK,
                "DYN_SYSTEM_HOST": LOOPBACK,
                "DYN_SDK_DISABLE_ANSI_LOGGING": "1",
                "NO_COLOR": "1",
                # The frontend caches model cards under $HOME/.cache: keep that inside the run dir.
                "HOME": str(home),
                "XDG_CACHE_HOME": str(home / ".cache"),
                "HF_HUB_OFFLINE": "1",
                "HF_HUB_CACHE": str(self.run_dir / "hub"),
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    def _spawn(
        self, role: Role, index: int, args: list[str], env: dict[str, str], port: int | None = None
    ) -> DynamoProcess:
        assert self.run_dir is not None
        proc_name = role if role == "broker" else f"{role}{index}"
        log_path = self.run_dir / "logs" / f"{proc_name}.log"
        group: dict[str, Any] = {}
        if self.broker is None:
            group = _new_group_kwargs()
        elif _GROUPS_SUPPORTED:
            group = _join_group_kwargs(self.broker.pid)
        python = sys.executable if role == "broker" else self.python  # the broker is our own module
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [python, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.run_dir,
                env=env,
                close_fds=True,
                **group,
            )
        return DynamoProcess(role, index, popen, log_path, port=port)

    def _start_broker(self) -> None:
        assert self.run_dir is not None
        ready = self.run_dir / "broker.json"
        env = self._env(self.run_dir / "home" / "broker")
        # The broker is our own module: make it importable even when running from a source checkout.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        args = ["-m", "otel_session.dynamo._broker", "--ready-file", str(ready)]
        args += ["--parent-pid", str(os.getpid()), "--run-dir", str(self.run_dir)]
        self.broker = self._spawn("broker", 0, args, env)
        deadline = time.monotonic() + min(self.startup_timeout, 30.0)
        while not ready.exists():
            if not self.broker.running() or time.monotonic() > deadline:
                raise DynamoStartError(f"ZMQ broker did not start:\n{self.broker.log_tail()}")
            time.sleep(0.01)
        ports = json.loads(ready.read_text())
        self._broker_url = f"xsub=tcp://{LOOPBACK}:{ports['xsub']} , xpub=tcp://{LOOPBACK}:{ports['xpub']}"

    def _spawn_worker(self, index: int, model_dir: Path, count: int = 1) -> DynamoProcess:
        assert self.run_dir is not None
        args = [
            "-m", "dynamo.mocker",
            "--model-path", str(model_dir),
            "--model-name", self.model_name,
            "--endpoint", f"dyn://{self.namespace}.backend.generate",
            "--discovery-backend", "file",
            "--block-size", str(self.block_size),
            "--speedup-ratio", str(self.speedup_ratio),
            *(["--num-workers", str(count)] if count > 1 else []),
            *self.worker_args,
        ]  # fmt: skip
        proc = self._spawn("worker", index, args, self._env(self.run_dir / "home" / f"worker{index}"))
        proc.hosts_workers = count
        return proc

    def _frontend_cmd(self, port: int) -> list[str]:
        args = [
            "-m", "dynamo.frontend",
            "--http-host", LOOPBACK,
            "--http-port", str(port),
            "--discovery-backend", "file",
            "--namespace", self.namespace,
            "--router-mode", self.router_mode,
        ]  # fmt: skip
        if self.affinity_ttl_secs is not None:
            args += ["--router-session-affinity-ttl-secs", str(self.affinity_ttl_secs)]
            if _version_tuple(self.dynamo_version or "") >= _AFFINITY_MODE_SINCE:
                args += ["--router-session-affinity-mode", self.affinity_mode]
        return [*args, *self.frontend_args]

    def _spawn_frontend(self, index: int, port: int) -> DynamoProcess:
        assert self.run_dir is not None
        env = self._env(self.run_dir / "home" / f"frontend{index}")
        return self._spawn("frontend", index, self._frontend_cmd(port), env, port=port)

    def _start_frontends(self, deadline: float) -> None:
        """Spawn frontends on reserved ports (see ``_ports``); a port some unrelated process took between
        the reservation and the bind is retried on another."""
        for i in range(self.num_frontends):
            fixed = self.requested_port if i == 0 else None
            self.frontends.append(self._spawn_frontend(i, fixed or reserve_port(LOOPBACK)))
        for attempt in range(3):
            time.sleep(0.3)
            retried = False
            for i, fe in enumerate(self.frontends):
                if fe.running() or "in use" not in fe.log_tail(10).lower():
                    continue
                if (i == 0 and self.requested_port) or attempt == 2 or time.monotonic() > deadline:
                    continue  # _wait_ready reports it with its log.
                fe.log_path.rename(fe.log_path.with_suffix(f".attempt{attempt}.log"))
                self.frontends[i] = self._spawn_frontend(i, reserve_port(LOOPBACK))
                retried = True
            if not retried:
                return

    # ----------------------------------------------------------------- readiness

    def _generate_instances(self, frontend: DynamoProcess) -> list[dict[str, Any]]:
        health = _get_json(f"http://{LOOPBACK}:{frontend.port}/health")
        return [i for i in health.get("instances", []) if i.get("endpoint") == "generate"]

    def _frontend_ready(self, frontend: DynamoProcess) -> tuple[bool, list[dict[str, Any]]]:
        try:
            models = _get_json(f"http://{LOOPBACK}:{frontend.port}/v1/models")
            if not any(m.get("id") == self.model_name for m in models.get("data", [])):
                return False, []
            instances = self._generate_instances(frontend)
        except (OSError, ValueError, urllib.error.URLError):
            return False, []
        return len(instances) >= self.num_workers, instances

    def _wait_ready(self, deadline: float) -> None:
        while True:
            for p in self._processes():
                if not p.running():
                    code = "?" if p.role == "broker" else p.popen.returncode
                    raise DynamoStartError(
                        f"Dynamo {p.name} (pid {p.pid}) exited with code {code} during startup. "
                        f"Log tail:\n{p.log_tail()}"
                    )
            states = [self._frontend_ready(fe) for fe in self.frontends]
            if all(ok for ok, _ in states) and self._map_instances(states[0][1]):
                return
            if time.monotonic() > deadline:
                self._raise_timeout(states)
            time.sleep(0.05)

    def _map_instances(self, instances: list[dict[str, Any]]) -> bool:
        """Match each worker process to its Dynamo instance id via the TCP port it listens on."""
        by_port: dict[int, set[int]] = {}
        for inst in instances:
            addr = str(inst.get("transport", {}).get("tcp", "")).split("/", 1)[0]
            with contextlib.suppress(ValueError, KeyError, TypeError):
                by_port.setdefault(int(addr.rsplit(":", 1)[1]), set()).add(int(inst["instance_id"]))
        for w in self.workers:
            ids = {i for p in _listening_ports(w.pid) for i in by_port.get(p, ())}
            w.instance_ids = sorted(ids)
            w.instance_id = w.instance_ids[0] if len(ids) == 1 and w.hosts_workers == 1 else None
        return all(len(w.instance_ids) == w.hosts_workers for w in self.workers)

    def _raise_timeout(self, states: list[tuple[bool, list[dict[str, Any]]]]) -> None:
        laggards = [fe for fe, (ok, _) in zip(self.frontends, states, strict=True) if not ok]
        suspects = laggards or self.frontends
        registered = max((len(inst) for _, inst in states), default=0)
        if registered < self.num_workers:
            self._map_instances(max((inst for _, inst in states), key=len, default=[]))
            suspects = [*suspects, *(w for w in self.workers if len(w.instance_ids) < w.hosts_workers)]
        tails = "\n\n".join(f"--- {p.name} (pid {p.pid}) log tail:\n{p.log_tail()}" for p in suspects)
        raise DynamoStartError(
            f"Dynamo stack not ready after {self.startup_timeout:.0f}s "
            f"({registered}/{self.num_workers} workers registered).\n{tails}"
        )

    # ----------------------------------------------------------------- operations

    def stop_worker(
        self,
        index: int,
        sig: int = signal.SIGTERM,
        *,
        wait_deregistered: bool | None = None,
        timeout: float = 15.0,
    ) -> DynamoProcess:
        """Signal one worker (fault injection) and wait for it to exit.

        With SIGTERM a worker deregisters at once, so by default we also wait until no frontend lists
        it any more -- the next request is then routed to a survivor. After SIGKILL discovery needs
        10-14 s to notice, so by default we do not wait for that.
        """
        worker = self.workers[index]
        if wait_deregistered is None:
            wait_deregistered = sig != signal.SIGKILL
        with contextlib.suppress(ProcessLookupError):
            worker.popen.send_signal(sig)
        worker.popen.wait(timeout=timeout)
        worker.stopped = True
        deadline = time.monotonic() + timeout
        while wait_deregistered and time.monotonic() < deadline:
            try:
                ids = {int(i["instance_id"]) for fe in self.frontends for i in self._generate_instances(fe)}
            except (OSError, ValueError, urllib.error.URLError):
                ids = {worker.instance_id or -1}
            if worker.instance_id not in ids:
                break
            time.sleep(0.05)
        return worker

    def health(self, frontend: int = 0) -> dict[str, Any]:
        """The frontend's ``/health`` document (status, endpoints, registered instances)."""
        result: dict[str, Any] = _get_json(f"http://{self.hosts[frontend]}/health")
        return result

    def metrics(self, frontend: int = 0) -> str:
        """Prometheus text from the frontend, e.g. ``dynamo_frontend_cached_tokens_sum``."""
        with _HTTP.open(f"http://{self.hosts[frontend]}/metrics", timeout=5) as resp:
            text: str = resp.read().decode("utf-8")
        return text

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory per live process (Linux), for sizing CI machines."""
        out: dict[str, int] = {}
        for p in self._processes():
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[p.name] = int(line.split()[1]) * 1024
        return out


# Process groups: the broker leads a fresh group; everything else joins it. `process_group=` is 3.11+.
_GROUPS_SUPPORTED = hasattr(os, "setpgid")


def _new_group_kwargs() -> dict[str, Any]:
    if not _GROUPS_SUPPORTED:
        return {}
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}


def _join_group_kwargs(pgid: int) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        return {"process_group": pgid}

    def _join() -> None:
        os.setpgid(0, pgid)

    return {"preexec_fn": _join}
