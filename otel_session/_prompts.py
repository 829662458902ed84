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
from collections.abc import Mapping
from typing import Any

MAX_BODY = 4 << 20  # bytes: far above a first turn's prompt, far below what parsing once would make slow
_FIELDS = ("messages", "prompt", "input")  # chat completions, completions, responses


def key_of(body: bytes | bytearray | memoryview | str | None) -> tuple[str, str] | None:
    """A group key for a request whose serialized body is ``body``; ``None``: no prompt read."""
    if body is None or not body or len(body) > MAX_BODY:
        return None
    try:
        data = json.loads(body if not isinstance(body, memoryview) else bytes(body))
    except (ValueError, TypeError, RecursionError):
        return None
    return key_of_data(data)


def key_of_data(data: object) -> tuple[str, str] | None:
    """The group key for a request body already parsed (``None``: it carries no prompt we read)."""
    if not isinstance(data, Mapping):
        return None
    for name in _FIELDS:
        value = data.get(name)
        if value is None:
            continue
        digest = hashlib.blake2b(digest_size=16)
        digest.update(name.encode())
        if not _digest(value, digest, 0):
            return None
        model = data.get("model")
        if isinstance(model, str):  # one prompt sent to two models is two groups
            _part(digest, "model", model)
        return ("prompt", digest.hexdigest())
    return None


def _part(digest: Any, role: str, text: str) -> None:
    data = text.encode(errors="surrogatepass")
    digest.update(f"{len(role)}:{role}{len(data)}:".encode())
    digest.update(data)


def _digest(value: object, digest: Any, depth: int) -> bool:
    """Feed ``value`` (a prompt text, a list of messages or parts, a message) to ``digest``, role and
    text alike, with lengths so that no two prompts feed the same bytes; ``False``: nothing usable."""
    if depth > 8:
        return False
    if isinstance(value, str):
        _part(digest, "text", value)
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # token ids
        _part(digest, "token", repr(value))
        return True
    if isinstance(value, list):
        digest.update(f"[{len(value)}".encode())
        return all(_digest(item, digest, depth + 1) for item in value)
    if isinstance(value, Mapping):
        role = value.get("role")
        if isinstance(role, str):
            _part(digest, "role", role)
        for name in ("content", "text", "image_url", "input_audio", "output", "tool_calls", "function"):
            if name in value:
                _part(digest, "field", name)
                part = value[name]
                if isinstance(part, Mapping):
                    part = json.dumps(part, sort_keys=True, default=str)
                if part is not None and not _digest(part, digest, depth + 1):
                    return False
        return True
    return False
