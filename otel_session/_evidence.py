"""Whether a router honours the session, judged from what the client already received.

A client hook hands over what the application itself parsed (a response body's JSON, a streamed
chunk) and the router's error answers; nothing here sends a request or reads a body. Per session and
router it keeps the previous turn (its prompt size, its worker, when it ended), so each later turn
says how much of the history the router served from cache and whether the worker changed. Counted
in ``_metrics``; when the evidence says affinity is not holding, one line per router per process
names the likely cause and the fix (``_verdict``). Thresholds and their reasons: docs/tracing.md,
"Metrics".
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.context import get_current

from otel_session import _faults, _metrics, _settings
from otel_session._context import session_ids
from otel_session._metrics import Router

SESSIONS_KEPT = 16_384  # (session, router) pairs remembered: more than any run keeps in flight
MIN_HISTORY = 32  # a previous prompt shorter than this (two KV blocks) says too little to judge
MISS_SLACK = 64  # a later turn "missed" when more than this many of the previous prompt's tokens were
# not served from cache: a hit loses less than one KV block (16 to 64 tokens in common engines)
MIN_JUDGED = 12  # later turns judged at a router before the cache evidence may speak
MISS_ALARM = 0.5  # ... and it speaks when at least this share of them missed
MIN_PAIRS = 8  # turn pairs with both workers known before the worker evidence may speak
SWITCH_ALARM = 0.4  # ... and it speaks when at least this share of them switched worker
MIN_PAUSE = 1.0  # seconds: Dynamo's shortest TTL; a shorter pause says nothing of one
OVERLOADED = 529  # Dynamo's answer to a new session when its affinity table is full


@dataclass
class _Turn:
    """A session's last turn: how many it had, where it went, how long its prompt was, when it ended."""

    turns: int = 0
    router: Router | None = None
    prompt: int | None = None
    worker: int | None = None
    ended: float = 0.0


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

    def summary(self) -> dict[str, Any]:
        """The figures a person reads (``otel-session`` prints them beside its verdict)."""
        return {
            "judged_turns": self.judged,
            "missed_turns": self.missed,
            "worker_pairs": self.pairs,
            "worker_switches": self.switched,
            "turns_from_another_address": self.crossed,
            "refused_529": self.refused,
            "error_answers": self.errors,
            "warnings": sorted(self.warned),
        }


_lock = threading.Lock()
_turns: OrderedDict[str, _Turn] = OrderedDict()  # by session: one conversation, wherever each turn went
_pending_worker: dict[str, int] = {}
routers: dict[Router, RouterEvidence] = {}
GAPS_KEPT = 512


