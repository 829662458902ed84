"""Hostile input, generated: inbound session headers and baggage, host patterns and destinations.

Every header a server receives is attacker-controlled, and so is any URL a tool call is pointed at.
Each generated target runs 10,000 cases in-process, 3,000 fixed ones in CI (the real extraction,
propagator, host rules, carrier adapters and client instrumentors; the clients over an in-memory
transport, so their own code runs) and checks what must hold whatever the input:

- nothing raises into the caller, except the documented ``ValueError`` naming a malformed host
  pattern; nothing is even swallowed by otel-session's own last-resort handlers (``_faults``);
- a session header we emit is 1 to 256 characters of visible ASCII; no header we write holds CR,
  LF, NUL or anything but printable ASCII (``tracestate`` may hold a space, as W3C allows);
- a router's session header reaches that router's hosts only (never another profile's header) and
  baggage trusted hosts only, judged by a separate, deliberately plain oracle from where the client
  actually connects (its ``raw_host``, scheme and port), not from otel-session's own normalization;
- the carrier adapters edit every header type exactly as its own public API would.

The loopback cases at the end send hostile headers through real servers (uvicorn + Starlette with
``otel_session.servers.SessionMiddleware``) that forward to a recording Dynamo.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import re
import socket
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import httpx
import httpx2
import pytest
import yarl
from hypothesis import assume, given
from hypothesis import strategies as st
from multidict import CIMultiDict, MultiDict
from opentelemetry import baggage, propagate
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route as StarletteRoute

import otel_session
from benchmarks._servers import canned_aiohttp_connector
from otel_session import _carriers, _faults, _settings
from otel_session._context import HOP_KEY, session_ids
from otel_session._hop import Hop, Offered, Plan, offer_for
from otel_session._hosts import NOWHERE, HostPattern, HostRules, Route, parse_patterns
from otel_session._policy import Offer, names_for, plan
from otel_session._propagator import SessionPropagator, extract_session
from otel_session._routers import BUILTIN, DYNAMO, Profile, profile_named
from otel_session._settings import Settings
from otel_session.instrumentation import aiohttp_client as aiohttp_hook
from otel_session.instrumentation import httpx as httpx_hook
from otel_session.instrumentation._base import ProbedTypes
from otel_session.servers import SessionMiddleware
from tests.generated import MANY
from tests.loopback import AsgiServer
from tests.recorder import Recorder, wait_until

SESSION_VALUE = re.compile(r"[\x21-\x7e]{1,256}")
VISIBLE_VALUE = re.compile(r"[\x21-\x7e]+")
PRINTABLE = re.compile(r"[\x20-\x7e]*")
VLLM = BUILTIN["vllm-router"]
CUSTOM = profile_named("header:X-Custom-Key")
PROFILES: tuple[Profile, ...] = (*BUILTIN.values(), CUSTOM)
# Every router profile's headers: a destination may receive its own profile's and no other's.
SESSION_NAMES = {
    name.lower() for profile in PROFILES for name in (profile.session_header, profile.parent_header) if name
}
OURS = {*SESSION_NAMES, "baggage", "traceparent", "tracestate"}
ROUTES = (
    NOWHERE,
    Route(DYNAMO),
    Route(None, trusted=True),
    Route(DYNAMO, trusted=True),
    Route(VLLM),
    Route(BUILTIN["smg"], trusted=True),
    Route(CUSTOM),
)
_baggage_reader = W3CBaggagePropagator()


def otel_baggage(header: str) -> dict[str, object]:
    """``header`` as OpenTelemetry's own extractor reads it (not with otel-session's ``_w3c``)."""
    return dict(baggage.get_all(_baggage_reader.extract({"baggage": header}, Context())))


@pytest.fixture(autouse=True)
def _no_swallowed_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Hostile input must be handled, not caught by the last-resort handlers (which would hide it)."""
    monkeypatch.setattr(_faults, "_reported", set())
    logging.getLogger("otel_session").setLevel(logging.ERROR)  # "no Dynamo hosts" hints
    logging.getLogger("opentelemetry.baggage").setLevel(logging.CRITICAL)  # every malformed member
    yield
    logging.getLogger("otel_session").setLevel(logging.NOTSET)
    logging.getLogger("opentelemetry.baggage").setLevel(logging.NOTSET)
    assert _faults._reported == set()


# ---- inbound values ----------------------------------------------------------------------------

VISIBLE = "".join(chr(code) for code in range(0x21, 0x7F))
NASTY = "\r\n\x00\t \x7f\x0b\x0c\x1b" + "é\u00fc\u0130\u0131\u200b\u200d\u202e\ufeff\U0001f600" + '%,;="\\'
PERCENT = [
    "%0d",
    "%0a",
    "%0D%0A",
    "%00",
    "%25",
    "%2C",
    "%3B",
    "%3D",
    "%20",
    "%E2%80%AE",
    "%C3%A9",
    "%ZZ",
    "%",
    "+",
]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def header_values() -> st.SearchStrategy[str]:
    """Strings a client may send as a header value, nice and nasty, up to 10 kB."""
    return st.one_of(
        st.uuids().map(str),
        st.text(alphabet=VISIBLE, min_size=1, max_size=300),  # around the 256 limit
        st.text(alphabet=VISIBLE + NASTY, max_size=60),
        st.text(max_size=30),  # any Unicode
        st.lists(st.sampled_from([*PERCENT, "session.id", "=", ",", ";", "a", "-", " "]), max_size=16).map(
            "".join
        ),
        st.builds(
            lambda unit, count, tail: unit * count + tail,
            st.sampled_from(["a", "é", "%41", "\n", " ", "session.id=x,"]),
            st.sampled_from([255, 256, 257, 4096, 8192, 8193, 10_240]),
            st.text(alphabet=VISIBLE + NASTY, max_size=5),
        ),
    )


def baggage_values() -> st.SearchStrategy[str]:
    key = st.one_of(
        st.sampled_from(
            ["session.id", "session.parent_id", "SESSION.ID", " session.id ", "session%2Eid", ""]
        ),
        st.text(alphabet=VISIBLE + NASTY, min_size=1, max_size=10),
    )
    prop = st.sampled_from(["", ";p", ";p=1", ";;", ";=", ";metadata=%0A"])
    member = st.builds(lambda k, v, p: f"{k}={v}{p}", key, header_values(), prop)
    return st.one_of(
        header_values(),
        st.lists(member, max_size=8).map(",".join),
        st.builds(
            lambda sid, n: ",".join([f"k{i}=v" for i in range(n)] + [f"session.id={sid}"]),
            st.uuids().map(str),
            st.sampled_from([179, 180, 181, 400]),
        ),
    )


