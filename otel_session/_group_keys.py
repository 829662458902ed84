"""Where a named boundary's group key is: ``module:Qualified.name[group=SPEC]``.

Every framework keeps what a prompt's siblings share somewhere else (rLLM's ``uid``, AReaL's
``data["messages"]``, TRL's ``group_id``), so a boundary can say where: ``SPEC`` is an argument by
name, then a dotted path into it (a mapping's item, else an attribute; a whole number indexes a
sequence), then transforms separated by ``|``: ``before_last(SEP)`` (a string's part before its last
``SEP``, the whole string without one) and ``digest``. A value that cannot be hashed (a list or dict
of messages) is digested anyway: kept only as a digest of its canonical JSON, never as its text.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_FUNCTION = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_ENTRY = re.compile(rf"\s*({_FUNCTION})\s*(?:\[\s*group\s*=(?P<spec>[^\]]*)\])?\s*")
_PATH = re.compile(r"[A-Za-z_]\w*(?:\.(?:[A-Za-z_]\w*|\d+))*")
_BEFORE_LAST = re.compile(r"before_last\((?P<sep>[^)]+)\)")
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
EXAMPLES = "e.g. group=uid, group=data.messages, group=task.hash|digest, group=uid|before_last(:)"


class Unresolved(Exception):
    """Why a group key cannot be read from one call, in words for the one warning it costs."""


@dataclass(frozen=True)
class GroupKey:
    """A parsed ``group=`` spec: the argument, the path into it, and the transforms, in order."""

    text: str
    argument: str
    path: tuple[str | int, ...]
    transforms: tuple[tuple[str, str], ...]  # (name, its argument)

    @classmethod
    def parse(cls, text: str) -> GroupKey:
        """``ValueError`` saying what is wrong, for a spec that is not ``path(|transform)*``."""
        path, *transforms = [part.strip() for part in text.split("|")]
        if not _PATH.fullmatch(path):
            raise ValueError(
                f"group={text.strip()!r}: {path!r} is not an argument or a path into one ({EXAMPLES})"
            )
        steps: list[tuple[str, str]] = []
        for transform in transforms:
            before = _BEFORE_LAST.fullmatch(transform)
            if before:
                steps.append(("before_last", before["sep"]))
            elif transform == "digest":
                steps.append(("digest", ""))
            else:
                raise ValueError(
                    f"group={text.strip()!r}: {transform!r} is not a transform (digest or before_last(SEP))"
                )
        argument, *rest = path.split(".")
        return cls(text.strip(), argument, tuple(int(s) if s.isdigit() else s for s in rest), tuple(steps))

    def read(self, value: Any) -> Hashable:
        """The group key from the argument's ``value``; ``Unresolved`` where the path or a transform
        does not apply to it, or it comes to ``None``."""
        where = self.argument
        for step in self.path:
            value = _step(value, step, where)
            where = f"{where}.{step}"
        for name, argument in self.transforms:
            if name == "digest":
                value = digest(value, where)
            elif not isinstance(value, str):
                raise Unresolved(f"{where} is a {type(value).__name__}, not a string to cut")
            else:
                head, found, _ = value.rpartition(argument)
                value = head if found else value
        if value is None:
            raise Unresolved(f"{where} is None")
        try:
            hash(value)
        except Exception:
            return digest(value, where)
        return value  # type: ignore[no-any-return]


def _step(value: Any, step: str | int, where: str) -> Any:
    try:  # the application's own container code (a lazy record, a list subclass) may raise
        if isinstance(value, Mapping):
            if step in value:
                return value[step]
        elif (
            isinstance(step, int)
            and isinstance(value, Sequence)
            and not isinstance(value, str)
            and step < len(value)
        ):
            return value[step]
    except Exception as exc:
        kind = type(value).__name__
        raise Unresolved(f"reading {step} of {where} ({kind}) raised {type(exc).__name__}") from None
    if isinstance(step, str):
        try:
            return getattr(value, step)
        except Exception:
            pass
    raise Unresolved(f"{where} ({type(value).__name__}) has no {step}")


def digest(value: Any, where: str = "the value") -> str:
    """A digest of ``value``'s canonical JSON (keys sorted): equal conversations, equal digests."""
    try:
        text = _CANONICAL.encode(value)
    except Exception as exc:  # not JSON, too deep, or the value's own code raised while encoding
        raise Unresolved(f"{where} cannot be digested ({type(exc).__name__}: {exc})") from None
    return hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=16).hexdigest()


def entry(text: str) -> tuple[str, GroupKey | None]:
    """``(module:Qualified.name, its group key or None)`` of one entry; ``ValueError`` says why not."""
    matched = _ENTRY.fullmatch(text)
    if not matched:
        raise ValueError(
            f"{text!r} is not module:Qualified.name[group=...] (e.g. my_rl.rollouts:Agent.run_episode, "
            "my_rl.rollouts:run_episode[group=uid])"
        )
    try:
        return matched[1], None if matched["spec"] is None else GroupKey.parse(matched["spec"])
    except ValueError as exc:
        raise ValueError(f"{matched[1]}: {exc}") from None


def name_of(text: str) -> str | None:
    """The ``module:Qualified.name`` of an entry whose only fault may be its ``[...]`` part, else None:
    a variable with a bad spec still opens the boundary, its siblings grouped by their first prompt."""
    matched = re.fullmatch(rf"\s*({_FUNCTION})\s*\[[^\]]*\]\s*", text)
    return matched[1] if matched else None


def split(text: str) -> list[str]:
    """A variable's entries: separated by commas outside ``[...]`` (a separator may be a comma)."""
    entries, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth <= 0:
            entries.append(text[start:index])
            start, depth = index + 1, 0
    return [e for e in [*entries, text[start:]] if e.strip()]


def canonical(name: str, key: GroupKey | None) -> str:
    """An entry as settings keep it: the name, and its spec where it has one."""
    return name if key is None else f"{name}[group={key.text}]"
