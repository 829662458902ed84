"""What otel-session does beside a framework's own session header (docs/integrations.md, per framework).

SkyRL and verifiers send ``X-Session-ID``, slime ``X-SMG-Routing-Key``. Real httpx and aiohttp requests
from inside a trajectory to loopback recording servers configured as a Dynamo host, a vLLM router and
an SGLang gateway: the framework's header always arrives as it set it; where the router's own header
is a different one (Dynamo's ``X-Dynamo-Session-ID``), ours is added beside it, and Dynamo reads ours
first; where it is the same header, the framework's is the one sent.
"""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import httpx
import pytest

import otel_session
from tests.recorder import Recorder, Seen


@pytest.fixture
def routers() -> Iterator[tuple[Recorder, Recorder, Recorder]]:
    with Recorder() as dynamo, Recorder(host="127.0.0.2") as vllm_router, Recorder(host="127.0.0.3") as smg:
        otel_session.configure(
            dynamo_hosts=[dynamo.authority],
            routers={"vllm-router": [vllm_router.authority], "smg": [smg.authority]},
        )
        yield dynamo, vllm_router, smg


async def _send(client: str, url: str, headers: dict[str, str]) -> None:
    if client == "httpx":
        async with httpx.AsyncClient() as http:
            (await http.post(f"{url}/v1/chat/completions", json={}, headers=headers)).raise_for_status()
    else:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/chat/completions", json={}, headers=headers) as answer,
        ):
            answer.raise_for_status()


def _ours(seen: Seen) -> dict[str, str]:
    return {k.lower(): v for k, v in seen.headers if k.lower().startswith(("x-", "baggage", "traceparent"))}


@pytest.mark.parametrize("client", ["httpx", "aiohttp"])
async def test_a_frameworks_own_session_header_arrives_as_set(
    client: str, routers: tuple[Recorder, Recorder, Recorder]
) -> None:
    dynamo, vllm_router, smg = routers
    with otel_session.trajectory() as attempt:
        await _send(client, dynamo.url, {"X-Session-ID": "skyrl-7_0"})  # SkyRL, verifiers
        await _send(client, vllm_router.url, {"X-Session-ID": "skyrl-7_0"})
        await _send(client, smg.url, {"X-SMG-Routing-Key": "slime-7"})  # slime
        await _send(client, vllm_router.url, {})
    assert _ours(dynamo.requests[0]) == {
        "x-session-id": "skyrl-7_0",
        "x-dynamo-session-id": attempt.session_id,
    }
    assert [_ours(seen) for seen in vllm_router.requests] == [
        {"x-session-id": "skyrl-7_0"},  # the same header as the router's: the framework's is the one sent
        {"x-session-id": attempt.session_id},
    ]
    assert _ours(smg.requests[0]) == {"x-smg-routing-key": "slime-7"}


async def test_outside_any_trajectory_nothing_is_added_to_a_frameworks_header(
    routers: tuple[Recorder, Recorder, Recorder],
) -> None:
    dynamo, _, _ = routers
    await _send("httpx", dynamo.url, {"X-Session-ID": "skyrl-7_0"})
    assert _ours(dynamo.requests[0]) == {"x-session-id": "skyrl-7_0"}
