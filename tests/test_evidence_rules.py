"""``otel_session._evidence``'s rules one by one in the fast tier: which usage counts, which turn a
turn is compared with, what is judged, kept, counted and said. Called the way a client hook calls
them, with no server: the instruments are replaced by tests/test_metrics_rules.py's recorders. The
same path through real clients over loopback is tests/test_evidence.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

import otel_session
from otel_session import _evidence, _hop, _metrics, _verdicts
from tests.test_metrics_rules import Recording

ROUTER: _metrics.Router = ("dynamo", "127.0.0.1", 8000)
OTHER: _metrics.Router = ("dynamo", "127.0.0.1", 8001)
AT = ("http", "127.0.0.1", 8000)
NAMED = {"otel_session.router.profile": "dynamo", "server.address": "127.0.0.1", "server.port": 8000}
INSTRUMENTS = (
    "turns",
    "prompt_tokens",
    "cached_tokens",
    "worker_checks",
    "crowded_turns",
    "unpinned_sessions",
    "error_responses",
)


@pytest.fixture
def counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> Iterator[dict[str, Recording]]:
    """Every instrument ``_evidence`` counts into, as a recorder; nothing seen before or after."""
    _evidence.forget()
    caplog.set_level(logging.WARNING, "otel_session")
    made = {name: Recording() for name in INSTRUMENTS}
    for name, recording in made.items():
        monkeypatch.setattr(_metrics, name, recording)
    yield made
    _evidence.forget()


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "otel_session"]


def _answer(prompt: int, cached: int | None = None, worker: int | None = None, **more: Any) -> dict[str, Any]:
    """A parsed chat completion as the SDK hands it over: usage, and Dynamo's worker when asked."""
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": 1}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    data: dict[str, Any] = {"usage": usage, **more}
    if worker is not None:
        data["nvext"] = {"worker_id": {"decode_worker_id": worker}}
    return data


def test_a_prompt_count_is_taken_from_0_to_2_to_the_32_and_a_cached_count_up_to_the_prompt() -> None:
    def usage(prompt: Any, cached: Any = None) -> Any:
        details = {} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}
        return _evidence.usage_of({"usage": {"prompt_tokens": prompt, **details}})

    assert usage(0) == (0, None)
    assert usage(_evidence.MAX_TOKENS) == (2**32, None)
    assert usage(_evidence.MAX_TOKENS + 1) is None
    assert usage(-1) is None
    assert usage(True) is None and usage(False) is None
    assert usage(100, 100) == (100, 100)
    assert usage(100, 0) == (100, 0)
    assert usage(100, 101) == (100, None)
    assert usage(100, -1) == (100, None)


def test_a_router_is_known_only_under_a_configuration_that_routes_there() -> None:
    assert _evidence.router_for(*AT) is None  # not configured
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    assert _evidence.router_for(*AT) == ROUTER
    assert _evidence.router_for("http", "10.9.9.9", 8000) is None  # not a router
    assert _evidence.router_for("http", "", 8000) is None
    assert _evidence.router_for("http", None, 8000) is None


def test_what_is_no_mapping_is_no_turn_even_if_it_holds_the_words(counted: dict[str, Recording]) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    with otel_session.trajectory():
        for data in (None, "usage nvext", ["usage", "nvext"], 7):
            _evidence.parsed(data, *AT)
        _evidence.parsed({"model": "m", "choices": []}, *AT)  # a mapping, but neither usage nor nvext
    assert counted["turns"].added == [] and _evidence.routers == {} and _evidence._pending_worker == {}


def test_turns_are_compared_per_model_named_by_its_first_256_characters(
    counted: dict[str, Recording],
) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    long = "p" * 256
    with otel_session.trajectory():
        _evidence.parsed(_answer(1000, 0, worker=1, model="policy"), *AT)
        _evidence.parsed(_answer(50, 0, worker=2, model="judge"), *AT)  # another conversation
        _evidence.parsed(_answer(1100, 1000, worker=1, model="policy"), *AT)
        _evidence.parsed(_answer(60, 50, worker=2, model="judge"), *AT)
        _evidence.parsed(_answer(100, worker=3, model=long + "a"), *AT)
        _evidence.parsed(_answer(100, worker=3, model=long + "b"), *AT)  # the same 256: a later turn
        _evidence.parsed(_answer(100, worker=4), *AT)  # no model: its own conversation
        _evidence.parsed(_answer(100, worker=5, model=7), *AT)  # a model that is no text: none
    seen = _evidence.routers[ROUTER]
    assert (seen.pairs, seen.switched) == (4, 1)  # policy 1 -> 1, judge 2 -> 2, long 3 -> 3; none 4 -> 5
    assert [a[_metrics.TURN] for _, a in counted["turns"].added] == [
        "first", "first", "later", "later", "first", "later", "first", "later"
    ]  # fmt: skip


