"""Issue 34, round 5 of the attacks: the new surfaces, attacked from outside.

Written from the docs alone (README, docs/*.md, ``--help``), without reading the package's code:
the sibling policies (``OTEL_SESSION_SIBLINGS``), the fleet size read from a router's ``/health``,
sibling groups (``trajectory(group=...)`` keys and groups inferred from the first request's prompt)
and ``doctor --watch``. Every server is real and on loopback (http.server, uvicorn, raw sockets);
every client is real (httpx, aiohttp, the openai SDK, the ``otel-session`` CLI).

Findings are plain tests that fail until the library changes; the attacks that held pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import io
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import httpx
import openai
import pytest

import otel_session

SESSION = "x-dynamo-session-id"
PARENT = "x-dynamo-parent-session-id"
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # a control byte other than \t and \n


# --------------------------------------------------------------------------------------------------
# Servers


class Router:
    """A stand-in Dynamo frontend on loopback: ``/health`` as each test scripts it (a body, or a
    function writing raw bytes to the socket), ``/v1/models`` and chat completions answered as
    Dynamo answers them (usage, ``nvext.worker_id``), every request's headers recorded."""

    def __init__(self, health: bytes | Callable[[BaseHTTPRequestHandler], None] = b"{}") -> None:
        self.health = health
        self.log: list[tuple[str, str, dict[str, str]]] = []
        self.health_done = threading.Event()
        router = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _record(self) -> None:
                router.log.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

            def _send(self, body: bytes, status: int = 200) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._record()
                if self.path.startswith("/health"):
                    try:
                        if callable(router.health):
                            router.health(self)
                        else:
                            self._send(router.health)
                    except OSError:
                        pass
                    finally:
                        router.health_done.set()
                elif self.path.startswith("/v1/models"):
                    self._send(b'{"object":"list","data":[{"id":"m","object":"model"}]}')
                else:
                    self._send(b"{}", 404)

            def do_POST(self) -> None:
                self._record()
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        self.rfile.read(size + 2)
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                else:
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                session = self.headers.get(SESSION)
                worker = (sum(session.encode()) % 2) if session else len(router.log) % 2
                self._send(
                    json.dumps(
                        {
                            "id": "c",
                            "object": "chat.completion",
                            "created": 0,
                            "model": "m",
                            "choices": [
                                {
                                    "index": 0,
                                    "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": "ok"},
                                }
                            ],
                            "usage": {
                                "prompt_tokens": 100,
                                "completion_tokens": 1,
                                "total_tokens": 101,
                                "prompt_tokens_details": {"cached_tokens": 0},
                            },
                            "nvext": {"worker_id": {"decode_worker_id": worker}},
                        }
                    ).encode()
                )

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # siblings connect at once: a full backlog costs a 1 s SYN retry
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.daemon = True
        self.thread.start()

    def requests(self) -> list[dict[str, str]]:
        return [h for method, path, h in self.log if not path.startswith("/health")]

    def healths(self) -> list[dict[str, str]]:
        return [h for method, path, h in self.log if path.startswith("/health")]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def router(health: bytes | Callable[[BaseHTTPRequestHandler], None] = b"{}") -> Iterator[Router]:
    server = Router(health)
    try:
        yield server
    finally:
        server.close()


class RawServer:
    """A TCP server on loopback that reads one request head and then runs ``script(sock)``: for the
    endpoints that do not speak HTTP, cut bodies short, or trickle."""

    def __init__(self, script: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.script = script
        self.stopped = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                self.script(conn)
            except OSError:
                pass

    def close(self) -> None:
        self.stopped = True
        self.listener.close()


def instances(workers: int) -> bytes:
    """A /health body in Dynamo 1.6.1's own shape (as a real frontend answered here): per worker one
    instance serving ``generate`` and one serving its KV-query endpoint."""
    listed: list[dict[str, Any]] = []
    for worker in range(workers):
        instance_id = 10**17 + worker
        for endpoint in ("generate", f"worker_kv_query_source_{worker:014x}"):
            listed.append(
                {
                    "component": "backend",
                    "endpoint": endpoint,
                    "namespace": "dynamo",
                    "instance_id": instance_id,
                    "transport": {
                        "tcp": f"127.0.0.1:{30000 + worker % 30000}/{instance_id:x}/dynamo/backend/{endpoint}"
                    },
                    "device_type": "cuda",
                    "request_plane_codec": "msgpack",
                }
            )
    return json.dumps(
        {"status": "healthy", "endpoints": ["dyn://dynamo.backend.generate"], "instances": listed}
    ).encode()


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OTEL_SESSION_", "OTEL_PYTHON_", "OTEL_PROPAGATORS"))
    }
    env.update(extra)
    return env


