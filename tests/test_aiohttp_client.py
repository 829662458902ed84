"""aiohttp as a first-class client (NeMo-Gym and NeMo-RL talk server to server with it).

Real ``aiohttp.ClientSession`` against recording servers on loopback: the session header goes to
Dynamo, baggage to trusted hosts, nothing elsewhere, also across redirects and retry loops.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import aiohttp
import pytest

import otel_session
from tests.recorder import Recorder, Seen

SESSION = "X-Dynamo-Session-ID"
PARENT = "X-Dynamo-Parent-Session-ID"
OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent"}


def _only(server: Recorder, path: str) -> Seen:
    [seen] = [seen for seen in server.requests if seen.path == path]
    return seen


@pytest.fixture
def configured(dynamo: Recorder, gym: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[gym.authority])


@pytest.mark.usefixtures("configured")
async def test_header_to_dynamo_baggage_to_trusted_nothing_elsewhere(
    dynamo: Recorder, gym: Recorder, other: Recorder
) -> None:
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory() as traj:
            for server in (dynamo, gym, other):
                async with http.post(f"{server.url}/in") as reply:
                    assert reply.status == 200
        for server in (dynamo, gym, other):
            async with http.post(f"{server.url}/out") as reply:
                assert reply.status == 200

    at_dynamo = _only(dynamo, "/in")
    assert at_dynamo.get(SESSION) == traj.session_id
    assert not at_dynamo.names() & (OURS - {"x-dynamo-session-id"})
    at_gym = _only(gym, "/in")
    assert at_gym.get("baggage") == f"session.id={traj.session_id}"
    assert not at_gym.names() & (OURS - {"baggage"})
    assert not _only(other, "/in").names() & OURS
    for server in (dynamo, gym, other):
        assert not _only(server, "/out").names() & OURS


@pytest.mark.usefixtures("configured")
async def test_sub_agent_sends_its_parent(dynamo: Recorder, gym: Recorder) -> None:
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory() as outer, otel_session.trajectory() as inner:
            for server in (dynamo, gym):
                async with http.post(f"{server.url}/sub"):
                    pass
    seen = _only(dynamo, "/sub")
    assert (seen.get(SESSION), seen.get(PARENT)) == (inner.session_id, outer.session_id)
    baggage = _only(gym, "/sub").get("baggage") or ""
    assert sorted(baggage.split(",")) == sorted(
        [f"session.id={inner.session_id}", f"session.parent_id={outer.session_id}"]
    )


@pytest.mark.usefixtures("configured")
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_redirect_from_dynamo_to_another_host_carries_nothing(
    dynamo: Recorder, other: Recorder, method: str
) -> None:
    dynamo.redirect_to = other.url  # /r/landing -> other's /landing
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory() as traj, otel_session.trajectory():
            async with http.request(method, f"{dynamo.url}/r/landing") as reply:
                assert reply.status == 200
                assert len(reply.history) == 1
    assert _only(dynamo, "/r/landing").get(SESSION) is not None
    assert traj.session_id is not None
    assert not _only(other, "/landing").names() & OURS


@pytest.mark.usefixtures("configured")
async def test_redirect_between_dynamo_and_trusted_hosts_gives_each_its_own(
    dynamo: Recorder, gym: Recorder
) -> None:
    dynamo.redirect_to, gym.redirect_to = gym.url, dynamo.url
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory() as traj:
            async with http.post(f"{dynamo.url}/r/landing") as reply:
                assert reply.status == 200
            async with http.post(f"{gym.url}/r/landing") as reply:
                assert reply.status == 200
    landed_on_gym = _only(gym, "/landing")
    assert landed_on_gym.get(SESSION) is None
    assert landed_on_gym.get("baggage") == f"session.id={traj.session_id}"
    landed_on_dynamo = _only(dynamo, "/landing")
    assert landed_on_dynamo.get(SESSION) == traj.session_id
    assert landed_on_dynamo.get("baggage") is None


async def _post_with_retries(http: aiohttp.ClientSession, url: str, tries: int = 5) -> int:
    """A retry wrapper in the style of NeMo-Gym's ``_request_with_retries`` (5xx and 429 again)."""
    for _ in range(tries - 1):
        async with http.post(url, json={"try": True}) as reply:
            if reply.status < 500 and reply.status != 429:
                return reply.status
        await asyncio.sleep(0.01)
    async with http.post(url) as reply:
        return reply.status


