"""Sizing Dynamo's session TTL against a run's trajectory rate: its affinity table is finite.

Dynamo keeps at most 65,536 session bindings (``MAX_SESSION_AFFINITY_ENTRIES``, compiled into 1.6.1
and 1.3.0.post1 alike; no flag or variable changes it). A binding leaves only when its session has
been idle for ``--router-session-affinity-ttl-secs``: the stock router has no unbind, and a terminal
``X-Dynamo-Session-Final`` request does not free it. So a run that starts N new trajectories per
second holds about N x TTL bindings.

What a full table does is said once, in :data:`WHEN_FULL`, which ``doctor`` prints. The evidence: on
1.6.1 it was measured with ``benchmarks/capacity.py`` (hard and soft mode, round-robin router:
exactly 65,536 sessions bound, then 529 for every new session, the frontend logging an ``overload``
error); 1.3.0.post1's frontend takes the same path in its source (``ResourceExhausted`` from the
affinity table, answered as Overloaded) but was not filled here. The line "Affinity table full;
routing without session affinity" in the 1.6.1 binary belongs to the KV router's selection service,
at debug level, not to the frontend's path: a frontend never routes a new session unpinned.
Why one module of some 360 lines: the table's sizing and the step's, each rule beside the
measured figures ``doctor`` quotes with it, so a rule and its figures change together.
"""

from __future__ import annotations

import math

from otel_session import _siblings

#: Dynamo's session affinity table (1.3.0.post1 and 1.6.1).
TABLE_SIZE = 65_536
#: Plan for at most this share of the table: trajectory starts come in bursts (a GRPO step starts a
#: whole batch at once), and a TTL counts from a session's *last* request, not its first.
HEADROOM = 0.8
#: The bindings a run should plan for: 80 % of 65,536, rounded down (52,428).
BUDGET = int(TABLE_SIZE * HEADROOM)
#: What the frontend answers a new session once the table is full (the status, and as said).
FULL_STATUS = 529
FULL_ANSWER = f"HTTP {FULL_STATUS} Overloaded"
#: The one statement of what a full table does (see the module docstring for how it is known).
WHEN_FULL = (
    f'once the table is full, every request of a new session is refused with {FULL_ANSWER}, "Service '
    'temporarily overloaded" (DYN_HTTP_OVERLOAD_STATUS_CODE on the frontend changes the status), in '
    "hard and soft affinity mode alike, while sessions already bound stay pinned and requests without "
    "a session header are served"
)


def bindings_held(trajectories_per_second: float, ttl_secs: float) -> float:
    """Bindings a steady run holds: each trajectory's stays ``ttl_secs`` after its last turn."""
    return max(0.0, trajectories_per_second) * max(0.0, ttl_secs)


def largest_ttl(trajectories_per_second: float, table_size: int = TABLE_SIZE) -> int:
    """The longest TTL (whole seconds, Dynamo's unit) that keeps the run within the headroom:
    ``int(table_size * HEADROOM) / trajectories_per_second``, rounded down (at least 1)."""
    if trajectories_per_second <= 0:
        return 31_536_000  # Dynamo's own maximum: no rate, no limit from the table
    return max(1, int(int(table_size * HEADROOM) / trajectories_per_second))


def sizing_note(trajectories_per_second: float | None = None, ttl_secs: int | None = None) -> list[str]:
    """The doctor's lines on the table: the rule, and a verdict when the rate and TTL are known."""
    lines = [
        f"Dynamo keeps at most {TABLE_SIZE:,} session bindings; each leaves only after "
        f"--router-session-affinity-ttl-secs idle, and {WHEN_FULL}.",
        "A run holds about (new trajectories per second) x TTL bindings: set the TTL a little above the "
        "longest pause inside one trajectory (tool call, reward, environment step) and at most "
        f"{BUDGET:,} / (new trajectories per second) seconds, rounded down: {BUDGET:,} is "
        f"{HEADROOM:.0%} of {TABLE_SIZE:,}, the rest kept free for bursts.",
    ]
    if trajectories_per_second is not None and trajectories_per_second > 0:
        limit = largest_ttl(trajectories_per_second)
        if ttl_secs is None:
            lines.append(f"At {trajectories_per_second:g} trajectories/s: a TTL of at most {limit} s.")
        else:
            held = bindings_held(trajectories_per_second, ttl_secs)
            verdict = "fits" if ttl_secs <= limit else f"too many: lower the TTL to {limit} s or less"
            lines.append(
                f"At {trajectories_per_second:g} trajectories/s with a TTL of {ttl_secs} s: about "
                f"{held:,.0f} bindings of {TABLE_SIZE:,} ({verdict})."
            )
    return lines