def test_a_response_counts_once_however_often_it_is_parsed_and_one_without_an_object_each_time(
    counted: dict[str, Recording],
) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])

    class Response:
        pass

    one, two = Response(), Response()
    with otel_session.trajectory():
        _evidence.parsed(_answer(100), *AT, response=one)
        _evidence.parsed(_answer(100), *AT, response=one)
        _evidence.parsed(_answer(200), *AT, response=two)
        _evidence.parsed(_answer(300), *AT)
        _evidence.parsed(_answer(300), *AT)
    assert len(counted["turns"].added) == 4


def test_a_turns_latency_reaches_the_fleet_with_its_session_and_worker(counted: dict[str, Recording]) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    with otel_session.trajectory() as attempt:
        _evidence.parsed(_answer(100, worker=3), *AT, latency=0.25)
    [(_, session, worker, latency)] = _evidence.routers[ROUTER].fleet.recent
    assert (session, worker, latency) == (attempt.session_id, 3, 0.25)


def test_a_streams_worker_waits_for_its_usage_and_is_dropped_once_the_usage_names_its_own(
    counted: dict[str, Recording],
) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    with otel_session.trajectory():
        _evidence.parsed({"nvext": {"worker_id": {"decode_worker_id": 5}}}, *AT)  # a chunk
        assert list(_evidence._pending_worker.values()) == [5]
        _evidence.parsed(_answer(100), *AT)  # the usage chunk: the turn was on worker 5
        assert _evidence._pending_worker == {}
        _evidence.parsed({"nvext": {"worker_id": {"decode_worker_id": 6}}}, *AT)
        _evidence.parsed(_answer(200, worker=7), *AT)  # names its own worker: the chunk's is stale
        assert _evidence._pending_worker == {}
        _evidence.parsed(_answer(300), *AT)  # no worker known: not 6
    seen = _evidence.routers[ROUTER]
    assert seen.fleet.workers == {5, 7} and (seen.pairs, seen.switched) == (1, 1)


def test_pending_workers_are_cleared_at_their_cap(
    counted: dict[str, Recording], monkeypatch: pytest.MonkeyPatch
) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    monkeypatch.setattr(_evidence, "SESSIONS_KEPT", 2)
    chunk = {"nvext": {"worker_id": {"decode_worker_id": 5}}}
    for model in ("a", "b"):
        with otel_session.trajectory():
            _evidence.parsed({**chunk, "model": model}, *AT)
    assert len(_evidence._pending_worker) == 2
    with otel_session.trajectory():
        _evidence.parsed({**chunk, "model": "c"}, *AT)
    assert [model for _, model in _evidence._pending_worker] == ["c"]


def test_a_turn_is_counted_with_its_router_and_whether_it_is_a_later_one(
    counted: dict[str, Recording],
) -> None:
    _evidence.turn("s", ROUTER, 500, 0, 1)
    _evidence.turn("s", ROUTER, 600, 480, 2)
    _evidence.turn("s", ROUTER, 700, None, None)
    assert counted["turns"].added == [
        (1, {**NAMED, _metrics.TURN: "first"}),
        (1, {**NAMED, _metrics.TURN: "later"}),
        (1, {**NAMED, _metrics.TURN: "later"}),
    ]
    # token counts only where the cached count is known, so the two sums stay comparable
    assert counted["prompt_tokens"].added == [
        (500, {**NAMED, _metrics.TURN: "first"}),
        (600, {**NAMED, _metrics.TURN: "later"}),
    ]
    assert counted["cached_tokens"].added == [
        (0, {**NAMED, _metrics.TURN: "first"}),
        (480, {**NAMED, _metrics.TURN: "later"}),
    ]
    assert counted["worker_checks"].added == [(1, {**NAMED, _metrics.SWITCHED: True})]
    # each turn with a worker, by whether that worker is crowded (none is); none without a worker
    assert counted["crowded_turns"].added == [(1, {**NAMED, _metrics.CROWDED: False})] * 2


