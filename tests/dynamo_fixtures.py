"""Pytest fixtures that give tests a real local Dynamo stack (frontend + mocker workers on loopback).

Use from a test module or ``tests/conftest.py``::

    def test_x(dynamo_stack): ...   # provided by tests/conftest.py

``dynamo_stack`` (session scope): 4 workers, round-robin, session affinity on (TTL 300 s, hard).
``dynamo_stack_no_affinity`` (session scope): the same with affinity off, Dynamo's default.
``local_dynamo_factory`` (session scope): ``factory(**LocalDynamo kwargs)`` starts another stack,
stopped at session end -- for tests that must damage a stack (stop workers) or need other settings.
Shared stacks must not be damaged: tests that stop workers should make their own with the factory or
with :func:`make_dynamo_fixture`.

When Dynamo cannot be installed the fixtures skip, unless ``OTEL_SESSION_REQUIRE_DYNAMO=1`` (CI), where
a missing Dynamo is an error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from otel_session.dynamo import DynamoInstallError, LocalDynamo

__all__ = [
    "dynamo_stack",
    "dynamo_stack_no_affinity",
    "local_dynamo_factory",
    "make_dynamo_fixture",
    "start_local_dynamo",
]


def start_local_dynamo(**kwargs: Any) -> LocalDynamo:
    """Start a stack, turning "Dynamo cannot be installed here" into a skip (or an error in CI)."""
    try:
        return LocalDynamo(**kwargs).start()
    except DynamoInstallError as exc:
        if os.environ.get("OTEL_SESSION_REQUIRE_DYNAMO") == "1":
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
