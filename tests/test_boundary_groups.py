"""Group keys for named boundaries: ``module:function[group=argument.path]`` (issue 35, item 2).

A framework keeps each attempt's group somewhere of its own (rLLM's ``uid``, AReaL's ``data``, TRL's
``group_id``, a task's ``hash``); the entry says where, and attempts whose key there is equal are
siblings under the default (``groups:2``: each two open at once under one parent). Real httpx
requests to a loopback recording server configured as a Dynamo host; the framework's module is
written to a temporary folder per test and imported as a framework's would be.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER
from otel_session._settings import SettingError, build
from otel_session.instrumentation.boundaries import group_key, split
from tests.recorder import Recorder

FRAMEWORK = """
import threading, httpx

URL = None
gate = None  # a threading.Barrier: every attempt open before any sends, as a GRPO step's siblings are


def _wait():
    if gate is not None:
        gate.wait(10)

def post(body):
    httpx.post(URL + "/v1/chat/completions", json=body)

class Task:
    def __init__(self, prompt_id, messages):
        self.prompt_id = prompt_id
        self.data = {"messages": messages}

class Workflow:
    def run(self, task, uid, **kwargs):
        _wait()
        post({})  # a body naming no prompt: only the boundary's group can pair siblings
        post({})
        return uid

def generate_one(prompt, group_id):
    _wait()
    post({})
    return group_id
"""


@pytest.fixture
def framework(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dynamo: Recorder) -> Iterator[ModuleType]:
    name = f"fw_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(FRAMEWORK)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__(name)
    otel_session.unconfigure()
    sys.modules.pop(name, None)


def _configure(module: ModuleType, dynamo: Recorder, *entries: str) -> None:
    otel_session.configure(
        dynamo_hosts=[dynamo.authority], trajectory_functions=[f"{module.__name__}:{e}" for e in entries]
    )
    module.URL = dynamo.url


def _at_once(module: ModuleType, calls: list[Callable[[], object]]) -> list[object]:
    """The calls on threads of their own, every attempt opened before any request is sent."""
    module.gate = threading.Barrier(len(calls))
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=30) for f in [pool.submit(call) for call in calls]]


def _by_attempt(dynamo: Recorder) -> dict[str, str | None]:
    """Each attempt's session and the one parent all its requests carried."""
    parents: dict[str, set[str | None]] = {}
    for session, parent in _parents(dynamo):
        assert session is not None
        parents.setdefault(session, set()).add(parent)
    assert all(len(p) == 1 for p in parents.values()), parents  # one parent for every request of one
    return {session: next(iter(p)) for session, p in parents.items()}


def _parents(dynamo: Recorder) -> list[tuple[str | None, str | None]]:
    return [(seen.get(SESSION_HEADER), seen.get(PARENT_SESSION_HEADER)) for seen in dynamo.requests]


def test_an_entry_splits_into_module_function_and_group_path() -> None:
    assert split("a.b:C.run[group=task.data.0]") == ("a.b", "C.run", ("task", "data", "0"))
    assert split("a.b:run") == ("a.b", "run", ())


def test_group_keys_are_equal_for_equal_values_and_keep_no_text() -> None:
    messages = [{"role": "user", "content": "solve x"}]
    assert group_key(messages) == group_key([{"content": "solve x", "role": "user"}])
    assert group_key(messages) != group_key([{"role": "user", "content": "solve y"}])
    assert group_key("1") != group_key(1)  # the type is part of the key
    assert "solve" not in group_key(messages) and len(group_key(messages)) == 32
    looped: list[object] = []
    looped.append(looped)
    assert len(group_key(looped)) == 32  # no JSON form: its repr


def test_siblings_named_by_an_argument_attribute_pair_up_under_one_parent(
    framework: ModuleType, dynamo: Recorder
) -> None:
    _configure(framework, dynamo, "Workflow.run[group=task.prompt_id]")
    workflow = framework.Workflow()
    tasks = {"a": "p1", "b": "p1", "c": "p2"}
    done = _at_once(
        framework, [lambda u=u, p=p: workflow.run(framework.Task(p, []), u) for u, p in tasks.items()]
    )
    assert done == ["a", "b", "c"] and len(dynamo.requests) == 6
    parents = _by_attempt(dynamo)
    assert len(parents) == 3 and all(parents.values())  # three attempts, each with a parent
    assert len(set(parents.values())) == 2  # p1's two share one parent, p2 has its own


def test_unhashable_group_values_are_digested_and_keyword_arguments_found(
    framework: ModuleType, dynamo: Recorder
) -> None:
    _configure(framework, dynamo, "Workflow.run[group=task.data.messages]")
    workflow = framework.Workflow()
    same = [{"role": "user", "content": "same prompt"}]
    _at_once(framework, [lambda i=i: workflow.run(task=framework.Task(i, list(same)), uid=i) for i in "ab"])
    parents = _by_attempt(dynamo)
    assert len(parents) == 2 and len(set(parents.values())) == 1 and None not in parents.values()


def test_a_plain_argument_is_a_group_key_too(framework: ModuleType, dynamo: Recorder) -> None:
    _configure(framework, dynamo, "generate_one[group=group_id]")
    assert _at_once(framework, [lambda g=g: framework.generate_one("prompt", g) for g in (7, 7, 8)]) == [
        7,
        7,
        8,
    ]
    parents = _by_attempt(dynamo)
    assert len(parents) == 3 and None not in parents.values() and len(set(parents.values())) == 2


def test_a_path_that_does_not_resolve_warns_once_and_the_attempt_still_runs(
    framework: ModuleType, dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    _configure(framework, dynamo, "Workflow.run[group=task.no_such_field]")
    caplog.set_level(logging.WARNING)
    workflow = framework.Workflow()
    assert workflow.run(framework.Task("p", []), "u1") == "u1"
    assert workflow.run(framework.Task("p", []), "u2") == "u2"
    said = [r.getMessage() for r in caplog.records if "does not resolve at a call" in r.getMessage()]
    assert (
        len(said) == 1 and "Workflow.run[group=task.no_such_field]" in said[0] and "no_such_field" in said[0]
    )
    seen = _parents(dynamo)
    assert len(seen) == 4 and all(session for session, _ in seen)  # still one session per attempt
    assert seen[0][0] != seen[2][0] and not any(parent for _, parent in seen)  # no group: no parent


def test_a_bad_group_spec_is_refused_by_name_as_an_argument_and_left_out_as_a_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for bad in ("m:f[group=]", "m:f[group=a b]", "m:f[grp=a]", "m:f[group=a]x"):
        with pytest.raises(SettingError, match="trajectory_functions") as raised:
            otel_session.configure(dynamo_hosts=["127.0.0.1:1"], trajectory_functions=[bad])
        assert "[group=argument.path]" in str(raised.value)
    monkeypatch.setenv("OTEL_SESSION_TRAJECTORY_FUNCTIONS", "m:f[group=],m:g[group=task.id]")
    caplog.set_level(logging.WARNING)
    lenient, said = build(lenient=True)  # zero code: the bad entry costs one line, the good one stays
    assert lenient.trajectory_functions == ("m:g[group=task.id]",)
    assert [line for line in said if "m:f[group=]" in line] and not [line for line in said if "m:g" in line]
