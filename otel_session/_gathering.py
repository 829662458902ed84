"""A process's first step, gathered before its sibling groups are sized.

``auto`` (the default) and ``fleet`` size sibling groups to the fleet from the shape of a step: how
many groups are open at once and how many siblings each has. Before any step has ended the only
shape is the one opening now, and a GRPO step opens it all at once: its trajectories are started
together (``asyncio.gather`` of one coroutine per attempt), so each reaches its first request to the
router before the next has even begun. An async client's first request of an attempt there counts
the attempt in its group and yields to the event loop: the step's other attempts reach theirs and
count themselves too, and the router's fleet size (``_fleet``) is read meanwhile. The wait ends
once a pass of the loop adds no attempt and the size is known, or after ``WAIT`` seconds; then K
is chosen from the step open now. Only async clients wait (a thread cannot yield to its siblings),
only until the first group ends, and a request that waits here only ever waits, never fails.
"""

from __future__ import annotations

import asyncio
import time

from otel_session import _faults, _fleet, _hop, _prompts, _siblings

WAIT = 0.5  # seconds at most a first step's first requests wait for the step and the fleet's size
SETTLE = 0.005  # seconds between looks: a step's attempts arriving over the network count too


def gathers(offered: _hop.Offered, destination: _hop.Destination) -> bool:
    """Whether this request, its attempt's first to a router, waits for its step to gather: under a
    sized policy, before any step has ended, to a router that takes a parent, in an asyncio task."""
    holder = offered.undecided
    if holder is None or not holder.policy.sized or _siblings.step_seen() or not destination[1]:
        return False
    profile = offered.plan(*destination).route.profile
    if profile is None or profile.parent_header is None:
        return False
    try:
        return asyncio.current_task() is not None
    except RuntimeError:  # no asyncio loop running here (trio, or a loop of another kind)
        return False


async def gather(
    offered: _hop.Offered, body: bytes | bytearray | None, destination: _hop.Destination
) -> None:
    """Count the attempt in its group (its prompt's, or its ``group=``), then wait for its step's
    other attempts and the router's fleet size; the request is decided and sent after."""
    holder = offered.undecided
    if holder is None:
        return
    try:
        holder.enter(_prompts.key_of(body))
        if holder.key is None:
            return  # no group (a body with no prompt, a key that cannot be hashed): nothing to size
        scheme, host, port = destination
        origin = (scheme, host or "", port)
        end = time.monotonic() + WAIT
        seen = -1
        await asyncio.sleep(0)  # the step's other attempts, started with this one, reach their first request
        while True:
            now = _siblings.joined()
            known = _fleet.size_at(origin, holder.policy.withholds) is not None
            if (now == seen and known) or time.monotonic() >= end:
                return
            seen = now
            await asyncio.sleep(SETTLE)
    except Exception as exc:  # a bug of ours: the request goes on, decided as without waiting
        _faults.report("gathering a first step's attempts", exc)
