"""Whether a router honours the session, judged from what the client already received.

A client hook hands over what the application itself parsed (a response body's JSON, a streamed
chunk) and the router's error answers; nothing here sends a request or reads a body. Per session and
router it keeps the previous turn (its prompt size, its worker, when it ended), so each later turn
says how much of the history the router served from cache and whether the worker changed. Counted
in ``_metrics``; when the evidence says affinity is not holding, one line per router per process
names the likely cause and the fix (``_verdicts``). Thresholds and their reasons: docs/tracing.md,
"Metrics".
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import get_current

from otel_session import _faults, _hop, _metrics, _settings, _verdicts
from otel_session._context import session_ids
from otel_session._metrics import Router

SESSIONS_KEPT = 16_384  # sessions remembered: more than any run keeps in flight
MIN_HISTORY = 32  # a previous prompt shorter than this (two KV blocks) says too little to judge
OVERLOADED = 529  # Dynamo's answer to a new session when its affinity table is full
# No prompt is this long: a larger count is garbage, and counted it would stay in the cumulative sums,
# failing every later export of the application's metrics (OTLP sends int64; Prometheus, floats).
MAX_TOKENS = 2**32


@dataclass
class _Turn:
    """A session's last turn: how many it had, where it went, how long its prompt was, when it ended."""

    turns: int = 0
    router: Router | None = None
    prompt: int | None = None
    worker: int | None = None
    ended: float = 0.0


_lock = threading.Lock()
# By session and model: one conversation with one model, wherever each turn went (an agent's session
# may also ask a judge model through the same router: its turns are not the policy's next ones).
_turns: OrderedDict[tuple[str, str | None], _Turn] = OrderedDict()
_pending_worker: dict[tuple[str, str | None], int] = {}
# Responses whose turn is counted: a stream carrying usage in every chunk (vLLM's continuous usage
# stats) or a body the application reads twice is one turn, not one per chunk or read.
_counted: weakref.WeakSet[object] = weakref.WeakSet()
routers: dict[Router, _verdicts.RouterEvidence] = {}


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
    if not isinstance(prompt, int) or isinstance(prompt, bool) or not 0 <= prompt <= MAX_TOKENS:
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
    try:
        profile = settings.rules.route(scheme, host, port).profile
    except Exception:  # reported once where the request was planned (the same rules): not twice
        return None
    return None if profile is None else _metrics.router_of(profile, host, port)


def parsed(
    data: object,
    scheme: str,
    host: str | None,
    port: int | None,
    latency: float | None = None,
    response: object = None,
) -> None:
    """The application parsed ``data`` from a response it received from this origin: a turn of the
    current context's session if it carries usage (or, in a stream, a chunk naming the worker);
    ``latency``: seconds from sending the request to its whole answer, where the client measured it;
    ``response``: the client's response object, whose first usage alone is its turn."""
    if not isinstance(data, Mapping) or ("usage" not in data and "nvext" not in data):
        return
    ctx = get_current()
    session = session_ids(ctx)[0]
    if session is None or not _hop.sends_session(ctx, session):
        return
    router = router_for(scheme, host, port)
    if router is None:
        return
    worker = worker_of(data)
    usage = usage_of(data)
    model = data.get("model")
    key = (session, model[:256] if isinstance(model, str) else None)  # a copy: not a garbage name kept
    if usage is None:
        if worker is not None:  # a stream's chunk: the turn is counted when its usage arrives
            with _lock:
                if len(_pending_worker) >= SESSIONS_KEPT:
                    _pending_worker.clear()
                _pending_worker[key] = worker
        return
    if response is not None:
        with _lock:
            if response in _counted:
                return
            _counted.add(response)
    turn(session, router, usage[0], usage[1], worker, latency, key[1])


