"""The one destination policy, ``_policy.plan``, as properties over any route, offer and held headers.

``plan`` is pure, so each property runs 10,000 generated cases in-process: routes built from the
real router profiles, offers as a trajectory's context can hold them (any baggage, any sizes), and
what a request may already hold (a caller's own headers, or what a stock propagator copied there).
Decoding is checked with OpenTelemetry's own ``W3CBaggagePropagator``, not with our ``_w3c``.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry import baggage
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context

from otel_session import _policy, _w3c
from otel_session._hosts import NOWHERE, Route
from otel_session._policy import BAGGAGE, TRACEPARENT, Offer, names_for, plan
from otel_session._routers import BUILTIN, DYNAMO, Profile, profile_named
from tests.generated import MANY

SESSION_KEY, PARENT_KEY = "session.id", "session.parent_id"
PROFILES: list[Profile | None] = [
    None,
    *BUILTIN.values(),
    profile_named("header:X-Custom-Key"),
    profile_named("header:X-Session-ID"),  # the same header as vllm-router's, spelt as a custom one
    Profile("short-ids", "X-Short", "X-Short-Parent", max_id_bytes=8),
]
ALL_PROFILE_HEADERS = {
    name.lower()
    for profile in PROFILES
    if profile is not None
    for name in (profile.session_header, profile.parent_header)
    if name is not None
}
VISIBLE = "".join(chr(code) for code in range(0x21, 0x7F))
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
OUR_TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
_extractor = W3CBaggagePropagator()


@pytest.fixture(autouse=True)
def _quiet_extractor() -> Iterator[None]:
    """OpenTelemetry's extractor logs every malformed member it skips: thousands of lines here."""
    logger = logging.getLogger("opentelemetry.baggage")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


ROUTES = st.builds(Route, st.sampled_from(PROFILES), st.booleans())
SESSIONS = st.one_of(
    st.uuids().map(str),
    st.sampled_from(["episode:42", "a,b;c=d", "100%", "x+y", 'q"\\', "s" * 9, "%" * 256]),
    st.text(VISIBLE, min_size=1, max_size=24),
)
MAYBE_SESSION = st.one_of(st.none(), SESSIONS)
KEYS = st.one_of(
    st.sampled_from(["tenant", "user.id", "k", "a%41", "k+b", "bad key", "é", "", "x=y", "a,b"]),
    st.text(VISIBLE, min_size=1, max_size=12),
)
VALUES = st.one_of(
    st.text(max_size=20),
    st.text(VISIBLE, max_size=40),
    st.sampled_from([" padded ", "a b", "x+y", "%41", "é", ""]),
    st.builds(
        lambda unit, count: unit * count, st.sampled_from(["v", "%", "é", ","]), st.integers(100, 5000)
    ),
    st.integers(),
)
ENTRIES = st.lists(st.tuples(KEYS, VALUES), max_size=8)
MANY_MEMBERS = st.sampled_from([0] * 9 + [100, 179, 200])  # past the 180 a receiver reads, sometimes
TRACEPARENTS = st.sampled_from([None, OUR_TRACEPARENT])
SEEDS = st.integers(0, 2**32 - 1)
SMALL = st.integers(0, 9)
SEPARATORS = st.sampled_from([",", ", ", " ,"])
LEADING = st.sampled_from(["", " ", "\t", "  ", "\xa0", "\x85"])
TRAILING = st.sampled_from(["", " ", "\t"])
THEIR_MEMBERS = st.sampled_from(["tenant=acme", "session.id=theirs", "k=v;p=1", "junk"])
HUGE = st.sampled_from(["k=" + "v" * 8180, "k=" + "é" * 4500, ",".join(["m=v"] * 185)])
SHORT_TEXT = st.text(max_size=12)
OTHER_MEMBERS = st.one_of(
    st.sampled_from(["tenant=acme", "session.id=not-ours", "junk", "session.idx=1", "=x", " k = v "]),
    st.builds(lambda key, value: f"{key}={value}", KEYS, st.text(VISIBLE, max_size=10)),
)
PROPERTIES = st.sampled_from(["", ";p", ";p=1", " ; x"])
HELD_TRACEPARENTS = st.sampled_from([OUR_TRACEPARENT, f"00-{'1' * 32}-{'2' * 16}-01", "junk"])


