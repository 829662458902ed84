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

Over 300 lines because every bound is its own code: two router protocols, a deadline that the
standard library's per-operation timeouts cannot give (name look-up and each read of a dripping
peer), a bounded pool of slots, and a waiting side for each of asyncio and trio.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import http.client
import ipaddress
import json
import math
import socket
import ssl
import sys
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from otel_session import _settings
from otel_session._faults import logger, report, warn
from otel_session._ids import PARENT_SESSION_HEADER, SESSION_HEADER
from otel_session._routers import END_DYNAMO_FINAL, END_VLLM_FINISH, profile_named

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

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
        if done is not None and not _loop_running():
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
        if done is None:
            return
        if _trio_running():
            await _wait_trio(done)
        else:
            await _wait_asyncio(done)
    except Exception as exc:
        report("ending sessions", exc)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _trio_running()
    return True


def _trio_running() -> bool:
    """Whether this thread runs trio's loop; without trio imported it cannot, and nothing is imported."""
    if "trio" not in sys.modules:
        return False
    try:
        import sniffio
    except ImportError:  # trio depends on sniffio; should it be missing, trio goes unrecognised
        return False
    try:
        return bool(sniffio.current_async_library() == "trio")
    except sniffio.AsyncLibraryNotFoundError:
        return False


async def _wait_asyncio(done: _Done) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # some other library's loop: the notices go out unawaited
    future: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop may be closed by then
            loop.call_soon_threadsafe(_resolve, future)

    done.on_done(wake)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(future), BUDGET_SECONDS)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _wait_trio(done: _Done) -> None:
    """Await the notices in trio, woken from the last notice's thread through trio's token.

    The wait is shielded and ends at the budget or at the deadline of the scopes around it, whichever
    comes first, so it never raises ``Cancelled`` into the exit: a cancelled trajectory does not wait.
    """
    import trio

    finished = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def wake() -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(finished.set)

    done.on_done(wake)
    deadline = min(trio.current_time() + BUDGET_SECONDS, trio.current_effective_deadline())
    with trio.CancelScope(deadline=deadline, shield=True):
        await finished.wait()


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


def _start(session: str, parent: str | None, visits: Iterable[Visit] | None) -> _Done | None:
    if not visits:
        return None
    owed = notices(session, parent, visits)
    if not owed:
        return None
    done = _Done(len(owed))
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


def _run(notice: Notice, deadline: float, done: _Done) -> None:
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
                exc,
            )
    finally:
        _give_slot()
        done.one_finished()


def _send(notice: Notice, deadline: float) -> None:
    _, scheme, host, port = notice.visit
    router = _Router(scheme, host, port, deadline)
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


def _dynamo_models(router: _Router) -> list[str]:
    listing = json.loads(router.request("GET", "/v1/models", None, {}, 1 << 20))
    ids = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
    return [i for i in ids if isinstance(i, str) and i][:MAX_MODELS]


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no complete answer within {NOTICE_DEADLINE_S} s")
    return left


class _Router:
    """One router's address, looked up once per notice, and requests to it within the notice's deadline."""

    def __init__(self, scheme: str, host: str, port: int | None, deadline: float) -> None:
        self.tls = scheme == "https"
        self.host = host.strip("[]")
        self.port = port if port is not None else (443 if self.tls else 80)
        self.deadline = deadline
        self._addresses: list[tuple[int, Any]] | None = None

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str], cap: int) -> bytes:
        """One request on a fresh connection; the answer's body (up to ``cap`` bytes) if it is a 2xx."""
        if self._addresses is None:
            self._addresses = _addresses(self.host, self.port, self.deadline)
        connection = _Connection(self, self._addresses)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read(cap)
        finally:
            connection.close()
        if not 200 <= response.status < 300:  # a redirect too: a notice goes nowhere but its router
            where = path.split("?")[0]  # the query holds the session ID, which a warning does not show
            raise http.client.HTTPException(f"HTTP {response.status} {response.reason} for {method} {where}")
        return payload


