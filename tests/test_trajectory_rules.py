"""The rules of one attempt (``otel_session._trajectory``), in the fast tier and in-process: what
entering gives (session, parent, group, span and its attributes), what leaving releases on every way
out (return, exception, cancellation, a generator closed early, a fork child unwinding), and how each
kind of callable (function, coroutine, generator, async generator, callable object) is one attempt.

Spans are read from a real OpenTelemetry SDK ``TracerProvider`` with an in-memory exporter: the only
stand-in is the tracer lookup (``_tracing.tracer``), which would otherwise start an OTLP export
pipeline per test. Counts are read the way ``test_metrics_rules`` reads them (a recording counter in
place of the API's no-op proxy). Routers are real loopback servers (``tests/recorder.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import inspect
import logging
import os
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import otel_session
from otel_session import (
    PARENT_SESSION_HEADER,
    _faults,
    _fleet,
    _hop,
    _metrics,
    _pacing,
    _siblings,
    _stock,
    _tracing,
    _trajectory,
)
from otel_session._trajectory import as_attempt, trajectory
from tests.loopback import AsgiServer
from tests.recorder import Recorder

SID = "episode-1"
OURS = ("otel_session", "opentelemetry")  # the loggers a test of ours judges (not asyncio's, of other tests)
PROMPT = {"model": "m", "messages": [{"role": "user", "content": "the same prompt for every sibling"}]}


class Spans:
    """Finished spans of an SDK provider that trajectories start their spans on."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def finished(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def one(self) -> ReadableSpan:
        [span] = self.finished()
        return span


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spans]:
    made = Spans()
    monkeypatch.setattr(_tracing, "tracer", lambda: made.provider.get_tracer("test"))
    yield made
    made.provider.shutdown()


class Counted:
    """The ``otel_session.trajectories`` counter's adds."""

    def __init__(self) -> None:
        self.added: list[dict[str, Any]] = []

    def add(self, amount: int, attributes: dict[str, Any]) -> None:
        assert amount == 1
        self.added.append(dict(attributes))


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counted:
    made = Counted()
    monkeypatch.setattr(_metrics, "trajectories", made)
    monkeypatch.setattr(_metrics, "recording", lambda: True)
    return made


STARTED = {"otel_session.trajectory.state": "started"}
ENDED = {"otel_session.trajectory.state": "ended"}


def ended_by(error: str) -> dict[str, str]:
    return {"otel_session.trajectory.state": "ended", "error.type": error}


@pytest.fixture
def configured() -> Iterator[None]:
    otel_session.configure(dynamo_hosts=["dynamo.invalid:1"], siblings="groups:2")
    yield
    otel_session.unconfigure()


@pytest.fixture
def router() -> Iterator[Recorder]:
    with Recorder() as server:
        yield server


def failed_with(span: ReadableSpan, name: str) -> bool:
    return span.status.status_code is StatusCode.ERROR and span.status.description == name


