"""``otel-session doctor``: does this Dynamo deployment actually pin sessions, and if not, why?

Three probes, each through the real client path a rollout uses: is the frontend reachable and which
model does it serve; does Dynamo say which worker served a request (needed to see anything); do
requests of one session land on one worker while requests without a session spread. Every failed
check comes with the change that fixes it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, TextIO
from urllib.parse import urlsplit

import otel_session
from otel_session import SESSION_HEADER, _fleet, trajectory
from otel_session.dynamo import NVEXT_EXTRA_BODY, _checks, worker_id_of
from otel_session.dynamo._library_log import no_session_on_purpose
from otel_session.dynamo.sizing import (
    FULL_ANSWER,
    caches_hold,
    prompts_outnumber,
    prompts_split,
    sibling_group_size,
    siblings_note,
    siblings_setting,
    sizing_note,
    step_advice,
    step_rule,
)

AFFINITY_FLAG = "--router-session-affinity-ttl-secs"


@dataclass
class Check:
    """One finding: a name, whether it passed, what was seen, and what to do when it did not pass."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass
class Report:
    base_url: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def add(self, name: str, ok: bool, detail: str, fix: str = "") -> bool:
        self.checks.append(Check(name, ok, detail, fix))
        return ok

    def to_dict(self) -> dict[str, Any]:
        """A passing check has no ``fix``: there is nothing to do about it."""
        checks = [
            {k: v for k, v in vars(check).items() if k != "fix" or not check.ok} for check in self.checks
        ]
        return {"base_url": self.base_url, "ok": self.ok, "checks": checks}

    def render(self, out: TextIO) -> None:
        out.write(f"otel-session doctor: {self.base_url}\n")
        for check in self.checks:
            out.write(f"  [{'ok' if check.ok else 'FAIL'}] {check.name}: {check.detail}\n")
            if not check.ok and check.fix:
                out.write(f"         fix: {check.fix}\n")
        out.write(
            "\n"
            + (
                "Every check passed: the header reaches the router on every session request, and the "
                "step time line says whether the router should pin it.\n"
                if self.ok
                else "Sessions are NOT pinned yet; apply the fix above and run doctor again.\n"
            )
        )


def _recording_transport(sent: list[tuple[bool, str | None]]) -> Any:
    """A real HTTP transport that notes, as each request leaves this process, whether it was sent
    inside a trajectory (so meant to carry the header) and the header it did carry."""
    import httpx2

    class Recording(httpx2.HTTPTransport):
        def handle_request(self, request: httpx2.Request) -> httpx2.Response:
            meant = otel_session.current_session_id() is not None
            sent.append((meant, request.headers.get(SESSION_HEADER)))
            return super().handle_request(request)

    return Recording()


