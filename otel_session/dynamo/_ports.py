"""HTTP ports for local Dynamo frontends that no other stack, and no kernel-assigned socket, can take.

A frontend must be told its port before it starts, so the port is chosen here and bound later by
Dynamo. Asking the kernel for a free port (``bind(0)``) and closing it again is racy: every Dynamo
process binds its request-plane socket to kernel-assigned ports from the same ephemeral range, and a
worker of a stack starting at the same moment was seen taking a frontend's port in that gap. So ports
are picked *below* the ephemeral range, where the kernel never assigns one, and handed out under a
cross-process lock file with a short-lived record, so two stacks starting at once never get the same
port. Whatever still listens there (some unrelated server) is skipped by a bind check.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["reserve_port"]

#: A reservation protects a port until its frontend has had time to bind it.
HOLD_SECONDS = 120.0
_LOWEST = 10_000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default; other systems use 49152-65535, which this stays below


def _candidates() -> range:
    low, high = _ephemeral_range()
    if low - _LOWEST >= 1_000:
        return range(_LOWEST, low)
    return range(high + 1, 65_536)  # an unusual layout: the ports above the range are the free ones


def _registry_path() -> Path:
    return Path(tempfile.gettempdir()) / f"otel-session-dynamo-ports-{os.getuid()}.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock shared by every process of this user (``fcntl`` where there is one)."""
    try:
        import fcntl
    except ImportError:  # Windows: LocalDynamo is POSIX-only anyway; the bind check still applies
        yield
        return
    with open(path.with_suffix(".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _read(path: Path, now: float) -> dict[str, float]:
    try:
        held = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(held, dict):
        return {}
    return {
        str(port): float(until)
        for port, until in held.items()
        if isinstance(until, (int, float)) and until > now
    }


def reserve_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now and that no other caller gets for :data:`HOLD_SECONDS`."""
    path = _registry_path()
    candidates = _candidates()
    rng = random.Random()
    with _locked(path):
        now = time.time()
        held = _read(path, now)
        for _ in range(200):
            port = rng.choice(candidates)
            if str(port) in held or not _bindable(host, port):
                continue
            held[str(port)] = now + HOLD_SECONDS
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(held), encoding="utf-8")
            os.replace(tmp, path)
            return port
    raise OSError(f"no free port for a Dynamo frontend on {host} in {candidates.start}-{candidates.stop - 1}")
