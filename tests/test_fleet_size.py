"""The fleet's size as ``_fleet`` reads it from a router's ``/health``: what counts as a worker, and
reads that fail (no list, not JSON, an error, a peer that never answers) without any request waiting
on them. Real servers over loopback; the hanging one is a socket that accepts and never answers."""

from __future__ import annotations

import http.server
import json
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

import otel_session
from otel_session import SESSION_HEADER, _bounded_http, _faults, _fleet
from tests.recorder import PATIENCE, Recorder
from tests.support import forked_while_held

_START = threading.Thread.start


@pytest.mark.parametrize(
    ("health", "workers"),
    [
        ({"instances": [{"endpoint": "generate", "instance_id": i} for i in range(5)]}, 5),
        ({"instances": [{"endpoint": "generate", "instance_id": 1}] * 3}, 1),  # one worker listed thrice
        ({"instances": [{"endpoint": "clear_kv_blocks", "instance_id": 1}]}, 0),  # not a generate worker
        ({"instances": [{"endpoint": "generate"}, {"endpoint": "generate", "instance_id": None}]}, 0),
        ({"instances": [None, 7, "x", [], {"endpoint": "generate", "instance_id": "a"}]}, 1),
        ({"instances": {"endpoint": "generate"}}, 0),  # not a list
        ({"status": "healthy"}, 0),
        ([], 0),
        ("healthy", 0),
        (None, 0),
    ],
)
def test_workers_are_the_distinct_instances_serving_generate(health: Any, workers: int) -> None:
    assert _fleet.workers_in(health) == workers


def _readers() -> list[threading.Thread]:
    """The threads reading a router's ``/health`` now."""
    return [t for t in threading.enumerate() if t.name == "otel-session-fleet"]


def _wait_known(origin: str, timeout: float = PATIENCE) -> Any:
    """The size read at ``origin`` once the read started before this call is over (a read under way
    is in ``_reading``, its thread alive, until its size is kept): a read that keeps nothing, or
    never started, fails at once, not after PATIENCE."""
    deadline = time.monotonic() + timeout
    while origin not in _fleet.known() and _fleet._reading and _readers() and time.monotonic() < deadline:
        time.sleep(0.02)
    return _fleet.known().get(origin)


def test_a_router_is_read_once_while_a_read_is_under_way_and_while_its_size_is_fresh(
    dynamo: Recorder,
) -> None:
    """Every attempt of a step asks for the size: one GET of /health serves them all, whether they
    ask while it is in flight or once its answer is known."""
    dynamo.instances, dynamo.health_delay = 3, 0.2
    origin = ("http", dynamo.host, dynamo.port)
    assert [_fleet.size_at(origin) for _ in range(5)] == [None] * 5  # one read under way
    assert _wait_known(dynamo.url) == 3
    assert [_fleet.size_at(origin) for _ in range(5)] == [3] * 5  # fresh: not read again
    time.sleep(0.3)  # a second read, had one started, would have been answered by now
    assert len(dynamo.health_reads) == 1


