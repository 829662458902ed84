"""A thin adapter that puts the real Dynamo 1.6.1 frontend behind TRL's and AReaL's token-in rollout calls.

Neither framework's request is one Dynamo answers as sent (checked over loopback against frontend +
mocker workers; docs/integrations.md has the details):

- TRL 1.16.0 posts vLLM's ``/v1/completions`` with ``"return_token_ids": true``: Dynamo answers 400
  "Unsupported parameter(s): `return_token_ids`". Without it Dynamo answers, but with neither
  ``choices[0].token_ids`` nor ``choices[0].logprobs``, which TRL reads.
- AReaL 1.0.4's SGLang backend posts SGLang's ``/generate`` with ``"stream": false``. Dynamo serves
  ``/generate`` itself (frontend ``DYN_SGLANG_ENABLE_GENERATE=1``, mocker ``--sglang-generate``), with
  SGLang's output ids and ``output_token_logprobs``, but only streamed: 501 "non-streaming SGLang
  generate requests are not implemented; set stream=true".

So each request goes on to Dynamo's own ``/generate`` with ``stream: true`` and **the headers it came
with** (less hop-by-hop ones): the session headers the preset wrote are what Dynamo routes by, and
Dynamo's session affinity is what keeps an attempt on one worker. The stream is folded into the one
answer the framework reads. AReaL gets Dynamo's tokens and logprobs as they are. TRL gets the turn the
stand-in's script gives (tests/token_engine.py: a tool call until the rollout holds ``STEPS`` tool
results, then an answer), because the mocker samples random tokens and would never call a tool; Dynamo
generates exactly that many tokens (``ignore_eos``) and their logprobs are Dynamo's.

``/generate`` answers carry no ``nvext`` worker id, so :meth:`DynamoAdapter.workers` reads which worker
served each request (by Dynamo's request id, ``meta_info.id``) from the frontend's own log line for the
finished route ("route request completed ... worker_id=..."). The stack is ``dynamo_stack_generate``
(tests/dynamo_fixtures.py).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from otel_session.dynamo import LocalDynamo
from tests.token_engine import TokenEngine

_HOP = {"host", "content-length", "content-type", "connection", "keep-alive", "transfer-encoding", "te",
        "upgrade", "proxy-connection", "accept-encoding"}  # fmt: skip
_ROUTED = re.compile(r"route request completed.*")
_REQUEST_ID = re.compile(r"request_id=([0-9a-f-]{36})")
_WORKER_ID = re.compile(r"worker_id=(\d+)")


@dataclass
class Folded:
    """A streamed ``/generate`` answer, folded: Dynamo's request id, tokens, their logprobs, why it ended."""

    request_id: str
    ids: list[int]
    logprobs: list[float]
    finish_reason: Any
    prompt_tokens: int


@dataclass
class DynamoAdapter(TokenEngine):
    """Serves TRL's ``/v1/completions`` and AReaL's ``/generate`` through ``dynamo``'s ``/generate``;
    records each request as a :class:`~tests.token_engine.Turn` with Dynamo's request id."""

    dynamo: LocalDynamo | None = None

    async def _generate(self, request: Request, ids: list[int], sampling: dict[str, Any]) -> Folded:
        assert self.dynamo is not None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client:  # per request: the server's loop is a thread's
            answer = await client.post(f"http://{self.dynamo.host}/generate", json=body, headers=headers)
        answer.raise_for_status()
        chunks = [json.loads(line[5:]) for line in answer.text.splitlines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]  # fmt: skip
        meta = [chunk["meta_info"] for chunk in chunks]
        return Folded(
            request_id=meta[-1]["id"],
            ids=[i for chunk in chunks for i in chunk["output_ids"]],
            logprobs=[lp[0] for m in meta for lp in m.get("output_token_logprobs", [])],
            finish_reason=meta[-1]["finish_reason"],
            prompt_tokens=meta[-1]["prompt_tokens"],
        )

    def _note(self, index: int, folded: Folded) -> None:
        self.turns[index] = replace(self.turns[index], request_id=folded.request_id)

    async def handle(self, request: Request) -> Response:
        path = request.url.path
        if path == "/generate":  # AReaL: SGLang's own request, sent on streamed, answered folded
            body = json.loads(await request.body())
            index = len(self.turns)
            self.record(request, body["input_ids"])
            folded = await self._generate(request, body["input_ids"], body["sampling_params"])
            self._note(index, folded)
            pairs = zip(folded.logprobs, folded.ids, strict=True)
            meta = {
                "id": folded.request_id,
                "output_token_logprobs": [[lp, i, None] for lp, i in pairs],
                "finish_reason": folded.finish_reason,
                "prompt_tokens": folded.prompt_tokens,
                "completion_tokens": len(folded.ids),
            }
            return JSONResponse({"text": self.tokenizer.decode(folded.ids), "output_ids": folded.ids,
                                 "meta_info": meta})  # fmt: skip
        if not path.endswith("/completions"):  # health checks, model listings
            return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})
        body = json.loads(await request.body())  # TRL: vLLM's token-in completion
        index = len(self.turns)
        script = self.answer(self.tokenizer, self.record(request, body["prompt"]))
        sampling = {k: body[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty") if k in body}
        folded = await self._generate(
            request, body["prompt"], {**sampling, "max_new_tokens": len(script), "ignore_eos": True}
        )
        self._note(index, folded)
        if len(folded.logprobs) != len(script):  # one logprob per token, or TRL rejects the turn
            return JSONResponse({"error": f"Dynamo generated {len(folded.logprobs)} of {len(script)}"}, 502)
        choice = {
            "index": 0,
            "text": self.tokenizer.decode(script),
            "token_ids": script,
            "logprobs": {"token_logprobs": folded.logprobs},
            "finish_reason": "stop",
        }
        usage = {"prompt_tokens": folded.prompt_tokens, "completion_tokens": len(script)}
        return JSONResponse({"id": folded.request_id, "object": "text_completion", "choices": [choice],
                             "usage": usage})  # fmt: skip

    def workers(self, timeout: float = 10.0) -> dict[str, int]:
        """Dynamo's request id -> the worker that served it, from the frontend's log, waiting (bounded)
        until every recorded request is there: the line is written as the stream ends."""
        assert self.dynamo is not None
        wanted = {t.request_id for t in self.turns if t.request_id is not None}
        deadline = time.monotonic() + timeout
        while True:
            found: dict[str, int] = {}
            for line in self.dynamo.frontends[0].log_path.read_text(errors="replace").splitlines():
                if _ROUTED.search(line) and (worker := _WORKER_ID.search(line)):
                    found.update((rid, int(worker[1])) for rid in _REQUEST_ID.findall(line))
            if wanted <= found.keys() or time.monotonic() > deadline:
                return found
            time.sleep(0.1)
