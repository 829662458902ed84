"""An outside attack on the sixth round's surfaces (issue 34, item 3): sibling group keys, named
boundaries' group specs, the run-time evidence read from router responses, and ``doctor --watch``.
Written from README.md and docs/ only, through the public API over loopback to real servers; each
test here failed before the fix committed with it (the commit message says what it showed)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import http.server
import importlib
import json
import logging
import multiprocessing
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

import otel_session
from otel_session import PARENT_SESSION_HEADER, SESSION_HEADER
from tests.gym_servers import AiohttpServer
from tests.recorder import Recorder
from tests.support import metric_delta, metric_points, metrics_reader, prometheus_url


class HashRaises:
    """A group key whose ``__hash__`` raises something other than ``TypeError`` (a lazy record whose
    hash reads a field not loaded yet, say)."""

    def __hash__(self) -> int:
        raise RuntimeError("hash exploded")


class Shifting:
    """A group key hashed by a field the application changes while the attempt runs."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shifting) and other.name == self.name


def test_a_group_key_whose_hash_raises_still_opens_an_attempt_with_a_session(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="groups:2")
    with otel_session.trajectory(group=HashRaises()) as attempt, httpx.Client() as client:
        assert client.get(f"{dynamo.url}/h", timeout=10).status_code == 200
    assert dynamo.requests[0].get(SESSION_HEADER) == attempt.session_id
    assert dynamo.requests[0].get(PARENT_SESSION_HEADER) is None


class BreaksLater:
    """A group key whose ``__hash__`` works until the application flips ``broken``."""

    broken = False

    def __hash__(self) -> int:
        if BreaksLater.broken:
            raise RuntimeError("hash exploded later")
        return 11


def _traced_growth(attempts: Callable[[int], None], count: int) -> int:
    """Bytes otel-session's own code allocated and still holds after ``count`` attempts (and a
    warm-up), as tracemalloc counts them: the interpreter's own caches are not ours to bound."""
    for index in range(200):
        attempts(index)
    gc.collect()
    ours = [tracemalloc.Filter(True, "*/otel_session/*")]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(ours)
        for index in range(count):
            attempts(index)
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(ours)
    finally:
        tracemalloc.stop()
    return sum(stat.size_diff for stat in after.compare_to(before, "filename"))


def test_group_keys_changed_or_broken_during_their_attempts_leave_no_state_behind() -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="groups:2")

    def shifting(index: int) -> None:
        key = Shifting(f"before-{index}")
        with otel_session.trajectory(group=key):
            key.name = f"after-{index}"  # its hash now differs from the one it joined under

    def breaking(index: int) -> None:
        with otel_session.trajectory(group=BreaksLater()):
            BreaksLater.broken = True
        BreaksLater.broken = False

    # measured on the unfixed code: ~430 bytes a shifted attempt (430 MB over a million attempts)
    grown = {"shifting": _traced_growth(shifting, 5000), "breaking": _traced_growth(breaking, 5000)}
    assert all(size < 60_000 for size in grown.values()), grown


def test_every_way_an_attempt_ends_leaves_no_group_state_behind() -> None:
    """Raised, cancelled, a generator closed early or dropped, unconfigure() and configure() again
    mid-attempt: each one's group is forgotten (1M such attempts: RSS flat, see the commit)."""
    configure = functools.partial(otel_session.configure, dynamo_hosts=["127.0.0.1:9"], siblings="groups:2")
    configure()

    def rollout(key: int) -> Generator[int, None, None]:
        with otel_session.trajectory(group=key):
            yield 1
            yield 2

    async def cancelled(key: int) -> None:
        async def attempt() -> None:
            async with otel_session.trajectory(group=key):
                await asyncio.sleep(10)

        task = asyncio.ensure_future(attempt())
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def ending(index: int) -> None:
        key, way = index % 7, index % 5
        if way == 0:
            with contextlib.suppress(ValueError), otel_session.trajectory(group=key):
                raise ValueError
        elif way == 1:
            steps = rollout(key)
            next(steps)
            steps.close()
        elif way == 2:
            next(rollout(key))  # dropped half-way: closed by the collector
        elif way == 3:
            asyncio.run(cancelled(key))
        elif index % 50 == 4:  # configure() is slow: a tenth of these
            with otel_session.trajectory(group=key):
                otel_session.unconfigure()
                configure()
        else:
            with otel_session.trajectory(group=key):
                pass

    grown = _traced_growth(ending, 3000)
    assert grown < 60_000, grown  # ~15 KB here (the last configure()'s state); 155 KB without leave()


