"""``otel_session._verdicts``: when the affinity evidence speaks, at each threshold's edge, and the
exact lines it says (the user reads them, so every word is behaviour). Pure functions of the figures
``_evidence`` gathers; the same lines reached through real clients are in tests/test_evidence.py."""

from __future__ import annotations

import pytest

from otel_session import _crowding, _verdicts
from otel_session._metrics import Router

DYNAMO: Router = ("dynamo", "127.0.0.1", 8000)
VLLM: Router = ("vllm-router", "r.internal", None)
ONCE = " Logged once per router per process."
DYNAMO_CAUSE = (
    "Likely causes: the frontend runs without --router-session-affinity-ttl-secs (Dynamo ignores "
    "X-Dynamo-Session-ID without it: start it with the flag, or DYN_ROUTER_SESSION_AFFINITY_TTL_SECS); "
    "a TTL shorter than the pauses between turns (raise it); or several frontends behind one address, "
    "each pinning sessions on its own (send every request of a base URL to one frontend: an ingress "
    "hash on X-Dynamo-Session-ID, or one frontend per trainer). `otel-session doctor URL` checks a "
    "deployment on demand."
)
OTHER_CAUSE = (
    "Likely causes: the router does not key on the header the vllm-router profile sends (check the "
    "router's session-affinity setting, or configure the profile it reads), its affinity forgets "
    "sessions sooner than the pauses between turns, or several router replicas share one address "
    "without sharing their session table (put an ingress hash on the session header)."
)
ALTERNATED = (
    "Most of the sessions' turns alternated between addresses of this router kind (several frontends "
    "or replicas behind alternate base URLs), which keep their session tables apart: send every turn "
    "of a session to one of them (one base URL per trajectory, an ingress hash on the session header, "
    "or replicas that share their bindings)."
)
TTL_CAUSE = (
    "Turns after a pause of 2.0 s or more went wrong, sooner ones did not: the router forgets a "
    "session after an idle TTL shorter than the pauses inside a trajectory; for Dynamo raise "
    "--router-session-affinity-ttl-secs a little above the longest tool or environment pause (within "
    'docs/integrations.md, "Capacity").'
)
SIBLINGS_FIX = (
    "siblings='groups:3' puts many siblings under one parent, which the router binds to one worker: "
    "use configure(siblings='groups:2') (OTEL_SESSION_SIBLINGS), or 'attempt'"
)
AFFINITY_FIX = (
    "OTEL_SESSION_SIBLINGS=fleet sends new attempts here without their session once this is seen; or "
    "drop session affinity (start the frontend without --router-session-affinity-ttl-secs: kv routing "
    "sees every worker's cache), which is what several frontends behind one balancer need (each binds "
    "parents on its own)"
)
FLEET_FIX = "fleet now sends new attempts here without their session (the next line)"


def _evidence(**figures: int) -> _verdicts.RouterEvidence:
    return _verdicts.RouterEvidence(**figures)  # type: ignore[arg-type]


def test_the_summary_names_every_figure() -> None:
    seen = _evidence(judged=1, missed=2, pairs=3, switched=4, crossed=5, refused=6, errors=7)
    seen.fleet.workers.update({10, 11, 12})
    seen.fleet.crowded = frozenset({12, 10})
    seen.warned.update({"crowded", "affinity"})
    assert seen.summary() == {
        "judged_turns": 1,
        "missed_turns": 2,
        "worker_pairs": 3,
        "worker_switches": 4,
        "turns_from_another_address": 5,
        "refused_full": 6,
        "error_answers": 7,
        "workers_seen": 3,
        "crowded_workers": [10, 12],
        "warnings": ["affinity", "crowded"],
    }


def test_an_origin_is_its_host_with_the_port_where_one_was_dialled() -> None:
    assert _verdicts.origin(DYNAMO) == "127.0.0.1:8000"
    assert _verdicts.origin(VLLM) == "r.internal"


def test_both_findings_are_said_in_one_line_with_the_cause_for_dynamo() -> None:
    seen = _evidence(judged=12, missed=12, pairs=10, switched=10)
    assert _verdicts.verdict(DYNAMO, seen) == (
        "otel-session: session affinity is not holding at dynamo router 127.0.0.1:8000: 12 of 12 later "
        "turns of sessions were served with less than the previous turn's prompt cached (all but 64 "
        f"tokens); 10 of 10 later turns moved to another worker. {DYNAMO_CAUSE}{ONCE}"
    )
    assert _verdicts.verdict(DYNAMO, seen) is None  # said once
    assert seen.warned == {"affinity"}


