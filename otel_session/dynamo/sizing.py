"""Sizing Dynamo's session TTL against a run's trajectory rate: its affinity table is finite.

Dynamo 1.6.1 keeps at most 65,536 session bindings (compiled in; no flag or variable changes it).
A binding leaves only when its session has been idle for ``--router-session-affinity-ttl-secs``:
the stock router has no unbind, and a terminal ``X-Dynamo-Session-Final`` request does not free it.
So a run that starts N new trajectories per second holds about N x TTL bindings. Once the table is
full, every request of a *new* session is refused with HTTP 529 "Service temporarily overloaded"
(measured with ``benchmarks/capacity.py``, hard and soft mode alike; the binary also carries the
message "Affinity table full; routing without session affinity", which that run never logged), while
old sessions stay pinned and requests without a session header are served. ``doctor`` and the README
state this rule; these functions compute it.
"""

from __future__ import annotations

#: Dynamo 1.6.1's session affinity table.
TABLE_SIZE = 65_536
#: Plan for at most this share of the table: trajectory starts come in bursts (a GRPO step starts a
#: whole batch at once), and a TTL counts from a session's *last* request, not its first.
HEADROOM = 0.8


def bindings_held(trajectories_per_second: float, ttl_secs: float) -> float:
    """Bindings a steady run holds: each trajectory's stays ``ttl_secs`` after its last turn."""
    return max(0.0, trajectories_per_second) * max(0.0, ttl_secs)


def largest_ttl(trajectories_per_second: float, table_size: int = TABLE_SIZE) -> int:
    """The longest TTL (whole seconds, Dynamo's unit) that keeps the run within the headroom."""
    if trajectories_per_second <= 0:
        return 31_536_000  # Dynamo's own maximum: no rate, no limit from the table
    return max(1, int(table_size * HEADROOM / trajectories_per_second))


def sizing_note(trajectories_per_second: float | None = None, ttl_secs: int | None = None) -> list[str]:
    """The doctor's lines on the table: the rule, and a verdict when the rate and TTL are known."""
    lines = [
        f"Dynamo 1.6.1 keeps at most {TABLE_SIZE:,} session bindings; each leaves only after "
        "--router-session-affinity-ttl-secs idle, and once the table is full every request of a new "
        "session is refused with 529 Overloaded (Dynamo's message: 'Affinity table full').",
        "A run holds about (new trajectories per second) x TTL bindings: set the TTL a little above the "
        "longest pause inside one trajectory (tool call, reward, environment step) and at most "
        f"{int(TABLE_SIZE * HEADROOM):,} / (trajectories per second).",
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
