"""Server auto-instrumentation: every Starlette/FastAPI app and aiohttp app gets the session middleware.

Frameworks build their apps where no user code can reach (NeMo-Gym inside ``setup_webserver()``,
NeMo-RL's token wrapper inside ``start()``), and the middleware must sit *inside* Starlette's cookie
session and whatever mints the episode ID there. Both frameworks assemble their middleware chain at
one late moment, after every ``add_middleware`` call, so that moment is hooked:

- Starlette and FastAPI build the stack lazily (``build_middleware_stack``, at the first request or
  lifespan event); the hook appends ``SessionMiddleware`` to ``user_middleware`` for that build only,
  so it wraps the router inside every middleware the app registered. FastAPI overrides the method,
  so the hook covers each subclass that defines its own, including ones defined later.
- aiohttp fixes an app's middlewares when the app freezes (``pre_freeze``, at runner setup); the hook
  appends ours last, which aiohttp runs innermost.

An app that already has otel-session's middleware (added by hand) is left exactly as it is. Which
server-side ID to adopt comes from ``OTEL_SESSION_ADOPT``: ``session:KEY`` (``request.session[KEY]``,
Starlette's cookie session, as NeMo-Gym keeps ``session_id``) or ``cookie:NAME``; unset adopts nothing.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import wrapt

from otel_session import _faults, _settings
from otel_session.servers import (
    SessionMiddleware,
    SessionSource,
    cookie,
    is_session_middleware,
    make_aiohttp_session_middleware,
    starlette_session,
)

ENV_ADOPT = "OTEL_SESSION_ADOPT"
ENV_SERVERS = "OTEL_SESSION_SERVERS"
_ORIGINAL = "__otel_session_original__"
_BUILD = "build_middleware_stack"


def servers_setting(servers: bool | None, default: bool = False) -> bool:
    """``servers`` as given, else ``OTEL_SESSION_SERVERS`` (``ValueError`` naming it when malformed)."""
    return _settings.flag("servers", servers, ENV_SERVERS, default)


@dataclass(frozen=True)
class Adopt:
    """Where a server keeps its own session ID: ``session`` (``request.session[name]``) or ``cookie``."""

    kind: str
    name: str


def adopt_from_environment() -> Adopt | None:
    """``OTEL_SESSION_ADOPT`` parsed; a bad value is one warning line and means adopt nothing.

    A server must keep serving whatever this variable says, so it never raises.
    """
    raw = os.environ.get(ENV_ADOPT, "")
    if not raw.strip():
        return None
    kind, sep, name = raw.strip().partition(":")
    kind, name = kind.strip().lower(), name.strip()
    if sep and kind in ("session", "cookie") and name and not any(c.isspace() or c in ",;=" for c in name):
        return Adopt(kind, name)
    _faults.logger.warning(
        "otel-session: %s=%r is not understood, so no server-side session ID is adopted; use "
        "session:KEY (request.session[KEY], e.g. session:session_id for NeMo-Gym) or cookie:NAME",
        ENV_ADOPT,
        raw,
    )
    return None


_adopt: Adopt | None = None


def _has_starlette_sessions(app: Any) -> bool:
    """Whether the app registered Starlette's cookie session, what sets ``scope["session"]``."""
    try:
        from starlette.middleware.sessions import SessionMiddleware as CookieSessions
    except ImportError:
        return False
    return any(
        isinstance(entry.cls, type) and issubclass(entry.cls, CookieSessions) for entry in app.user_middleware
    )


def _starlette_source(app: Any) -> SessionSource | None:
    adopt = _adopt
    if adopt is None:
        return None
    if adopt.kind == "cookie":
        return cookie(adopt.name)
    # Only where the app keeps a cookie session: others (a token wrapper) simply have no ID to adopt.
    return starlette_session(adopt.name) if _has_starlette_sessions(app) else None


def _aiohttp_source() -> SessionSource | None:
    adopt = _adopt
    # ``session:KEY`` is Starlette's request.session, which aiohttp has not: a run that sets it for its
    # Gym servers also starts aiohttp apps (Ray's own agents among them), which simply adopt nothing.
    return cookie(adopt.name) if adopt is not None and adopt.kind == "cookie" else None


