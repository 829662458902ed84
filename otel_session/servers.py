"""Servers in the middle (Gym agent and model servers, token wrappers): continue the caller's session.

A request arriving with ``X-Dynamo-Session-ID`` or W3C baggage ``session.id`` (and the parent session,
if any) makes that session current for the whole request, streamed responses included, so the
server's own calls to Dynamo through the client hooks carry it. A server that keeps its own stable
per-episode ID (NeMo-Gym's cookie session) adopts it with ``session_from``. Incoming values are
untrusted input: anything that is not a valid session ID is ignored, never answered with an error.

    app.add_middleware(SessionMiddleware)                              # FastAPI / Starlette
    web.Application(middlewares=[aiohttp_session_middleware])          # aiohttp

Reading the session needs no ``configure()``: the middleware extracts directly, so
``current_session_id()`` works in any server. Forwarding it onward does need ``configure()`` in the
server process (it installs the client hooks and says which hosts are Dynamo). With
``configure(servers=True)``, and by default in zero-code mode, no ``add_middleware`` is needed at all:
every app the process builds gets this middleware innermost (``_server_hooks``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.context import Context, get_current
from opentelemetry.propagators.textmap import Getter

from otel_session import _faults
from otel_session._context import PARENT_KEY, SESSION_KEY, session_ids, with_session
from otel_session._ids import is_valid_session_id
from otel_session._propagator import extract_session

if TYPE_CHECKING:
    from aiohttp import web

__all__ = [
    "SessionMiddleware",
    "SessionSource",
    "aiohttp_session_middleware",
    "cookie",
    "is_session_middleware",
    "make_aiohttp_session_middleware",
    "starlette_session",
]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SessionSource = Callable[[Any], "str | None"]
"""Reads a server's own session ID from the ASGI scope (Starlette) or the ``web.Request`` (aiohttp)."""

_Headers = dict[str, list[str]]


class _HeadersGetter(Getter[_Headers]):
    """Headers folded once into lower-case name -> all values, so every lookup is one dict access."""

    def get(self, carrier: _Headers, key: str) -> list[str] | None:
        return carrier.get(key.lower())

    def keys(self, carrier: _Headers) -> list[str]:
        return list(carrier)


_getter = _HeadersGetter()


def _fold(pairs: Iterable[tuple[str, str]]) -> _Headers:
    headers: _Headers = {}
    for name, value in pairs:
        headers.setdefault(name.lower(), []).append(value)
    return headers


def _own_session(source: SessionSource | None, request: Any) -> str | None:
    """The server's own ID if ``source`` yields a valid one; a broken source must not fail the request."""
    if source is None:
        return None
    try:
        value = source(request)
    except Exception as exc:
        _faults.report("reading the server's own session ID (session_from)", exc)
        return None
    if isinstance(value, str):
        value = value.strip()
    return value if is_valid_session_id(value) else None


def _request_context(headers: _Headers, own_session: str | None = None) -> Context:
    """The context a request runs in: its caller's session (or ``own_session``), nothing inherited.

    The session keys of the server's ambient context are dropped first, so a request that arrives
    without a session forwards none, whatever context the server happened to start in. A span that
    an outer instrumentation already started for this request stays current (extracting
    ``traceparent`` again would skip it as a parent); otherwise the caller's ``traceparent`` is used.
    """
    current = get_current()
    base = baggage.remove_baggage(PARENT_KEY, baggage.remove_baggage(SESSION_KEY, current))
    try:
        ctx = extract_session(headers, base, _getter)
    except Exception as exc:
        _faults.report("extracting an incoming session", exc)
        ctx = base
    server_span = trace.get_current_span(current)
    if server_span.get_span_context().is_valid:
        ctx = trace.set_span_in_context(server_span, ctx)
    if own_session is not None:
        # The server's own ID names this same trajectory; a parent is only a caller's parent, if any.
        _, parent = session_ids(ctx)
        ctx = with_session(own_session, parent if parent != own_session else None, ctx)
    return ctx