def _two_steps_of_two_siblings(url: str) -> None:
    """In a forked worker: two GRPO steps one after the other, each two siblings of prompt "g" open at
    once, each sending one request to the Dynamo host."""

    async def sibling(step: int, index: int, opened: list[int], both_open: asyncio.Event) -> None:
        async with otel_session.trajectory(group="g"), httpx.AsyncClient() as client:
            opened.append(index)
            if len(opened) == 2:
                both_open.set()
            await both_open.wait()
            await client.get(f"{url}/step{step}/{index}", timeout=10)

    async def steps() -> None:
        for step in range(2):
            opened: list[int] = []
            both_open = asyncio.Event()
            await asyncio.gather(*(sibling(step, index, opened, both_open) for index in range(2)))

    asyncio.run(steps())


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_worker_forked_during_an_attempt_groups_its_own_siblings_afresh(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="groups:2")
    with otel_session.trajectory(group="g") as launcher:  # the group is open as the worker forks
        worker = multiprocessing.get_context("fork").Process(
            target=_two_steps_of_two_siblings, args=(dynamo.url,)
        )
        worker.start()
        worker.join(30)
    assert worker.exitcode == 0
    parents = {seen.path: seen.get(PARENT_SESSION_HEADER) for seen in dynamo.requests}
    step0, step1 = [(parents[f"/step{step}/0"], parents[f"/step{step}/1"]) for step in range(2)]
    # each step's two siblings under one parent of their own, never the launcher's, never shared by steps
    assert step0[0] is not None and step0[0] == step0[1] != launcher.parent_session_id, parents
    assert step1[0] is not None and step1[0] == step1[1] and step1[0] not in step0, parents


BOUNDARIES = """
import httpx
from collections.abc import Mapping

URL = None

class Lazy(Mapping):
    '''A task record whose items load on access, and fail to.'''
    def __getitem__(self, key):
        raise RuntimeError("store unreachable")
    def __iter__(self):
        return iter(["prompt"])
    def __len__(self):
        return 1

class Rows(list):
    def __getitem__(self, index):
        raise RuntimeError("rows unreachable")

class Odd(dict):
    '''Its JSON encoding runs the application's own code, which raises.'''
    def items(self):
        raise RuntimeError("items unreachable")

def run_episode(task, label):
    return httpx.get(f"{URL}/{label}", timeout=10).status_code

def run_sample(input_sample, label):  # NeMo-RL's argument name: its conversation is read for a group
    return httpx.get(f"{URL}/{label}", timeout=10).status_code
"""


@pytest.mark.parametrize(
    ("spec", "task"),
    [("task.prompt", "Lazy()"), ("task.0", "Rows([1])"), ("task|digest", "Odd(a=1)")],
)
def test_a_group_path_whose_container_raises_still_opens_the_attempt(
    dynamo: Recorder, new_module: Callable[[str, str], str], spec: str, task: str
) -> None:
    name = new_module("raising_paths", BOUNDARIES)
    entry = f"{name}:run_episode[group={spec}]"
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[entry])
    module = importlib.import_module(name)
    module.URL = dynamo.url
    assert module.run_episode(eval(task, vars(module)), "a") == 200
    assert dynamo.requests[0].get(SESSION_HEADER) is not None  # an attempt, only without a group


def test_a_sample_whose_mapping_raises_still_opens_the_attempt(
    dynamo: Recorder, new_module: Callable[[str, str], str]
) -> None:
    name = new_module("raising_sample", BOUNDARIES)
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{name}:run_sample"])
    module = importlib.import_module(name)
    module.URL = dynamo.url
    assert module.run_sample(module.Lazy(), "s") == 200
    assert dynamo.requests[0].get(SESSION_HEADER) is not None


