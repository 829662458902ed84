"""Starlette and FastAPI servers: every app the process builds gets the session middleware, innermost.

Frameworks build their apps where no user code can reach (NeMo-Gym inside ``setup_webserver()``,
NeMo-RL's token wrapper inside ``start()``), and the middleware must sit inside Starlette's cookie
session and whatever mints the episode ID there. Starlette assembles the chain lazily, after every
``add_middleware`` call (``build_middleware_stack``, at the first request or lifespan event), so that
moment is patched: ``SessionMiddleware`` is appended to ``user_middleware`` for that build only.
FastAPI overrides the method, so every class defining its own is patched: those that exist when
instrumenting, and those defined since when one of their apps is first called.

An app that already has otel-session's middleware (added by hand) is left exactly as it is. Which
server-side ID to adopt comes from ``OTEL_SESSION_ADOPT`` (``Settings.adopt``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from otel_session import _faults, _settings
from otel_session.instrumentation._base import SessionInstrumentor, Wrapper
from otel_session.servers import (
    SessionMiddleware,
    SessionSource,
    cookie,
    is_session_middleware,
    starlette_session,
)

_BUILD = "build_middleware_stack"


def _has_cookie_sessions(app: Any) -> bool:
    """Whether the app registered Starlette's cookie session, what sets ``scope["session"]``."""
    try:
        from starlette.middleware.sessions import SessionMiddleware as CookieSessions
    except ImportError:
        return False
    return any(
        isinstance(entry.cls, type) and issubclass(entry.cls, CookieSessions) for entry in app.user_middleware
    )


def _source(app: Any) -> SessionSource | None:
    settings = _settings.current
    adopt = settings.adopt if settings is not None else None
    if adopt is None:
        return None
    kind, name = adopt
    if kind == "cookie":
        return cookie(name)
    # Only where the app keeps a cookie session: others (a token wrapper) simply have no ID to adopt.
    return starlette_session(name) if _has_cookie_sessions(app) else None


def _build(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``build_middleware_stack`` with ours registered last (innermost, inside the cookie session)."""
    ours = None
    try:
        registered = list(instance.user_middleware)
        # Added by hand (or by an outer build of a subclass calling this one): never twice.
        if _INSTRUMENTOR.active and not any(is_session_middleware(entry.cls) for entry in registered):
            from starlette.middleware import Middleware

            ours = Middleware(SessionMiddleware, session_from=_source(instance))
    except Exception as exc:  # an app we do not understand is served as it is
        _faults.report("adding the session middleware to a Starlette app", exc)
    if ours is None:
        return wrapped(*args, **kwargs)
    saved = instance.user_middleware
    instance.user_middleware = [*registered, ours]
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.user_middleware = saved


def _subclasses(root: type) -> list[type]:
    found, pending = [], [root]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def _builders(classes: list[type]) -> list[tuple[Any, str, Wrapper]]:
    return [(cls, _BUILD, _build) for cls in classes if callable(cls.__dict__.get(_BUILD))]


class StarletteSessionInstrumentor(SessionInstrumentor):
    """The session middleware in every Starlette/FastAPI app (entry point ``otel_session_starlette``)."""

    library = "starlette.applications"
    requirement = "starlette >= 0.27"
    kind = "server"

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        return [*_builders(_subclasses(module.Starlette)), (module.Starlette, "__call__", _called)]


def _called(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An app's call: its class, if defined since instrumenting, gets its builder patched first.

    Synchronous, returning the original's coroutine: uvicorn tells an app from an app factory by
    calling it with no argument, which must raise ``TypeError`` here as it does unpatched."""
    try:
        if instance.middleware_stack is None:
            for owner, name, wrapper in _builders(list(type(instance).__mro__)):
                _INSTRUMENTOR.patch(owner, name, wrapper)  # a no-op for those patched already
    except Exception as exc:
        _faults.report("instrumenting a Starlette app class", exc)
    return wrapped(*args, **kwargs)


_INSTRUMENTOR = StarletteSessionInstrumentor()
