"""One HTTP request to one peer, bounded in total by a deadline: look-up, connect, TLS, send, every read.

The standard library's timeouts bound one operation each, so a peer that answers a byte at a time, or
a resolver that hangs, would hold the caller for as long as it likes. Here every operation gets only
what is left until the deadline. The request goes straight to the peer with ``http.client``: no
proxy, no redirect followed, no hook of the application's.
"""

from __future__ import annotations

import http.client
import ipaddress
import math
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any

from otel_session import _faults

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

#: Name look-ups hanging at once, process-wide; beyond it no new one starts until one returns.
MAX_LOOKUPS = 64

Address = tuple[int, Any]  # (family, sockaddr)


def time_left(deadline: float) -> float:
    """Seconds until ``deadline``; ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no complete answer before the deadline")
    return left


class Peer:
    """One peer's address, looked up once, and requests to it that all end by ``deadline``."""

    def __init__(self, scheme: str, host: str, port: int | None, deadline: float) -> None:
        self.tls = scheme == "https"
        self.host = host.strip("[]")
        self.port = port if port is not None else (443 if self.tls else 80)
        self.deadline = deadline
        self._addresses: list[Address] | None = None

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str], cap: int) -> bytes:
        """One request on a fresh connection; the answer's body (up to ``cap`` bytes) if it is a 2xx.

        Anything else raises: a redirect too, since the request is meant for this peer and no other.
        """
        if self._addresses is None:
            self._addresses = _addresses(self.host, self.port, self.deadline)
        connection = _Connection(self, self._addresses)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read(cap)
            if response.length and len(payload) < cap:  # the peer closed before the length it announced
                raise http.client.IncompleteRead(payload, response.length)
        finally:
            connection.close()
        if not 200 <= response.status < 300:
            where = path.split("?")[0]  # a query may hold what a message must not show
            reason = _faults.one_line(response.reason, 80)
            raise http.client.HTTPException(f"HTTP {response.status} {reason} for {method} {where}")
        return payload


class _Connection(http.client.HTTPConnection):
    """``http.client`` on a socket whose every operation gets only what is left of the deadline."""

    def __init__(self, peer: Peer, addresses: list[Address]) -> None:
        super().__init__(peer.host, peer.port)
        self._peer = peer
        self._addresses = addresses

    def connect(self) -> None:
        peer = self._peer
        failure: OSError = OSError(f"no address for {peer.host}")
        for family, address in self._addresses:
            sock = _DeadlineSocket(family, socket.SOCK_STREAM)
            sock.deadline = peer.deadline
            try:
                sock.settimeout(time_left(peer.deadline))
                sock.connect(address)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if peer.tls:
                    sock.settimeout(time_left(peer.deadline))  # the handshake, in all
                    tls = _tls_context().wrap_socket(sock, server_hostname=peer.host)
                    if isinstance(tls, _DeadlineTLSSocket):
                        tls.deadline = peer.deadline
                    self.sock = tls
                else:
                    self.sock = sock
                return
            except OSError as exc:
                sock.close()
                failure = exc
                if isinstance(exc, TimeoutError):
                    break
        raise failure


class _DeadlineSocket(socket.socket):
    """A socket whose reads and writes each time out at what is left until ``deadline``."""

    deadline = math.inf

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(time_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self.settimeout(time_left(self.deadline))  # sendall's timeout is for all of it
        super().sendall(data, flags)


class _DeadlineTLSSocket(ssl.SSLSocket):
    """The same over TLS (its ``sendall`` calls ``send`` until all is sent)."""

    deadline = math.inf

    def recv_into(self, buffer: WriteableBuffer, nbytes: int | None = None, flags: int = 0) -> int:
        self.settimeout(time_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def send(self, data: ReadableBuffer, flags: int = 0) -> int:
        self.settimeout(time_left(self.deadline))
        return super().send(data, flags)


_tls: ssl.SSLContext | None = None


def _tls_context() -> ssl.SSLContext:
    """The default verifying context (as ``urllib`` uses), made at the first https request."""
    global _tls
    if _tls is None:
        context = ssl.create_default_context()
        context.sslsocket_class = _DeadlineTLSSocket
        _tls = context
    return _tls


# ----------------------------------------------------------------------------- name look-up


class _Lookup:
    """One ``getaddrinfo`` on its own thread, shared by every request for that (host, port) meanwhile.

    The resolver has no timeout of its own; a request waits for it only until its deadline, and
    requests to one peer never start a second look-up while one is running, so slow look-ups leave
    at most one thread per peer behind (and no more than :data:`MAX_LOOKUPS` in all).
    """

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.finished = threading.Event()
        self.result: list[Address] | OSError = OSError("not looked up")

    def run(self) -> None:
        host, port = self.key
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            self.result = [(family, address) for family, _, _, _, address in found]
        except OSError as exc:
            self.result = exc
        except Exception as exc:  # e.g. UnicodeError for a name IDNA refuses
            self.result = OSError(f"cannot look up {host!r}: {exc}")
        finally:
            with _lookups_lock:
                if _lookups.get(self.key) is self:
                    del _lookups[self.key]
            self.finished.set()


_lookups: dict[tuple[str, int], _Lookup] = {}
_lookups_lock = threading.Lock()


def _addresses(host: str, port: int, deadline: float) -> list[Address]:
    """Where ``host`` is, looked up within ``deadline``; an address literal needs no look-up."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        return [(family, address) for family, _, _, _, address in found]
    key = (host, port)
    with _lookups_lock:
        lookup = _lookups.get(key)
        if lookup is None:
            if len(_lookups) >= MAX_LOOKUPS:  # a resolver hanging for every name: start no more
                raise TimeoutError(f"{len(_lookups)} name look-ups are still hanging; not looking up {host}")
            lookup = _lookups[key] = _Lookup(key)
            try:
                threading.Thread(target=lookup.run, name="otel-session-lookup", daemon=True).start()
            except BaseException:
                del _lookups[key]
                raise
    if not lookup.finished.wait(time_left(deadline)):
        raise TimeoutError(f"looking up {host} did not finish before the deadline")
    if isinstance(lookup.result, OSError):
        raise lookup.result
    return lookup.result
