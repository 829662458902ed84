"""Test helpers that more than one test module needs, written once.

- ``exited_unreaped(pid)``: whether a child process has exited, without reaping it (the harnesses
  that stop Phoenix and the routers by process group);
- the ``fleet`` fixture (three recording backends for a module's routers) and the autouse
  ``_fresh_records`` fixture that clears what they recorded before each test. A module uses them by
  importing both names: pytest finds fixtures in a module's namespace, and an imported autouse
  fixture applies to that module only;
- ``DynamoProxy``: a recording forwarder in front of the real local Dynamo, so a test can see on the
  wire what a driver process sent and which worker served it (``Forwarded``, one per request). The
  end-to-end tests of NeMo-RL and verifiers read what they need from the recorded bodies themselves;
- ``run_zero_code``: runs such a test's driver (no otel-session code in it) under
  ``opentelemetry-instrument``, configured by environment variables only, and reads back its report;
- ``chat(prompt)``: a chat completion's request body of one user message, as the client hooks'
  tests send it (the prompt a group is read from).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from otel_session.dynamo import worker_id_of
from tests.gym_servers import ROOT, AiohttpServer

if TYPE_CHECKING:
    from tests.routers import Backend


def chat(prompt: str) -> dict[str, Any]:
    """A chat completion's request body: model ``m``, one user message ``prompt``."""
    return {"model": "m", "messages": [{"role": "user", "content": prompt}]}


_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


def exited_unreaped(pid: int) -> bool:
    """Has our child ``pid`` exited? It is left a zombie (not reaped), so its PID, and the process
    group ID it may name, cannot have been reused yet."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def forked_while_held(lock: Any, in_child: Callable[[], bool]) -> None:
    """Fork while another thread holds ``lock`` (a module's, as a rollout worker may fork mid-request);
    ``in_child()`` runs in the child, which exits 0 where it says true. Fails where it says false or
    hangs on the lock it inherited (killed after 10 s)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            code = 0 if in_child() else 2
        finally:
            os._exit(code)
    release.set()
    holder.join(10)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the lock it inherited")
    assert os.waitstatus_to_exitcode(done[1]) == 0


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[Backend]]:
    """Three recording OpenAI-style backends, for the routers a module starts in front of them."""
    from tests.routers import backends  # here: tests.routers imports this module

    with backends(3) as started:
        yield started


@pytest.fixture(autouse=True)
def _fresh_records(fleet: list[Backend]) -> None:
    """Each test sees only the requests it sent."""
    for backend in fleet:
        backend.seen.clear()


# Dynamo 1.6.1's 529 to a new session once its affinity table is full (results/capacity-hard.json)
TABLE_FULL_BODY = '{"message":"Service temporarily overloaded","type":"Overloaded","code":529}'


@dataclass
class Forwarded:
    """One request to Dynamo as the proxy saw it, and its answer (``worker``: the Dynamo instance id
    of the worker that served it, when the answer names one)."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    status: int = 0
    worker: int | None = None
    answer: bytes = b""

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def json(self) -> Any:
        return json.loads(self.body)


def _worker_of(payload: bytes) -> int | None:
    """Dynamo's worker id from a JSON body or from any chunk of an SSE stream."""
    for line in payload.splitlines():
        data = line.removeprefix(b"data:").strip()
        if data.startswith(b"{") and (worker := worker_id_of(json.loads(data))) is not None:
            return worker
    return None