def test_misses_alone_at_another_router_name_its_header() -> None:
    assert _verdicts.verdict(VLLM, _evidence(judged=12, missed=6)) == (
        "otel-session: session affinity is not holding at vllm-router router r.internal: 6 of 12 later "
        "turns of sessions were served with less than the previous turn's prompt cached (all but 64 "
        f"tokens). {OTHER_CAUSE}{ONCE}"
    )


@pytest.mark.parametrize(
    ("figures", "speaks"),
    [
        ({"judged": 12, "missed": 6}, True),  # half of the fewest judged turns missed
        ({"judged": 12, "missed": 5}, False),
        ({"judged": 11, "missed": 11}, False),  # too few judged
        ({"pairs": 8, "switched": 4}, True),  # the fewest pairs, at least 40 % switched
        ({"pairs": 10, "switched": 4}, True),  # exactly 40 %
        ({"pairs": 10, "switched": 3}, False),
        ({"pairs": 10, "switched": 1}, False),
        ({"pairs": 7, "switched": 7}, False),  # too few pairs
        # misses where every turn stayed on its worker are evictions there, not routing
        ({"judged": 12, "missed": 12, "pairs": 8, "switched": 0}, False),
        ({"judged": 12, "missed": 12, "pairs": 7, "switched": 0}, True),  # too few pairs to say so
    ],
)
def test_the_affinity_verdict_speaks_from_each_thresholds_edge(figures: dict[str, int], speaks: bool) -> None:
    assert (_verdicts.verdict(DYNAMO, _evidence(**figures)) is not None) is speaks


@pytest.mark.parametrize(
    ("figures", "alternated"),
    [
        ({"judged": 10, "missed": 10, "crossed": 5, "crossed_missed": 5}, True),  # half, each way
        ({"judged": 10, "missed": 10, "crossed": 4, "crossed_missed": 5}, False),
        ({"judged": 10, "missed": 10, "crossed": 5, "crossed_missed": 4}, False),
        ({"pairs": 10, "crossed": 5}, True),  # later turns judged by worker count too
        ({}, False),  # nothing crossed: nothing alternated
    ],
)
def test_alternating_addresses_are_the_cause_when_half_the_turns_and_half_the_misses_crossed(
    figures: dict[str, int], alternated: bool
) -> None:
    assert _verdicts.cause(DYNAMO, _evidence(**figures)) == (ALTERNATED if alternated else DYNAMO_CAUSE)


def test_a_pause_that_breaks_affinity_is_the_cause_before_any_other() -> None:
    seen = _evidence(judged=10, missed=10, crossed=10, crossed_missed=10)
    seen.gaps = [(0.1, False)] * 5 + [(2.0, True)] * 5
    assert _verdicts.cause(DYNAMO, seen) == TTL_CAUSE


@pytest.mark.parametrize(
    ("gaps", "pause"),
    [
        ([(0.1, False)] * 5 + [(2.0, True)] * 5, 2.0),  # the fewest turns on each side
        ([(0.1, False)] * 5 + [(2.0, True), (3.0, True)] + [(4.0, True)] * 3, 2.0),  # the first long one
        ([(0.1, False)] * 5 + [(1.0, True)] * 5, 1.0),  # MIN_PAUSE itself is a pause
        ([(0.5, False)] * 5 + [(1.0, True)] * 5, 1.0),  # exactly twice the longest good one
        ([(0.6, False)] * 5 + [(1.1, True)] + [(1.3, True)] * 4, None),  # less than twice
        ([(0.4, False)] * 5 + [(1.5, False)] + [(2.0, True)] * 4, 1.5),  # its own turn went right
        ([(0.1, False)] * 4 + [(0.6, False), (1.0, True)] + [(2.0, True)] * 4, None),  # after 0.6 s
        ([(0.1, False)] * 5 + [(0.5, True)] + [(2.0, True)] * 4, None),  # went wrong below MIN_PAUSE
        ([(0.1, False)] * 5 + [(2.0, True)] * 2 + [(2.0, False)] * 3, 2.0),  # 40 % of the long ones
        ([(0.1, False)] * 5 + [(2.0, True)] + [(2.0, False)] * 4, None),  # 20 %
        ([(1.0, False)] * 2 + [(3.0, True)] * 8, None),  # fewer than 5 right before
        ([(0.1, False)] * 6 + [(2.0, True)] * 2, None),  # fewer than 5 after
        ([(0.1, False)] * 10, None),  # nothing went wrong
        ([], None),
    ],
)
def test_the_pause_that_breaks_needs_5_right_before_it_at_most_half_as_long_and_40_percent_wrong_after(
    gaps: list[tuple[float, bool]], pause: float | None
) -> None:
    assert _verdicts.pause_that_breaks(gaps) == pause


