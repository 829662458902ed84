"""What every overhead result file records alongside its figures, and the statistics they share.

The three overhead views (``overhead.py``, ``overhead_requests.py``, ``overhead_configs.py``) write
one JSON file each under ``benchmarks/results/``; each says which machine, Python and package
versions produced it, because on a shared 2-core machine a figure means little without them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

PACKAGES = (
    "otel-session",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-instrumentation-httpx",
    "opentelemetry-instrumentation-aiohttp-client",
    "httpx",
    "httpx2",
    "openai",
    "aiohttp",
)


def versions() -> dict[str, str | None]:
    """Installed versions of the packages the figures depend on (``None``: not installed)."""
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def machine() -> dict[str, Any]:
    """Where a figure was measured; load averages too, since other work shares the cores."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": [round(value, 2) for value in os.getloadavg()],
        "versions": versions(),
    }


def quartiles(values: list[float]) -> tuple[float, float]:
    """Lower and upper quartile (both the value itself for a single sample)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def lower_quartile(values: list[float]) -> float:
    """A request's cost when the machine's other load did not get in its way.

    Per-request times on a shared machine have a long right tail (preemption, interrupts, the
    server on the other core) that both kinds of request share; the median sits where that tail
    starts and wanders by more than the hook costs, while the lower quantiles are steady, and the
    hook shifts them all alike.
    """
    return quartiles(values)[0]


def write_results(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