class HealthyRouter:
    """An OpenAI-style router stand-in whose worker caches are perfect: each (session, model) is
    pinned to one worker, and every turn finds the previous turn's whole prompt in its cache. What it
    reports, and how, is the attack: ``usage`` in every stream chunk (vLLM's continuous usage stats),
    absurd token counts. A prompt is counted as 100 tokens a message."""

    def __init__(self) -> None:
        self.cached: dict[tuple[str | None, str], int] = {}
        self.every_chunk = False
        self.prompt_tokens: int | None = None  # forced, where the attack says so
        self.server: AiohttpServer | None = None

    def _usage(self, request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
        key = (request.headers.get(SESSION_HEADER), str(body.get("model"))[:64])
        asked = "worker_id" in (body.get("nvext") or {}).get("extra_fields", ())  # as Dynamo: if asked
        prompt = 100 * len(body.get("messages") or [])
        cached, self.cached[key] = self.cached.get(key, 0), prompt
        if self.prompt_tokens is not None:
            prompt, cached = self.prompt_tokens, self.prompt_tokens // 2
        return {  # type: ignore[no-any-return]
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": 1,
                "total_tokens": prompt + 1,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        } | ({"nvext": {"worker_id": {"decode_worker_id": hash(key) % 1000}}} if asked else {})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        evidence = self._usage(request, body)
        head = {"id": "c", "created": 0, "model": body.get("model")}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "ok"}
            choices = [{"index": 0, "message": message, "finish_reason": "stop"}]
            return web.json_response({**head, "object": "chat.completion", "choices": choices, **evidence})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(3):
            chunk = {
                **head,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": "o"}}],
            }
            await response.write(
                f"data: {json.dumps({**chunk, **(evidence if self.every_chunk else {})})}\n\n".encode()
            )
        last = {**head, "object": "chat.completion.chunk", "choices": [], **evidence}
        await response.write(f"data: {json.dumps(last)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    @property
    def base_url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}/v1"


@pytest.fixture
def healthy(caplog: pytest.LogCaptureFixture) -> Iterator[HealthyRouter]:
    metrics_reader()  # the process's MeterProvider (set once), so the counts flow somewhere
    caplog.set_level(logging.WARNING, "otel_session")
    served = HealthyRouter()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", served.chat)
    with AiohttpServer(app) as server:
        served.server = server
        otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"])
        yield served


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


async def _conversations(healthy: HealthyRouter, sessions: int, turns: int, ask: Ask) -> None:
    """``sessions`` trajectories at once, each ``turns`` turns whose conversation grows by a message."""

    async def conversation(client: openai.AsyncOpenAI, http: aiohttp.ClientSession) -> None:
        async with otel_session.trajectory():
            messages: list[Any] = [{"role": "user", "content": "go"}]
            for _ in range(turns):
                await ask(client, http, messages)
                messages.append({"role": "user", "content": "more"})

    client = openai.AsyncOpenAI(base_url=healthy.base_url, api_key="-", max_retries=0)
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(conversation(client, http) for _ in range(sessions)))
    await client.close()


Ask = Callable[[openai.AsyncOpenAI, aiohttp.ClientSession, list[Any]], Awaitable[None]]
NVEXT: Any = {"nvext": {"extra_fields": ["worker_id"]}}


async def _streamed(client: openai.AsyncOpenAI, http: aiohttp.ClientSession, messages: list[Any]) -> None:
    stream = await client.chat.completions.create(
        model="policy",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # vLLM's: no nvext
    )
    async for _ in stream:
        pass


async def _read_twice(client: openai.AsyncOpenAI, http: aiohttp.ClientSession, messages: list[Any]) -> None:
    url = f"{str(client.base_url).rstrip('/')}/chat/completions"
    async with http.post(url, json={"model": "policy", "messages": messages}) as response:
        assert await response.json() == await response.json()  # an application that reads it twice


async def _with_a_judge(client: openai.AsyncOpenAI, http: aiohttp.ClientSession, messages: list[Any]) -> None:
    await client.chat.completions.create(model="policy", messages=messages, extra_body=NVEXT)
    judged = [{"role": "system", "content": "judge this"}, *messages]  # a second model, same session
    await client.chat.completions.create(model="judge", messages=judged, extra_body=NVEXT)


