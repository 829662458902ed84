"""The argument checks that :class:`LocalDynamo`, ``doctor`` and the ``otel-session`` command share.

One implementation of each: the command line calls the same function as the API, so a value is
refused for the same reason, in the same words, wherever it is given. Each raises :class:`ValueError`
saying what it accepts and what it got; the caller puts the argument's name in front (``router_mode``
in Python, ``--router`` on the command line). Nothing here imports Dynamo or starts anything.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
from urllib.parse import urlsplit

__all__ = [
    "AFFINITY_MODES",
    "AFFINITY_TTL_RANGE",
    "ROUTER_MODES",
    "affinity_mode",
    "affinity_ttl",
    "base_url",
    "interpreter",
    "port",
    "port_unavailable",
    "router_mode",
    "whole_number",
]

#: The ``--router-mode`` values of Dynamo's frontend (1.3.0.post1 and 1.6.1 have the same) that serve
#: the local stack's mocker workers. Dynamo's seventh, ``direct``, answers every request that does not
#: name its worker with 400 "Invalid request".
ROUTER_MODES = ("round-robin", "random", "kv", "least-loaded", "power-of-two", "device-aware-weighted")
#: ``--router-session-affinity-mode`` (Dynamo 1.5 and later).
AFFINITY_MODES = ("hard", "soft")
#: ``--router-session-affinity-ttl-secs``: Dynamo's own range, in seconds.
AFFINITY_TTL_RANGE = (1, 31_536_000)
_PORT_RANGE = (1, 65_535)


def _range(low: int, high: int | None) -> str:
    return f"a whole number from {low} to {high}" if high is not None else f"a whole number of at least {low}"


def _whole(value: object, low: int, high: int | None, none: str | None = None) -> int | None:
    """The one range check: ``value`` if an ``int`` (not a ``bool``) from ``low`` to ``high``, or
    ``None`` when ``none`` says what ``None`` means."""
    if value is None and none is not None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        wanted = _range(low, high) if none is None else f"None ({none}) or {_range(low, high)}"
        raise ValueError(f"expected {wanted}, got {value!r}")
    return value


def whole_number(value: object, low: int, high: int | None = None) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) from ``low`` to ``high`` (no limit: ``None``)."""
    checked = _whole(value, low, high)
    assert checked is not None
    return checked


def router_mode(value: object) -> str:
    if value not in ROUTER_MODES:
        raise ValueError(f"expected one of {', '.join(ROUTER_MODES)}, got {value!r}")
    return str(value)


def affinity_mode(value: object) -> str:
    if value not in AFFINITY_MODES:
        raise ValueError(f"expected one of {', '.join(AFFINITY_MODES)}, got {value!r}")
    return str(value)


def affinity_ttl(value: object) -> int | None:
    """Seconds, or ``None``: session affinity off (Dynamo's default)."""
    return _whole(value, *AFFINITY_TTL_RANGE, none="affinity off")


def interpreter(value: object) -> str:
    """The Python that runs Dynamo: a path to an executable file, or a command found on ``PATH``.

    Only that it can be run is checked here; whether Dynamo is installed there takes running it, which
    the stack does next (``dynamo_version_of``).
    """
    given = os.fspath(value) if isinstance(value, os.PathLike) else value
    text = given if isinstance(given, str) else ""
    path = shutil.which(text) if text.strip() and os.sep not in text else text
    if not text.strip():
        problem = "not a path"
    elif path is None:
        problem = "no such command on PATH"
    elif not os.path.exists(path):
        problem = "no such file"
    elif os.path.isdir(path):
        problem = "a directory"
    elif not os.access(path, os.X_OK):
        problem = "not executable"
    else:
        return text
    raise ValueError(
        f"expected the Python interpreter of a Dynamo install, e.g. .venv-dynamo13/bin/python, got "
        f"{given!r} ({problem})"
    )


def port(value: object) -> int | None:
    """A TCP port, or ``None``: a free one is picked."""
    return _whole(value, *_PORT_RANGE, none="a free port is picked")


def port_unavailable(host: str, number: int) -> str | None:
    """Why a server could not listen on ``host:number`` now, or ``None`` if it could.

    The probe binds the way Dynamo's frontend does (``SO_REUSEADDR``, as tokio sets it), so a port
    left in TIME_WAIT by a stack that just stopped counts as free, and one somebody listens on does not.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, number))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"{host}:{number} is already in use"
            if exc.errno == errno.EACCES:
                return f"{host}:{number} needs privileges to bind (ports below 1024 do)"
            return f"{host}:{number} cannot be bound ({exc.strerror or exc})"
    return None


def _shown(text: str) -> str:
    """``text`` as it may be echoed: anything before an ``@`` (a user name, a password) is masked."""
    if "@" not in text:
        return text
    scheme = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text)
    return (scheme[0] if scheme else "") + "***@" + text.rpartition("@")[2]


def base_url(text: str) -> str:
    """An OpenAI-compatible base URL (``http(s)://host[:port]/...``), stripped of spaces and a final ``/``.

    Credentials in it are refused, never echoed: a report prints the URL, and the session header's host
    list is built from it.
    """
    shown = _shown(text.strip())
    try:
        parts = urlsplit(text.strip())
        port_ok = parts.port is None or parts.port > 0
        userinfo = parts.username is not None or parts.password is not None
    except ValueError:  # "http://[::1", "http://h:99999"
        parts, port_ok, userinfo = urlsplit(""), False, False
    if userinfo or ("@" in text and parts.scheme not in ("http", "https")):
        raise ValueError(
            f"credentials in the URL are not supported; give it without user:password@ (got {shown!r})"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or " " in text.strip():
        raise ValueError(f"expected a URL like http://dynamo:8000/v1, got {shown!r}")
    return text.strip().rstrip("/")
