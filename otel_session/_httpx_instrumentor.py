"""httpx and httpx2 (what the openai SDK uses): the session on every hop, for that hop only.

``Client._send_single_request`` runs once per hop, so every transport, every redirect hop and every
retry passes through it, for clients created before or after instrumenting. A hop where anything may
be written (our headers, or a propagator's inside an upstream instrumentation) is sent as a copy of
the caller's ``Request`` with headers of its own: the caller's object is never edited, so the same
``Request`` sent by two trajectories (or threads) at once carries each its own ID, and the redirect
httpx builds from it carries nothing of ours.

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

# Hops in flight: id(request sent) -> (that request: our copy, or the caller's own where the hop had
# nothing to write; the destination it was planned for; the plan; the caller's own headers).
_in_flight: dict[int, tuple[Any, tuple[str, str, int | None], _hop.Prepared, Any]] = {}

Plan = tuple[Any, object, int]  # (request sent, context token or None, in-flight key)


def _begin(request: Any) -> Plan | None:
    """What to send for this hop and how to end it; ``None``: send the caller's request as it is."""
    url = request.url
    prepared = _hop.prepare(request.headers, url.scheme, url.host, url.port)
    if prepared is None:
        return None
    announce = prepared.watched or not _propagator.is_sole_global()
    sent = request
    if prepared.edits or announce:
        # A copy whenever anything may be written in this hop, by us or by a propagator an upstream
        # instrumentation calls: the caller's object is never edited, whoever else sends it meanwhile.
        sent = _carriers.copy_request(request)
        _carriers.apply(sent.headers, prepared.edits, held=prepared.held)
    key = id(sent)
    _in_flight[key] = (sent, (url.scheme, url.host, url.port), prepared, request.headers)
    token = None
    if announce:
        hop = prepared.hop._replace(authority=sent.headers.get("host"))
        token = otel_context.attach(otel_context.set_value(HOP_KEY, hop))
    return sent, token, key


def _finish(plan: Plan) -> None:
    _, token, key = plan
    _in_flight.pop(key, None)
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
        again = _hop.prepare(entry[3], url.scheme, url.host, url.port)
        sent = request
        if request.headers is not entry[3]:  # our copy: back to the caller's headers, ours gone
            request.headers = _carriers.copy_headers(entry[3])
        elif again is not None and again.edits:  # the caller's own object: edit a copy of it
            sent = _carriers.copy_request(request)
        if again is not None:
            _carriers.apply(sent.headers, again.edits, held=again.held)
        return sent
    except Exception as exc:
        _faults.report("planning a re-targeted request again", exc)
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
