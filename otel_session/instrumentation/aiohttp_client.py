"""aiohttp's client: the session on every hop, for that hop only.

``ClientRequest.send`` is where a request's destination is final: it runs once per hop (redirects
build a new ``ClientRequest``; a client middleware that sends the same one again, maybe elsewhere,
passes through again). That send gets a copy of the caller's headers with ours; the caller's are
never edited, so every re-send starts from them. An https proxy's ``CONNECT`` goes through ``send`` too,
with the final URL: the proxy is not the destination, so it gets nothing of ours.

aiohttp's upstream instrumentation injects through the global propagator before any of this, when
no destination is known, so ours adds nothing there. Where stock propagators are composed with ours
they do add, to every host: this hook then takes back what is recognisably ours (our trace's
``traceparent``, our ``session.id`` however encoded) where it must not go.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from opentelemetry import context as otel_context

from otel_session import _carriers, _faults, _hop, _propagator
from otel_session._context import HOP_KEY
from otel_session._instrumentor import SessionInstrumentor, Wrapper

# Sends of ours under way: id(the headers we put on a request for one send) -> (those headers, the
# caller's own they were copied from). Another send of the same request started meanwhile (a hedging
# middleware's) copies the caller's, never a copy holding that send's session.
_in_flight: dict[int, tuple[Any, Any]] = {}


def _send(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``ClientRequest.send``: the hop planned as it is called; sent as it is (no coroutine of ours)
    where there is nothing to add, take back or watch, as for the usual request outside a
    trajectory or to a host that gets nothing; else through ``_hop_send``."""
    if _INSTRUMENTOR.active and instance.method != "CONNECT":
        callers, swap = instance.headers, False
        if _in_flight:
            entry = _in_flight.get(id(callers))
            if entry is not None and entry[0] is callers:
                callers, swap = entry[1], True  # another send's copy: start from the caller's
        prepared, watched = None, False
        try:
            now = _hop.now()
            if now is not None:
                url = instance.url
                # aiohttp's own instrumentation injects before this, with no destination: under a stock
                # propagator composed with ours, what it copied is taken back here, where the hop is known.
                sole = _propagator.is_sole_global()
                prepared = _hop.prepare(now, callers, url.scheme, url.raw_host, url.port, sole)
                watched = prepared.watched or not sole
        except Exception as exc:  # a bug of ours must not fail the request
            _faults.report("adding session headers to a request", exc)
            prepared, watched = None, False
        if swap or watched or (prepared is not None and prepared.edits):
            return _hop_send(wrapped, instance, args, kwargs, callers, swap, prepared, watched)
    return wrapped(*args, **kwargs)


async def _hop_send(
    wrapped: Any,
    instance: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    callers: Any,
    swap: bool,
    prepared: _hop.Prepared | None,
    watched: bool,
) -> Any:
    """One planned hop, made when the send starts, so a coroutine never awaited leaves the request
    as it was. The send gets headers of its own, a copy of the caller's with ours; the caller's are
    never edited, so any other send of the request (a retry, a middleware's, even one started while
    this one is under way) starts from them. After the send ours are taken out of the copy too: it
    stays on the request, with what aiohttp added while sending, and the response's
    ``request_info`` shows it (an application may copy that into another request)."""
    sent = None
    saved = None
    names: list[str] = []
    token = None
    try:
        edits = prepared.edits if prepared is not None else []
        if swap or edits:
            sent = _carriers.copy_headers(callers)
            if prepared is not None and edits:
                saved = _carriers.snapshot(callers, prepared.held)
                names = [name for name, _ in edits]
                _carriers.apply(sent, edits, held=prepared.held)
            _in_flight[id(sent)] = (sent, callers)
            instance.headers = sent
        if watched and prepared is not None:
            hop = prepared.hop._replace(carrier=instance.headers)  # for this send's headers only
            token = otel_context.attach(otel_context.set_value(HOP_KEY, hop))
    except Exception as exc:  # a bug of ours must not fail the request, nor send another's session
        _faults.report("adding session headers to a request", exc)
        if sent is not None or swap:
            instance.headers = callers
        if sent is not None:
            _in_flight.pop(id(sent), None)
        return await wrapped(*args, **kwargs)
    try:
        return await wrapped(*args, **kwargs)
    finally:
        try:
            if token is not None:
                otel_context.detach(token)
            if sent is not None:
                _in_flight.pop(id(sent), None)
                if names:
                    _carriers.restore(sent, saved, names)
        except Exception as exc:
            _faults.report("restoring request headers", exc)


class AioHttpSessionInstrumentor(SessionInstrumentor):
    """Session headers for aiohttp's client (entry point ``otel_session_aiohttp``)."""

    library = "aiohttp"
    requirement = "aiohttp >= 3.9"

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        return [(module.ClientRequest, "send", _send)]


_INSTRUMENTOR = AioHttpSessionInstrumentor()
