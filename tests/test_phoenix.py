"""Traces a person can look at: a GRPO batch against the real local Dynamo, exported into a real Phoenix.

Arize Phoenix (its own venv, see tests/phoenix_harness.py) runs on loopback and receives the batch of
tests/phoenix_batch.py over OTLP/HTTP; everything is then read back through Phoenix's own REST API:
one trace per trajectory attempt, every HTTP attempt a client span under it, ``session.id`` on every
span, each attempt its own Phoenix session, and nothing at all when tracing is off. In CI a missing
Phoenix is a failure, not a skip.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from otel_session.dynamo import LocalDynamo
from tests.collector_standin import AttributesForwarder, collector_hash
from tests.phoenix_batch import PROMPTS, RERUN, RETRIED, SIBLINGS, TURNS
from tests.phoenix_harness import (
    REPO,
    ListeningSocket,
    Phoenix,
    PhoenixUnavailable,
    decode_proc_address,
    listening_sockets,
    phoenix_required,
)
from tests.test_dynamo_affinity import FlakyProxy

ON_PROJECT = "grpo-tracing-on"
OFF_PROJECT = "grpo-tracing-off"
HASHED_PROJECT = "grpo-ids-hashed"  # exported through collector-config.yaml's attributes/session_ids


@pytest.fixture(scope="module")
def phoenix() -> Iterator[Phoenix]:
    try:
        server = Phoenix()
        server.start()
    except PhoenixUnavailable as exc:
        if phoenix_required():
            pytest.fail(f"Phoenix is required here (CI): {exc}")
        pytest.skip(f"Phoenix unavailable: {exc}")
    try:
        yield server
    finally:
        server.close()


@dataclass
class Runs:
    on: dict[str, Any]  # what the batch did with tracing on (tests/phoenix_batch.py's report)
    off: dict[str, Any]
    hashed: dict[str, Any]  # on again, exported through collector-config.yaml's attributes processor
    spans: list[dict[str, Any]]  # the on-run's spans, as Phoenix stored them
    hashed_spans: list[dict[str, Any]]
    injected_500s: int
    retries_through_proxy: int


def _run_batch(endpoint: str, dynamo: LocalDynamo, proxy_url: str, project: str, on: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
    env.update(
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,  # set in every run: off must send nothing anyway
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_SERVICE_NAME="grpo-rollouts",
        OTEL_RESOURCE_ATTRIBUTES=f"openinference.project.name={project}",  # Phoenix's project
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.phoenix_batch",
            dynamo.base_url,
            proxy_url,
            dynamo.model_name,
            "on" if on else "off",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def _expected_spans(report: dict[str, Any]) -> int:
    return sum(1 + attempt["http_attempts"] for attempt in report["attempts"])


@pytest.fixture(scope="module")
def runs(phoenix: Phoenix, dynamo_stack: LocalDynamo) -> Runs:
    """The batch with tracing off, then on, then on through the collector's hashing, into one Phoenix.

    Off first: Phoenix stores what it receives in arrival order, so once the later runs' spans are
    all stored, anything the off-run had sent would be stored too.
    """
    with FlakyProxy(dynamo_stack.base_url) as proxy, AttributesForwarder(phoenix.endpoint) as collector:
        upstream = proxy.url + "/v1"
        off = _run_batch(phoenix.endpoint, dynamo_stack, upstream, OFF_PROJECT, on=False)
        on = _run_batch(phoenix.endpoint, dynamo_stack, upstream, ON_PROJECT, on=True)
        hashed = _run_batch(collector.endpoint, dynamo_stack, upstream, HASHED_PROJECT, on=True)
        injected, retried = proxy.injected, proxy.retry_counts["1"]
    return Runs(
        on=on,
        off=off,
        hashed=hashed,
        spans=phoenix.wait_for_spans(ON_PROJECT, _expected_spans(on), timeout=60),
        hashed_spans=phoenix.wait_for_spans(HASHED_PROJECT, _expected_spans(hashed), timeout=60),
        injected_500s=injected,
        retries_through_proxy=retried,
    )


def _by_trace(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        traces[span["context"]["trace_id"]].append(span)
    return traces


def _root(trace: list[dict[str, Any]]) -> dict[str, Any]:
    (root,) = [span for span in trace if span["parent_id"] is None]
    return root


def _status(span: dict[str, Any]) -> int | None:
    attributes = span["attributes"]
    code = attributes.get("http.response.status_code", attributes.get("http.status_code"))
    return None if code is None else int(code)


def test_the_batch_ran_as_planned(runs: Runs) -> None:
    """The shape every other test relies on: 4 sibling lines, one re-run, one retried request."""
    for report in (runs.on, runs.off, runs.hashed):
        attempts = report["attempts"]
        keys = sorted((a["prompt_index"], a["sibling_index"], a["attempt"]) for a in attempts)
        planned = sorted([(p, s, 1) for p in range(PROMPTS) for s in range(SIBLINGS)] + [(*RERUN, 2)])
        assert keys == planned
        for attempt in attempts:
            failed = (attempt["prompt_index"], attempt["sibling_index"], attempt["attempt"]) == (*RERUN, 1)
            assert attempt["error"] == ("InternalServerError" if failed else None), attempt
            assert attempt["turns"] == (0 if failed else TURNS), attempt
        assert len({a["session_id"] for a in attempts}) == len(attempts)  # every attempt a new session
        assert report["outside_trajectories"] == 0
    assert runs.retries_through_proxy == 3  # one per run: the retried request's second try
    assert runs.injected_500s == 6  # two per run: the retried request's first try, the failed attempt's


def test_one_trace_per_trajectory_attempt(runs: Runs, phoenix: Phoenix) -> None:
    traces = _by_trace(runs.spans)
    assert len(traces) == len(runs.on["attempts"]) == len(phoenix.traces(ON_PROJECT))
    roots = {_root(trace)["attributes"]["session.id"]: _root(trace) for trace in traces.values()}
    for attempt in runs.on["attempts"]:
        root = roots[attempt["session_id"]]
        assert root["name"] == "trajectory"
        attributes = root["attributes"]
        assert attributes["gen_ai.conversation.id"] == attempt["session_id"]
        assert attributes["otel_session.prompt_index"] == attempt["prompt_index"]
        assert attributes["otel_session.sibling_index"] == attempt["sibling_index"]
        assert attributes["otel_session.attempt"] == attempt["attempt"]


def test_every_http_attempt_is_a_client_span_under_its_trajectory(runs: Runs) -> None:
    assert len(runs.spans) == _expected_spans(runs.on)
    traces = {_root(trace)["attributes"]["session.id"]: trace for trace in _by_trace(runs.spans).values()}
    for attempt in runs.on["attempts"]:
        trace = traces[attempt["session_id"]]
        root = _root(trace)
        clients = [span for span in trace if span is not root]
        assert len(clients) == attempt["http_attempts"]  # counted in the batch by a client event hook
        for span in clients:
            assert span["parent_id"] == root["context"]["span_id"]
            assert span["name"] == "POST"
            assert span["status_code"] == ("ERROR" if _status(span) == 500 else "UNSET")
        statuses = sorted(_status(span) or 0 for span in clients)
        key = (attempt["prompt_index"], attempt["sibling_index"])
        if key == RETRIED:
            assert statuses == [200] * TURNS + [500]  # the 500 and its retry: two spans for one call
        elif key == RERUN and attempt["attempt"] == 1:
            assert statuses == [500]
        else:
            assert statuses == [200] * TURNS


def test_every_span_carries_its_trajectorys_session_id(runs: Runs) -> None:
    sessions = {attempt["session_id"] for attempt in runs.on["attempts"]}
    for trace in _by_trace(runs.spans).values():
        session = _root(trace)["attributes"]["session.id"]
        assert session in sessions
        assert {span["attributes"].get("session.id") for span in trace} == {session}


def test_siblings_are_different_sessions_in_phoenix(runs: Runs, phoenix: Phoenix) -> None:
    stored = phoenix.sessions(ON_PROJECT)
    traces = {
        _root(trace)["attributes"]["session.id"]: trace_id
        for trace_id, trace in _by_trace(runs.spans).items()
    }
    assert sorted(session["session_id"] for session in stored) == sorted(traces)
    for session in stored:
        assert [trace["trace_id"] for trace in session["traces"]] == [traces[session["session_id"]]]
    by_sibling: dict[tuple[int, int], set[str]] = defaultdict(set)
    for attempt in runs.on["attempts"]:
        by_sibling[(attempt["prompt_index"], attempt["sibling_index"])].add(attempt["session_id"])
    for prompt in range(PROMPTS):
        first, second = (by_sibling[(prompt, sibling)] for sibling in range(SIBLINGS))
        assert first.isdisjoint(second)
    assert len(by_sibling[RERUN]) == 2  # the re-run attempt is a session of its own


def test_tracing_off_puts_nothing_in_phoenix(runs: Runs, phoenix: Phoenix) -> None:
    assert runs.spans, "the on-run reached Phoenix, so the off-run's endpoint was live"
    assert OFF_PROJECT not in phoenix.projects()
    assert phoenix.spans(OFF_PROJECT) == []
    off_sessions = {attempt["session_id"] for attempt in runs.off["attempts"]}
    for project in phoenix.projects():
        for span in phoenix.spans(project):
            assert span["attributes"].get("session.id") not in off_sessions, project
        assert project in (ON_PROJECT, HASHED_PROJECT) or phoenix.spans(project) == [], project


def test_phoenix_listens_on_loopback_only(runs: Runs, phoenix: Phoenix) -> None:
    found = phoenix.listening_sockets()
    assert {phoenix.port, phoenix.grpc_port} <= {sock.port for sock in found}, found
    assert [sock for sock in found if not sock.loopback] == []
    # The gRPC receiver is kept, on loopback, not switched off.
    with grpc.insecure_channel(f"127.0.0.1:{phoenix.grpc_port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=10)


@pytest.mark.parametrize(
    ("field", "address", "port", "loopback"),
    [
        ("0100007F:1F90", "127.0.0.1", 8080, True),
        ("0200007F:0050", "127.0.0.2", 80, True),
        ("00000000:10E1", "0.0.0.0", 4321, False),
        ("0100000A:10E1", "10.0.0.1", 4321, False),
        ("00000000000000000000000000000000:10E1", "::", 4321, False),
        ("00000000000000000000000001000000:0016", "::1", 22, True),
        ("0000000000000000FFFF00000100007F:10E1", "::ffff:127.0.0.1", 4321, True),
        ("0000000000000000FFFF00000100000A:10E1", "::ffff:10.0.0.1", 4321, False),
    ],
)
def test_kernel_socket_addresses_are_read_and_judged(
    field: str, address: str, port: int, loopback: bool
) -> None:
    """Rows as Linux writes them in /proc/net/tcp{,6}: what the listening check decides on."""
    decoded, decoded_port = decode_proc_address(field)
    assert (ipaddress.ip_address(decoded), decoded_port) == (ipaddress.ip_address(address), port)
    assert ListeningSocket("tcp6" if len(field) > 13 else "tcp", address, port, 1).loopback is loopback


def test_listening_sockets_sees_a_real_listener() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        sock.listen()
        port = sock.getsockname()[1]
        mine = [found for found in listening_sockets(os.getpid()) if found.port == port]
    assert mine == [ListeningSocket("tcp", "127.0.0.2", port, os.getpid())]


def test_hashed_ids_keep_each_attempt_one_session(runs: Runs, phoenix: Phoenix) -> None:
    """Exported through collector-config.yaml's hashing: the IDs are unreadable, the grouping intact."""
    raw = {attempt["session_id"] for attempt in runs.hashed["attempts"]}
    hashed = {collector_hash(session) for session in raw}
    assert len(hashed) == len(raw)
    assert len(runs.hashed_spans) == _expected_spans(runs.hashed)
    traces = _by_trace(runs.hashed_spans)
    by_session = {}
    for trace_id, trace in traces.items():
        (session,) = {span["attributes"].get("session.id") for span in trace}  # one per trace, on all
        by_session[session] = trace_id
        assert _root(trace)["attributes"]["gen_ai.conversation.id"] == session
    assert set(by_session) == hashed
    stored = phoenix.sessions(HASHED_PROJECT)
    assert sorted(s["session_id"] for s in stored) == sorted(hashed)
    for session in stored:
        assert [trace["trace_id"] for trace in session["traces"]] == [by_session[session["session_id"]]]
    stored_text = json.dumps(runs.hashed_spans)
    assert not any(session in stored_text for session in raw)  # no readable ID anywhere in the project
