"""``trajectory()``: one attempt, one session, as a context manager or a decorator.

Entering attaches a context whose baggage carries the session and whose current span is the
trajectory span; leaving detaches that exact token, so the caller's context comes back unchanged
even after an exception or a cancellation. With ``end_sessions`` on, the context also holds the set
of routers the trajectory's requests reached, and leaving tells each of them the session is over
(``_session_end``), on success, error and cancellation alike.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from otel_session import _hop, _session_end, _tracing
from otel_session._context import ROUTER_VISITS_KEY, SESSION_ATTRIBUTE, session_ids, with_session
from otel_session._ids import check_session_id, new_session_id

_F = TypeVar("_F", bound=Callable[..., Any])


class trajectory:
    """Run one trajectory attempt under its own Dynamo session.

    Each entry is a new attempt with a fresh UUID4, unless ``session_id`` adopts an existing stable
    ID (NeMo-Gym's per-episode UUID, say). Opened inside another trajectory it gets a new ID of its
    own, and its requests to Dynamo name the outer one as parent. As a decorator every call of the
    function is a new attempt.
    """

    def __init__(
        self,
        session_id: str | None = None,
        *,
        name: str = "trajectory",
        prompt_index: int | None = None,
        sibling_index: int | None = None,
        attempt: int | None = None,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        self._adopted = None if session_id is None else check_session_id(session_id)
        self._name = name
        self._attributes: dict[str, AttributeValue] = dict(attributes or {})
        for key, value in (
            ("prompt_index", prompt_index),
            ("sibling_index", sibling_index),
            ("attempt", attempt),
        ):
            if value is not None:
                self._attributes[f"otel_session.{key}"] = value
        self._token: object | None = None
        self._span: Span | None = None
        self._visits: set[_session_end.Visit] | None = None
        self.session_id: str | None = None
        self.parent_session_id: str | None = None

    @property
    def span(self) -> Span:
        """The trajectory span (non-recording while tracing is off)."""
        return self._span if self._span is not None else trace.INVALID_SPAN

    def _fresh(self) -> trajectory:
        """An unentered copy, so one decorator serves many concurrent calls."""
        clone = trajectory.__new__(trajectory)
        clone.__dict__.update(self.__dict__)
        clone._attributes = dict(self._attributes)
        return clone

    def __enter__(self) -> trajectory:
        if self._token is not None:
            raise RuntimeError("this trajectory is already running; open a new otel_session.trajectory()")
        current = otel_context.get_current()
        parent, grandparent = session_ids(current)
        session = self._adopted if self._adopted is not None else new_session_id()
        reentered = session == parent
        if reentered:
            parent = grandparent  # re-entering the enclosing session: the same session, the same parent
        ctx = with_session(session, parent, current)
        # A re-entered session is ended by the trajectory that opened it: it keeps that one's set.
        visits = None if reentered else _session_end.new_visits()
        if visits is not None:
            ctx = otel_context.set_value(ROUTER_VISITS_KEY, visits, ctx)
        attributes = {SESSION_ATTRIBUTE: session, "gen_ai.conversation.id": session, **self._attributes}
        if parent is not None:
            attributes["otel_session.parent_session_id"] = parent
        span = _tracing.tracer().start_span(self._name, context=ctx, attributes=attributes)
        self._span = span
        self._visits = visits
        self.session_id, self.parent_session_id = session, parent
        ctx = trace.set_span_in_context(span, ctx)
        _hop.entered(ctx, session, parent, span)
        self._token = otel_context.attach(ctx)  # last: nothing after it can fail and leave it attached
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        visits = self._leave(exc)
        if visits and self.session_id is not None:
            _session_end.finish(self.session_id, self.parent_session_id, visits)

    def _leave(self, exc: BaseException | None) -> set[_session_end.Visit] | None:
        """Detach and end the span; returns the routers to tell the session is over (at most once)."""
        token, span, visits = self._token, self._span, self._visits
        self._token, self._visits = None, None
        try:
            if span is not None and exc is not None and span.is_recording():
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        finally:
            if token is not None:
                otel_context.detach(token)  # type: ignore[arg-type]
            if span is not None:
                span.end()
        return visits

    async def __aenter__(self) -> trajectory:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        visits = self._leave(exc)
        if visits and self.session_id is not None:
            await _session_end.finish_async(self.session_id, self.parent_session_id, visits)

    def __call__(self, func: _F) -> _F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                async with self._fresh():
                    return await func(*args, **kwargs)

            return cast(_F, run_async)

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return cast(_F, run)
