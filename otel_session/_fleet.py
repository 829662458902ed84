"""How many workers a Dynamo router places sessions on, read from its frontend's ``/health``.

Sibling groups are sized to the fleet (``_siblings``: ``auto``, the default, and ``fleet``), so the
fleet's size is needed without asking the user for it. A Dynamo frontend's ``/health`` lists the instances
registered behind it (the same list ``otel-session doctor`` reads); one bounded GET per router, in a
thread of its own so no request waits on it, and read again after ``REREAD`` seconds (workers come
and go). Until the first answer the size is unknown; a router that has no such list is ``UNREADABLE``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from otel_session import _faults
from otel_session._bounded_http import Peer

Origin = tuple[str, str, "int | None"]  # (scheme, host, port) as the client dials the router

UNREADABLE = 0  # the router's /health gives no instances: its fleet size cannot be known here
DEADLINE = 5.0  # seconds for one look-up of /health, connect to the last byte
CAP = 16 * 1024 * 1024  # bytes of /health read at most (Dynamo's is ~600 bytes a worker: 27,000 workers)
REREAD = 60.0  # seconds before a router's size is read again
ORIGINS_KEPT = 64

_sizes: dict[Origin, tuple[int, float]] = {}  # origin -> (workers or UNREADABLE, when read)
_reading: set[Origin] = set()
_era = [0]  # bumped by forget(): a read started before it answers a configuration that is gone
_warned: set[Origin] = set()
_lock = threading.Lock()


def workers_in(health: object) -> int:
    """Distinct instances serving ``generate`` in a ``/health`` document (0: none listed)."""
    found = health.get("instances") if isinstance(health, Mapping) else None
    if not isinstance(found, list):
        return 0
    ids = {
        str(item.get("instance_id"))
        for item in found
        if isinstance(item, Mapping)
        and item.get("endpoint") == "generate"
        and item.get("instance_id") is not None
    }
    return len(ids)


def size_at(origin: Origin, tell: bool = True) -> int | None:
    """The router's fleet size as last read (``UNREADABLE`` if it has none; ``None`` while still
    unknown), starting a read in the background where none is fresh; ``tell``: a router that lists
    no workers is said once (``fleet``; the default keys siblings two by two there, as it always did)."""
    now = time.monotonic()
    with _lock:
        known = _sizes.get(origin)
        stale = known is None or now - known[1] >= REREAD
        if stale and origin not in _reading:
            _reading.add(origin)
            start = True
        else:
            start = False
    if start:
        try:
            threading.Thread(
                target=_read, args=(origin, tell, _era[0]), name="otel-session-fleet", daemon=True
            ).start()
        except Exception as exc:  # no thread to be had (interpreter shutting down): read again later
            with _lock:
                _reading.discard(origin)
            _faults.report("starting the read of a router's fleet size", exc)
    return known[0] if known is not None else None


def size_seen(origin: Origin) -> int | None:
    """The router's fleet size as last read, never starting a read (policies that do not size by it
    never ask the router's /health)."""
    with _lock:
        known = _sizes.get(origin)
    return known[0] if known is not None else None


def read(origin: Origin, deadline: float) -> tuple[int, str]:
    """One GET of the router's ``/health``, done by ``deadline``: its workers (``UNREADABLE`` where
    it lists none or cannot be read) and, where none, why, in words fit for one line."""
    scheme, host, port = origin
    try:
        body = Peer(scheme, host, port, deadline).request(
            "GET", "/health", None, {"Accept": "application/json"}, CAP + 1
        )
        if len(body) > CAP:
            return UNREADABLE, f"its /health is over {CAP // 2**20} MiB"
        workers = workers_in(json.loads(body))
    except Exception as exc:  # no /health, not JSON, too slow: the size stays unknown
        return UNREADABLE, f"its /health cannot be read ({_faults.one_line(f'{type(exc).__name__}: {exc}')})"
    return workers, "" if workers else "its /health lists no workers (no instance serving generate)"


def _read(origin: Origin, loud: bool, era: int) -> None:
    workers, reason = read(origin, time.monotonic() + DEADLINE)
    with _lock:
        if era != _era[0]:
            return
        if len(_sizes) >= ORIGINS_KEPT and origin not in _sizes:
            _sizes.clear()
        _sizes[origin] = (workers, time.monotonic())
        _reading.discard(origin)
        tell = loud and workers == UNREADABLE and origin not in _warned
        if tell:
            _warned.add(origin)
    if tell:
        _faults.warn(
            "otel-session: sibling groups cannot be sized to the fleet of the router at %s: %s, so "
            "siblings there share a parent two by two (groups:2); set "
            "OTEL_SESSION_SIBLINGS=groups:K as `otel-session doctor` sizes it",
            _shown(origin),
            reason,
        )


def _shown(origin: Origin) -> str:
    scheme, host, port = origin
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}" + (f":{port}" if port is not None else "")


def largest() -> int | None:
    """The most workers any router has listed here (``None``: none read yet, or none listed any): the
    fleet a ``trajectory(group=...)`` is sized to as it opens, before it has sent anything."""
    with _lock:
        return max((workers for workers, _ in _sizes.values() if workers != UNREADABLE), default=None)


def _forget_in_child() -> None:
    """``os.register_at_fork`` hook: a read in flight is the parent's thread, which the child does
    not have; left marked, the child would never read that router's size again."""
    global _lock
    _reading.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # where processes fork (not on Windows)
    os.register_at_fork(after_in_child=_forget_in_child)


def forget() -> None:
    """Forget every size read (``unconfigure()``): the next configuration may name other routers."""
    with _lock:
        _sizes.clear()
        _warned.clear()
        _reading.clear()
        _era[0] += 1


def known() -> dict[str, Any]:
    """The sizes read so far, by router (for ``doctor`` and tests)."""
    with _lock:
        return {_shown(origin): workers for origin, (workers, _) in _sizes.items()}
