"""One hop of one request: where it goes, what the trajectory offers, what to add.

The client instrumentors call ``prepare`` at the point where a request's destination is final (the
connection's scheme, host and port) and apply the edits it returns to that hop's headers only. The
propagator reads the ``Hop`` they leave in the context, so an upstream instrumentation injecting
later in the same hop gets the same answer.

Answers are remembered for the current context, by destination (``plans_now``): a trajectory sends
many requests to a few hosts from one context, and the policy's only other input, what the request
already holds, is checked on each (``Plan.fits``). httpx's hook takes a remembered answer without
calling ``prepare`` at all: that is the whole cost of the usual request.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from opentelemetry import baggage, trace
from opentelemetry.context import Context, get_current

from otel_session import _carriers, _faults, _settings, _w3c
from otel_session._context import ROUTER_VISITS_KEY, session_ids
from otel_session._hosts import Route, canonical_origin
from otel_session._policy import Edit, Offer, names_for, plan
from otel_session._session_end import Visit


class Hop(NamedTuple):
    """What the propagator needs to know about the hop in progress: its route, what we added, and
    the headers it is for.

    ``carrier``: the hop's own headers object, where an instrumentor binds the hop to them before
    putting it in the context. Everything run in that context sees the hop: a client's trace
    callbacks, and the task a client starts to stream the body, which keeps a copy of the context
    after the hop is over. A request sent from there (an audit call, a body read from another host)
    injects into a carrier of its own, which is not this hop's and gets nothing: the check can only
    ever withhold, never grant.
    """

    route: Route
    added: frozenset[str]
    carrier: object | None = None


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
    """What ``ctx`` offers a request, with tracing on or off (``now`` remembers the answer)."""
    session, parent = session_ids(ctx)
    return Offer(session, parent, baggage.get_all(ctx), _passed_on(trace.get_current_span(ctx), tracing))


def _passed_on(span: trace.Span, tracing: bool) -> str | None:
    """The ``traceparent`` naming ``span``, where it may be passed on at all: with tracing off a
    caller's extracted span is not, only spans recorded here are."""
    span_context = span.get_span_context()
    traced = span_context.is_valid and (tracing or not span_context.is_remote)
    return _w3c.traceparent(span_context) if traced else None


# What the context offers a request at this moment, under the configuration in force: (settings,
# context, offer, watched: tracing is on or a span is current, see ``Prepared``). A plain tuple: one
# is built for every request in a trajectory.
Now = tuple[_settings.Settings, Context, Offer, bool]
Destination = tuple[str, "str | None", "int | None"]  # (scheme, host, port) as the client dials them


class Plan(NamedTuple):
    """A hop's answer remembered for one destination, valid for a request holding none of ``names``
    (what the request holds is the only input of the policy not fixed by context and destination).

    ``entries``: the edits as a fast ``Headers`` keeps them (``_carriers.entries_for``), ``None``
    where one cannot be appended so. ``note``: (the trajectory's set of routers reached, this one),
    to add on every hop when sessions are ended.
    """

    names: _carriers.Names
    prepared: Prepared
    entries: _carriers.Entries | None
    note: tuple[set[Visit], Visit] | None
    nowhere: bool  # the destination may receive nothing: where only callers wrote, nothing to check

    def fits(self, headers: Any, callers_only: bool) -> bool:
        """Whether this answer is valid for a request with ``headers``: it holds none of ``names``,
        or it goes nowhere and everything it holds was set by its caller (the answer is then
        nothing, whatever it holds)."""
        return (self.nowhere and callers_only) or not _carriers.holds_any(headers, self.names)

    def taken(self) -> Prepared:
        """The remembered answer, for a request found to hold none of ``names``."""
        note = self.note
        if note is not None:
            note[0].add(note[1])
        return self.prepared


# The last context seen, under the configuration then in force: (context, settings, what it offers
# (``now``'s answer), the plans made from it so far by destination; ``None`` for both where it offers
# nothing). A ``Context`` is immutable, so the same object always gives the same answers, and one
# trajectory's requests share one until something attaches another: the usual request then costs
# two identity checks and one lookup. Swapped whole, and its dict only ever gains or loses whole
# entries, so thread-safe.
_Memo = tuple["Context | None", "_settings.Settings | None", "Now | None", "dict[Destination, Plan] | None"]
_memo: _Memo = (None, None, None, None)
PLANS_KEPT = 64  # destinations remembered per context: a trajectory talks to a handful of hosts


