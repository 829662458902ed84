"""Reliability, third round: Unix sockets, numeric wildcards, boundaries of every kind inside a
trajectory, a caller's unprintable exception, forked pools, re-entrant configuration, ``*`` disabling,
and the stock-propagator warning on every path. Over loopback and real Unix sockets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.server
import logging
import multiprocessing
import os
import shutil
import signal
import socketserver
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

import otel_session
from otel_session import SESSION_HEADER
from tests.otlp_receiver import OtlpHttpReceiver
from tests.recorder import Recorder


class _Recording(http.server.BaseHTTPRequestHandler):
    seen: list[dict[str, str]]

    def do_GET(self) -> None:
        self.seen.append({k.lower(): v for k, v in self.headers.items()})
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def address_string(self) -> str:
        return "unix"

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def unix_server(tmp_path: Path) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A real HTTP server on a Unix socket, recording each request's headers."""
    path = str(tmp_path / "router.sock")
    seen: list[dict[str, str]] = []
    handler = type("Handler", (_Recording,), {"seen": seen})
    server = socketserver.ThreadingUnixStreamServer(path, handler)
    # a 50 ms poll: shutdown() waits up to one (0.5 s by default) for serve_forever to notice
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield path, seen
    server.shutdown()
    server.server_close()


def test_a_unix_socket_is_not_the_urls_host_for_httpx_or_aiohttp(
    unix_server: tuple[str, list[dict[str, str]]],
) -> None:
    path, seen = unix_server
    otel_session.configure(dynamo_hosts=["https://dynamo.internal:8443", "dynamo.internal:8000"])

    async def over_aiohttp() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as session:
            for url in ("https://dynamo.internal:8443/v1/x", "http://dynamo.internal:8000/v1/x"):
                async with session.get(url) as response:
                    assert response.status == 200

    with otel_session.trajectory():
        asyncio.run(over_aiohttp())
        with httpx.Client(transport=httpx.HTTPTransport(uds=path)) as client:
            assert client.get("http://dynamo.internal:8000/v1/x").status_code == 200
        mounted = {"http://dynamo.internal:8000": httpx.HTTPTransport(uds=path)}
        with httpx.Client(mounts=mounted) as client:
            assert client.get("http://dynamo.internal:8000/v1/x").status_code == 200
    assert len(seen) == 4
    assert all(SESSION_HEADER.lower() not in headers for headers in seen)


def test_the_same_requests_over_tcp_do_carry_it(dynamo: Recorder) -> None:
    """The control for the Unix-socket test: the hooks work for these clients over TCP."""
    otel_session.configure(dynamo_hosts=[dynamo.url])

    async def over_aiohttp() -> None:
        async with aiohttp.ClientSession() as session, session.get(dynamo.url + "/v1/x") as response:
            assert response.status == 200

    with otel_session.trajectory():
        asyncio.run(over_aiohttp())
        httpx.get(dynamo.url + "/v1/x")
    assert all(seen.get(SESSION_HEADER) for seen in dynamo.requests) and len(dynamo.requests) == 2


@pytest.mark.parametrize("pattern", ["*.0.0.5", "*.1", "*.168.1.1", "*.0.0.5:8000"])
def test_a_wildcard_that_would_match_addresses_is_refused(pattern: str) -> None:
    with pytest.raises(ValueError, match="wildcard is for DNS names"):
        otel_session.configure(dynamo_hosts=[pattern])


def test_a_base_url_without_a_scheme_is_its_host_and_port(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[f"127.0.0.1:{dynamo.port}/v1"])
    with otel_session.trajectory() as traj:
        httpx.get(dynamo.url + "/v1/models")
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id