def step_bindings(per_step: int, step_secs: float, ttl_secs: float, trajectory_secs: float = 0.0) -> int:
    """Bindings held just after a GRPO step starts: its own ``per_step`` at once, plus every earlier
    step's still inside its TTL (a step's bindings live ``trajectory_secs + ttl_secs`` from its start).
    The rate rule's ``per_step / step_secs x TTL``, counted in whole steps, burst included."""
    if per_step <= 0:
        return 0
    if step_secs <= 0:
        return per_step  # a single step: nothing earlier to count
    alive = max(1, math.ceil((max(0.0, trajectory_secs) + max(0.0, ttl_secs)) / step_secs))
    return per_step * alive


def largest_step_ttl(per_step: int, step_secs: float, trajectory_secs: float = 0.0) -> int | None:
    """The longest whole-second TTL keeping :func:`step_bindings` within the budget, or ``None`` when
    no TTL does: one step alone starts more sessions than the budget holds."""
    steps = BUDGET // per_step if per_step > 0 else 0
    if steps < 1:
        return None
    ttl = math.floor(steps * step_secs - max(0.0, trajectory_secs))
    return ttl if ttl >= 1 else None


def step_rule(per_step: int) -> str:
    """The doctor's line for a batch shape when the step interval is not known: how many steps'
    bindings fit, hence how long TTL plus a trajectory may last in step intervals."""
    steps = BUDGET // per_step if per_step > 0 else 0
    if steps < 1:
        return (
            f"a step of {per_step:,} trajectories starts more than {BUDGET:,} sessions at once: no TTL "
            f"fits, and the sessions past the table get {FULL_ANSWER}"
        )
    plural = "s" if steps != 1 else ""
    return (
        f"a step of {per_step:,} trajectories: the bindings of {steps:,} step{plural} fit in {BUDGET:,}, "
        f"so keep TTL + one trajectory's duration within {steps:,} step interval{plural} "
        "(bindings ~= trajectories per step x ceil((duration + TTL) / interval))"
    )


def step_note(
    per_step: int, step_secs: float, ttl_secs: int | None = None, trajectory_secs: float = 0.0
) -> str:
    """The doctor's line for a GRPO run: a step of ``per_step`` trajectories every ``step_secs``."""
    limit = largest_step_ttl(per_step, step_secs, trajectory_secs)
    head = f"GRPO steps of {per_step:,} trajectories every {step_secs:g} s"
    if limit is None:
        return (
            f"{head}: more than {BUDGET:,} new sessions within one TTL; no TTL fits: start fewer "
            f"trajectories per step, or expect {FULL_ANSWER} for the sessions past the table"
        )
    if ttl_secs is None:
        return f"{head}: a TTL of at most {limit} s."
    held = step_bindings(per_step, step_secs, ttl_secs, trajectory_secs)
    verdict = "fits" if ttl_secs <= limit else f"too many: lower the TTL to {limit} s or less"
    return (
        f"{head} with a TTL of {ttl_secs} s: about {held:,} bindings of {TABLE_SIZE:,} at each step's "
        f"start ({verdict})."
    )


def sibling_group_size(workers: int, prompts: int, siblings: int) -> int:
    """Siblings per group so a step's groups about fill the fleet, one group per worker (``_siblings``
    states the rule, :data:`SIBLINGS_RULE` says it to the user)."""
    if siblings <= 1 or prompts <= 0 or workers <= 0:
        return 1
    return _siblings.group_size(workers, prompts, siblings)


