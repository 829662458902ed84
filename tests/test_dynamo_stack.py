"""The local Dynamo stack itself: serving, worker ids, session affinity, fault injection, cleanup.

These tests exercise the stack, not the library, so they set ``X-Dynamo-Session-ID`` by hand.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from otel_session.dynamo import (
    NVEXT_EXTRA_BODY,
    DynamoStartError,
    LocalDynamo,
    cached_tokens_of,
    ensure_model_dir,
    reserve_port,
    ttft_ms_of,
    worker_id_of,
)
from tests.dynamo_fixtures import dynamo_python_for, make_dynamo_fixture

openai = pytest.importorskip("openai")

# A stack of this module's own; the tests that stop workers start their own stacks.
stack = make_dynamo_fixture(scope="module", workers=4, router_mode="round-robin", affinity_ttl_secs=300)

SESSIONS = [f"sess-{i}" for i in range(5)]  # odd: even counts can look pinned under round-robin


def _client(base_url: str) -> Any:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


def _ask(dyn: LocalDynamo, session: str | None, base_url: str | None = None) -> int:
    """One short chat turn; returns the index of the worker that served it."""
    headers = {"X-Dynamo-Session-ID": session} if session else None
    resp = _client(base_url or dyn.base_url).chat.completions.create(
        model=dyn.model_name,
        messages=[{"role": "user", "content": f"hello from {session}"}],
        max_tokens=2,
        extra_body=NVEXT_EXTRA_BODY,
        extra_headers=headers,
    )
    worker_id = worker_id_of(resp)
    assert worker_id is not None
    return dyn.worker_index(worker_id)


MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def _alive(pid: int) -> bool:
    """Running (not a zombie: orphans wait for init to reap them, which may lag)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_model_dir_is_built_once_even_concurrently(tmp_path: Path) -> None:
    code = (
        f"from otel_session.dynamo._model import ensure_model_dir; print(ensure_model_dir({str(tmp_path)!r}))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    outs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outs) == 1
    model = Path(outs.pop())
    assert [p.name for p in tmp_path.iterdir()] == [model.name]  # no temp dirs left behind
    assert all((model / f).is_file() for f in MODEL_FILES)
    assert "chat_template" in json.loads((model / "tokenizer_config.json").read_text())
    assert ensure_model_dir(tmp_path) == model


def test_serves_chat_completion_with_worker_id(stack: LocalDynamo) -> None:
    assert stack.base_url == f"http://{stack.host}/v1"
    assert stack.host.startswith("127.0.0.1:")
    assert len(stack.worker_ids) == len(set(stack.worker_ids)) == 4
    client = _client(stack.base_url)
    messages = [{"role": "user", "content": "The trace session worker reports a latency budget."}]

    resp = client.chat.completions.create(
        model=stack.model_name, messages=messages, max_tokens=5, extra_body=NVEXT_EXTRA_BODY
    )
    assert resp.choices[0].message.content
    assert worker_id_of(resp) in stack.worker_ids
    assert resp.model_extra["nvext"]["worker_id"]["decode_worker_id"] == worker_id_of(resp)
    ttft = ttft_ms_of(resp)
    assert ttft is not None and ttft >= 0
    assert isinstance(cached_tokens_of(resp), int)

    chunks = list(
        client.chat.completions.create(
            model=stack.model_name,
            messages=messages,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NVEXT_EXTRA_BODY,
        )
    )
    ids = {worker_id_of(c) for c in chunks} - {None}
    assert len(ids) == 1 and ids <= set(stack.worker_ids)
    assert any(ttft_ms_of(c) is not None for c in chunks)
    assert any(cached_tokens_of(c) is not None for c in chunks)


def test_affinity_pins_sessions_and_spreads_them(stack: LocalDynamo) -> None:
    # Interleave turns across sessions: plain round-robin would move every session each turn.
    seen: dict[str, list[int]] = {s: [] for s in SESSIONS}
    for _turn in range(4):
        for s in SESSIONS:
            seen[s].append(_ask(stack, s))
    assert all(len(set(workers)) == 1 for workers in seen.values()), seen
    assert len({workers[0] for workers in seen.values()}) >= 3, seen
    # Control: without the header the same router spreads requests.
    assert len({_ask(stack, None) for _ in range(4)}) > 1


def test_sigterm_worker_rebinds_session() -> None:
    stack = LocalDynamo(workers=3).start()  # its own: a damaged stack must not be any other test's
    try:
        _rebinds_after_sigterm(stack)
    finally:
        stack.stop()


def _rebinds_after_sigterm(stack: LocalDynamo) -> None:
    session = "sess-failover"
    first = {_ask(stack, session) for _ in range(3)}
    assert len(first) == 1
    victim = first.pop()
    stack.stop_worker(victim, signal.SIGTERM)
    assert stack.workers[victim].popen.returncode == 0
    after = [_ask(stack, session) for _ in range(4)]
    assert victim not in after
    assert len(set(after)) == 1, after  # re-bound to one survivor
    assert all(_ask(stack, s) != victim for s in SESSIONS)  # other sessions keep working too


def test_stop_leaves_nothing_behind() -> None:
    """Its own stack (so no other test's stack is stopped under it), one worker already stopped."""
    stack = LocalDynamo(workers=2).start()
    try:
        stack.stop_worker(1)
        assert stack.broker is not None and stack.run_dir is not None
        pids, pgid, run_dir, port = stack.pids, stack.broker.pid, stack.run_dir, stack.port
        running = [p.pid for p in [stack.broker, *stack.workers, *stack.frontends] if p.running()]
        assert sorted(_group_members(pgid)) == sorted(running)  # the group holds exactly our processes
        stack.stop()
        assert not run_dir.exists()
        assert not any(_alive(p) for p in pids)
        assert _group_members(pgid) == []
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass
    finally:
        stack.stop()  # idempotent: a no-op when the test got this far


def test_affinity_is_shared_between_two_frontends(local_dynamo_factory: Callable[..., LocalDynamo]) -> None:
    dyn = local_dynamo_factory(workers=3, frontends=2, router_mode="random", affinity_ttl_secs=300)
    assert len(set(dyn.base_urls)) == 2
    for s in SESSIONS:
        workers = set()
        for turn in range(4):
            workers.add(_ask(dyn, s, dyn.base_urls[turn % 2]))
            time.sleep(0.05)  # the binding reaches the other frontend as an event-plane message
        assert len(workers) == 1, (s, workers)
    dyn.stop()


def test_failed_start_reports_log_and_cleans_up(tmp_path: Path) -> None:
    dyn = LocalDynamo(workers=1, frontend_args=["--no-such-flag"], startup_timeout=20)
    with pytest.raises(DynamoStartError, match="no-such-flag"):
        dyn.start()
    assert dyn.run_dir is not None and not dyn.run_dir.exists()
    assert not any(_alive(p) for p in dyn.pids)


def test_watchdog_cleans_up_when_owner_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import json, sys, time
        from otel_session.dynamo import LocalDynamo
        dyn = LocalDynamo(workers=1).start()
        print(json.dumps({"pids": dyn.pids, "run_dir": str(dyn.run_dir)}), flush=True)
        time.sleep(120)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        info = json.loads(owner.stdout.readline())
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in info["pids"]) and not Path(info["run_dir"]).exists():
            break
        time.sleep(0.1)
    assert not any(_alive(p) for p in info["pids"])
    assert not Path(info["run_dir"]).exists()


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_reserved_ports_are_distinct_across_processes_and_outside_the_kernels_range() -> None:
    code = "from otel_session.dynamo import reserve_port; print(*(reserve_port() for _ in range(25)))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)
    ]
    ports = [int(p) for proc in procs for p in proc.communicate(timeout=60)[0].split()]
    assert all(proc.returncode == 0 for proc in procs)
    assert len(ports) == len(set(ports)) == 100  # no two callers got the same port
    assert all(port < _ephemeral_low() for port in ports)  # bind(0) never hands these out
    with socket.socket() as busy:  # a port somebody listens on is never handed out
        busy.bind(("127.0.0.1", reserve_port()))
        busy.listen()
        taken = busy.getsockname()[1]
        assert taken not in {reserve_port() for _ in range(50)}


