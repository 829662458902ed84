"""``otel-session``: show, against a real Dynamo, what one session per trajectory changes.

With no arguments it starts a local Dynamo stack (frontend and mocker workers on loopback, session
affinity on) and runs the same GRPO-style batch twice through the openai SDK: once with otel-session
delivering a session per trajectory, once with no session header at all. It prints both side by side
and one verdict line. ``--base-url`` does the same against a deployment you already have; ``doctor``
tells whether that deployment pins sessions and, if not, what to change.

Every flag and every ``OTEL_SESSION_*`` variable is checked before anything starts: a mistake is one
line naming it and what it accepts, exit code 2 (the flags shared with :class:`LocalDynamo` by the same
checks, ``_checks``). Missing packages are named with the one command that installs them, before any
stack or install begins.

Why one module of some 600 lines: it is the whole command, each part written for this command only
(flags, up-front checks, progress, the side-by-side table, the three subcommands); the work itself
is in ``workload`` and ``doctor``.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, NoReturn, TextIO
from urllib.parse import urlsplit

import otel_session
from otel_session import _evidence, _faults
from otel_session.dynamo import _checks
from otel_session.dynamo._library_log import each_warning_once, no_session_on_purpose
from otel_session.dynamo.sizing import FULL_ANSWER, LAYOUTS

if TYPE_CHECKING:  # imported when a run starts: a usage mistake is answered without loading them
    from otel_session.dynamo.workload import Summary, TrajectoryResult, Workload

_LOCAL_ONLY = ("workers", "router", "affinity_ttl")
_ENV_DYNAMO_HOSTS = "OTEL_SESSION_DYNAMO_HOSTS"
#: The modules the command needs beyond the library, and the distribution that provides each.
_CLI_MODULES = {"openai": "openai", "httpx2": "httpx2"}


class UsageError(Exception):
    """A flag, variable or combination the command cannot run with: one line, exit code 2."""


class RunError(Exception):
    """The command ran but could not do its job (unreachable frontend, failed start): exit code 1."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (no usage block), so it reads like every other error."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _flag(check: Any, *args: Any) -> Any:
    """An argparse ``type=`` that runs one of the checks ``LocalDynamo`` runs (``_checks``): the same
    rule and words on the command line as in Python, argparse adding the flag's name."""

    def parse(text: str) -> Any:
        try:
            return check(text, *args)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = check.__name__  # argparse names the type in some of its own messages
    return parse


def _whole_text(text: str, low: int, high: int) -> int:
    """A whole number given as text: anything ``int()`` cannot read is refused as itself."""
    try:
        value: object = int(text)
    except ValueError:
        value = text
    return _checks.whole_number(value, low, high)


def _whole(low: int, high: int) -> Any:
    return _flag(_whole_text, low, high)


