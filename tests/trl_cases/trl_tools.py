"""The tool and reward TRL's rollout worker pickles into its spawned child (module-level, as it requires).

``step`` asks a tool server over loopback (requests) from TRL's tool thread pool, inside the rollout's
attempt: a host that is neither a router nor trusted, so it must receive nothing of otel-session's.
"""

from __future__ import annotations

import os

import requests


def step(n: int) -> str:
    """Take one step of the task.

    Args:
        n: the step's number
    """
    requests.post(os.environ["TRL_CASE_TOOL_URL"], json={"n": n}, timeout=30).raise_for_status()
    return f"observation {n}"


def reward(completions: list, **kwargs: object) -> list[float]:
    return [1.0 for _ in completions]
