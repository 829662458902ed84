"""Group keys for named boundaries (issue 35, item 2): ``module:Qualified.name[group=SPEC]``.

Real aiohttp requests to a loopback recording server configured as a Dynamo host. The named functions
live in a module written to a temporary folder per test, shaped as the frameworks' are (rLLM's
``run_with_termination_handling(task, uid)``, AReaL's ``arun_episode(engine, data)``, TRL's
``_generate_one(prompt, tool_dict, tools, group_id=0)``). Each run opens 2 prompts x 2 siblings at once
(``asyncio.gather``), so under the default ``groups:2`` the siblings of a prompt name one parent. The
requests' bodies carry no prompt, so no group is inferred from them: a parent comes from ``group=`` only.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections import defaultdict
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import otel_session
from otel_session import _environment, _group_keys
from tests.recorder import Recorder

ROLLOUTS = """
import aiohttp

URL = None

async def _post(label):
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.post(f"{URL}/w/{label}/v1/chat/completions", json={}) as response:
                await response.read()

class Workflow:
    async def run_with_termination_handling(self, task, uid, **kwargs):
        await _post(uid)

class Task:
    def __init__(self, hash):
        self.hash = hash

async def run_task(task, label):
    await _post(label)

async def arun_episode(engine, data):
    await _post(data["label"])

async def generate_one(prompt, tool_dict, tools, group_id=0):
    await _post(f"{group_id}-{len(tool_dict)}")
"""


@pytest.fixture
def rollouts(new_module: Callable[[str, str], str]) -> str:
    return new_module("grouped", ROLLOUTS)


def _load(name: str, dynamo: Recorder) -> ModuleType:
    module = importlib.import_module(name)
    module.URL = dynamo.url
    return module


def _run(*calls: Any) -> None:
    async def run() -> None:
        await asyncio.gather(*calls)

    asyncio.run(run())


def _parents(dynamo: Recorder) -> dict[str, set[str | None]]:
    """Each label's parents (the label is the path's second part), after checking every request has a
    session and each label's requests one session of their own."""
    parents: dict[str, set[str | None]] = defaultdict(set)
    sessions: dict[str, set[str | None]] = defaultdict(set)
    for seen in dynamo.requests:
        label = seen.path.split("/")[2]
        parents[label].add(seen.get("X-Dynamo-Parent-Session-ID"))
        sessions[label].add(seen.get("X-Dynamo-Session-ID"))
    assert all(len(found) == 1 and None not in found for found in sessions.values()), sessions
    assert len({s for found in sessions.values() for s in found}) == len(sessions), (
        sessions
    )  # one per attempt
    return parents


def _grouped(parents: dict[str, set[str | None]], groups: list[list[str]]) -> None:
    """The labels of each group name one parent, and no two groups the same one."""
    named = []
    for labels in groups:
        (parent,) = set().union(*(parents[label] for label in labels))
        assert parent is not None, parents
        named.append(parent)
    assert len(set(named)) == len(groups), parents


def test_an_argument_cut_before_its_last_separator_groups_rllm_style_uids(
    rollouts: str, dynamo: Recorder
) -> None:
    """``group=uid|before_last(:)``: rLLM's ``f"{task_id}:{rollout_idx}"`` grouped by its task id."""
    entry = f"{rollouts}:Workflow.run_with_termination_handling[group=uid|before_last(:)]"
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[entry])
    module = _load(rollouts, dynamo)
    workflows = [module.Workflow() for _ in range(4)]
    uids = ["a:b:0", "a:b:1", "c:0", "c:1"]  # a task id may hold the separator itself
    _run(
        *(w.run_with_termination_handling({"q": 1}, uid=uid) for w, uid in zip(workflows, uids, strict=True))
    )
    assert len(dynamo.requests) == 8
    _grouped(_parents(dynamo), [["a:b:0", "a:b:1"], ["c:0", "c:1"]])


