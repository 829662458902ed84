"""Telling each router a trajectory talked to that its session is over (``configure(end_sessions=True)``).

A router that pins sessions holds a binding per session until it idles out. Releasing it when the
trajectory ends frees that capacity at once: vLLM's router (``sticky_least_loaded``) stops counting
the session against its engine, and Dynamo's lifecycle-aware ThunderAgent router releases the
program. The stock Dynamo KV router would *run* the terminal request like any other, hence opt-in.

What each router is told (the visit set is filled by the client hooks, one entry per router):

- ``dynamo``: one minimal chat completion carrying ``X-Dynamo-Session-ID`` (and its parent) with
  ``X-Dynamo-Session-Final: true``, for the model the frontend lists (``GET /v1/models``);
- ``vllm-router``: ``POST /finish_session?session_id=ID`` (its contract in 0.1.17: 200
  ``{"status": "ok", "session_id": ID}``, for known and unknown sessions alike);
- every other profile: nothing, they have no end of session.

Rules: the exit of a trajectory waits at most :data:`BUDGET_SECONDS` for all of its notices (they go
out concurrently on daemon threads; one that is slower carries on in the background). Each notice
is given :data:`NOTICE_DEADLINE_S` in all, name look-up, connecting, sending and every read together,
so a router that answers a byte at a time or a resolver that hangs gives its slot back by then.
Nothing here ever raises into the caller; each (session, router) is told at most once per process.
The notices are sent with ``http.client`` straight to the router (no proxy, no redirect followed)
from an empty context with every header set here, so no hook, propagator or proxy setting of the
application adds to them.

A plain ``with`` exiting on a thread that runs an event loop (asyncio, or trio, anyio on either) does
not wait at all; ``async with`` awaits the notices on whichever of the two runs it.

How one request is bounded in total lives in ``_bounded_http``; how an exit waits (or does not) in
plain code, asyncio and trio lives in ``_waiting``.
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from otel_session import _settings
from otel_session._bounded_http import Peer
from otel_session._faults import logger, report, warn
from otel_session._ids import PARENT_SESSION_HEADER, SESSION_HEADER
from otel_session._routers import END_DYNAMO_FINAL, END_VLLM_FINISH, profile_named
from otel_session._waiting import Countdown, loop_running, wait_async

#: The most a trajectory's exit is delayed by telling its routers the session ended.
BUDGET_SECONDS = 0.5
#: The most one notice may take in all, look-up included: then its thread gives its slot back. A few
#: budgets, so a notice that is merely slower than the exit waits for still arrives.
NOTICE_DEADLINE_S = 3 * BUDGET_SECONDS
FINAL_HEADER = "X-Dynamo-Session-Final"
#: Dynamo frontends serving several models get one terminal request per model, at most this many.
MAX_MODELS = 4
# Notices in flight at once, process-wide; beyond it a notice is dropped (the binding then idles out).
_MAX_IN_FLIGHT = 64
# (session, router) pairs already told, remembered up to this many.
_ENDED_CAP = 65_536

Visit = tuple[str, str, str, int | None]  # (profile name, scheme, host, port), as the hooks record it

_slots_lock = threading.Lock()
_slots_taken = 0
_ended: OrderedDict[tuple[str, Visit], None] = OrderedDict()
_ended_lock = threading.Lock()
# Router -> the configuration it was last warned about: one warning per router per configure().
_warned: dict[str, object] = {}
_warned_lock = threading.Lock()


def new_visits() -> set[Visit] | None:
    """A fresh visit set for a trajectory about to start, or ``None`` while sessions are not ended."""
    settings = _settings.current
    return set() if settings is not None and settings.end_sessions else None


def in_flight() -> int:
    """Notices being sent now, each holding one of the process's slots until it ends or its deadline."""
    return _slots_taken


@dataclass(frozen=True)
class Notice:
    """One router to tell: how (``ends_by``), where (``base``), and which session."""

    ends_by: str
    base: str
    visit: Visit
    session: str
    parent: str | None


def notices(session: str, parent: str | None, visits: Iterable[Visit]) -> list[Notice]:
    """The notices owed for ``visits`` that have not been sent yet (and are now marked as sent)."""
    owed = []
    for visit in sorted(set(visits), key=repr):  # a copy: hooks may still add to the original
        name, scheme, host, port = visit
        try:
            ends_by = profile_named(name).ends_by
        except (TypeError, ValueError):
            continue
        if ends_by is None or _already_ended(session, visit):
            continue
        owed.append(Notice(ends_by, _base_url(scheme, host, port), visit, session, parent))
    return owed


def _already_ended(session: str, visit: Visit) -> bool:
    key = (session, visit)
    with _ended_lock:
        if key in _ended:
            return True
        _ended[key] = None
        if len(_ended) > _ENDED_CAP:
            _ended.popitem(last=False)
    return False