def _wrap_build(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def build_middleware_stack(self: Any) -> Any:
        ours = None
        try:
            registered = list(self.user_middleware)
            # Added by hand (or by an outer build of a subclass calling this one): never twice.
            if not any(is_session_middleware(entry.cls) for entry in registered):
                from starlette.middleware import Middleware

                ours = Middleware(SessionMiddleware, session_from=_starlette_source(self))
        except Exception as exc:  # an app we do not understand is served as it is
            _faults.report("adding the session middleware to a Starlette app", exc)
        if ours is None:
            return original(self)
        saved = self.user_middleware
        self.user_middleware = [*registered, ours]  # last registered = innermost, inside the session
        try:
            return original(self)
        finally:
            self.user_middleware = saved

    setattr(build_middleware_stack, _ORIGINAL, original)
    return build_middleware_stack


def _patch_build(cls: type) -> None:
    current = cls.__dict__.get(_BUILD)
    if current is not None and not hasattr(current, _ORIGINAL):
        setattr(cls, _BUILD, _wrap_build(current))


def _unpatch_build(cls: type) -> None:
    original = getattr(cls.__dict__.get(_BUILD), _ORIGINAL, None)
    if original is not None:
        setattr(cls, _BUILD, original)


def _starlette_classes(root: type) -> list[type]:
    found, pending = [], [root]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


_SUBCLASS_HOOK = "__init_subclass__"


def _install_starlette(module: ModuleType) -> None:
    if not _wanted:
        return
    starlette = module.Starlette
    for cls in _starlette_classes(starlette):
        _patch_build(cls)
    previous = starlette.__dict__.get(_SUBCLASS_HOOK)  # a classmethod Starlette defined itself, if any
    if hasattr(getattr(previous, "__func__", None), _ORIGINAL):
        return

    def __init_subclass__(cls: type, /, **kwargs: Any) -> None:
        # FastAPI (and any app class defined after configure()) overrides build_middleware_stack.
        if previous is not None:
            previous.__get__(None, cls)(**kwargs)
        else:
            super(starlette, cls).__init_subclass__(**kwargs)
        _patch_build(cls)

    setattr(__init_subclass__, _ORIGINAL, previous)
    starlette.__init_subclass__ = classmethod(__init_subclass__)


def _uninstall_starlette() -> None:
    module = sys.modules.get(_STARLETTE)
    if module is None:
        return
    starlette = module.Starlette
    for cls in _starlette_classes(starlette):
        _unpatch_build(cls)
    ours = getattr(starlette.__dict__.get(_SUBCLASS_HOOK), "__func__", None)
    if hasattr(ours, _ORIGINAL):
        previous = getattr(ours, _ORIGINAL)
        if previous is None:
            delattr(starlette, _SUBCLASS_HOOK)
        else:
            setattr(starlette, _SUBCLASS_HOOK, previous)


def _wrap_pre_freeze(original: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def pre_freeze(self: Any) -> None:
        try:
            if not self.pre_frozen and not any(is_session_middleware(m) for m in self.middlewares):
                # aiohttp runs the last middleware innermost, next to the handler.
                self.middlewares.append(make_aiohttp_session_middleware(session_from=_aiohttp_source()))
        except Exception as exc:
            _faults.report("adding the session middleware to an aiohttp app", exc)
        original(self)

    setattr(pre_freeze, _ORIGINAL, original)
    return pre_freeze


def _install_aiohttp(module: ModuleType) -> None:
    if not _wanted:
        return
    application = module.Application
    current = application.__dict__.get("pre_freeze")
    if current is not None and not hasattr(current, _ORIGINAL):
        application.pre_freeze = _wrap_pre_freeze(current)


def _guarded(install: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def hook(module: ModuleType) -> None:
        try:
            install(module)
        except Exception as exc:  # a framework we cannot hook still serves, without the middleware
            _faults.report(f"hooking {module.__name__} for the session middleware", exc)

    return hook


_STARLETTE, _AIOHTTP = "starlette.applications", "aiohttp.web_app"
_wanted = False
_hooks_registered = False


def install() -> None:
    """Hook app building in Starlette, FastAPI and aiohttp; idempotent.

    Each framework is hooked when the process imports it (at once if it has already), never imported
    here. Re-reads ``OTEL_SESSION_ADOPT`` each time, so a new ``configure()`` takes a new value.
    """
    global _adopt, _wanted, _hooks_registered
    _adopt = adopt_from_environment()
    _wanted = True
    if not _hooks_registered:
        _hooks_registered = True  # post-import hooks cannot be removed: they check ``_wanted``
        wrapt.register_post_import_hook(_guarded(_install_starlette), _STARLETTE)
        wrapt.register_post_import_hook(_guarded(_install_aiohttp), _AIOHTTP)
        return
    for name, hook in ((_STARLETTE, _install_starlette), (_AIOHTTP, _install_aiohttp)):
        module = sys.modules.get(name)
        if module is not None:
            _guarded(hook)(module)


def uninstall() -> None:
    """Put every hooked method back; apps already built keep the middleware they were built with."""
    global _adopt, _wanted
    _adopt = None
    _wanted = False
    _uninstall_starlette()
    module = sys.modules.get(_AIOHTTP)
    if module is not None:
        application = module.Application
        original = getattr(application.__dict__.get("pre_freeze"), _ORIGINAL, None)
        if original is not None:
            application.pre_freeze = original
