"""The ``otel-session`` command as a user runs it: a subprocess, its exit code and what it prints.

Bad input is checked before anything starts, so those cases end in well under a second each: one line
on stderr naming the flag or variable, exit code 2, no traceback. Every run has a timeout, so a hang
is a failure rather than a stuck suite. The runs that do work use the shared local Dynamo stacks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from io import StringIO
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_session.dynamo import DynamoInstallError, LocalDynamo, _checks
from otel_session.dynamo.cli import Progress, Verdict
from otel_session.dynamo.doctor import diagnose
from otel_session.dynamo.sizing import sizing_note, step_advice
from otel_session.dynamo.workload import Summary
from tests.loopback import AsgiServer

_BIN = Path(sys.executable).parent / "otel-session"
CLI = [str(_BIN)] if _BIN.exists() else [sys.executable, "-m", "otel_session.dynamo.cli"]


def _env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without any otel-session setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(extra or {})
    return env


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 30, prefix: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*(prefix or CLI), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(env),
    )


def assert_one_line(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """Exit ``code``, nothing on stdout, exactly one line on stderr containing every needle."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stdout == "", proc.stdout
    line = lines[0]
    assert line.startswith("otel-session: "), line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A loopback port bound but never listening: connections are refused, and nobody else can take it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


# ------------------------------------------------------------------------------------------ bad flags

BAD_FLAGS = [
    (["--concurrency", "0"], "--concurrency", "1 to 10000"),
    (["--concurrency", "many"], "--concurrency", "whole number"),
    (["--turns", "-1"], "--turns", "1 to 100"),
    (["--prompts", "0"], "--prompts", "1 to 1000"),
    (["--siblings", "0"], "--siblings", "1 to 1000"),
    (["--workers", "0"], "--workers", "1 to 16"),
    (["--turns", "2.5"], "--turns", "whole number"),
    (["--base-url", "http://[::1/v1"], "--base-url", "http://dynamo:8000/v1"),
    (["--base-url", "http:///v1"], "--base-url", "http://dynamo:8000/v1"),
    (["install-dynamo", "--now"], "--now", "--help"),
    (["--affinity-ttl", "0"], "--affinity-ttl", "1 to 31536000"),
    (["--router", "bogus"], "--router", "round-robin"),
    (["--router", "direct"], "--router", "device-aware-weighted"),
    (["--base-url", "notaurl"], "--base-url", "http://dynamo:8000/v1"),
    (["--base-url", "http://host:99999/v1"], "--base-url", "http://dynamo:8000/v1"),
    (["--base-url", "ftp://host/v1"], "--base-url", "http://dynamo:8000/v1"),
    (["--model", " "], "--model", "model name"),
    (["--base-url", "http://127.0.0.1:9/v1", "--workers", "2"], "--workers", "local stack"),
    (["--base-url", "http://127.0.0.1:9/v1", "--router", "kv"], "--router", "local stack"),
    (["--no-such-flag"], "--no-such-flag", "--help"),
    (["--turns"], "--turns", "expected one argument"),
    (["doctor"], "--base-url", "required"),
    (["doctor", "--base-url", "nope"], "--base-url", "http://dynamo:8000/v1"),
    (["doctor", "--base-url", "http://127.0.0.1:9/v1", "--requests", "0"], "--requests", "2 to 1000"),
    (
        ["doctor", "--base-url", "http://127.0.0.1:9/v1", "--kv-tokens", "4096"],
        "--context-tokens",
        "together",
    ),
    (
        [
            "doctor",
            "--base-url",
            "http://127.0.0.1:9/v1",
            "--kv-tokens",
            "9",
            "--context-tokens",
            "2",
            "--prompt-tokens",
            "3",
        ],
        "--prompt-tokens",
        "cannot exceed --context-tokens",
    ),
    (["bogus-command"], "bogus-command", "--help"),
]


