"""Patching nobody can tell from the original (issue 28, item 1).

Every target any instrumentor of ours patches, taken from the instrumentors themselves
(``patched()``), is compared before and after: calls with wrong arguments (through the class and
through a bare instance) raise the same exception at call time, ``inspect`` says the same, the
signature is the same, and pickling and copying work as they do for the original. A new target an
instrumentor adds is walked too, with nothing to change here.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import pickle
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

import otel_session
from otel_session import _registry

BOUNDARIES = """
class Agent:
    def run(self, x): return x
    async def run_async(self, x): return x
    def run_gen(self, x): yield x
    async def run_agen(self, x): yield x
    @classmethod
    def build(cls, x): return x
    @staticmethod
    def plain(x): return x

def rollout(sample_idx, prompt): return prompt
async def rollout_async(sample_idx, prompt): return prompt
def rollout_gen(sample_idx): yield sample_idx
async def rollout_agen(sample_idx): yield sample_idx
"""
NAMED = [
    "Agent.run", "Agent.run_async", "Agent.run_gen", "Agent.run_agen", "Agent.build", "Agent.plain",
    "rollout", "rollout_async", "rollout_gen", "rollout_agen",
]  # fmt: skip


def _outcome(call: Callable[[], Any]) -> tuple[str, str]:
    """What a call does at once: the exception it raises, or the kind of thing it returns."""
    try:
        result = call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    kind = type(result).__name__
    if inspect.iscoroutine(result) or inspect.isgenerator(result):
        result.close()
    return "returned", kind


def _unwrapped(value: Any) -> Any:
    return inspect.unwrap(getattr(value, "__func__", value))


def _copied(how: Callable[[Any], Any], value: Any) -> tuple[str, str]:
    try:
        return "ok", getattr(_unwrapped(how(value)), "__qualname__", "?")
    except Exception as exc:
        return "error", type(exc).__name__


def _bare(owner: Any) -> Any:
    try:
        return object.__new__(owner)
    except Exception:
        return None


def profile(owner: Any, name: str) -> dict[str, Any]:
    """Everything code outside can observe of ``owner.name`` without a real request."""
    value = getattr(owner, name)
    seen: dict[str, Any] = {
        "iscoroutinefunction": inspect.iscoroutinefunction(value),
        "isasyncgenfunction": inspect.isasyncgenfunction(value),
        "isgeneratorfunction": inspect.isgeneratorfunction(value),
        "isroutine": inspect.isroutine(value),
        "callable": callable(value),
        "qualname": getattr(value, "__qualname__", None),
        "module": getattr(value, "__module__", None),
        "doc": getattr(value, "__doc__", None),
        "no arguments": _outcome(lambda: value()),
        "a bogus keyword": _outcome(lambda: value(otel_bogus=1)),
        "too many": _outcome(lambda: value(*range(12))),
        "pickled": _copied(lambda v: pickle.loads(pickle.dumps(v)), value),
        "copied": _copied(copy.copy, value),
        "deep-copied": _copied(copy.deepcopy, value),
    }
    try:
        seen["signature"] = str(inspect.signature(value))
    except (TypeError, ValueError) as exc:
        seen["signature"] = type(exc).__name__
    instance = _bare(owner) if isinstance(owner, type) else None
    if instance is not None:
        bound = getattr(instance, name)
        seen["bare instance, no arguments"] = _outcome(lambda: bound())
        seen["bare instance, a bogus keyword"] = _outcome(lambda: bound(otel_bogus=1))
        seen["bare instance, iscoroutinefunction"] = inspect.iscoroutinefunction(bound)
    return seen


@pytest.fixture
def everything_importable(new_module: Callable[[str, str], str]) -> Iterator[tuple[ModuleType, str]]:
    """Every library our instrumentors patch, imported, plus boundaries of every kind of callable
    and an httpx transport of the application's own (patched as "elsewhere")."""
    import importlib

    import aiohttp
    import aiohttp.web  # noqa: F401
    import fastapi  # noqa: F401
    import httpx
    import httpx2  # noqa: F401
    import starlette.applications  # noqa: F401
    import urllib3  # noqa: F401

    name = new_module("boundaries_all_kinds", BOUNDARIES)
    module = importlib.import_module(name)

    class OwnTransport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200)

    class OwnSyncTransport(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200)

    module.OwnTransport, module.OwnSyncTransport = OwnTransport, OwnSyncTransport
    yield module, name


def _configure(name: str) -> None:
    otel_session.configure(
        dynamo_hosts=["127.0.0.1:9"], servers=True, trajectory_functions=[f"{name}:{q}" for q in NAMED]
    )


def _targets() -> dict[str, list[tuple[Any, str]]]:
    return {name: _registry.instrumentor(name).patched() for name in _registry.instrumentors()}


def test_every_patched_target_is_indistinguishable_from_its_original(
    everything_importable: tuple[ModuleType, str],
) -> None:
    module, name = everything_importable
    _configure(name)
    by_instrumentor = _targets()
    targets = [target for found in by_instrumentor.values() for target in found]
    # The walk cannot be empty: every instrumentor whose library is imported patched something.
    for instrumentor in (
        "otel_session_httpx",
        "otel_session_httpx2",
        "otel_session_aiohttp",
        "otel_session_urllib3",
        "otel_session_starlette",
        "otel_session_aiohttp_server",
        "otel_session_boundaries",
    ):
        assert by_instrumentor[instrumentor], instrumentor
    assert (module.OwnTransport, "handle_async_request") in targets
    assert len(by_instrumentor["otel_session_boundaries"]) == len(NAMED)
    after = {(owner, attribute): profile(owner, attribute) for owner, attribute in targets}
    otel_session.unconfigure()
    assert not any(_targets().values())  # all taken off: what follows is the original
    before = {(owner, attribute): profile(owner, attribute) for owner, attribute in targets}
    for target in targets:
        assert after[target] == before[target], target


def test_a_patched_target_reached_through_an_instance_pickles_as_a_method(
    everything_importable: tuple[ModuleType, str],
) -> None:
    module, name = everything_importable
    _configure(name)
    agent = module.Agent()
    for attribute in ("run", "build", "plain"):
        loaded = pickle.loads(pickle.dumps(getattr(agent, attribute)))
        assert loaded(7) == 7
    loaded = pickle.loads(pickle.dumps(agent.run_async))
    assert asyncio.run(loaded(7)) == 7
    assert copy.deepcopy(agent.run)(3) == 3


def test_the_patched_objects_keep_wrapped(everything_importable: tuple[ModuleType, str]) -> None:
    _, name = everything_importable
    _configure(name)
    for owner, attribute in (t for found in _targets().values() for t in found):
        value = owner.__dict__[attribute]
        assert hasattr(value, "__wrapped__"), (owner, attribute)
