"""Real NeMo-Gym 0.7.0 servers, started the way Gym's launcher starts them, and what they sent.

Each server (``VLLMModel``, ``GymnasiumAgent``, ``ExampleMultiTurnEnv``) runs unmodified from the
``.venv-gym`` install (``scripts/nemo_gym_venv``) as its own process: ``python app.py`` in its
directory, the global config dict as YAML in ``NEMO_GYM_CONFIG_DICT``, its name in
``NEMO_GYM_CONFIG_PATH``, its directory on ``PYTHONPATH``, as ``nemo_gym/cli/env.py`` does, and zero
code: ``opentelemetry-instrument`` and ``OTEL_SESSION_*`` variables only.

To see what crossed each hop, ``RecordingProxy`` sits in front of Dynamo, the model server and the
resources server. It is a harness part, not a fake: it forwards every request and response byte for
byte (method, path, headers, body; no header added, removed or changed apart from the hop's own
Host/Content-Length/Transfer-Encoding, no cookie jar, no decompression, no retry) to one upstream, so
it changes no header and no routing; it only records. The agent's copy of the config names the
proxies' ports for the model and resources servers; each server's own copy names its real port.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml
from aiohttp import web
from multidict import CIMultiDict

from tests.gym_servers import ROOT, AiohttpServer
from tests.loopback import bind_loopback

GYM_VENV = ROOT / ".venv-gym"
GYM_PYTHON = GYM_VENV / "bin" / "python"
GYM_INSTRUMENT = GYM_VENV / "bin" / "opentelemetry-instrument"
REQUIRE_ENV = "OTEL_SESSION_REQUIRE_GYM"  # set by scripts/test: a missing Gym venv fails, never skips

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def gym_site_packages() -> Path:
    (found,) = GYM_VENV.glob("lib/python*/site-packages")
    return found


@dataclass
class Exchange:
    """One request through a proxy and its answer."""

    method: str
    path: str
    request_headers: list[tuple[str, str]]
    status: int
    response_headers: list[tuple[str, str]]
    response_body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.request_headers:
            if key.lower() == name.lower():
                return value
        return None

    def json(self) -> Any:
        return json.loads(self.response_body)


@dataclass
class RecordingProxy:
    """A byte-for-byte forwarder to ``upstream`` (``http://host:port``) that records each exchange.

    Two harness options, both off by default and neither touching a header or the routing:
    ``fail_first`` answers the first N requests 503 itself (to drive a client's retries), and
    ``adapt_body`` rewrites successful JSON response bodies (NeMo-RL's token wrapper needs
    ``nvext.engine_data`` and ``logprobs``, which Dynamo's mocker does not return).
    """

    upstream: str
    fail_first: int = 0
    adapt_body: Callable[[Any], Any] | None = None
    exchanges: list[Exchange] = field(default_factory=list)
    _server: AiohttpServer | None = None

    def _app(self) -> web.Application:
        client_key = web.AppKey("client", aiohttp.ClientSession)

        async def client(app: web.Application) -> Any:
            app[client_key] = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, timeout=aiohttp.ClientTimeout(120)
            )
            yield
            await app[client_key].close()

        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP)
            if self.fail_first > 0:
                self.fail_first -= 1
                busy = b'{"error": {"message": "busy (harness)"}}'
                self.exchanges.append(
                    Exchange(request.method, request.path, list(headers.items()), 503, [], busy)
                )
                return web.Response(status=503, body=busy, content_type="application/json")
            async with request.app[client_key].request(
                request.method,
                f"{self.upstream}{request.path_qs}",
                headers=headers,
                data=body,
                allow_redirects=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            ) as upstream:
                payload = await upstream.read()
                if self.adapt_body is not None and upstream.status == 200:
                    payload = json.dumps(self.adapt_body(json.loads(payload))).encode()
                reply_headers = CIMultiDict(
                    (k, v) for k, v in upstream.headers.items() if k.lower() not in _HOP
                )
                status = upstream.status
            self.exchanges.append(
                Exchange(
                    request.method,
                    request.path,
                    list(headers.items()),
                    status,
                    list(reply_headers.items()),
                    payload,
                )
            )
            return web.Response(status=status, body=payload, headers=reply_headers)

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.cleanup_ctx.append(client)
        app.router.add_route("*", "/{tail:.*}", forward)
        return app

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.port

    @property
    def authority(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> RecordingProxy:
        self._server = AiohttpServer(self._app()).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.__exit__(*exc)


def starlette_session_of(set_cookie: str) -> dict[str, Any]:
    """The data in a Starlette ``SessionMiddleware`` cookie (base64 JSON, then itsdangerous' signature)."""
    value = set_cookie.split(";", 1)[0].split("=", 1)[1].strip('"')
    payload = value.split(".", 1)[0]
    decoded: dict[str, Any] = json.loads(base64.b64decode(payload + "=" * (-len(payload) % 4)))
    return decoded


@dataclass
class Ports:
    """Every server's real port, bound now so that all configs can name them before anything starts."""

    names: tuple[str, ...]
    sockets: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.names:
            self.sockets[name] = bind_loopback()

    def port(self, name: str) -> int:
        port: int = self.sockets[name].getsockname()[1]
        return port

    def release(self, name: str) -> None:
        """Free the port just before the server that owns it binds it (Gym binds by number)."""
        self.sockets.pop(name).close()


MODEL, RESOURCES, AGENT = "policy_model", "example_multi_turn_gymnasium", "example_multi_turn_gymnasium_agent"


def gym_config(ports: dict[str, int], dynamo_base_url: str, model_name: str) -> dict[str, Any]:
    """The resolved global config dict for the three servers, as Gym's launcher hands it down."""

    def server(kind: str, impl: str, name: str, **extra: Any) -> dict[str, Any]:
        return {kind: {impl: {"entrypoint": "app.py", "host": "127.0.0.1", "port": ports[name], **extra}}}

    return {
        "head_server": {"host": "127.0.0.1", "port": ports["head"]},
        "dry_run": False,
        MODEL: server(
            "responses_api_models",
            "vllm_model",
            MODEL,
            base_url=dynamo_base_url,
            api_key="unused",
            model=model_name,
            return_token_id_information=False,
            uses_reasoning_parser=False,
            # Gym's own request option: Dynamo then says which worker served each turn.
            extra_body={"max_tokens": 8, "nvext": {"extra_fields": ["worker_id"]}},
        ),
        RESOURCES: server("resources_servers", "example_multi_turn_gymnasium", RESOURCES),
        AGENT: server(
            "responses_api_agents",
            "gymnasium_agent",
            AGENT,
            resources_server={"type": "resources_servers", "name": RESOURCES},
            model_server={"type": "responses_api_models", "name": MODEL},
            max_steps=5,
        ),
    }


SERVER_DIRS = {
    MODEL: "responses_api_models/vllm_model",
    RESOURCES: "resources_servers/example_multi_turn_gymnasium",
    AGENT: "responses_api_agents/gymnasium_agent",
}


class GymProcess:
    """One Gym server process, in its own process group, stopped by that group."""

    def __init__(
        self, name: str, config: dict[str, Any], env: dict[str, str], log_dir: Path, *, instrument: bool
    ) -> None:
        """``instrument``: under ``opentelemetry-instrument``, else plain python (``OTEL_SESSION_AUTO``)."""
        self.name = name
        self.port: int = next(iter(next(iter(config[name].values())).values()))["port"]
        directory = gym_site_packages() / SERVER_DIRS[name]
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_", "PYTHON"))}
        self.log = (log_dir / f"{name}.log").open("wb")
        self.proc = subprocess.Popen(
            [str(GYM_INSTRUMENT)] * instrument + [str(GYM_PYTHON), "app.py"],
            cwd=directory,
            env={
                **clean,
                **env,
                "NEMO_GYM_CONFIG_DICT": yaml.safe_dump(config),
                "NEMO_GYM_CONFIG_PATH": name,
                "PYTHONPATH": str(directory),
                "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
            },
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout} s: {self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


async def run_episode(agent_url: str, row: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """POST the agent's ``/run`` for one dataset row, bounded: Gym's client retries a 502 forever."""
    async with httpx.AsyncClient(timeout=timeout) as client:
        reply = await asyncio.wait_for(client.post(f"{agent_url}/run", json=row), timeout)
    reply.raise_for_status()
    result: dict[str, Any] = reply.json()
    return result
