"""The smallest OpenEnv environment TRL's harness rollout can drive, on openenv's public base classes.

A stand-in environment, written here because openenv 0.10.0 ships none of its own (only templates;
its environments are separate packages, mostly Docker images): ``StepEnvironment`` (openenv's
``Environment``) answers each ``advance`` tool call with an observation and reward 1, never done, so the
rollout ends when the model answers without a tool call. Everything around it is openenv's real code:
it is served by ``create_fastapi_app`` (``/ws``, uvicorn, on 127.0.0.2: neither a router nor trusted,
so it must receive nothing of otel-session's), each rollout's session is a ``StepEnvSessionAdapter``
over a ``GenericEnvClient`` (a WebSocket connection per session), and ``MCPHarnessAdapter`` runs the
turns. TRL calls ``harness_session_factory()`` in its spawned rollout child for the factory, so the driver
passes ``functools.partial(StepSessionFactory, url)``, pickled: module-level.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import Tool
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.generic_client import GenericEnvClient
from openenv.core.harness import ResourceSessionFactory, StepEnvSessionAdapter

ADVANCE = Tool(  # not "step": openenv reserves that name for its orchestration controls
    name="advance",
    description="Take one step of the task.",
    input_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
)


class StepAction(Action):
    n: int


class StepObservation(Observation):
    text: str = ""


class StepEnvironment(Environment[StepAction, StepObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> StepObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return StepObservation(text="ready", reward=0.0)

    def step(self, action: StepAction, timeout_s: float | None = None, **kwargs: Any) -> StepObservation:
        self._state.step_count += 1
        return StepObservation(text=f"observation {action.n}", reward=1.0)

    @property
    def state(self) -> State:
        return self._state


@dataclass
class StepSessionFactory(ResourceSessionFactory[StepEnvSessionAdapter]):
    """One WebSocket session of the environment at ``url`` per rollout; the task is TRL's prompt."""

    url: str

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> StepEnvSessionAdapter:
        return StepEnvSessionAdapter(
            GenericEnvClient(base_url=self.url),
            task=task,
            seed=seed,
            episode_id=episode_id,
            tool_specs=[ADVANCE],
            action_builder=lambda name, arguments: {"n": int(arguments.get("n", 0))},
            initial_messages_builder=lambda result, prompt: list(prompt),
        )


@dataclass
class Served:
    """The environment's server in a thread of the driver, recording each connection's header names."""

    host: str = "127.0.0.2"
    url: str = ""
    headers: list[list[str]] = field(default_factory=list)
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            self.headers.append(sorted(k.decode("latin-1").lower() for k, _ in scope["headers"]))
        await self._inner(scope, receive, send)

    def __enter__(self) -> Served:
        self._inner = create_fastapi_app(StepEnvironment, StepAction, StepObservation, max_concurrent_envs=8)
        config = uvicorn.Config(self._app, host=self.host, port=0, log_level="warning", interface="asgi3")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        for _ in range(200):
            if self._server.started:
                break
            threading.Event().wait(0.05)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=10)
