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
answer the framework reads. AReaL gets Dynamo's tokens and logprobs as they are. TRL gets a scripted turn
(:meth:`DynamoAdapter.script`: a tool call until the rollout holds ``STEPS`` tool results, then an
answer), because the mocker samples random tokens and would never call a tool: the one part that stands
in. Dynamo generates exactly that many tokens (``ignore_eos``) and their logprobs are Dynamo's.

``/generate`` answers carry no ``nvext`` worker id, so :meth:`DynamoAdapter.workers` reads which worker
served each request (by Dynamo's request id, ``meta_info.id``) from the frontend's own log line for the
finished route ("route request completed ... worker_id=..."). The stack is ``dynamo_stack_generate``
(tests/dynamo_fixtures.py).

Each request is recorded as a :class:`Turn`: its headers, and which prompt and turn it is, read by
decoding the prompt with the tiny local tokenizer (``otel_session.dynamo.ensure_model_dir``, plus the
chat template's special tokens in the order TRL's driver adds them): a turn is the number of ``marker``
texts the conversation holds so far.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tokenizers import AddedToken, Tokenizer

from otel_session.dynamo import LocalDynamo
from tests.loopback import AsgiServer, Served

# The special tokens TRL's qwen3 chat template writes, added in this order by TRL's driver too.
SPECIAL = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
           "<think>", "</think>"]  # fmt: skip
STEPS = 2  # tool calls in each of TRL's scripted rollouts
_PROMPT = re.compile(r"prompt (\d+):")

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


@dataclass(frozen=True)
class Turn:
    """One generation request: its headers, the prompt it continues, how many ``marker`` texts it holds."""

    headers: list[tuple[str, str]]
    prompt: int
    turn: int
    host: str
    #: The id Dynamo gave the request (``meta_info.id``), once Dynamo answered it.
    request_id: str | None = None

    def get(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


@dataclass
class DynamoAdapter(Served):
    """Serves TRL's ``/v1/completions`` and AReaL's ``/generate`` through ``dynamo``'s ``/generate``;
    records each request as a :class:`Turn` with Dynamo's request id."""

    dynamo: LocalDynamo
    model_dir: Path
    marker: str = "<tool_response>"
    tool: str = "step"  # the tool TRL's scripted turns call
    host: str = "127.0.0.1"
    port: int = 0
    turns: list[Turn] = field(default_factory=list)
    _served: AsgiServer | None = None
    _tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        assert self._tokenizer is not None, "start() first"
        return self._tokenizer

    def script(self, steps_done: int) -> list[int]:
        """TRL's scripted turn: a ``tool`` call until the rollout holds ``STEPS`` tool results."""
        if steps_done < STEPS:
            call = json.dumps({"name": self.tool, "arguments": {"n": steps_done + 1}})
            text = f"<tool_call>\n{call}\n</tool_call><|im_end|>"
        else:
            text = "done<|im_end|>"
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def record(self, request: Request, ids: list[int]) -> int:
        """Record the request as a :class:`Turn`; returns its turn number."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        matched = _PROMPT.search(text)
        turn = text.count(self.marker)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]
        self.turns.append(Turn(headers, int(matched[1]) if matched else -1, turn, request.url.netloc))
        return turn

    async def _generate(self, request: Request, ids: list[int], sampling: dict[str, Any]) -> Folded:
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
        script = self.script(self.record(request, body["prompt"]))
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

    def start(self) -> DynamoAdapter:
        tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
        self._tokenizer = tokenizer
        app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST"])])
        self._served = AsgiServer(app, host=self.host, port=self.port).__enter__()
        self.port = self._served.port
        return self

    def stop(self) -> None:
        if self._served is not None:
            self._served.__exit__()
            self._served = None

    def __enter__(self) -> DynamoAdapter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