@st.composite
def offers(draw: st.DrawFn) -> Offer:
    """What a trajectory's context offers: its session in its baggage, as ``_hop.offer_for`` reads it."""
    session = draw(MAYBE_SESSION)
    parent = draw(MAYBE_SESSION) if session is not None else None
    entries: dict[str, object] = dict(draw(ENTRIES))
    entries.update({f"m{index}": "v" for index in range(draw(MANY_MEMBERS))})
    if session is not None:
        entries[SESSION_KEY] = session
        if parent is not None:
            entries[PARENT_KEY] = parent
    return Offer(session, parent, entries, draw(TRACEPARENTS))


def encoded(value: str, seed: int) -> str:
    """``value`` percent-encoded as any W3C encoder may: per character, or not, upper or lower hex."""
    rng = random.Random(seed)
    out = []
    for char in value:
        how = rng.randrange(4)
        if how == 0 and char not in '%+,; "\\' and char.isprintable() and char.isascii():
            out.append(char)
        elif how == 1 and char == " ":
            out.append("+")
        else:
            escaped = "".join(f"%{byte:02X}" for byte in char.encode("utf-8"))
            out.append(escaped.lower() if how == 2 else escaped)
    return "".join(out)


@st.composite
def held_baggage(draw: st.DrawFn, offer: Offer) -> str:
    """A baggage value a request may hold: a caller's own, or ours as a stock propagator wrote it."""
    members = []
    for _ in range(draw(SMALL) // 2):
        choice = draw(SMALL)
        if choice == 0 and offer.session is not None:
            members.append(f"session.id={encoded(offer.session, draw(SEEDS))}")
        elif choice == 1 and offer.parent is not None:
            members.append(f"session.parent_id={encoded(offer.parent, draw(SEEDS))}")
        elif choice < 5:
            members.append(draw(THEIR_MEMBERS))
        else:
            members.append(f"{draw(KEYS)}={draw(SHORT_TEXT)}")
    text = draw(SEPARATORS).join(members) if draw(SMALL) else draw(HUGE)
    return draw(LEADING) + text + draw(TRAILING)


@st.composite
def held_headers(draw: st.DrawFn, route: Route, offer: Offer) -> dict[str, str]:
    """Lower-case name -> value for a subset of the names ``plan`` reads for ``route``."""
    held: dict[str, str] = {}
    for name in names_for(route):
        choice = draw(SMALL)
        if choice < 5:
            continue
        if name == BAGGAGE:
            held[name] = draw(held_baggage(offer))
        elif name == TRACEPARENT:
            held[name] = draw(HELD_TRACEPARENTS)
        else:
            held[name] = (offer.session or "theirs") if choice < 7 else "" if choice < 8 else draw(SHORT_TEXT)
    return held


Case = tuple[Route, Offer, dict[str, str], bool, frozenset[str]]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    route, offer = draw(ROUTES), draw(offers())
    held = draw(held_headers(route, offer))
    callers_only = draw(st.booleans())
    names = names_for(route)
    replaceable = frozenset() if callers_only else frozenset(n for n in names if draw(SMALL) < 3)
    return route, offer, held, callers_only, replaceable


def _stripped(header: str) -> str:
    return header.strip(" \t")  # optional whitespace: what HTTP itself does not count as the value


def _our_part(value: str, theirs: str | None) -> str:
    """What ``plan`` appended to ``theirs`` (the whole value where it held none)."""
    if theirs is None or not _stripped(theirs):
        return value
    prefix = _stripped(theirs)
    assert value == prefix or value.startswith(prefix + ","), (theirs, value)
    return value[len(prefix) + 1 :]


def _otel_read(header: str) -> dict[str, object]:
    return dict(baggage.get_all(_extractor.extract({"baggage": header}, Context())))


def _otel_counted(header: str) -> int:
    """List members a receiving OpenTelemetry counts towards its limit of 180."""
    return sum(
        1
        for entry in re.split(r"[ \t]*,[ \t]*", header)
        if entry and entry.isascii() and len(entry) <= _w3c.MAX_MEMBER_BYTES
    )


def test_plan_keeps_every_rule_for_any_route_offer_and_held_headers() -> None:
    """(a), (b), (c) and the route of every other host, each on the same 10,000 generated cases
    (generating a case costs ten times checking it, so one run checks them all)."""

    @MANY
    @given(cases())
    def check(case: Case) -> None:
        a_callers_headers_are_never_removed_or_changed(case)
        b_a_route_gains_only_its_own_profiles_headers(case)
        c_emitted_baggage_fits_and_decodes_to_what_was_offered(case)
        c_the_session_reaches_a_trusted_route_whenever_the_caller_left_room(case)
        nowhere_gets_nothing_and_takes_back_only_what_is_ours(case)

    check()


def a_callers_headers_are_never_removed_or_changed(case: Case) -> None:
    """(a) With only the caller's headers held, nothing is taken away or rewritten; baggage to a trusted
    host is theirs byte for byte (less HTTP's optional whitespace) with ours after it."""
    route, offer, held, _, _ = case
    for name, value in plan(route, offer, held):
        assert value is not None, name
        lower = name.lower()
        if lower in held:
            assert lower == BAGGAGE and route.trusted, (name, held, value)
            _our_part(value, held[lower])


def b_a_route_gains_only_its_own_profiles_headers(case: Case) -> None:
    """(b) No profile: no session header of any profile. A profile: its own headers, nothing else."""
    route, offer, held, callers_only, replaceable = case
    edits = plan(route, offer, held, callers_only=callers_only, replaceable=replaceable)
    own = set()
    if route.profile is not None:
        own = {route.profile.session_header, route.profile.parent_header} - {None}
    for name, value in edits:
        if name.lower() in ALL_PROFILE_HEADERS:
            assert name in own, (route, name)
            assert value is not None
        else:
            assert name.lower() in (BAGGAGE, TRACEPARENT), name
        if name.lower() == BAGGAGE and not route.trusted:  # only ever a take-back of copied members
            assert not callers_only and BAGGAGE in held, (route, value)
            theirs = {_stripped(member) for member in held[BAGGAGE].split(",")}
            assert value is None or set(value.split(",")) <= theirs, (held, value)
        if name.lower() == TRACEPARENT and value is not None:
            assert route and value == offer.traceparent, (route, value)
    written = dict(edits)
    profile = route.profile
    if profile is not None:
        expected = offer.session if offer.session is not None and profile.accepts(offer.session) else None
        name = profile.session_header
        if name.lower() in held and name.lower() not in replaceable:
            expected = None
        assert written.get(name) == expected, (profile, offer.session, held)
        if profile.parent_header is not None and profile.parent_header in written:
            assert expected is not None and written[profile.parent_header] == offer.parent


def c_emitted_baggage_fits_and_decodes_to_what_was_offered(case: Case) -> None:
    """(c) Within 8192 bytes (or the caller's own, never grown), ``session.id`` first whenever the
    caller left room for it, and every member we wrote reads back through OpenTelemetry's extractor
    as the key and value offered (as OpenTelemetry's own round trip gives it: whitespace trimmed)."""
    route, offer, held, callers_only, replaceable = case
    edits = dict(plan(route, offer, held, callers_only=callers_only, replaceable=replaceable))
    value = edits.get(BAGGAGE)
    if not route.trusted or value is None:
        return
    theirs = None if BAGGAGE in replaceable else held.get(BAGGAGE)
    ours = _our_part(value, theirs)
    if len(value.encode("utf-8")) > _w3c.MAX_HEADER_BYTES:
        assert theirs is not None and not ours and len(value) <= len(theirs), len(value)
    if not ours:
        return
    assert _otel_counted(value) <= _w3c.MAX_MEMBERS, "a receiver would drop what we appended"
    read = _otel_read(ours)
    assert len(read) == len(ours.split(",")), ours  # each member we wrote is one OpenTelemetry reads
    for key, got in read.items():
        assert key in offer.baggage, (key, ours)
        assert got == str(offer.baggage[key]).strip(), (key, got, offer.baggage[key])
    if offer.session is None:
        return
    theirs_keys = {key for key, _, _ in _w3c.decoded_members(theirs or "")}
    if SESSION_KEY not in theirs_keys:
        assert ours.startswith("session.id="), ours
        assert read[SESSION_KEY] == offer.session


def c_the_session_reaches_a_trusted_route_whenever_the_caller_left_room(case: Case) -> None:
    """(c) A trusted route always gets ``session.id`` unless the caller's own baggage names one or
    leaves no room for it."""
    route, offer, held, callers_only, replaceable = case
    if not route.trusted or offer.session is None:
        return
    value = dict(plan(route, offer, held, callers_only=callers_only, replaceable=replaceable)).get(BAGGAGE)
    theirs = None if BAGGAGE in replaceable else held.get(BAGGAGE)
    if theirs is None or not _stripped(theirs):
        assert value is not None and _otel_read(value).get(SESSION_KEY) == offer.session, value
        return
    if SESSION_KEY in {key for key, _, _ in _w3c.decoded_members(theirs)}:
        return
    needed = len(_stripped(theirs).encode("utf-8")) + len(",session.id=") + len(quote(offer.session))
    if needed <= _w3c.MAX_HEADER_BYTES and _otel_counted(theirs) < _w3c.MAX_MEMBERS:
        assert value is not None, theirs
        assert _otel_read(_our_part(value, theirs)).get(SESSION_KEY) == offer.session


def test_take_back_removes_ours_however_encoded_and_keeps_every_other_member() -> None:
    """(d) ``without_members``: our members go whatever their percent-encoding; the rest stay as text."""

    @MANY
    @given(
        SESSIONS,
        MAYBE_SESSION,
        st.lists(st.tuples(SMALL, SEEDS, OTHER_MEMBERS, PROPERTIES), max_size=8),
        SEPARATORS,
    )
    def check(
        session: str, parent: str | None, drawn: list[tuple[int, int, str, str]], separator: str
    ) -> None:
        ours = {SESSION_KEY: session} if parent is None else {SESSION_KEY: session, PARENT_KEY: parent}
        members: list[tuple[bool, str]] = []
        for choice, seed, other, prop in drawn:
            if choice < 3:
                members.append((True, f"session.id={encoded(session, seed)}{prop}"))
            elif choice < 5 and parent is not None:
                members.append((True, f" session.parent_id = {encoded(parent, seed)}{prop}"))
            elif other.strip() and "," not in other and not _is_ours(other, ours):
                members.append((False, other))
        header = separator.join(text for _, text in members)
        result = _w3c.without_members(header, ours)
        kept = [_stripped(text) for is_ours, text in members if not is_ours and _stripped(text)]
        if not any(is_ours for is_ours, _ in members):
            assert result is header
            return
        assert (result.split(",") if result is not None else []) == kept, (header, result)
        if result is not None:
            assert session not in {v for k, v in _otel_read(result).items() if k == SESSION_KEY}

    check()


def _is_ours(text: str, ours: dict[str, str]) -> bool:
    """Plainly: the member's key is one of ours and its value, once percent-decoded, is ours."""
    key, sep, rest = text.partition("=")
    if not sep or key.strip() not in ours:
        return False
    raw = rest.split(";")[0].strip()
    decoded = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), raw.replace("+", " "))
    try:
        decoded = decoded.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return False
    return decoded == ours[key.strip()]


