"""The end of a session (``configure(end_sessions=True)``): each router a trajectory reached is told once.

Against the real vLLM router 0.1.17 with its ``sticky_least_loaded`` policy, the one that keeps
per-session bindings and releases them on ``POST /finish_session``: its own log says "SLL: finished
session", and the next request of that session is bound afresh ("SLL: new session" a second time),
which it would not be while the binding held. Dynamo's terminal request is checked byte for byte at a
recording server playing the Dynamo frontend (the ThunderAgent proof is in
``tests/test_thunderagent.py``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator

import aiohttp
import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import otel_session
from otel_session._session_end import BUDGET_SECONDS, NOTICE_DEADLINE_S
from otel_session.dynamo import NVEXT_EXTRA_BODY, LocalDynamo, worker_id_of
from tests import support
from tests.loopback import AsgiServer
from tests.routers import Backend, RouterProcess, backends, router

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


fleet = support.fleet
_fresh_records = support._fresh_records


@pytest.fixture(scope="module")
def sll(fleet: list[Backend]) -> Iterator[RouterProcess]:
    with router("vllm-router", fleet, policy="sticky_least_loaded") as started:
        yield started


def _count(process: RouterProcess, text: str) -> int:
    return process.log_text().count(text)


def _wait_count(process: RouterProcess, text: str, expected: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (found := _count(process, text)) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def _rebind_count(process: RouterProcess, sid: str) -> int:
    """Send one more request of ``sid`` by hand (otel-session off) and count its fresh bindings."""
    otel_session.unconfigure()
    httpx.post(
        process.url + "/v1/chat/completions", json=BODY, headers={"X-Session-ID": sid}
    ).raise_for_status()
    time.sleep(0.2)  # the router logs asynchronously to answering
    return _count(process, f"SLL: new session '{sid}'")


# ----------------------------------------------------------------------------- ways to end a trajectory


def _sync_success(url: str) -> str | None:
    with openai.OpenAI(base_url=url + "/v1", api_key="k") as client, otel_session.trajectory() as traj:
        for _ in range(3):
            client.chat.completions.create(**BODY)  # type: ignore[call-overload]
    return traj.session_id


def _sync_error(url: str) -> str | None:
    holder: list[str | None] = []
    with (
        pytest.raises(KeyError),
        openai.OpenAI(base_url=url + "/v1", api_key="k") as client,
        otel_session.trajectory() as traj,
    ):
        holder.append(traj.session_id)
        client.chat.completions.create(**BODY)  # type: ignore[call-overload]
        raise KeyError("the user's own error")
    return holder[0]


def _sync_decorated(url: str) -> str | None:
    with openai.OpenAI(base_url=url + "/v1", api_key="k") as client:

        @otel_session.trajectory()
        def rollout() -> str | None:
            client.chat.completions.create(**BODY)  # type: ignore[call-overload]
            return otel_session.current_session_id()

        return rollout()


async def _async_success(url: str) -> str | None:
    async with aiohttp.ClientSession() as session, otel_session.trajectory() as traj:
        for _ in range(3):
            async with session.post(url + "/v1/chat/completions", json=BODY) as resp:
                resp.raise_for_status()
    return traj.session_id


async def _async_decorated(url: str) -> str | None:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k") as client:

        @otel_session.trajectory()
        async def rollout() -> str | None:
            await client.chat.completions.create(**BODY)  # type: ignore[call-overload]
            return otel_session.current_session_id()

        return await rollout()


async def _async_cancelled(url: str) -> str | None:
    started = asyncio.Event()
    holder: list[str | None] = []

    async def rollout() -> None:
        async with aiohttp.ClientSession() as session, otel_session.trajectory() as traj:
            holder.append(traj.session_id)
            async with session.post(url + "/v1/chat/completions", json=BODY) as resp:
                resp.raise_for_status()
            started.set()
            await asyncio.sleep(60)  # a tool call that never comes back: the trainer cancels it

    task = asyncio.create_task(rollout())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return holder[0]


SYNC: dict[str, Callable[[str], str | None]] = {
    "sync": _sync_success, "sync-error": _sync_error, "sync-decorator": _sync_decorated,
}  # fmt: skip
ASYNC = {"async": _async_success, "async-decorator": _async_decorated, "async-cancelled": _async_cancelled}


@pytest.mark.parametrize("how", [*SYNC, *ASYNC])
def test_vllm_router_releases_the_session_once_whenever_the_trajectory_ends(
    how: str, sll: RouterProcess
) -> None:
    otel_session.configure(routers={"vllm-router": [sll.authority]}, end_sessions=True)
    began = time.monotonic()
    sid = SYNC[how](sll.url) if how in SYNC else asyncio.run(ASYNC[how](sll.url))
    assert sid is not None
    assert time.monotonic() - began < 10
    finished = f"SLL: finished session '{sid}'"
    assert _wait_count(sll, finished, 1) == 1
    assert _count(sll, f"SLL: new session '{sid}'") == 1
    # Released: the next request of the same ID is a new binding, not the old one.
    assert _rebind_count(sll, sid) == 2
    assert _count(sll, finished) == 1  # told once, not once per turn


def test_without_end_sessions_the_binding_stays(sll: RouterProcess) -> None:
    otel_session.configure(routers={"vllm-router": [sll.authority]})
    sid = _sync_success(sll.url)
    assert sid is not None
    time.sleep(0.3)
    assert _count(sll, f"SLL: finished session '{sid}'") == 0
    assert _rebind_count(sll, sid) == 1  # still bound: no second "new session"


def test_an_adopted_session_is_ended_at_most_once_per_router(sll: RouterProcess) -> None:
    otel_session.configure(routers={"vllm-router": [sll.authority]}, end_sessions=True)
    sid = "gym-episode-4242-adopted"
    with httpx.Client() as client:
        for _ in range(2):  # the same episode adopted by two attempts in a row
            with otel_session.trajectory(session_id=sid):
                client.post(sll.url + "/v1/chat/completions", json=BODY).raise_for_status()
            # Re-entering the enclosing session is not a new session: it ends with the outer one.
            with otel_session.trajectory(session_id=sid), otel_session.trajectory(session_id=sid):
                client.post(sll.url + "/v1/chat/completions", json=BODY).raise_for_status()
    time.sleep(0.3)
    assert _count(sll, f"SLL: finished session '{sid}'") == 1


def test_nested_trajectories_end_their_own_sessions(sll: RouterProcess) -> None:
    otel_session.configure(routers={"vllm-router": [sll.authority]}, end_sessions=True)
    with httpx.Client() as client, otel_session.trajectory() as outer:
        client.post(sll.url + "/v1/chat/completions", json=BODY).raise_for_status()
        with otel_session.trajectory() as inner:
            client.post(sll.url + "/v1/chat/completions", json=BODY).raise_for_status()
        assert _wait_count(sll, f"SLL: finished session '{inner.session_id}'", 1) == 1
        assert _count(sll, f"SLL: finished session '{outer.session_id}'") == 0  # still running
    assert _wait_count(sll, f"SLL: finished session '{outer.session_id}'", 1) == 1


# ----------------------------------------------------------------------------- Dynamo's terminal request


def test_dynamo_gets_one_minimal_final_request_per_session_with_its_parent(fleet: list[Backend]) -> None:
    frontend = fleet[0]  # a recording server playing the Dynamo frontend (it lists model "m")
    otel_session.configure(dynamo_hosts=[frontend.authority], end_sessions=True)
    with (
        openai.OpenAI(base_url=frontend.url + "/v1", api_key="k") as client,
        otel_session.trajectory() as outer,
    ):
        client.chat.completions.create(**BODY)  # type: ignore[call-overload]
        with otel_session.trajectory() as inner:
            for _ in range(2):
                client.chat.completions.create(**BODY)  # type: ignore[call-overload]
        finals_after_inner = [s for s in frontend.completions() if s.get("x-dynamo-session-final")]
    finals = [s for s in frontend.completions() if s.get("x-dynamo-session-final")]
    assert len(finals_after_inner) == 1 and len(finals) == 2
    first, second = finals
    assert (first.get("x-dynamo-session-id"), first.get("x-dynamo-parent-session-id")) == (
        inner.session_id,
        outer.session_id,
    )
    # the outer's parent is its prompt's group, decided by its first request (issue 33, item 5): its
    # end names the same parent as every request of it
    assert outer.parent_session_id is not None
    assert (second.get("x-dynamo-session-id"), second.get("x-dynamo-parent-session-id")) == (
        outer.session_id,
        outer.parent_session_id,
    )
    outers = [s for s in frontend.completions() if s.get("x-dynamo-session-id") == outer.session_id]
    assert {s.get("x-dynamo-parent-session-id") for s in outers} == {outer.parent_session_id}
    for final in finals:
        assert final.get("x-dynamo-session-final") == "true"
        assert final.path == "/v1/chat/completions"
        # Sent by us with its headers set here: nothing of the hooks, the SDK or tracing rides along.
        assert not final.names() & {
            "baggage",
            "traceparent",
            "x-session-id",
            "x-stainless-lang",
            "authorization",
        }
    assert len([s for s in frontend.completions() if not s.get("x-dynamo-session-final")]) == 3


def test_profiles_without_an_end_get_nothing(fleet: list[Backend], sll: RouterProcess) -> None:
    plain = fleet[1]
    with router("smg", fleet) as smg:
        otel_session.configure(
            routers={"smg": [smg.authority], "litellm": [plain.authority], "header:X-My-Key": ["127.0.0.1"]},
            end_sessions=True,
        )
        with httpx.Client() as client, otel_session.trajectory():
            client.post(smg.url + "/v1/chat/completions", json=BODY).raise_for_status()
            client.post(plain.url + "/v1/chat/completions", json=BODY).raise_for_status()
        time.sleep(0.3)
    assert sum(len(b.completions()) for b in fleet) == 2
    assert [s.method for b in fleet for s in b.seen if s.method == "POST"] == ["POST", "POST"]


# ----------------------------------------------------------------------------- bounded, never raising


class _SlowEnds:
    """A router that answers turns at once but takes ``delay`` s over its end-of-session endpoints."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.ends = 0

    async def handle(self, request: Request) -> Response:
        if request.url.path in {"/finish_session", "/v1/models"}:
            self.ends += 1
            await asyncio.sleep(self.delay)
            return JSONResponse({"status": "ok", "data": [{"id": "m"}]})
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]})

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST"])])


