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
  ``destroy_process_group()`` calls are accepted as they are. With ``--max-restarts N`` in
  that line, a run in which a rank fails is started again, every rank anew, up to ``N`` times,
  as torchrun does (``TORCHELASTIC_RESTART_COUNT`` counts the restarts); the output compared is
  the last run's.
- Every ``text`` block after a ``python`` block, up to the next ``python`` block or heading, is
  that block's expected output: what it prints must match them (joined in order) line by
  line, trailing spaces aside; ``...`` matches any text. A multi-rank script is run on
  every rank it names and every rank's output is compared: a block titled ``rank N``
  (```` ```text title="rank 1" ````) is rank N's output, an untitled one rank 0's, and a
  rank the page shows no block for must print nothing. A ``text`` block with no ``python``
  block before it in its section (a file layout, a sketch) is not an output.
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

from tests.distributed._launch import DistributedTestError, run_distributed

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n]*)$")
_PYTHON = ("python", "py")
_LAUNCH = re.compile(r"^#.*torchrun\b.*--nproc[-_]per[-_]node[ =](?P<n>\d+)")
_RESTARTS = re.compile(r"--max[-_]restarts[ =](?P<n>\d+)")
_RANK_TITLE = re.compile(r'\btitle="rank (?P<rank>\d+)"')
_HEADING = re.compile(r"^#{1,6} ")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    info: str = ""  # the fence's info string after the language, e.g. 'title="rank 1"'
    # The text blocks shown as its output: (rank, text), rank ``None`` when untitled.
    outputs: tuple[tuple[int | None, str], ...] = ()

    @property
    def ranks(self) -> int | None:
        """Number of ranks for a complete multi-rank script, else ``None``."""
        first = self.code.lstrip("\n").split("\n", 1)[0]
        match = _LAUNCH.match(first)
        return int(match["n"]) if match else None

    @property
    def restarts(self) -> int:
        """``--max-restarts`` of a multi-rank script's launch line (0 without it)."""
        first = self.code.lstrip("\n").split("\n", 1)[0]
        match = _RESTARTS.search(first) if _LAUNCH.match(first) else None
        return int(match["n"]) if match else 0

    @property
    def name(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


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
        language, _, info = match["info"].strip().partition(" ")
        language = language.lstrip("{.").rstrip("}")
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            msg = f"{path}:{start + 1}: code block opened with {fence} is never closed."
            raise ValueError(msg)
        blocks.append(Block(path, start + 1, language, "\n".join(body) + "\n", info))
        ends.append(i)
        i += 1
    owner: int | None = None  # index of the python block whose outputs follow
    for k, block in enumerate(blocks):
        if k and any(_HEADING.match(x) for x in lines[ends[k - 1] + 1:block.line - 1]):
            owner = None
        if block.language in _PYTHON:
            owner = k
        elif block.language == "text" and owner is not None:
            title = _RANK_TITLE.search(block.info)
            rank = int(title["rank"]) if title else None
            blocks[owner] = replace(blocks[owner], outputs=(*blocks[owner].outputs, (rank, block.code)))
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


@dataclass(frozen=True)
class Build:
    site: Path
    returncode: int
    log: str


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """``mkdocs build --strict`` once for the tests that read the site."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    return Build(site, result.returncode, result.stdout + result.stderr)


def test_mkdocs_build_strict(build: Build) -> None:
    """The site builds with no warning at all: strict mode, and the log is read too."""
    warnings = [line for line in build.log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert build.returncode == 0 and not warnings, f"mkdocs build --strict failed or warned:\n{build.log}"
    assert "Documentation built" in build.log, f"mkdocs printed no build summary; was its log silenced?\n{build.log}"
    assert (build.site / "index.html").exists()


def test_site_frame_at_1280_and_390_px(build: Build, tmp_path: Path) -> None:
    """scripts/screenshots.py: one-row navbar, nothing wider than a phone, anchors clear of the navbar,
    and tables a reader can read (no cell narrower than its longest word, no row taller than the
    screen, no clipped column), on the tutorial, the benchmarks and the API pages."""
    screenshots = _load_script("screenshots")
    chromium = os.environ.get("CHROMIUM") or screenshots.find_chromium()
    if chromium is None:
        pytest.skip("Chromium is not installed, so the site's layout at 1280 and 390 px is NOT checked: "
                    "apt-get install chromium (./scripts/test.sh installs it when run as root)")
    assert {"getting_started/", "benchmarks/", "api/sharded_tensor/"} <= set(screenshots.PAGES)
    assert build.returncode == 0, build.log
    results = screenshots.check(build.site, tmp_path / "shots", chromium)
    assert len(results) == len(screenshots.PAGES) * len(screenshots.WIDTHS)
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['page']} at {r['width']} px: {r['problems']}" for r in failed)


PACKAGES = ("sharding", "sharded_tensor", "checkpoint")


@pytest.mark.parametrize("package", PACKAGES)
def test_api_reference_lists_every_public_name(package: str) -> None:
    """Each name in ``__all__`` has its entry in docs/api/<package>.md (the page orders them by use)."""
    module = importlib.import_module(package)
    page = (ROOT / "docs" / "api" / f"{package}.md").read_text()
    listed = set(re.findall(rf"^::: {package}\.(\w+)\s*$", page, re.MULTILINE))
    missing = sorted(set(module.__all__) - listed)
    assert not missing, (f"docs/api/{package}.md has no entry for {missing}; add a line "
                         f"'::: {package}.<name>' under the section where a user would look for it")


def test_api_overview_names_every_public_name() -> None:
    """docs/api/index.md links every name of every package's ``__all__`` to its entry."""
    page = (ROOT / "docs" / "api" / "index.md").read_text()
    linked = set(re.findall(r"\]\((\w+)\.md#(\w+\.\w+)\)", page))
    missing = [f"{package}.{name}" for package in PACKAGES for name in importlib.import_module(package).__all__
               if (package, f"{package}.{name}") not in linked]
    assert not missing, (f"docs/api/index.md does not link {missing}; add each under the step where a user "
                         f"needs it, as [`name`]({{package}}.md#{{package}}.name)")


def test_no_example_writes_a_key_the_training_state_overwrites() -> None:
    """``{"model": ..., **st.get_state_dict(model, optim)}``: the unpacked dict's "model" replaces the first."""
    import ast

    found = []
    for path in FILES:
        for block in _python_blocks(path):
            for node in ast.walk(ast.parse(block.code)):
                if not isinstance(node, ast.Dict):
                    continue
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                unpacks = [v for k, v in zip(node.keys, node.values) if k is None and isinstance(v, ast.Call)
                           and isinstance(v.func, ast.Attribute) and v.func.attr == "get_state_dict"]
                if unpacks and keys & {"model", "optim"}:
                    found.append(f"{block.name}: {sorted(keys & {'model', 'optim'})}")
    assert not found, f"examples build a dict whose keys **st.get_state_dict(...) replaces: {found}"


def test_api_reference_is_compact_and_public(build: Build) -> None:
    """Signatures are one line each (the page wraps them), and the API pages name public types only."""
    assert build.returncode == 0, build.log
    for package in PACKAGES:
        page = (build.site / "api" / package / "index.html").read_text()
        signatures = re.findall(r'doc-signature highlight"><pre>(.*?)</pre>', page, re.DOTALL)
        assert signatures, f"no signatures found in the API page of {package}"
        texts = [re.sub(r"<[^>]*>", "", s).strip() for s in signatures]
        folded = [text[:60] for text in texts if "\n" in text]
        assert not folded, f"signatures laid out over several lines in the API page of {package}: {folded}"
        text = re.sub(r"<[^>]*>", "", page)  # visible text only: tags and their attributes go
        private = sorted(set(re.findall(r"(?<![\w.])_[a-z]\w*\.[A-Za-z]\w*", text)))
        private += sorted(set(re.findall(r"\b(?:InitArg|Intervals|ProcessGroup = Any)\b", text)))
        assert not private, f"the API reference of {package} shows private names: {private}"


def test_public_constructors_are_documented() -> None:
    """Every parameter of every public class's constructor is described (Args or Attributes)."""
    griffe = pytest.importorskip("griffe", reason="griffe comes with the docs extra (pip install -e '.[docs]')")
    loader = griffe.GriffeLoader(search_paths=[str(ROOT)], docstring_parser=griffe.Parser.google)
    modules = {name: loader.load(name) for name in (*PACKAGES, "_shardkit")}
    loader.resolve_aliases()
    undocumented = {}
    for package in PACKAGES:
        for name in modules[package].exports:
            cls = modules[package][name]
            cls = cls.final_target if cls.is_alias else cls
            if not cls.is_class:
                continue
            init = cls.all_members.get("__init__")
            params = [p.name for p in (init.parameters if init is not None else []) if p.name != "self"]
            if params == ["args", "kwargs"] and init.docstring is not None:
                continue  # not constructed directly, and its __init__ says so (ShardedTensor)
            described = {item.name for holder in (cls, init) if holder is not None and holder.docstring
                         for section in holder.docstring.parsed
                         if section.kind.value in ("parameters", "attributes", "other parameters")
                         for item in section.value}
            if [p for p in params if p not in described]:
                undocumented[f"{package}.{name}"] = [p for p in params if p not in described]
    assert not undocumented, f"constructor parameters with no description (add an Args: section): {undocumented}"


def _load_script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
            _check_outputs(block, [printed.getvalue()])
        else:
            for restart in range(block.restarts + 1):
                try:
                    outputs = run_distributed(_run_script, block.ranks, source, str(block.path), str(tmp_path),
                                              restart, timeout=60)
                    break
                except DistributedTestError:
                    if restart == block.restarts:
                        raise
            _check_outputs(block, outputs)


def expected_outputs(block: Block, ranks: int) -> list[str]:
    """What each rank should print; an example whose page shows no output must print nothing."""
    if not block.outputs:
        return [""] * ranks
    want = [""] * ranks
    for rank, text in block.outputs:
        r = 0 if rank is None else rank
        if not 0 <= r < ranks:
            msg = f"{block.name}: an output block is titled rank {r}, but the example runs on {ranks} rank(s)"
            raise AssertionError(msg)
        want[r] += text
    return want


def output_matches(printed: str, expected: str) -> bool:
    """Line by line, trailing spaces aside; ``...`` in an expected line stands for any text (doctest's ELLIPSIS)."""
    got = [line.rstrip() for line in printed.rstrip("\n").split("\n")] if printed.strip() else []
    want = [line.rstrip() for line in expected.rstrip("\n").split("\n")] if expected.strip() else []
    return len(got) == len(want) and all(
        re.fullmatch(".*".join(re.escape(part) for part in w.split("...")), g) for g, w in zip(got, want))


def _check_outputs(block: Block, printed: list[str]) -> None:
    for rank, (got, want) in enumerate(zip(printed, expected_outputs(block, len(printed)), strict=True)):
        if output_matches(got, want):
            continue
        who = f"rank {rank} of the example" if block.ranks is not None else "the example"
        shown = f"the page shows\n{want}" if want else "the page shows no output for it"
        raise AssertionError(f"{block.name}: {who} printed\n{got}\nbut {shown}")


def _run_script(rank: int, world_size: int, source: str, filename: str, workdir: str, restart: int = 0) -> str:
    """Execute one documented script on this rank as torchrun would start it; return what it printed."""
    import torch.distributed as dist

    os.chdir(workdir)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", TORCHELASTIC_RESTART_COUNT=str(restart))
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


def test_output_check_fails_on_a_wrong_page(tmp_path: Path) -> None:
    """The comparison can fail: a wrong line, a rank's unshown output, a missing rank block."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\n# run with: torchrun --nproc-per-node 2 x.py\nprint(1)\n```\n\n```text\none\n```\n\n"
        "Rank 1 prints:\n\n```text title=\"rank 1\"\ntwo\n```\n\n## Next\n\n```text\nnot an output\n```\n")
    (block,) = _python_blocks(page)
    assert expected_outputs(block, 2) == ["one\n", "two\n"]
    _check_outputs(block, ["one\n", "two  \n"])
    for printed in (["one\n", "2\n"], ["one\n", ""], ["one\nextra\n", "two\n"]):
        with pytest.raises(AssertionError, match="printed"):
            _check_outputs(block, printed)
    assert output_matches("a 12 b\n", "a ... b") and not output_matches("a 12 c\n", "a ... b")
