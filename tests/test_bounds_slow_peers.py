"""Slow peers cannot hold us longer than promised (issue 23, items 7-9), over loopback with real servers.

A peer here is a raw HTTP/1.1 server on 127.0.0.1 that answers some paths at once and "drips" others:
it sends the start of an answer and then one byte at a time, so every socket read succeeds and no
per-read timeout ever fires. Against it:

- 7: trace export (an OTLP collector that drips) holds ``unconfigure()`` and process exit for at most
  ``SHUTDOWN_BUDGET_S``, and a malformed ``OTEL_EXPORTER_OTLP_TIMEOUT`` gets the library's 2 s;
- 8: an end-of-session notice to a router that drips (or whose name takes long to look up) gives its
  slot back within ``NOTICE_DEADLINE_S``;
- 9: under trio (and anyio on trio) a plain ``with`` exit does not block the loop and ``async with``
  awaits the notice with trio's own primitives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import trio
import trustme

import otel_session
from otel_session import _bounded_http, _export, _session_end, _tracing
from otel_session._session_end import BUDGET_SECONDS, NOTICE_DEADLINE_S
from tests.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ANSWER = json.dumps(
    {
        "status": "ok",
        "data": [{"id": "m"}],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
    }
).encode()


@dataclass(frozen=True)
class Arrival:
    method: str
    target: str
    at: float


class Peer:
    """A raw HTTP/1.1 server on 127.0.0.1 that answers at once, after ``delay_s``, or by dripping.

    A dripped answer is a status line and then one header byte every ``every`` seconds, for
    ``drip_for`` seconds: a client with per-read timeouts keeps waiting the whole time.
    """

    def __init__(
        self,
        drip: tuple[str, ...] = (),
        delay: tuple[str, ...] = (),
        *,
        every: float = 0.3,
        drip_for: float = 30.0,
        delay_s: float = 0.3,
        tls: ssl.SSLContext | None = None,
        silent: bool = False,
    ) -> None:
        self.drip, self.delay, self.every, self.drip_for, self.delay_s = drip, delay, every, drip_for, delay_s
        self.tls, self.silent = tls, silent  # silent: accept connections and never say a word
        self.connections = 0
        self.arrivals: list[Arrival] = []
        self.dripping = 0  # answers being dripped right now
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self.port = int(self._listener.getsockname()[1])
        self.authority = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.authority}"
        threading.Thread(target=self._accept, name="peer-accept", daemon=True).start()

    def paths(self) -> list[str]:
        with self._lock:
            return [arrival.target.split("?")[0] for arrival in self.arrivals]

    def targets(self, path: str) -> list[str]:
        with self._lock:
            return [a.target for a in self.arrivals if a.target.split("?")[0] == path]

    def wait_for(self, path: str, count: int = 1, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.targets(path)) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="peer-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self.connections += 1
        if self.silent:
            with conn:
                self._stop.wait(self.drip_for)
            return
        with conn:
            conn.settimeout(10)
            try:
                if self.tls is not None:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                with self._lock:
                    self.arrivals.append(Arrival(method, target, time.monotonic()))
                path = target.split("?")[0]
                if path in self.drip:
                    self._drip(conn)
                    return
                if path in self.delay:
                    self._stop.wait(self.delay_s)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {len(ANSWER)}\r\n\r\n".encode()
                    + ANSWER
                )
            except OSError:
                return

    def _drip(self, conn: socket.socket) -> None:
        with self._lock:
            self.dripping += 1
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Drip: ")
            ends = time.monotonic() + self.drip_for
            while time.monotonic() < ends and not self._stop.wait(self.every):
                conn.sendall(b"a")
        except OSError:
            pass  # the client gave up
        finally:
            with self._lock:
                self.dripping -= 1


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _eventually(condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``condition`` held (polled every 10 ms); fails after ``timeout``."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < timeout, "condition never held"
        time.sleep(0.01)
    return time.monotonic() - began


@pytest.mark.usefixtures("clean_otel_env")
def test_unconfigure_is_bounded_while_the_collector_drips(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with Peer() as dynamo, Peer(drip=("/v1/traces",), drip_for=60) as collector:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # an export starts, and hangs, at once
        otel_session.configure(dynamo_hosts=[dynamo.authority], tracing=True)
        with caplog.at_level(logging.WARNING, logger="otel_session"), httpx.Client() as client:
            with otel_session.trajectory():
                client.post(f"{dynamo.url}/v1/chat/completions", json=BODY)
            assert collector.wait_for("/v1/traces")
            for _ in range(20):  # more spans queued behind the export that hangs
                with otel_session.trajectory():
                    client.post(f"{dynamo.url}/v1/chat/completions", json=BODY)
            time.sleep(_export.DEFAULT_EXPORT_TIMEOUT_S + 0.2)  # the first export has been given up
            began = time.monotonic()
            otel_session.unconfigure()
            took = time.monotonic() - began
            assert took < 5.0, took
            assert took < _export.SHUTDOWN_BUDGET_S + 0.5, took
            assert collector.dripping >= 1  # the collector never stopped: the bound is ours
    given_up = [r for r in caplog.records if "no complete answer from the collector" in r.getMessage()]
    assert len(given_up) == 1 and "\n" not in given_up[0].getMessage()


EXIT_SCRIPT = """
    import sys, time, httpx, otel_session
    otel_session.configure(dynamo_hosts=[sys.argv[1]], tracing=True)
    with httpx.Client() as client:
        for _ in range(3):
            with otel_session.trajectory():
                client.post(f"http://{sys.argv[1]}/v1/chat/completions", json={})
        time.sleep(0.5)  # an export is under way, and hangs
        for _ in range(50):
            with otel_session.trajectory():
                client.post(f"http://{sys.argv[1]}/v1/chat/completions", json={})
    print("rollout done", flush=True)
