"""collector-config.yaml: checked statically, since no collector binary can be installed here.

A collector refuses to start when a pipeline names an undefined component, so that is checked for
every pipeline, along with the ports the README documents and the processor order it relies on. What
the hashing does to grouping is checked here on OTLP attributes, and in tests/test_phoenix.py through
a real Phoenix.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

import otel_session
from tests.collector_standin import apply_actions, collector_hash, load_actions

CONFIG = Path(__file__).resolve().parent.parent / "collector-config.yaml"
SESSION_KEYS = {"session.id", "gen_ai.conversation.id", "otel_session.parent_session_id"}


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    loaded = yaml.safe_load(CONFIG.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _pipelines(config: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    pipelines = config["service"]["pipelines"]
    assert pipelines, "the collector has no pipeline"
    return pipelines  # type: ignore[no-any-return]


def test_every_pipeline_names_only_defined_components(config: dict[str, Any]) -> None:
    for name, pipeline in _pipelines(config).items():
        assert pipeline.get("receivers") and pipeline.get("exporters"), name
        for kind in ("receivers", "processors", "exporters"):
            defined = set(config.get(kind) or {})
            for component in pipeline.get(kind, []):
                assert component in defined, f"pipeline {name} uses undefined {kind[:-1]} {component!r}"


def test_otlp_receiver_listens_on_the_documented_ports(config: dict[str, Any]) -> None:
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].rsplit(":", 1)[1] == "4317"
    assert protocols["http"]["endpoint"].rsplit(":", 1)[1] == "4318"
    for pipeline in _pipelines(config).values():
        assert "otlp" in pipeline["receivers"]


def test_memory_limiter_first_and_batch_last(config: dict[str, Any]) -> None:
    for name, pipeline in _pipelines(config).items():
        processors = pipeline["processors"]
        assert processors[0] == "memory_limiter", name
        assert processors[-1] == "batch", name


def test_session_identifiers_are_hashed_or_dropped_before_export(config: dict[str, Any]) -> None:
    for name, pipeline in _pipelines(config).items():
        scrubbed: set[str] = set()
        for processor in pipeline["processors"]:
            if processor.split("/")[0] != "attributes":
                continue
            for action in config["processors"][processor]["actions"]:
                if action["action"] in ("hash", "delete"):
                    scrubbed.add(action["key"])
        assert scrubbed >= SESSION_KEYS, f"pipeline {name} exports {SESSION_KEYS - scrubbed} as they are"


def test_exports_to_debug_file_and_an_otlp_backend(config: dict[str, Any]) -> None:
    pipelines = _pipelines(config).values()
    types = {exporter.split("/")[0] for pipeline in pipelines for exporter in pipeline["exporters"]}
    assert {"debug", "file"} <= types
    assert types & {"otlp", "otlp_grpc", "otlphttp", "otlp_http"}


def test_a_pipeline_exports_to_phoenix_over_otlp_http(config: dict[str, Any]) -> None:
    exporters = [
        (name, exporter)
        for pipeline in _pipelines(config).values()
        for exporter in pipeline["exporters"]
        for name in [exporter.split("/")[0]]
        if name in ("otlp_http", "otlphttp") and exporter.endswith("/phoenix")
    ]
    assert len(exporters) == 1, exporters
    endpoint = urlsplit(config["exporters"][exporters[0][1]]["endpoint"])
    # Phoenix's UI port takes OTLP/HTTP; the exporter appends /v1/traces itself.
    assert (endpoint.scheme, endpoint.hostname, endpoint.port, endpoint.path) == (
        "http",
        "localhost",
        6006,
        "",
    )


def _span(attributes: dict[str, str]) -> list[KeyValue]:
    return [KeyValue(key=key, value=AnyValue(string_value=value)) for key, value in attributes.items()]


def test_hashing_keeps_a_trajectorys_spans_together_and_siblings_apart() -> None:
    """The config's own actions on spans as otel-session writes them: the same grouping, no readable ID."""
    actions = load_actions()
    spans = []
    for _ in range(2):  # two siblings, each with a nested trajectory (a tool call, say)
        with otel_session.trajectory() as outer, otel_session.trajectory() as inner:
            assert outer.session_id is not None and inner.session_id is not None
            root = {"session.id": outer.session_id, "gen_ai.conversation.id": outer.session_id}
            spans.append((outer.session_id, _span(root)))
            spans.append((outer.session_id, _span({"session.id": outer.session_id, "http.method": "POST"})))
            nested = {"session.id": inner.session_id, "otel_session.parent_session_id": outer.session_id}
            spans.append((inner.session_id, _span(nested)))
    raw = {session for session, _ in spans}
    grouped: dict[str, set[str]] = defaultdict(set)
    for session, attributes in spans:
        apply_actions(actions, attributes)
        values = {pair.key: pair.value.string_value for pair in attributes}
        grouped[values["session.id"]].add(session)
        assert not raw & set(values.values()), values  # no ID is readable after the processor
        assert values.get("http.method", "POST") == "POST"  # other attributes pass untouched
        if "gen_ai.conversation.id" in values:
            assert values["gen_ai.conversation.id"] == values["session.id"]
        if "otel_session.parent_session_id" in values:
            assert values["otel_session.parent_session_id"] in grouped  # still names its parent's group
    assert len(grouped) == len(raw) == 4  # one group per trajectory: none merged, none split
    assert all(len(sessions) == 1 for sessions in grouped.values())
    assert set(grouped) == {collector_hash(session) for session in raw}
