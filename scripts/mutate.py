"""The mutation run over the core (``bash scripts/mutate``; docs/contributing.md explains it).

mutmut 3.8.1 mutates every module that decides what a request carries or what the user is told
(``MODULES``) and runs, for each mutant, the tests of that module's files in ``MODULES`` that called
the mutated function in a first traced run: one traced run over all of them, then each mutant against
its own module's tests only. A mutant no test fails on is a behaviour no test pins, unless it is
listed in ``scripts/mutation_equivalents.txt`` with the reason it cannot change behaviour. The run
works on a copy in ``build/mutation`` (the checkout is never touched), prints killed, survived and
equivalent per module, the diff of each survivor, and exits 1 when the kill rate of the
non-equivalent mutants is below ``--threshold``, or when a mutant listed as equivalent is killed
(the list is then wrong).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutation"
EQUIVALENTS = ROOT / "scripts" / "mutation_equivalents.txt"
# per mutated function, the tests that killed its mutants, in order, kept from run to run (the first
# mutants of a function in a run otherwise have no killer to try first)
KILLERS = ROOT / "build" / "mutation-killers"
KILLERS_READ = 400  # the last lines of a function's file read: its latest runs
PHASES = WORK / "phases.txt"  # how long the traced run and the collection took
RUNS = WORK / "runs.jsonl"  # each mutant's child: the tests it ran, the one that failed, their seconds
# Functions that run only in a forked child (``os.register_at_fork`` hooks): mutmut's trace, taken in
# the tests' own process, maps no test to them, so their mutants survived untried. These tests fork,
# and the child, which inherits the mutant's name, checks what the hook left it.
FORK_HOOKS = {
    "otel_session._siblings.x__forget_in_child": (
        "tests/test_siblings_table.py::test_a_forked_child_starts_with_an_empty_table_and_fresh_locks",
    ),
    "otel_session._fleet.x__forget_in_child": (
        "tests/test_fleet_size.py::test_a_child_forked_while_a_read_is_under_way_reads_the_router_itself",
    ),
}
# The first five: the rules of what a request may carry, pinned by these fast test files together.
_RULES_TESTS = (
    "tests/test_policy.py",
    "tests/test_hosts.py",
    "tests/test_propagator.py",
    "tests/test_w3c.py",
    "tests/test_ids.py",
    "tests/test_wire.py",
)
# Each module (under otel_session, dotted) and the fast, in-process test files whose tests may be run
# against its mutants: only these, so a mutant of one module never waits on another module's tests.
_SIBLINGS_TESTS = (
    "tests/test_siblings_table.py",
    "tests/test_siblings_fleet.py",
    "tests/test_prompts.py",
    "tests/test_siblings.py",
    "tests/test_siblings_inferred.py",
    "tests/test_boundaries_groups.py",
    "tests/test_trajectory.py",
)
# One hop's rules, in-process (the files that send through the client hooks start loopback servers: a
# surviving mutant of _hop cost minutes there, and a whole run against them never finished).
_HOP_TESTS = ("tests/test_hop_rules.py", "tests/test_siblings_fleet.py", "tests/test_pacing.py")
_EVIDENCE_TESTS = (
    "tests/test_evidence_rules.py",
    "tests/test_verdicts_rules.py",
    "tests/test_metrics_rules.py",
    "tests/test_evidence.py",
    "tests/test_crowding.py",
    "tests/test_fallback.py",
)
# The machinery the client hooks share: its own rules and the walks over every real target, all
# in-process and quick (the client files start loopback servers: minutes per surviving mutant).
_BASE_TESTS = (
    "tests/test_hook_base.py",
    "tests/test_transparent.py",
    "tests/test_instrumentors.py",
    "tests/test_late_import.py",
)
# The urllib3 hook: its own rules, then requests and urllib3 end to end over loopback (the files of
# the other clients never send through urllib3, and cost minutes per survivor).
_URLLIB3_TESTS = ("tests/test_urllib3_hook.py", "tests/test_requests_client.py", "tests/test_transparent.py")
# The httpx hook: its own rules, then httpx's clients end to end over one loopback server.
_HTTPX_TESTS = ("tests/test_httpx_hook.py", "tests/test_transparent.py")
# The aiohttp client hook: its own rules, then aiohttp's client end to end over one loopback server.
_AIOHTTP_TESTS = ("tests/test_aiohttp_hook.py", "tests/test_transparent.py")
MODULES: dict[str, tuple[str, ...]] = {
    "_policy": _RULES_TESTS,
    "_hosts": _RULES_TESTS,
    "_w3c": _RULES_TESTS,
    "_propagator": _RULES_TESTS,
    "_ids": _RULES_TESTS,
    "_siblings": (*_SIBLINGS_TESTS, "tests/test_gathering.py"),
    "_gathering": (
        "tests/test_gathering.py",
        "tests/test_pacing.py",
        "tests/test_siblings.py",
        "tests/test_siblings_fleet.py",
    ),
    "_pacing": ("tests/test_pacing.py",),
    "_prompts": _SIBLINGS_TESTS,
    "_group_keys": ("tests/test_group_keys.py", "tests/test_boundaries_groups.py"),
    "_fleet": ("tests/test_fleet_size.py", "tests/test_siblings_fleet.py"),
    "_trajectory": ("tests/test_trajectory_rules.py",),
    "_hop": _HOP_TESTS,
    "_settings": ("tests/test_settings_rules.py",),
    "_carriers": (
        "tests/test_carriers.py",
        "tests/test_faults.py",
        "tests/test_hostile.py",
        "tests/test_leaks.py",
        "tests/test_propagator.py",
    ),
    "_session_end": ("tests/test_session_end_rules.py",),
    "_evidence": _EVIDENCE_TESTS,
    "_verdicts": _EVIDENCE_TESTS,
    "_metrics": _EVIDENCE_TESTS,
    "_crowding": _EVIDENCE_TESTS,
    "instrumentation._base": _BASE_TESTS,
    "instrumentation.httpx": (*_HTTPX_TESTS, "tests/test_gathering.py", "tests/test_pacing.py"),
    "instrumentation.aiohttp_client": (*_AIOHTTP_TESTS, "tests/test_gathering.py", "tests/test_pacing.py"),
    "instrumentation.urllib3_client": (*_URLLIB3_TESTS, "tests/test_pacing.py"),
}
# pytest's arguments for every run of the tests, mutmut's and PreparedTests': a fixed order (each test
# must pass alone anyway); no cache written into the copy; pytest's unraisable- and thread-exception
# plugins collect the garbage twice at each session's end: half of each mutant's 0.11 s (under
# mutation, test_gathering's one test that turns their warning into an error cannot see it).
PYTEST_ARGS = (
    "-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:unraisableexception",
    "-p", "no:threadexception", "-m", "not slow",
)  # fmt: skip
SEED = 20261205
COPIED = ("otel_session", "tests", "benchmarks", "pyproject.toml", "setup.py")
SEPARATOR = "\u01c1"  # mutmut's separator in a method's mangled name (xǁClassǁmethod)


def path_of(module: str) -> Path:
    """``instrumentation.httpx`` -> ``otel_session/instrumentation/httpx.py``."""
    return Path("otel_session", *module.split(".")).with_suffix(".py")


def module_of(mutant: str) -> str:
    """``otel_session.instrumentation.httpx.x_f__mutmut_3`` -> ``instrumentation.httpx``."""
    return mutant.partition("__mutmut_")[0].rpartition(".")[0].removeprefix("otel_session.")


def tests_of(modules: list[str]) -> list[str]:
    """The test files of ``modules``, each once, in order."""
    return [t for t in dict.fromkeys(t for m in modules for t in MODULES[m]) if (ROOT / t).exists()]


def mutmut_config(modules: list[str]) -> str:
    only = ", ".join(f'"{path_of(module)}"' for module in modules)
    tests = ", ".join(f'"{test}"' for test in tests_of(modules))
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["otel_session"]\n'
        'also_copy = ["benchmarks"]\n'  # test_leaks imports its loopback server from there
        f"only_mutate = [{only}]\n"
        f"pytest_add_cli_args = {json.dumps(list(PYTEST_ARGS))}\n"
        f"pytest_add_cli_args_test_selection = [{tests}]\n"
        # a mutant that hangs is killed (a timeout) at 4 times its tests' time plus 8 s, not 15 times plus
        # 15 s: a hang in the pacing tests held one of the two cores for 6 minutes
        "timeout_multiplier = 4.0\n"
        "timeout_constant = 2.0\n"
    )


def prepare(modules: list[str]) -> None:
    """A fresh copy of the package and its tests, with mutmut's configuration added."""
    shutil.rmtree(WORK, ignore_errors=True)
    KILLERS.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, WORK / name, ignore=ignore)
        else:
            shutil.copy2(source, WORK / name)
    with open(WORK / "pyproject.toml", "a", encoding="utf-8") as out:
        out.write(mutmut_config(modules))


