"""The header exactly as it crosses the wire: name spelling and value bytes, read from a raw socket.

uvicorn and aiohttp lower-case header names before an application sees them, so this test reads the
request bytes itself.
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import openai
import pytest

import otel_session


class RawServer:
    """Answers every request with a fixed 200 and keeps the raw request heads."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        self.heads.append(head)
        body = b'{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[]}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n")
        writer.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()


@pytest.mark.parametrize("kind", ["httpx", "openai", "aiohttp"])
async def test_header_name_and_value_on_the_wire(kind: str) -> None:
    async with RawServer() as server:
        url = f"http://127.0.0.1:{server.port}"
        otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"])
        async with otel_session.trajectory() as traj:
            if kind == "httpx":
                async with httpx.AsyncClient() as client:
                    await client.get(url)
            elif kind == "openai":
                async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
                    await client.chat.completions.create(model="m", messages=[])
            else:
                async with aiohttp.ClientSession() as session, session.get(url) as response:
                    await response.read()
        (head,) = [head for head in server.heads if not head.startswith(b"GET /health ")]
        lines = head.split(b"\r\n")
        expected = b"X-Dynamo-Session-ID: " + (traj.session_id or "").encode()
        assert expected in lines
        assert sum(line.lower().startswith(b"x-dynamo-session-id") for line in lines) == 1
