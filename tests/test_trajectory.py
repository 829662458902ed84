"""trajectory(): one fresh ID per attempt, adoption rules, and exact restoration of the context."""

from __future__ import annotations

import asyncio
import inspect
import json
import multiprocessing
import subprocess
import sys
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from opentelemetry import baggage, context, trace

import otel_session
from otel_session import _hop, _trajectory
from tests.otlp_receiver import OtlpHttpReceiver


def test_each_attempt_mints_a_canonical_uuid4() -> None:
    ids = set()
    for _ in range(100):
        with otel_session.trajectory() as traj:
            assert traj.session_id is not None
            assert str(uuid.UUID(traj.session_id)) == traj.session_id
            assert uuid.UUID(traj.session_id).version == 4
            assert otel_session.current_session_id() == traj.session_id
            ids.add(traj.session_id)
    assert len(ids) == 100
    assert otel_session.current_session_id() is None


def test_minted_ids_are_uuid4s_with_every_random_bit_drawn() -> None:
    """What ``str(uuid.uuid4())`` gives, bit for bit: version 4, the RFC 4122 variant, and the other
    122 bits random (each seen both set and clear over 2,000 IDs: a bit stuck either way fails)."""
    ones, zeros = 0, 0
    for _ in range(2000):
        with otel_session.trajectory() as traj:
            assert traj.session_id is not None
            parsed = uuid.UUID(traj.session_id)
            assert str(parsed) == traj.session_id and len(traj.session_id) == 36
            assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
            ones |= parsed.int
            zeros |= ~parsed.int & (1 << 128) - 1
    fixed = 0xF << 76 | 0x3 << 62  # the version nibble and the two variant bits
    assert ones & ~fixed == zeros & ~fixed == (1 << 128) - 1 & ~fixed


def _mint_in_child(count: int, out: multiprocessing.SimpleQueue[list[str]]) -> None:
    ids = []
    for _ in range(count):
        with otel_session.trajectory() as traj:
            ids.append(traj.session_id)
    out.put(ids)


def test_a_forked_child_never_mints_its_parents_ids() -> None:
    """IDs are drawn in batches: a child forked with part of a batch left must not hand it out too."""
    with otel_session.trajectory():
        pass  # the parent now holds drawn IDs it has not handed out
    fork = multiprocessing.get_context("fork")
    out: multiprocessing.SimpleQueue[list[str]] = fork.SimpleQueue()
    children = [fork.Process(target=_mint_in_child, args=(100, out)) for _ in range(2)]
    for child in children:
        child.start()
    theirs = [out.get() for _ in children]
    for child in children:
        child.join(timeout=30)
        assert child.exitcode == 0
    mine = []
    for _ in range(100):
        with otel_session.trajectory() as traj:
            mine.append(traj.session_id)
    everyone = mine + theirs[0] + theirs[1]
    assert len(set(everyone)) == len(everyone) == 300


# Forks Python does not see, or sees late, each in a process of its own (a fork hook cannot be
# taken back): C code forking (uWSGI's workers, by default), and a fork hook registered before
# otel-session's that opens a trajectory in the child before ours ran.
FORKS_UNSEEN = {
    "forked-in-c": """
        import ctypes
        fork = ctypes.CDLL(None).fork
    """,
    "hook-runs-first": """
        import os
        def _early() -> None:
            import otel_session
            with otel_session.trajectory() as traj:
                early.append(traj.session_id)
        early = []
        os.register_at_fork(after_in_child=_early)
        fork = os.fork
    """,
}
FORK_SCRIPT = """
    import json, os, sys
    {how}
    import otel_session
    with otel_session.trajectory():
        pass  # a batch of IDs drawn, most not handed out yet
    read, write = os.pipe()
    pid = fork()
    ids = []
    for _ in range(20):
        with otel_session.trajectory() as traj:
            ids.append(traj.session_id)
    if pid == 0:
        os.write(write, json.dumps(ids + early if "early" in globals() else ids).encode())
        os._exit(0)
    os.close(write)
    theirs = json.loads(os.read(read, 1 << 16).decode())
    os.waitpid(pid, 0)
    print(json.dumps([ids, theirs]))
"""


