"""Shared fixtures: recording servers on loopback and a clean otel-session configuration per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import otel_session
from tests.recorder import Recorder

# The real local Dynamo stack: dynamo_stack, dynamo_stack_no_affinity, local_dynamo_factory.
pytest_plugins = ["tests.dynamo_fixtures"]


@pytest.fixture(autouse=True)
def _unconfigured() -> Iterator[None]:
    """Every test starts and ends with otel-session not configured."""
    otel_session.unconfigure()
    yield
    otel_session.unconfigure()


@pytest.fixture
def dynamo() -> Iterator[Recorder]:
    """A recording server playing a Dynamo frontend (configure it as a Dynamo host)."""
    with Recorder() as server:
        yield server


@pytest.fixture
def gym() -> Iterator[Recorder]:
    """A recording server playing a trusted Gym server."""
    with Recorder() as server:
        yield server


@pytest.fixture
def other() -> Iterator[Recorder]:
    """A recording server playing any other host (vLLM, a tool server, a reward server...)."""
    with Recorder(host="127.0.0.2") as server:
        yield server
