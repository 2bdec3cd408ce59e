#!/usr/bin/env python
"""Benchmark shardkit checkpoints against torch.distributed.checkpoint (DCP) and the raw disk.

Not a test: it prints one JSON document (and, with ``--markdown``, a table for
docs/benchmarks-history.md). Default workload, from issue 4: a 1 GiB fp32 state dict of 16 tensors
of 64 MiB (4096 x 4096), split on dim 0, on 4 and then 2 Gloo ranks (one process per rank):

=================  ==========================================  =============================================
phase              shardkit                                    DCP (DTensors, same layout, DeviceMesh("cpu"))
=================  ==========================================  =============================================
save               checkpoint.save                             dcp.save (FileSystemWriter defaults)
load_same          checkpoint.load into dim-0 ShardedTensors   dcp.load into Shard(0) DTensors
load_dim1          checkpoint.load into dim-1 ShardedTensors   dcp.load into Shard(1) DTensors
load_world         2 ranks load the 4-rank checkpoint (dim 0)  2 ranks dcp.load the 4-rank DCP checkpoint
collect            checkpoint.collect_state_dict -> rank 0     get_model_state_dict(full_state_dict=True,
                                                               cpu_offload=True) on DTensor parameters
consolidate        checkpoint.consolidate -> one .safetensors  format_utils.dcp_to_torch_save -> one file
                   (1 process, 4-rank checkpoint)              (1 process, 4-rank DCP checkpoint)
=================  ==========================================  =============================================

Plus the raw sequential write speed of the same disk: one stream writing 1 GiB in 64 MiB
blocks then ``fsync``, and N parallel streams (one per rank) writing 1/N GiB each then
``fsync`` -- the pattern a sharded save has.

Method:
- Every phase is timed between two barriers and repeated ``--repeat`` times; the best
  (shortest) time is reported, with all repetitions kept in the JSON.
- Load targets are allocated and zero-filled before the clock starts (a model being
  restored already has its memory), for both libraries alike.
- Loads read right after the saves, so data comes from the page cache for both libraries;
  the cache is not dropped (that would disturb the whole machine).
- Memory: before each phase every process resets its peak RSS (``/proc/self/clear_refs``,
  Linux) and reports ``VmHWM - VmRSS`` afterwards: the phase's peak growth, per rank.
- GB/s is 1e9 bytes of state dict per second.

Usage::

    python scripts/bench/checkpoint.py                 # full run (1 GiB), ~ a few minutes
    python scripts/bench/checkpoint.py --quick         # 64 MiB, seconds
    python scripts/bench/checkpoint.py --markdown      # also print a Markdown table
    python scripts/bench/checkpoint.py --phases collect  # collect alone (no save, no disk)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# After the repository root: bench/checkpoint.py is not the package.
sys.path.append(str(Path(__file__).resolve().parent))
from _harness import PeakGrowth, raw_write  # noqa: E402

from _shardkit.launch import run_distributed  # noqa: E402 - after the path set-up

GB = 1e9

PHASES = frozenset({"save", "load_same", "load_dim1", "load_world", "collect", "consolidate"})
# Phases that read the checkpoint a save phase wrote.
_READERS = frozenset({"load_same", "load_dim1", "load_world", "consolidate"})


# -- memory ------------------------------------------------------------------------------------

_Peak = PeakGrowth


# -- workload ------------------------------------------------------------------------------------

def _config(quick: bool) -> dict[str, int]:
    # 16 tensors either way; 4096 x 4096 fp32 = 64 MiB each (1 GiB), quick: 1024 x 1024 (64 MiB).
    side = 1024 if quick else 4096
    return {"n": 16, "rows": side, "cols": side}


def _timed(fn: Callable[[], Any], barrier: Callable[[], None]) -> tuple[float, int, Any]:
    barrier()
    with _Peak() as peak:
        start = time.perf_counter()
        result = fn()
        barrier()
        seconds = time.perf_counter() - start
    return seconds, peak.growth, result


def _ours_specs(world: int):  # type: ignore[no-untyped-def]
    from sharding import single_split

    ranks = [f"rank:{r}/cpu" for r in range(world)]
    return single_split(0, ranks), single_split(1, ranks)


def _ours_state_dict(cfg: dict[str, int], spec, fill: str):  # type: ignore[no-untyped-def]
    import torch

    import sharded_tensor as st

    sd = {}
    for i in range(cfg["n"]):
        t = st.empty(cfg["rows"], cfg["cols"], sharding_spec=spec, dtype=torch.float32)
        for shard in t.local_shards():
            if fill == "rand":
                shard.tensor.uniform_()
            else:
                shard.tensor.zero_()
        sd[f"layers.{i}.weight"] = t
    return sd


def _dcp_state_dict(cfg: dict[str, int], mesh, dim: int, fill: str):  # type: ignore[no-untyped-def]
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: F401

    world, rank = mesh.size(), mesh.get_local_rank()
    sd = {}
    for i in range(cfg["n"]):
        size = [cfg["rows"], cfg["cols"]]
        chunk = -(-size[dim] // world)
        lo, hi = min(rank * chunk, size[dim]), min((rank + 1) * chunk, size[dim])
        local_size = list(size)
        local_size[dim] = hi - lo
        local = torch.empty(local_size, dtype=torch.float32)
        local.uniform_() if fill == "rand" else local.zero_()
        sd[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False,
                                                      shape=torch.Size(size), stride=(size[1], 1))
    return sd


def _rank_phases(rank: int, world: int, cfg: dict[str, int], folder: str, repeat: int, which: list[str],
                 load_world_from: int | None, phases: frozenset[str] = PHASES) -> dict[str, Any]:
    """One rank's part of the distributed ``phases``, for shardkit and DCP."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    barrier = dist.barrier
    out: dict[str, Any] = {}

    def record(name: str, fn: Callable[[], Any], setup: Callable[[], Any] | None = None) -> None:
        runs = []
        for _ in range(repeat):
            if setup is not None:
                setup()
            seconds, growth, _ = _timed(fn, barrier)
            runs.append({"seconds": seconds, "growth": growth})
            gc.collect()
        out[name] = runs

    base = Path(folder)
    if "ours" in which:
        import checkpoint

        dim0, dim1 = _ours_specs(world)
        sd = _ours_state_dict(cfg, dim0, "rand")
        path = str(base / f"ours-{world}")

        def clear(p: str = path) -> None:
            if rank == 0 and os.path.exists(p):
                shutil.rmtree(p)
            barrier()

        if "save" in phases:
            record("ours.save", lambda: checkpoint.save(sd, path), setup=clear)
        if "load_same" in phases:
            target = _ours_state_dict(cfg, dim0, "zero")
            record("ours.load_same", lambda: checkpoint.load(target, path))
            _check_equal_ours(sd, target)
            del target
        if "load_dim1" in phases:
            target = _ours_state_dict(cfg, dim1, "zero")
            record("ours.load_dim1", lambda: checkpoint.load(target, path))
            del target
        gc.collect()
        if load_world_from is not None and "load_world" in phases:
            target = _ours_state_dict(cfg, dim0, "zero")
            other = str(base / f"ours-{load_world_from}")
            record("ours.load_world", lambda: checkpoint.load(target, other))
            del target
        if "collect" in phases:
            record("ours.collect", lambda: checkpoint.collect_state_dict(sd))
        del sd
        gc.collect()
    if "dcp" in which:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        sd = _dcp_state_dict(cfg, mesh, 0, "rand")
        path = str(base / f"dcp-{world}")

        def clear_dcp(p: str = path) -> None:
            if rank == 0 and os.path.exists(p):
                shutil.rmtree(p)
            barrier()

        if "save" in phases:
            record("dcp.save", lambda: dcp.save(sd, checkpoint_id=path), setup=clear_dcp)
        if "load_same" in phases:
            target = _dcp_state_dict(cfg, mesh, 0, "zero")
            record("dcp.load_same", lambda: dcp.load(target, checkpoint_id=path))
            del target
        if "load_dim1" in phases:
            target = _dcp_state_dict(cfg, mesh, 1, "zero")
            record("dcp.load_dim1", lambda: dcp.load(target, checkpoint_id=path))
            del target
        gc.collect()
        if load_world_from is not None and "load_world" in phases:
            target = _dcp_state_dict(cfg, mesh, 0, "zero")
            other = str(base / f"dcp-{load_world_from}")
            record("dcp.load_world", lambda: dcp.load(target, checkpoint_id=other))
            del target
        if "collect" in phases:
            record("dcp.collect", lambda: _dcp_full_state_dict(sd))
        del sd
    return out


