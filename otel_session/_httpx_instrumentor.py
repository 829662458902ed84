"""httpx and httpx2 (what the openai SDK uses): the session on every hop, for that hop only.

``Client._send_single_request`` runs once per hop, so every transport, every redirect hop and every
retry passes through it, for clients created before or after instrumenting. A hop where anything may
be written (our headers, or a propagator's inside an upstream instrumentation) is sent as a copy of
the caller's ``Request`` with headers of its own: the caller's object is never edited, so the same
``Request`` sent by two trajectories (or threads) at once carries each its own ID, and the redirect
httpx builds from it carries nothing of ours.

httpx's own transport dials the request's URL as it is. Any other transport may send the request
somewhere else (one that re-targets it before handing it to ``HTTPTransport``): for those, and only
once a process uses one, ``HTTPTransport`` itself is patched too, and a request whose destination
changed after we planned it is planned again there, at the last point before the socket.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from opentelemetry import context as otel_context

from otel_session import _carriers, _faults, _hop, _propagator
from otel_session._context import HOP_KEY
from otel_session._instrumentor import SessionInstrumentor, Wrapper

# Hops through a transport other than httpx's own, in flight: id(request sent) -> (that request: our
# copy, or the caller's own where the hop had nothing to write; the destination it was planned for;
# the caller's own headers).
_in_flight: dict[int, tuple[Any, tuple[str, str, int | None], Any]] = {}

Plan = tuple[Any, object, int | None]  # (request to send, context token or None, in-flight key or None)


class _Hooks:
    """The wrappers for one httpx-like library, made once so that patching can recognise them."""

    def __init__(self, instrumentor: SessionInstrumentor, module: ModuleType) -> None:
        self.instrumentor, self.module = instrumentor, module
        self.stock = (module.HTTPTransport, module.AsyncHTTPTransport)
        self.transports: list[tuple[Any, str, Wrapper]] = [
            (module.HTTPTransport, "handle_request", _handle_request),
            (module.AsyncHTTPTransport, "handle_async_request", _handle_async_request),
        ]
        self.send: Wrapper = self._send
        self.send_async: Wrapper = self._send_async

    def begin(self, request: Any, client: Any) -> Plan | None:
        """What to send for this hop and how to end it; ``None``: send the caller's request as it is."""
        now = _hop.now()
        if now is None:
            return None
        url = request.url
        scheme, host, port = url.scheme, url.host, url.port
        prepared = _hop.prepare(now, request.headers, scheme, host, port)
        announce = prepared.watched or not _propagator.is_sole_global()
        stock = type(_transport(client, url)) in self.stock
        if stock and not (prepared.edits or announce):
            return None
        sent = request
        if prepared.edits or announce:
            # A copy whenever anything may be written in this hop, by us or by a propagator an upstream
            # instrumentation calls: the caller's object is never edited, whoever else sends it meanwhile.
            sent = _carriers.copy_request(request, prepared.edits, prepared.held)
        key = None
        if not stock:
            for owner, name, wrapper in self.transports:
                self.instrumentor.patch(owner, name, wrapper)
            key = id(sent)
            _in_flight[key] = (sent, (scheme, host, port), request.headers)
        token = None
        if announce:
            hop = prepared.hop._replace(authority=sent.headers.get("host"))
            token = otel_context.attach(otel_context.set_value(HOP_KEY, hop))
        return sent, token, key

    def _safe_begin(self, request: Any, client: Any) -> Plan | None:
        try:
            return self.begin(request, client)
        except Exception as exc:  # a bug of ours must not fail the request
            _faults.report("adding session headers to a request", exc)
            return None

    def _send(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.instrumentor.active or not args:
            return wrapped(*args, **kwargs)
        plan = self._safe_begin(args[0], instance)
        if plan is None:
            return wrapped(*args, **kwargs)
        try:
            response = wrapped(plan[0], *args[1:], **kwargs)
        finally:
            if plan[1] is not None or plan[2] is not None:
                _finish(plan)
        return _as_sent_by_caller(response, args[0])

    async def _send_async(
        self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if not self.instrumentor.active or not args:
            return await wrapped(*args, **kwargs)
        plan = self._safe_begin(args[0], instance)
        if plan is None:
            return await wrapped(*args, **kwargs)
        try:
            response = await wrapped(plan[0], *args[1:], **kwargs)
        finally:
            if plan[1] is not None or plan[2] is not None:
                _finish(plan)
        return _as_sent_by_caller(response, args[0])


def _transport(client: Any, url: Any) -> Any:
    """The transport ``client`` sends ``url`` through (``None`` if that cannot be told)."""
    try:
        return client._transport_for_url(url) if client._mounts else client._transport
    except Exception:
        return None


def _finish(plan: Plan) -> None:
    try:
        _, token, key = plan
        if key is not None:
            _in_flight.pop(key, None)
        if token is not None:
            otel_context.detach(token)  # type: ignore[arg-type]
    except Exception as exc:
        _faults.report("ending a request's hop", exc)


def _as_sent_by_caller(response: Any, request: Any) -> Any:
    """The response names the caller's ``Request`` (not a hop's copy): a re-send of it starts clean."""
    if response.request is not request:
        response.request = request
    return response


def _replan_if_moved(request: Any) -> Any:
    """The request to send: planned again if a transport changed where it goes after we planned it."""
    entry = _in_flight.get(id(request))
    if entry is None or entry[0] is not request:
        return request
    url = request.url
    if (url.scheme, url.host, url.port) == entry[1]:
        return request
    try:
        callers = entry[2]
        now = _hop.now()
        again = _hop.prepare(now, callers, url.scheme, url.host, url.port) if now is not None else None
        edits, held = (again.edits, again.held) if again is not None else ([], frozenset())
        if request.headers is not callers:  # our copy: back to the caller's headers, ours gone
            request.headers = _carriers.copy_headers(callers)
            _carriers.apply(request.headers, edits, held=held)
            return request
        return _carriers.copy_request(request, edits, held) if edits else request
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
    _hooks: _Hooks | None = None

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        if self._hooks is None or self._hooks.module is not module:
            self._hooks = _Hooks(self, module)
        return [
            (module.Client, "_send_single_request", self._hooks.send),
            (module.AsyncClient, "_send_single_request", self._hooks.send_async),
        ]


class HTTPX2SessionInstrumentor(HTTPXSessionInstrumentor):
    """The same for httpx2, the httpx fork the openai SDK uses (entry point ``otel_session_httpx2``)."""

    library = "httpx2"
    requirement = "httpx2"