def nowhere_gets_nothing_and_takes_back_only_what_is_ours(case: Case) -> None:
    """The route of every other host: nothing added; where a stock propagator may have copied ours,
    only our members and our own ``traceparent`` are taken back."""
    _, offer, held, _, _ = case
    held = {name: value for name, value in held.items() if name in names_for(NOWHERE)}
    assert plan(NOWHERE, offer, held) == []
    for name, value in plan(NOWHERE, offer, held, callers_only=False):
        assert name in held
        if name == TRACEPARENT:
            assert value is None and held[name] == OUR_TRACEPARENT and offer.traceparent is not None
        else:
            assert name == BAGGAGE and offer.session is not None
            ours = {SESSION_KEY: offer.session}
            if offer.parent is not None:
                ours[PARENT_KEY] = offer.parent
            before = [_stripped(m) for m in held[BAGGAGE].split(",") if _stripped(m)]
            after = value.split(",") if value is not None else []
            assert after == [m for m in before if not _is_ours(m, ours)], (held, value)


def test_dynamo_receives_its_session_and_parent() -> None:
    """The everyday case, written out: Dynamo's two headers and, for a trusted Dynamo, baggage too."""
    offer = Offer("sess-1", "parent-1", {SESSION_KEY: "sess-1", PARENT_KEY: "parent-1", "tenant": "a b"})
    assert plan(Route(DYNAMO), offer, {}) == [
        ("X-Dynamo-Session-ID", "sess-1"),
        ("X-Dynamo-Parent-Session-ID", "parent-1"),
    ]
    assert plan(Route(DYNAMO, trusted=True), offer, {"baggage": "tenant=acme"})[-1] == (
        "baggage",
        "tenant=acme,session.id=sess-1,session.parent_id=parent-1",
    )


