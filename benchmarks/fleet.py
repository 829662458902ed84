"""Fleet scale: what sessions are worth to a GRPO step, per arm, on real fleets (issues 29 and 33).

Every run starts, per arm, a fresh real Dynamo 1.6.1 stack (``benchmarks/harness.py``): the
frontend (or several replicas behind a real nginx) and ONE mocker process hosting all the workers,
each worker's KV cache sized in blocks of 16 tokens. The load is one GRPO step of a shape
(:data:`SHAPES`, a :class:`otel_session.dynamo.workload.Workload`): P prompts x G siblings, every
trajectory started at once, the siblings sharing their prompt, each turn re-sending the growing
history after a pause. Requests go through the openai SDK, and otel-session makes the sessions:
every attempt is a ``trajectory(group=prompt)`` (``/nogroup`` arms: a plain ``trajectory()``, the
library infers the group from the first request's prompt) and the arm's ``configure(siblings=...)``
says which siblings name a common parent session. The shapes:

    grpo     4 turns; a ~2.4k-token prompt shared by the siblings, ~150 tokens per observation;
             pauses 0.04 s of model time, uniform 0.5-1.5x (0.2 s of wall time at --speedup 0.2)
    agentic  a coding agent calibrated to NeMo-RL #3663 (turns per session p50 29, p90 56), turn
             counts scaled down 4x for 2 cores: lognormal, p50 7, p90 14, at most 28; a ~3k-token
             task shared by the siblings, ~2.3k tokens of tool output per turn (contexts reach ~17k
             tokens at the median attempt, ~33k at p90); tool pauses lognormal with a long tail,
             mean 1 s of model time, sigma 1.2 (p50 0.5 s, p99 about 8 s)

Pauses are in model time: they are divided by ``--speedup`` (the mocker's ``--speedup-ratio``), so a
step keeps its shape whatever the speedup and the ratio between arms can be compared across two.

The arms (what the frontend runs, what otel-session sends):

    rr, kv                 round-robin or kv routing, no session header
    kv+header/off          the default's headers, session affinity OFF at the frontend (the header
                           is sent and ignored: what ``doctor --layout kv`` recommends)
    kv+default             kv, affinity on (hard), the library's default sibling keying (auto: one group
                           per worker, sized from the fleet; groups:2 where its size is unknown)
    kv+default/nogroup     the same with a plain trajectory(): the group inferred from the prompt
    kv+attempt             a session per attempt, no parent (the "no parent at all" arm)
    kv+prompt, kv+groups:K all siblings of a prompt under one parent; each K under one
    kv+auto                groups:K as ``otel-session doctor --prompts P --siblings G`` sizes it
    kv+default/soft, kv+attempt/soft   soft affinity
    kv+default/predicted   --router-predicted-ttl-secs 5 (siblings placed before KV events arrive)
    kv+default/busy        Dynamo's busy thresholds (--active-decode-blocks-threshold 0.85,
                           --active-prefill-tokens-threshold 4096), which reject work: errors counted
    kv+default/ttl2        the session released about 2 s after its last request: an EMULATION of
                           releasing it at the end of the attempt with a short idle TTL (the stock
                           1.6.1 router keeps a binding after X-Dynamo-Session-Final, see
                           tests/test_session_end.py); longer tool pauses also unpin mid-attempt
    rr+attempt, rr+default round-robin with sessions
    3fe:..., 3fe-hash:...  three frontend replicas over the same workers behind nginx, round-robin
                           or hashing X-Dynamo-Session-ID consistently; 3fe-parent: hashing the
                           parent session where a request names one (a sibling group reaches one
                           frontend), else the session; -sync: --router-replica-sync
    .../pace10, 40, 80     the pace set (OTEL_SESSION_PACE_MS): new parents 10, 40 or 80 ms apart at a
                           router, not by the burst (10 was the default until 2026-12-06)

Arms of one repeat see the same text on a cold fleet; repeats use new text and rotate the arms'
order. Per run: the step's makespan (first request sent to last response: a GRPO step waits for its
slowest trajectory), the fleet's tokens/s over it, TTFT p50/p90/p99, per-worker crowding (the
busiest worker's requests in flight over the fleet's mean, sampled every 20 ms; the peak in flight
on one worker; the busiest worker's share of the turns), prefix hit rate of turns 2+
(``cached_tokens / prompt_tokens``) and its ceiling, and the cores' busy fraction over the run
(``/proc/stat``; "saturated" above 85 %, see ``harness.SATURATED``).

    python benchmarks/fleet.py --quick                      # about a minute: 8 workers, 4 arms (CI)
    python benchmarks/fleet.py --cells 32:256:16:8 --arms kv,kv+header/off,kv+default --speedup 0.2
    python benchmarks/fleet.py --cells 16:3360:8:8:agentic --speedup 0.4
    python benchmarks/fleet.py --plot-only                  # tables and chart from --out
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import otel_session  # noqa: E402
from benchmarks import harness  # noqa: E402
from otel_session.dynamo.sizing import siblings_setting  # noqa: E402
from otel_session.dynamo.workload import TrajectoryResult, Workload  # noqa: E402

RESULTS = harness.RESULTS
BLOCK_SIZE = harness.BLOCK_SIZE
AFFINITY_TTL = 300

#: The step shapes (prompts, siblings and seed are the cell's); pauses in model time (see above).
SHAPES: dict[str, Workload] = {
    "grpo": Workload(turns=4, prompt_words=1300, turn_words=100, max_tokens=16, pause_secs=0.04),
    "quick": Workload(turns=3, prompt_words=600, turn_words=60, max_tokens=16, pause_secs=0.04),
    "agentic": Workload(
        turns=7,
        turns_p90=14,
        prompt_words=2000,
        turn_words=1500,
        max_tokens=32,
        pause_secs=1.0,
        pause_sigma=1.2,
    ),
}


@dataclass(frozen=True)
class Arm:
    """How one arm routes and keys its sessions."""

    name: str
    router: str
    keying: str  # "none", "attempt", "default", "prompt", "groups:K", "auto" (doctor's K) or "fleet"
    mode: str = "hard"
    affinity_ttl: int | None = AFFINITY_TTL  # None: affinity off at the frontend (the header is ignored)
    frontend_args: tuple[str, ...] = ()
    frontends: int = 1  # more than one: replicas behind nginx, balancing as below
    balancer: harness.Balancer = "rr"  # "rr", "hash" (X-Dynamo-Session-ID), "parent" (parent, else session)
    name_group: bool = True  # trajectory(group=prompt); False: a plain trajectory(), the group inferred
    pace_ms: float | None = None  # OTEL_SESSION_PACE_MS: new parents this far apart (None: by the burst)

    @property
    def deployment(self) -> harness.Deployment:
        return harness.Deployment(
            router=self.router,
            affinity_ttl=self.affinity_ttl,
            mode="soft" if self.mode == "soft" else "hard",
            frontends=self.frontends,
            balancer=self.balancer,
            frontend_args=self.frontend_args,
        )


_SYNC = ("--router-replica-sync",)  # the frontends share their routers' active-load view
_BUSY = ("--active-decode-blocks-threshold", "0.85", "--active-prefill-tokens-threshold", "4096")
ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("rr", "round-robin", "none"),
        Arm("kv", "kv", "none"),
        Arm("kv+header/off", "kv", "default", affinity_ttl=None),
        Arm("kv+default", "kv", "default"),  # the library's default: auto (groups:2 until sized)
        Arm("kv+default/nogroup", "kv", "default", name_group=False),
        Arm("kv+attempt", "kv", "attempt"),
        Arm("kv+prompt", "kv", "prompt"),
        Arm("kv+groups:2", "kv", "groups:2"),
        Arm("kv+groups:3", "kv", "groups:3"),
        Arm("kv+groups:4", "kv", "groups:4"),
        Arm("kv+groups:6", "kv", "groups:6"),
        Arm("kv+groups:8", "kv", "groups:8"),
        Arm("kv+auto", "kv", "auto"),
        Arm("kv+fleet", "kv", "fleet"),
        Arm("kv+fleet/nogroup", "kv", "fleet", name_group=False),
        Arm("kv+attempt/soft", "kv", "attempt", "soft"),
        Arm("kv+default/soft", "kv", "default", "soft"),
        Arm("kv+default/predicted", "kv", "default", frontend_args=("--router-predicted-ttl-secs", "5")),
        Arm("kv+default/busy", "kv", "default", frontend_args=_BUSY),
        Arm("kv+default/ttl2", "kv", "default", affinity_ttl=2),
        Arm("rr+attempt", "round-robin", "attempt"),
        Arm("rr+default", "round-robin", "default"),
        Arm("3fe:kv", "kv", "none", frontends=3),
        Arm("3fe:kv+header/off", "kv", "default", affinity_ttl=None, frontends=3),
        Arm("3fe-hash:kv+header/off", "kv", "default", affinity_ttl=None, frontends=3, balancer="hash"),
        Arm("3fe:kv+default", "kv", "default", frontends=3),
        Arm("3fe-hash:kv+default", "kv", "default", frontends=3, balancer="hash"),
        Arm("3fe-parent:kv+default", "kv", "default", frontends=3, balancer="parent"),
        Arm("3fe-parent:kv+fleet", "kv", "fleet", frontends=3, balancer="parent"),
        Arm("3fe:kv+fleet", "kv", "fleet", frontends=3),
        Arm("3fe-sync:kv", "kv", "none", frontends=3, frontend_args=_SYNC),
        Arm("3fe-sync:kv+default", "kv", "default", frontends=3, frontend_args=_SYNC),
        Arm(
            "3fe-parent-sync:kv+default", "kv", "default", frontends=3, balancer="parent", frontend_args=_SYNC
        ),
        Arm("3fe-parent-sync:kv+fleet", "kv", "fleet", frontends=3, balancer="parent", frontend_args=_SYNC),
        Arm(
            "3fe-parent-sync:kv+default/pace40",
            "kv",
            "default",
            frontends=3,
            balancer="parent",
            frontend_args=_SYNC,
            pace_ms=40,
        ),
        Arm(
            "3fe-parent-sync:kv+default/pace10",
            "kv",
            "default",
            frontends=3,
            balancer="parent",
            frontend_args=_SYNC,
            pace_ms=10,
        ),
        Arm("kv+default/pace10", "kv", "default", pace_ms=10),
        Arm("kv+default/pace40", "kv", "default", pace_ms=40),
        Arm("kv+default/pace80", "kv", "default", pace_ms=80),
        Arm("3fe:rr", "round-robin", "none", frontends=3),
        Arm("3fe-hash:rr+default", "round-robin", "default", frontends=3, balancer="hash"),
    )
}


@dataclass(frozen=True)
class Cell:
    """A fleet and a step: workers, KV blocks per worker, prompts x siblings, and the step's shape."""

    workers: int
    blocks: int
    prompts: int
    siblings: int
    shape: str = "grpo"

    @property
    def label(self) -> str:
        suffix = "" if self.shape == "grpo" else f" {self.shape}"
        return f"{self.workers}w {self.blocks}blk {self.prompts}x{self.siblings}{suffix}"

    @property
    def in_flight_per_worker(self) -> float:
        return self.prompts * self.siblings / self.workers

    def workload(self, seed: int, speedup: float = 1.0, name_group: bool = True) -> Workload:
        """The step this cell runs: its shape with the cell's batch, pauses in wall time."""
        shape = SHAPES[self.shape]
        return replace(
            shape,
            prompts=self.prompts,
            siblings=self.siblings,
            seed=seed,
            pause_secs=shape.pause_secs / speedup,
            name_group=name_group,
        )

    @classmethod
    def parse(cls, text: str) -> Cell:
        """``W:B:P:G`` or ``W:B:P:G:shape``."""
        parts = text.split(":")
        shape = parts[4] if len(parts) > 4 else "grpo"
        if len(parts) not in (4, 5) or shape not in SHAPES:
            raise ValueError(f"{text!r}: expected W:B:P:G[:shape], shape one of {', '.join(SHAPES)}")
        workers, blocks, prompts, siblings = (int(part) for part in parts[:4])
        return cls(workers, blocks, prompts, siblings, shape)