HEADER_NAMES = [
    "X-Dynamo-Session-ID",
    "x-dynamo-session-id",
    "X-DYNAMO-SESSION-ID",
    "X-Dynamo-Session-Id",
    "X-Dynamo-Parent-Session-ID",
    "x-dynamo-parent-session-id",
    "baggage",
    "Baggage",
    "BAGGAGE",
    "traceparent",
    "tracestate",
    "host",
    "Host",
    "X-Session-ID",
    "x-smg-routing-key",
    "X-Custom-Key",
]


def inbound_headers() -> st.SearchStrategy[list[tuple[str, str]]]:
    """A request's header list: any names (ours in every casing), values, repeats, many headers."""
    value = st.one_of(
        header_values(),
        baggage_values(),
        st.sampled_from([TRACEPARENT, "dynamo.internal:8000", "gym.internal"]),
    )
    pair = st.tuples(
        st.one_of(st.sampled_from(HEADER_NAMES), st.text(alphabet=VISIBLE, min_size=1, max_size=20)), value
    )
    flood = st.builds(
        lambda v, n: [("x-dynamo-session-id", v)] * n, header_values(), st.sampled_from([2, 100, 500])
    )
    return st.one_of(
        st.lists(pair, max_size=30), st.builds(lambda a, b: a + b, flood, st.lists(pair, max_size=5))
    )


def carriers(pairs: list[tuple[str, str]]) -> list[Any]:
    """The same headers as a server may hand them over: folded (ASGI-like), a plain dict, httpx."""
    folded: dict[str, list[str]] = {}
    for name, value in pairs:
        folded.setdefault(name.lower(), []).append(value)
    raw = [(name.encode(), value.encode("utf-8", "surrogatepass")) for name, value in pairs]
    return [folded, dict(pairs), httpx.Headers(raw)]


def _first_lower(pairs: list[tuple[str, str]], name: str) -> str | None:
    values = [value for key, value in pairs if key.lower() == name]
    return values[0] if values else None


def check_emitted(items: list[tuple[str, str]], route: Route, session: str | None) -> None:
    """What one outbound request carries of ours, for a destination of ``route``."""
    profile = route.profile
    own = (
        set()
        if profile is None
        else {n.lower() for n in (profile.session_header, profile.parent_header) if n}
    )
    for name, value in items:
        lower = name.lower()
        assert lower in OURS, name
        assert PRINTABLE.fullmatch(value), (name, value)
        if lower in SESSION_NAMES:
            assert lower in own, (name, route)
            assert SESSION_VALUE.fullmatch(value), value
        elif lower == "baggage":
            assert route.trusted, route
            assert VISIBLE_VALUE.fullmatch(value), value
            assert len(value.encode()) <= 8192, len(value)
        else:
            assert route, (name, route)
    sent = {name.lower(): value for name, value in items}
    if profile is not None:
        assert sent.get(profile.session_header.lower()) == session, (route, sent)
    if route.trusted and session is not None:
        assert otel_baggage(sent.get("baggage", "")).get("session.id") == session, sent


def test_inbound_headers_extract_and_reinject_cleanly() -> None:
    """A server extracts whatever arrived; what it would forward anywhere is clean and where allowed.

    Forwarded through the propagator with the hop's route in the context, as the client hooks leave
    it, for every kind of route; without a hop (any ``Host`` header notwithstanding) nothing is added.
    """
    propagator = SessionPropagator()

    @MANY
    @given(inbound_headers())
    def check(pairs: list[tuple[str, str]]) -> None:
        carriers_of = carriers(pairs)
        assert propagator.extract(carriers_of[0], Context()) is not None
        for carrier in carriers_of:
            ctx = extract_session(carrier, Context())
            session, parent = session_ids(ctx)
            assert session is None or SESSION_VALUE.fullmatch(session)
            assert parent is None or (session is not None and SESSION_VALUE.fullmatch(parent))
            given_session = _first_lower(pairs, "x-dynamo-session-id")
            folded = carrier is carriers_of[0]
            if folded and given_session is not None and SESSION_VALUE.fullmatch(given_session.strip()):
                assert session == given_session.strip()  # the first one, as ASGI servers fold them
            for route in ROUTES:
                as_dict: dict[str, str] = {}
                propagator.inject(as_dict, otel_context.set_value(HOP_KEY, Hop(route, frozenset()), ctx))
                check_emitted(list(as_dict.items()), route, session)
            everywhere = Route(DYNAMO, trusted=True)
            as_httpx = httpx.Headers()
            _carriers.apply(as_httpx, plan(everywhere, offer_for(ctx, False), {}))
            check_emitted(as_httpx.multi_items(), everywhere, session)
        unknown = dict(pairs)  # may name "host: dynamo.internal:8000": still no destination
        propagator.inject(unknown, ctx)
        assert unknown == dict(pairs)

    check()


class Seen:
    """The in-process server: records what each request carried and where it was headed."""

    def __init__(self) -> None:
        self.headers: list[tuple[str, str]] = []
        self.raw_host = ""
        self.port: int | None = None
        self.scheme = ""

    def __call__(self, request: Any) -> Any:
        self.headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() in OURS]
        url = request.url
        self.raw_host, self.port, self.scheme = url.raw_host.decode("ascii"), url.port, url.scheme
        return (httpx2 if isinstance(request, httpx2.Request) else httpx).Response(200)


def test_inbound_headers_forwarded_through_the_httpx_hook() -> None:
    """A server in the middle forwards a hostile caller's session: clean, and to its routers only."""
    otel_session.configure(
        dynamo_hosts=["dynamo.internal:8000"],
        trusted_hosts=["gym.internal"],
        routers={"vllm-router": ["vllm.internal:8000"]},
    )
    seen = Seen()
    client = httpx.Client(transport=httpx.MockTransport(seen))
    targets = {
        "http://dynamo.internal:8000/v1": Route(DYNAMO),
        "http://vllm.internal:8000/v1": Route(VLLM),
        "http://gym.internal/x": Route(None, trusted=True),
        "http://tools.x/": NOWHERE,
    }

    @MANY
    @given(inbound_headers(), st.sampled_from(sorted(targets)))
    def check(pairs: list[tuple[str, str]], url: str) -> None:
        ctx = extract_session(carriers(pairs)[0], Context())
        token = otel_context.attach(ctx)
        try:
            client.get(url)
        finally:
            otel_context.detach(token)
        check_emitted(seen.headers, targets[url], session_ids(ctx)[0])

    try:
        check()
    finally:
        client.close()


CARRIER_TYPES = ["httpx", "httpx2", "multidict", "dict"]
SAME_TRACE = f"{TRACEPARENT[:36]}1111111111111111-01"  # our trace, another span: ours to take back


