"""Siblings with zero code (issue 33, item 5): attempts whose first request to a router carries the
same prompt name a common parent as ``configure(siblings=...)`` says, with a plain ``trajectory()``,
through httpx, the openai SDK and aiohttp, over loopback to a recording Dynamo host. The prompt's
digest stays in the process; a body that cannot be read cheaply names no group and fails nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER, _prompts
from otel_session._siblings import open_groups
from tests.recorder import Recorder

Send = Callable[[str, int, list[dict[str, str]]], Awaitable[None]]  # (base url, turn, messages)


def _chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]


async def _httpx_send(client: Any, url: str, turn: int, messages: list[dict[str, str]]) -> None:
    answer = await client.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": messages})
    answer.raise_for_status()


def _step(dynamo: Recorder, prompts: list[str], client: str, turns: int = 2) -> list[dict[str, Any]]:
    """One GRPO step: an attempt per entry of ``prompts`` (siblings repeat a prompt), all open at
    once, each a plain ``trajectory()`` of ``turns`` chat requests through ``client``; what each
    request carried, by attempt index."""
    barrier = asyncio.Barrier(len(prompts))

    async def attempt(index: int, prompt: str) -> None:
        messages = _chat(prompt)
        async with otel_session.trajectory(), _client(client) as send:
            for turn in range(turns):
                await send(f"{dynamo.url}/a{index}", turn, messages)
                messages = [*messages, {"role": "assistant", "content": f"turn {turn}"}]
                if turn == 0:
                    await barrier.wait()  # every sibling open (and decided) before any ends

    async def step() -> None:
        await asyncio.gather(*(attempt(i, p) for i, p in enumerate(prompts)))

    asyncio.run(step())
    return [
        {
            "attempt": int(seen.path.split("/")[1][1:]),
            "session": seen.get(SESSION_HEADER),
            "parent": seen.get(PARENT_SESSION_HEADER),
            "headers": seen.headers,
        }
        for seen in dynamo.requests
    ]


class _client:
    """An async context giving ``send(url, turn, messages)`` through one real client library."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.closing: Callable[[], Awaitable[Any]] | None = None

    async def __aenter__(self) -> Send:
        if self.kind == "httpx":
            client = httpx.AsyncClient(timeout=10)
            self.closing = client.aclose
            return lambda url, turn, messages: _httpx_send(client, url, turn, messages)
        if self.kind == "openai":
            clients: dict[str, openai.AsyncOpenAI] = {}

            async def send(url: str, turn: int, messages: list[dict[str, str]]) -> None:
                if url not in clients:
                    clients[url] = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
                await clients[url].chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]

            async def close() -> None:
                for each in clients.values():
                    await each.close()

            self.closing = close
            return send
        session = aiohttp.ClientSession()
        self.closing = session.close

        async def post(url: str, turn: int, messages: list[dict[str, str]]) -> None:
            body = {"model": "m", "messages": messages}
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                await r.read()

        return post

    async def __aexit__(self, *exc: object) -> None:
        if self.closing is not None:
            await self.closing()


def _per_attempt(seen: list[dict[str, Any]]) -> dict[int, tuple[str, str | None]]:
    attempts: dict[int, set[tuple[str, str | None]]] = {}
    for request in seen:
        attempts.setdefault(request["attempt"], set()).add((request["session"], request["parent"]))
    assert all(len(carried) == 1 for carried in attempts.values()), attempts  # every turn the same
    return {key: next(iter(carried)) for key, carried in attempts.items()}