class _Connection(http.client.HTTPConnection):
    """``http.client`` on a socket whose every operation gets only what is left of the deadline."""

    def __init__(self, router: _Router, addresses: list[tuple[int, Any]]) -> None:
        super().__init__(router.host, router.port)
        self._router = router
        self._addresses = addresses

    def connect(self) -> None:
        router = self._router
        failure: OSError = OSError(f"no address for {router.host}")
        for family, address in self._addresses:
            sock = _DeadlineSocket(family, socket.SOCK_STREAM)
            sock.deadline = router.deadline
            try:
                sock.settimeout(_time_left(router.deadline))
                sock.connect(address)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if router.tls:
                    sock.settimeout(_time_left(router.deadline))  # the handshake, in all
                    tls = _tls_context().wrap_socket(sock, server_hostname=router.host)
                    if isinstance(tls, _DeadlineTLSSocket):
                        tls.deadline = router.deadline
                    self.sock = tls
                else:
                    self.sock = sock
                return
            except OSError as exc:
                sock.close()
                failure = exc
                if isinstance(exc, TimeoutError):
                    break
        raise failure


class _DeadlineSocket(socket.socket):
    """A socket whose reads and writes each time out at what is left until ``deadline``.

    A socket timeout bounds one operation, so a peer sending a byte at a time would reset it forever.
    """

    deadline = math.inf

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(_time_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self.settimeout(_time_left(self.deadline))  # sendall's timeout is for all of it
        super().sendall(data, flags)


class _DeadlineTLSSocket(ssl.SSLSocket):
    """The same over TLS (its ``sendall`` calls ``send`` until all is sent)."""

    deadline = math.inf

    def recv_into(self, buffer: WriteableBuffer, nbytes: int | None = None, flags: int = 0) -> int:
        self.settimeout(_time_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def send(self, data: ReadableBuffer, flags: int = 0) -> int:
        self.settimeout(_time_left(self.deadline))
        return super().send(data, flags)


_tls: ssl.SSLContext | None = None


def _tls_context() -> ssl.SSLContext:
    """The default verifying context (as ``urllib`` uses), made at the first https notice."""
    global _tls
    if _tls is None:
        context = ssl.create_default_context()
        context.sslsocket_class = _DeadlineTLSSocket
        _tls = context
    return _tls


# ----------------------------------------------------------------------------- name look-up


class _Lookup:
    """One ``getaddrinfo`` on its own thread, shared by every notice for that (host, port) meanwhile.

    The resolver has no timeout of its own; a notice waits for it only until its deadline, and notices
    to one router never start a second look-up while one is running, so slow look-ups hold no slot and
    leave at most one thread per router behind (and no more than there are slots in all).
    """

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.finished = threading.Event()
        self.result: list[tuple[int, Any]] | OSError = OSError("not looked up")

    def run(self) -> None:
        host, port = self.key
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            self.result = [(family, address) for family, _, _, _, address in found]
        except OSError as exc:
            self.result = exc
        except Exception as exc:  # e.g. UnicodeError for a name IDNA refuses
            self.result = OSError(f"cannot look up {host!r}: {exc}")
        finally:
            with _lookups_lock:
                if _lookups.get(self.key) is self:
                    del _lookups[self.key]
            self.finished.set()


_lookups: dict[tuple[str, int], _Lookup] = {}
_lookups_lock = threading.Lock()


def _addresses(host: str, port: int, deadline: float) -> list[tuple[int, Any]]:
    """Where ``host`` is, looked up within ``deadline``; an address literal needs no look-up."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        return [(family, address) for family, _, _, _, address in found]
    key = (host, port)
    with _lookups_lock:
        lookup = _lookups.get(key)
        if lookup is None:
            if len(_lookups) >= _MAX_IN_FLIGHT:  # a resolver hanging for every name: start no more
                raise TimeoutError(f"{len(_lookups)} name look-ups are still hanging; not looking up {host}")
            lookup = _lookups[key] = _Lookup(key)
            try:
                threading.Thread(target=lookup.run, name="otel-session-lookup", daemon=True).start()
            except BaseException:
                del _lookups[key]
                raise
    if not lookup.finished.wait(_time_left(deadline)):
        raise TimeoutError(f"looking up {host} took longer than {NOTICE_DEADLINE_S} s")
    if isinstance(lookup.result, OSError):
        raise lookup.result
    return lookup.result
