"""How many generated cases the property tests run, in one place.

CI draws the same 3,000 cases per target on every run, so a landing never hinges on the draw (and the
run stays well inside its time); local runs explore 10,000 new ones each time.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

IN_CI = os.environ.get("CI") == "true"

MANY = settings(
    max_examples=3_000 if IN_CI else 10_000,
    derandomize=IN_CI,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
