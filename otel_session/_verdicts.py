"""What the affinity evidence means, in words: when it is enough to speak, the likeliest cause, the fix.

``_evidence`` gathers the figures per router (``RouterEvidence``) and asks ``verdict`` after each
turn; the thresholds are here, each with the reason for its value (docs/tracing.md, "Metrics").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from otel_session import _crowding
from otel_session._metrics import Router

MISS_SLACK = 64  # a later turn "missed" when more than this many of the previous prompt's tokens were
# not served from cache: a hit loses less than one KV block (16 to 64 tokens in common engines)
MIN_JUDGED = 12  # later turns judged at a router before the cache evidence may speak
MISS_ALARM = 0.5  # ... and it speaks when at least this share of them missed
MIN_PAIRS = 8  # turn pairs with both workers known before the worker evidence may speak
SWITCH_ALARM = 0.4  # ... and it speaks when at least this share of them switched worker
MIN_PAUSE = 1.0  # seconds: Dynamo's shortest TTL; a shorter pause says nothing of one
GAPS_KEPT = 512


@dataclass
class RouterEvidence:
    """What one router's answers showed in this process."""

    judged: int = 0  # later turns whose previous prompt was long enough to judge the cache by
    missed: int = 0
    pairs: int = 0  # later turns with this and the previous turn's worker known
    switched: int = 0
    crossed: int = 0  # later turns whose previous turn went to another address of the same profile
    crossed_missed: int = 0
    refused: int = 0  # 529 answers to requests carrying a session
    errors: int = 0
    # (pause before it, whether it missed or switched) for each later turn judged by cache or worker
    gaps: list[tuple[float, bool]] = field(default_factory=list)
    warned: set[str] = field(default_factory=set)
    fleet: _crowding.Fleet = field(default_factory=_crowding.Fleet)  # its workers, for crowding

    def summary(self) -> dict[str, Any]:
        """The figures a person reads (``otel-session`` prints them beside its verdict)."""
        return {
            "judged_turns": self.judged,
            "missed_turns": self.missed,
            "worker_pairs": self.pairs,
            "worker_switches": self.switched,
            "turns_from_another_address": self.crossed,
            "refused_full": self.refused,
            "error_answers": self.errors,
            "workers_seen": len(self.fleet.workers),
            "crowded_workers": sorted(self.fleet.crowded),
            "warnings": sorted(self.warned),
        }


def origin(router: Router) -> str:
    return router[1] if router[2] is None else f"{router[1]}:{router[2]}"


def verdict(router: Router, seen: RouterEvidence) -> str | None:
    """The one line saying affinity is not holding at ``router``, the first time the evidence says so
    (called under ``_lock``); ``None`` otherwise."""
    if "affinity" in seen.warned:
        return None
    cache_broken = seen.judged >= MIN_JUDGED and seen.missed >= MISS_ALARM * seen.judged
    workers_broken = seen.pairs >= MIN_PAIRS and seen.switched >= SWITCH_ALARM * seen.pairs
    pinned = seen.pairs >= MIN_PAIRS and not workers_broken
    if not workers_broken and not (cache_broken and not pinned):
        return None  # the same worker serving every turn: misses there are evictions, not routing
    seen.warned.add("affinity")
    found = []
    if cache_broken:
        found.append(
            f"{seen.missed} of {seen.judged} later turns of sessions were served with less than "
            f"the previous turn's prompt cached (all but {MISS_SLACK} tokens)"
        )
    if workers_broken:
        found.append(f"{seen.switched} of {seen.pairs} later turns moved to another worker")
    return (
        f"otel-session: session affinity is not holding at {router[0]} router {origin(router)}: "
        f"{'; '.join(found)}. {cause(router, seen)} Logged once per router per process."
    )


def pinning_crowds(seen: RouterEvidence, look: _crowding.Look) -> bool:
    """Whether ``look`` shows pinning costing step time: crowded workers while others idle (or turns
    elsewhere measurably faster), and sessions staying on their workers (else nothing is pinned)."""
    if not _crowding.costs_step_time(look):
        return False
    return seen.pairs >= MIN_PAIRS and seen.switched < SWITCH_ALARM * seen.pairs


