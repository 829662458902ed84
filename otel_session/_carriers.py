"""Carrier adapters: reading and editing headers in whatever object a request keeps them in.

The policy (``_policy.plan``) decides; these apply its answer to plain dicts, case-insensitive
mappings (multidict's ``CIMultiDict``, requests' ``CaseInsensitiveDict``), and httpx's / httpx2's
``Headers``. Every public lookup in an httpx ``Headers`` first decodes every header to find its
encoding, about a microsecond each, and this runs on every request; so for a ``Headers`` type whose
instances are checked once to keep ``_list`` exactly as expected ((raw name, lower-case name, value)
byte triples) the fast adapter reads and edits ``_list`` itself. A ``CIMultiDict`` (aiohttp's
headers) checked once to compare names ignoring case in its keys view, and to add and pop headers,
is asked "any of these names?" in one C call and edited with ``add``/``popall``, no scan in Python.
Any other layout, or any surprise, falls back to the public API.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, MutableMapping
from typing import Any

from opentelemetry.propagators.textmap import Setter

_PLAIN, _CASE_INSENSITIVE, _ENTRIES, _MULTIDICT = 0, 1, 2, 3
_CASE_INSENSITIVE_TYPES = frozenset(
    {
        ("httpx", "Headers"),
        ("httpx2", "Headers"),
        ("multidict", "CIMultiDict"),
        ("multidict", "CIMultiDictProxy"),
        ("requests", "CaseInsensitiveDict"),
    }
)
_kinds: dict[type, int] = {}
_LOWER_NAME = operator.itemgetter(1)  # of a fast ``Headers``' ``_list`` entry: the lower-case name
# Fast ``Headers`` types whose instances hold ``_list`` and ``_encoding`` and nothing else: a copy of
# one is made by setting those two (``_appended``).
_two_attribute_types: set[type] = set()


def _layout_holds(kind: type) -> tuple[bool, bool]:
    """Whether ``kind``'s instances keep ``_list`` as the fast adapter expects; and whether they hold
    nothing else."""
    try:
        probe = kind([("X-Probe", "1"), ("Other", "2"), ("x-PROBE", "3")])
        expected = [(b"X-Probe", b"x-probe", b"1"), (b"Other", b"other", b"2")]
        if probe._list != [*expected, (b"x-PROBE", b"x-probe", b"3")]:
            return False, False
        clone = copy_headers(probe, _ENTRIES)
        del clone["X-PROBE"]
        clone["New"] = "4"
        holds = bool(
            clone._list == [*expected[1:], (b"New", b"new", b"4")]
            and clone.get("other") == "2"
            and probe.get("x-probe") == "1, 3"
        )
        return holds, holds and sorted(vars(probe)) == ["_encoding", "_list"]
    except Exception:
        return False, False


def _multidict_holds(kind: type) -> bool:
    """Whether ``kind``'s instances compare names ignoring case in their keys view, and add and pop
    headers as ``CIMultiDict`` does (multidict 6.1 and later; older ones compare keys as spelled)."""
    try:
        probe = kind([("X-Probe", "1"), ("Other", "2")])
        keys = probe.keys()
        folds = not keys.isdisjoint(("x-probe", "absent")) and keys.isdisjoint(("x-absent",))
        probe.add("New", "3")
        probe.add("new", "4")
        probe.popall("NEW", None)
        return bool(folds and list(probe.items()) == [("X-Probe", "1"), ("Other", "2")])
    except Exception:
        return False


def kind_of(carrier: Any) -> int:
    """How to treat ``carrier``, decided once per type (exact type, by module and name)."""
    kind = type(carrier)
    found = _kinds.get(kind)
    if found is None:
        found = _PLAIN
        if (kind.__module__.partition(".")[0], kind.__qualname__) in _CASE_INSENSITIVE_TYPES:
            found = _CASE_INSENSITIVE
            if kind.__qualname__ == "Headers":
                _kinds[kind] = _CASE_INSENSITIVE  # while probing: copy_headers must not recurse
                try:
                    holds, two_attributes = _layout_holds(kind)
                finally:  # cached below like any answer: with the cache full, this one stuck
                    _kinds.pop(kind, None)
                found = _ENTRIES if holds else _CASE_INSENSITIVE
                if two_attributes:
                    _two_attribute_types.add(kind)
            elif kind.__qualname__ == "CIMultiDict" and _multidict_holds(kind):
                found = _MULTIDICT
        if len(_kinds) < 64:  # carrier types are few; bounded all the same
            _kinds[kind] = found
    return found


def _encoded(names: tuple[str, ...]) -> dict[bytes, str]:
    """``names`` as a fast ``Headers`` keeps lower-case names, to the names: read on every request."""
    found = _encodings.get(names)
    if found is None:
        found = {name.encode("latin-1"): name for name in names}
        if len(_encodings) < 256:  # names come from the few configured routes; bounded all the same
            _encodings[names] = found
    return found


_encodings: dict[tuple[str, ...], dict[bytes, str]] = {}


def read(carrier: Any, names: tuple[str, ...]) -> dict[str, str]:
    """The first value of each of ``names`` (lower-case) present in ``carrier``."""
    held: dict[str, str] = {}
    how = _kinds.get(type(carrier))
    if how is None:
        how = kind_of(carrier)
    if how == _ENTRIES:
        encoded = _encoded(names)
        if encoded.keys().isdisjoint(map(_LOWER_NAME, carrier._list)):
            return held  # the usual request: none of them, found without a Python loop
        for _, lower, _ in carrier._list:
            name = encoded.get(lower)
            if name is not None and name not in held:
                value = carrier.get(name)  # the public way for a hit: its encoding, its joining
                if isinstance(value, str):
                    held[name] = value.partition(",")[0] if name != "baggage" else value
        return held
    if how == _MULTIDICT and carrier.keys().isdisjoint(names):
        return held  # as for a fast ``Headers``: none of them, in one C call
    wanted = set(names)
    if how in (_CASE_INSENSITIVE, _MULTIDICT):
        getall = getattr(carrier, "getall", None)
        for name in wanted:
            if name in carrier:
                if name == "baggage" and callable(getall):  # a list header: every line of it
                    value = ",".join(line for line in getall(name) if isinstance(line, str))
                else:
                    value = carrier.get(name)
                if isinstance(value, str):
                    held[name] = value
        return held
    keys = getattr(carrier, "keys", None)
    if not callable(keys):
        return held
    for key in list(keys()):
        if isinstance(key, str) and key.lower() in wanted and key.lower() not in held:
            value = carrier.get(key)
            if isinstance(value, str):
                held[key.lower()] = value
    return held


# Header names as ``holds_any`` looks them up: as given (lower-case), and as a fast ``Headers``
# keeps them. Made once per set of names by ``names_to_find``.
Names = tuple[tuple[str, ...], frozenset[bytes]]


def names_to_find(names: tuple[str, ...]) -> Names:
    """``names`` (lower-case) ready for ``holds_any``, which runs on every request."""
    found = _to_find.get(names)
    if found is None:
        found = (names, frozenset(_encoded(names)))
        if len(_to_find) < 256:  # names come from the few configured routes; bounded all the same
            _to_find[names] = found
    return found


_to_find: dict[tuple[str, ...], Names] = {}


def holds_any(carrier: Any, names: Names) -> bool:
    """Whether ``carrier`` holds any of ``names`` (see ``names_to_find``). The usual request holds
    none of ours, and a fast ``Headers`` answers that without a Python loop over its headers."""
    if not names[0]:
        return False
    how = _kinds.get(type(carrier))
    if how == _ENTRIES:
        return not names[1].isdisjoint(map(_LOWER_NAME, carrier._list))
    if how == _MULTIDICT:
        return not carrier.keys().isdisjoint(names[0])
    return bool(read(carrier, names[0]))


def remove(carrier: Any, name: str) -> None:
    """Take header ``name`` (any case, every occurrence) out of ``carrier``."""
    how = _kinds.get(type(carrier))
    if how is None:
        how = kind_of(carrier)
    lower = name.lower()
    if how == _ENTRIES:
        encoded = lower.encode("latin-1")
        carrier._list[:] = [entry for entry in carrier._list if entry[1] != encoded]
        return
    if how == _MULTIDICT:
        carrier.popall(name, None)
        return
    if how == _CASE_INSENSITIVE:
        popall = getattr(carrier, "popall", None)
        if callable(popall):
            popall(name, None)
        else:
            carrier.pop(name, None)
        return
    if isinstance(carrier, MutableMapping):
        for key in [key for key in carrier if isinstance(key, str) and key.lower() == lower]:
            del carrier[key]


def write(carrier: Any, name: str, value: str, setter: Setter[Any] | None = None) -> None:
    """Set header ``name`` to ``value``, replacing any value of it in any case."""
    how = _kinds.get(type(carrier))
    if how is None:
        how = kind_of(carrier)
    if how == _ENTRIES and value.isascii():
        remove(carrier, name)
        carrier._list.append((name.encode("ascii"), name.lower().encode("ascii"), value.encode("ascii")))
        return
    if how == _PLAIN:
        remove(carrier, name)  # a plain dict would otherwise keep both spellings
    if setter is not None:
        setter.set(carrier, name, value)
    else:
        carrier[name] = value


def copy_headers(headers: Any, how: int | None = None) -> Any:
    """A copy of an httpx ``Headers`` to edit for one hop, leaving the caller's object as it was."""
    if (how if how is not None else kind_of(headers)) == _ENTRIES:
        return _copy(headers, "_list", list(headers._list))
    return headers.copy()


