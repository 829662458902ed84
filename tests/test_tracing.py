"""Trace export over OTLP, end to end: real loopback servers, real OTLP receivers, real protobuf.

What is global for a process (the tracer provider once set, process exit) is tested in subprocesses,
so these tests hold whatever other test modules did to this process's OpenTelemetry globals.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import openai
import pytest
from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
from opentelemetry.instrumentation.httpx import HTTPX2ClientInstrumentor, HTTPXClientInstrumentor

import otel_session
from otel_session import _settings, _tracing
from tests.otlp_receiver import HeaderServer, OtlpGrpcReceiver, OtlpHttpReceiver, ReceivedSpan

Receiver = OtlpHttpReceiver | OtlpGrpcReceiver
PROTOCOLS: dict[str, type[Receiver]] = {"http/protobuf": OtlpHttpReceiver, "grpc": OtlpGrpcReceiver}


@pytest.fixture(autouse=True)
def _clean(clean_otel_env: None) -> None:
    """Every test here starts from no exporter or otel-session variable of the machine's."""


@pytest.fixture
def servers() -> Iterator[tuple[HeaderServer, HeaderServer, HeaderServer]]:
    """(Dynamo, trusted host, any other host), all on 127.0.0.1 with their own ports."""
    found = (HeaderServer(), HeaderServer(), HeaderServer())
    yield found
    for server in found:
        server.close()