# ---- found by the properties above, written out -------------------------------------------------

TRUSTED = Route(None, trusted=True)
SESSION_ONLY = Offer("sess-1", None, {SESSION_KEY: "sess-1"})


def test_a_callers_baggage_is_kept_byte_for_byte() -> None:
    """Only HTTP's optional whitespace (space, tab) is not part of a value; a no-break space is."""
    assert plan(TRUSTED, SESSION_ONLY, {"baggage": "tenant=acme\xa0"}) == [
        ("baggage", "tenant=acme\xa0,session.id=sess-1")
    ]
    assert plan(TRUSTED, SESSION_ONLY, {"baggage": " tenant=acme\t"}) == [
        ("baggage", "tenant=acme,session.id=sess-1")
    ]


def test_a_baggage_key_reaches_opentelemetry_as_offered() -> None:
    """OpenTelemetry's extractor percent-decodes keys too: ``a%41`` written raw arrives as ``aA``."""
    offer = Offer("sess-1", None, {SESSION_KEY: "sess-1", "a%41": "x", "k+b": "y"})
    value = dict(plan(TRUSTED, offer, {}))["baggage"]
    assert value is not None
    read = _otel_read(value)
    assert all(offer.baggage.get(key) == got for key, got in read.items()), (value, read)


def test_what_is_appended_to_a_callers_baggage_fits_in_bytes() -> None:
    """The limit is 8192 bytes on the wire: 4,500 "é" are 4,502 characters but 9,002 bytes."""
    theirs = "k=" + "é" * 4500
    for name, value in plan(TRUSTED, SESSION_ONLY, {"baggage": theirs}):
        assert name != "baggage" or len(value or "") <= len(theirs), "grew a header past the limit"