def siblings_setting(workers: int, prompts: int, siblings: int) -> str:
    """The sibling keying for a batch shape on a fleet, as ``OTEL_SESSION_SIBLINGS`` spells it."""
    size = sibling_group_size(workers, prompts, siblings)
    if size <= 1:
        return "attempt"
    return "prompt" if size >= siblings else f"groups:{size}"


#: Siblings per parent where the default (``auto``) cannot size groups yet (``groups:2``).
DEFAULT_GROUP = 2
#: The default's step against kv routing alone's with more prompts than workers (8 workers, 16 x 4,
#: tight caches; docs/performance.md, "New parents, paced"): paced, and as it was unpaced.
CROWDED_STEPS = "0.55-0.75x"
CROWDED_UNPACED = "0.72-1.52x"
CROWDED_WIDE = "1.03-1.25x"  # ... and paced 40 ms apart, as a burst of fewer groups than workers is
#: ... pairs (8 workers, 16 x 2, and up to 1.33x a fair share on the busiest: 14 x 2, 12 x 2; 16
#: workers, 24 x 2): paced by the burst (40 ms apart), and the most 10 ms apart took (12 x 2;
#: docs/performance.md, "Pairs, paced by the burst").
PAIRS_STEPS = "0.72-0.98x"
PAIRS_CLOSE = "1.37x"
#: ... with up to a third more prompts than workers (8 workers, 10 prompts x 4): each prompt split
#: (3, 1) and paced by the burst; whole groups; the split paced 10 ms apart.
UNEVEN_STEPS = "0.80-0.90x"
UNEVEN_WHOLE = "0.83-1.28x"
UNEVEN_CLOSE = "1.34-1.66x"
#: ... the same step on caches that hold it (1,024 blocks a worker): the default's split, whole
#: groups, pairs, a session per attempt (docs/performance.md, "Caches that hold the step").
AMPLE_SPLIT = "1.02-1.12x"
AMPLE_WHOLE = "1.02-1.07x"
AMPLE_PAIRS = "0.99-1.06x"
AMPLE_ATTEMPT = "0.95-1.00x"
#: Pairs and triples crowded past what sharing saves on workers of 4,096 tokens, pinned as the
#: default groups them (6 pairs on 4 workers, 9 to 11 on 8, 12 triples on 8: their worse step), and
#: 12 pairs on 8 a session per attempt (docs/performance.md, "Pairs, paced by the burst"; 2 runs each).
UNSHARED_STEPS = "1.08-1.38x"
UNSHARED_ATTEMPT = "1.09-1.29x"
#: The rule ``doctor`` and docs/performance.md state for GRPO siblings (measured there).
SIBLINGS_RULE = (
    "key a GRPO step's siblings in groups sized so each worker gets about one group: "
    "K = ceil(siblings / max(1, workers // prompts)) siblings share one parent session "
    "(OTEL_SESSION_SIBLINGS=groups:K; K >= siblings is 'prompt', K = 1 'attempt'); with more prompts "
    "than workers, whole groups, unless they put 1.5x a fair share of siblings or more on the "
    "busiest worker (up to a third more prompts than workers), then the largest K that puts the "
    "fewest siblings there, a prompt's last siblings in a smaller group (10 prompts x 4 on 8 "
    "workers: groups:3); a session per attempt "
    "thrashes a worker whose KV cache holds fewer of the contexts it is given, and one "
    "group per prompt leaves workers idle when prompts are fewer than workers"
)


def prompts_outnumber(workers: int, prompts: int, siblings: int) -> bool:
    """Whether a step of siblings has more prompts than the fleet has workers (several groups share a
    worker)."""
    return siblings > 1 and prompts > workers