def run_python(code: str, timeout: float = 30, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(**env),
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


def cli(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[bytes]:
    exe = os.path.join(os.path.dirname(sys.executable), "otel-session")
    return subprocess.run([exe, *args], capture_output=True, timeout=timeout, env=clean_env(**env))


@pytest.fixture(autouse=True)
def _configured_per_test() -> Iterator[None]:
    yield
    otel_session.unconfigure()


# --------------------------------------------------------------------------------------------------
# GRPO steps: P prompts x G siblings open at once, one request each


async def grpo_step(
    client: httpx.AsyncClient, url: str, prompts: int, siblings: int, tag: str
) -> dict[int, list[str | None]]:
    opened: list[int] = []
    all_open = asyncio.Event()

    async def attempt(prompt: int) -> tuple[int, str | None]:
        async with otel_session.trajectory(group=f"{tag}-prompt-{prompt}") as traj:
            opened.append(prompt)
            if len(opened) == prompts * siblings:
                all_open.set()
            await all_open.wait()
            answer = await client.post(
                f"{url}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": f"{tag}-{prompt}"}]},
            )
            assert answer.status_code == 200
            return prompt, traj.parent_session_id

    parents: dict[int, list[str | None]] = {}
    for prompt, parent in await asyncio.gather(
        *(attempt(p) for p in range(prompts) for _ in range(siblings))
    ):
        parents.setdefault(prompt, []).append(parent)
    return parents


def group_sizes(parents: dict[int, list[str | None]]) -> list[int]:
    """How many siblings named each parent (an attempt with no parent counts as a group of 1)."""
    sizes: list[int] = []
    for named in parents.values():
        sizes += [named.count(p) for p in set(named) if p is not None] + [1] * named.count(None)
    return sorted(sizes)


async def two_steps(
    server: Router, prompts: int = 2, siblings: int = 4, settle: float = 5.0
) -> tuple[list[int], list[int]]:
    async with httpx.AsyncClient(timeout=10) as client:
        first = await grpo_step(client, server.url, prompts, siblings, "one")
        server.health_done.wait(settle)  # the /health read answered (or gave up on our side)
        await asyncio.sleep(0.5)  # and parsed
        second = await grpo_step(client, server.url, prompts, siblings, "two")
    return group_sizes(first), group_sizes(second)


# ==================================================================================================
# FINDINGS: these fail today


def test_a_group_key_whose_hash_raises_type_error_opens_its_attempt_without_a_parent() -> None:
    """docs/api.md: a key "whose own __hash__ or __eq__ raises opens its attempt without a parent (one
    warning)". A tuple (the kind the library's own error message recommends) holding a list, and a key
    whose __hash__ raises TypeError (a mutable task object), raise TypeError out of trajectory()
    instead: the rollout dies before its first request. A __hash__ raising ValueError is contained."""
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="prompt")

    class MutableTask:
        def __hash__(self) -> int:
            raise TypeError("unhashable: the task is mutable")

    for key in (("task-7", ["msg"]), MutableTask()):
        with otel_session.trajectory(group=key) as attempt:
            assert attempt.session_id
            assert attempt.parent_session_id is None


def test_a_group_key_whose_hash_raises_is_one_warning_line_without_a_traceback() -> None:
    """docs/api.md: such a key opens its attempt without a parent "(one warning)". Today the warning
    ("comparing a trajectory(group=...) key failed", though it was the hash) is followed by an
    11-line traceback of the application's __hash__ on stderr."""
    done = run_python(
        """
        import otel_session
        otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="prompt")
        class Key:
            def __hash__(self):
                raise ValueError("no hash today")
        with otel_session.trajectory(group=Key()) as attempt:
            assert attempt.parent_session_id is None
        print("attempt ran")
        """
    )
    assert done.returncode == 0, done.stderr
    assert "attempt ran" in done.stdout
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, lines


def test_a_group_key_is_hashed_once_as_its_attempt_opens() -> None:
    """docs/api.md: "A key is hashed once, as its attempt opens". Under the default (and `prompt`,
    `groups:K`) the key's __hash__ runs twice, the second time under the group table's lock (so
    application code runs holding it: see the hang below)."""
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"])
    calls: list[str] = []

    class Key:
        def __hash__(self) -> int:
            calls.append("hash")
            return 11

    with otel_session.trajectory(group=Key()):
        pass
    assert calls == ["hash"]


def test_a_group_key_whose_hash_opens_a_trajectory_does_not_hang_the_process() -> None:
    """A key whose __hash__ itself opens a trajectory (any re-entry into otel-session from a key's
    own code) deadlocks the thread forever: the key is hashed a second time inside the group table's
    lock, and the inner trajectory waits on that lock. One thread, no concurrency needed."""
    code = """
        import otel_session
        otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="prompt")
        class Key:
            def __hash__(self):
                with otel_session.trajectory(group="inner"):
                    pass
                return 3
        with otel_session.trajectory(group=Key()):
            pass
        print("no hang")
        """
    try:
        done = run_python(code, timeout=6)
    except subprocess.TimeoutExpired:
        pytest.fail("trajectory(group=key) whose __hash__ opens a trajectory hung for 6 s (deadlock)")
    assert "no hang" in done.stdout, done.stderr