class SessionMiddleware:
    """Pure ASGI middleware: the request's session is current for the app, body streaming included.

    ``app.add_middleware(SessionMiddleware)`` or ``SessionMiddleware(app)``. It attaches and detaches
    in its own ``__call__`` (no task of its own, unlike ``BaseHTTPMiddleware``), so everything the app
    awaits, including a ``StreamingResponse`` body, sees the session. ``session_from`` adopts the
    server's own ID (it wins over the caller's); it sees ``scope`` as it is at this middleware, so a
    source reading ``scope["session"]`` needs this middleware inside Starlette's ``SessionMiddleware``
    and inside whatever mints the ID (with ``add_middleware``: register this one first).
    Only ``http`` is touched; lifespan and websocket pass through unchanged.
    """

    def __init__(self, app: ASGIApp, *, session_from: SessionSource | None = None) -> None:
        self.app = app
        self.session_from = session_from

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _fold((name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"])
        token = otel_context.attach(_request_context(headers, _own_session(self.session_from, scope)))
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)


_MARK = "__otel_session_middleware__"  # on every aiohttp middleware made here
Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]
AiohttpMiddleware = Callable[["web.Request", Handler], Awaitable["web.StreamResponse"]]


def make_aiohttp_session_middleware(*, session_from: SessionSource | None = None) -> AiohttpMiddleware:
    """An aiohttp middleware like ``aiohttp_session_middleware`` that adopts the server's own ID.

    ``web.Application(middlewares=[make_aiohttp_session_middleware(session_from=cookie("session_id"))])``.
    aiohttp's own server instrumentation never makes the extracted baggage current, hence this.
    """

    async def session_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        headers = _fold(request.headers.items())
        token = otel_context.attach(_request_context(headers, _own_session(session_from, request)))
        try:
            # A StreamResponse is written inside the handler, so a streamed body sees the session too.
            return await handler(request)
        finally:
            otel_context.detach(token)

    # What ``@aiohttp.web.middleware`` sets; done by hand so importing this module needs no aiohttp.
    session_middleware.__middleware_version__ = 1  # type: ignore[attr-defined]
    setattr(session_middleware, _MARK, True)
    return session_middleware


def is_session_middleware(candidate: object) -> bool:
    """Whether ``candidate`` is otel-session's middleware (the ASGI class or an aiohttp one of ours).

    Server auto-instrumentation asks this so that a middleware added by hand is never doubled.
    """
    if isinstance(candidate, type):
        return issubclass(candidate, SessionMiddleware)
    return getattr(candidate, _MARK, False) is True


aiohttp_session_middleware: AiohttpMiddleware = make_aiohttp_session_middleware()
"""``web.Application(middlewares=[aiohttp_session_middleware])``: the caller's session is current."""


def cookie(name: str) -> SessionSource:
    """``session_from=cookie("session_id")``: the server's own ID is the plain value of cookie ``name``.

    Works for both middlewares (it reads ``web.Request.cookies`` or the ASGI ``cookie`` header).
    """

    def read(request: Any) -> str | None:
        cookies = getattr(request, "cookies", None)
        if cookies is not None:  # aiohttp web.Request
            found: object = cookies.get(name)
            return found if isinstance(found, str) else None
        for header, raw in request.get("headers", ()):
            if header.lower() != b"cookie":
                continue
            text: str = raw.decode("latin-1")
            for part in text.split(";"):
                key, _, value = part.strip().partition("=")
                if key == name:
                    return value.strip().strip('"')
        return None

    return read


_ORDER_HINT = (
    "otel_session.servers.SessionMiddleware cannot see scope['session']: it runs outside Starlette's "
    "SessionMiddleware, so the server's own session ID is never adopted. Register it with "
    "app.add_middleware(...) before the session middleware (and before whatever mints the ID)."
)


_order_warned: list[bool] = []  # once per process: a misplaced middleware stays misplaced


def starlette_session(key: str = "session_id") -> SessionSource:
    """``session_from=starlette_session("session_id")``: the ID kept in ``request.session[key]``.

    This is where NeMo-Gym keeps its per-episode ID (Starlette's signed cookie session, key
    ``session_id``). Placed wrongly (outside Starlette's ``SessionMiddleware``) it warns once.
    """

    def read(scope: Any) -> str | None:
        session = scope.get("session") if isinstance(scope, MutableMapping) else None
        if session is None:
            if not _order_warned:
                _order_warned.append(True)
                _faults.warn(_ORDER_HINT)
            return None
        value: object = session.get(key)
        return value if isinstance(value, str) else None

    return read