def prompts_split(workers: int, prompts: int, siblings: int) -> bool:
    """Whether the default splits each prompt of this step into a group and a smaller rest (up to a
    third more prompts than workers: whole groups would crowd a few workers)."""
    return (
        workers > 0
        and prompts_outnumber(workers, prompts, siblings)
        and _siblings.splits(workers, prompts, siblings)
    )


def siblings_note(workers: int | None, prompts: int, siblings: int) -> str:
    """The doctor's line for a batch shape: the rule, this fleet's setting when its size is known,
    and how the library's default (``auto``) reaches it."""
    if workers is None:
        return (
            "fleet size unknown (no /health instances): the default cannot size sibling groups to the "
            f"fleet and pairs them (groups:{DEFAULT_GROUP}); set OTEL_SESSION_SIBLINGS=groups:K by the "
            f"rule: {SIBLINGS_RULE}."
        )
    setting = siblings_setting(workers, prompts, siblings)
    verdict = (
        "the default (auto) keys them so from the workers /health lists and the step's shape, from "
        "the first step (its attempts wait a moment at their first request for the step to gather); "
        f"where /health cannot be read in time it pairs them (groups:{DEFAULT_GROUP}) and "
        "OTEL_SESSION_SIBLINGS=fleet sends that step without sessions instead (kv routing alone's "
        f"step); OTEL_SESSION_SIBLINGS={setting} fixes K from the start"
    )
    if prompts_outnumber(workers, prompts, siblings) and _siblings.unshared(
        workers, prompts, siblings, _siblings.group_size(workers, prompts, siblings)
    ):
        verdict += (
            f"; but {prompts} groups of {siblings} on {workers} workers put more siblings on the busiest "
            "worker than sharing a prompt saves, and no grouping spreads them evenly (pinned, 6 pairs on "
            f"4 workers, 9 to 11 on 8 and 12 triples on 8 took {UNSHARED_STEPS} kv routing alone's step; "
            f"12 pairs on 8 a session per attempt {UNSHARED_ATTEMPT}): set "
            "OTEL_SESSION_SIBLINGS=fleet, which sends "
            "such a step without sessions, or leave session affinity off"
        )
    elif prompts_split(workers, prompts, siblings):
        verdict += (
            f"; whole groups would crowd a few of the {workers} workers: each prompt's last "
            "siblings go in a smaller group, and the library sends each new group's first requests "
            "up to 40 ms after the last group's, so the router counts each group's siblings before it "
            f"places the next ({UNEVEN_STEPS} kv routing alone's step; whole groups were {UNEVEN_WHOLE}, "
            f"and these groups 10 ms apart {UNEVEN_CLOSE})"
        )
    elif prompts_outnumber(workers, prompts, siblings) and not _siblings.paced_close(
        workers, prompts, siblings
    ):
        verdict += (
            f"; {prompts} prompts on {workers} workers put several pairs on a worker: the library "
            "sends each new pair's first requests up to 40 ms after the last pair's, so a worker's two "
            f"pairs do not prefill their prompts together ({PAIRS_STEPS} kv routing alone's step with "
            f"12 to 16 prompts of 2 on 8 workers and 24 on 16; 10 ms apart, up to {PAIRS_CLOSE})"
        )
    elif prompts_outnumber(workers, prompts, siblings):
        verdict += (
            f"; {prompts} prompts on {workers} workers put several groups on a worker: the library "
            "sends each new group's first requests 10 ms after the last group's, so the router places "
            f"them one at a time, evenly ({CROWDED_STEPS} kv routing alone's step; 40 ms apart, as for "
            f"fewer groups than workers, the step was {CROWDED_WIDE}; sent all at once, "
            f"half the bursts measured were placed unevenly: {CROWDED_UNPACED})"
        )
    even = (
        "one group per worker is" if prompts <= workers else "the grouping that spreads them most evenly is"
    )
    return (
        f"{workers} workers, {prompts} prompts x {siblings} siblings: {even} {setting} "
        f"({verdict}); the rule: {SIBLINGS_RULE}."
    )