@pytest.mark.parametrize(
    ("ask", "every_chunk"),
    [(_streamed, True), (_read_twice, False), (_with_a_judge, False)],
    ids=["usage-in-every-chunk", "body-read-twice", "two-models-one-session"],
)
def test_a_healthy_router_is_never_called_broken(
    healthy: HealthyRouter, caplog: pytest.LogCaptureFixture, ask: Ask, every_chunk: bool
) -> None:
    healthy.every_chunk = every_chunk
    before = metric_points()
    asyncio.run(_conversations(healthy, sessions=12, turns=4, ask=ask))
    assert _warnings(caplog) == []
    calls = 2 if ask is _with_a_judge else 1
    assert metric_delta(before, "otel_session.turns") == 12 * 4 * calls  # one turn a response
    assert metric_delta(before, "otel_session.worker_checks", otel_session__worker__switched=True) == 0


@pytest.mark.parametrize("tokens", [2**63, 10**400], ids=["2**63", "10**400"])
def test_absurd_token_counts_never_poison_the_applications_metric_export(
    healthy: HealthyRouter, caplog: pytest.LogCaptureFixture, tokens: int
) -> None:
    """A JSON integer too big for an int64 (or a float): counted, it would stay in the cumulative sum
    for the rest of the run, and every later OTLP export (and Prometheus scrape) of the application's
    metrics would fail on it."""
    healthy.prompt_tokens = tokens

    async def ask(client: openai.AsyncOpenAI, http: aiohttp.ClientSession, messages: list[Any]) -> None:
        reply = await client.chat.completions.create(model="policy", messages=messages)
        assert reply.usage is not None and reply.usage.prompt_tokens == tokens  # the application's, as sent

    asyncio.run(_conversations(healthy, sessions=1, turns=2, ask=ask))
    encode_metrics(metrics_reader().get_metrics_data()).SerializeToString()  # what OTLP exporters send
    scraped = httpx.get(prometheus_url(), timeout=10)
    assert scraped.status_code == 200 and "otel_session_requests_total" in scraped.text
    assert _warnings(caplog) == []


def _endless_server() -> tuple[socket.socket, threading.Thread]:
    """A loopback HTTP server answering every GET 200 with a body that never ends (1 MiB at a time,
    as fast as the reader takes it, for up to 20 s): a wrong port, a log stream, a misbehaving proxy."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)

    def serve() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                conn, _ = listener.accept()
            except OSError:
                if listener.fileno() < 0:
                    return
                continue
            with conn, contextlib.suppress(OSError):
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
                while time.monotonic() < deadline:
                    conn.sendall(b"x" * 1048576)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_doctor_watch_against_an_endless_body_stops_in_bounded_memory() -> None:
    listener, _ = _endless_server()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"

    def limited() -> None:  # the unbounded read took 4.7 GB in its 10 s; 1.5 GB of address space here
        resource.setrlimit(resource.RLIMIT_AS, (1536 * 2**20, 1536 * 2**20))

    try:
        done = subprocess.run(
            [str(Path(sys.executable).with_name("otel-session")), "doctor", "--watch", url, "--samples", "1"],
            capture_output=True,
            text=True,
            timeout=40,
            check=False,
            preexec_fn=limited,
        )
    finally:
        listener.close()
    said = done.stdout + done.stderr
    assert "Traceback" not in said and "MemoryError" not in said, said[-2000:]
    assert done.returncode == 1 and f"cannot read {url}" in said, said[-2000:]


class Pages:
    """A loopback HTTP server answering each GET with the next of ``pages`` (the last one repeated),
    as a Collector's Prometheus endpoint would over successive scrapes."""

    def __init__(self, pages: list[str]) -> None:
        self.pages = list(pages)
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                page = (served.pages.pop(0) if len(served.pages) > 1 else served.pages[0]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # a 50 ms poll: shutdown() waits up to one (0.5 s by default) for serve_forever to notice
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _doctor_watch(url: str, samples: int = 1) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).with_name("otel-session")), "doctor", "--watch", url]
    return subprocess.run(
        [*command, "--interval", "1", "--samples", str(samples)],
        capture_output=True,
        text=True,
        timeout=40,
        check=False,
    )


def _page(**processes: tuple[int, int, int]) -> str:
    """A Collector's page of two trainer processes' later turns: (turns, prompt tokens, cached)."""
    lines = []
    for instance, (turns, prompt, cached) in processes.items():
        labels = f'instance="{instance}",otel_session_turn="later"'
        lines += [
            f"otel_session_turns_total{{{labels}}} {turns}",
            f"otel_session_prompt_tokens_total{{{labels}}} {prompt}",
            f"otel_session_cached_tokens_total{{{labels}}} {cached}",
        ]
    return "\n".join(lines) + "\n"