@pytest.mark.parametrize(("args", "flag", "accepts"), BAD_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_and_exit_2(args: list[str], flag: str, accepts: str) -> None:
    began = time.monotonic()
    proc = run_cli(*args)
    assert_one_line(proc, 2, flag, accepts)
    assert time.monotonic() - began < 20  # nothing was started or installed


BAD_ENV = [
    ("OTEL_SESSION_TRACING", "maybe", "true/false"),
    ("OTEL_SESSION_DYNAMO_HOSTS", "a:b:c", "a:b:c"),
    ("OTEL_SESSION_DYNAMO_HOSTS", "http://[::1", "not a valid URL"),
    ("OTEL_SESSION_TRUSTED_HOSTS", "http://[::1", "not a valid URL"),
    ("OTEL_SESSION_TRUSTED_HOSTS", "host:notaport", "host:notaport"),
]


@pytest.mark.parametrize(("name", "value", "says"), BAD_ENV, ids=[f"{n}={v}" for n, v, _ in BAD_ENV])
@pytest.mark.parametrize(
    "command", [[], ["doctor", "--base-url", "http://127.0.0.1:9/v1"]], ids=["run", "doctor"]
)
def test_a_bad_variable_is_one_line_and_exit_2_before_anything_starts(
    name: str, value: str, says: str, command: list[str]
) -> None:
    proc = run_cli(*command, env={name: value})
    assert_one_line(proc, 2, name, says)


CREDENTIALS = [
    "http://user:s3cret@127.0.0.1:9/v1",
    "https://user:s3cret@dynamo.example:8443/v1",
    "http://:s3cret@127.0.0.1:9/v1",
    "http://user:s3cret@127.0.0.1:99999/v1",  # a bad port too: still no echo of the password
    "user:s3cret@127.0.0.1:9/v1",  # no scheme
    "http://user:s3c/ret@127.0.0.1:9/v1",  # a slash in the password: urlsplit sees no userinfo
]


@pytest.mark.parametrize("url", CREDENTIALS)
@pytest.mark.parametrize("command", [["doctor"], []], ids=["doctor", "run"])
def test_credentials_in_the_base_url_are_refused_in_one_line_that_never_shows_them(
    url: str, command: list[str]
) -> None:
    proc = run_cli(*command, "--base-url", url)
    assert_one_line(
        proc, 2, "--base-url", "credentials in the URL are not supported", "without user:password@"
    )
    assert "s3c" not in proc.stderr + proc.stdout


def test_diagnose_refuses_credentials_without_repeating_them() -> None:
    with pytest.raises(ValueError, match=r"^base_url: credentials in the URL are not supported") as error:
        diagnose("http://user:s3cret@127.0.0.1:9/v1")
    assert "s3cret" not in str(error.value)


def test_the_command_and_local_dynamo_refuse_a_router_mode_in_the_same_words() -> None:
    """One check, two callers: only the argument's name differs."""
    with pytest.raises(ValueError) as api:
        LocalDynamo(router_mode="kvv")
    line = assert_one_line(run_cli("--router", "kvv"), 2, "argument --router: ")
    words = str(api.value).removeprefix("router_mode: ")
    assert words != str(api.value) and words in line
    assert ", ".join(_checks.ROUTER_MODES) in words


def test_a_dead_base_url_is_one_line_pointing_at_doctor(dead_url: str) -> None:
    line = assert_one_line(run_cli("--base-url", dead_url), 1, dead_url, "doctor --base-url")
    assert "refused" in line.lower()


def test_doctor_against_a_dead_port_reports_and_exits_1(dead_url: str) -> None:
    proc = run_cli("doctor", "--base-url", dead_url, "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    assert [c["name"] for c in report["checks"]] == ["frontend reachable"]
    assert "fix" in report["checks"][0] and "/v1" in report["checks"][0]["fix"]


# ------------------------------------------------------------------------------------------ missing parts

# No real part can uninstall a package from the shared test environment, so this interpreter is told
# to behave as if the `cli` extra were not installed: a meta-path finder that refuses exactly those
# modules, the way Python reacts when they are absent.
WITHOUT = textwrap.dedent(
    """
    import sys
    ABSENT = tuple(sys.argv.pop(1).split(","))
    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ABSENT:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, Absent())
    from otel_session.dynamo.cli import main
    sys.argv[0] = "otel-session"
    sys.exit(main())
    """
)


def _distribution(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


@pytest.mark.parametrize("absent", ["openai,httpx2", "httpx2", "openai"])
@pytest.mark.parametrize(
    "command", [[], ["doctor", "--base-url", "http://127.0.0.1:9/v1"]], ids=["run", "doctor"]
)
def test_without_the_cli_extra_it_installs_exactly_what_is_missing_and_starts_nothing(
    command: list[str], absent: str
) -> None:
    proc = run_cli(*command, prefix=[sys.executable, "-c", WITHOUT, absent])
    line = assert_one_line(proc, 1, *absent.split(","), "pip install")
    assert "installing" not in line  # nothing is installed unasked
    pip = shlex.split(line.split("install with: ", 1)[1])
    assert pip[:4] == [sys.executable, "-m", "pip", "install"], pip
    assert [_distribution(r) for r in pip[4:]] == absent.split(","), pip  # httpx2 is not httpx
    if "openai" in absent:
        assert any(r.startswith("openai>=") for r in pip[4:]), pip  # the extra's floor


@pytest.fixture(scope="module")
def python_without_dynamo(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real interpreter (a bare venv of this one) with no Dynamo installed."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    return str(venv / "bin" / "python")


def test_a_dynamo_interpreter_without_dynamo_is_a_bad_variable_exit_2(python_without_dynamo: str) -> None:
    began = time.monotonic()
    proc = run_cli(env={"OTEL_SESSION_DYNAMO_PYTHON": python_without_dynamo})
    assert_one_line(
        proc, 2, "OTEL_SESSION_DYNAMO_PYTHON: ", python_without_dynamo, "pip install ai-dynamo", "or unset it"
    )
    assert time.monotonic() - began < 20  # nothing was started or installed


def _not_executable(tmp_path: Path) -> str:
    (tmp_path / "python").write_text("")
    return str(tmp_path / "python")


NOT_INTERPRETERS = [
    (lambda tmp_path: str(tmp_path / "missing"), "no such file"),
    (lambda tmp_path: str(tmp_path), "a directory"),
    (_not_executable, "not executable"),
    (lambda tmp_path: "no-such-python-anywhere", "no such command on PATH"),
]


@pytest.mark.parametrize(("make", "says"), NOT_INTERPRETERS, ids=[s for _, s in NOT_INTERPRETERS])
def test_a_dynamo_interpreter_that_cannot_run_is_a_bad_variable_exit_2(
    tmp_path: Path, make: Callable[[Path], str], says: str
) -> None:
    python = make(tmp_path)
    proc = run_cli(env={"OTEL_SESSION_DYNAMO_PYTHON": python})
    line = assert_one_line(proc, 2, "OTEL_SESSION_DYNAMO_PYTHON: ", repr(python), says, "or unset it")
    assert "Errno" not in line


def test_local_dynamo_names_a_bad_interpreter_before_anything_starts(
    python_without_dynamo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API refuses what the command refuses, in the same words, under the argument's own name."""
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"^python: .*'/.*missing' \(no such file\); pass another") as api:
        LocalDynamo(python=missing)
    line = assert_one_line(run_cli(env={"OTEL_SESSION_DYNAMO_PYTHON": missing}), 2)
    assert str(api.value).split(": ", 1)[1].split("; ")[0] in line
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_PYTHON", missing)
    with pytest.raises(ValueError, match=r"^OTEL_SESSION_DYNAMO_PYTHON: .*; point OTEL_SESSION_DYNAMO_"):
        LocalDynamo()
    monkeypatch.delenv("OTEL_SESSION_DYNAMO_PYTHON")
    stack = LocalDynamo(python=python_without_dynamo)
    refused = rf"^python: {re.escape(python_without_dynamo)} has no Dynamo.*; or pass another"
    with pytest.raises(DynamoInstallError, match=refused):
        stack.start()
    assert stack.pids == [] and stack.run_dir is None and not stack.running


# ------------------------------------------------------------------------------------------ the demo


def test_the_progress_clock_starts_at_the_first_turn() -> None:
    out = StringIO()
    progress = Progress(total=4, stream=out, enabled=True)
    time.sleep(0.5)  # install and stack start-up happen here, before the first turn
    progress.start()
    for _ in range(4):
        progress.step()
    seconds = [float(s) for s in re.findall(r"turns\s+([\d.]+)s", out.getvalue())]
    assert len(seconds) == 4 and max(seconds) < 0.4, out.getvalue()


def _verdict(stdout: str) -> re.Match[str]:
    found = re.search(r"^verdict: pinned (\d+)/(\d+) vs (\d+)/(\d+)", stdout, re.MULTILINE)
    assert found, stdout
    return found


def test_the_demo_runs_both_arms_and_ends_on_one_verdict_line() -> None:
    proc = run_cli("--prompts", "3", "--siblings", "3", "--turns", "3", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "outside any trajectory" not in proc.stderr  # the batch without sessions is so on purpose
    assert "with sessions" in proc.stdout and "without (no header)" in proc.stdout
    pinned, total, pinned_without, total_without = map(int, _verdict(proc.stdout).groups())
    assert (pinned, total, total_without) == (9, 9, 9)
    assert pinned_without < 9  # round-robin without a header moves trajectories between workers
    assert re.search(
        r"hit rate \d+% vs \d+%; TTFT ([\d.]+x (faster|slower)|about the same) with sessions",
        proc.stdout.strip().splitlines()[-1],
    )
    assert proc.stdout.strip().splitlines()[-1].startswith("verdict: ")
    # the run-time evidence beside the verdict: 9 sessions x 2 later turns, none moved, no warning
    assert re.search(
        r"dynamo 127\.0\.0\.1:\d+: 0 of 18 later turns missed the cache, 0 of 18 moved", proc.stdout
    )
    assert "warnings: none" in proc.stdout and "not holding" not in proc.stderr


def _summary(mean_ttft_ms: float) -> Summary:
    return Summary(
        trajectories=9,
        pinned=9,
        prompts_spread=3,
        prompts=3,
        hit_rate=0.5,
        ceiling=0.9,
        mean_ttft_ms=mean_ttft_ms,
        p90_ttft_ms=mean_ttft_ms * 2,
        mean_switches=0.0,
        errors=0,
    )


@pytest.mark.parametrize(
    ("with_ms", "without_ms", "says"),
    [
        (40.0, 52.0, "TTFT 1.3x faster with sessions"),
        (52.0, 40.0, "TTFT 1.3x slower with sessions"),
        (40.0, 41.0, "TTFT about the same with sessions (within 5%)"),
        (41.0, 40.0, "TTFT about the same with sessions (within 5%)"),
    ],
)
def test_the_verdict_says_which_way_ttft_moved(with_ms: float, without_ms: float, says: str) -> None:
    line = Verdict.of(_summary(with_ms), _summary(without_ms)).line
    assert line.split("; ")[2] == says, line


def test_one_worker_pins_either_way_and_the_verdict_says_it_proves_nothing() -> None:
    proc = run_cli(
        "--workers", "1", "--prompts", "1", "--siblings", "3", "--turns", "2", "--quiet", timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _verdict(proc.stdout).groups() == ("3", "3", "3", "3")
    assert "cannot tell them apart" in proc.stdout


def test_against_a_deployment_that_pins_json_has_both_arms(dynamo_stack: LocalDynamo) -> None:
    proc = run_cli(
        "--base-url", dynamo_stack.base_url, "--json", "--prompts", "1", "--turns", "2", timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "outside any trajectory" not in proc.stderr  # the batch without sessions is so on purpose
    doc = json.loads(proc.stdout)
    assert doc["model"] == dynamo_stack.model_name and doc["verdict"]["pinned"] is True
    on, off = doc["with_sessions"], doc["without_sessions"]
    assert on["summary"]["pinned"] == on["summary"]["trajectories"] == 3
    assert off["summary"]["trajectories"] == 3
    ids = {t["session_id"] for t in on["trajectories"]}
    assert len(ids) == 3
    assert doc["verdict"]["line"].startswith("pinned 3/3 vs ")
    [seen] = doc["evidence"].values()
    assert seen["worker_switches"] == 0 and seen["worker_pairs"] == 3 and seen["warnings"] == []


def test_against_a_deployment_that_does_not_pin_it_exits_1_and_points_at_doctor(
    dynamo_stack_no_affinity: LocalDynamo,
) -> None:
    url = dynamo_stack_no_affinity.base_url
    proc = run_cli("--base-url", url, "--quiet", timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"otel-session doctor --base-url {url}" in proc.stderr
    pinned, total, _, _ = map(int, _verdict(proc.stdout).groups())
    assert pinned < total
    assert "warnings: affinity" in proc.stdout  # the evidence printed beside the verdict
    assert proc.stderr.count("session affinity is not holding") == 1


def test_a_model_the_local_stack_does_not_serve_is_one_line_before_it_starts() -> None:
    assert_one_line(run_cli("--model", "m"), 2, "--model 'm'", "otel-session-tiny")


def test_a_model_the_deployment_does_not_serve_is_one_line(dynamo_stack: LocalDynamo) -> None:
    proc = run_cli("--base-url", dynamo_stack.base_url, "--model", "m")
    assert_one_line(proc, 1, "--model 'm'", dynamo_stack.model_name)


@pytest.fixture
def frontend_listing_no_model() -> Iterator[str]:
    """A loopback frontend up before any worker registered: ``/v1/models`` answers with an empty list."""

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": []})

    with AsgiServer(Starlette(routes=[Route("/v1/models", models)])) as server:
        yield server.url + "/v1"


@pytest.mark.parametrize("model", [["--model", "m"], []], ids=["--model", "default"])
def test_a_frontend_listing_no_model_yet_is_one_line_saying_so(
    frontend_listing_no_model: str, model: list[str]
) -> None:
    proc = run_cli("--base-url", frontend_listing_no_model, *model)
    says = f"{frontend_listing_no_model}/models lists no model (yet)"
    line = assert_one_line(proc, 1, says, "start a worker")
    assert "it serves" not in line
    assert ("--model 'm'" in line) == bool(model)


def test_dynamo_hosts_from_the_environment_are_kept_and_said_so(dynamo_stack: LocalDynamo) -> None:
    proc = run_cli(
        "--base-url", dynamo_stack.base_url, "--json", "--prompts", "1", "--turns", "2",
        env={"OTEL_SESSION_DYNAMO_HOSTS": "garbage"}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["verdict"]["pinned"] is True
    assert f"OTEL_SESSION_DYNAMO_HOSTS='garbage' kept; {dynamo_stack.host} added" in proc.stderr


BOUNDARY_WARNING = "otel-session: a request to"
ADOPT_WARNING = "otel-session: OTEL_SESSION_ADOPT='bad' is not understood"
DOCTOR_AND_RUN = {
    "doctor": ["doctor", "--requests", "2", "--base-url"],
    "run": ["--prompts", "1", "--turns", "2", "--quiet", "--base-url"],
}


@pytest.mark.parametrize("command", list(DOCTOR_AND_RUN))
def test_a_warning_about_a_variable_is_shown_once_per_run(dynamo_stack: LocalDynamo, command: str) -> None:
    """The command calls configure() for its checks and again for the run: one warning, not two."""
    proc = run_cli(
        *DOCTOR_AND_RUN[command], dynamo_stack.base_url, env={"OTEL_SESSION_ADOPT": "bad"}, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.count(ADOPT_WARNING) == 1, proc.stderr


def test_doctor_does_not_warn_about_the_requests_it_sends_without_a_session_on_purpose(
    dynamo_stack: LocalDynamo,
) -> None:
    proc = run_cli(
        "doctor", "--base-url", dynamo_stack.base_url, "--requests", "2",
        env={"OTEL_SESSION_ADOPT": "bad"}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Every check passed: the header reaches the router on every session request" in proc.stdout
    assert BOUNDARY_WARNING not in proc.stderr and "outside any trajectory" not in proc.stderr
    assert ADOPT_WARNING in proc.stderr  # the library's other warnings still reach the user


# ------------------------------------------------------------------------------------------ doctor


def test_doctor_on_a_pinning_deployment_passes_with_no_fix_and_counts_only_session_requests(
    versioned_dynamo_stack: LocalDynamo,
) -> None:
    url = versioned_dynamo_stack.base_url
    proc = run_cli("doctor", "--base-url", url, "--requests", "4", "--json", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is True and all(c["ok"] for c in checks.values())
    assert not any("fix" in c for c in checks.values())  # nothing to fix when it passes
    # 3 probe sessions x 4 requests were meant to carry the header; the 1 + 4 free ones were not
    assert checks["header sent"]["detail"].startswith("12 of 12 requests sent in a session")
    assert checks["no header outside a session"]["detail"].startswith("0 requests")
    assert checks["session table"]["detail"] == " ".join(sizing_note())  # sizing's words, not a copy


def test_doctor_on_a_deployment_without_affinity_names_the_flag(
    dynamo_stack_no_affinity: LocalDynamo,
) -> None:
    proc = run_cli("doctor", "--base-url", dynamo_stack_no_affinity.base_url, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "[FAIL] sessions pinned" in proc.stdout
    assert "--router-session-affinity-ttl-secs" in proc.stdout
    assert "--layout kv" in proc.stdout  # and where affinity off is the recommended setting


def test_doctor_for_one_kv_frontend_takes_affinity_off_as_the_recommended_setting(
    dynamo_stack_no_affinity: LocalDynamo,
) -> None:
    url = dynamo_stack_no_affinity.base_url
    proc = run_cli("doctor", "--base-url", url, "--layout", "kv", "--json", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert (
        checks["sessions pinned"]["ok"]
        and "affinity is off, what kv routing needs" in checks["sessions pinned"]["detail"]
    )
    assert checks["step time"]["detail"] == step_advice("kv")
    assert checks["header sent"]["ok"]  # the header still leaves the process on every session request


def test_doctor_turns_affinity_on_only_where_each_worker_holds_the_group_it_is_given(
    dynamo_stack: LocalDynamo,
) -> None:
    """4 workers, 2 prompts x 4 siblings: doctor's groups:2 gives each worker one group. Turns
    re-reading 2,500 tokens do not fit 4,096 twice; with the 2,170 the siblings share kept once, they do."""
    shape = ["--layout", "kv", "--prompts", "2", "--siblings", "4", "--kv-tokens", "4096"]
    steps = {}
    for shared in ([], ["--prompt-tokens", "2170"]):
        args = ["doctor", "--base-url", dynamo_stack.base_url, *shape, "--context-tokens", "2500", *shared]
        proc = run_cli(*args, "--json", timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        steps[bool(shared)] = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}["step time"]["detail"]
    assert steps[False] == step_advice("kv", False, "groups:2")
    assert steps[True] == step_advice("kv", True, "groups:2")
    assert "OTEL_SESSION_SIBLINGS=groups:2" in steps[True] and "turn session affinity on" in steps[True]


def test_doctor_with_a_model_the_frontend_does_not_serve_names_the_ones_it_does(
    dynamo_stack: LocalDynamo,
) -> None:
    proc = run_cli("doctor", "--base-url", dynamo_stack.base_url, "--model", "no-such-model", timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "[FAIL] model served: 'no-such-model' is not among the models listed" in proc.stdout
    assert dynamo_stack.model_name in proc.stdout
    assert "session table full" not in proc.stdout  # not the fix for a request that failed with a 404
