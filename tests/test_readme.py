"""The README's Python snippets run as written, each in a fresh interpreter, against a real local Dynamo.

Convention (for everyone editing README.md): every ```` ```python ```` block is run by this test,
as a script of its own, and must exit 0 on its own within the timeout. A snippet that needs a Dynamo
starts ``otel_session.dynamo.LocalDynamo`` itself (as the quickstart does), so it runs anywhere the
``dynamo`` and ``cli`` extras are installed. A block that is not a complete program -- an API listing,
a fragment of a larger app -- is marked on the line right before its fence (blank lines allowed in
between) with an HTML comment, which GitHub does not show::

    <!-- not run: an API listing -->
    ```python
    otel_session.configure(dynamo_hosts=None, ...) -> Settings
    ```

The reason after ``not run:`` is required. Shell blocks (```` ```bash ````) are not run: they install
packages or start long-running servers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```\s*([\w+-]*)")
_NOT_RUN = re.compile(r"^<!--\s*not run:(.*?)-->\s*$")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    not_run: str | None  # the reason, when marked


def readme_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opened = _FENCE.match(lines[index])
        if not opened:
            index += 1
            continue
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = _NOT_RUN.match(before.strip())
        end = next((i for i in range(index + 1, len(lines)) if lines[i].startswith("```")), len(lines))
        code = "\n".join(lines[index + 1 : end]) + "\n"
        blocks.append(Block(index + 1, opened[1].lower(), code, marker[1].strip() if marker else None))
        index = end + 1
    return blocks


BLOCKS = [b for b in readme_blocks(README.read_text(encoding="utf-8")) if b.language in ("python", "py")]
RUNNABLE = [b for b in BLOCKS if b.not_run is None]


def test_the_quickstart_is_among_the_snippets_that_run() -> None:
    assert any("otel_session.trajectory" in b.code and "LocalDynamo" in b.code for b in RUNNABLE), [
        b.line for b in RUNNABLE
    ]


def test_every_not_run_marker_gives_a_reason() -> None:
    unexplained = [b.line for b in BLOCKS if b.not_run == ""]
    assert not unexplained, unexplained


def test_the_extractor_reads_fences_and_markers() -> None:
    text = "x\n<!-- not run: a listing -->\n\n```python\nf()\n```\n"
    text += "```python\nprint(1)\n```\n```bash\nls\n```\n"
    assert [(b.line, b.language, b.code, b.not_run) for b in readme_blocks(text)] == [
        (4, "python", "f()\n", "a listing"),
        (7, "python", "print(1)\n", None),
        (10, "bash", "ls\n", None),
    ]


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"README.md:{b.line}" for b in RUNNABLE])
def test_snippet_runs_as_written(block: Block, tmp_path: Path) -> None:
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
        f"README.md line {block.line}: the snippet failed (mark it <!-- not run: why --> if it is not a "
        f"complete program):\n{proc.stderr[-3000:]}"
    )
