#!/usr/bin/env python
"""Benchmark ``ShardedTensor.reshard`` against DTensor.redistribute and the raw wire limit.

Not a test: prints one JSON document on stdout (progress goes to stderr). Issue 3, item 5.

For 2 and 4 Gloo ranks (spawned here, TCP on 127.0.0.1) and fp32 tensors of 4096 x 4096 and
8192 x 8192, each transition is run four ways in the same processes, interleaved rep by rep
so that machine noise hits all of them alike:

- ``ours``: ``t.reshard(spec)``, the whole user call (metadata, plan, pack, wire, unpack).
  Large buffers freed by the previous repetition are reused (``_shardkit.memory``), as in
  a training loop that reshards every step.
- ``ours_cold``: the same call with that cache emptied first, so every new buffer is fresh
  memory from the OS, as in a process's first reshard (reported, not a goal).
- ``dtensor``: ``DTensor.redistribute`` of the same data on a ``DeviceMesh("cpu", ...)``,
  where DTensor can express the transition ("n/a" otherwise: uneven splits).
- ``raw``: the wire limit, a bare ``all_to_all_single`` over preallocated, pre-touched uint8
  buffers moving exactly the bytes our plan moves between each pair of ranks (and, for a
  replicated target, ``all_gather_into_tensor`` too; the faster of the two counts).

Transitions (``pl`` = the ranks in order):

=================  ==========================================  ======================================
name               ours                                        DTensor
=================  ==========================================  ======================================
dim0_to_dim1       single_split(0, pl) -> single_split(1, pl)  [Shard(0)] -> [Shard(1)]
dim0_to_replicate  single_split(0, pl) -> DevicePlacement(cpu)  [Shard(0)] -> [Replicate()]
replicate_to_dim0  DevicePlacement(cpu) -> single_split(0, pl)  [Replicate()] -> [Shard(0)]
even_to_uneven     single_split(0, pl) -> shard_sizes 1:3 (2     n/a (DTensor splits evenly only)
                   ranks) or 1:2:3:2 (4 ranks), eighths of N
mesh_to_dim1       mesh 2x1 (2 ranks) / 2x2 (4 ranks) ->        mesh (2, w/2): [Shard(0), Shard(1)]
                   single_split(1, pl)                          -> [Shard(1), Shard(1)]
=================  ==========================================  ======================================

Bytes: ``bytes_sent`` is what shardkit's ``CommCounter`` counted per rank; ``min_bytes`` is the
plan's per-rank figure (``total_traffic``) and ``lower_bound_total`` an independent count of the
elements each rank needs and does not already hold. ``wire_bytes`` (all three ways) is the
change of ``wchar`` in /proc/self/io over the call: what the process really wrote to its
sockets, Gloo headers included. Every result is checked against a reference built directly
in the target layout (``st.rand`` is layout-invariant), for ours and for DTensor.

Usage::

    .venv/bin/python scripts/bench/reshard.py            # full: 2 and 4 ranks, 4096^2 and 8192^2
    .venv/bin/python scripts/bench/reshard.py --quick    # 4096^2 only, fewer repetitions
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))  # after the repository root: bench/checkpoint.py is not the package

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _harness import launch, machine, median, ratio, timed  # noqa: E402

import sharded_tensor as st  # noqa: E402
import sharding as sh  # noqa: E402
from _shardkit.memory import empty_cache  # noqa: E402
from sharded_tensor._plan import plan_reshard, total_traffic  # noqa: E402

TRANSITIONS = ("dim0_to_dim1", "dim0_to_replicate", "replicate_to_dim0", "even_to_uneven", "mesh_to_dim1")


def _layouts(name: str, world: int, n: int) -> tuple[Any, Any, Any]:
    """(our source spec, our target spec, DTensor (mesh shape, src placements, dst placements) or None)."""
    from torch.distributed.tensor import Replicate, Shard

    pl = [f"rank:{r}/cpu" for r in range(world)]
    if name == "dim0_to_dim1":
        return sh.single_split(0, pl), sh.single_split(1, pl), ((world,), [Shard(0)], [Shard(1)])
    if name == "dim0_to_replicate":
        return sh.single_split(0, pl), sh.DevicePlacement("cpu"), ((world,), [Shard(0)], [Replicate()])
    if name == "replicate_to_dim0":
        return sh.DevicePlacement("cpu"), sh.single_split(0, pl), ((world,), [Replicate()], [Shard(0)])
    if name == "even_to_uneven":
        weights = [1, 3] if world == 2 else [1, 2, 3, 2]
        sizes = [n * w // sum(weights) for w in weights]
        sizes[-1] += n - sum(sizes)
        return sh.single_split(0, pl), sh.single_split(0, pl, sizes), None
    if name == "mesh_to_dim1":
        rows = [pl[i * (world // 2):(i + 1) * (world // 2)] for i in range(2)]
        return sh.mesh(rows), sh.single_split(1, pl), ((2, world // 2), [Shard(0), Shard(1)], [Shard(1), Shard(1)])
    raise ValueError(name)


def _lower_bound_total(src: Any, dst: Any) -> int:
    """Elements that must cross the wire: per destination rank, what it needs and does not hold."""
    from sharding.layout import intersect

    total = 0
    for rank in {s.rank for s in dst.shards}:
        held = {s.region for s in src.shards if s.rank == rank and s.numel}
        for region in {s.region for s in dst.shards if s.rank == rank and s.numel}:
            have = sum(torch.Size(c[1]).numel() for c in (intersect(region, h) for h in held) if c)
            total += torch.Size(region[1]).numel() - have
    return total


def _dtensor_local(result: Any) -> torch.Tensor:
    local = result.to_local()
    return local.wait() if hasattr(local, "wait") else local


def _case(rank: int, world: int, n: int, name: str, reps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    src_spec, dst_spec, dt = _layouts(name, world, n)
    torch.manual_seed(1234)
    source = st.rand(n, n, sharding_spec=src_spec)
    torch.manual_seed(1234)
    expected = st.rand(n, n, sharding_spec=dst_spec)
    src_md, dst_md = source.sharding_metadata(), expected.sharding_metadata()
    plan = plan_reshard(src_md, dst_md, rank)
    traffic = total_traffic(src_md, dst_md)
    itemsize = 4
    runs: dict[str, list[float]] = {}
    wire: dict[str, int] = {}
    impls: list[tuple[str, Any]] = []

    cpu: dict[str, list[float]] = {}

    def measure(key: str, fn: Any) -> None:
        seconds, sent = timed(fn, cpu.setdefault(key, []))
        runs.setdefault(key, []).append(seconds)
        wire[key] = sent

    counted = [0]

    def ours() -> None:
        # A tensor of its own, as a user's would be: reshard may then keep blocks of its memory.
        torch.manual_seed(1234)
        t = st.rand(n, n, sharding_spec=src_spec)
        with st.CommCounter() as comm:
            measure("ours", lambda: t.reshard(dst_spec))
        counted[0] = comm.bytes_sent
        got, want = t.local_shards(), expected.local_shards()
        assert len(got) == len(want) and all(torch.equal(a.tensor, b.tensor) for a, b in zip(got, want)), name

    def ours_cold() -> None:
        # The same with no freed memory to reuse: every new buffer is fresh from the OS, as in a
        # process's first reshard of this size.
        torch.manual_seed(1234)
        t = st.rand(n, n, sharding_spec=src_spec)
        empty_cache()
        measure("ours_cold", lambda: t.reshard(dst_spec))
        got, want = t.local_shards(), expected.local_shards()
        assert len(got) == len(want) and all(torch.equal(a.tensor, b.tensor) for a, b in zip(got, want)), name

    impls += [("ours", ours), ("ours_cold", ours_cold)]
    if dt is not None:
        mesh_shape, src_pl, dst_pl = dt
        mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
        d_src = DTensor.from_local(source.local_shards()[0].tensor, mesh, src_pl, run_check=False)
        mine = expected.local_shards()[0].tensor

        def dtensor() -> None:
            out: list[torch.Tensor] = []
            measure("dtensor", lambda: out.append(_dtensor_local(d_src.redistribute(mesh, dst_pl))))
            assert torch.equal(out[0], mine), f"DTensor's result differs from ours: {name}"

        impls.append(("dtensor", dtensor))
    # The wire limit: exactly our plan's bytes between each pair of ranks, nothing else.
    send_counts = [sum(p.numel for p in plan.sends.get(r, [])) * itemsize for r in range(world)]
    recv_counts = [sum(p.numel for p in plan.recvs.get(r, [])) * itemsize for r in range(world)]
    if sum(traffic.values()):  # decided alike on every rank
        send_buf = torch.ones(sum(send_counts), dtype=torch.uint8)
        recv_buf = torch.ones(sum(recv_counts), dtype=torch.uint8)

        def raw_all_to_all() -> None:
            measure("raw_all_to_all", lambda: dist.all_to_all_single(recv_buf, send_buf, recv_counts, send_counts))

        def raw_fresh() -> None:
            # The same collective receiving into new memory, as any reshard must.
            measure("raw_all_to_all_fresh_output", lambda: dist.all_to_all_single(
                torch.empty(sum(recv_counts), dtype=torch.uint8), send_buf, recv_counts, send_counts))

        impls += [("raw_all_to_all", raw_all_to_all), ("raw_all_to_all_fresh_output", raw_fresh)]
    if name == "dim0_to_replicate":
        shard = source.local_shard()
        full = torch.ones(n, n)

        def raw_all_gather() -> None:
            measure("raw_all_gather", lambda: dist.all_gather_into_tensor(full, shard))

        impls.append(("raw_all_gather", raw_all_gather))
    if name == "replicate_to_dim0":
        # Nothing crosses the wire; the floor is one copy of this rank's new shard.
        whole = source.local_shard()
        rows = expected.local_shard().shape[0]

        def copy_limit() -> None:
            measure("copy_limit", lambda: whole[rank * rows:(rank + 1) * rows].clone())

        impls.append(("copy_limit", copy_limit))
    for _, impl in impls:  # warm-up: connections, DTensor's sharding-propagation cache
        impl()
    runs.clear()
    cpu.clear()
    for rep in range(reps):
        k = rep % len(impls)
        for _, impl in impls[k:] + impls[:k]:
            impl()
    med = {k: median(v) for k, v in runs.items()}
    raw = {k: v for k, v in med.items() if k in ("raw_all_to_all", "raw_all_gather")}
    return {
        "transition": name, "world": world, "size": [n, n],
        "ours_s": med["ours"],
        "ours_cold_s": med["ours_cold"],
        "dtensor_s": med.get("dtensor", "n/a"),
        "raw_s": min(raw.values()) if raw else "n/a (no bytes to move)",
        "medians_s": med,
        "runs_s": runs,
        "bytes_sent": counted[0],
        "min_bytes": traffic.get(rank, 0) * itemsize,
        "lower_bound_total_bytes": _lower_bound_total(src_md, dst_md) * itemsize,
        "wire_bytes": wire,
        "cpu_s": {k: median(v) for k, v in cpu.items()},
    }


def _rank_main(rank: int, world: int, sizes: list[int], reps: int, only: list[str]) -> list[dict[str, Any]]:
    out = []
    for n in sizes:
        for name in only:
            if rank == 0:
                print(f"  world={world} n={n} {name}", file=sys.stderr, flush=True)
            out.append(_case(rank, world, n, name, reps))
    return out


def _merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    merged = []
    for cases in zip(*per_rank):
        first = dict(cases[0])
        for key in ("bytes_sent", "min_bytes"):
            first[key] = [c[key] for c in cases]
        first["cpu_s_mean_over_ranks"] = {k: sum(c["cpu_s"][k] for c in cases) / len(cases)
                                          for k in cases[0]["cpu_s"]}
        del first["cpu_s"]
        cpu_ours = first["cpu_s_mean_over_ranks"]["ours"]
        cpu_raw = [first["cpu_s_mean_over_ranks"][k] for k in ("raw_all_to_all", "raw_all_gather")
                   if k in first["cpu_s_mean_over_ranks"]]
        first["cpu_ratio_ours_raw"] = ratio(cpu_ours, min(cpu_raw)) if cpu_raw else "n/a"
        first["cpu_ratio_ours_dtensor"] = ratio(cpu_ours, first["cpu_s_mean_over_ranks"].get("dtensor"))
        first["wire_bytes_per_rank"] = {k: [c["wire_bytes"].get(k) for c in cases] for k in cases[0]["wire_bytes"]}
        del first["wire_bytes"]
        first["bytes_equal_min"] = first["bytes_sent"] == first["min_bytes"] and \
            sum(first["min_bytes"]) == first["lower_bound_total_bytes"]
        ours, dt, raw = first["ours_s"], first["dtensor_s"], first["raw_s"]
        first["ratio_ours_dtensor"] = ratio(ours, dt) if isinstance(dt, float) else "n/a"
        first["ratio_ours_raw"] = ratio(ours, raw) if isinstance(raw, float) else "n/a"
        first["ratio_ours_cold_dtensor"] = ratio(first["ours_cold_s"], dt) if isinstance(dt, float) else "n/a"
        fresh = first["medians_s"].get("raw_all_to_all_fresh_output")
        first["ratio_ours_raw_fresh_output"] = ratio(ours, fresh) if fresh else "n/a"
        first["goal_dtensor_0.5x"] = (first["ratio_ours_dtensor"] <= 0.5) if isinstance(dt, float) else "n/a"
        first["goal_raw_3x"] = (first["ratio_ours_raw"] <= 3.0) if isinstance(raw, float) else "n/a"
        merged.append(first)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4096^2 only, 3 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per way (default 5, quick 3)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--only", nargs="+", default=list(TRANSITIONS), choices=TRANSITIONS)
    args = parser.parse_args()
    sizes = args.sizes or ([4096] if args.quick else [4096, 8192])
    reps = args.reps or (3 if args.quick else 5)
    results = []
    for world in args.worlds:
        print(f"reshard benchmark: {world} ranks", file=sys.stderr, flush=True)
        results += _merge(launch(_rank_main, world, sizes, reps, args.only))
    doc = {"benchmark": "reshard", "machine": machine(), "repetitions": reps, "statistic": "median",
           "dtype": "float32", "goals": {"bytes": "bytes_sent == plan minimum == lower bound",
                                         "vs_dtensor": "<= 0.5", "vs_raw": "<= 3.0"},
           "results": results}
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
