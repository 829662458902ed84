"""collector-config.yaml: checked statically, since no collector binary can be installed here.

A collector refuses to start when a pipeline names an undefined component, so that is checked for
every pipeline, along with the ports the README documents and the processor order it relies on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

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