def _remember(settings: _settings.Settings, ctx: Context, offer: Offer | None = None) -> _Memo:
    """``_memo`` for ``ctx`` under ``settings``, made afresh (from ``offer`` where it is known)."""
    global _memo
    tracing = settings.tracing
    if offer is None:
        offer = offer_for(ctx, tracing)
    watched = tracing or offer.traceparent is not None
    offered = offer.session is not None or bool(offer.baggage) or watched
    memo: _Memo = (ctx, settings, None, None)
    if offered:
        memo = (ctx, settings, (settings, ctx, offer, watched), {})
    _memo = memo
    return memo


def entered(ctx: Context, session: str, parent: str | None, span: trace.Span) -> None:
    """``trajectory()`` is making ``ctx`` current, with ``session`` (and ``parent``) in its
    baggage and ``span`` as its span: what it offers is remembered from those, so that its first
    request does not read them back out of the context. That reading, with the caches cold as a
    trajectory starts, cost about 50 us (a third of the start)."""
    settings = _settings.current
    if settings is None:
        return
    try:
        offer = Offer(session, parent, baggage.get_all(ctx), _passed_on(span, settings.tracing))
        _remember(settings, ctx, offer)
    except Exception as exc:  # a bug of ours must not fail the trajectory: its first request reads it
        _faults.report("remembering what a trajectory offers", exc)


def _memo_now(ctx: Context | None) -> _Memo | None:
    """``_memo`` for ``ctx`` (by default the current context) under the configuration in force,
    made afresh if it was another's; ``None`` when nothing is configured."""
    settings = _settings.current
    if settings is None:
        return None
    if ctx is None:
        ctx = get_current()
    memo = _memo
    if memo[0] is not ctx or memo[1] is not settings:
        memo = _remember(settings, ctx)
    return memo


def now(ctx: Context | None = None) -> Now | None:
    """What a request sent now (in ``ctx``, by default the current context) could carry; ``None``
    when nothing at all (no configuration, or outside any trajectory with no baggage and tracing
    off): the usual untraced request outside a trajectory learns that before its destination is
    even read."""
    memo = _memo_now(ctx)
    return None if memo is None else memo[2]


def plans_now() -> dict[Destination, Plan] | None:
    """The plans remembered for a request sent now from the current context, by destination (the
    express path: a hit, on a request holding none of its ``names``, is the whole answer); ``None``
    when nothing can be added at all, as for ``now``. A miss is planned by ``prepare``."""
    memo = _memo_now(None)
    return None if memo is None else memo[3]


def prepare(
    now: Now, headers: Any, scheme: str, host: str | None, port: int | None, callers_only: bool = True
) -> Prepared:
    """What this hop's ``headers`` must gain, sent ``now`` to that destination.

    ``callers_only=False`` where a stock propagator may already have written into ``headers``. (A
    request holding none of the names the policy reads gets the same answer either way: that is
    the answer remembered.)
    """
    settings, ctx, offer, watched = now
    memo = _memo
    plans = memo[3] if memo[0] is ctx and memo[1] is settings else None
    destination = (scheme, host, port)
    if plans is not None:
        known = plans.get(destination)
        if known is not None and known.fits(headers, callers_only):
            return known.taken()
    route = settings.rules.route(scheme, host, port)
    # Every name the policy reads for this route, even where it reads none now: a request to a
    # route-less host may still hold a stock propagator's copies, which the remembered answer for
    # callers_only=False takes back.
    names = names_for(route)
    held: dict[str, str] = {}
    edits: list[Edit] = []
    if route or not callers_only:  # else: nothing to add, nothing to take back
        held = _carriers.read(headers, names)
        edits = plan(route, offer, held, callers_only=callers_only)
    added = frozenset(name.lower() for name, value in edits if value is not None)
    prepared = Prepared(edits, Hop(route, added), watched, frozenset(held))
    note = _note(ctx, route, edits, scheme, host, port) if settings.end_sessions else None
    if note is not None:
        note[0].add(note[1])
    if not held and plans is not None:
        if len(plans) >= PLANS_KEPT:
            plans.clear()
        plans[destination] = Plan(
            _carriers.names_to_find(names), prepared, _carriers.entries_for(edits), note, not route
        )
    return prepared


def _note(
    ctx: Context,
    route: Route,
    edits: list[Edit],
    scheme: str,
    host: str | None,
    port: int | None,
) -> tuple[set[Visit], Visit] | None:
    """Where ``trajectory()`` ends sessions (``end_sessions`` on): its set of routers reached, and
    this hop's router if the hop delivers the session to one."""
    profile = route.profile
    if profile is None or not host or not edits:
        return None
    if edits[0][0] != profile.session_header:
        return None
    visits = ctx.get(ROUTER_VISITS_KEY)
    if not isinstance(visits, set):
        return None
    return visits, (profile.name, *canonical_origin(scheme, host, port))
