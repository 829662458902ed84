"""aiohttp's client: the session on every hop, for that hop only.

``ClientRequest.send`` is where a request's destination is final: it runs once per hop (redirects
build a new ``ClientRequest``; a client middleware that sends the same one again, maybe elsewhere,
passes through again). That send gets a copy of the caller's headers with ours; the caller's are
never edited, so every re-send starts from them. An https proxy's ``CONNECT`` goes through ``send`` too,
with the final URL: the proxy is not the destination, so it gets nothing of ours.

aiohttp's upstream instrumentation injects through the global propagator before any of this, when
no destination is known, so ours adds nothing there. Where stock propagators are composed with ours
they do add, to every host: this hook then takes back what is recognisably ours (our trace's
``traceparent``, our ``session.id`` however encoded) where it must not go. (Over 300 lines: the
send's plan, its copy of the headers, the first step's wait (``_gathering``, in ``_request``
before a connection is taken) and the answer's status are one hop.)
"""

from __future__ import annotations

import json
import socket
import weakref
from types import ModuleType
from typing import Any

from opentelemetry import context as otel_context

from otel_session import _carriers, _evidence, _faults, _gathering, _hop, _metrics, _propagator
from otel_session._context import HOP_KEY
from otel_session.instrumentation._base import ProbedTypes, SessionInstrumentor, Wrapper

# Sends of ours under way: id(the headers we put on a request for one send) -> (those headers, the
# caller's own they were copied from). Another send of the same request started meanwhile (a hedging
# middleware's) copies the caller's, never a copy holding that send's session.
_in_flight: dict[int, tuple[Any, Any]] = {}
_NOTHING: dict[str, str] = {}
# Responses of routers to hops of ours, not started yet: their status is read as they start.
_watched: weakref.WeakSet[Any] = weakref.WeakSet()


def _folds_case(kind: type) -> bool:
    """Whether ``kind``'s keys view compares names ignoring case (multidict 6.1 and later; older
    ones compare names as spelled), and ``add``/``popall`` work as expected."""
    try:
        probe = kind([("X-Probe", "1"), ("Other", "2")])
        keys = probe.keys()
        folds = not keys.isdisjoint(("x-probe", "absent")) and keys.isdisjoint(("x-absent",))
        probe.add("New", "3")
        probe.add("new", "4")
        probe.popall("NEW", None)
        return bool(folds and list(probe.items()) == [("X-Probe", "1"), ("Other", "2")])
    except Exception:
        return False


# ``CIMultiDict`` classes found to compare names ignoring case in their keys view, and to add and pop
# as multidict 6.1 does: asked "any of these names?" in one C call, edited with add/popall.
_FOLDING = ProbedTypes(lambda kind: kind.__qualname__ == "CIMultiDict" and _folds_case(kind))


def _held(headers: Any, plan: _hop.Plan) -> dict[str, str]:
    """What ``headers`` hold of the names ``plan`` reads (``_NOTHING``, the usual case, in one C call)."""
    if type(headers) in _FOLDING and headers.keys().isdisjoint(plan.names):
        return _NOTHING
    return _carriers.read(headers, plan.names)


