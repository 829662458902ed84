"""Every configuration block by block, in one process: tracing on, the upstream instrumentors.

    python benchmarks/overhead_configs.py            # about 3 minutes on 2 cores
    python benchmarks/overhead_configs.py --quick    # 4 rounds of a quarter of the requests

A third view, for costs far above the tracing-off hook's: each round visits every configuration
once, in a shuffled order, for a short block of requests, and a row's "added" figure is the median
over rounds of (row - the bare row of the same round). Good to some microseconds on a shared
machine, which is plenty for costs of 80 to 400 us; the tracing-off figures are better taken by
``overhead.py`` (two whole processes, what a user pays) and ``overhead_requests.py`` (the hook's
own CPU, request by request).

Measured are client CPU (``time.process_time``: every thread of this process, so a span
processor's export thread counts) and wall time (``time.perf_counter``). In-process rows use a
transport that answers without a socket (see ``overhead_clients.py``); loopback rows talk to
``_servers.py`` in a separate process, so server CPU is not counted. "dynamo" rows go to the host
configured in ``dynamo_hosts`` inside a ``trajectory()`` (the session header is added); "other"
rows to a host that is not configured (nothing is added).

Tracing "on" is ``configure(tracing=True)``, exporting over OTLP/HTTP to a sink on loopback (the
benchmark server, which discards it); every timed block ends with a flush, so exporting its spans is
paid inside the window. Its global instrumentation does not reach ``MockTransport``, so in-process
httpx/openai tracing rows also get ``instrument_client`` with the global provider, as a real
transport would be instrumented. If the library cannot trace here, those rows are left out and the
output says so. "upstream" rows are ``opentelemetry-instrumentation-httpx`` / ``-aiohttp-client``
on the client without (API only) and with an SDK provider exporting the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # run as a script: `benchmarks.*` importable; PYTHONPATH still first

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import httpx2  # noqa: E402
import openai  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.instrumentation.aiohttp_client import create_trace_config  # noqa: E402
from opentelemetry.instrumentation.httpx import HTTPX2ClientInstrumentor, HTTPXClientInstrumentor  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402
from opentelemetry.trace import NoOpTracerProvider  # noqa: E402

import otel_session  # noqa: E402
from benchmarks._servers import LoopbackServer, canned_aiohttp_connector  # noqa: E402
from benchmarks.overhead_clients import (  # noqa: E402
    CLIENTS,
    INPROC_DYNAMO_AUTHORITY,
    INPROC_URLS,
    MESSAGES,
    PAYLOAD,
    SESSION_HEADER,
    Canned,
    maybe_trajectory,
    no_sdk_in_effect,
)
from benchmarks.overhead_report import machine, quartiles, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "overhead_configs.json"
ENV_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


@dataclass(frozen=True)
class Variant:
    """One row: what is installed, where the request goes, and whether a trajectory is open."""

    key: str
    label: str
    mode: str  # none | session | session+tracing | upstream | upstream+sdk
    host: str  # dynamo | other
    in_trajectory: bool = True

    @property
    def baseline(self) -> str:
        return f"none:{self.host}"


VARIANTS = (
    Variant("none:dynamo", "nothing installed -> dynamo", "none", "dynamo"),
    Variant("none:other", "nothing installed -> other", "none", "other"),
    Variant("session:dynamo", "otel-session, tracing off -> dynamo", "session", "dynamo"),
    Variant("session:other", "otel-session, tracing off -> other", "session", "other"),
    Variant("session:outside", "otel-session, off, no trajectory -> dynamo", "session", "dynamo", False),
    Variant("tracing:dynamo", "otel-session, tracing on -> dynamo", "session+tracing", "dynamo"),
    Variant("tracing:other", "otel-session, tracing on -> other", "session+tracing", "other"),
    Variant("upstream:dynamo", "upstream instrumentor, API only -> dynamo", "upstream", "dynamo"),
    Variant("upstream+sdk:dynamo", "upstream instrumentor + SDK -> dynamo", "upstream+sdk", "dynamo"),
)


@dataclass
class Setup:
    """What one timed block adds to its own client, and what it calls before the clock stops.

    ``instrument`` is ``False`` for nothing, else the tracer provider for the upstream instrumentor.
    """

    instrument: Any = False
    flush: Callable[[], object] | None = None


@dataclass
class Env:
    """Process-wide pieces shared by all measurements."""

    provider: TracerProvider  # the "upstream + SDK" rows' own provider
    dynamo_authority: str = ""

    @contextlib.contextmanager
    def installed(self, mode: str, inproc: bool, client: str) -> Iterator[Setup]:
        """Install ``mode`` globally for one timed block, and undo it afterwards."""
        setup = Setup()
        if mode in ("session", "session+tracing"):
            tracing = mode == "session+tracing"
            otel_session.configure(dynamo_hosts=[self.dynamo_authority], tracing=tracing)
            if tracing:
                ours = trace.get_tracer_provider()  # otel-session's, made global at its first tracing-on
                setup.flush = getattr(ours, "force_flush", None)
                if inproc and client != "aiohttp":  # global instrument() does not reach MockTransport
                    setup.instrument = ours
        elif mode == "upstream":
            setup.instrument = NoOpTracerProvider()  # API only, even once an SDK provider is global
        elif mode == "upstream+sdk":
            setup.instrument, setup.flush = self.provider, self.provider.force_flush
        try:
            yield setup
        finally:
            otel_session.unconfigure()


def _timed(run: Callable[[int], None], n: int, setup: Setup) -> tuple[float, float]:
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    run(n)
    if setup.flush is not None:
        setup.flush()  # this block's spans are exported inside the window
    return (time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6


async def _atimed(
    run: Callable[[int], Coroutine[Any, Any, None]], n: int, setup: Setup
) -> tuple[float, float]:
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    await run(n)
    if setup.flush is not None:
        setup.flush()
    return (time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6


# Each measure_* sends warm-up requests (noting, in-process, the session header each carried), then
# ``n`` timed ones, and returns (CPU us/request, wall us/request, session headers seen in warm-up).
Measured = tuple[float, float, list[str | None]]


def _httpx_instrument(instrumentor: Any, client: Any, setup: Setup) -> None:
    if setup.instrument is not False:
        instrumentor.instrument_client(client, tracer_provider=setup.instrument)


def measure_httpx_sync(url: str, inproc: bool, setup: Setup, traj: bool, n: int, warm: int) -> Measured:
    canned = Canned(httpx)
    client = httpx.Client(transport=httpx.MockTransport(canned)) if inproc else httpx.Client()
    _httpx_instrument(HTTPXClientInstrumentor, client, setup)

    def run(count: int) -> None:
        for _ in range(count):
            client.post(url, json=PAYLOAD).raise_for_status()

    try:
        with maybe_trajectory(traj):
            run(warm)
            canned.check = False
            cpu, wall = _timed(run, n, setup)
    finally:
        client.close()
    return cpu, wall, canned.seen


async def measure_httpx_async(
    url: str, inproc: bool, setup: Setup, traj: bool, n: int, warm: int
) -> Measured:
    canned = Canned(httpx)
    client = httpx.AsyncClient(transport=httpx.MockTransport(canned)) if inproc else httpx.AsyncClient()
    _httpx_instrument(HTTPXClientInstrumentor, client, setup)

    async def run(count: int) -> None:
        for _ in range(count):
            (await client.post(url, json=PAYLOAD)).raise_for_status()

    try:
        with maybe_trajectory(traj):
            await run(warm)
            canned.check = False
            cpu, wall = await _atimed(run, n, setup)
    finally:
        await client.aclose()
    return cpu, wall, canned.seen


def measure_openai_sync(url: str, inproc: bool, setup: Setup, traj: bool, n: int, warm: int) -> Measured:
    canned = Canned(httpx2)
    http = httpx2.Client(transport=httpx2.MockTransport(canned)) if inproc else httpx2.Client()
    _httpx_instrument(HTTPX2ClientInstrumentor, http, setup)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="bench", http_client=http, max_retries=0)

    def run(count: int) -> None:
        for _ in range(count):
            client.chat.completions.create(model="bench", messages=MESSAGES)

    try:
        with maybe_trajectory(traj):
            run(warm)
            canned.check = False
            cpu, wall = _timed(run, n, setup)
    finally:
        client.close()
    return cpu, wall, canned.seen


async def measure_aiohttp(url: str, inproc: bool, setup: Setup, traj: bool, n: int, warm: int) -> Measured:
    trace_configs = (
        [] if setup.instrument is False else [create_trace_config(tracer_provider=setup.instrument)]
    )
    seen: list[str | None] = []
    checking = True

    def on_request(head: bytes) -> None:
        """The request as written to the (in-memory) socket, after every hook ran."""
        if checking:
            found = None
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == SESSION_HEADER.encode():
                    found = value.strip().decode()
            seen.append(found)

    connector = canned_aiohttp_connector(on_request=on_request) if inproc else aiohttp.TCPConnector()
    session = aiohttp.ClientSession(connector=connector, trace_configs=trace_configs)

    async def run(count: int) -> None:
        for _ in range(count):
            async with session.post(f"{url}/v1/chat/completions", json=PAYLOAD) as response:
                response.raise_for_status()
                await response.read()

    try:
        with maybe_trajectory(traj):
            await run(warm)
            checking = False
            cpu, wall = await _atimed(run, n, setup)
    finally:
        await session.close()
    return cpu, wall, seen if inproc else []


MEASURES: dict[str, tuple[Callable[..., Any], bool]] = {  # name: (measure function, async?)
    "httpx-sync": (measure_httpx_sync, False),
    "httpx-async": (measure_httpx_async, True),
    "openai-sync": (measure_openai_sync, False),
    "aiohttp": (measure_aiohttp, True),
}


@dataclass
class Samples:
    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    header_ok: bool = True


def _expected_header(variant: Variant) -> bool:
    return variant.mode.startswith("session") and variant.host == "dynamo" and variant.in_trajectory


def run_scenario(
    env: Env,
    variants: Sequence[Variant],
    client: str,
    transport: str,
    urls: dict[str, str],
    rounds: int,
    n: int,
    warm: int,
    seed: int,
) -> dict[str, Samples]:
    """All variants of one (client, transport), interleaved block by block."""
    measure, is_async = MEASURES[client]
    inproc = transport == "in-process"
    samples = {variant.key: Samples() for variant in variants}
    order = list(variants)
    rng = random.Random(seed)
    loop = asyncio.new_event_loop() if is_async else None
    try:
        for _ in range(rounds):
            rng.shuffle(order)
            for variant in order:
                with env.installed(variant.mode, inproc, client) as setup:
                    args = (urls[variant.host], inproc, setup, variant.in_trajectory, n, warm)
                    if loop is not None:
                        cpu, wall, seen = loop.run_until_complete(measure(*args))
                    else:
                        cpu, wall, seen = measure(*args)
                sample = samples[variant.key]
                sample.cpu.append(cpu)
                sample.wall.append(wall)
                if any((value is not None) != _expected_header(variant) for value in seen):
                    sample.header_ok = False
    finally:
        if loop is not None:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
    return samples


def summarize(samples: dict[str, Samples], variants: Sequence[Variant]) -> list[dict[str, Any]]:
    """Per row: medians, and the median of the per-round differences to its baseline."""
    rows = []
    for variant in variants:
        mine, base = samples[variant.key], samples[variant.baseline]
        added_cpu = [a - b for a, b in zip(mine.cpu, base.cpu, strict=True)]
        added_wall = [a - b for a, b in zip(mine.wall, base.wall, strict=True)]
        base_wall = statistics.median(base.wall)
        rows.append(
            {
                "variant": variant.key,
                "label": variant.label,
                "host": variant.host,
                "in_trajectory": variant.in_trajectory,
                "cpu_us": statistics.median(mine.cpu),
                "wall_us": statistics.median(mine.wall),
                "added_cpu_us": statistics.median(added_cpu),
                "added_cpu_us_iqr": quartiles(added_cpu),
                "ratio_cpu": statistics.median(a / b for a, b in zip(mine.cpu, base.cpu, strict=True)),
                "added_wall_us": statistics.median(added_wall),
                "baseline_wall_us": base_wall,
                "added_cpu_pct_of_wall": 100 * statistics.median(added_cpu) / base_wall,
                "header_as_expected": mine.header_ok,
                "samples_cpu_us": [round(value, 2) for value in mine.cpu],
                "samples_wall_us": [round(value, 2) for value in mine.wall],
            }
        )
    return rows


def print_table(title: str, rows: list[dict[str, Any]], loopback: bool) -> None:
    print(f"\n{title}")
    head = f"  {'row':44} {'CPU us/req':>10} {'added':>8} {'added IQR':>15} {'ratio':>6}"
    if loopback:
        head += f" {'wall us':>8} {'added':>8} {'CPU added/wall':>14}"
    print(head)
    for row in rows:
        baseline = row["variant"].startswith("none:")
        lo, hi = row["added_cpu_us_iqr"]
        line = f"  {row['label']:44} {row['cpu_us']:10.1f} "
        if baseline:
            line += f"{'':>8} {'':>15} {'1.00':>6}"
        else:
            line += f"{row['added_cpu_us']:+8.1f} {f'[{lo:+.1f}, {hi:+.1f}]':>15} {row['ratio_cpu']:6.2f}"
        if loopback:
            line += f" {row['wall_us']:8.1f} "
            if not baseline:
                line += f"{row['added_wall_us']:+8.1f} {row['added_cpu_pct_of_wall']:13.1f}%"
        if not row["header_as_expected"]:
            line += "  !! session header not as expected"
        print(line)


def _native_tracing(authority: str) -> bool:
    try:
        otel_session.configure(dynamo_hosts=[authority], tracing=True)
    except (NotImplementedError, ImportError):
        return False
    finally:
        otel_session.unconfigure()
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds of a quarter of the requests")
    parser.add_argument("--rounds", type=int, help="rounds per scenario (default 15)")
    parser.add_argument("--requests", type=int, help="in-process requests per block (default 400)")
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"subset of {','.join(CLIENTS)}")
    parser.add_argument("--transports", default="in-process,loopback")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds = args.rounds or (4 if args.quick else 15)
    n_inproc = args.requests or (100 if args.quick else 400)
    n_loopback = max(25, n_inproc // 4)
    warm = 20
    logging.getLogger("otel_session").setLevel(logging.ERROR)  # the "no Dynamo hosts" hint is not news here
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    with LoopbackServer(["127.0.0.1", "127.0.0.2", "127.0.0.3"]) as server:
        sink = f"{server.urls[2]}/v1/traces"  # OTLP/HTTP export, answered 200 and dropped
        os.environ[ENV_TRACES_ENDPOINT] = sink
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=sink)))
        native = _native_tracing(server.authorities[0])
        variants = [v for v in VARIANTS if native or v.mode != "session+tracing"]
        if not no_sdk_in_effect():
            print(
                "turning tracing off left a recording provider in effect: 'off' rows would lie",
                file=sys.stderr,
            )
            return 2
        env = Env(provider)
        tracing_mode = (
            "configure(tracing=True), OTLP/HTTP to a loopback sink"
            if native
            else "not available here: its rows are left out"
        )
        print(
            f"Every configuration, block by block: {rounds} rounds, blocks of {n_inproc} in-process / "
            f"{n_loopback} loopback requests (openai: a quarter); tracing on = {tracing_mode}"
        )
        for transport in args.transports.split(","):
            for client in args.clients.split(","):
                share = CLIENTS[client][1]
                if transport == "in-process":
                    urls = INPROC_URLS
                    env.dynamo_authority, n = INPROC_DYNAMO_AUTHORITY, max(10, int(n_inproc * share))
                else:
                    urls = {"dynamo": server.urls[0], "other": server.urls[1]}
                    env.dynamo_authority, n = server.authorities[0], max(10, int(n_loopback * share))
                samples = run_scenario(env, variants, client, transport, urls, rounds, n, warm, args.seed)
                rows = summarize(samples, variants)
                results.append(
                    {"client": client, "transport": transport, "requests_per_block": n, "rows": rows}
                )
                title = f"{CLIENTS[client][0]}, {transport} ({rounds} rounds x {n} requests per row)"
                print_table(title, rows, transport == "loopback")
                if not no_sdk_in_effect():
                    print("a recording provider leaked into tracing-off rows", file=sys.stderr)
                    return 2
        provider.shutdown()
    meta = machine() | {
        "view": "in-process, every configuration block by block (tracing on, upstream instrumentors)",
        "timer": "time.process_time (client process, all threads) and time.perf_counter, per block",
        "method": "interleaved rounds, shuffled, added = median over rounds of (row - same-round baseline)",
        "rounds": rounds,
        "warmup_requests_per_block": warm,
        "tracing_on": tracing_mode,
        "server": "benchmarks/_servers.py: asyncio + uvloop in a separate process",
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_results(args.out, {"meta": meta, "scenarios": results})
    print(f"\nwrote {args.out} ({meta['seconds']} s)")
    ok = all(row["header_as_expected"] for scenario in results for row in scenario["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