@st.composite
def existing_headers(draw: st.DrawFn) -> list[tuple[str, str]]:
    """A request's own headers, with ours in any casing: absent, present, or present with our values."""
    names = st.sampled_from([*HEADER_NAMES, "Content-Type", "Authorization", "X-Other"])
    values = st.one_of(
        st.sampled_from(
            ["sess-a", "parent-b", "session.id=sess-a", "x", "a,b", "tenant=acme, session.id=sess-a"]
        ),
        st.sampled_from([TRACEPARENT, SAME_TRACE, " session.id=sess%2Da ", "café", "k=é"]),
        st.text(VISIBLE, max_size=8),
    )
    return draw(st.lists(st.tuples(names, values), max_size=8))


@st.composite
def hop_offers(draw: st.DrawFn) -> Offer:
    """What a trajectory offers a hop: a session (maybe a parent) in its baggage, maybe a span."""
    session = draw(st.sampled_from([None, "sess-a", "sess-c"]))
    parent = draw(st.sampled_from([None, "parent-b"])) if session is not None else None
    entries: dict[str, object] = dict(draw(st.lists(st.sampled_from([("tenant", "a b"), ("k", "é")]))))
    if session is not None:
        entries["session.id"] = session
        if parent is not None:
            entries["session.parent_id"] = parent
    return Offer(session, parent, entries, draw(st.sampled_from([None, TRACEPARENT])))


def build_carrier(kind: str, pairs: list[tuple[str, str]]) -> Any:
    if kind == "dict":
        return dict(pairs)  # names in any casing, side by side
    if kind == "multidict":
        return CIMultiDict(pairs)
    module = httpx if kind == "httpx" else httpx2
    return module.Headers([(name.encode(), value.encode()) for name, value in pairs])


def apply_publicly(carrier: Any, edits: list[tuple[str, str | None]]) -> None:
    """The edits as each carrier's own public API makes them: the reference for the adapters."""
    for name, value in edits:
        if isinstance(carrier, dict):
            for key in [key for key in carrier if key.lower() == name.lower()]:
                del carrier[key]
            if value is not None:
                carrier[name] = value
        elif isinstance(carrier, CIMultiDict):
            if value is None:
                carrier.popall(name, None)
            else:
                carrier[name] = value
        elif value is None:
            if name in carrier:
                del carrier[name]
        else:
            carrier[name] = value


def header_multiset(carrier: Any) -> Counter[tuple[Any, Any]]:
    return Counter(carrier.raw if isinstance(carrier, (httpx.Headers, httpx2.Headers)) else carrier.items())


def present(carrier: Any, name: str) -> bool:
    if isinstance(carrier, dict):
        return any(key.lower() == name for key in carrier)
    return name in carrier


def a_plan(route: Route, offer: Offer, edits: list[tuple[str, str | None]]) -> Plan:
    """A hop's ``Plan`` for ``route`` carrying ``edits``: its ``names``, ``raw_names`` and ``wire``
    are what the client hooks read and append."""
    return Plan(Offered(Settings(), Context(), offer), route, ("http", "dynamo.internal", 8000), edits)


def test_carrier_adapters_edit_exactly_as_each_carriers_public_api() -> None:
    """``_carriers`` and the client hooks' own ways into their headers (httpx's header list,
    multidict's keys view) against each carrier type's public API.

    For random headers, routes and offers: what ``read`` finds is what the carrier holds (and what
    each hook's ``_held`` finds, its fast path included), and applying ``plan``'s edits through
    ``_carriers.apply`` to the carrier, or as a hop does to its copy of it (httpx's ``_copy_headers``
    appending the plan's ``wire`` where the caller held none of the names, aiohttp's ``_edit``), gives
    the same headers (as a multiset: the fast path appends where ``Headers.__setitem__`` replaces in
    place); the copy leaves the caller's headers exactly as they were.
    """
    assert httpx.Headers in httpx_hook._LISTED and httpx2.Headers in httpx_hook._LISTED
    assert CIMultiDict in aiohttp_hook._FOLDING
    assert all(
        _carriers.case_insensitive(build_carrier(kind, [])) for kind in CARRIER_TYPES if kind != "dict"
    )
    assert not _carriers.case_insensitive({})

    @MANY
    @given(
        existing_headers(),
        st.sampled_from(CARRIER_TYPES),
        st.sampled_from(ROUTES),
        hop_offers(),
        st.booleans(),
        st.sets(st.sampled_from(["baggage", "traceparent", "x-dynamo-session-id"])),
    )
    def check(
        pairs: list[tuple[str, str]],
        kind: str,
        route: Route,
        offer: Offer,
        callers_only: bool,
        replaceable: set[str],
    ) -> None:
        carrier, reference = build_carrier(kind, pairs), build_carrier(kind, pairs)
        names = names_for(route)
        held = _carriers.read(carrier, names)
        assert set(held) == {name for name in names if present(reference, name)}, (held, pairs)
        if kind == "multidict":
            assert aiohttp_hook._held(carrier, a_plan(route, offer, [])) == held
        elif kind != "dict":
            assert httpx_hook._held(carrier, a_plan(route, offer, [])) == held
        edits = plan(route, offer, held, callers_only=callers_only, replaceable=frozenset(replaceable))
        copy = None
        if kind != "dict":
            before = list(header_multiset(carrier).elements())
            if kind == "multidict":
                copy = carrier.copy()
                aiohttp_hook._edit(copy, edits, held)  # as a send does, having just read it
            else:
                wire = None if held else a_plan(route, offer, edits).wire
                copy = httpx_hook._copy_headers(carrier, edits, wire)
            assert list(header_multiset(carrier).elements()) == before  # the caller's, untouched
        _carriers.apply(carrier, edits)
        apply_publicly(reference, edits)
        assert header_multiset(carrier) == header_multiset(reference), (pairs, edits)
        if copy is not None:
            assert header_multiset(copy) == header_multiset(reference), (pairs, edits)
        for name in names:
            assert present(carrier, name) == present(reference, name)

    check()


