"""A named boundary's ``[group=SPEC]`` (``otel_session._group_keys``), rule by rule, in the fast tier:
how a spec parses, how a path walks an argument, what each transform does, and what the user is
told when one does not apply. End to end over loopback: ``tests/test_boundaries_groups.py``.
"""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest

from otel_session._group_keys import GroupKey, Unresolved, digest, entry, name_of, split


def test_a_spec_parses_into_argument_path_and_transforms() -> None:
    key = GroupKey.parse(" data.messages.0 | before_last(:) | digest ")
    assert key.text == "data.messages.0 | before_last(:) | digest"
    assert (key.argument, key.path) == ("data", ("messages", 0))
    assert key.transforms == (("before_last", ":"), ("digest", ""))


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("", "'' is not an argument or a path into one (e.g. group=uid"),
        ("a..b", "'a..b' is not an argument or a path into one"),
        ("uid|upper", "'upper' is not a transform (digest or before_last(SEP))"),
    ],
)
def test_a_bad_spec_says_what_is_wrong_and_shows_examples(spec: str, said: str) -> None:
    with pytest.raises(ValueError, match="group=") as caught:
        GroupKey.parse(spec)
    assert said in str(caught.value), str(caught.value)


def test_a_path_reads_items_then_attributes_and_indexes_sequences() -> None:
    task = SimpleNamespace(meta={"tries": ["first", "second"]}, hash="h1")
    assert GroupKey.parse("task.meta.tries.1").read(task) == "second"
    assert GroupKey.parse("task.hash").read(task) == "h1"
    assert GroupKey.parse("data.keys").read({"keys": "an item wins over the dict's method"}) == (
        "an item wins over the dict's method"
    )


@pytest.mark.parametrize(
    ("spec", "value", "said"),
    [
        ("xs.2", ["a", "b"], "xs (list) has no 2"),  # one past the end: no index, no error of Python's
        ("xs.0", "text", "xs (str) has no 0"),  # a string is not a sequence to index
        ("xs.0", {"a": 1}, "xs (dict) has no 0"),  # nor is a mapping without that key
        ("xs.0", 7, "xs (int) has no 0"),  # an int index into a non-sequence
        ("task.missing", SimpleNamespace(), "task (SimpleNamespace) has no missing"),
        ("a.b.c", {"b": {"c": None}}, "a.b.c is None"),
    ],
)
def test_a_path_that_does_not_apply_says_where_it_stopped(spec: str, value: object, said: str) -> None:
    with pytest.raises(Unresolved) as caught:
        GroupKey.parse(spec).read(value)
    assert str(caught.value) == said


def test_before_last_cuts_at_the_last_separator_and_keeps_a_string_without_one() -> None:
    cut = GroupKey.parse("uid|before_last(:)")
    assert cut.read("task:7:3") == "task:7"  # the LAST separator: task ids may hold one too
    assert cut.read("task-7") == "task-7"
    assert GroupKey.parse("uid|before_last(::)").read("a::b::c") == "a::b"
    with pytest.raises(Unresolved, match=r"^uid is a int, not a string to cut$"):
        cut.read(7)


def test_digest_is_the_blake2b_of_the_canonical_json() -> None:
    messages = [{"role": "user", "content": "hi"}, {"content": "x", "role": "assistant"}]
    text = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    expected = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    assert digest(messages) == expected
    assert GroupKey.parse("data.messages|digest").read({"messages": messages}) == expected
    assert digest("\ud800") != digest("\ud801")  # a lone surrogate is digested, not refused


def test_a_value_that_cannot_be_hashed_is_digested_and_one_that_cannot_be_digested_says_where() -> None:
    key = GroupKey.parse("data.messages")
    messages = [{"role": "user", "content": "hi"}]
    assert key.read({"messages": messages}) == digest(messages)
    with pytest.raises(Unresolved, match=r"^data\.messages cannot be digested \(TypeError: "):
        key.read({"messages": [{1, 2}]})  # a set inside a list: neither hashable nor JSON
    with pytest.raises(Unresolved, match=r"^the value cannot be digested"):
        digest(object())


def test_entries_name_a_function_and_maybe_a_key() -> None:
    name, key = entry(" my_rl.rollouts:Agent.run [ group = uid ] ")
    assert name == "my_rl.rollouts:Agent.run" and key is not None and key.argument == "uid"
    assert entry("a:b") == ("a:b", None)
    with pytest.raises(ValueError) as bad:
        entry("not an entry")
    assert str(bad.value) == (
        "'not an entry' is not module:Qualified.name[group=...] (e.g. my_rl.rollouts:Agent.run_episode, "
        "my_rl.rollouts:run_episode[group=uid])"
    )
    with pytest.raises(ValueError, match=r"^a:b: group='x\|y'"):
        entry("a:b[group=x|y]")
    assert name_of("a:b[group=x|y]") == "a:b"


def test_split_keeps_brackets_whole_and_drops_empty_entries() -> None:
    assert split("a:b[group=x|before_last(,)],c:d") == ["a:b[group=x|before_last(,)]", "c:d"]
    assert split("a:b[group=x[0]],c:d") == ["a:b[group=x[0]]", "c:d"]  # nested brackets count back
    assert split("a:b[[x],y],c:d") == ["a:b[[x],y]", "c:d"]  # each ] closes one [ only
    assert split("a:b],c:d") == ["a:b]", "c:d"]  # a stray ] does not swallow the next separator
    assert split(" , a:b ,, ") == [" a:b "]


def test_a_container_whose_own_code_raises_says_what_raised_where() -> None:
    """The application's container raising as it is read (a lazy record) is one line naming the
    step, where it was, the container's type and the error's, never the error itself."""

    class Lazy(dict[str, object]):
        def __contains__(self, key: object) -> bool:
            raise KeyError("the record is gone")

    class Rows(list[object]):
        def __len__(self) -> int:
            raise RuntimeError("not loaded")

    with pytest.raises(Unresolved) as caught:
        GroupKey.parse("task.uid").read(Lazy())
    assert str(caught.value) == "reading uid of task (Lazy) raised KeyError"
    with pytest.raises(Unresolved) as caught:
        GroupKey.parse("rows.0").read(Rows([1]))
    assert str(caught.value) == "reading 0 of rows (Rows) raised RuntimeError"