def all_mutants(modules: list[str]) -> list[str]:
    """Every mutant's name, as mutmut will name them, in a stable order."""
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    names = []
    for module in modules:
        path = path_of(module)
        made = mutate_file_contents(str(path), (WORK / path).read_text(encoding="utf-8"))
        names += [get_mutant_name(path, name) for name in made.mutant_names]
    return sorted(names)


def readable(mutant: str) -> str:
    """``otel_session._hosts.xǁHostPatternǁparse__mutmut_7`` -> ``_hosts.HostPattern.parse``."""
    module, _, function = mutant.partition("__mutmut_")[0].rpartition(".")
    if function.startswith(f"x{SEPARATOR}"):
        function = function[2:].replace(SEPARATOR, ".")
    else:
        function = function.removeprefix("x_")
    return f"{module.removeprefix('otel_session.')}.{function}"


def changed_lines(mutant: str) -> tuple[str, ...]:
    """The lines the mutant takes away (``-``) and puts in (``+``), stripped: what identifies it."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    diff = get_diff_for_mutant(mutant, path=path_of(module_of(mutant)))
    return tuple(
        line[0] + " " + line[1:].strip()
        for line in diff.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    )


def read_equivalents() -> dict[tuple[str, tuple[str, ...]], str]:
    """``[function]``, then ``- old`` and ``+ new`` lines, then ``= why`` (see the file's head)."""
    found: dict[tuple[str, tuple[str, ...]], str] = {}
    function, lines = "", list[str]()
    for raw in EQUIVALENTS.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            function, lines = line[1:-1], []
        elif line[:2] in ("- ", "+ "):
            lines.append(line[0] + " " + line[2:].strip())
        elif line.startswith("= ") and function and lines:
            found[(function, tuple(lines))] = line[2:]
            lines = []
        else:
            raise SystemExit(f"{EQUIVALENTS.name}: cannot read {raw!r}")
    return found


def run_mutmut(modules: list[str], names: list[str], jobs: int, everything: bool, equivalents: bool) -> float:
    env = dict(
        os.environ,
        HYPOTHESIS_PROFILE="mutation",
        TEST_PATIENCE="2",  # tests wait this long, not 10 s, for what never comes (tests/recorder.py)
        PYTHONDONTWRITEBYTECODE="1",
        MUTATE_TESTS=json.dumps({f"otel_session.{m}": MODULES[m] for m in modules}),
        MUTATE_RUN_EQUIVALENTS="1" if equivalents else "0",
    )
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--mutmut",
        "run",
        "--max-children",
        str(jobs),
    ]
    if not everything:
        command += names
    log = WORK / "mutmut.log"
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        done = subprocess.run(command, cwd=WORK, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    took = time.monotonic() - started
    if done.returncode != 0:
        print(log.read_text(encoding="utf-8", errors="replace")[-4000:])
        raise SystemExit(f"mutmut failed (exit {done.returncode}); its log: {log}")
    return took


def mutmut_with_tests_by_module() -> None:
    """mutmut's command line, with each mutant run against its own module's test files only, and
    no second run of the whole test set before the mutants.

    After mutmut's traced run maps each function to the tests that called it, the tests of another
    module's files are dropped from each mapping (``MUTATE_TESTS``: module -> its files), so a mutant
    of ``_settings``, whose functions every test reaches through ``configure()``, runs the settings
    tests only.
    """
    import mutmut.__main__ as mutmut_main
    from mutmut.mutation.trampoline import set_mutant_under_test
    from mutmut.state import state

    files_by_module: dict[str, list[str]] = json.loads(os.environ["MUTATE_TESTS"])
    collect = mutmut_main.collect_or_load_stats

    def collect_then_keep_own(*args: object, **kwargs: object) -> None:
        collect(*args, **kwargs)  # type: ignore[arg-type]
        for function, tests in state().tests_by_mangled_function_name.items():
            files = files_by_module.get(function.rpartition(".")[0])
            if files is not None:
                tests -= {t for t in tests if t.partition("::")[0] not in files}
        for function, forking in FORK_HOOKS.items():  # a test renamed: its hook's mutants show untried
            if function.rpartition(".")[0] in files_by_module:
                known = [test for test in forking if test in state().duration_by_test]
                state().tests_by_mangled_function_name[function].update(known)

    mutmut_main.collect_or_load_stats = collect_then_keep_own
    # mutmut runs the whole test set twice before any mutant: its traced stats run (which fails the
    # run where a test fails) and then a "clean" run of the same tests untraced. The second tells
    # nothing the first did not, and costs as much (about 100 s of CI's 230 s sample): skipped.
    make_runner = mutmut_main.get_mutant_runner  # type: ignore[attr-defined]

    def runner_without_clean_run(*args: object, **kwargs: object) -> object:
        runner: Any = make_runner(*args, **kwargs)  # type: ignore[arg-type]  # mutmut's ForkRunner
        runner.run_clean_tests = lambda tests: 0
        start = runner.startup

        files = tests_of([m.removeprefix("otel_session.") for m in files_by_module])
        prepared: list[PreparedTests | None] = [None]
        traced = [0.0]  # the traced run's seconds, for the log

        def collect_once() -> None:
            began = time.monotonic()
            try:
                prepared[0] = PreparedTests(files)
            except Exception as exc:  # each child then runs a pytest.main of its own, as mutmut does
                print(f"the tests could not be collected once ({exc!r}): each mutant collects its own")
                return
            took = time.monotonic() - began  # for the summary (mutmut captures what is printed here)
            PHASES.write_text(
                f"traced in {traced[0]:.0f} s, collected once in {took:.1f} s", encoding="utf-8"
            )

        def collected_then_start() -> None:
            # after mutmut's own runs of pytest (its stats, the forced failure), before the first fork
            if prepared[0] is None:
                collect_once()
            held = prepared[0]
            if held is not None:
                run_tests = runner.test_runner.run_tests

                def run_prepared(*, mutant_name: str | None, tests: Any) -> int:
                    found = held.run(mutant_name, list(tests)) if mutant_name else None
                    return run_tests(mutant_name=mutant_name, tests=tests) if found is None else found

                runner.test_runner.run_tests = run_prepared
            start()

        runner.startup = collected_then_start
        collect_stats = runner.collect_stats

        def stats_side_by_side(tests: Any) -> int:
            # mutmut traces every test file in one child before the first mutant (2.5 minutes of a
            # whole run): here its jobs take the files from one queue, a pytest run per file each
            if tests:  # an incremental run of named tests: as mutmut does it
                return int(collect_stats(tests))
            began = time.monotonic()
            code = traced_side_by_side(runner, files, runner.max_workers)
            traced[0] = time.monotonic() - began
            # collected here, under no mutant: the forced-failure run next imports every test module
            # where none was imported yet, and under it a module whose import calls our code fails
            # (its tests were then missing from the held session: each urllib3 mutant collected its own)
            set_mutant_under_test("")
            collect_once()
            set_mutant_under_test("stats")
            return code

        runner.collect_stats = stats_side_by_side
        submit = runner.submit

        def quickest_first(name: str, tests: list[str], cpu_time_limit: int, estimated_time: float) -> None:
            # mutmut hands a set's order and stops at the first failure: the quick tests first make a
            # killed mutant cost its quickest failing test, not whichever came first
            durations = state().duration_by_test
            quickest = sorted(tests, key=lambda test: (durations.get(test, 0.0), test))
            submit(name, quickest, cpu_time_limit, estimated_time)

        runner.submit = quickest_first
        return runner

    mutmut_main.get_mutant_runner = runner_without_clean_run  # type: ignore[attr-defined, assignment]
    worst_case = mutmut_main.estimated_worst_case_time

    def each_functions_first_mutants_first(name: str) -> tuple[int, float]:
        # mutmut runs the mutants quickest function first, a function's mutants side by side: its
        # first ones then had no killer to try first (``killers_first``). Each function's first
        # mutant, then each one's second, and so on: every later mutant has its earlier ones' killers.
        return int(name.rpartition("__mutmut_")[2] or 0), worst_case(name)

    mutmut_main.estimated_worst_case_time = each_functions_first_mutants_first  # type: ignore[assignment]
    # The mutants listed as equivalent are not run (they survive every test by their reason, at the
    # cost of all their tests): the report counts them from the list. --check-equivalents runs them.
    if os.environ.get("MUTATE_RUN_EQUIVALENTS") != "1":
        collect_data = mutmut_main.collect_source_file_mutation_data

        def collect_data_without_equivalents(*, mutant_names: tuple[str, ...] | list[str]) -> Any:
            mutants, by_path = collect_data(mutant_names=mutant_names)
            kept = [m for m in mutants if listed_key(m[1].replace("__init__.", "")) is None]
            return (kept or mutants[:1]), by_path  # mutmut refuses an empty selection

        mutmut_main.collect_source_file_mutation_data = collect_data_without_equivalents
    sys.argv = ["mutmut", *sys.argv[2:]]
    mutmut_main.cli()


def traced_side_by_side(runner: Any, files: list[str], jobs: int) -> int:
    """mutmut's traced run of ``files`` in ``jobs`` forked children at once, their findings merged
    into mutmut's state: each takes the next file (the largest first) from a queue of indices in a
    pipe (4-byte reads, each whole) and traces it in a pytest run of its own. mutmut's process
    traces the smallest file itself, as its ForkRunner would all of them: its forced-failure run
    next needs the conftest imported under no mutant, and a process that ran every test forks each
    mutant's child from more memory (250 MB against 220). Nonzero where a file's tests fail (5, a
    file whose tests are all deselected, is no failure)."""
    from mutmut.models.results import StatsResult
    from mutmut.state import state

    order = sorted(range(len(files)), key=lambda n: -(ROOT / files[n]).stat().st_size)
    queue, feed = os.pipe()
    os.write(feed, b"".join(n.to_bytes(4, "big") for n in order[:-1]))  # a few hundred bytes: fits
    os.close(feed)

    def trace(file: str) -> int:
        ran = runner.test_runner.run_stats(tests=[file])
        return 0 if ran == 5 else int(ran)

    def drain() -> int:
        code = 0
        while taken := os.read(queue, 4):
            code = max(code, trace(files[int.from_bytes(taken, "big")]))
        return code

    children: list[tuple[int, Path]] = []
    for job in range(max(1, min(jobs, len(files) - 1))):
        out = WORK / f"stats-{job}.json"
        pid = os.fork()
        if pid == 0:  # before mutmut's process imports pytest: a clean fork
            code = 1
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # a failing test's report in the log
            try:
                code = drain()
                found = state()
                result = StatsResult(
                    exit_code=code,
                    tests_by_mangled_function_name=dict(found.tests_by_mangled_function_name),
                    duration_by_test=dict(found.duration_by_test),
                    stats_time=0.0,
                    function_dependencies=dict(found.function_dependencies),
                )
                out.write_text(json.dumps(result.to_dict()), encoding="utf-8")
            except BaseException:  # said in mutmut's log, which shows it as the stats' failure
                os.write(2, traceback.format_exc().encode())
                code = 1
            finally:
                os._exit(code)
        children.append((pid, out))
    os.close(queue)
    code = trace(files[order[-1]])
    for pid, out in children:
        exited = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if exited != 0 or not out.exists():
            code = max(code, exited, 1)
            continue
        result = StatsResult.from_dict(json.loads(out.read_text(encoding="utf-8")))
        for function, tests in result.tests_by_mangled_function_name.items():
            state().tests_by_mangled_function_name[function] |= tests
        state().duration_by_test.update(result.duration_by_test)
        for function, callers in result.function_dependencies.items():
            state().function_dependencies[function] |= callers
    return code


class PreparedTests:
    """The run's test files collected once, in mutmut's parent, into one pytest session that runs no
    test there; each mutant's forked child runs its own tests through pytest's run-test protocol.

    A mutant's child otherwise runs a whole ``pytest.main`` of its own (configuration, plugins,
    collection, the session's end): about 0.1 s, most of a killed mutant's cost over 7,000 mutants.
    pytest has no public way to hold a session open, hence its private ``_prepareconfig``.
    """

    def __init__(self, files: list[str]) -> None:
        from _pytest.config import _prepareconfig
        from _pytest.main import Session

        self.failed = False
        args = ["--rootdir=.", "--tb=native", "-qq", *PYTEST_ARGS, *files]  # as mutmut runs pytest
        old = os.getcwd()
        os.chdir("mutants")
        try:
            config = _prepareconfig(args, plugins=[self])
            config._do_configure()
            session = Session.from_config(config)
            config.hook.pytest_sessionstart(session=session)
            config.hook.pytest_collection(session=session)
        finally:
            os.chdir(old)
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:  # its global capture would swallow mutmut's own output here
            capture.suspend_global_capture(in_=True)
        self.items = {item.nodeid: item for item in session.items}

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.failed = self.failed or bool(report.failed)

    def run(self, mutant: str, tests: list[str]) -> int | None:
        """1 at the first test that fails, else 0; ``None`` where a test was not collected here. What
        it cost goes to ``RUNS``, the test that failed to ``KILLERS`` (the next mutants' order)."""
        found = [self.items.get(test) for test in tests]
        items = [item for item in found if item is not None]
        if not items or len(items) < len(found):
            return None
        function = mutant.partition("__mutmut_")[0]
        killers = KILLERS / function
        items = killers_first(items, killers)
        os.chdir("mutants")
        quiet = os.open(os.devnull, os.O_WRONLY)  # pytest's reporter writes to the parent's log
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        began = last = time.monotonic()
        ran, code = 0, 0
        try:
            for item, following in zip(items, [*items[1:], None], strict=True):
                last, ran = time.monotonic(), ran + 1
                item.ihook.pytest_runtest_protocol(item=item, nextitem=following)
                if self.failed:
                    code = 1
                    break
        except BaseException:  # what pytest lets out of a test (KeyboardInterrupt, pytest.exit) must
            code = 1  # not leave this function: the child would go on running mutmut's loop
        ended = time.monotonic()
        record = dict(mutant=mutant, ran=ran, of=len(items), killer=items[ran - 1].nodeid if code else None)
        record.update(before=round(last - began, 4), last=round(ended - last, 4))
        with open(RUNS, "a", encoding="utf-8") as out:  # one line a mutant, appended whole
            out.write(json.dumps(record) + "\n")
        if code and ran:
            with open(killers, "a", encoding="utf-8") as out:
                out.write(items[ran - 1].nodeid + "\n")
        return code


def killers_first(items: list[Any], killers: Path) -> list[Any]:
    """``items`` by their expected cost to kill the mutant: a test's time over the share of this
    function's earlier mutants it killed (a tenth of one for a test that killed none). A mutant of a
    function most tests call is mostly killed by the few tests that pin what it changed, which
    quickest-first runs after every quicker test that calls it; a slow killer is still tried after
    a quick test that may kill."""
    from mutmut.state import state

    try:
        named = collections.Counter(killers.read_text(encoding="utf-8").splitlines()[-KILLERS_READ:])
    except FileNotFoundError:
        return items
    durations, seen = state().duration_by_test, sum(named.values())

    def cost(item: Any) -> float:
        return (durations.get(item.nodeid, 0.0) + 0.001) * (seen + 1) / (named[item.nodeid] + 0.1)

    return sorted(items, key=cost)


@functools.cache
def _listed() -> tuple[dict[tuple[str, tuple[str, ...]], str], frozenset[str]]:
    """The equivalents file, read once, and the functions it names."""
    equivalents = read_equivalents()
    return equivalents, frozenset(function for function, _ in equivalents)


def listed_key(mutant: str) -> tuple[str, tuple[str, ...]] | None:
    """``mutant``'s key where ``scripts/mutation_equivalents.txt`` lists it, else ``None`` (its diff
    read only when its function has an entry)."""
    equivalents, functions = _listed()
    function = readable(mutant)
    if function not in functions:
        return None
    key = (function, changed_lines(mutant))
    return key if key in equivalents else None


def results(modules: list[str]) -> dict[str, str]:
    from mutmut.stats import status_by_exit_code

    found = {}
    for module in modules:
        meta = json.loads((WORK / "mutants" / path_of(module)).with_suffix(".py.meta").read_text())
        for name, code in meta["exit_code_by_key"].items():
            found[name] = status_by_exit_code[code]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(prog="bash scripts/mutate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sample", type=int, default=0, help="mutants to run, drawn with a fixed seed (0: all)"
    )
    parser.add_argument("--seed", type=int, default=SEED, help="the sample's seed")
    parser.add_argument(
        "--threshold", type=float, default=95.0, help="least %% of non-equivalent mutants killed"
    )
    parser.add_argument(
        "--check-equivalents",
        action="store_true",
        help="run the mutants listed as equivalent too, and fail if a test kills one (the list is wrong)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=2 * (os.cpu_count() or 1),  # many mutants' tests wait in real time: two a core
        help="mutants run at once (default: two per core)",
    )
    parser.add_argument(
        "--module",
        action="append",
        default=[],
        metavar="NAME",
        help=f"only this module (repeatable): {', '.join(MODULES)}",
    )
    args = parser.parse_args()
    modules = [name.replace("/", ".").removesuffix(".py") for name in args.module] or list(MODULES)
    unknown = [name for name in modules if name not in MODULES]
    if unknown:
        parser.error(f"not a module of the run: {', '.join(unknown)} (the run's: {', '.join(MODULES)})")

    prepare(modules)
    os.chdir(WORK)  # mutmut reads its configuration and writes its mutants relative to here
    names = all_mutants(modules)
    chosen = sample(names, args.sample, args.seed) if 0 < args.sample < len(names) else names
    print(
        f"mutating {', '.join(modules)}: {len(chosen)} of {len(names)} mutants, "
        f"tests {' '.join(tests_of(modules))}",
        flush=True,
    )
    took = run_mutmut(modules, chosen, args.jobs, chosen is names, args.check_equivalents)

    status = results(modules)
    rows: dict[str, dict[str, int]] = {m: dict(killed=0, survived=0, equivalent=0) for m in modules}
    survivors, wrongly_listed = [], []
    for name in chosen:
        module = module_of(name)
        killed = status[name] in ("killed", "timeout")
        key = listed_key(name)
        if key is not None:
            rows[module]["equivalent"] += 1
            if killed:
                wrongly_listed.append((name, key))
        elif killed:
            rows[module]["killed"] += 1
        else:
            rows[module]["survived"] += 1
            survivors.append((name, status[name], (readable(name), changed_lines(name))))

    for name, status_text, key in survivors:
        print(f"\nsurvived ({status_text}): {name}\n[{key[0]}]")
        print("\n".join(key[1]))
    for name, key in wrongly_listed:
        print(f"\nlisted as equivalent but killed: {name} [{key[0]}] {' / '.join(key[1])}")

    print(
        f"\n{'module':<30} {'mutants':>7} {'killed':>7} {'survived':>8} {'equivalent':>10} {'kill rate':>9}"
    )
    total = dict(killed=0, survived=0, equivalent=0)
    for module, row in rows.items():
        for field in total:
            total[field] += row[field]
        print(line_for(module, row))
    print(line_for("all", total))
    rate = rate_of(total)
    print(
        f"\n{len(chosen)} mutants in {took:.0f} s with {args.jobs} at once "
        f"(load average before the summary: {os.getloadavg()[0]:.1f})"
    )
    print(where_the_time_went(chosen, status))
    if wrongly_listed:
        print(
            f"FAIL: {len(wrongly_listed)} mutant(s) listed as equivalent were killed: fix {EQUIVALENTS.name}"
        )
        return 1
    if rate < args.threshold:
        print(f"FAIL: {rate:.1f} % of the non-equivalent mutants killed, below {args.threshold:.1f} %")
        return 1
    print(f"OK: {rate:.1f} % of the non-equivalent mutants killed (threshold {args.threshold:.1f} %)")
    return 0


def where_the_time_went(chosen: list[str], status: dict[str, str]) -> str:
    """The run's phases (``PHASES``), the mutants' time in their tests, and how many mutants
    ran a pytest of their own (their tests not all in the session held open: each costs 0.5 s)."""
    phases = PHASES.read_text(encoding="utf-8") if PHASES.exists() else "tests collected by each mutant"
    lines = RUNS.read_text(encoding="utf-8").splitlines() if RUNS.exists() else []
    records = [json.loads(line) for line in lines]
    seen = {record["mutant"] for record in records}
    ran = [n for n in chosen if status[n] in ("killed", "survived") and listed_key(n) is None]
    alone = [n for n in ran if n not in seen]
    spent = sum(record["before"] + record["last"] for record in records)
    said = f"{phases}; {len(records)} mutants' tests took {spent:.0f} s"
    return said + (f"; {len(alone)} ran a pytest of their own (e.g. {alone[0]})" if alone else "")


def sample(names: list[str], size: int, seed: int) -> list[str]:
    """``size`` of ``names`` drawn with ``seed``, from every module in proportion to its mutants (at
    least one each), so a sample of any size exercises every module's tests."""
    by_module: dict[str, list[str]] = {}
    for name in names:
        by_module.setdefault(module_of(name), []).append(name)
    shares = {module: size * len(found) / len(names) for module, found in by_module.items()}
    counts = {module: max(1, int(share)) for module, share in shares.items()}
    for module in sorted(shares, key=lambda m: counts[m] - shares[m])[: max(0, size - sum(counts.values()))]:
        counts[module] += 1
    draw = random.Random(seed)
    return sorted(name for module, found in by_module.items() for name in draw.sample(found, counts[module]))


def rate_of(row: dict[str, int]) -> float:
    counted = row["killed"] + row["survived"]
    return 100.0 * row["killed"] / counted if counted else 100.0


def line_for(module: str, row: dict[str, int]) -> str:
    count = row["killed"] + row["survived"] + row["equivalent"]
    return (
        f"{module:<30} {count:>7} {row['killed']:>7} {row['survived']:>8} {row['equivalent']:>10} "
        f"{rate_of(row):>8.1f}%"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--mutmut"]:  # run_mutmut's child, in the copy
        mutmut_with_tests_by_module()
    else:
        sys.exit(main())
