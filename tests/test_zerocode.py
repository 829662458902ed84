"""Zero-code setup: an unmodified script under ``opentelemetry-instrument``, checked from the wire.

The script never calls ``configure()``; everything comes from entry points and environment variables.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.util._importlib_metadata import EntryPoint, entry_points

import otel_session
from otel_session import SessionPropagator, _settings
from otel_session.zerocode import SessionConfigurator, SessionDistro
from tests.otlp_receiver import HeaderServer, OtlpHttpReceiver

INSTRUMENT = str(Path(sys.executable).with_name("opentelemetry-instrument"))

ROLLOUT = """
import asyncio, json, sys
import aiohttp, httpx, openai
import otel_session
from opentelemetry import trace

async def main(dynamo, other):
    with otel_session.trajectory() as traj:
        with httpx.Client() as client:
            client.get(f"{dynamo}/httpx")
            client.get(f"{other}/httpx")
        llm = openai.OpenAI(base_url=f"{dynamo}/v1", api_key="unused", max_retries=0)
        llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        async with aiohttp.ClientSession() as session:
            for url in (f"{dynamo}/aiohttp", f"{other}/aiohttp"):
                async with session.get(url) as response:
                    await response.read()
    print(json.dumps({"session": traj.session_id, "provider": type(trace.get_tracer_provider()).__name__}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture
def servers() -> Iterator[tuple[HeaderServer, HeaderServer]]:
    """(Dynamo, any other host)."""
    found = (HeaderServer(), HeaderServer())
    yield found
    for server in found:
        server.close()


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield
    otel_session.unconfigure()


def _rollout(
    tmp_path: Path, dynamo: HeaderServer, other: HeaderServer, prefix: list[str], **env: str
) -> tuple[dict[str, str], str]:
    """Run the unmodified rollout script as ``prefix python rollout.py``: (its report, its stderr)."""
    script = tmp_path / "rollout.py"
    script.write_text(ROLLOUT)
    clean = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    result = subprocess.run(
        [*prefix, sys.executable, str(script), dynamo.url, other.url],
        env={**clean, "OTEL_SESSION_DYNAMO_HOSTS": dynamo.authority, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    report: dict[str, str] = json.loads(result.stdout.strip().splitlines()[-1])
    return report, result.stderr


def _instrumented(tmp_path: Path, dynamo: HeaderServer, other: HeaderServer, **env: str) -> dict[str, str]:
    return _rollout(tmp_path, dynamo, other, [INSTRUMENT], **env)[0]


def test_tracing_off_sends_the_session_to_dynamo_only_and_no_traceparent(
    servers: tuple[HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    dynamo, other = servers
    report = _instrumented(tmp_path, dynamo, other, OTEL_PYTHON_DISTRO="otel_session")
    assert report["provider"] == "ProxyTracerProvider"  # no SDK: the upstream configurator did not run
    assert [path for path, _ in dynamo.seen] == ["/httpx", "/v1/chat/completions", "/aiohttp"]
    assert dynamo.headers("x-dynamo-session-id") == [report["session"]] * 3
    assert [path for path, _ in other.seen] == ["/httpx", "/aiohttp"]
    for name in ("x-dynamo-session-id", "baggage"):
        assert other.headers(name) == [None, None], name
    for server in servers:
        assert server.headers("traceparent") == [None] * len(server.seen)


def test_tracing_on_exports_spans(servers: tuple[HeaderServer, HeaderServer], tmp_path: Path) -> None:
    dynamo, other = servers
    receiver = OtlpHttpReceiver()
    try:
        report = _instrumented(
            tmp_path,
            dynamo,
            other,
            OTEL_PYTHON_DISTRO="otel_session",
            OTEL_SESSION_TRACING="true",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_SERVICE_NAME="rollout-under-test",
        )
        spans = receiver.spans()  # the exit flush has run: the process is gone
    finally:
        receiver.close()
    assert report["provider"] == "TracerProvider"
    (root,) = [span for span in spans if span.name == "trajectory"]
    clients = [span for span in spans if span is not root]
    assert sorted(span.scope.rsplit(".", 1)[1] for span in clients) == ["aiohttp_client"] * 2 + ["httpx"] * 3
    for span in spans:
        assert span.resource["service.name"] == "rollout-under-test"
        assert span.attributes["session.id"] == report["session"]
        assert span.trace_id == root.trace_id
    assert {span.parent_span_id for span in clients} == {root.span_id}
    sent = [traceparent.split("-")[2] for traceparent in dynamo.headers("traceparent") if traceparent]
    assert len(sent) == 3 and set(sent) <= {span.span_id for span in clients}
    assert other.headers("traceparent") == [None, None]


UPSTREAM = {
    "OTEL_PYTHON_DISTRO": "distro",
    "OTEL_PYTHON_CONFIGURATOR": "configurator",
    "OTEL_PROPAGATORS": "tracecontext,dynamo_session",
    "OTEL_TRACES_EXPORTER": "none",
    "OTEL_METRICS_EXPORTER": "none",
    "OTEL_LOGS_EXPORTER": "none",
}


def test_dynamo_session_propagator_entry_point_with_the_upstream_distro(
    servers: tuple[HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    """The upstream SDK is on here, yet ``traceparent`` goes to Dynamo only: the session propagator
    runs after ``tracecontext`` and takes back what that one put on a request bound elsewhere."""
    dynamo, other = servers
    report = _instrumented(tmp_path, dynamo, other, **UPSTREAM)
    assert report["provider"] == "TracerProvider"
    httpx_and_openai = dynamo.headers("x-dynamo-session-id")[:2]
    assert httpx_and_openai == [report["session"]] * 2
    assert all(dynamo.headers("traceparent")[:2])
    for name in ("x-dynamo-session-id", "traceparent", "baggage"):
        assert other.headers(name) == [None, None], name


def test_upstream_distro_alone_reaches_dynamo_over_aiohttp(
    servers: tuple[HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    """otel-session's instrumentors are entry points: the upstream distro loads them too."""
    dynamo, other = servers
    report = _instrumented(tmp_path, dynamo, other, **UPSTREAM)
    assert dynamo.headers("x-dynamo-session-id")[2] == report["session"]


def _entry_point(group: str, name: str) -> EntryPoint:
    (found,) = [ep for ep in entry_points(group=group) if ep.name == name]
    return found


def test_entry_points_are_registered() -> None:
    assert _entry_point("opentelemetry_distro", "otel_session").load() is SessionDistro
    assert _entry_point("opentelemetry_configurator", "otel_session").load() is SessionConfigurator
    propagator = _entry_point("opentelemetry_propagator", "dynamo_session").load()()
    assert isinstance(propagator, SessionPropagator)


def test_distro_skips_client_instrumentors_and_loads_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SESSION_TRACING", raising=False)
    distro = SessionDistro()
    httpx_ep = EntryPoint(
        name="httpx",
        value="opentelemetry.instrumentation.httpx:HTTPXClientInstrumentor",
        group="opentelemetry_instrumentor",
    )
    server_ep = EntryPoint(
        name="aiohttp-server",
        value="opentelemetry.instrumentation.aiohttp_server:AioHttpServerInstrumentor",
        group="opentelemetry_instrumentor",
    )
    distro.load_instrumentor(httpx_ep, skip_dep_check=True)
    assert not HTTPXClientInstrumentor().is_instrumented_by_opentelemetry
    try:
        distro.load_instrumentor(server_ep, skip_dep_check=True)
        assert AioHttpServerInstrumentor().is_instrumented_by_opentelemetry
    finally:
        AioHttpServerInstrumentor().uninstrument()


def test_configurator_configures_only_when_nothing_did(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "dynamo-a:8000")
    SessionConfigurator().configure()
    first = _settings.current
    assert first is not None and first.rules
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "dynamo-b:8000")
    SessionConfigurator().configure()
    assert _settings.current is first


# --- failing open: a setting that cannot be honoured is one line, the session is still delivered ---


def _our_lines(stderr: str) -> list[str]:
    """stderr without the notice opentelemetry-instrument itself logs when several configurators are
    installed ("Configuration of configurator not loaded, ..."; the dev venv has opentelemetry-distro's)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("Configuration of ")]


def _assert_delivered(report: dict[str, str], dynamo: HeaderServer, other: HeaderServer) -> None:
    assert dynamo.headers("x-dynamo-session-id") == [report["session"]] * 3
    assert other.headers("x-dynamo-session-id") == [None, None]


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"OTEL_SESSION_TRACING": "maybe"}, "OTEL_SESSION_TRACING"),
        (
            {"OTEL_SESSION_TRACING": "true", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"},
            "OTEL_SESSION_TRACING",
        ),
        ({"OTEL_SESSION_TRUSTED_HOSTS": "http://[::1"}, "OTEL_SESSION_TRUSTED_HOSTS"),
        ({"OTEL_SESSION_SERVERS": "sometimes"}, "OTEL_SESSION_SERVERS"),
    ],
    ids=["bad-tracing", "tracing-exporter-unusable", "bad-trusted-hosts", "bad-servers"],
)
def test_zero_code_fails_open_with_one_line_naming_the_variable(
    servers: tuple[HeaderServer, HeaderServer], tmp_path: Path, env: dict[str, str], variable: str
) -> None:
    dynamo, other = servers
    report, stderr = _rollout(tmp_path, dynamo, other, [INSTRUMENT], OTEL_PYTHON_DISTRO="otel_session", **env)
    _assert_delivered(report, dynamo, other)
    assert report["provider"] == "ProxyTracerProvider"  # tracing could not be honoured: it is off
    lines = _our_lines(stderr)
    assert len(lines) == 1 and variable in lines[0] and "otel-session" in lines[0], stderr
    assert "Failed to auto initialize" not in stderr


NO_SDK_PYTHON = Path(__file__).resolve().parent.parent / ".venv-nosdk" / "bin" / "python"


HTTPX_ROLLOUT = """
import json, sys
import httpx, otel_session

with otel_session.trajectory() as traj, httpx.Client() as client:
    client.get(sys.argv[1] + "/no-sdk")
    client.get(sys.argv[2] + "/no-sdk")
print(json.dumps({"session": traj.session_id}))
"""


def test_tracing_on_without_the_sdk_keeps_delivering_and_says_so(
    servers: tuple[HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    """In a venv with otel-session, opentelemetry-instrument and httpx but no SDK (scripts/nosdk_venv)."""
    if not NO_SDK_PYTHON.exists():
        if os.environ.get("OTEL_SESSION_REQUIRE_GYM") == "1":
            pytest.fail("the no-SDK venv is missing: run scripts/nosdk_venv")
        pytest.skip("the no-SDK venv (.venv-nosdk) is missing: run scripts/nosdk_venv")
    dynamo, other = servers
    script = tmp_path / "rollout.py"
    script.write_text(HTTPX_ROLLOUT)
    clean = {
        name: value for name, value in os.environ.items() if not name.startswith(("OTEL_", "VIRTUAL_ENV"))
    }
    instrument = str(NO_SDK_PYTHON.with_name("opentelemetry-instrument"))
    result = subprocess.run(
        [instrument, str(NO_SDK_PYTHON), str(script), dynamo.url, other.url],
        env={**clean, "OTEL_SESSION_DYNAMO_HOSTS": dynamo.authority, "OTEL_SESSION_TRACING": "true"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "Failed to auto initialize" not in result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert dynamo.headers("x-dynamo-session-id") == [report["session"]]
    assert other.headers("x-dynamo-session-id") == [None]
    lines = _our_lines(result.stderr)
    assert len(lines) == 1 and "OTEL_SESSION_TRACING" in lines[0] and "otel-session[tracing]" in lines[0], (
        lines
    )


# --- processes opentelemetry-instrument does not reach: OTEL_SESSION_AUTO at interpreter start -----


def test_auto_variable_configures_a_plain_python_process(
    servers: tuple[HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    """No opentelemetry-instrument, no configure(): the installed .pth does it from the environment."""
    dynamo, other = servers
    report, stderr = _rollout(tmp_path, dynamo, other, [], OTEL_SESSION_AUTO="true")
    _assert_delivered(report, dynamo, other)
    assert stderr == ""


@pytest.mark.parametrize("value", [None, "", "false"])
def test_without_the_auto_variable_interpreter_start_imports_nothing(value: str | None) -> None:
    env = {name: v for name, v in os.environ.items() if not name.startswith("OTEL_")}
    if value is not None:
        env["OTEL_SESSION_AUTO"] = value
    probe = (
        "import sys; print(sorted(m for m in sys.modules if m.startswith(('otel_session', 'opentelemetry'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=30
    )
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, "[]", "")


def test_a_bad_auto_variable_is_one_line_and_the_process_runs() -> None:
    env = {name: v for name, v in os.environ.items() if not name.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", "print('ran')"],
        env={**env, "OTEL_SESSION_AUTO": "perhaps"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0 and result.stdout == "ran\n"
    [line] = result.stderr.splitlines()
    assert "OTEL_SESSION_AUTO" in line and "true/false" in line


def test_the_autostart_pth_is_installed() -> None:
    found = [
        Path(p) / "otel_session_autostart.pth"
        for p in sys.path
        if (Path(p) / "otel_session_autostart.pth").exists()
    ]
    assert found, "pip install -e . (or the wheel) installs otel_session_autostart.pth into site-packages"


RAY_DRIVER = """
import json, os, sys
import ray
import ray._private.ray_constants as ray_constants

ray_constants.ENABLE_RAY_CLUSTER = False  # loopback only, as in tests/test_carry.py
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
         _node_ip_address="127.0.0.1")

@ray.remote
class Rollout:
    # NeMo-RL-shaped rollout actor: the one trajectory() line, no configure() anywhere.
    def run(self, url):
        import httpx, otel_session
        with otel_session.trajectory() as traj:
            httpx.post(url)
        return traj.session_id

env = {"OTEL_SESSION_AUTO": "true", "OTEL_SESSION_DYNAMO_HOSTS": sys.argv[2]}
auto = Rollout.options(runtime_env={"env_vars": env}).remote()
plain = Rollout.options(runtime_env={"env_vars": {"OTEL_SESSION_DYNAMO_HOSTS": sys.argv[2]}}).remote()
runs = ((auto, "auto"), (plain, "plain"))
sessions = [ray.get(actor.run.remote(f"{sys.argv[1]}/{name}")) for actor, name in runs]
print(json.dumps(sessions))
ray.shutdown()
"""


def test_ray_actor_configures_itself_from_its_runtime_env(
    servers: tuple[HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'otel-session[ray]')")
    dynamo, _ = servers
    script = tmp_path / "driver.py"
    script.write_text(RAY_DRIVER)
    env = {name: v for name, v in os.environ.items() if not name.startswith("OTEL_")}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    driver = subprocess.Popen(
        [sys.executable, str(script), dynamo.url, dynamo.authority],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that a hung run is stopped with everything Ray started under it
    )
    try:
        stdout, stderr = driver.communicate(timeout=180)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=10)
    assert driver.returncode == 0, stderr[-3000:]
    auto_session, plain_session = json.loads(stdout.strip().splitlines()[-1])
    assert dynamo.seen[0][0] == "/auto" and dynamo.headers("x-dynamo-session-id") == [auto_session, None]
    assert plain_session is not None  # the actor without OTEL_SESSION_AUTO had a trajectory, sent nothing


# --- hosts known only at runtime -------------------------------------------------------------------


def test_add_dynamo_hosts_reaches_this_process_and_later_children_but_not_neighbours(
    servers: tuple[HeaderServer, HeaderServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dynamo, neighbour = servers  # neighbour: the same host, another port (a Gym or tool server)
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "frontend.invalid:8000")
    otel_session.configure(trusted_hosts=["gym.invalid"])
    for bad in ("127.0.0.1", "*.local:80", "http://127.0.0.1/v1", ""):
        with pytest.raises(ValueError, match="exact host:port"):
            otel_session.add_dynamo_hosts(bad)
    assert os.environ["OTEL_SESSION_DYNAMO_HOSTS"] == "frontend.invalid:8000"  # nothing changed
    otel_session.add_dynamo_hosts(f"http://{dynamo.authority}/v1")
    assert os.environ["OTEL_SESSION_DYNAMO_HOSTS"] == f"frontend.invalid:8000,{dynamo.authority}"
    active = _settings.current
    assert active is not None and active.rules.trusted  # the rest of the configuration is kept
    import httpx

    with otel_session.trajectory() as traj, httpx.Client() as client:
        client.get(f"{dynamo.url}/here")
        client.get(f"{neighbour.url}/here")
    assert dynamo.headers("x-dynamo-session-id") == [traj.session_id]
    assert neighbour.headers("x-dynamo-session-id") == [None]
    # A process started afterwards inherits the variable (here with OTEL_SESSION_AUTO, zero code).
    script = tmp_path / "rollout.py"
    script.write_text(ROLLOUT)
    env = {**os.environ, "OTEL_SESSION_AUTO": "true"}
    result = subprocess.run(
        [sys.executable, str(script), dynamo.url, neighbour.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    child = json.loads(result.stdout.strip().splitlines()[-1])["session"]
    assert dynamo.headers("x-dynamo-session-id")[1:] == [child] * 3
    assert neighbour.headers("x-dynamo-session-id") == [None] * 3


# --- quiet by default -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "warnings"),
    [
        ({"OTEL_SESSION_TRUSTED_HOSTS": "gym-agent:9000"}, 0),  # baggage-only: a forwarding process
        ({"OTEL_SESSION_DYNAMO_HOSTS": "dynamo:8000", "OTEL_SESSION_ADOPT": "session:session_id"}, 0),
        ({}, 1),  # nothing to deliver anywhere: the one real misconfiguration here
    ],
    ids=["baggage-only", "dynamo-and-adopt", "nothing"],
)
def test_zero_code_warns_once_per_real_misconfiguration_and_never_otherwise(
    env: dict[str, str], warnings: int
) -> None:
    clean = {name: v for name, v in os.environ.items() if not name.startswith("OTEL_")}
    app = "import aiohttp.web as w, fastapi; w.Application().freeze(); print('served')"
    result = subprocess.run(
        [INSTRUMENT, sys.executable, "-c", app],
        env={**clean, "OTEL_PYTHON_DISTRO": "otel_session", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout) == (0, "served\n"), result.stderr
    assert len(_our_lines(result.stderr)) == warnings, result.stderr


REQUESTS_ROLLOUT = """
import json, sys
import concurrent.futures
import requests, urllib3
import otel_session

dynamo, other = sys.argv[1], sys.argv[2]
with otel_session.trajectory() as traj:
    with requests.Session() as session:
        session.get(f"{dynamo}/requests")
        session.get(f"{other}/requests")
    urllib3.request("GET", f"{dynamo}/urllib3")
    with concurrent.futures.ThreadPoolExecutor() as pool:  # the threading instrumentation, on too
        pool.submit(requests.get, f"{dynamo}/pool").result()
print(json.dumps({"session": traj.session_id}))
"""


def test_zero_code_requests_urllib3_and_a_thread_pool(
    servers: tuple[HeaderServer, HeaderServer], tmp_path: Path
) -> None:
    dynamo, other = servers
    script = tmp_path / "rollout_requests.py"
    script.write_text(REQUESTS_ROLLOUT)
    clean = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env = {**clean, "OTEL_SESSION_DYNAMO_HOSTS": dynamo.authority, "OTEL_PYTHON_DISTRO": "otel_session"}
    result = subprocess.run(
        [INSTRUMENT, sys.executable, str(script), dynamo.url, other.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "already instrumented" not in result.stderr, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [path for path, _ in dynamo.seen] == ["/requests", "/urllib3", "/pool"]
    assert dynamo.headers("x-dynamo-session-id") == [report["session"]] * 3
    assert other.headers("x-dynamo-session-id") == [None] and other.headers("baggage") == [None]
