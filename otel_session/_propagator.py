"""The destination-aware propagator: what a request may carry depends on where it goes.

OpenTelemetry's stock propagators send ``traceparent`` and ``baggage`` to every host. This one sends
the session header only to Dynamo hosts, baggage only to trusted hosts, ``traceparent`` only to
either, and nothing to anyone else; it also takes back its own values when a redirect copied them
onto a request bound elsewhere. It is a ``TextMapPropagator`` so the upstream instrumentations, the
``OTEL_PROPAGATORS`` machinery and servers' ``extract`` all use it unchanged.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from opentelemetry import baggage, trace
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

from otel_session import _faults, _settings
from otel_session._context import DESTINATION_KEY, PARENT_KEY, SESSION_KEY, session_ids, with_session
from otel_session._hosts import DYNAMO, NOTHING, TRUSTED, HostRules
from otel_session._ids import PARENT_SESSION_HEADER, SESSION_HEADER, is_valid_session_id

_SESSION = SESSION_HEADER.lower()
_PARENT = PARENT_SESSION_HEADER.lower()
_MAX_BAGGAGE_HEADER = 8192

_tracecontext = TraceContextTextMapPropagator()
_baggage = W3CBaggagePropagator()
_EMPTY_RULES = HostRules()


_CANONICAL = {_SESSION: SESSION_HEADER, _PARENT: PARENT_SESSION_HEADER}


def _spellings(name: str) -> tuple[str, ...]:
    """Spellings to try in a plain dict carrier; header mappings are case-insensitive anyway."""
    return (name, name.title(), _CANONICAL.get(name, name))


# What a carrier is, decided once per type, because the lookups below run on every request and each
# public lookup in an httpx ``Headers`` costs about a microsecond:
# - a plain mapping (a dict): try the usual spellings of a name;
# - a case-insensitive header mapping (multidict's): one lookup answers for every spelling;
# - httpx's or httpx2's ``Headers``, which keep ``_list``, (raw name, lower-case name, value) byte
#   triples, and whose every public lookup or delete first works out ``encoding`` by decoding every
#   header. For a type whose instances are checked once to behave exactly so, a miss (the usual case)
#   is answered from ``_list`` and our own header is deleted from it; a hit reads the public way.
_PLAIN, _CASE_INSENSITIVE, _ENTRIES = 0, 1, 2
_CASE_INSENSITIVE_TYPES = frozenset(
    {
        ("httpx", "Headers"),
        ("httpx2", "Headers"),
        ("multidict", "CIMultiDict"),
        ("multidict", "CIMultiDictProxy"),
    }
)
_carrier_kinds: dict[type, int] = {}
_entry_names: dict[str, bytes | None] = {
    name: name.lower().encode("ascii")
    for name in (SESSION_HEADER, PARENT_SESSION_HEADER, _SESSION, _PARENT, "baggage", "traceparent")
}


def _layout_holds(kind: type) -> bool:
    try:
        probe = kind([("X-Probe", "1"), ("Other", "2"), ("x-PROBE", "3")])
        expected = [(b"X-Probe", b"x-probe", b"1"), (b"Other", b"other", b"2")]
        if probe._list != [*expected, (b"x-PROBE", b"x-probe", b"3")]:
            return False
        del probe["X-PROBE"]
        probe["New"] = "4"
        return bool(probe._list == [*expected[1:], (b"New", b"new", b"4")] and probe.get("other") == "2")
    except Exception:
        return False


def _carrier_kind(carrier: Any) -> int:
    kind = type(carrier)
    found = _carrier_kinds.get(kind)
    if found is None:
        found = _PLAIN
        if (kind.__module__.partition(".")[0], kind.__qualname__) in _CASE_INSENSITIVE_TYPES:
            found = _ENTRIES if kind.__qualname__ == "Headers" and _layout_holds(kind) else _CASE_INSENSITIVE
        if len(_carrier_kinds) < 64:  # carrier types are few; bounded all the same
            _carrier_kinds[kind] = found
    return found


def _is_case_insensitive(carrier: Any) -> bool:
    """Whether ``carrier`` is one of the known case-insensitive header types (exact type, by name)."""
    return _carrier_kind(carrier) != _PLAIN


def _entry_name(name: str) -> bytes | None:
    """``name`` as ``_list`` stores it for matching; ``None`` if not ASCII (left to the public way)."""
    lower = _entry_names.get(name)
    if lower is None and name not in _entry_names:
        lower = name.lower().encode("ascii") if name.isascii() else None
        if len(_entry_names) < 64:
            _entry_names[name] = lower
    return lower


def add_header(carrier: Any, name: str, value: str) -> bool:
    """``carrier[name] = value`` if ``name`` is absent, for ``Headers`` of the known layout only.

    False (nothing done) for any other carrier, a present name, or a non-ASCII name or value: the
    caller then goes the public way. ASCII encodes alike in every encoding httpx would pick.
    """
    if _carrier_kinds.get(type(carrier)) != _ENTRIES or not value.isascii():
        return False
    lower_name = _entry_names.get(name) or _entry_name(name)
    if lower_name is None:
        return False
    entries = carrier._list
    for entry in entries:
        if entry[1] == lower_name:
            return False
    entries.append((name.encode("ascii"), lower_name, value.encode("ascii")))
    return True


def remove_header(carrier: Any, name: str) -> None:
    """``carrier.pop(name, None)`` for a header mapping, without its decoding where that is known."""
    if _carrier_kinds.get(type(carrier)) == _ENTRIES:
        lower_name = _entry_names.get(name) or _entry_name(name)
        if lower_name is not None:
            entries = carrier._list
            entries[:] = [entry for entry in entries if entry[1] != lower_name]
            return
    try:  # noqa: SIM105 - ``pop(key, None)`` minus its second lookup; suppress() costs more
        del carrier[name]
    except KeyError:
        pass


def _carrier_get(carrier: Any, name: str) -> Any:
    """Read a header from a header mapping (httpx, multidict) or a plain dict, ignoring case."""
    how = _carrier_kinds.get(type(carrier))
    if how is None:
        how = _carrier_kind(carrier)
    if how == _ENTRIES:
        lower_name = _entry_names.get(name) or _entry_name(name)
        if lower_name is not None:
            for entry in carrier._list:
                if entry[1] == lower_name:
                    return carrier.get(name)
            return None
    if how != _PLAIN:
        # ``in`` first: a miss through httpx's ``get`` raises and catches KeyError.
        return carrier.get(name) if name in carrier else None
    get = getattr(carrier, "get", None)
    if not callable(get):
        return None
    for key in _spellings(name):
        value = get(key)
        if value is not None:
            return value
    return None


def _carrier_pop_if(carrier: Any, name: str, values: set[str]) -> None:
    """Remove header ``name`` only where its value is one of ``values``: one that we put there."""
    if _is_case_insensitive(carrier):
        if _carrier_get(carrier, name) in values:
            remove_header(carrier, name)
        return
    if not isinstance(carrier, MutableMapping):
        return
    for key in _spellings(name):
        if carrier.get(key) in values:
            del carrier[key]


class SessionPropagator(TextMapPropagator):
    """``X-Dynamo-Session-ID`` for Dynamo hosts, W3C baggage for trusted hosts, nothing elsewhere.

    The destination comes from the context (set by otel-session's client hooks, exact) or else from
    the carrier's ``host`` entry (what httpx puts in its header copy). Without either it is unknown,
    and an unknown destination receives nothing. Constructed without arguments (as the
    ``dynamo_session`` entry point is) it follows whatever ``configure()`` installed, else the
    ``OTEL_SESSION_*`` environment, and never raises.
    """

    def __init__(self, rules: HostRules | None = None) -> None:
        self._fixed = rules
        self._env_rules: HostRules | None = None

    def _rules(self) -> HostRules:
        if self._fixed is not None:
            return self._fixed
        settings = _settings.active()
        if settings is not None:
            return settings.rules
        if self._env_rules is None:
            try:
                self._env_rules = _settings.build_settings(tracing=False).rules
            except ValueError as exc:
                _faults.report("reading OTEL_SESSION_* host patterns", exc)
                self._env_rules = _EMPTY_RULES
        return self._env_rules

    def destination_kind(self, carrier: Any, context: Context) -> int:
        """``DYNAMO`` / ``TRUSTED`` flags for where ``carrier`` is headed, ``NOTHING`` if unknown."""
        rules = self._rules()
        destination = context.get(DESTINATION_KEY)
        if isinstance(destination, tuple):
            scheme, host, port = destination
            return rules.classify_url(scheme, host, port)
        authority = _carrier_get(carrier, "host")
        return rules.classify_authority(authority) if isinstance(authority, str) else NOTHING

    def inject(
        self, carrier: CarrierT, context: Context | None = None, setter: Setter[CarrierT] = default_setter
    ) -> None:
        try:
            ctx = context if context is not None else get_current()
            inject_for(self.destination_kind(carrier, ctx), carrier, ctx, setter)
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
        return {_SESSION, _PARENT, "baggage", *_tracecontext.fields}


_SESSION_ENTRY = (SESSION_HEADER.encode("ascii"), _SESSION.encode("ascii"))
_PARENT_ENTRY = (PARENT_SESSION_HEADER.encode("ascii"), _PARENT.encode("ascii"))


def inject_headers(
    kind: int, headers: Any, added: list[tuple[str, Any]], session: str | None, parent: str | None
) -> bool:
    """``inject_ids`` for the commonest request, in one pass; ``False`` (nothing done) for any other.

    Only for a context whose current span is not valid (the caller knows). It handles the header
    mapping of httpx / httpx2 (``Headers`` of the known layout) or aiohttp (``CIMultiDict``) going to
    a Dynamo or unconfigured host (not a trusted one) without a ``baggage`` header, which is every
    request of a tracing-off rollout, and does exactly what ``inject_ids`` with the hooks' undo
    setter would: add the absent session headers and note ``(name, None)`` in ``added`` for each.
    Anything else returns ``False`` before touching ``headers``, for ``inject_ids`` to handle.
    """
    how = _carrier_kinds.get(type(headers))
    if kind & TRUSTED or not how:  # a plain mapping, or a type not seen yet
        return False
    if session is None:
        return True  # no session and no span: inject_ids would neither add nor take anything
    if how == _ENTRIES:
        entries = headers._list
        present = {entry[1] for entry in entries}
        has_session, has_parent = _SESSION_ENTRY[1] in present, _PARENT_ENTRY[1] in present
        has_baggage = b"baggage" in present
    else:  # a case-insensitive mapping: ``in`` answers for every spelling
        has_session, has_parent, has_baggage = _SESSION in headers, _PARENT in headers, "baggage" in headers
    if has_baggage:
        return False  # ours may be in it, to take back
    if not kind & DYNAMO:
        # Not for Dynamo: only a session header someone copied here would need taking back.
        return not has_session and (parent is None or not has_parent)
    if not has_session:
        if how == _ENTRIES:  # session IDs are visible ASCII: encoded alike in any encoding
            entries.append((*_SESSION_ENTRY, session.encode("ascii")))
        else:
            headers[SESSION_HEADER] = session
        added.append((SESSION_HEADER, None))
        if parent is not None and not has_parent:
            if how == _ENTRIES:
                entries.append((*_PARENT_ENTRY, parent.encode("ascii")))
            else:
                headers[PARENT_SESSION_HEADER] = parent
            added.append((PARENT_SESSION_HEADER, None))
    return True


def inject_for(kind: int, carrier: Any, context: Context, setter: Setter[Any] = default_setter) -> None:
    """Write into ``carrier`` what a destination of ``kind`` may receive; take back ours elsewhere."""
    session, parent = session_ids(context)
    inject_ids(kind, carrier, context, setter, session, parent)


def inject_ids(
    kind: int, carrier: Any, context: Context, setter: Setter[Any], session: str | None, parent: str | None
) -> None:
    """``inject_for`` with ``session_ids(context)`` already read, as the client hooks have to anyway."""
    if kind & DYNAMO:
        if session is not None and _carrier_get(carrier, _SESSION) is None:
            setter.set(carrier, SESSION_HEADER, session)
            if parent is not None and _carrier_get(carrier, _PARENT) is None:
                setter.set(carrier, PARENT_SESSION_HEADER, parent)
    elif session is not None:
        _carrier_pop_if(carrier, _SESSION, {session})
        if parent is not None:
            _carrier_pop_if(carrier, _PARENT, {parent})
    span_context = trace.get_current_span(context).get_span_context()
    if kind:
        if span_context.is_valid:
            _tracecontext.inject(carrier, context, setter)
    elif span_context.is_valid:
        traceparent = _carrier_get(carrier, "traceparent")
        if isinstance(traceparent, str) and format(span_context.trace_id, "032x") in traceparent:
            _carrier_pop_if(carrier, "traceparent", {traceparent})
    if kind & TRUSTED:
        _baggage.inject(carrier, context, setter)
    elif session is not None:
        header = _carrier_get(carrier, "baggage")
        if isinstance(header, str) and f"{SESSION_KEY}={session}" in header:
            _carrier_pop_if(carrier, "baggage", {header})


def _first_valid(getter: Getter[Any], carrier: Any, name: str) -> str | None:
    for key in _spellings(name):
        values = getter.get(carrier, key)
        if values:
            value = values[0].strip() if isinstance(values[0], str) else None
            return value if is_valid_session_id(value) else None
    return None


def extract_session(carrier: Any, context: Context | None, getter: Getter[Any] = default_getter) -> Context:
    """Read ``traceparent``, baggage and the Dynamo session headers into a context.

    An explicit ``X-Dynamo-Session-ID`` wins over baggage (it is what Dynamo itself would use). Invalid
    values are dropped, never raised: an inbound header is untrusted input.
    """
    ctx = _tracecontext.extract(carrier, context, getter)
    raw = getter.get(carrier, "baggage")
    if raw and sum(len(value) for value in raw) <= _MAX_BAGGAGE_HEADER:
        ctx = _baggage.extract(carrier, ctx, getter)
    session = _first_valid(getter, carrier, _SESSION)
    if session is not None:
        return with_session(session, _first_valid(getter, carrier, _PARENT), ctx)
    in_baggage = baggage.get_all(ctx)
    if SESSION_KEY in in_baggage or PARENT_KEY in in_baggage:
        valid, parent = session_ids(ctx)
        if valid is None:
            ctx = baggage.remove_baggage(PARENT_KEY, baggage.remove_baggage(SESSION_KEY, ctx))
        else:
            ctx = with_session(valid, parent, ctx)
    return ctx