def test_an_item_path_into_a_dict_digests_the_messages_it_reaches(rollouts: str, dynamo: Recorder) -> None:
    """``group=data.messages``: AReaL's siblings get equal ``data``; its messages (a list of dicts, not
    hashable) are digested, so equal conversations in different objects are one group."""
    otel_session.configure(
        dynamo_hosts=[dynamo.url], trajectory_functions=f"{rollouts}:arun_episode[group=data.messages]"
    )
    module = _load(rollouts, dynamo)

    def data(prompt: str, label: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": prompt}], "label": label}

    _run(*(module.arun_episode(None, data(p, f"{p}{i}")) for p in ("x", "y") for i in (0, 1)))
    _grouped(_parents(dynamo), [["x0", "x1"], ["y0", "y1"]])


def test_an_attribute_path_and_a_default_argument_each_name_the_group(
    rollouts: str, dynamo: Recorder
) -> None:
    """``group=task.hash`` reads an attribute; ``group=group_id`` a parameter left at its default
    (TRL's ``group_id: int = 0``) as well as one passed."""
    otel_session.configure(
        dynamo_hosts=[dynamo.url],
        trajectory_functions=[
            f"{rollouts}:run_task[group=task.hash]",
            f"{rollouts}:generate_one[group=group_id]",
        ],
    )
    module = _load(rollouts, dynamo)
    _run(*(module.run_task(module.Task(h), f"{h}{i}") for h in ("h", "k") for i in (0, 1)))
    _grouped(_parents(dynamo), [["h0", "h1"], ["k0", "k1"]])
    dynamo.clear()
    tools: list[dict[str, Any]] = [{}, {"a": 1}]
    _run(
        *(module.generate_one([], tools[i], []) for i in (0, 1)),
        *(module.generate_one([], tools[i], [], 7) for i in (0, 1)),
    )
    _grouped(_parents(dynamo), [["0-0", "0-1"], ["7-0", "7-1"]])


def test_without_a_group_the_same_siblings_name_no_parent(rollouts: str, dynamo: Recorder) -> None:
    """The control: the same boundary without ``group=`` opens the same attempts, with no parent."""
    otel_session.configure(
        dynamo_hosts=[dynamo.url], trajectory_functions=f"{rollouts}:Workflow.run_with_termination_handling"
    )
    module = _load(rollouts, dynamo)
    _run(*(module.Workflow().run_with_termination_handling({}, uid=u) for u in ("a:0", "a:1", "c:0", "c:1")))
    assert set().union(*_parents(dynamo).values()) == {None}


def test_a_path_that_does_not_resolve_is_one_warning_naming_the_entry_and_the_attempt_runs(
    rollouts: str, dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "otel_session")
    name = f"{rollouts}:arun_episode"
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{name}[group=data.prompt]"])
    module = _load(rollouts, dynamo)
    _run(*(module.arun_episode(None, {"label": f"p{i}", "messages": []}) for i in range(4)))
    parents = _parents(dynamo)  # every attempt still has its session
    assert set().union(*parents.values()) == {None}
    lines = [r.getMessage() for r in caplog.records if "does not resolve" in r.getMessage()]
    assert len(lines) == 1, lines
    assert name in lines[0] and "group=data.prompt" in lines[0] and "has no prompt" in lines[0], lines


def test_a_bad_group_spec_is_an_error_naming_the_argument_and_one_warning_naming_the_variable(
    rollouts: str, dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for bad in ("[group=]", "[group=uid|upper]", "[group=a..b]", "[grp=uid]", "[group=uid"):
        with pytest.raises(ValueError, match="trajectory_functions"):
            otel_session.configure(
                dynamo_hosts=[dynamo.url], trajectory_functions=[f"{rollouts}:run_task{bad}"]
            )
    caplog.set_level(logging.WARNING, "otel_session")
    monkeypatch.setenv(
        "OTEL_SESSION_TRAJECTORY_FUNCTIONS",
        f"{rollouts}:run_task[group=task|shout],{rollouts}:generate_one[group=group_id|before_last(,)]",
    )
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", dynamo.url)
    _environment.configure_from_environment()
    module = _load(rollouts, dynamo)
    _run(module.run_task(module.Task(1), "t"), module.generate_one([], {}, [], "g,1"))
    sessions = {seen.path.split("/")[2]: seen.get("X-Dynamo-Session-ID") for seen in dynamo.requests}
    # A bad spec in a variable costs the group key, not the boundary: run_task still opens its attempt.
    assert sessions["t"] is not None and sessions["g,1-0"] is not None  # a comma inside [...] is no separator
    lines = [r.getMessage() for r in caplog.records if "OTEL_SESSION_TRAJECTORY_FUNCTIONS:" in r.getMessage()]
    said = f"{rollouts}:run_task: group='task|shout': 'shout' is not a transform"
    assert len(lines) == 1 and said in lines[0] and f"{rollouts}:run_task applies without" in lines[0], lines


def test_only_an_entry_whose_name_is_bad_is_left_out() -> None:
    """What keeps a boundary under a bad spec, and what does not: the name must be whole on its own."""
    assert _group_keys.name_of("a.b:C.run[group=x|shout]") == "a.b:C.run"
    assert _group_keys.name_of(" a:run [grp=uid] ") == "a:run"
    assert _group_keys.name_of("a:run[group=]") == "a:run"
    for bad in ("a:run[group=uid", "a:run", "a b:run[group=x]", "a:run[x]]", "a:[group=x]", "a:run[x]y"):
        assert _group_keys.name_of(bad) is None, bad


def test_the_users_group_wins_over_a_presets_for_one_function(rollouts: str, dynamo: Recorder) -> None:
    from otel_session.instrumentation.boundaries import TrajectoryFunctionsInstrumentor

    class Preset(TrajectoryFunctionsInstrumentor):
        library = "otel_session"
        presets = (f"{rollouts}:run_task[group=label]",)  # every attempt its own group: no parents

    otel_session.configure(
        dynamo_hosts=[dynamo.url], trajectory_functions=[f"{rollouts}:run_task[group=task.hash]"]
    )
    preset = Preset()
    preset.instrument()
    try:
        module = _load(rollouts, dynamo)
        _run(*(module.run_task(module.Task(h), f"{h}{i}") for h in ("h", "k") for i in (0, 1)))
    finally:
        preset.uninstrument()
    _grouped(_parents(dynamo), [["h0", "h1"], ["k0", "k1"]])


def test_a_group_key_reads_paths_and_transforms_and_keeps_no_text_of_what_it_digests() -> None:
    key = _group_keys.GroupKey.parse(" data.messages.0 | digest ")
    messages = [{"role": "user", "content": "secret prompt"}]
    digested = key.read({"messages": messages})
    assert isinstance(digested, str) and len(digested) == 32 and "secret" not in digested
    assert digested == key.read({"messages": [{"content": "secret prompt", "role": "user"}]})  # canonical
    whole = _group_keys.GroupKey.parse("data.messages").read({"messages": messages})
    assert isinstance(whole, str) and len(whole) == 32 and whole != digested  # unhashable: digested
    assert _group_keys.GroupKey.parse("uid|before_last(:)").read("no-separator") == "no-separator"
    assert _group_keys.GroupKey.parse("x.1").read(("a", "b")) == "b"
    for spec, value, why in [
        ("x.y", {"z": 1}, "x (dict) has no y"),
        ("x|before_last(:)", 3, "x is a int, not a string"),
        ("x", None, "x is None"),
        ("x|digest", {1: object()}, "x cannot be digested"),
    ]:
        with pytest.raises(_group_keys.Unresolved, match=why.replace("(", r"\(").replace(")", r"\)")):
            _group_keys.GroupKey.parse(spec).read(value)
    assert _group_keys.split("a:b[group=x|before_last(,)], c:d ,") == ["a:b[group=x|before_last(,)]", " c:d "]