@pytest.mark.parametrize("profile", ["vllm-router", "dynamo"])
def test_a_slow_router_delays_the_exit_by_at_most_the_budget(
    profile: str, caplog: pytest.LogCaptureFixture
) -> None:
    slow = _SlowEnds(delay=NOTICE_DEADLINE_S + 0.5)  # slower than a notice may take: it fails
    with AsgiServer(slow.app()) as server:
        otel_session.configure(routers={profile: [server.authority]}, end_sessions=True)
        with httpx.Client() as client:

            async def rollout() -> float:
                async with otel_session.trajectory():
                    (await asyncio.to_thread(client.post, server.url + "/v1/chat/completions", json=BODY))
                    entered_exit = time.monotonic()
                return time.monotonic() - entered_exit

            with caplog.at_level(logging.WARNING, logger="otel_session"):
                async_delay = asyncio.run(rollout())
                with otel_session.trajectory():
                    client.post(server.url + "/v1/chat/completions", json=BODY).raise_for_status()
                    entered_exit = time.monotonic()
                sync_delay = time.monotonic() - entered_exit
                deadline = time.monotonic() + 5
                while not any("could not tell" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, "no warning for the failed end"
                    time.sleep(0.05)
        assert slow.ends >= 2
    for delay in (async_delay, sync_delay):
        assert BUDGET_SECONDS * 0.8 < delay < BUDGET_SECONDS + 0.4
    warnings = [r for r in caplog.records if "could not tell" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()


def test_a_stopped_router_is_one_warning_and_no_delay(caplog: pytest.LogCaptureFixture) -> None:
    with backends(1) as (only,), caplog.at_level(logging.WARNING, logger="otel_session"):
        otel_session.configure(routers={"vllm-router": [only.authority]}, end_sessions=True)
        with httpx.Client() as client:
            for _ in range(3):
                with otel_session.trajectory():
                    client.post(only.url + "/v1/chat/completions", json=BODY).raise_for_status()
                    only.stop()  # gone before the trajectory ends: connection refused
                    entered_exit = time.monotonic()
                assert time.monotonic() - entered_exit < BUDGET_SECONDS
                only.start()  # back on the same port for the next trajectory's turn
    warnings = [r for r in caplog.records if "could not tell" in r.getMessage()]
    assert len(warnings) == 1  # three failed ends, one line: per router, not per session
    assert all("\n" not in r.getMessage() for r in warnings)


def test_a_sync_exit_inside_a_running_event_loop_does_not_block_it() -> None:
    slow = _SlowEnds(delay=2.0)
    with AsgiServer(slow.app()) as server:
        otel_session.configure(routers={"vllm-router": [server.authority]}, end_sessions=True)

        async def rollout() -> float:
            with httpx.Client() as client:
                with otel_session.trajectory():  # a plain `with` in async code
                    client.post(server.url + "/v1/chat/completions", json=BODY).raise_for_status()
                    entered_exit = time.monotonic()
                return time.monotonic() - entered_exit

        # Blocking would wait out the whole budget (the router takes 2 s); half of it leaves a slow
        # machine room.
        assert asyncio.run(rollout()) < BUDGET_SECONDS / 2
        deadline = time.monotonic() + 5
        while slow.ends < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert slow.ends == 1  # it still went out, from its own thread


def test_session_end_threads_are_daemons_and_finish() -> None:
    with backends(1) as (only,):
        otel_session.configure(routers={"vllm-router": [only.authority]}, end_sessions=True)
        with httpx.Client() as client, otel_session.trajectory() as traj:
            client.post(only.url + "/v1/chat/completions", json=BODY).raise_for_status()
        ends = [s for s in only.seen if s.path == "/finish_session"]
        assert len(ends) == 1 and ends[0].method == "POST"
        # Only what the notice sets: nothing of the trajectory rides along on it.
        assert not ends[0].names() & {"x-session-id", "x-dynamo-session-id", "baggage", "traceparent"}
        assert re.fullmatch(r"[0-9a-f-]{36}", traj.session_id or "")
        time.sleep(0.1)
        assert not [t for t in threading.enumerate() if t.name == "otel-session-end"]


def test_the_stock_dynamo_router_runs_the_terminal_request_and_keeps_the_binding(
    dynamo_stack: LocalDynamo,
) -> None:
    """Why ending Dynamo sessions is opt-in: without a lifecycle-aware router the terminal request is
    an ordinary 1-token completion, and the session's binding stays until its idle TTL."""
    log_path = dynamo_stack.frontends[0].log_path
    log_before = len(log_path.read_text(errors="replace"))
    otel_session.configure(dynamo_hosts=dynamo_stack.hosts, end_sessions=True)
    body = {**BODY, "model": dynamo_stack.model_name, "max_tokens": 1, **NVEXT_EXTRA_BODY}
    with httpx.Client(base_url=dynamo_stack.base_url) as client:
        with otel_session.trajectory() as traj:
            served = [worker_id_of(client.post("/chat/completions", json=body).json()) for _ in range(2)]
        assert len(set(served)) == 1 and served[0] is not None
        otel_session.unconfigure()
        headers = {"X-Dynamo-Session-ID": traj.session_id or ""}
        if traj.parent_session_id is not None:  # its prompt's group (issue 33, item 5): Dynamo binds that
            headers["X-Dynamo-Parent-Session-ID"] = traj.parent_session_id
        after = [
            worker_id_of(client.post("/chat/completions", json=body, headers=headers).json())
            for _ in range(3)
        ]
    assert after == served[:1] * 3  # still bound: 4 workers round-robin would have moved it
    new_log = log_path.read_text(errors="replace")[log_before:].splitlines()
    served_chats = [
        line for line in new_log if "http response sent status=200" in line and "chat/completions" in line
    ]
    assert len(served_chats) == 6  # 2 turns + the terminal request, run as a completion + 3 after
