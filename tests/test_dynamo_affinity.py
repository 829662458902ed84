"""Against a real Dynamo (frontend + mocker workers on loopback): the header is worth something.

Every test runs once per Dynamo version of ``tests.dynamo_fixtures.DYNAMO_PYTHONS``: 1.6.1 and
NeMo-RL's pin, 1.3.0.post1. Requests are driven only through otel-session (no hand-set headers);
Dynamo's own ``nvext.worker_id`` says which worker served each turn.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import httpx
import openai
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import otel_session
from otel_session.dynamo import NVEXT_EXTRA_BODY, LocalDynamo, worker_id_of
from otel_session.dynamo.workload import Workload, run_batch, summarize
from tests.loopback import AsgiServer

WORKLOAD = Workload(prompts=3, siblings=3, turns=4, prompt_words=600, turn_words=60)  # 9 trajectories: odd


def test_every_concurrent_trajectory_stays_on_one_worker_and_siblings_spread(
    versioned_dynamo_stack: LocalDynamo,
) -> None:
    # Each sibling under no parent (``attempt``): the default sizes a step's siblings one group per
    # worker from its first step on (3 prompts of 3 on 4 workers: each prompt's 3 on one worker),
    # which tests/test_fleet.py's quick run on a real fleet checks; here every session is placed alone.
    otel_session.configure(dynamo_hosts=versioned_dynamo_stack.hosts, siblings="attempt")
    results = asyncio.run(
        run_batch(
            versioned_dynamo_stack.base_urls, versioned_dynamo_stack.model_name, WORKLOAD, concurrency=9
        )
    )
    summary = summarize(results)
    assert summary.errors == 0, [r.error for r in results]
    assert [len(r.turns) for r in results] == [4] * 9
    assert summary.pinned == 9, [r.workers for r in results]
    # Siblings are sessions of their own: keyed on the prompt (as some RL stacks key), every prompt's
    # siblings would share one worker (0 spread). Round-robin over 4 workers can still put one prompt's
    # 3 siblings on one worker by chance, when their first requests happen to go out 4 apart (1 order
    # of the 9 in 84 per prompt), and never two prompts' at once: so at least 2 of 3 spread.
    assert summary.prompts_spread >= 2, [r.workers for r in results]
    assert len({r.session_id for r in results}) == 9


def test_without_otel_session_the_same_trajectories_scatter(versioned_dynamo_stack: LocalDynamo) -> None:
    """The control: same stack, same workload, otel-session not configured."""
    results = asyncio.run(
        run_batch(
            versioned_dynamo_stack.base_urls, versioned_dynamo_stack.model_name, WORKLOAD, concurrency=9
        )
    )
    summary = summarize(results)
    assert summary.errors == 0
    assert summary.pinned < 9


def test_affinity_off_at_the_frontend_the_header_is_harmless(
    versioned_dynamo_stack_no_affinity: LocalDynamo,
) -> None:
    stack = versioned_dynamo_stack_no_affinity
    otel_session.configure(dynamo_hosts=stack.hosts)
    results = asyncio.run(run_batch(stack.base_urls, stack.model_name, WORKLOAD, concurrency=9))
    summary = summarize(results)
    assert summary.errors == 0
    assert sum(len(r.turns) for r in results) == 36
    assert summary.pinned < 9  # nothing pins without the frontend flag: routing is unchanged


class FlakyProxy:
    """A server in the middle that answers 500 to the first try of every request, then forwards.

    It forwards the incoming headers as a token wrapper does, so the session it received reaches Dynamo.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.injected = 0
        self.retry_counts: Counter[str] = Counter()
        app = Starlette(routes=[Route("/v1/{path:path}", self.handle, methods=["GET", "POST"])])
        self.served = AsgiServer(app)
        self.client = httpx.AsyncClient(timeout=60)

    async def handle(self, request: Request) -> Response:
        retry = request.headers.get("x-stainless-retry-count", "0")
        self.retry_counts[retry] += 1
        if retry == "0":
            self.injected += 1
            return JSONResponse({"error": "injected"}, status_code=500)
        keep = {k: v for k, v in request.headers.items() if k.lower() not in {"host", "content-length"}}
        upstream = await self.client.post(
            f"{self.upstream}/{request.path_params['path']}", content=await request.body(), headers=keep
        )
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    def __enter__(self) -> FlakyProxy:
        self.url = self.served.__enter__().url
        return self

    def __exit__(self, *exc: object) -> None:
        self.served.__exit__()