class TaggedRequest(httpx.Request):
    """A caller's own ``Request`` type with an attribute of its own: copied through ``__dict__``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = "mine"


def test_a_hops_request_copy_is_the_callers_request_with_the_plans_edits() -> None:
    """What a hop sends in place of the caller's ``Request`` against the public API: its headers are
    the caller's with ``plan``'s edits made publicly, every other attribute is the caller's own
    (body read or streaming, extensions, a subclass's or a caller's own attribute), and the caller's
    ``Request`` is exactly as it was. ``_copy_request`` (any other transport: a copy of the exact
    type, attribute by attribute) and ``_stand_in`` (httpx's own transport, for exact ``Request``
    types: only the attributes that transport reads), each with ``_copy_headers`` as the hop makes it."""

    @MANY
    @given(
        existing_headers(),
        st.sampled_from([httpx, httpx2]),
        st.sampled_from(["bytes", "stream", "subclass", "attribute"]),
        st.sampled_from(ROUTES),
        hop_offers(),
        st.sampled_from(["_copy_request", "_stand_in"]),
    )
    def check(
        pairs: list[tuple[str, str]], module: Any, body: str, route: Route, offer: Offer, how: str
    ) -> None:
        kind = TaggedRequest if body == "subclass" and module is httpx else module.Request
        content: Any = iter([b"chunk"]) if body == "stream" else b'{"a": 1}'
        headers = [(name.encode(), value.encode()) for name, value in pairs]
        request = kind("POST", "http://dynamo.internal:8000/v1", headers=headers, content=content)
        if body == "attribute":
            request.tag = "set by the caller"  # an exact httpx Request with an attribute of its own
        before = (list(request.headers.raw), dict(vars(request)))
        held = httpx_hook._held(request.headers, a_plan(route, offer, []))
        edits = plan(route, offer, held)
        wire = None if held else a_plan(route, offer, edits).wire
        sent = getattr(httpx_hook, how)(request, httpx_hook._copy_headers(request.headers, edits, wire))
        reference = module.Headers(request.headers.raw)
        apply_publicly(reference, edits)
        assert header_multiset(sent.headers) == header_multiset(reference), (pairs, edits)
        assert (list(request.headers.raw), dict(vars(request))) == before  # the caller's, untouched
        assert sent is not request and sent.headers is not request.headers
        if how == "_copy_request":
            assert type(sent) is type(request)
            assert {k: v for k, v in vars(sent).items() if k != "headers"} == {
                k: v for k, v in vars(request).items() if k != "headers"
            }
        else:
            assert type(sent) is type(request) and set(vars(sent)) == httpx_hook.TRANSPORT_READS
            shared = httpx_hook.TRANSPORT_READS - {"headers"}
            assert all(getattr(sent, k) is getattr(request, k) for k in shared)

    check()


def test_a_sends_headers_are_put_back_exactly_after_the_send() -> None:
    """aiohttp's hop: a send gets a copy of ``ClientRequest.headers`` with the edits (``_edit``), and
    after the send ``_restore`` puts the copy back to the caller's items exactly (names as spelt,
    values, order), whatever the edits were; with no copy of the rest kept where the caller held none
    of the names read. The caller's own headers are never touched."""

    @MANY
    @given(existing_headers(), st.sampled_from(ROUTES), hop_offers(), st.booleans())
    def check(pairs: list[tuple[str, str]], route: Route, offer: Offer, callers_only: bool) -> None:
        callers = CIMultiDict(pairs)
        held = aiohttp_hook._held(callers, a_plan(route, offer, []))
        edits = plan(route, offer, held, callers_only=callers_only)
        saved = list(callers.items()) if held else None  # as the send keeps them
        sent = callers.copy()
        aiohttp_hook._edit(sent, edits, held)
        reference = CIMultiDict(pairs)
        apply_publicly(reference, edits)
        assert header_multiset(sent) == header_multiset(reference), (pairs, edits)
        sent.add("Connection", "keep-alive")  # what aiohttp's send adds meanwhile stays, after them
        aiohttp_hook._restore(sent, saved, [name for name, _ in edits])
        assert list(sent.items()) == [*pairs, ("Connection", "keep-alive")], edits
        assert list(callers.items()) == pairs

    check()


def test_a_carrier_type_met_when_the_kinds_cache_is_full_is_still_found_fast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the cache of carrier types full, an httpx ``Headers`` met for the first time kept the
    placeholder of its probe (case-insensitive, the slow way) for good: the suite failed when a test
    filling the cache ran before the first httpx2 request. ``_carriers``' cache of types, full, still
    answers right, and filling it leaves the hooks' fast ways in to a type met for the first time."""
    monkeypatch.setattr(_carriers, "_case_insensitive", {})
    monkeypatch.setattr(httpx_hook, "_LISTED", ProbedTypes(httpx_hook._headers_are_listed))
    monkeypatch.setattr(aiohttp_hook, "_FOLDING", ProbedTypes(aiohttp_hook._folds_case))
    for index in range(64):
        _carriers.read(type(f"Carrier{index}", (dict,), {})(), ("baggage",))
    for _ in range(2):
        assert _carriers.case_insensitive(httpx2.Headers())
        assert _carriers.case_insensitive(CIMultiDict())
        assert not _carriers.case_insensitive(type("Carrier64", (dict,), {})())
        assert httpx2.Headers in httpx_hook._LISTED
        assert CIMultiDict in aiohttp_hook._FOLDING
    assert len(_carriers._case_insensitive) == 64


def test_a_multidict_whose_keys_view_compares_names_as_spelled_is_read_name_by_name() -> None:
    """multidict before 6.1 compared a ``CIMultiDict``'s keys view as spelled: asked "any of these
    names?" in one call, it would answer no for ``X-Dynamo-Session-ID`` against the lower-case name,
    and a hand-set header would be added to. Such a type is found so once and read name by name."""
    as_spelled = type("CIMultiDict", (MultiDict,), {"__module__": "multidict.old"})
    assert aiohttp_hook._folds_case(CIMultiDict)
    assert not aiohttp_hook._folds_case(as_spelled)
    assert as_spelled not in aiohttp_hook._FOLDING
    assert _carriers.case_insensitive(as_spelled())


# ---- destinations ------------------------------------------------------------------------------

DYNAMO_PATTERNS = [
    "dynamo.internal:8000",
    "*.dynamo.svc.cluster.local",
    "10.1.2.3:8000",
    "[fd00::1]:8000",
    "bücher.example:8000",
    "strasse.example:8000",
    "https://secure.dynamo.example",  # a URL pattern keeps its scheme, and its default port
    "http://plain.dynamo.example:8080/v1",
]
TRUSTED_PATTERNS = ["gym.internal", "*.trusted.example:8443", "https://tls.gym.example/"]
DYNAMO_EXACT = {
    ("dynamo.internal", 8000),
    ("10.1.2.3", 8000),
    ("fd00::1", 8000),
    ("xn--bcher-kva.example", 8000),
    ("strasse.example", 8000),
}
# (host, scheme, port) the URL patterns above mean, and nothing else
DYNAMO_URLS = {("secure.dynamo.example", "https", 443), ("plain.dynamo.example", "http", 8080)}
TRUSTED_URLS = {("tls.gym.example", "https", 443)}
DEFAULT_PORT = {"http": 80, "https": 443}

HOST_BASES = [
    "dynamo.internal",
    "dynamo.svc.cluster.local",
    "a.dynamo.svc.cluster.local",
    "x.y.dynamo.svc.cluster.local",
    "gym.internal",
    "trusted.example",
    "api.trusted.example",
    "bücher.example",
    "xn--bcher-kva.example",
    "buecher.example",
    "straße.example",
    "strasse.example",
    "evil.com",
    "localhost",
    "10.1.2.3",
    "10.1.2.30",
    "010.1.2.3",
    "167838211",
    "0x0a.1.2.3",
    "fd00::1",
    "FD00:0::1",
    "fd00:0:0:0:0:0:0:1",
    "fd00::2",
    "::ffff:10.1.2.3",
    "127.0.0.1",
    "secure.dynamo.example",
    "plain.dynamo.example",
    "tls.gym.example",
]
# dotless i, Cyrillic a and ie, ideographic full stop
LOOKALIKE = {"o": "0", "i": "\u0131", "l": "1", "a": "\u0430", "e": "\u0435", "m": "rn", ".": "\u3002"}


