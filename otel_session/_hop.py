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


def offer_for(ctx: Context, tracing: bool) -> Offer:
    """What ``ctx`` offers a request, with tracing on or off (``now`` keeps the last answer)."""
    session, parent = session_ids(ctx)
    span_context = trace.get_current_span(ctx).get_span_context()
    # With tracing off a caller's extracted span is not passed on: only spans recorded here are.
    traced = span_context.is_valid and (tracing or not span_context.is_remote)
    entries = baggage.get_all(ctx)
    return Offer(session, parent, entries, _w3c.traceparent(span_context) if traced else None)


# The offer for the last context seen. A ``Context`` is immutable, so the same object always gives
# the same answer, and one trajectory's requests share one until something attaches another: the
# usual request skips reading baggage and finding the span. Swapped whole, so thread-safe.
_last: tuple[object, bool, Offer] = (None, False, NO_OFFER)


# What the context offers a request at this moment, under the configuration in force: (settings,
# context, offer, watched: tracing is on or a span is current, see ``Prepared``). A plain tuple: one
# is built for every request in a trajectory.
Now = tuple[_settings.Settings, Context, Offer, bool]


def now(ctx: Context | None = None) -> Now | None:
    """What a request sent now (in ``ctx``, by default the current context) could carry; ``None``
    when nothing at all (no configuration, or outside any trajectory with no baggage and tracing
    off): the usual untraced request outside a trajectory learns that before its destination is
    even read."""
    global _last
    settings = _settings.current
    if settings is None:
        return None
    if ctx is None:
        ctx = get_current()
    tracing = settings.tracing
    last = _last
    if last[0] is ctx and last[1] is tracing:
        offer = last[2]
    else:
        offer = offer_for(ctx, tracing)
        _last = (ctx, tracing, offer)
    watched = tracing or offer.traceparent is not None
    if offer.session is None and not offer.baggage and not watched:
        return None
    return settings, ctx, offer, watched


def prepare(
    now: Now, headers: Any, scheme: str, host: str | None, port: int | None, callers_only: bool = True
) -> Prepared:
    """What this hop's ``headers`` must gain, sent ``now`` to that destination.

    ``callers_only=False`` where a stock propagator may already have written into ``headers``.
    """
    global _recent
    settings, ctx, offer, watched = now
    recent = _recent
    asked = (offer, scheme, host, port, settings, callers_only)
    if recent[0] == asked and not _carriers.holds_any(headers, recent[1]):
        # the usual request: a trajectory's next turn to the same router
        if recent[3] is not None:
            _visited(ctx, recent[3])
        return recent[2]
    route = settings.rules.route(scheme, host, port)
    names: tuple[str, ...] = ()
    held: dict[str, str] = {}
    edits: list[Edit] = []
    if route or not callers_only:  # else: nothing to add, nothing to take back
        names = names_for(route)
        held = _carriers.read(headers, names)
        edits = plan(route, offer, held, callers_only=callers_only)
    added = frozenset(name.lower() for name, value in edits if value is not None)
    prepared = Prepared(edits, Hop(route, added), watched, frozenset(held))
    profile = route.profile
    visit = None
    ends = settings.end_sessions  # else no trajectory keeps a set of routers to tell
    if ends and profile is not None and host and edits and edits[0][0] == profile.session_header:
        visit = (profile.name, *canonical_origin(scheme, host, port))
        _visited(ctx, visit)
    if not held:
        _recent = (asked, _carriers.names_to_find(names), prepared, visit)
    return prepared


def _visited(ctx: Context, visit: tuple[str, str, str, int | None]) -> None:
    """Note for ``trajectory()`` (when it ends sessions) a router this trajectory's session reached."""
    visits = ctx.get(ROUTER_VISITS_KEY)
    if isinstance(visits, set):
        visits.add(visit)


# The last hop prepared whose request held none of our headers: (what was asked: offer, scheme, host,
# port, settings, callers_only; the names a request holding any of must be planned afresh, as
# ``_carriers.names_to_find`` gives them; the answer; the router visit to note). A trajectory's turns
# to one router ask the same question every time: answered once, then from here while the context,
# destination and configuration stay the same. One tuple, compared in one step, swapped whole:
# thread-safe.
_Asked = tuple[object, str, "str | None", "int | None", object, bool]
_recent: tuple[_Asked | None, _carriers.Names, Prepared, tuple[str, str, str, int | None] | None] = (
    None,
    _carriers.names_to_find(()),
    Prepared([], Hop(Route(), frozenset()), False, frozenset()),
    None,
)
