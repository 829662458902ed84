"""How a real Dynamo 1.6.1 kv router places a burst of new parent sessions (issue 33).

A GRPO step opens its sibling groups together, each under a new parent session, and the step waits
for its most crowded worker. This sends G siblings of each of P groups (one parent per group, a
session each, a prompt per group) to a fresh frontend with session affinity on over one mocker
process of W workers, the groups' requests either all at once or each group's ``--gaps`` ms after
the one before, and counts the groups each worker got (from Dynamo's ``nvext`` worker ids). Even
placement is ``P / W`` groups on every worker; siblings of one parent split over workers are
counted too.

    python benchmarks/placement.py                    # 8 workers, 16 x 4, gaps 0, 5, 10 ms, 8 trials
    python benchmarks/placement.py --trials 4 --gaps 0,10
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from otel_session.dynamo import NVEXT_EXTRA_BODY, worker_id_of  # noqa: E402

# short words: a 500-word prompt is about 600 tokens, so 8 siblings fit a 256-block worker
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
WORDS += ["lambda", "mu", "nu", "xi", "pi", "rho", "sigma", "tau"]


async def trial(url: str, model: str, groups: int, siblings: int, gap_ms: float, seed: int) -> dict[str, Any]:
    """One burst: groups per worker (most first) and groups whose siblings were split."""
    draw = random.Random(seed)

    async def one(http: httpx.AsyncClient, group: int, prompt: str, parent: str) -> tuple[int, int | None]:
        await asyncio.sleep(group * gap_ms / 1000)
        body = {
            "model": model,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": prompt}],
            **NVEXT_EXTRA_BODY,
        }
        headers = {"X-Dynamo-Session-ID": str(uuid.uuid4()), "X-Dynamo-Parent-Session-ID": parent}
        answer = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        answer.raise_for_status()
        return group, worker_id_of(answer.json())

    async with httpx.AsyncClient(timeout=120) as http:
        sends = []
        for group in range(groups):
            prompt, parent = " ".join(draw.choice(WORDS) for _ in range(500)), str(uuid.uuid4())
            sends += [one(http, group, prompt, parent) for _ in range(siblings)]
        served = await asyncio.gather(*sends)
    workers_of: dict[int, set[int | None]] = collections.defaultdict(set)
    for group, worker in served:
        workers_of[group].add(worker)
    per_worker = collections.Counter(next(iter(w)) for w in workers_of.values() if len(w) == 1)
    return {
        "groups_per_worker": sorted(per_worker.values(), reverse=True),
        "split": sum(len(w) > 1 for w in workers_of.values()),
    }


def _positive(text: str) -> int:
    """A count of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of 1 or more")
    return value


def _gaps(text: str) -> list[float]:
    """``--gaps``: comma-separated milliseconds, each 0 or more."""
    try:
        gaps = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected milliseconds such as 0,5,10") from None
    if not all(0 <= gap < float("inf") for gap in gaps):
        raise argparse.ArgumentTypeError(f"{text!r}: each gap is 0 ms or more")
    return gaps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=_positive, default=8)
    parser.add_argument("--groups", type=_positive, default=16)
    parser.add_argument("--siblings", type=_positive, default=4)
    parser.add_argument(
        "--gaps", type=_gaps, default="0,5,10", help="ms between one group's requests and the next's"
    )
    parser.add_argument("--trials", type=_positive, default=8)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "placement.json")
    args = parser.parse_args(argv)
    gaps: list[float] = args.gaps
    rows = []
    # kv routing with hard affinity (300 s TTL), one frontend, 256 blocks of 16 tokens per worker
    with harness.stack(harness.Deployment(), args.workers, blocks=256, speedup=0.2) as served:
        url, model = served.base_url.removesuffix("/v1"), served.stack.model_name
        for gap in gaps:
            for number in range(args.trials):
                seed = int(gap * 1000) + number
                found = asyncio.run(trial(url, model, args.groups, args.siblings, gap, seed))
                rows.append({"gap_ms": gap, "trial": number, **found})
            even = args.groups / args.workers
            done = [r for r in rows if r["gap_ms"] == gap]
            uneven = sum(max(r["groups_per_worker"], default=0) > even or r["split"] > 0 for r in done)
            print(
                f"{args.workers} workers, {args.groups} groups x {args.siblings}, gap {gap:g} ms: "
                f"uneven in {uneven} of {len(done)} bursts; groups per worker "
                + "; ".join(",".join(map(str, r["groups_per_worker"])) for r in done),
                flush=True,
            )
    args.out.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