def copy_request(request: Any, edits: list[tuple[str, str | None]], held: frozenset[str]) -> Any:
    """A shallow copy of an httpx ``Request`` (same body, same extensions) whose own headers carry
    ``edits``; ``held`` as for ``apply``. The caller's ``Request`` and its headers stay as they were."""
    return _copy(request, "headers", _headers_with(request.headers, edits, held))


def request_for_transport(request: Any, edits: list[tuple[str, str | None]], held: frozenset[str]) -> Any:
    """What a transport that reads only ``TRANSPORT_READS`` of a request (httpx's own: its
    instrumentor checks) sends in place of ``request``: those attributes, headers with ``edits`` of
    their own. The caller's ``Request`` and its headers stay as they were."""
    return _for_transport(request, _headers_with(request.headers, edits, held))


TRANSPORT_READS = frozenset({"method", "url", "headers", "stream", "extensions"})


def stand_in(request: Any, names: frozenset[bytes], entries: Entries) -> Any | None:
    """``request_for_transport`` on the express path, for edits known as ``entries``: ``None``
    (plan it in full) unless its headers are of the layout ``_layout_holds`` saw and hold none of
    ``names`` (as a fast ``Headers`` keeps names: ``names_to_find``'s second part)."""
    headers = request.headers
    if type(headers) not in _two_attribute_types or not names.isdisjoint(map(_LOWER_NAME, headers._list)):
        return None
    return _for_transport(request, _appended(headers, entries))


