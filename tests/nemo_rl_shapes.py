"""NeMo-RL's two HTTP shapes, written here because NeMo-RL itself is not installable from the index.

No otel-session line anywhere but the rollout's one ``with otel_session.trajectory():``; processes run
with ``opentelemetry-instrument`` or ``OTEL_SESSION_AUTO`` and variables only (see test_nemo_rl.py).

``python -m tests.nemo_rl_shapes wrapper FRONTEND_V1_URL``: the token wrapper's shape
(``DynamoTokenWrapperServer``): ``start()`` builds a FastAPI app, whose lifespan opens one shared
aiohttp session, and serves it with uvicorn in a thread on a free port; ``/v1/chat/completions``
forwards the JSON body with Content-Type and Authorization only, and answers 502 when Dynamo's
answer lacks ``nvext.engine_data`` or ``choices[].logprobs``. Prints ``{"base_url": ...}``.

``python -m tests.nemo_rl_shapes rollout WRAPPER_V1_URL FRONTEND_V1_URL MODEL``: a rollout that runs
trajectories through the wrapper and through the shape of ``DynamoGeneration._post_completion_request``
(aiohttp POST to ``/completions``, 3 attempts on transport errors, bad JSON, 408, 429 and 5xx, 1 s
apart, a new ``ClientSession`` per call). Prints what it saw as JSON.
"""

# No ``from __future__ import annotations``: FastAPI must resolve the handlers' ``Request`` annotation.
import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

NVEXT = {"extra_fields": ["worker_id"]}
RETRY_STATUSES = {408, 429}


class TokenWrapper:
    def __init__(self, frontend_v1: str) -> None:
        self.frontend_v1 = frontend_v1.rstrip("/")
        self.session: aiohttp.ClientSession | None = None
        self.base_url: str | None = None

    def start(self) -> str:
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                self.session = session
                yield
                self.session = None

        app = FastAPI(lifespan=lifespan)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            headers = {"Content-Type": "application/json"}
            if request.headers.get("authorization"):
                headers["Authorization"] = request.headers["authorization"]
            assert self.session is not None
            async with self.session.post(
                f"{self.frontend_v1}/chat/completions", json=await request.json(), headers=headers
            ) as reply:
                status, body = reply.status, await reply.json()
            usable = "engine_data" in body.get("nvext", {}) and all(
                choice.get("logprobs") is not None for choice in body.get("choices", [])
            )
            if 200 <= status < 300 and not usable:
                return JSONResponse({"error": {"message": "no nvext.engine_data"}}, status_code=502)
            return JSONResponse(body, status_code=status)

        with socket.socket() as probe:  # NeMo-RL picks a free port in 3000-4000 on the node IP
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self.base_url


async def async_http_post_json(url: str, payload: dict[str, Any]) -> tuple[int, Any]:
    """One POST with its own ClientSession, as NeMo-RL's helper does."""
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as reply:
        text = await reply.text()
        return reply.status, json.loads(text)


async def post_completion_request(frontend_v1: str, payload: dict[str, Any]) -> Any:
    last: object = None
    for attempt in range(3):
        try:
            status, body = await async_http_post_json(f"{frontend_v1}/completions", payload)
            if status < 300:
                return body
            if status not in RETRY_STATUSES and status < 500:
                raise RuntimeError(f"completion failed with {status}")
            last = status
        except (aiohttp.ClientError, json.JSONDecodeError) as exc:
            last = exc
        if attempt < 2:
            await asyncio.sleep(1.0)
    raise RuntimeError(f"completion failed after 3 attempts: {last}")


async def rollout(wrapper_v1: str, frontend_v1: str, model: str) -> dict[str, Any]:
    import otel_session  # the rollout's one line of otel-session is the trajectory() below

    trajectories = []
    auth = {"Authorization": "Bearer rl-key"}
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            with otel_session.trajectory() as traj:
                workers = []
                for turn in range(3):
                    chat = {
                        "model": model,
                        "messages": [{"role": "user", "content": f"turn {turn}: count to three"}],
                        "max_tokens": 4,
                        "nvext": NVEXT,
                    }
                    async with http.post(f"{wrapper_v1}/chat/completions", json=chat, headers=auth) as reply:
                        answer = await reply.json()
                        if reply.status != 200:
                            raise RuntimeError(f"wrapper answered {reply.status}: {answer}")
                        workers.append(answer["nvext"]["worker_id"]["decode_worker_id"])
                    body = {"model": model, "prompt": f"turn {turn}:", "max_tokens": 4, "nvext": NVEXT}
                    completion = await post_completion_request(frontend_v1, body)
                    workers.append(completion["nvext"]["worker_id"]["decode_worker_id"])
            trajectories.append({"session": traj.session_id, "workers": workers})
        async with http.post(f"{wrapper_v1}/chat/completions", json=chat, headers=auth) as plain:
            outside = plain.status
    return {"trajectories": trajectories, "outside_status": outside}


def main(argv: list[str]) -> None:
    if argv[0] == "wrapper":
        wrapper = TokenWrapper(argv[1])
        print(json.dumps({"base_url": wrapper.start()}), flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin (or stops us)
    elif argv[0] == "rollout":
        print(json.dumps(asyncio.run(rollout(argv[1], argv[2], argv[3]))))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
