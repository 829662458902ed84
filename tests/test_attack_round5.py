"""An outside attack on the fifth round's sibling groups (issue 34, item 3), written from README.md
and docs/ only, through the public API over loopback to a recording Dynamo."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import httpx
import pytest

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER
from tests.recorder import Recorder


class Colliding:
    """Unequal keys that all hash alike."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Colliding) and other.name == self.name


class EqRaises:
    """A key whose equality raises once two of its kind meet in one bucket."""

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("eq exploded")


def _carried(dynamo: Recorder) -> list[tuple[str | None, str | None]]:
    return [(seen.get(SESSION_HEADER), seen.get(PARENT_SESSION_HEADER)) for seen in dynamo.requests]


def _at_once(dynamo: Recorder, keys: list[object]) -> list[str | None]:
    """One attempt per key, all open at once on tasks; the parent each one's request named."""

    async def attempt(index: int, key: object) -> None:
        async with otel_session.trajectory(group=key), httpx.AsyncClient() as client:
            await asyncio.sleep(0.05)  # every attempt open before any asks
            await client.get(f"{dynamo.url}/{index}", timeout=10)

    async def step() -> None:
        await asyncio.gather(*(attempt(i, key) for i, key in enumerate(keys)))

    asyncio.run(step())
    by_path = {seen.path: seen.get(PARENT_SESSION_HEADER) for seen in dynamo.requests}
    return [by_path[f"/{i}"] for i in range(len(keys))]


def test_unequal_group_keys_with_equal_hashes_never_share_a_parent(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")
    a1, a2, b1, b2 = _at_once(dynamo, [Colliding("a"), Colliding("a"), Colliding("b"), Colliding("b")])
    assert a1 is not None and a1 == a2 and b1 is not None and b1 == b2 and a1 != b1


def test_a_group_left_by_a_generator_closed_early_or_a_cancellation_is_forgotten(
    dynamo: Recorder,
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="prompt")

    def rollout() -> Generator[int, None, None]:
        with otel_session.trajectory(group="g"), httpx.Client() as client:
            client.get(f"{dynamo.url}/gen", timeout=10)
            yield 1
            yield 2

    steps = rollout()
    next(steps)
    steps.close()

    async def cancelled() -> None:
        async def attempt() -> None:
            async with otel_session.trajectory(group="g"), httpx.AsyncClient() as client:
                await client.get(f"{dynamo.url}/task", timeout=10)
                await asyncio.sleep(60)

        task = asyncio.ensure_future(attempt())
        await asyncio.sleep(0.3)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    with otel_session.trajectory(group="g"), httpx.Client() as client:
        client.get(f"{dynamo.url}/after", timeout=10)
    parents = {seen.path: seen.get(PARENT_SESSION_HEADER) for seen in dynamo.requests}
    assert len({parents["/gen"], parents["/task"], parents["/after"]}) == 3, parents


def test_group_keys_whose_equality_raises_never_fail_a_request(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="groups:2")
    parents = _at_once(dynamo, [EqRaises(), EqRaises(), EqRaises()])
    assert len(parents) == 3 and len(dynamo.requests) == 3


def test_a_huge_group_key_is_carried_as_a_bounded_header(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="groups:2")
    key: Any = "p" * 5_000_000
    with otel_session.trajectory(group=key), httpx.Client() as client:
        assert client.get(f"{dynamo.url}/h", timeout=10).status_code == 200
    for session, parent in _carried(dynamo):
        assert session is not None and len(session) < 200
        assert parent is None or len(parent) < 200


@pytest.mark.parametrize("key", [None, 0, 0.0, False, (), b"", frozenset(), float("nan")])
def test_every_hashable_group_key_opens_an_attempt_that_carries_a_session(
    dynamo: Recorder, key: object
) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="groups:2")
    with otel_session.trajectory(group=key), httpx.Client() as client:
        assert client.get(f"{dynamo.url}/k", timeout=10).status_code == 200
    assert all(session for session, _ in _carried(dynamo))


# Short enough that the headers (45 bytes) are in well before doctor's 10 s deadline, so the trickling
# case waits out that deadline in the body, not the headers' own pace; its 400-byte body would take
# 40 s without the deadline (the subprocess's timeout).
TRICKLE_PAUSE = 0.1


def _raw_server(reply: bytes, trickle: bool) -> tuple[socket.socket, threading.Thread]:
    """A loopback TCP server that does not speak HTTP: it sends ``reply`` (byte by byte if
    ``trickle``, one every ``TRICKLE_PAUSE`` s, for up to 45 s) to each connection and closes it."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)

    def serve() -> None:
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            try:
                conn, _ = listener.accept()
            except OSError:
                if listener.fileno() < 0:
                    return
                continue
            with conn, contextlib.suppress(OSError):
                for index in range(len(reply) if trickle else 1):
                    conn.sendall(reply[index : index + 1] if trickle else reply)
                    if trickle:
                        time.sleep(TRICKLE_PAUSE)
                        if time.monotonic() > deadline:
                            break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize(
    ("reply", "trickle"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n", False),
        (b"\x00\xff" * 64, False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\ndynamo_frontend_cached_tok", False),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + b"x" * 400, True, marks=pytest.mark.slow
        ),
    ],
)
def test_doctor_watch_against_a_server_that_does_not_speak_http_prints_a_line_in_bounded_time(
    reply: bytes, trickle: bool
) -> None:
    listener, _ = _raw_server(reply, trickle)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
    started = time.monotonic()
    try:
        done = subprocess.run(
            [
                str(Path(sys.executable).with_name("otel-session")),
                "doctor",
                "--watch",
                url,
                "--interval",
                "1",
                "--samples",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=40,
            check=False,
        )
    finally:
        listener.close()
    assert time.monotonic() - started < 25  # its own 10 s timeout, whole, plus start-up
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert (done.stdout + done.stderr).strip(), "not a word"
