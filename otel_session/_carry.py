"""Carrying a trajectory where ``contextvars`` do not follow: thread pools, threads, other processes.

``ThreadPoolExecutor.submit`` and ``threading.Thread`` start from an empty context, and a Ray task runs
in another process; without help their requests would carry no session. ``bind`` copies the context
afresh for every call (one copy entered twice at once is an error), and a carrier is a plain dict of
strings that pickles anywhere.

A process is a case of its own. A raw ``os.fork()`` child is a copy of its parent at that instant,
context included, as OpenTelemetry's own context survives a fork: code that forks to do the
trajectory's own work (a sandbox, a tool run) keeps its session. A multiprocessing worker (``Process``,
``Pool``, ``ProcessPoolExecutor``) does other work than the code that started it: a pool whose workers
fork inside trajectory A would send A's session for all its later work, submitted from trajectory B
or from none. Its workers therefore start outside any trajectory, whatever the start method (spawn and
forkserver start from a fresh context anyway), and continue one only where they are handed it
(``bind``, or ``session_carrier`` and ``resume``).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any, ParamSpec, TypeVar, cast

import wrapt
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_session import _faults, _hop, _settings
from otel_session._context import (
    HOP_KEY,
    PARENT_KEY,
    ROUTER_VISITS_KEY,
    SESSION_KEY,
    session_ids,
    with_session,
)
from otel_session._ids import is_valid_session_id
from otel_session._trajectory import continued, keeping_kind

_P = ParamSpec("_P")
_R = TypeVar("_R")
_tracecontext = TraceContextTextMapPropagator()


def bind(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Make ``func`` run in the caller's current context, wherever it is later called.

    ``pool.submit(otel_session.bind(work), x)`` keeps the trajectory's session in the pool thread.
    A coroutine function, generator function or async generator function (or a function returning
    one of those) keeps it where its body runs: awaited or iterated later, on another thread or loop,
    as ``trajectory()`` does for them.
    """
    captured = contextvars.copy_context()
    ctx = otel_context.get_current()
    kept = keeping_kind(
        func, lambda args, kwargs: lambda: (None, ctx, captured.copy().run(func, *args, **kwargs))
    )
    if kept is not None:
        return cast(Callable[_P, _R], kept)

    @functools.wraps(func)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        result = captured.copy().run(func, *args, **kwargs)
        later = continued(None, ctx, result)  # ``lambda: step()``: the coroutine it returns, too
        return cast(_R, later) if later is not None else result

    return run


def session_carrier() -> dict[str, str]:
    """The current session (and trace parent, when tracing) as a picklable dict of strings.

    Pass it to a Ray task or actor method and open ``otel_session.resume(carrier)`` there.
    """
    carrier: dict[str, str] = {}
    session, parent = session_ids()
    if session is not None:
        carrier[SESSION_KEY] = session
        if parent is not None:
            carrier[PARENT_KEY] = parent
    _tracecontext.inject(carrier)
    return carrier


@contextmanager
def resume(carrier: Mapping[str, Any] | None) -> Iterator[str | None]:
    """Continue, in this thread or process, the trajectory that ``session_carrier()`` described.

    It is the same attempt, so the same session ID, not a new or nested one. A missing or invalid
    carrier leaves the context as it is (and yields ``None``) rather than failing the work.
    """
    session = carrier.get(SESSION_KEY) if isinstance(carrier, Mapping) else None
    if not is_valid_session_id(session):
        yield None
        return
    if _settings.current is None:
        _hop.unconfigured()
    parent = carrier.get(PARENT_KEY) if carrier is not None else None
    strings = {k: v for k, v in carrier.items() if isinstance(k, str) and isinstance(v, str)}  # type: ignore[union-attr]
    try:
        ctx: Context | None = _tracecontext.extract(strings)
    except Exception as exc:  # a trace parent that cannot be read: the session still continues
        _faults.report("reading the trace parent of a session carrier", exc)
        ctx = None
    ctx = with_session(session, parent if is_valid_session_id(parent) and parent != session else None, ctx)  # type: ignore[arg-type]
    token = otel_context.attach(ctx)
    try:
        yield session
    finally:
        otel_context.detach(token)


def _leave_trajectory_in_worker(_: object = None) -> None:
    """multiprocessing's after-fork hook, run in each forked worker before its work: the worker
    starts outside the trajectory the pool was started from."""
    try:
        _hop.forget()
        ctx = otel_context.get_current()
        if session_ids(ctx)[0] is None and ctx.get(ROUTER_VISITS_KEY) is None:
            return
        ctx = baggage.remove_baggage(PARENT_KEY, baggage.remove_baggage(SESSION_KEY, ctx))
        for key in (ROUTER_VISITS_KEY, HOP_KEY):
            ctx = otel_context.set_value(key, None, ctx)
        otel_context.attach(trace.set_span_in_context(trace.INVALID_SPAN, ctx))  # never detached: the
        # child's whole life runs below this point
    except Exception as exc:
        _faults.report("leaving the parent's trajectory in a multiprocessing worker", exc)


def _multiprocessing_imported(util: ModuleType) -> None:
    # Held weakly by multiprocessing, keyed on the function itself, which lives as long as this module.
    util.register_after_fork(_leave_trajectory_in_worker, _leave_trajectory_in_worker)


# Registered when multiprocessing.util is first imported (at once if it is): a process that starts no
# workers never imports it for us.
wrapt.register_post_import_hook(_multiprocessing_imported, "multiprocessing.util")