def test_a_full_table_is_explained_strict_or_not() -> None:
    rule = (
        "Bindings ~= new trajectories per second x TTL, kept under 65,536: set the TTL a little above the "
        "longest pause inside a trajectory and within the table's budget; see docs/integrations.md, "
        '"Capacity", or `otel-session doctor`.'
    )
    full = (
        "its session-affinity table is full, so every new session is refused until bindings idle out "
        "(Dynamo keeps a fixed number, each until it has been idle for "
        "--router-session-affinity-ttl-secs); "
    )
    assert _verdicts.table_full(DYNAMO, "s1", True) == (
        f"otel-session: dynamo router 127.0.0.1:8000 answered 529 to a request of session s1: {full}"
        "OTEL_SESSION_STRICT_AFFINITY keeps such sessions pinned, so their retries get the same answer. "
        f"{rule}{ONCE}"
    )
    assert _verdicts.table_full(VLLM, "s1") == (
        f"otel-session: vllm-router router r.internal answered 529 to a request of session s1: {full}"
        "such a session's retries and later turns go without the pin, served like requests without "
        "otel-session (counted in otel_session.unpinned_sessions; OTEL_SESSION_STRICT_AFFINITY=true keeps "
        f"the error instead). {rule}{ONCE}"
    )


def _look(crowded: dict[int, int], idle: int, slow: float | None, fast: float | None) -> _crowding.Look:
    return _crowding.Look(crowded, workers=12, idle=idle, sessions=40, slow=slow, fast=fast)


def _crowding_line(router: Router, workers: str, found: str, fix: str) -> str:
    return (
        f"otel-session: pinning costs step time at {router[0]} router {_verdicts.origin(router)}: in the "
        f"last 30 s, sessions pinned by affinity crowded worker(s) {workers} while {found}; a GRPO step "
        f"waits for its slowest trajectory. Fix: {fix}.{ONCE}"
    )


def test_crowding_names_the_first_4_crowded_workers_the_idle_ones_and_the_timing() -> None:
    look = _look({5: 5, 1: 9, 2: 8, 3: 7, 4: 6}, idle=2, slow=3.0, fast=1.0)
    seen = _evidence(pairs=8)
    assert _verdicts.crowding(DYNAMO, seen, look, "groups:3") == _crowding_line(
        DYNAMO,
        "1 (9 sessions), 2 (8 sessions), 3 (7 sessions), 4 (6 sessions)",
        "2 of the 12 workers seen served none; turns there took 3000 ms (median), 1000 ms elsewhere",
        SIBLINGS_FIX,
    )
    assert _verdicts.crowding(DYNAMO, seen, look, "groups:3") is None  # said once
    assert seen.warned == {"crowded"}


@pytest.mark.parametrize(
    ("idle", "slow", "fast", "found"),
    [
        (2, None, None, "2 of the 12 workers seen served none"),
        (1, 0.4, None, "1 of the 12 workers seen served none"),  # one side timed: no timing
        (0, 0.4, 0.1, "turns there took 400 ms (median), 100 ms elsewhere"),
    ],
)
def test_crowding_says_what_it_saw(idle: int, slow: float | None, fast: float | None, found: str) -> None:
    look = _look({1: 9}, idle, slow, fast)
    assert _verdicts.crowding(VLLM, _evidence(pairs=8), look, "attempt") == _crowding_line(
        VLLM, "1 (9 sessions)", found, AFFINITY_FIX
    )


@pytest.mark.parametrize(
    ("siblings", "fix"),
    [
        ("groups:3", SIBLINGS_FIX),
        ("prompt", SIBLINGS_FIX.replace("'groups:3'", "'prompt'", 1)),
        ("groups:2", AFFINITY_FIX),
        ("attempt", AFFINITY_FIX),
        ("auto", AFFINITY_FIX),
        ("fleet", FLEET_FIX),
    ],
)
def test_the_crowding_fix_follows_the_siblings_setting(siblings: str, fix: str) -> None:
    look = _look({1: 9}, 2, None, None)
    said = _verdicts.crowding(DYNAMO, _evidence(pairs=8), look, siblings)
    assert said is not None and said.endswith(f" Fix: {fix}.{ONCE}")


@pytest.mark.parametrize(
    ("pairs", "switched", "speaks"),
    [(8, 0, True), (7, 0, False), (10, 3, True), (10, 4, False), (10, 1, True)],
)
def test_crowding_is_pinnings_only_while_sessions_stay_on_their_workers(
    pairs: int, switched: int, speaks: bool
) -> None:
    look = _look({1: 9}, 2, None, None)
    said = _verdicts.crowding(DYNAMO, _evidence(pairs=pairs, switched=switched), look, "attempt")
    assert (said is not None) is speaks


def test_crowding_without_a_cost_is_silent() -> None:
    look = _look({1: 9}, 0, 0.2, 0.2)  # none idle, no slower
    assert _verdicts.crowding(DYNAMO, _evidence(pairs=8), look, "attempt") is None