def test_two_stacks_started_at_once_never_collide() -> None:
    """Each process starts a stack at the same moment as the other, serves one request, stops."""
    script = textwrap.dedent(
        """
        import json, openai
        from otel_session.dynamo import LocalDynamo
        with LocalDynamo(workers=2, startup_timeout=120) as dyn:
            reply = openai.OpenAI(base_url=dyn.base_url, api_key="-", max_retries=0).chat.completions.create(
                model=dyn.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            print(json.dumps({"port": dyn.port, "ok": bool(reply.choices)}))
        """
    )
    for _ in range(2):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        outs = [proc.communicate(timeout=180) for proc in procs]
        assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outs]
        results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        assert all(r["ok"] for r in results)
        assert results[0]["port"] != results[1]["port"]


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_the_frontend_gets_the_flags_its_version_has(versioned_dynamo_stack: LocalDynamo) -> None:
    """1.3.0.post1 has no ``--router-session-affinity-mode`` (it would refuse to start); 1.6.1 gets it."""
    args = _cmdline(versioned_dynamo_stack.frontends[0].pid)
    assert args[args.index("--router-session-affinity-ttl-secs") + 1] == "300"
    has_mode = "--router-session-affinity-mode" in args
    assert has_mode == (versioned_dynamo_stack.dynamo_version != "1.3.0.post1")
    assert _ask(versioned_dynamo_stack, "sess-version") == _ask(versioned_dynamo_stack, "sess-version")