"""


@pytest.mark.usefixtures("clean_otel_env")
def test_process_exit_is_bounded_while_the_collector_drips(tmp_path: Path) -> None:
    with Peer() as dynamo, Peer(drip=("/v1/traces",), drip_for=60) as collector:
        script = tmp_path / "script.py"
        script.write_text(textwrap.dedent(EXIT_SCRIPT))
        env = {
            **{name: value for name, value in os.environ.items() if not name.startswith("OTEL_")},
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        process = subprocess.Popen(
            [sys.executable, str(script), dynamo.authority],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "rollout done"
            began = time.monotonic()
            _, stderr = process.communicate(timeout=60)
            took = time.monotonic() - began
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert collector.targets("/v1/traces")  # the export reached the collector, which dripped
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert took < 6.0, took
    assert len(dynamo.targets("/v1/chat/completions")) == 53


@pytest.mark.usefixtures("clean_otel_env")
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"])
@pytest.mark.parametrize("raw", ["abc", "-1", "0", "nan"])
def test_a_malformed_export_timeout_gets_the_library_bound(
    raw: str, variable: str, protocol: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the collector refusing connections an export retries until its timeout: the library's 2 s,
    not the exporter's 10 s (or, for ``-1``, none at all, failing every export at once)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv(variable, raw)
    if protocol == "grpc" and variable.endswith("TRACES_TIMEOUT") and raw == "abc":
        # The gRPC exporter parses this one itself and cannot start: refused with the variable named.
        with pytest.raises(ValueError, match=variable):
            otel_session.configure(dynamo_hosts=["127.0.0.1:1"], tracing=True)
        return
    with Peer() as dynamo, caplog.at_level(logging.WARNING, logger="otel_session"):
        otel_session.configure(dynamo_hosts=[dynamo.authority], tracing=True)
        with otel_session.trajectory(), httpx.Client() as client:
            client.post(f"{dynamo.url}/v1/chat/completions", json=BODY)
        provider = _tracing.provider()
        assert provider is not None
        began = time.monotonic()
        provider.force_flush()  # one export, retried against the refused collector until it gives up
        flushed = time.monotonic() - began
        began = time.monotonic()
        otel_session.unconfigure()
        unconfigured = time.monotonic() - began
    ours = [r.getMessage() for r in caplog.records if r.name == "otel_session" and variable in r.getMessage()]
    assert len(ours) == 1, ours
    assert "\n" not in ours[0] and "2.0 s" in ours[0]
    assert flushed < _export.DEFAULT_EXPORT_TIMEOUT_S + 0.5, flushed
    assert unconfigured < _export.SHUTDOWN_BUDGET_S + 0.5, unconfigured
    if protocol == "http/protobuf":
        assert flushed > 0.5, flushed  # it did retry (-1 would have failed at once): 2 s, not 0


@pytest.mark.usefixtures("clean_otel_env")
@pytest.mark.parametrize("receiver_class", [OtlpHttpReceiver, OtlpGrpcReceiver])
def test_a_malformed_export_timeout_still_exports(
    receiver_class: type[OtlpHttpReceiver | OtlpGrpcReceiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = receiver_class()
    try:
        protocol = "grpc" if receiver_class is OtlpGrpcReceiver else "http/protobuf"
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "-1")
        otel_session.configure(dynamo_hosts=["127.0.0.1:1"], tracing=True)
        with otel_session.trajectory() as traj:
            pass
        otel_session.unconfigure()
        spans = receiver.wait_for(lambda found: len(found) >= 1, timeout=5)
        assert [span.attributes["session.id"] for span in spans] == [traj.session_id]
    finally:
        receiver.close()


# ----------------------------------------------------------------------------- 8. end-of-session notices


@pytest.mark.parametrize(
    ("profile", "dripped"), [("vllm-router", "/finish_session"), ("dynamo", "/v1/models")]
)
def test_a_dripping_router_gives_the_notice_slot_back_by_its_deadline(
    profile: str, dripped: str, caplog: pytest.LogCaptureFixture
) -> None:
    with Peer(drip=(dripped,), every=0.1) as router, caplog.at_level(logging.WARNING, logger="otel_session"):
        otel_session.configure(routers={profile: [router.authority]}, end_sessions=True)
        assert _session_end.in_flight() == 0

        async def three_trajectories() -> list[str | None]:
            sessions = []
            with httpx.Client() as client:
                for _ in range(3):  # plain `with` in a running loop: the exits do not wait
                    with otel_session.trajectory() as traj:
                        client.post(f"{router.url}/v1/chat/completions", json=BODY).raise_for_status()
                    sessions.append(traj.session_id)
            return sessions

        began = time.monotonic()
        asyncio.run(three_trajectories())
        assert router.wait_for(dripped, 3)
        assert _session_end.in_flight() == 3  # each held by a router that goes on dripping for 30 s
        _eventually(lambda: _session_end.in_flight() == 0, timeout=NOTICE_DEADLINE_S + 5)
        freed_after = time.monotonic() - began
        _eventually(lambda: router.dripping == 0, timeout=2)  # and each connection was closed
    assert NOTICE_DEADLINE_S - 0.1 < freed_after < NOTICE_DEADLINE_S + 1.0, freed_after
    warnings = [r.getMessage() for r in caplog.records if "could not tell" in r.getMessage()]
    assert len(warnings) == 1 and "TimeoutError" in warnings[0], warnings
    time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "otel-session-end"]


def test_a_slow_name_lookup_gives_the_notice_slot_back_by_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A resolver has no timeout of ours: notices wait for it only until their deadline, and a burst of
    notices to one router shares one look-up, so no thread piles up per notice."""
    release = threading.Event()
    asked: list[str] = []
    real = socket.getaddrinfo

    def slow_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "slow-router.test":
            asked.append(host)
            release.wait(30)  # a resolver that hangs
            return real("127.0.0.1", *args, **kwargs)
        return real(host, *args, **kwargs)

    with Peer() as router:
        monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
        otel_session.configure(routers={"vllm-router": ["slow-router.test"]}, end_sessions=True)
        try:
            visit = ("vllm-router", "http", "slow-router.test", router.port)

            async def burst() -> None:  # in a running loop the exits do not wait
                for n in range(8):
                    _session_end.finish(f"slow-lookup-{n}", None, {visit})

            began = time.monotonic()
            asyncio.run(burst())
            exits = time.monotonic() - began
            assert _session_end.in_flight() == 8
            _eventually(lambda: _session_end.in_flight() == 0, timeout=NOTICE_DEADLINE_S + 5)
            freed_after = time.monotonic() - began
            assert asked == ["slow-router.test"]  # one look-up for the burst
            assert len([t for t in threading.enumerate() if t.name == "otel-session-lookup"]) == 1
        finally:
            release.set()
        assert exits < 0.5
        assert NOTICE_DEADLINE_S - 0.1 < freed_after < NOTICE_DEADLINE_S + 1.0, freed_after
        # Once the look-up answers, the next notice goes out (and the look-up thread is gone).
        _eventually(lambda: not [t for t in threading.enumerate() if t.name == "otel-session-lookup"], 5)
        _session_end.finish("slow-lookup-after", None, {visit})
        assert router.wait_for("/finish_session")
        assert router.targets("/finish_session") == ["/finish_session?session_id=slow-lookup-after"]


