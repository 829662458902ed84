"""The W3C formats at their edges: the byte budgets to the byte, members as written, ``traceparent``.

tests/test_policy.py checks the formats as properties over generated cases; the cases here are the
exact boundaries a generator rarely hits (a header of exactly 8,192 bytes, a member of exactly 4,096,
exactly 180 members), each written out with what OpenTelemetry's own extractor reads from it.
"""

from __future__ import annotations

import pytest
from opentelemetry import baggage
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context

from otel_session._w3c import (
    MAX_HEADER_BYTES,
    MAX_MEMBER_BYTES,
    MAX_MEMBERS,
    decoded_members,
    encode_baggage,
    member,
    merge_baggage,
    trace_id_of,
    well_formed_value,
    without_members,
)

FIRST = ("session.id", "session.parent_id")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def otel_read(header: str) -> dict[str, object]:
    return dict(baggage.get_all(W3CBaggagePropagator().extract({"baggage": header}, Context())))


def filler(key: str, size: int) -> tuple[str, str]:
    """A member ``key=vvv...`` of exactly ``size`` bytes, as (key, value)."""
    return key, "v" * (size - len(key) - 1)


def test_a_member_of_exactly_4096_bytes_is_sent_and_one_more_is_not() -> None:
    key, value = filler("k", MAX_MEMBER_BYTES)
    assert member(key, value) == f"{key}={value}" and len(f"{key}={value}") == MAX_MEMBER_BYTES
    assert member(key, value + "v") is None
    assert member("k", "é" * 1364) is None  # 2 + 1364 * 6 bytes of escapes: 8186, too long...
    assert member("k", "é" * 682) == "k=" + "%C3%A9" * 682  # ...4094 bytes is not


def test_a_header_of_exactly_8192_bytes_is_built_and_a_byte_more_drops_that_member() -> None:
    """Two members and their comma fill the budget exactly; one byte more and the second is left
    out, never cut, while a later member that still fits goes."""
    a, b = filler("a", MAX_MEMBER_BYTES), filler("b", MAX_HEADER_BYTES - MAX_MEMBER_BYTES - 1)
    header = encode_baggage(dict([a, b]))
    assert header is not None and len(header) == MAX_HEADER_BYTES
    assert otel_read(header) == dict([a, b])
    over = filler("b", MAX_HEADER_BYTES - MAX_MEMBER_BYTES)
    assert encode_baggage(dict([a, over, ("c", "1")])) == f"{a[0]}={a[1]},c=1"


def test_the_session_and_parent_lead_and_the_budget_counts_them() -> None:
    """session.id and session.parent_id first, then others to exactly 8,192 bytes."""
    lead = {"session.id": "s", "session.parent_id": "p"}
    used = len("session.id=s,session.parent_id=p,")
    rest = dict([filler("a", MAX_MEMBER_BYTES), filler("b", MAX_HEADER_BYTES - used - MAX_MEMBER_BYTES - 1)])
    header = encode_baggage({**rest, **lead}, FIRST)
    assert header is not None and len(header) == MAX_HEADER_BYTES
    assert header.startswith("session.id=s,session.parent_id=p,a=")
    assert otel_read(header) == {**lead, **rest}
    rest["b"] += "v"
    assert encode_baggage({**rest, **lead}, FIRST) == "session.id=s,session.parent_id=p,a=" + rest["a"]


def test_exactly_180_members_are_sent() -> None:
    entries = {"session.id": "s", "session.parent_id": "p"} | {f"m{i}": "v" for i in range(MAX_MEMBERS)}
    header = encode_baggage(entries, FIRST)
    assert header is not None
    members = header.split(",")
    assert len(members) == MAX_MEMBERS
    assert members[:3] == ["session.id=s", "session.parent_id=p", "m0=v"]
    assert members[-1] == f"m{MAX_MEMBERS - 3}=v"


