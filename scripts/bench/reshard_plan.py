#!/usr/bin/env python
"""Benchmark reshard planning alone (no processes): how planning time grows with the world size.

Not a test: prints one JSON document on stdout (progress goes to stderr). Issue 3, item 3.

For world sizes 8, 64, 512 and 4096 and several layout pairs of an fp32 tensor of
(64 n) x (64 n) elements (n = world size; only metadata is built, no data), it times:

- ``build_metadata`` of the source and of the destination spec (every rank builds the
  whole layout, from the spec alone);
- ``plan_reshard(src, dst, rank)`` for one rank (n // 2 + 1), cold: the planner's per-layout
  caches are cleared before every repetition. That is what each rank does in a reshard.

Layout pairs (``pl`` = the n ranks in order):

==================  =========================================================================
mesh_to_dim0        mesh(a x b) -> single_split(0, pl); a x b = 2x4, 8x8, 16x32, 64x64
dim0_to_dim1        single_split(0, pl) -> single_split(1, pl): every rank talks to every rank
even_to_uneven      single_split(0, pl) -> shard_sizes 1:3:1:3... (in units of 32 rows)
replicate_to_dim0   DevicePlacement("cpu") (n replicas) -> single_split(0, pl)
dim0_to_replicate   single_split(0, pl) -> DevicePlacement("cpu"): n - 1 peers each way
==================  =========================================================================

Reported per pair: median wall and CPU seconds (``time.process_time``), time per shard, the
number of pieces in the rank's plan, and the growth exponent k of time ~ n^k fitted by least
squares on log-log over all world sizes and between the two largest. For reference, n log n
over 8..4096 fits k ~ 1.15, and n log n between 512 and 4096 gives k ~ 1.1.

Torch runs with one intra-op thread, as ``torchrun`` sets it when several ranks share a node.

Usage::

    .venv/bin/python scripts/bench/reshard_plan.py            # 9 repetitions per point
    .venv/bin/python scripts/bench/reshard_plan.py --quick    # 3 repetitions per point
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# After the repository root: bench/checkpoint.py is not the package.
sys.path.append(str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _harness import machine  # noqa: E402

import sharding as sh  # noqa: E402
from sharded_tensor import _plan  # noqa: E402

PAIRS = ("mesh_to_dim0", "dim0_to_dim1", "even_to_uneven", "replicate_to_dim0", "dim0_to_replicate")


def _specs(name: str, n: int) -> tuple[Any, Any]:
    pl = [f"rank:{r}/cpu" for r in range(n)]
    if name == "mesh_to_dim0":
        a = 2 ** (int(math.log2(n)) // 2)
        b = n // a
        return sh.mesh([pl[i * b:(i + 1) * b] for i in range(a)]), sh.single_split(0, pl)
    if name == "dim0_to_dim1":
        return sh.single_split(0, pl), sh.single_split(1, pl)
    if name == "even_to_uneven":
        return sh.single_split(0, pl), sh.single_split(0, pl, [32 if r % 2 == 0 else 96 for r in range(n)])
    if name == "replicate_to_dim0":
        return sh.DevicePlacement("cpu"), sh.single_split(0, pl)
    if name == "dim0_to_replicate":
        return sh.single_split(0, pl), sh.DevicePlacement("cpu")
    raise ValueError(name)


def _clock(fn: Callable[[], Any], reps: int, before: Callable[[], None] = lambda: None) -> tuple[float, float, Any]:
    """Median wall and CPU seconds of ``fn`` over ``reps`` calls, and its last result."""
    walls, cpus = [], []
    result = None
    for _ in range(reps):
        before()
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return statistics.median(walls), statistics.median(cpus), result


def _exponent(ns: list[int], ts: list[float]) -> float:
    xs, ys = [math.log(n) for n in ns], [math.log(max(t, 1e-9)) for t in ts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions per point")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512, 4096])
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 9)
    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    for name in PAIRS:
        points = []
        for n in args.worlds:
            print(f"  {name} n={n}", file=sys.stderr, flush=True)
            src_spec, dst_spec = _specs(name, n)
            size = (64 * n, 64 * n)
            b_src_wall, b_src_cpu, src = _clock(
                lambda: src_spec.build_metadata(size, torch.float32, world_size=n), reps)
            b_dst_wall, b_dst_cpu, dst = _clock(
                lambda: dst_spec.build_metadata(size, torch.float32, world_size=n), reps)
            rank = n // 2 + 1
            p_wall, p_cpu, plan = _clock(lambda: _plan.plan_reshard(src, dst, rank), reps,
                                         before=_plan._REGIONS_CACHE.clear)
            pieces = sum(len(v) for v in plan.sends.values()) + sum(len(v) for v in plan.recvs.values()) \
                + len(plan.copies)
            points.append({
                "world": n, "shards": [len(src.shards), len(dst.shards)], "rank": rank, "pieces": pieces,
                "peers": [len(plan.sends), len(plan.recvs)],
                "plan_s": p_wall, "plan_cpu_s": p_cpu, "plan_us_per_shard": round(p_wall / n * 1e6, 2),
                "build_metadata_src_s": b_src_wall, "build_metadata_dst_s": b_dst_wall,
                "build_metadata_cpu_s": b_src_cpu + b_dst_cpu,
                "build_dst_plus_plan_s": b_dst_wall + p_wall,
            })
        ns = [p["world"] for p in points]
        growth = {
            "plan_exponent_all": _exponent(ns, [p["plan_s"] for p in points]),
            "plan_cpu_exponent_all": _exponent(ns, [p["plan_cpu_s"] for p in points]),
            "plan_exponent_largest_two": _exponent(ns[-2:], [p["plan_s"] for p in points[-2:]]),
            "build_metadata_dst_exponent_all": _exponent(ns, [p["build_metadata_dst_s"] for p in points]),
        }
        results.append({"pair": name, "points": points, "growth": growth})
    mesh = next(r for r in results if r["pair"] == "mesh_to_dim0")
    largest = mesh["points"][-1]
    doc = {"benchmark": "reshard_plan", "machine": machine(), "repetitions": reps, "statistic": "median",
           "torch_threads": 1,
           "goals": {"mesh_to_dim0_plan_at_4096_s": "< 1", "growth": "about n log n or better (k <~ 1.15)"},
           "goal_check": {"mesh_to_dim0_plan_s_at_largest": largest["plan_s"], "world": largest["world"],
                          "plan_under_1s": largest["plan_s"] < 1.0,
                          "plan_plus_build_dst_under_1s": largest["build_dst_plus_plan_s"] < 1.0,
                          "exponents": {r["pair"]: r["growth"]["plan_exponent_all"] for r in results}},
           "results": results}
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
