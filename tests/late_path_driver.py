"""The NeMo-RL driver with NeMo-RL put on ``sys.path`` by the script itself, after the interpreter
started: as a research script's ``sys.path.insert`` does, and as Ray's ``working_dir``/``py_modules``
arrive. It lives outside tests/standin on purpose: a script's own folder is on ``sys.path`` from
the start, and NeMo-RL must not be findable until this script adds it
(tests/test_nemo_rl_boundaries.py, tests/test_late_import.py)."""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

STANDIN = Path(__file__).resolve().parent / "standin"

if __name__ == "__main__":
    assert importlib.util.find_spec("nemo_rl") is None, "NeMo-RL is findable before the driver adds it"
    sys.path.insert(0, str(STANDIN))
    runpy.run_path(str(STANDIN / "rollout_driver.py"), run_name="__main__")
