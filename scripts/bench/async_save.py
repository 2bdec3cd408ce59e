#!/usr/bin/env python
"""Benchmark checkpointing while training: shardkit's async_save against DCP's async_save.

Not a test: prints one JSON document. Workload: a 1 GiB fp32 state dict (16 tensors of
4096 x 4096, split on dim 0) over 4 Gloo ranks, in a training-like loop: a compute step
(matrix products on a private tensor) runs continuously, and every ``--every`` steps the
state dict is saved, ``--saves`` times per mode. Modes, in the same run:

- ``ours.sync``: ``checkpoint.save`` (the training thread waits until it is durable);
- ``ours.async``: ``checkpoint.async_save``; training goes on while it is written;
- ``dcp.async``: ``torch.distributed.checkpoint.async_save`` on DTensors of the same layout.

Per save and rank it records: ``blocked`` (seconds the training thread spent in the save
call), ``durable`` (from the call to the commit: the handle's/future's completion), the
staging bytes held afterwards (shardkit), and the compute step times while a save is being
written against those with no save in flight (the slowdown). Before each save, the previous
one is waited for, as a checkpoint manager does. Figures are medians per rank; the reported
value is the slowest rank's median.

Usage::

    python scripts/bench/async_save.py            # 1 GiB, 4 ranks
    python scripts/bench/async_save.py --quick    # 64 MiB
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


def _rank(rank: int, world: int, cfg: dict[str, int], folder: str, saves: int, every: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import checkpoint
    from checkpoint import _async

    spec, _ = _ours_specs(world)
    sd = _ours_state_dict(cfg, spec, "rand")
    local_bytes = sum(s.tensor.numel() * 4 for t in sd.values() for s in t.local_shards())
    x = torch.rand(384, 384)
    out: dict[str, Any] = {"local_bytes": local_bytes}

    def loop(name: str, start_save: Any) -> dict[str, Any]:
        blocked, durable, staging, busy, quiet = [], [], [], [], []
        pending: Any = None
        nonlocal x
        for i in range(saves):
            for _ in range(every):
                x, seconds = _compute(x)
                (busy if pending is not None and not pending[0]() else quiet).append(seconds)
            while pending is not None and not pending[0]():  # keep training until it is durable
                x, seconds = _compute(x)
                busy.append(seconds)
            if pending is not None:
                durable.append(pending[1]())
            dist.barrier()
            pending = start_save(i, blocked)
            if name == "ours.async":
                staging.append(_async._staging_bytes())
        while not pending[0]():
            x, seconds = _compute(x)
            busy.append(seconds)
        durable.append(pending[1]())
        dist.barrier()
        return {"blocked": blocked, "durable": durable, "staging_bytes": staging,
                "step_busy_median": statistics.median(busy) if busy else None,
                "step_quiet_median": statistics.median(quiet) if quiet else None}

    def ours_sync(i: int, blocked: list[float]) -> Any:
        start = time.perf_counter()
        checkpoint.save(sd, f"{folder}/sync-{i % 2}", quiet=True)
        blocked.append(time.perf_counter() - start)
        took = blocked[-1]
        return (lambda: True, lambda: took)

    def ours_async(i: int, blocked: list[float]) -> Any:
        start = time.perf_counter()
        handle = checkpoint.async_save(sd, f"{folder}/async-{i % 2}")
        blocked.append(time.perf_counter() - start)

        def finished() -> float:
            handle.result()
            return handle._finished_at - start

        return (handle.done, finished)

    out["ours.sync"] = loop("ours.sync", ours_sync)
    out["ours.async"] = loop("ours.async", ours_async)

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    dsd = _dcp_state_dict(cfg, mesh, 0, "rand")
    dcp_group = dist.new_group(backend="gloo")

    def dcp_async(i: int, blocked: list[float]) -> Any:
        path = f"{folder}/dcp-{i}"
        start = time.perf_counter()
        future = dcp.async_save(dsd, checkpoint_id=path, process_group=dcp_group)
        blocked.append(time.perf_counter() - start)
        end: list[float] = []
        future.add_done_callback(lambda _: end.append(time.perf_counter()))

        def finished() -> float:
            future.result()
            while not end:
                time.sleep(0.001)
            if i >= 2 and rank == 0:
                shutil.rmtree(f"{folder}/dcp-{i - 2}", ignore_errors=True)
            return end[0] - start

        return (future.done, finished)

    out["dcp.async"] = loop("dcp.async", dcp_async)
    return out


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--every", type=int, default=5, help="compute steps between saves")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--dir", default=None, help="scratch folder (default: <repo>/out)")
    args = parser.parse_args(argv)
    cfg = _config(args.quick)
    parent = Path(args.dir) if args.dir else ROOT / "out"
    parent.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="bench-async-", dir=parent)
    os.environ.setdefault("SHARDKIT_QUIET", "1")
    try:
        per_rank = launch(_rank, args.world, cfg, folder, args.saves, args.every)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    modes: dict[str, Any] = {}
    for mode in ("ours.sync", "ours.async", "dcp.async"):
        blocked = [_median(r[mode]["blocked"]) for r in per_rank]
        durable = [_median(r[mode]["durable"]) for r in per_rank]
        slow = [round(r[mode]["step_busy_median"] / r[mode]["step_quiet_median"], 3)
                if r[mode]["step_busy_median"] and r[mode]["step_quiet_median"] else None for r in per_rank]
        modes[mode] = {"blocked_s_median_per_rank": blocked, "blocked_s": max(blocked),
                       "durable_s_median_per_rank": durable, "durable_s": max(durable),
                       "compute_step_slowdown_while_writing_per_rank": slow}
    local = [r["local_bytes"] for r in per_rank]
    staging = [r["ours.async"]["staging_bytes"] for r in per_rank]
    peak_ratio = max(max(s) / lb for s, lb in zip(staging, local))
    steady = all(len(set(s)) == 1 for s in staging)
    ours, sync, dcp = modes["ours.async"], modes["ours.sync"], modes["dcp.async"]
    goals = {
        "blocked <= 0.25x DCP": {"ratio": round(ours["blocked_s"] / dcp["blocked_s"], 3),
                                 "met": ours["blocked_s"] <= 0.25 * dcp["blocked_s"]},
        "durable <= 1.1x sync save": {"ratio": round(ours["durable_s"] / sync["durable_s"], 3),
                                      "met": ours["durable_s"] <= 1.1 * sync["durable_s"]},
        "staging <= 1.1x local bytes, steady": {"peak_over_local": round(peak_ratio, 3), "steady": steady,
                                                "met": peak_ratio <= 1.1 and steady},
    }
    result = {"benchmark": "async_save",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["scripts/bench/async_save.py", *(argv if argv is not None else sys.argv[1:])]),
              "host": machine(), "config": {**cfg, "world": args.world, "saves": args.saves, "every": args.every},
              "local_bytes_per_rank": local, "staging_bytes_per_rank_per_save": staging,
              "modes": modes, "goals": goals}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
