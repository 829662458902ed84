"""``trajectory()``: one attempt, one session, as a context manager, a decorator or a named boundary.

Entering attaches a context whose baggage carries the session and whose current span is the
trajectory span; leaving detaches that exact token, so the caller's context comes back unchanged
even after an exception or a cancellation. With ``end_sessions`` on, the context also holds the set
of routers the trajectory's requests reached, and leaving tells each of them the session is over
(``_session_end``), on success, error and cancellation alike.

As a decorator (and for functions named as boundaries, ``as_attempt``) every call is one attempt,
whatever the function returns: a coroutine is awaited inside it, and a generator or async generator
is one attempt for as long as it is iterated. The attempt's context is attached only while the
generator's own code runs, never between its items, where the consumer's code runs. (Over 300
lines: one attempt over each of those four kinds of callable, each with its own way to end.)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Hashable, Mapping
from types import TracebackType
from typing import Any, TypeVar, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from otel_session import (
    _faults,
    _fleet,
    _hop,
    _metrics,
    _pacing,
    _session_end,
    _settings,
    _siblings,
    _stock,
    _tracing,
)
from otel_session._context import (
    ROUTER_VISITS_KEY,
    SESSION_ATTRIBUTE,
    SIBLINGS_KEY,
    session_ids,
    with_session,
)
from otel_session._ids import check_session_id, new_session_id

_OPEN_KEY = otel_context.create_key("otel_session.trajectory")  # the attempt whose context this is

_F = TypeVar("_F", bound=Callable[..., Any])
_DESCRIPTORS = (classmethod, staticmethod, property)


class _TrajectoryType(type):
    """``with otel_session.trajectory:`` (no parentheses) gets an error that says what to write."""

    def __enter__(cls) -> None:
        raise TypeError("write `with otel_session.trajectory():` (or `async with`), with parentheses")

    __exit__ = __aenter__ = __aexit__ = __enter__  # never reached past __enter__; async with too


class trajectory(metaclass=_TrajectoryType):
    """Run one trajectory attempt under its own Dynamo session.

    Each entry is a new attempt with a fresh UUID4, unless ``session_id`` adopts an existing stable
    ID (NeMo-Gym's per-episode UUID, say). Opened inside another trajectory it gets a new ID of its
    own, and its requests to Dynamo name the outer one as parent. ``group`` names what siblings
    share (the prompt of a GRPO group: an index, a hash, any hashable value): attempts of one group
    open at once name a common parent session as ``configure(siblings=...)`` says (``groups:2`` by
    default: each two siblings under a parent of their own). As a decorator, with or without
    parentheses, every call of the function is a new attempt.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs:  # ``@trajectory`` without parentheses: the function alone
            (func,) = args
            if not isinstance(func, str) and (callable(func) or isinstance(func, _DESCRIPTORS)):
                return cls()(func)
        return object.__new__(cls)

    def __init__(
        self,
        session_id: str | None = None,
        *,
        name: str = "trajectory",
        prompt_index: int | None = None,
        sibling_index: int | None = None,
        attempt: int | None = None,
        attributes: Mapping[str, AttributeValue] | None = None,
        group: Hashable | None = None,
    ) -> None:
        self._adopted = None if session_id is None else check_session_id(session_id)
        self._group: _siblings.GroupKey | None = None
        self._ungrouped = False  # a group given whose key cannot be hashed: no parent at all
        self._grouped(group)
        self._joined: _siblings.GroupKey | None = None  # the group this attempt is open in, while it is
        self._inferred: _siblings.Inferred | None = None  # its group, read from its first request
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
        self._pending: object | None = None  # ended under another open attempt: detached after it
        self._span: Span | None = None
        self._visits: set[_session_end.Visit] | None = None
        self._context: Context | None = None
        self._pid = 0  # the process that began the attempt, the one that ends it
        self.session_id: str | None = None
        self._parent: str | None = None

    @property
    def parent_session_id(self) -> str | None:
        """The parent session its requests to a router name: the enclosing trajectory's, its group's,
        or, with no group given, the one its first request to a router decided (``None`` until then)."""
        inferred = self._inferred
        if self._parent is None and inferred is not None:
            return inferred.parent
        return self._parent

    @property
    def span(self) -> Span:
        """The trajectory span (non-recording while tracing is off)."""
        return self._span if self._span is not None else trace.INVALID_SPAN

    def _fresh(
        self, attributes: Mapping[str, AttributeValue] | None = None, group: Hashable | None = None
    ) -> trajectory:
        """An unentered copy, so one decorator serves many concurrent calls (``group``: in that one)."""
        clone: trajectory = object.__new__(trajectory)
        clone.__dict__.update(self.__dict__)
        clone._attributes = {**self._attributes, **(attributes or {})}
        if group is not None:
            clone._grouped(group)
        return clone

    def _grouped(self, group: Hashable | None) -> None:
        """The attempt's group key, hashed once here (one line, and no parent, where it cannot be)."""
        self._group = None if group is None else _siblings.key_of(group)
        self._ungrouped = group is not None and self._group is None

    def _begin(self) -> Context:
        """Start the attempt: its session, span and context, not attached yet."""
        if self._context is not None:
            raise RuntimeError("this trajectory is already running; open a new otel_session.trajectory()")
        if _settings.current is None:
            _hop.unconfigured()
        else:
            _stock.check_global()
        current = otel_context.get_current()
        parent, grandparent = session_ids(current)
        session = self._adopted if self._adopted is not None else new_session_id()
        reentered = session == parent
        if reentered:
            parent = grandparent  # re-entering the enclosing session: the same session, the same parent
        elif session == grandparent:
            parent = None  # the one outside the enclosing: its own parent is not known here, never a cycle
        settings = _settings.current
        policy = settings.siblings if settings is not None else _siblings.Siblings(None)
        # A group given under ``fleet``, or under ``auto`` before any step has ended where no trusted
        # host may carry the parent on, is decided at the attempt's first request to a router (where
        # a first step gathers: ``_gathering``).
        deferred = policy.withholds or (
            policy.sized and not _siblings.step_seen() and settings is not None and not settings.rules.trusted
        )
        if parent is None and self._group is not None and settings is not None and not deferred:
            # An enclosing trajectory wins. Sized to the largest fleet seen so far (``auto``): the
            # parent goes in baggage too, for a trusted host's requests to the router.
            joined = _siblings.join(self._group, policy, _fleet.largest() if policy.sized else None)
            if joined is not None:
                parent, self._joined = joined
        ctx = with_session(session, parent, current)
        if not reentered:  # a re-entered session is the same attempt: it keeps the group it has
            # With no group given (or under ``fleet``, which may withhold the session), the attempt's
            # first request to a router decides its group and parent.
            inferred = None
            if (
                parent is None
                and policy.size is not None
                and not self._ungrouped
                and (self._group is None or deferred)
            ):
                inferred = _siblings.Inferred(policy, self._group)
            if inferred is not None or current.get(SIBLINGS_KEY) is not None:
                ctx = otel_context.set_value(SIBLINGS_KEY, inferred, ctx)
            self._inferred = inferred
        # A re-entered session is ended by the trajectory that opened it: it keeps that one's set.
        visits = None if reentered else _session_end.new_visits()
        if visits is not None:
            ctx = otel_context.set_value(ROUTER_VISITS_KEY, visits, ctx)
        ctx = otel_context.set_value(_OPEN_KEY, self, ctx)
        attributes = {SESSION_ATTRIBUTE: session, "gen_ai.conversation.id": session, **self._attributes}
        if parent is not None:
            attributes["otel_session.parent_session_id"] = parent
        try:
            span = _tracing.tracer().start_span(self._name, context=ctx, attributes=attributes)
        except Exception as exc:  # the application's own TracerProvider: the span is lost, not the attempt
            _faults.report("starting a trajectory span", exc)
            span = trace.INVALID_SPAN
        self._span = span
        self._visits = visits
        self.session_id, self._parent = session, parent
        ctx = trace.set_span_in_context(span, ctx)
        _hop.entered(ctx, session, parent, span)
        _metrics.trajectory("started")
        self._context = ctx
        self._pid = os.getpid()
        return ctx

    def __enter__(self) -> trajectory:
        ctx = self._begin()
        self._token = otel_context.attach(ctx)  # last: nothing after it can fail and leave it attached
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end(exc)

    async def __aenter__(self) -> trajectory:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._end_async(exc)

    def _end(self, exc: BaseException | None) -> None:
        # An unpinned session (its router refused it for want of room) is bound nowhere: nothing to end.
        visits = self._leave(exc)
        if visits and self.session_id is not None and self.session_id not in _hop.unpinned:
            _session_end.finish(self.session_id, self.parent_session_id, visits)

    async def _end_async(self, exc: BaseException | None) -> None:
        visits = self._leave(exc)
        if visits and self.session_id is not None and self.session_id not in _hop.unpinned:
            await _session_end.finish_async(self.session_id, self.parent_session_id, visits)

    def _leave(self, exc: BaseException | None) -> set[_session_end.Visit] | None:
        """Detach and end the span; returns the routers to tell the session is over (at most once).
        A raw fork child leaving the attempt (``sys.exit`` unwinding through the ``with``) only
        detaches: the attempt, its span and its session's end are the parent's, still running it."""
        token, span, visits = self._token, self._span, self._visits
        self._token, self._visits, self._context = None, None, None
        if self._joined is not None:
            _siblings.leave(self._joined)
            self._joined = None
        if self.session_id is not None:  # the parent of attempts nested in it: its turn is over
            _pacing.release((self.session_id,))
        if self._inferred is not None:
            self._parent = self._parent or self._inferred.parent  # the session's end names it too
            if self._parent is not None and span is not None and span.is_recording():
                span.set_attribute("otel_session.parent_session_id", self._parent)
            self._inferred.release()
            self._inferred = None
        if self._pid != os.getpid():
            span, visits = None, None
        try:
            if span is not None and exc is not None and span.is_recording():
                _record_failure(span, exc)
        finally:
            if token is not None:
                self._detach(token)
            if span is not None:
                span.end()
                _metrics.trajectory("ended", exc)
        return visits

    def _detach(self, token: object) -> None:
        """Detach this attempt's context; ended while another attempt it does not enclose is open on
        top (two episodes ended out of order on one thread), only once that one ends, so the thread
        is never left inside an ended attempt (resetting now would put the other's end back here)."""
        top = otel_context.get_current().get(_OPEN_KEY)
        if isinstance(top, trajectory) and top is not self and top._context is not None:
            self._pending = token
            return
        otel_context.detach(token)  # type: ignore[arg-type]
        top = otel_context.get_current().get(_OPEN_KEY)
        while isinstance(top, trajectory) and top._pending is not None:
            token, top._pending = top._pending, None
            otel_context.detach(token)  # type: ignore[arg-type]
            top = otel_context.get_current().get(_OPEN_KEY)

    def __call__(self, func: _F) -> _F:
        """Every call of ``func`` is a new attempt (see ``as_attempt``); the decorated function keeps
        ``func``'s kind, so frameworks that inspect it (coroutine, generator) still see what it is.
        A ``classmethod`` or ``staticmethod`` stays one; a class or a ``property`` is refused: decorate
        the method that runs one attempt, or the property's getter."""
        if isinstance(func, (classmethod, staticmethod)):
            return cast(_F, type(func)(self(func.__func__)))
        if isinstance(func, property) or inspect.isclass(func):
            raise TypeError(
                f"trajectory() cannot decorate a {'property' if isinstance(func, property) else 'class'}: "
                "decorate the function or method that runs one attempt"
            )
        kept = keeping_kind(func, lambda args, kwargs: _starter(self, func, args, kwargs))
        if kept is not None:
            return cast(_F, kept)

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            return as_attempt(self, func, args, kwargs)

        return cast(_F, run)


def keeping_kind(
    func: Callable[..., Any], start: Callable[[tuple[Any, ...], dict[str, Any]], Callable[[], Started]]
) -> Callable[..., Any] | None:
    """A wrapper of the same kind as ``func`` (coroutine, generator or async generator function)
    whose every call runs through ``start`` in its context; ``None`` for any other callable. The kind
    is kept so that frameworks inspecting the function still see what it is."""
    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        async def run_async_generator(*args: Any, **kwargs: Any) -> Any:
            # By hand what ``yield from`` does for a generator: what is sent or thrown, and the close,
            # reach the function's own generator (an ``async for`` here would drop them).
            inner = async_generator_in(start(args, kwargs))
            step: Callable[[Any], Awaitable[Any]] = inner.asend
            value: Any = None
            while True:
                try:
                    item = await step(value)
                except StopAsyncIteration:
                    return
                try:
                    value, step = (yield item), inner.asend
                except GeneratorExit:
                    await inner.aclose()
                    raise
                except BaseException as exc:
                    value, step = exc, inner.athrow

        return run_async_generator
    if inspect.isgeneratorfunction(func):

        @functools.wraps(func)
        def run_generator(*args: Any, **kwargs: Any) -> Any:
            return (yield from generator_in(start(args, kwargs)))

        return run_generator
    if _is_async_callable(func):

        @functools.wraps(func)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            return await awaited_in(start(args, kwargs))

        return run_async
    return None


def _is_async_callable(func: object) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(func) or (
        not inspect.isfunction(func)
        and inspect.iscoroutinefunction(inspect.getattr_static(type(func), "__call__", None))
    )


# (the attempt, or None where there is none to end; its context; what calling the function gave)
Started = tuple["trajectory | None", Context, Any]
_Begun = tuple["trajectory", Context, Any]


def _starter(
    template: trajectory, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[[], _Begun]:
    """Starts a new attempt of ``template`` and calls ``func`` in it, when the result is first used:
    a coroutine never awaited, or a generator never iterated, starts no attempt at all."""

    def start() -> _Begun:
        attempt = template._fresh()
        ctx = attempt._begin()
        return attempt, ctx, _call_in(attempt, ctx, func, args, kwargs)

    return start


def as_attempt(
    template: trajectory, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Call ``func`` as one new attempt of ``template``, whatever it returns: a coroutine is awaited
    inside the attempt, a generator or async generator is one attempt for as long as it is iterated,
    anything else ends the attempt as the call returns or raises. Where ``func`` is known to return a
    coroutine or a generator, the attempt starts when that is first awaited or iterated; arguments
    it refuses fail at the call all the same, as they would unwrapped."""
    start = _starter(template, func, args, kwargs)
    if _is_async_callable(func):
        _refuse_now(func, args, kwargs)
        return awaited_in(start)
    if inspect.isasyncgenfunction(func):
        _refuse_now(func, args, kwargs)
        return async_generator_in(start)
    if inspect.isgeneratorfunction(func):
        _refuse_now(func, args, kwargs)
        return generator_in(start)
    attempt, ctx, result = start()
    later = continued(attempt, ctx, result)
    if later is not None:
        return later
    attempt._end(None)
    return result


def _refuse_now(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise now what calling ``func`` with these arguments raises at once (a coroutine or generator
    function binds its arguments when called, before any of its code runs). Only arguments its
    signature refuses are passed to ``func`` here, so the error is the function's own."""
    try:
        signature, bound = _signature_of(func, args)
        if signature is None:
            return
        signature.bind(*bound, **kwargs)
    except TypeError:
        made = func(*args, **kwargs)  # raises, unless the signature was not the function's
        if inspect.iscoroutine(made) or inspect.isgenerator(made):
            made.close()  # not run: the attempt calls the function itself


SIGNATURES_KEPT = 256  # functions whose signature is remembered: a run has a few rollout functions
_signatures: dict[Any, inspect.Signature | None] = {}


def _signature_of(
    func: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[inspect.Signature | None, tuple[Any, ...]]:
    """``func``'s signature, made once per function (``inspect.signature`` costs more than the rest of
    starting an attempt), and the arguments to bind to it: a bound method's instance first, since its
    function's signature is the one remembered (a new bound method is made at every attribute access).
    ``None`` where it has none."""
    key: Any = func
    function = getattr(func, "__func__", None)
    if function is not None and hasattr(func, "__self__") and not hasattr(func, "__signature__"):
        key, args = function, (func.__self__, *args)
    try:
        found = _signatures.get(key, _UNKNOWN)
    except TypeError:  # unhashable: asked afresh
        found = _UNKNOWN
    if found is _UNKNOWN:
        try:
            found = inspect.signature(key)
        except ValueError:
            found = None
        try:
            if len(_signatures) >= SIGNATURES_KEPT:
                _signatures.clear()
            _signatures[key] = found
        except TypeError:
            pass
    return found, args


_UNKNOWN: Any = object()


def continued(attempt: trajectory | None, ctx: Context, result: Any) -> Any:
    """A coroutine, generator or async generator that a call returned, to run (awaited or iterated
    later, anywhere) in ``ctx`` as the rest of ``attempt``; ``None`` for any other result."""
    if inspect.iscoroutine(result):
        return awaited_in(lambda: (attempt, ctx, result))
    if inspect.isgenerator(result):
        return generator_in(lambda: (attempt, ctx, result))
    if inspect.isasyncgen(result):
        return async_generator_in(lambda: (attempt, ctx, result))
    return None


def _call_in(attempt: trajectory, ctx: Context, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` with ``ctx`` attached; a failure ends the attempt."""
    token = otel_context.attach(ctx)
    try:
        result = func(*args, **kwargs)
    except BaseException as exc:
        otel_context.detach(token)
        attempt._end(exc)
        raise
    otel_context.detach(token)
    return result


async def awaited_in(start: Callable[[], Started]) -> Any:
    """Await what ``start`` gives, with its context attached, as the rest of the attempt (if any)."""
    attempt, ctx, awaitable = start()
    failure: BaseException | None = None
    token = otel_context.attach(ctx)
    try:
        return await awaitable
    except BaseException as exc:
        failure = exc
        raise
    finally:
        otel_context.detach(token)
        if attempt is not None:
            await attempt._end_async(failure)


def generator_in(start: Callable[[], Started]) -> Generator[Any, Any, Any]:
    """Iterate the generator ``start`` gives as the rest of the attempt (if any), its context attached
    only while the generator's code runs."""
    attempt, ctx, generator = start()
    failure: BaseException | None = None
    step: Callable[[Any], Any] = generator.send
    value: Any = None
    try:
        while True:
            token = otel_context.attach(ctx)
            try:
                item = step(value)
            except StopIteration as stop:
                return stop.value
            finally:
                otel_context.detach(token)
            try:
                value, step = (yield item), generator.send
            except GeneratorExit:
                token = otel_context.attach(ctx)
                try:
                    generator.close()
                finally:
                    otel_context.detach(token)
                raise
            except BaseException as exc:
                value, step = exc, generator.throw
    except GeneratorExit:
        raise
    except BaseException as exc:
        failure = exc
        raise
    finally:
        if attempt is not None:
            attempt._end(failure)


async def async_generator_in(start: Callable[[], Started]) -> AsyncGenerator[Any, Any]:
    """``generator_in`` for an async generator."""
    attempt, ctx, generator = start()
    failure: BaseException | None = None
    step: Callable[[Any], Awaitable[Any]] = generator.asend
    value: Any = None
    try:
        while True:
            token = otel_context.attach(ctx)
            try:
                item = await step(value)
            except StopAsyncIteration:
                return
            finally:
                otel_context.detach(token)
            try:
                value, step = (yield item), generator.asend
            except GeneratorExit:
                token = otel_context.attach(ctx)
                try:
                    await generator.aclose()
                finally:
                    otel_context.detach(token)
                raise
            except BaseException as exc:
                value, step = exc, generator.athrow
    except GeneratorExit:
        raise
    except BaseException as exc:
        failure = exc
        raise
    finally:
        if attempt is not None:
            await attempt._end_async(failure)


def _record_failure(span: Span, exc: BaseException) -> None:
    """Record ``exc`` on the span; an exception that cannot even be printed is recorded by its type
    only. Nothing raised here may replace the caller's own exception."""
    try:
        span.record_exception(exc)
    except Exception:
        with contextlib.suppress(Exception):
            span.add_event("exception", {"exception.type": type(exc).__qualname__})
    with contextlib.suppress(Exception):
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
