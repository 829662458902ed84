"""Instrumentors apply when their library is imported, whenever that is (issue 28, item 2).

A library that cannot be found when ``configure()`` runs may still arrive: a research script's
``sys.path.insert``, Ray's ``working_dir``. Each case runs in a fresh interpreter (import hooks and
``sys.modules`` are per process) against a recording loopback server; NeMo-RL is the stand-in in
tests/standin (NeMo-RL is not installable from the package index). The real rollout loop with the
driver adding NeMo-RL itself, against the real Dynamo, is in tests/test_nemo_rl_boundaries.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from otel_session import _registry
from otel_session._settings import build
from tests.recorder import Recorder

STANDIN = Path(__file__).resolve().parent / "standin"
NOTICE = "was sent outside any trajectory"
PRESET = "nemo_rl.experience.rollouts:run_sample_multi_turn_rollout"


def run(code: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out


def test_every_instrumentor_not_disabled_is_wanted_whether_its_library_is_found_or_not() -> None:
    settings, _ = build(dynamo_hosts=["127.0.0.1:1"], servers=True)
    assert _registry.wanted(settings) == list(_registry.instrumentors())


def test_nemo_rls_preset_applies_when_nemo_rl_arrives_after_configure(dynamo: Recorder) -> None:
    """The preset's function is a boundary once imported: its requests carry a session each call,
    and the outside-any-trajectory line, said before the import, says no boundary was in force."""
    out = run(f"""
        import asyncio, importlib.util, sys
        import httpx, otel_session
        assert importlib.util.find_spec("nemo_rl") is None
        otel_session.configure(dynamo_hosts=[{dynamo.url!r}])
        httpx.get({dynamo.url!r} + "/before", timeout=10)  # outside any trajectory: the one line
        sys.path.insert(0, {str(STANDIN)!r})
        import nemo_rl.experience.rollouts as rollouts
        assert hasattr(rollouts.run_sample_multi_turn_rollout, "__wrapped__")
        async def sample(*args, **kwargs):  # the stand-in's body replaced: one request per sample
            import httpx, otel_session
            async with httpx.AsyncClient() as client:
                await client.get({dynamo.url!r} + "/inside", timeout=10)
            return otel_session.current_session_id()
        rollouts.run_sample_multi_turn_rollout.__wrapped__.__code__ = sample.__code__
        async def main():
            return await asyncio.gather(*(rollouts.run_sample_multi_turn_rollout(i) for i in range(3)))
        print(asyncio.run(main()))
    """)
    inside = [seen.get("x-dynamo-session-id") for seen in dynamo.requests if seen.path == "/inside"]
    assert len(inside) == 3 and None not in inside and len(set(inside)) == 3
    assert [seen.get("x-dynamo-session-id") for seen in dynamo.requests if seen.path == "/before"] == [None]
    (line,) = [line for line in out.stderr.splitlines() if NOTICE in line]
    assert "no named boundary is in force in this process" in line
    assert "NeMo-RL's is built in" not in line


def test_the_outside_line_names_the_boundaries_in_force_and_only_those(dynamo: Recorder) -> None:
    out = run(f"""
        import sys, httpx, otel_session
        sys.path.insert(0, {str(STANDIN)!r})
        otel_session.configure(dynamo_hosts=[{dynamo.url!r}], trajectory_functions=["nemo_rl.nowhere:f"])
        import nemo_rl.experience.rollouts
        httpx.get({dynamo.url!r} + "/outside", timeout=10)
    """)
    (line,) = [line for line in out.stderr.splitlines() if NOTICE in line]
    assert PRESET in line and "nemo_rl.nowhere" not in line, line
    assert "AsyncRolloutImpl" not in line  # its module was never imported: not in force


def test_a_client_library_found_only_after_configure_is_instrumented(dynamo: Recorder) -> None:
    """aiohttp cannot be found when ``configure()`` runs (its site directory is off ``sys.path``);
    put back and imported later, its requests carry the session."""
    out = run(f"""
        import importlib, importlib.util, sys
        import otel_session
        otel_session.configure(dynamo_hosts=["127.0.0.1:1"]); otel_session.unconfigure()  # entry points read
        site = importlib.util.find_spec("aiohttp").submodule_search_locations[0].rsplit("/aiohttp", 1)[0]
        saved = list(sys.path)
        sys.path[:] = [p for p in sys.path if p != site]
        importlib.invalidate_caches()
        assert importlib.util.find_spec("aiohttp") is None
        otel_session.configure(dynamo_hosts=[{dynamo.url!r}])
        sys.path[:] = saved
        importlib.invalidate_caches()
        import asyncio, aiohttp
        async def main():
            async with otel_session.trajectory() as attempt, aiohttp.ClientSession() as http:
                async with http.get({dynamo.url!r} + "/late-aiohttp") as response:
                    await response.read()
            return attempt.session_id
        print(asyncio.run(main()))
    """)
    (seen,) = [seen for seen in dynamo.requests if seen.path == "/late-aiohttp"]
    assert seen.get("x-dynamo-session-id") == out.stdout.strip().splitlines()[-1]


def test_a_library_outside_the_required_versions_is_left_unpatched_with_one_line(dynamo: Recorder) -> None:
    """The version check upstream makes at ``instrument()`` is made when the library is imported."""
    out = run(f"""
        import otel_session
        from otel_session.instrumentation.httpx import HTTPXSessionInstrumentor
        HTTPXSessionInstrumentor.requirement = "httpx >= 999"
        otel_session.configure(dynamo_hosts=[{dynamo.url!r}])
        import httpx
        with otel_session.trajectory():
            httpx.get({dynamo.url!r} + "/old-httpx", timeout=10)
    """)
    (seen,) = [seen for seen in dynamo.requests if seen.path == "/old-httpx"]
    assert seen.get("x-dynamo-session-id") is None
    lines = [line for line in out.stderr.splitlines() if "left unpatched" in line]
    assert len(lines) == 1 and "httpx >= 999" in lines[0], out.stderr


def test_a_library_deleted_from_sys_modules_and_imported_again_is_patched_again(dynamo: Recorder) -> None:
    """A fresh import (a test isolating a library, a plugin system starting over) makes new classes:
    they are patched too, and a boundary's module imported afresh is a boundary again."""
    out = run(f"""
        import asyncio, sys
        sys.path.insert(0, {str(STANDIN)!r})
        import otel_session
        otel_session.configure(dynamo_hosts=[{dynamo.url!r}], trajectory_functions=[{PRESET!r}])
        import aiohttp, nemo_rl.experience.rollouts
        first = aiohttp.ClientSession
        for name in [n for n in sys.modules if n == "aiohttp" or n.startswith(("aiohttp.", "nemo_rl"))]:
            del sys.modules[name]
        import aiohttp
        import nemo_rl.experience.rollouts as rollouts
        assert aiohttp.ClientSession is not first  # new classes
        assert hasattr(rollouts.run_sample_multi_turn_rollout, "__wrapped__")
        async def main():
            async with otel_session.trajectory() as attempt, aiohttp.ClientSession() as http:
                async with http.get({dynamo.url!r} + "/again") as response:
                    await response.read()
            return attempt.session_id
        print(asyncio.run(main()))
    """)
    (seen,) = [seen for seen in dynamo.requests if seen.path == "/again"]
    assert seen.get("x-dynamo-session-id") == out.stdout.strip().splitlines()[-1]


def test_a_boundary_in_a_module_loaded_by_file_path_is_not_applied_and_says_so(
    dynamo: Recorder, tmp_path: Path
) -> None:
    """Loading by file path runs no import hook, so the named function stays as it is (documented in
    docs/api.md, "Patching"); instead of silence, the exit says why and what to do."""
    path = tmp_path / "by_path_rollouts.py"
    path.write_text("import otel_session\ndef run():\n    return otel_session.current_session_id()\n")
    out = run(f"""
        import importlib.util, sys
        import otel_session
        otel_session.configure(dynamo_hosts=[{dynamo.url!r}], trajectory_functions=["by_path_rollouts:run"])
        spec = importlib.util.spec_from_file_location("by_path_rollouts", {str(path)!r})
        module = importlib.util.module_from_spec(spec)
        sys.modules["by_path_rollouts"] = module
        spec.loader.exec_module(module)
        print(module.run())
    """)
    assert out.stdout.strip().splitlines()[-1] == "None"
    lines = [line for line in out.stderr.splitlines() if "by_path_rollouts:run was never applied" in line]
    assert len(lines) == 1 and "file path" in lines[0] and "import it by name" in lines[0], out.stderr