def _for_transport(request: Any, headers: Any) -> Any:
    """The stand-in itself: ``TRANSPORT_READS`` of ``request``, with ``headers``.

    Set directly, as few as that: unlike ``copy_request``, it never reads the caller's ``__dict__``,
    which would make every later read of the caller's object slower too (measured: more than the copy).
    """
    clone = object.__new__(type(request))
    clone.method, clone.url, clone.stream = request.method, request.url, request.stream
    clone.extensions = request.extensions
    clone.headers = headers
    return clone


def _appended(headers: Any, entries: Entries) -> Any:
    """A copy of a fast ``Headers`` of the layout ``_layout_holds`` saw (two attributes, set
    directly), ``entries`` appended to its list."""
    copy = object.__new__(type(headers))
    copy._list = headers._list + entries
    copy._encoding = headers._encoding
    return copy


Entries = list[tuple[bytes, bytes, bytes]]  # header entries as a fast ``Headers`` keeps them in ``_list``


def entries_for(edits: list[tuple[str, str | None]]) -> Entries | None:
    """``edits`` as entries to append to a fast ``Headers``' ``_list``; ``None`` if there are none,
    or one takes a header away or is not ASCII (then they are applied one by one)."""
    if not edits:
        return None
    entries = [
        (name.encode("ascii"), name.lower().encode("ascii"), value.encode("ascii"))
        for name, value in edits
        if value is not None and name.isascii() and value.isascii()
    ]
    return entries if len(entries) == len(edits) else None


