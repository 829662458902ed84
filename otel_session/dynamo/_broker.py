"""Loopback-only ZMQ XSUB/XPUB forwarder for Dynamo's event plane, run as its own process.

Without a broker, Dynamo binds its event-plane PUB sockets on 0.0.0.0 (hard-coded). Pointing every
process at this forwarder via ``DYN_ZMQ_BROKER_URL`` keeps all sockets on 127.0.0.1 while KV events still
reach the router. It is a poll loop rather than ``zmq.proxy`` because ``zmq.proxy`` never returns to
Python, so SIGTERM would not stop it cleanly.

It also acts as the stack's watchdog: if the process that started it dies without calling ``stop()``
(SIGKILL, crash), it terminates its own process group -- which holds only the stack's processes -- and
removes the run directory, so nothing is left behind.

Usage: ``python -m otel_session.dynamo._broker --ready-file PATH [--parent-pid PID] [--run-dir DIR]``.
The chosen ports are written to the ready file as JSON ``{"xsub": port, "xpub": port}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import zmq

__all__ = ["main", "run_broker"]

_POLL_MS = 100


class _Stop:
    """Set from the signal handler; checked between polls."""

    requested = False


def _request_stop(signum: int, frame: FrameType | None) -> None:
    _Stop.requested = True


def _write_ready_file(path: Path, xsub_port: int, xpub_port: int) -> None:
    """Write via rename so the reader never sees a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"xsub": xsub_port, "xpub": xpub_port, "pid": os.getpid()}), encoding="utf-8")
    os.replace(tmp, path)


def _port_of(sock: zmq.Socket[bytes]) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    text = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
    return int(text.rsplit(":", 1)[1])


def _reap_orphaned_stack(run_dir: Path | None) -> None:
    """Our starter died: stop every process in our own group, then delete the run dir."""
    pgid = os.getpgid(0)
    if pgid != os.getpid():
        return  # We are not a group leader: the group is not ours alone, so never signal it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if not _group_has_others(pgid):
            break
    else:
        _kill_group_except_self(pgid)
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)


def _group_members(pgid: int) -> list[int]:
    members: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Field 5 (pgrp) comes after the parenthesised command name, which may itself contain spaces.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _group_has_others(pgid: int) -> bool:
    return any(pid != os.getpid() for pid in _group_members(pgid))


def _kill_group_except_self(pgid: int) -> None:
    for pid in _group_members(pgid):
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run_broker(ready_file: Path, parent_pid: int | None = None, run_dir: Path | None = None) -> int:
    """Forward until SIGTERM/SIGINT, or until ``parent_pid`` is no longer our parent."""
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    ctx = zmq.Context()
    xsub = ctx.socket(zmq.XSUB)
    xpub = ctx.socket(zmq.XPUB)
    orphaned = False
    try:
        for sock in (xsub, xpub):
            sock.setsockopt(zmq.LINGER, 0)
        xsub.bind("tcp://127.0.0.1:*")
        xpub.bind("tcp://127.0.0.1:*")
        _write_ready_file(ready_file, _port_of(xsub), _port_of(xpub))
        poller = zmq.Poller()
        poller.register(xsub, zmq.POLLIN)
        poller.register(xpub, zmq.POLLIN)
        while not _Stop.requested:
            if parent_pid is not None and os.getppid() != parent_pid:
                orphaned = True
                break
            try:
                events = dict(poller.poll(_POLL_MS))
            except zmq.ZMQError:
                continue  # EINTR from a signal: loop re-checks the stop flag.
            # Drain a bounded batch per wake-up so one busy direction cannot starve the other.
            if xsub in events:
                for _ in range(1000):
                    try:
                        xpub.send_multipart(xsub.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if xpub in events:  # Subscriptions flow upstream so publishers filter at source.
                for _ in range(1000):
                    try:
                        xsub.send_multipart(xpub.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
    finally:
        xsub.close(0)
        xpub.close(0)
        ctx.term()
    if orphaned:
        _reap_orphaned_stack(run_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    return run_broker(args.ready_file, args.parent_pid, args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
