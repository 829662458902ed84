"""Reading and editing headers in the carriers clients really use (``otel_session._carriers``), in the
fast tier: httpx's ``Headers`` (read through ``get_list``), multidict's ``CIMultiDict`` (``getall``),
requests' ``CaseInsensitiveDict`` (plain ``get``) and plain dicts."""

from __future__ import annotations

import httpx
import pytest
from multidict import CIMultiDict
from requests.structures import CaseInsensitiveDict

from otel_session import _carriers

NAMES = ("baggage", "x-dynamo-session-id")


def test_httpx_headers_are_read_as_sent_never_joined_with_a_space() -> None:
    headers = httpx.Headers(
        [("Baggage", "a=1"), ("baggage", "b=2"), ("X-Dynamo-Session-ID", "s1"), ("x-dynamo-session-id", "s2")]
    )
    assert _carriers.read(headers, NAMES) == {"baggage": "a=1,b=2", "x-dynamo-session-id": "s1"}


def test_multidict_lines_are_read_with_getall() -> None:
    headers = CIMultiDict([("BAGGAGE", "a=1"), ("Baggage", "b=2"), ("X-Dynamo-Session-ID", "s1")])
    assert _carriers.read(headers, NAMES) == {"baggage": "a=1,b=2", "x-dynamo-session-id": "s1"}


def test_a_case_insensitive_dict_is_read_with_get_and_a_value_that_is_no_string_is_skipped() -> None:
    headers = CaseInsensitiveDict({"Baggage": "a=1", "X-Dynamo-Session-ID": 7})
    assert _carriers.read(headers, NAMES) == {"baggage": "a=1"}
    assert _carriers.read(CaseInsensitiveDict({"X-Dynamo-Session-ID": "s"}), NAMES) == {
        "x-dynamo-session-id": "s"
    }


def test_a_plain_dict_is_read_in_any_case_and_the_first_spelling_wins() -> None:
    headers = {"Baggage": "a=1", "baggage": "b=2", "X-DYNAMO-SESSION-ID": "s", 3: "not a name", "other": "x"}
    assert _carriers.read(headers, NAMES) == {"baggage": "a=1", "x-dynamo-session-id": "s"}
    assert _carriers.read({"baggage": 5}, NAMES) == {}
    assert _carriers.read(object(), NAMES) == {}  # no keys at all: nothing read


def test_case_insensitivity_is_decided_once_per_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_carriers, "_case_insensitive", {})  # earlier tests' types may have filled it
    assert _carriers.case_insensitive(httpx.Headers()) is True
    assert _carriers._case_insensitive[httpx.Headers] is True
    assert _carriers.case_insensitive({}) is False and _carriers._case_insensitive[dict] is False
    monkeypatch.setattr(_carriers, "_CASE_INSENSITIVE_TYPES", frozenset())
    assert _carriers.case_insensitive(httpx.Headers()) is True  # decided: not looked up again


@pytest.mark.parametrize(
    "make",
    [dict, httpx.Headers, CIMultiDict, CaseInsensitiveDict],
    ids=["dict", "httpx", "multidict", "requests"],
)
def test_write_replaces_every_spelling_and_remove_takes_every_one(make: type) -> None:
    headers = make()
    headers["Baggage"] = "old"
    if make is CIMultiDict:
        headers.add("baggage", "older")
    _carriers.write(headers, "baggage", "new")
    assert _carriers.read(headers, ("baggage",)) == {"baggage": "new"}
    _carriers.apply(headers, [("baggage", None), ("x-dynamo-session-id", "s")])
    assert _carriers.read(headers, NAMES) == {"x-dynamo-session-id": "s"}
