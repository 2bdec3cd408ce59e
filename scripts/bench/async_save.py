#!/usr/bin/env python
"""Benchmark checkpointing while training: shardkit's async_save against DCP's async_save.

Not a test: prints one JSON document. Workload: a 1 GiB fp32 state dict (16 tensors of
4096 x 4096, split on dim 0) over 4 Gloo ranks, in a training-like loop that saves after
every ``--every`` steps and keeps stepping while a save is in flight. Two kinds of step
(``--loop``, both by default, interleaved in the same run):

- ``cpu``: four 384 x 384 matrix products on the CPU (4 ranks share the cores with the writers);
- ``accelerator``: a sleep as long as the CPU step's median, the CPU left free as when the
  step runs on a device.

Modes, one save each per round, the order rotated from round to round, ``--saves`` rounds:

- ``ours.sync``: ``checkpoint.save`` (the training thread waits until it is durable);
- ``ours.async``: ``checkpoint.async_save``; training goes on while it is written;
- ``dcp.async``: ``torch.distributed.checkpoint.async_save`` on DTensors of the same layout.

Per save and rank it records: ``blocked`` (seconds the training thread spent in the save
call; for ``ours.async`` split into its parts), ``durable`` (from the call to the commit:
the handle's/future's completion; for shardkit split into phases: until the writer starts,
prepare, writing this rank's file, waiting for the others and the commit), the staging bytes
held afterwards, and the step times while a save is in flight against those with none (the
slowdown). Each save goes to a new folder; the disk is synced between saves. Figures are
medians per rank; the reported value is the slowest rank's median. It also times a plain
copy of each rank's bytes, every rank at once (into fresh and into reused memory): the
machine's limit for staging.

Usage::

    python scripts/bench/async_save.py                  # 1 GiB, 4 ranks, both loop kinds
    python scripts/bench/async_save.py --loop accelerator
    python scripts/bench/async_save.py --quick          # 64 MiB
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util  # noqa: E402
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# This folder's checkpoint.py (a benchmark) must not shadow the checkpoint package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if str(_HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(_HERE.parents[1]))


def _bench_module(name: str) -> Any:
    """A sibling bench script by file (``checkpoint.py`` here would shadow the package by name)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", _HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_harness = _bench_module("_harness")
_ckpt_bench = _bench_module("checkpoint")
ROOT, launch, machine = _harness.ROOT, _harness.launch, _harness.machine
_config, _dcp_state_dict = _ckpt_bench._config, _ckpt_bench._dcp_state_dict
_ours_specs, _ours_state_dict = _ckpt_bench._ours_specs, _ckpt_bench._ours_state_dict


def _compute(x: Any) -> Any:
    import torch

    start = time.perf_counter()
    for _ in range(4):
        x = torch.tanh(x @ x) * 0.5
    return x, time.perf_counter() - start


class _Marks:
    """When this rank's save reached each phase: ``_save``'s phase hooks, stamped with ``perf_counter``.

    The hooks run on whichever thread runs the save (the training thread for ``save``, the
    writer thread for ``async_save``): ``planned`` (prepare starts), ``writing`` (the ranks
    agreed, this rank's file is being written), ``data_written`` (this rank's file is written
    and fsynced).
    """

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def __call__(self, phase: str) -> None:
        self.times.setdefault(phase, time.perf_counter())

    def phases(self, start: float, end: float) -> dict[str, float] | None:
        """Seconds from the call to the writer's start, in prepare, writing, and after (``durable`` in all)."""
        t = self.times
        if not {"planned", "writing", "data_written"} <= set(t):
            return None
        return {"until_writer_runs": t["planned"] - start,       # async: staging, thread start
                "prepare": t["writing"] - t["planned"],          # rank 0: folder, lease; agreement
                "write_own_file": t["data_written"] - t["writing"],  # checksum, write, fsync
                "peers_and_commit": end - t["data_written"]}     # slowest rank, metadata, old files


