"""How many generated cases the property tests run, in one place: a Hypothesis profile by name.

``HYPOTHESIS_PROFILE`` picks it: ``dev`` (the default, and the fast tier: a few hundred new cases per
target, seconds), ``ci`` (the full tier that CI runs: the same 800 cases on every run, so a landing
never hinges on the draw) or ``deep`` (10,000 new cases each, for a long local look).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
}
PROFILES = {
    "dev": settings(max_examples=300, **_COMMON),  # type: ignore[arg-type]
    "ci": settings(max_examples=800, derandomize=True, **_COMMON),  # type: ignore[arg-type]
    "deep": settings(max_examples=10_000, **_COMMON),  # type: ignore[arg-type]
    # scripts/mutate: the same few hundred cases for every mutant, so a verdict never hinges on the draw,
    # and no shrinking: the first failing case kills the mutant (shrinking it cost a second a kill)
    "mutation": settings(
        max_examples=300,
        derandomize=True,
        phases=(Phase.explicit, Phase.generate),
        report_multiple_bugs=False,
        **_COMMON,  # type: ignore[arg-type]
    ),
}
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") == "true" else "dev")
# an unknown name stops the run in conftest's pytest_configure with one line, before any module loads
MANY = PROFILES.get(PROFILE, PROFILES["dev"])