def siblings_of(keying: str, cell: Cell) -> str | None:
    """The ``configure(siblings=...)`` an arm runs with (``None``: the library's default); ``auto``
    is what ``otel-session doctor --prompts P --siblings G`` recommends for the cell's fleet."""
    if keying == "auto":
        return siblings_setting(cell.workers, cell.prompts, cell.siblings)
    return None if keying == "default" else keying


def group_size(setting: str, cell: Cell) -> int | None:
    """Siblings under one parent for a siblings setting as the library spells it (``None``: none).
    ``auto`` and ``fleet`` size K from the step itself in the first step (gathered before its groups
    are sized) and from the step before in the others: the cell's shape either way."""
    if setting in ("auto", "fleet"):
        setting = siblings_setting(cell.workers, cell.prompts, cell.siblings)
    if setting == "prompt":
        return cell.siblings
    if setting.startswith("groups:"):
        return min(cell.siblings, int(setting.split(":", 1)[1]))
    return None


def measure(
    results: Sequence[TrajectoryResult], workers: int, wall: float, group: int | None = None
) -> dict[str, Any]:
    """The figures of one run (see the module docstring); ``group``: siblings under one parent, for
    the share of those groups Dynamo put together (all of a group's first turns on one worker)."""
    bs = BLOCK_SIZE
    turns = [t for r in results for t in r.turns]
    later = [t for r in results for t in r.turns[1:]]
    later_prompt = sum(t.prompt_tokens for t in later) or 1
    reach_later = sum(
        min(now.prompt_tokens, before.prompt_tokens // bs * bs)
        for r in results
        for before, now in zip(r.turns, r.turns[1:], strict=False)
    )
    # Turn 1: every sibling but one of each prompt could find the shared prompt cached.
    first_seen: set[int] = set()
    reach_first = 0
    for r in sorted(results, key=lambda r: (r.prompt_index, r.sibling_index)):
        if r.turns:
            if r.prompt_index in first_seen:
                reach_first += r.turns[0].prompt_tokens // bs * bs
            first_seen.add(r.prompt_index)
    all_prompt = sum(t.prompt_tokens for t in turns) or 1
    ttft_later = [t.ttft_ms for t in later if t.ttft_ms is not None]
    ttft_all = [t.ttft_ms for t in turns if t.ttft_ms is not None]
    by_prompt: dict[int, set[int | None]] = {}
    for r in results:
        if r.turns:
            by_prompt.setdefault(r.prompt_index, set()).add(r.turns[0].worker)
    together: float | None = None
    busiest: int | None = None
    if group:
        first_workers: dict[tuple[int, int], set[int | None]] = {}
        for r in results:
            if r.turns:
                key = (r.prompt_index, r.sibling_index // group)
                first_workers.setdefault(key, set()).add(r.turns[0].worker)
        together = (
            sum(len(w) == 1 for w in first_workers.values()) / len(first_workers) if first_workers else 0.0
        )
        # Where each group was placed: two groups on one worker (a collision) crowd the step.
        placed = Counter(next(iter(w)) for w in first_workers.values() if len(w) == 1)
        busiest = max(placed.values(), default=0)
    return {
        "groups_together": together,
        "groups_on_busiest_worker": busiest,
        "trajectories": len(results),
        "errors": sum(r.error is not None for r in results),
        "first_error": next((r.error[:300] for r in results if r.error), None),
        "turns_done": len(turns),
        "hit_rate": sum(t.cached_tokens or 0 for t in later) / later_prompt,
        "ceiling": reach_later / later_prompt,
        "hit_rate_all": sum(t.cached_tokens or 0 for t in turns) / all_prompt,
        "ceiling_all": (reach_later + reach_first) / all_prompt,
        "mean_prompt_tokens": statistics.fmean(t.prompt_tokens for t in turns) if turns else 0.0,
        "max_prompt_tokens": max((t.prompt_tokens for t in turns), default=0),
        "ttft_ms": statistics.fmean(ttft_later) if ttft_later else None,
        "ttft_p90_ms": harness.percentile(ttft_later, 0.9),  # turns 2+; the step's p90 is ttft_all_p90_ms
        "ttft_all_ms": statistics.fmean(ttft_all) if ttft_all else None,
        "turns_per_s": len(turns) / wall if wall else 0.0,
        "workers_used": len({t.worker for t in turns if t.worker is not None}),
        "switches": statistics.fmean(r.switches for r in results) if results else 0.0,
        "pinned": sum(r.pinned for r in results),
        "workers_per_prompt_turn1": statistics.fmean(len(w) for w in by_prompt.values())
        if by_prompt
        else 0.0,
        "wall_s": wall,
        **_step(harness.step_figures(turns, workers)),
    }


def _step(figures: dict[str, Any]) -> dict[str, Any]:
    # The step's TTFT p90 is of every turn; ``ttft_p90_ms`` stays the turns-2+ one older rows have.
    figures["ttft_all_p90_ms"] = figures.pop("ttft_p90_ms")
    return figures


def run_arm(cell: Cell, arm: Arm, seed: int, speedup: float = 1.0, steps: int = 1) -> list[dict[str, Any]]:
    """A fresh stack for one arm of one repeat (the fleet's caches start cold for every arm), and
    ``steps`` GRPO steps on it one after another under one configuration, each with prompts of its
    own: what the library learns in one step (``fleet``'s shape) serves the next, as in training."""
    rows = []
    with harness.stack(arm.deployment, cell.workers, cell.blocks, speedup) as served:
        setting = "none"
        if arm.keying != "none":
            settings = otel_session.configure(
                dynamo_hosts=served.hosts,
                siblings=siblings_of(arm.keying, cell),
                pace_ms=arm.pace_ms,
            )
            setting = str(settings.siblings)  # what the library resolved, its default included
        try:
            for step in range(steps):
                machine = harness.load_figures()
                workload = cell.workload(seed + 1000 * step, speedup, arm.name_group)
                load = harness.run_load([served.base_url], served.stack.model_name, workload)
                rows.append(_row(cell, arm, seed, speedup, setting, workload, load, machine, step, steps))
        finally:
            otel_session.unconfigure()
    return rows


def _row(
    cell: Cell,
    arm: Arm,
    seed: int,
    speedup: float,
    setting: str,
    workload: Workload,
    load: harness.Load,
    machine: dict[str, Any],
    step: int,
    steps: int,
) -> dict[str, Any]:
    size = group_size(setting, cell)
    shape = {k: v for k, v in asdict(workload).items() if k not in ("prompts", "siblings", "seed")}
    return {
        **asdict(cell),
        **shape,
        # a later step of a multi-step run is a cell of its own: its arms pair only with each other
        "cell": cell.label if steps == 1 else f"{cell.label} step {step + 1}/{steps}",
        "step": step,
        "arm": arm.name,
        "router": arm.router,
        "keying": arm.keying,
        "mode": arm.mode,
        "affinity": arm.affinity_ttl is not None,
        "affinity_ttl": arm.affinity_ttl,
        "frontends": arm.frontends,
        "balancer": arm.balancer,
        "frontend_args": list(arm.frontend_args),
        "name_group": arm.name_group,
        "speedup": speedup,
        "group_size": size,
        "siblings_setting": setting,
        "keying_impl": "api",  # configure(siblings=...) + trajectory(group=p); earlier rows: nested
        "seed": seed,
        **machine,
        **measure(load.results, cell.workers, load.wall, size),
        **load.cpu,
        "load_after": harness.load_figures()["load_before"],
    }


def run_cell(
    cell: Cell,
    arms: Sequence[Arm],
    repeats: int,
    seed0: int,
    sink: list[dict[str, Any]],
    out: Path | None,
    speedups: Sequence[float] = (1.0,),
    steps: int = 1,
) -> None:
    """Every arm at every speedup, ``repeats`` times, the arms' order rotated each repeat (so drift
    in the machine's load spreads over the arms), rows saved after each run."""
    for rep in range(repeats):
        order = list(arms[rep % len(arms) :]) + list(arms[: rep % len(arms)])
        for speedup in speedups:
            for arm in order:
                for row in run_arm(cell, arm, seed0 + rep, speedup, steps):
                    row["repeat"] = rep
                    sink.append(row)
                    print(_line(row), flush=True)
                if out is not None:
                    _save(sink, out)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (
    "| cell | arm | rep | speedup | step s | tok/s | busiest x fair | peak | cpu | hit 2+ | ceil 2+ | "
    "hit all | ceil all | "
    "TTFT ms | p90 | TTFT all | turns/s | "
    "balance | used | switch | pinned | err | load |\n|" + "---|" * 23
)


def _line(r: dict[str, Any]) -> str:
    return (
        f"| {r['cell']} | {r['arm']} | {r.get('repeat', 0)} | {r.get('speedup', 1.0):g} | "
        f"{r.get('makespan_s', r['wall_s']):.1f} | "
        f"{r.get('tokens_per_s', 0.0):.0f} | {r.get('busiest_x_fair', 0.0):.1f} | "
        f"{r.get('peak_in_flight', 0.0):.0f} | "
        f"{fmt(r.get('cpu_busy'), '.0%')}{' SAT' if r.get('saturated') else ''} | "
        f"{r['hit_rate']:.3f} | {r['ceiling']:.3f} | "
        f"{r['hit_rate_all']:.3f} | {r['ceiling_all']:.3f} | {fmt(r['ttft_ms'], '.0f')} | "
        f"{fmt(r['ttft_p90_ms'], '.0f')} | {fmt(r['ttft_all_ms'], '.0f')} | {r['turns_per_s']:.1f} | "
        f"{r['balance']:.2f} | {r['workers_used']} | {r['switches']:.2f} | "
        f"{r['pinned']}/{r['trajectories']} | {r['errors']} | {r['load_before']:.1f} |"
    )


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
            return harness.span([r[key] for r in rs if r[key] is not None], spec)

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
    cell and speedup (means over repeats; beside it the range of the run-by-run ratios on the same
    text, :func:`paired`), with the arm's own spread (min-max over repeats), tokens/s,
    TTFT p50/p90/p99 of every turn, hit rate of turns 2+, crowding (the busiest worker's turns over a
    fair share; the most requests in flight on one worker), the cores' busy fraction, and the
    verdict: "slower" when the arm's fastest repeat is slower than kv's slowest (outside both
    spreads), "faster" the other way round, else "within spread"."""
    cells: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        if "makespan_s" in r:
            cells.setdefault((r["cell"], r.get("speedup", 1.0)), {}).setdefault(r["arm"], []).append(r)
    lines = [
        "| cell | speedup | arm | runs | step s (spread) | x kv (paired) | x rr | tok/s | "
        "TTFT p50/p90/p99 ms | hit 2+ | busiest x fair | peak in flight | cpu busy | vs kv |",
        "|" + "---|" * 14,
    ]
    for (cell, speedup), arms in cells.items():
        base, rr = arms.get("kv"), arms.get("rr")

        def mean(rs: list[dict[str, Any]], key: str, fallback: str = "") -> float:
            values = [r.get(key, r.get(fallback)) for r in rs]
            kept = [v for v in values if v is not None]
            return statistics.fmean(kept) if kept else math.nan

        for arm, rs in arms.items():
            step = mean(rs, "makespan_s")
            x_kv = f"{step / mean(base, 'makespan_s'):.2f}" if base else "-"
            pairs = paired(rs, base or [])
            if pairs and arm != "kv":
                x_kv += f" ({harness.span(pairs, '.2f')})"
            x_rr = f"{step / mean(rr, 'makespan_s'):.2f}" if rr else "-"
            verdict = "-"
            if base and arm != "kv":
                verdict = versus(rs, base)
            sat = sum(bool(r.get("saturated")) for r in rs)
            errors = sum(r.get("errors", 0) for r in rs)
            lines.append(
                f"| {cell} | {speedup:g} | {arm} | {len(rs)} | "
                f"{step:.1f} ({harness.span([r['makespan_s'] for r in rs], '.1f')}) "
                f"| {x_kv} | {x_rr} | {mean(rs, 'tokens_per_s'):.0f} | "
                f"{mean(rs, 'ttft_p50_ms'):.0f}/{mean(rs, 'ttft_all_p90_ms', 'ttft_p90_ms'):.0f}/"
                f"{mean(rs, 'ttft_p99_ms'):.0f} | "
                f"{mean(rs, 'hit_rate'):.2f} | {mean(rs, 'busiest_x_fair'):.1f} | "
                f"{harness.span([r['peak_in_flight'] for r in rs if 'peak_in_flight' in r], '.0f')} | "
                f"{harness.span([r['cpu_busy'] for r in rs if r.get('cpu_busy') is not None], '.0%')}"
                f"{f' ({sat} saturated)' if sat else ''} | {verdict}"
                f"{f' ({errors} errors)' if errors else ''} |"
            )
    return "\n".join(lines)


def paired(rs: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]) -> list[float]:
    """The arm's step over kv alone's run by run, on the same text (the same seed): where the seed
    moves the step itself (the agentic shape's longest trajectory), the spread that matters."""
    kv = {r.get("seed"): r["makespan_s"] for r in base}
    return [r["makespan_s"] / kv[r.get("seed")] for r in rs if kv.get(r.get("seed"))]


def versus(rs: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]) -> str:
    """An arm's step against kv alone's: "slower" when its fastest repeat is slower than kv's
    slowest, "faster" when its slowest is faster than kv's fastest, else "within spread"."""
    if min(r["makespan_s"] for r in rs) > max(r["makespan_s"] for r in base):
        return "slower"
    if max(r["makespan_s"] for r in rs) < min(r["makespan_s"] for r in base):
        return "faster"
    return "within spread"


def speedup_check(rows: Sequence[dict[str, Any]]) -> str:
    """Each arm's step over kv alone's, per cell, at every speedup measured: a ratio that holds at
    two speedups is the simulator's, not the CPU's (the mocker times its work in wall-clock time)."""
    cells: dict[str, dict[str, dict[float, list[float]]]] = {}
    for r in rows:
        if "makespan_s" in r:
            by_arm = cells.setdefault(r["cell"], {})
            by_arm.setdefault(r["arm"], {}).setdefault(r.get("speedup", 1.0), []).append(r["makespan_s"])
    lines = ["| cell | arm | step / kv alone's at each speedup (runs) |", "|---|---|---|"]
    for cell, by_arm in cells.items():
        base = by_arm.get("kv", {})
        for arm, by_speed in by_arm.items():
            shared = sorted(s for s in by_speed if s in base)
            if arm == "kv" or len(shared) < 2:
                continue
            ratios = [
                f"{statistics.fmean(by_speed[s]) / statistics.fmean(base[s]):.2f} at {s:g} "
                f"({len(by_speed[s])})"
                for s in shared
            ]
            lines.append(f"| {cell} | {arm} | {'; '.join(ratios)} |")
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
            hit = harness.span([r["hit_rate"] for r in rs], ".2f")
            ttft = harness.span([r["ttft_all_ms"] for r in rs if r["ttft_all_ms"] is not None], ".0f")
            return f"{hit} / {ttft} ms"

        runs = harness.span([float(len(rs)) for rs in by_arm.values()], ".0f")
        ceiling = harness.span([r["ceiling"] for rs in by_arm.values() for r in rs], ".2f")
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
            style: dict[str, Any] = {
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
        "--steps", type=int, default=1, help="GRPO steps per run, one after another on one stack"
    )
    parser.add_argument(
        "--speedup",
        default="1.0",
        help="the mocker's --speedup-ratio, or several comma-separated, each run in every repeat "
        "(below 1: slower, less CPU-bound)",
    )
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = sink if sink is not None else []
    if args.plot_only or args.append:
        with contextlib.suppress(FileNotFoundError):
            rows = json.loads(args.out.read_text())["rows"]
    if not args.plot_only:
        if args.quick:
            cells = [Cell(8, 256, 4, 4, "quick")]
            arms = [ARMS[a] for a in ("rr", "kv", "kv+attempt", "kv+default")]
            repeats = 1
        else:
            specs = ISSUE_CELLS if args.cells == "issue" else args.cells.split(",")
            cells = [Cell.parse(spec) for spec in specs]
            unknown = [a for a in args.arms.split(",") if a not in ARMS]
            if unknown:
                parser.error(f"no such arm: {', '.join(unknown)} (the arms: {', '.join(ARMS)})")
            arms = [ARMS[a] for a in args.arms.split(",")]
            repeats = args.repeats
        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
        print(HEADER)
        for cell in cells:
            speedups = [float(x) for x in args.speedup.split(",")]
            out = None if args.quick else args.out
            run_cell(cell, arms, repeats, args.seed, rows, out, speedups, args.steps)
    print()
    print(step_table(rows))
    print()
    print(speedup_check(rows))
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
