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
out concurrently on daemon threads, and one that is slower carries on in the background, bounded by
its own socket timeouts); nothing here ever raises into the caller; each (session, router) is told
at most once per process. The notices are sent with ``urllib`` from an empty context with every
header set here, so no hook, propagator or proxy setting of the application adds to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from otel_session import _settings
from otel_session._faults import logger, report
from otel_session._ids import PARENT_SESSION_HEADER, SESSION_HEADER
from otel_session._routers import END_DYNAMO_FINAL, END_VLLM_FINISH, profile_named

#: The most a trajectory's exit is delayed by telling its routers the session ended.
BUDGET_SECONDS = 0.5
FINAL_HEADER = "X-Dynamo-Session-Final"
#: Dynamo frontends serving several models get one terminal request per model, at most this many.
MAX_MODELS = 4
# Notices in flight at once, process-wide; beyond it a notice is dropped (the binding then idles out).
_MAX_IN_FLIGHT = 64
# (session, router) pairs already told, remembered up to this many.
_ENDED_CAP = 65_536

Visit = tuple[str, str, str, int | None]  # (profile name, scheme, host, port), as the hooks record it


# Never through a proxy from the environment: the notice goes where the trajectory's requests went.
class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A notice goes to the router it names, nowhere else: a redirect is an error, never followed."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise urllib.error.HTTPError(req.full_url, code, f"not following a redirect to {newurl}", headers, fp)


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())
_in_flight = threading.BoundedSemaphore(_MAX_IN_FLIGHT)
_ended: OrderedDict[tuple[str, Visit], None] = OrderedDict()
_ended_lock = threading.Lock()
# Router -> the configuration it was last warned about: one warning per router per configure().
_warned: dict[str, object] = {}
_warned_lock = threading.Lock()


def new_visits() -> set[Visit] | None:
    """A fresh visit set for a trajectory about to start, or ``None`` while sessions are not ended."""
    settings = _settings.current
    return set() if settings is not None and settings.end_sessions else None


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


def finish(session: str, parent: str | None, visits: Iterable[Visit] | None) -> None:
    """Tell every router in ``visits``; waits up to :data:`BUDGET_SECONDS`, never raises.

    On a thread that runs an event loop (a sync ``with`` inside async code) it does not wait at all:
    blocking the loop would stall every other trajectory; the notices still go out.
    """
    try:
        done = _start(session, parent, visits)
        if done is None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            done.wait(BUDGET_SECONDS)
    except Exception as exc:
        report("ending sessions", exc)


async def finish_async(session: str, parent: str | None, visits: Iterable[Visit] | None) -> None:
    """``finish`` for ``async with`` and async decorated functions: awaits, never blocks the loop."""
    try:
        done = _start(session, parent, visits)
        if done is None:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop may be closed by then
                loop.call_soon_threadsafe(_resolve, future)

        done.on_done(wake)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(future), BUDGET_SECONDS)
    except Exception as exc:
        report("ending sessions", exc)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Done:
    """Counts finished notices; ``wait`` and ``on_done`` see the last one finish."""

    def __init__(self, count: int) -> None:
        self._left = count
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    def one_finished(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left > 0:
                return
            callbacks, self._callbacks = self._callbacks, []
        self._event.set()
        for callback in callbacks:
            callback()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)

    def on_done(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._left > 0:
                self._callbacks.append(callback)
                return
        callback()


def _start(session: str, parent: str | None, visits: Iterable[Visit] | None) -> _Done | None:
    if not visits:
        return None
    owed = notices(session, parent, visits)
    if not owed:
        return None
    done = _Done(len(owed))
    for notice in owed:
        if not _in_flight.acquire(blocking=False):
            logger.debug("otel-session: too many session ends in flight; %s left to its TTL", notice.base)
            done.one_finished()
            continue
        thread = threading.Thread(target=_run, args=(notice, done), name="otel-session-end", daemon=True)
        thread.start()
    return done


def _run(notice: Notice, done: _Done) -> None:
    try:
        contextvars.Context().run(_send, notice)  # an empty context: no trajectory, no span
    except Exception as exc:
        where = f"{notice.visit[0]} at {notice.base}"
        settings = _settings.current
        with _warned_lock:
            first = where not in _warned or _warned[where] is not settings
            _warned[where] = settings
        if first:
            logger.warning(
                "otel-session: could not tell %s that a session ended (%s: %s); its binding will "
                "idle out instead. Further failures for this router are not logged.",
                where,
                type(exc).__name__,
                exc,
            )
    finally:
        _in_flight.release()
        done.one_finished()


def _send(notice: Notice) -> None:
    if notice.ends_by == END_VLLM_FINISH:
        query = urllib.parse.urlencode({"session_id": notice.session})
        _request(f"{notice.base}/finish_session?{query}", b"", {"Content-Length": "0"})
    elif notice.ends_by == END_DYNAMO_FINAL:
        for model in _dynamo_models(notice.base):
            _request(
                f"{notice.base}/v1/chat/completions",
                final_request_body(model),
                dynamo_final_headers(notice.session, notice.parent),
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


def _dynamo_models(base: str) -> list[str]:
    with _OPENER.open(f"{base}/v1/models", timeout=BUDGET_SECONDS) as resp:
        listing = json.loads(resp.read(1 << 20))
    ids = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
    return [i for i in ids if isinstance(i, str) and i][:MAX_MODELS]


def _request(url: str, body: bytes, headers: dict[str, str]) -> None:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with _OPENER.open(request, timeout=BUDGET_SECONDS) as resp:
        resp.read(1 << 16)
