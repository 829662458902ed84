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
"""

from __future__ import annotations

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
