"""The destination-aware propagator: what a carrier may receive depends on where its request goes.

OpenTelemetry's stock propagators send ``traceparent`` and ``baggage`` to every host. This one asks
``_policy.plan`` for the route of the hop in progress, which otel-session's client instrumentors put in
the context (``Hop``), and a carrier without one receives nothing: a ``Host`` header or a dict key is
something the caller can set, never the destination. Composed after stock propagators
(``OTEL_PROPAGATORS=tracecontext,baggage,dynamo_session``) it takes back what they copied of ours
where it must not go, recognising our baggage members however they were encoded.

``extract`` reads an incoming session: an explicit ``X-Dynamo-Session-ID`` wins over baggage.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import baggage, propagate
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context, get_current
from opentelemetry.propagators.textmap import (
    CarrierT,
    Getter,
    Setter,
    TextMapPropagator,
    default_getter,
    default_setter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_session import _carriers, _faults, _hop, _stock, _w3c
from otel_session._context import HOP_KEY, PARENT_KEY, SESSION_KEY, with_session
from otel_session._ids import PARENT_SESSION_HEADER, SESSION_HEADER, is_valid_session_id
from otel_session._policy import names_for, plan

_tracecontext = TraceContextTextMapPropagator()
_baggage = W3CBaggagePropagator()


class SessionPropagator(TextMapPropagator):
    """Router headers for routers, W3C baggage for trusted hosts, nothing elsewhere or when unknown.

    Constructed without arguments (as the ``dynamo_session`` entry point is); never raises.
    """

    def inject(
        self, carrier: CarrierT, context: Context | None = None, setter: Setter[CarrierT] = default_setter
    ) -> None:
        try:
            _stock.check_global()
            ctx = context if context is not None else get_current()
            hop = ctx.get(HOP_KEY)
            if not isinstance(hop, _hop.Hop):
                return  # no destination known: nothing added, nothing taken
            if hop.carrier is not None and carrier is not hop.carrier:
                return  # another request, sent from inside the hop: its destination is unknown
            offered = _hop.current(ctx)
            # None: unconfigured (the propagator used on its own), or nothing offered with tracing off
            offer = offered.offer if offered is not None else _hop.offer_for(ctx, False)
            held = _carriers.read(carrier, names_for(hop.route))
            edits = plan(hop.route, offer, held, callers_only=False, replaceable=hop.added)
            _carriers.apply(carrier, edits, setter)
        except Exception as exc:  # never let a propagation bug break the request
            _faults.report("injecting session headers", exc)

    def extract(
        self, carrier: CarrierT, context: Context | None = None, getter: Getter[CarrierT] = default_getter
    ) -> Context:
        try:
            return extract_session(carrier, context, getter)
        except Exception as exc:
            _faults.report("extracting an incoming session", exc)
            return context if context is not None else get_current()

    @property
    def fields(self) -> set[str]:
        return {SESSION_HEADER.lower(), PARENT_SESSION_HEADER.lower(), "baggage", *_tracecontext.fields}


def is_sole_global() -> bool:
    """Whether the global propagator is ours alone (not composed with stock ones that need a ``Hop``)."""
    return type(propagate.get_global_textmap()) is SessionPropagator


def _first_valid(getter: Getter[Any], carrier: Any, name: str) -> str | None:
    for key in dict.fromkeys((name, name.lower(), name.title())):
        values = getter.get(carrier, key)
        if values:
            value = values[0].strip() if isinstance(values[0], str) else None
            return value if is_valid_session_id(value) else None
    return None


def extract_session(carrier: Any, context: Context | None, getter: Getter[Any] = default_getter) -> Context:
    """Read ``traceparent``, baggage and the Dynamo session headers into a context.

    An explicit ``X-Dynamo-Session-ID`` wins over baggage (it is what Dynamo itself would use), and
    its parent then comes only from ``X-Dynamo-Parent-Session-ID``. Invalid values are dropped, never
    raised: an inbound header is untrusted input.
    """
    ctx = _tracecontext.extract(carrier, context, getter)
    raw = getter.get(carrier, "baggage")
    ours: dict[str, str] | None = None
    if raw and sum(len(value) for value in raw) <= _w3c.MAX_HEADER_BYTES:
        ctx = _baggage.extract(carrier, ctx, getter)
        # Ours are read from every header line ourselves: the stock extractor reads only the first
        # line, stops at its member limit, and keeps a member's properties in its value
        # (``session.id=V;ttl=60`` would be the session "V;ttl=60"; W3C says the value is V).
        ours = _our_members(raw)
    session = _first_valid(getter, carrier, SESSION_HEADER)
    if session is not None:
        return with_session(session, _first_valid(getter, carrier, PARENT_SESSION_HEADER), ctx)
    in_baggage = baggage.get_all(ctx)
    if ours is not None and (ours or SESSION_KEY in in_baggage or PARENT_KEY in in_baggage):
        session, parent = ours.get(SESSION_KEY), ours.get(PARENT_KEY)
        ctx = baggage.remove_baggage(PARENT_KEY, baggage.remove_baggage(SESSION_KEY, ctx))
        if is_valid_session_id(session):
            parent = parent if is_valid_session_id(parent) and parent != session else None
            ctx = with_session(session, parent, ctx)  # type: ignore[arg-type]
    return ctx


def _our_members(headers: list[str]) -> dict[str, str]:
    """Our keys' valid values among the first 180 members (W3C's limit) of all ``baggage`` lines,
    decoded and without properties; the last one wins, as in the stock extractor."""
    found = {}
    members = [member for header in headers for member in _w3c.decoded_members(header)]
    for key, value, text in members[: _w3c.MAX_MEMBERS]:
        if key in (SESSION_KEY, PARENT_KEY) and _w3c.well_formed_value(text):
            found[key] = value
    return found
