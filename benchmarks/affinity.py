"""What session affinity is worth: prefix-cache hits and TTFT with otel-session configured vs absent.

Runs multi-turn conversations (each turn re-sends the growing history) against a real local Dynamo
1.6.1 stack with mocker workers, for 2 and 4 workers under the round-robin and kv routers, once with
otel-session configured (sessions pinned) and once without it, all in one run. Reports, over turns
2+, the prefix-cache hit rate (``usage.prompt_tokens_details.cached_tokens``) next to the workload's
ceiling, mean and p90 TTFT (Dynamo's own ``nvext.timing``) and worker switches per conversation.

    python benchmarks/affinity.py            # full: 32 conversations x 6 turns per cell, ~6k-token prompts
    python benchmarks/affinity.py --quick    # smaller, for a smoke run
    python benchmarks/affinity.py --plot-only  # redraw affinity.png from affinity.json, no Dynamo
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import otel_session  # noqa: E402
from benchmarks import harness  # noqa: E402
from otel_session.dynamo import LocalDynamo  # noqa: E402
from otel_session.dynamo.workload import Workload, summarize  # noqa: E402

RESULTS = harness.RESULTS


def run_cell(workers: int, router: str, workload: Workload, concurrency: int) -> list[dict[str, Any]]:
    """One stack, both arms (absent first, then configured), on fresh conversations each."""
    rows = []
    with LocalDynamo(workers=workers, router_mode=router, affinity_ttl_secs=600) as stack:
        for arm in ("absent", "otel-session"):
            if arm == "otel-session":
                otel_session.configure(dynamo_hosts=stack.hosts)
            # A different seed per arm: the second arm must not find the first arm's prefixes cached.
            arm_load = Workload(**{**asdict(workload), "seed": workload.seed + (arm == "otel-session")})
            try:
                load = harness.run_load(
                    stack.base_urls,
                    stack.model_name,
                    arm_load,
                    concurrency=concurrency,
                    max_retries=2,
                    timeout=60,
                )
            finally:
                otel_session.unconfigure()
            results = load.results
            summary = summarize(results, block_size=stack.block_size)
            if summary.errors:
                raise SystemExit(
                    f"{summary.errors} trajectories failed: {[r.error for r in results if r.error][:3]}"
                )
            prompt_tokens = [t.prompt_tokens for r in results for t in r.turns]
            rows.append(
                {
                    "workers": workers,
                    "router": router,
                    "arm": arm,
                    "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens),
                    **asdict(summary),
                    "makespan_s": harness.step_figures(load.turns, workers)["makespan_s"],
                    **load.cpu,
                }
            )
            print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    return (
        f"| {row['workers']} | {row['router']:<11} | {row['arm']:<12} | {row['hit_rate']:6.3f} | "
        f"{row['ceiling']:6.3f} | {row['mean_ttft_ms']:7.1f} | {row['p90_ttft_ms']:7.1f} | "
        f"{row['mean_switches']:5.2f} | {row['pinned']:>3}/{row['trajectories']:<3} |"
    )


HEADER = (
    "| workers | router | otel-session | hit rate 2+ | ceiling | mean TTFT ms | p90 TTFT ms | "
    "switches/conv | pinned |\n|---|---|---|---|---|---|---|---|---|"
)


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["workers"], r["router"]) for r in rows})
    labels = [f"{w} workers\n{router}" for w, router in cells]
    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4.4))
    width = 0.38
    for offset, arm, color in ((-width / 2, "absent", "#b0b0b0"), (width / 2, "otel-session", "#2a7ab9")):
        by_cell = {(r["workers"], r["router"]): r for r in rows if r["arm"] == arm}
        xs = [i + offset for i in range(len(cells))]
        hits.bar(xs, [by_cell[c]["hit_rate"] for c in cells], width, label=arm, color=color)
        ttft.bar(xs, [by_cell[c]["mean_ttft_ms"] for c in cells], width, label=arm, color=color)
    ceiling = {(r["workers"], r["router"]): r["ceiling"] for r in rows if r["arm"] == "otel-session"}
    hits.scatter(
        range(len(cells)), [ceiling[c] for c in cells], marker="_", s=900, color="black", label="ceiling"
    )
    for axis, title in ((hits, "prefix-cache hit rate, turns 2+"), (ttft, "mean TTFT, turns 2+ (ms)")):
        axis.set_xticks(range(len(cells)), labels)
        axis.set_title(title)
    # One legend for both panels, below them: inside a panel it covered bars.
    handles, names = hits.get_legend_handles_labels()
    order = sorted(range(len(names)), key=lambda i: names[i] == "ceiling")  # the arms first
    fig.legend(
        [handles[i] for i in order],
        [names[i] for i in order],
        loc="lower center",
        ncol=len(names),
        fontsize=9,
        frameon=False,
    )
    fig.suptitle("Dynamo 1.6.1 with mocker workers: session affinity via otel-session")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="9 conversations x 4 turns per cell")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="redraw affinity.png from the affinity.json in --out; runs no Dynamo",
    )
    args = parser.parse_args(argv)
    if args.plot_only:
        rows = json.loads((args.out / "affinity.json").read_text())["rows"]
        chart(rows, args.out / "affinity.png")
        print(f"wrote {args.out / 'affinity.png'} from {args.out / 'affinity.json'}")
        return 0
    if args.quick:
        workload, concurrency = Workload(prompts=9, siblings=1, turns=4, prompt_words=1500, turn_words=120), 5
    else:
        # About 6k prompt tokens on average. Five conversations in flight keep the 2-core machine from
        # queueing, so TTFT measures prefill (from cache or not) rather than CPU contention; an odd
        # number, because an even one in lockstep over 2 or 4 round-robin workers looks pinned by chance.
        workload, concurrency = (
            Workload(prompts=32, siblings=1, turns=6, prompt_words=3500, turn_words=200),
            5,
        )
    print(
        f"{workload.trajectories} conversations x {workload.turns} turns per cell, concurrency {concurrency}"
    )
    print(HEADER)
    rows = [
        row
        for workers in (2, 4)
        for router in ("round-robin", "kv")
        for row in run_cell(workers, router, workload, concurrency)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "affinity.json").write_text(
        json.dumps({"workload": asdict(workload), "rows": rows}, indent=2)
    )
    chart(rows, args.out / "affinity.png")
    base = {(r["workers"], r["router"]): r for r in rows if r["arm"] == "absent"}
    for row in rows:
        if row["arm"] == "otel-session":
            off = base[(row["workers"], row["router"])]
            speedup = off["mean_ttft_ms"] / row["mean_ttft_ms"]
            print(
                f"{row['workers']} workers {row['router']:<11}: TTFT {speedup:.2f}x "
                f"better, hit rate {row['hit_rate']:.3f} vs ceiling {row['ceiling']:.3f} "
                f"({row['ceiling'] - row['hit_rate']:+.3f})"
            )
    print(f"wrote {args.out / 'affinity.json'} and {args.out / 'affinity.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