def test_what_is_appended_to_a_callers_baggage_is_within_the_members_a_receiver_reads() -> None:
    """A receiver reads 180 list-members: appending ``session.id`` as the 186th sends it for nothing."""
    theirs = ",".join(["m=v"] * 185)
    for name, value in plan(TRUSTED, SESSION_ONLY, {"baggage": theirs}):
        if name == "baggage" and value is not None and value != theirs:
            assert _otel_read(value).get(SESSION_KEY) == "sess-1", "appended what no receiver reads"


def test_a_baggage_value_with_no_utf8_form_raises_nothing() -> None:
    """A lone surrogate (``baggage.set_baggage("note", "\\ud800")``) has no UTF-8 form."""
    offer = Offer("sess-1", None, {SESSION_KEY: "sess-1", "note": "\ud800"})
    edits = dict(plan(Route(DYNAMO, trusted=True), offer, {}))
    assert edits["X-Dynamo-Session-ID"] == "sess-1"
    assert _otel_read(edits["baggage"] or "").get(SESSION_KEY) == "sess-1"


def test_no_other_member_is_appended_where_the_session_did_not_fit() -> None:
    """Room for ``tenant=a`` but not for ``session.id``: foreign members go first, never ours."""
    theirs = "k=" + "v" * (_w3c.MAX_HEADER_BYTES - 20)
    offer = Offer("sess-" + "1" * 40, None, {SESSION_KEY: "sess-" + "1" * 40, "t": "a"})
    for name, value in plan(TRUSTED, offer, {"baggage": theirs}):
        assert name != "baggage" or value == theirs, f"appended {(value or '')[len(theirs) :]!r}"