def test_doctor_watch_reads_a_restarted_processs_counters_as_prometheus_does() -> None:
    """Process b restarts between two scrapes (its counters start again from zero) while a runs on;
    both serve 90 % of every later turn's prompt from cache: healthy, not broken."""
    pages = Pages(
        [
            _page(a=(100, 100_000, 90_000), b=(100, 196_000, 180_000)),
            _page(a=(300, 300_000, 270_000), b=(1, 1_000, 900)),
        ]
    )
    try:
        done = _doctor_watch(pages.url)
    finally:
        pages.close()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "later turns 201, 90% of their prompt cached" in done.stdout and "-> healthy" in done.stdout


@pytest.mark.parametrize(
    "page",
    ["<!doctype html><html><body>Dynamo</body></html>\n", '{"object":"list","data":[{"id":"qwen"}]}'],
    ids=["html", "the-models-list"],
)
def test_doctor_watch_at_a_page_that_is_no_metrics_says_so_at_once(page: str) -> None:
    pages = Pages([page])  # the frontend's base URL or /v1/models given instead of /metrics
    try:
        done = _doctor_watch(pages.url, samples=3)
    finally:
        pages.close()
    said = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1 and "too little traffic" not in done.stdout, said
    assert said[-1].startswith(f"otel-session: cannot read {pages.url} (") and len(said) == 2, said


@pytest.mark.parametrize("url", ["file:///etc/hostname", "ftp://127.0.0.1:1/metrics"])
def test_doctor_watch_reads_http_only(url: str) -> None:
    done = _doctor_watch(url)
    assert done.returncode == 1 and f"cannot read {url} (" in done.stderr, done.stdout + done.stderr
    assert "http" in done.stderr.rsplit("(", 1)[-1]


class Stalling:
    """A group key whose equality waits for ``go``: an application's own ``__eq__`` doing I/O, say."""

    go = threading.Event()

    def __hash__(self) -> int:
        return 5

    def __eq__(self, other: object) -> bool:
        Stalling.go.wait(10)
        return self is other


def test_a_child_forked_while_other_threads_are_inside_the_group_table_does_not_hang(
    dynamo: Recorder,
) -> None:
    """Thread A compares group keys (the table's lock held); thread B's first request to a router
    decides its inferred group and waits for A. A process forked then must still open attempts of its
    own, grouped or not, rather than wait for threads it does not have."""
    otel_session.configure(dynamo_hosts=[dynamo.url], siblings="groups:2")
    Stalling.go.clear()
    prompt: Any = {"model": "m", "messages": [{"role": "user", "content": "same"}]}

    def stalled() -> None:
        with otel_session.trajectory(group=Stalling()):
            pass

    def inferred() -> None:
        with otel_session.trajectory(), httpx.Client() as client:
            client.post(f"{dynamo.url}/v1/chat/completions", json=prompt, timeout=10)

    held = threading.Event()

    def holder() -> None:  # a sibling open in the table, so the next key is compared with it
        with otel_session.trajectory(group=Stalling()):
            held.set()
            Stalling.go.wait(10)

    threads = [threading.Thread(target=target) for target in (holder, stalled, inferred)]
    threads[0].start()
    held.wait(10)
    for thread in threads[1:]:
        thread.start()
        time.sleep(0.3)  # A in __eq__ holding the table's lock, then B deciding and waiting for it
    try:
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
                signal.alarm(5)  # a hang ends the child with SIGALRM
                with otel_session.trajectory(group="child"):
                    pass
                inferred()
                code = 0
            finally:
                os._exit(code)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        Stalling.go.set()
        for thread in threads:
            thread.join(10)
    assert status == 0, f"the forked child hung or failed: {status}"


