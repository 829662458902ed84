"""The affinity table at GRPO step rates: whole steps of bindings, counted at each step's start."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from otel_session.dynamo import LocalDynamo, sizing
from otel_session.dynamo.doctor import diagnose
from otel_session.dynamo.sizing import (
    BUDGET,
    LAYOUTS,
    SIBLINGS_RULE,
    caches_hold,
    largest_step_ttl,
    sibling_group_size,
    siblings_note,
    siblings_setting,
    step_advice,
    step_bindings,
    step_note,
    step_rule,
)


def test_a_step_holds_its_own_bindings_and_those_of_steps_still_inside_the_ttl() -> None:
    assert step_bindings(1000, 60, 0) == 1000  # a burst: the whole step at once
    assert step_bindings(1000, 60, 60) == 1000  # the previous step's bindings just expired
    assert step_bindings(1000, 60, 61) == 2000
    assert step_bindings(1000, 60, 300, trajectory_secs=30) == 6000  # 330 s of steps, 60 s apart
    assert step_bindings(0, 60, 300) == 0 and step_bindings(5, 0, 300) == 5


@pytest.mark.parametrize(
    ("per_step", "step_secs", "run_secs"),
    [(8192, 60, 30), (1024, 20, 5), (128, 3, 2), (52_428, 100, 10), (7, 0.5, 0.2)],
)
def test_the_largest_ttl_fits_and_one_second_more_does_not(
    per_step: int, step_secs: float, run_secs: float
) -> None:
    ttl = largest_step_ttl(per_step, step_secs, run_secs)
    assert ttl is not None
    assert step_bindings(per_step, step_secs, ttl, run_secs) <= BUDGET
    assert step_bindings(per_step, step_secs, ttl + 1, run_secs) > BUDGET


def test_a_step_bigger_than_the_budget_has_no_ttl_and_says_what_happens() -> None:
    assert largest_step_ttl(BUDGET + 1, 60) is None
    assert largest_step_ttl(BUDGET, 10, trajectory_secs=10) is None  # not even 1 s left
    note = step_note(60_000, 60)
    assert "no TTL fits" in note and "529" in note
    assert step_note(8192, 60, 600, 30).endswith("(too many: lower the TTL to 330 s or less).")
    assert step_note(8192, 60, 300, 30).endswith("(fits).")
    assert step_note(1024, 20) == "GRPO steps of 1,024 trajectories every 20 s: a TTL of at most 1020 s."


@pytest.mark.parametrize(
    ("workers", "prompts", "siblings", "setting"),
    [
        (32, 16, 8, "groups:4"),  # 2 groups per prompt fill 32 workers
        (64, 8, 16, "groups:2"),
        (8, 16, 8, "prompt"),  # more prompts than workers: one group per prompt
        (8, 10, 4, "groups:3"),  # ... unless the workers do not divide them evenly
        (8, 5, 8, "prompt"),  # fewer prompts than workers: one group each, some workers idle
        (8, 4, 8, "groups:4"),
        (128, 16, 8, "attempt"),  # 8 workers per prompt: every sibling its own
        (32, 32, 1, "attempt"),
        (1024, 512, 16, "groups:8"),
    ],
)
def test_siblings_setting(workers: int, prompts: int, siblings: int, setting: str) -> None:
    assert siblings_setting(workers, prompts, siblings) == setting
    size = sibling_group_size(workers, prompts, siblings)
    groups = prompts * -(-siblings // size)
    assert groups >= min(workers, prompts * siblings) or size == siblings  # the groups fill the fleet


def test_the_siblings_note_names_the_setting_and_the_rule() -> None:
    assert siblings_note(64, 8, 16).startswith(
        "64 workers, 8 prompts x 16 siblings: one group per worker is groups:2 (the default (auto) keys"
    )
    idle = siblings_note(32, 4, 8)  # 8 workers per prompt: each sibling alone
    assert "one group per worker is attempt" in idle and "OTEL_SESSION_SIBLINGS=attempt fixes K" in idle
    note = siblings_note(32, 16, 8)
    assert "from the first step (its attempts wait a moment" in note and "cannot be read in time" in note
    assert "OTEL_SESSION_SIBLINGS=fleet" in idle
    assert "pairs them (groups:2)" in siblings_note(None, 8, 16)
    paced = "sends each new group's first requests 10 ms after the last group's"
    assert paced in siblings_note(8, 16, 4) and "16 prompts on 8 workers" in siblings_note(8, 16, 4)
    uneven = siblings_note(8, 10, 4)
    assert "would crowd a few" in uneven and "up to 40 ms after the last group's" in uneven
    whole = siblings_note(8, 16, 4) + siblings_note(8, 5, 8) + siblings_note(8, 12, 4)
    assert paced not in uneven and "would crowd a few" not in whole
    assert uneven.startswith(
        "8 workers, 10 prompts x 4 siblings: the grouping that spreads them most evenly is groups:3"
    )
    assert "(0.55-0.75x kv routing alone's step; 40 ms apart" in siblings_note(8, 16, 4)
    assert paced not in siblings_note(8, 8, 4) + siblings_note(8, 16, 1) + siblings_note(32, 16, 8)
    assert SIBLINGS_RULE in siblings_note(64, 8, 16) and SIBLINGS_RULE in siblings_note(None, 8, 16)
    pairs = siblings_note(8, 10, 2)  # 10 pairs on 8 workers: the busiest 4 against a fair 2.5
    assert "put more siblings on the busiest worker than sharing a prompt saves" in pairs
    assert "set OTEL_SESSION_SIBLINGS=fleet, which sends such a step without sessions" in pairs
    assert paced not in pairs and "sharing a prompt saves" not in whole + siblings_note(8, 16, 2)
    even_pairs = siblings_note(8, 16, 2)  # pairs keep the burst's spacing, not 10 ms
    assert "sends each new pair's first requests up to 40 ms after the last pair's" in even_pairs
    assert "(0.72-0.98x kv routing alone's step with 12 to 16 prompts of 2 on 8 workers" in even_pairs
    assert paced not in even_pairs and "new pair's" not in pairs + whole + siblings_note(4, 8, 3)
    crowded_pairs = siblings_note(8, 12, 2) + siblings_note(16, 24, 2)  # 1.33x: pinned, 40 ms apart
    assert "sharing a prompt saves" not in crowded_pairs and crowded_pairs.count("new pair's") == 2
    assert "sharing a prompt saves" in siblings_note(4, 6, 2)  # 1.33x on 4 workers: withheld
    split_pairs = siblings_note(8, 10, 3)  # split into a pair and one: still crowded past a fair share
    assert "sharing a prompt saves" in split_pairs and "would crowd a few" not in split_pairs


@pytest.mark.slow
def test_doctor_reads_the_fleet_size_and_recommends(local_dynamo_factory: Callable[..., LocalDynamo]) -> None:
    stack = local_dynamo_factory(
        workers=8, workers_per_process=8, router_mode="round-robin", affinity_ttl_secs=60
    )
    assert len(set(stack.worker_ids)) == 8  # one process, eight workers, each its own instance
    report = diagnose(stack.base_url, requests=3, batch=(2, 8))
    line = next(c for c in report.checks if c.name == "sibling keying")
    assert line.detail.startswith("8 workers, 2 prompts x 8 siblings: one group per worker is groups:2 (")
    assert "the bindings of 3,276 steps fit" in next(
        c.detail for c in report.checks if c.name == "session table per step"
    )
    assert report.ok
    # 10 prompts x 4 on these 8 workers, caches that hold the step: the split, and affinity left off
    split = diagnose(stack.base_url, requests=3, batch=(10, 4), layout="kv", caches=(16_384, 2_700))
    step = next(c.detail for c in split.checks if c.name == "step time")
    assert step == step_advice("kv", True, "groups:3", True, True) and "leave session affinity off" in step
    tight = diagnose(stack.base_url, requests=3, batch=(10, 4), layout="kv", caches=(4_096, 2_300))
    step = next(c.detail for c in tight.checks if c.name == "step time")
    assert step == step_advice("kv", False, "groups:3", True, True) and "turn session affinity on" in step


def test_the_step_rule_counts_whole_steps() -> None:
    assert "the bindings of 6 steps fit" in step_rule(8192) and "within 6 step intervals" in step_rule(8192)
    assert "no TTL fits" in step_rule(BUDGET + 1) and "529" in step_rule(BUDGET + 1)
    assert "the bindings of 1 step fit" in step_rule(BUDGET) and "1 step interval " in step_rule(BUDGET)


def test_step_advice_follows_what_the_router_can_see() -> None:
    kv, unaware, both = step_advice("kv"), step_advice("unaware"), step_advice(None)
    assert kv.startswith("with kv routing, leave session affinity off (no --router-session-affinity-ttl")
    assert "turn session affinity on" in kv.split("affinity pays only where")[1]  # on, only with grouping
    assert "--router-mode kv" in unaware and "X-Dynamo-Session-ID" in unaware and "1.51x" in unaware
    assert kv.rstrip(".") in both and unaware.rstrip(".") in both
    assert set(LAYOUTS) == {"kv", "unaware"}


def test_caches_hold_counts_each_workers_share_of_the_step() -> None:
    # the measured cell: 128 trajectories (16 prompts x 8) on 32 workers of 256 blocks (4,096 tokens),
    # turns re-reading up to 2.5k tokens of which the siblings share 2,170
    assert not caches_hold(32, 128, 2_500, 256 * 16)  # a session each: 4 x 2,500 > 4,096
    assert caches_hold(32, 128, 2_500, 1024 * 16)  # 10,000 <= 16,384: ample
    assert caches_hold(32, 128, 4_096, 4 * 4_096) and not caches_hold(32, 129, 4_096, 4 * 4_096)
    assert caches_hold(0, 128, 2_500, 1) and caches_hold(32, 0, 2_500, 1)  # nothing to place
    # doctor's groups:4, one group per worker: 2,170 + 4 x 330 = 3,490 <= 4,096 (measured 0.72x kv's step)
    assert caches_hold(32, 128, 2_500, 256 * 16, group=4, shared_tokens=2_170)
    # groups:2 (auto's first step), two groups per worker: 2 x (2,170 + 2 x 330) > 4,096 (measured 1.31x)
    assert not caches_hold(32, 128, 2_500, 256 * 16, group=2, shared_tokens=2_170)
    assert not caches_hold(32, 128, 2_500, 256 * 16, group=4)  # nothing shared: 4 x 2,500 again
    # agentic (8 workers of an H100's KV for Llama-3.1-8B scaled to 8 trajectories a worker, 107,520
    # tokens): one group of 8 siblings per worker re-reading up to 33k, sharing 3k: does not hold
    assert not caches_hold(8, 64, 33_000, 6_720 * 16, group=8, shared_tokens=3_000)


def test_step_advice_turns_affinity_on_only_with_groups_the_caches_hold() -> None:
    for layout in ("kv", None):
        tight, ample = step_advice(layout, False), step_advice(layout, True, "groups:4")
        tight = tight.split("round-robin or random")[0]  # the kv part; the other layout's follows
        assert "leave session affinity off" in tight and "turn session affinity on" not in tight
        assert "1.31x" in tight and "1.05x" in tight
        on = "turn session affinity on (--router-session-affinity-ttl-secs 600): the default (auto)"
        assert on in ample
        assert "from the first step (its attempts gather at their first request)" in ample
        assert "OTEL_SESSION_SIBLINGS=groups:4" in ample and "0.60x" in ample and "=fleet" in ample
        # behind several frontends: affinity off, or on with the sync, a parent hash and the default's pace
        assert "--router-replica-sync and a balancer hashing X-Dynamo-Parent-Session-ID" in ample
        assert "up to 40 ms apart" in ample and "0.52-0.77x kv routing alone's on 32-128 workers" in ample
        assert "but 1.39-1.69x on 256" in ample and "prefer kv routing alone with the sync" in ample
        assert (
            "OTEL_SESSION_SIBLINGS=fleet, which stops pinning there after one such step (1.39x, then" in ample
        )
        assert "leave session affinity off" not in ample and "--kv-tokens" not in tight + ample
        assert "--kv-tokens" in step_advice(layout)  # unknown: how to have it checked
    assert step_advice("unaware", True) == step_advice("unaware", False)  # switch to kv routing first


def test_step_advice_leaves_affinity_off_for_a_split_step_on_caches_that_hold_it() -> None:
    """10 prompts x 4 on 8 workers of 1,024 blocks: the default's split measured 1.02-1.12x kv routing
    alone's step, a session per attempt 0.95-1.00x: doctor must not turn affinity on there; on tight
    caches, or with one group per worker, its advice is as before."""
    assert sizing.prompts_split(8, 10, 4) and not sizing.prompts_split(8, 12, 4)
    assert not sizing.prompts_split(8, 8, 4) and not sizing.prompts_split(8, 10, 1)
    assert not sizing.prompts_split(0, 10, 4)
    split = step_advice("kv", True, "groups:3", True)
    assert "turn session affinity on" not in split and "leave session affinity off" in split
    assert "up to a third more prompts than workers" in split
    assert "1.02-1.12x" in split and "0.95-1.00x" in split
    assert step_advice("kv", True, "groups:3") != split  # no split: on, as before
    assert "turn session affinity on" in step_advice("kv", True, "groups:3")
    assert step_advice("kv", False, "groups:3", True) == step_advice("kv", False, "groups:3")
    assert step_advice("kv", None, "groups:3", True) == step_advice("kv", None, "groups:3")
    # on tight caches, more prompts than workers: pinning paid (paced, placed evenly), so on
    tight = step_advice("kv", False, "groups:3", True, True)
    assert "turn session affinity on" in tight and "leave session affinity off" not in tight
    assert "0.55-0.75x" in tight and "0.80-0.90x" in tight and "cannot hold all the groups" in tight
    assert "several to a worker" in tight and "one group per worker" not in tight and "0.60x" not in tight
    assert step_advice("kv", False, "groups:4", False, True) == tight.replace("groups:3", "groups:4")
    assert step_advice("kv", True, "groups:3", True, True) == split  # caches that hold it: off
    unknown = step_advice("kv", None, "groups:3", True, True)  # caches not told: off, and when on pays
    assert "leave session affinity off" in unknown and "several to a worker" in unknown
    assert "with more prompts than workers pinning paid on tight caches:" in unknown
    assert "caches that hold the step" in step_advice("kv", None, "groups:4", False, True)
    assert "1.31x" not in split  # the crowding it names is of caches that cannot hold the groups


def test_doctors_summary_claims_no_pinning_the_advice_may_turn_off() -> None:
    """Found from outside: "leave session affinity off" was followed by "Sessions are pinned:
    otel-session is fully effective here."; the summary now says what every passing check means."""
    import io

    from otel_session.dynamo.doctor import Check, Report

    report = Report(
        "http://127.0.0.1:8000/v1", [Check("step time", True, step_advice("kv", True, "groups:3", True))]
    )
    out = io.StringIO()
    report.render(out)
    assert "leave session affinity off" in out.getvalue() and "Sessions are pinned" not in out.getvalue()
    assert out.getvalue().endswith("step time line says whether the router should pin it.\n")
    failed = Report("u", [Check("header sent", False, "no header", "fix it")])
    out = io.StringIO()
    failed.render(out)
    assert out.getvalue().endswith("Sessions are NOT pinned yet; apply the fix above and run doctor again.\n")