def test_attempts_ended_out_of_order_leave_no_session_behind() -> None:
    """Two episodes on one thread, each with its own ExitStack (a callback-driven env loop: start
    A, start B, A ends, B ends). After both ended, the thread is still inside A: current_session_id()
    is A's ended session, every later request to the router carries it (docs: "Outside any
    trajectory a request to a router host carries no session"), and every later attempt is nested
    under A, so under groups:2 all later siblings, one at a time, name A as their parent. (Run in a
    copy of the context, so what it leaves behind stays out of the other tests.)"""
    with router() as server:
        otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"], siblings="groups:2")

        def episodes() -> tuple[str, str | None, list[str | None]]:
            episode_a, episode_b = contextlib.ExitStack(), contextlib.ExitStack()
            a = episode_a.enter_context(otel_session.trajectory(group="prompt-1"))
            episode_b.enter_context(otel_session.trajectory(group="prompt-1"))
            episode_a.close()
            episode_b.close()
            left = otel_session.current_session_id()
            httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": []})
            later: list[str | None] = []
            for _ in range(4):
                with otel_session.trajectory(group="prompt-1") as attempt:
                    later.append(attempt.parent_session_id)
            return a.session_id, left, later

        a_session, left, later = contextvars.copy_context().run(episodes)
    assert left is None, "after both attempts ended the thread is still in attempt A"
    assert SESSION not in server.requests()[-1], "a request after every attempt ended carried a session"
    assert a_session not in later, "later attempts were nested under an attempt that had ended"


