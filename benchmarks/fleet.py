"""Fleet scale: what sessions are worth with 8 to 256 workers and GRPO-shaped steps (issue 29).

Every cell starts, per arm, a fresh real Dynamo 1.6.1 stack: one frontend and ONE mocker process
hosting all the workers (``--num-workers``), each worker's KV cache sized with
``--num-gpu-blocks-override``. The load is one GRPO step: P prompts x G siblings, every trajectory
started at once, a prompt of about 2k tokens shared by the siblings, ``turns`` turns each adding a
unique observation after a short environment pause, the history growing. Requests go through the
openai SDK (AsyncOpenAI, httpx2), and otel-session makes the sessions: every attempt is a
``trajectory(group=prompt)`` and the arm's ``configure(siblings=...)`` says which siblings name a
common parent session (``X-Dynamo-Parent-Session-ID``). The arms:

    rr               round-robin, no session header
    kv               kv routing, no session header
    kv+attempt       kv, siblings=attempt: a session per attempt, no parent
    kv+default       kv, the library's default (groups:2)
    kv+prompt        kv, siblings=prompt: all siblings of a prompt under one parent
    kv+groups:K      kv, siblings=groups:K: each K siblings under a parent of their own
    kv+auto          kv, what `otel-session doctor` recommends for the cell's fleet and batch
                     (groups:K with K = ceil(G / max(1, workers // prompts)))
    rr+attempt       round-robin, a session per attempt
    kv+attempt/soft  kv, a session per attempt, soft affinity
    kv+default/soft  kv, the default, soft affinity
    kv+header/off    kv, the default's headers, session affinity OFF at the frontend (what ``doctor
                     --layout kv`` recommends: the header is sent and ignored)
    kv+default/predicted, kv+default/busy   the default with ``--router-predicted-ttl-secs 5``, or
                     with Dynamo's busy thresholds (which reject work: errors are counted)
    3fe:...          three frontend replicas over the same workers behind nginx, round-robin
                     (``3fe-hash:``: hashing ``X-Dynamo-Session-ID``), with kv or round-robin routers

(Rows with ``"keying_impl": "nested"`` absent were measured before the siblings API existed, with
nested trajectories sending the same headers: an outer trajectory per group around its siblings.)

Every frontend runs with ``--router-session-affinity-ttl-secs`` (an arm without sessions sends no
header, so that changes nothing for it). Arms of one repeat see the same text on a cold fleet;
repeats use new text and rotate the arms' order.

Per run: prefix hit rate of turns 2+ (``cached_tokens / prompt_tokens``) and its ceiling (each
turn's previous prompt, in whole blocks), the same over all turns with a ceiling that also counts
the siblings' shared prompt on turn 1, TTFT mean and p90 (Dynamo's ``nvext.timing``), completed
turns per second, load balance (max over mean requests in flight per worker, sampled every 20 ms
from each request's start, end and serving worker), workers used, worker switches per trajectory,
trajectories pinned. The machine's load average is recorded beside each run.

The headline is the step (``step_table``): its makespan, first request sent to last response, since
a GRPO step waits for its slowest trajectory; beside it the fleet's tokens/s, TTFT p50/p90/p99, the
busiest worker's turns over a fair share, and the cores' busy fraction over the run (``/proc/stat``;
"saturated" above 85 %: the mocker times prefill and decode in wall-clock time, so such a run
measured the machine). ``--speedup`` slows the mocker (``--speedup-ratio``): a ratio that holds at
two speedups is the simulator's, not the CPU's.

    python benchmarks/fleet.py --quick                      # a couple of minutes: 8 workers, 4 arms
    python benchmarks/fleet.py --cells issue --repeats 3    # the three cells issue 29 names
    python benchmarks/fleet.py --cells W:B:P:G[,...]        # e.g. 32:1024:16:8,128:8192:32:8
    python benchmarks/fleet.py --plot-only                  # table and chart from results/fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import otel_session  # noqa: E402
from otel_session import trajectory  # noqa: E402
from otel_session.dynamo import NVEXT_EXTRA_BODY, LocalDynamo, cached_tokens_of, ttft_ms_of, worker_id_of  # noqa: E402
from otel_session.dynamo.sizing import siblings_setting  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16
AFFINITY_TTL = 300
SAMPLE_SECONDS = 0.02
SATURATED = 0.85  # mean busy fraction of all cores above which a run measured the machine, not the model
_VOCABULARY = (
    "session worker router prefix cache token model request response latency stream agent tool user "
    "reward policy gradient rollout episode trajectory sample batch decode prefill attention layer "
    "block memory transfer metric export python rust function method value string list file path"
)
_WORDS = _VOCABULARY.split()


@dataclass(frozen=True)
class Arm:
    """How one arm routes and keys its sessions."""

    name: str
    router: str
    keying: str  # "none", "attempt", "prompt", "groups:K" or "auto"
    mode: str = "hard"
    affinity: bool = True  # the frontend runs with session affinity; off: the header is sent and ignored
    frontend_args: tuple[str, ...] = ()
    frontends: int = 1  # more than one: replicas behind nginx (benchmarks/frontends.py), balancing as below
    balancer: str = "rr"  # "rr": round-robin, "hash": consistent hashing on X-Dynamo-Session-ID


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("rr", "round-robin", "none"),
        Arm("kv", "kv", "none"),
        Arm("kv+attempt", "kv", "attempt"),
        Arm("kv+default", "kv", "default"),
        Arm("kv+prompt", "kv", "prompt"),
        Arm("kv+groups:2", "kv", "groups:2"),
        Arm("kv+groups:4", "kv", "groups:4"),
        Arm("kv+auto", "kv", "auto"),
        Arm("rr+attempt", "round-robin", "attempt"),
        Arm("kv+attempt/soft", "kv", "attempt", "soft"),
        Arm("kv+default/soft", "kv", "default", "soft"),
        Arm("kv+header/off", "kv", "default", affinity=False),
        Arm("3fe:kv", "kv", "none", frontends=3),
        Arm("3fe:kv+header/off", "kv", "default", affinity=False, frontends=3),
        Arm("3fe:kv+default", "kv", "default", frontends=3),
        Arm("3fe-hash:kv+default", "kv", "default", frontends=3, balancer="hash"),
        Arm("3fe:rr", "round-robin", "none", frontends=3),
        Arm("3fe-hash:rr+default", "round-robin", "default", frontends=3, balancer="hash"),
        Arm("kv+default/predicted", "kv", "default", frontend_args=("--router-predicted-ttl-secs", "5")),
        Arm(
            "kv+default/busy",
            "kv",
            "default",
            frontend_args=(
                "--active-decode-blocks-threshold",
                "0.85",
                "--active-prefill-tokens-threshold",
                "4096",
            ),
        ),
    )
}


@dataclass(frozen=True)
class Cell:
    """A fleet and a step: workers, KV blocks per worker, prompts x siblings."""

    workers: int
    blocks: int
    prompts: int
    siblings: int
    turns: int = 4
    prompt_words: int = 1300
    turn_words: int = 100
    pause_secs: float = 0.2
    max_tokens: int = 16

    @property
    def label(self) -> str:
        return f"{self.workers}w {self.blocks}blk {self.prompts}x{self.siblings}"

    @property
    def in_flight_per_worker(self) -> float:
        return self.prompts * self.siblings / self.workers

    @classmethod
    def parse(cls, text: str) -> Cell:
        workers, blocks, prompts, siblings = (int(part) for part in text.split(":"))
        return cls(workers, blocks, prompts, siblings)


def siblings_of(keying: str, cell: Cell) -> str | None:
    """The ``configure(siblings=...)`` an arm runs with (``None``: the library's default); ``auto``
    is what ``otel-session doctor --prompts P --siblings G`` recommends for the cell's fleet."""
    if keying == "auto":
        return siblings_setting(cell.workers, cell.prompts, cell.siblings)
    return None if keying == "default" else keying


def group_size(setting: str, cell: Cell) -> int | None:
    """Siblings under one parent for a siblings setting as the library spells it (``None``: none)."""
    if setting == "prompt":
        return cell.siblings
    if setting.startswith("groups:"):
        return min(cell.siblings, int(setting.split(":", 1)[1]))
    return None


@dataclass
class Request:
    turn: int
    worker: int | None
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float | None
    start: float
    end: float
    completion_tokens: int = 0


@dataclass
class Attempt:
    prompt: int
    sibling: int
    requests: list[Request] = field(default_factory=list)
    error: str | None = None

    @property
    def workers(self) -> list[int | None]:
        return [r.worker for r in self.requests]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def _attempt(client: Any, model: str, cell: Cell, seed: int, p: int, s: int, keyed: bool) -> Attempt:
    prompt_rng = random.Random(f"{seed}/{p}")
    turn_rng = random.Random(f"{seed}/{p}/{s}")
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": _text(prompt_rng, cell.prompt_words)},  # shared by the siblings
    ]
    result = Attempt(p, s)
    # group=p: the siblings' prompt, as NeMo-RL's preset names it; configure(siblings=...) decides
    # which of them name a common parent session.
    async with trajectory(group=p) if keyed else contextlib.nullcontext():
        try:
            for turn in range(cell.turns):
                if turn:
                    await asyncio.sleep(cell.pause_secs * (0.5 + turn_rng.random()))  # the environment
                    messages.append({"role": "user", "content": _text(turn_rng, cell.turn_words)})
                start = time.perf_counter()
                response = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=cell.max_tokens, extra_body=NVEXT_EXTRA_BODY
                )
                usage = response.usage
                result.requests.append(
                    Request(
                        turn=turn,
                        worker=worker_id_of(response),
                        prompt_tokens=usage.prompt_tokens if usage else 0,
                        cached_tokens=cached_tokens_of(response) or 0,
                        ttft_ms=ttft_ms_of(response),
                        start=start,
                        end=time.perf_counter(),
                        completion_tokens=usage.completion_tokens if usage else 0,
                    )
                )
                messages.append({"role": "assistant", "content": response.choices[0].message.content or ""})
        except Exception as exc:  # one failure is reported with the others, it does not end the run
            result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