def _over_unix_socket(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the connection ``send`` was handed is a Unix socket (``UnixConnector``): the bytes go
    to a local process, not to the URL's host, and not over TLS whatever the URL says."""
    conn = args[0] if args else kwargs.get("conn")
    transport = getattr(conn, "transport", None)
    if transport is None:
        return False
    sock = transport.get_extra_info("socket")
    family = getattr(sock, "family", None)
    return family is not None and family == getattr(socket, "AF_UNIX", object())


def _send(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``ClientRequest.send``: the hop planned as it is called; sent as it is (no coroutine of ours)
    where there is nothing to add, take back or watch, as for the usual request outside a
    trajectory or to a host that gets nothing; else through ``_hop_send``. The original is called at
    once either way, so a call it refuses fails here, as it would unpatched."""
    planned = _planned(instance, args, kwargs) if _INSTRUMENTOR.active else None
    if planned is None:
        return wrapped(*args, **kwargs)
    return _hop_send(wrapped(*args, **kwargs), instance, *planned)


def _request(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``ClientSession._request``: an attempt's first request in a process's first step waits here
    for its step to gather (``_gathering``), before aiohttp takes a pooled connection (which its peer
    may close meanwhile, or other attempts queue for) or starts the request's timeout; any other call
    goes on as it is, the original called at once either way."""
    waiting = _to_gather(instance, args, kwargs) if _INSTRUMENTOR.active else None
    if waiting is None:
        return wrapped(*args, **kwargs)
    return _gathered(wrapped(*args, **kwargs), waiting)


def _to_gather(
    session: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[_hop.Offered, _gathering.Body, _hop.Destination] | None:
    """(what the context offers, the prompt's body, the destination) for a request that is to wait
    for its step; ``None`` for every other (a fault here is the request's own planning's to report)."""
    try:
        offered = _hop.current()
        if offered is None or not _gathering.may_wait(offered):
            return None
        url = args[1] if len(args) > 1 else kwargs.get("str_or_url")
        url = session._build_url(url)  # the session's base_url joined, as aiohttp itself does
        destination = (url.scheme, url.raw_host, url.port)
        if not _gathering.gathers(offered, destination):
            return None
        body = kwargs.get("data")
        if kwargs.get("json") is not None:
            body = json.dumps(kwargs["json"])  # the prompt is read from it, not the bytes: any dumps does
        return offered, body if isinstance(body, (bytes, bytearray, str)) else None, destination
    except Exception:
        return None


async def _gathered(sending: Any, waiting: tuple[_hop.Offered, _gathering.Body, _hop.Destination]) -> Any:
    """Wait for the step to gather, then await ``sending`` (the original's coroutine, not started)."""
    try:
        await _gathering.gather(*waiting)
    except BaseException:
        sending.close()  # cancelled while it waited: never started, so no "never awaited" for it
        raise
    return await sending


_Planned = tuple[Any, bool, "_hop.Plan | None", dict[str, str], bool]


def _body_of(instance: Any) -> bytes | bytearray | None:
    """The request's body where it is held in memory (``json=``, ``data=`` bytes or text); a stream,
    a file or a form is never read."""
    body = instance.body
    if isinstance(body, (bytes, bytearray)):
        return body
    value = getattr(body, "_value", None) if isinstance(body, _BYTES_PAYLOADS) else None
    return value if isinstance(value, (bytes, bytearray)) else None


def _decided(offered: _hop.Offered, instance: Any, destination: _hop.Destination) -> _hop.Offered:
    """What the context offers once this request, an attempt's first to a router, decided the
    attempt's group from the prompt in its body (one not held in memory names no group)."""
    return offered.decide(_body_of(instance), destination)


def _planned(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Planned | None:
    """(the caller's headers, whether ``instance`` holds another send's copy of them, the plan, what
    the caller's hold of its names, whether the hop is watched) for one send; ``None``: nothing to do."""
    try:
        if instance.method == "CONNECT":
            return None
        callers, swap = instance.headers, False
        if _in_flight:
            entry = _in_flight.get(id(callers))
            if entry is not None and entry[0] is callers:
                callers, swap = entry[1], True  # another send's copy: start from the caller's
        plan, held, watched = None, _NOTHING, False
        offered = _hop.current()
        if offered is None and _hop.untold:  # until a request to a router outside any trajectory
            _hop.outside(instance.url.scheme, instance.url.raw_host, instance.url.port)
        if offered is None and _metrics.recording():
            _metrics.outside(instance.url.scheme, instance.url.raw_host, instance.url.port)
        if offered is not None:
            url = instance.url
            if _over_unix_socket(args, kwargs):
                plan = offered.plan("unix", None, None)
            else:
                destination = (url.scheme, url.raw_host, url.port)
                plan = offered.plan(*destination)
                if offered.undecided is not None and plan.route.profile is not None:
                    plan = _decided(offered, instance, destination).plan(*destination)
            # aiohttp's own instrumentation injects before this, with no destination: under a stock
            # propagator composed with ours, what it copied is taken back here, where the hop is known.
            sole = _propagator.is_sole_global()
            held = _held(callers, plan)
            if held:
                plan = plan.given(held, sole)
            watched = plan.watched or not sole
    except Exception as exc:  # a bug of ours (or a request we do not understand) must not fail it
        _faults.report("adding session headers to a request", exc)
        return None
    if swap or watched or (plan is not None and plan.edits):
        return callers, swap, plan, held, watched
    return None


async def _hop_send(
    sending: Any,
    instance: Any,
    callers: Any,
    swap: bool,
    plan: _hop.Plan | None,
    held: dict[str, str],
    watched: bool,
) -> Any:
    """One planned hop around ``sending`` (the original's coroutine, not started yet), made when the
    send starts, so a coroutine never awaited leaves the request as it was. The send gets headers of
    its own, a copy of the caller's with ours; the caller's are never edited, so any other send of
    the request (a retry, a middleware's, even one started while this one is under way) starts from
    them. After the send ours are taken out of the copy too: it stays on the request, with what
    aiohttp added while sending, and the response's ``request_info`` shows it (an application may
    copy that into another request)."""
    sent = None
    saved = None
    names: list[str] = []
    token = None
    try:
        edits = plan.edits if plan is not None else []
        if swap or edits:
            sent = callers.copy()
            if plan is not None and edits:
                saved = list(callers.items()) if held else None
                names = [name for name, _ in edits]
                _edit(sent, edits, held)
                plan.delivered()
            _in_flight[id(sent)] = (sent, callers)
            instance.headers = sent
        if watched and plan is not None:
            hop = plan.hop._replace(carrier=instance.headers)  # for this send's headers only
            token = otel_context.attach(otel_context.set_value(HOP_KEY, hop))
    except Exception as exc:  # a bug of ours must not fail the request, nor send another's session
        _faults.report("adding session headers to a request", exc)
        if sent is not None or swap:
            instance.headers = callers
        if sent is not None:
            _in_flight.pop(id(sent), None)
        return await sending
    try:
        response = await sending
        if plan is not None and plan.route.profile is not None:
            _watched.add(response)  # its status is known once aiohttp has started it (``_start``)
        return response
    finally:
        try:
            if token is not None:
                otel_context.detach(token)
            if sent is not None:
                _in_flight.pop(id(sent), None)
                if names:
                    _restore(sent, saved, names)
        except Exception as exc:
            _faults.report("restoring request headers", exc)


def _start(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``ClientResponse.start``, which reads the status line: for a router's answer to a hop of ours,
    awaited in a coroutine of ours to see the status; any other response's coroutine, untouched."""
    starting = wrapped(*args, **kwargs)
    if not _watched or instance not in _watched:
        return starting
    return _started(starting, instance)


async def _started(starting: Any, response: Any) -> Any:
    started = await starting
    try:
        _watched.discard(response)
        url = response.url
        _evidence.answered_status(response.status, url.scheme, url.raw_host, url.port)
    except Exception as exc:  # evidence lost, never the response
        _faults.report("reading a response's status", exc)
    return started


def _json(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``ClientResponse.json``, which the application calls to read a body it asked for: inside a
    trajectory, the JSON it returns is shown to ``_evidence`` (usage, Dynamo's worker) after the
    application's own read, from a coroutine of ours; anywhere else the original's, untouched."""
    reading = wrapped(*args, **kwargs)
    if not _INSTRUMENTOR.active or _hop.current() is None:
        return reading
    return _read_json(reading, instance)


async def _read_json(reading: Any, response: Any) -> Any:
    data = await reading
    try:
        url = response.url
        _evidence.parsed(data, url.scheme, url.raw_host, url.port, response=response)
    except Exception as exc:  # evidence lost, never the body
        _faults.report("reading the usage of an aiohttp response", exc)
    return data


def _edit(headers: Any, edits: list[tuple[str, str | None]], held: dict[str, str]) -> None:
    """Make ``edits`` on a send's own headers: a name the caller's do not hold is only added."""
    fast = not held and type(headers) in _FOLDING
    for name, value in edits:
        if value is None:
            _carriers.remove(headers, name)
        elif fast:
            headers.add(name, value)
        else:
            _carriers.write(headers, name, value)


def _restore(headers: Any, saved: list[tuple[str, str]] | None, names: list[str]) -> None:
    """Take ours out of a send's headers after the send. Where the caller held none of the names we
    edited (``saved`` is ``None``), ours were only added: taking them back is removing them. Else
    the caller's own values go back in their places and spellings; what the client added meanwhile
    under other names (aiohttp's ``Connection``, say) stays, after them."""
    if saved is None:
        for name in names:
            _carriers.remove(headers, name)
        return
    ours = {name.lower() for name in names}
    added = list(headers.items())
    for item in saved:
        if item[0].lower() not in ours and item in added:
            added.remove(item)
    headers.clear()
    headers.extend(saved)
    headers.extend(item for item in added if item[0].lower() not in ours)


class AioHttpSessionInstrumentor(SessionInstrumentor):
    """Session headers for aiohttp's client (entry point ``otel_session_aiohttp``)."""

    library = "aiohttp"
    requirement = "aiohttp >= 3.9"
    replaces = ("aiohttp-client",)
    upstream = ("opentelemetry.instrumentation.aiohttp_client", "AioHttpClientInstrumentor")

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        global _BYTES_PAYLOADS
        kind = getattr(getattr(module, "payload", None), "BytesPayload", None)
        _BYTES_PAYLOADS = (kind,) if isinstance(kind, type) else ()
        return [
            (module.ClientSession, "_request", _request),
            (module.ClientRequest, "send", _send),
            (module.ClientResponse, "start", _start),
            (module.ClientResponse, "json", _json),
        ]


_INSTRUMENTOR = AioHttpSessionInstrumentor()
# aiohttp's payloads that hold their body in memory as bytes (``json=``, ``data=`` bytes or text):
# read for an attempt's group; any other payload (a stream, a file, a form) never is.
# Found as aiohttp is instrumented.
_BYTES_PAYLOADS: tuple[type, ...] = ()
