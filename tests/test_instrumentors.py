"""The hooks as OpenTelemetry instrumentors: entry points, lazy patching, disabling, undoing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from importlib.metadata import entry_points
from pathlib import Path

import aiohttp
import httpx
import pytest
import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

import otel_session
from otel_session import SESSION_HEADER, _registry
from otel_session.instrumentation import httpx as httpx_hook
from tests.recorder import Recorder

NAMES = {
    "otel_session_httpx",
    "otel_session_httpx2",
    "otel_session_aiohttp",
    "otel_session_urllib3",
    "otel_session_starlette",
    "otel_session_aiohttp_server",
}


def test_each_hook_is_an_instrumentor_entry_point() -> None:
    found = {ep.name: ep for ep in entry_points(group="opentelemetry_instrumentor") if ep.name in NAMES}
    assert set(found) == NAMES
    for entry_point in found.values():
        instrumentor = entry_point.load()()
        assert isinstance(instrumentor, BaseInstrumentor)
        assert instrumentor.instrumentation_dependencies()
    assert found["otel_session_httpx"].load()() is not found["otel_session_httpx2"].load()()
    ours = {
        ep.name
        for ep in entry_points(group="opentelemetry_instrumentor")
        if ep.value.startswith("otel_session.")
    }
    assert NAMES <= ours == set(_registry.instrumentors())  # the one registry: configure() finds them there


def _run(tmp_path: Path, source: str, **env: str) -> dict[str, object]:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(source))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTEST"))}
    done = subprocess.run(
        [sys.executable, str(script)], env={**clean, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


PROBE = """
    import json, os, sys
    import otel_session
    otel_session.configure(dynamo_hosts=[os.environ["DYNAMO"]])
    imported_by_configure = sorted(m for m in ("httpx", "httpx2", "aiohttp") if m in sys.modules)
    import httpx, aiohttp, wrapt
    patched = {
        "httpx": isinstance(httpx.HTTPTransport.__dict__["handle_request"], wrapt.FunctionWrapper),
        "aiohttp": isinstance(aiohttp.ClientRequest.__dict__["send"], wrapt.FunctionWrapper),
    }
    with otel_session.trajectory() as traj:
        httpx.get("http://" + os.environ["DYNAMO"] + "/x")
    print(json.dumps({"imported": imported_by_configure, "patched": patched, "session": traj.session_id}))
