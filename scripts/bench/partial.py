#!/usr/bin/env python
"""Benchmark reducing partial values: ``reshard`` from ``PartialSpec`` against DTensor and raw collectives.

Not a test: prints one JSON document on stdout (progress goes to stderr).

For 2 and 4 Gloo ranks (spawned here, TCP on 127.0.0.1) and fp32 tensors of 4096 x 4096 and
8192 x 8192, every rank holds a full-size partial sum, and each transition runs three ways
in the same processes, interleaved rep by rep so that machine noise hits all of them alike:

- ``ours``: ``t.reshard(spec)`` on a fresh ``ShardedTensor`` of partial values (built with
  ``from_local_shards(..., reduce_op="sum")`` outside the clock), the whole user call.
- ``dtensor``: ``DTensor.redistribute`` of the same data from ``[Partial()]`` on a 1-D
  ``DeviceMesh("cpu", ...)``.
- ``raw``: the bare collective on preallocated, pre-touched buffers: ``all_reduce`` for the
  replica, ``reduce_scatter_tensor`` (Gloo has it in this torch) for the splits, into a row
  block (what a column split also costs on the wire). Gloo's ``reduce_scatter_tensor`` puts
  the whole tensor on the wire from each rank (see ``wire_bytes``), twice the minimum, so the
  splits also run
- ``raw_all_to_all_and_sum``: the minimum by hand, ``all_to_all_single`` of each peer's rows
  then one ``torch.sum`` over the received blocks, on preallocated buffers.

=================  =================================  ================================  ======================
name               ours                               DTensor                           raw
=================  =================================  ================================  ======================
to_replicate       partial(pl) -> DevicePlacement     [Partial()] -> [Replicate()]      all_reduce
to_rows            partial(pl) -> single_split(0, pl) [Partial()] -> [Shard(0)]         reduce_scatter_tensor
to_cols            partial(pl) -> single_split(1, pl) [Partial()] -> [Shard(1)]         reduce_scatter_tensor
=================  =================================  ================================  ======================

Values are integer-valued floats, so every order of summation gives the same bits: every
result (ours and DTensor's) is checked against the sum computed locally. Bytes:
``bytes_sent`` is what ``CommCounter`` counted per rank; ``min_bytes`` the minimum per rank
(2 (w-1)/w of the tensor for an all-reduce, (w-1)/w for a reduce-scatter); ``wire_bytes`` the
change of ``wchar`` in /proc/self/io over the call for all three ways (Gloo headers included).

Usage::

    .venv/bin/python scripts/bench/partial.py            # 2 and 4 ranks, 4096^2 and 8192^2
    .venv/bin/python scripts/bench/partial.py --quick    # 4096^2 only, 3 repetitions
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

TRANSITIONS = ("to_replicate", "to_rows", "to_cols")


def _partial_values(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-8, 9, (n, n), generator=g).float()


def _case(rank: int, world: int, n: int, name: str, reps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    pl = [f"rank:{r}/cpu" for r in range(world)]
    target = {"to_replicate": sh.DevicePlacement("cpu"), "to_rows": sh.single_split(0, pl),
              "to_cols": sh.single_split(1, pl)}[name]
    placement = {"to_replicate": Replicate(), "to_rows": Shard(0), "to_cols": Shard(1)}[name]
    mine = _partial_values(rank, n)
    total = sum(_partial_values(r, n) for r in range(world))
    expected = [total[s.offsets[0]:s.offsets[0] + s.dims[0], s.offsets[1]:s.offsets[1] + s.dims[1]]
                for _, s in target.build_metadata((n, n), world_size=world).shards_on(rank)][0]
    nbytes = n * n * 4
    minimum = 2 * (world - 1) * nbytes // world if name == "to_replicate" else (world - 1) * nbytes // world
    runs: dict[str, list[float]] = {}
    wire: dict[str, int] = {}
    cpu: dict[str, list[float]] = {}
    counted = [0]

    def measure(key: str, fn: Any) -> None:
        seconds, sent = timed(fn, cpu.setdefault(key, []))
        runs.setdefault(key, []).append(seconds)
        wire[key] = sent

    def ours() -> None:
        t = st.ShardedTensor.from_local_shards(
            [st.Shard(mine.clone(), sh.ShardMetadata((0, 0), (n, n), pl[rank]))], (n, n), reduce_op="sum")
        with st.CommCounter() as comm:
            measure("ours", lambda: t.reshard(target))
        counted[0] = comm.bytes_sent
        assert torch.equal(t.local_shard(), expected), name

    mesh = DeviceMesh("cpu", list(range(world)))

    def dtensor() -> None:
        d = DTensor.from_local(mine.clone(), mesh, [Partial()], run_check=False)
        out: list[torch.Tensor] = []

        def call() -> None:
            local = d.redistribute(mesh, [placement]).to_local()
            out.append(local.wait() if hasattr(local, "wait") else local)

        measure("dtensor", call)
        assert torch.equal(out[0], expected), f"DTensor's result differs: {name}"

    if name == "to_replicate":
        buffer = mine.clone()

        def raw() -> None:
            buffer.copy_(mine)  # outside the clock: the same values every time
            measure("raw", lambda: dist.all_reduce(buffer))
            assert torch.equal(buffer, expected)
    else:
        source, block = mine.clone(), torch.empty(n // world, n)
        received = torch.ones(world, n // world, n)

        def raw() -> None:
            measure("raw", lambda: dist.reduce_scatter_tensor(block, source))

        def raw_min() -> None:
            # The minimum on the wire by hand: each rank sends each peer only the peer's rows,
            # then sums what it received.
            def call() -> None:
                dist.all_to_all_single(received.view(-1), source.view(-1))
                torch.sum(received, dim=0, out=block)

            measure("raw_all_to_all_and_sum", call)

    impls = [ours, dtensor, raw] + ([] if name == "to_replicate" else [raw_min])
    for impl in impls:  # warm-up: connections, DTensor's caches
        impl()
    runs.clear()
    cpu.clear()
    for rep in range(reps):
        k = rep % len(impls)
        for impl in impls[k:] + impls[:k]:
            impl()
    med = {k: median(v) for k, v in runs.items()}
    return {"transition": name, "world": world, "size": [n, n], "ours_s": med["ours"], "dtensor_s": med["dtensor"],
            "raw_s": med["raw"], "raw_op": "all_reduce" if name == "to_replicate" else "reduce_scatter_tensor",
            "raw_all_to_all_and_sum_s": med.get("raw_all_to_all_and_sum", "n/a"),
            "runs_s": runs, "bytes_sent": counted[0], "min_bytes": minimum, "wire_bytes": wire,
            "cpu_s": {k: median(v) for k, v in cpu.items()}}


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
        first["bytes_sent"] = [c["bytes_sent"] for c in cases]
        first["min_bytes"] = [c["min_bytes"] for c in cases]
        first["bytes_equal_min"] = first["bytes_sent"] == first["min_bytes"]
        first["wire_bytes_per_rank"] = {k: [c["wire_bytes"].get(k) for c in cases] for k in cases[0]["wire_bytes"]}
        del first["wire_bytes"]
        first["cpu_s_mean_over_ranks"] = {k: sum(c["cpu_s"][k] for c in cases) / len(cases) for k in cases[0]["cpu_s"]}
        del first["cpu_s"]
        first["ratio_ours_raw"] = ratio(first["ours_s"], first["raw_s"])
        first["ratio_ours_dtensor"] = ratio(first["ours_s"], first["dtensor_s"])
        by_hand = first["raw_all_to_all_and_sum_s"]
        first["ratio_ours_raw_all_to_all_and_sum"] = ratio(first["ours_s"], by_hand) if by_hand != "n/a" else "n/a"
        goal = 1.1 if first["transition"] == "to_replicate" else 1.2
        first["goal_raw"] = f"<= {goal}"
        first["goal_raw_met"] = first["ratio_ours_raw"] is not None and first["ratio_ours_raw"] <= goal
        merged.append(first)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4096^2 only, 3 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per way (default 7, quick 3)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--only", nargs="+", default=list(TRANSITIONS), choices=TRANSITIONS)
    args = parser.parse_args()
    sizes = args.sizes or ([4096] if args.quick else [4096, 8192])
    reps = args.reps or (3 if args.quick else 7)
    results = []
    for world in args.worlds:
        print(f"partial benchmark: {world} ranks", file=sys.stderr, flush=True)
        results += _merge(launch(_rank_main, world, sizes, reps, args.only))
    doc = {"benchmark": "partial", "machine": machine(), "repetitions": reps, "statistic": "median",
           "dtype": "float32", "goals": {"bytes": "bytes_sent == minimum", "to_replicate_vs_raw_all_reduce": "<= 1.1",
                                         "to_split_vs_raw_reduce_scatter_tensor": "<= 1.2"},
           "results": results}
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
