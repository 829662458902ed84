"""A GRPO-shaped multi-turn workload, and what it tells about session affinity.

The main command, the integration tests and every Dynamo benchmark (affinity, frontends, fleet)
drive Dynamo the same way: ``prompts x siblings`` trajectories, each re-sending its growing history
turn after turn, every attempt inside ``otel_session.trajectory()``, through the openai SDK. Each
turn records the worker that served it (Dynamo's ``nvext``), the prompt tokens it found in that
worker's prefix cache and when it was sent and answered, so "did the trajectory stay on one worker,
what did that save, and how long did the step take" is read off the results. The shape can also be
agentic: turn counts and tool pauses drawn per attempt from long-tailed (lognormal) distributions.

Why one module of some 330 lines: the shape, the run and the reading of its results are one
contract that the command, the tests and the benchmarks share; split, each part would be read only
with the others.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from otel_session import trajectory
from otel_session.dynamo import NVEXT_EXTRA_BODY, cached_tokens_of, ttft_ms_of, worker_id_of

_WORDS = [
    "session",
    "worker",
    "router",
    "prefix",
    "cache",
    "token",
    "model",
    "request",
    "response",
    "latency",
    "stream",
    "agent",
    "tool",
    "user",
    "reward",
    "policy",
    "gradient",
    "rollout",
    "episode",
    "trajectory",
    "sample",
    "batch",
    "decode",
    "prefill",
    "attention",
    "layer",
    "block",
    "memory",
    "transfer",
    "metric",
    "export",
    "python",
    "rust",
    "function",
    "method",
    "value",
    "string",
    "list",
    "file",
    "path",
]


@dataclass
class Turn:
    """One model call of a trajectory, as Dynamo reported it."""

    worker: int | None
    prompt_tokens: int
    #: ``None`` when Dynamo does not report prefix-cache use (1.3.0.post1 does not).
    cached_tokens: int | None
    ttft_ms: float | None
    seconds: float
    #: ``time.perf_counter()`` when the request was sent: a step's makespan runs from the first to the
    #: last answer of its turns.
    start: float = 0.0
    completion_tokens: int = 0

    @property
    def end(self) -> float:
        return self.start + self.seconds


@dataclass
class TrajectoryResult:
    """One attempt: its session, and every turn it made."""

    prompt_index: int
    sibling_index: int
    session_id: str
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None

    @property
    def workers(self) -> list[int | None]:
        return [turn.worker for turn in self.turns]

    @property
    def pinned(self) -> bool:
        """Every turn served by one and the same (known) worker."""
        return len(self.turns) > 0 and None not in self.workers and len(set(self.workers)) == 1

    @property
    def switches(self) -> int:
        return sum(1 for a, b in zip(self.workers, self.workers[1:], strict=False) if a != b)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pinned": self.pinned, "switches": self.switches}


@dataclass
class Summary:
    """The figures the table's last lines and the benchmark report."""

    trajectories: int
    pinned: int
    prompts_spread: int
    prompts: int
    #: ``None`` when the deployment reports no cached tokens at all.
    hit_rate: float | None
    ceiling: float
    mean_ttft_ms: float | None
    p90_ttft_ms: float | None
    mean_switches: float
    errors: int


