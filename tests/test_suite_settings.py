"""The suite's own settings (``TEST_PATIENCE``, ``HYPOTHESIS_PROFILE``): a bad value stops the run with
one line and pytest's usage-error exit, never a traceback or a collection error per module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _collect(**env: str) -> subprocess.CompletedProcess[str]:
    """pytest collecting one module of this suite, in a process of its own, with ``env`` added."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co", "tests/test_group_keys.py"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("TEST_PATIENCE", "abc", "give a positive number"),
        ("TEST_PATIENCE", "-1", "give a positive number"),
        ("TEST_PATIENCE", "inf", "give a positive number"),
        ("HYPOTHESIS_PROFILE", "bogus", "use one of dev, ci, deep, mutation"),
    ],
)
def test_a_bad_setting_stops_the_run_with_one_line(name: str, value: str, says: str) -> None:
    run = _collect(**{name: value})
    out = run.stdout + run.stderr
    assert run.returncode == 4, out  # pytest's usage error
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ERROR: {name}={value!r}: "), out
    assert says in lines[0]


def test_good_settings_collect_the_module() -> None:
    run = _collect(TEST_PATIENCE="3", HYPOTHESIS_PROFILE="ci")
    assert run.returncode == 0 and "tests collected" in run.stdout, run.stdout + run.stderr
