"""What ``otel_session._metrics`` counts and under which attributes, rule by rule, in the fast tier,
with the instruments replaced by recorders (the export through a real ``MeterProvider`` is in
``tests/test_evidence.py``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from otel_session import _faults, _metrics, _settings


class Recording:
    """An instrument that keeps every ``add`` (or raises, to stand for a broken vendor bridge)."""

    def __init__(self, fails: bool = False) -> None:
        self.added: list[tuple[int, dict[str, Any]]] = []
        self.fails = fails

    def add(self, amount: int, attributes: dict[str, Any]) -> None:
        if self.fails:
            raise RuntimeError("the bridge is down")
        self.added.append((amount, dict(attributes)))


def test_a_router_is_named_by_profile_address_and_port_when_it_has_one() -> None:
    assert _metrics.router_attributes(("dynamo", "10.0.0.1", 8000)) == {
        "otel_session.router.profile": "dynamo",
        "server.address": "10.0.0.1",
        "server.port": 8000,
    }
    assert _metrics.router_attributes(("vllm-router", "h", None)) == {
        "otel_session.router.profile": "vllm-router",
        "server.address": "h",
    }


def test_request_attributes_are_made_once_per_key_and_the_cache_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_metrics, "_attributes", {})
    first = _metrics._request_attributes("dynamo", ("http", "h", 80), True, False)
    assert first == {
        "otel_session.router.profile": "dynamo",
        "server.address": "h",
        "server.port": 80,
        "otel_session.session": True,
        "otel_session.retry": False,
    }
    assert _metrics._request_attributes("dynamo", ("http", "h", 80), True, False) is first
    assert _metrics._request_attributes("dynamo", ("http", None, 80), False, True)["server.address"] == ""
    for port in range(1024 - 2):
        _metrics._request_attributes("dynamo", ("http", "h", 10_000 + port), True, False)
    assert len(_metrics._attributes) == 1024
    _metrics._request_attributes("dynamo", ("http", "h", 9), True, False)
    assert len(_metrics._attributes) == 1  # cleared at 1,024, then the new one


def test_a_raising_instrument_costs_the_count_and_one_report(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_faults, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _metrics.count(Recording(fails=True), 1, {})
        _metrics.count(Recording(fails=True), 1, {})
    said = [r for r in caplog.records if r.name == "otel_session"]
    assert len(said) == 1 and said[0].exc_info is not None
    assert (
        said[0].getMessage().startswith("otel-session: counting otel-session's metrics failed (RuntimeError)")
    )
    fine = Recording()
    _metrics.count(fine, 3, {"a": 1})
    assert fine.added == [(3, {"a": 1})]


def test_an_error_answer_is_counted_and_the_sessions_next_request_is_a_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    errors = Recording()
    monkeypatch.setattr(_metrics, "error_responses", errors)
    monkeypatch.setattr(_metrics, "failed", set())
    _metrics.answered_error(("dynamo", "h", 80), "s1", 529)
    assert errors.added == [
        (
            1,
            {
                "otel_session.router.profile": "dynamo",
                "server.address": "h",
                "server.port": 80,
                "http.response.status_code": 529,
            },
        )
    ]
    assert _metrics.failed == {("s1", ("dynamo", "h", 80))}


def test_the_failed_sessions_kept_are_cleared_at_their_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_metrics, "error_responses", Recording())
    monkeypatch.setattr(_metrics, "failed", set())
    monkeypatch.setattr(_metrics, "FAILED_KEPT", 3)
    for index in range(3):
        _metrics.answered_error(("dynamo", "h", 80), f"s{index}", 503)
    assert len(_metrics.failed) == 3
    _metrics.answered_error(("dynamo", "h", 80), "s3", 503)
    assert _metrics.failed == {("s3", ("dynamo", "h", 80))}


def test_recording_reads_the_apis_global_and_falls_back_to_the_public_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = _metrics._api
    monkeypatch.setattr(api, "_METER_PROVIDER", None, raising=False)
    assert _metrics.recording() is False
    monkeypatch.setattr(api, "_METER_PROVIDER", object())
    assert _metrics.recording() is True
    monkeypatch.delattr(api, "_METER_PROVIDER")  # an API that keeps it elsewhere
    monkeypatch.setattr(_metrics.metrics, "get_meter_provider", lambda: _metrics._UNSET)
    assert _metrics.recording() is False
    monkeypatch.setattr(_metrics.metrics, "get_meter_provider", lambda: object())
    assert _metrics.recording() is True


def test_trajectories_are_counted_by_state_and_error_type_while_recording(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted = Recording()
    monkeypatch.setattr(_metrics, "trajectories", counted)
    monkeypatch.setattr(_metrics, "recording", lambda: True)
    _metrics.trajectory("started")
    _metrics.trajectory("ended", KeyError("x"))
    _metrics.trajectory("ended")
    assert counted.added == [
        (1, {"otel_session.trajectory.state": "started"}),
        (1, {"otel_session.trajectory.state": "ended", "error.type": "KeyError"}),
        (1, {"otel_session.trajectory.state": "ended"}),
    ]
    monkeypatch.setattr(_metrics, "recording", lambda: False)
    _metrics.trajectory("started")
    assert len(counted.added) == 3


def test_a_request_outside_a_trajectory_is_counted_only_to_a_router(monkeypatch: pytest.MonkeyPatch) -> None:
    import otel_session

    seen: list[tuple[str, Any, Any]] = []
    monkeypatch.setattr(
        _metrics,
        "sent",
        lambda profile, destination, session: seen.append((profile.name, destination, session)),
    )
    _metrics.outside("http", "127.0.0.1", 8000)  # not configured: nothing
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    _metrics.outside("http", None, 8000)
    _metrics.outside("http", "", 8000)
    _metrics.outside("http", "10.9.9.9", 8000)  # not a router
    _metrics.outside("http", "127.0.0.1", 8000)
    assert seen == [("dynamo", ("http", "127.0.0.1", 8000), None)]


def test_recording_reads_the_apis_global_without_the_public_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the API keeps its provider in a global, that global is the answer: the public
    ``get_meter_provider()`` (an environment lookup on every request) is never called."""

    def never() -> object:
        raise AssertionError("get_meter_provider called on the request path")

    monkeypatch.setattr(_metrics.metrics, "get_meter_provider", never)
    monkeypatch.setattr(_metrics._api, "_METER_PROVIDER", None, raising=False)
    assert _metrics.recording() is False
    monkeypatch.setattr(_metrics._api, "_METER_PROVIDER", object())
    assert _metrics.recording() is True


