#!/usr/bin/env python
"""Curated mutation check: each safety check, switched off on its own, must make a test fail.

Every mutation names a file, an exact snippet of its source, a replacement that disables one
check, and the tests expected to notice. The repository is copied once to a temporary folder
(the working tree is never touched); each mutation is applied to that copy alone, the named
tests run there (``PYTHONPATH`` at the copy), and the file is restored before the next one.

A mutation is *killed* when its tests fail, *survived* when they pass, *stale* when its
snippet no longer occurs exactly once in the file (the code moved: update the list), and
*invalid* when the mutated file no longer compiles. The named tests are first run unmutated
(each selection must pass, or its mutations would look killed). Prints JSON; exits 1 unless every
mutation is killed::

    python scripts/mutation_check.py                 # every mutation
    python scripts/mutation_check.py --only lease    # those whose name contains "lease"
    python scripts/mutation_check.py --list          # names and files, nothing run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORRUPTION = "tests/unit/test_checkpoint_corruption.py"
READ_PATHS = f"{CORRUPTION}::test_a_flipped_byte_is_caught_on_every_read_path"


@dataclass(frozen=True)
class Mutation:
    """Replace ``before`` (exactly once in ``file``) by ``after``; ``tests`` (pytest arguments) must fail."""

    name: str
    file: str
    before: str
    after: str
    tests: tuple[str, ...]


MUTATIONS = [
    # -- chunk checksums on every read path of checkpoint.load ----------------------------------------
    Mutation("load: chunk CRC of remote batch reads (memory://, S3)", "checkpoint/_files.py",
             "        RegionCheck(shard, task.path, task.name, ca, reader.verified).update(data)\n",
             "        pass\n", (READ_PATHS, "-k", "memory or s3")),
    Mutation("load: chunk CRC on the local streaming path", "checkpoint/_files.py",
             "        check.update(piece)\n        a, b = max(start, first), min(start + len(piece), last)\n",
             "        a, b = max(start, first), min(start + len(piece), last)\n", (READ_PATHS, "-k", "local")),
    Mutation("load: chunk CRC of direct reads into the target", "checkpoint/_files.py",
             "            check.update(piece)\n    except CheckpointError:\n",
             "            pass\n    except CheckpointError:\n", (READ_PATHS, "-k", "same")),
    Mutation("load: chunk CRC before mapping the target onto the file (mmap=True)", "checkpoint/_files.py",
             "        RegionCheck(shard, task.path, task.name, lo, reader.verified).update(data)\n",
             "        pass\n", (READ_PATHS, "-k", "local and mmap")),
    Mutation("load: chunk CRC of memory-mapped copies", "checkpoint/_files.py",
             "        RegionCheck(task.shard, task.path, task.name, lo, reader.verified).update(view)\n",
             "        pass\n", (READ_PATHS, "-k", "local and copy")),
    Mutation("load: CRC of a 0-d tensor", "checkpoint/_files.py",
             "    RegionCheck(shard, task.path, task.name).update(data)\n", "    pass\n",
             (f"{CORRUPTION}::test_a_flipped_byte_of_a_scalar_is_caught",)),
    Mutation("load: partial reads widened to whole chunks", "checkpoint/_reader.py",
             "        return first + plan.read_start, first + plan.read_end\n", "        return start, end\n",
             (READ_PATHS, "-k", "edge")),
    Mutation("load: the span check itself (a mismatch is let through)", "checkpoint/_reader.py",
             "            if actual != expected:\n", "            if False:\n", (READ_PATHS, "-k", "inner")),
    # -- consolidate and verify read whole regions ----------------------------------------------------
    Mutation("verify/consolidate: CRC of streamed regions", "checkpoint/_reader.py",
             "            check.update(piece)\n            start += len(piece)\n",
             "            start += len(piece)\n", ("tests/unit/test_cli.py", "-k", "verify")),
    Mutation("consolidate: CRC of regions read whole", "checkpoint/_reader.py",
             "        RegionCheck(shard, path, tensor).update(out)\n", "        pass\n",
             ("tests/unit/test_consolidate.py",)),
    # -- the save lease ------------------------------------------------------------------------------
    Mutation("save: lease checked before commit", "checkpoint/_save.py",
             '        job.storage("checking the save lease", lambda watchdog: lease.check())\n', "",
             ("tests/unit/test_checkpoint_defects.py", "-k", "lost_its_lease")),
    Mutation("save lease: a lease held on a local folder refuses a second save", "checkpoint/_lease.py",
             "                raise _busy(root, held) from None\n", "                pass\n",
             ("tests/unit/test_checkpoint_defects.py", "-k", "save_in_progress")),
    Mutation("save lease: an unexpired lease on an object store refuses a second save", "checkpoint/_lease.py",
             "            raise _busy(root, previous)\n", "            pass\n",
             ("tests/unit/test_checkpoint_guards.py", "-k", "lease")),
    # -- what load accepts -----------------------------------------------------------------------------
    Mutation("load: strict keys", "checkpoint/_load.py",
             "    if strict:\n        missing, unexpected", "    if False:\n        missing, unexpected",
             ("tests/unit/test_checkpoint.py", "-k", "strict")),
    Mutation("load/verify: shardkit.json's checksum of its own content", "checkpoint/_schema.py",
             "    if actual != recorded:\n", "    if False:\n",
             ("tests/unit/test_checkpoint_defects.py", "-k", "edited_metadata")),
    # -- no pickle unless asked, and then only DCP's own classes --------------------------------------
    Mutation("no pickle: the DCP unpickler admits only DCP's metadata classes", "checkpoint/_dcp_metadata.py",
             "        if (module, name) in _ALLOWED_CALLABLES:\n            return _resolve(module, name)\n",
             "        if True:\n            return super().find_class(module, name)\n",
             ("tests/unit/test_checkpoint_defects.py", "-k", "planted")),
    Mutation("no pickle: format detection never falls back to DCP's .metadata", "checkpoint/_sources.py",
             '    if from_format == "dcp":\n',
             '    if from_format == "dcp" or os.path.isfile(os.path.join(os.fspath(path), ".metadata")):\n',
             ("tests/unit/test_checkpoint_defects.py", "-k", "planted or read_only_when_named")),
    # -- tensor parallelism refusals ------------------------------------------------------------------
    Mutation("shard_model: head-cut refusal past the first projection (k_proj/v_proj, grouped-query)",
             "sharded_tensor/_model/zone_plan.py",
             "        for e in endpoints:\n            if full and not e.name.startswith(full + \".\"):\n",
             "        for e in endpoints[:1]:\n            if full and not e.name.startswith(full + \".\"):\n",
             ("tests/unit/test_zones.py", "-k", "head")),
    Mutation("shard_model: head-cut refusal of nn.MultiheadAttention", "sharded_tensor/_model/attention.py",
             "            if mine[0] % head or mine[1] % head:\n", "            if False:\n",
             ("tests/unit/test_parallel_plan.py", "-k", "multihead")),
    Mutation("shard_model: packed-split refusal (Linear, Embedding)", "sharded_tensor/_model/parallel.py",
             "        if layout.pieces is not None:\n            shown =", "        if False:\n            shown =",
             ("tests/unit/test_parallel_plan.py", "-k", "packed")),
    # -- the optimizer-order guard ------------------------------------------------------------------
    Mutation("optimizer guard: beyond the first param group", "sharded_tensor/_model/guard.py",
             "    for group in optim.param_groups:\n        for param in group[\"params\"]:\n"
             "            found = getattr(param, _REPLACED",
             "    for group in optim.param_groups[:1]:\n        for param in group[\"params\"]:\n"
             "            found = getattr(param, _REPLACED",
             ("tests/unit/test_training_local.py", "-k", "optimizer")),
    Mutation("optimizer guard: the step refusal", "sharded_tensor/_model/guard.py",
             "    if not stale:\n        return\n", "    if True:\n        return\n",
             ("tests/unit/test_training_local.py", "-k", "optimizer")),
    # -- the manager's deletion rules -----------------------------------------------------------------
    Mutation("manager: a symbolic link is never a step (pruning would follow it)", "checkpoint/_manager.py",
             'if step is None or entry.get("type") != "directory" or entry.get("islink"):', "if step is None:",
             ("tests/unit/test_manager_safety.py", "-k", "symbolic")),
    Mutation("manager: names that are not exactly a step's name are left alone", "checkpoint/_manager.py",
             "    return step if name == _name(step) else None", "    return step",
             ("tests/unit/test_manager_safety.py", "tests/unit/test_async_checkpoint.py", "-k",
              "foreign or not_exactly")),
    Mutation("manager: a step folder is removed only under its save lease", "checkpoint/_manager.py",
             "        if lease is None:\n            return\n",
             "        if lease is None:\n            lease = type('Unleased', (), {'drop': lambda self: None})()\n",
             ("tests/unit/test_manager_safety.py", "-k", "second_manager or abandoned")),
    Mutation("manager: keep_last", "checkpoint/_manager.py",
             "(set(steps[-self.keep_last:]) if self.keep_last is not None else set())", "set()",
             ("tests/unit/test_async_checkpoint.py", "-k", "manager")),
    Mutation("manager: keep_every", "checkpoint/_manager.py",
             "            keep |= {s for s in steps if s % self.keep_every == 0}\n", "            pass\n",
             ("tests/unit/test_async_checkpoint.py", "-k", "manager")),
    Mutation("manager: the step being loaded is never deleted", "checkpoint/_manager.py",
             "            keep |= self._reading\n", "            pass\n",
             ("tests/unit/test_async_checkpoint.py", "-k", "manager")),
]


def _copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache",
                                    "site", "*.egg-info")
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)


def _run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, list[str], str]:
    """``(exit code, failed test ids, last lines of output)`` of pytest on ``tests`` in the copy."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, [], f"timed out after {timeout} s"
    out = done.stdout + done.stderr
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)))
    return done.returncode, failed, "\n".join(out.strip().splitlines()[-5:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run only the mutations whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run (default 600)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or args.only in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name}  [{m.file}]  tests: {' '.join(m.tests)}")
        return 0
    if not chosen:
        print(f"no mutation's name contains {args.only!r}; see --list.", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="shardkit-mutation-") as tmp:
        copy = Path(tmp) / "repo"
        _copy_repo(copy)
        for tests in _baselines(chosen):
            code, failed, tail = _run_tests(copy, tests, args.timeout)
            if code != 0:  # the unmutated code must pass, or every mutation would look killed
                print(json.dumps({"baseline": "failed", "tests": " ".join(tests), "failed": failed,
                                  "output": tail}, indent=1))
                return 1
        for m in chosen:
            path = copy / m.file
            original = path.read_text()
            count = original.count(m.before)
            entry: dict[str, object] = {"mutation": m.name, "file": m.file, "tests": " ".join(m.tests)}
            if count != 1:
                entry.update(status="stale", detail=f"the snippet occurs {count} times in {m.file}, not once")
                results.append(entry)
                continue
            mutated = original.replace(m.before, m.after)
            try:
                compile(mutated, m.file, "exec")
            except SyntaxError as exc:
                entry.update(status="invalid", detail=str(exc))
                results.append(entry)
                continue
            t0 = time.perf_counter()
            path.write_text(mutated)
            try:
                code, failed, tail = _run_tests(copy, m.tests, args.timeout)
            finally:
                path.write_text(original)
            entry.update(status="killed" if code not in (0, 5) else "survived", failed=failed,
                         seconds=round(time.perf_counter() - t0, 1))
            if code == 5:
                entry["detail"] = "no test was collected"
            elif code != 0 and not failed:
                entry["detail"] = tail
            results.append(entry)
            print(f"{entry['status']:>8}  {m.name}", file=sys.stderr, flush=True)
    summary = {s: sum(r["status"] == s for r in results) for s in ("killed", "survived", "stale", "invalid")}
    print(json.dumps({"mutations": results, "summary": summary,
                      "seconds": round(time.perf_counter() - started, 1)}, indent=1))
    return 0 if summary["killed"] == len(results) else 1


def _baselines(chosen: list[Mutation]) -> list[tuple[str, ...]]:
    """The unmutated runs covering every mutation's selection: one per test file or node, ``-k`` joined by ``or``."""
    selections: dict[tuple[str, ...], list[str] | None] = {}
    for m in chosen:
        target, rest = m.tests[:1], m.tests[1:]
        if len(rest) == 2 and rest[0] == "-k" and selections.get(target, []) is not None:
            selections.setdefault(target, []).append(rest[1])  # type: ignore[union-attr]
        elif not rest:
            selections[target] = None  # the whole file or node
        else:
            selections[m.tests] = None  # anything else runs as it is
    return [(*target, "-k", " or ".join(f"({k})" for k in dict.fromkeys(keys))) if keys else target
            for target, keys in selections.items()]


if __name__ == "__main__":
    sys.exit(main())
