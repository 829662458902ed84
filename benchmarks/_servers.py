"""A fast loopback HTTP/1.1 server in its own process, for the benchmarks and the scale test.

The server runs in a child process so that its CPU time never lands in the client's
``time.process_time()``: the overhead benchmark compares client CPU only. It is a bare asyncio
protocol (uvloop when installed) rather than uvicorn + Starlette because a slow server makes every
client look cheap relative to a request's wall time; the faster the server, the harsher the "at
most 5% of a loopback request" budget.

Every request gets the same OpenAI-style chat completion, so the openai SDK can talk to it too.
With ``record=True`` it remembers, per request, the path and every session-related header, and
hands the list back on ``GET /__records`` (then forgets it), which is how the scale benchmark
checks each request against the trajectory that sent it. Requests under ``/__check`` are recorded
either way, so a timed run can check a few requests without paying for recording all of them.

Run as a script it prints one line, ``READY <port> <port> ...``, and serves until stdin closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECORDED = ("x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent")
CHECK_PATH = "/__check"  # requests under this path are recorded even when ``record`` is off

COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    },
    separators=(",", ":"),
).encode()


def http_response(body: bytes, content_type: bytes = b"application/json") -> bytes:
    """A complete keep-alive HTTP/1.1 response; also what the in-process aiohttp transport answers."""
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


COMPLETION_RESPONSE = http_response(COMPLETION)


def split_request(buffer: bytes) -> tuple[bytes, bytes, bytes] | None:
    """``(head, body, rest)`` for the first complete request in ``buffer``, ``None`` if incomplete.

    Requests are only ever sent by our own benchmark clients, so a minimal parser (Content-Length
    bodies, no chunked uploads) is enough and keeps the server cheap.
    """
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buffer[:end]
    length = 0
    lower = head.lower()
    at = lower.find(b"\r\ncontent-length:")
    if at >= 0:
        stop = lower.find(b"\r\n", at + 2)
        length = int(lower[at + 17 : stop if stop >= 0 else None].strip())
    start = end + 4
    if len(buffer) < start + length:
        return None
    return head, buffer[start : start + length], buffer[start + length :]


class _Protocol(asyncio.Protocol):
    """One keep-alive connection: answer each request as soon as its bytes are complete."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            parts = split_request(self.buffer)
            if parts is None:
                return
            head, _body, self.buffer = parts
            assert self.transport is not None
            self.transport.write(self.server.answer(head))


@dataclass
class _Server:
    record: bool
    records: list[dict[str, Any]] = field(default_factory=list)

    def answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        path = lines[0].split(" ")[1] if " " in lines[0] else ""
        if path == "/__records":
            records, self.records = self.records, []
            return http_response(json.dumps(records).encode())
        if self.record or path.startswith(CHECK_PATH):
            seen: dict[str, Any] = {"path": path}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name in RECORDED:
                    seen.setdefault(name, []).append(value.strip())
            self.records.append(seen)
        return COMPLETION_RESPONSE


async def _serve(hosts: Sequence[str], record: bool) -> None:
    loop = asyncio.get_running_loop()
    state = _Server(record)
    servers = [await loop.create_server(lambda: _Protocol(state), host, 0, backlog=4096) for host in hosts]
    ports = [srv.sockets[0].getsockname()[1] for srv in servers]
    print("READY", *ports, flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # the parent closes our stdin to stop us
    for srv in servers:
        srv.close()


def main(argv: Sequence[str]) -> None:
    hosts = [arg for arg in argv if not arg.startswith("--")] or ["127.0.0.1"]
    runner: Any = asyncio.run
    if "--no-uvloop" not in argv:
        with contextlib.suppress(ImportError):
            import uvloop

            runner = uvloop.run
    runner(_serve(hosts, record="--record" in argv))


class LoopbackServer:
    """Start ``_servers.py`` as a child process listening on each of ``hosts`` (all loopback).

    ``urls`` are the base URLs in the order of ``hosts``. ``records()`` fetches (and clears) what a
    recording server saw, over a plain socket so no client hook is involved.
    """

    def __init__(
        self, hosts: Sequence[str] = ("127.0.0.1",), record: bool = False, uvloop: bool = True
    ) -> None:
        self.hosts = list(hosts)
        args = [sys.executable, str(Path(__file__).resolve()), *self.hosts]
        if record:
            args.append("--record")
        if not uvloop:
            args.append("--no-uvloop")
        env = dict(os.environ, PYTHONPATH="")
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().decode().split()
        if not line or line[0] != "READY":
            self.close()
            raise RuntimeError(f"loopback server did not start: {line!r}")
        self.ports = [int(port) for port in line[1:]]

    @property
    def urls(self) -> list[str]:
        return [f"http://{host}:{port}" for host, port in zip(self.hosts, self.ports, strict=True)]

    @property
    def authorities(self) -> list[str]:
        return [f"{host}:{port}" for host, port in zip(self.hosts, self.ports, strict=True)]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def records(self, index: int = 0) -> list[dict[str, Any]]:
        """What the server recorded on any of its ports since the last call."""
        with socket.create_connection((self.hosts[index], self.ports[index])) as sock:
            sock.sendall(b"GET /__records HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            data = b""
            while True:
                parts = _split_response(data)
                if parts is not None:
                    return json.loads(parts)  # type: ignore[no-any-return]
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise RuntimeError("server closed before the records were complete")
                data += chunk

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> LoopbackServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split_response(data: bytes) -> bytes | None:
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = data[:end].lower()
    at = head.find(b"content-length:")
    length = int(head[at + 15 :].split(b"\r\n", 1)[0])
    body = data[end + 4 : end + 4 + length]
    return body if len(body) == length else None


class CannedTransport(asyncio.Transport):
    """An in-memory socket for aiohttp: each complete request written is answered with ``response``.

    aiohttp has no ``MockTransport``; giving its real ``ResponseHandler`` protocol a transport that
    answers in memory runs the whole client (request writer, response parser, connection pool, and
    ``ClientRequest.send`` where our hook sits) with no socket and no server CPU.
    """

    def __init__(
        self,
        protocol: asyncio.Protocol,
        response: bytes = COMPLETION_RESPONSE,
        on_request: Callable[[bytes], None] | None = None,
    ) -> None:
        super().__init__()
        self._protocol = protocol
        self._response = response
        self._on_request = on_request
        self._buffer = b""
        self._closing = False
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._buffer += bytes(data)
        while True:
            parts = split_request(self._buffer)
            if parts is None:
                return
            self._buffer = parts[2]
            if self._on_request is not None:
                self._on_request(parts[0])
            self._loop.call_soon(self._protocol.data_received, self._response)

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._loop.call_soon(self._protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False


def canned_aiohttp_connector(
    response: bytes = COMPLETION_RESPONSE, on_request: Callable[[bytes], None] | None = None
) -> Any:
    """An aiohttp connector whose connections are ``CannedTransport``s (pooled like real ones).

    ``on_request`` sees the head (request line and headers, as bytes) of every request written.
    """
    import aiohttp

    class _Connector(aiohttp.BaseConnector):
        async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
            protocol = self._factory()
            protocol.connection_made(CannedTransport(protocol, response, on_request))
            return protocol

    return _Connector()


if __name__ == "__main__":
    main(sys.argv[1:])
