"""The real vLLM router (0.1.17) and SGLang Model Gateway (1.13.0) pin every trajectory by its header.

Each router runs as its real binary on loopback in front of three recording backends that answer with
their own name (``tests/routers.py``). Trajectories are driven only through otel-session (the openai
SDK, sync and async, and aiohttp; no hand-set headers except in the harness checks), with 11 siblings
(an odd count) x 3 turns, so "siblings spread" cannot happen by alternation and "all on one backend"
by chance has a probability of 3 x 3^-11.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import httpx
import openai
import pytest

import otel_session
from tests import support
from tests.routers import Backend, RouterKind, RouterProcess, group_members, is_loopback, router

SIBLINGS = 11
TURNS = 3
HEADERS = {"vllm-router": "X-Session-ID", "smg": "X-SMG-Routing-Key"}
# Every header any profile could add: a router must receive its own and none of the others.
ALL_SESSION_HEADERS = {
    "x-session-id", "x-smg-routing-key", "x-litellm-session-id", "x-dynamo-session-id",
    "x-dynamo-parent-session-id", "x-dynamo-session-final", "baggage", "traceparent",
}  # fmt: skip
CLIENTS = ["openai", "openai-async", "aiohttp"]
fleet = support.fleet  # three recording backends for this module's routers
_fresh_records = support._fresh_records  # autouse: each test sees only what it sent


@pytest.fixture(scope="module")
def vllm(fleet: list[Backend]) -> Iterator[RouterProcess]:
    with router("vllm-router", fleet, policy="consistent_hash") as started:
        yield started


@pytest.fixture(scope="module")
def smg(fleet: list[Backend]) -> Iterator[RouterProcess]:
    with router("smg", fleet, policy="consistent_hashing") as started:
        yield started


def _routers(request: pytest.FixtureRequest, kind: str) -> RouterProcess:
    return request.getfixturevalue("vllm" if kind == "vllm-router" else "smg")  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- drivers


def _body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "max_tokens": 8}


def _next_turn(messages: list[dict[str, str]], answer: str, turn: int) -> None:
    messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": f"turn {turn + 1}: go on"})


async def run_siblings(
    kind: str, base_url: str, siblings: int = SIBLINGS
) -> list[tuple[str | None, list[str]]]:
    """``siblings`` concurrent trajectories of ``TURNS`` turns: (session id, backend per turn) each."""
    if kind == "openai":
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="k")

        @otel_session.trajectory()
        def one_sync(prompt: str) -> tuple[str | None, list[str]]:
            messages, served = [{"role": "user", "content": prompt}], []
            for turn in range(TURNS):
                answer = client.chat.completions.create(**_body(messages)).choices[0].message.content or ""
                served.append(answer)
                _next_turn(messages, answer, turn)
            return otel_session.current_session_id(), served

        with client, ThreadPoolExecutor(max_workers=siblings) as pool:
            return await asyncio.to_thread(lambda: list(pool.map(one_sync, ["same prompt"] * siblings)))

    if kind == "openai-async":
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="k") as aclient:

            @otel_session.trajectory()
            async def one_openai(prompt: str) -> tuple[str | None, list[str]]:
                messages, served = [{"role": "user", "content": prompt}], []
                for turn in range(TURNS):
                    response = await aclient.chat.completions.create(**_body(messages))
                    answer = response.choices[0].message.content or ""
                    served.append(answer)
                    _next_turn(messages, answer, turn)
                return otel_session.current_session_id(), served

            return list(await asyncio.gather(*(one_openai("same prompt") for _ in range(siblings))))

    assert kind == "aiohttp"
    async with aiohttp.ClientSession() as session:

        @otel_session.trajectory()
        async def one_aiohttp(prompt: str) -> tuple[str | None, list[str]]:
            messages, served = [{"role": "user", "content": prompt}], []
            for turn in range(TURNS):
                async with session.post(base_url + "/v1/chat/completions", json=_body(messages)) as resp:
                    resp.raise_for_status()
                    answer = (await resp.json())["choices"][0]["message"]["content"]
                served.append(answer)
                _next_turn(messages, answer, turn)
            return otel_session.current_session_id(), served

        return list(await asyncio.gather(*(one_aiohttp("same prompt") for _ in range(siblings))))


def _assert_pinned_and_spread(results: list[tuple[str | None, list[str]]]) -> None:
    assert len(results) == SIBLINGS
    assert len({sid for sid, _ in results}) == SIBLINGS and None not in {sid for sid, _ in results}
    for sid, served in results:
        assert len(served) == TURNS
        assert len(set(served)) == 1, f"trajectory {sid} moved between backends: {served}"
    assert len({served[0] for _, served in results}) >= 2, "all siblings on one backend"


def _assert_headers_at_backends(
    fleet: list[Backend], header: str, results: list[tuple[str | None, list[str]]]
) -> None:
    """Each backend got exactly its trajectories' IDs in the router's header, and no other session header."""
    by_name = {b.name: b for b in fleet}
    for sid, served in results:
        seen = [s for s in by_name[served[0]].completions() if s.get(header) == sid]
        assert len(seen) == TURNS, (sid, served)
    for backend in fleet:
        for request in backend.completions():
            assert request.get(header) is not None
            extra = request.names() & ALL_SESSION_HEADERS - {header.lower()}
            assert not extra, f"{backend.name} received {extra}"


# ----------------------------------------------------------------------------- the harness itself


@pytest.mark.parametrize("kind", ["vllm-router", "smg"])
def test_router_listens_on_loopback_only_pins_by_hand_set_header_and_stops(
    kind: RouterKind, fleet: list[Backend]
) -> None:
    policy = "consistent_hash" if kind == "vllm-router" else "consistent_hashing"
    process = RouterProcess(kind, [b.url for b in fleet], policy=policy)
    with process:
        listening = process.listening()
        assert {port for _, port in listening} >= {process.port, process.metrics_port}
        assert all(is_loopback(addr) for addr, _ in listening), listening
        assert 29000 not in {port for _, port in listening}
        placed: dict[str, set[str]] = {}
        with httpx.Client() as client:
            for turn in range(TURNS):
                for key in (f"hand-set-{i}" for i in range(SIBLINGS)):
                    body = _body([{"role": "user", "content": "x" * (turn + 1)}])
                    response = client.post(
                        process.url + "/v1/chat/completions", json=body, headers={HEADERS[kind]: key}
                    )
                    placed.setdefault(key, set()).add(response.json()["choices"][0]["message"]["content"])
        assert all(len(names) == 1 for names in placed.values()), placed
        assert len(set().union(*placed.values())) >= 2
        pgid = process.pgid
    assert group_members(pgid) == []
    assert process.popen is not None and process.popen.returncode is not None
    with pytest.raises(httpx.TransportError):
        httpx.get(process.url + "/health", timeout=1.0)


# ----------------------------------------------------------------------------- through otel-session


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("kind", ["vllm-router", "smg"])
def test_every_trajectory_stays_on_one_backend_and_siblings_spread(
    kind: str, client: str, fleet: list[Backend], request: pytest.FixtureRequest
) -> None:
    process = _routers(request, kind)
    otel_session.configure(routers={kind: [process.authority]})
    results = asyncio.run(run_siblings(client, process.url))
    _assert_pinned_and_spread(results)
    _assert_headers_at_backends(fleet, HEADERS[kind], results)


def test_without_otel_session_vllm_router_sends_every_trajectory_to_one_backend(
    fleet: list[Backend], vllm: RouterProcess
) -> None:
    """The control. ``consistent_hash`` without a session header falls back to the key ``request:``
    plus the request text, and 0.1.17 hands it no text for chat completions, so the key is the same
    for every request: the router's own log says so. Turns stay together only because *everything*
    lands on one engine; no sibling spreads."""
    log_before = len(vllm.log_text())
    results = asyncio.run(run_siblings("openai-async", vllm.url))
    backends_used = {name for _, served in results for name in served}
    assert len(backends_used) == 1, backends_used
    assert all(not (r.names() & ALL_SESSION_HEADERS) for b in fleet for r in b.completions())
    new_log = vllm.log_text()[log_before:]
    keys = [
        line.rsplit("Extracted hash key: ", 1)[1]
        for line in new_log.splitlines()
        if "Extracted hash key: " in line
    ]
    assert len(keys) == SIBLINGS * TURNS and set(keys) == {"request:"}


def test_without_otel_session_smg_moves_turns_between_backends(
    fleet: list[Backend], smg: RouterProcess
) -> None:
    """The control for the gateway: without ``X-SMG-Routing-Key`` its turns scatter."""
    results = asyncio.run(run_siblings("aiohttp", smg.url))
    moved = [served for _, served in results if len(set(served)) > 1]
    assert moved, "every trajectory stayed on one backend without a routing key"
    assert all(not (r.names() & ALL_SESSION_HEADERS) for b in fleet for r in b.completions())


def test_each_router_gets_only_its_own_header_when_one_trajectory_uses_both(
    fleet: list[Backend], vllm: RouterProcess, smg: RouterProcess
) -> None:
    otel_session.configure(routers={"vllm-router": [vllm.authority], "smg": [smg.authority]})

    async def both() -> str | None:
        async with otel_session.trajectory() as traj, aiohttp.ClientSession() as session:
            for url in (vllm.url, smg.url):
                async with session.post(
                    url + "/v1/chat/completions", json=_body([{"role": "user", "content": "x"}])
                ) as r:
                    r.raise_for_status()
            return traj.session_id

    sid = asyncio.run(both())
    got = [r for b in fleet for r in b.completions()]
    assert len(got) == 2
    pairs = {(r.get("x-session-id"), r.get("x-smg-routing-key")) for r in got}
    assert pairs == {(sid, None), (None, sid)}


# ----------------------------------------------------------------------------- the environment form

_CHILD = textwrap.dedent(
    """
    import json, openai, otel_session
    otel_session.configure()  # everything from OTEL_SESSION_ROUTERS
    out = {}
    for name, url in (("vllm-router", VLLM), ("smg", SMG)):
        client = openai.OpenAI(base_url=url + "/v1", api_key="k")
        rows = []
        for sibling in range(5):
            with otel_session.trajectory() as traj:
                served = []
                for turn in range(3):
                    messages = [{"role": "user", "content": "turn %d" % turn}]
                    reply = client.chat.completions.create(model="m", max_tokens=4, messages=messages)
                    served.append(reply.choices[0].message.content)
            rows.append([traj.session_id, served])
        out[name] = rows
    print(json.dumps(out))
    """
)


def test_otel_session_routers_environment_variable_end_to_end(
    fleet: list[Backend], vllm: RouterProcess, smg: RouterProcess
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_SESSION_")}
    env["OTEL_SESSION_ROUTERS"] = f"vllm-router={vllm.authority} ; smg=http://{smg.authority}/v1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    code = f"VLLM, SMG = {vllm.url!r}, {smg.url!r}\n" + _CHILD
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    by_name = {b.name: b for b in fleet}
    for kind, rows in out.items():
        header = HEADERS[kind]
        for sid, served in rows:
            assert len(set(served)) == 1, (kind, sid, served)
            seen = [r for r in by_name[served[0]].completions() if r.get(header) == sid]
            assert len(seen) == 3
            assert all(not (r.names() & ALL_SESSION_HEADERS - {header.lower()}) for r in seen)