def test_the_oldest_session_is_forgotten_at_the_cap(
    counted: dict[str, Recording], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_evidence, "SESSIONS_KEPT", 2)
    for session in ("a", "b", "a", "c"):  # "a" used again: "b" is the oldest when "c" comes
        _evidence.turn(session, ROUTER, 100, None, None)
    assert list(_evidence._turns) == [("a", None), ("c", None)]
    _evidence.turn("b", ROUTER, 100, None, None)
    assert counted["turns"].added[-1][1][_metrics.TURN] == "first"


@pytest.mark.parametrize(
    ("previous", "prompt", "cached", "judged", "missed"),
    [
        (32, 32, 0, 1, 0),  # the shortest history judged, sent again unchanged
        (31, 40, 0, 0, 0),  # too short to say anything
        (200, 199, 0, 0, 0),  # the history was not sent again: nothing to serve from cache
        (200, 300, 136, 1, 0),  # all but MISS_SLACK tokens cached: a hit
        (200, 300, 135, 1, 1),  # one more missing: a miss
        (200, 300, None, 0, 0),  # no cached count: not judged
    ],
)
def test_a_later_turn_is_judged_by_the_previous_prompt(
    counted: dict[str, Recording], previous: int, prompt: int, cached: int | None, judged: int, missed: int
) -> None:
    _evidence.turn("s", ROUTER, previous, 0, None)
    _evidence.turn("s", ROUTER, prompt, cached, None)
    seen = _evidence.routers[ROUTER]
    assert (seen.judged, seen.missed) == (judged, missed)
    assert len(seen.gaps) == judged


def test_a_pair_needs_both_workers_and_each_is_counted_once(counted: dict[str, Recording]) -> None:
    for worker in (1, None, 1, 1, 2):
        _evidence.turn("s", ROUTER, 10, None, worker)
    seen = _evidence.routers[ROUTER]
    assert (seen.pairs, seen.switched) == (2, 1)  # 1 -> 1, 1 -> 2; not across the unknown one


def test_each_judged_turn_keeps_its_pause_and_whether_it_went_wrong(counted: dict[str, Recording]) -> None:
    _evidence.turn("s", ROUTER, 10, None, None)
    _evidence.turn("s", ROUTER, 20, 0, None)  # neither judged by cache nor by worker: no gap
    assert _evidence.routers[ROUTER].gaps == []
    _evidence.turn("s", ROUTER, 30, None, 1)
    _evidence.turn("s", ROUTER, 40, None, 2)  # judged by worker alone: switched
    _evidence.turn("s", ROUTER, 40, None, 2)  # stayed
    gaps = _evidence.routers[ROUTER].gaps
    assert [bad for _, bad in gaps] == [True, False]
    assert all(0 <= pause < 5 for pause, _ in gaps)  # seconds since the previous turn ended


def test_the_gaps_kept_stop_at_their_cap(
    counted: dict[str, Recording], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_verdicts, "GAPS_KEPT", 2)
    for _ in range(4):
        _evidence.turn("s", ROUTER, 10, None, 1)
    seen = _evidence.routers[ROUTER]
    assert seen.pairs == 3 and len(seen.gaps) == 2


def test_a_turn_from_another_address_that_hit_is_crossed_not_crossed_and_missed(
    counted: dict[str, Recording],
) -> None:
    _evidence.turn("s", ROUTER, 200, 0, None)
    _evidence.turn("s", OTHER, 300, 200, None)  # moved, but served from cache
    _evidence.turn("t", ROUTER, 200, 0, None)
    _evidence.turn("t", ROUTER, 300, 0, None)  # stayed, and missed
    here, there = _evidence.routers[ROUTER], _evidence.routers[OTHER]
    assert (there.crossed, there.crossed_missed, there.missed) == (1, 0, 0)
    assert (here.crossed, here.crossed_missed, here.missed) == (0, 0, 1)