@dataclass
class DynamoProxy:
    """A forwarder to the real Dynamo frontend that records each request in ``requests``. Headers and
    body are never changed, and streamed answers are passed on whole, so Dynamo routes exactly what the
    driver sent. ``fail_once`` picks one request that the proxy answers 503 itself instead of
    forwarding it (to drive a client's retry); it is dropped after its first match. ``balance``: more
    upstreams, taken in turn with ``upstream`` request by request (a round-robin balancer in front of
    several frontends). ``table_full``: a request carrying ``X-Dynamo-Session-ID`` is answered
    Dynamo 1.6.1's own 529 for a full affinity table instead (the body benchmarks/capacity.py recorded),
    one without it is forwarded, as the real frontend does once its 65,536 bindings are taken."""

    upstream: str
    fail_once: Callable[[Forwarded], bool] | None = None
    table_full: bool = False
    requests: list[Forwarded] = field(default_factory=list)
    balance: Sequence[str] = ()
    health_reads: int = 0  # GET /health (otel-session reading the fleet's size): forwarded, not recorded
    _server: AiohttpServer | None = None

    def _app(self) -> web.Application:
        client_key = web.AppKey("client", aiohttp.ClientSession)

        async def client(app: web.Application) -> AsyncIterator[None]:
            app[client_key] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(120))
            yield
            await app[client_key].close()

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP)
            if request.path == "/health":  # not a request of the driver's: the library's own look
                self.health_reads += 1
                async with request.app[client_key].get(f"{self.upstream}/health") as upstream:
                    return web.Response(status=upstream.status, body=await upstream.read())
            seen = Forwarded(request.method, request.path, list(headers.items()), body)
            self.requests.append(seen)
            if self.fail_once is not None and self.fail_once(seen):
                self.fail_once = None
                seen.status = 503
                return web.json_response({"error": {"message": "busy (harness)"}}, status=503)
            if self.table_full and seen.header("x-dynamo-session-id") is not None:
                seen.status = 529
                return web.Response(status=529, text=TABLE_FULL_BODY, content_type="application/json")
            upstreams = [self.upstream, *self.balance]
            target = upstreams[(len(self.requests) - 1) % len(upstreams)]
            async with request.app[client_key].request(
                request.method, f"{target}{request.path_qs}", headers=headers, data=body
            ) as upstream:
                payload = await upstream.read()
                seen.answer = payload
                seen.status = upstream.status
                content_type = upstream.headers.get("Content-Type", "application/json")
            seen.worker = _worker_of(payload)
            return web.Response(status=seen.status, body=payload, headers={"Content-Type": content_type})

        app = web.Application()
        app.cleanup_ctx.append(client)
        app.router.add_route("*", "/{tail:.*}", forward)
        return app

    @property
    def authority(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.port}"

    def __enter__(self) -> DynamoProxy:
        self._server = AiohttpServer(self._app()).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.__exit__(*exc)


def run_zero_code(
    argv: Sequence[str],
    *,
    dynamo: str,
    env: Mapping[str, str],
    timeout: float,
    drop: tuple[str, ...] = ("OTEL_", "PYTHON"),
) -> tuple[dict[str, Any], str]:
    """Run ``argv`` (``opentelemetry-instrument python DRIVER ...``) from the repository root, set up by
    environment variables only: this process's without those starting with ``drop`` (our own settings,
    and whatever would point the driver's interpreter at other packages), then the otel_session distro
    with ``OTEL_SESSION_DYNAMO_HOSTS=dynamo``, then ``env``. The driver must exit 0 without a traceback
    and print its report as the last line of stdout; returns that report and the driver's stderr."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    ours = {"OTEL_PYTHON_DISTRO": "otel_session", "OTEL_SESSION_DYNAMO_HOSTS": dynamo}
    result = subprocess.run(
        list(argv), cwd=ROOT, env=clean | ours | dict(env), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


_reader: Any = None
_prometheus: str | None = None


def metrics_reader() -> Any:
    """The real OpenTelemetry SDK reader this test process counts into: a ``MeterProvider`` with an
    ``InMemoryMetricReader`` (and a ``PrometheusMetricReader``, served by ``prometheus_url``) set as
    the global one the first time (the global can be set only once)."""
    global _reader
    if _reader is None:
        from opentelemetry import metrics
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        _reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[_reader, PrometheusMetricReader()]))
    return _reader


def prometheus_url() -> str:
    """The same metrics as a Prometheus endpoint on loopback (prometheus_client's own server), as an
    application exporting them would serve them."""
    global _prometheus
    metrics_reader()
    if _prometheus is None:
        from prometheus_client import start_http_server

        from tests.loopback import bind_loopback

        sock = bind_loopback()
        port = sock.getsockname()[1]
        sock.close()
        start_http_server(port, addr="127.0.0.1")
        _prometheus = f"http://127.0.0.1:{port}/metrics"
    return _prometheus


def metric_points() -> dict[tuple[str, frozenset[tuple[str, Any]]], int]:
    """Every sum of otel-session's the reader holds now: (metric name, its attributes) -> cumulative
    value. Other libraries' instruments (an upstream instrumentation's duration histograms, once a
    provider is set) are not ours to compare."""
    points: dict[tuple[str, frozenset[tuple[str, Any]]], int] = {}
    data = metrics_reader().get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if not metric.name.startswith("otel_session."):
                    continue
                for point in metric.data.data_points:
                    points[(metric.name, frozenset(point.attributes.items()))] = point.value
    return points


def metric_delta(
    before: Mapping[tuple[str, frozenset[tuple[str, Any]]], int], name: str, **attributes: Any
) -> int:
    """How much metric ``name`` grew since ``before``, over every point holding ``attributes``
    (dots in attribute names written as ``__``)."""
    wanted = {(key.replace("__", "."), value) for key, value in attributes.items()}
    return sum(
        value - before.get(key, 0)
        for key, value in metric_points().items()
        if key[0] == name and wanted <= key[1]
    )