@st.composite
def hosts(draw: st.DrawFn) -> str:
    """A destination host: a configured one, spelled differently, or a lookalike of one."""
    host = draw(st.sampled_from(HOST_BASES))
    for _ in range(draw(st.integers(0, 3))):
        how = draw(
            st.sampled_from(["upper", "title", "dot", "prefix", "suffix", "glue", "lookalike", "label"])
        )
        if how == "upper":
            host = host.upper()
        elif how == "title":
            host = host.title()
        elif how == "dot":
            host += "."
        elif how == "prefix":
            host = draw(st.sampled_from(["evil.", "dynamo.", "x-", "a.b.", "-", "_"])) + host
        elif how == "suffix":
            host += draw(st.sampled_from([".evil.com", "evil.com", ".", "-", ":", "%2e", ".dynamo.internal"]))
        elif how == "glue":
            host = (
                draw(st.sampled_from(["dynamo.internal", "gym.internal"]))
                + draw(st.sampled_from(["@", "#", "?", "\\", "/"]))
                + host
            )
        elif how == "lookalike":
            old = draw(st.sampled_from(sorted(LOOKALIKE)))
            host = host.replace(old, LOOKALIKE[old], 1)
        else:
            host = draw(st.text(alphabet="abcdü-_0.", min_size=1, max_size=8)) + "." + host
    return host


@st.composite
def urls(draw: st.DrawFn) -> str:
    scheme = draw(st.sampled_from(["http", "https", "HTTP"]))
    userinfo = draw(
        st.sampled_from(["", "dynamo.internal@", "dynamo.internal:8000@", "user:pw@", "gym.internal@"])
    )
    host = draw(hosts())
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = draw(st.one_of(st.none(), st.sampled_from([8000, 80, 443, 8443, 8080]), st.integers(1, 65535)))
    return f"{scheme}://{userinfo}{host}{'' if port is None else f':{port}'}/v1/chat/completions"


LDH_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def oracle(raw_host: str, port: int | None, scheme: str) -> tuple[bool, bool, bool]:
    """(Dynamo?, trusted?, well-formed?) for where a client connects: plain, independent matching.

    A name that is not strict letters-digits-hyphens (a leading hyphen, say) may be refused by the
    rules, which err towards sending nothing; for those only "never where not allowed" is checked.
    """
    host = raw_host.lower().strip("[]")
    if host.endswith(".") and ":" not in host:  # a name's root dot; no IPv6 literal ends in one
        host = host[:-1]
    try:
        host = ipaddress.ip_address(host).compressed
        well_formed = True
    except ValueError:
        well_formed = all(LDH_LABEL.fullmatch(label) for label in host.split("."))
    scheme = scheme.lower()
    port = port if port is not None else DEFAULT_PORT[scheme]
    dynamo = (
        (host, port) in DYNAMO_EXACT
        or host.endswith(".dynamo.svc.cluster.local")
        or (host, scheme, port) in DYNAMO_URLS
    )
    trusted = (
        host == "gym.internal"
        or (host.endswith(".trusted.example") and port == 8443)
        or (host, scheme, port) in TRUSTED_URLS
    )
    return dynamo, trusted, well_formed


def check_delivery(
    headers: list[tuple[str, str]], raw_host: str, port: int | None, scheme: str, sid: str
) -> None:
    dynamo, trusted, well_formed = oracle(raw_host, port, scheme)
    sent = {name.lower(): value for name, value in headers}
    where = (raw_host, port, sent)
    if not dynamo:
        assert "x-dynamo-session-id" not in sent and "x-dynamo-parent-session-id" not in sent, where
    elif well_formed:
        assert sent.get("x-dynamo-session-id") == sid, where
    if not trusted:
        assert "baggage" not in sent, where
    elif well_formed:
        assert f"session.id={sid}" in sent.get("baggage", ""), where
    assert sent.get("x-dynamo-session-id") in (None, sid), where
    assert "traceparent" not in sent  # tracing is off and no SDK is installed
    for name, value in headers:
        assert PRINTABLE.fullmatch(value), (name, value)


def _errors_alike(send: Callable[[], object]) -> type[BaseException] | None:
    try:
        send()
    except Exception as exc:
        return type(exc)
    return None


def test_destinations_through_the_httpx_and_httpx2_hooks() -> None:
    """Lookalikes, userinfo, ports, IPv6, IDN, case, trailing dots: the header goes where allowed only."""
    otel_session.configure(dynamo_hosts=DYNAMO_PATTERNS, trusted_hosts=TRUSTED_PATTERNS)
    seen = Seen()
    clients: dict[Any, Any] = {
        httpx: httpx.Client(transport=httpx.MockTransport(seen)),
        httpx2: httpx2.Client(transport=httpx2.MockTransport(seen)),
    }

    @MANY
    @given(urls(), st.sampled_from([httpx, httpx2]))
    def check(url: str, module: Any) -> None:
        try:
            request = module.Request("GET", url)
        except Exception:  # the client itself refuses the URL: nothing of ours is involved
            assume(False)
        seen.raw_host = ""
        with otel_session.trajectory() as traj:
            error = _errors_alike(lambda: clients[module].send(request))
        if error is not None:  # the same must happen without otel-session
            otel_session.unconfigure()
            try:
                assert _errors_alike(lambda: clients[module].send(module.Request("GET", url))) is error
            finally:
                otel_session.configure(dynamo_hosts=DYNAMO_PATTERNS, trusted_hosts=TRUSTED_PATTERNS)
            return
        assert traj.session_id is not None
        check_delivery(seen.headers, seen.raw_host, seen.port, seen.scheme, traj.session_id)
        assert not any(name.lower() in OURS for name in request.headers)  # the caller's Request is as it was

    try:
        check()
    finally:
        for client in clients.values():
            client.close()


def test_a_destination_read_from_the_parsed_url_is_the_one_its_properties_give() -> None:
    """httpx's hook reads scheme, host and port where ``httpx.URL`` keeps them parsed, not through
    its properties: for every URL either library accepts, the same three, IDNA hosts included."""
    otel_session.configure(dynamo_hosts=DYNAMO_PATTERNS)
    assert {httpx.URL, httpx2.URL} <= httpx_hook._parsed_urls  # else the test checks nothing

    @MANY
    @given(urls(), st.sampled_from([httpx, httpx2]))
    def check(text: str, module: Any) -> None:
        try:
            url = module.URL(text)
            expected = (url.scheme, url.host, url.port)
        except Exception:  # the library refuses the URL: never sent, never planned
            assume(False)
        assert httpx_hook._destination(url) == expected

    check()