def test_doctor_watch_reads_a_body_cut_short_as_unreadable() -> None:
    """docs/tracing.md: an answer "not whole within 10 s is one line, `otel-session: cannot read URL
    (why)`, and exit code 1". A page that announces 100,000 bytes and closes after 100 is judged as if
    whole ("too little traffic to judge", exit 0); a chunked page cut short is refused correctly."""
    page = (
        b"# TYPE otel_session_requests_total counter\n"
        b'otel_session_requests_total{otel_session_session="true"} 5\n'
    )

    def cut_short(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n" + page)

    server = RawServer(cut_short)
    try:
        done = cli(
            "doctor", "--watch", f"{server.url}/metrics", "--samples", "1", "--interval", "1", timeout=30
        )
    finally:
        server.close()
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 1, out
    assert "cannot read" in out, out


def test_doctor_watch_prints_no_raw_bytes_of_a_hostile_endpoint() -> None:
    """An endpoint that answers a status line of its own bytes (terminal escapes: set the window title,
    clear the screen; then CR LF) has them printed raw into the user's terminal, and the promised
    one 'cannot read' line becomes two. A body that is not Prometheus text is quoted escaped
    ('\\x1b[2J...'), so the status line is the odd one out."""

    def hostile(conn: socket.socket) -> None:
        conn.sendall(b"\x1b]0;pwned\x07\x1b[2J\x1b[31mHTTP/1.1 200 OK\r\n\r\n")

    server = RawServer(hostile)
    try:
        done = cli(
            "doctor", "--watch", f"{server.url}/metrics", "--samples", "1", "--interval", "1", timeout=30
        )
    finally:
        server.close()
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 1, out
    assert not CONTROL.search(out.replace("\r\n", "\n")), repr(out)
    assert "\r" not in out, repr(out)
    reasons = [line for line in out.splitlines() if "cannot read" in line]
    assert len(reasons) == 1 and reasons[0].rstrip().endswith("full URL"), repr(out)


def test_the_fleet_line_about_a_router_that_does_not_speak_http_is_one_clean_line() -> None:
    """A router port whose /health answers with something that is not HTTP (another service; here
    with terminal escapes) makes the library's own warning embed those raw bytes: the line breaks in
    two at the peer's CR LF and carries its escape sequences into the application's log. The same
    happens with a hostile reason phrase on a 404."""

    def not_http(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(b"\x1b]0;pwned\x07\x1b[2J SSH-2.0-OpenSSH_9.6\r\n")
        handler.wfile.flush()
        handler.close_connection = True

    with router(not_http) as server:
        done = run_python(
            f"""
            import asyncio, httpx, otel_session, time
            otel_session.configure(dynamo_hosts=["127.0.0.1:{server.port}"], siblings="fleet")
            async def attempt(client, opened, all_open):
                async with otel_session.trajectory(group="p"):
                    opened.append(1)
                    if len(opened) == 2:
                        all_open.set()
                    await all_open.wait()
                    body = {{"model": "m", "messages": []}}
                    await client.post("{server.url}/v1/chat/completions", json=body)
            async def main():
                async with httpx.AsyncClient() as client:
                    opened, all_open = [], asyncio.Event()
                    await asyncio.gather(attempt(client, opened, all_open), attempt(client, opened, all_open))
                await asyncio.sleep(1.0)
            asyncio.run(main())
            """
        )
    assert done.returncode == 0, done.stderr
    assert server.healths(), "the fleet's size was never read"
    assert not CONTROL.search(done.stderr.replace("\r\n", "\n")) and "\r" not in done.stderr, repr(
        done.stderr
    )
    assert all(line.startswith("otel-session: ") for line in done.stderr.splitlines() if line.strip()), repr(
        done.stderr
    )


async def test_a_large_fleets_health_is_read_not_called_empty() -> None:
    """docs: W is read from the router's /health and K = ceil(G / max(1, W // P)). A fleet of 10,000
    workers, as Dynamo 1.6.1 lists them (two instances each, ~600 bytes per worker: 6 MB), is cut at
    4 MiB and read as "lists no workers (JSONDecodeError ... char 4194304)", so the default pairs
    siblings (K = 2) where K is 1, saying nothing in `auto` mode; `otel-session doctor` reads the
    same /health whole and says the default keys them one per worker ("attempt"). From ~6,700 workers
    on, the default and doctor disagree."""
    body = instances(10_000)
    assert len(body) > 4 * 1024 * 1024
    with router(body) as server:
        otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"])
        _, second = await two_steps(server, prompts=2, siblings=4)
    assert second == [1] * 8, f"step 2's groups {second}: 10,000 workers for 2 x 4 siblings is K = 1"


def _doctor(server: Router, siblings: str) -> tuple[int, str]:
    done = cli(
        "doctor",
        "--base-url",
        f"{server.url}/v1",
        "--requests",
        "3",
        timeout=60,
        OTEL_SESSION_SIBLINGS=siblings,
    )
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


@pytest.mark.slow
def test_doctor_under_the_documented_fleet_setting_does_not_fail_a_healthy_router() -> None:
    """The README recommends OTEL_SESSION_SIBLINGS=fleet. With it in the environment, `otel-session
    doctor` against a router that pins every session says "[FAIL] header sent: 6 of 9 requests" and
    "[FAIL] sessions pinned: 2 of 3" and exits 1: its own first probe session is withheld as a
    first-step sibling, and the fix it names (a proxy dropping the header) sends the user chasing
    nothing. The same router passes every check under the default."""
    with router(instances(2)) as server:
        healthy_rc, healthy = _doctor(server, "auto")
        assert healthy_rc == 0 and "[FAIL]" not in healthy, healthy  # the stand-in is healthy
        rc, out = _doctor(server, "fleet")
    assert "[FAIL]" not in out, out
    assert rc == 0, out


@pytest.mark.slow
def test_doctor_under_the_fleet_setting_passes_a_real_dynamo_that_pins() -> None:
    """The same against a real Dynamo 1.6.1 frontend and 2 mocker workers (affinity on): doctor
    passes under the default and says "[FAIL] header sent: 12 of 18" and "[FAIL] sessions pinned:
    2 of 3", exit 1, under OTEL_SESSION_SIBLINGS=fleet."""
    from otel_session.dynamo import LocalDynamo

    with LocalDynamo(workers=2) as dynamo:
        done = cli("doctor", "--base-url", dynamo.base_url, timeout=120, OTEL_SESSION_SIBLINGS="fleet")
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert "[FAIL]" not in out, out
    assert done.returncode == 0, out


def _demo(server: Router, siblings: str) -> tuple[int, str]:
    done = cli("--base-url", f"{server.url}/v1", "--quiet", timeout=90, OTEL_SESSION_SIBLINGS=siblings)
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


@pytest.mark.slow
def test_the_demo_under_the_documented_fleet_setting_sees_a_pinning_router_pin() -> None:
    """`OTEL_SESSION_SIBLINGS=fleet otel-session --base-url URL` against a router that pins every
    session: "verdict: pinned 0/9 vs 0/9", exit 1, and "not every trajectory stayed on one worker;
    find out why with: otel-session doctor" (which then fails too, above). The demo's batch is one
    step, which `fleet` sends without sessions. Under the default: "pinned 9/9 vs 1/9", exit 0."""
    with router(instances(4)) as server:
        rc, out = _demo(server, "fleet")
    assert "pinned 9/9" in out, out
    assert rc == 0, out


@pytest.mark.slow
def test_the_demos_batch_without_sessions_has_the_library_say_nothing() -> None:
    """docs/local-dynamo.md: "The batch without sessions runs with otel-session unconfigured, so the
    library has nothing to say about its requests." It says "otel-session: a trajectory started (or
    was resumed) but otel-session is not configured in this process, so no request carries its
    session; call otel_session.configure(...)": advice to configure, printed by the demo itself."""
    with router(instances(4)) as server:
        rc, out = _demo(server, "auto")
    assert rc == 0 and "pinned 9/9" in out, out
    assert "not configured in this process" not in out, out


class Trickle:
    """A /health that announces 4,000 bytes and sends one every 0.1 s (400 s in all)."""

    def __call__(self, handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4000\r\n\r\n"
        )
        handler.wfile.flush()
        for _ in range(4000):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.1)


@pytest.mark.slow
def test_doctor_reading_a_trickling_health_is_bounded() -> None:
    """`otel-session doctor --prompts P --siblings G` reads the fleet's size from /health. Against a
    /health that trickles a byte every 0.1 s it waits as long as the trickle lasts (63 s for a 600-byte
    trickle here; a 400 s one is cut by this test at 30 s): each read has a timeout, the whole read
    none. The library's own read of the same /health gives up after ~5 s, `doctor --watch` after 10 s."""
    with router(Trickle()) as server:
        started = time.monotonic()
        try:
            done = cli(
                "doctor",
                "--base-url",
                f"{server.url}/v1",
                "--prompts",
                "16",
                "--siblings",
                "8",
                "--requests",
                "2",
                timeout=30,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"doctor still reading a trickling /health after {time.monotonic() - started:.0f} s")
    assert b"Traceback" not in done.stdout + done.stderr


# ==================================================================================================
# HELD: the attacks that did not break it (quick ones only)


@pytest.mark.parametrize(
    "value",
    [
        "bogus",
        "groups:0",
        "groups:2_0",
        "fleet:3",
    ],
)
def test_a_bad_siblings_variable_is_one_line_and_exit_2_in_the_cli(value: str) -> None:
    for args in (
        ("--base-url", "http://127.0.0.1:9/v1", "--quiet"),
        ("doctor", "--base-url", "http://127.0.0.1:9/v1"),
    ):
        done = cli(*args, timeout=30, OTEL_SESSION_SIBLINGS=value)
        lines = (done.stdout + done.stderr).decode().strip().splitlines()
        assert done.returncode == 2, lines
        assert len(lines) == 1 and "OTEL_SESSION_SIBLINGS" in lines[0] and repr(value) in lines[0], lines


def test_a_bad_siblings_variable_in_zero_code_mode_is_one_line_and_sessions_still_flow() -> None:
    with router() as server:
        done = run_python(
            f"""
            import httpx, otel_session
            with otel_session.trajectory(group="g"):
                httpx.post("{server.url}/v1/chat/completions", json={{"model": "m", "messages": []}})
            """,
            OTEL_SESSION_AUTO="true",
            OTEL_SESSION_DYNAMO_HOSTS=f"127.0.0.1:{server.port}",
            OTEL_SESSION_SIBLINGS="groups:zero",
        )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "OTEL_SESSION_SIBLINGS" in lines[0], lines
    assert SESSION in server.requests()[-1]


def test_a_bad_siblings_argument_raises_and_keeps_the_configuration_in_force() -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="prompt")
    for bad in ("groups:0", "", 2, b"auto", ("groups", 2)):
        with pytest.raises(ValueError, match="siblings"):
            otel_session.configure(dynamo_hosts=["127.0.0.1:10"], siblings=bad)  # type: ignore[arg-type]

    def hold(seen: list[str | None], barrier: threading.Barrier) -> None:
        with otel_session.trajectory(group="g") as attempt:
            barrier.wait(5)
            seen.append(attempt.parent_session_id)
            barrier.wait(5)

    seen: list[str | None] = []
    barrier = threading.Barrier(3)
    threads = [threading.Thread(target=hold, args=(seen, barrier)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(set(seen)) == 1 and seen[0] is not None  # still `prompt`: all three under one parent


def _slow(handler: BaseHTTPRequestHandler) -> None:
    time.sleep(8)


def _status(code: int) -> Callable[[BaseHTTPRequestHandler], None]:
    def answer(handler: BaseHTTPRequestHandler) -> None:
        body = instances(1)
        handler.send_response(code)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return answer


def _redirect(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(302)
    handler.send_header("Location", os.environ["ATTACK5_ELSEWHERE"])
    handler.send_header("Content-Length", "0")
    handler.end_headers()


def _garbage(handler: BaseHTTPRequestHandler) -> None:
    handler.wfile.write(b"SSH-2.0-OpenSSH_9.6\r\n")
    handler.close_connection = True


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


HOSTILE_HEALTH: dict[str, tuple[bytes | Callable[[BaseHTTPRequestHandler], None], list[int] | None]] = {
    # name: (/health, step 2's group sizes for 2 prompts x 4 siblings, None where not checked)
    "0 workers": (instances(0), [2, 2, 2, 2]),
    "1 worker": (instances(1), [4, 4]),
    "2 workers": (instances(2), [4, 4]),
    "8 workers": (instances(8), [1] * 8),
    "1,000 workers": (instances(1000), [1] * 8),
    "404 with a body listing 1": (_status(404), [2, 2, 2, 2]),
    "500": (_status(500), [2, 2, 2, 2]),
    "redirect elsewhere": (_redirect, [2, 2, 2, 2]),
    "not http": (_garbage, [2, 2, 2, 2]),
    "not json": (b"<html>ok</html>", [2, 2, 2, 2]),
    "a list": (b"[1, 2]", [2, 2, 2, 2]),
    "instances a dict": (_json({"instances": {"a": 1}}), [2, 2, 2, 2]),
    "instances of numbers": (_json({"instances": [1, 2, 3]}), [2, 2, 2, 2]),
    "endpoint a list": (
        _json({"instances": [{"endpoint": ["generate"], "instance_id": i} for i in range(8)]}),
        [2, 2, 2, 2],
    ),
    "instance ids unhashable": (
        _json({"instances": [{"endpoint": "generate", "instance_id": {"i": i}} for i in range(8)]}),
        None,
    ),
    "nested 100,000 deep": (b'{"instances":' + b"[" * 100_000 + b"]" * 100_000 + b"}", [2, 2, 2, 2]),
    "a 5,000-digit id": (b'{"instances":[{"endpoint":"generate","instance_id":' + b"9" * 5000 + b"}]}", None),
    "NaN": (b'{"instances": NaN}', [2, 2, 2, 2]),
    "slow (8 s)": (_slow, None),
}


@pytest.mark.parametrize("name", list(HOSTILE_HEALTH))
async def test_a_hostile_health_never_costs_a_request_nor_carries_a_session(
    name: str, capfd: pytest.CaptureFixture[str]
) -> None:
    health, expected = HOSTILE_HEALTH[name]
    with router() as elsewhere, router(health) as server:
        os.environ["ATTACK5_ELSEWHERE"] = f"{elsewhere.url}/health"
        try:
            otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"])
            started = time.monotonic()
            first, second = await two_steps(server, settle=0.0 if name.startswith("slow") else 5.0)
            took = time.monotonic() - started
        finally:
            del os.environ["ATTACK5_ELSEWHERE"]
        assert not elsewhere.log, "a redirect from /health was followed"
    assert len(server.healths()) == 1  # one GET, and no session header, baggage or traceparent on it
    assert not {SESSION, PARENT, "baggage", "traceparent"} & set(server.healths()[0])
    assert all(SESSION in h for h in server.requests())  # every request of every attempt, both steps
    # a process's first step, gathered (``_gathering``): sized as the next where /health is read
    if expected is not None:
        assert first == expected and second == expected
    if name.startswith("slow"):
        assert first == [2, 2, 2, 2]  # the size not known in time: pairs
    if name.startswith("slow"):
        assert took < 3, f"a slow /health held the steps for {took:.1f} s"
    err = capfd.readouterr().err
    assert "Traceback" not in err, err


def test_a_hanging_health_does_not_hold_the_process_at_exit() -> None:
    with router(_slow) as server:
        started = time.monotonic()
        done = run_python(
            f"""
            import httpx, otel_session, threading
            otel_session.configure(dynamo_hosts=["127.0.0.1:{server.port}"])
            barrier = threading.Barrier(2)
            def attempt():
                with otel_session.trajectory(group="g"):
                    barrier.wait(5)
                    httpx.post("{server.url}/v1/chat/completions", json={{"model": "m", "messages": []}})
                    barrier.wait(5)
            threads = [threading.Thread(target=attempt) for _ in range(2)]
            [t.start() for t in threads]; [t.join() for t in threads]
            print("done")
            """
        )
        took = time.monotonic() - started
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
    assert server.healths()
    assert took < 7, f"the process took {took:.1f} s to exit while /health hung (it answers after 8 s)"


def test_fleet_withholds_the_end_of_session_notice_of_a_withheld_attempt_too() -> None:
    # /health too slow for the first step to be sized as it gathers: fleet withholds that step
    with router(_slow) as server:
        otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"], siblings="fleet", end_sessions=True)

        async def step() -> None:
            async with httpx.AsyncClient() as client:
                await grpo_step(client, server.url, 2, 2, "first")

        asyncio.run(step())
        time.sleep(0.6)
    assert len(server.requests()) == 4, server.log  # the four turns, and no notice of ours
    assert not any(SESSION in h or PARENT in h or "x-dynamo-session-final" in h for h in server.requests())


def _concurrently(keys: list[Any]) -> list[str | None]:
    parents: list[str | None] = [None] * len(keys)
    opened, closing = threading.Barrier(len(keys)), threading.Barrier(len(keys))

    def run(index: int, key: Any) -> None:
        with otel_session.trajectory(group=key) as attempt:
            opened.wait(5)
            parents[index] = attempt.parent_session_id
            closing.wait(5)

    threads = [threading.Thread(target=run, args=(i, k)) for i, k in enumerate(keys)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return parents


def test_group_keys_are_told_apart_by_equality_not_by_hash() -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="prompt")

    class Colliding:
        def __init__(self, value: int) -> None:
            self.value = value

        def __hash__(self) -> int:
            return 7

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Colliding) and other.value == self.value

    assert hash(-1) == hash(-2)
    minus = _concurrently([-1, -2])
    assert None not in minus and minus[0] != minus[1]
    unequal = _concurrently([Colliding(1), Colliding(2)])
    assert None not in unequal and unequal[0] != unequal[1]
    equal = _concurrently([Colliding(1), Colliding(1), "x" * 10_000_000, "x" * 10_000_000])
    assert equal[0] == equal[1] != equal[2] == equal[3]


def _reopen_parent() -> str | None:
    with otel_session.trajectory(session_id=otel_session.current_session_id()) as same:
        return same.parent_session_id


def _end_by_exception() -> str | None:
    with contextlib.suppress(RuntimeError), otel_session.trajectory(group="g") as attempt:
        parent = attempt.parent_session_id
        raise RuntimeError
    return parent


def _end_by_cancellation() -> str | None:
    parents: list[str | None] = []

    async def attempt() -> None:
        async with otel_session.trajectory(group="g") as traj:
            parents.append(traj.parent_session_id)
            await asyncio.sleep(30)

    async def main() -> None:
        task = asyncio.ensure_future(attempt())
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    return parents[0]


def _end_by_closing_a_generator() -> str | None:
    @otel_session.trajectory(group="g")
    def episode() -> Iterator[str | None]:
        yield _reopen_parent()
        yield None

    steps = episode()
    parent = next(steps)
    steps.close()
    return parent


def _end_by_abandoning_a_generator() -> str | None:
    @otel_session.trajectory(group="g")
    def episode() -> Iterator[str | None]:
        yield _reopen_parent()
        yield None

    steps = episode()
    parent = next(steps)
    del steps
    gc.collect()
    return parent


def _end_by_unconfigure() -> str | None:
    with otel_session.trajectory(group="g") as attempt:
        parent = attempt.parent_session_id
        otel_session.unconfigure()
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="prompt")
    return parent


def _end_by_an_exception_in_another_thread() -> str | None:
    parents: list[str | None] = []

    def run() -> None:
        with contextlib.suppress(KeyboardInterrupt), otel_session.trajectory(group="g") as attempt:
            parents.append(attempt.parent_session_id)
            raise KeyboardInterrupt

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(5)
    return parents[0]


@pytest.mark.parametrize(
    "end",
    [
        _end_by_exception,
        _end_by_cancellation,
        _end_by_closing_a_generator,
        _end_by_abandoning_a_generator,
        _end_by_unconfigure,
        _end_by_an_exception_in_another_thread,
    ],
    ids=lambda f: f.__name__.removeprefix("_end_by_"),
)
def test_an_attempt_ended_any_way_leaves_its_group(end: Callable[[], str | None]) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="prompt")
    ended_parent = end()
    assert ended_parent is not None
    with otel_session.trajectory(group="g") as later:
        assert later.parent_session_id not in (None, ended_parent)