def crowding(router: Router, seen: RouterEvidence, look: _crowding.Look, siblings: str) -> str | None:
    """The one line saying pinning costs step time at ``router``: sessions held by affinity crowd a
    few workers while others idle, the first time a look shows it (called under ``_lock``); ``None``
    otherwise, and always while affinity is not holding (then nothing is pinned)."""
    if "crowded" in seen.warned or not pinning_crowds(seen, look):
        return None
    seen.warned.add("crowded")
    workers = ", ".join(f"{worker} ({held} sessions)" for worker, held in sorted(look.crowded.items())[:4])
    idle = f"{look.idle} of the {look.workers} workers seen served none" if look.idle else ""
    if look.slow is not None and look.fast is not None:
        timing = f"turns there took {look.slow * 1000:.0f} ms (median), {look.fast * 1000:.0f} ms elsewhere"
        idle = f"{idle}; {timing}" if idle else timing
    if siblings == "prompt" or (siblings.startswith("groups:") and int(siblings[7:]) > 2):
        fix = (
            f"siblings={siblings!r} puts many siblings under one parent, which the router binds to one "
            "worker: use configure(siblings='groups:2') (OTEL_SESSION_SIBLINGS), or "
            "'attempt'"
        )
    else:
        fix = (
            "OTEL_SESSION_SIBLINGS=fleet sends new attempts here without their session once this is "
            "seen; or drop session affinity (start the frontend without "
            "--router-session-affinity-ttl-secs: kv routing sees every worker's cache), which is what "
            "several frontends behind one balancer need (each binds parents on its own)"
        )
        if siblings == "fleet":
            fix = "fleet now sends new attempts here without their session (the next line)"
    return (
        f"otel-session: pinning costs step time at {router[0]} router {origin(router)}: in the last "
        f"{_crowding.WINDOW:.0f} s, sessions pinned by affinity crowded worker(s) {workers} while "
        f"{idle or 'others had few'}; a GRPO step waits for its slowest trajectory. Fix: {fix}. "
        "Logged once per router per process."
    )


def cause(router: Router, seen: RouterEvidence) -> str:
    """The likeliest cause, from when the misses happened, and its fix."""
    pause = pause_that_breaks(seen.gaps)
    if pause is not None:
        return (
            f"Turns after a pause of {pause:.1f} s or more went wrong, sooner ones did not: the router "
            f"forgets a session after an idle TTL shorter than the pauses inside a trajectory; for "
            f"Dynamo raise --router-session-affinity-ttl-secs a little above the longest tool or "
            f'environment pause (within docs/integrations.md, "Capacity").'
        )
    later = max(seen.judged, seen.pairs)  # later turns judged by cache or by worker
    if seen.crossed and seen.crossed * 2 >= later and seen.crossed_missed * 2 >= seen.missed:
        return (
            "Most of the sessions' turns alternated between addresses of this router kind (several "
            "frontends or replicas behind alternate base URLs), which keep their session tables apart: "
            "send every turn of a session to one of them (one base URL per trajectory, an ingress hash "
            "on the session header, or replicas that share their bindings)."
        )
    if router[0] == "dynamo":
        return (
            "Likely causes: the frontend runs without --router-session-affinity-ttl-secs (Dynamo "
            "ignores X-Dynamo-Session-ID without it: start it with the flag, or "
            "DYN_ROUTER_SESSION_AFFINITY_TTL_SECS); a TTL shorter than the pauses between turns (raise "
            "it); or several frontends behind one address, each pinning sessions on its own (send "
            "every request of a base URL to one frontend: an ingress hash on X-Dynamo-Session-ID, or "
            "one frontend per trainer). `otel-session doctor URL` checks a deployment on demand."
        )
    return (
        f"Likely causes: the router does not key on the header the {router[0]} profile sends (check "
        f"the router's session-affinity setting, or configure the profile it reads), its affinity "
        f"forgets sessions sooner than the pauses between turns, or several router replicas share "
        f"one address without sharing their session table (put an ingress hash on the session header)."
    )


def pause_that_breaks(gaps: list[tuple[float, bool]]) -> float | None:
    """The pause (at least ``MIN_PAUSE`` s) after which turns go wrong, where at least 5 turns after
    shorter pauses, at most half as long, all went right and at least 40 % of the later ones did not;
    ``None`` where the turns went wrong whatever the pause."""
    ordered = sorted(gaps)
    for split in range(5, len(ordered) - 4):
        short, long = ordered[:split], ordered[split:]
        if any(bad for _, bad in short) or long[0][0] < MIN_PAUSE or long[0][0] < 2 * short[-1][0]:
            continue
        if sum(bad for _, bad in long) >= SWITCH_ALARM * len(long):
            return long[0][0]
    return None


def table_full(router: Router, session: str, strict: bool = False) -> str:
    """The one line for a 529: the table is full, what becomes of the session, and the rule that
    sizes the table (its figures are in docs/integrations.md, "Capacity", and ``otel-session doctor``)."""
    then = (
        "OTEL_SESSION_STRICT_AFFINITY keeps such sessions pinned, so their retries get the same answer"
        if strict
        else "such a session's retries and later turns go without the pin, served like requests without "
        "otel-session (counted in otel_session.unpinned_sessions; OTEL_SESSION_STRICT_AFFINITY=true "
        "keeps the error instead)"
    )
    return (
        f"otel-session: {router[0]} router {origin(router)} answered 529 to a request of session {session}: "
        "its session-affinity table is full, so every new session is refused until bindings idle out "
        "(Dynamo keeps a fixed number, each until it has been idle for --router-session-affinity-ttl-secs); "
        f"{then}. "
        "Bindings ~= new trajectories per second x TTL, kept under 65,536: set the TTL a little above the "
        "longest pause "
        'inside a trajectory and within the table\'s budget; see docs/integrations.md, "Capacity", or '
        "`otel-session doctor`. Logged once per router per process."
    )