def test_destinations_through_the_aiohttp_hook() -> None:
    """The same through aiohttp's real client, answered in memory; where it connects is yarl's host."""
    otel_session.configure(dynamo_hosts=DYNAMO_PATTERNS, trusted_hosts=TRUSTED_PATTERNS)
    heads: list[bytes] = []
    loop = asyncio.new_event_loop()

    async def open_session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=canned_aiohttp_connector(on_request=heads.append))

    session = loop.run_until_complete(open_session())

    async def send(url: str) -> aiohttp.RequestInfo:
        async with session.get(url) as response:
            await response.read()
            return response.request_info

    @MANY
    @given(urls())
    def check(url: str) -> None:
        try:
            target = yarl.URL(url)
            assume(target.raw_host is not None)
        except Exception:
            assume(False)
        heads.clear()
        with otel_session.trajectory() as traj:
            try:
                info = loop.run_until_complete(send(url))
            except Exception as exc:
                error: type[BaseException] | None = type(exc)
            else:
                error = None
        if error is not None:
            otel_session.unconfigure()
            try:
                assert _errors_alike(lambda: loop.run_until_complete(send(url))) is error
            finally:
                otel_session.configure(dynamo_hosts=DYNAMO_PATTERNS, trusted_hosts=TRUSTED_PATTERNS)
            return
        assert traj.session_id is not None and len(heads) == 1
        lines = heads[0].decode("latin-1").split("\r\n")[1:]
        sent = [(name.strip(), value.strip()) for name, _, value in (line.partition(":") for line in lines)]
        ours = [(name, value) for name, value in sent if name.lower() in OURS]
        assert info.url.raw_host is not None
        check_delivery(ours, info.url.raw_host, info.url.explicit_port, info.url.scheme, traj.session_id)

    try:
        check()
    finally:
        loop.run_until_complete(session.close())
        loop.close()


def test_idna_deviation_characters_do_not_redirect_the_session() -> None:
    """``straße.example`` is ``xn--strae-oqa.example`` to httpx and yarl, not ``strasse.example``.

    IDNA 2003 would map one onto the other and send the session to a different host.
    """
    otel_session.configure(dynamo_hosts=["strasse.example:8000"])
    seen = Seen()
    with httpx.Client(transport=httpx.MockTransport(seen)) as client, otel_session.trajectory() as traj:
        client.get("http://straße.example:8000/v1")
    assert traj.session_id is not None
    check_delivery(seen.headers, seen.raw_host, seen.port, seen.scheme, traj.session_id)


def test_a_baggage_value_with_no_utf8_form_costs_no_request_its_session() -> None:
    """Application baggage is anything ``baggage.set_baggage`` took, a lone surrogate included: that
    member cannot be written, and the request still carries the session (and no fault is logged)."""
    otel_session.configure(dynamo_hosts=["dynamo.internal:8000"], trusted_hosts=["dynamo.internal"])
    seen = Seen()
    with httpx.Client(transport=httpx.MockTransport(seen)) as client, otel_session.trajectory() as traj:
        token = otel_context.attach(baggage.set_baggage("note", "\ud800"))
        try:
            client.get("http://dynamo.internal:8000/v1")
        finally:
            otel_context.detach(token)
    sent = {name.lower(): value for name, value in seen.headers}
    assert sent.get("x-dynamo-session-id") == traj.session_id, sent
    assert otel_baggage(sent.get("baggage", "")).get("session.id") == traj.session_id, sent


def test_aiohttp_gives_back_the_callers_headers_exactly() -> None:
    """After the hop, aiohttp's record of the request (``request_info.headers``, what a middleware
    re-sends) holds the caller's headers as they set them: names as spelt, in their order."""
    otel_session.configure(dynamo_hosts=["dynamo.internal:8000"], trusted_hosts=["gym.internal"])
    heads: list[bytes] = []
    caller = [("Baggage", "tenant=acme"), ("X-Other", "1")]

    async def send() -> list[tuple[str, str]]:
        connector = canned_aiohttp_connector(on_request=heads.append)
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.get("http://gym.internal/x", headers=CIMultiDict(caller)) as response,
        ):
            await response.read()
            ours = {"baggage", "x-other"}
            return [(k, v) for k, v in response.request_info.headers.items() if k.lower() in ours]

    with otel_session.trajectory() as traj:
        recorded = asyncio.run(send())
    assert f"tenant=acme,session.id={traj.session_id}".encode() in heads[0]  # merged on the wire
    assert recorded == caller


# ---- host patterns and rules -------------------------------------------------------------------

LABELS = [
    "dynamo",
    "gym",
    "api",
    "a",
    "x-y",
    "b_c",
    "svc",
    "internal",
    "example",
    "com",
    "evil",
    "bücher",
    "xn--bcher-kva",
    "7",
]
IDN = {"bücher": "xn--bcher-kva"}
ADDRESSES = {  # spelling -> canonical (the oracle's own table)
    "10.1.2.3": "10.1.2.3",
    "192.168.0.1": "192.168.0.1",
    "fd00::1": "fd00::1",
    "FD00:0::1": "fd00::1",
    "fd00:0:0:0:0:0:0:1": "fd00::1",
    "::1": "::1",
    "0:0::1": "::1",
}


@st.composite
def names(draw: st.DrawFn) -> str:
    return ".".join(draw(st.lists(st.sampled_from(LABELS), min_size=1, max_size=4)))


def _canonical_name(name: str) -> str | None:
    """Lower case, no root dot, IDN labels from the table; ``None`` for a name IDNA 2008 refuses:
    one with a non-ASCII label is encoded whole, and IDNA 2008 allows no "_" in any label."""
    name = name.lower()
    if name.endswith("."):
        name = name[:-1]
    labels = name.split(".")
    if any(label in IDN for label in labels) and any("_" in label for label in labels):
        return None
    if all(label.isdigit() for label in labels) and not (
        len(labels) == 4 and all(int(x) < 256 for x in labels)
    ):
        return None  # a number that is not a whole IPv4 address is no name: a resolver reads it as one
    return ".".join(IDN.get(label, label) for label in labels)


def _spell(draw: st.DrawFn, name: str) -> str:
    """The same name as someone may write it: any case, maybe one trailing dot (one draw, for speed)."""
    how = draw(st.integers(0, 7))
    spelled = [
        name,
        name.upper(),
        name.title(),
        "".join(c.upper() if i % 2 else c for i, c in enumerate(name)),
    ]
    return spelled[how % 4] + ("." if how >= 4 else "")


Spec = tuple[str, "str | None", bool, "int | None", "str | None"]