def _child_attempt(queue: Any) -> None:
    with otel_session.trajectory(group="g") as attempt:
        queue.put(attempt.parent_session_id)


def test_a_forked_worker_knows_none_of_its_parents_open_groups() -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"], siblings="prompt")
    opened, release = threading.Event(), threading.Event()
    seen: list[str | None] = []

    def hold() -> None:
        with otel_session.trajectory(group="g") as attempt:
            seen.append(attempt.parent_session_id)
            opened.set()
            release.wait(20)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert opened.wait(5)
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_child_attempt, args=(queue,))
        child.start()
        child_parent = queue.get(timeout=20)
        child.join(10)
    finally:
        release.set()
        holder.join(10)
    assert child_parent is not None and child_parent != seen[0]


DEEP = b'{"model":"m","messages":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
ODD_BODIES: dict[str, dict[str, Any]] = {
    "nested 200,000 deep": {"content": DEEP},
    "not json": {"content": b"\xff\xfe not json"},
    "utf-16 json": {
        "content": json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode("utf-16")
    },
    "a list": {"json": [{"model": "m"}]},
    "model a dict": {"json": {"model": {"a": [1]}, "messages": [{"role": "user", "content": "x"}]}},
    "messages a string": {"json": {"model": "m", "messages": "hello"}},
    "NaN and Infinity": {"content": b'{"model":"m","messages":[NaN, Infinity, -Infinity]}'},
    "a 5,000-digit number": {"content": b'{"model":"m","messages":[' + b"9" * 5000 + b"]}"},
    "a lone surrogate": {"content": b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}'},
    "over 4 MiB": {"json": {"model": "m", "messages": [{"role": "user", "content": "x" * (5 << 20)}]}},
    "a form": {"data": {"model": "m", "messages": "x"}},
    "a file": {"files": {"f": b"abc"}},
}