def _memory_copy(nbytes: int, repeat: int) -> dict[str, float]:
    """The machine's copy rate, every rank at once: seconds for ``nbytes`` into fresh and into reused memory."""
    import torch
    import torch.distributed as dist

    source = torch.rand(nbytes // 4)
    target = torch.empty_like(source)
    target.copy_(source)  # fault its pages in once
    fresh, reused = [], []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        torch.empty_like(source).copy_(source)
        fresh.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        target.copy_(source)
        reused.append(time.perf_counter() - start)
    return {"fresh_s": statistics.median(fresh), "reused_s": statistics.median(reused)}


MODES = ("ours.sync", "ours.async", "dcp.async")


def _rank(rank: int, world: int, cfg: dict[str, int], folder: str, saves: int, every: int,
          loops: list[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import checkpoint
    from checkpoint import _async, _save

    spec, _ = _ours_specs(world)
    sd = _ours_state_dict(cfg, spec, "rand")
    mesh = init_device_mesh("cpu", (world,))
    dsd = _dcp_state_dict(cfg, mesh, 0, "rand")
    dcp_group = dist.new_group(backend="gloo")
    local_bytes = sum(s.tensor.numel() * 4 for t in sd.values() for s in t.local_shards())
    x = torch.rand(384, 384)
    out: dict[str, Any] = {"local_bytes": local_bytes, "memory_copy": _memory_copy(local_bytes, 5)}

    # The step an accelerator loop sleeps for: the CPU step's median with every rank computing
    # and no save in flight (the same on every rank: the slowest rank's).
    dist.barrier()
    quiet_steps = []
    for _ in range(30):
        x, seconds = _compute(x)
        quiet_steps.append(seconds)
    step = torch.tensor([statistics.median(quiet_steps[5:])], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    accelerator_step = float(step.item())
    out["accelerator_step_s"] = accelerator_step

    def train_step(kind: str) -> float:
        nonlocal x
        if kind == "cpu":
            x, seconds = _compute(x)
            return float(seconds)
        start = time.perf_counter()
        time.sleep(accelerator_step)  # the device computes; the CPU is free
        return time.perf_counter() - start

    marks = _Marks()
    _save._test_hook = marks

    def ours_sync(kind: str, i: int, record: dict[str, Any]) -> Any:
        start = time.perf_counter()
        checkpoint.save(sd, f"{folder}/{kind}-sync-{i}", quiet=True)
        end = time.perf_counter()
        record["blocked"].append(end - start)
        phases = marks.phases(start, end)
        return lambda: True, lambda: (end - start, phases)

    def ours_async(kind: str, i: int, record: dict[str, Any]) -> Any:
        start = time.perf_counter()
        handle = checkpoint.async_save(sd, f"{folder}/{kind}-async-{i}")
        record["blocked"].append(time.perf_counter() - start)
        record["blocked_parts"].append(dict(handle._blocked_parts))
        record["staging_bytes"].append(_async._staging_bytes())

        def finished() -> tuple[float, Any]:
            handle.result()
            assert handle._finished_at is not None
            return handle._finished_at - start, marks.phases(start, handle._finished_at)

        return handle.done, finished

    def dcp_async(kind: str, i: int, record: dict[str, Any]) -> Any:
        path = f"{folder}/{kind}-dcp-{i}"
        start = time.perf_counter()
        future = dcp.async_save(dsd, checkpoint_id=path, process_group=dcp_group)
        record["blocked"].append(time.perf_counter() - start)
        end: list[float] = []
        future.add_done_callback(lambda _: end.append(time.perf_counter()))

        def finished() -> tuple[float, Any]:
            future.result()
            while not end:
                time.sleep(0.001)
            return end[0] - start, None

        return future.done, finished

    start_save = {"ours.sync": ours_sync, "ours.async": ours_async, "dcp.async": dcp_async}
    records = {kind: {mode: {"blocked": [], "durable": [], "phases": [], "blocked_parts": [], "staging_bytes": [],
                             "busy": [], "quiet": []} for mode in MODES} for kind in loops}
    # Round-robin, one save per kind and mode in each round, the order rotated from round to
    # round: the disk's speed drifts, so every mode sees the same conditions. Every save goes
    # to a new folder, removed once it is durable (no save removes an older one's files inside
    # its timing), and the disk is synced before the next one (no save pays for the writeback
    # and discards the one before left).
    cases = [(kind, mode) for kind in loops for mode in MODES]
    for i in range(saves):
        for kind, mode in cases[i % len(cases):] + cases[:i % len(cases)]:
            record = records[kind][mode]
            for _ in range(every):
                record["quiet"].append(train_step(kind))
            if rank == 0:
                os.sync()  # the previous save's removals and writeback are not this save's cost
            dist.barrier()
            marks.times = {}
            done, finished = start_save[mode](kind, i, record)
            while not done():  # keep training until it is durable
                record["busy"].append(train_step(kind))
            durable, phases = finished()
            dist.barrier()
            if rank == 0:
                for name in os.listdir(folder):
                    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            record["durable"].append(durable)
            if phases is not None:
                record["phases"].append(phases)
    dist.barrier()
    _save._test_hook = None
    for kind in loops:
        out[kind] = {}
        for mode, r in records[kind].items():
            out[kind][mode] = {**{k: r[k] for k in ("blocked", "durable", "phases", "blocked_parts", "staging_bytes")},
                               "step_busy_median": statistics.median(r["busy"]) if r["busy"] else None,
                               "step_quiet_median": statistics.median(r["quiet"])}
    return out


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def _median_dict(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: _median([r[k] for r in rows]) for k in rows[0]} if rows else {}


def _summary(per_rank: list[dict[str, Any]], kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(modes, goals)`` of one loop kind: each rank's medians, the slowest rank's, the goal ratios."""
    modes: dict[str, Any] = {}
    for mode in per_rank[0][kind]:
        runs = [r[kind][mode] for r in per_rank]
        blocked = [_median(r["blocked"]) for r in runs]
        durable = [_median(r["durable"]) for r in runs]
        slow = [round(r["step_busy_median"] / r["step_quiet_median"], 3)
                if r["step_busy_median"] and r["step_quiet_median"] else None for r in runs]
        modes[mode] = {"blocked_s_median_per_rank": blocked, "blocked_s": max(blocked),
                       "durable_s_median_per_rank": durable, "durable_s": max(durable),
                       "step_quiet_s_median_per_rank": [r["step_quiet_median"] and round(r["step_quiet_median"], 4)
                                                        for r in runs],
                       "compute_step_slowdown_while_writing_per_rank": slow}
        if runs[0]["phases"]:
            modes[mode]["phases_s_median_per_rank"] = [_median_dict(r["phases"]) for r in runs]
        if runs[0]["blocked_parts"]:
            modes[mode]["blocked_parts_s_median_per_rank"] = [_median_dict(r["blocked_parts"]) for r in runs]
    local = [r["local_bytes"] for r in per_rank]
    staging = [r[kind]["ours.async"]["staging_bytes"] for r in per_rank]
    peak_ratio = max(max(s) / lb for s, lb in zip(staging, local))
    steady = all(len(set(s)) == 1 for s in staging)
    ours, sync, dcp = modes["ours.async"], modes["ours.sync"], modes["dcp.async"]
    goals = {
        "blocked <= 0.25x DCP": {"ratio": round(ours["blocked_s"] / dcp["blocked_s"], 3),
                                 "met": ours["blocked_s"] <= 0.25 * dcp["blocked_s"]},
        "durable <= 1.1x sync save": {"ratio": round(ours["durable_s"] / sync["durable_s"], 3),
                                      "dcp_ratio": round(dcp["durable_s"] / sync["durable_s"], 3),
                                      "met": ours["durable_s"] <= 1.1 * sync["durable_s"]},
        "staging <= 1.1x local bytes, steady": {"peak_over_local": round(peak_ratio, 3), "steady": steady,
                                                "staging_bytes_per_rank_per_save": staging,
                                                "met": peak_ratio <= 1.1 and steady},
    }
    return modes, goals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--every", type=int, default=5, help="compute steps between saves")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--loop", choices=("cpu", "accelerator", "both"), default="both",
                        help="compute step: CPU matrix products, a sleep as long (the CPU left free, "
                             "as accelerator compute does), or both in turn in the same run")
    parser.add_argument("--dir", default=None, help="scratch folder (default: <repo>/out)")
    args = parser.parse_args(argv)
    cfg = _config(args.quick)
    loops = ["cpu", "accelerator"] if args.loop == "both" else [args.loop]
    parent = Path(args.dir) if args.dir else ROOT / "out"
    parent.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="bench-async-", dir=parent)
    os.environ.setdefault("SHARDKIT_QUIET", "1")
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    try:
        per_rank = launch(_rank, args.world, cfg, folder, args.saves, args.every, loops)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    local = [r["local_bytes"] for r in per_rank]
    copies = [r["memory_copy"] for r in per_rank]
    result: dict[str, Any] = {
        "benchmark": "async_save",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["scripts/bench/async_save.py", *(argv if argv is not None else sys.argv[1:])]),
        "host": {**machine(), "load_average_at_start": load_at_start},
        "config": {**cfg, "world": args.world, "saves": args.saves, "every": args.every, "loops": loops},
        "local_bytes_per_rank": local,
        "accelerator_step_s": per_rank[0]["accelerator_step_s"],
        "memory_copy_of_local_bytes_every_rank_at_once": {
            "fresh_s_per_rank": [round(c["fresh_s"], 4) for c in copies],
            "reused_s_per_rank": [round(c["reused_s"], 4) for c in copies],
            "reused_gb_s_per_rank": [round(b / c["reused_s"] / 1e9, 2) for b, c in zip(local, copies)]},
        "loops": {}, "goals": {}}
    for kind in loops:
        modes, goals = _summary(per_rank, kind)
        result["loops"][kind] = modes
        result["goals"][kind] = goals
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
