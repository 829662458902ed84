"""One hop of one request: where it goes, what the trajectory offers, what to add.

The client instrumentors call ``prepare`` at the point where a request's destination is final (the
connection's scheme, host and port) and apply the edits it returns to that hop's headers only. The
propagator reads the ``Hop`` they leave in the context, so an upstream instrumentation injecting
later in the same hop gets the same answer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from opentelemetry import baggage, trace
from opentelemetry.context import Context, get_current

from otel_session import _carriers, _settings, _w3c
from otel_session._context import ROUTER_VISITS_KEY, session_ids
from otel_session._hosts import Route, canonical_origin
from otel_session._policy import NO_OFFER, Edit, Offer, names_for, plan


class Hop(NamedTuple):
    """What the propagator needs to know about the hop in progress: its route, and what we added.

    ``authority``: the hop's own ``Host`` header, where it has one. A carrier that shows another
    (a request some other client sends from inside this hop, a transport's audit call, say) is not
    this hop's, and gets nothing: the check can only ever withhold, never grant.
    """

    route: Route
    added: frozenset[str]
    authority: str | None = None


class Prepared(NamedTuple):
    """``prepare``'s answer: the edits for this hop, the ``Hop``, and whether it must be made current.

    ``watched``: tracing is on or a span is current, so an upstream instrumentation may inject later
    in this hop and our propagator must know where it goes. (A stock propagator composed with ours
    needs it too: the instrumentors check for that.)
    """

    edits: list[Edit]
    hop: Hop
    watched: bool
    held: frozenset[str]


# The offer for the last context seen. A ``Context`` is immutable, so the same object always gives
# the same answer, and one trajectory's requests share one until something attaches another: the
# usual request skips reading baggage and finding the span. Swapped whole, so thread-safe.
_last: tuple[object, bool, Offer] = (None, False, NO_OFFER)


def offer_for(ctx: Context, tracing: bool) -> Offer:
    """What ``ctx`` offers a request, with tracing on or off."""
    global _last
    last = _last
    if last[0] is ctx and last[1] is tracing:
        return last[2]
    session, parent = session_ids(ctx)
    span_context = trace.get_current_span(ctx).get_span_context()
    # With tracing off a caller's extracted span is not passed on: only spans recorded here are.
    traced = span_context.is_valid and (tracing or not span_context.is_remote)
    entries = baggage.get_all(ctx)
    offer = Offer(session, parent, entries, _w3c.traceparent(span_context) if traced else None)
    _last = (ctx, tracing, offer)
    return offer


def prepare(
    headers: Any, scheme: str, host: str | None, port: int | None, *, callers_only: bool = True
) -> Prepared | None:
    """What this hop's ``headers`` must gain; ``None`` when there is nothing to do at all.

    Outside a trajectory, with no baggage and tracing off, that is the first thing it finds out.
    ``callers_only=False`` where a stock propagator may already have written into ``headers``.
    """
    settings = _settings.active()
    if settings is None:
        return None
    ctx = get_current()
    offer = offer_for(ctx, settings.tracing)
    watched = settings.tracing or offer.traceparent is not None
    empty = offer.session is None and not offer.baggage and not watched
    if empty and not settings.tracing:
        return None
    route = settings.rules.route(scheme, host, port)
    if empty or (not route and callers_only):
        return Prepared([], Hop(route, frozenset()), watched, frozenset())
    held = _carriers.read(headers, names_for(route))
    global _last_plan
    last = _last_plan
    if not held and last[0] is offer and last[1] is route:  # the usual request: as the one before
        prepared = last[2]
    else:
        edits = plan(route, offer, held, callers_only=callers_only)
        added = frozenset(name.lower() for name, value in edits if value is not None)
        prepared = Prepared(edits, Hop(route, added), watched, frozenset(held))
        if not held:
            _last_plan = (offer, route, prepared)
    profile = route.profile
    if profile is not None and prepared.edits and prepared.edits[0][0] == profile.session_header:
        visits = ctx.get(ROUTER_VISITS_KEY)
        if isinstance(visits, set) and host:
            visits.add((profile.name, *canonical_origin(scheme, host, port)))
    return prepared


# The plan for the last (offer, route) whose request held none of our headers: a trajectory's turns
# to one router ask the same question every time. Swapped whole, so thread-safe.
_last_plan: tuple[object, object, Prepared] = (
    None,
    None,
    Prepared([], Hop(Route(), frozenset()), False, frozenset()),
)
