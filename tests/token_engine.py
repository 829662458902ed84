"""An inference engine stand-in for token-in, token-out rollouts (TRL, AReaL), recording what it was sent.

No vLLM or SGLang runs here (no GPU), and Dynamo 1.6.1 serves neither TRL's ``return_token_ids`` (400
"Unsupported parameter(s)") nor SGLang's native ``/generate``, which AReaL's remote engine posts. So
this loopback server plays the engine and answers as they do: vLLM's ``POST /v1/completions`` with a
prompt of token ids (``choices[0].token_ids``, ``logprobs.token_logprobs``), and SGLang's ``POST
/generate`` with ``input_ids`` (``meta_info.output_token_logprobs``, ``finish_reason``). It decodes
each prompt with the tiny local tokenizer (``otel_session.dynamo.ensure_model_dir``, plus the chat
template's special tokens in the order TRL's driver adds them) to record which prompt and turn it is:
a turn is the number of ``marker`` texts the conversation holds so far. For TRL it answers a ``step``
tool call until the conversation holds ``STEPS`` tool results, then a plain answer; for AReaL, a plain
answer every turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tokenizers import AddedToken, Tokenizer

from tests.loopback import AsgiServer, Served

# The special tokens TRL's qwen3 chat template writes, added in this order by the driver too.
SPECIAL = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
           "<think>", "</think>"]  # fmt: skip
STEPS = 2
_PROMPT = re.compile(r"prompt (\d+):")


@dataclass(frozen=True)
class Turn:
    """One generation request: its headers, the prompt it continues and how many tool results it holds."""

    headers: list[tuple[str, str]]
    prompt: int
    turn: int
    host: str
    #: The id Dynamo gave the request (``meta_info.id``), when it went through tests/engine_adapter.py.
    request_id: str | None = None

    def get(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


@dataclass
class TokenEngine(Served):
    model_dir: Path = Path()
    marker: str = "<tool_response>"
    host: str = "127.0.0.1"
    port: int = 0
    turns: list[Turn] = field(default_factory=list)
    _served: AsgiServer | None = None
    _tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        assert self._tokenizer is not None, "start() first"
        return self._tokenizer

    def answer(self, tokenizer: Tokenizer, steps_done: int) -> list[int]:
        if steps_done < STEPS:
            call = json.dumps({"name": "step", "arguments": {"n": steps_done + 1}})
            text = f"<tool_call>\n{call}\n</tool_call><|im_end|>"
        else:
            text = "done<|im_end|>"
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    def record(self, request: Request, ids: list[int]) -> int:
        assert self._tokenizer is not None
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        matched = _PROMPT.search(text)
        turn = text.count(self.marker)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]
        self.turns.append(Turn(headers, int(matched[1]) if matched else -1, turn, request.url.netloc))
        return turn

    async def handle(self, request: Request) -> Response:
        assert self._tokenizer is not None
        path = request.url.path
        if path == "/generate":  # SGLang's native API
            body = json.loads(await request.body())
            self.record(request, body["input_ids"])
            ids = list(self._tokenizer.encode("an answer", add_special_tokens=False).ids)
            meta = {
                "output_token_logprobs": [[-0.5, i, None] for i in ids],
                "finish_reason": {"type": "stop"},
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids),
            }
            return JSONResponse({"text": "an answer", "meta_info": meta})
        if not path.endswith("/completions"):  # health checks, model listings
            return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})
        body = json.loads(await request.body())
        ids = self.answer(self._tokenizer, self.record(request, body["prompt"]))
        choice = {
            "index": 0,
            "text": self._tokenizer.decode(ids),
            "token_ids": ids,
            "logprobs": {"token_logprobs": [-0.5] * len(ids)},
            "finish_reason": "stop",
        }
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}
        return JSONResponse(
            {"id": "cmpl-standin", "object": "text_completion", "choices": [choice], "usage": usage}
        )

    def start(self) -> TokenEngine:
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

    def __enter__(self) -> TokenEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
