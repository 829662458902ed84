"""Availability over affinity: a session its router refuses for want of room goes on unpinned.

The router here is a stand-in for a Dynamo 1.6.1 frontend whose affinity table is full: it answers a
request carrying ``X-Dynamo-Session-ID`` with Dynamo's own 529 body (as ``benchmarks/capacity.py``
recorded it from the real frontend, ``benchmarks/results/capacity-hard.json``) and serves one
without it, which is what the real frontend does then. The real table holds 65,536 bindings,
compiled in with no flag to shrink it, and takes minutes to fill on this machine, so a test cannot
fill it. The clients are real: the openai SDK with its own retries, and an aiohttp loop of three
attempts like NeMo-RL's ``DynamoGeneration._post_completion_request``; otel-session sends nothing of
its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

import otel_session
from otel_session import _evidence, _hop
from otel_session.dynamo import LocalDynamo
from tests.gym_servers import AiohttpServer
from tests.support import TABLE_FULL_BODY, DynamoProxy, metric_delta, metric_points, metrics_reader

FULL_TABLE = TABLE_FULL_BODY  # Dynamo 1.6.1
WARNING = "answered 529"
MESSAGES: Any = [{"role": "user", "content": "hi"}]
COMPLETION = {
    "id": "c",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
}


class FullTable:
    """A frontend whose affinity table is full: 529 to a session, 200 to a request without one."""

    def __init__(self) -> None:
        self.sessions: list[str | None] = []
        self.server: AiohttpServer | None = None

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        session = request.headers.get("x-dynamo-session-id")
        self.sessions.append(session)
        if session is not None:
            return web.Response(status=529, text=FULL_TABLE, content_type="application/json")
        return web.json_response(COMPLETION)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    @property
    def base_url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}/v1"


@pytest.fixture
def frontend(caplog: pytest.LogCaptureFixture) -> Iterator[FullTable]:
    metrics_reader()
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    served = FullTable()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", served.chat)
    app.router.add_get("/v1/models", served.models)
    with AiohttpServer(app) as server:
        served.server = server
        otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"])
        yield served
    _evidence.forget()


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


def _ask_openai(frontend: FullTable, retries: int = 2) -> Any:
    client = openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=retries)
    try:
        return client.chat.completions.create(model="m", messages=MESSAGES)
    finally:
        client.close()


async def _post_completion_request(frontend: FullTable) -> dict[str, Any]:
    """NeMo-RL's loop: three attempts, retrying 408, 429 and 5xx, a new session per call."""
    last = ""
    for _ in range(3):
        async with aiohttp.ClientSession() as session:
            url = f"{frontend.base_url}/chat/completions"
            async with session.post(url, json={"model": "m", "messages": MESSAGES}) as reply:
                if reply.status in (408, 429) or reply.status >= 500:
                    last = f"{reply.status} {await reply.text()}"
                    await asyncio.sleep(0.01)
                    continue
                data: dict[str, Any] = await reply.json()
                return data
    raise RuntimeError(f"3 attempts failed: {last}")


def test_the_openai_sdk_retry_goes_unpinned_and_succeeds(
    frontend: FullTable, caplog: pytest.LogCaptureFixture
) -> None:
    before = metric_points()
    with otel_session.trajectory() as attempt:
        answer = _ask_openai(frontend)
        assert answer.choices[0].message.content == "hi"
        assert frontend.sessions == [attempt.session_id, None]  # the SDK's own retry, without the pin
        _ask_openai(frontend, retries=0)  # the rest of the attempt stays unpinned: no 529 again
    assert frontend.sessions[2:] == [None]
    said = _said(caplog)
    assert len(said) == 1
    assert "without the pin" in said[0] and "65,536" in said[0] and "per second x TTL" in said[0]
    assert "OTEL_SESSION_STRICT_AFFINITY" in said[0]
    assert metric_delta(before, "otel_session.unpinned_sessions") == 1
    with otel_session.trajectory() as second:  # a new attempt asks for a binding again
        _ask_openai(frontend)
    assert frontend.sessions[3:] == [second.session_id, None]
    assert len(_said(caplog)) == 1  # one line per router per process
    assert metric_delta(before, "otel_session.unpinned_sessions") == 2


def test_an_aiohttp_retry_loop_goes_unpinned_and_succeeds(frontend: FullTable) -> None:
    async def rollout() -> tuple[str, dict[str, Any]]:
        async with otel_session.trajectory() as attempt:
            return attempt.session_id, await _post_completion_request(frontend)

    session, answer = asyncio.run(rollout())
    assert answer["choices"][0]["message"]["content"] == "hi"
    assert frontend.sessions == [session, None]