def test_a_router_is_read_once_and_again_after_a_while(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    dynamo.instances = 3
    origin = ("http", dynamo.host, dynamo.port)
    assert _fleet.size_at(origin) is None  # not read yet: the read starts, nothing waits on it
    assert _wait_known(dynamo.url) == 3
    assert _fleet.size_at(origin) == 3 and len(dynamo.health_reads) == 1  # fresh: not read again
    monkeypatch.setattr(_fleet, "REREAD", 0.0)
    dynamo.instances = 5
    assert _fleet.size_at(origin) == 3  # stale: the last size serves while it is read again
    deadline = time.monotonic() + PATIENCE
    while _fleet.known().get(dynamo.url) != 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _fleet.known()[dynamo.url] == 5
    _fleet.forget()
    assert _fleet.known() == {} and _fleet.largest() is None


@pytest.fixture
def silent_peer() -> Iterator[tuple[str, int]]:
    """A peer that accepts connections and never answers a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield sock.getsockname()
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    sock.close()


def test_the_size_seen_is_the_last_read_and_never_starts_one(dynamo: Recorder) -> None:
    """What ``_pacing`` is handed (more parents than workers go closer): the size a read found, per
    router, ``None`` before any, and never a /health read of its own (policies that do not size by
    the fleet never ask)."""
    dynamo.instances = 3
    origin = ("http", dynamo.host, dynamo.port)
    other = ("http", dynamo.host, dynamo.port + 1)
    assert _fleet.size_seen(origin) is None
    time.sleep(0.1)
    assert not dynamo.health_reads and dynamo.url not in _fleet.known()
    _fleet.size_at(origin)
    assert _wait_known(dynamo.url) == 3
    assert _fleet.size_seen(origin) == 3 and _fleet.size_seen(other) is None
    assert len(dynamo.health_reads) == 1


def test_a_peer_that_never_answers_costs_no_request_and_ends_unreadable(
    silent_peer: tuple[str, int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_fleet, "DEADLINE", 0.5)
    host, port = silent_peer
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        assert _fleet.size_at(("http", host, port)) is None
        assert time.monotonic() - began < 0.2  # the caller never waits on the read
        assert _wait_known(f"http://{host}:{port}") == _fleet.UNREADABLE
    lines = [r.getMessage() for r in caplog.records if "cannot be sized" in r.getMessage()]
    assert len(lines) == 1 and "its /health cannot be read (TimeoutError" in lines[0]


@pytest.mark.parametrize("answer", ["not json", "error"])
def test_a_health_that_is_not_a_list_is_unreadable_and_said_once_only_when_asked(
    answer: str, caplog: pytest.LogCaptureFixture
) -> None:
    with Recorder() as router:
        if answer == "error":
            router.fail_next.extend([500, 500])
        origin = ("http", router.host, router.port)
        with caplog.at_level(logging.WARNING, logger="otel_session"):
            _fleet.size_at(origin, tell=False)
            assert _wait_known(router.url) == _fleet.UNREADABLE
            _fleet.forget()
            _fleet.size_at(origin)
            assert _wait_known(router.url) == _fleet.UNREADABLE
        lines = [r.getMessage() for r in caplog.records if "cannot be sized" in r.getMessage()]
        assert len(lines) == 1 and router.url in lines[0] and "groups:2" in lines[0]


def test_no_request_waits_for_a_health_that_is_slow(dynamo: Recorder) -> None:
    """Under ``fleet``, siblings against a router whose /health takes 2 s: every request goes at
    once (withheld while the size is unknown), none waits for the read."""
    dynamo.instances, dynamo.health_delay = 4, 2.0
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="fleet")
    began = time.monotonic()
    for _ in range(3):
        with otel_session.trajectory(group="g"), httpx.Client(timeout=5) as client:
            client.post(f"{dynamo.url}/v1/chat/completions", json={"messages": []})
    assert time.monotonic() - began < 1.5 and len(dynamo.requests) == 3
    assert {seen.get(SESSION_HEADER) for seen in dynamo.requests} == {None}
    assert _wait_known(dynamo.url) == 4


def test_the_read_is_one_get_of_json_in_a_daemon_thread_of_its_own(dynamo: Recorder) -> None:
    dynamo.instances, dynamo.health_delay = 2, 0.2  # the reader is still reading as it is looked for
    before = set(_readers())
    _fleet.size_at(("http", dynamo.host, dynamo.port))  # its thread started before it returns
    (reader,) = set(_readers()) - before
    assert reader.daemon  # never holds the interpreter at exit
    assert _wait_known(dynamo.url) == 2
    (headers,) = dynamo.health_reads
    assert headers.get("accept") == "application/json"


def test_the_largest_fleet_counts_only_routers_that_list_workers(dynamo: Recorder) -> None:
    dynamo.instances = 3
    with Recorder() as unlisted:
        _fleet.size_at(("http", unlisted.host, unlisted.port), tell=False)
        assert _wait_known(unlisted.url) == _fleet.UNREADABLE and _fleet.largest() is None
        _fleet.size_at(("http", dynamo.host, dynamo.port))
        assert _wait_known(dynamo.url) == 3 and _fleet.largest() == 3


def test_routers_are_named_as_a_url_would_name_them() -> None:
    assert _fleet._shown(("http", "::1", 8000)) == "http://[::1]:8000"
    assert _fleet._shown(("https", "router.local", None)) == "https://router.local"


def test_the_line_for_a_router_without_a_list_says_what_and_what_to_do(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        before = _readers()
        _fleet.size_at(("http", dynamo.host, dynamo.port))
        for reader in set(_readers()) - set(before):
            reader.join(PATIENCE)  # the line is said after the size is kept, as the thread ends
    (line,) = [r.getMessage() for r in caplog.records if "/health" in r.getMessage()]
    assert line == (
        f"otel-session: sibling groups cannot be sized to the fleet of the router at {dynamo.url}: its "
        "/health lists no workers (no instance serving generate), so siblings there share a "
        "parent two by two (groups:2); set OTEL_SESSION_SIBLINGS=groups:K as `otel-session doctor` "
        "sizes it"
    )


def test_routers_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fleet, "ORIGINS_KEPT", 2)
    with Recorder() as one, Recorder() as two, Recorder() as three:
        for router in (one, two):
            _fleet.size_at(("http", router.host, router.port), tell=False)
            _wait_known(router.url)
        _fleet.size_at(("http", two.host, two.port), tell=False)  # fresh: read again it would not be
        assert set(_fleet.known()) == {one.url, two.url}
        _fleet.size_at(("http", three.host, three.port), tell=False)
        assert _wait_known(three.url) == _fleet.UNREADABLE and set(_fleet.known()) == {three.url}


def test_a_thread_that_cannot_start_is_reported_once_and_tried_again(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dynamo.instances = 2
    origin = ("http", dynamo.host, dynamo.port)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_faults, "_reported", set())  # reported once per process: start afresh
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        monkeypatch.setattr(threading.Thread, "start", refuse)
        assert _fleet.size_at(origin) is None and _fleet.size_at(origin) is None
        monkeypatch.setattr(threading.Thread, "start", _START)
    lines = [r.getMessage() for r in caplog.records if "fleet size" in r.getMessage()]
    assert len(lines) == 1 and "starting the read of a router's fleet size failed (RuntimeError)" in lines[0]
    _fleet.size_at(origin)  # no read left marked as running: this one starts
    assert _wait_known(dynamo.url) == 2


def test_a_router_read_again_is_said_once(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_fleet, "REREAD", 0.0)
    origin = ("http", dynamo.host, dynamo.port)
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        for reads in (1, 2):
            _fleet.size_at(origin)
            deadline = time.monotonic() + PATIENCE
            while origin in _fleet._reading:  # under way until the router has answered
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert len(dynamo.health_reads) == reads  # not PATIENCE's wait where no read was made
    assert len([r for r in caplog.records if "cannot be sized" in r.getMessage()]) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_read_is_under_way_reads_the_router_itself(dynamo: Recorder) -> None:
    """A rollout worker forked while the parent reads a router's size (and another thread holds the
    table's lock): the read is the parent's thread, which the child has not, so the child starts
    one of its own, on a lock of its own (left marked, it would never read that router again)."""
    dynamo.instances, dynamo.health_delay = 2, 0.5
    origin = ("http", dynamo.host, dynamo.port)
    assert _fleet.size_at(origin) is None and origin in _fleet._reading
    forked_while_held(
        _fleet._lock,
        lambda: not _fleet._reading and _fleet.size_at(origin) is None and origin in _fleet._reading,
    )
    assert _wait_known(dynamo.url) == 2


def test_a_read_still_in_flight_when_forgotten_is_not_kept(dynamo: Recorder) -> None:
    """unconfigure() forgets every size: a read it did not wait for must not bring its answer back
    into the next configuration (a test after another found the last one's router known)."""
    dynamo.instances, dynamo.health_delay = 4, 0.3
    origin = ("http", dynamo.host, dynamo.port)
    assert _fleet.size_at(origin) is None
    _fleet.forget()
    deadline = time.monotonic() + PATIENCE
    while not dynamo.health_reads and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.6)  # the answer (0.3 s late) has come back to the reading thread
    assert dynamo.health_reads and _fleet.known() == {}
    assert _fleet.size_at(origin) is None  # read afresh for the configuration now in force
    assert _wait_known(dynamo.url) == 4


class _Health(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def _health_of(body: bytes) -> tuple[int, str]:
    """``_fleet.read`` of a /health answering ``body`` whole, from a plain loopback server."""
    handler = type("Handler", (_Health,), {"body": body})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        try:
            return _fleet.read(("http", "127.0.0.1", server.server_address[1]), time.monotonic() + 5)
        finally:
            server.shutdown()


def test_a_health_of_exactly_the_cap_is_read_and_a_byte_more_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fleet, "CAP", 2**20)
    listed = json.dumps({"instances": [{"endpoint": "generate", "instance_id": i} for i in range(3)]})
    whole = listed.encode().ljust(2**20)  # JSON padded with spaces to the byte
    assert _health_of(whole) == (3, "")
    assert _health_of(whole + b" ") == (_fleet.UNREADABLE, "its /health is over 1 MiB")
    assert _health_of(b'{"instances": []}') == (
        _fleet.UNREADABLE,
        "its /health lists no workers (no instance serving generate)",
    )
    said = _health_of(b"\x1b]0;owned\x07\r\nnot json")[1]
    assert said.startswith("its /health cannot be read (JSONDecodeError: ") and "\r" not in said


def test_an_https_router_is_read_over_tls_and_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router reached over https: its /health is read over TLS, the certificate checked against the
    trusted CAs (a test CA, trusted as the system's through ``SSL_CERT_FILE``); one nobody trusts is
    not read."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    monkeypatch.setattr(_bounded_http, "_tls", None)  # made afresh, reading SSL_CERT_FILE
    listed = json.dumps({"instances": [{"endpoint": "generate", "instance_id": i} for i in range(2)]})
    handler = type("Handler", (_Health,), {"body": listed.encode()})
    for issuer, read in ((ca, (2, "")), (trustme.CA(), None)):
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        issuer.issue_cert("127.0.0.1").configure_cert(tls)
        with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
            server.socket = tls.wrap_socket(server.socket, server_side=True)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            try:
                said = _fleet.read(("https", "127.0.0.1", server.server_address[1]), time.monotonic() + 5)
            finally:
                server.shutdown()
        if read is not None:
            assert said == read
        else:
            assert said[0] == _fleet.UNREADABLE and "CERTIFICATE_VERIFY_FAILED" in said[1], said


class _Endless(_Health):
    """A /health that never ends: spaces until the client hangs up (no Content-Length)."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        try:
            while True:
                self.wfile.write(b" " * 65536)
        except OSError:
            pass


def test_a_health_that_never_ends_is_read_up_to_the_cap_not_to_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_fleet, "CAP", 2**20)
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endless) as server:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        try:
            began = time.monotonic()
            said = _fleet.read(("http", "127.0.0.1", server.server_address[1]), began + 5)
            took = time.monotonic() - began
        finally:
            server.shutdown()
    assert said == (_fleet.UNREADABLE, "its /health is over 1 MiB") and took < 2.5, (said, took)