#: What the router can see (docs/performance.md, "At fleet scale"): ``kv`` routing on one frontend or on
#: replicas (each reads the workers' KV events), or ``unaware`` of the caches (round-robin, random).
LAYOUTS = ("kv", "unaware")

#: Step makespans measured against kv routing alone's (docs/performance.md, "At fleet scale"), the
#: figures the advice quotes: GRPO (32 workers, 16 prompts x 8, tight caches) and agentic.
STEP_OFF = "1.05x"  # kv, the default's headers, affinity off (GRPO; routing ignores the header)
STEP_DEFAULT_ON = "1.31x"  # kv + siblings paired (groups:2, auto's first step unsized), affinity on
STEP_GROUPED_ON = "0.60x"  # kv + one group per worker (auto from the second step, fleet), affinity on
STEP_FRONTENDS_ON = "1.7-2.4x"  # 3 frontends behind nginx, the default, affinity on (GRPO, 1 run)
STEP_FRONTENDS_SYNC = "0.72-0.84x"  # 3 frontends, kv alone, with --router-replica-sync (2 runs)
STEP_FRONTENDS_PACED = (
    "0.52-0.77x"  # 3 synced frontends, parent-hashed, the default by the burst (32-128 workers)
)
STEP_FRONTENDS_PACED_256 = "1.39-1.69x"  # the same on 256 workers (1 run: two groups on a worker)
STEP_FLEET_256 = "1.39x, then 0.91-0.99x"  # ``fleet`` there: one step pinned, then withheld (1 run)
STEP_RR = "1.51x"  # round-robin, no header (GRPO)
STEP_RR_ON = "0.89x round-robin alone's"  # round-robin + the default, affinity on, one frontend (GRPO)


def caches_hold(
    workers: int,
    trajectories: int,
    context_tokens: int,
    kv_tokens_per_worker: int,
    group: int = 1,
    shared_tokens: int = 0,
) -> bool:
    """Whether each worker's KV cache holds the contexts pinned to it at once: siblings pinned in
    groups of ``group`` land on one worker each and keep their shared prompt (``shared_tokens``)
    there once, so a worker given ``ceil(groups / workers)`` groups needs that many times
    ``shared_tokens + group x (context_tokens - shared_tokens)``. Where it holds, pinned turns find
    their cache and affinity shortened the step; where it does not, pinned contexts evict each other
    on crowded workers and kv routing alone was faster."""
    if workers <= 0 or trajectories <= 0:
        return True
    group = max(1, group)
    shared = min(max(0, shared_tokens), context_tokens) if group > 1 else 0
    groups = math.ceil(trajectories / group)
    need = math.ceil(groups / workers) * (shared + group * (context_tokens - shared))
    return need <= kv_tokens_per_worker


