"""urllib3, and requests above it: the session on every hop, for that hop only.

The hop is planned in ``HTTPConnectionPool.urlopen``, not in requests' ``HTTPAdapter.send``: every
requests call ends there (any adapter built on urllib3 too), so does plain urllib3, and it is where the
destination is final. A pool dials its own host; through a proxy an https request goes through a
``CONNECT`` tunnel that urllib3 opens itself, outside ``urlopen`` (the proxy gets nothing of ours) to a
pool for the final host, while a forwarded request (plain http, or urllib3's https forwarding) goes to
the proxy's pool with the absolute URL, which is then the destination, as with aiohttp and httpx.

``urlopen`` gets a copy of the caller's headers with ours; the caller's (requests' ``PreparedRequest``)
are never edited, so requests' redirects, built from them, start with nothing of ours. urllib3 calls
``urlopen`` again itself for a retry or a redirect it follows, handing it our copy (or a copy of that):
such a call starts again from the caller's headers, planned for where it goes.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from otel_session import _carriers, _evidence, _faults, _gathering, _hop, _metrics, _propagator
from otel_session._policy import Edit
from otel_session.instrumentation._base import ProbedTypes, SessionInstrumentor, Wrapper

_NOTHING: dict[str, str] = {}
_DEFAULT_PORT = {"http": 80, "https": 443}
_BODY = 2  # urlopen(method, url, body, headers, ...)
_HEADERS = 3  # urlopen(method, url, body, headers, ...): where urllib3 passes headers by position
# urlopen calls of ours under way on this thread: (pool, the caller's headers, the names our copy edited)
_sending = threading.local()


def _is_folded(kind: type) -> bool:
    """Whether ``kind`` keeps its items as requests' ``CaseInsensitiveDict`` does: ``_store``, an
    ordered dict of lower-case name -> (name as spelled, value), and nothing else."""
    try:
        probe = kind([("X-Probe", "1"), ("Other", "2")])
        if sorted(vars(probe)) != ["_store"] or list(probe._store.items()) != [
            ("x-probe", ("X-Probe", "1")),
            ("other", ("Other", "2")),
        ]:
            return False
        copy: Any = object.__new__(kind)
        copy._store = probe._store.copy()
        copy._store["new"] = ("New", "3")
        return bool(
            copy.get("NEW") == "3" and "new" not in probe and list(copy) == ["X-Probe", "Other", "New"]
        )
    except Exception:
        return False


# requests' ``CaseInsensitiveDict`` and the like: asked "any of these names?" and copied through ``_store``.
_FOLDED = ProbedTypes(lambda kind: kind.__qualname__ == "CaseInsensitiveDict" and _is_folded(kind))


def _held(headers: Any, plan: _hop.Plan) -> dict[str, str]:
    """What ``headers`` hold of the names ``plan`` reads (``_NOTHING``, the usual case, in one C call
    for requests' headers)."""
    if headers is None or (type(headers) in _FOLDED and headers._store.keys().isdisjoint(plan.names)):
        return _NOTHING
    return _carriers.read(headers, plan.names)


def _copy(headers: Any, edits: list[Edit], added_only: bool) -> Any:
    """A copy of ``headers`` (of the same type, which urllib3 may copy again) with ``edits`` made."""
    if added_only and type(headers) in _FOLDED:
        copy: Any = object.__new__(type(headers))
        store = copy._store = headers._store.copy()
        for name, value in edits:
            store[name.lower()] = (name, value)
        return copy
    copy = headers.copy() if callable(getattr(headers, "copy", None)) else dict(headers)
    _carriers.apply(copy, edits)
    return copy


# urllib3's own URL parser and its rule for when a proxy tunnels, found when urllib3 is imported.
_parse_url: Any = None
_tunnelled: Any = None


def _own(pool: Any) -> _hop.Destination:
    """Where ``pool`` connects: its host as its connections dial it (without trailing dots)."""
    host = pool.host
    if host and host[-1] == ".":
        host = host.rstrip(".")
    return pool.scheme, host, pool.port


def _destination(pool: Any, url: Any) -> _hop.Destination:
    """Where ``pool.urlopen(..., url)`` sends its request: the pool's own host, but the absolute URL's
    where the pool forwards through a proxy (``CONNECT`` tunnels are opened for the final host's pool)."""
    proxy = pool.proxy
    if proxy is None or not isinstance(url, str) or url.startswith("/"):
        return _own(pool)
    parsed = _parse_url(url)
    scheme = (parsed.scheme or "").lower()
    if _tunnelled(proxy, pool.proxy_config, scheme or None):
        return _own(pool)
    host = parsed.host
    if host is not None and host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return scheme, host, parsed.port or _DEFAULT_PORT.get(scheme)


def _called(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(url, headers) of an ``urlopen`` call, each by position or by name."""
    url = args[1] if len(args) > 1 else kwargs.get("url")
    headers = args[_HEADERS] if len(args) > _HEADERS else kwargs.get("headers")
    return url, headers


def _with_headers(
    args: tuple[Any, ...], kwargs: dict[str, Any], headers: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if len(args) > _HEADERS:
        return (*args[:_HEADERS], headers, *args[_HEADERS + 1 :]), kwargs
    return args, {**kwargs, "headers": headers}


def _outside(pool: Any, url: Any) -> None:
    """A request outside any trajectory: said once if it goes to a router, counted where counting."""
    destination = _destination(pool, url)
    if _hop.untold:
        _hop.outside(*destination)
    if _metrics.recording():
        _metrics.outside(*destination)


def _callers_again(pool: Any, headers: Any) -> Any:
    """In a call urllib3 makes from inside one of ours on the same pool (a retry, a redirect it
    follows), the headers it hands on are ours, or a copy of ours: the caller's, back in their place."""
    outer = getattr(_sending, "hop", None)
    if outer is None or outer[0] is not pool:
        return headers
    callers, names = outer[1], outer[2]
    base = _copy(headers if headers is not None else pool.headers, [(name, None) for name in names], False)
    _carriers.apply(base, list(_carriers.read(callers, names).items()) if callers is not None else [])
    return base


def _planned(
    offered: _hop.Offered, pool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], _hop.Plan, Any] | None:
    """(the call as it is sent, the plan, the caller's headers) for a hop with something to add or take
    back; ``None``: sent as it was called."""
    url, headers = _called(args, kwargs)
    callers = _callers_again(pool, headers)
    destination = _destination(pool, url)
    plan = offered.plan(*destination)
    if _gathering.may_wait(offered) and plan.route.profile is not None:  # its group still to read, or
        # its parent's turn at the router still to come (``_pacing``)
        body = args[_BODY] if len(args) > _BODY else kwargs.get("body")  # requests' json= is bytes here
        prompt = body if isinstance(body, (bytes, bytearray, str)) else None
        offered = _gathering.gather_here(offered, prompt, destination)  # a first step's threads
        offered = offered.decide(prompt, destination)
        plan = offered.plan(*destination)
    base = callers if callers is not None else pool.headers
    held = _held(base, plan)
    if held:
        plan = plan.given(held, _propagator.is_sole_global())
    if not plan.edits:
        if callers is headers:
            return None
        return (*_with_headers(args, kwargs, callers), plan, callers)
    plan.delivered()
    sent = _copy(base, plan.edits, not held)
    return (*_with_headers(args, kwargs, sent), plan, callers)


def _urlopen(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``HTTPConnectionPool.urlopen``: the hop planned and sent with a copy of the caller's headers
    holding ours; the usual request outside a trajectory, as it was called."""
    offered = _hop.current()
    if offered is None:
        if _hop.untold or _metrics.recording():
            try:
                _outside(instance, _called(args, kwargs)[0])
            except Exception as exc:
                _faults.report("reading a request's destination", exc)
        return wrapped(*args, **kwargs)
    try:
        planned = _planned(offered, instance, args, kwargs)
    except Exception as exc:  # a bug of ours (or a pool we do not understand) must not fail the request
        _faults.report("adding session headers to a request", exc)
        planned = None
    if planned is None:
        return wrapped(*args, **kwargs)
    sent_args, sent_kwargs, plan, callers = planned
    outer = getattr(_sending, "hop", None)
    _sending.hop = (instance, callers, plan.names)
    try:
        response = wrapped(*sent_args, **sent_kwargs)
    finally:
        _sending.hop = outer
    if plan.route.profile is not None:
        _answered(response, plan.destination)
    return response


def _answered(response: Any, destination: _hop.Destination) -> None:
    """A router's answer to a hop of ours goes to ``_evidence``, which decides which statuses are
    error answers (429, 5xx)."""
    try:
        status = response.status
        if status >= 429:
            _evidence.answered_status(status, *destination)
    except Exception as exc:  # evidence lost, never the response
        _faults.report("reading a response's status", exc)


class Urllib3SessionInstrumentor(SessionInstrumentor):
    """Session headers for urllib3's connection pools, so for requests too (entry point
    ``otel_session_urllib3``)."""

    library = "urllib3"
    requirement = "urllib3 >= 1.26"
    replaces = ("urllib3", "requests")
    upstream = ("opentelemetry.instrumentation.requests", "RequestsInstrumentor")

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        from urllib3.util import parse_url
        from urllib3.util.proxy import connection_requires_http_tunnel

        global _parse_url, _tunnelled
        _parse_url, _tunnelled = parse_url, connection_requires_http_tunnel
        return [(module.HTTPConnectionPool, "urlopen", _urlopen)]