@pytest.mark.usefixtures("configured")
async def test_retry_loop_keeps_the_id_of_the_first_try(dynamo: Recorder) -> None:
    dynamo.fail_next.extend([503, 429, 500])
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory() as traj:
            assert await _post_with_retries(http, f"{dynamo.url}/v1/chat/completions") == 200
    assert [seen.get(SESSION) for seen in dynamo.requests] == [traj.session_id] * 4


@pytest.mark.usefixtures("configured")
async def test_callers_headers_are_left_as_they_were(dynamo: Recorder, gym: Recorder) -> None:
    defaults = {"X-Team": "rl"}
    per_call = {"Authorization": "Bearer t"}
    async with aiohttp.ClientSession(headers=defaults) as http:
        with otel_session.trajectory():
            for server in (dynamo, gym):
                async with http.post(f"{server.url}/h", headers=per_call):
                    pass
        assert dict(http.headers) == {"X-Team": "rl"}
    assert per_call == {"Authorization": "Bearer t"}
    assert _only(dynamo, "/h").get("authorization") == "Bearer t"
    assert _only(gym, "/h").get("x-team") == "rl"


@pytest.mark.usefixtures("configured")
async def test_an_explicit_session_header_is_not_overwritten(dynamo: Recorder) -> None:
    """A forwarding server that copies the header itself sends exactly what it received."""
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory():
            async with http.post(f"{dynamo.url}/x", headers={SESSION: "forwarded-1"}):
                pass
    assert [value for key, value in _only(dynamo, "/x").headers if key.lower() == "x-dynamo-session-id"] == [
        "forwarded-1"
    ]


@pytest.mark.usefixtures("configured")
async def test_concurrent_trajectories_on_one_client_stay_apart(dynamo: Recorder) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def rollout(index: int) -> tuple[str, str | None]:
            with otel_session.trajectory() as traj:
                for turn in range(3):
                    async with http.post(f"{dynamo.url}/c{index}/t{turn}") as reply:
                        assert reply.status == 200
                    await asyncio.sleep(0)
            return f"/c{index}", traj.session_id

        results = await asyncio.gather(*(rollout(i) for i in range(128)))
    assert len({session for _, session in results}) == 128
    for prefix, session in results:
        seen = [s.get(SESSION) for s in dynamo.requests if s.path.startswith(f"{prefix}/")]
        assert seen == [session] * 3


async def test_unconfigured_sends_nothing(dynamo: Recorder) -> None:
    async with aiohttp.ClientSession() as http:
        with otel_session.trajectory():
            async with http.post(f"{dynamo.url}/u"):
                pass
    assert not _only(dynamo, "/u").names() & OURS


def test_a_send_never_awaited_warns_twice_as_documented(dynamo: Recorder) -> None:
    """docs/api.md, "Patching": a ``ClientRequest.send`` coroutine created inside a trajectory and
    dropped unawaited warns for ours and for aiohttp's (closing aiohttp's would cost every request a
    finalizer). Sent nowhere: the request is left as it was."""
    code = f"""
        import asyncio, gc, aiohttp, yarl, otel_session
        otel_session.configure(dynamo_hosts=[{dynamo.url!r}])
        async def main():
            async with otel_session.trajectory():
                loop = asyncio.get_running_loop()
                request = aiohttp.ClientRequest("GET", yarl.URL({dynamo.url!r} + "/unsent"), loop=loop)
                request.send(None)
                gc.collect()
        asyncio.run(main())
        gc.collect()
    """
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    said = sorted(line.split("coroutine ")[1] for line in out.stderr.splitlines() if "never awaited" in line)
    assert said == ["'ClientRequest.send' was never awaited", "'_hop_send' was never awaited"], out.stderr
    assert not [seen for seen in dynamo.requests if seen.path == "/unsent"]
