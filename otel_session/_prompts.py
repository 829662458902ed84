"""The prompt a request body carries, as a digest: what siblings of one GRPO group have in common.

Siblings of a prompt send the same first request (the same chat ``messages``, completions ``prompt``
or responses ``input``), so a digest of its roles and texts names their group without the caller
saying so. The digest stays in this process (a key of ``_siblings``), is never sent and never kept
as text. Only a body already in memory, and no longer than ``MAX_BODY``, is read: anything else
(a stream, a file, a generator, a huge body, something not JSON) names no group.
"""

from __future__ import annotations

import hashlib
import json

MAX_BODY = 4 << 20  # bytes: far above a first turn's prompt, far below what parsing once would make slow
_FIELDS = ("messages", "prompt", "input")  # chat completions, completions, responses
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))  # dumps(...) would make one a call


def key_of(body: bytes | bytearray | memoryview | str | None) -> tuple[str, str] | None:
    """A group key for a request whose serialized body is ``body``; ``None``: no prompt read.

    The prompt field (whatever its messages hold: roles, texts, parts, tool calls) and the model are
    serialized again canonically and hashed once: a few microseconds, paid once per attempt."""
    if body is None or not body or len(body) > MAX_BODY:
        return None
    try:
        data = json.loads(body if isinstance(body, str) else bytes(body).decode())
        if not isinstance(data, dict):
            return None
        for name in _FIELDS:
            value = data.get(name)
            if value is None:
                continue
            if not isinstance(value, (str, list)) or not value:
                return None
            text = _CANONICAL.encode([name, data.get("model"), value])
            return ("prompt", hashlib.blake2b(text.encode(), digest_size=16).hexdigest())
    except (ValueError, TypeError, RecursionError):
        pass
    return None
