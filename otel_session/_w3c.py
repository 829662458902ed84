"""The W3C text formats otel-session writes and reads: ``baggage`` and ``traceparent``.

OpenTelemetry's own baggage propagator percent-encodes every value with ``urllib.parse.quote``, so a
forwarded header grows with each hop (``episode:42`` becomes ``episode%3A42``) until servers refuse
it, and it cannot tell our members apart from a caller's. Here a value is encoded only where the
W3C grammar requires, members are compared by their decoded value however they were encoded, and the
header is kept within what servers accept, dropping other members before ever dropping ours.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from urllib.parse import unquote_plus

from opentelemetry.trace import SpanContext

MAX_HEADER_BYTES = 8192  # what OpenTelemetry's propagators (and common servers' defaults) accept
MAX_MEMBER_BYTES = 4096
MAX_MEMBERS = 180

_KEY = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# baggage-octet: visible ASCII but DQUOTE, comma, semicolon, backslash; '%' starts an escape.
# '+' is escaped too: OpenTelemetry's extractor decodes values with ``unquote_plus``.
_UNSAFE = re.compile(r"[^\x21\x23-\x24\x26-\x2a\x2d-\x3a\x3c-\x5b\x5d-\x7e]")


_OWS = " \t"  # HTTP's optional white space: the only thing trimmed around members


def _quote(value: str) -> str:
    """Percent-encode what the grammar does not allow; ``UnicodeEncodeError`` if it has no UTF-8 form."""
    if _UNSAFE.search(value) is None:
        return value
    return _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode("utf-8")), value)


def _decode(text: str) -> str:
    """A key or value as OpenTelemetry's extractor reads it (decoded, then any white space trimmed)."""
    return unquote_plus(text).strip()


def member(key: str, value: object) -> str | None:
    """``key=value`` encoded, or ``None`` where it cannot be sent (no token, too long, no UTF-8 form).

    The key is encoded too: OpenTelemetry's extractor decodes keys, so a ``%`` or ``+`` in one must
    be escaped to arrive as written. The result is ASCII, so its length is its size in bytes.
    """
    if not _KEY.fullmatch(key):
        return None
    try:
        text = f"{_quote(key)}={_quote(str(value))}"
    except UnicodeEncodeError:  # a lone surrogate: nothing a receiver could decode
        return None
    return text if len(text) <= MAX_MEMBER_BYTES else None


def _parts(header: str) -> list[str]:
    return [part.strip(_OWS) for part in header.split(",") if part.strip(_OWS)]


# baggage-octet as written on the wire (percent escapes included): a DQUOTE, comma, semicolon,
# backslash, space or control character in a value makes the member invalid, as the stock extractor holds.
_WRITTEN_VALUE = re.compile(r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*")


def well_formed_value(member_text: str) -> bool:
    """Whether a member, as written, has a value of baggage-octets only (its properties aside)."""
    return _WRITTEN_VALUE.fullmatch(member_text.partition("=")[2].partition(";")[0].strip(_OWS)) is not None


def decoded_members(header: str) -> list[tuple[str, str, str]]:
    """(decoded key, decoded value, member text as written) for each well-formed member of ``header``."""
    found = []
    for text in _parts(header):
        key, sep, rest = text.partition("=")
        if sep and _KEY.fullmatch(_decode(key)):
            found.append((_decode(key), _decode(rest.partition(";")[0]), text))
    return found


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _build(base: str, lead: list[str | None], rest: Iterable[str | None]) -> str | None:
    """``base`` (members as written) then ``lead`` then what of ``rest`` fits; ``None`` if ``lead``
    does not fit whole: then nothing is added at all, never another member in the session's place.
    """
    members = [base] if base else []
    size, count = _size(base), len(_parts(base))

    def fits(text: str) -> bool:
        return count < MAX_MEMBERS and size + len(text) + (1 if members else 0) <= MAX_HEADER_BYTES

    for text in lead:
        if text is None or not fits(text):
            return None
        size, count = size + len(text) + (1 if members else 0), count + 1
        members.append(text)
    for candidate in rest:
        if candidate is not None and fits(candidate):
            size, count = size + len(candidate) + (1 if members else 0), count + 1
            members.append(candidate)
    return ",".join(members) or None


def _lead(entries: Mapping[str, object], first: Sequence[str], absent: Callable[[str], bool]) -> list[str]:
    """The ``first`` keys to send, in order, each only with the one before it (no parent without
    its session); the others of ``first`` are not sent at all."""
    keys = []
    for key in first:
        if key not in entries or not absent(key):
            break
        keys.append(key)
    return keys


def encode_baggage(entries: Mapping[str, object], first: Sequence[str] = ()) -> str | None:
    """The ``baggage`` header for ``entries``, ``first`` keys leading; ``None`` when empty."""
    lead = _lead(entries, first, lambda key: True)
    rest = (member(key, value) for key, value in entries.items() if key not in first)
    return _build("", [member(key, entries[key]) for key in lead], rest)


def merge_baggage(theirs: str, entries: Mapping[str, object], first: Sequence[str] = ()) -> str:
    """``theirs`` as written, then the members of ``entries`` whose keys it lacks, within budget.

    Where our ``first`` members (the session) do not fit, ``theirs`` goes as it is, alone.
    """
    present = {key for key, _, _ in decoded_members(theirs)}
    base = theirs.strip(_OWS)
    lead = _lead(entries, first, lambda key: key not in present)
    rest = (member(k, v) for k, v in entries.items() if k not in present and k not in first)
    merged = _build(base, [member(key, entries[key]) for key in lead], rest)
    return theirs if merged is None else merged


def without_members(header: str, ours: Mapping[str, str]) -> str | None:
    """``header`` less the members equal to ``ours`` (by decoded key and value); ``None`` if nothing
    is left. Returns ``header`` itself when none of ours is in it.
    """
    kept, dropped = [], False
    for text in _parts(header):
        key, sep, rest = text.partition("=")
        if sep and ours.get(_decode(key)) == _decode(rest.partition(";")[0]):
            dropped = True
        else:
            kept.append(text)
    if not dropped:
        return header
    return ",".join(kept) or None


def traceparent(span_context: SpanContext) -> str:
    """The ``traceparent`` value naming ``span_context`` as the parent."""
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{span_context.trace_flags:02x}"


def trace_id_of(header: str) -> str | None:
    """The trace ID (32 lower-case hex digits) of a ``traceparent`` value, ``None`` if malformed."""
    parts = header.strip().split("-")
    return parts[1].lower() if len(parts) >= 4 and len(parts[1]) == 32 else None
