"""Every router profile through every client path: its own header, to its own hosts, nothing else."""

from __future__ import annotations

import asyncio

import httpx2
import pytest

import otel_session
from otel_session._routers import BUILTIN
from tests.clients import CLIENTS, send
from tests.recorder import Recorder

PROFILES = {
    **{name: profile.session_header for name, profile in BUILTIN.items()},
    "header:X-My-Key": "X-My-Key",
}
EVERY_SESSION_HEADER = {header.lower() for header in PROFILES.values()} | {"x-dynamo-parent-session-id"}
PATHS = [*CLIENTS, "httpx2"]


async def _send(kind: str, url: str) -> None:
    if kind == "httpx2":  # the openai SDK's transport library, used directly
        await asyncio.to_thread(lambda: httpx2.post(url + "/v1/chat/completions", json={}).raise_for_status())
    else:
        await send(kind, url)


@pytest.mark.parametrize("kind", PATHS)
@pytest.mark.parametrize("profile", list(PROFILES))
async def test_a_profile_gets_its_own_header_and_no_one_elses(
    profile: str, kind: str, dynamo: Recorder, other: Recorder
) -> None:
    otel_session.configure(dynamo_hosts=[], routers={profile: [dynamo.authority]})
    with otel_session.trajectory() as traj:
        await _send(kind, dynamo.url)
        await _send(kind, other.url)
    [at_router] = dynamo.requests
    assert at_router.get(PROFILES[profile]) == traj.session_id
    # Dynamo's own companion only: the parent its first request's prompt grouped the attempt under
    # (a body with no prompt, as httpx2's here, names no group and so no parent)
    companion = {"x-dynamo-parent-session-id"} if profile == "dynamo" else set()
    extra = at_router.names() & EVERY_SESSION_HEADER - {PROFILES[profile].lower()}
    assert PROFILES[profile].lower() in at_router.names() and extra <= companion
    if extra:
        assert at_router.get("x-dynamo-parent-session-id") == traj.parent_session_id
    assert (profile == "dynamo" and kind != "httpx2") == bool(extra)
    assert at_router.get("baggage") is None and at_router.get("traceparent") is None
    [elsewhere] = other.requests
    assert not elsewhere.names() & (EVERY_SESSION_HEADER | {"baggage", "traceparent"})


def test_the_routers_variable_is_read_when_routers_is_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_ROUTERS", " vllm-router = a:1 , b ; ; smg=*.gw.internal ;header:X-K=c ")
    rules = otel_session.configure().rules
    routes = {(profile.name, pattern.host, pattern.port) for profile, pattern in rules.routes}
    assert routes == {
        ("vllm-router", "a", 1),
        ("vllm-router", "b", None),
        ("smg", "gw.internal", None),
        ("header:X-K", "c", None),
    }


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("vllm-router", "PROFILE=PATTERN"),
        ("=a:1", "PROFILE=PATTERN"),
        ("bogus=a:1", "unknown router profile 'bogus'"),
        ("header:Authorization=a", "reserved"),
        ("header:Host=a", "reserved"),
        ("header:bad name=a", "not a valid HTTP header name"),
        ("smg=a:99999", "not a port number"),
    ],
)
def test_a_bad_routers_variable_is_one_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, value: str, names: str
) -> None:
    monkeypatch.setenv("OTEL_SESSION_ROUTERS", value)
    with pytest.raises(ValueError, match="OTEL_SESSION_ROUTERS") as error:
        otel_session.configure()
    assert names in str(error.value)