@st.composite
def pattern_specs(draw: st.DrawFn) -> Spec:
    """(pattern text, canonical host, wildcard, port, scheme) built together: the oracle knows the meaning.

    A URL pattern means its scheme and its port, the scheme's default when none is written (ws and wss
    count as http and https); a pattern without a scheme means any scheme.
    """
    port = draw(st.one_of(st.none(), st.sampled_from([80, 443, 8000]), st.integers(1, 65535)))
    suffix = "" if port is None else f":{port}"
    url = draw(st.sampled_from([None, None, "http", "https", "ws", "wss", "HTTPS"]))
    scheme = None if url is None else {"ws": "http", "wss": "https"}.get(url.lower(), url.lower())
    url_port = port if port is not None or scheme is None else DEFAULT_PORT[scheme]
    if draw(st.booleans()):
        spelling = draw(st.sampled_from(sorted(ADDRESSES)))
        bracket = ":" in spelling and (port is not None or url is not None or draw(st.booleans()))
        host = f"[{spelling}]" if bracket else spelling
        if url is not None:
            return f"{url}://{host}{suffix}/v1", ADDRESSES[spelling], False, url_port, scheme
        return host + suffix, ADDRESSES[spelling], False, port, None
    name = draw(names())
    assume(_canonical_name(name) is not None)  # patterns that must be refused: see the parse test
    wildcard = draw(st.booleans()) and not re.fullmatch(r"[0-9.]+", name)  # "*." needs a domain name
    written = ("*." if wildcard else "") + _spell(draw, name)
    if url is not None:
        return f"{url}://{written}{suffix}/", _canonical_name(name), wildcard, url_port, scheme
    return written + suffix, _canonical_name(name), wildcard, port, None


@st.composite
def destinations(draw: st.DrawFn) -> tuple[str, str | None, int | None]:
    """(host as a client reports it, its canonical form or None if invalid, port)."""
    port = draw(st.one_of(st.none(), st.sampled_from([80, 443, 8000]), st.integers(1, 65535)))
    choice = draw(st.integers(0, 9))
    if choice < 3:
        spelling = draw(st.sampled_from(sorted(ADDRESSES)))
        return spelling, ADDRESSES[spelling], port
    if choice < 9:
        name = draw(names())
        return _spell(draw, name), _canonical_name(name), port
    junk = draw(
        st.one_of(
            st.sampled_from(
                [
                    "",
                    ".",
                    "..",
                    "a..b",
                    "-a.com",
                    "a-.com",
                    "a b",
                    "a/b",
                    "a@b",
                    "a\x00b",
                    "a" * 64 + ".com",
                    ".".join(["a" * 60] * 5),
                    "*.dynamo",
                    "a:b:c",
                    "dynamo.internal\r\n",
                ]
            ),
            st.text(alphabet=NASTY + "@/:[]*", min_size=1, max_size=6),
        )
    )
    return junk, None, port


FAMILY = {"http": "http", "https": "https", "ws": "http", "wss": "https"}


def _oracle_match(spec: Spec, host: str | None, scheme: str, port: int | None) -> bool:
    _, pattern_host, wildcard, pattern_port, pattern_scheme = spec
    family = FAMILY.get(scheme)
    if port is None and family is not None:
        port = DEFAULT_PORT[family]
    if host is None or pattern_host is None or (pattern_port is not None and port != pattern_port):
        return False
    if pattern_scheme is not None and family != pattern_scheme:
        return False
    return host.endswith("." + pattern_host) if wildcard else host == pattern_host


def _oracle_profile(
    configured: list[tuple[Profile, Spec]], host: str | None, scheme: str, port: int | None
) -> Any:
    """The matching pattern that names the most (a host before a wildcard, then a port, then a
    scheme); between equals the first configured."""
    matching = [(profile, spec) for profile, spec in configured if _oracle_match(spec, host, scheme, port)]
    if not matching:
        return None
    best = max((not spec[2], spec[3] is not None, spec[4] is not None) for _, spec in matching)
    return next(p for p, spec in matching if (not spec[2], spec[3] is not None, spec[4] is not None) == best)


def test_host_rules_agree_with_the_oracle() -> None:
    """``HostRules.route`` against a matcher written from the spec alone, two profiles and trusted hosts."""

    @MANY
    @given(
        st.lists(pattern_specs(), max_size=3),
        st.lists(pattern_specs(), max_size=2),
        st.lists(pattern_specs(), max_size=2),
        destinations(),
        st.sampled_from(["http", "https", "ws", "wss", "ftp"]),
    )
    def check(
        dynamo: list[Spec],
        vllm: list[Spec],
        trusted: list[Spec],
        destination: tuple[str, str | None, int | None],
        scheme: str,
    ) -> None:
        configured = [(DYNAMO, spec) for spec in dynamo] + [(VLLM, spec) for spec in vllm]
        rules = HostRules(
            [(profile, HostPattern.parse(spec[0])) for profile, spec in configured],
            parse_patterns([spec[0] for spec in trusted]),
        )
        raw, canonical, port = destination
        profile = _oracle_profile(configured, canonical, scheme, port)
        is_trusted = any(_oracle_match(spec, canonical, scheme, port) for spec in trusted)
        expected = Route(profile, is_trusted) if profile is not None or is_trusted else NOWHERE
        assert rules.route(scheme, raw, port) == expected, (raw, scheme, port)
        assert rules.route(scheme, raw, port) == expected  # again, now from the cache
        if canonical is not None and ":" in canonical:
            assert rules.route(scheme, f"[{raw}]", port) == expected  # as yarl may spell it

    check()


def _named(error: ValueError, pattern: str) -> bool:
    return repr(pattern) in str(error) or (not pattern.strip() and "empty" in str(error))


def _unicode_digits(text: str) -> bool:
    """Digits outside ASCII ("¹", "٨"): ``str.isdigit`` takes them; see test_a_port_is_ascii_digits."""
    return any(char.isdigit() and not char.isascii() for char in text)


def test_host_pattern_parse_returns_or_names_the_pattern() -> None:
    """Any text: a pattern, or a ValueError that names it, so a typo is found at configure()."""
    pattern_like = st.builds(
        lambda pre, host, post: pre + host + post,
        st.sampled_from(
            ["", "*.", "*", "http://", "https://", "ftp://", "[", "user@", "http://u:p@", " ", "**."]
        ),
        st.one_of(st.sampled_from(HOST_BASES), st.text(alphabet=VISIBLE + NASTY, max_size=12)),
        st.sampled_from(
            ["", ":8000", ":0", ":65536", ":-1", ":x", "]", "]:80", "/", "/path", ":", ".", ":80:80"]
        ),
    )

    @MANY
    @given(st.one_of(pattern_like, st.text(max_size=40)))
    def check(text: str) -> None:
        assume(not _unicode_digits(text))
        try:
            pattern = HostPattern.parse(text)
        except ValueError as exc:
            assert _named(exc, text), str(exc)
            return
        assert (
            pattern.host == pattern.host.lower() and pattern.host.isascii() and not pattern.host.endswith(".")
        )
        assert pattern.port is None or 0 < pattern.port < 65536

    check()


