"""Running an RL framework's real rollout code from ``.venv-rl`` against the real local Dynamo, zero code.

Shared by tests/test_trl.py, tests/test_trl_openenv.py and tests/test_areal.py: each starts its driver
(no otel-session code) as ``opentelemetry-instrument python driver.py ENGINE MODEL_DIR`` with only the
distro and the Dynamo host set, its engine being tests/engine_adapter.py in front of the Dynamo stack,
and reads back the driver's report, every request the engine got, and which worker served each.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from otel_session.dynamo import LocalDynamo, ensure_model_dir
from tests.engine_adapter import DynamoAdapter, Turn
from tests.gym_servers import ROOT
from tests.support import run_zero_code

VENV = ROOT / ".venv-rl"
REQUIRE_ENV = "OTEL_SESSION_REQUIRE_GYM"  # set by scripts/test: a missing venv fails, never skips
OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent", "tracestate"}
NOTICE = "was sent outside any trajectory"


@dataclass
class Run:
    report: dict[str, Any]
    stderr: str
    turns: list[Turn]
    workers: dict[str, int]  # Dynamo's request id -> the worker that served it


def _missing(why: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{why}: run scripts/rl_venv")
    pytest.skip(f"{why}: run scripts/rl_venv")


@pytest.fixture(scope="module")
def rl_venv() -> None:
    """Skips (fails under scripts/test) where ``.venv-rl`` was not made."""
    if not (VENV / "bin" / "opentelemetry-instrument").exists():
        _missing("the RL frameworks' venv (.venv-rl) is missing")


def require_in_rl_venv(module: str) -> None:
    """Skips (fails under scripts/test) where ``.venv-rl`` lacks ``module``: one made before it was added."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
    found = subprocess.run([str(VENV / "bin" / "python"), "-c", probe, module], timeout=60, check=False)
    if found.returncode != 0:
        _missing(f"the RL frameworks' venv (.venv-rl) has no {module}")


def run_driver(
    stack: LocalDynamo,
    driver: Path,
    *,
    address: Callable[[DynamoAdapter], str],
    env: Mapping[str, str],
    marker: str = "<tool_response>",
    tool: str = "step",
    timeout: float = 240,
) -> Run:
    """Run ``driver`` with ``address(engine)`` as its engine, the engine adapter being the Dynamo host
    (``marker`` and ``tool``: how it counts turns and which tool its scripted turns call)."""
    model_dir = ensure_model_dir()
    with DynamoAdapter(dynamo=stack, model_dir=model_dir, marker=marker, tool=tool) as engine:
        report, stderr = run_zero_code(
            [str(VENV / "bin" / "opentelemetry-instrument"), str(VENV / "bin" / "python"), str(driver),
             address(engine), str(model_dir)],
            dynamo=engine.authority,
            env={"HF_HUB_OFFLINE": "1", **env},
            timeout=timeout,
            drop=("OTEL_", "PYTHON", "VIRTUAL_ENV"),
        )  # fmt: skip
        return Run(report, stderr, list(engine.turns), engine.workers())
