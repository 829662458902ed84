"""The package's shape, read from its own source: the rules docs/architecture.md states.

No import cycle; the core imports nothing from ``instrumentation/`` or ``dynamo/``; nothing but the
demo itself imports the demo; no private name is imported from another module; the core stays
small; and a module over 300 lines says at its top why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "otel_session"
CORE = (
    "otel_session",
    "otel_session._ids",
    "otel_session._context",
    "otel_session._faults",
    "otel_session._routers",
    "otel_session._hosts",
    "otel_session._settings",
    "otel_session._w3c",
    "otel_session._policy",
    "otel_session._hop",
    "otel_session._carriers",
    "otel_session._propagator",
    "otel_session._trajectory",
    "otel_session._carry",
    "otel_session._config",
    "otel_session._siblings",
    "otel_session._gathering",
    "otel_session._pacing",
)
# 2,500 until siblings (one parent per group of K) and calls that fail where the original does joined it.
# 2,700 until siblings with no code (the group read from an attempt's first request to a router) joined it.
# 2,900 until fleet-sized siblings (K chosen at run time, the session withheld until a step is seen).
# 3,150 until fleet withholding where pinning crowds, group keys hashed once outside the locks, attempts
# ended out of order, and the async-generator and re-targeted-transport fixes of the fifth round.
# 3,300 until a first step gathered before its groups are sized (``_gathering``: asyncio and threads).
# 3,480 until new parents paced apart at each router (``_pacing``).
# 3,700 until a parent leaves PACE after the last that left and a cancelled step's turns go back.
# 3,760 until one look per event loop and router is shared by a first step's attempts.
# 3,790 until the process's threads share one look too, held weakly (a closed loop's goes with it).
# 3,850 until the pace between new parents became a setting (``OTEL_SESSION_PACE_MS``).
# 3,890 until, unset, the pace is chosen by the burst (40 ms for a small one: several frontends), and
# a wait ends by its bound whatever happens to the turns (``unconfigure()``, a new pace).
# 3,925 until the burst is the parents that asked in the last 4 s (a steady stream's backlog drains).
# 3,930 until a burst of more parents than the router's workers goes 10 ms apart (they share workers).
# 3,945 until prompts outnumbering workers by up to a third are split (a group and a smaller rest).
# 4,010 until a step is sized by the step before alone (an evaluation pass of lone attempts kept out, and
# the step after a lone first step gathered), and the sized line says how a prompt is split.
# 4,030 until an attempt finds its group by identity alone (a key whose ``__eq__`` raised by then left
# its group in the table for good, and ``place`` raised it).
# 4,045 until ``fleet`` withholds a step whose groups crowd a worker past what sharing saves.
# 4,075 until the rule also takes pairs past a fair share and a prompt split into a pair and one, and
# the default's line on K names ``fleet`` where it pins such a step.
# 4,085 until pairs keep the burst's spacing, and crowded pairs are withheld by their own line.
CORE_MAX_LINES = 4_095
# Core modules beside the request path (counting, and judging what clients received): held to the
# same import rule, not counted in the core's size.
BESIDE_CORE = (
    "otel_session._metrics",
    "otel_session._evidence",
    "otel_session._verdicts",
    "otel_session._fleet",
)
LONG = 300


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None]]:
    """``(module, imported name or None)`` for every import of the package, lazy ones included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.startswith("otel_session")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("otel_session"):
                found += [(base, alias.name) for alias in node.names]
    return found


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = set()
        for module, imported in _imports(name, path):
            full = f"{module}.{imported}"
            targets.add(full if full in MODULES else module)
        edges[name] = {t for t in targets if t in MODULES and t != name}
    return edges


def test_the_modules_the_core_names_exist() -> None:
    assert set(CORE + BESIDE_CORE) <= set(MODULES)


def test_no_import_cycle() -> None:
    edges = _edges()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    assert cycles == []


def _reach(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("module", CORE + BESIDE_CORE)
def test_the_core_reaches_neither_instrumentation_nor_the_demo(module: str) -> None:
    reached = _reach(module, _edges())
    outside = sorted(
        m for m in reached if m.startswith(("otel_session.instrumentation", "otel_session.dynamo"))
    )
    assert outside == [], f"{module} imports {outside}"


def test_only_the_demo_imports_the_demo() -> None:
    edges = _edges()
    users = sorted(
        m
        for m, targets in edges.items()
        if not m.startswith("otel_session.dynamo")
        and any(t.startswith("otel_session.dynamo") for t in targets)
    )
    assert users == []


def test_no_private_name_is_imported_from_another_module() -> None:
    crossing = []
    for name, path in MODULES.items():
        for module, imported in _imports(name, path):
            if imported and imported.startswith("_") and f"{module}.{imported}" not in MODULES:
                crossing.append(f"{name}: from {module} import {imported}")
    assert crossing == []


def test_the_core_is_small() -> None:
    lines = sum(len(MODULES[m].read_text(encoding="utf-8").splitlines()) for m in CORE)
    assert lines <= CORE_MAX_LINES, f"the core is {lines} lines"


@pytest.mark.parametrize("name", sorted(MODULES), ids=sorted(MODULES))
def test_a_long_module_says_at_its_top_why(name: str) -> None:
    text = MODULES[name].read_text(encoding="utf-8")
    if len(text.splitlines()) <= LONG:
        return
    docstring = " ".join((ast.get_docstring(ast.parse(text)) or "").split())
    assert "300 lines" in docstring or "Why one module of some" in docstring, (
        f"{name} does not say why it is long"
    )