def test_appending_to_a_callers_baggage_counts_its_bytes_and_members() -> None:
    theirs = ",".join(f"t{i}=v" for i in range(MAX_MEMBERS - 2))
    merged = merge_baggage(theirs, {"session.id": "s", "session.parent_id": "p", "k": "v"}, FIRST)
    assert merged == theirs + ",session.id=s,session.parent_id=p"  # 180 members: no room for k
    key, value = filler("t", MAX_HEADER_BYTES - len(",session.id=s"))
    merged = merge_baggage(f"{key}={value}", {"session.id": "s", "k": "v"}, FIRST)
    assert merged == f"{key}={value},session.id=s" and len(merged) == MAX_HEADER_BYTES


def test_where_the_session_does_not_fit_the_callers_baggage_goes_alone_as_written() -> None:
    theirs = " " + "k=" + "v" * (MAX_HEADER_BYTES - 10) + "\t"
    assert merge_baggage(theirs, {"session.id": "sess-1", "t": "a"}, FIRST) is theirs


def test_a_callers_session_is_theirs_and_no_parent_comes_without_ours() -> None:
    """The caller named a session: ours is not appended, nor our parent (it would be the parent of
    another session); other members still are."""
    theirs = "session.id=theirs,k=v"
    entries = {"session.id": "mine", "session.parent_id": "my-parent", "t": "a"}
    assert merge_baggage(theirs, entries, FIRST) == theirs + ",t=a"
    assert merge_baggage("session.id%3Dx=1,k=v", entries, FIRST).startswith(
        "session.id%3Dx=1,k=v,session.id=mine"
    )


def test_members_are_read_as_written_properties_aside() -> None:
    assert decoded_members(" k = v ;p=1, junk,=x,a%41=b+c ,k2=v2;q") == [
        ("k", "v", "k = v ;p=1"),
        ("aA", "b c", "a%41=b+c"),
        ("k2", "v2", "k2=v2;q"),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("k=v", True),
        ("k=v;p=1", True),
        ("k=v;p=1;q=2", True),
        ('k=v;p="quoted"', True),  # properties are not the value
        ("k= v\t", True),  # optional white space is not the value either
        ("k=%22a%22", True),  # escaped, any octet may be sent
        ("k=", True),
        ("k=a b", False),
        ("k=a b;p=1", False),
        ('k=a"b', False),
        ("k=a\\b", False),
        ("k=v\xa0", False),  # a no-break space is no white space of HTTP's
        ("k=v\x85", False),
        ("k=v=w", True),  # '=' is a baggage-octet
    ],
)
def test_a_value_as_written_is_checked_against_the_baggage_octets(text: str, expected: bool) -> None:
    assert well_formed_value(text) is expected


def test_taking_members_back_keeps_the_rest_byte_for_byte() -> None:
    ours = {"session.id": "s"}
    assert without_members("tenant=acme\xa0,session.id=s", ours) == "tenant=acme\xa0"
    assert without_members("\xa0,session.id=s;p=1", ours) == "\xa0"
    assert without_members(" session.id=s ,\t", ours) is None
    header = "tenant=acme, k=v"
    assert without_members(header, ours) is header


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (f"00-{TRACE_ID}-00f067aa0ba902b7-01", TRACE_ID),
        (f" 00-{TRACE_ID.upper()}-00f067aa0ba902b7-01\t", TRACE_ID),
        (f"01-{TRACE_ID}-00f067aa0ba902b7-01-future", TRACE_ID),  # a later version may add fields
        (f"00-{TRACE_ID}-00f067aa0ba902b7", None),
        (f"00-{TRACE_ID}1-00f067aa0ba902b7-01", None),
        (f"00-{TRACE_ID[:-1]}-00f067aa0ba902b7-01", None),
        (f"00 {TRACE_ID} 00f067aa0ba902b7 01", None),
        ("", None),
    ],
)
def test_the_trace_id_of_a_traceparent(header: str, expected: str | None) -> None:
    assert trace_id_of(header) == expected