def _headers_with(headers: Any, edits: list[tuple[str, str | None]], held: frozenset[str]) -> Any:
    """A copy of ``headers`` with ``edits`` made."""
    if not held and _kinds.get(type(headers)) == _ENTRIES:
        entries = entries_for(edits)
        if entries is not None:  # the usual hop: new headers appended to a copy of the caller's list
            if type(headers) in _two_attribute_types:
                return _appended(headers, entries)
            return _copy(headers, "_list", headers._list + entries)
    copy = copy_headers(headers)
    apply(copy, edits, held=held)
    return copy


def _copy(obj: Any, name: str, value: Any) -> Any:
    """A shallow copy of ``obj``, every attribute (a caller's own too), whose ``name`` is ``value``.

    Built attribute by attribute, in the original's order: ``clone.__dict__.update()`` would give
    the copy a materialised dict, which CPython's attribute caches serve slower on every later read,
    and httpx reads the hop's request often enough for that to cost more per request (about 30 k
    instructions, measured) than everything else otel-session does.
    """
    clone = object.__new__(type(obj))
    attributes = obj.__dict__
    for key, current in attributes.items():
        setattr(clone, key, value if key == name else current)
    if name not in attributes:
        setattr(clone, name, value)
    return clone


def apply(
    carrier: Any,
    edits: Iterable[tuple[str, str | None]],
    setter: Setter[Any] | None = None,
    held: frozenset[str] | None = None,
) -> None:
    """Make ``edits`` (``(name, value)`` to set, ``(name, None)`` to take away) on ``carrier``.

    ``held``: the lower-case names the carrier was just read to hold, if known; any other is absent,
    so a fast ``Headers`` or a ``CIMultiDict`` adds it without looking for an old value first.
    """
    how = _kinds.get(type(carrier)) if held is not None and setter is None else None
    for name, value in edits:
        if value is None:
            remove(carrier, name)
        elif how == _MULTIDICT and name.lower() not in held:  # type: ignore[operator]
            carrier.add(name, value)
        elif how == _ENTRIES and name.lower() not in held and value.isascii():  # type: ignore[operator]
            carrier._list.append((name.encode("ascii"), name.lower().encode("ascii"), value.encode("ascii")))
        else:
            write(carrier, name, value, setter)


def snapshot(carrier: Any, held: frozenset[str]) -> list[tuple[str, str]] | None:
    """A multidict carrier's items now, in order and as spelled, for ``restore`` after one hop; ``None``
    where it holds none of the names the hop edits (``held`` empty): ours are then only added, and
    taking them back is taking them away, with no copy of the rest."""
    return list(carrier.items()) if held else None


def restore(carrier: Any, saved: list[tuple[str, str]] | None, names: Iterable[str]) -> None:
    """Put back a multidict carrier's ``snapshot`` for ``names`` (the headers we edited): the caller's
    own values in their places and spellings, ours gone. What the client added meanwhile under other
    names (aiohttp's ``Connection``, say) stays, after them.
    """
    if saved is None:
        for name in names:
            remove(carrier, name)
        return
    ours = {name.lower() for name in names}
    added = list(carrier.items())
    for item in saved:
        if item[0].lower() not in ours and item in added:
            added.remove(item)
    carrier.clear()
    carrier.extend(saved)
    carrier.extend(item for item in added if item[0].lower() not in ours)