def in_other_context(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` run in a copy of the context as it is now (another task's, as it were)."""
    copied = contextvars.copy_context()
    return lambda: copied.run(call)


# ---- the bare name, and how a trajectory is made ---------------------------------------------------


def test_the_bare_name_says_to_add_parentheses_with_and_async_with() -> None:
    said = "write `with otel_session.trajectory():` (or `async with`), with parentheses"
    with pytest.raises(TypeError) as caught, trajectory:  # type: ignore[attr-defined]
        pass
    assert str(caught.value) == said

    async def use() -> None:
        async with trajectory:  # type: ignore[attr-defined]
            pass

    with pytest.raises(TypeError) as caught:
        asyncio.run(use())
    assert str(caught.value) == said


def test_the_name_alone_on_a_function_decorates_it_and_a_string_alone_is_a_session_id() -> None:
    @trajectory
    def rollout() -> str | None:
        return otel_session.current_session_id()

    first, second = rollout(), rollout()
    assert first and second and first != second and rollout.__name__ == "rollout"
    with trajectory(SID) as traj:
        assert traj.session_id == SID == otel_session.current_session_id()
    with pytest.raises(TypeError, match="session_id must be a str"):
        trajectory(rollout, name="x")  # with keywords, the one argument is the session ID


def test_a_classmethod_or_staticmethod_stays_one_and_a_property_or_class_is_refused() -> None:
    class Agent:
        @trajectory
        @classmethod
        def by_class(cls) -> tuple[type, str | None]:
            return cls, otel_session.current_session_id()

        @trajectory()
        @staticmethod
        def alone() -> str | None:
            return otel_session.current_session_id()

    assert isinstance(Agent.__dict__["by_class"], classmethod)
    assert isinstance(Agent.__dict__["alone"], staticmethod)
    owner, session = Agent.by_class()
    assert owner is Agent and session is not None
    assert Agent.alone() is not None and Agent().alone() != Agent.alone()
    for bad, kind in ((property(lambda self: 1), "property"), (Agent, "class")):
        for make in (lambda b: trajectory(b), lambda b: trajectory()(b)):
            with pytest.raises(TypeError) as caught:
                make(bad)
            assert str(caught.value) == (
                f"trajectory() cannot decorate a {kind}: decorate the function or method that runs one "
                "attempt"
            )


def test_a_group_key_that_cannot_be_hashed_runs_alone_whether_unhashable_or_its_hash_fails(
    configured: None,
) -> None:
    with trajectory(group=["a"]) as traj:
        assert traj.session_id is not None and traj.parent_session_id is None

    class Broken:
        def __hash__(self) -> int:
            raise RuntimeError("no hash today")

    attempt = trajectory(group=Broken())
    with attempt as traj:
        assert traj.session_id is not None and traj.parent_session_id is None
    assert _siblings.open_groups() == 0


# ---- what entering gives --------------------------------------------------------------------------


def test_the_span_carries_the_session_the_indexes_and_the_attributes(spans: Spans, counted: Counted) -> None:
    assert trajectory().span is trace.INVALID_SPAN
    with trajectory(
        SID,
        name="rollout",
        prompt_index=0,
        sibling_index=3,
        attempt=1,
        attributes={"env": "gym", "prompt_index": 9},
    ) as traj:
        assert trace.get_current_span() is traj.span and traj.span.is_recording()
        assert counted.added == [STARTED]
    span = spans.one()
    assert span.name == "rollout"
    assert dict(span.attributes or {}) == {
        "session.id": SID,
        "gen_ai.conversation.id": SID,
        "env": "gym",
        "prompt_index": 9,
        "otel_session.prompt_index": 0,
        "otel_session.sibling_index": 3,
        "otel_session.attempt": 1,
    }
    assert span.status.status_code is StatusCode.UNSET and not span.events
    assert counted.added == [STARTED, ENDED]
    with trajectory():
        pass
    assert spans.finished()[-1].name == "trajectory"
    assert "otel_session.attempt" not in (spans.finished()[-1].attributes or {})


def test_a_nested_attempt_names_the_outer_one_as_parent_in_baggage_and_on_its_span(spans: Spans) -> None:
    with trajectory() as outer:
        with trajectory() as inner:
            assert inner.parent_session_id == outer.session_id != inner.session_id
            assert baggage.get_baggage("session.id") == inner.session_id
            assert baggage.get_baggage("session.parent_id") == outer.session_id
        assert baggage.get_baggage("session.parent_id") is None
    inner_span, outer_span = spans.finished()
    assert (inner_span.attributes or {})["otel_session.parent_session_id"] == outer.session_id
    assert "otel_session.parent_session_id" not in (outer_span.attributes or {})


def test_an_attempts_turn_as_a_parent_is_forgotten_as_it_ends() -> None:
    """Attempts nested in this one named its session as their parent at a router (``_pacing``): the
    turn goes with the attempt, however it ends; another parent's turn stays."""
    here = ("http", "127.0.0.1", 1)
    _pacing.delay(here, "someone else's")
    with pytest.raises(KeyError), trajectory() as outer:
        _pacing.delay(here, outer.session_id)
        assert outer.session_id in _pacing._turns
        raise KeyError("the episode fails")
    assert list(_pacing._turns) == ["someone else's"]


def test_re_entering_a_session_keeps_its_parent_and_adopting_the_grandparent_names_none() -> None:
    with trajectory("top") as top, trajectory("mid") as mid:
        assert mid.parent_session_id == "top"
        with trajectory("mid") as again:
            assert again.parent_session_id == "top"  # the same session, the same parent
            assert baggage.get_baggage("session.parent_id") == "top"
        with trajectory("top") as back:
            assert back.parent_session_id is None  # never a cycle
            assert baggage.get_baggage("session.parent_id") is None
    assert top.parent_session_id is None


def test_one_trajectory_object_runs_one_attempt_at_a_time() -> None:
    attempt = trajectory()
    with attempt:
        with pytest.raises(RuntimeError) as caught:
            attempt.__enter__()
        assert str(caught.value) == "this trajectory is already running; open a new otel_session.trajectory()"
    with attempt as again:  # ended: it may run again, under a new session
        assert again.session_id is not None


def test_a_trajectory_unconfigured_says_so_once_and_still_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_hop, "unconfigured_untold", True)
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        for _ in range(2):
            with trajectory(group="g") as traj:
                assert otel_session.current_session_id() == traj.session_id
                assert traj.parent_session_id is None
    said = [r.getMessage() for r in caplog.records if "not configured" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("otel-session: a trajectory started")
    assert _siblings.open_groups() == 0


def test_a_configured_trajectory_says_nothing_of_configuration_but_checks_the_propagator(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, configured: None
) -> None:
    monkeypatch.setattr(_hop, "unconfigured_untold", True)
    monkeypatch.setattr(_stock, "_leak_warned", [])
    before = propagate.get_global_textmap()
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        with trajectory():
            pass
        assert not caplog.records
        propagate.set_global_textmap(W3CBaggagePropagator())  # the application's, after configure()
        try:
            with trajectory():
                pass
        finally:
            propagate.set_global_textmap(before)
    [line] = [r.getMessage() for r in caplog.records]
    assert "the global propagator includes the stock baggage propagator" in line
    assert _hop.unconfigured_untold is True


def test_a_span_that_cannot_start_costs_the_span_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, counted: Counted
) -> None:
    class Failing:
        def start_span(self, *args: object, **kwargs: object) -> trace.Span:
            raise RuntimeError("the provider is broken")

    monkeypatch.setattr(_tracing, "tracer", Failing)
    monkeypatch.setattr(_faults, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        with trajectory() as traj:
            assert traj.span is trace.INVALID_SPAN and otel_session.current_session_id() == traj.session_id
        with pytest.raises(KeyError), trajectory():
            raise KeyError("x")
    [line] = [r.getMessage() for r in caplog.records if "span" in r.getMessage()]
    assert line.startswith("otel-session: starting a trajectory span failed (RuntimeError)")
    assert counted.added == [STARTED, ENDED, STARTED, ended_by("KeyError")]


# ---- groups -----------------------------------------------------------------------------------------


def test_siblings_of_a_group_open_together_share_a_parent_two_by_two(configured: None) -> None:
    attempts = [trajectory(group="prompt-7") for _ in range(3)]
    enter = [in_other_context(a.__enter__) for a in attempts]
    leave = [in_other_context(lambda a=a: a.__exit__(None, None, None)) for a in attempts]
    for go in enter:
        go()
    first, second, third = (a.parent_session_id for a in attempts)
    assert first is not None and first == second and third not in (None, first)
    assert _siblings.open_groups() == 1
    # an enclosing trajectory wins over the group
    with trajectory() as outer, trajectory(group="prompt-7") as inner:
        assert inner.parent_session_id == outer.session_id
    for go in leave:
        go()
    assert _siblings.open_groups() == 0
    assert [a.parent_session_id for a in attempts] == [first, second, third]  # still known once ended


def test_under_attempt_a_group_names_no_parent() -> None:
    otel_session.configure(dynamo_hosts=["d.invalid:1"], siblings="attempt")
    b = trajectory(group="g")
    in_other_context(b.__enter__)()
    with trajectory(group="g") as a:
        assert a.parent_session_id is None and b.parent_session_id is None
        assert _siblings.open_groups() == 0
    in_other_context(lambda: b.__exit__(None, None, None))()


def test_a_group_is_left_on_an_exception_and_on_a_decorated_call(configured: None) -> None:
    with pytest.raises(ValueError), trajectory(group="g"):
        assert _siblings.open_groups() == 1
        raise ValueError("x")
    assert _siblings.open_groups() == 0

    @trajectory(group="g")
    def rollout() -> int:
        return _siblings.open_groups()

    assert rollout() == 1 and _siblings.open_groups() == 0


def test_without_a_group_the_first_prompt_to_a_router_decides_the_parent(
    router: Recorder, spans: Spans
) -> None:
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{router.port}"], siblings="groups:2")
    attempts = [trajectory() for _ in range(2)]
    for attempt in attempts:
        in_other_context(attempt.__enter__)()
        assert attempt.parent_session_id is None  # not decided before its first request

    def ask(attempt: trajectory) -> None:
        with httpx.Client() as client:
            client.post(f"{router.url}/v1/chat/completions", json=PROMPT)
        assert attempt.parent_session_id is not None

    for attempt in attempts:
        token = otel_context.attach(attempt._context)  # type: ignore[arg-type]
        try:
            ask(attempt)
        finally:
            otel_context.detach(token)
    parents = [seen.get(PARENT_SESSION_HEADER) for seen in router.requests]
    assert parents[0] is not None and parents == [a.parent_session_id for a in attempts]
    assert _siblings.open_groups() == 1
    for attempt in attempts:
        in_other_context(lambda a=attempt: a.__exit__(None, None, None))()
    assert _siblings.open_groups() == 0
    assert [a.parent_session_id for a in attempts] == parents  # kept once the attempt ended
    for span in spans.finished():
        assert (span.attributes or {})["otel_session.parent_session_id"] == parents[0]


def test_a_nested_attempt_never_decides_the_outer_ones_group(router: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{router.port}"], siblings="groups:2")
    with trajectory() as outer:
        with trajectory() as inner, httpx.Client() as client:
            client.post(f"{router.url}/v1/chat/completions", json=PROMPT)
            assert _siblings.open_groups() == 0  # its prompt opened no group: it has its parent
        assert inner.parent_session_id == outer.session_id
        assert outer.parent_session_id is None and _siblings.open_groups() == 0


# ---- what leaving releases --------------------------------------------------------------------------


def test_leaving_on_an_exception_records_it_and_restores_the_context(spans: Spans, counted: Counted) -> None:
    token = otel_context.attach(baggage.set_baggage("user.key", "kept"))
    try:
        before = otel_context.get_current()
        with pytest.raises(KeyError), trajectory():
            raise KeyError("boom")
        assert otel_context.get_current() == before
    finally:
        otel_context.detach(token)
    span = spans.one()
    assert failed_with(span, "KeyError") and span.end_time is not None
    [event] = span.events
    assert event.name == "exception" and (event.attributes or {})["exception.message"] == "'boom'"
    assert counted.added == [STARTED, ended_by("KeyError")]


def test_an_exception_that_cannot_be_printed_is_recorded_by_its_type(spans: Spans) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    with pytest.raises(Unprintable), trajectory():
        raise Unprintable
    span = spans.one()
    [event] = span.events
    assert event.name == "exception"
    assert dict(event.attributes or {}) == {"exception.type": Unprintable.__qualname__}
    assert failed_with(span, "Unprintable")


async def test_cancellation_ends_the_attempt_as_cancelled(spans: Spans, counted: Counted) -> None:
    entered = asyncio.Event()

    async def attempt() -> None:
        async with trajectory():
            entered.set()
            await asyncio.sleep(10)

    before = otel_context.get_current()
    task = asyncio.create_task(attempt())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert otel_context.get_current() == before
    assert failed_with(spans.one(), "CancelledError")
    assert counted.added == [STARTED, ended_by("CancelledError")]


def test_a_fork_child_unwinding_the_attempt_only_detaches(spans: Spans) -> None:
    read, write = os.pipe()
    with trajectory() as traj:
        pid = os.fork()
        if pid == 0:  # the child: leave the attempt as sys.exit() unwinding through the with would
            try:
                traj.__exit__(None, None, None)
                ended = len(spans.finished())
                os.write(write, f"{ended} {otel_session.current_session_id()}".encode())
            finally:
                os._exit(0)
        os.close(write)
        told = os.read(read, 200).decode()
        os.close(read)
        os.waitpid(pid, 0)
    assert told == "0 None"  # the child detached and ended nothing
    assert len(spans.finished()) == 1  # the parent ended its span


# ---- the end of a session ---------------------------------------------------------------------------


def finishes(router: Recorder) -> list[str | None]:
    return [seen.get("x-session-id") for seen in router.requests if seen.path == "/finish_session"]


def test_leaving_tells_each_router_reached_that_the_session_is_over(router: Recorder) -> None:
    otel_session.configure(routers={"vllm-router": [f"127.0.0.1:{router.port}"]}, end_sessions=True)
    with trajectory() as traj, httpx.Client() as client:
        client.get(f"{router.url}/v1/models")
    ends = [seen for seen in router.requests if seen.path == "/finish_session"]
    assert len(ends) == 1 and traj.session_id is not None
    with trajectory():
        pass  # no router reached: none told
    assert len([seen for seen in router.requests if seen.path == "/finish_session"]) == 1


def test_a_re_entered_session_is_ended_by_the_attempt_that_opened_it(router: Recorder) -> None:
    otel_session.configure(routers={"vllm-router": [f"127.0.0.1:{router.port}"]}, end_sessions=True)
    with trajectory(SID), httpx.Client() as client:
        with trajectory(SID):
            client.get(f"{router.url}/v1/models")
        assert not [seen for seen in router.requests if seen.path == "/finish_session"]
    assert len([seen for seen in router.requests if seen.path == "/finish_session"]) == 1


def test_sessions_are_not_ended_while_ending_is_off_or_once_the_router_unpinned_them(
    router: Recorder,
) -> None:
    otel_session.configure(routers={"vllm-router": [f"127.0.0.1:{router.port}"]})
    with trajectory(), httpx.Client() as client:
        client.get(f"{router.url}/v1/models")
    otel_session.configure(routers={"vllm-router": [f"127.0.0.1:{router.port}"]}, end_sessions=True)
    router.fail_next.append(529)  # no room: the session is unpinned, bound nowhere
    with trajectory() as traj, httpx.Client() as client:
        client.get(f"{router.url}/v1/models")
    assert traj.session_id in _hop.unpinned
    assert not [seen for seen in router.requests if seen.path == "/finish_session"]


async def test_async_with_and_async_calls_end_their_sessions_without_blocking(router: Recorder) -> None:
    otel_session.configure(routers={"vllm-router": [f"127.0.0.1:{router.port}"]}, end_sessions=True)
    async with trajectory(), httpx.AsyncClient() as client:
        await client.get(f"{router.url}/v1/models")
    assert len([seen for seen in router.requests if seen.path == "/finish_session"]) == 1

    @trajectory()
    async def rollout() -> None:
        async with httpx.AsyncClient() as client:
            await client.get(f"{router.url}/v1/models")

    await rollout()
    assert len([seen for seen in router.requests if seen.path == "/finish_session"]) == 2
    router.fail_next.append(529)
    async with trajectory(), httpx.AsyncClient() as client:
        await client.get(f"{router.url}/v1/models")
    assert len([seen for seen in router.requests if seen.path == "/finish_session"]) == 2


# ---- each kind of callable as one attempt -----------------------------------------------------------


def test_a_decorated_function_keeps_its_kind_and_name() -> None:
    async def coroutine() -> None: ...

    def generator() -> Iterator[int]:
        yield 1

    async def async_generator() -> AsyncIterator[int]:
        yield 1

    def plain() -> None: ...

    class Callable_:
        async def __call__(self) -> None: ...

    assert inspect.iscoroutinefunction(trajectory()(coroutine))
    assert inspect.isgeneratorfunction(trajectory()(generator))
    assert inspect.isasyncgenfunction(trajectory()(async_generator))
    assert inspect.iscoroutinefunction(trajectory()(Callable_()))
    for func in (coroutine, generator, async_generator, plain):
        wrapped = trajectory()(func)
        assert wrapped.__name__ == func.__name__ and wrapped.__wrapped__ is func
        assert not inspect.iscoroutinefunction(wrapped) or func is coroutine
    assert _trajectory.keeping_kind(plain, lambda a, k: lambda: (None, None, None)) is None  # type: ignore[arg-type,return-value]


def test_a_function_call_is_one_attempt_ending_as_it_returns_or_raises(
    spans: Spans, counted: Counted
) -> None:
    @trajectory(name="call")
    def rollout(x: int, *, y: int = 0) -> tuple[int, str | None]:
        if x < 0:
            raise ValueError("negative")
        return x + y, otel_session.current_session_id()

    total, session = rollout(1, y=2)
    assert total == 3 and session is not None and otel_session.current_session_id() is None
    with pytest.raises(ValueError):
        rollout(-1)
    assert otel_session.current_session_id() is None
    ok, bad = spans.finished()
    assert (ok.attributes or {})["session.id"] == session and ok.status.status_code is StatusCode.UNSET
    assert failed_with(bad, "ValueError")
    assert counted.added == [STARTED, ENDED, STARTED, ended_by("ValueError")]


async def test_a_coroutine_is_awaited_inside_its_attempt(spans: Spans, counted: Counted) -> None:
    @trajectory()
    async def rollout(fail: bool) -> str | None:
        await asyncio.sleep(0)
        if fail:
            raise LookupError("x")
        return otel_session.current_session_id()

    made = rollout(False)
    assert counted.added == []  # nothing starts before it is awaited
    session = await made
    assert session is not None and otel_session.current_session_id() is None
    with pytest.raises(LookupError):
        await rollout(True)
    assert otel_session.current_session_id() is None
    assert counted.added == [STARTED, ENDED, STARTED, ended_by("LookupError")]
    assert failed_with(spans.finished()[1], "LookupError")


def test_a_generator_is_one_attempt_whose_context_is_attached_only_while_it_runs(
    spans: Spans, counted: Counted
) -> None:
    seen: list[object] = []

    @trajectory()
    def rollout() -> Iterator[str | None]:
        got = yield otel_session.current_session_id()
        seen.append(got)
        yield otel_session.current_session_id()
        return "done"

    made = rollout()
    assert counted.added == []  # not iterated yet: no attempt
    first = next(made)
    assert first is not None and otel_session.current_session_id() is None  # the consumer's turn
    assert made.send("sent") == first and seen == ["sent"]
    with pytest.raises(StopIteration) as stop:
        next(made)
    assert stop.value.value == "done"
    assert counted.added == [STARTED, ENDED] and spans.one().status.status_code is StatusCode.UNSET

    def outer() -> Iterator[Any]:
        result = yield from rollout()
        yield result

    assert list(outer())[-1] == "done"


def test_a_generator_gets_what_is_thrown_into_it_and_its_failure_ends_the_attempt(
    spans: Spans, counted: Counted
) -> None:
    @trajectory()
    def rollout() -> Iterator[str]:
        try:
            yield "first"
        except KeyError:
            yield f"caught in {otel_session.current_session_id() is not None}"
        raise ValueError("gave up")

    made = rollout()
    assert next(made) == "first"
    assert made.throw(KeyError("k")) == "caught in True"
    with pytest.raises(ValueError):
        next(made)
    assert failed_with(spans.one(), "ValueError")
    assert counted.added == [STARTED, ended_by("ValueError")]
    assert otel_session.current_session_id() is None


def test_a_generator_closed_early_is_closed_in_its_context_and_ends_the_attempt(
    spans: Spans, counted: Counted
) -> None:
    cleaned: list[str | None] = []

    @trajectory()
    def rollout() -> Iterator[int]:
        try:
            yield 1
            yield 2
        finally:
            cleaned.append(otel_session.current_session_id())

    made = rollout()
    assert next(made) == 1
    made.close()
    assert cleaned[0] is not None and otel_session.current_session_id() is None
    assert spans.one().status.status_code is StatusCode.UNSET
    assert counted.added == [STARTED, ENDED]


async def test_a_decorated_async_generator_passes_on_what_is_sent_and_thrown_and_its_close() -> None:
    """As ``yield from`` does for a generator: a value sent with ``asend``, an exception thrown with
    ``athrow`` and ``aclose`` reach the decorated async generator itself, at once (an ``async for``
    re-yielding its items dropped the first two and left the close to the garbage collector)."""
    got: list[object] = []

    @trajectory()
    async def rollout() -> AsyncIterator[str]:
        try:
            got.append((yield "first"))
            try:
                yield "second"
            except KeyError as exc:
                got.append(exc)
                yield "caught"
            yield "last"
        finally:
            got.append("closed")

    made = rollout()
    assert await made.__anext__() == "first"
    assert await made.asend("sent") == "second" and got == ["sent"]
    thrown = KeyError("k")
    assert await made.athrow(thrown) == "caught" and got[1] is thrown
    await made.aclose()
    assert got[2:] == ["closed"]


async def test_an_async_generator_is_one_attempt_on_every_way_out(spans: Spans, counted: Counted) -> None:
    cleaned: list[str | None] = []

    @trajectory()
    async def rollout(fail: bool) -> AsyncIterator[str | None]:
        try:
            got = yield otel_session.current_session_id()
            yield f"{got} in {otel_session.current_session_id() is not None}"
            try:
                yield "third"
            except KeyError:
                yield "caught"
            if fail:
                raise ValueError("x")
        finally:
            cleaned.append(otel_session.current_session_id())

    made = rollout(False)
    assert counted.added == []
    first = await made.__anext__()
    assert first is not None and otel_session.current_session_id() is None
    assert await made.asend("sent") == "sent in True"
    assert await made.__anext__() == "third"
    assert await made.athrow(KeyError("k")) == "caught"
    with pytest.raises(StopAsyncIteration):
        await made.__anext__()
    assert cleaned == [first] and counted.added == [STARTED, ENDED]

    failing = rollout(True)
    assert await failing.__anext__() is not None
    assert await failing.__anext__() == "None in True"
    assert await failing.__anext__() == "third"
    assert await failing.athrow(KeyError("k")) == "caught"
    with pytest.raises(ValueError):
        await failing.__anext__()
    closed = rollout(False)
    await closed.__anext__()
    await closed.aclose()
    assert cleaned[-1] is not None and otel_session.current_session_id() is None
    statuses = [span.status.status_code for span in spans.finished()]
    assert statuses == [StatusCode.UNSET, StatusCode.ERROR, StatusCode.UNSET]
    assert counted.added == [STARTED, ENDED, STARTED, ended_by("ValueError"), STARTED, ENDED]


# ---- as_attempt: any callable, whatever it returns -------------------------------------------------


async def test_a_plain_function_returning_a_coroutine_or_generator_continues_the_attempt(
    counted: Counted,
) -> None:
    async def later() -> str | None:
        return otel_session.current_session_id()

    def sync_gen() -> Iterator[str | None]:
        yield otel_session.current_session_id()

    async def async_gen() -> AsyncIterator[str | None]:
        yield otel_session.current_session_id()

    template = trajectory()
    awaited = as_attempt(template, lambda: later(), (), {})
    assert counted.added == [STARTED]  # the call ran in the attempt; the coroutine is still to come
    assert await awaited is not None and counted.added == [STARTED, ENDED]
    assert next(iter(as_attempt(template, lambda: sync_gen(), (), {}))) is not None
    items = [item async for item in as_attempt(template, lambda: async_gen(), (), {})]
    assert len(items) == 1 and items[0] is not None
    assert as_attempt(template, lambda x: x * 2, (4,), {}) == 8
    assert counted.added[-2:] == [STARTED, ENDED] and len(counted.added) == 8


def test_arguments_a_coroutine_or_generator_function_refuses_fail_at_the_call(counted: Counted) -> None:
    async def coroutine(a: int) -> None: ...

    def generator(a: int) -> Iterator[None]:
        yield None

    async def async_generator(a: int) -> AsyncIterator[None]:
        yield None

    for func in (coroutine, generator, async_generator):
        with pytest.raises(TypeError, match="argument"):
            as_attempt(trajectory(), func, (), {})
        with pytest.raises(TypeError, match="argument"):
            as_attempt(trajectory(), func, (1, 2), {})
    assert counted.added == []  # no attempt started


def test_a_signature_that_is_not_the_functions_own_never_refuses_a_good_call(counted: Counted) -> None:
    ran: list[int] = []

    async def episode(*args: int) -> int:
        ran.append(len(args))
        return len(args)

    episode.__signature__ = inspect.Signature()  # type: ignore[attr-defined]  # claims no arguments
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert asyncio.run(as_attempt(trajectory(), episode, (1, 2), {})) == 2
        gc.collect()  # the coroutine made to check the arguments was closed, never left unawaited
    assert ran == [2] and counted.added == [STARTED, ENDED]


def test_signatures_are_kept_per_function_a_bound_methods_under_its_function_and_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_trajectory, "_signatures", {})

    class Agent:
        async def episode(self, turns: int) -> int:
            return turns

    assert asyncio.run(as_attempt(trajectory(), Agent().episode, (3,), {})) == 3
    assert list(_trajectory._signatures) == [Agent.episode]
    with pytest.raises(TypeError, match="argument"):
        as_attempt(trajectory(), Agent().episode, (1, 2), {})
    assert list(_trajectory._signatures) == [Agent.episode]

    def make(i: int) -> Callable[..., Any]:
        async def f() -> int:
            return i

        return f

    made = [make(i) for i in range(_trajectory.SIGNATURES_KEPT)]
    for func in made[1:]:
        _trajectory._signature_of(func, ())
    assert len(_trajectory._signatures) == _trajectory.SIGNATURES_KEPT == 256
    _trajectory._signature_of(made[0], ())
    assert list(_trajectory._signatures) == [made[0]]  # full: forgotten, then this one kept


def test_a_method_with_its_own_signature_is_bound_as_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_trajectory, "_signatures", {})

    class Agent:
        async def episode(self, turns: int) -> int:
            return turns

    bound = Agent().episode
    wrapped = functools.wraps(bound)(lambda turns: bound(turns))
    signature, args = _trajectory._signature_of(wrapped, (3,))
    assert args == (3,) and signature is not None and list(signature.parameters) == ["turns"]
    signature, args = _trajectory._signature_of(bound, (3,))
    assert (
        args == (bound.__self__, 3)
        and signature is not None
        and list(signature.parameters) == ["self", "turns"]
    )


def test_an_unhashable_callable_object_is_an_attempt_with_its_signature_made_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_trajectory, "_signatures", {})

    class Rollout:
        __hash__ = None  # type: ignore[assignment]

        def __eq__(self, other: object) -> bool:
            return self is other

        async def __call__(self, turns: int) -> str | None:
            return otel_session.current_session_id()

    rollout = Rollout()
    assert asyncio.run(as_attempt(trajectory(), rollout, (1,), {})) is not None
    assert _trajectory._signatures == {}
    with pytest.raises(TypeError, match="argument"):
        as_attempt(trajectory(), rollout, (), {})
    assert trajectory()(rollout) is not None and inspect.iscoroutinefunction(trajectory()(rollout))


def test_a_callable_without_a_signature_is_remembered_as_having_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_trajectory, "_signatures", {})
    assert _trajectory._signature_of(min, (1, 2)) == (None, (1, 2))
    assert _trajectory._signatures == {min: None}
    _trajectory._refuse_now(min, (), {})  # nothing to check it against: left to the call itself


# ---- what a nested attempt tells its router, on its first request and at its end -------------------


class DynamoStandIn:
    """A loopback server answering as a Dynamo frontend does where it matters here (``/v1/models``
    lists one model, so a session's end is one terminal request) and recording every request."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.workers = 0  # the instances its /health lists
        self.health_delay = 0.0  # seconds its /health takes to answer

    async def handle(self, request: Request) -> Response:
        await request.body()
        if request.url.path == "/health":
            await asyncio.sleep(self.health_delay)
            listed = [{"endpoint": "generate", "instance_id": 7000 + i} for i in range(self.workers)]
            return JSONResponse({"status": "healthy", "instances": listed})
        self.seen.append((request.method, request.url.path, dict(request.headers)))
        if request.url.path == "/v1/models":
            return JSONResponse({"data": [{"id": "m"}]})
        if request.url.path == "/v1/chat/completions":
            return JSONResponse(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "ok"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
            )
        return JSONResponse({"ok": True})

    def finals(self) -> list[tuple[str | None, str | None]]:
        """(session, parent) of each terminal request."""
        return [
            (headers.get("x-dynamo-session-id"), headers.get("x-dynamo-parent-session-id"))
            for _, path, headers in self.seen
            if headers.get("x-dynamo-session-final") == "true"
        ]


@pytest.fixture
def dynamo() -> Iterator[tuple[DynamoStandIn, AsgiServer]]:
    stand_in = DynamoStandIn()
    app = Starlette(routes=[Route("/{path:path}", stand_in.handle, methods=["GET", "POST"])])
    with AsgiServer(app) as server:
        yield stand_in, server


def test_a_nested_attempt_names_its_parent_on_its_first_request_and_at_its_end(
    dynamo: tuple[DynamoStandIn, AsgiServer],
) -> None:
    stand_in, server = dynamo
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"], end_sessions=True, siblings="attempt")
    with trajectory() as outer, trajectory() as inner, httpx.Client() as client:
        client.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=PROMPT)
    first = next(headers for _, path, headers in stand_in.seen if path == "/v1/chat/completions")
    assert first.get("x-dynamo-session-id") == inner.session_id
    assert first.get("x-dynamo-parent-session-id") == outer.session_id
    assert stand_in.finals() == [(inner.session_id, outer.session_id)]


async def test_an_async_nested_attempt_names_its_parent_at_its_end(
    dynamo: tuple[DynamoStandIn, AsgiServer],
) -> None:
    stand_in, server = dynamo
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"], end_sessions=True, siblings="attempt")
    async with trajectory() as outer, trajectory() as inner, httpx.AsyncClient() as client:
        await client.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=PROMPT)
    assert stand_in.finals() == [(inner.session_id, outer.session_id)]


def test_a_nested_attempt_under_a_withheld_one_still_carries_its_session(
    dynamo: tuple[DynamoStandIn, AsgiServer],
) -> None:
    """Under ``fleet`` an attempt whose group cannot be sized yet goes without its session; one
    opened inside it has a parent (the outer one) and no group to wait for: it carries its own."""
    stand_in, server = dynamo
    stand_in.health_delay = 1.5  # still being read once a first step stops waiting for it (0.5 s)
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"], siblings="fleet")
    with trajectory() as outer, httpx.Client() as client:
        client.post(url, json=PROMPT)
        with trajectory() as inner:
            client.post(url, json=PROMPT)
    sent = [headers for _, path, headers in stand_in.seen if path == "/v1/chat/completions"]
    assert sent[0].get("x-dynamo-session-id") is None  # withheld
    assert sent[1].get("x-dynamo-session-id") == inner.session_id
    assert sent[1].get("x-dynamo-parent-session-id") == outer.session_id


# ---- the span's context, and a span that fails at everything -----------------------------------------


def test_a_span_processor_sees_the_attempts_own_context(spans: Spans) -> None:
    """The README's ``SessionSpanProcessor`` labels each span with the session of the context it
    starts in: for the trajectory span that is the attempt's own, never the enclosing one's."""
    spans.provider.add_span_processor(otel_session.SessionSpanProcessor())
    with trajectory("outer-1"), trajectory("inner-1"):
        pass
    inner, outer = spans.finished()
    assert (inner.attributes or {})["session.id"] == "inner-1"
    assert (outer.attributes or {})["session.id"] == "outer-1"


def test_an_undecided_attempt_puts_no_parent_on_its_span_and_logs_nothing(
    spans: Spans, caplog: pytest.LogCaptureFixture, configured: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_faults, "_reported", set())  # a fault is logged once per process: here, anew
    with caplog.at_level(logging.WARNING), trajectory():
        pass
    assert "otel_session.parent_session_id" not in (spans.one().attributes or {})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(OURS)]


def test_a_span_that_fails_at_everything_never_replaces_the_callers_exception(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Broken(trace.NonRecordingSpan):
        """Stands for a vendor's span whose every call raises (no real SDK span does)."""

        def is_recording(self) -> bool:
            return True

        def record_exception(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("record_exception")

        def add_event(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("add_event")

        def set_status(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("set_status")

    class Tracer:
        def start_span(self, *args: object, **kwargs: object) -> trace.Span:
            return Broken(trace.INVALID_SPAN_CONTEXT)

    monkeypatch.setattr(_tracing, "tracer", Tracer)
    with pytest.raises(KeyError, match="mine"), trajectory():
        raise KeyError("mine")
    assert otel_session.current_session_id() is None


# ---- arguments refused at the call, with the function's own words ------------------------------------


def own_error(func: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    with pytest.raises(TypeError) as caught:
        made = func(*args, **kwargs)
        made.close()  # never reached: the call itself raises
    return str(caught.value)


def test_each_refused_call_raises_what_the_function_itself_raises(counted: Counted) -> None:
    async def coroutine(a: int) -> None: ...

    def generator(a: int) -> Iterator[None]:
        yield None

    async def async_generator(a: int) -> AsyncIterator[None]:
        yield None

    async def nothing() -> None: ...

    def nothing_gen() -> Iterator[None]:
        yield None

    async def nothing_async_gen() -> AsyncIterator[None]:
        yield None

    calls: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
    for func in (coroutine, generator, async_generator):
        calls += [(func, (), {}), (func, (1, 2), {}), (func, (1,), {"b": 2})]
    for func in (nothing, nothing_gen, nothing_async_gen):
        calls += [(func, (1,), {}), (func, (), {"x": 1})]
    for func, args, kwargs in calls:
        said = own_error(func, *args, **kwargs)
        with pytest.raises(TypeError) as caught:
            as_attempt(trajectory(), func, args, kwargs)
        assert str(caught.value) == said
    assert counted.added == []


def test_a_coroutine_made_only_to_check_arguments_is_closed(counted: Counted) -> None:
    ran: list[int] = []

    async def episode(*args: int, **kwargs: int) -> int:
        ran.append(len(args) + len(kwargs))
        return len(args) + len(kwargs)

    episode.__signature__ = inspect.Signature()  # type: ignore[attr-defined]  # claims no arguments
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert asyncio.run(as_attempt(trajectory(), episode, (1, 2), {"k": 3})) == 3
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert ran == [3] and counted.added == [STARTED, ENDED]


async def test_a_coroutine_generator_or_async_generator_function_is_one_attempt_when_called_as_one(
    counted: Counted,
) -> None:
    async def coroutine(a: int) -> tuple[int, str | None]:
        return a, otel_session.current_session_id()

    def generator(a: int) -> Iterator[tuple[int, str | None]]:
        yield a, otel_session.current_session_id()

    async def async_generator(a: int) -> AsyncIterator[tuple[int, str | None]]:
        yield a, otel_session.current_session_id()

    got = [await as_attempt(trajectory(), coroutine, (1,), {})]
    got += list(as_attempt(trajectory(), generator, (2,), {}))
    got += [item async for item in as_attempt(trajectory(), async_generator, (3,), {})]
    assert [a for a, _ in got] == [1, 2, 3] and None not in [s for _, s in got]
    assert len({s for _, s in got}) == 3 and counted.added == [STARTED, ENDED] * 3


def test_a_sync_callable_that_is_no_function_is_called_as_it_is() -> None:
    class Agent:
        def act(self, x: int) -> str | None:
            return otel_session.current_session_id()

    assert as_attempt(trajectory(), min, (3, 1), {}) == 1
    assert as_attempt(trajectory(), Agent().act, (1,), {}) is not None
    assert not inspect.iscoroutinefunction(trajectory()(Agent().act))


def test_a_signature_is_made_once_per_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_trajectory, "_signatures", {})
    made: list[object] = []
    signature = inspect.signature

    def counting(func: Any, *args: Any, **kwargs: Any) -> inspect.Signature:
        made.append(func)
        return signature(func, *args, **kwargs)

    async def episode(turns: int) -> int:
        return turns

    monkeypatch.setattr(inspect, "signature", counting)
    for turns in range(3):
        assert asyncio.run(as_attempt(trajectory(), episode, (turns,), {})) == turns
    assert made == [episode]


def test_a_bound_method_whose_function_has_a_signature_of_its_own_is_bound_as_called(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``__signature__`` (set by a decorator, say) is the callable's as called: no instance first."""
    monkeypatch.setattr(_trajectory, "_signatures", {})

    class Agent:
        async def episode(self, turns: int) -> int:
            return turns

    Agent.episode.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("turns", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    )
    agent = Agent()
    signature, args = _trajectory._signature_of(agent.episode, (3,))
    assert args == (3,) and signature is not None
    assert asyncio.run(as_attempt(trajectory(), agent.episode, (3,), {})) == 3


def test_a_copy_for_one_call_keeps_the_templates_attributes_and_takes_its_group(
    spans: Spans, configured: None
) -> None:
    template = trajectory(name="boundary", attributes={"a": 1})
    copy = template._fresh({"b": 2}, group="g")
    same = template._fresh(group="g")
    enter_same = in_other_context(same.__enter__)
    copy.__enter__()
    enter_same()
    assert copy.parent_session_id is not None and copy.parent_session_id == same.parent_session_id
    copy.__exit__(None, None, None)
    in_other_context(lambda: same.__exit__(None, None, None))()
    assert template._fresh()._group is None
    first = spans.finished()[0]
    assert first.name == "boundary" and {"a": 1, "b": 2}.items() <= dict(first.attributes or {}).items()


def test_a_decorated_call_leaves_no_context_behind_and_logs_nothing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_hop, "unconfigured_untold", False)  # that once-a-process line is said above

    @trajectory()
    def rollout() -> str | None:
        return otel_session.current_session_id()

    before = otel_context.get_current()
    with caplog.at_level(logging.DEBUG):
        assert rollout() is not None
    assert otel_context.get_current() is before
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(OURS)]


def test_an_attempt_not_yet_entered_has_no_session_and_no_parent() -> None:
    attempt = trajectory(group="g")
    assert attempt.session_id is None and attempt.parent_session_id is None


# ---- groups sized to the fleet --------------------------------------------------------------------


def wait_for_fleet(workers: int) -> None:
    deadline = time.monotonic() + 10
    while _fleet.largest() != workers:
        assert time.monotonic() < deadline, "the router's /health was never read"
        time.sleep(0.01)


def one_step(group: str, siblings: int, url: str | None = None) -> list[trajectory]:
    """``siblings`` attempts of ``group`` open together (each sending one request to ``url``, if
    given), then all ended: one step of a run."""
    attempts = [trajectory(group=group) for _ in range(siblings)]
    for attempt in attempts:
        in_other_context(attempt.__enter__)()
        if url is not None:
            token = otel_context.attach(attempt._context)  # type: ignore[arg-type]
            try:
                with httpx.Client() as client:
                    client.post(url, json=PROMPT)
            finally:
                otel_context.detach(token)
    for attempt in attempts:
        in_other_context(lambda a=attempt: a.__exit__(None, None, None))()
    return attempts


def test_under_auto_a_named_group_is_sized_as_it_opens_to_the_largest_fleet_read(
    dynamo: tuple[DynamoStandIn, AsgiServer],
) -> None:
    stand_in, server = dynamo
    stand_in.workers = 4
    # a trusted host may carry the parent on in baggage: a named group is decided as it opens
    otel_session.configure(
        dynamo_hosts=[f"127.0.0.1:{server.port}"], trusted_hosts=["127.0.0.9"], siblings="auto"
    )
    _fleet.size_at(("http", "127.0.0.1", server.port))
    wait_for_fleet(4)
    first = one_step("step-1", 4)  # no step seen yet: two by two
    assert len({a.parent_session_id for a in first}) == 2 and None not in {a.parent_session_id for a in first}
    second = one_step("step-2", 4, f"http://127.0.0.1:{server.port}/v1/chat/completions")
    assert [a.parent_session_id for a in second] == [None] * 4  # 1 group of 4 on 4 workers: each alone
    assert _siblings.last_shape() == (1, 4)  # each attempt counted once, though it sent a request


def test_under_auto_a_named_group_with_no_trusted_host_is_decided_at_its_first_request(
    dynamo: tuple[DynamoStandIn, AsgiServer],
) -> None:
    """Before any step has ended and with no trusted host to carry the parent on, a named group
    waits for its first request to a router, where an async step gathers (``_gathering``)."""
    stand_in, server = dynamo
    stand_in.workers = 4
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"], siblings="auto")
    first = one_step("step-1", 4)
    assert [a.parent_session_id for a in first] == [None] * 4  # nothing decided at the opening
    assert not _siblings.step_seen() and _siblings.open_groups() == 0


def test_under_fleet_the_group_given_wins_over_each_attempts_prompt(
    dynamo: tuple[DynamoStandIn, AsgiServer],
) -> None:
    stand_in, server = dynamo
    stand_in.workers = 1
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"], siblings="fleet")

    def step(group: str) -> list[trajectory]:
        attempts = [trajectory(group=group) for _ in range(2)]
        for index, attempt in enumerate(attempts):
            in_other_context(attempt.__enter__)()
            token = otel_context.attach(attempt._context)  # type: ignore[arg-type]
            try:
                with httpx.Client() as client:
                    client.post(
                        url, json={"model": "m", "messages": [{"role": "user", "content": str(index)}]}
                    )
            finally:
                otel_context.detach(token)
        for attempt in attempts:
            in_other_context(lambda a=attempt: a.__exit__(None, None, None))()
        return attempts

    step("step-1")  # the fleet's size read, and one step seen: 1 group of 2
    wait_for_fleet(1)
    stand_in.seen.clear()
    attempts = step("step-2")
    parents = {a.parent_session_id for a in attempts}
    assert len(parents) == 1 and None not in parents  # one group, though their prompts differ
    sent = [
        h.get("x-dynamo-parent-session-id") for _, path, h in stand_in.seen if path.endswith("completions")
    ]
    assert sent == [attempts[0].parent_session_id] * 2


def test_a_nested_attempt_under_a_withheld_one_has_its_turns_judged(
    dynamo: tuple[DynamoStandIn, AsgiServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its session goes to the router (above), so its turns are evidence of affinity: the outer
    attempt's withheld group is not the nested one's."""
    import openai

    stand_in, server = dynamo
    stand_in.health_delay = 1.5  # unknown when the gathering gives up (0.5 s): the outer attempt is withheld
    turns: list[dict[str, Any]] = []
    monkeypatch.setattr(_metrics, "recording", lambda: True)
    monkeypatch.setattr(_metrics, "turns", type("Turns", (), {"add": lambda self, n, a: turns.append(a)})())
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"], siblings="fleet")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
    with trajectory():
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "outer"}])
        assert turns == []  # withheld: its turns say nothing of affinity
        with trajectory():
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "inner"}])
    client.close()
    assert len(turns) == 1


# ---- attempts ended out of order on one thread -------------------------------------------------------


def _open(stack: list[Any], group: str | None = None) -> str:
    attempt = trajectory(group=group)
    stack.append(attempt)
    attempt.__enter__()
    assert attempt.session_id is not None
    return attempt.session_id


def test_attempts_ended_out_of_order_leave_the_thread_where_it_was(
    configured: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Episodes on one thread each in its own ExitStack end in any order: the thread is inside the
    innermost attempt still open, and outside all of them once all ended (never in an ended one);
    no detach fails on the way (OpenTelemetry logs one that does)."""

    def run() -> None:
        opened: list[Any] = []
        a, b, c = _open(opened), _open(opened), _open(opened)
        assert otel_session.current_session_id() == c
        opened[1].__exit__(None, None, None)  # b ends under c, which is still open
        assert otel_session.current_session_id() == c
        opened[0].__exit__(None, None, None)  # a too
        assert otel_session.current_session_id() == c
        opened[2].__exit__(None, None, None)  # c: the ended ones under it go with it
        assert otel_session.current_session_id() is None and a != b
        x, y = _open(opened), _open(opened)
        opened[3].__exit__(None, None, None)
        assert otel_session.current_session_id() == y
        opened[4].__exit__(None, None, None)
        assert otel_session.current_session_id() is None and x != y
        z = _open(opened)  # in order, as ever
        inner = _open(opened)
        opened[6].__exit__(None, None, None)
        assert otel_session.current_session_id() == z != inner
        opened[5].__exit__(None, None, None)
        assert otel_session.current_session_id() is None

    with caplog.at_level(logging.DEBUG):
        contextvars.copy_context().run(run)
    assert otel_session.current_session_id() is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(OURS)]


def test_attempts_of_two_groups_open_at_once_name_their_own_groups_parent() -> None:
    otel_session.configure(dynamo_hosts=["dynamo.invalid:1"], siblings="prompt")
    opened = []
    for group in ("g1", "g1", "g2"):  # side by side, each in a context of its own (not nested)
        attempt, where = trajectory(group=group), contextvars.copy_context()
        where.run(attempt.__enter__)
        opened.append((attempt, where))
    a, b, c = (attempt.parent_session_id for attempt, _ in opened)
    assert a is not None and a == b and c not in (None, a)
    for attempt, where in opened:
        where.run(attempt.__exit__, None, None, None)
    assert _siblings.open_groups() == 0


def test_an_attempt_ended_under_a_context_not_an_attempts_detaches_at_once(configured: None) -> None:
    """Only another open attempt on top defers an attempt's detach: a context the application
    attached on top (not an attempt's) is detached with it, as it always was."""

    def run() -> None:
        attempt = trajectory()
        attempt.__enter__()
        otel_context.attach(otel_context.Context())  # not an attempt's, never detached by the app
        attempt.__exit__(None, None, None)
        assert otel_session.current_session_id() is None
        assert otel_context.get_current() == otel_context.Context()

    contextvars.copy_context().run(run)


def test_an_unhashable_group_runs_alone_and_is_not_read_from_its_prompt(router: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[router.url], siblings="prompt")
    body = {"model": "m", "messages": [{"role": "user", "content": "same"}]}
    parents = []
    for key in (["a"], ["a"], None, None):
        with trajectory(group=key) as attempt:
            httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=10)
            parents.append(attempt.parent_session_id)
    assert parents[:2] == [None, None]  # no group, and none read from the prompt either
    assert None not in parents[2:]  # plain attempts: their group read from the prompt