def _crowd() -> None:
    """12 sessions of 2 turns, each on one worker: 8 on worker 1 at 400 ms a turn, one on each of
    workers 2 to 5 at 100 ms; the crowded worker's sessions last in each round."""
    placed = [(f"other{w}", w, 0.1) for w in (2, 3, 4, 5)] + [(f"pinned{i}", 1, 0.4) for i in range(8)]
    for _ in range(2):
        for session, worker, latency in placed:
            _evidence.turn(session, ROUTER, 100, None, worker, latency)


@pytest.mark.parametrize(
    ("siblings", "fix"),
    [
        (None, "drop session affinity"),  # not configured: the default's fix
        ("groups:2", "drop session affinity"),
        ("prompt", "siblings='prompt' puts many siblings under one parent"),
        ("groups:3", "siblings='groups:3' puts many siblings under one parent"),
    ],
)
def test_pinned_sessions_crowding_a_slower_worker_are_named_once_with_the_fix_for_the_siblings_setting(
    counted: dict[str, Recording], caplog: pytest.LogCaptureFixture, siblings: str | None, fix: str
) -> None:
    if siblings is not None:
        otel_session.configure(dynamo_hosts=["127.0.0.1:8000"], siblings=siblings)
    _crowd()
    [said] = _said(caplog)
    assert said.startswith(
        "otel-session: pinning costs step time at dynamo router 127.0.0.1:8000: in the last 30 s, "
        "sessions pinned by affinity crowded worker(s) 1 (8 sessions) while turns there took 400 ms "
        "(median), 100 ms elsewhere; "
    )
    assert fix in said
    crowded = [a[_metrics.CROWDED] for _, a in counted["crowded_turns"].added]
    assert len(crowded) == 24 and crowded[-1] is True and crowded[0] is False
    assert _hop.crowded == {ROUTER}  # where ``fleet`` now withholds new attempts' sessions
    _crowd()
    assert len(_said(caplog)) == 1


def test_error_answers_are_counted_and_only_a_529_is_a_full_table(
    counted: dict[str, Recording], caplog: pytest.LogCaptureFixture
) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    _evidence.answered(ROUTER, "s", 503)
    _evidence.answered(ROUTER, "s", 429)
    assert _evidence.routers[ROUTER].summary()["error_answers"] == 2
    assert _said(caplog) == [] and counted["unpinned_sessions"].added == []
    _evidence.answered(ROUTER, "s", 529)
    summary = _evidence.routers[ROUTER].summary()
    assert (summary["error_answers"], summary["refused_full"]) == (3, 1)
    assert counted["unpinned_sessions"].added == [(1, NAMED)]  # not strict: the session goes unpinned
    [said] = _said(caplog)
    assert said.startswith(
        "otel-session: dynamo router 127.0.0.1:8000 answered 529 to a request of session s:"
    )


def test_a_status_is_an_error_answer_from_429_and_from_500_inside_a_trajectory_at_a_router(
    counted: dict[str, Recording],
) -> None:
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    with otel_session.trajectory():
        for status in (200, 404, 428, 430, 499):
            _evidence.answered_status(status, *AT)
        _evidence.answered_status(503, "http", "10.9.9.9", 8000)  # not a router
        assert _evidence.routers == {}
        for status in (429, 500):
            _evidence.answered_status(status, *AT)
    _evidence.answered_status(503, *AT)  # no session
    assert _evidence.routers[ROUTER].errors == 2
    assert [a["http.response.status_code"] for _, a in counted["error_responses"].added] == [429, 500]


def test_the_turns_of_a_session_unpinned_after_a_refusal_are_no_evidence(
    counted: dict[str, Recording],
) -> None:
    """A session the router refused and that goes unpinned since (``_hop.unpinned``) lands where the
    router alone places it: its turns say nothing of affinity and are not counted; another
    session's are."""
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    with otel_session.trajectory() as refused:
        assert _hop.unpin(refused.session_id)
        try:
            _evidence.parsed(_answer(1000, 0, worker=1), *AT)
            _evidence.parsed(_answer(1100, 0, worker=2), *AT)
        finally:
            _hop.unpinned.pop(refused.session_id, None)
    assert counted["turns"].added == [] and _evidence.routers == {}
    with otel_session.trajectory():
        _evidence.parsed(_answer(1000, 0, worker=1), *AT)
    assert len(counted["turns"].added) == 1
