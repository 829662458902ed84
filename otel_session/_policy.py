"""The one rule of what a request may carry, as a pure function of where it goes and what it holds.

``plan`` sees the destination's ``Route``, what the current trajectory offers (``Offer``) and the few
headers the request already holds, and returns the edits to make: headers to set and headers to take
away. It touches no carrier, so the client instrumentors and the propagator apply the same answer
to whatever header object they have.

- A router receives its own profile's session header (and parent header), nothing of another's.
- A trusted host receives W3C baggage: a caller's own baggage is kept as written, ours appended.
- Either receives ``traceparent`` when there is a span to name (tracing on, or a span recorded here).
- Every other host receives nothing from us.
- A session its router refused for want of room (``Offer.pinned`` false) is no longer pinned: its
  requests go on without the router's headers, as they would without otel-session.
- A header the caller set is left as set. Only where the carrier may also hold what a stock
  OpenTelemetry propagator copied (``callers_only=False``) are values recognisably ours taken back.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from otel_session import _w3c
from otel_session._context import PARENT_KEY, SESSION_KEY
from otel_session._hosts import Route

BAGGAGE = "baggage"
TRACEPARENT = "traceparent"
_SESSION_FIRST = (SESSION_KEY, PARENT_KEY)

Edit = tuple[str, "str | None"]  # (header name, value to set, or None to take the header away)


class Offer(NamedTuple):
    """What the current context offers a request: the session, its baggage, the span to name.

    A tuple, not a dataclass: one is made at the first request of every trajectory.
    """

    session: str | None = None
    parent: str | None = None
    baggage: Mapping[str, object] = MappingProxyType({})
    traceparent: str | None = None
    pinned: bool = True  # False once the session's router refused it for want of room (``_hop.unpin``)

    @property
    def trace_id(self) -> str | None:
        return _w3c.trace_id_of(self.traceparent) if self.traceparent else None


NO_OFFER = Offer()


def names_for(route: Route) -> tuple[str, ...]:
    """The lower-case header names ``plan`` reads for ``route``: all a carrier adapter must look up."""
    found = _names.get(id(route))  # by identity: routes are few and kept, and hashing one is slow
    if found is not None and found[0] is route:
        return found[1]
    names = [BAGGAGE, TRACEPARENT]
    if route.profile is not None:
        names.append(route.profile.session_header.lower())
        if route.profile.parent_header is not None:
            names.append(route.profile.parent_header.lower())
    if len(_names) >= 256:
        _names.clear()
    _names[id(route)] = (route, tuple(names))
    return tuple(names)


_names: dict[int, tuple[Route, tuple[str, ...]]] = {}


def plan(
    route: Route,
    offer: Offer,
    held: Mapping[str, str],
    *,
    callers_only: bool = True,
    replaceable: frozenset[str] = frozenset(),
) -> list[Edit]:
    """The edits that make a request to ``route`` carry exactly what it may.

    ``held`` maps lower-case names (those of ``names_for(route)``) to the values the request has.
    ``callers_only``: everything held was set by the caller (the client instrumentors' case);
    otherwise a stock propagator may have copied our members there, and those are taken back where
    they must not go. ``replaceable``: names held only because otel-session set them earlier in this
    hop, which may be rewritten (the client span's ``traceparent`` replaces the trajectory's).
    """
    edits: list[Edit] = []
    profile = route.profile
    if profile is not None and offer.session is not None and offer.pinned and profile.accepts(offer.session):
        name = profile.session_header
        if name.lower() not in held or name.lower() in replaceable:
            edits.append((name, offer.session))
            parent, parent_name = offer.parent, profile.parent_header
            if (
                parent_name is not None
                and parent is not None
                and profile.accepts(parent)
                and (parent_name.lower() not in held or parent_name.lower() in replaceable)
            ):
                edits.append((parent_name, parent))
    theirs = None if BAGGAGE in replaceable else held.get(BAGGAGE)
    if route.trusted:
        if offer.baggage:
            if theirs is None:
                value = _w3c.encode_baggage(offer.baggage, _SESSION_FIRST)
            else:
                value = _w3c.merge_baggage(theirs, offer.baggage, _SESSION_FIRST)
            if value is not None and value != held.get(BAGGAGE):
                edits.append((BAGGAGE, value))
    elif not callers_only and theirs is not None and offer.session is not None:
        ours = {SESSION_KEY: offer.session}
        if offer.parent is not None:
            ours[PARENT_KEY] = offer.parent
        rest = _w3c.without_members(theirs, ours)
        if rest is not theirs:
            edits.append((BAGGAGE, rest))
    held_parent = held.get(TRACEPARENT)
    if route:
        if offer.traceparent is not None and (held_parent is None or TRACEPARENT in replaceable):
            edits.append((TRACEPARENT, offer.traceparent))
    elif (
        not callers_only
        and held_parent is not None
        and offer.trace_id is not None
        and _w3c.trace_id_of(held_parent) == offer.trace_id
    ):
        edits.append((TRACEPARENT, None))
    return edits
