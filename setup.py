"""Packaging beyond what pyproject.toml can say: ``otel_session_autostart.pth`` at the wheel's root.

A ``.pth`` file in site-packages runs at every interpreter start, so processes a framework starts
itself (Ray workers, spawned servers) can configure otel-session from their environment alone. Its
one line only reads ``OTEL_SESSION_AUTO``; unset or off, it imports nothing and costs nothing. Editable
installs (``pip install -e``) get it too: there ``build_py`` is told to write into the wheel itself.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "otel_session_autostart.pth"
# site.py executes a .pth line that starts with "import"; a failure inside is one line, never a traceback.
PTH_LINE = (
    "import os; exec(\"try:\\n from otel_session._environment import autostart\\n autostart()\\n"
    "except Exception as exc:\\n import sys; print('otel-session: not started (OTEL_SESSION_AUTO):', "
    "exc, file=sys.stderr)\") if os.environ.get('OTEL_SESSION_AUTO', 'off').strip().lower() not in "
    "('', '0', 'false', 'no', 'off') else None\n"
)


class BuildPyWithAutostart(build_py):  # type: ignore[misc]
    def run(self) -> None:
        super().run()
        target = self.build_lib
        if getattr(self, "editable_mode", False):  # the editable wheel is assembled in install_lib
            target = self.get_finalized_command("install").install_lib
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, PTH_NAME), "w", encoding="utf-8") as pth:
            pth.write(PTH_LINE)


setup(cmdclass={"build_py": BuildPyWithAutostart})