def test_a_decorated_generator_inside_a_trajectory_is_its_own_nested_attempt(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url])

    @otel_session.trajectory()
    def turns() -> Iterator[int]:
        for turn in range(2):
            httpx.get(dynamo.url + "/x")
            yield turn

    with otel_session.trajectory() as outer:
        list(turns())
        list(turns())
    sessions = [seen.get(SESSION_HEADER) for seen in dynamo.requests]
    parents = {seen.get("X-Dynamo-Parent-Session-ID") for seen in dynamo.requests}
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3] and outer.session_id not in sessions
    assert parents == {outer.session_id}


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def test_the_callers_exception_comes_out_unchanged_with_tracing_on(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = OtlpHttpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    try:
        otel_session.configure(dynamo_hosts=["dynamo:8000"], tracing=True)
        raised = _Unprintable()
        with pytest.raises(_Unprintable) as caught, otel_session.trajectory():
            raise raised
        assert caught.value is raised

        async def attempt() -> None:
            async with otel_session.trajectory():
                raise raised

        with pytest.raises(_Unprintable):
            asyncio.run(attempt())
    finally:
        otel_session.unconfigure()
        receiver.close()


def _session_in_worker(_: object = None) -> str | None:
    return otel_session.current_session_id()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_pool_keeps_no_trajectory_it_was_not_handed() -> None:
    pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"))
    try:
        with otel_session.trajectory():
            first = pool.submit(_session_in_worker).result(timeout=60)  # the workers fork here
        with otel_session.trajectory():
            second = pool.submit(_session_in_worker).result(timeout=60)
        third = pool.submit(_session_in_worker).result(timeout=60)
        with otel_session.trajectory() as handed:
            carrier = otel_session.session_carrier()
        resumed = pool.submit(_resumed_in_worker, carrier).result(timeout=60)
    finally:
        pool.shutdown()
    assert (first, second, third) == (None, None, None)
    assert resumed == handed.session_id


def _resumed_in_worker(carrier: dict[str, str]) -> str | None:
    with otel_session.resume(carrier) as session:
        return session


def test_a_log_handler_that_unconfigures_when_warned_does_not_deadlock(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both in the same thread and through another thread the handler waits for."""
    monkeypatch.setenv("OTEL_SESSION_ADOPT", "junk")

    class Unconfigures(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            helper = threading.Thread(target=otel_session.unconfigure)
            helper.start()
            helper.join(10)
            otel_session.unconfigure()

    handler = Unconfigures()
    logger = logging.getLogger("otel_session")
    logger.addHandler(handler)
    try:
        done = threading.Event()

        def run() -> None:
            otel_session.configure(dynamo_hosts=[dynamo.url], servers=True)
            done.set()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        assert done.wait(20), "configure() hung on a warning whose handler called unconfigure()"
    finally:
        logger.removeHandler(handler)


def test_disabling_every_instrumentation_with_a_star_disables_ours(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "*")
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with otel_session.trajectory():
        httpx.get(dynamo.url + "/x")
    assert dynamo.requests[0].get(SESSION_HEADER) is None


STOCK_SCRIPT = """
import httpx, otel_session
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
HTTPXClientInstrumentor().instrument()
with otel_session.trajectory():
    httpx.get("{url}/x")
    httpx.get("{url}/y")
"""


@pytest.mark.parametrize("propagators", ["tracecontext,baggage,dynamo_session", "dynamo_session,baggage"])
def test_stock_propagators_loaded_only_from_the_list_are_warned_about_once(
    other: Recorder, propagators: str
) -> None:
    """No configure() and no distro: the propagator itself sees the combination, once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_PROPAGATORS"] = propagators
    script = textwrap.dedent(STOCK_SCRIPT.format(url=other.url))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "includes the stock" in line]
    assert len(warnings) == 1 and "OTEL_PROPAGATORS=dynamo_session" in warnings[0]


def test_an_app_that_replaces_the_global_propagator_after_configure_is_warned_once(
    other: Recorder, dynamo: Recorder
) -> None:
    """The app's own bootstrap, after configure(), installs the stock propagators and instruments a
    client of its own: ours no longer runs at all, so the next trajectory says so, once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    script = textwrap.dedent(
        """
        import httpx, otel_session
        from opentelemetry import propagate
        from opentelemetry.baggage.propagation import W3CBaggagePropagator
        from opentelemetry.propagators.composite import CompositePropagator
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
        otel_session.configure(dynamo_hosts=["{dynamo}"])
        with otel_session.trajectory():
            httpx.get("{other}/before")
        propagate.set_global_textmap(
            CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
        )
        HTTPXClientInstrumentor().instrument()
        for _ in range(3):
            with otel_session.trajectory():
                httpx.get("{dynamo}/x")
        """
    ).format(other=other.url, dynamo=dynamo.url)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "includes the stock" in line]
    assert len(warnings) == 1 and "set_global_textmap" in warnings[0]
    assert other.requests[0].get("baggage") is None  # before the app replaced it: nothing
    assert all(seen.get(SESSION_HEADER) for seen in dynamo.requests)


STOCK_SHAPES = {
    "subclass": "propagate.set_global_textmap(type('Mine', (W3CBaggagePropagator,), {})())",
    "nested": "propagate.set_global_textmap(Composite([Composite([TC(), W3CBaggagePropagator()])]))",
}


@pytest.mark.parametrize("shape", STOCK_SHAPES.values(), ids=STOCK_SHAPES.keys())
def test_a_stock_propagator_subclassed_or_nested_is_warned_about_too(other: Recorder, shape: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    script = "\n".join(
        [
            "import otel_session",
            "from opentelemetry import propagate",
            "from opentelemetry.baggage.propagation import W3CBaggagePropagator",
            "from opentelemetry.propagators.composite import CompositePropagator as Composite",
            "from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator as TC",
            f"otel_session.configure(dynamo_hosts=['{other.authority}'])",
            shape,
            "with otel_session.trajectory(): pass",
        ]
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sum("includes the stock" in line for line in done.stderr.splitlines()) == 1, done.stderr


def test_configuring_while_trajectories_start_on_another_thread_warns_of_nothing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From an outside attack: between configure() setting its settings and installing its propagator,
    a trajectory on another thread took OpenTelemetry's default propagator for one the app had set."""
    from otel_session import _stock

    monkeypatch.setattr(_stock, "_leak_warned", [])
    stop = threading.Event()

    def attempts() -> None:
        while not stop.is_set():
            with otel_session.trajectory():
                pass

    with caplog.at_level(logging.WARNING, logger="otel_session"):
        otel_session.configure(dynamo_hosts=["dynamo:8000"])
        worker = threading.Thread(target=attempts)
        worker.start()
        try:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                otel_session.unconfigure()
                otel_session.configure(dynamo_hosts=["dynamo:8000"])
        finally:
            stop.set()
            worker.join()
    assert not [r for r in caplog.records if "includes the stock" in r.getMessage()]


def test_the_opentelemetry_instrument_launcher_is_not_configured_too(dynamo: Recorder) -> None:
    """OTEL_SESSION_AUTO with opentelemetry-instrument: the launcher's own interpreter starts only the
    program, so each bad variable is one warning, not one from each of the two processes."""
    launcher = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    assert launcher is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_SESSION_AUTO="true",
        OTEL_PYTHON_DISTRO="otel_session",
        OTEL_SESSION_DYNAMO_HOSTS=f"bad host,{dynamo.authority}",
        OTEL_SESSION_ADOPT="junk",
    )
    done = subprocess.run(
        [launcher, sys.executable, "-c", "print('ran')"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ran", done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("otel-session:")]
    assert sum("'bad host'" in line for line in lines) == 1, lines
    assert sum("OTEL_SESSION_ADOPT" in line for line in lines) == 1, lines


@pytest.mark.parametrize(
    "propagators", ["tracecontext,baggage,dynamo_session", "dynamo_session,tracecontext,baggage"]
)
def test_stock_copies_are_taken_back_where_our_hooks_run_in_either_order(
    other: Recorder, dynamo: Recorder, propagators: str
) -> None:
    """With otel-session's hooks on (here: the upstream distro's path, our instrumentors loaded and
    configured from the variables), a stock propagator's copies of ours never reach another host."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_PROPAGATORS=propagators, OTEL_SESSION_DYNAMO_HOSTS=dynamo.url)
    script = textwrap.dedent(
        """
        import httpx, otel_session
        from otel_session import _registry
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
        for name, kind in _registry.instrumentors().items():
            kind().instrument()  # as upstream's loader does with the entry points
        HTTPXClientInstrumentor().instrument()
        with otel_session.trajectory():
            httpx.get("{other}/x")
            httpx.get("{dynamo}/x")
        """
    ).format(other=other.url, dynamo=dynamo.url)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert other.requests and other.requests[0].get("baggage") is None
    assert dynamo.requests[0].get(SESSION_HEADER)
    assert sum("includes the stock" in line for line in done.stderr.splitlines()) == 1


@pytest.mark.timeout(60)
def test_a_signal_handler_that_unconfigures_while_tracing_starts_does_not_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The signal arrives while configure() and tracing's start hold their locks (main thread)."""
    from otel_session import _export

    receiver = OtlpHttpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    handled: list[bool] = []

    def on_signal(signum: int, frame: object) -> None:
        otel_session.unconfigure()
        handled.append(True)

    real_exporter = _export.otlp_exporter

    def exporter_with_a_signal() -> object:
        signal.raise_signal(signal.SIGUSR1)  # the handler runs before this returns
        return real_exporter()

    previous = signal.signal(signal.SIGUSR1, on_signal)
    monkeypatch.setattr(_export, "otlp_exporter", exporter_with_a_signal)
    try:
        otel_session.configure(dynamo_hosts=["dynamo:8000"], tracing=True)
        assert handled == [True]
    finally:
        signal.signal(signal.SIGUSR1, previous)
        otel_session.unconfigure()
        receiver.close()


def test_zero_code_keeps_the_good_hosts_beside_a_bad_one(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from otel_session import _environment

    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", f"http://,127.0.0.1:{dynamo.port}")
    caplog.set_level(logging.WARNING, "otel_session")
    _environment.configure_from_environment()
    with otel_session.trajectory() as traj:
        httpx.get(dynamo.url + "/v1/models")
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id
    bad = [r.getMessage() for r in caplog.records if "OTEL_SESSION_DYNAMO_HOSTS" in r.getMessage()]
    assert len(bad) == 1 and "'http://'" in bad[0] and "left out" in bad[0]
    with pytest.raises(ValueError, match=r"dynamo_hosts|http://"):
        otel_session.configure(dynamo_hosts=["http://", f"127.0.0.1:{dynamo.port}"])  # strict as an argument


class _Wrapping(httpx.BaseTransport):
    """A transport of the application's that wraps httpx's own (a retry or fail-over layer)."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(request)


class _UdsSubclass(httpx.HTTPTransport):
    pass


def test_a_unix_socket_behind_a_wrapping_or_subclassed_transport_is_nobodys_host(
    unix_server: tuple[str, list[dict[str, str]]],
) -> None:
    """Found by an outside attack: a copy a wrapping transport planned for the URL's host reached a
    Unix-socket transport, which sent it as planned."""
    path, seen = unix_server
    otel_session.configure(dynamo_hosts=["dynamo.internal:8000"])
    transports = [_Wrapping(httpx.HTTPTransport(uds=path)), _UdsSubclass(uds=path)]
    with otel_session.trajectory():
        for transport in transports:
            with httpx.Client(transport=transport) as client:
                assert client.get("http://dynamo.internal:8000/v1/x").status_code == 200
    assert len(seen) == 2 and all(SESSION_HEADER.lower() not in headers for headers in seen)


def test_stock_copies_injected_between_a_wrapping_transport_and_httpxs_own_are_taken_back(
    dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an outside attack: with tracing on and stock propagators composed with ours, the
    upstream instrumentation injected into the copy a wrapping transport had planned, and the router
    got ``baggage: session.id=...`` beside its session header."""
    from opentelemetry import propagate
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    receiver = OtlpHttpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    try:
        otel_session.configure(dynamo_hosts=[dynamo.url], tracing=True)
        ours = propagate.get_global_textmap()
        stock = [TraceContextTextMapPropagator(), W3CBaggagePropagator()]
        propagate.set_global_textmap(CompositePropagator([*stock, ours]))
        try:
            with (
                otel_session.trajectory() as traj,
                httpx.Client(transport=_Wrapping(httpx.HTTPTransport())) as c,
            ):
                c.get(dynamo.url + "/v1/models")
        finally:
            propagate.set_global_textmap(ours)
        seen = dynamo.requests[0]
        assert seen.get(SESSION_HEADER) == traj.session_id and seen.get("baggage") is None
    finally:
        otel_session.unconfigure()
        receiver.close()


def test_re_entering_the_trajectory_outside_the_enclosing_one_makes_no_parent_cycle(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with (
        otel_session.trajectory() as outer,
        otel_session.trajectory() as inner,
        otel_session.trajectory(session_id=outer.session_id) as again,
    ):
        httpx.get(dynamo.url + "/x")
    assert inner.parent_session_id == outer.session_id
    assert again.session_id == outer.session_id and again.parent_session_id is None
    assert dynamo.requests[0].get("X-Dynamo-Parent-Session-ID") is None


@pytest.mark.parametrize("trigger", ["boundary", "timeout", "empty"])
def test_no_warning_of_ours_is_logged_while_configure_holds_its_lock(
    trigger: str, dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that hands ``unconfigure()`` to another thread and waits for it deadlocked on any
    warning logged under ``configure()``'s lock: a named function that does not resolve in a module
    already imported, a malformed export timeout while tracing starts, no hosts at all."""
    receiver = OtlpHttpReceiver()
    arguments: dict[str, object] = {"dynamo_hosts": [dynamo.url]}
    if trigger == "boundary":
        arguments["trajectory_functions"] = ["json:no_such_function"]
    elif trigger == "timeout":
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")
        arguments["tracing"] = True
    else:
        arguments["dynamo_hosts"] = []
    heard: list[str] = []
    stuck: list[bool] = []

    class HandsOff(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())
            helper = threading.Thread(target=otel_session.unconfigure, daemon=True)
            helper.start()
            helper.join(3)
            stuck.append(helper.is_alive())  # still waiting on configure()'s lock

    logger = logging.getLogger("otel_session")
    handler = HandsOff()
    logger.addHandler(handler)
    try:
        done = threading.Event()

        def run() -> None:
            otel_session.configure(**arguments)  # type: ignore[arg-type]
            done.set()

        threading.Thread(target=run, daemon=True).start()
        assert done.wait(30), "configure() hung"
        assert heard, "the trigger warned nothing: the test checks nothing"
        assert not any(stuck), "a warning was logged while configure() held its lock"
    finally:
        logger.removeHandler(handler)
        otel_session.unconfigure()
        receiver.close()


def test_configure_that_fails_to_start_tracing_keeps_the_previous_boundaries(
    new_module: Callable[[str, str], str], dynamo: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = new_module(
        "kept", "def rollout():\n    import otel_session\n    return otel_session.current_session_id()\n"
    )
    module = __import__(name)
    otel_session.configure(dynamo_hosts=[dynamo.url], trajectory_functions=[f"{name}:rollout"])
    assert module.rollout() is not None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        otel_session.configure(dynamo_hosts=[dynamo.url], tracing=True)
    assert module.rollout() is not None  # the previous configuration, its boundary included, in force