async def run_step(
    base_url: str, model: str, cell: Cell, keying: str, seed: int
) -> tuple[list[Attempt], float]:
    """One GRPO step, every trajectory started at once; returns the attempts and the wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    began = time.perf_counter()
    try:
        attempts = await asyncio.gather(  # opened in this order: siblings s = 0, 1, ... of each prompt
            *(
                _attempt(client, model, cell, seed, p, s, keying != "none")
                for p in range(cell.prompts)
                for s in range(cell.siblings)
            )
        )
    finally:
        await client.close()
    return list(attempts), time.perf_counter() - began


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat; (0, 0) where there is none."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class CpuWatch:
    """The machine's busy fraction (all cores) over a run, sampled every half second: the mocker times
    prefill and decode in wall-clock time, so a run that saturated the cores measured the machine."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = _cpu_times()
        while not self._stop.wait(0.5):
            now = _cpu_times()
            total = now[1] - last[1]
            if total > 0:
                self.samples.append((now[0] - last[0]) / total)
            last = now

    def __enter__(self) -> CpuWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def figures(self) -> dict[str, float | bool | None]:
        if not self.samples:
            return {"cpu_busy": None, "cpu_busy_p90": None, "saturated": False}
        ordered = sorted(self.samples)
        mean = statistics.fmean(ordered)
        return {
            "cpu_busy": mean,
            "cpu_busy_p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "saturated": mean > SATURATED,
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0..1) of ``values``; ``None`` for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def step_figures(requests: Sequence[Request], workers: int) -> dict[str, Any]:
    """What a GRPO step costs: the makespan (first request sent to last response), tokens/s of the
    fleet over it, TTFT p50/p90/p99 of every turn, and the busiest worker's share of the turns."""
    if not requests:
        return {
            "makespan_s": 0.0, "tokens_per_s": 0.0, "ttft_p50_ms": None, "ttft_p99_ms": None,
            "busiest_share": 0.0, "busiest_x_fair": 0.0,
        }  # fmt: skip
    makespan = max(r.end for r in requests) - min(r.start for r in requests)
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in requests)
    ttfts = [r.ttft_ms for r in requests if r.ttft_ms is not None]
    per_worker: dict[int | None, int] = {}
    for r in requests:
        per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    busiest = max(per_worker.values()) / len(requests)
    return {
        "makespan_s": makespan,
        "tokens_per_s": tokens / makespan if makespan > 0 else 0.0,
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "busiest_share": busiest,
        "busiest_x_fair": busiest * workers,  # 1.0: every worker served as many turns
    }


