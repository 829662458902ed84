"""httpx and httpx2 (what the openai SDK uses): the session on every hop, for that hop only.

``Client._send_single_request`` runs once per hop, so every transport, every redirect hop and every
retry passes through it, for clients created before or after instrumenting. A hop that gains headers
gets header entries of its own, lent for that hop and given back after it (``_carriers.lend``), so
the caller's ``Request`` comes back as it was and the redirect httpx builds from it carries nothing
of ours. The same ``Request`` sent by two trajectories at once: the second hop edits a copy, made
from the caller's own entries, so each carries its own ID.

A transport may still send the request somewhere else than its URL said (a custom transport that
re-targets it before handing it to ``HTTPTransport``): there, at the last point before the socket,
a request whose destination changed is planned again for where it now goes.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from opentelemetry import context as otel_context

from otel_session import _carriers, _faults, _hop, _propagator
from otel_session._context import HOP_KEY
from otel_session._instrumentor import SessionInstrumentor, Wrapper

# Hops in flight: id(sent request) -> (the request, the destination it was planned for, the plan,
# the caller's own header entries if they were lent to the hop, else None).
_in_flight: dict[int, tuple[Any, tuple[str, str, int | None], _hop.Prepared, list[Any] | None]] = {}

Plan = tuple[Any, object, int, "list[Any] | None"]  # (request sent, context token, key, lent entries)


def _begin(request: Any) -> Plan | None:
    """What to send for this hop and how to end it; ``None``: send the request as it is."""
    url = request.url
    headers = request.headers
    prepared = _hop.prepare(headers, url.scheme, url.host, url.port)
    if prepared is None:
        return None
    sent, lent = request, None
    if prepared.edits:
        busy = _in_flight.get(id(request))
        if busy is None and (lent := _carriers.lend(headers)) is not None:
            _carriers.apply(headers, prepared.edits, held=prepared.held)
        else:  # sent by another hop right now (or no fast headers): this hop edits a copy
            sent = _carriers.copy_request(request, busy[3] if busy is not None else None)
            _carriers.apply(sent.headers, prepared.edits, held=prepared.held)
    key = id(sent)
    _in_flight[key] = (sent, (url.scheme, url.host, url.port), prepared, lent)
    token = None
    if prepared.watched or not _propagator.is_sole_global():
        token = otel_context.attach(otel_context.set_value(HOP_KEY, prepared.hop))
    return sent, token, key, lent


def _finish(plan: Plan) -> None:
    sent, token, key, lent = plan
    _in_flight.pop(key, None)
    if lent is not None:
        _carriers.give_back(sent.headers, lent)
    if token is not None:
        otel_context.detach(token)  # type: ignore[arg-type]


def _safe_begin(request: Any) -> Plan | None:
    try:
        return _begin(request)
    except Exception as exc:  # a bug of ours must not fail the request
        _faults.report("adding session headers to a request", exc)
        return None


def _safe_finish(plan: Plan) -> None:
    try:
        _finish(plan)
    except Exception as exc:
        _faults.report("ending a request's hop", exc)


def _as_sent_by_caller(response: Any, request: Any) -> Any:
    """The response names the caller's ``Request`` (not a hop's copy): a re-send of it starts clean."""
    if response.request is not request:
        response.request = request
    return response


def _send_single_request(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not args or not (_INSTRUMENTORS[0].active or _INSTRUMENTORS[1].active):
        return wrapped(*args, **kwargs)
    plan = _safe_begin(args[0])
    if plan is None:
        return wrapped(*args, **kwargs)
    try:
        return _as_sent_by_caller(wrapped(plan[0], *args[1:], **kwargs), args[0])
    finally:
        _safe_finish(plan)


async def _send_single_request_async(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if not args or not (_INSTRUMENTORS[0].active or _INSTRUMENTORS[1].active):
        return await wrapped(*args, **kwargs)
    plan = _safe_begin(args[0])
    if plan is None:
        return await wrapped(*args, **kwargs)
    try:
        return _as_sent_by_caller(await wrapped(plan[0], *args[1:], **kwargs), args[0])
    finally:
        _safe_finish(plan)


def _replan_if_moved(request: Any) -> Any:
    """The request to send: planned again if a transport changed where it goes after we planned it."""
    entry = _in_flight.get(id(request))
    if entry is None or entry[0] is not request:
        return request
    url = request.url
    if (url.scheme, url.host, url.port) == entry[1]:
        return request
    try:
        sent, planned, lent = request, entry[2], entry[3]
        if planned.edits and lent is not None:
            _carriers.relend(request.headers, lent)  # back to the caller's headers, ours gone
        elif planned.edits:  # a copy of ours: build it again from the caller's
            return _replan_copy(request, url)
        again = _hop.prepare(request.headers, url.scheme, url.host, url.port)
        if again is not None and again.edits:
            if lent is None:  # still the caller's own headers, unlent: edit a copy
                sent = _carriers.copy_request(request)
            _carriers.apply(sent.headers, again.edits, held=again.held)
        return sent
    except Exception as exc:
        _faults.report("planning a re-targeted request again", exc)
        return request


def _replan_copy(request: Any, url: Any) -> Any:
    for name, _ in _in_flight[id(request)][2].edits:
        _carriers.remove(request.headers, name)
    again = _hop.prepare(request.headers, url.scheme, url.host, url.port)
    if again is not None:
        _carriers.apply(request.headers, again.edits, held=again.held)
    return request


def _handle_request(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args and _in_flight:
        args = (_replan_if_moved(args[0]), *args[1:])
    return wrapped(*args, **kwargs)


async def _handle_async_request(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if args and _in_flight:
        args = (_replan_if_moved(args[0]), *args[1:])
    return await wrapped(*args, **kwargs)


class HTTPXSessionInstrumentor(SessionInstrumentor):
    """Session headers for httpx's ``Client`` and ``AsyncClient`` (entry point ``otel_session_httpx``)."""

    library = "httpx"
    requirement = "httpx >= 0.23"

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        return [
            (module.Client, "_send_single_request", _send_single_request),
            (module.AsyncClient, "_send_single_request", _send_single_request_async),
            (module.HTTPTransport, "handle_request", _handle_request),
            (module.AsyncHTTPTransport, "handle_async_request", _handle_async_request),
        ]


class HTTPX2SessionInstrumentor(HTTPXSessionInstrumentor):
    """The same for httpx2, the httpx fork the openai SDK uses (entry point ``otel_session_httpx2``)."""

    library = "httpx2"
    requirement = "httpx2"


_INSTRUMENTORS = (HTTPXSessionInstrumentor(), HTTPX2SessionInstrumentor())
