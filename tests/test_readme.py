"""The Python snippets of README.md and docs/*.md run as written, each in a fresh interpreter.

Convention (for everyone editing README.md or docs/): every ```` ```python ```` block is run by this
test, as a script of its own, and must exit 0 on its own within the timeout. A snippet that needs a
Dynamo starts ``otel_session.dynamo.LocalDynamo`` itself (as the quickstart does), so it runs anywhere
the ``dynamo`` and ``cli`` extras are installed. A block that is not a complete program -- an API
listing, a fragment of a larger app -- says so in visible text: the last non-blank line before its
fence begins ``Not run in the tests:`` and gives the reason::

    Not run in the tests: a listing of signatures, not a program.

    ```python
    otel_session.configure(dynamo_hosts=None, ...) -> Settings
    ```

The reader sees why it is not run. An HTML comment (``<!-- not run: why -->``, which GitHub does not
show) may sit between that line and the fence, but is never enough on its own. Shell blocks
(```` ```bash ````) are not run: they install packages or start long-running servers.

Relative links between these files (and their ``#anchors``) must resolve too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FILES = [README, *DOCS]
_FENCE = re.compile(r"^\s*```\s*([\w+-]*)")
_CLOSE = re.compile(r"^\s*```\s*$")
_VISIBLE = re.compile(r"^[*_]*Not run in the tests:(.*?)[*_]*$")
_COMMENT = re.compile(r"^<!--\s*not run:(.*?)-->$")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    not_run: str | None  # the reason, when marked (visibly or only in a comment)
    visible: bool  # the reason is shown to the reader, not only in an HTML comment


def _dedent(lines: list[str], indent: int) -> list[str]:
    return [line[indent:] if line[:indent].strip() == "" else line for line in lines]


def readme_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opened = _FENCE.match(lines[index])
        if not opened:
            index += 1
            continue
        before = [lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()][:2]
        reason: str | None = None
        visible = False
        if before and (comment := _COMMENT.match(before[0])):
            reason = comment[1].strip()
            before = before[1:]
        if before and (shown := _VISIBLE.match(before[0])):
            reason, visible = shown[1].strip(), True
        end = next((i for i in range(index + 1, len(lines)) if _CLOSE.match(lines[i])), len(lines))
        indent = len(lines[index]) - len(lines[index].lstrip())
        code = "\n".join(_dedent(lines[index + 1 : end], indent)) + "\n"
        blocks.append(Block(index + 1, opened[1].lower(), code, reason, visible))
        index = end + 1
    return blocks


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _python_blocks(path: Path) -> list[Block]:
    return [b for b in readme_blocks(path.read_text(encoding="utf-8")) if b.language in ("python", "py")]


BLOCKS = {_name(path): _python_blocks(path) for path in FILES}
RUNNABLE = [
    (name, number, block)
    for name, blocks in BLOCKS.items()
    for number, block in enumerate((b for b in blocks if b.not_run is None), 1)
]


def test_the_docs_are_there() -> None:
    assert "docs/api.md" in BLOCKS and len(BLOCKS) > 2, sorted(BLOCKS)


def test_the_quickstart_is_among_the_snippets_that_run() -> None:
    assert any(
        "otel_session.trajectory" in b.code and "LocalDynamo" in b.code
        for name, _, b in RUNNABLE
        if name == "README.md"
    ), [b.line for name, _, b in RUNNABLE if name == "README.md"]


def test_every_snippet_that_is_not_run_says_why_in_visible_text() -> None:
    marked = [(name, b) for name, blocks in BLOCKS.items() for b in blocks if b.not_run is not None]
    hidden = [(name, b.line) for name, b in marked if not b.visible]
    unexplained = [(name, b.line) for name, b in marked if not b.not_run]
    assert not hidden and not unexplained, {"only in an HTML comment": hidden, "no reason": unexplained}


def test_the_extractor_reads_fences_and_markers() -> None:
    text = "x\nNot run in the tests: a listing.\n<!-- not run: a listing -->\n\n```python\nf()\n```\n"
    text += "```python\nprint(1)\n```\n```bash\nls\n```\n<!-- not run: hidden -->\n```python\ng()\n```\n"
    text += "1. step\n\n   *Not run in the tests: a fragment.*\n   ```python\n   h()\n     i()\n   ```\n"
    assert [(b.line, b.language, b.code, b.not_run, b.visible) for b in readme_blocks(text)] == [
        (5, "python", "f()\n", "a listing.", True),
        (8, "python", "print(1)\n", None, False),
        (11, "bash", "ls\n", None, False),
        (15, "python", "g()\n", "hidden", False),
        (21, "python", "h()\n  i()\n", "a fragment.", True),
    ]


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors: set[str] = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("path", FILES, ids=_name)
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for target in _LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{_name(path)}: {broken}"


@pytest.mark.parametrize(
    ("name", "number", "block"), RUNNABLE, ids=[f"{name}#{number}" for name, number, _ in RUNNABLE]
)
def test_snippet_runs_as_written(name: str, number: int, block: Block, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_SESSION_")}
    proc = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, (
        f"{name} line {block.line} (runnable snippet {number}) failed; if it is not a complete program, "
        f"say so on the line before it ('Not run in the tests: why'):\n{proc.stderr[-3000:]}"
    )
