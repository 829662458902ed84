"""aiohttp's client: the session on every hop, for that hop only.

``ClientRequest.send`` is where a request's destination is final: it runs once per hop (redirects
build a new ``ClientRequest``; a client middleware that sends the same one again, maybe elsewhere,
passes through again). Headers are added for that one send and taken back when it returns, so a
re-send starts from the caller's headers. An https proxy's ``CONNECT`` goes through ``send`` too,
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


def _send(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``ClientRequest.send``: as it is (no coroutine of ours) where the context offers nothing,
    the usual request outside a trajectory; else through ``_hop_send``."""
    if _INSTRUMENTOR.active and instance.method != "CONNECT":
        try:
            offered = _hop.now() is not None
        except Exception as exc:  # a bug of ours must not fail the request
            _faults.report("adding session headers to a request", exc)
            offered = False
        if offered:
            return _hop_send(wrapped, instance, args, kwargs)
    return wrapped(*args, **kwargs)


async def _hop_send(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One hop: planned and edited when the send starts (not when it is called), taken back when
    it returns, so a coroutine never awaited leaves the request as it was."""
    headers = instance.headers
    prepared = None
    edited = False
    saved = None
    token = None
    try:
        now = _hop.now()
        if now is not None:
            url = instance.url
            # aiohttp's own instrumentation injects before this, with no destination: under a stock
            # propagator composed with ours, what it copied is taken back here, where the hop is known.
            sole = _propagator.is_sole_global()
            prepared = _hop.prepare(now, headers, url.scheme, url.raw_host, url.port, sole)
            if prepared.edits:
                saved = _carriers.snapshot(headers, prepared.held)
                edited = True
                _carriers.apply(headers, prepared.edits, held=prepared.held)
            if prepared.watched or not sole:
                hop = prepared.hop._replace(carrier=headers)  # for these headers only
                token = otel_context.attach(otel_context.set_value(HOP_KEY, hop))
    except Exception as exc:  # a bug of ours must not fail the request
        _faults.report("adding session headers to a request", exc)
        if edited and prepared is not None:
            _carriers.restore(headers, saved, (name for name, _ in prepared.edits))
        return await wrapped(*args, **kwargs)
    try:
        return await wrapped(*args, **kwargs)
    finally:
        try:
            if token is not None:
                otel_context.detach(token)
            if edited and prepared is not None:
                _carriers.restore(headers, saved, (name for name, _ in prepared.edits))
        except Exception as exc:
            _faults.report("restoring request headers", exc)


class AioHttpSessionInstrumentor(SessionInstrumentor):
    """Session headers for aiohttp's client (entry point ``otel_session_aiohttp``)."""

    library = "aiohttp"
    requirement = "aiohttp >= 3.9"

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        return [(module.ClientRequest, "send", _send)]


_INSTRUMENTOR = AioHttpSessionInstrumentor()
