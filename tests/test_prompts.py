"""What a request body's prompt digest (``otel_session._prompts.key_of``) reads and what it refuses.

The digest names a GRPO group without the caller saying so (``tests/test_siblings_inferred.py`` shows
it end to end); here its rules, each pinned on its own: which field, which bodies, what makes two
keys equal and what keeps them apart.
"""

from __future__ import annotations

import json
import re

import pytest

from otel_session._prompts import MAX_BODY, key_of

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]


def _body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_a_key_is_a_tagged_hex_digest_of_sixteen_bytes() -> None:
    key = key_of(_body(model="m", messages=CHAT))
    assert key is not None and key[0] == "prompt" and re.fullmatch(r"[0-9a-f]{32}", key[1]), key


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview, str])
def test_every_kind_of_body_in_memory_gives_the_same_key(kind: type) -> None:
    raw = _body(model="m", messages=CHAT)
    body = raw.decode() if kind is str else kind(raw)
    assert key_of(body) == key_of(raw) is not None


def test_the_key_ignores_layout_and_key_order_but_not_content() -> None:
    compact = json.dumps({"model": "m", "messages": CHAT}, separators=(",", ":"))
    spaced = json.dumps({"messages": [dict(reversed(m.items())) for m in CHAT], "model": "m"}, indent=2)
    assert key_of(compact) == key_of(spaced) is not None
    other = [*CHAT[:1], {"role": "user", "content": "3+3?"}]
    assert key_of(_body(model="m", messages=other)) != key_of(compact)


def test_the_model_and_the_field_are_part_of_the_key() -> None:
    assert key_of(_body(model="a", messages=CHAT)) != key_of(_body(model="b", messages=CHAT))
    assert key_of(_body(model="m", prompt="hello")) != key_of(_body(model="m", input="hello"))
    assert key_of(_body(prompt="hello")) != key_of(_body(model="m", prompt="hello"))


def test_fields_are_read_in_order_and_a_missing_one_is_skipped() -> None:
    both = key_of(_body(model="m", messages=CHAT, prompt="p"))
    assert both == key_of(_body(model="m", messages=CHAT))  # messages first
    assert key_of(_body(model="m", messages=None, prompt="p")) == key_of(_body(model="m", prompt="p"))
    assert key_of(_body(model="m", prompt=None, input=["x"])) == key_of(_body(model="m", input=["x"]))


@pytest.mark.parametrize("value", ["", [], 7, {"role": "user"}, True])
def test_an_empty_or_odd_prompt_names_no_group_and_does_not_fall_through(value: object) -> None:
    assert key_of(_body(model="m", messages=value, prompt="p")) is None


@pytest.mark.parametrize(
    "body",
    [
        None,
        b"",
        "",
        b"[1, 2]",
        b'"text"',
        b"null",
        b"{not json",
        b"\xff\xfe{}",
        b'{"model": "m"}',
        "[" * 100_000,
    ],
)
def test_a_body_without_a_readable_prompt_names_no_group(body: object) -> None:
    assert key_of(body) is None  # type: ignore[arg-type]


def test_bodies_up_to_the_limit_are_read_and_longer_ones_are_not() -> None:
    head = b'{"model":"m","prompt":"'
    filler = MAX_BODY - len(head) - 2
    at_limit = head + b"x" * filler + b'"}'
    assert len(at_limit) == MAX_BODY and key_of(at_limit) is not None
    over = head + b"x" * (filler + 1) + b'"}'
    assert key_of(over) is None
    assert key_of(over.decode()) is None  # a str is measured too
