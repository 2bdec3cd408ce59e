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

import json
import sys
from pathlib import Path
from typing import Any

# After the repository root: bench/checkpoint.py is not the package.
sys.path.append(str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _harness import Interleaved, machine, ratio, sweep, sweep_args  # noqa: E402

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
    clock = Interleaved()
    measure = clock.measure
    impls: list[Any] = []
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

    impls += [ours, ours_cold]
    if dt is not None:
        mesh_shape, src_pl, dst_pl = dt
        mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
        d_src = DTensor.from_local(source.local_shards()[0].tensor, mesh, src_pl, run_check=False)
        mine = expected.local_shards()[0].tensor

        def dtensor() -> None:
            out: list[torch.Tensor] = []
            measure("dtensor", lambda: out.append(_dtensor_local(d_src.redistribute(mesh, dst_pl))))
            assert torch.equal(out[0], mine), f"DTensor's result differs from ours: {name}"

        impls.append(dtensor)
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

        impls += [raw_all_to_all, raw_fresh]
    if name == "dim0_to_replicate":
        shard = source.local_shard()
        full = torch.ones(n, n)

        def raw_all_gather() -> None:
            measure("raw_all_gather", lambda: dist.all_gather_into_tensor(full, shard))

        impls.append(raw_all_gather)
    if name == "replicate_to_dim0":
        # Nothing crosses the wire; the floor is one copy of this rank's new shard.
        whole = source.local_shard()
        rows = expected.local_shard().shape[0]

        def copy_limit() -> None:
            measure("copy_limit", lambda: whole[rank * rows:(rank + 1) * rows].clone())

        impls.append(copy_limit)
    clock.run(impls, reps)  # the warm-up fills DTensor's sharding-propagation cache
    med = clock.medians()
    raw = {k: v for k, v in med.items() if k in ("raw_all_to_all", "raw_all_gather")}
    return {
        "transition": name, "world": world, "size": [n, n],
        "ours_s": med["ours"],
        "ours_cold_s": med["ours_cold"],
        "dtensor_s": med.get("dtensor", "n/a"),
        "raw_s": min(raw.values()) if raw else "n/a (no bytes to move)",
        "medians_s": med,
        "runs_s": clock.runs,
        "bytes_sent": counted[0],
        "min_bytes": traffic.get(rank, 0) * itemsize,
        "lower_bound_total_bytes": _lower_bound_total(src_md, dst_md) * itemsize,
        "wire_bytes": clock.wire,
        "cpu_s": clock.cpu_medians(),
    }


def _goals(case: dict[str, Any]) -> dict[str, Any]:
    """A case merged over ranks, with its ratios and whether it meets its goals."""
    cpu = case["cpu_s_mean_over_ranks"]
    cpu_raw = [cpu[k] for k in ("raw_all_to_all", "raw_all_gather") if k in cpu]
    case["cpu_ratio_ours_raw"] = ratio(cpu["ours"], min(cpu_raw)) if cpu_raw else "n/a"
    case["cpu_ratio_ours_dtensor"] = ratio(cpu["ours"], cpu.get("dtensor"))
    case["bytes_equal_min"] = case["bytes_sent"] == case["min_bytes"] and \
        sum(case["min_bytes"]) == case["lower_bound_total_bytes"]
    ours, dt, raw = case["ours_s"], case["dtensor_s"], case["raw_s"]
    case["ratio_ours_dtensor"] = ratio(ours, dt) if isinstance(dt, float) else "n/a"
    case["ratio_ours_raw"] = ratio(ours, raw) if isinstance(raw, float) else "n/a"
    case["ratio_ours_cold_dtensor"] = ratio(case["ours_cold_s"], dt) if isinstance(dt, float) else "n/a"
    fresh = case["medians_s"].get("raw_all_to_all_fresh_output")
    case["ratio_ours_raw_fresh_output"] = ratio(ours, fresh) if fresh else "n/a"
    case["goal_dtensor_0.5x"] = (case["ratio_ours_dtensor"] <= 0.5) if isinstance(dt, float) else "n/a"
    case["goal_raw_3x"] = (case["ratio_ours_raw"] <= 3.0) if isinstance(raw, float) else "n/a"
    return case


def main() -> None:
    args = sweep_args(__doc__.split("\n")[0], TRANSITIONS, reps=5)
    results = [_goals(case) for case in sweep("reshard", _case, args)]
    doc = {"benchmark": "reshard", "machine": machine(), "repetitions": args.reps, "statistic": "median",
           "dtype": "float32", "goals": {"bytes": "bytes_sent == plan minimum == lower bound",
                                         "vs_dtensor": "<= 0.5", "vs_raw": "<= 3.0"},
           "results": results}
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
