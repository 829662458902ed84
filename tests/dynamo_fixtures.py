"""Pytest fixtures that give tests a real local Dynamo stack (frontend + mocker workers on loopback).

Use from a test module or ``tests/conftest.py``::

    def test_x(dynamo_stack): ...   # provided by tests/conftest.py

``dynamo_stack`` (session scope): 4 workers, round-robin, session affinity on (TTL 300 s, hard).
``dynamo_stack_no_affinity`` (session scope): the same with affinity off, Dynamo's default.
``dynamo_stack_generate`` (session scope): 3 workers, round-robin, affinity on, serving SGLang's
``/generate`` too (streamed only; tests/engine_adapter.py puts TRL and AReaL in front of it).
``local_dynamo_factory`` (session scope): ``factory(**LocalDynamo kwargs)`` starts another stack,
stopped at session end -- for tests that must damage a stack (stop workers) or need other settings.
Shared stacks must not be damaged: tests that stop workers should make their own with the factory or
with :func:`make_dynamo_fixture`.

**Dynamo versions.** ``versioned_dynamo_stack``, ``versioned_dynamo_stack_no_affinity`` and
``dynamo_python`` are parametrized over :data:`DYNAMO_PYTHONS`: Dynamo 1.6.1 in this interpreter and
1.3.0.post1 (NeMo-RL's pin) in its own virtual environment, ``.venv-dynamo13`` at the repository root
as ``scripts/test`` makes it (or ``$OTEL_SESSION_DYNAMO13_PYTHON``). A test taking one of them runs
once per version.

When a Dynamo cannot be found or installed the fixtures skip, unless ``OTEL_SESSION_REQUIRE_DYNAMO=1``
(CI), where a missing Dynamo -- either version -- is an error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_session.dynamo import DynamoInstallError, LocalDynamo, dynamo_version_of

__all__ = [
    "DYNAMO_PYTHONS",
    "dynamo_python",
    "dynamo_python_for",
    "dynamo_stack",
    "dynamo_stack_generate",
    "dynamo_stack_no_affinity",
    "local_dynamo_factory",
    "make_dynamo_fixture",
    "start_local_dynamo",
    "versioned_dynamo_stack",
    "versioned_dynamo_stack_no_affinity",
]

_ROOT = Path(__file__).resolve().parents[1]
#: Dynamo version -> the interpreter that has it installed.
DYNAMO_PYTHONS: dict[str, str] = {
    "1.6.1": sys.executable,
    "1.3.0.post1": os.environ.get(
        "OTEL_SESSION_DYNAMO13_PYTHON", str(_ROOT / ".venv-dynamo13" / "bin" / "python")
    ),
}


def _required() -> bool:
    return os.environ.get("OTEL_SESSION_REQUIRE_DYNAMO") == "1"


def start_local_dynamo(**kwargs: Any) -> LocalDynamo:
    """Start a stack, turning "Dynamo cannot be installed here" into a skip (or an error in CI)."""
    try:
        return LocalDynamo(**kwargs).start()
    except DynamoInstallError as exc:
        if _required():
            raise
        pytest.skip(f"local Dynamo unavailable: {exc}")


def make_dynamo_fixture(scope: Any = "session", **kwargs: Any) -> Callable[..., Iterator[LocalDynamo]]:
    """Build a fixture yielding a running :class:`LocalDynamo` with these settings, stopped afterwards."""

    @pytest.fixture(scope=scope)
    def _fixture() -> Iterator[LocalDynamo]:
        stack = start_local_dynamo(**kwargs)
        try:
            yield stack
        finally:
            stack.stop()

    return _fixture


dynamo_stack = make_dynamo_fixture(workers=4, router_mode="round-robin", affinity_ttl_secs=300)
dynamo_stack_no_affinity = make_dynamo_fixture(workers=4, router_mode="round-robin", affinity_ttl_secs=None)
# An odd number of workers: round-robin alone cannot keep interleaved rollouts on one worker by accident.
dynamo_stack_generate = make_dynamo_fixture(
    workers=3,
    router_mode="round-robin",
    affinity_ttl_secs=300,
    worker_args=["--sglang-generate"],
    env={"DYN_SGLANG_ENABLE_GENERATE": "1"},
)


@pytest.fixture(scope="session", params=list(DYNAMO_PYTHONS), ids=lambda v: f"dynamo-{v}")
def dynamo_python(request: pytest.FixtureRequest) -> str:
    """The interpreter running the requested Dynamo version."""
    return dynamo_python_for(request.param)


def dynamo_python_for(version: str) -> str:
    """The interpreter that has this Dynamo version; checked, so a wrong venv fails loudly."""
    python = DYNAMO_PYTHONS[version]
    try:
        found = dynamo_version_of(python)
    except DynamoInstallError as exc:
        if _required():
            raise
        pytest.skip(f"Dynamo {version} unavailable: {exc}")
    assert found == version, f"{python} has Dynamo {found}, expected {version}"
    return python


def _versioned(
    request: pytest.FixtureRequest, python: str, shared: str, **kwargs: Any
) -> Iterator[LocalDynamo]:
    """This interpreter's version reuses the shared stack of the same settings (one stack less)."""
    if python == sys.executable:
        yield request.getfixturevalue(shared)
        return
    stack = start_local_dynamo(python=python, **kwargs)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def versioned_dynamo_stack(request: pytest.FixtureRequest, dynamo_python: str) -> Iterator[LocalDynamo]:
    """Like ``dynamo_stack``, once per Dynamo version."""
    yield from _versioned(
        request, dynamo_python, "dynamo_stack", workers=4, router_mode="round-robin", affinity_ttl_secs=300
    )


@pytest.fixture(scope="session")
def versioned_dynamo_stack_no_affinity(
    request: pytest.FixtureRequest, dynamo_python: str
) -> Iterator[LocalDynamo]:
    """Like ``dynamo_stack_no_affinity``, once per Dynamo version."""
    yield from _versioned(
        request,
        dynamo_python,
        "dynamo_stack_no_affinity",
        workers=4,
        router_mode="round-robin",
        affinity_ttl_secs=None,
    )


@pytest.fixture(scope="session")
def local_dynamo_factory() -> Iterator[Callable[..., LocalDynamo]]:
    started: list[LocalDynamo] = []

    def factory(**kwargs: Any) -> LocalDynamo:
        stack = start_local_dynamo(**kwargs)
        started.append(stack)
        return stack

    try:
        yield factory
    finally:
        for stack in started:
            stack.stop()
