"""Zero-code setup: ``opentelemetry-instrument python rollout.py`` with otel-session's rules.

The upstream distro and configurator would install an SDK provider, which sends ``traceparent`` to
every host even with nothing exported. This distro instead runs ``otel_session.configure()`` from the
``OTEL_SESSION_*`` variables: the destination-aware propagator and the lean client hooks, the session
middleware in every server app the process builds (unless ``OTEL_SESSION_SERVERS=false``), and the
SDK with OTLP export only when ``OTEL_SESSION_TRACING`` is true. The configurator installs nothing
else. A variable it cannot honour is one warning line, never a traceback that leaves the library off.
Child processes inherit ``opentelemetry-instrument`` through ``PYTHONPATH`` (its ``sitecustomize``);
for processes started without it (Ray workers), see ``OTEL_SESSION_AUTO`` in ``_environment``.

``OTEL_PROPAGATORS`` cannot be used for this: the global propagator is built when
``opentelemetry.propagate`` is first imported, before any distro runs, hence ``configure()``.

With ``opentelemetry-distro`` installed too, ``opentelemetry-instrument`` takes whichever distro it
finds first: set ``OTEL_PYTHON_DISTRO=otel_session`` to choose this one (it then picks this
configurator too, unless ``OTEL_PYTHON_CONFIGURATOR`` names another).
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry.instrumentation.distro import BaseDistro  # type: ignore[attr-defined]
from opentelemetry.instrumentation.environment_variables import OTEL_PYTHON_CONFIGURATOR
from opentelemetry.util._importlib_metadata import EntryPoint

from otel_session import _environment, _registry, _settings, _threads

ENTRY_POINT_NAME = "otel_session"


class SessionDistro(BaseDistro):  # type: ignore[misc]
    """Configures otel-session, then loads every other instrumentor: not ours (``configure()`` ran those
    it was asked for) nor the upstream client ones ours stand in for (with tracing off they would only
    add cost; with tracing on ``configure()`` instrumented them with its provider)."""

    def _configure(self, **kwargs: Any) -> None:
        # The configurator runs after this; without a name the first one installed would win.
        os.environ.setdefault(OTEL_PYTHON_CONFIGURATOR, ENTRY_POINT_NAME)
        if _settings.current is None:  # OTEL_SESSION_AUTO may have done it at interpreter start
            _environment.configure_from_environment()

    def load_instrumentor(self, entry_point: EntryPoint, **kwargs: Any) -> None:
        if entry_point.name in _registry.instrumentors():
            return
        if entry_point.name == _threads.ENTRY_POINT and _threads.on():
            return  # configure() turned it on already: instrumenting again would only warn
        if any(entry_point.name in kind.replaces for kind in _registry.instrumentors().values()):
            return
        super().load_instrumentor(entry_point, **kwargs)


class SessionConfigurator:
    """The configurator that keeps tracing off unless asked: no SDK provider, nothing exported.

    After ``SessionDistro`` it has nothing left to do; with another distro it configures otel-session.
    """

    def configure(self, **kwargs: Any) -> None:
        if _settings.current is None:
            _environment.configure_from_environment()