def _base_url(scheme: str, host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{scheme}://{shown}" + ("" if port is None else f":{port}")


# ----------------------------------------------------------------------------- waiting, or not


def finish(session: str, parent: str | None, visits: Iterable[Visit] | None) -> None:
    """Tell every router in ``visits``; waits up to :data:`BUDGET_SECONDS`, never raises.

    On a thread that runs an event loop (a sync ``with`` inside async code, asyncio or trio) it does
    not wait at all: blocking the loop would stall every other trajectory; the notices still go out.
    """
    try:
        done = _start(session, parent, visits)
        if done is not None and not loop_running():
            done.wait(BUDGET_SECONDS)
    except Exception as exc:
        report("ending sessions", exc)


async def finish_async(session: str, parent: str | None, visits: Iterable[Visit] | None) -> None:
    """``finish`` for ``async with`` and async decorated functions: awaits, never blocks the loop.

    Under trio (anyio on trio included) it waits with trio's own primitives, under asyncio with
    asyncio's; trio is only imported once it is known to be the library running.
    """
    try:
        done = _start(session, parent, visits)
        if done is not None:
            await wait_async(done, BUDGET_SECONDS)
    except Exception as exc:
        report("ending sessions", exc)


# ----------------------------------------------------------------------------- sending


def _take_slot() -> bool:
    global _slots_taken
    with _slots_lock:
        if _slots_taken >= _MAX_IN_FLIGHT:
            return False
        _slots_taken += 1
        return True


def _give_slot() -> None:
    global _slots_taken
    with _slots_lock:
        _slots_taken -= 1


def _start(session: str, parent: str | None, visits: Iterable[Visit] | None) -> Countdown | None:
    if not visits:
        return None
    owed = notices(session, parent, visits)
    if not owed:
        return None
    done = Countdown(len(owed))
    for notice in owed:
        if not _take_slot():
            logger.debug("otel-session: too many session ends in flight; %s left to its TTL", notice.base)
            done.one_finished()
            continue
        deadline = time.monotonic() + NOTICE_DEADLINE_S
        try:
            thread = threading.Thread(
                target=_run, args=(notice, deadline, done), name="otel-session-end", daemon=True
            )
            thread.start()
        except BaseException:
            _give_slot()
            done.one_finished()
            raise
    return done


def _run(notice: Notice, deadline: float, done: Countdown) -> None:
    try:
        contextvars.Context().run(_send, notice, deadline)  # an empty context: no trajectory, no span
    except Exception as exc:
        where = f"{notice.visit[0]} at {notice.base}"
        settings = _settings.current
        with _warned_lock:
            first = where not in _warned or _warned[where] is not settings
            _warned[where] = settings
        if first:
            warn(
                "otel-session: could not tell %s that a session ended (%s: %s); its binding will "
                "idle out instead. Further failures for this router are not logged.",
                where,
                type(exc).__name__,
                f"{exc} ({NOTICE_DEADLINE_S} s after it started)" if isinstance(exc, TimeoutError) else exc,
            )
    finally:
        _give_slot()
        done.one_finished()


def _send(notice: Notice, deadline: float) -> None:
    _, scheme, host, port = notice.visit
    router = Peer(scheme, host, port, deadline)
    if notice.ends_by == END_VLLM_FINISH:
        query = urllib.parse.urlencode({"session_id": notice.session})
        router.request("POST", f"/finish_session?{query}", b"", {}, 1 << 16)
    elif notice.ends_by == END_DYNAMO_FINAL:
        for model in _dynamo_models(router):
            router.request(
                "POST",
                "/v1/chat/completions",
                final_request_body(model),
                dynamo_final_headers(notice.session, notice.parent),
                1 << 16,
            )


def dynamo_final_headers(session: str, parent: str | None) -> dict[str, str]:
    """Exactly the headers of Dynamo's terminal session request."""
    headers = {
        "Content-Type": "application/json",
        SESSION_HEADER: session,
        FINAL_HEADER: "true",
    }
    if parent is not None:
        headers[PARENT_SESSION_HEADER] = parent
    return headers


def final_request_body(model: str) -> bytes:
    """The smallest valid chat completion: a lifecycle router releases the program without running it."""
    body = {"model": model, "messages": [{"role": "user", "content": "."}], "max_tokens": 1, "stream": False}
    return json.dumps(body).encode()


def _dynamo_models(router: Peer) -> list[str]:
    listing = json.loads(router.request("GET", "/v1/models", None, {}, 1 << 20))
    ids = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
    return [i for i in ids if isinstance(i, str) and i][:MAX_MODELS]
