"""Who receives what, through every real client, over loopback (the destination table of the core)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER
from tests.clients import CLIENTS, send
from tests.recorder import Recorder

pytestmark = pytest.mark.parametrize("kind", CLIENTS)


def _is_uuid4(value: str | None) -> bool:
    return (
        value is not None
        and len(value) == 36
        and str(uuid.UUID(value)) == value
        and uuid.UUID(value).version == 4
    )


async def test_every_turn_carries_the_attempts_one_id(kind: str, dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory() as traj:
        for _ in range(4):
            await send(kind, dynamo.url)
    seen = [r.get(SESSION_HEADER) for r in dynamo.requests]
    assert len(seen) == 4
    assert set(seen) == {traj.session_id}
    assert _is_uuid4(traj.session_id)


async def test_other_hosts_get_exactly_what_they_get_without_otel_session(
    kind: str, dynamo: Recorder, other: Recorder
) -> None:
    await send(kind, other.url, headers={"Authorization": "Bearer x"})
    baseline = other.requests[-1].headers
    otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=["gym.internal"])
    with otel_session.trajectory():
        await send(kind, other.url, headers={"Authorization": "Bearer x"})
    assert _comparable(other.requests[-1].headers) == _comparable(baseline)


def _comparable(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    # Only per-process values differ between two otherwise identical requests: openai's retry timeout
    # and id headers, and the content length of a body that is the same.
    varying = {"x-stainless-read-timeout", "x-stainless-retry-count"}
    return [(k, v) for k, v in headers if k.lower() not in varying]


async def test_dynamo_gets_the_session_trusted_gets_baggage_nobody_gets_traceparent(
    kind: str, dynamo: Recorder, gym: Recorder, other: Recorder
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[gym.url])
    with otel_session.trajectory() as traj:
        for server in (dynamo, gym, other):
            await send(kind, server.url)
    to_dynamo, to_gym, to_other = dynamo.requests[-1], gym.requests[-1], other.requests[-1]
    assert to_dynamo.get(SESSION_HEADER) == traj.session_id
    assert "baggage" not in to_dynamo.names()
    assert to_gym.get("baggage") == f"session.id={traj.session_id}"
    assert SESSION_HEADER.lower() not in to_gym.names()
    assert not {SESSION_HEADER.lower(), "baggage", "traceparent"} & to_other.names()
    assert "traceparent" not in to_dynamo.names() | to_gym.names()  # tracing is off


async def test_nothing_outside_a_trajectory(kind: str, dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    await send(kind, dynamo.url)
    assert not {SESSION_HEADER.lower(), "baggage", "traceparent"} & dynamo.requests[-1].names()


async def test_redirect_from_dynamo_to_another_host_carries_nothing(
    kind: str, dynamo: Recorder, other: Recorder
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    dynamo.redirect_to = other.url
    with otel_session.trajectory() as traj:
        await send(kind, dynamo.url, path="/r/v1")
    assert dynamo.requests[-1].get(SESSION_HEADER) == traj.session_id  # the first hop had it
    assert other.requests[-1].path == "/v1/chat/completions"  # the redirect was followed
    assert not {SESSION_HEADER.lower(), "baggage", "traceparent"} & other.requests[-1].names()


async def test_redirect_between_dynamo_hosts_keeps_the_session(kind: str, dynamo: Recorder) -> None:
    with Recorder() as second:
        otel_session.configure(dynamo_hosts=[dynamo.authority, second.authority])
        dynamo.redirect_to = second.url
        with otel_session.trajectory() as traj:
            await send(kind, dynamo.url, path="/r/v1")
        assert second.requests[-1].get(SESSION_HEADER) == traj.session_id


async def test_a_header_set_by_hand_is_left_as_the_caller_set_it(
    kind: str, dynamo: Recorder, other: Recorder
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory():
        await send(kind, dynamo.url, headers={SESSION_HEADER: "my-own-id"})
        await send(kind, other.url, headers={SESSION_HEADER: "my-own-id"})
    assert dynamo.requests[-1].get(SESSION_HEADER) == "my-own-id"
    assert other.requests[-1].get(SESSION_HEADER) == "my-own-id"


async def test_nested_trajectory_sends_its_own_id_and_the_parent(kind: str, dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory() as outer:
        with otel_session.trajectory() as inner:
            await send(kind, dynamo.url)
        await send(kind, dynamo.url)
    nested, after = dynamo.requests[-2], dynamo.requests[-1]
    assert nested.get(SESSION_HEADER) == inner.session_id != outer.session_id
    assert nested.get(PARENT_SESSION_HEADER) == outer.session_id
    assert after.get(SESSION_HEADER) == outer.session_id
    # the outer's own first request names its prompt's group (issue 33, item 5), never the inner
    assert after.get(PARENT_SESSION_HEADER) not in (None, inner.session_id, outer.session_id)


async def test_a_retried_attempt_gets_a_new_id(kind: str, dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    ids = []
    for _ in range(3):  # the whole attempt run again, as a trajectory-level retry does
        with otel_session.trajectory():
            await send(kind, dynamo.url)
            await send(kind, dynamo.url)
    ids = [r.get(SESSION_HEADER) for r in dynamo.requests]
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[4] == ids[5]
    assert len({ids[0], ids[2], ids[4]}) == 3


async def test_concurrent_trajectories_never_see_each_others_id(kind: str, dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])

    async def attempt(i: int) -> str:
        async with otel_session.trajectory() as traj:
            for _ in range(2):
                await send(kind, dynamo.url, headers={"X-Tag": f"{i}"})
                await asyncio.sleep(0)
            assert otel_session.current_session_id() == traj.session_id
            return traj.session_id  # type: ignore[return-value]

    ids = await asyncio.gather(*(attempt(i) for i in range(9)))
    assert len(set(ids)) == 9
    for request in dynamo.requests:
        assert request.get(SESSION_HEADER) == ids[int(request.get("X-Tag") or -1)]