RAISING_PROVIDER = """
import asyncio, sys
import aiohttp, httpx
from opentelemetry import metrics
from opentelemetry.metrics import NoOpCounter, NoOpMeter, NoOpMeterProvider

class Raising(NoOpCounter):
    def add(self, amount, attributes=None, context=None):
        raise RuntimeError("the exporter bridge is down")

class Meter(NoOpMeter):
    def create_counter(self, name, unit="", description=""):
        return Raising(name)

class Provider(NoOpMeterProvider):
    '''A provider whose counters raise: a broken bridge to a vendor's metrics. The SDK's own never
    raises, so this one is written here; the API's classes are what such a bridge subclasses.'''
    def get_meter(self, name, version=None, schema_url=None, attributes=None):
        return Meter(name)

url, when = sys.argv[1], sys.argv[2]
if when == "before":
    metrics.set_meter_provider(Provider())
import otel_session
otel_session.configure(dynamo_hosts=[url])
if when == "after":
    metrics.set_meter_provider(Provider())
httpx.get(f"{url}/outside", timeout=10)
with otel_session.trajectory():
    httpx.get(f"{url}/httpx", timeout=10)

async def aio():
    async with otel_session.trajectory(), aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", json={"messages": []}) as reply:
            await reply.json()

asyncio.run(aio())
print("done")
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_meter_provider_whose_counters_raise_never_fails_a_trajectory_or_drops_a_session(
    dynamo: Recorder, tmp_path: Path, when: str
) -> None:
    script = tmp_path / "raising_provider.py"
    script.write_text(RAISING_PROVIDER)
    command = [sys.executable, str(script), dynamo.url, when]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-3000:]
    carried = {seen.path: seen.get(SESSION_HEADER) for seen in dynamo.requests}
    assert carried["/outside"] is None
    assert carried["/httpx"] and carried["/v1/chat/completions"], carried


RAISING_TRACER = """
import sys
import httpx
from opentelemetry import trace
from opentelemetry.trace import NoOpTracer, NoOpTracerProvider

class Tracer(NoOpTracer):
    def start_span(self, *args, **kwargs):
        raise RuntimeError("the tracing bridge is down")

class Provider(NoOpTracerProvider):
    '''A provider whose spans cannot start: a broken bridge to a vendor's tracing (the SDK's own never
    raises, so this one is written here, on the API's classes such a bridge subclasses).'''
    def get_tracer(self, *args, **kwargs):
        return Tracer()

trace.set_tracer_provider(Provider())
import otel_session
otel_session.configure(dynamo_hosts=[sys.argv[1]])
with otel_session.trajectory():
    httpx.get(f"{sys.argv[1]}/traced", timeout=10)
print("done")
"""


def test_a_tracer_provider_whose_spans_cannot_start_never_fails_a_trajectory(
    dynamo: Recorder, tmp_path: Path
) -> None:
    script = tmp_path / "raising_tracer.py"
    script.write_text(RAISING_TRACER)
    command = [sys.executable, str(script), dynamo.url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-3000:]
    assert dynamo.requests[0].get(SESSION_HEADER)


def test_a_router_naming_huge_models_leaves_nothing_behind(healthy: HealthyRouter) -> None:
    """Turns are compared per model, by the name the router answers with: a garbage router echoing a
    512 KiB name must not have each one kept with the session's last turn."""

    async def ask(client: openai.AsyncOpenAI, http: aiohttp.ClientSession, messages: list[Any]) -> None:
        url = f"{str(client.base_url).rstrip('/')}/chat/completions"
        model = f"{len(messages)}-" + "m" * 2**19  # under the server's 1 MiB request limit
        async with http.post(url, json={"model": model, "messages": messages}) as response:
            await response.json()

    asyncio.run(_conversations(healthy, sessions=2, turns=1, ask=ask))  # warm-up: imports, pools
    gc.collect()
    server_side = [tracemalloc.Filter(False, "*/aiohttp/web_*")]  # the stand-in router's own buffers
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(server_side)
        asyncio.run(_conversations(healthy, sessions=8, turns=2, ask=ask))
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(server_side)
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown < 2**21, grown  # 16 names of 512 KiB were answered


def test_doctor_watch_never_prints_a_credential_of_its_url() -> None:
    """A metrics URL behind basic auth (``user:secret@``) is printed with its credential replaced, in
    the first line and in the line saying it cannot be read."""
    pages = Pages(["<html>not metrics</html>\n"])
    try:
        authority = pages.url.split("//", 1)[1]
        done = _doctor_watch(f"http://trainer:s3cr3t@{authority}", samples=2)
    finally:
        pages.close()
    said = done.stdout + done.stderr
    assert done.returncode == 1 and "s3cr3t" not in said and "trainer" not in said, said
    assert f"cannot read http://***@{authority}" in said, said
