"""The mutation run over the core rules (``bash scripts/mutate``; docs/contributing.md explains it).

mutmut 3.8.1 mutates the five modules that decide what a request may carry (``_policy``, ``_hosts``,
``_w3c``, ``_propagator``, ``_ids``) and runs, for each mutant, the tests of ``TESTS`` that call the
mutated function. A mutant no test fails on is a behaviour no test pins, unless it is listed in
``scripts/mutation_equivalents.txt`` with the reason it cannot change behaviour. The run works on a
copy in ``build/mutation`` (the checkout is never touched), prints killed, survived and equivalent per
module, the diff of each survivor, and exits 1 when the kill rate of the non-equivalent mutants is
below ``--threshold``, or when a mutant listed as equivalent is killed (the list is then wrong).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutation"
EQUIVALENTS = ROOT / "scripts" / "mutation_equivalents.txt"
MODULES = ("_policy", "_hosts", "_w3c", "_propagator", "_ids")
# The fast-tier tests that exercise the five modules directly; mutmut runs, per mutant, those of them
# that reached the mutated function in a first traced run.
TESTS = (
    "tests/test_policy.py",
    "tests/test_hosts.py",
    "tests/test_propagator.py",
    "tests/test_w3c.py",
    "tests/test_ids.py",
    "tests/test_wire.py",
)
SEED = 20261205
COPIED = ("otel_session", "tests", "pyproject.toml", "setup.py")
SEPARATOR = "\u01c1"  # mutmut's separator in a method's mangled name (xǁClassǁmethod)


def mutmut_config() -> str:
    only = ", ".join(f'"otel_session/{module}.py"' for module in MODULES)
    tests = ", ".join(f'"{test}"' for test in TESTS if (ROOT / test).exists())
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["otel_session"]\n'
        f"only_mutate = [{only}]\n"
        # a fixed order (each test must pass alone anyway); no cache written into the copy
        'pytest_add_cli_args = ["-p", "no:randomly", "-p", "no:cacheprovider", "-m", "not slow"]\n'
        f"pytest_add_cli_args_test_selection = [{tests}]\n"
    )


def prepare() -> None:
    """A fresh copy of the package and its tests, with mutmut's configuration added."""
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, WORK / name, ignore=ignore)
        else:
            shutil.copy2(source, WORK / name)
    with open(WORK / "pyproject.toml", "a", encoding="utf-8") as out:
        out.write(mutmut_config())


def all_mutants() -> list[str]:
    """Every mutant's name, as mutmut will name them, in a stable order."""
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    names = []
    for module in MODULES:
        path = Path("otel_session") / f"{module}.py"
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

    module = mutant.partition("__mutmut_")[0].rpartition(".")[0]
    diff = get_diff_for_mutant(mutant, path=Path(*module.split(".")).with_suffix(".py"))
    return tuple(
        line[0] + " " + line[1:].strip()
        for line in diff.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    )


def read_equivalents() -> dict[tuple[str, tuple[str, ...]], str]:
    """``[function]``, then ``- old`` and ``+ new`` lines, then ``= why`` (see the file's head)."""
    found: dict[tuple[str, tuple[str, ...]], str] = {}
    function, lines = "", []
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


def run_mutmut(names: list[str], jobs: int, everything: bool) -> float:
    env = dict(os.environ, HYPOTHESIS_PROFILE="mutation", PYTHONDONTWRITEBYTECODE="1")
    command = [
        sys.executable,
        "-c",
        "from mutmut.__main__ import cli; cli()",
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


def results() -> dict[str, str]:
    from mutmut.stats import status_by_exit_code

    found = {}
    for module in MODULES:
        meta = json.loads((WORK / "mutants" / "otel_session" / f"{module}.py.meta").read_text())
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
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="mutants run at once")
    args = parser.parse_args()

    prepare()
    os.chdir(WORK)  # mutmut reads its configuration and writes its mutants relative to here
    names = all_mutants()
    chosen = (
        sorted(random.Random(args.seed).sample(names, args.sample)) if 0 < args.sample < len(names) else names
    )
    print(f"mutating {', '.join(MODULES)}: {len(chosen)} of {len(names)} mutants, tests {' '.join(TESTS)}")
    took = run_mutmut(chosen, args.jobs, chosen is names)

    status = results()
    equivalents = read_equivalents()
    rows: dict[str, dict[str, int]] = {m: dict(killed=0, survived=0, equivalent=0) for m in MODULES}
    survivors, wrongly_listed = [], []
    for name in chosen:
        module = name.split(".")[1]
        killed = status[name] in ("killed", "timeout")
        key = None
        if not killed or equivalents:
            lines = changed_lines(name)
            key = (readable(name), lines)
        if key in equivalents:
            rows[module]["equivalent"] += 1
            if killed:
                wrongly_listed.append((name, key))
        elif killed:
            rows[module]["killed"] += 1
        else:
            rows[module]["survived"] += 1
            survivors.append((name, status[name], key))

    for name, status_text, key in survivors:
        assert key is not None
        print(f"\nsurvived ({status_text}): {name}\n[{key[0]}]")
        print("\n".join(key[1]))
    for name, key in wrongly_listed:
        print(f"\nlisted as equivalent but killed: {name} [{key[0]}] {' / '.join(key[1])}")

    print(
        f"\n{'module':<12} {'mutants':>7} {'killed':>7} {'survived':>8} {'equivalent':>10} {'kill rate':>9}"
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


def rate_of(row: dict[str, int]) -> float:
    counted = row["killed"] + row["survived"]
    return 100.0 * row["killed"] / counted if counted else 100.0


def line_for(module: str, row: dict[str, int]) -> str:
    count = row["killed"] + row["survived"] + row["equivalent"]
    return (
        f"{module:<12} {count:>7} {row['killed']:>7} {row['survived']:>8} {row['equivalent']:>10} "
        f"{rate_of(row):>8.1f}%"
    )


if __name__ == "__main__":
    sys.exit(main())