def test_a_mode_the_version_lacks_is_refused_before_anything_starts() -> None:
    dyn = LocalDynamo(workers=1, affinity_mode="soft", python=dynamo_python_for("1.3.0.post1"))
    with pytest.raises(ValueError, match="no --router-session-affinity-mode"):
        dyn.start()
    assert dyn.pids == [] and dyn.run_dir is None


# ------------------------------------------------------------------------------------------ arguments

BAD_ARGUMENTS = [
    ({"router_mode": "kvv"}, "router_mode", "round-robin, random, kv"),
    ({"affinity_mode": "sticky"}, "affinity_mode", "hard, soft"),
    ({"port": 70000}, "port", "1 to 65535"),
    ({"port": 0}, "port", "None (a free port is picked)"),
    ({"affinity_ttl_secs": 0}, "affinity_ttl_secs", "1 to 31536000"),
    ({"workers": 0}, "workers", "at least 1"),
    ({"frontends": 0}, "frontends", "at least 1"),
]


@pytest.mark.parametrize(
    ("kwargs", "name", "accepts"),
    BAD_ARGUMENTS,
    ids=[next(iter(k)) + "=" + repr(*k.values()) for k, _, _ in BAD_ARGUMENTS],
)
def test_a_bad_argument_is_one_line_naming_it_and_what_it_accepts(
    kwargs: dict[str, Any], name: str, accepts: str
) -> None:
    with pytest.raises(ValueError) as error:
        LocalDynamo(**kwargs)
    message = str(error.value)
    assert message.startswith(f"{name}: expected ") and accepts in message, message
    assert repr(next(iter(kwargs.values()))) in message and "\n" not in message


def test_a_port_somebody_listens_on_is_one_line_before_anything_starts() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", reserve_port()))
        busy.listen()
        port = busy.getsockname()[1]
        dyn = LocalDynamo(workers=1, port=port, startup_timeout=30)
        began = time.monotonic()
        with pytest.raises(DynamoStartError) as error:
            dyn.start()
        assert time.monotonic() - began < 2  # nothing installed, spawned or waited for
    message = str(error.value)
    assert (
        message == f"port: 127.0.0.1:{port} is already in use; pass another port, or port=None for a free one"
    )
    assert dyn.pids == [] and dyn.run_dir is None and not dyn.running


def test_a_fixed_port_a_stack_just_left_is_free_for_the_next() -> None:
    """The check binds as the frontend does: a port in TIME_WAIT after a stop is not "in use"."""
    port = reserve_port()
    for _ in range(2):
        with LocalDynamo(workers=1, port=port) as dyn:
            assert dyn.port == port
            assert _ask(dyn, "sess-port") == 0
