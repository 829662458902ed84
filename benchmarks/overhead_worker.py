"""One side of a process pair in ``overhead.py``: a whole process sending chunks of httpx requests.

    python benchmarks/overhead_worker.py --kind bare|imports|least|configured --dynamo URL --other URL

The point of a separate process per side is that each pays everything its setup brings, as a user's
process would: what the imports load (and every later garbage collection then walks), what
``configure()`` patches, and the hook on each request. So the bare side must not import
otel-session at all, and this module imports nothing of the project (no ``sys.path`` games either:
the coordinator chooses which otel-session the others load through ``PYTHONPATH``).

Kinds: ``bare`` imports httpx only; ``imports`` also imports the modules ``--imports`` names (by
default otel-session and the client libraries ``configure()`` imported up front as of the
baseline, httpx2 and aiohttp), without configuring anything, to show what the imports alone cost;
``least`` never imports otel-session either, and installs the least hook that delivers a session
header (``install_least_hook``), to show what delivering one costs at the least; ``configured``
calls ``otel_session.configure(dynamo_hosts=[the dynamo URL's host:port])`` with tracing off.

It speaks JSON lines: first it prints what its setup cost, then for each command read from stdin
(``{"case": "dynamo" | "other" | "outside", "n": N}``) it sends ``N`` requests on one keep-alive
``httpx.Client`` and prints the chunk's process CPU, wall time, time in garbage collection, and
the wall time to the end of its first request (a trajectory's start, paid with caches cold).
"dynamo" and "other" run inside one ``trajectory()`` per chunk (configured side only), to the
Dynamo host or to a host that is not configured; "outside" goes to the Dynamo host with no
trajectory open. ``{"check": PATH}`` sends one request per case to ``PATH/<case>`` (the server
records those) so the coordinator can see the session header went where it should and
nowhere else. End of input ends the process.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

PAYLOAD = {"model": "bench", "messages": [{"role": "user", "content": "hello"}]}
IMPORTED_BY_CONFIGURE = "otel_session,httpx2,aiohttp"  # what configure() imported up front at the baseline
Opener = Callable[[bool], contextlib.AbstractContextManager[Any]]


class GcClock:
    """Wall time spent in the garbage collector, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections += 1


def no_trajectory(inside: bool) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def session_trajectory(inside: bool) -> contextlib.AbstractContextManager[Any]:
    import otel_session  # the configured side only, which imported it in setup()

    return otel_session.trajectory() if inside else contextlib.nullcontext()


def install_least_hook(dynamo_url: str) -> None:
    """The least any hook can do to deliver a session: the floor's own floor, in the same run.

    One wrapt wrapper on httpx's transport (wrapt, as OpenTelemetry's instrumentations patch), which
    sends requests for the Dynamo host as a stand-in with one fixed session header appended, built
    the cheapest way known (httpx's private header list, as otel-session's fast path). No context
    read, no configuration, no check of what the caller set: nothing a real library can skip.
    """
    import uuid

    import httpx
    import wrapt

    where = urlsplit(dynamo_url)
    host, port = where.hostname, where.port
    entry = (b"X-Dynamo-Session-ID", b"x-dynamo-session-id", str(uuid.uuid4()).encode())

    def handle_request(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = args[0]
        url = request.url
        if url.host != host or url.port != port:
            return wrapped(*args, **kwargs)
        headers = object.__new__(httpx.Headers)
        headers._list = [*request.headers._list, entry]
        headers._encoding = request.headers._encoding
        sent = object.__new__(httpx.Request)
        sent.method, sent.url, sent.stream = request.method, url, request.stream
        sent.extensions, sent.headers = request.extensions, headers
        return wrapped(sent)

    wrapt.wrap_function_wrapper(httpx.HTTPTransport, "handle_request", handle_request)


def setup(kind: str, dynamo_url: str, imports: Sequence[str]) -> tuple[dict[str, Any], Opener]:
    """Import and configure as ``kind`` says; returns what that cost and the trajectory opener."""
    cpu, wall = time.process_time(), time.perf_counter()
    import httpx  # noqa: F401  (every side uses it; timed on its own)

    httpx_cpu, httpx_wall = time.process_time() - cpu, time.perf_counter() - wall
    opener: Opener = no_trajectory
    library = ""
    if kind == "imports":
        for name in imports:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
    elif kind == "least":
        install_least_hook(dynamo_url)
    elif kind == "configured":
        import otel_session

        otel_session.configure(dynamo_hosts=[urlsplit(dynamo_url).netloc], tracing=False)
        opener = session_trajectory

    if "otel_session" in sys.modules:
        library = os.path.dirname(sys.modules["otel_session"].__file__ or "")
    facts = {
        "kind": kind,
        "library": library,
        "import_httpx_cpu_ms": round(httpx_cpu * 1e3, 2),
        "import_httpx_wall_ms": round(httpx_wall * 1e3, 2),
        "setup_cpu_ms": round((time.process_time() - cpu) * 1e3, 2),
        "setup_wall_ms": round((time.perf_counter() - wall) * 1e3, 2),
        "process_cpu_ms_at_ready": round(time.process_time() * 1e3, 2),
        "max_rss_kb_at_ready": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "modules": len(sys.modules),
        "gc_objects": len(gc.get_objects()),
        "top_level_packages": sorted({name.partition(".")[0] for name in sys.modules}),
    }
    return facts, opener


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--kind", choices=("bare", "imports", "least", "configured"), required=True)
    parser.add_argument("--dynamo", required=True, help="base URL of the Dynamo host")
    parser.add_argument("--other", required=True, help="base URL of a host that is not configured")
    parser.add_argument("--imports", default=IMPORTED_BY_CONFIGURE, help="modules the imports side imports")
    args = parser.parse_args()
    facts, trajectory = setup(args.kind, args.dynamo, [name for name in args.imports.split(",") if name])
    import httpx

    urls = {"dynamo": args.dynamo, "other": args.other, "outside": args.dynamo}
    clock = GcClock()
    client = httpx.Client()
    print(json.dumps(facts), flush=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if "check" in command:
                for case, url in urls.items():
                    with trajectory(case != "outside"):
                        client.post(f"{url}{command['check']}/{case}", json=PAYLOAD)
                print("{}", flush=True)
                continue
            url, n = f"{urls[command['case']]}/v1/chat/completions", int(command["n"])
            gc_before = clock.seconds, clock.collections
            cpu, wall = time.process_time(), time.perf_counter()
            first = 0.0
            with trajectory(command["case"] != "outside"):
                for index in range(n):
                    client.post(url, json=PAYLOAD).raise_for_status()
                    if index == 0:  # the trajectory's start and its first request, caches cold
                        first = time.perf_counter() - wall
            wall = time.perf_counter() - wall
            cpu = time.process_time() - cpu
            result = {
                "cpu": cpu,
                "wall": wall,
                "first": first,
                "gc": clock.seconds - gc_before[0],
                "collections": clock.collections - gc_before[1],
            }
            print(json.dumps(result), flush=True)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
