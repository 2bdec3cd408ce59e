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
    clock = Interleaved()
    measure = clock.measure
    counted = [0]

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

    clock.run([ours, dtensor, raw] + ([] if name == "to_replicate" else [raw_min]), reps)
    med = clock.medians()
    return {"transition": name, "world": world, "size": [n, n], "ours_s": med["ours"], "dtensor_s": med["dtensor"],
            "raw_s": med["raw"], "raw_op": "all_reduce" if name == "to_replicate" else "reduce_scatter_tensor",
            "raw_all_to_all_and_sum_s": med.get("raw_all_to_all_and_sum", "n/a"),
            "runs_s": clock.runs, "bytes_sent": counted[0], "min_bytes": minimum, "wire_bytes": clock.wire,
            "cpu_s": clock.cpu_medians()}


def _goals(case: dict[str, Any]) -> dict[str, Any]:
    """A case merged over ranks, with its ratios and whether it meets its goals."""
    case["bytes_equal_min"] = case["bytes_sent"] == case["min_bytes"]
    case["ratio_ours_raw"] = ratio(case["ours_s"], case["raw_s"])
    case["ratio_ours_dtensor"] = ratio(case["ours_s"], case["dtensor_s"])
    by_hand = case["raw_all_to_all_and_sum_s"]
    case["ratio_ours_raw_all_to_all_and_sum"] = ratio(case["ours_s"], by_hand) if by_hand != "n/a" else "n/a"
    goal = 1.1 if case["transition"] == "to_replicate" else 1.2
    case["goal_raw"] = f"<= {goal}"
    case["goal_raw_met"] = case["ratio_ours_raw"] is not None and case["ratio_ours_raw"] <= goal
    return case


def main() -> None:
    args = sweep_args(__doc__.split("\n")[0], TRANSITIONS, reps=7)
    results = [_goals(case) for case in sweep("partial", _case, args)]
    doc = {"benchmark": "partial", "machine": machine(), "repetitions": args.reps, "statistic": "median",
           "dtype": "float32", "goals": {"bytes": "bytes_sent == minimum", "to_replicate_vs_raw_all_reduce": "<= 1.1",
                                         "to_split_vs_raw_reduce_scatter_tensor": "<= 1.2"},
           "results": results}
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