def _model(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a model name, got an empty string")
    return text.strip()


# ------------------------------------------------------------------------------------------ checks


def _check_environment() -> None:
    """Every ``OTEL_SESSION_*`` variable, read the way the library reads it: by ``configure()``."""
    try:
        if os.environ.get(_ENV_DYNAMO_HOSTS, "").strip():
            otel_session.configure()
        else:  # a placeholder host: no "no Dynamo hosts" warning, the other variables still read
            otel_session.configure(dynamo_hosts=["127.0.0.1"])
    except (ValueError, ImportError) as exc:
        raise UsageError(" ".join(str(exc).split())) from None
    finally:
        otel_session.unconfigure()


def _requirement(distribution: str) -> str:
    """What to pip-install for ``distribution``: the ``cli`` extra's requirement for it when the extra
    names it (this install's own metadata, so it matches pyproject), else the bare name."""
    import importlib.metadata
    import re

    try:
        requires = importlib.metadata.requires("otel-session") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    for requirement in requires:
        spec, _, marker = requirement.partition(";")
        name = re.split(r"[\s\[<>=!~;]", spec.strip(), maxsplit=1)[0]
        if re.search(r"extra\s*==\s*['\"]cli['\"]", marker) and name.lower() == distribution.lower():
            return spec.strip()
    return distribution


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_clients() -> None:
    """The openai SDK (and httpx2 under it) must be there before a stack starts, not after; the
    command offered installs exactly what is missing."""
    missing = [module for module in _CLI_MODULES if not _importable(module)]
    if missing:
        wanted = [_requirement(_CLI_MODULES[module]) for module in missing]
        command = shlex.join([sys.executable, "-m", "pip", "install", *wanted])
        raise RunError(f"{' and '.join(missing)} not installed; install with: {command}")


def _check_local_dynamo(python: str) -> str:
    """Which Dynamo the local stack will run; another interpreter's (``OTEL_SESSION_DYNAMO_PYTHON``,
    already checked to be an executable by ``LocalDynamo``) is asked before anything starts, and one
    without Dynamo is a mistake in that variable, in the words ``LocalDynamo.start()`` would use."""
    from otel_session.dynamo import DYNAMO_VERSION, ENV_DYNAMO_PYTHON, DynamoInstallError, _stack

    if os.path.abspath(python) != os.path.abspath(sys.executable):
        try:
            return _stack.dynamo_version_for(python, ENV_DYNAMO_PYTHON)
        except DynamoInstallError as exc:
            raise UsageError(str(exc)) from None
    return DYNAMO_VERSION  # when missing, LocalDynamo.start() installs it and says so, with progress


# ------------------------------------------------------------------------------------------ output


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per quarter in a log file.

    The clock starts with :meth:`start`, at the first turn: install and stack start-up are not turns.
    """

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.done, self.stream, self.enabled = total, 0, stream, enabled
        self.live = enabled and stream.isatty()
        self._lock = threading.Lock()
        self._began: float | None = None

    def start(self) -> None:
        self._began = time.monotonic()

    def step(self) -> None:
        with self._lock:
            if self._began is None:
                self._began = time.monotonic()
            self.done += 1
            total = max(self.total, 1)
            quarter = self.done * 4 // total != (self.done - 1) * 4 // total
            if self.enabled and (self.live or quarter):
                filled = int(30 * self.done / total)
                elapsed = time.monotonic() - self._began
                bar = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} turns  {elapsed:5.1f}s"
                self.stream.write(("\r" + bar) if self.live else bar + "\n")
                self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()


def _worker_label(worker: int | None, names: dict[int, str]) -> str:
    if worker is None:
        return "?"
    return names.setdefault(worker, f"w{len(names)}")


def _cached(result: TrajectoryResult) -> str:
    later = result.turns[1:]
    prompt = sum(t.prompt_tokens for t in later)
    if not prompt or all(t.cached_tokens is None for t in later):
        return "-"
    return f"{sum(t.cached_tokens or 0 for t in later) / prompt:.0%}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _ttft(summary: Summary) -> str:
    if summary.mean_ttft_ms is None or summary.p90_ttft_ms is None:
        return "n/a"
    return f"{summary.mean_ttft_ms:.0f} / {summary.p90_ttft_ms:.0f} ms"


def _ttft_change(with_sessions: float, without: float) -> str:
    """Mean TTFT with sessions against without, the direction in words: "TTFT 1.3x faster with
    sessions" (without / with), "TTFT 1.3x slower with sessions" (with / without), or "about the same"
    when the larger is under 1.05 times the smaller (it would print as 1.0x)."""
    ratio = max(with_sessions, without) / min(with_sessions, without)
    if f"{ratio:.1f}" == "1.0":
        return "TTFT about the same with sessions (within 5%)"
    return f"TTFT {ratio:.1f}x {'faster' if with_sessions < without else 'slower'} with sessions"


@dataclass
class Verdict:
    """What the two runs showed, as one line and an exit code."""

    line: str
    pinned: bool

    @staticmethod
    def of(on: Summary, off: Summary) -> Verdict:
        parts = [f"pinned {on.pinned}/{on.trajectories} vs {off.pinned}/{off.trajectories}"]
        if on.hit_rate is not None and off.hit_rate is not None:
            parts.append(f"hit rate {_percent(on.hit_rate)} vs {_percent(off.hit_rate)}")
        if on.mean_ttft_ms and off.mean_ttft_ms:
            parts.append(_ttft_change(on.mean_ttft_ms, off.mean_ttft_ms))
        pinned = on.errors == 0 and on.pinned == on.trajectories > 0
        if off.pinned == off.trajectories > 0:
            parts.append("without sessions pinned too, so this run cannot tell them apart (more workers?)")
        return Verdict("; ".join(parts), pinned)


def render(
    with_sessions: Sequence[TrajectoryResult],
    without: Sequence[TrajectoryResult],
    out: TextIO,
    names: dict[int, str] | None = None,
    evidence: dict[str, dict[str, Any]] | None = None,
) -> Verdict:
    """Both runs side by side (one row per trajectory, then the summaries), then the verdict line."""
    from otel_session.dynamo.workload import summarize

    names = {} if names is None else names
    on, off = summarize(with_sessions), summarize(without)
    turns = max((len(r.turns) for r in [*with_sessions, *without]), default=0)
    width = max(3 * turns, 15)
    out.write(f"{'':15}   {'with sessions':{width + 8}}   without (no header)\n")
    out.write(
        f"{'prompt sib':10} {'session':8}  {'workers':{width}} {'cached':>6}   {'workers':{width}} cached\n"
    )
    for a, b in zip(with_sessions, without, strict=False):
        left = " ".join(_worker_label(w, names) for w in a.workers)
        right = " ".join(_worker_label(w, names) for w in b.workers)
        line = (
            f"{a.prompt_index:>6} {a.sibling_index:>3} {a.session_id[:8]:8}  {left:{width}} {_cached(a):>6}"
        )
        line += f"   {right:{width}} {_cached(b):>6}"
        errors = [f"ERROR {r.error}" for r in (a, b) if r.error]
        out.write(line + ("  " + "; ".join(errors) if errors else "") + "\n")
    rows = [
        (
            "trajectories pinned to one worker",
            f"{on.pinned}/{on.trajectories}",
            f"{off.pinned}/{off.trajectories}",
        ),
        (
            "prompts whose siblings spread",
            f"{on.prompts_spread}/{on.prompts}",
            f"{off.prompts_spread}/{off.prompts}",
        ),
        ("prefix-cache hit rate, turns 2+", _percent(on.hit_rate), _percent(off.hit_rate)),
        ("TTFT turns 2+, mean / p90", _ttft(on), _ttft(off)),
        ("failed trajectories", str(on.errors), str(off.errors)),
    ]
    out.write(f"\n{'':34} {'with sessions':>16} {'without':>16}\n")
    for label, left, right in rows:
        out.write(f"{label:34} {left:>16} {right:>16}\n")
    if evidence is not None:
        out.write("\n")
        render_evidence(evidence, out)
    verdict = Verdict.of(on, off)
    out.write(f"\nverdict: {verdict.line}\n")
    return verdict


def render_evidence(summaries: dict[str, dict[str, Any]], out: TextIO) -> None:
    """What otel-session itself saw in the responses of the run with sessions (the run-time evidence
    an application's metrics carry), one line per router, beside the verdict."""
    out.write("run-time evidence (from the responses the client parsed, no extra request):\n")
    if not summaries:
        out.write("  none: no response with usage or a worker id came back in a trajectory\n")
    for router, seen in sorted(summaries.items()):
        warned = ", ".join(seen["warnings"]) or "none"
        out.write(
            f"  {router}: {seen['missed_turns']} of {seen['judged_turns']} later turns missed the cache, "
            f"{seen['worker_switches']} of {seen['worker_pairs']} moved worker, {seen['refused_full']} "
            f"answered {FULL_ANSWER}; warnings: {warned}\n"
        )


# ------------------------------------------------------------------------------------------ commands


def _served_models(base_url: str) -> list[str]:
    """The frontend's model list, through the same SDK the batch uses; one line when unreachable."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=10)
    try:
        return [model.id for model in client.models.list()]
    except Exception as exc:
        cause = exc.__cause__ or exc  # the SDK's "Connection error." hides the useful part
        reason = " ".join(str(cause).split()) or type(cause).__name__
        raise RunError(
            f"cannot list models at {base_url}/models ({reason}); check the URL (it ends in /v1) "
            f"and that the Dynamo frontend runs: otel-session doctor --base-url {base_url}"
        ) from None
    finally:
        client.close()


def _dynamo_hosts(base_urls: Sequence[str], announce: bool = False) -> list[str]:
    """The frontends of this run, plus whatever ``OTEL_SESSION_DYNAMO_HOSTS`` names: kept, not
    silently replaced, and said so (the run must reach its own frontend either way)."""
    raw = os.environ.get(_ENV_DYNAMO_HOSTS, "")
    extra = [p.strip() for p in raw.split(",") if p.strip()]
    own = [urlsplit(url).netloc for url in base_urls]
    if extra and announce:
        print(f"otel-session: {_ENV_DYNAMO_HOSTS}={raw!r} kept; {', '.join(own)} added", file=sys.stderr)
    return [*own, *extra]


async def _both_arms(
    base_urls: Sequence[str], model: str, workload: Workload, concurrency: int, progress: Progress
) -> tuple[list[TrajectoryResult], list[TrajectoryResult], dict[str, dict[str, Any]]]:
    """The batch with sessions, then the same shape with no header at all (new text, so the second
    run finds no cache left warm by the first), and the evidence of the first, read before
    ``unconfigure()`` forgets it."""
    from otel_session.dynamo.workload import run_batch

    progress.start()
    hosts = _dynamo_hosts(base_urls, announce=True)
    if otel_session.configure(dynamo_hosts=hosts).siblings.withholds:
        # fleet withholds a first step it cannot size (a slow /health): this one-step run must show
        print(
            "otel-session: OTEL_SESSION_SIBLINGS=fleet sends a first step it cannot size without "
            "sessions; this one-step run keys siblings as the default (auto) does instead",
            file=sys.stderr,
        )
        otel_session.configure(dynamo_hosts=hosts, siblings="auto")
    _evidence.forget()  # the evidence printed beside the verdict is this arm's
    try:
        on = await run_batch(base_urls, model, workload, concurrency=concurrency, on_turn=progress.step)
        evidence = _evidence.summaries()
    finally:
        otel_session.unconfigure()
    off_load = replace(workload, seed=workload.seed + 1)
    with no_session_on_purpose():  # the library's "not configured" line is about this batch
        off = await run_batch(base_urls, model, off_load, concurrency=concurrency, on_turn=progress.step)
    return on, off, evidence


def _run(args: argparse.Namespace) -> int:
    if args.base_url:
        given = [f"--{name.replace('_', '-')}" for name in _LOCAL_ONLY if getattr(args, name) is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: only for the local stack, not with --base-url")
    args.workers = 4 if args.workers is None else args.workers
    args.router = "round-robin" if args.router is None else args.router
    args.affinity_ttl = 300 if args.affinity_ttl is None else args.affinity_ttl
    _check_environment()
    _check_clients()
    import asyncio

    from otel_session.dynamo.workload import Workload, summarize

    workload = Workload(prompts=args.prompts, siblings=args.siblings, turns=args.turns)
    progress = Progress(
        2 * workload.trajectories * workload.turns, sys.stderr, not args.json and not args.quiet
    )
    names: dict[int, str] = {}
    stack: Any = None
    if args.base_url:
        served = _served_models(args.base_url)
        if not served:
            model = f", so --model {args.model!r} is not served either" if args.model else ""
            raise RunError(
                f"{args.base_url}/models lists no model (yet){model}: no worker has registered one with "
                "the frontend; start a worker (or wait until it registers) and run again"
            )
        if args.model and args.model not in served:
            raise RunError(
                f"--model {args.model!r} is not served at {args.base_url} (it serves: {', '.join(served)})"
            )
        base_urls, model = [args.base_url], args.model or served[0]
    else:
        from otel_session.dynamo import DynamoInstallError, DynamoStartError, LocalDynamo

        try:  # the flags are checked already: what is left is OTEL_SESSION_DYNAMO_PYTHON, named
            stack = LocalDynamo(
                workers=args.workers, router_mode=args.router, affinity_ttl_secs=args.affinity_ttl
            )
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if args.model and args.model != stack.model_name:
            raise UsageError(f"--model {args.model!r}: the local stack serves only {stack.model_name!r}")
        version = _check_local_dynamo(stack.python)
        if not args.json:
            print(
                f"starting a local Dynamo {version}: {args.workers} mocker workers, {args.router} router, "
                "session affinity on ...",
                file=sys.stderr,
                flush=True,
            )
        try:
            stack.start()
        except (DynamoInstallError, DynamoStartError) as exc:
            raise RunError(str(exc)) from None
        base_urls, model = stack.base_urls, stack.model_name
        names = {w.instance_id: f"w{w.index}" for w in stack.workers if w.instance_id is not None}
    try:
        on, off, evidence = asyncio.run(_both_arms(base_urls, model, workload, args.concurrency, progress))
        progress.close()
    finally:
        if stack is not None:
            stack.stop()
    if args.json:
        verdict = Verdict.of(summarize(on), summarize(off))
        document = {
            "base_urls": list(base_urls),
            "model": model,
            "verdict": {"line": verdict.line, "pinned": verdict.pinned},
            "evidence": evidence,
            "with_sessions": {"summary": asdict(summarize(on)), "trajectories": [r.to_dict() for r in on]},
            "without_sessions": {
                "summary": asdict(summarize(off)),
                "trajectories": [r.to_dict() for r in off],
            },
        }
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        verdict = render(on, off, sys.stdout, names, evidence)
    if verdict.pinned:
        return 0
    if args.base_url:
        hint = f"find out why with: otel-session doctor --base-url {args.base_url}"
    else:
        hint = "the local stack should always pin: run otel-session doctor against a stack of your own"
    print(f"otel-session: not every trajectory stayed on one worker; {hint}", file=sys.stderr)
    return 1


def _watch_flags(doctor: argparse.ArgumentParser) -> None:
    """``doctor --watch``: a running deployment's own figures, no probes (``watch.py``)."""
    doctor.add_argument(
        "--watch",
        metavar="METRICS_URL",
        help="read a Prometheus endpoint the deployment serves (the Dynamo frontend's /metrics, or the "
        "application's otel_session_* metrics) every --interval seconds; no probe requests",
    )
    doctor.add_argument("--interval", type=_whole(1, 3600), default=10, help="seconds between reads (10)")
    doctor.add_argument("--samples", type=_whole(1, 100_000), help="stop after this many windows")


def _watch(args: argparse.Namespace) -> int:
    from otel_session.dynamo.watch import shown, watch

    try:
        windows = watch(args.watch, sys.stdout, interval=args.interval, samples=args.samples)
    except (OSError, ValueError, http.client.HTTPException) as exc:  # HTTPException: not HTTP at all
        said = _faults.one_line(str(exc).replace(args.watch, shown(args.watch)))  # a peer's bytes, escaped
        raise RunError(
            f"cannot read {shown(args.watch)} ({said}); give the metrics endpoint's full URL"
        ) from None
    return 1 if any(w.verdict().startswith("BROKEN") for w in windows) else 0


def _doctor(args: argparse.Namespace) -> int:
    if args.watch:
        return _watch(args)
    if not args.base_url:
        raise UsageError("doctor: --base-url is required (or --watch METRICS_URL)")
    if (args.kv_tokens is None) != (args.context_tokens is None):
        raise UsageError("doctor: --kv-tokens and --context-tokens go together (a cache, what it must hold)")
    if args.prompt_tokens and args.context_tokens and args.prompt_tokens > args.context_tokens:
        raise UsageError("doctor: --prompt-tokens (the prompt siblings share) cannot exceed --context-tokens")
    _check_environment()
    _check_clients()
    from otel_session.dynamo.doctor import diagnose

    batch = (args.prompts, args.siblings) if args.prompts and args.siblings else None
    report = diagnose(
        args.base_url, model=args.model, requests=args.requests, batch=batch, layout=args.layout,
        caches=(args.kv_tokens, args.context_tokens) if args.kv_tokens and args.context_tokens else None,
        prompt_tokens=args.prompt_tokens or 0,
    )  # fmt: skip
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        report.render(sys.stdout)
    return 0 if report.ok else 1


def _install(_: argparse.Namespace) -> int:
    from otel_session.dynamo import DYNAMO_VERSION, DynamoInstallError, ensure_dynamo_installed

    try:
        ensure_dynamo_installed(auto_install=True)
    except DynamoInstallError as exc:
        raise RunError(str(exc)) from None
    print(
        f"Dynamo {DYNAMO_VERSION} (frontend and mocker) is installed. `pip check` lists ai-dynamo's "
        "unmet requirements: expected, they are left out on purpose (see the README)."
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="otel-session",
        description="Run GRPO-style multi-turn rollouts with and without otel-session and show whether "
        "every trajectory stays on one Dynamo worker. With no arguments a local Dynamo stack is started.",
    )
    parser.add_argument(
        "--base-url",
        type=_flag(_checks.base_url),
        help="an existing Dynamo frontend, e.g. http://dynamo:8000/v1",
    )
    parser.add_argument("--model", type=_model, help="model name (default: the first one the frontend lists)")
    parser.add_argument("--prompts", type=_whole(1, 1000), default=3, help="prompts in the batch (default 3)")
    parser.add_argument(
        "--siblings", type=_whole(1, 1000), default=3, help="trajectories per prompt (default 3)"
    )
    parser.add_argument("--turns", type=_whole(1, 100), default=4, help="turns per trajectory (default 4)")
    parser.add_argument(
        "--concurrency", type=_whole(1, 10_000), default=16, help="trajectories in flight (default 16)"
    )
    parser.add_argument("--workers", type=_whole(1, 16), help="local stack: mocker workers (default 4)")
    parser.add_argument(
        "--router",
        type=_flag(_checks.router_mode),
        metavar="{" + ",".join(_checks.ROUTER_MODES) + "}",
        help="local stack: router mode (default round-robin)",
    )
    parser.add_argument(
        "--affinity-ttl",
        type=_whole(*_checks.AFFINITY_TTL_RANGE),
        help="local stack: affinity TTL seconds (default 300)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_run)
    sub = parser.add_subparsers(dest="command")
    doctor = sub.add_parser(
        "doctor", help="check that a Dynamo deployment pins sessions, and say how to fix it"
    )
    doctor.add_argument(
        "--base-url",
        type=_flag(_checks.base_url),
        help="the Dynamo frontend, e.g. http://dynamo:8000/v1 (required unless --watch)",
    )
    _watch_flags(doctor)
    doctor.add_argument("--model", type=_model, help="model name (default: the first one the frontend lists)")
    doctor.add_argument(
        "--requests", type=_whole(2, 1000), default=6, help="requests per probe session (default 6)"
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.add_argument("--prompts", type=_whole(1, 1_000_000), help="GRPO batch: prompts per step")
    doctor.add_argument("--siblings", type=_whole(1, 10_000), help="GRPO batch: samples per prompt")
    doctor.add_argument(
        "--layout",
        choices=LAYOUTS,
        help="what the router sees: kv (kv routing, one frontend or replicas) or "
        "unaware (round-robin or random routing)",
    )
    doctor.add_argument(
        "--kv-tokens", type=_whole(1, 10**9), help="KV cache per worker, in tokens (with --context-tokens)"
    )
    doctor.add_argument(
        "--context-tokens",
        type=_whole(1, 10**8),
        help="the longest context a trajectory's turn re-reads (its last turn's prompt), in tokens",
    )
    doctor.add_argument(
        "--prompt-tokens",
        type=_whole(1, 10**8),
        help="the prompt a GRPO group's siblings share, in tokens (cached once per group)",
    )
    doctor.set_defaults(func=_doctor)
    install = sub.add_parser(
        "install-dynamo", help="install Dynamo 1.6.1 for the local stack (pip, --no-deps)"
    )
    install.set_defaults(func=_install)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        with each_warning_once():  # configure() runs more than once per run, each reading the variables
            return int(args.func(args))
    except UsageError as exc:
        print(f"otel-session: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"otel-session: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\notel-session: interrupted; every process it started has been stopped.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `otel-session | head`: the reader left, so nothing more is written
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