def worker_of(data: Mapping[str, Any]) -> int | None:
    """Dynamo's decode (else prefill) worker id from a response's ``nvext.worker_id``, if it was asked for."""
    nvext = data.get("nvext")
    worker = nvext.get("worker_id") if isinstance(nvext, Mapping) else None
    if not isinstance(worker, Mapping):
        return None
    value = worker.get("decode_worker_id", worker.get("prefill_worker_id"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_of(data: Mapping[str, Any]) -> tuple[int, int | None] | None:
    """(prompt tokens, cached prompt tokens or ``None``) from an OpenAI-style ``usage``, if any."""
    usage = data.get("usage")
    if not isinstance(usage, Mapping):
        return None
    prompt = usage.get("prompt_tokens")
    if not isinstance(prompt, int) or isinstance(prompt, bool) or prompt < 0:
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if not isinstance(cached, int) or isinstance(cached, bool) or not 0 <= cached <= prompt:
        cached = None
    return prompt, cached


def router_for(scheme: str, host: str | None, port: int | None) -> Router | None:
    """The router a response from this origin came from, under the configuration in force."""
    settings = _settings.current
    if settings is None or not host:
        return None
    profile = settings.rules.route(scheme, host, port).profile
    return None if profile is None else _metrics.router_of(profile, host, port)


def parsed(data: object, scheme: str, host: str | None, port: int | None) -> None:
    """The application parsed ``data`` from a response it received from this origin: a turn of the
    current context's session if it carries usage (or, in a stream, a chunk naming the worker)."""
    if not isinstance(data, Mapping) or ("usage" not in data and "nvext" not in data):
        return
    session = session_ids(get_current())[0]
    if session is None:
        return
    router = router_for(scheme, host, port)
    if router is None:
        return
    worker = worker_of(data)
    usage = usage_of(data)
    if usage is None:
        if worker is not None:  # a stream's chunk: the turn is counted when its usage arrives
            with _lock:
                if len(_pending_worker) >= SESSIONS_KEPT:
                    _pending_worker.clear()
                _pending_worker[session] = worker
        return
    turn(session, router, usage[0], usage[1], worker)


def turn(session: str, router: Router, prompt: int, cached: int | None, worker: int | None) -> None:
    """One turn of ``session`` answered by ``router``: counted, compared with the previous one, judged."""
    now = time.monotonic()
    with _lock:
        key = session
        if worker is None:
            worker = _pending_worker.pop(key, None)
        else:
            _pending_worker.pop(key, None)
        last = _turns.pop(key, None) or _Turn()
        if len(_turns) >= SESSIONS_KEPT:
            _turns.popitem(last=False)
        _turns[key] = _Turn(last.turns + 1, router, prompt, worker, now)
        seen = routers.setdefault(router, RouterEvidence())
        later = last.turns > 0
        crossed = later and last.router is not None and last.router != router and last.router[0] == router[0]
        seen.crossed += crossed
        missed: bool | None = None
        switched = None
        history = last.prompt if later and cached is not None and last.prompt is not None else 0
        if history >= MIN_HISTORY and prompt >= history:  # the history was sent again: cacheable
            missed = cached is not None and cached + MISS_SLACK < history
            seen.judged += 1
            seen.missed += missed
            seen.crossed_missed += missed and crossed
        if later and worker is not None and last.worker is not None:
            switched = worker != last.worker
            seen.pairs += 1
            seen.switched += switched
        if (missed is not None or switched is not None) and len(seen.gaps) < GAPS_KEPT:
            seen.gaps.append((now - last.ended, bool(missed or switched)))
        message = _verdict(router, seen)
    attributes = {**_metrics.router_attributes(router), _metrics.TURN: "later" if later else "first"}
    _metrics.turns.add(1, attributes)
    if cached is not None:
        _metrics.prompt_tokens.add(prompt, attributes)
        _metrics.cached_tokens.add(cached, attributes)
    if switched is not None:
        _metrics.worker_checks.add(1, {**_metrics.router_attributes(router), _metrics.SWITCHED: switched})
    if message is not None:
        _faults.warn("%s", message)


def answered(router: Router, session: str, status: int) -> None:
    """``router`` answered a request of ``session`` with an error ``status`` (429 or 5xx)."""
    _metrics.answered_error(router, session, status)
    with _lock:
        seen = routers.setdefault(router, RouterEvidence())
        seen.errors += 1
        if status != OVERLOADED:
            return
        seen.refused += 1
        if "table-full" in seen.warned:
            return
        seen.warned.add("table-full")
    _faults.warn(
        "otel-session: %s router %s answered 529 to a request of session %s: its session-affinity table "
        "is full, so every new session is refused until bindings idle out (Dynamo keeps at most 65,536, "
        "each until it has been idle for --router-session-affinity-ttl-secs). Bindings ~= new "
        "trajectories per second x TTL: set the TTL a little above the longest pause inside a trajectory "
        'and at most 52,428 / (new trajectories per second); see docs/integrations.md, "Capacity". '
        "Logged once per router per process.",
        router[0],
        _origin(router),
        session,
    )


def answered_status(status: int, scheme: str, host: str | None, port: int | None) -> None:
    """A client hook saw ``status`` from this origin for a request sent from the current context:
    an error answer to a request carrying a session is recorded (anything else costs nothing)."""
    if status != 429 and status < 500:
        return
    session = session_ids(get_current())[0]
    router = router_for(scheme, host, port) if session is not None else None
    if session is not None and router is not None:
        answered(router, session, status)


def _origin(router: Router) -> str:
    return router[1] if router[2] is None else f"{router[1]}:{router[2]}"


def _verdict(router: Router, seen: RouterEvidence) -> str | None:
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
        f"otel-session: session affinity is not holding at {router[0]} router {_origin(router)}: "
        f"{'; '.join(found)}. {_cause(router, seen)} Logged once per router per process."
    )


def _cause(router: Router, seen: RouterEvidence) -> str:
    """The likeliest cause, from when the misses happened, and its fix."""
    pause = _pause_that_breaks(seen.gaps)
    if pause is not None:
        return (
            f"Turns after a pause of {pause:.1f} s or more went wrong, sooner ones did not: the router "
            f"forgets a session after an idle TTL shorter than the pauses inside a trajectory; for "
            f"Dynamo raise --router-session-affinity-ttl-secs a little above the longest tool or "
            f'environment pause (within docs/integrations.md, "Capacity").'
        )
    if seen.crossed_missed * 2 >= seen.missed and seen.crossed * 2 >= seen.judged:
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


def _pause_that_breaks(gaps: list[tuple[float, bool]]) -> float | None:
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


def summaries() -> dict[str, dict[str, Any]]:
    """Every router's evidence so far, keyed by ``profile host:port``."""
    with _lock:
        return {f"{r[0]} {_origin(r)}": seen.summary() for r, seen in routers.items()}


def forget() -> None:
    """Drop everything seen (a new configuration, a test, a forked child)."""
    with _lock:
        _turns.clear()
        _pending_worker.clear()
        routers.clear()
    _metrics.failed.clear()