@pytest.mark.parametrize("how", sorted(FORKS_UNSEEN))
def test_a_child_forked_where_python_does_not_see_it_never_mints_its_parents_ids(how: str) -> None:
    script = textwrap.dedent(FORK_SCRIPT).format(how=textwrap.dedent(FORKS_UNSEEN[how]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    mine, theirs = json.loads(done.stdout)
    assert len(theirs) >= 20 and len(set(mine + theirs)) == len(mine) + len(theirs)


def test_ids_minted_by_many_threads_at_once_are_all_distinct() -> None:
    def mint(_: int) -> list[str]:
        ids = []
        for _ in range(500):
            with otel_session.trajectory() as traj:
                assert traj.session_id is not None
                ids.append(traj.session_id)
        return ids

    with ThreadPoolExecutor(8) as pool:
        everyone = [session for ids in pool.map(mint, range(8)) for session in ids]
    assert len(set(everyone)) == len(everyone) == 4000


@pytest.mark.parametrize("tracing", [False, True], ids=["tracing-off", "tracing-on"])
def test_what_a_trajectory_offers_its_requests_is_what_its_context_holds(
    tracing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offer remembered as a trajectory starts (so its first request need not read it back) is
    the one read from its context: plain, nested, adopted, under a caller's baggage and span."""
    receiver = OtlpHttpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    otel_session.configure(dynamo_hosts=["dynamo:8000"], tracing=tracing)
    caller_span = trace.NonRecordingSpan(
        trace.SpanContext(0x1F, 0x2F, is_remote=False, trace_flags=trace.TraceFlags(1))
    )
    token = context.attach(trace.set_span_in_context(caller_span, baggage.set_baggage("user.key", "kept")))
    try:
        with otel_session.trajectory() as outer:
            checks = [_hop.current()]
            with otel_session.trajectory():
                checks.append(_hop.current())
                with otel_session.trajectory(session_id=outer.session_id):
                    checks.append(_hop.current())
        for now in checks:
            assert now is not None
            offer = now.offer
            assert offer == _hop.offer_for(now.context, now.settings.tracing)
            assert dict(offer.baggage)["user.key"] == "kept"
            assert now.watched == (now.settings.tracing or offer.traceparent is not None)
            assert offer.traceparent is not None  # the caller's span (local), or the trajectory's
        # re-entering the outer one inside the inner one: its own session, no parent (never a cycle)
        assert [now.offer.parent for now in checks if now] == [None, outer.session_id, None]
    finally:
        context.detach(token)
        otel_session.unconfigure()
        receiver.close()


def test_leaving_restores_the_previous_context_exactly_also_on_error() -> None:
    token = context.attach(baggage.set_baggage("user.key", "kept"))
    try:
        before = context.get_current()
        with pytest.raises(KeyError), otel_session.trajectory():
            assert baggage.get_baggage("user.key") == "kept"  # the caller's baggage stays visible
            raise KeyError("boom")
        assert context.get_current() == before
    finally:
        context.detach(token)


async def test_cancellation_restores_the_context() -> None:
    entered = asyncio.Event()

    async def attempt() -> None:
        async with otel_session.trajectory():
            entered.set()
            await asyncio.sleep(10)

    before = context.get_current()
    task = asyncio.create_task(attempt())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert context.get_current() == before
    assert otel_session.current_session_id() is None


def test_adopted_id_is_used_as_is_and_nested_adoption_of_the_same_id_is_no_nesting() -> None:
    gym_uuid = str(uuid.uuid4())
    with otel_session.trajectory(session_id=gym_uuid) as traj:
        assert traj.session_id == gym_uuid
        with otel_session.trajectory(session_id=gym_uuid) as again:
            assert again.parent_session_id is None


@pytest.mark.parametrize("bad", ["", "a b", "x" * 257, "caf\u00e9", "line\nbreak", "tab\t", "\x00"])
def test_an_unusable_adopted_id_is_a_clear_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="session_id"):
        otel_session.trajectory(session_id=bad)


def test_longest_and_shortest_adoptable_ids() -> None:
    for good in ("x", "~" * 256, "episode-7:turn=3"):
        with otel_session.trajectory(session_id=good) as traj:
            assert traj.session_id == good


def test_nested_trajectory_has_its_own_id_and_knows_its_parent() -> None:
    with otel_session.trajectory() as outer:
        with otel_session.trajectory() as inner:
            assert inner.session_id != outer.session_id
            assert inner.parent_session_id == outer.session_id
            assert otel_session.current_session_id() == inner.session_id
        assert otel_session.current_session_id() == outer.session_id
        assert baggage.get_baggage("session.parent_id") is None


def test_decorator_gives_every_call_a_new_attempt() -> None:
    @otel_session.trajectory()
    def rollout() -> str | None:
        return otel_session.current_session_id()

    first, second = rollout(), rollout()
    assert first and second and first != second


async def test_async_decorator_runs_concurrent_calls_apart() -> None:
    @otel_session.trajectory()
    async def rollout() -> str | None:
        sid = otel_session.current_session_id()
        await asyncio.sleep(0.01)
        assert otel_session.current_session_id() == sid
        return sid

    ids = await asyncio.gather(*(rollout() for _ in range(50)))
    assert len(set(ids)) == 50 and None not in ids


def test_one_trajectory_object_cannot_be_entered_twice_at_once() -> None:
    traj = otel_session.trajectory()
    with traj, pytest.raises(RuntimeError, match="already running"), traj:
        pass


def test_the_span_is_non_recording_while_tracing_is_off() -> None:
    with otel_session.trajectory() as traj:
        assert not traj.span.is_recording()
        assert not trace.get_current_span().get_span_context().is_valid


def test_a_callable_given_as_session_id_is_refused_by_name() -> None:
    for wrong in (uuid.uuid4, str, lambda: "id"):
        with pytest.raises(TypeError, match="session_id must be a str"):
            otel_session.trajectory(session_id=wrong)  # type: ignore[arg-type]


def test_the_bare_name_as_a_context_manager_says_to_add_parentheses() -> None:
    with pytest.raises(TypeError, match=r"with otel_session\.trajectory\(\):"), otel_session.trajectory:  # type: ignore[attr-defined]
        pass

    async def use() -> None:
        async with otel_session.trajectory:  # type: ignore[attr-defined]
            pass

    with pytest.raises(TypeError, match=r"\(or `async with`\)"):
        asyncio.run(use())
    assert otel_session.current_session_id() is None


def test_a_boundarys_signature_is_made_once_per_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """A boundary (``as_attempt``: named functions, framework presets, a callable object) checks the
    arguments at the call, since a coroutine binds them when called, from a signature made once per
    function: ``inspect.signature`` costs more than the rest of starting an attempt."""
    made: list[object] = []
    signature = inspect.signature

    def counting(func: Any, *args: Any, **kwargs: Any) -> inspect.Signature:
        made.append(func)
        return signature(func, *args, **kwargs)

    class Agent:
        async def episode(self, turns: int) -> str | None:
            return otel_session.current_session_id()

    class Rollout:
        async def __call__(self, turns: int) -> str | None:
            return otel_session.current_session_id()

    template, rollout = otel_session.trajectory(), Rollout()
    monkeypatch.setattr(inspect, "signature", counting)
    for _ in range(3):
        assert asyncio.run(_trajectory.as_attempt(template, rollout, (1,), {})) is not None
        episode = Agent().episode  # a new instance, a new bound method, one function
        assert asyncio.run(_trajectory.as_attempt(template, episode, (1,), {})) is not None
    assert len(made) == 2, made
    with pytest.raises(TypeError, match="argument"):
        _trajectory.as_attempt(template, rollout, (), {})  # still refused at the call, by the function
    with pytest.raises(TypeError, match="argument"):
        _trajectory.as_attempt(template, Agent().episode, (1, 2), {})
