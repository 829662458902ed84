"""aiohttp servers: every ``web.Application`` the process runs gets the session middleware, innermost.

aiohttp fixes an app's middlewares when the app freezes (``pre_freeze``, at runner setup), after
every middleware the app registered; ours is appended then, and aiohttp runs the last one innermost.
aiohttp's own server instrumentation never makes the extracted baggage current, hence a middleware.
An app that already has otel-session's middleware (added by hand) is left as it is.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from otel_session import _faults, _settings
from otel_session.instrumentation._base import SessionInstrumentor, Wrapper
from otel_session.servers import SessionSource, cookie, is_session_middleware, make_aiohttp_session_middleware


def _source() -> SessionSource | None:
    settings = _settings.current
    adopt = settings.adopt if settings is not None else None
    # ``session:KEY`` is Starlette's request.session, which aiohttp has not: a run that sets it for its
    # Gym servers also starts aiohttp apps (Ray's own agents among them), which simply adopt nothing.
    return cookie(adopt[1]) if adopt is not None and adopt[0] == "cookie" else None


def _pre_freeze(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        if (
            _INSTRUMENTOR.active
            and not instance.pre_frozen
            and not any(is_session_middleware(m) for m in instance.middlewares)
        ):
            instance.middlewares.append(make_aiohttp_session_middleware(session_from=_source()))
    except Exception as exc:  # an app we do not understand is served as it is
        _faults.report("adding the session middleware to an aiohttp app", exc)
    return wrapped(*args, **kwargs)


class AioHttpServerSessionInstrumentor(SessionInstrumentor):
    """The session middleware in every aiohttp app (entry point ``otel_session_aiohttp_server``)."""

    library = "aiohttp.web_app"
    requirement = "aiohttp >= 3.9"
    kind = "server"

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        return [(module.Application, "pre_freeze", _pre_freeze)]


_INSTRUMENTOR = AioHttpServerSessionInstrumentor()
