"""``phoenix serve`` with every listening socket on loopback: run it with the Python that has arize-phoenix.

Phoenix 20.26.x binds its OTLP/gRPC receiver to ``[::]:PHOENIX_GRPC_PORT``, every interface, and offers
a setting for the port only (read-only mode, the one way to turn it off, also refuses OTLP/HTTP). This
launcher changes one thing before Phoenix starts: a gRPC server it creates binds ``127.0.0.1`` instead
of whatever host Phoenix asks for. The UI, REST, GraphQL and OTLP/HTTP (``/v1/traces``) listen where
``PHOENIX_HOST`` says; this launcher defaults it to ``127.0.0.1`` and refuses a host that is not
loopback, so nothing it starts is reachable from another machine.

    python scripts/phoenix_loopback.py        # then open http://127.0.0.1:6006

Every other setting is Phoenix's own (``PHOENIX_PORT``, ``PHOENIX_GRPC_PORT``, ``PHOENIX_WORKING_DIR``,
...); ``PHOENIX_TELEMETRY_ENABLED`` defaults to ``false`` here. Arguments go to ``phoenix serve``.
With ``PHOENIX_LOOPBACK_PARENT_PID`` set to its parent's PID (the tests do), Phoenix stops when that
process is gone, so a test run killed outright leaves no server behind.
This file runs inside Phoenix's environment, not otel-session's: it imports nothing of the project.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

LOOPBACK = "127.0.0.1"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _loopback_address(address: str) -> str:
    """``[::]:4317`` (or any ``host:port``) becomes ``127.0.0.1:4317``."""
    return f"{LOOPBACK}:{address.rsplit(':', 1)[-1]}"


def _bind_loopback_only(bind: Callable[..., int]) -> Callable[..., int]:
    def bind_on_loopback(address: str, *args: Any, **kwargs: Any) -> int:
        return bind(_loopback_address(address), *args, **kwargs)

    return bind_on_loopback


def keep_grpc_on_loopback() -> None:
    """Make every ``grpc.aio.server()`` created from now on bind its ports on 127.0.0.1 only.

    Phoenix looks ``grpc.aio.server`` up when its receiver starts, so replacing that one public factory
    covers it; the returned server's ``add_insecure_port`` / ``add_secure_port`` rewrite the host.
    """
    import grpc.aio

    create = grpc.aio.server

    def loopback_server(*args: Any, **kwargs: Any) -> Any:
        server = create(*args, **kwargs)
        server.add_insecure_port = _bind_loopback_only(server.add_insecure_port)
        server.add_secure_port = _bind_loopback_only(server.add_secure_port)
        return server

    grpc.aio.server = loopback_server


def stop_with_parent(parent: int) -> None:
    """SIGTERM ourselves (uvicorn's graceful stop) once ``parent`` is no longer our parent."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(20)
        os._exit(1)  # the graceful stop hung

    threading.Thread(target=watch, name="stop-with-parent", daemon=True).start()


def main(argv: list[str]) -> int:
    host = os.environ.setdefault("PHOENIX_HOST", LOOPBACK)
    if not _is_loopback(host):
        print(f"phoenix_loopback: PHOENIX_HOST={host!r} is not a loopback address", file=sys.stderr)
        return 2
    os.environ.setdefault("PHOENIX_TELEMETRY_ENABLED", "false")
    try:
        from phoenix.server.main import main as phoenix_main
    except ImportError:
        print("phoenix_loopback: arize-phoenix is not installed for this Python", file=sys.stderr)
        return 2
    keep_grpc_on_loopback()
    parent = os.environ.get("PHOENIX_LOOPBACK_PARENT_PID", "")
    if parent.isdigit() and int(parent) == os.getppid():
        stop_with_parent(int(parent))
    sys.argv = ["phoenix", "serve", *argv]
    phoenix_main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