# ---- pinned by the mutation run (scripts/mutate): each test below fails on a mutant that survived ----


def test_names_for_are_the_lower_case_names_plan_reads() -> None:
    assert names_for(Route(DYNAMO)) == (
        "baggage",
        "traceparent",
        "x-dynamo-session-id",
        "x-dynamo-parent-session-id",
    )
    assert names_for(Route(profile_named("header:X-Custom-Key"))) == (
        "baggage",
        "traceparent",
        "x-custom-key",
    )
    assert names_for(TRUSTED) == ("baggage", "traceparent")


def test_names_for_a_route_are_worked_out_once_and_kept_within_bounds() -> None:
    """Kept by the route's identity: the same tuple for the same route, a fresh answer for another
    route even where it reuses a forgotten route's ``id``; never more than 256 routes kept."""
    route = Route(DYNAMO)
    names_for(route)
    assert names_for(route) is names_for(route)
    gone = Route(BUILTIN["smg"])
    _policy._names[id(route)] = (gone, names_for(gone))  # as if ``route`` had reused a dead one's id
    assert names_for(route) == ("baggage", "traceparent", "x-dynamo-session-id", "x-dynamo-parent-session-id")
    kept = [Route(profile_named(f"header:X-K{i}")) for i in range(600)]
    largest = 0
    for other in kept:
        names_for(other)
        largest = max(largest, len(_policy._names))
    assert largest == 256


def test_a_span_to_name_goes_to_every_route_unless_the_caller_named_one() -> None:
    offer = Offer("sess-1", None, {SESSION_KEY: "sess-1"}, OUR_TRACEPARENT)
    for route in (Route(DYNAMO), TRUSTED, Route(DYNAMO, trusted=True)):
        assert (TRACEPARENT, OUR_TRACEPARENT) in plan(route, offer, {}), route
        theirs = {TRACEPARENT: f"00-{'1' * 32}-{'2' * 16}-01"}
        assert TRACEPARENT not in dict(plan(route, offer, theirs)), route
        replaced = plan(route, offer, theirs, callers_only=False, replaceable=frozenset({TRACEPARENT}))
        assert (TRACEPARENT, OUR_TRACEPARENT) in replaced, route
    assert plan(NOWHERE, offer, {}) == []


def test_what_otel_session_wrote_earlier_in_the_hop_is_rewritten_parent_included() -> None:
    offer = Offer("sess-1", "parent-1", {SESSION_KEY: "sess-1", PARENT_KEY: "parent-1"})
    held = {"x-dynamo-session-id": "old", "x-dynamo-parent-session-id": "old-parent"}
    names = frozenset(held)
    assert plan(Route(DYNAMO), offer, held, callers_only=False, replaceable=names) == [
        ("X-Dynamo-Session-ID", "sess-1"),
        ("X-Dynamo-Parent-Session-ID", "parent-1"),
    ]
    only_session = frozenset({"x-dynamo-session-id"})
    assert plan(Route(DYNAMO), offer, held, callers_only=False, replaceable=only_session) == [
        ("X-Dynamo-Session-ID", "sess-1")
    ]


def test_baggage_otel_session_wrote_earlier_in_the_hop_is_written_afresh() -> None:
    """Not merged into: members of an earlier answer (another session's) must not stay."""
    held = {"baggage": "session.id=old,tenant=stale"}
    replaced = plan(TRUSTED, SESSION_ONLY, held, callers_only=False, replaceable=frozenset({BAGGAGE}))
    assert replaced == [("baggage", "session.id=sess-1")]
    assert plan(TRUSTED, SESSION_ONLY, held, callers_only=False) == []  # a caller's: kept as is
