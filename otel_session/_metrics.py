"""What otel-session does, counted through the OpenTelemetry metrics API.

The instruments come from ``metrics.get_meter("otel_session")``: where the application sets no
``MeterProvider`` they are the API's proxies, whose ``add`` does nothing, and they start counting
the moment one is set, flowing to whatever that provider exports. The request path only counts here
(``sent``); judging what the counts mean is ``_evidence``'s job. Names follow the OpenTelemetry
semantic conventions' style (docs/tracing.md, "Metrics").
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from opentelemetry import metrics

from otel_session import _faults, _settings
from otel_session._routers import Profile

ROUTER_PROFILE = "otel_session.router.profile"
WITH_SESSION = "otel_session.session"
RETRY = "otel_session.retry"
TURN = "otel_session.turn"
SWITCHED = "otel_session.worker.switched"
STATE = "otel_session.trajectory.state"
CROWDED = "otel_session.worker.crowded"

Router = tuple[str, str, int | None]  # (profile name, host, port): one router as the client dials it

# The API's stand-in provider while the application has set none: then nothing is classified to be
# counted (``outside``). Told apart by its class, the API having no public name for it.
_first = metrics.get_meter_provider()
_api = sys.modules.get("opentelemetry.metrics._internal")
_UNSET: object = _first if type(_first).__name__ == "_ProxyMeterProvider" else object()
_meter = metrics.get_meter("otel_session")
trajectories = _meter.create_counter(
    "otel_session.trajectories", unit="{trajectory}", description="Trajectory attempts started and ended."
)
requests = _meter.create_counter(
    "otel_session.requests",
    unit="{request}",
    description="Requests to a configured router host, with a session and without one.",
)
error_responses = _meter.create_counter(
    "otel_session.error_responses",
    unit="{response}",
    description="Error answers (429, 5xx) from a router to requests carrying a session.",
)
turns = _meter.create_counter(
    "otel_session.turns",
    unit="{turn}",
    description="Responses of a session whose usage the client parsed: its first turn or a later one.",
)
prompt_tokens = _meter.create_counter(
    "otel_session.prompt_tokens", unit="{token}", description="Prompt tokens of the turns counted."
)
cached_tokens = _meter.create_counter(
    "otel_session.cached_tokens",
    unit="{token}",
    description="Prompt tokens the router's worker served from its prefix cache, of the same turns.",
)
worker_checks = _meter.create_counter(
    "otel_session.worker_checks",
    unit="{turn}",
    description="Turns of a session whose worker and the previous turn's worker are both known.",
)

crowded_turns = _meter.create_counter(
    "otel_session.worker_crowding",
    unit="{turn}",
    description="Turns whose worker is known, by whether that worker was crowded with pinned sessions.",
)

unpinned_sessions = _meter.create_counter(
    "otel_session.unpinned_sessions",
    unit="{session}",
    description="Sessions a router refused for want of room (529) whose later requests went unpinned.",
)

sibling_choices = _meter.create_counter(
    "otel_session.sibling_choices",
    unit="{trajectory}",
    description="Attempts OTEL_SESSION_SIBLINGS=fleet decided, by choice: grouped, alone or withheld.",
)

Destination = tuple[str, "str | None", "int | None"]  # (scheme, host, port) as the client dials them
# Attribute sets made once per (profile, destination, with session, retry): a run has few routers.
_attributes: dict[tuple[str, Destination, bool, bool], dict[str, Any]] = {}
# (session, router) whose last answer was an error: the session's next request there is a retry.
failed: set[tuple[str, Router]] = set()
_lock = threading.Lock()
FAILED_KEPT = 4096


def count(instrument: Any, amount: int, attributes: dict[str, Any]) -> None:
    """``instrument.add``: counts go to the application's own ``MeterProvider``, and one that raises
    (a broken bridge to a vendor's metrics) must cost the count, never a trajectory or a session."""
    try:
        instrument.add(amount, attributes)
    except Exception as exc:
        _faults.report("counting otel-session's metrics", exc)


def router_of(profile: Profile, host: str, port: int | None) -> Router:
    """The key one router is counted under."""
    return profile.name, host, port


def router_attributes(router: Router) -> dict[str, Any]:
    """The attributes naming ``router`` on every instrument."""
    attributes: dict[str, Any] = {ROUTER_PROFILE: router[0], "server.address": router[1]}
    if router[2] is not None:
        attributes["server.port"] = router[2]
    return attributes


def _request_attributes(name: str, destination: Destination, session: bool, retry: bool) -> dict[str, Any]:
    key = (name, destination, session, retry)
    found = _attributes.get(key)
    if found is None:
        if len(_attributes) >= 1024:
            _attributes.clear()
        router = (name, destination[1] or "", destination[2])
        found = _attributes[key] = {**router_attributes(router), WITH_SESSION: session, RETRY: retry}
    return found


def sent(profile: Profile, destination: Destination, session: str | None) -> None:
    """One request to a router host went out to ``destination`` (scheme, host, port), carrying
    ``session`` (``None``: none). On the request path: one dict lookup and the counter's ``add``."""
    retry = False
    if failed and session is not None:
        key = (session, (profile.name, destination[1] or "", destination[2]))
        if key in failed:
            with _lock:
                failed.discard(key)
            retry = True
    count(requests, 1, _request_attributes(profile.name, destination, session is not None, retry))


def recording() -> bool:
    """Whether the application has set a ``MeterProvider`` (so counts go somewhere). Read from the
    API's global where it keeps one: ``get_meter_provider()`` looks up an environment variable on
    every call, some 6 k instructions on every request sent outside a trajectory (docs/performance.md)."""
    provider = getattr(_api, "_METER_PROVIDER", _api)
    if provider is _api:  # an API that keeps it elsewhere: the public way
        return metrics.get_meter_provider() is not _UNSET
    return provider is not None


def outside(scheme: str, host: str | None, port: int | None) -> None:
    """A request sent outside any trajectory: counted, without a session, if it goes to a router host
    (callers ask ``recording()`` first, so the usual request is not classified for nothing)."""
    settings = _settings.current
    if settings is None or not host:
        return
    profile = settings.rules.route(scheme, host, port).profile
    if profile is not None:
        sent(profile, (scheme, host, port), None)


def answered_error(router: Router, session: str, status: int) -> None:
    """A router answered a request of ``session`` with error ``status``: counted, and the session's
    next request to it will count as a retry."""
    with _lock:
        if len(failed) >= FAILED_KEPT:
            failed.clear()
        failed.add((session, router))
    count(error_responses, 1, {**router_attributes(router), "http.response.status_code": status})


_STATES = {"started": {STATE: "started"}, "ended": {STATE: "ended"}}


def trajectory(state: str, error: BaseException | None = None) -> None:
    """A trajectory attempt ``started`` or ``ended`` (with the exception that ended it, if any)."""
    if not recording():
        return
    if error is None:
        count(trajectories, 1, _STATES[state])
    else:
        count(trajectories, 1, {STATE: state, "error.type": type(error).__qualname__})
