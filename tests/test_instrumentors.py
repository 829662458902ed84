"""The client hooks as OpenTelemetry instrumentors: entry points, lazy patching, disabling, undoing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import aiohttp
import httpx
import pytest
import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

import otel_session
from otel_session import SESSION_HEADER
from tests.recorder import Recorder

NAMES = {"otel_session_httpx", "otel_session_httpx2", "otel_session_aiohttp"}


def test_each_hook_is_an_instrumentor_entry_point() -> None:
    found = {ep.name: ep for ep in entry_points(group="opentelemetry_instrumentor") if ep.name in NAMES}
    assert set(found) == NAMES
    for entry_point in found.values():
        instrumentor = entry_point.load()()
        assert isinstance(instrumentor, BaseInstrumentor)
        assert instrumentor.instrumentation_dependencies()
    assert found["otel_session_httpx"].load()() is not found["otel_session_httpx2"].load()()


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
        "httpx": isinstance(httpx.Client.__dict__["_send_single_request"], wrapt.FunctionWrapper),
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


def test_unconfigure_puts_every_original_method_back() -> None:
    originals = (httpx.Client.__dict__["_send_single_request"], aiohttp.ClientRequest.__dict__["send"])
    assert not any(isinstance(method, wrapt.FunctionWrapper) for method in originals)
    otel_session.configure(dynamo_hosts=["d"])
    assert isinstance(httpx.Client.__dict__["_send_single_request"], wrapt.FunctionWrapper)
    otel_session.unconfigure()
    after = (httpx.Client.__dict__["_send_single_request"], aiohttp.ClientRequest.__dict__["send"])
    assert after == originals


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

    def patched() -> bool:
        return isinstance(httpx.HTTPTransport.__dict__["handle_request"], wrapt.FunctionWrapper)

    class Retarget(httpx.BaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.HTTPTransport()

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            request.url = request.url.copy_with(path="/retargeted")
            host, port = os.environ["DYNAMO"].split(":")
            request.url = request.url.copy_with(host=host, port=int(port))
            return self.inner.handle_request(request)

    otel_session.configure(dynamo_hosts=[os.environ["DYNAMO"]])
    seen = [patched()]
    with otel_session.trajectory() as traj:
        httpx.get("http://" + os.environ["DYNAMO"] + "/stock")
        seen.append(patched())
        with httpx.Client(transport=Retarget()) as client:
            client.get("http://" + os.environ["OTHER"] + "/custom")
        seen.append(patched())
    otel_session.unconfigure()
    seen.append(patched())
    print(json.dumps({"patched": seen, "session": traj.session_id}))
"""


def test_httpx_own_transport_is_patched_only_once_another_transport_is_used(
    tmp_path: Path, dynamo: Recorder, other: Recorder
) -> None:
    """httpx's ``HTTPTransport`` sends where the URL says: a process whose clients all use it pays
    for no hook there. The first request through another transport (which may re-target it) patches
    it, that very request is planned again where it really goes, and unconfigure takes it off."""
    report = _run(tmp_path, TRANSPORT_PROBE, DYNAMO=dynamo.authority, OTHER=other.authority)
    assert report["patched"] == [False, False, True, False]
    assert [(r.path, r.get(SESSION_HEADER)) for r in dynamo.requests] == [
        ("/stock", report["session"]),
        ("/retargeted", report["session"]),  # planned for a tool host, sent to Dynamo
    ]
    assert other.requests == []