def test_a_sessions_request_after_an_error_answer_is_one_retry_under_its_routers_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import otel_session

    counted = Recording()
    monkeypatch.setattr(_metrics, "requests", counted)
    monkeypatch.setattr(_metrics, "error_responses", Recording())
    monkeypatch.setattr(_metrics, "failed", set())
    monkeypatch.setattr(_metrics, "_attributes", {})
    otel_session.configure(dynamo_hosts=["127.0.0.1:8000"])
    settings = _settings.current
    assert settings is not None
    profile = settings.rules.route("http", "127.0.0.1", 8000).profile
    assert profile is not None
    destination = ("http", "127.0.0.1", 8000)
    _metrics.answered_error(_metrics.router_of(profile, "127.0.0.1", 8000), "s1", 503)
    _metrics.sent(profile, destination, "s2")  # another session: not a retry
    _metrics.sent(profile, destination, "s1")  # the retry
    _metrics.sent(profile, destination, "s1")  # the one after: not a retry again
    _metrics.sent(profile, destination, None)
    router = {"otel_session.router.profile": "dynamo", "server.address": "127.0.0.1", "server.port": 8000}
    assert counted.added == [
        (1, {**router, "otel_session.session": True, "otel_session.retry": False}),
        (1, {**router, "otel_session.session": True, "otel_session.retry": True}),
        (1, {**router, "otel_session.session": True, "otel_session.retry": False}),
        (1, {**router, "otel_session.session": False, "otel_session.retry": False}),
    ]
    assert _metrics.failed == set()