def test_openai_retry_after_a_5xx_stays_on_the_trajectorys_worker(
    versioned_dynamo_stack: LocalDynamo,
) -> None:
    with FlakyProxy(versioned_dynamo_stack.base_url) as proxy:
        otel_session.configure(dynamo_hosts=[proxy.url, *versioned_dynamo_stack.hosts])
        results = asyncio.run(
            run_batch([proxy.url + "/v1"], versioned_dynamo_stack.model_name, WORKLOAD, concurrency=9)
        )
    summary = summarize(results)
    assert summary.errors == 0, [r.error for r in results]
    assert proxy.injected == 36 and proxy.retry_counts["1"] == 36  # every turn failed once, then retried
    assert summary.pinned == 9, [r.workers for r in results]


def test_sigterm_of_the_bound_worker_rebinds_the_session_and_the_trajectory_finishes(
    local_dynamo_factory: Callable[..., LocalDynamo], dynamo_python: str
) -> None:
    stack = local_dynamo_factory(workers=3, affinity_ttl_secs=300, python=dynamo_python)
    otel_session.configure(dynamo_hosts=stack.hosts)
    client = openai.OpenAI(base_url=stack.base_url, api_key="k", max_retries=2)
    messages = [{"role": "user", "content": "a long task " * 50}]

    def turn() -> int:
        response = client.chat.completions.create(
            model=stack.model_name,
            messages=messages,
            max_tokens=4,
            extra_body=NVEXT_EXTRA_BODY,  # type: ignore[arg-type]
        )
        messages.append({"role": "assistant", "content": response.choices[0].message.content or ""})
        messages.append({"role": "user", "content": "and then?"})
        worker = worker_id_of(response)
        assert worker is not None
        return worker

    with otel_session.trajectory() as traj:
        before = [turn() for _ in range(3)]
        assert len(set(before)) == 1
        stack.stop_worker(stack.worker_index(before[0]))
        after = [turn() for _ in range(3)]
        assert otel_session.current_session_id() == traj.session_id
    assert len(set(after)) == 1 and after[0] != before[0]  # re-bound once, then pinned again
    client.close()


def test_turns_alternating_between_two_frontend_replicas(
    local_dynamo_factory: Callable[..., LocalDynamo], dynamo_python: str
) -> None:
    """Replicas behind a load balancer: Dynamo 1.6.1 frontends share session bindings over the event
    plane, so alternating turns stay on one worker. 1.3.0.post1's do not: each replica pins a session
    on its own, so a session must always reach the same frontend (hash the header at the ingress)."""
    stack = local_dynamo_factory(workers=3, frontends=2, affinity_ttl_secs=300, python=dynamo_python)
    otel_session.configure(dynamo_hosts=stack.hosts)
    results = asyncio.run(
        run_batch(stack.base_urls, stack.model_name, WORKLOAD, concurrency=9)
    )  # turn t -> fe t%2
    summary = summarize(results)
    assert summary.errors == 0, [r.error for r in results]
    workers = [r.workers for r in results]
    if stack.dynamo_version == "1.3.0.post1":
        assert all(len(set(w[0::2])) == len(set(w[1::2])) == 1 for w in workers), workers  # per replica
        assert summary.pinned < 9, workers  # but the replicas do not agree
    else:
        assert summary.pinned == 9, workers
