"""Real loopback HTTP servers that record every request's headers, for tests and benchmarks.

A ``Recorder`` is a Starlette app served by uvicorn on 127.0.0.1 in a background thread. It answers
OpenAI-style chat completions (so the real openai SDK can talk to it), can be told to fail the next
requests with a status (to drive client retries) and, for paths under ``/r/``, to redirect to
``redirect_to`` (to check what a redirect carries).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from tests.loopback import AsgiServer, Served


# Seconds a test waits for what a loopback peer or a background thread does within milliseconds: ample
# on a loaded CI machine. The mutation run sets TEST_PATIENCE lower (scripts/mutate.py), so a mutant
# that stops it from happening is killed in that time rather than in ten seconds.
def _patience() -> float:
    """TEST_PATIENCE's seconds; NaN where it is not a number (conftest's ``pytest_configure`` refuses
    the run with one line: a traceback while loading the conftest would be all the user saw)."""
    try:
        return float(os.environ.get("TEST_PATIENCE", "10"))
    except ValueError:
        return math.nan


PATIENCE = _patience()


@dataclass
class Seen:
    """One request as it arrived: raw header pairs in order, as bytes were decoded by the server."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    at: float = field(default_factory=time.monotonic)  # when it arrived (``time.monotonic``)

    def get(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    def names(self) -> set[str]:
        return {key.lower() for key, _ in self.headers}

    def values(self, name: str) -> list[str]:
        """Every value of header ``name`` (any casing), in order: a header sent twice shows twice."""
        return [value for key, value in self.headers if key.lower() == name.lower()]


@dataclass
class Recorder(Served):
    """A recording server; ``url`` is its base URL, ``requests`` what it saw."""

    host: str = "127.0.0.1"
    port: int = 0
    requests: list[Seen] = field(default_factory=list)
    fail_next: deque[int] = field(default_factory=deque)
    redirect_to: str | None = None
    tls: tuple[str, str] | None = None  # (certificate file, key file): serve https
    instances: int = 0  # workers its /health lists, as a Dynamo frontend's does (0: no list)
    health_reads: list[dict[str, str]] = field(default_factory=list)  # the headers of each GET /health
    health_delay: float = 0.0  # seconds /health takes to answer
    _served: AsgiServer | None = None
    _stopping: bool = False  # a /health still delayed answers at once: the server stops without waiting

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def clear(self) -> None:
        self.requests.clear()

    async def _handle(self, request: Request) -> Response:
        if (
            request.url.path == "/health"
        ):  # otel-session reading the fleet's size, not a request of the test's
            self.health_reads.append(dict(request.headers))
            answer_at = time.monotonic() + self.health_delay
            while not self._stopping and (left := answer_at - time.monotonic()) > 0:
                await asyncio.sleep(min(left, 0.02))
            if self.instances:
                listed = [{"endpoint": "generate", "instance_id": 7000 + i} for i in range(self.instances)]
                return JSONResponse({"status": "healthy", "instances": listed})
            return JSONResponse({"status": "healthy"})
        self.requests.append(
            Seen(
                request.method,
                request.url.path,
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]],
            )
        )
        if self.fail_next:
            return JSONResponse({"error": "injected failure"}, status_code=self.fail_next.popleft())
        if request.url.path.startswith("/r/") and self.redirect_to:
            return RedirectResponse(self.redirect_to + request.url.path[2:], status_code=307)
        if request.url.path.endswith("/chat/completions"):
            body = json.loads(await request.body() or b"{}")
            return JSONResponse(_completion(body))
        return JSONResponse({"ok": True})

    def start(self) -> Recorder:
        self._stopping = False
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST", "PUT"])])
        self._served = AsgiServer(app, host=self.host, port=self.port, tls=self.tls).__enter__()
        self.port = self._served.port
        return self

    def stop(self) -> None:
        self._stopping = True
        if self._served is not None:
            self._served.__exit__()

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _completion(body: dict[str, object]) -> dict[str, object]:
    messages = body.get("messages") or []
    return {
        "id": "chatcmpl-recorder",
        "object": "chat.completion",
        "created": 0,
        "model": body.get("model", "recorder"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"turn {len(messages)}"},  # type: ignore[arg-type]
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


async def wait_until(predicate: object, timeout: float = 5.0) -> None:
    """Poll ``predicate()`` until true (servers record asynchronously to the client returning)."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