def _balance(requests: Sequence[Request], workers: int) -> float:
    """Mean over 20 ms samples of (max requests in flight on one worker) / (mean over all workers)."""
    if not requests:
        return 0.0
    t0 = min(r.start for r in requests)
    t1 = max(r.end for r in requests)
    ratios = []
    t = t0
    while t < t1:
        active: dict[int | None, int] = {}
        for r in requests:
            if r.start <= t < r.end:
                active[r.worker] = active.get(r.worker, 0) + 1
        total = sum(active.values())
        if total:
            ratios.append(max(active.values()) / (total / workers))
        t += SAMPLE_SECONDS
    return statistics.fmean(ratios) if ratios else 0.0


def measure(attempts: Sequence[Attempt], cell: Cell, wall: float, group: int | None = None) -> dict[str, Any]:
    """The figures of one run (see the module docstring); ``group``: siblings under one parent, for
    the share of those groups Dynamo put together (all of a group's first turns on one worker)."""
    bs = BLOCK_SIZE
    reqs = [r for a in attempts for r in a.requests]
    later = [r for r in reqs if r.turn > 0]
    later_prompt = sum(r.prompt_tokens for r in later) or 1
    reach_later = sum(
        min(now.prompt_tokens, before.prompt_tokens // bs * bs)
        for a in attempts
        for before, now in zip(a.requests, a.requests[1:], strict=False)
    )
    # Turn 1: every sibling but one of each prompt could find the shared prompt cached.
    first_seen: set[int] = set()
    reach_first = 0
    for a in sorted(attempts, key=lambda a: (a.prompt, a.sibling)):
        if a.requests:
            if a.prompt in first_seen:
                reach_first += a.requests[0].prompt_tokens // bs * bs
            first_seen.add(a.prompt)
    all_prompt = sum(r.prompt_tokens for r in reqs) or 1
    ttft_later = sorted(r.ttft_ms for r in later if r.ttft_ms is not None)
    ttft_all = sorted(r.ttft_ms for r in reqs if r.ttft_ms is not None)

    def p90(values: list[float]) -> float | None:
        return values[min(len(values) - 1, int(0.9 * len(values)))] if values else None

    switches = [sum(1 for x, y in zip(a.workers, a.workers[1:], strict=False) if x != y) for a in attempts]
    pinned = sum(1 for a in attempts if a.requests and None not in a.workers and len(set(a.workers)) == 1)
    by_prompt: dict[int, set[int | None]] = {}
    for a in attempts:
        if a.requests:
            by_prompt.setdefault(a.prompt, set()).add(a.requests[0].worker)
    together: float | None = None
    if group:
        first_workers: dict[tuple[int, int], set[int | None]] = {}
        for a in attempts:
            if a.requests:
                first_workers.setdefault((a.prompt, a.sibling // group), set()).add(a.requests[0].worker)
        together = (
            sum(len(w) == 1 for w in first_workers.values()) / len(first_workers) if first_workers else 0.0
        )
    return {
        "groups_together": together,
        "trajectories": len(attempts),
        "errors": sum(a.error is not None for a in attempts),
        "first_error": next((a.error for a in attempts if a.error), None),
        "turns_done": len(reqs),
        "hit_rate": sum(r.cached_tokens for r in later) / later_prompt,
        "ceiling": reach_later / later_prompt,
        "hit_rate_all": sum(r.cached_tokens for r in reqs) / all_prompt,
        "ceiling_all": (reach_later + reach_first) / all_prompt,
        "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in reqs) if reqs else 0.0,
        "ttft_ms": statistics.fmean(ttft_later) if ttft_later else None,
        "ttft_p90_ms": p90(ttft_later),
        "ttft_all_ms": statistics.fmean(ttft_all) if ttft_all else None,
        "ttft_all_p90_ms": p90(ttft_all),
        "turns_per_s": len(reqs) / wall if wall else 0.0,
        "balance": _balance(reqs, cell.workers),
        "workers_used": len({r.worker for r in reqs if r.worker is not None}),
        "switches": statistics.fmean(switches) if switches else 0.0,
        "pinned": pinned,
        "workers_per_prompt_turn1": statistics.fmean(len(w) for w in by_prompt.values())
        if by_prompt
        else 0.0,
        "wall_s": wall,
        **step_figures(reqs, cell.workers),
    }


@contextlib.contextmanager
def _balanced(frontends: list[str], arm: Arm) -> Iterator[tuple[str, list[str]]]:
    """(base URL, router hosts) the load goes to: the one frontend, or nginx in front of several."""
    if arm.frontends <= 1:
        yield f"http://{frontends[0]}/v1", frontends
        return
    from benchmarks.frontends import Nginx

    with Nginx(frontends, hash_session=arm.balancer == "hash") as nginx:
        yield nginx.base_url, [nginx.host]


def run_arm(cell: Cell, arm: Arm, seed: int, speedup: float = 1.0) -> dict[str, Any]:
    """A fresh stack for one arm of one repeat: the fleet's caches start cold for every arm."""
    load_before = os.getloadavg()[0]
    watch = CpuWatch()
    with (
        LocalDynamo(
            workers=cell.workers,
            workers_per_process=cell.workers,
            router_mode=arm.router,
            affinity_ttl_secs=AFFINITY_TTL if arm.affinity else None,
            affinity_mode=arm.mode,  # type: ignore[arg-type]
            block_size=BLOCK_SIZE,
            speedup_ratio=speedup,
            frontends=arm.frontends,
            frontend_args=list(arm.frontend_args),
            worker_args=["--num-gpu-blocks-override", str(cell.blocks)],
            startup_timeout=120,
        ) as stack,
        _balanced(stack.hosts, arm) as (base_url, hosts),
    ):
        setting = "none"
        if arm.keying != "none":
            settings = otel_session.configure(dynamo_hosts=hosts, siblings=siblings_of(arm.keying, cell))
            setting = str(settings.siblings)  # what the library resolved, its default included
        try:
            with watch:
                attempts, wall = asyncio.run(run_step(base_url, stack.model_name, cell, arm.keying, seed))
        finally:
            otel_session.unconfigure()
    row = {
        **asdict(cell),
        "cell": cell.label,
        "arm": arm.name,
        "router": arm.router,
        "keying": arm.keying,
        "mode": arm.mode,
        "affinity": arm.affinity,
        "frontends": arm.frontends,
        "balancer": arm.balancer,
        "frontend_args": list(arm.frontend_args),
        "speedup": speedup,
        "group_size": group_size(setting, cell),
        "siblings_setting": setting,
        "keying_impl": "api",  # configure(siblings=...) + trajectory(group=p); earlier rows: nested
        "seed": seed,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        **measure(attempts, cell, wall, group_size(setting, cell)),
        **watch.figures(),
    }
    return row


def run_cell(
    cell: Cell,
    arms: Sequence[Arm],
    repeats: int,
    seed0: int,
    sink: list[dict[str, Any]],
    out: Path | None,
    speedup: float = 1.0,
) -> None:
    for rep in range(repeats):
        order = list(arms[rep % len(arms) :]) + list(arms[: rep % len(arms)])
        for arm in order:
            row = run_arm(cell, arm, seed0 + rep, speedup)
            row["repeat"] = rep
            sink.append(row)
            print(_line(row), flush=True)
            if out is not None:
                _save(sink, out)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (
    "| cell | arm | rep | step s | tok/s | busiest x fair | cpu | hit 2+ | ceil 2+ | hit all | ceil all | "
    "TTFT ms | p90 | TTFT all | turns/s | "
    "balance | used | switch | pinned | err | load |\n|" + "---|" * 21
)


def _line(r: dict[str, Any]) -> str:
    return (
        f"| {r['cell']} | {r['arm']} | {r.get('repeat', 0)} | {r.get('makespan_s', r['wall_s']):.1f} | "
        f"{r.get('tokens_per_s', 0.0):.0f} | {r.get('busiest_x_fair', 0.0):.1f} | "
        f"{_fmt(r.get('cpu_busy'), '.0%')}{' SAT' if r.get('saturated') else ''} | "
        f"{r['hit_rate']:.3f} | {r['ceiling']:.3f} | "
        f"{r['hit_rate_all']:.3f} | {r['ceiling_all']:.3f} | {_fmt(r['ttft_ms'], '.0f')} | "
        f"{_fmt(r['ttft_p90_ms'], '.0f')} | {_fmt(r['ttft_all_ms'], '.0f')} | {r['turns_per_s']:.1f} | "
        f"{r['balance']:.2f} | {r['workers_used']} | {r['switches']:.2f} | "
        f"{r['pinned']}/{r['trajectories']} | {r['errors']} | {r['load_before']:.1f} |"
    )


def _span(values: list[float], spec: str) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return format(lo, spec) if format(lo, spec) == format(hi, spec) else f"{lo:{spec}}-{hi:{spec}}"


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (cell, arm): the range over repeats of each figure."""
    keys: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        keys.setdefault((r["cell"], r["arm"]), []).append(r)
    lines = [
        "| cell | arm | runs | hit 2+ | ceiling 2+ | hit all / ceiling | TTFT 2+ ms | p90 ms | TTFT all ms | "
        "turns/s | balance | workers used | switches | pinned | errors | load |",
        "|" + "---|" * 16,
    ]
    for (cell, arm), rs in keys.items():

        def col(key: str, spec: str, rs: list[dict[str, Any]] = rs) -> str:
            return _span([r[key] for r in rs if r[key] is not None], spec)

        lines.append(
            f"| {cell} | {arm} | {len(rs)} | {col('hit_rate', '.2f')} | {col('ceiling', '.2f')} | "
            f"{col('hit_rate_all', '.2f')} / {col('ceiling_all', '.2f')} | {col('ttft_ms', '.0f')} | "
            f"{col('ttft_p90_ms', '.0f')} | {col('ttft_all_ms', '.0f')} | {col('turns_per_s', '.0f')} | "
            f"{col('balance', '.1f')} | {col('workers_used', '.0f')} | {col('switches', '.2f')} | "
            f"{sum(r['pinned'] for r in rs)}/{sum(r['trajectories'] for r in rs)} | "
            f"{sum(r['errors'] for r in rs)} | {col('load_before', '.1f')} |"
        )
    return "\n".join(lines)


def step_table(rows: Sequence[dict[str, Any]]) -> str:
    """The headline: each arm's step makespan against kv routing alone and round-robin in the same
    cell and speedup (means over repeats), with the arm's own spread, kv's spread, TTFT p50/p90/p99,
    tokens/s, the busiest worker's turns over a fair share, the CPU's busy fraction, and the verdict:
    "slower" when the arm's fastest repeat is slower than kv's slowest (outside both spreads)."""
    cells: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        if "makespan_s" in r:
            cells.setdefault((r["cell"], r.get("speedup", 1.0)), {}).setdefault(r["arm"], []).append(r)
    lines = [
        "| cell | speedup | arm | runs | step s (spread) | x kv | x rr | tok/s | TTFT p50/p90/p99 ms | "
        "hit 2+ | busiest x fair | cpu busy | vs kv |",
        "|" + "---|" * 13,
    ]
    for (cell, speedup), arms in cells.items():
        base, rr = arms.get("kv"), arms.get("rr")

        def mean(rs: list[dict[str, Any]], key: str) -> float:
            values = [r[key] for r in rs if r.get(key) is not None]
            return statistics.fmean(values) if values else math.nan

        for arm, rs in arms.items():
            step = mean(rs, "makespan_s")
            x_kv = f"{step / mean(base, 'makespan_s'):.2f}" if base else "-"
            x_rr = f"{step / mean(rr, 'makespan_s'):.2f}" if rr else "-"
            verdict = "-"
            if base and arm != "kv":
                slower = min(r["makespan_s"] for r in rs) > max(r["makespan_s"] for r in base)
                faster = max(r["makespan_s"] for r in rs) < min(r["makespan_s"] for r in base)
                verdict = "slower" if slower else "faster" if faster else "within spread"
            sat = sum(bool(r.get("saturated")) for r in rs)
            lines.append(
                f"| {cell} | {speedup:g} | {arm} | {len(rs)} | "
                f"{step:.1f} ({_span([r['makespan_s'] for r in rs], '.1f')}) "
                f"| {x_kv} | {x_rr} | {mean(rs, 'tokens_per_s'):.0f} | "
                f"{mean(rs, 'ttft_p50_ms'):.0f}/{mean(rs, 'ttft_p90_ms'):.0f}/"
                f"{mean(rs, 'ttft_p99_ms'):.0f} | "
                f"{mean(rs, 'hit_rate'):.2f} | {mean(rs, 'busiest_x_fair'):.1f} | "
                f"{_span([r['cpu_busy'] for r in rs if r.get('cpu_busy') is not None], '.0%')}"
                f"{f' ({sat} saturated)' if sat else ''} | {verdict} |"
            )
    return "\n".join(lines)


def versus_kv(rows: Sequence[dict[str, Any]]) -> str:
    """Each arm against kv routing alone in the same cell, means over repeats: the hit rate of turns
    2+ and of all turns (a difference), mean TTFT of all turns and of turns 2+ (a ratio), and
    "worse" when the hit rate is lower by more than 0.01 or the mean TTFT (all turns) is above the
    slowest of kv's own repeats, i.e. outside kv's spread."""
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        cells.setdefault(r["cell"], {}).setdefault(r["arm"], []).append(r)
    lines = [
        "| cell | arm | d hit 2+ | d hit all | TTFT all x kv | TTFT 2+ x kv | balance | verdict |",
        "|" + "---|" * 8,
    ]
    for cell, arms in cells.items():
        base = arms.get("kv")
        if not base:
            continue

        def mean(rs: list[dict[str, Any]], key: str) -> float:
            return statistics.fmean(r[key] for r in rs if r[key] is not None)

        kv_slowest = max(r["ttft_all_ms"] for r in base)
        for arm, rs in arms.items():
            if arm == "kv":
                continue
            d_hit = mean(rs, "hit_rate") - mean(base, "hit_rate")
            d_all = mean(rs, "hit_rate_all") - mean(base, "hit_rate_all")
            worse = []
            if d_hit < -0.01:
                worse.append("hit")
            if mean(rs, "ttft_all_ms") > kv_slowest:
                worse.append("TTFT")
            lines.append(
                f"| {cell} | {arm} | {d_hit:+.3f} | {d_all:+.3f} | "
                f"{mean(rs, 'ttft_all_ms') / mean(base, 'ttft_all_ms'):.2f} | "
                f"{mean(rs, 'ttft_ms') / mean(base, 'ttft_ms'):.2f} | {mean(rs, 'balance'):.1f} | "
                f"{'worse: ' + ', '.join(worse) if worse else 'not worse'} |"
            )
    return "\n".join(lines)


def docs_table(rows: Sequence[dict[str, Any]]) -> str:
    """The table docs/performance.md leads with: per cell, hit rate of turns 2+ and mean TTFT of all
    turns for the arms a user chooses between (:data:`CHART_ARMS`), each a range over the repeats."""
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        cells.setdefault(r["cell"], {}).setdefault(chart_arm(r), []).append(r)
    arms = [a for a in CHART_ARMS if any(a in by_arm for by_arm in cells.values())]
    lines = [
        "| workers, KV blocks/worker, prompts x siblings | runs | ceiling | "
        + " | ".join(CHART_ARMS[a] for a in arms)
        + " |",
        "|" + "---|" * (3 + len(arms)),
    ]

    def order(cell: str) -> tuple[int, int, int, int]:
        r = next(iter(cells[cell].values()))[0]
        return (r["blocks"], r["siblings"] == 1, r["workers"], r["prompts"])

    for cell in sorted(cells, key=order):
        by_arm = cells[cell]

        def fig(arm: str, by_arm: dict[str, list[dict[str, Any]]] = by_arm) -> str:
            rs = by_arm.get(arm)
            if not rs:
                return "-"
            hit = _span([r["hit_rate"] for r in rs], ".2f")
            ttft = _span([r["ttft_all_ms"] for r in rs if r["ttft_all_ms"] is not None], ".0f")
            return f"{hit} / {ttft} ms"

        runs = _span([float(len(rs)) for rs in by_arm.values()], ".0f")
        ceiling = _span([r["ceiling"] for rs in by_arm.values() for r in rs], ".2f")
        lines.append(f"| {cell} | {runs} | {ceiling} | " + " | ".join(fig(a) for a in arms) + " |")
    return "\n".join(lines)


def default_vs_kv(rows: Sequence[dict[str, Any]]) -> str:
    """The library's default against kv routing alone, cell by cell: what docs/performance.md
    states as "never worse" or not. Means over repeats; "worse" as in :func:`versus_kv`, and the
    TTFT verdict also names kv's own spread (slowest over fastest repeat)."""
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        cells.setdefault(r["cell"], {}).setdefault(chart_arm(r), []).append(r)
    lines = [
        "| cell | runs (default, kv) | hit 2+: default - kv | TTFT all turns: default / kv "
        "| kv's own spread | verdict |",
        "|" + "---|" * 6,
    ]
    for cell, by_arm in cells.items():
        base, ours = by_arm.get("kv"), by_arm.get("kv+default")
        if not base or not ours:
            continue
        d_hit = statistics.fmean(r["hit_rate"] for r in ours) - statistics.fmean(r["hit_rate"] for r in base)
        t_ours = statistics.fmean(r["ttft_all_ms"] for r in ours)
        t_base = [r["ttft_all_ms"] for r in base]
        worse = [w for w, bad in (("hit", d_hit < -0.01), ("TTFT", t_ours > max(t_base))) if bad]
        lines.append(
            f"| {cell} | {len(ours)}, {len(base)} | {d_hit:+.2f} | "
            f"{t_ours / statistics.fmean(t_base):.2f}x | {max(t_base) / min(t_base):.2f}x | "
            f"{'worse: ' + ', '.join(worse) if worse else 'not worse'} |"
        )
    return "\n".join(lines)


#: The arms the chart draws, and their labels; ``kv+groups:2`` is the default's setting (rows measured
#: before the siblings API had no ``kv+default`` arm), so the two are drawn as one.
CHART_ARMS = {
    "kv": "kv, no session",
    "kv+attempt": "kv + session per attempt",
    "kv+default": "kv + otel-session default (groups:2)",
    "kv+prompt": "kv + one parent per prompt",
    "kv+auto": "kv + doctor's groups:K",
    "rr": "round-robin, no session",
}


def chart_arm(row: dict[str, Any]) -> str:
    return "kv+default" if row["arm"] == "kv+groups:2" else str(row["arm"])


def chart(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Hit rate 2+ and mean TTFT against workers, one line per arm, a row of panels per step shape
    (cache per worker, siblings, trajectories per worker, prompts per worker) measured at two or
    more fleet sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def family(r: dict[str, Any]) -> tuple[int, int, float, float]:
        return (
            r["blocks"],
            r["siblings"],
            r["prompts"] * r["siblings"] / r["workers"],
            r["prompts"] / r["workers"],
        )

    sizes: dict[tuple[int, int, float, float], set[int]] = {}
    for r in rows:
        sizes.setdefault(family(r), set()).add(r["workers"])
    families = sorted(f for f, ws in sizes.items() if len(ws) >= 2)
    if not families:
        families = sorted(sizes)
    fig, axes = plt.subplots(len(families), 2, figsize=(12, 3.4 * len(families)), squeeze=False)
    colors = plt.get_cmap("tab10")
    for row_axes, fam_key in zip(axes, families, strict=True):
        blocks, siblings, flight, _ = fam_key
        fam = [r for r in rows if family(r) == fam_key]
        for i, (arm, label) in enumerate(CHART_ARMS.items()):
            pts: dict[int, list[dict[str, Any]]] = {}
            for r in fam:
                if chart_arm(r) == arm:
                    pts.setdefault(r["workers"], []).append(r)
            if not pts:
                continue
            xs = sorted(pts)
            style = {
                "color": colors(i),
                "marker": "o",
                "label": label,
                "linestyle": "-" if "kv" in arm else "--",
            }
            if arm == "kv+default":
                style["linewidth"] = 2.5
            for ax, key in ((row_axes[0], "hit_rate"), (row_axes[1], "ttft_all_ms")):
                means = [statistics.fmean(r[key] for r in pts[x]) for x in xs]
                ax.plot(xs, means, **style)
                for x in xs:  # every repeat as a faint dot: the spread
                    ax.scatter([x] * len(pts[x]), [r[key] for r in pts[x]], color=colors(i), s=8, alpha=0.4)
        ceilings = [r["ceiling"] for r in fam]
        if ceilings:
            row_axes[0].axhline(
                statistics.fmean(ceilings), color="black", linewidth=0.8, linestyle=":", label="ceiling"
            )
        for ax in row_axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(sizes[fam_key]), [str(w) for w in sorted(sizes[fam_key])])
            ax.set_xlabel("workers")
        row_axes[0].set_ylim(0, 1)
        row_axes[0].set_title(
            f"hit rate, turns 2+: {blocks} blocks/worker, G={siblings}, {flight:g} trajectories/worker",
            fontsize=10,
        )
        row_axes[1].set_title("mean TTFT, all turns (ms)", fontsize=10)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Dynamo 1.6.1 router + mocker fleet, one GRPO step per run (measured; 2 shared cores)")
    fig.tight_layout(rect=(0, 0.09, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def model(rows: Sequence[dict[str, Any]], predict_at: Sequence[int] = (1024, 4096)) -> str:
    """A small model for fleets past this machine (issue 29, item 4), and how far off it was.

    The model: at a fixed step *shape* per worker (cache per worker, siblings, trajectories per
    worker, prompts per worker) an arm's hit rate and TTFT do not depend on the fleet's size. Checked
    where it can be: fitted (the mean) on every size but the largest measured, compared with the
    largest. Its predictions for ``predict_at`` workers are the mean over every measured size. What
    it leaves out: a real frontend's routing cost per request grows with the workers it scores, and
    real engines are not Dynamo's mocker; both are why these are labelled modelled."""
    shapes: dict[tuple[int, int, float, float, str], dict[int, list[dict[str, Any]]]] = {}
    for r in rows:
        key = (
            r["blocks"],
            r["siblings"],
            r["prompts"] * r["siblings"] / r["workers"],
            r["prompts"] / r["workers"],
            chart_arm(r),
        )
        shapes.setdefault(key, {}).setdefault(r["workers"], []).append(r)
    lines = [
        "| blocks/worker, G, traj/worker, prompts/worker | arm | measured at (workers: hit 2+ / TTFT ms) | "
        "model for the largest (fitted on the others) | off by | modelled at "
        + ", ".join(f"{w:,}" for w in predict_at)
        + " workers |",
        "|" + "---|" * 6,
    ]
    for (blocks, g, flight, ppw, arm), by_size in sorted(shapes.items()):
        if len(by_size) < 2 or arm not in CHART_ARMS:
            continue
        sizes = sorted(by_size)

        def hit(ws: Sequence[int], by_size: dict[int, list[dict[str, Any]]] = by_size) -> float:
            return statistics.fmean(r["hit_rate"] for w in ws for r in by_size[w])

        def ttft(ws: Sequence[int], by_size: dict[int, list[dict[str, Any]]] = by_size) -> float:
            return statistics.fmean(r["ttft_all_ms"] for w in ws for r in by_size[w] if r["ttft_all_ms"])

        measured = "; ".join(f"{w}: {hit([w]):.2f} / {ttft([w]):.0f}" for w in sizes)
        fit, last = sizes[:-1], sizes[-1]
        trend = _log_trend([(w, hit([w])) for w in sizes], predict_at)
        lines.append(
            f"| {blocks}, {g}, {flight:g}, {ppw:g} | {arm} | {measured} | "
            f"{hit(fit):.2f} / {ttft(fit):.0f} ms | "
            f"{hit([last]) - hit(fit):+.2f} / {ttft([last]) / ttft(fit) - 1:+.0%} | "
            f"{hit(sizes):.2f} / {ttft(sizes):.0f} ms (hit trend in log2 workers: {trend}) |"
        )
    return "\n".join(lines)


def _log_trend(points: Sequence[tuple[int, float]], at: Sequence[int]) -> str:
    """Hit rate on a least-squares line in log2(workers), clipped to [0, 1], at each of ``at``: the
    alternative to the flat model, for arms whose hit rate moves with the fleet's size."""
    xs = [math.log2(w) for w, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return ", ".join(f"{min(1.0, max(0.0, my + slope * (math.log2(w) - mx))):.2f}" for w in at)


def _save(rows: Sequence[dict[str, Any]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": list(rows)}, indent=1))


ISSUE_CELLS = ["32:1024:16:8", "32:8192:16:8", "64:1024:8:16"]


def main(argv: list[str] | None = None, sink: list[dict[str, Any]] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 workers, 4 arms, 1 repeat (CI)")
    parser.add_argument("--cells", default="issue", help="'issue' or W:B:P:G[,...]")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arm names")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "fleet.json")
    parser.add_argument("--append", action="store_true", help="add to the rows already in --out")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="the mocker's --speedup-ratio (below 1: slower, less CPU-bound)",
    )
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = sink if sink is not None else []
    if args.plot_only or args.append:
        with contextlib.suppress(FileNotFoundError):
            rows = json.loads(args.out.read_text())["rows"]
    if not args.plot_only:
        if args.quick:
            cells = [Cell(8, 256, 4, 4, prompt_words=600, turn_words=60, turns=3)]
            arms = [ARMS[a] for a in ("rr", "kv", "kv+attempt", "kv+default")]
            repeats = 1
        else:
            specs = ISSUE_CELLS if args.cells == "issue" else args.cells.split(",")
            cells = [Cell.parse(spec) for spec in specs]
            arms = [ARMS[a] for a in args.arms.split(",")]
            repeats = args.repeats
        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
        print(HEADER)
        for cell in cells:
            run_cell(cell, arms, repeats, args.seed, rows, None if args.quick else args.out, args.speedup)
    print()
    print(step_table(rows))
    print()
    print(summary_table(rows))
    print()
    print(versus_kv(rows))
    print()
    print(docs_table(rows))
    print()
    print(default_vs_kv(rows))
    print()
    print(model(rows))
    if not args.quick:
        _save(rows, args.out)
        chart(rows, args.out.with_suffix(".png"))
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
