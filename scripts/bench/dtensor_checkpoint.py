#!/usr/bin/env python
"""Benchmark checkpoints of an FSDP2 model's DTensor state dict: shardkit against DCP, same run.

Not a test: it prints one JSON document (and, with ``--markdown``, a table for
docs/benchmarks-history.md). Workload: a model of 16 bias-free ``nn.Linear(4096, 4096)`` layers
(1 GiB fp32), ``fully_shard`` (FSDP2) on 4 Gloo ranks; its ``state_dict()`` holds 16
``Shard(0)`` DTensors of 256 MiB per rank in all. The *same* state dict goes to both libraries:

==============  ===============================================  =====================================
phase           shardkit                                         DCP
==============  ===============================================  =====================================
save            ``checkpoint.save(sd)``                          ``dcp.save(sd)`` (FileSystemWriter
                                                                 defaults: fsync on)
load_same       ``checkpoint.load`` into a second FSDP2 model's  ``dcp.load`` into the same
                state dict (4 ranks)
load_world      ``checkpoint.load`` of the 4-rank checkpoint     ``dcp.load`` of the 4-rank DCP folder
                into an FSDP2 model on 2 ranks                   into the same
convert         every entry to a ShardedTensor view              -
                (``st.from_dtensor``) and back (``to_dtensor``)
==============  ===============================================  =====================================

Plus the raw write speed of the same disk with one stream per rank (1/N GiB each, then
``fsync``): the pattern a sharded save has, and the ceiling for any save.

Method: each phase runs ``--repeat`` times between barriers; the median is reported (all
runs are kept). Ratios compare medians of the same run. Load targets exist before the clock
starts (a model being restored already has its memory). Loads read right after the saves,
from the page cache, for both libraries alike. Memory: peak RSS growth per rank over the
phase (``VmHWM`` reset through ``/proc/self/clear_refs``). GB/s is 1e9 bytes per second.

Usage::

    PYTHONPATH=. python scripts/bench/dtensor_checkpoint.py            # 1 GiB, a few minutes
    PYTHONPATH=. python scripts/bench/dtensor_checkpoint.py --quick    # 64 MiB, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# This folder holds a script named checkpoint.py: keep it off the path so that `import checkpoint`
# finds the package, here and in the ranks started from this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# After the repository root: bench/checkpoint.py is not the package.
sys.path.append(str(Path(__file__).resolve().parent))
from _harness import PeakGrowth, raw_write  # noqa: E402

from _shardkit.launch import run_distributed  # noqa: E402 - after the path set-up

GB = 1e9


_Peak = PeakGrowth


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import platform

    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "backend": "gloo (TCP on 127.0.0.1)", "load_average": [round(x, 2) for x in os.getloadavg()]}


def _fsdp2_model(layers: int, side: int, seed: int) -> Any:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(side, side, bias=False) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed + torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-1, 1, generator=g)
    return model


def _rank(rank: int, world: int, cfg: dict[str, int], folder: str, repeat: int, phase: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import checkpoint
    from checkpoint._dtensor import dtensor_views

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    out: dict[str, list[dict[str, float]]] = {}

    def once(fn: Callable[[], Any], setup: Callable[[], Any] | None) -> dict[str, float]:
        if setup is not None:
            setup()
        dist.barrier()
        with _Peak() as peak:
            start = time.perf_counter()
            fn()
            dist.barrier()
            seconds = time.perf_counter() - start
        gc.collect()
        return {"seconds": seconds, "growth_MiB": round(peak.growth / 2**20, 1)}

    def record(name: str, fn: Callable[[], Any], setup: Callable[[], Any] | None = None) -> None:
        out[name] = [once(fn, setup) for _ in range(repeat)]

    def record_pair(phase: str, ours_fn: Callable[[], Any], dcp_fn: Callable[[], Any],
                    ours_setup: Callable[[], Any] | None = None, dcp_setup: Callable[[], Any] | None = None) -> None:
        # Alternate the two libraries so that a noisy moment on the shared machine hits both.
        out[f"ours.{phase}"], out[f"dcp.{phase}"] = [], []
        for i in range(repeat):
            first, second = (("ours", ours_fn, ours_setup), ("dcp", dcp_fn, dcp_setup))[:: 1 if i % 2 == 0 else -1]
            for lib, fn, setup in (first, second):
                out[f"{lib}.{phase}"].append(once(fn, setup))

    ours, theirs = f"{folder}/shardkit", f"{folder}/dcp"
    if phase == "save":
        sd = _fsdp2_model(cfg["layers"], cfg["side"], seed=0).state_dict()

        def clear(path: str) -> None:
            if rank == 0 and os.path.exists(path):
                shutil.rmtree(path)
            dist.barrier()

        def convert() -> None:
            views, _ = dtensor_views(sd)
            meshes = {name: value.device_mesh for name, value in sd.items()}
            for name, view in views.items():
                view.to_dtensor(meshes[name])

        convert()  # first calls import and warm up DTensor's dispatch: not part of the cost
        record("convert", convert)
        record_pair("save", lambda: checkpoint.save(sd, ours, quiet=True), lambda: dcp.save(sd, checkpoint_id=theirs),
                    lambda: clear(ours), lambda: clear(theirs))
        target = _fsdp2_model(cfg["layers"], cfg["side"], seed=1).state_dict()
        target_dcp = _fsdp2_model(cfg["layers"], cfg["side"], seed=1).state_dict()
        record_pair("load_same", lambda: checkpoint.load(target, ours, quiet=True),
                    lambda: dcp.load(target_dcp, checkpoint_id=theirs))
        assert all(torch.equal(target[k].to_local(), sd[k].to_local()) for k in sd)
        assert all(torch.equal(target_dcp[k].to_local(), sd[k].to_local()) for k in sd)
    else:
        target = _fsdp2_model(cfg["layers"], cfg["side"], seed=1).state_dict()
        target_dcp = _fsdp2_model(cfg["layers"], cfg["side"], seed=2).state_dict()
        record_pair("load_world", lambda: checkpoint.load(target, ours, quiet=True),
                    lambda: dcp.load(target_dcp, checkpoint_id=theirs))
        assert all(torch.equal(target_dcp[k].to_local(), target[k].to_local()) for k in target)
    return out


def _summary(per_rank: list[dict[str, Any]], total: int) -> dict[str, Any]:
    summary = {}
    for name in per_rank[0]:
        runs = [max(r[name][i]["seconds"] for r in per_rank) for i in range(len(per_rank[0][name]))]
        med = statistics.median(runs)
        summary[name] = {"median_seconds": round(med, 3), "runs": [round(x, 3) for x in runs],
                         "GB_per_s": round(total / med / GB, 3),
                         "peak_growth_MiB_per_rank": [statistics.median(x["growth_MiB"] for x in r[name])
                                                      for r in per_rank]}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    args = parser.parse_args(argv)
    cfg = {"layers": 16, "side": 1024 if args.quick else 4096}
    total = cfg["layers"] * cfg["side"] ** 2 * 4
    folder = tempfile.mkdtemp(prefix="shardkit-bench-dtensor-", dir=os.environ.get("BENCH_DIR"))
    try:
        four = run_distributed(_rank, 4, cfg, folder, args.repeat, "save", timeout=3600)
        two = run_distributed(_rank, 2, cfg, folder, args.repeat, "load_world", timeout=3600)
        raw = run_distributed(raw_write, 4, folder, total, args.repeat, timeout=3600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    phases = {**_summary(four, total), **_summary(two, total)}
    raw_times = [max(r[i] for r in raw) for i in range(args.repeat)]
    raw_gbps = round(total / statistics.median(raw_times) / GB, 3)

    def ratio(phase: str) -> float:
        return round(phases[f"dcp.{phase}"]["median_seconds"] / phases[f"ours.{phase}"]["median_seconds"], 3)

    save_vs_disk = round(phases["ours.save"]["GB_per_s"] / raw_gbps, 3)
    goals = {
        "save >= 1.3x DCP or within 10% of the disk": {"ratio": ratio("save"), "fraction_of_raw_write": save_vs_disk,
                                                       "met": ratio("save") >= 1.3 or save_vs_disk >= 0.9},
        "load_same >= 2x DCP": {"ratio": ratio("load_same"), "met": ratio("load_same") >= 2},
        "load onto 2 ranks >= 2x DCP": {"ratio": ratio("load_world"), "met": ratio("load_world") >= 2},
        "convert costs no copy": {"seconds": phases["convert"]["median_seconds"],
                                  "peak_growth_MiB_per_rank": phases["convert"]["peak_growth_MiB_per_rank"],
                                  "met": max(phases["convert"]["peak_growth_MiB_per_rank"]) < 8},
    }
    results = {"machine": machine(), "state_dict_bytes": total, "config": cfg, "repeat": args.repeat,
               "raw_write_4_streams": {"GB_per_s": raw_gbps, "runs": [round(x, 3) for x in raw_times]},
               "phases": phases, "goals": goals}
    print(json.dumps(results, indent=2))
    if args.markdown:
        print("\n| phase | shardkit s | shardkit GB/s | DCP s | DCP GB/s | DCP/shardkit time | peak growth per rank, "
              "MiB (shardkit / DCP) |\n|---|---:|---:|---:|---:|---:|---|")
        for phase in ("save", "load_same", "load_world"):
            o, d = phases[f"ours.{phase}"], phases[f"dcp.{phase}"]
            print(f"| {phase} | {o['median_seconds']:.2f} | {o['GB_per_s']} | {d['median_seconds']:.2f} | "
                  f"{d['GB_per_s']} | {ratio(phase):.2f} | {o['peak_growth_MiB_per_rank']} / "
                  f"{d['peak_growth_MiB_per_rank']} |")
        c = phases["convert"]
        print(f"| convert (all 16, both ways) | {c['median_seconds']:.4f} | - | - | - | - | "
              f"{c['peak_growth_MiB_per_rank']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
