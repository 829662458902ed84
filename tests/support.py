"""Test helpers that more than one test module needs, written once.

- ``exited_unreaped(pid)``: whether a child process has exited, without reaping it (the harnesses
  that stop Phoenix and the routers by process group);
- the ``fleet`` fixture (three recording backends for a module's routers) and the autouse
  ``_fresh_records`` fixture that clears what they recorded before each test. A module uses them by
  importing both names: pytest finds fixtures in a module's namespace, and an imported autouse
  fixture applies to that module only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.routers import Backend


def exited_unreaped(pid: int) -> bool:
    """Has our child ``pid`` exited? It is left a zombie (not reaped), so its PID, and the process
    group ID it may name, cannot have been reused yet."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[Backend]]:
    """Three recording OpenAI-style backends, for the routers a module starts in front of them."""
    from tests.routers import backends  # here: tests.routers imports this module

    with backends(3) as started:
        yield started


@pytest.fixture(autouse=True)
def _fresh_records(fleet: list[Backend]) -> None:
    """Each test sees only the requests it sent."""
    for backend in fleet:
        backend.seen.clear()
