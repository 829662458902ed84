"""Shared fixtures: recording servers on loopback and a clean otel-session configuration per test."""

from __future__ import annotations

import gc
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import otel_session
from tests.generated import PROFILE, PROFILES
from tests.recorder import PATIENCE, Recorder

# The real local Dynamo stacks: dynamo_stack, dynamo_stack_generate, dynamo_stack_no_affinity, and
# local_dynamo_factory for others; rl_venv, for the RL frameworks' venv.
pytest_plugins = ["tests.dynamo_fixtures", "tests.rl_driver"]

# The full tier only: modules that start real Dynamo, the routers, Phoenix, NeMo-Gym's venv or
# subprocesses under opentelemetry-instrument, or wait out timeouts on purpose. Everything else (pure
# functions, in-process loopback servers) is the fast tier: ``bash scripts/test --fast``.
SLOW_MODULES = frozenset(
    {
        "test_bounds_slow_peers", "test_cli", "test_dynamo_affinity", "test_dynamo_stack",
        "test_evidence_dynamo", "test_gym_e2e",
        "test_nemo_gym", "test_nemo_rl", "test_nemo_rl_boundaries", "test_overhead_benchmark", "test_phoenix",
        "test_readme", "test_routers", "test_session_end", "test_thunderagent", "test_tools_newcomer",
        "test_areal", "test_rllm", "test_trl", "test_trl_openenv", "test_verifiers", "test_zerocode",
    }
)  # fmt: skip
SLOW_FIXTURES = frozenset(
    {"dynamo_stack", "dynamo_stack_generate", "dynamo_stack_no_affinity", "local_dynamo_factory"}
)


def pytest_configure(config: pytest.Config) -> None:
    if not 0 < PATIENCE < math.inf:
        raise pytest.UsageError(
            f"TEST_PATIENCE={os.environ.get('TEST_PATIENCE')!r}: the seconds a test waits for what a peer "
            "does in ms; give a positive number such as 10"
        )
    if PROFILE not in PROFILES:
        raise pytest.UsageError(f"HYPOTHESIS_PROFILE={PROFILE!r}: use one of {', '.join(PROFILES)}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""  # type: ignore[attr-defined]
        if module in SLOW_MODULES or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def _collected_between_modules() -> None:
    """Each module starts with the objects still alive frozen out of the collector's reach: in one
    process that has run a thousand tests, a full collection walked them all and stopped every
    thread for 0.2-0.3 s, long enough to fail a test that times its requests (docs/contributing.md)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _unconfigured() -> Iterator[None]:
    """Every test starts and ends with otel-session not configured."""
    otel_session.unconfigure()
    yield
    otel_session.unconfigure()


@pytest.fixture
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No exporter, batch, sampler or otel-session variable from the machine; unconfigured after."""
    for name in list(os.environ):
        if name.startswith(("OTEL_EXPORTER_OTLP_", "OTEL_BSP_", "OTEL_SESSION_", "OTEL_TRACES_SAMPLER")):
            monkeypatch.delenv(name)
    yield
    otel_session.unconfigure()


@pytest.fixture
def new_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], str]]:
    """``new_module(prefix, source)``: a module of that source, importable and not yet imported, as
    a framework's would be; its name is returned, and it is forgotten after the test."""
    made: list[str] = []

    def make(prefix: str, source: str) -> str:
        name = f"{prefix}_{tmp_path.name.replace('-', '_')}"
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        made.append(name)
        return name

    yield make
    for name in made:
        sys.modules.pop(name, None)


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