def step_advice(
    layout: str | None,
    holds: bool | None = None,
    setting: str | None = None,
    split: bool = False,
    outnumber: bool = False,
) -> str:
    """How to run the router for the shortest step, by what it can see (``LAYOUTS``; ``None``: not
    said), whether each worker's KV cache holds the group pinned to it (``holds``, from
    :func:`caches_hold` with the grouping ``setting`` doctor recommends, e.g. ``groups:4``; ``None``:
    unknown), whether the step has more prompts than workers (``outnumber``) and whether the default
    splits them (``split``, :func:`prompts_split`). otel-session sends the header either way; the
    frontend's affinity flag decides whether it pins. Pinning paid with siblings one group per worker
    in caches that hold it, and with more prompts than workers on tight caches (paced, placed
    evenly); a split step on caches that hold it was placed best by kv routing alone."""
    grouping = setting or "groups:K"
    plain_off = (
        "leave session affinity off (no --router-session-affinity-ttl-secs): without the flag Dynamo "
        "routes as if the header were absent, so the step is kv routing alone's (the default's headers "
        f"measured {STEP_OFF} of it, within run-to-run spread)"
    )
    off = (
        f"{plain_off}; with the flag, pinned siblings crowd workers whose caches cannot hold them "
        f"(affinity on with siblings paired: {STEP_DEFAULT_ON})"
    )
    keyed = (
        f"in groups sized to the fleet ({grouping} here), several to a worker, each new group's first "
        "requests paced, "
        if outnumber
        else f"one group per worker ({grouping} here), each worker's cache holds its group's shared "
        f"prompt and contexts, and the step measured {STEP_GROUPED_ON} kv routing alone's, "
    )
    on = (
        f"turn session affinity on (--router-session-affinity-ttl-secs 600): the default (auto) keys "
        f"siblings {keyed}"
        "from the first step (its attempts gather at their first request); where /health cannot be "
        f"read in time it pairs them ({STEP_DEFAULT_ON}), which OTEL_SESSION_SIBLINGS=fleet avoids by "
        f"sending that step without sessions (kv routing alone's step), and "
        f"OTEL_SESSION_SIBLINGS={grouping} by fixing K from the start; all this on "
        "one frontend: behind several, leave affinity off (each binds parents on its own: "
        f"{STEP_FRONTENDS_ON}) and run them with --router-replica-sync (kv alone's step "
        f"{STEP_FRONTENDS_SYNC} of theirs without it), or keep it on with --router-replica-sync and a "
        "balancer hashing X-Dynamo-Parent-Session-ID where a request carries one (else "
        "X-Dynamo-Session-ID), the default pacing a step's new parents up to 40 ms apart for the "
        f"frontends' shared load view to catch up (measured {STEP_FRONTENDS_PACED} kv routing alone's "
        f"on 32-128 workers, but {STEP_FRONTENDS_PACED_256} on 256, where a step's 256 new parents "
        "go 12 ms apart: past 128 workers, prefer kv routing alone with the sync, or "
        f"OTEL_SESSION_SIBLINGS=fleet, which stops pinning there after one such step ({STEP_FLEET_256}); "
        "do not set OTEL_SESSION_PACE_MS to 10 there)"
    )
    unaware = (
        "round-robin or random routing cannot see the caches: run --router-mode kv instead "
        f"(round-robin measured {STEP_RR} kv routing alone's step); if it must stay, turn session "
        f"affinity on and hash any balancer in front of several frontends on X-Dynamo-Session-ID "
        f"({STEP_RR_ON} on one frontend)"
    )
    tail = " (pass --kv-tokens and --context-tokens, with --prompts and --siblings, to have it checked)"
    crowded = (
        "each worker's KV cache holds its share, but the step has up to a third more prompts than "
        "workers, which no grouping of siblings spreads evenly: with caches that hold the step the "
        f"default's split measured {AMPLE_SPLIT} kv routing alone's step (whole groups {AMPLE_WHOLE}, "
        f"pairs {AMPLE_PAIRS}, a session per attempt {AMPLE_ATTEMPT}: kv routing finds each prompt's "
        "cache by itself there), so "
    )
    tight = (
        "each worker's KV cache cannot hold all the groups pinned to it, but with more prompts than "
        "workers the library sends each new group's first requests paced, so the router places the "
        f"groups evenly, and pinning paid there (8 workers of 4,096 tokens: {CROWDED_STEPS} kv routing "
        f"alone's step with 16 prompts x 4, {UNEVEN_STEPS} with 10 x 4): "
    )
    if holds is True and split:
        kv = f"with kv routing, {crowded}{plain_off}"
    elif holds is False and outnumber:
        kv = f"with kv routing, {tight}{on}"
    elif holds is True:
        kv = f"with kv routing, {on}"
    elif holds is False:
        kv = f"with kv routing, each worker's KV cache cannot hold the group pinned to it: {off}"
    elif outnumber:
        where = "on tight caches" if split else "on tight caches and on caches that hold the step"
        kv = f"with kv routing, {off}; with more prompts than workers pinning paid {where}: {on}{tail}"
    else:
        kv = f"with kv routing, {off}; affinity pays only where a worker's cache holds its group: {on}{tail}"
    if layout == "kv":
        return kv + "."
    if layout == "unaware":
        return unaware + "."
    return f"for the shortest GRPO step: {kv}; {unaware}."
