"""Whether pinning costs step time at a router: a few workers crowded with pinned sessions while
others of the same router sit idle, and turns on the crowded ones slower.

A GRPO step ends with its slowest trajectory, and a pinned session cannot leave a crowded worker
(issue 33), so a faster mean turn can still be a longer step. From what ``_evidence`` already
reads (the worker Dynamo names when asked through ``nvext``, and each turn's latency where the
client measured one) this keeps, per router, the turns of the last ``WINDOW`` seconds and the
workers ever seen, and says which workers are crowded; not in a step's tail (the window holding
under half the most sessions it has held, that most halving every minute: a step of the same size
run slower later is judged), where the last groups on a few workers are no crowding.
Thresholds and their reasons: docs/tracing.md.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

WINDOW = 30.0  # seconds of turns judged together: a few turns of every trajectory of one step
WORKERS_KEPT = 4096
TURNS_KEPT = 4096
EVERY = 8  # turns between two looks (a look walks the window)
CROWDED_SESSIONS = 4  # a worker is crowded with at least this many sessions in the window ...
CROWD_RATIO = 2.0  # ... and this many times the sessions per worker seen (a fair share): two groups
# where the library sized one per worker
MIN_LATENCIES = 4  # turns with a latency on each side before latency may speak
SLOWER = 1.5  # turns on crowded workers this many times slower (median) than the others'
PEAK_HALF_LIFE = 60.0  # seconds for the most sessions a window held to count half (a tail is recent)


Seen = tuple[float, str, int, "float | None"]


@dataclass
class Look:
    """What one look at a router's window found."""

    crowded: dict[int, int]  # worker -> sessions in the window, for the crowded ones
    workers: int  # workers ever seen at this router
    idle: int  # of those, how many served no session in the window
    sessions: int  # sessions in the window
    slow: float | None  # median latency of turns on crowded workers, seconds (None: not measured)
    fast: float | None  # ... and on the others


@dataclass
class Fleet:
    """One router's workers, as its answers named them."""

    workers: set[int] = field(default_factory=set)
    # (when, session, worker, latency) of the turns of the last ``WINDOW`` seconds
    recent: deque[Seen] = field(default_factory=lambda: deque(maxlen=TURNS_KEPT))
    crowded: frozenset[int] = frozenset()
    since: int = 0
    peak: float = 0.0  # the most sessions a look has found in the window, halving every PEAK_HALF_LIFE
    peaked: float = 0.0  # when ``peak`` was last brought up to date

    def turn(self, session: str, worker: int, latency: float | None, now: float | None = None) -> Look | None:
        """One turn of ``session`` on ``worker``; every ``EVERY`` turns a look at the window (``None``
        between looks, and where nothing is crowded)."""
        now = time.monotonic() if now is None else now
        if len(self.workers) < WORKERS_KEPT:
            self.workers.add(worker)
        self.recent.append((now, session, worker, latency))
        self.since += 1
        if self.since < EVERY:
            return None
        self.since = 0
        return self.look(now)

    def look(self, now: float) -> Look | None:
        while self.recent and self.recent[0][0] < now - WINDOW:
            self.recent.popleft()
        per_worker: dict[int, set[str]] = {}
        for _, session, worker, _ in self.recent:
            per_worker.setdefault(worker, set()).add(session)
        sessions = len({session for _, session, _, _ in self.recent})
        self.peak *= 0.5 ** (max(0.0, now - self.peaked) / PEAK_HALF_LIFE)
        self.peak, self.peaked = max(self.peak, sessions), now
        if sessions * 2 < self.peak:  # a step's tail: its last groups on a few workers, the rest done
            self.crowded = frozenset()
            return None
        known = len(self.workers)
        share = sessions / known if known else 0.0
        crowded = {
            worker: len(held)
            for worker, held in per_worker.items()
            if len(held) >= CROWDED_SESSIONS and len(held) >= CROWD_RATIO * share
        }
        self.crowded = frozenset(crowded)
        if not crowded or known < 2:
            return None
        slow = [lat for _, _, worker, lat in self.recent if lat is not None and worker in crowded]
        fast = [lat for _, _, worker, lat in self.recent if lat is not None and worker not in crowded]
        return Look(
            crowded,
            known,
            known - len(per_worker),
            sessions,
            _median(slow) if len(slow) >= MIN_LATENCIES else None,
            _median(fast) if len(fast) >= MIN_LATENCIES else None,
        )


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]  # (``statistics`` costs its import in every process)


def costs_step_time(look: Look) -> bool:
    """Whether the look shows pinning costing step time: crowded workers while others idle (a
    worker seen that served nothing in the window, or turns elsewhere measurably faster)."""
    if look.slow is not None and look.fast is not None:
        return look.slow >= SLOWER * look.fast
    return look.idle > 0
