"""``doctor --watch``'s one GET is bounded in total, headers included: a peer that trickles its status
line and headers a byte at a time meets the deadline as a trickled body does (urllib's timeout is per
read, so it waited for as long as the peer liked). A real socket server over loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from otel_session.dynamo import watch

ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 30\r\n\r\n"
    b"dynamo_frontend_requests 1.0\n\n"
)


@pytest.fixture
def trickler() -> Iterator[str]:
    """Answers every connection one byte per 0.1 s, headers first."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(4096)
                    for byte in ANSWER:
                        if stop.is_set():
                            break
                        conn.sendall(bytes([byte]))
                        time.sleep(0.1)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/metrics"
    stop.set()
    thread.join(timeout=5)
    server.close()


def test_trickled_headers_meet_the_deadline(trickler: str) -> None:
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        watch.fetch(trickler, timeout=1.0)
    assert time.monotonic() - began < 2.0  # the headers alone take 7 s at this pace


@pytest.mark.parametrize("url", ["http:///metrics", "file:///etc/passwd", "ftp://127.0.0.1/x"])
def test_a_url_without_an_http_host_is_refused_before_any_request(url: str) -> None:
    with pytest.raises(ValueError, match="metrics endpoint"):
        watch.fetch(url, timeout=1.0)