def _check_equal_ours(saved: dict[str, Any], loaded: dict[str, Any]) -> None:
    import torch

    for name, value in saved.items():
        for a, b in zip(value.local_shards(), loaded[name].local_shards()):
            if not torch.equal(a.tensor, b.tensor):
                msg = f"benchmark sanity check: {name} differs after load"
                raise AssertionError(msg)


def _dcp_full_state_dict(sd: dict[str, Any]) -> Any:
    """DCP's way to a full state dict on rank 0: get_model_state_dict on DTensor parameters."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    model = torch.nn.Module()
    for name, value in sd.items():
        module = model
        *parents, leaf = name.split(".")
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _consolidate_phase(rank: int, world: int, folder: str, repeat: int, which: list[str]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    out: dict[str, Any] = {}
    base = Path(folder)

    def record(name: str, fn: Callable[[], Any], output: Path) -> None:
        runs = []
        for _ in range(repeat):
            if output.exists():
                shutil.rmtree(output) if output.is_dir() else output.unlink()
            seconds, growth, _ = _timed(fn, lambda: None)
            runs.append({"seconds": seconds, "growth": growth})
            gc.collect()
        out[name] = runs
        if output.exists():
            shutil.rmtree(output) if output.is_dir() else output.unlink()

    if "ours" in which:
        import checkpoint

        single = base / "ours-consolidated.safetensors"
        record("ours.consolidate", lambda: checkpoint.consolidate(str(base / "ours-4"), str(single)), single)
    if "dcp" in which:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        single = base / "dcp-consolidated.pt"
        record("dcp.consolidate", lambda: dcp_to_torch_save(str(base / "dcp-4"), str(single)), single)
    return out


# -- reporting ---------------------------------------------------------------------------------

def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in runs]
    return {"seconds": min(seconds), "median_seconds": statistics.median(seconds), "all_seconds": seconds}


def _summarize(per_rank: list[dict[str, Any]], total: int) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name in per_rank[0]:
        # A phase ends with a barrier, so every rank sees about the same time; take the slowest.
        runs = [max(per_rank[r][name][i]["seconds"] for r in range(len(per_rank)))
                for i in range(len(per_rank[0][name]))]
        best = min(runs)
        summary[name] = {
            "seconds": round(best, 4),
            "median_seconds": round(statistics.median(runs), 4),
            "all_seconds": [round(s, 4) for s in runs],
            "GB_per_s": round(total / best / GB, 3),
            "peak_growth_MiB_per_rank": [round(max(r["growth"] for r in per_rank[k][name]) / 2**20, 1)
                                         for k in range(len(per_rank))],
        }
    return summary


def _ratios(summary: dict[str, Any], key: str = "seconds") -> dict[str, float]:
    """Throughput ratio ours/DCP per phase (> 1: ours is faster), from best or median times."""
    ratios = {}
    for name, ours in summary.items():
        if name.startswith("ours."):
            phase = name.removeprefix("ours.")
            dcp = summary.get(f"dcp.{phase}")
            if dcp:
                ratios[phase] = round(dcp[key] / ours[key], 3)
    return ratios


def _goals(results: dict[str, Any]) -> dict[str, Any]:
    """Each goal of issue 4, judged on best times and on median times (both are reported)."""
    goals: dict[str, Any] = {}
    for world, res in results["worlds"].items():
        s, best, median = res["phases"], res["ours_over_dcp"], res["ours_over_dcp_median"]
        raw_parallel = res["raw_write_parallel"]["GB_per_s"] if "raw_write_parallel" in res else None
        total = results["state_dict_bytes"]
        g: dict[str, Any] = {}

        def ratio_goal(name: str, phase: str, target: float) -> None:
            if phase in best:
                g[name] = {"ratio_best": best[phase], "ratio_median": median[phase],
                           "met_best": best[phase] >= target, "met_median": median[phase] >= target}

        ratio_goal("save >= 1.3x DCP", "save", 1.3)
        if "ours.save" in s and raw_parallel:
            frac = s["ours.save"]["GB_per_s"] / raw_parallel
            frac_median = total / s["ours.save"]["median_seconds"] / GB / raw_parallel
            g["save >= 70% raw write"] = {"fraction_best": round(frac, 3), "fraction_median": round(frac_median, 3),
                                          "met_best": frac >= 0.7, "met_median": frac_median >= 0.7}
        for phase in ("load_same", "load_dim1", "load_world"):
            ratio_goal(f"{phase} >= 2x DCP", phase, 2.0)
        ratio_goal("collect <= 0.5x DCP time", "collect", 2.0)
        if "ours.collect" in s:
            mem = s["ours.collect"]["peak_growth_MiB_per_rank"]
            full = results["state_dict_bytes"] / 2**20
            one = full / results["config"]["n"]
            g["collect memory"] = {
                "rank0_MiB": mem[0], "bound_rank0_MiB": round(full + one, 1),
                "others_max_MiB": max(mem[1:]) if len(mem) > 1 else 0.0, "bound_others_MiB": round(one, 1),
                "met": mem[0] <= (full + one) * 1.05 and (len(mem) == 1 or max(mem[1:]) <= one * 1.05)}
        goals[world] = g
    return goals


def _markdown(results: dict[str, Any]) -> str:
    lines = []
    for world, res in results["worlds"].items():
        s, r, m = res["phases"], res["ours_over_dcp"], res["ours_over_dcp_median"]
        disk = (f" (raw write: 1 stream {results['raw_write_single']['GB_per_s']} GB/s, "
                f"{world} streams {res['raw_write_parallel']['GB_per_s']} GB/s)" if "raw_write_parallel" in res else "")
        lines.append(f"\n**{world} ranks**{disk}\n")
        lines.append("| phase | shardkit s (best / median) | shardkit GB/s | DCP s (best / median) | DCP GB/s | "
                     "ours/DCP (best / median) | peak growth per rank, MiB (shardkit) | (DCP) |")
        lines.append("|---|---:|---:|---:|---:|---:|---|---|")
        for phase in ("save", "load_same", "load_dim1", "load_world", "collect", "consolidate"):
            o, d = s.get(f"ours.{phase}"), s.get(f"dcp.{phase}")
            if o is None and d is None:
                continue

            def cell(x: dict[str, Any] | None, key: str) -> str:
                return "-" if x is None else str(x[key])

            def times(x: dict[str, Any] | None) -> str:
                return "-" if x is None else f"{x['seconds']:.2f} / {x['median_seconds']:.2f}"

            ratio = f"{r[phase]:.2f} / {m[phase]:.2f}" if phase in r else "-"
            lines.append(f"| {phase} | {times(o)} | {cell(o, 'GB_per_s')} | {times(d)} | "
                         f"{cell(d, 'GB_per_s')} | {ratio} | "
                         f"{'-' if o is None else o['peak_growth_MiB_per_rank']} | "
                         f"{'-' if d is None else d['peak_growth_MiB_per_rank']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions per phase (best is reported)")
    parser.add_argument("--worlds", default="4,2",
                        help="world sizes, comma-separated; the first must be 4 for load_world (default 4,2)")
    parser.add_argument("--only", choices=["ours", "dcp"], help="run one library only")
    parser.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: <repo>/out)")
    parser.add_argument("--markdown", action="store_true", help="also print a Markdown table to stderr")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per distributed run")
    parser.add_argument("--phases", default=",".join(sorted(PHASES)),
                        help="phases to run, comma-separated (default: all); a load or consolidate "
                             "phase also runs save, e.g. --phases collect runs collect alone")
    args = parser.parse_args(argv)
    phases = frozenset(p.strip() for p in args.phases.split(",") if p.strip())
    if not phases or phases - PHASES:
        parser.error(f"--phases={args.phases!r} names {sorted(phases - PHASES) or 'nothing'}; "
                     f"choose from {sorted(PHASES)}")
    if phases & _READERS:
        phases |= {"save"}

    which = [args.only] if args.only else ["ours", "dcp"]
    cfg = _config(args.quick)
    total = cfg["n"] * cfg["rows"] * cfg["cols"] * 4
    worlds = [int(w) for w in args.worlds.split(",")]
    scratch_parent = Path(args.dir) if args.dir else ROOT / "out"
    scratch_parent.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=scratch_parent)
    os.environ.setdefault("SHARDKIT_QUIET", "1")
    results: dict[str, Any] = {
        "benchmark": "checkpoint", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                 "load_average_at_start": [round(x, 2) for x in os.getloadavg()]},
        "config": {**cfg, "dtype": "float32", "split": "dim 0", "repeat": args.repeat,
                   "phases": sorted(phases)},
        "state_dict_bytes": total, "scratch": folder, "worlds": {},
    }
    try:
        import torch

        results["host"]["torch"] = torch.__version__
        # The raw disk speed is what a save is judged against; other phases do not write.
        measure_disk = "save" in phases
        if measure_disk:
            raw1 = run_distributed(raw_write, 1, folder, total, args.repeat, timeout=args.timeout)[0]
            results["raw_write_single"] = {"seconds": round(min(raw1), 4),
                                           "GB_per_s": round(total / min(raw1) / GB, 3)}
        saved_worlds: list[int] = []
        for world in worlds:
            if measure_disk:
                raw = run_distributed(raw_write, world, folder, total, args.repeat, timeout=args.timeout)
                raw_s = [max(r[i] for r in raw) for i in range(args.repeat)]
            load_from = 4 if world != 4 and 4 in saved_worlds else None
            per_rank = run_distributed(_rank_phases, world, cfg, folder, args.repeat, which, load_from, phases,
                                       timeout=args.timeout)
            saved_worlds.append(world)
            summary = _summarize(per_rank, total)
            results["worlds"][str(world)] = {"phases": summary}
            if measure_disk:
                results["worlds"][str(world)]["raw_write_parallel"] = {
                    "seconds": round(min(raw_s), 4), "GB_per_s": round(total / min(raw_s) / GB, 3)}
        if 4 in saved_worlds and "consolidate" in phases:
            cons = run_distributed(_consolidate_phase, 1, folder, args.repeat, which, timeout=args.timeout)
            summary = _summarize(cons, total)
            results["worlds"]["4"]["phases"].update(summary)
        for res in results["worlds"].values():
            res["ours_over_dcp"] = _ratios(res["phases"])
            res["ours_over_dcp_median"] = _ratios(res["phases"], "median_seconds")
        results["goals"] = _goals(results)
        results["host"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        results["disk_usage_note"] = ("both libraries' loads read from the page cache (just written); "
                                      "see the script's docstring for the method")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(results, indent=2))
    if args.markdown:
        print(_markdown(results), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
