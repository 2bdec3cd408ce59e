#!/usr/bin/env python
"""Benchmark ``st.shard_tensor`` against DTensor's ``distribute_tensor``: one source, N ranks.

Not a test: prints one JSON document on stdout (progress goes to stderr). Issue 2, item 6.

A 1 GiB fp32 tensor (16384 x 16384) lives on rank 0 and is split on dim 0 over 2 and then 4
Gloo ranks (spawned here, TCP on 127.0.0.1), two ways in the same processes, alternating rep
by rep:

- ``ours``: ``st.shard_tensor(x, single_split(0, ranks), src_rank=0)`` (other ranks pass None).
- ``dtensor``: ``distribute_tensor(x, DeviceMesh("cpu", ranks), [Shard(0)], src_data_rank=0)``.
  DTensor wants a tensor of the full shape on every rank; the others pass ``torch.empty``
  of that shape, which it never reads (so it costs no memory traffic).

Bytes rank 0 sent:

- ours: shardkit's ``CommCounter`` (payload per operation), checked against the bytes of the
  other ranks' shards, which is the goal;
- both: ``wchar`` of /proc/self/io over the call, i.e. what the process really wrote to its
  sockets (Gloo adds a few dozen header bytes per message);
- DTensor by its algorithm: a Gloo ``scatter`` from rank 0 of ``torch.chunk`` pieces padded to
  equal size, i.e. rank 0 sends every other rank its chunk; ``CommDebugMode`` confirms which
  collective ran (it counts collectives, not bytes).

Every result is checked bit for bit against the source rows, for both.

Usage::

    .venv/bin/python scripts/bench/shard_tensor.py           # 1 GiB, 5 repetitions
    .venv/bin/python scripts/bench/shard_tensor.py --quick   # 256 MiB, 3 repetitions
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# After the repository root: bench/checkpoint.py is not the package.
sys.path.append(str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _harness import GiB, launch, machine, median, ratio, timed  # noqa: E402

import sharded_tensor as st  # noqa: E402
import sharding as sh  # noqa: E402


def _rank_main(rank: int, world: int, rows: int, reps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    size = (rows, rows)
    spec = sh.single_split(0, [f"rank:{r}/cpu" for r in range(world)])
    layout = spec.build_metadata(size, torch.float32, world_size=world)
    mine = layout.shards[rank]
    if rank == 0:
        torch.manual_seed(0)
        x = torch.rand(size)
    else:
        x = torch.empty(size)  # DTensor wants the full shape everywhere; never touched here
    mesh = DeviceMesh("cpu", list(range(world)))
    runs: dict[str, list[float]] = {"ours": [], "dtensor": []}
    cpu: dict[str, list[float]] = {"ours": [], "dtensor": []}
    wire: dict[str, int] = {}
    counted: dict[str, int] = {}
    results: dict[str, torch.Tensor] = {}

    def ours() -> None:
        box: list[Any] = []
        with st.CommCounter() as comm:
            seconds, sent = timed(lambda: box.append(st.shard_tensor(x if rank == 0 else None, spec)), cpu["ours"])
        runs["ours"].append(seconds)
        wire["ours"] = sent
        counted.update(comm.bytes_by_op)
        results["ours"] = box[0].local_shard()

    def dtensor() -> None:
        box: list[Any] = []

        def call() -> None:
            local = distribute_tensor(x, mesh, [Shard(0)], src_data_rank=0).to_local()
            box.append(local.wait() if hasattr(local, "wait") else local)

        seconds, sent = timed(call, cpu["dtensor"])
        runs["dtensor"].append(seconds)
        wire["dtensor"] = sent
        results["dtensor"] = box[0]

    impls = [ours, dtensor]
    for impl in impls:  # warm-up
        impl()
    with CommDebugMode() as debug:
        distribute_tensor(x, mesh, [Shard(0)], src_data_rank=0)
    dtensor_ops = {str(op): n for op, n in debug.get_comm_counts().items()}
    for key in runs:
        runs[key].clear()
        cpu[key].clear()
    for rep in range(reps):
        order = impls if rep % 2 == 0 else impls[::-1]
        for impl in order:
            impl()
    # Bit-for-bit check of the last results (rank 0 compares against its rows of x).
    if rank == 0:
        rows_0 = x[mine.offsets[0]:mine.offsets[0] + mine.dims[0]]
        assert torch.equal(results["ours"], rows_0) and torch.equal(results["dtensor"], rows_0)
    same = torch.equal(results["ours"], results["dtensor"])
    assert same, f"rank {rank}: shard_tensor and distribute_tensor disagree"
    shard_bytes = [s.numel * 4 for s in layout.shards]
    chunk = -(-rows // world) * rows * 4  # torch.chunk size, padded to equal chunks by DTensor
    return {
        "rank": rank, "ours_runs_s": runs["ours"], "dtensor_runs_s": runs["dtensor"],
        "cpu_s": {k: median(v) for k, v in cpu.items()},
        "ours_bytes_by_op": counted, "wire_bytes": wire, "dtensor_comm_counts": dtensor_ops,
        "expected_bytes_from_rank0": sum(shard_bytes) - shard_bytes[0],
        "dtensor_algorithm_bytes_from_rank0": chunk * (world - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB and 3 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per way (default 5, quick 3)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = 8192 if args.quick else 16384
    reps = args.reps or (3 if args.quick else 5)
    results = []
    for world in args.worlds:
        print(f"shard_tensor benchmark: {world} ranks, {rows}x{rows} fp32", file=sys.stderr, flush=True)
        per_rank = launch(_rank_main, world, rows, reps)
        r0 = per_rank[0]
        ours, dt = median(r0["ours_runs_s"]), median(r0["dtensor_runs_s"])
        payload = r0["ours_bytes_by_op"].get("send/recv", 0)
        expected = r0["expected_bytes_from_rank0"]
        results.append({
            "world": world, "size": [rows, rows], "tensor_bytes": rows * rows * 4,
            "ours_s": ours, "dtensor_s": dt, "ratio_ours_dtensor": ratio(ours, dt),
            "goal_time_ratio_le_1": ours <= dt,
            "ours_runs_s": r0["ours_runs_s"], "dtensor_runs_s": r0["dtensor_runs_s"],
            "cpu_s_per_rank": [p["cpu_s"] for p in per_rank],
            "cpu_ratio_ours_dtensor_all_ranks": ratio(sum(p["cpu_s"]["ours"] for p in per_rank),
                                                      sum(p["cpu_s"]["dtensor"] for p in per_rank)),
            "rank0_bytes": {
                "expected_other_ranks_shards": expected,
                "ours_comm_counter_payload": payload,
                "ours_comm_counter_by_op": r0["ours_bytes_by_op"],
                "ours_wire_measured": r0["wire_bytes"]["ours"],
                "dtensor_wire_measured": r0["wire_bytes"]["dtensor"],
                "dtensor_by_algorithm": r0["dtensor_algorithm_bytes_from_rank0"],
                "dtensor_bytes_method": ("measured: wchar of /proc/self/io on rank 0 over the call; "
                                         "reasoned: Gloo scatter of padded torch.chunk pieces from rank 0; "
                                         "CommDebugMode counts only collectives: "
                                         + json.dumps(r0["dtensor_comm_counts"])),
            },
            "goal_bytes_equal_other_shards": payload == expected,
            "other_ranks_wire_bytes": {k: [p["wire_bytes"][k] for p in per_rank[1:]] for k in ("ours", "dtensor")},
        })
    doc = {"benchmark": "shard_tensor", "machine": machine(), "repetitions": reps, "statistic": "median",
           "dtype": "float32", "tensor_gib": rows * rows * 4 / GiB,
           "goals": {"bytes": "rank 0 sends exactly the other ranks' shards", "vs_dtensor": "<= 1.0"},
           "results": results}
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
