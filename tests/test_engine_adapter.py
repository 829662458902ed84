"""Why TRL and AReaL reach the real Dynamo through tests/engine_adapter.py, and that its worker ids are
Dynamo's: Dynamo 1.6.1's answers to the frameworks' own requests (if a later Dynamo serves them, these
fail and the adapter should go), and the adapter's log-read worker against ``nvext.worker_id``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from otel_session.dynamo import LocalDynamo, ensure_model_dir, worker_id_of
from tests.engine_adapter import DynamoAdapter

PROMPT = [10, 20, 30, 40, 50]
# TRL 1.16.0's _generate_one_turn payload, AReaL 1.0.4's SGLangBackend and VLLMBackend ones (their source).
TRL = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
       "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0, "seed": 7}  # fmt: skip
SAMPLING = {"top_p": 1.0, "top_k": -1, "max_new_tokens": 4, "temperature": 1.0, "stop_token_ids": None,
            "ignore_eos": False, "skip_special_tokens": True, "frequency_penalty": 0.0}  # fmt: skip
AREAL_SGLANG = {"input_ids": PROMPT, "image_data": None, "sampling_params": SAMPLING, "return_logprob": True,
                "stream": False}  # fmt: skip
AREAL_VLLM = {"top_p": 1.0, "top_k": -1, "max_tokens": 4, "temperature": 1.0, "stop_token_ids": None,
              "ignore_eos": False, "skip_special_tokens": True, "return_tokens_as_token_ids": True,
              "logprobs": 0, "use_beam_search": False, "stream": False, "prompt": PROMPT}  # fmt: skip


@pytest.fixture
def adapter(dynamo_stack_generate: LocalDynamo) -> Iterator[DynamoAdapter]:
    with DynamoAdapter(dynamo=dynamo_stack_generate, model_dir=ensure_model_dir()) as served:
        yield served


def test_dynamo_refuses_what_trl_and_areal_send(dynamo_stack_generate: LocalDynamo) -> None:
    base, model = f"http://{dynamo_stack_generate.host}", dynamo_stack_generate.model_name
    trl = httpx.post(f"{base}/v1/completions", json={"model": model, **TRL}, timeout=30)
    assert trl.status_code == 400 and "return_token_ids" in trl.text, trl.text
    rest = {k: v for k, v in TRL.items() if k != "return_token_ids"}  # refused even when false
    without = httpx.post(f"{base}/v1/completions", json={"model": model, **rest}, timeout=30)
    (choice,) = without.json()["choices"]  # served, but without what TRL reads
    assert "token_ids" not in choice and choice.get("logprobs") is None, choice
    sglang = httpx.post(f"{base}/generate", json=AREAL_SGLANG, timeout=30)
    assert sglang.status_code == 501 and "set stream=true" in sglang.text, sglang.text
    vllm = httpx.post(f"{base}/v1/completions", json=AREAL_VLLM, timeout=30)
    assert vllm.status_code == 400 and "missing field `model`" in vllm.text, vllm.text
    vllm = httpx.post(f"{base}/v1/completions", json={"model": model, **AREAL_VLLM}, timeout=30)
    assert vllm.status_code == 400 and "use_beam_search" in vllm.text, vllm.text


def test_the_adapter_answers_each_framework_and_reads_dynamos_worker(
    adapter: DynamoAdapter, dynamo_stack_generate: LocalDynamo
) -> None:
    session = {"X-Dynamo-Session-ID": "adapter-check"}
    areal = httpx.post(f"{adapter.url}/generate", json=AREAL_SGLANG, headers=session, timeout=30)
    meta = areal.json()["meta_info"]  # SGLang's non-streaming shape, Dynamo's tokens and logprobs
    assert len(meta["output_token_logprobs"]) == 4 and meta["finish_reason"]["type"] == "length", meta
    trl = httpx.post(f"{adapter.url}/v1/completions", json=TRL, headers=session, timeout=30)
    (choice,) = trl.json()["choices"]  # vLLM's shape, one logprob per token
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0, choice
    assert [t.get("x-dynamo-session-id") for t in adapter.turns] == ["adapter-check"] * 2
    workers = adapter.workers()
    (pinned,) = {workers[str(t.request_id)] for t in adapter.turns}
    direct = httpx.post(
        f"http://{dynamo_stack_generate.host}/v1/completions",
        json={"model": dynamo_stack_generate.model_name, "prompt": PROMPT, "max_tokens": 2,
              "nvext": {"extra_fields": ["worker_id"]}},
        headers=session,
        timeout=30,
    )  # fmt: skip
    assert worker_id_of(direct.json()) == pinned  # the log's worker is the one nvext names for the session
