"""Lean client hooks: put the session on requests from httpx, httpx2 (openai) and aiohttp.

They patch the one method each client calls once per HTTP hop (httpx's ``_send_single_request``,
aiohttp's ``ClientRequest.send``), so every transport, every redirect hop and every retry passes
through them, for clients created before or after ``configure()``. They start no span: with tracing
off that is the whole cost of otel-session, a dictionary lookup for most requests. Headers are added
to the request for the hop only and taken away afterwards, so the caller's ``Request`` is left as it
was and a redirect built from it carries nothing of ours.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context, get_current
from opentelemetry.propagators.textmap import Setter

from otel_session import _faults, _settings
from otel_session._context import DESTINATION_KEY, session_ids
from otel_session._hosts import _DEFAULT_PORTS, NOTHING
from otel_session._propagator import (
    _carrier_get,
    _is_case_insensitive,
    add_header,
    inject_headers,
    inject_ids,
    remove_header,
)

_ORIGINAL = "__otel_session_original__"


class _Undo(Setter[Any]):
    """Records each header we set with the value it replaced, to put things back after the hop."""

    __slots__ = ("changes",)

    def __init__(self) -> None:
        self.changes: list[tuple[str, Any]] = []

    def set(self, carrier: Any, key: str, value: str) -> None:
        if add_header(carrier, key, value):  # the usual case: absent before, in one pass
            self.changes.append((key, None))
            return
        # The cheapest exact ``carrier.get(key)`` for a header mapping: this runs on every request.
        previous = _carrier_get(carrier, key) if _is_case_insensitive(carrier) else carrier.get(key)
        self.changes.append((key, previous))
        carrier[key] = value

    def restore(self, headers: Any) -> None:
        for key, previous in reversed(self.changes):
            if previous is not None:
                headers[key] = previous
                continue
            try:
                remove_header(headers, key)
            except Exception as exc:
                # Taking our header back is what keeps it off a redirect: fall back to the public way.
                _faults.report("removing a header the fast way", exc)
                headers.pop(key, None)


# What the hooks read from the current context, for the last context seen. A ``Context`` is immutable,
# so the same object always gives the same answer, and one trajectory's requests share one until
# something attaches another: the usual request skips reading baggage, validating the IDs and
# finding the span. One entry, whatever the number of sessions; swapped whole, so thread-safe.
_last_context: tuple[object, str | None, str | None, bool] = (None, None, None, False)


def _context_facts(ctx: Context) -> tuple[str | None, str | None, bool]:
    """(session, parent, whether the current span is valid) in ``ctx``."""
    global _last_context
    session, parent = session_ids(ctx)
    span_valid = trace.get_current_span(ctx).get_span_context().is_valid
    _last_context = (ctx, session, parent, span_valid)
    return session, parent, span_valid


def _begin(headers: Any, scheme: str, host: str | None, port: int | None) -> tuple[_Undo, object] | None:
    """Add what this destination may receive; ``None`` when there is nothing to do or undo."""
    settings = _settings._active  # not active(): a call less on every request
    if settings is None:
        return None
    ctx = get_current()
    rules = settings.rules
    # ``rules.classify_url`` inlined for the usual cache hit: a request's whole cost here is counted.
    port_or_default = port if port is not None else _DEFAULT_PORTS.get(scheme.lower())
    kind = rules._cache.get((host, port_or_default)) if host else NOTHING
    if kind is None:
        kind = rules.classify_url(scheme, host, port)
    last = _last_context
    if last[0] is ctx:
        _, session, parent, span_valid = last
    else:
        session, parent, span_valid = _context_facts(ctx)
    if kind == NOTHING and not settings.tracing and session is None:
        return None
    undo = _Undo()
    try:
        if span_valid or not inject_headers(kind, headers, undo.changes, session, parent):
            inject_ids(kind, headers, ctx, undo, session, parent)
    except BaseException:
        undo.restore(headers)  # a failure halfway must not leave half our headers on the request
        raise
    token = None
    if settings.tracing:
        # The upstream instrumentation injects later through the global propagator: tell it where.
        token = otel_context.attach(otel_context.set_value(DESTINATION_KEY, (scheme, host, port), ctx))
    return undo, token


def _end(headers: Any, plan: tuple[_Undo, object]) -> None:
    undo, token = plan
    if token is not None:
        otel_context.detach(token)  # type: ignore[arg-type]
    undo.restore(headers)


def _safe_begin(headers: Any, scheme: str, host: str | None, port: int | None) -> tuple[_Undo, object] | None:
    try:
        return _begin(headers, scheme, host, port)
    except Exception as exc:  # a bug of ours must not fail the request
        _faults.report("adding session headers to a request", exc)
        return None


# The httpx wrappers inline ``_safe_begin`` and guard ``_end`` the same way: a call less per request.


def _httpx_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _send_single_request(self: Any, request: Any) -> Any:
        url = request.url
        headers = request.headers
        try:
            plan = _begin(headers, url.scheme, url.host, url.port)
        except Exception as exc:  # a bug of ours must not fail the request
            _faults.report("adding session headers to a request", exc)
            plan = None
        if plan is None:
            return original(self, request)
        try:
            return original(self, request)
        finally:
            request.headers = headers  # an upstream instrumentation may have swapped in a copy
            try:
                _end(headers, plan)
            except Exception as exc:
                _faults.report("restoring request headers", exc)

    return _send_single_request


def _httpx_async(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def _send_single_request(self: Any, request: Any) -> Any:
        url = request.url
        headers = request.headers
        try:
            plan = _begin(headers, url.scheme, url.host, url.port)
        except Exception as exc:
            _faults.report("adding session headers to a request", exc)
            plan = None
        if plan is None:
            return await original(self, request)
        try:
            return await original(self, request)
        finally:
            request.headers = headers
            try:
                _end(headers, plan)
            except Exception as exc:
                _faults.report("restoring request headers", exc)

    return _send_single_request


def _aiohttp_send(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def send(self: Any, conn: Any) -> Any:
        # One ClientRequest per hop, built from the session's own headers: ours never reach the next.
        url = self.url
        plan = _safe_begin(self.headers, url.scheme, url.raw_host, url.port)
        if plan is None or plan[1] is None:
            return await original(self, conn)
        try:
            return await original(self, conn)
        finally:
            otel_context.detach(plan[1])  # type: ignore[arg-type]

    return send


# (module, class, method, wrapper factory)
_TARGETS: tuple[tuple[str, str, str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...] = (
    ("httpx", "Client", "_send_single_request", _httpx_sync),
    ("httpx", "AsyncClient", "_send_single_request", _httpx_async),
    ("httpx2", "Client", "_send_single_request", _httpx_sync),
    ("httpx2", "AsyncClient", "_send_single_request", _httpx_async),
    ("aiohttp", "ClientRequest", "send", _aiohttp_send),
)


def _installed_targets() -> Iterator[
    tuple[str, type, str, Callable[[Callable[..., Any]], Callable[..., Any]]]
]:
    """(name, class, method, wrapper factory) for each target whose client library is installed."""
    for module_name, class_name, method, factory in _TARGETS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        yield f"{module_name}.{class_name}", cls, method, factory


def install() -> list[str]:
    """Patch every installed client (idempotent); returns what was patched, e.g. ``httpx.Client``."""
    patched = []
    for name, cls, method, factory in _installed_targets():
        current = cls.__dict__.get(method)
        if current is None:
            continue
        if not hasattr(current, _ORIGINAL):
            wrapper = factory(current)
            setattr(wrapper, _ORIGINAL, current)
            setattr(cls, method, wrapper)
        patched.append(name)
    return patched


def uninstall() -> None:
    """Put every patched method back."""
    for _, cls, method, _ in _installed_targets():
        original = getattr(cls.__dict__.get(method), _ORIGINAL, None)
        if original is not None:
            setattr(cls, method, original)
