"""Reading and editing headers in whatever object a request keeps them, through its public behaviour.

The policy (``_policy.plan``) decides; this applies its answer to plain dicts and to the
case-insensitive mappings clients use (httpx's ``Headers``, multidict's ``CIMultiDict``, requests'
``CaseInsensitiveDict``), for the propagator and for any carrier an instrumentation has no faster
way into. A library's own faster ways (httpx's header list, multidict's keys view) live in that
library's instrumentation module.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

from opentelemetry.propagators.textmap import Setter

# Types, by top-level module and name, whose lookups ignore the case of a header name.
_CASE_INSENSITIVE_TYPES = frozenset(
    {
        ("httpx", "Headers"),
        ("httpx2", "Headers"),
        ("multidict", "CIMultiDict"),
        ("multidict", "CIMultiDictProxy"),
        ("requests", "CaseInsensitiveDict"),
    }
)
_case_insensitive: dict[type, bool] = {}


def case_insensitive(carrier: Any) -> bool:
    """Whether ``carrier``'s lookups ignore the case of a name (decided once per exact type)."""
    kind = type(carrier)
    found = _case_insensitive.get(kind)
    if found is None:
        found = (kind.__module__.partition(".")[0], kind.__qualname__) in _CASE_INSENSITIVE_TYPES
        if len(_case_insensitive) < 64:  # carrier types are few; bounded all the same
            _case_insensitive[kind] = found
    return found


def read(carrier: Any, names: Iterable[str]) -> dict[str, str]:
    """The value of each of ``names`` (lower-case) present in ``carrier``: the first one, but every
    line of ``baggage`` (a list header) joined."""
    held: dict[str, str] = {}
    if case_insensitive(carrier):
        getall = getattr(carrier, "getall", None)
        get_list = getattr(carrier, "get_list", None)
        for name in names:
            if name not in carrier:
                continue
            if callable(getall):
                lines = [line for line in getall(name) if isinstance(line, str)]
            elif callable(get_list):  # httpx: the values as sent, never joined
                lines = [line for line in get_list(name) if isinstance(line, str)]
            else:
                value = carrier.get(name)
                lines = [value] if isinstance(value, str) else []
            if lines:
                held[name] = ",".join(lines) if name == "baggage" else lines[0]
        return held
    keys = getattr(carrier, "keys", None)
    if not callable(keys):
        return held
    wanted = set(names)
    for key in list(keys()):
        if isinstance(key, str) and key.lower() in wanted and key.lower() not in held:
            value = carrier.get(key)
            if isinstance(value, str):
                held[key.lower()] = value
    return held


def remove(carrier: Any, name: str) -> None:
    """Take header ``name`` (any case, every occurrence) out of ``carrier``."""
    if case_insensitive(carrier):
        popall = getattr(carrier, "popall", None)
        if callable(popall):
            popall(name, None)
        else:
            carrier.pop(name, None)
        return
    if isinstance(carrier, MutableMapping):
        lower = name.lower()
        for key in [key for key in carrier if isinstance(key, str) and key.lower() == lower]:
            del carrier[key]


def write(carrier: Any, name: str, value: str, setter: Setter[Any] | None = None) -> None:
    """Set header ``name`` to ``value``, replacing any value of it in any case."""
    remove(carrier, name)  # a plain dict would otherwise keep both spellings; a multidict both values
    if setter is not None:
        setter.set(carrier, name, value)
    else:
        carrier[name] = value


def apply(carrier: Any, edits: Iterable[tuple[str, str | None]], setter: Setter[Any] | None = None) -> None:
    """Make ``edits`` (``(name, value)`` to set, ``(name, None)`` to take away) on ``carrier``."""
    for name, value in edits:
        if value is None:
            remove(carrier, name)
        else:
            write(carrier, name, value, setter)