@pytest.fixture(params=sorted(PROTOCOLS))
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def receiver(protocol: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    found = PROTOCOLS[protocol]()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", found.endpoint)
    yield found
    found.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _flush() -> None:
    provider = _tracing.provider()
    assert provider is not None
    assert provider.force_flush(5000)


def _url(span: ReceivedSpan) -> str:
    return str(span.attributes.get("url.full") or span.attributes.get("http.url"))


def _span_id_of(traceparent: str | None) -> str:
    assert traceparent is not None
    return traceparent.split("-")[2]


async def test_trajectory_and_client_spans_reach_the_collector(
    receiver: Receiver, servers: tuple[HeaderServer, HeaderServer, HeaderServer]
) -> None:
    dynamo, trusted, other = servers
    dynamo.fail_first = 1  # openai's first try gets a 503 and is retried: two spans, one session
    otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[trusted.authority], tracing=True)
    provider = _tracing.provider()
    assert provider is not None

    async with otel_session.trajectory(
        prompt_index=4, sibling_index=2, attempt=1, attributes={"rollout.step": 7}
    ) as traj:
        llm = openai.AsyncOpenAI(base_url=f"{dynamo.url}/v1", api_key="unused", max_retries=2)
        await llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        async with httpx.AsyncClient() as client:
            await client.get(f"{trusted.url}/httpx")
        with httpx.Client() as sync_client:
            sync_client.get(f"{other.url}/httpx")
        async with aiohttp.ClientSession() as http:
            for url in (f"{dynamo.url}/aiohttp", f"{other.url}/aiohttp"):
                async with http.get(url) as response:
                    await response.read()
        with provider.get_tracer("app").start_as_current_span("app.step"):
            pass
    with httpx.Client() as sync_client:
        sync_client.get(f"{other.url}/outside")
    _flush()

    spans = receiver.wait_for(lambda found: len(found) >= 9)
    assert len(spans) == 9, [(span.name, _url(span)) for span in spans]
    (root,) = [span for span in spans if span.name == "trajectory"]
    session = traj.session_id
    assert session is not None
    assert root.parent_span_id == ""
    assert root.scope == "otel_session"
    assert root.attributes["session.id"] == session
    assert root.attributes["gen_ai.conversation.id"] == session
    assert root.attributes["otel_session.prompt_index"] == 4
    assert root.attributes["otel_session.sibling_index"] == 2
    assert root.attributes["otel_session.attempt"] == 1
    assert root.attributes["rollout.step"] == 7
    assert root.resource["service.name"] == provider.resource.attributes["service.name"]
    assert {span.resource["service.name"] for span in spans} == {root.resource["service.name"]}

    inside = [span for span in spans if span is not root and "/outside" not in _url(span)]
    assert len(inside) == 7
    for span in inside:
        assert span.trace_id == root.trace_id
        assert span.parent_span_id == root.span_id
        assert span.attributes["session.id"] == session, span.name
    (outside,) = [span for span in spans if "/outside" in _url(span)]
    assert outside.trace_id != root.trace_id
    assert "session.id" not in outside.attributes

    llm_spans = [span for span in inside if _url(span).endswith("/v1/chat/completions")]
    assert len(llm_spans) == 2  # the 503 and its retry
    assert {span.scope for span in llm_spans} == {"opentelemetry.instrumentation.httpx"}
    aiohttp_spans = [span for span in inside if span.scope == "opentelemetry.instrumentation.aiohttp_client"]
    assert len(aiohttp_spans) == 2
    (app_span,) = [span for span in inside if span.name == "app.step"]
    assert app_span.scope == "app"

    # Dynamo: the session on every request, and a traceparent naming the client span that sent it.
    assert dynamo.headers("x-dynamo-session-id") == [session] * 3
    assert dynamo.headers("x-stainless-retry-count")[:2] == ["0", "1"]
    client_span_ids = {span.span_id for span in inside}
    for traceparent in dynamo.headers("traceparent"):
        assert traceparent is not None and traceparent.split("-")[1] == root.trace_id
        assert _span_id_of(traceparent) in client_span_ids
    sent_by_llm = {_span_id_of(tp) for tp in dynamo.headers("traceparent")[:2]}
    assert sent_by_llm == {span.span_id for span in llm_spans}
    # Trusted host: traceparent and baggage, no session header.
    assert _span_id_of(trusted.headers("traceparent")[0]) in client_span_ids
    assert f"session.id={session}" in str(trusted.headers("baggage")[0])
    assert trusted.headers("x-dynamo-session-id") == [None]
    # Any other host: none of it.
    for name in ("traceparent", "baggage", "x-dynamo-session-id", "tracestate"):
        assert other.headers(name) == [None, None, None], name


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_collector_down_adds_no_latency_and_shutdown_is_bounded(
    protocol: str, servers: tuple[HeaderServer, HeaderServer, HeaderServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    dynamo = servers[0]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # export (and fail) while requests run
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "16")

    def rollout(endpoint: str) -> tuple[list[float], float]:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        otel_session.configure(dynamo_hosts=[dynamo.authority], tracing=True)
        latencies = []
        with httpx.Client() as client:
            for _ in range(150):
                with otel_session.trajectory():
                    began = time.perf_counter()
                    response = client.get(f"{dynamo.url}/step")
                    latencies.append(time.perf_counter() - began)
                    assert response.status_code == 200
        began = time.perf_counter()
        otel_session.unconfigure()
        return latencies[10:], time.perf_counter() - began

    collector = PROTOCOLS[protocol]()
    try:
        up, _ = rollout(collector.endpoint)
        assert len(collector.wait_for(lambda found: len(found) >= 300, timeout=5)) >= 300
    finally:
        collector.close()
    down, shutdown_seconds = rollout(f"http://127.0.0.1:{_closed_port()}")

    assert len(dynamo.seen) == 300
    assert shutdown_seconds < 5.0
    assert statistics.median(down) <= statistics.median(up) * 1.5 + 0.002, (
        statistics.median(down),
        statistics.median(up),
    )
    assert max(down) < 1.0  # no request ever waited for an export


def _run(tmp_path: Path, source: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    clean = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, str(script), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


ROLLOUT_THEN_EXIT = """
    import sys, httpx, otel_session
    otel_session.configure(dynamo_hosts=[sys.argv[1]], tracing=True)
    with httpx.Client() as client:
        for _ in range(120):
            with otel_session.trajectory():
                assert client.get(f"http://{sys.argv[1]}/step").status_code == 200
    print("rollout done", flush=True)
"""


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_process_exit_with_collector_down_is_bounded(
    protocol: str, servers: tuple[HeaderServer, HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    dynamo = servers[0]
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(ROLLOUT_THEN_EXIT))
    env = {
        **{name: value for name, value in os.environ.items() if not name.startswith("OTEL_")},
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "16",  # 15 batches queued at exit, none deliverable
    }
    process = subprocess.Popen(
        [sys.executable, str(script), dynamo.authority],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "rollout done"
    began = time.perf_counter()
    _, stderr = process.communicate(timeout=30)
    exit_seconds = time.perf_counter() - began
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert exit_seconds < 5.0
    assert len(dynamo.seen) == 120


OFF_SCRIPT = """
    import json, sys, httpx, otel_session
    from opentelemetry import trace
    dynamo, trusted, other = sys.argv[1:4]
    report = {}

    def round(name):
        with otel_session.trajectory() as traj, httpx.Client() as client:
            for host in (dynamo, trusted, other):
                client.get(f"http://{host}/{name}")
        report[name] = {
            "session": traj.session_id,
            "recording": traj.span.is_recording(),
            "valid": traj.span.get_span_context().is_valid,
            "provider": type(trace.get_tracer_provider()).__name__,
            "sdk": sorted(name for name in sys.modules if name.startswith("opentelemetry.sdk")),
        }

    otel_session.configure(dynamo_hosts=[dynamo], trusted_hosts=[trusted])
    round("off")
    otel_session.configure(dynamo_hosts=[dynamo], trusted_hosts=[trusted], tracing=True)
    otel_session.configure(dynamo_hosts=[dynamo], trusted_hosts=[trusted], tracing=False)
    round("off-again")
    report["app-span-valid"] = trace.get_tracer("app").start_span("app").get_span_context().is_valid
    otel_session.unconfigure()
    print(json.dumps(report))
"""


def test_tracing_off_installs_no_sdk_and_sends_no_traceparent(
    servers: tuple[HeaderServer, HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    dynamo, trusted, other = servers
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    result = _run(tmp_path, OFF_SCRIPT, env, dynamo.authority, trusted.authority, other.authority)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["off"]["provider"] == "ProxyTracerProvider"
    assert report["off"]["sdk"] == []  # not even imported: a process with tracing off never loads it
    assert "opentelemetry.sdk.trace" in report["off-again"]["sdk"]
    # After on -> off the global provider is our idle SDK one, and trajectories still get no valid span.
    assert report["off-again"]["provider"] == "TracerProvider"
    assert report["app-span-valid"] is False  # the application's tracer on it has gone quiet too
    for name in ("off", "off-again"):
        assert report[name]["recording"] is False and report[name]["valid"] is False
    sessions = [report["off"]["session"], report["off-again"]["session"]]
    for server in servers:
        assert server.headers("traceparent") == [None, None]
    assert dynamo.headers("x-dynamo-session-id") == sessions
    for session, baggage in zip(sessions, trusted.headers("baggage"), strict=True):
        assert f"session.id={session}" in str(baggage)
    for name in ("baggage", "x-dynamo-session-id"):
        assert other.headers(name) == [None, None]


APP_PROVIDER_SCRIPT = """
    import json, sys, httpx, otel_session
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    dynamo, trusted, other, when = sys.argv[1:5]
    if when == "late":  # a trajectory before the application sets its provider: ours follows it
        otel_session.configure(dynamo_hosts=[dynamo], trusted_hosts=[trusted])
        with otel_session.trajectory():
            pass
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    otel_session.configure(dynamo_hosts=[dynamo], trusted_hosts=[trusted])
    with otel_session.trajectory(attempt=2) as traj, httpx.Client() as client:
        for host in (dynamo, trusted, other):
            client.get(f"http://{host}/app")
    print(json.dumps({
        "session": traj.session_id,
        "trace_id": format(traj.span.get_span_context().trace_id, "032x"),
        "span_id": format(traj.span.get_span_context().span_id, "016x"),
        "flags": format(traj.span.get_span_context().trace_flags, "02x"),
        "spans": [{"name": s.name, "attributes": dict(s.attributes)} for s in exporter.get_finished_spans()],
    }))
"""


@pytest.mark.parametrize("when", ["early", "late"])
def test_application_provider_records_our_spans_with_tracing_off(
    when: str, servers: tuple[HeaderServer, HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    """The application's provider, set before configure() or after trajectories already ran."""
    dynamo, trusted, other = servers
    authorities = (dynamo.authority, trusted.authority, other.authority)
    result = _run(tmp_path, APP_PROVIDER_SCRIPT, {}, *authorities, when)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    (span,) = report["spans"]  # ours only: with tracing off the clients are not instrumented
    assert span["name"] == "trajectory"
    assert span["attributes"]["session.id"] == report["session"]
    assert span["attributes"]["otel_session.attempt"] == 2
    expected = f"00-{report['trace_id']}-{report['span_id']}-{report['flags']}"
    assert dynamo.headers("traceparent") == [expected]
    assert trusted.headers("traceparent") == [expected]
    assert other.headers("traceparent") == [None]


APP_PROCESSOR_SCRIPT = """
    import json, sys, httpx, otel_session
    otel_session.configure(dynamo_hosts=[sys.argv[1]])
    loaded_before = "opentelemetry.sdk" in sys.modules
    from opentelemetry import trace
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(otel_session.SessionSpanProcessor())  # the README's one line
    import typing
    typing.get_type_hints(otel_session.SessionSpanProcessor.on_start)  # its annotations resolve
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    HTTPXClientInstrumentor().instrument(tracer_provider=provider)
    with httpx.Client() as client:
        with otel_session.trajectory() as traj:
            client.get(f"http://{sys.argv[1]}/in")
        client.get(f"http://{sys.argv[1]}/out")
    print(json.dumps({
        "loaded_before": loaded_before,
        "session": traj.session_id,
        "spans": [
            {"name": s.name, "session": s.attributes.get("session.id")} for s in exporter.get_finished_spans()
        ],
    }))
"""


def test_session_span_processor_on_an_application_provider(
    servers: tuple[HeaderServer, HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    """``otel_session.SessionSpanProcessor`` (loaded on first use, with the SDK) labels the client
    spans of the application's own provider inside a trajectory, and only those."""
    result = _run(tmp_path, APP_PROCESSOR_SCRIPT, {}, servers[0].authority)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["loaded_before"] is False
    sid = report["session"]
    # finished in order: the client span inside, the trajectory span, the client span outside
    assert [span["session"] for span in report["spans"]] == [sid, sid, None], report
    assert [span["name"] for span in report["spans"]][1] == "trajectory"


def test_missing_sdk_is_a_clear_import_error_and_changes_nothing(tmp_path: Path) -> None:
    source = """
        import sys
        sys.modules["opentelemetry.sdk"] = None  # as if the [tracing] extra were not installed
        import otel_session
        from otel_session import _settings
        try:
            otel_session.configure(dynamo_hosts=["dynamo:8000"], tracing=True)
        except ImportError as exc:
            print(exc)
        print(_settings.current)
        otel_session.configure(dynamo_hosts=["dynamo:8000"])
        print(_settings.current.tracing)
        print(otel_session.SessionSpanProcessor().on_start.__name__)  # still a class to name
    """
    result = _run(tmp_path, source, {})
    assert result.returncode == 0, result.stderr
    error, active, tracing, processor = result.stdout.strip().splitlines()
    assert processor == "on_start"
    assert "pip install 'otel-session[tracing]'" in error
    assert active == "None"
    assert tracing == "False"


SDK_LATER_SCRIPT = """
    import json, sys, httpx, otel_session
    sys.modules["opentelemetry.sdk"] = None  # not installed yet
    from otel_session import *  # noqa: F403  (names SessionSpanProcessor: its SDK-less stand-in)
    stand_in = otel_session.SessionSpanProcessor
    try:
        otel_session.configure(dynamo_hosts=[sys.argv[1]], tracing=True)
    except ImportError:
        pass
    del sys.modules["opentelemetry.sdk"]  # installed since, in the same process (a notebook's pip)
    otel_session.configure(dynamo_hosts=[sys.argv[1]], tracing=True)
    with otel_session.trajectory() as traj:
        status = httpx.get(f"http://{sys.argv[1]}/later").status_code
        recording = traj.span.is_recording()
    from opentelemetry.sdk.trace import SpanProcessor
    print(json.dumps({
        "status": status,
        "recording": recording,
        "stand_in_was_sdk": issubclass(stand_in, SpanProcessor),
        "now_sdk": issubclass(otel_session.SessionSpanProcessor, SpanProcessor),
    }))
"""


def test_sdk_installed_after_the_processor_was_named_still_traces(
    servers: tuple[HeaderServer, HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    """The SDK-less stand-in of ``SessionSpanProcessor`` is never put on a provider: once the SDK can
    be imported, tracing turns on with the real processor and requests go through."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    result = _run(tmp_path, SDK_LATER_SCRIPT, env, servers[0].authority)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    report = json.loads(result.stdout)
    assert report == {"status": 200, "recording": True, "stand_in_was_sdk": False, "now_sdk": True}
    assert servers[0].headers("x-dynamo-session-id") != [None]


def test_type_checkers_still_see_every_name_of_the_package(tmp_path: Path) -> None:
    """The lazy ``SessionSpanProcessor`` (a module ``__getattr__``) must not make every misspelt name
    of ``otel_session`` pass ``mypy --strict`` as ``Any``."""
    user = tmp_path / "user.py"
    user.write_text(
        textwrap.dedent("""
            import otel_session
            from otel_session import SessionSpanProcessor
            processor: SessionSpanProcessor = otel_session.SessionSpanProcessor()
            otel_session.configur(dynamo_hosts=["dynamo:8000"])
        """)
    )
    package_root = Path(otel_session.__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(user)],
        env={**os.environ, "MYPYPATH": str(package_root)},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert 'Module has no attribute "configur"' in result.stdout, result.stdout
    assert result.stdout.count("error:") == 1, result.stdout


def test_missing_exporter_or_bad_protocol_keeps_the_previous_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = otel_session.configure(dynamo_hosts=["dynamo:8000"])
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(ImportError, match=r"pip install 'otel-session\[tracing\]'"):
        otel_session.configure(dynamo_hosts=["other:8000"], tracing=True)
    assert _settings.current is before
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        otel_session.configure(dynamo_hosts=["other:8000"], tracing=True)
    assert _settings.current is before
    assert not HTTPXClientInstrumentor().is_instrumented_by_opentelemetry


async def test_off_uninstruments_and_on_again_exports_to_the_new_endpoint(
    servers: tuple[HeaderServer, HeaderServer, HeaderServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    dynamo = servers[0]
    first, second = OtlpHttpReceiver(), OtlpHttpReceiver()
    instrumentors = (HTTPXClientInstrumentor(), HTTPX2ClientInstrumentor(), AioHttpClientInstrumentor())
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", first.endpoint)
        otel_session.configure(dynamo_hosts=[dynamo.authority], tracing=True)
        assert all(instrumentor.is_instrumented_by_opentelemetry for instrumentor in instrumentors)
        lingering = aiohttp.ClientSession()  # keeps the instrumentation's tracer after tracing is off
        with otel_session.trajectory(), httpx.Client() as client:
            client.get(f"{dynamo.url}/on")
        otel_session.configure(dynamo_hosts=[dynamo.authority], tracing=False)
        assert not any(instrumentor.is_instrumented_by_opentelemetry for instrumentor in instrumentors)
        assert len(first.spans()) == 2  # shutdown flushed the trajectory and its client span
        with otel_session.trajectory() as idle, httpx.Client() as client:
            client.get(f"{dynamo.url}/off")
        assert not idle.span.is_recording()
        async with lingering, lingering.get(f"{dynamo.url}/off-aiohttp") as response:
            await response.read()

        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", second.endpoint)
        otel_session.configure(dynamo_hosts=[dynamo.authority], tracing=True)
        with otel_session.trajectory() as traj, httpx.Client() as client:
            client.get(f"{dynamo.url}/on-again")
        otel_session.unconfigure()
        spans = second.spans()
        assert sorted(span.name for span in spans) == ["GET", "trajectory"]
        assert {span.attributes["session.id"] for span in spans} == {traj.session_id}
        assert len(first.spans()) == 2
        assert [path for path, _ in dynamo.seen] == ["/on", "/off", "/off-aiohttp", "/on-again"]
        assert [tp is not None for tp in dynamo.headers("traceparent")] == [True, False, False, True]
    finally:
        first.close()
        second.close()


# --- found by an outside attack on tracing (each failed before its fix) ------------------------------


def test_an_exporter_that_cannot_start_in_zero_code_mode_is_one_line_and_sessions_still_flow(
    servers: tuple[HeaderServer, HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    """The gRPC exporter raises its own exception type for a bad compression variable; zero-code mode
    caught only ValueError and ImportError, so the whole library stayed off with a traceback."""
    dynamo = servers[0]
    done = _run(
        tmp_path,
        """
        import sys, httpx, otel_session
        with otel_session.trajectory():
            httpx.get(f"http://{sys.argv[1]}/step")
        """,
        {
            "OTEL_SESSION_AUTO": "true",
            "OTEL_SESSION_TRACING": "true",
            "OTEL_SESSION_DYNAMO_HOSTS": dynamo.authority,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_COMPRESSION": "bogus",
        },
        dynamo.authority,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    [line] = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert "OTEL_EXPORTER_OTLP_" in line and "tracing stays off" in line
    assert dynamo.headers("x-dynamo-session-id")[0]


def test_a_configure_whose_tracing_cannot_start_leaves_the_global_provider_to_the_app(tmp_path: Path) -> None:
    done = _run(
        tmp_path,
        """
        import otel_session
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        try:
            otel_session.configure(dynamo_hosts=["dynamo:8000"], tracing=True)
        except ValueError as exc:
            print("refused:", exc)
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        mine = TracerProvider()
        trace.set_tracer_provider(mine)
        assert trace.get_tracer_provider() is mine
        print("app provider in force")
        """,
        {"OTEL_BSP_MAX_QUEUE_SIZE": "-5"},
    )
    assert done.returncode == 0, done.stderr
    assert "refused: the OTEL_BSP_* variables" in done.stdout and "app provider in force" in done.stdout


def test_an_app_with_its_own_provider_instruments_its_clients_itself_after_configure(
    servers: tuple[HeaderServer, HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    dynamo = servers[0]
    done = _run(
        tmp_path,
        """
        import sys, httpx, otel_session
        from opentelemetry import trace
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        mine = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(mine))
        trace.set_tracer_provider(provider)
        otel_session.configure(dynamo_hosts=[sys.argv[1]], tracing=True)
        HTTPXClientInstrumentor().instrument()
        with otel_session.trajectory():
            httpx.get(f"http://{sys.argv[1]}/step")
        print([span.name for span in mine.get_finished_spans()])
        """,
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"},
        dynamo.authority,
    )
    assert done.returncode == 0, done.stderr
    assert "GET" in done.stdout and "already instrumented" not in done.stderr


def test_spans_of_a_forked_pools_workers_are_exported_when_the_pool_closes(
    servers: tuple[HeaderServer, HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    """Pool workers leave through os._exit, past atexit: their queued spans were lost."""
    dynamo = servers[0]
    collector = OtlpHttpReceiver()
    try:
        done = _run(
            tmp_path,
            """
            import sys, multiprocessing, httpx, otel_session
            otel_session.configure(dynamo_hosts=[sys.argv[1]], tracing=True)

            def rollout(index):
                with otel_session.trajectory(attempt=index):
                    httpx.get(f"http://{sys.argv[1]}/step")

            if __name__ == "__main__":
                with otel_session.trajectory():  # the parent's own, exported at its exit as usual
                    pass
                pool = multiprocessing.get_context("fork").Pool(2)
                pool.map(rollout, range(4))
                pool.close()
                pool.join()
            """,
            {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint},
            dynamo.authority,
        )
        assert done.returncode == 0, done.stderr
        found = collector.wait_for(lambda spans: sum(s.name == "trajectory" for s in spans) >= 5, timeout=10)
        attempts = sorted(
            s.attributes.get("otel_session.attempt", -1) for s in found if s.name == "trajectory"
        )
        assert attempts == [-1, 0, 1, 2, 3]
    finally:
        collector.close()


@pytest.mark.parametrize("value", ["1e10", "1e-9", "inf", "-1"])
def test_an_export_timeout_no_exporter_can_use_gets_the_default_and_one_line(
    value: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from otel_session import _export

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", value)
    with caplog.at_level("WARNING", logger="otel_session"):
        assert _export.export_timeout() == _export.DEFAULT_EXPORT_TIMEOUT_S
    assert [r for r in caplog.records if "from 0.01 to 3600" in r.getMessage()]