def summarize(results: Sequence[TrajectoryResult], block_size: int = 16) -> Summary:
    """Affinity figures over turns 2+ (turn 1 of a new conversation cannot be cached).

    The ceiling is what a perfect router could serve from cache: each turn's prompt starts with the
    previous turn's prompt, cached in whole blocks of ``block_size`` tokens.
    """
    later = [turn for result in results for turn in result.turns[1:]]
    prompt = sum(turn.prompt_tokens for turn in later)
    reachable = sum(
        min(now.prompt_tokens, before.prompt_tokens // block_size * block_size)
        for result in results
        for before, now in zip(result.turns, result.turns[1:], strict=False)
    )
    ttfts = sorted(turn.ttft_ms for turn in later if turn.ttft_ms is not None)
    reported = any(turn.cached_tokens is not None for turn in later)
    cached = sum(turn.cached_tokens or 0 for turn in later)
    by_prompt: dict[int, set[int | None]] = {}
    for result in results:
        if result.turns:
            by_prompt.setdefault(result.prompt_index, set()).add(result.turns[0].worker)
    return Summary(
        trajectories=len(results),
        pinned=sum(result.pinned for result in results),
        prompts_spread=sum(1 for workers in by_prompt.values() if len(workers) > 1),
        prompts=len(by_prompt),
        hit_rate=cached / prompt if prompt and reported else None,
        ceiling=reachable / prompt if prompt else 0.0,
        mean_ttft_ms=statistics.fmean(ttfts) if ttfts else None,
        p90_ttft_ms=ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None,
        mean_switches=statistics.fmean(r.switches for r in results) if results else 0.0,
        errors=sum(result.error is not None for result in results),
    )


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


#: The 90th percentile of a standard normal: a lognormal with median m and 90th percentile q has
#: sigma = ln(q / m) / Z90.
Z90 = 1.2815515655446004


@dataclass
class Workload:
    """The shape of a GRPO batch: how many prompts, siblings per prompt, turns, how long, and the
    pauses between turns (a tool call, the environment).

    ``turns`` is every attempt's turn count, or with ``turns_p90`` the median of a lognormal drawn
    per attempt (capped at twice ``turns_p90``). ``pause_secs`` is the mean pause before each turn
    after the first: uniform in 0.5-1.5x, or lognormal with ``pause_sigma`` when that is above 0 (a
    long tail of slow tools). ``name_group``: each attempt passes ``trajectory(group=prompt_index)``,
    as a framework preset does; else the library infers the group from the first request's prompt.
    """

    prompts: int = 3
    siblings: int = 3
    turns: int = 4
    prompt_words: int = 1500
    turn_words: int = 150
    max_tokens: int = 16
    seed: int = 0
    pause_secs: float = 0.0
    pause_sigma: float = 0.0
    turns_p90: int | None = None
    name_group: bool = False

    @property
    def trajectories(self) -> int:
        return self.prompts * self.siblings

    def _timing_rng(self, prompt_index: int, sibling_index: int) -> random.Random:
        # Apart from the text's generator, so a shape with pauses keeps the text of one without.
        return random.Random(f"{self.seed}/{prompt_index}/{sibling_index}/timing")

    def turns_of(self, prompt_index: int, sibling_index: int) -> int:
        """How many turns this attempt makes (the same every time for the same seed)."""
        if self.turns_p90 is None or self.turns_p90 <= self.turns:
            return self.turns
        sigma = math.log(self.turns_p90 / self.turns) / Z90
        drawn = self._timing_rng(prompt_index, sibling_index).lognormvariate(math.log(self.turns), sigma)
        return max(1, min(2 * self.turns_p90, round(drawn)))

    def pauses(self, prompt_index: int, sibling_index: int) -> list[float]:
        """The pause before each turn of this attempt (0 before the first), in seconds."""
        rng = self._timing_rng(prompt_index, sibling_index)
        rng.random()  # the draw turns_of used
        count = self.turns_of(prompt_index, sibling_index)
        if self.pause_secs <= 0:
            return [0.0] * count
        if self.pause_sigma > 0:  # median chosen so the mean is pause_secs
            mu = math.log(self.pause_secs) - self.pause_sigma**2 / 2
            drawn = [rng.lognormvariate(mu, self.pause_sigma) for _ in range(count - 1)]
        else:
            drawn = [self.pause_secs * (0.5 + rng.random()) for _ in range(count - 1)]
        return [0.0, *drawn]


async def run_trajectory(
    clients: Sequence[Any],
    model: str,
    workload: Workload,
    prompt_index: int,
    sibling_index: int,
    on_turn: Callable[[], None] | None = None,
) -> TrajectoryResult:
    """One attempt; turn ``t`` goes through ``clients[t % len(clients)]`` (frontend replicas)."""
    prompt_rng = random.Random(f"{workload.seed}/{prompt_index}")
    turn_rng = random.Random(f"{workload.seed}/{prompt_index}/{sibling_index}")
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": _text(prompt_rng, workload.prompt_words)},  # shared by siblings
    ]
    group = prompt_index if workload.name_group else None
    pauses = workload.pauses(prompt_index, sibling_index)
    async with trajectory(prompt_index=prompt_index, sibling_index=sibling_index, group=group) as traj:
        result = TrajectoryResult(prompt_index, sibling_index, traj.session_id or "")
        try:
            for index, pause in enumerate(pauses):
                if pause > 0:
                    await asyncio.sleep(pause)
                if index:
                    messages.append({"role": "user", "content": _text(turn_rng, workload.turn_words)})
                began = time.perf_counter()
                response = await clients[index % len(clients)].chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=workload.max_tokens,
                    extra_body=NVEXT_EXTRA_BODY,
                )
                usage = response.usage
                result.turns.append(
                    Turn(
                        worker=worker_id_of(response),
                        prompt_tokens=usage.prompt_tokens if usage else 0,
                        cached_tokens=cached_tokens_of(response),
                        ttft_ms=ttft_ms_of(response),
                        seconds=time.perf_counter() - began,
                        start=began,
                        completion_tokens=usage.completion_tokens if usage else 0,
                    )
                )
                messages.append({"role": "assistant", "content": response.choices[0].message.content or ""})
                if on_turn is not None:
                    on_turn()
        except Exception as exc:  # reported per trajectory: one failure must not hide the others
            result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_batch(
    base_urls: Sequence[str],
    model: str,
    workload: Workload,
    *,
    concurrency: int = 16,
    max_retries: int = 2,
    timeout: float = 60.0,
    on_turn: Callable[[], None] | None = None,
) -> list[TrajectoryResult]:
    """Run every trajectory of the batch, at most ``concurrency`` at a time, on one event loop."""
    import openai

    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")  # 0 would wait forever

    clients = [
        # A bounded timeout: a frontend that accepts and never answers fails the turn, not the run.
        openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=max_retries, timeout=timeout)
        for url in base_urls
    ]
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt_index: int, sibling_index: int) -> TrajectoryResult:
        async with gate:
            return await run_trajectory(clients, model, workload, prompt_index, sibling_index, on_turn)

    try:
        return list(
            await asyncio.gather(
                *(one(p, s) for p in range(workload.prompts) for s in range(workload.siblings))
            )
        )
    finally:
        for client in clients:
            await client.close()
