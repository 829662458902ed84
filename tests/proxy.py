"""A forward proxy on loopback that records what it is asked, and really relays.

It is a complete, if small, HTTP/1.1 forward proxy written for the tests (no proxy server package
runs here with a way to show the exact request lines and headers it received): ``CONNECT host:port``
opens a tunnel and relays bytes both ways, so TLS is end to end between client and server, and an
absolute-form request (``GET http://host:port/path``) is forwarded to its origin once, with
``Connection: close``. Every request head it receives is kept in ``seen``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field


@dataclass
class ProxyRequest:
    method: str
    target: str
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key.lower() == name.lower()), None)

    def names(self) -> set[str]:
        return {key.lower() for key, _ in self.headers}


@dataclass
class RecordingProxy:
    host: str = "127.0.0.1"
    port: int = 0
    seen: list[ProxyRequest] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(Exception):
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            pairs = (line.partition(":") for line in lines[1:] if ":" in line)
            headers = [(key.strip(), value.strip()) for key, _, value in pairs]
            self.seen.append(ProxyRequest(method, target, headers))
            if method == "CONNECT":
                host, _, port = target.rpartition(":")
                up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                await asyncio.gather(self._relay(reader, up_writer), self._relay(up_reader, writer))
                return
            rest = target.split("://", 1)[1]
            authority, _, path = rest.partition("/")
            host, _, port = authority.rpartition(":")
            length = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
            body = await reader.readexactly(length) if length else b""
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port or 80))
            kept = [(k, v) for k, v in headers if k.lower() not in {"proxy-connection", "connection"}]
            request = f"{method} /{path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in kept)
            up_writer.write((request + "Connection: close\r\n\r\n").encode("latin-1") + body)
            await up_writer.drain()
            while data := await up_reader.read(65536):
                writer.write(data)
            await writer.drain()
            up_writer.close()
        except Exception:
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def __enter__(self) -> RecordingProxy:
        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, self.host, self.port))
            self.port = self._server.sockets[0].getsockname()[1]
            started.set()
            loop.run_forever()
            self._server.close()
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