def diagnose(
    base_url: str,
    *,
    model: str | None = None,
    requests: int = 6,
    sessions: int = 3,
    batch: tuple[int, int] | None = None,
    layout: str | None = None,
    caches: tuple[int, int] | None = None,
    prompt_tokens: int = 0,
) -> Report:
    """Probe ``base_url`` (an OpenAI-compatible Dynamo frontend ending in ``/v1``); ``layout``
    (``sizing.LAYOUTS``) says what the router can see, so sessions that do not pin on one kv frontend
    read as the setting recommended there, not as a failure. ``caches``: (KV tokens per worker,
    tokens of one trajectory's longest context), checked against ``batch`` and the fleet's size with
    siblings grouped as doctor recommends, each group keeping its shared ``prompt_tokens`` once.

    A URL that is not one, or that carries credentials (``user:password@``), is a :class:`ValueError`
    that does not repeat them: the report prints the URL. Some probes go outside any trajectory on
    purpose: the library's line about such a request is not logged for them (it is logged once per
    process, so a later one of the caller's is not told either).
    """
    import httpx2
    import openai

    try:
        base_url = _checks.base_url(base_url)
    except ValueError as exc:
        raise ValueError(f"base_url: {exc}") from None
    report = Report(base_url)
    netloc = urlsplit(base_url).netloc
    try:
        listed = httpx2.get(base_url.rstrip("/") + "/models", timeout=10).json().get("data") or []
    except Exception as exc:
        report.add(
            "frontend reachable",
            False,
            f"{type(exc).__name__}: {exc}",
            "check the URL (it ends in /v1) and that the Dynamo frontend is running",
        )
        return report
    # Whatever answers there may not be Dynamo at all: anything but a list of models is "none".
    items = listed if isinstance(listed, list) else []
    names = [str(item["id"]) for item in items if isinstance(item, dict) and item.get("id")]
    if not report.add(
        "frontend reachable",
        bool(names),
        f"models: {', '.join(names) or 'none'}",
        "no model is registered: start at least one worker for the model",
    ):
        return report
    if model is not None and not report.add(
        "model served",
        model in names,
        f"{model!r} is {'' if model in names else 'not '}among the models listed",
        f"pass one the frontend serves: {', '.join(names)}",
    ):
        return report
    model = model or names[0]

    sent: list[tuple[bool, str | None]] = []
    client = openai.OpenAI(
        base_url=base_url,
        api_key="unused",
        max_retries=1,
        http_client=httpx2.Client(transport=_recording_transport(sent), timeout=60),
    )
    rng = random.Random(time.time_ns())

    def ask() -> int | None:
        text = " ".join(str(rng.random()) for _ in range(8))  # distinct prompts: no accidental prefix pinning
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=1,
            extra_body=NVEXT_EXTRA_BODY,
        )
        return worker_id_of(response)

    # Its probes are no siblings: under any OTEL_SESSION_SIBLINGS each carries its own session (under
    # fleet a process's first attempts would go without one, and a healthy router would fail here).
    otel_session.configure(dynamo_hosts=[netloc], siblings="attempt")
    try:
        with no_session_on_purpose():  # the library's "sent outside any trajectory" is about these
            first = ask()
        if not report.add(
            "worker reported",
            first is not None,
            f"responses name worker {first}" if first is not None else "no nvext.worker_id",
            "Dynamo (1.3.0.post1 and 1.6.1 both) reports the serving worker when a request asks for "
            "nvext.extra_fields=['worker_id']: is a proxy in front of it dropping nvext from the body "
            "or the response?",
        ):
            return report
        with no_session_on_purpose():
            free = {ask() for _ in range(requests)}
        pinned: list[set[int | None]] = []
        for _ in range(sessions):
            with trajectory():
                pinned.append({ask() for _ in range(requests)})
    except Exception as exc:
        report.add(
            "requests succeed",
            False,
            f"{type(exc).__name__}: {exc}",
            "a request failed; if it failed only with a session, the session ID may be over 256 bytes "
            f"(HTTP 400) or Dynamo's session table full ({FULL_ANSWER} for new sessions; see "
            "--router-session-affinity-ttl-secs and the capacity rule)",
        )
        return report
    finally:
        otel_session.unconfigure()
        client.close()

    meant = [header for in_session, header in sent if in_session]
    carried = sum(1 for header in meant if header)
    report.add(
        "header sent",
        carried == len(meant) > 0,
        f"{carried} of {len(meant)} requests sent in a session left this process with {SESSION_HEADER}",
        "otel-session did not add the header: is this host in OTEL_SESSION_DYNAMO_HOSTS?",
    )
    stray = sum(1 for in_session, header in sent if not in_session and header)
    report.add(
        "no header outside a session",
        stray == 0,
        f"{stray} requests sent outside a session carried {SESSION_HEADER}",
        "something else in this process sets the header on every request: remove it",
    )
    report.add("requests without a session", True, f"spread over {len(free)} worker(s)")
    stuck = sum(1 for workers in pinned if len(workers) == 1)
    fleet = _workers(base_url)
    holds = None
    setting = siblings_setting(fleet, *batch) if batch is not None and fleet else None
    if caches is not None and batch is not None and fleet:
        group = sibling_group_size(fleet, *batch)
        holds = caches_hold(fleet, batch[0] * batch[1], caches[1], caches[0], group, prompt_tokens)
    if len(free) == 1 and stuck == sessions:
        report.add(
            "sessions pinned",
            False,
            "every request went to one worker, with or without a session, so affinity cannot be told apart",
            "run several workers (or a router that spreads load, e.g. --router-mode round-robin) and "
            "run doctor again",
        )
    elif layout == "kv" and stuck < sessions and not holds:
        report.add(
            "sessions pinned",
            True,
            f"{stuck} of {sessions} probe sessions stayed on one worker: affinity is off, what kv routing "
            "needs unless each worker's KV cache holds its share of a step (the header is harmless)",
        )
    else:
        report.add(
            "sessions pinned",
            stuck == sessions,
            f"{stuck} of {sessions} probe sessions stayed on one worker over {requests} requests",
            f"start the Dynamo frontend with {AFFINITY_FLAG} 600 (session affinity is off by default); "
            f"if it is on, a proxy or ingress in front of Dynamo is dropping the {SESSION_HEADER} header: "
            "let it through, and hash on it if several frontends sit behind a load balancer (with kv "
            "routing, affinity off is recommended unless siblings are grouped one group per worker in "
            "caches that hold it: pass --layout kv)",
        )
    split = batch is not None and bool(fleet) and prompts_split(fleet or 0, *batch)
    outnumber = batch is not None and bool(fleet) and prompts_outnumber(fleet or 0, *batch)
    report.add("step time", True, step_advice(layout, holds, setting, split, outnumber))
    report.add("session table", True, " ".join(sizing_note()))
    if batch is not None:
        report.add("sibling keying", True, siblings_note(fleet, *batch))
        report.add("session table per step", True, step_rule(batch[0] * batch[1]))
    return report


def _workers(base_url: str) -> int | None:
    """The fleet's size from the frontend's ``/health`` (``None``: an old frontend or a proxy)."""
    parts = urlsplit(base_url)
    try:
        origin = (parts.scheme.lower(), parts.hostname or "", parts.port)
    except ValueError:  # a port out of range: the probes have said so already
        return None
    # bounded in total like the library's own read (a /health trickling a byte at a time included);
    # an old frontend or a proxy without /health: advise without the fleet's size
    return _fleet.read(origin, time.monotonic() + 10)[0] or None
