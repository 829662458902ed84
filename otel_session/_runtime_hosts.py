"""Dynamo hosts known only at runtime: a wrapper or frontend that picked a random port on the node's IP.

NeMo-RL starts its token wrapper and the managed Dynamo frontend on random ports (3000-4000) on the
Ray node's address, so no variable set before the run can name them, and a pattern without a port
would also match every Gym and tool server on that node. The code that starts them adds the exact
``host:port``: to ``OTEL_SESSION_DYNAMO_HOSTS`` in ``os.environ`` (what every process started
afterwards inherits, and what a Ray ``runtime_env`` can copy), and to this process's configuration,
through ``configure()`` with the arguments it was last given.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import cast
from urllib.parse import urlsplit

from otel_session import _config, _settings


def exact_host_port(address: str) -> str:
    """``host:port`` (or ``[v6]:port``) of ``address``, which must name one port; ``ValueError`` else.

    Accepts ``host:port``, ``[v6]:port`` or a URL with an explicit port (``http://10.0.0.5:3412/v1``).
    """
    text = address.strip() if isinstance(address, str) else ""
    try:
        parts = urlsplit(text if "://" in text else f"//{text}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or port is None or "*" in host or any(c.isspace() for c in text):
        raise ValueError(
            f"{address!r} is not an exact host:port: a runtime Dynamo host needs its port (e.g. "
            "10.0.0.5:3412 or http://10.0.0.5:3412/v1), so that other servers on the node do not match"
        )
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_dynamo_hosts(*addresses: str) -> list[str]:
    """Add exact ``host:port`` Dynamo hosts for this process and every process it starts afterwards.

    ``otel_session.add_dynamo_hosts(f"{node_ip}:{port}")`` right after the frontend or wrapper
    listens. Returns the new ``OTEL_SESSION_DYNAMO_HOSTS`` entries. Raises ``ValueError`` (changing
    nothing) for an address without a port or one the configuration rejects.
    """
    added = [exact_host_port(address) for address in addresses]
    name = _settings.ENV_DYNAMO_HOSTS
    entries = [entry.strip() for entry in os.environ.get(name, "").split(",") if entry.strip()]
    entries += [host for host in added if host not in entries]
    previous = os.environ.get(name)
    os.environ[name] = ",".join(entries)
    try:
        if _settings.current is not None:
            arguments = _config.configured_arguments()
            given = arguments.get("dynamo_hosts")
            if given is not None:  # given explicitly: extend that list, not the variable
                listed = [given] if isinstance(given, str) else list(cast(Iterable[str], given))
                arguments["dynamo_hosts"] = listed + [h for h in added if h not in listed]
            _config.configure(**arguments)  # type: ignore[arg-type]
    except BaseException:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
        raise
    return entries
