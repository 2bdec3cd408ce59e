"""The documentation builds and every Python example in it runs.

- ``mkdocs build --strict`` into a temporary folder: broken links, missing pages and
  docstring problems in the API reference fail the test.
- Every fenced block tagged ``python`` in ``README.md`` and ``docs/*.md`` is executed. The
  blocks of one file run in order, from one temporary working directory; single-process
  blocks share one namespace, in the test's process.
- A ``python`` block whose first line names a launch command, e.g.
  ``# run with: torchrun --nproc-per-node 4 example.py``, is a complete script: it runs on
  that many Gloo ranks (``tests/distributed/_launch.py``), each rank executing it as
  ``__main__`` with torchrun's environment variables set. The launcher has already joined
  every rank to the process group, so the script's own ``init_process_group("gloo")`` and
  ``destroy_process_group()`` calls are accepted as they are.
- A ``text`` block that directly follows a ``python`` block (nothing but blank lines in
  between) is that block's expected output: what it prints (on rank 0 for a multi-rank
  script) must match it line by line, trailing spaces aside; ``...`` matches any text.
- Blocks tagged anything else (``bash``, ``text``, ...) are not run.

Every test here is marked ``docs`` (registered in setup.cfg), so ``pytest -m "not docs"``
leaves them out.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n]*)$")
_PYTHON = ("python", "py")
_LAUNCH = re.compile(r"^#.*torchrun\b.*--nproc[-_]per[-_]node[ =](?P<n>\d+)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    output: str | None = None  # the text block right after it, if any

    @property
    def ranks(self) -> int | None:
        """Number of ranks for a complete multi-rank script, else ``None``."""
        first = self.code.lstrip("\n").split("\n", 1)[0]
        match = _LAUNCH.match(first)
        return int(match["n"]) if match else None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown file, with its language and first line."""
    blocks: list[Block] = []
    ends: list[int] = []  # 0-based line of each block's closing fence
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        language = match["info"].strip().split(" ")[0].lstrip("{.").rstrip("}")
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            msg = f"{path}:{start + 1}: code block opened with {fence} is never closed."
            raise ValueError(msg)
        blocks.append(Block(path, start + 1, language, "\n".join(body) + "\n"))
        ends.append(i)
        i += 1
    for k in range(len(blocks) - 1):
        between = lines[ends[k] + 1:blocks[k + 1].line - 1]
        if blocks[k].language in _PYTHON and blocks[k + 1].language == "text" and not any(x.strip() for x in between):
            blocks[k] = replace(blocks[k], output=blocks[k + 1].code)
    return blocks


def _python_blocks(path: Path) -> list[Block]:
    return [b for b in code_blocks(path) if b.language in _PYTHON]


FILES = [p for p in DOC_FILES if p.exists() and _python_blocks(p)]


def _file_param(path: Path) -> Any:
    multi = any(b.ranks is not None for b in _python_blocks(path))
    return pytest.param(path, id=str(path.relative_to(ROOT)), marks=[pytest.mark.distributed] if multi else [])


def test_docs_have_examples() -> None:
    blocks = [b for p in FILES for b in _python_blocks(p)]
    assert any(b.ranks is None for b in blocks) and any(b.ranks is not None for b in blocks), \
        "README.md and docs/*.md should hold both single-process and multi-rank Python examples"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").exists()


@pytest.mark.parametrize("path", [_file_param(p) for p in FILES])
def test_examples(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a file's examples top to bottom in one working directory."""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    for block in _python_blocks(path):
        # Offset the line numbers so tracebacks point into the Markdown file.
        source = "\n" * block.line + block.code
        if block.ranks is None:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(source, str(block.path), "exec"), namespace)  # noqa: S102 - the docs are ours
            _check_output(block, printed.getvalue())
        else:
            outputs = run_distributed(_run_script, block.ranks, source, str(block.path), str(tmp_path), timeout=60)
            _check_output(block, outputs[0])


def _check_output(block: Block, printed: str) -> None:
    """Compare line by line; ``...`` in an expected line stands for any text (like doctest's ELLIPSIS)."""
    if block.output is None:
        return
    got = [line.rstrip() for line in printed.rstrip("\n").split("\n")]
    want = [line.rstrip() for line in block.output.rstrip("\n").split("\n")]
    same = len(got) == len(want) and all(
        re.fullmatch(".*".join(re.escape(part) for part in w.split("...")), g) for g, w in zip(got, want))
    assert same, f"{block.name}: the example printed\n{printed}\nbut the text block after it says\n{block.output}"


def _run_script(rank: int, world_size: int, source: str, filename: str, workdir: str) -> str:
    """Execute one documented script on this rank as torchrun would start it; return what it printed."""
    import torch.distributed as dist

    os.chdir(workdir)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    sys.argv = [Path(filename).name]

    def init_process_group(backend: str | None = None, *args: object, **kwargs: object) -> None:
        if backend not in (None, "gloo", "cpu:gloo"):
            msg = f"documented CPU examples must use the Gloo backend, got {backend!r}"
            raise AssertionError(msg)

    def destroy_process_group(*args: object, **kwargs: object) -> None:
        dist.barrier()

    saved = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(source, filename, "exec"), {"__name__": "__main__"})  # noqa: S102 - the docs are ours
    finally:
        dist.init_process_group, dist.destroy_process_group = saved
        sys.stdout.write(printed.getvalue())
    return printed.getvalue()