def test_a_url_patterns_error_names_the_url() -> None:
    with pytest.raises(ValueError) as caught:
        HostPattern.parse("http://dynamo.internal:")
    assert _named(caught.value, "http://dynamo.internal:"), str(caught.value)


def test_a_port_is_ascii_digits() -> None:
    """ "¹" passes ``isdigit`` and then fails ``int()`` unnamed; "٨٠٠٠" would read as 8000. In a
    ``Host`` header neither means anything: the propagator never takes a destination from a header."""
    otel_session.configure(dynamo_hosts=["dynamo.internal:8000"])
    for port in ("¹", "٨٠٠٠"):
        with pytest.raises(ValueError) as caught:
            HostPattern.parse(f"dynamo.internal:{port}")
        assert _named(caught.value, f"dynamo.internal:{port}"), str(caught.value)
        carrier = {"host": f"dynamo.internal:{port}"}  # a Host header is never the destination
        with otel_session.trajectory():
            propagate.inject(carrier)
        assert carrier == {"host": f"dynamo.internal:{port}"}


def test_configure_with_a_bad_pattern_names_it_and_changes_nothing() -> None:
    """configure() checks everything first: a bad pattern is named and the old configuration stays."""

    @MANY
    @given(
        st.lists(st.one_of(st.sampled_from(DYNAMO_PATTERNS), st.text(max_size=20)), min_size=1, max_size=4)
    )
    def check(patterns: list[str]) -> None:
        before = otel_session.configure(dynamo_hosts=["dynamo.internal:8000"])
        assume(not any(_unicode_digits(pattern) for pattern in patterns))
        try:
            otel_session.configure(dynamo_hosts=patterns, trusted_hosts=["gym.internal"])
        except ValueError as exc:
            assert any(_named(exc, p) for p in patterns), str(exc)
            assert _settings.current is before
        else:
            assert _settings.current is not before

    check()


# ---- loopback: hostile headers through real servers ----------------------------------------------

HOSTILE_INBOUND: list[tuple[str, bytes]] = [
    ("valid", b"X-Dynamo-Session-ID: sess-0123"),
    ("padded", b"X-Dynamo-Session-ID:    sess-pad   "),
    ("too long", b"X-Dynamo-Session-ID: " + b"a" * 257),
    ("longest", b"X-Dynamo-Session-ID: " + b"b" * 256),
    ("10 kB", b"X-Dynamo-Session-ID: " + b"c" * 10_240),
    ("inner space", b"X-Dynamo-Session-ID: a b"),
    ("NUL", b"X-Dynamo-Session-ID: a\x00b"),
    ("DEL", b"X-Dynamo-Session-ID: a\x7fb"),
    ("latin-1", b"X-Dynamo-Session-ID: caf\xe9"),
    ("utf-8", "X-Dynamo-Session-ID: café".encode()),
    ("RTL override", "X-Dynamo-Session-ID: a\u202eb".encode()),
    ("obs-fold", b"X-Dynamo-Session-ID: a\r\n b"),
    ("bare CR", b"X-Dynamo-Session-ID: a\rb"),
    ("empty", b"X-Dynamo-Session-ID: "),
    ("two", b"X-Dynamo-Session-ID: first-1\r\nX-Dynamo-Session-ID: second-2"),
    ("casing", b"x-DYNAMO-session-ID: cased-1"),
    ("percent", b"X-Dynamo-Session-ID: a%0D%0Ab"),
    ("baggage", b"baggage: session.id=bag-1,other=1"),
    ("baggage encoded", b"baggage: session.id=bag%0D%0A2"),
    ("baggage 10 kB", b"baggage: session.id=bag-3," + b"k=" + b"v" * 10_240),
    ("baggage many", b"baggage: " + b",".join(b"k%d=v" % i for i in range(400)) + b",session.id=bag-4"),
    (
        "many headers",
        b"\r\n".join(b"X-Junk-%d: x" % i for i in range(90)) + b"\r\nX-Dynamo-Session-ID: many-1",
    ),
    ("parent only", b"X-Dynamo-Parent-Session-ID: parent-1"),
]


def _valid_forward(label: str) -> str | None:
    """What the oracle expects Dynamo to receive: the caller's session when it was a valid one."""
    expected = {
        "valid": "sess-0123",
        "padded": "sess-pad",
        "longest": "b" * 256,
        "casing": "cased-1",
        "percent": "a%0D%0Ab",
        "baggage": "bag-1",
        "two": "first-1",
        "many headers": "many-1",
        "baggage 10 kB": None,
        "baggage many": None,
    }
    return expected.get(label)


@contextlib.contextmanager
def _serve(app: Any) -> Iterator[int]:
    with AsgiServer(app, log_level="critical") as server:  # hostile requests make uvicorn complain
        yield server.port


def _raw_request(port: int, extra: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /forward HTTP/1.1\r\nHost: middle\r\n" + extra + b"\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.mark.parametrize(("label", "raw"), HOSTILE_INBOUND, ids=[label for label, _ in HOSTILE_INBOUND])
async def test_hostile_headers_through_a_real_server_in_the_middle(
    label: str, raw: bytes, dynamo: Recorder
) -> None:
    """uvicorn + Starlette + SessionMiddleware, forwarding to Dynamo: clean, or nothing; never a 500."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])

    async def forward(request: Request) -> JSONResponse:
        async with httpx.AsyncClient() as client:
            await client.get(f"{dynamo.url}/v1/models")
        return JSONResponse({"session": otel_session.current_session_id()})

    app = SessionMiddleware(Starlette(routes=[StarletteRoute("/forward", forward)]))
    with _serve(app) as port:
        status, body = await asyncio.to_thread(_raw_request, port, raw)
    assert status in (200, 400), (status, body[:200])  # the HTTP parser may refuse it; never a crash
    if status != 200:
        return
    assert json.loads(body)["session"] == _valid_forward(label)  # what the app saw as current
    await wait_until(lambda: len(dynamo.requests) == 1)
    forwarded = dynamo.requests[0].get("x-dynamo-session-id")
    assert forwarded is None or SESSION_VALUE.fullmatch(forwarded), forwarded
    assert forwarded == _valid_forward(label)
    assert dynamo.requests[0].get("baggage") is None  # Dynamo is not a trusted host here
    assert dynamo.requests[0].get("x-dynamo-parent-session-id") is None  # no caller's parent was valid
    for name, value in dynamo.requests[0].headers:
        assert PRINTABLE.fullmatch(value), (name, value)