@pytest.fixture
def trusted_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[trustme.CA, ssl.SSLContext]:
    """A test CA the notices trust as the system's (``SSL_CERT_FILE``), and a server context from it."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    monkeypatch.setattr(_bounded_http, "_tls", None)  # made afresh, reading SSL_CERT_FILE
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    return ca, server


@pytest.mark.parametrize("peer", ["answers", "drips", "never completes the handshake"])
def test_a_notice_over_tls_is_verified_and_bounded(
    peer: str, trusted_ca: tuple[trustme.CA, ssl.SSLContext], caplog: pytest.LogCaptureFixture
) -> None:
    _, server_context = trusted_ca
    kinds = {
        "answers": {},
        "drips": {"drip": ("/finish_session",), "every": 0.1},
        "never completes the handshake": {"silent": True},
    }
    with Peer(tls=server_context, **kinds[peer]) as router:  # type: ignore[arg-type]
        otel_session.configure(routers={"vllm-router": [router.authority]}, end_sessions=True)
        visit = ("vllm-router", "https", "127.0.0.1", router.port)
        with caplog.at_level(logging.WARNING, logger="otel_session"):
            began = time.monotonic()
            _session_end.finish(f"tls-{peer}", None, {visit})
            waited = time.monotonic() - began
            _eventually(lambda: _session_end.in_flight() == 0, timeout=NOTICE_DEADLINE_S + 5)
            freed_after = time.monotonic() - began
        assert router.connections == 1
    assert waited < BUDGET_SECONDS + 0.2
    warnings = [r.getMessage() for r in caplog.records if "could not tell" in r.getMessage()]
    if peer == "answers":
        assert router.targets("/finish_session") == [f"/finish_session?session_id=tls-{peer}"]
        assert not warnings and freed_after < 1.0
    else:
        assert len(warnings) == 1 and "TimeoutError" in warnings[0], warnings
        assert NOTICE_DEADLINE_S - 0.1 < freed_after < NOTICE_DEADLINE_S + 1.0, freed_after


def test_a_notice_over_tls_refuses_an_untrusted_certificate(caplog: pytest.LogCaptureFixture) -> None:
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(server_context)  # a CA nobody trusts
    with Peer(tls=server_context) as router, caplog.at_level(logging.WARNING, logger="otel_session"):
        otel_session.configure(routers={"vllm-router": [router.authority]}, end_sessions=True)
        _session_end.finish("untrusted", None, {("vllm-router", "https", "127.0.0.1", router.port)})
        _eventually(lambda: _session_end.in_flight() == 0, timeout=5)
    assert router.targets("/finish_session") == []
    warnings = [r.getMessage() for r in caplog.records if "could not tell" in r.getMessage()]
    assert len(warnings) == 1 and "CERTIFICATE_VERIFY_FAILED" in warnings[0], warnings


# ----------------------------------------------------------------------------- 9. trio and anyio


def _run_trio(how: str, main: Callable[[], Any]) -> Any:
    if how == "trio":
        return trio.run(main)
    return anyio.run(main, backend="trio")


async def _loop_stalls(stop: trio.Event, gaps: list[float]) -> None:
    """Ticks every 5 ms and records the gaps: a blocked loop shows as one long gap."""
    last = trio.current_time()
    while not stop.is_set():
        await trio.sleep(0.005)
        now = trio.current_time()
        gaps.append(now - last)
        last = now


@pytest.mark.parametrize("how", ["trio", "anyio-on-trio"])
def test_a_plain_with_under_trio_does_not_block_the_loop(how: str, caplog: pytest.LogCaptureFixture) -> None:
    # The router takes 0.3 s over the notice: an exit that waited would block trio's loop that long.
    with Peer(delay=("/finish_session",), delay_s=0.3) as router:
        otel_session.configure(routers={"vllm-router": [router.authority]}, end_sessions=True)

        async def main() -> tuple[float, str | None, list[float]]:
            gaps: list[float] = []
            stop = trio.Event()
            async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
                nursery.start_soon(_loop_stalls, stop, gaps)
                with otel_session.trajectory() as traj:  # a plain `with` in trio code
                    (await client.post(f"{router.url}/v1/chat/completions", json=BODY)).raise_for_status()
                    entered_exit = time.monotonic()
                took = time.monotonic() - entered_exit
                await trio.sleep(0.05)
                stop.set()
            return took, traj.session_id, gaps

        with caplog.at_level(logging.WARNING, logger="otel_session"):
            took, session, gaps = _run_trio(how, main)
            assert router.wait_for("/finish_session")  # the notice still went out, from its thread
    assert took < 0.1, took
    assert max(gaps) < 0.2, max(gaps)
    assert router.targets("/finish_session") == [f"/finish_session?session_id={session}"]
    assert not [r for r in caplog.records if r.name == "otel_session"], caplog.text


@pytest.mark.parametrize("how", ["trio", "anyio-on-trio"])
def test_async_with_under_trio_awaits_the_notice(how: str, caplog: pytest.LogCaptureFixture) -> None:
    with Peer(delay=("/finish_session",), delay_s=0.2) as router:
        otel_session.configure(routers={"vllm-router": [router.authority]}, end_sessions=True)

        async def main() -> tuple[float, str | None, list[str], list[float]]:
            gaps: list[float] = []
            stop = trio.Event()
            async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
                nursery.start_soon(_loop_stalls, stop, gaps)
                async with otel_session.trajectory() as traj:
                    (await client.post(f"{router.url}/v1/chat/completions", json=BODY)).raise_for_status()
                    entered_exit = time.monotonic()
                took = time.monotonic() - entered_exit
                seen_at_exit = router.targets("/finish_session")
                stop.set()
            return took, traj.session_id, seen_at_exit, gaps

        with caplog.at_level(logging.DEBUG, logger="otel_session"):
            took, session, seen_at_exit, gaps = _run_trio(how, main)
    # It waited for the answer (the router took 0.2 s), within the budget, without blocking the loop.
    assert seen_at_exit == [f"/finish_session?session_id={session}"]
    assert 0.15 < took < BUDGET_SECONDS + 0.2, took
    assert max(gaps) < 0.1, max(gaps)
    assert not [r for r in caplog.records if r.name == "otel_session"], caplog.text
    assert "asyncio" not in {type(r).__module__ for r in caplog.records}


def test_async_with_under_trio_is_bounded_by_the_budget_and_never_raises_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A router that drips: the exit waits the budget, not more; inside a cancelled scope, not at all."""
    with Peer(drip=("/finish_session",)) as router:
        otel_session.configure(routers={"vllm-router": [router.authority]}, end_sessions=True)

        async def main() -> tuple[float, float, bool]:
            async with httpx.AsyncClient() as client:
                async with otel_session.trajectory():
                    (await client.post(f"{router.url}/v1/chat/completions", json=BODY)).raise_for_status()
                    entered_exit = time.monotonic()
                slow = time.monotonic() - entered_exit
                with trio.move_on_after(0.05) as scope:
                    async with otel_session.trajectory():
                        (await client.post(f"{router.url}/v1/chat/completions", json=BODY)).raise_for_status()
                        await trio.sleep(10)  # cancelled here
                cancelled_exit = time.monotonic() - entered_exit - slow
            return slow, cancelled_exit, scope.cancelled_caught

        with caplog.at_level(logging.WARNING, logger="otel_session"):
            slow, cancelled_exit, caught = trio.run(main)
            assert router.wait_for("/finish_session", 2)  # both notices went out
    assert BUDGET_SECONDS * 0.8 < slow < BUDGET_SECONDS + 0.3, slow
    assert caught  # the Cancelled was trio's own, caught by its scope: none raised from our exit
    assert cancelled_exit < 0.3, cancelled_exit
    assert not [r for r in caplog.records if "ending sessions failed" in r.getMessage()]


def test_trio_is_never_imported_by_us(tmp_path: Path) -> None:
    source = """
        import asyncio, sys, otel_session
        from otel_session import _session_end
        otel_session.configure(routers={"vllm-router": ["127.0.0.1:1"]}, end_sessions=True)
        visit = ("vllm-router", "http", "127.0.0.1", 1)
        _session_end.finish("a", None, {visit})
        async def main():
            with otel_session.trajectory():
                pass
            await _session_end.finish_async("b", None, {visit})
        asyncio.run(main())
        print("trio" in sys.modules, "sniffio" in sys.modules)
    """
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "False", result.stdout