@pytest.mark.parametrize("name", list(ODD_BODIES))
def test_an_odd_first_request_body_goes_out_whole_with_its_session(
    name: str, capfd: pytest.CaptureFixture[str]
) -> None:
    with router() as server:
        otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"], siblings="prompt")
        with otel_session.trajectory() as attempt:
            answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=10, **ODD_BODIES[name])
        assert answer.status_code == 200
        assert server.requests()[-1][SESSION] == attempt.session_id
    assert "Traceback" not in capfd.readouterr().err


def test_streamed_and_odd_bodies_from_aiohttp_and_the_openai_sdk_go_out_with_their_session() -> None:
    with router() as server:
        otel_session.configure(dynamo_hosts=[f"127.0.0.1:{server.port}"], siblings="prompt")

        async def chunks() -> Any:
            yield b'{"model":"m",'
            yield b'"messages":[]}'

        async def main() -> None:
            async with aiohttp.ClientSession() as session:
                bodies: list[dict[str, Any]] = [
                    {"data": DEEP},
                    {"data": chunks()},
                    {"json": {"model": {"x": [1]}, "messages": [[[]]]}},
                    {"data": b'{"model":"m","messages":[NaN]}'},
                    {"data": io.BytesIO(b"{}")},
                ]
                url = f"{server.url}/v1/chat/completions"
                for body in bodies:
                    async with otel_session.trajectory() as attempt, session.post(url, **body) as answer:
                        assert answer.status == 200
                    assert server.requests()[-1][SESSION] == attempt.session_id
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
            for messages in (
                [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                [{"role": "user", "content": None}],
                [],
            ):
                async with otel_session.trajectory() as attempt:
                    await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
                assert server.requests()[-1][SESSION] == attempt.session_id
            await client.close()

        asyncio.run(main())


def test_many_attempts_with_every_ending_leave_nothing_behind() -> None:
    """20,000 attempts of 2,000 group keys (plain ends, exceptions, async cancellations, generators
    closed early): what otel-session's own code holds afterwards (tracemalloc filtered to its files)."""
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"])
    own = os.path.dirname(otel_session.__file__) + os.sep + "*"

    def held() -> int:
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, own)])
        return sum(stat.size for stat in snapshot.statistics("filename"))

    @otel_session.trajectory(group="gen")
    def episode() -> Iterator[int]:
        yield 1
        yield 2

    async def cancelled(n: int) -> None:
        async def attempt(i: int) -> None:
            async with otel_session.trajectory(group=("c", i % 50)):
                await asyncio.sleep(10)

        tasks = [asyncio.ensure_future(attempt(i)) for i in range(n)]
        await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def churn(n: int) -> None:
        for i in range(n):
            if i % 4 == 1:
                with contextlib.suppress(KeyError), otel_session.trajectory(group=("k", i % 2000)):
                    raise KeyError
            elif i % 4 == 2:
                steps = episode()
                next(steps)
                steps.close()
            else:
                with otel_session.trajectory(group=("k", i % 2000)):
                    pass
        asyncio.run(cancelled(n // 10))

    tracemalloc.start()
    try:
        churn(2000)
        before = held()
        churn(18_000)
        after = held()
    finally:
        tracemalloc.stop()
    assert after - before < 64 * 1024, (
        f"{after - before} bytes more held by otel-session after 18,000 attempts"
    )


@pytest.mark.slow
def test_two_hundred_thousand_attempts_run_quickly_in_bounded_memory() -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:9"])
    gc.collect()
    before = sys.getallocatedblocks()
    started = time.monotonic()
    for i in range(200_000):
        with otel_session.trajectory(group=i % 997):
            pass
    took = time.monotonic() - started
    gc.collect()
    grown = sys.getallocatedblocks() - before
    assert took < 60, f"{took:.1f} s for 200,000 attempts"
    assert grown < 20_000, f"{grown} more memory blocks after 200,000 attempts"


def _closes(conn: socket.socket) -> None:
    conn.sendall(b"\x00\x01binary\xff")


def _resets(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


def _redirects(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: file:///etc/passwd\r\nContent-Length: 0\r\n\r\n")


def _headers_forever(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    for _ in range(2000):
        conn.sendall(b"X-A: b\r\n")
        time.sleep(0.001)


def _chunk_cut(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n# a\n\r\n")


@pytest.mark.parametrize(
    "script",
    [_closes, _resets, _redirects, _headers_forever, _chunk_cut],
    ids=lambda f: f.__name__.strip("_"),
)
def test_doctor_watch_at_an_endpoint_that_does_not_answer_metrics_is_one_line(
    script: Callable[[socket.socket], None],
) -> None:
    server = RawServer(script)
    try:
        started = time.monotonic()
        done = cli(
            "doctor", "--watch", f"{server.url}/metrics", "--samples", "1", "--interval", "1", timeout=30
        )
        took = time.monotonic() - started
    finally:
        server.close()
    lines = (done.stdout + done.stderr).decode(errors="replace").strip().splitlines()
    assert done.returncode == 1, lines
    assert len(lines) == 2 and lines[1].startswith("otel-session: cannot read"), lines
    assert took < 12


@pytest.mark.parametrize(
    "url",
    [
        "http://",
        "http://[::1",
        "http://127.0.0.1:99999/metrics",
        "ftp://127.0.0.1/x",
        "file:///etc/passwd",
        "http:127.0.0.1:9/m",
    ],
)
def test_doctor_watch_at_a_bad_url_is_one_line(url: str) -> None:
    done = cli("doctor", "--watch", url, "--samples", "1", "--interval", "1", timeout=30)
    lines = (done.stdout + done.stderr).decode(errors="replace").strip().splitlines()
    assert done.returncode == 1, lines
    assert lines[-1].startswith("otel-session: cannot read") and len(lines) == 2, lines