"""


def test_configure_imports_no_client_library_and_patches_each_when_imported(
    tmp_path: Path, dynamo: Recorder
) -> None:
    report = _run(tmp_path, PROBE, DYNAMO=dynamo.authority)
    assert report["imported"] == []
    assert report["patched"] == {"httpx": True, "aiohttp": True}
    assert dynamo.requests[0].get(SESSION_HEADER) == report["session"]


def test_disabled_instrumentations_are_honoured(tmp_path: Path, dynamo: Recorder) -> None:
    report = _run(
        tmp_path, PROBE, DYNAMO=dynamo.authority, OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="otel_session_aiohttp"
    )
    assert report["patched"] == {"httpx": True, "aiohttp": False}


PATCHED = (
    (httpx.HTTPTransport, "handle_request"),
    (httpx.AsyncHTTPTransport, "handle_async_request"),
    (httpx.MockTransport, "handle_request"),
    (httpx.MockTransport, "handle_async_request"),
    (httpx.ASGITransport, "handle_async_request"),
    (httpx.WSGITransport, "handle_request"),
    (httpx.Client, "__init__"),
    (httpx.AsyncClient, "__init__"),
    (aiohttp.ClientRequest, "send"),
)


def test_unconfigure_puts_every_original_method_back() -> None:
    originals = [owner.__dict__[name] for owner, name in PATCHED]
    assert not any(isinstance(method, wrapt.FunctionWrapper) for method in originals)
    otel_session.configure(dynamo_hosts=["d"])
    assert all(isinstance(owner.__dict__[name], wrapt.FunctionWrapper) for owner, name in PATCHED)
    otel_session.unconfigure()
    assert [owner.__dict__[name] for owner, name in PATCHED] == originals


@pytest.mark.parametrize("order", ["ours-first", "upstream-first"])
def test_upstream_instrumentation_on_and_off_never_doubles_or_drops_ours(
    order: str, dynamo: Recorder
) -> None:
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    upstream = HTTPXClientInstrumentor()
    if order == "upstream-first":
        upstream.instrument()
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    if order == "ours-first":
        upstream.instrument()
    upstream.uninstrument()
    with otel_session.trajectory() as traj:
        httpx.get(f"{dynamo.url}/x")
    otel_session.unconfigure()
    httpx.get(f"{dynamo.url}/after")
    assert [r.get(SESSION_HEADER) for r in dynamo.requests] == [traj.session_id, None]


TRANSPORT_PROBE = """
    import json, os
    import httpx, wrapt
    import otel_session

    def patched(kind: type) -> bool:
        return isinstance(kind.__dict__["handle_request"], wrapt.FunctionWrapper)

    otel_session.configure(dynamo_hosts=[os.environ["DYNAMO"]])

    class Retarget(httpx.BaseTransport):  # defined after configure(): patched when a client uses it
        def __init__(self) -> None:
            self.inner = httpx.HTTPTransport()

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            request.url = request.url.copy_with(path="/retargeted")
            host, port = os.environ["DYNAMO"].split(":")
            request.url = request.url.copy_with(host=host, port=int(port))
            return self.inner.handle_request(request)

    class Answer(httpx.BaseTransport):  # never reaches httpx's own transport
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json=dict(request.headers))

    seen = [patched(httpx.HTTPTransport), patched(Retarget), patched(Answer)]
    with otel_session.trajectory() as traj:
        httpx.get("http://" + os.environ["DYNAMO"] + "/stock")
        with httpx.Client(transport=Retarget()) as client:
            client.get("http://" + os.environ["OTHER"] + "/custom")
        with httpx.Client(mounts={"http://": Answer()}) as client:
            answered = client.get("http://" + os.environ["DYNAMO"] + "/answered").json()
    seen += [patched(Retarget), patched(Answer)]
    otel_session.unconfigure()
    seen += [patched(httpx.HTTPTransport), patched(Retarget), patched(Answer)]
    print(json.dumps({"patched": seen, "session": traj.session_id, "answered": answered}))
"""


def test_a_transport_class_defined_later_is_patched_when_a_client_uses_it(
    tmp_path: Path, dynamo: Recorder, other: Recorder
) -> None:
    """httpx's own transport is patched when httpx is; a transport class defined after configure()
    when the first client using it is built (as a mount too). A hop it re-targets is planned again
    where it really goes; one it answers itself carries the session; unconfigure takes all off."""
    report = _run(tmp_path, TRANSPORT_PROBE, DYNAMO=dynamo.authority, OTHER=other.authority)
    assert report["patched"] == [True, False, False, True, True, False, False, False]
    assert [(r.path, r.get(SESSION_HEADER)) for r in dynamo.requests] == [
        ("/stock", report["session"]),
        ("/retargeted", report["session"]),  # planned for a tool host, sent to Dynamo
    ]
    assert other.requests == []
    answered = report["answered"]
    assert isinstance(answered, dict)
    assert answered.get(SESSION_HEADER.lower()) == report["session"]


def test_httpx_own_transport_is_sent_a_stand_in_only_while_it_reads_no_more_than_that_carries() -> None:
    """A stand-in carries only the attributes httpx's own transport reads, checked on its code: a
    library whose transport read more (the body, say) would be sent full copies instead."""
    import httpx2

    otel_session.configure(dynamo_hosts=["d"])
    assert {httpx.Request, httpx2.Request} <= httpx_hook._stand_ins_for

    class Reading(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, content=request.content)

    library = types.SimpleNamespace(
        Request=httpx.Request, HTTPTransport=Reading, AsyncHTTPTransport=httpx.AsyncHTTPTransport
    )
    assert not httpx_hook._transport_reads_only_the_basics(library)  # type: ignore[arg-type]
    assert httpx_hook._transport_reads_only_the_basics(httpx)