@pytest.mark.parametrize("how", ["argument", "variable"])
def test_strict_affinity_keeps_the_error(
    frontend: FullTable, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    before = metric_points()
    if how == "argument":
        otel_session.configure(dynamo_hosts=[frontend.base_url.split("/")[2]], strict_affinity=True)
    else:
        monkeypatch.setenv("OTEL_SESSION_STRICT_AFFINITY", "true")
        otel_session.configure(dynamo_hosts=[frontend.base_url.split("/")[2]])
    with otel_session.trajectory() as attempt, pytest.raises(openai.APIStatusError) as raised:
        _ask_openai(frontend)
    assert raised.value.status_code == 529
    assert frontend.sessions == [attempt.session_id] * 3
    with pytest.raises(RuntimeError, match="529"):
        asyncio.run(_strict_aiohttp(frontend))
    said = _said(caplog)
    assert len(said) == 1 and "keeps such sessions pinned" in said[0]
    assert metric_delta(before, "otel_session.unpinned_sessions") == 0


async def _strict_aiohttp(frontend: FullTable) -> None:
    async with otel_session.trajectory():
        await _post_completion_request(frontend)


def test_an_unpinned_session_is_not_ended_at_the_router(frontend: FullTable) -> None:
    """Ending a session (end_sessions) tells a router to let its binding go: a session it refused has
    none, and the notice, carrying the session, would only be refused again."""
    otel_session.configure(dynamo_hosts=[frontend.base_url.split("/")[2]], end_sessions=True)
    with otel_session.trajectory() as attempt:
        _ask_openai(frontend)
    assert frontend.sessions == [attempt.session_id, None]  # no third request: no final notice


def test_unpinned_sessions_are_bounded() -> None:
    _hop.unpinned.clear()
    for index in range(_hop.UNPINNED_KEPT + 10):
        _hop.unpin(f"s{index}")
    assert len(_hop.unpinned) == _hop.UNPINNED_KEPT and "s0" not in _hop.unpinned
    assert not _hop.unpin(f"s{_hop.UNPINNED_KEPT}")
    _hop.unpinned.clear()


def test_unconfigure_forgets_the_evidence_and_the_unpinned_sessions(
    frontend: FullTable, caplog: pytest.LogCaptureFixture
) -> None:
    authority = frontend.base_url.split("/")[2]
    with otel_session.trajectory() as attempt:
        _ask_openai(frontend)
        assert _evidence.summaries() and attempt.session_id in _hop.unpinned
        otel_session.unconfigure()
        assert _evidence.summaries() == {} and not _hop.unpinned
        otel_session.configure(dynamo_hosts=[authority])
        _ask_openai(frontend)  # a new configuration: pinned again, refused again, unpinned again
    assert frontend.sessions == [attempt.session_id, None, attempt.session_id, None]
    assert len(_said(caplog)) == 2  # "once per router per process" starts again, like every warning


@pytest.mark.slow
def test_in_front_of_the_real_dynamo_the_unpinned_retry_is_served(
    dynamo_stack: LocalDynamo, caplog: pytest.LogCaptureFixture
) -> None:
    """The stand-in answers only what a full table answers (529 to a session); every request without
    the header reaches the real Dynamo 1.6.1 frontend and its mocker workers, and is answered there."""
    caplog.set_level(logging.WARNING, "otel_session")
    _evidence.forget()
    with DynamoProxy(f"http://{dynamo_stack.host}", table_full=True) as proxy:
        otel_session.configure(dynamo_hosts=[proxy.authority])
        client = openai.OpenAI(base_url=f"http://{proxy.authority}/v1", api_key="unused", max_retries=2)
        with otel_session.trajectory() as attempt:
            answer = client.chat.completions.create(
                model=dynamo_stack.model_name, messages=MESSAGES, max_tokens=4
            )
        client.close()
        assert answer.choices and answer.usage is not None
        chats = [r for r in proxy.requests if r.path.endswith("/chat/completions")]
        assert [(r.header("x-dynamo-session-id"), r.status) for r in chats] == [
            (attempt.session_id, 529),
            (None, 200),
        ]

        async def rollout() -> dict[str, Any]:
            async with otel_session.trajectory():
                url = f"http://{proxy.authority}/v1"
                for _ in range(3):  # NeMo-RL's _post_completion_request: 3 attempts on 5xx
                    async with aiohttp.ClientSession() as session:
                        body = {"model": dynamo_stack.model_name, "messages": MESSAGES, "max_tokens": 4}
                        async with session.post(f"{url}/chat/completions", json=body) as reply:
                            if reply.status >= 500:
                                continue
                            data: dict[str, Any] = await reply.json()
                            return data
            raise RuntimeError("3 attempts failed")

        assert asyncio.run(rollout())["choices"]
        chats = [r for r in proxy.requests if r.path.endswith("/chat/completions")]
        assert [r.status for r in chats[2:]] == [529, 200] and chats[3].header("x-dynamo-session-id") is None
    _evidence.forget()