def turn(
    session: str,
    router: Router,
    prompt: int,
    cached: int | None,
    worker: int | None,
    latency: float | None = None,
    model: str | None = None,
) -> None:
    """One turn of ``session`` with ``model`` answered by ``router``: counted, compared with the
    session's previous turn with that model, judged."""
    now = time.monotonic()
    with _lock:
        key = (session, model)
        if worker is None:
            worker = _pending_worker.pop(key, None)
        else:
            _pending_worker.pop(key, None)
        last = _turns.pop(key, None) or _Turn()
        if len(_turns) >= SESSIONS_KEPT:
            _turns.popitem(last=False)
        _turns[key] = _Turn(last.turns + 1, router, prompt, worker, now)
        seen = routers.setdefault(router, _verdicts.RouterEvidence())
        later = last.turns > 0
        crossed = later and last.router is not None and last.router != router and last.router[0] == router[0]
        seen.crossed += crossed
        missed: bool | None = None
        switched = None
        history = last.prompt if later and cached is not None and last.prompt is not None else 0
        if history >= MIN_HISTORY and prompt >= history:  # the history was sent again: cacheable
            missed = cached is not None and cached + _verdicts.MISS_SLACK < history
            seen.judged += 1
            seen.missed += missed
            seen.crossed_missed += missed and crossed
        if later and worker is not None and last.worker is not None:
            switched = worker != last.worker
            seen.pairs += 1
            seen.switched += switched
        if (missed is not None or switched is not None) and len(seen.gaps) < _verdicts.GAPS_KEPT:
            seen.gaps.append((now - last.ended, bool(missed or switched)))
        message = _verdicts.verdict(router, seen)
        crowded = None
        if worker is not None:
            look = seen.fleet.turn(session, worker, latency, now)
            if look is not None and _verdicts.pinning_crowds(seen, look):
                _hop.pinning_crowds(router)  # ``fleet`` withholds new attempts' sessions there
                if message is None:
                    message = _verdicts.crowding(router, seen, look, _siblings_policy())
            crowded = worker in seen.fleet.crowded
    attributes = {**_metrics.router_attributes(router), _metrics.TURN: "later" if later else "first"}
    _metrics.count(_metrics.turns, 1, attributes)
    if cached is not None:
        _metrics.count(_metrics.prompt_tokens, prompt, attributes)
        _metrics.count(_metrics.cached_tokens, cached, attributes)
    if switched is not None:
        checked = {**_metrics.router_attributes(router), _metrics.SWITCHED: switched}
        _metrics.count(_metrics.worker_checks, 1, checked)
    if crowded is not None:
        crowding = {**_metrics.router_attributes(router), _metrics.CROWDED: crowded}
        _metrics.count(_metrics.crowded_turns, 1, crowding)
    if message is not None:
        _faults.warn("%s", message)


def _siblings_policy() -> str:
    settings = _settings.current
    return str(settings.siblings) if settings is not None else "groups:2"


def answered(router: Router, session: str, status: int) -> None:
    """``router`` answered a request of ``session`` with an error ``status`` (429 or 5xx). A 529
    (no room for a new session) unpins the session for the rest of its attempt, unless strict: the
    client's own retries then go where a request without otel-session would have gone."""
    _metrics.answered_error(router, session, status)
    with _lock:
        seen = routers.setdefault(router, _verdicts.RouterEvidence())
        seen.errors += 1
        if status != OVERLOADED:
            return
        seen.refused += 1
    settings = _settings.current
    strict = settings is None or settings.strict_affinity
    if not strict and _hop.unpin(session):
        _metrics.count(_metrics.unpinned_sessions, 1, _metrics.router_attributes(router))
    with _lock:
        if "table-full" in seen.warned:
            return
        seen.warned.add("table-full")
    _faults.warn("%s", _verdicts.table_full(router, session, strict))


def answered_status(status: int, scheme: str, host: str | None, port: int | None) -> None:
    """A client hook saw ``status`` from this origin for a request sent from the current context:
    an error answer to a request carrying a session is recorded (anything else costs nothing)."""
    if status != 429 and status < 500:
        return
    session = session_ids(get_current())[0]
    router = router_for(scheme, host, port) if session is not None else None
    if session is not None and router is not None:
        answered(router, session, status)


def summaries() -> dict[str, dict[str, Any]]:
    """Every router's evidence so far, keyed by ``profile host:port``."""
    with _lock:
        return {f"{r[0]} {_verdicts.origin(r)}": seen.summary() for r, seen in routers.items()}


def forget() -> None:
    """Drop everything seen (a new configuration, a test, a forked child)."""
    with _lock:
        _turns.clear()
        _pending_worker.clear()
        _counted.clear()
        routers.clear()
    _metrics.failed.clear()
    _hop.unpinned.clear()
    _hop.forget_crowding()
