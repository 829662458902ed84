"""What a newcomer to the demo and tools (``otel_session.dynamo``) meets first: module tops and --help.

A module of more than about 300 lines says at its top why it is that long, in a sentence starting "Why
one module of some N lines", with N close to the truth, so the reason is read before the code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from otel_session.dynamo import _checks
from otel_session.dynamo.cli import build_parser

PACKAGE = Path(__file__).resolve().parents[1] / "otel_session" / "dynamo"
LONG = 300
MODULES = sorted(PACKAGE.glob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_a_long_module_says_at_its_top_why_it_is_long(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    docstring = ast.get_docstring(ast.parse(text)) or ""
    said = re.search(r"Why one module of some (\d+) lines", " ".join(docstring.split()))
    if lines <= LONG:
        return
    assert said, f"{path.name} has {lines} lines and its docstring does not say why"
    stated = int(said[1])
    assert 0.8 * lines <= stated <= 1.2 * lines, f"{path.name}: says {stated} lines, has {lines}"


def test_the_router_modes_in_help_are_the_ones_local_dynamo_accepts() -> None:
    help_text = " ".join(build_parser().format_help().split())
    assert "{" + ",".join(_checks.ROUTER_MODES) + "}" in help_text