@pytest.mark.parametrize("client", ["httpx", "openai", "aiohttp"])
def test_siblings_of_one_prompt_pair_up_under_a_parent_with_a_plain_trajectory(
    dynamo: Recorder, client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_SESSION_SIBLINGS", raising=False)
    otel_session.configure(dynamo_hosts=[dynamo.url])  # the default: groups:2
    prompts = ["two plus two?"] * 4 + ["name a color"] * 2 + ["alone"]
    seen = _step(dynamo, prompts, client)
    assert len(seen) == 14
    attempts = _per_attempt(seen)
    sessions = [session for session, _ in attempts.values()]
    assert len(set(sessions)) == 7 and None not in sessions
    first = Counter(attempts[i][1] for i in range(4))
    assert None not in first and sorted(first.values()) == [2, 2]
    second = {attempts[4][1], attempts[5][1]}
    assert len(second) == 1 and None not in second and not second & set(first)
    alone = attempts[6][1]
    assert alone is not None and alone not in first and alone not in second
    assert not {parent for _, parent in attempts.values()} & set(sessions)
    assert open_groups() == 0  # every group forgotten once its last attempt ended
    digests = {_prompts.key_of(json.dumps({"model": "m", "messages": _chat(p)}).encode()) for p in prompts}
    assert None not in digests and len(digests) == 3
    sent = json.dumps([request["headers"] for request in seen])
    assert not any(digest[1] in sent for digest in digests if digest)  # the digest is never sent


def test_the_prompt_policy_puts_every_sibling_under_one_parent(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")
    attempts = _per_attempt(_step(dynamo, ["p"] * 4 + ["q"] * 2, "httpx"))
    assert len({attempts[i][1] for i in range(4)}) == 1
    assert len({attempts[i][1] for i in (4, 5)}) == 1 and attempts[0][1] != attempts[4][1]


def test_the_attempt_policy_names_no_parent(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="attempt")
    attempts = _per_attempt(_step(dynamo, ["p"] * 4, "httpx"))
    assert {parent for _, parent in attempts.values()} == {None}


def test_an_explicit_group_wins_over_the_prompt(dynamo: Recorder) -> None:
    """Four attempts of one prompt, in two explicit groups of two, under ``prompt``: each explicit
    group has its own parent, where the prompt alone would have put all four under one."""
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")

    async def attempt(index: int) -> str | None:
        async with otel_session.trajectory(group=f"g{index % 2}") as traj, httpx.AsyncClient() as client:
            await _httpx_send(client, f"{dynamo.url}/a{index}", 0, _chat("same prompt"))
            await asyncio.sleep(0.05)
            return traj.parent_session_id

    async def step() -> list[str | None]:
        return list(await asyncio.gather(*(attempt(i) for i in range(4))))

    parents = asyncio.run(step())
    wire = {int(s.path.split("/")[1][1:]): s.get(PARENT_SESSION_HEADER) for s in dynamo.requests}
    assert [wire[i] for i in range(4)] == parents
    assert parents[0] == parents[2] != parents[1] == parents[3] and None not in parents


def test_the_first_router_request_decides_for_the_whole_attempt(dynamo: Recorder, gym: Recorder) -> None:
    """A first request with no prompt (a GET) decides: no group, and the attempt's later requests
    with a prompt carry no parent either. A trusted host's request before it decides nothing."""
    otel_session.configure(dynamo_hosts=[dynamo.url], trusted_hosts=[gym.url], siblings="prompt")
    with otel_session.trajectory(), httpx.Client(timeout=10) as client:
        client.post(f"{gym.url}/env", json={"messages": _chat("p")})
        client.get(f"{dynamo.url}/v1/models")
        client.post(f"{dynamo.url}/v1/chat/completions", json={"model": "m", "messages": _chat("p")})
    with otel_session.trajectory(), httpx.Client(timeout=10) as client:
        client.post(f"{gym.url}/env", json={"messages": _chat("p")})
        client.post(f"{dynamo.url}/v1/chat/completions", json={"model": "m", "messages": _chat("p")})
        client.get(f"{dynamo.url}/v1/models")
    first, second, third, fourth = dynamo.requests
    assert first.get(PARENT_SESSION_HEADER) is None and second.get(PARENT_SESSION_HEADER) is None
    assert third.get(PARENT_SESSION_HEADER) is not None
    assert fourth.get(PARENT_SESSION_HEADER) == third.get(PARENT_SESSION_HEADER)
    assert open_groups() == 0


@pytest.mark.parametrize("field", ["prompt", "input"])
def test_completions_and_responses_prompts_group_too(dynamo: Recorder, field: str) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")

    async def attempt(index: int, text: str) -> None:
        async with otel_session.trajectory(), httpx.AsyncClient() as client:
            await client.post(f"{dynamo.url}/a{index}", json={"model": "m", field: text})
            await asyncio.sleep(0.05)

    async def step() -> None:
        await asyncio.gather(*(attempt(i, t) for i, t in enumerate(["x", "x", "y"])))

    asyncio.run(step())
    wire = {int(s.path.split("/")[1][1:]): s.get(PARENT_SESSION_HEADER) for s in dynamo.requests}
    assert wire[0] == wire[1] != wire[2] and None not in wire.values()


def _stream() -> Iterator[bytes]:
    yield json.dumps({"model": "m", "messages": _chat("streamed")}).encode()


async def _astream() -> AsyncIterator[bytes]:
    yield json.dumps({"model": "m", "messages": _chat("streamed")}).encode()


HUGE = json.dumps({"model": "m", "messages": _chat("x" * (_prompts.MAX_BODY + 10))}).encode()
BODIES: dict[str, Callable[[], Any]] = {
    "not-json": lambda: b"\xff\xfe not json {",
    "json-without-prompt": lambda: b'{"model": "m"}',
    "json-list": lambda: b"[1, 2, 3]",
    "prompt-of-a-bad-kind": lambda: b'{"messages": 5}',
    "empty-prompt": lambda: b'{"messages": []}',
    "deeply-nested": lambda: b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "stream": _stream,
    "huge": lambda: HUGE,
}


@pytest.mark.parametrize("body", sorted(BODIES))
def test_a_body_that_cannot_be_read_cheaply_names_no_group_and_fails_nothing(
    dynamo: Recorder, body: str, caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")
    with caplog.at_level(logging.DEBUG, logger="otel_session"):
        for _ in range(2):
            with otel_session.trajectory(), httpx.Client(timeout=30) as client:
                assert client.post(f"{dynamo.url}/x", content=BODIES[body]()).status_code == 200
    assert [s.get(PARENT_SESSION_HEADER) for s in dynamo.requests] == [None, None]
    assert all(s.get(SESSION_HEADER) for s in dynamo.requests)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "otel_session"]
    assert open_groups() == 0


@pytest.mark.parametrize("body", ["stream", "not-json", "form"])
def test_an_aiohttp_body_that_cannot_be_read_cheaply_names_no_group(
    dynamo: Recorder, body: str, caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")

    async def attempt() -> None:
        data: Any = {"stream": _astream(), "not-json": b"{not json", "form": {"messages": "x"}}[body]
        async with (
            otel_session.trajectory(),
            aiohttp.ClientSession() as session,
            session.post(f"{dynamo.url}/x", data=data) as answer,
        ):
            assert answer.status == 200

    async def step() -> None:
        await asyncio.gather(attempt(), attempt())

    with caplog.at_level(logging.DEBUG, logger="otel_session"):
        asyncio.run(step())
    assert [s.get(PARENT_SESSION_HEADER) for s in dynamo.requests] == [None, None]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "otel_session"]


def test_the_attempt_names_the_parent_its_first_request_decided(dynamo: Recorder) -> None:
    """``trajectory.parent_session_id`` is the decided parent once the first request to a router
    went (and stays after the attempt: the session's end notice is sent with it)."""
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")
    body = {"model": "m", "messages": _chat("p")}
    with otel_session.trajectory() as attempt, httpx.Client(timeout=10) as client:
        assert attempt.parent_session_id is None  # nothing sent yet: nothing decided
        client.post(f"{dynamo.url}/v1/chat/completions", json=body)
        during = attempt.parent_session_id
    (seen,) = dynamo.requests
    assert during is not None and seen.get(PARENT_SESSION_HEADER) == during
    assert attempt.parent_session_id == during and open_groups() == 0
