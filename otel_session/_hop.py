"""One hop of one request: what the current context offers, and what a hop to one destination carries.

A client instrumentation asks ``current()`` what the context offers (``None``: nothing, so the usual
request outside a trajectory never reads its URL), then ``Offered.plan`` for the destination it is
about to dial. The ``Plan`` is the policy's answer for a request holding none of ``Plan.names``; a
request that holds one is planned afresh with ``Plan.given``. The instrumentation applies the edits to
that hop's headers only, and where an upstream instrumentation may inject later in the hop it puts
``Plan.hop`` in the context, so the propagator gives the same answer.

Plans are remembered per context and destination: a trajectory sends many requests to a few hosts
from one context, and a ``Context`` is immutable, so one context always offers the same. (Over 300
lines: the plans, the sessions unpinned after their router refused them, and the once-per-process
lines about requests outside any trajectory all answer from the same context and configuration.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import NamedTuple

from opentelemetry import baggage, trace
from opentelemetry.context import Context, get_current

from otel_session import _faults, _fleet, _metrics, _prompts, _settings, _siblings, _w3c
from otel_session._context import ROUTER_VISITS_KEY, SIBLINGS_KEY, session_ids
from otel_session._hosts import NOWHERE, Route, canonical_origin
from otel_session._policy import Edit, Offer, names_for, plan
from otel_session._session_end import Visit

PLANS_KEPT = 64  # destinations remembered per context: a trajectory talks to a handful of hosts
Destination = tuple[str, "str | None", "int | None"]  # (scheme, host, port) as the client dials them


class Hop(NamedTuple):
    """What the propagator needs to know of the hop in progress: its route, the header names we
    added, and the headers object it is for.

    ``carrier`` binds the hop to its own headers: everything run in the hop's context sees the hop
    (a client's trace callbacks, a body-streaming task that keeps a copy of the context), and a
    request sent from there injects into a carrier of its own, which gets nothing. The check can only
    ever withhold, never grant.
    """

    route: Route
    added: frozenset[str]
    carrier: object | None = None


class Plan:
    """What one hop to one destination carries, from one context under one configuration.

    ``edits`` hold for a request holding none of ``names`` (lower-case; ``raw_names`` the same as
    bytes, as HTTP/1 clients keep them). ``wire`` is ``edits`` as (name, lower-case name, value)
    byte triples, or ``None`` where one takes a header away or is not ASCII.
    """

    __slots__ = (
        "_note", "_offered", "added", "destination", "edits", "hop", "names", "raw_names", "route", "watched",
        "wire",
    )  # fmt: skip

    def __init__(self, offered: Offered, route: Route, destination: Destination, edits: list[Edit]) -> None:
        self._offered = offered
        self.destination = destination
        self.route = route
        self.names = names_for(route)
        self.raw_names = frozenset(name.encode("latin-1") for name in self.names)
        self.edits = edits
        self.added = frozenset(name.lower() for name, value in edits if value is not None)
        self.hop = Hop(route, self.added)
        self.watched = offered.watched
        wire = [
            (name.encode("ascii"), name.lower().encode("ascii"), value.encode("ascii"))
            for name, value in edits
            if value is not None and name.isascii() and value.isascii()
        ]
        self.wire = tuple(wire) if len(wire) == len(edits) else None
        self._note = offered.note(route, edits, destination)

    def given(self, held: Mapping[str, str], callers_only: bool) -> Plan:
        """This hop for a request that holds ``held`` (lower-case names of ``names``): planned afresh.

        ``callers_only=False`` where a stock propagator composed with ours may have copied our values
        into the request: what is recognisably ours is then taken back where it must not go.
        """
        if not held:
            return self  # the answer remembered is the answer for a request holding none of them
        if not self.route and callers_only:
            return self  # goes nowhere, and everything it holds is its caller's: nothing to do
        edits = plan(self.route, self._offered.offer, held, callers_only=callers_only)
        return Plan(self._offered, self.route, self.destination, edits)

    def delivered(self) -> None:
        """Record, where sessions are ended, that this hop took the session to its router (and count
        a request to a router host)."""
        if self.route.profile is not None and _metrics.recording():  # no provider: nothing to count into
            _metrics.sent(self.route.profile, self.destination, self._offered.offer.session)
        note = self._note
        if note is not None:
            note[0].add(note[1])


class Offered:
    """What one context offers a request under one configuration, and the plans made from it."""

    __slots__ = ("_plans", "context", "due", "offer", "offers", "settings", "undecided", "watched")

    def __init__(self, settings: _settings.Settings, context: Context, offer: Offer) -> None:
        if unpinned and offer.session in unpinned:
            offer = offer._replace(pinned=False)
        self.settings = settings
        self.context = context
        self.offer = offer
        # the attempt's group, still to be read from its first request to a router (``decide``)
        self.undecided = _undecided(context) if offer.parent is None and offer.session is not None else None
        # tracing is on or a span is current: an upstream instrumentation may inject later in the hop
        self.watched = settings.tracing or offer.traceparent is not None
        self.offers = offer.session is not None or bool(offer.baggage) or self.watched
        # a parent named whose turn at the router may still be to come (``_gathering``, ``_pacing``)
        self.due = offer.parent is not None and offer.pinned
        self._plans: dict[Destination, Plan] = {}

    def plan(self, scheme: str, host: str | None, port: int | None) -> Plan:
        """The plan for a hop to this destination, remembered."""
        destination = (scheme, host, port)
        found = self._plans.get(destination)
        if found is None:
            if len(self._plans) >= PLANS_KEPT:
                self._plans.clear()
            route = self.settings.rules.route(scheme, host, port) if host else NOWHERE
            if untold and route.profile is not None and self.offer.session is None:
                outside(scheme, host, port)
            policy = self.settings.siblings
            # Groups sized as they open need the router's fleet size: read it before it is needed.
            profile = route.profile
            if host and profile is not None and profile.parent_header and _siblings.needs_fleet_size(policy):
                _fleet.size_at((scheme, host, port), policy.withholds)
            found = Plan(self, route, destination, plan(route, self.offer, {}) if route else [])
            self._plans[destination] = found
        return found

    def decide(self, body: bytes | bytearray | memoryview | str | None, destination: Destination) -> Offered:
        """The first request to a router of an attempt whose group is still to read, whose serialized
        body is ``body`` (``None``: not readable cheaply) and which goes to ``destination``: its prompt
        (or the attempt's ``group=``) decides the attempt's group and parent, kept for every later
        request; what the context offers from now on."""
        holder = self.undecided
        if holder is None:
            return self
        if holder.decided:  # decided already, where the request waited for its turn (``_gathering``)
            return self.decided(holder.decide(None), holder.withheld)
        workers = None
        if holder.policy.sized:  # K from the router's fleet size: a router given no parent needs none
            profile = self.plan(*destination).route.profile
            scheme, host, port = destination
            if profile is None or profile.parent_header is None or not host:
                workers = _siblings.UNREADABLE
            elif holder.policy.withholds and (router := _metrics.router_of(profile, host, port)) in crowded:
                holder.withhold()
                _withheld_at(router)
                return self.decided(None, True)
            elif _siblings.needs_fleet_size(holder.policy):
                workers = _fleet.size_at((scheme, host, port), holder.policy.withholds)
        parent = holder.decide(_prompts.key_of(body), workers)
        if holder.policy.sized:
            _chose(holder, workers)
        return self.decided(parent, holder.withheld)

    def decided(self, parent: str | None, withheld: bool = False) -> Offered:
        """What the context offers once its attempt's parent is known (remembered in its place);
        ``withheld``: ``fleet`` sends the attempt without its session (baggage still goes as told)."""
        global _last
        if parent is None and not withheld:  # no group: this offer holds as it is, and its plans too
            self.undecided = None
            return self
        offer = self.offer._replace(parent=parent, pinned=self.offer.pinned and not withheld)
        found = Offered(self.settings, self.context, offer)
        if _last is self:
            _last = found
        return found

    def note(
        self, route: Route, edits: list[Edit], destination: Destination
    ) -> tuple[set[Visit], Visit] | None:
        """Where sessions are ended: the trajectory's set of routers reached, and this hop's router
        if the hop delivers the session to one."""
        profile = route.profile
        if not self.settings.end_sessions or profile is None or not edits or not destination[1]:
            return None
        if edits[0][0] != profile.session_header:
            return None
        visits = self.context.get(ROUTER_VISITS_KEY)
        if not isinstance(visits, set):
            return None
        scheme, host, port = destination
        return visits, (profile.name, *canonical_origin(scheme, host or "", port))


def offer_for(ctx: Context, tracing: bool) -> Offer:
    """What ``ctx`` offers a request, with tracing on or off."""
    session, parent = session_ids(ctx)
    if parent is None and session is not None:
        holder = ctx.get(SIBLINGS_KEY)
        if isinstance(holder, _siblings.Inferred):
            parent = holder.parent  # decided by the attempt's first request to a router (header only)
            if holder.withheld:  # ``fleet`` chose to send this attempt without its session
                traceparent = _passed_on(trace.get_current_span(ctx), tracing)
                return Offer(session, None, baggage.get_all(ctx), traceparent, pinned=False)
    return Offer(session, parent, baggage.get_all(ctx), _passed_on(trace.get_current_span(ctx), tracing))


_said: list[tuple[bool, int | None]] = []  # the last K said (and whether sized): said again when it changes
CROWDS = (  # said after K where ``auto`` pins a step ``fleet`` would withhold (``_siblings.unshared``)
    "; the busiest worker holds more than sharing a prompt saves, where kv routing alone measured the "
    "shorter step: OTEL_SESSION_SIBLINGS=fleet sends such a step without sessions"
)


def _chose(holder: _siblings.Inferred, workers: int | None) -> None:
    """``auto`` or ``fleet`` decided an attempt: the choice counted, and said where it is new (a K
    sized to the fleet, or the session withheld); the default's K before sizing is said nowhere."""
    ticket = holder.key
    if ticket is None:
        return  # no group read (a streamed body): the attempt goes alone, as under any policy
    choice = "withheld" if holder.withheld else "sized" if ticket.sized else "default"
    _count_choice(choice, ticket.size)
    if choice == "default" or (_said and _said[-1] == (ticket.sized, ticket.size)):
        return
    _said[:] = [(ticket.sized, ticket.size)]
    if choice == "withheld" and ticket.sized:
        groups, siblings = _siblings.last_shape()
        _faults.warn(
            "otel-session: OTEL_SESSION_SIBLINGS=fleet sends this step's attempts without their session: "
            "%d groups of %d siblings on %d workers would put more on the busiest worker than sharing a "
            "prompt saves (pinned, 6 pairs on 4 workers took 1.35-1.38x kv routing alone's step), so "
            "the router places them as it would without otel-session",
            groups,
            siblings,
            workers,  # sized: the router's size was read
        )
        return
    if choice == "withheld":
        why = "its /health is still being read" if workers is None else "no step has ended here yet"
        _faults.warn(
            "otel-session: OTEL_SESSION_SIBLINGS=fleet sends attempts without their session until it "
            "can size sibling groups to the router's fleet (%s): the router places them as it would "
            "without otel-session",
            why,
        )
        return
    groups, siblings = _siblings.last_shape()
    size = max(1, ticket.size or 1)
    parents = groups * -(-siblings // size)  # groups of K, over the whole step
    whole, rest = divmod(siblings, size)
    split = f" (each prompt's {siblings} as {' + '.join([str(size)] * whole + [str(rest)])})" if rest else ""
    sharing = workers and parents > workers
    shared = f"{parents} groups: some share a worker" if sharing else "one group per worker"
    crowds = bool(sharing) and _siblings.unshared(workers or 0, groups, siblings, size)
    _faults.warn(
        "otel-session: siblings sized to the fleet: %s (%d workers; %s %d groups of up to %d siblings "
        "open at once: %s)%s",
        "each alone under its own session" if ticket.size == 1 else f"{ticket.size} per parent session",
        workers or 0,
        "the step before had" if _siblings.step_seen() else "this step has",
        groups,
        siblings,
        shared + split,
        CROWDS if crowds else "",
    )


def _count_choice(choice: str, size: int | None) -> None:
    """One attempt decided under ``auto`` or ``fleet``, counted with its K where it has one."""
    if _metrics.recording():
        attributes: dict[str, object] = {"otel_session.siblings.choice": choice}
        if size is not None:
            attributes["otel_session.siblings.size"] = size
        _metrics.count(_metrics.sibling_choices, 1, attributes)


def _withheld_at(router: _metrics.Router) -> None:
    """``fleet`` sent an attempt without its session because pinning crowded ``router``'s workers:
    counted, and said once per router."""
    _count_choice("withheld", None)
    with _crowded_lock:
        if router in _crowded_said:
            return
        _crowded_said.add(router)
    _faults.warn(
        "otel-session: OTEL_SESSION_SIBLINGS=fleet sends new attempts to %s router %s:%s without their "
        "session from now on: sessions pinned there crowded a few workers while others idled (a GRPO "
        "step waits for its slowest trajectory), so kv routing alone places them; unconfigure() and "
        "configure() again to try pinning anew",
        *router,
    )


def sends_session(ctx: Context, session: str) -> bool:
    """Whether requests of ``ctx``'s attempt (session ``session``) carry it to their router: not one
    ``fleet`` withheld, nor one unpinned after its router refused it (their turns land where the
    router alone places them, which says nothing of affinity)."""
    holder = ctx.get(SIBLINGS_KEY)
    if isinstance(holder, _siblings.Inferred) and holder.withheld:
        return False
    return session not in unpinned


def _undecided(ctx: Context) -> _siblings.Inferred | None:
    """The group of ``ctx``'s attempt, if its first request to a router is still to decide it."""
    holder = ctx.get(SIBLINGS_KEY)
    return holder if isinstance(holder, _siblings.Inferred) and not holder.decided else None


def _passed_on(span: trace.Span, tracing: bool) -> str | None:
    """The ``traceparent`` naming ``span``, where it may be passed on at all: with tracing off a
    caller's extracted span is not, only spans recorded here are."""
    span_context = span.get_span_context()
    traced = span_context.is_valid and (tracing or not span_context.is_remote)
    return _w3c.traceparent(span_context) if traced else None


# The last context asked about. Swapped whole, and its dicts only gain or lose whole entries, so
# threads need no lock: the worst case is a plan made twice.
_last: Offered | None = None


def current(ctx: Context | None = None) -> Offered | None:
    """What a request sent now (from ``ctx``, by default the current context) is offered; ``None``
    when nothing at all: no configuration, or no session, baggage or span to pass on."""
    global _last
    settings = _settings.current
    if settings is None:
        return None
    if ctx is None:
        ctx = get_current()
    last = _last
    if last is None or last.context is not ctx or last.settings is not settings:
        last = _last = Offered(settings, ctx, offer_for(ctx, settings.tracing))
    return last if last.offers else None


def entered(ctx: Context, session: str, parent: str | None, span: trace.Span) -> None:
    """``trajectory()`` is making ``ctx`` current with ``session`` (and ``parent``) and ``span``:
    remember what it offers from those, so its first request does not read them back."""
    global _last
    settings = _settings.current
    if settings is None:
        return
    try:
        offer = Offer(session, parent, baggage.get_all(ctx), _passed_on(span, settings.tracing))
        _last = Offered(settings, ctx, offer)
    except Exception as exc:  # a bug of ours must not fail the trajectory: its first request reads it
        _faults.report("remembering what a trajectory offers", exc)


# No request to a router host has been seen outside any trajectory yet (``outside``).
untold = True
# The named trajectory boundaries applied in this process, kept by instrumentation/boundaries: the
# line ``outside`` logs names what is in force here, never a preset whose framework never arrived.
boundaries_in_force: set[str] = set()


def _boundaries_said() -> str:
    named = sorted(boundaries_in_force)
    if not named:
        return "no named boundary is in force in this process"
    return f"the boundaries in force in this process ({', '.join(named)}) did not enclose it"


def outside(scheme: str, host: str | None, port: int | None) -> None:
    """A request sent outside any trajectory: the first one to a router host says so, once per
    process, with how to give it a boundary. It still goes out as it is, with no session."""
    global untold
    settings = _settings.current
    route = settings.rules.route(scheme, host, port) if settings is not None and host else NOWHERE
    if route.profile is None or not untold:
        return
    untold = False
    with contextlib.suppress(Exception):
        _faults.warn(
            "otel-session: a request to %s router %s was sent outside any trajectory, so it carries no "
            "session (%s); give its rollout a boundary: otel_session.trajectory(), "
            "OTEL_SESSION_TRAJECTORY_FUNCTIONS=module:function, or a framework instrumentor (NeMo-RL's "
            "applies when nemo_rl's rollout modules are imported); if it was sent from a thread or pool "
            "inside a trajectory, hand the work over with otel_session.bind(). Logged once per process.",
            route.profile.name,
            f"{host}:{port}" if port is not None else host,
            _boundaries_said(),
        )


unconfigured_untold = True


def unconfigured() -> None:
    """The first trajectory (or ``resume``) of a process where otel-session is not configured says
    so, once: its requests carry no session, and without a word that looks like a working setup."""
    global unconfigured_untold
    if not unconfigured_untold:
        return
    unconfigured_untold = False
    with contextlib.suppress(Exception):
        _faults.warn(
            "otel-session: a trajectory started (or was resumed) but otel-session is not configured in "
            "this process, so no request carries its session; call otel_session.configure(dynamo_hosts="
            "[...]), run under opentelemetry-instrument with OTEL_PYTHON_DISTRO=otel_session, or set "
            "OTEL_SESSION_AUTO=true (a Ray worker, a child process). Logged once per process."
        )


def forget() -> None:
    """Drop what was remembered (a forked child starts from a context of its own)."""
    global _last
    _last = None


# Routers whose pinned sessions crowded a few workers while others idled (``_evidence``): under
# ``fleet`` their new attempts go without the session, as under kv routing alone.
crowded: set[_metrics.Router] = set()
_crowded_said: set[_metrics.Router] = set()
_crowded_lock = threading.Lock()


def pinning_crowds(router: _metrics.Router) -> None:
    """The evidence saw pinning cost step time at ``router`` (the routers are the configuration's)."""
    crowded.add(router)


def forget_crowding() -> None:
    """Drop the routers seen crowded and the K last said (a new configuration)."""
    crowded.clear()
    _crowded_said.clear()
    _said.clear()


UNPINNED_KEPT = 16_384  # sessions remembered: more than any run keeps in flight
# Sessions whose router refused them for want of room: the rest of their attempt goes unpinned.
unpinned: dict[str, None] = {}
_unpin_lock = threading.Lock()


def unpin(session: str) -> bool:
    """From now on, requests of ``session`` carry no router's session header (availability over
    affinity: the router refused it, and a retry pinned again would be refused again). ``True`` the
    first time for this session."""
    with _unpin_lock:
        if session in unpinned:
            return False
        if len(unpinned) >= UNPINNED_KEPT:
            unpinned.pop(next(iter(unpinned)), None)
        unpinned[session] = None
    forget()  # the plans remembered for the current context still pin it
    return True
