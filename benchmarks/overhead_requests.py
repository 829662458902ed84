"""What otel-session's hook costs per request, in one process: hooked and bare requests taking turns.

    python benchmarks/overhead_requests.py            # about 1 minute on 2 cores
    python benchmarks/overhead_requests.py --quick    # half the requests, a smoke check

A second view, narrower than ``overhead.py`` (two whole processes, what a user pays): the CPU of the
hook itself, tracing off. One configured process, one client, its requests alternately through otel-
session's hook and around it ("bare": the transport's or request's own method, ``__wrapped__`` under
the hook, shadowed on that instance: the client with nothing installed), in a trajectory to the
Dynamo host, to another host, and outside any trajectory; to Dynamo a third kind takes turns, bare
but setting the header by hand, the floor for any way of delivering it. Each request is timed on its
own and the lower quartiles compared: thousands of requests interleaved on one connection, so the
machine's other load and each connection's own timing fall out of the difference. What it leaves out
is everything the process pays as a whole (imports, what a patched method costs the interpreter, a
trajectory's own cost): that is ``overhead.py``'s figure.

In-process rows use a transport that answers without a socket (see ``overhead_clients.py``), so
they are the client library's own CPU plus ours; loopback rows talk to ``_servers.py`` in its own
process. The budget checked: at most 10 us of CPU per httpx sync request in-process, and at most
5% of a loopback request's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # run as a script: `benchmarks.*` importable; PYTHONPATH still first

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import httpx2  # noqa: E402
import openai  # noqa: E402

import otel_session  # noqa: E402
from benchmarks._servers import LoopbackServer, canned_aiohttp_connector  # noqa: E402
from benchmarks.overhead_clients import (  # noqa: E402
    CLIENTS,
    INPROC_DYNAMO_AUTHORITY,
    INPROC_URLS,
    MESSAGES,
    PAYLOAD,
    Canned,
    maybe_trajectory,
    no_sdk_in_effect,
    unhooked,
)
from benchmarks.overhead_report import lower_quartile, machine, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "overhead_requests.json"
CPU_BUDGET_US = 10.0  # httpx sync, in-process, tracing off
WALL_SHARE_BUDGET = 0.05  # added CPU per request / a loopback request's wall time, tracing off


PAIRED_TARGETS = (
    ("session:dynamo", "dynamo", True),
    ("session:other", "other", True),
    ("session:outside", "dynamo", False),
)


class Toggled:
    """One client whose requests go through otel-session's hook or not, switched per request.

    "Bare" shadows the hooked method with the original one on this instance only (httpx: the
    client's transport; aiohttp: the session's request class), so both kinds of request share the
    client, its pool and its very connection: nothing but the hook differs. (Two separate clients do
    not compare well over loopback: each connection's timing settles differently, by more than the
    hook costs.)
    """

    def __init__(self, client: str, url: str, inproc: bool) -> None:
        self.kind = client
        self.url = url
        if client in ("httpx-sync", "httpx-async"):
            cls = httpx.AsyncClient if client == "httpx-async" else httpx.Client
            self.http: Any = (
                cls(transport=httpx.MockTransport(Canned(httpx, check=False))) if inproc else cls()
            )
            self._shadow("handle_async_request" if client == "httpx-async" else "handle_request")
        elif client == "openai-sync":
            transport = httpx2.MockTransport(Canned(httpx2, check=False)) if inproc else None
            self.http = httpx2.Client(transport=transport)
            self._shadow("handle_request")
            self.openai = openai.OpenAI(
                base_url=f"{url}/v1", api_key="bench", http_client=self.http, max_retries=0
            )
        else:
            connector = canned_aiohttp_connector() if inproc else aiohttp.TCPConnector()
            self.http = aiohttp.ClientSession(connector=connector)
            original = unhooked(aiohttp.ClientRequest, "send")
            self.bare_request = type("BareRequest", (aiohttp.ClientRequest,), {"send": original})

    def _shadow(self, method: str) -> None:
        """httpx's hook is on the client's transport class: "bare" shadows it on this transport."""
        self.target, self.method = self.http._transport, method
        self.bare = unhooked(type(self.target), method)

    def hooked(self, on: bool) -> None:
        if self.kind == "aiohttp":
            self.http._request_class = aiohttp.ClientRequest if on else self.bare_request
        elif on:
            self.target.__dict__.pop(self.method, None)
        else:
            self.target.__dict__[self.method] = self.bare.__get__(self.target)

    def sender(self, headers: dict[str, str] | None = None) -> Callable[[], Any]:
        if self.kind == "httpx-sync":
            return lambda: self.http.post(self.url, json=PAYLOAD, headers=headers).raise_for_status()
        if self.kind == "openai-sync":
            return lambda: self.openai.chat.completions.create(
                model="bench", messages=MESSAGES, extra_headers=headers
            )
        if self.kind == "httpx-async":

            async def send_httpx() -> None:
                (await self.http.post(self.url, json=PAYLOAD, headers=headers)).raise_for_status()

            return send_httpx

        async def send_aiohttp() -> None:
            async with self.http.post(f"{self.url}/v1/chat/completions", json=PAYLOAD, headers=headers) as r:
                r.raise_for_status()
                await r.read()

        return send_aiohttp

    async def close(self) -> None:
        if self.kind == "openai-sync":
            self.openai.close()
        result = self.http.aclose() if self.kind == "httpx-async" else self.http.close()
        if asyncio.iscoroutine(result):
            await result


async def _alternate(
    client: Toggled, modes: Sequence[tuple[bool, Callable[[], Any]]], n: int, warm: int
) -> list[tuple[list[float], list[float]]]:
    """(CPU, wall) seconds per request for each (hooked?, sender) mode, taking turns in rotation."""
    times: list[tuple[list[float], list[float]]] = [([], []) for _ in modes]

    async def call(which: int) -> None:
        hooked, send = modes[which]
        client.hooked(hooked)
        result = send()
        if asyncio.iscoroutine(result):
            await result

    for _ in range(warm):
        for which in range(len(modes)):
            await call(which)
    gc.collect()
    order = list(range(len(modes)))
    for index in range(n):
        rotation = order[index % len(order) :] + order[: index % len(order)]
        for which in rotation if index % 2 else reversed(rotation):
            hooked, send = modes[which]
            client.hooked(hooked)
            cpu, wall = time.process_time(), time.perf_counter()
            result = send()
            if asyncio.iscoroutine(result):
                await result
            times[which][0].append(time.process_time() - cpu)
            times[which][1].append(time.perf_counter() - wall)
    return times


def run_paired(
    client: str, transport: str, urls: dict[str, str], authority: str, n: int
) -> list[dict[str, Any]]:
    """The tracing-off rows of one (client, transport), request by request.

    In a trajectory to Dynamo a third kind of request takes turns too: bare, sending the same header
    itself, the floor for any way of delivering it (a header costs the client something to carry).
    """
    inproc = transport == "in-process"
    rows = []
    otel_session.configure(dynamo_hosts=[authority])
    loop = asyncio.new_event_loop()
    try:
        for key, host, in_trajectory in PAIRED_TARGETS:

            async def measure(url: str = urls[host], traj: bool = in_trajectory) -> list[Any]:
                toggled = Toggled(client, url, inproc)
                try:
                    with maybe_trajectory(traj) as opened:
                        modes = [(True, toggled.sender()), (False, toggled.sender())]
                        if traj and url == urls["dynamo"]:
                            by_hand = {"X-Dynamo-Session-ID": opened.session_id}
                            modes.append((False, toggled.sender(by_hand)))
                        return await _alternate(toggled, modes, n, warm=20)
                finally:
                    await toggled.close()

            measured = [
                ([value * 1e6 for value in cpu], [value * 1e6 for value in wall])
                for cpu, wall in loop.run_until_complete(measure())
            ]
            (cpu_hooked, wall_hooked), (cpu_bare, wall_bare) = measured[0], measured[1]
            bare_cpu, bare_wall = lower_quartile(cpu_bare), lower_quartile(wall_bare)
            hooked_cpu = lower_quartile(cpu_hooked)
            added_cpu = hooked_cpu - bare_cpu
            row = {
                "variant": key,
                "requests_each": n,
                "cpu_us_bare": round(bare_cpu, 2),
                "cpu_us_hooked": round(hooked_cpu, 2),
                "added_cpu_us": round(added_cpu, 2),
                "added_cpu_us_by_median": round(
                    statistics.median(cpu_hooked) - statistics.median(cpu_bare), 2
                ),
                "ratio_cpu": round(hooked_cpu / bare_cpu, 4),
                "wall_us_bare": round(bare_wall, 2),
                "added_wall_us": round(lower_quartile(wall_hooked) - bare_wall, 2),
                "added_cpu_share_of_wall": round(added_cpu / bare_wall, 4),
                "cpu_us_header_by_hand": None,
            }
            if len(measured) == 3:
                row["cpu_us_header_by_hand"] = round(lower_quartile(measured[2][0]), 2)
            rows.append(row)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        otel_session.unconfigure()
    return rows


def print_paired(title: str, rows: list[dict[str, Any]], loopback: bool) -> None:
    print(f"\n{title}")
    head = (
        f"  {'target':32} {'bare CPU us':>11} {'with us':>8} {'added us':>9} {'ratio':>6} {'by hand us':>10}"
    )
    if loopback:
        head += f" {'bare wall us':>12} {'added wall':>10} {'CPU added/wall':>14}"
    print(head)
    labels = {
        "session:dynamo": "in a trajectory -> dynamo",
        "session:other": "in a trajectory -> other host",
        "session:outside": "no trajectory -> dynamo",
    }
    for row in rows:
        by_hand = row["cpu_us_header_by_hand"]
        line = (
            f"  {labels[row['variant']]:32} {row['cpu_us_bare']:11.1f} {row['cpu_us_hooked']:8.1f} "
            f"{row['added_cpu_us']:+9.2f} {row['ratio_cpu']:6.3f} "
            + (f"{by_hand:10.1f}" if by_hand is not None else f"{'':>10}")
        )
        if loopback:
            line += (
                f" {row['wall_us_bare']:12.1f} {row['added_wall_us']:+10.1f} "
                f"{100 * row['added_cpu_share_of_wall']:13.2f}%"
            )
        print(line)


def budget(paired: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tracing-off promises: <= 10 us CPU in-process (httpx sync), <= 5% of a loopback request."""
    checks = []
    for scenario in paired:
        for row in scenario["rows"]:
            if scenario["transport"] == "in-process" and scenario["client"] == "httpx-sync":
                value, limit, what = row["added_cpu_us"], CPU_BUDGET_US, "added CPU, us"
            elif scenario["transport"] == "loopback":
                value = row["added_cpu_share_of_wall"]
                limit, what = WALL_SHARE_BUDGET, "added CPU / loopback wall"
            else:
                continue
            checks.append(
                {
                    "client": scenario["client"],
                    "transport": scenario["transport"],
                    "variant": row["variant"],
                    "measure": what,
                    "value": round(value, 4),
                    "limit": limit,
                    "ok": value <= limit,
                }
            )
    return checks


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="half the requests")
    parser.add_argument("--requests", type=int, help="in-process requests per kind (default 2000)")
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"subset of {','.join(CLIENTS)}")
    parser.add_argument("--transports", default="in-process,loopback")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    n_pairs = args.requests or (1000 if args.quick else 2000)
    logging.getLogger("otel_session").setLevel(logging.ERROR)  # the "no Dynamo hosts" hint is not news here
    if not no_sdk_in_effect():
        print("a recording provider is in effect: tracing-off figures would lie", file=sys.stderr)
        return 2
    paired: list[dict[str, Any]] = []
    started = time.perf_counter()
    print(
        "Tracing off, request by request: one client, its requests alternately through otel-session's "
        f"hook and around it; lower quartiles of {n_pairs} in-process / {n_pairs // 2} loopback "
        "requests each (openai: a quarter)"
    )
    with LoopbackServer(["127.0.0.1", "127.0.0.2"]) as server:
        for transport in args.transports.split(","):
            for client in args.clients.split(","):
                share = CLIENTS[client][1]
                if transport == "in-process":
                    urls, authority = INPROC_URLS, INPROC_DYNAMO_AUTHORITY
                    n = max(50, int(n_pairs * share))
                else:
                    urls = {"dynamo": server.urls[0], "other": server.urls[1]}
                    authority = server.authorities[0]
                    n = max(50, int(n_pairs * share) // 2)
                rows = run_paired(client, transport, urls, authority, n)
                paired.append({"client": client, "transport": transport, "rows": rows})
                print_paired(f"{CLIENTS[client][0]}, {transport}", rows, transport == "loopback")
    checks = budget(paired)
    print(
        "\nTracing-off budget (<= 10 us CPU in-process for httpx sync; <= 5% of a loopback request)"
        + (": a quick run is indicative only, the full run decides" if args.quick else ":")
    )
    for check in checks:
        print(
            f"  {'ok  ' if check['ok'] else 'MISS'} {check['client']:12} {check['transport']:10} "
            f"{check['variant']:16} {check['measure']}: {check['value']:.3f} (limit {check['limit']})"
        )
    meta = machine() | {
        "view": "in-process, request by request: the hook's own CPU (not what a whole process pays)",
        "timer": "time.process_time (this process, all threads) and time.perf_counter, per request",
        "method": "one client, requests alternately hooked and bare; added = difference of lower quartiles",
        "server": "benchmarks/_servers.py: asyncio + uvloop in a separate process",
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_results(args.out, {"meta": meta, "tracing_off_paired": paired, "budget": checks})
    print(f"\nwrote {args.out} ({meta['seconds']} s)")
    return 0 if all(check["ok"] for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
