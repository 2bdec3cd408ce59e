#!/usr/bin/env python
"""Curated mutation check: each safety check switched off, and each computed value changed, must make a test fail.

Every mutation names a file, an exact snippet of its source, a replacement that disables one
check or changes one computed value (a gradient's scaling, a summation order, a routing
weight), and the tests expected to notice. The repository is copied once to a temporary
folder (the working tree is never touched); each mutation is applied to that copy alone, the
named tests run there (``PYTHONPATH`` at the copy), and the file is restored before the next
one. The copy is removed however the run ends: normally, on an error, or on SIGINT, SIGTERM
or SIGHUP (each stops the test run under way, its process group included, first).

A mutation is *killed* when its tests fail, *survived* when they pass, *timeout* when they
run past ``--timeout`` (not a kill: a test that hangs on a mutation notices nothing, it only
stops the check), *stale* when its snippet no longer occurs exactly once in the file (the
code moved: update the list), and *invalid* when the mutated file no longer compiles. The
named tests are first run unmutated (each selection must pass, or its mutations would look
killed). Prints JSON; exits 1 unless every mutation is killed::

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
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORRUPTION = "tests/unit/test_checkpoint_corruption.py"
READ_PATHS = f"{CORRUPTION}::test_a_flipped_byte_is_caught_on_every_read_path"
STEPS = "tests/unit/test_manager_steps.py"
UNTRUSTED = "tests/unit/test_untrusted_input.py"
VERSIONS = "tests/unit/test_format_versions.py"
HF_CACHE = "tests/unit/test_hf_cache.py"
FULLY_SHARD = "tests/distributed/test_fully_shard.py"
MOE = "tests/distributed/test_moe.py"
RULES = "tests/unit/test_split_rules.py"
ENGINE = "sharded_tensor/_model/engine/"


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
    Mutation("manager: a symbolic link is never a step (pruning would follow it)", "checkpoint/_steps.py",
             'if step is None or entry.get("type") != "directory" or entry.get("islink"):', "if step is None:",
             ("tests/unit/test_manager_safety.py", "-k", "symbolic")),
    Mutation("manager: names that are not exactly a step's name are left alone", "checkpoint/_steps.py",
             "    return step if name == step_name(step) else None", "    return step",
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
    Mutation("manager: a committed step is not overwritten unless asked", "checkpoint/_manager.py",
             "        if rank == 0 and step in self.steps():\n", "        if False:\n",
             (STEPS, "-k", "overwritten")),
    Mutation("manager root readers: 11 and more digits are steps too", "checkpoint/_steps.py",
             '_PATTERN = re.compile(r"^step-([0-9]{10,250})$")', '_PATTERN = re.compile(r"^step-([0-9]{10})$")',
             (STEPS, "-k", "boundary or latest_step")),
    # -- file names and DCP metadata: each check on its own ---------------------------------------------
    Mutation("file names: '..' is not a plain name", "checkpoint/_schema.py",
             'name not in ("", ".", "..")', 'name not in ("", ".")', (UNTRUSTED, "-k", "file_names")),
    Mutation("DCP metadata: storage offsets and lengths are non-negative ints", "checkpoint/_dcp_metadata.py",
             "        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in (info.offset, info.length)"
             "):", "        if False:", (UNTRUSTED, "-k", "dcp_storage")),
    Mutation("DCP metadata: persistent ids are refused", "checkpoint/_dcp_metadata.py",
             '        msg = f"DCP metadata {self._source!r} holds a persistent reference',
             '        return None\n        msg = f"DCP metadata {self._source!r} holds a persistent reference',
             (UNTRUSTED, "-k", "persistent")),
    Mutation("DCP metadata: a tensor of 2**63 bytes or more is refused", "checkpoint/_dcp_metadata.py",
             "        if math.prod(size) * entry.properties.dtype.itemsize >= 2**63:", "        if False:",
             (UNTRUSTED, "-k", "2_63")),
    # -- untrusted bytes cost bounded time --------------------------------------------------------------
    Mutation("DCP metadata: its pickle is measured before it is unpickled", "checkpoint/_dcp_metadata.py",
             '        scan(data, what=f"DCP metadata {source!r}")', "        pass",
             (UNTRUSTED, "-k", "crafted_pickle and not CLI and not entry")),
    Mutation("pickle scan: memo reads count in full (expanded size)", "checkpoint/_pickle_scan.py",
             "            node.size += child.size\n", "            node.size += 1\n",
             (UNTRUSTED, "-k", "random_pickles")),
    Mutation("pickle scan: a container changed after it was placed is refused (recursion)",
             "checkpoint/_pickle_scan.py", "        if node.sealed or any(child is node for child in children):",
             "        if False:", (UNTRUSTED, "-k", "random_pickles")),
    Mutation("DCP non-tensor entries: their pickle is measured before torch.load", "checkpoint/_dcp.py",
             '        _check_saved_value(value.getvalue(), f"DCP checkpoint {self.source!r}: the non-tensor entry '
             '{name!r}")', "        pass", (UNTRUSTED, "-k", "crafted_pickle and entry")),
    Mutation("JSON: nesting depth is measured before parsing", "checkpoint/_strict_json.py",
             "    if depth > MAX_DEPTH:\n", "    if False:\n", (UNTRUSTED, "-k", "deep_json or random_json")),
    Mutation("JSON: a duplicate key is refused", "checkpoint/_strict_json.py",
             "    if len(out) != len(pairs):\n", "    if False:\n", (UNTRUSTED, "-k", "duplicate")),
    Mutation("save: a value readers would refuse is never written", "checkpoint/_walk.py",
             "    _check_expanded(name, value)\n", "", (UNTRUSTED, "-k", "never_saved")),
    # -- the metadata's version -------------------------------------------------------------------------
    Mutation("metadata: checked by the rules of the newest version its fields show", "checkpoint/_schema.py",
             "    if writer > version:\n", "    if False:\n", (VERSIONS, "-k", "writers_version")),
    Mutation("verify --strict: unchecksummed versions are refused", "checkpoint/_cli.py",
             "        if strict and unguarded:\n", "        if False:\n", (VERSIONS, "-k", "strict")),
    # -- Hugging Face cache links -----------------------------------------------------------------------
    Mutation("cache links: only into the same cache's blobs/", "checkpoint/_safe_open.py",
             "    return target if target.startswith(inside) else None", "    return target",
             (HF_CACHE, "-k", "out_of_the_cache or another or links_out")),
    Mutation("cache links: only under <cache>/snapshots/<revision>", "checkpoint/_safe_open.py",
             '        if parts[k - 1] == "snapshots":', "        if True:",
             (HF_CACHE, "-k", "outside_a_snapshot")),
    # -- fully_shard: computed values -------------------------------------------------------------------
    Mutation("fully_shard: gradients averaged over the ranks", "sharded_tensor/_fsdp/unit.py",
             "                total.div_(plan.world)\n", "                pass\n",
             (FULLY_SHARD, "-k", "whole_batch and 2ranks and mlp and sgd")),
    Mutation("fully_shard: gradients summed in rank order (bit for bit)", "sharded_tensor/_fsdp/unit.py",
             "                parts.insert(me, rows)\n", "                parts.append(rows)\n",
             (FULLY_SHARD, "-k", "communication and 3ranks")),
    Mutation("fully_shard: parameters changed since the gather are gathered again", "sharded_tensor/_fsdp/unit.py",
             '        if self.state == "unsharded" and self._versions != [p._version for p in self.local]:',
             "        if False:", (FULLY_SHARD, "-k", "without_backward and 2ranks")),
    Mutation("fully_shard: a parameter without a gradient keeps none", "sharded_tensor/_fsdp/unit.py",
             "                if not present or not param.requires_grad:\n",
             "                if not param.requires_grad:\n", (FULLY_SHARD, "-k", "unused and 2ranks")),
    Mutation("fully_shard: ... also through a no_sync accumulation", "sharded_tensor/_fsdp/unit.py",
             "            had = [now or before for now, before in zip(had, self.accumulated_had)]",
             "            had = [True] * len(had)", (FULLY_SHARD, "-k", "unused and 2ranks")),
    Mutation("fully_shard: no_sync keeps the micro-batches' gradients", "sharded_tensor/_fsdp/unit.py",
             "                    self.accumulated[plan.full_slice(flat)].add_(grad.reshape(-1))\n",
             "                    pass\n", (FULLY_SHARD, "-k", "no_sync_accumulation and 2ranks")),
    Mutation("fully_shard: no_sync defers the reduction", "sharded_tensor/_fsdp/api.py",
             "        unit.sync = False\n", "        pass\n", (FULLY_SHARD, "-k", "no_sync_accumulation and 2ranks")),
    # -- expert routing -------------------------------------------------------------------------------
    Mutation("experts: outputs weighted by the router", "sharded_tensor/_model/experts.py",
             "    y = grouped_mm(act(gate) * up, down, rows.counts, linear=True) * rows.weights(weights)\n",
             "    y = grouped_mm(act(gate) * up, down, rows.counts, linear=True)\n",
             (MOE, "-k", "sharded_equals and 2ranks")),
    Mutation("experts: a rank runs its own experts (expert parallel)", "sharded_tensor/_model/experts.py",
             "    local = flat - first if first else flat\n",
             "    local = flat\n", (MOE, "-k", "sharded_equals and 2ranks")),
    Mutation("experts: the router's and the hidden states' gradients summed over ranks",
             "sharded_tensor/_model/experts.py",
             '        _comm.all_reduce(both, ctx.group, what="experts backward (all_reduce)")\n', "",
             (MOE, "-k", "sharded_equals and 2ranks")),
    Mutation("experts: the all-to-all combine adds the other ranks' rows", "sharded_tensor/_model/experts.py",
             "            mine[hits[peer][own]] += recvs[peer]\n", "            pass\n",
             (MOE, "-k", "sharded_equals and 2ranks")),
    # -- the compute engine: the vocabulary-parallel loss, the strided split, the moves' adjoints ----------
    Mutation("engine loss: a target is inside a rank's slice below its end only", ENGINE + "loss.py",
             "        inside = (target >= start) & (target < start + length)\n",
             "        inside = (target >= start) & (target <= start + length)\n", (RULES, "-k", "cross_entropy_at")),
    Mutation("engine loss: the loss in the logits' dtype (float64 kept)", "sharded_tensor/_model/engine/loss.py",
             "        return loss.to(logits.dtype)\n", "        return loss.float()\n",
             (RULES, "-k", "cross_entropy_at")),
    Mutation("engine loss: the target logit's gradient", "sharded_tensor/_model/engine/loss.py",
             "        probs.scatter_add_(1, local.unsqueeze(1), -inside.to(probs.dtype).unsqueeze(1))\n", "",
             (RULES, "-k", "cross_entropy_at")),
    Mutation("engine: a whole operand's gradient summed over the ranks (copy_to_ranks)",
             "sharded_tensor/_model/engine/placements.py",
             "            return _all_reduce(grad, ctx.group), None\n", "            return grad, None\n",
             (RULES, "-k", "rule_on_parts and linear")),
    Mutation("engine: a replica's gradient is one share of the whole (first holder only)",
             "sharded_tensor/_model/engine/placements.py",
             "    if intervals.index(intervals[rank]) != rank and length:\n", "    if False:\n",
             (RULES, "-k", "rule_on_parts and (linear or matmul or attention)")),
    Mutation("engine strided: each block's rows gathered within the block", ENGINE + "placements.py",
             "        return gather(self.unmerged(x), self.dim + 1, self.intervals, self.group).flatten(self.dim, "
             "self.dim + 1)\n",
             "        return gather(self.unmerged(x), self.dim, self.intervals, self.group).flatten(self.dim, "
             "self.dim + 1)\n", (RULES, "-k", "Strided or merged_heads")),
    Mutation("engine dropout: this rank's slice of the whole mask", "sharded_tensor/_model/engine/split.py",
             "    return x * noise.narrow(split.dim, start, length)\n",
             "    return x * noise.narrow(split.dim, 0, length)\n", (RULES, "-k", "dropout_draws")),
    Mutation("engine conv1d: a packed input's filters cut in its slices' order", ENGINE + "conv.py",
             "    return torch.cat(parts, dim)\n", "    return torch.cat(parts[::-1], dim)\n",
             (RULES, "-k", "Packed-conv1d or causal_convolution")),
    Mutation("engine pad: padding along the split gathers", ENGINE + "conv.py",
             "        if x.dim() - 1 - i == placement.dim and (pads[2 * i] or pads[2 * i + 1]):\n",
             "        if False:\n", (RULES, "-k", "Split-pad")),
    Mutation("engine repeat_interleave: the split scaled by the repeats", ENGINE + "heads.py",
             "    return Decision(out=scaled)\n", "    return Decision(out=split)\n",
             (RULES, "-k", "repeat_interleave or gated_delta")),
    Mutation("engine solve_triangular: only B's independent dimension splits", ENGINE + "heads.py",
             "        elif t is b and s.dim == independent and sa is None:\n",
             "        elif t is b and s.dim >= b.dim() - 2 and sa is None:\n", (RULES, "-k", "solve_triangular")),
    Mutation("engine strided reductions: never over the strided dimension", ENGINE + "heads.py",
             "    if placement.dim in normed or not isinstance(call.meta_out(), Tensor):\n",
             "    if not isinstance(call.meta_out(), Tensor):\n", (RULES, "-k", "Strided-sum or Strided-mean")),
    Mutation("engine packed cat: each operand's slices offset by the sizes before it", ENGINE + "packed.py",
             "        offset += p.size  # type: ignore[union-attr]\n", "        offset += 0\n",
             (RULES, "-k", "Packed-cat or causal_convolution")),
    Mutation("engine packed element-wise: a whole operand along the packed dimension gathers", ENGINE + "packed.py",
             "        if local_dim >= 0 and t.shape[local_dim] != 1:\n", "        if False:\n",
             (RULES, "-k", "Packed-add or Packed-mul")),
    Mutation("engine packed transpose: the packed dimension moves", ENGINE + "packed.py",
             "    return Decision(out=moved(packed, permuted_dim(call, packed.dim)))\n",
             "    return Decision(out=packed)\n", (RULES, "-k", "Packed-transpose or causal_convolution")),
]


def _copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache",
                                    "site", "*.egg-info")
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)


TIMED_OUT = -1  # the exit code ``_run_tests`` reports for a run stopped at its timeout


class _Stopped(BaseException):
    """SIGTERM or SIGHUP: unwind like KeyboardInterrupt, so every ``finally`` (the copy's removal) runs."""


def _stop(signum: int, frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)


def _run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, list[str], str]:
    """``(exit code, failed test ids, last lines of output)`` of pytest on ``tests`` in the copy.

    pytest runs in its own process group (distributed tests start ranks of their own); at the
    timeout, or if this script is stopped, the whole group is killed. A timeout returns
    ``TIMED_OUT``.
    """
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider", *tests]
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return TIMED_OUT, [], f"timed out after {timeout:g} s"
    except BaseException:
        _kill_group(proc)
        raise
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)))
    return proc.returncode, failed, "\n".join(out.strip().splitlines()[-5:])


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


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
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    tmp = tempfile.mkdtemp(prefix="shardkit-mutation-")
    try:
        return _check(chosen, Path(tmp) / "repo", args.timeout, started)
    except (KeyboardInterrupt, _Stopped) as exc:
        print(f"mutation check stopped ({type(exc).__name__} {exc}); removing {tmp}", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check(chosen: list[Mutation], copy: Path, timeout: float, started: float) -> int:
    """Run the baselines, then every mutation, in ``copy``; print the JSON report; the exit status."""
    results = []
    _copy_repo(copy)
    for tests in _baselines(chosen):
        code, failed, tail = _run_tests(copy, tests, timeout)
        if code != 0:  # the unmutated code must pass, or every mutation would look killed
            print(json.dumps({"baseline": "timeout" if code == TIMED_OUT else "failed", "tests": " ".join(tests),
                              "failed": failed, "output": tail}, indent=1))
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
            code, failed, tail = _run_tests(copy, m.tests, timeout)
        finally:
            path.write_text(original)
        status = "timeout" if code == TIMED_OUT else "survived" if code in (0, 5) else "killed"
        entry.update(status=status, failed=failed, seconds=round(time.perf_counter() - t0, 1))
        if code == 5:
            entry["detail"] = "no test was collected"
        elif status == "killed" and not failed:
            entry["detail"] = tail
        elif status == "timeout":
            entry["detail"] = f"the tests ran past --timeout={timeout:g} s: a hang is not a kill"
        results.append(entry)
        print(f"{entry['status']:>8}  {m.name}", file=sys.stderr, flush=True)
    statuses = ("killed", "survived", "timeout", "stale", "invalid")
    summary = {s: sum(r["status"] == s for r in results) for s in statuses}
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
