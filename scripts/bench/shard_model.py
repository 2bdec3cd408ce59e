"""Benchmark: shard a ~2 GiB fp32 model over 4 Gloo ranks, three ways. Prints JSON.

Not a test. Each way runs in its own fresh set of processes, so every rank's peak resident
memory (``VmHWM`` from ``/proc/self/status``, reset with ``/proc/self/clear_refs`` once the
process is warm) measures that way alone:

* ``shardkit_meta``: build on the meta device, ``st.shard_model(model, spec)``; each rank
  allocates and initializes only its blocks (torch's generator, seeded per block);
* ``shardkit_meta_seeded``: the same with ``seed=0``: layout-invariant values from the
  counter-based generator (identical for any world size or split);
* ``materialize_then_shard``: build the model with real weights on every rank (the usual
  eager construction), then ``st.shard_model(model, spec)`` keeps each rank's block;
* ``torch_parallelize_module``: PyTorch's own path: build on meta,
  ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on a 1-D CPU mesh,
  ``to_empty(device="cpu")``, then every module's ``reset_parameters()``.

The model is a stack of Megatron-style MLP blocks (``Linear(d, 4d)`` split on outputs,
``Linear(4d, d)`` split on inputs), the same layout in all three ways. Times are wall
seconds from the start of model construction to sharded parameters ready (the slowest
rank, after a barrier) and each rank's CPU seconds over the same span; growth is ``VmHWM``
minus the resident size before construction.
``distinct_random_blocks`` checks that the ranks' blocks of one weight hold different values
(independent draws, not one stream repeated on every rank).

Usage::

    python scripts/bench/shard_model.py                  # ~2 GiB, 4 ranks
    python scripts/bench/shard_model.py --dim 1024 --blocks 2   # quick check
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Any

# After the repository root: bench/checkpoint.py is not the package.
sys.path.append(str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    distinct_over_ranks,
    finish_fresh_report,
    fresh_runs,
    local_param_bytes,
    measured,
    summarize_fresh,
)

METHODS = ("shardkit_meta", "shardkit_meta_seeded", "materialize_then_shard", "torch_parallelize_module")


def build(dim: int, blocks: int) -> Any:
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)

        def forward(self, x: Any) -> Any:
            return x + self.fc2(F.gelu(self.fc1(x)))

    return nn.Sequential(*(Block() for _ in range(blocks)))


def _spec(world: int, blocks: int) -> Any:
    from sharding import composite, single_split

    ranks = [f"rank:{r}/cpu" for r in range(world)]
    block = composite(fc1=single_split(0, ranks), fc2=composite(weight=single_split(1, ranks)))
    return composite(**{str(i): block for i in range(blocks)})


def _shardkit(world: int, dim: int, blocks: int, meta: bool, seed: int | None = None) -> Any:
    import torch

    import sharded_tensor as st

    if meta:
        with torch.device("meta"):
            model = build(dim, blocks)
        return st.shard_model(model, _spec(world, blocks), seed=seed)
    model = build(dim, blocks)
    return st.shard_model(model, _spec(world, blocks))


def _torch_path(world: int, dim: int, blocks: int) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = build(dim, blocks)
    plan = {}
    for i in range(blocks):
        plan[f"{i}.fc1"] = ColwiseParallel()
        plan[f"{i}.fc2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model


def _rank(rank: int, world: int, method: str, dim: int, blocks: int) -> dict[str, Any]:
    import torch

    # Warm up on a tiny model: imports and one-time set-up are not what is measured.
    run = {"shardkit_meta": lambda d, b: _shardkit(world, d, b, True),
           "shardkit_meta_seeded": lambda d, b: _shardkit(world, d, b, True, seed=0),
           "materialize_then_shard": lambda d, b: _shardkit(world, d, b, False),
           "torch_parallelize_module": lambda d, b: _torch_path(world, d, b)}[method]
    warm = run(64, 1)
    warm(torch.randn(2, 64))
    del warm
    model, elapsed, cpu, growth = measured(lambda: run(dim, blocks))
    with torch.no_grad():
        y = model(torch.randn(2, dim))
        # Does each rank hold different values in its block of fc1.weight (rows r*k..)?
        weight = model[0].fc1.weight
        block = weight.to_local() if hasattr(weight, "to_local") else weight
        distinct = distinct_over_ranks(block[0, :64], world)
    return {"seconds": elapsed, "cpu_seconds": cpu, "peak_growth": growth, "shard_bytes": local_param_bytes(model),
            "output_finite": bool(torch.isfinite(y if not hasattr(y, "full_tensor") else y.full_tensor()).all()),
            "distinct_blocks": distinct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=4096, help="model width d (blocks are d -> 4d -> d)")
    parser.add_argument("--blocks", type=int, default=4, help="number of MLP blocks")
    parser.add_argument("--world", type=int, default=4, help="Gloo ranks")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--repeat", type=int, default=3, help="fresh runs per way (medians are reported)")
    args = parser.parse_args()
    params = args.blocks * (8 * args.dim * args.dim + 5 * args.dim)
    report: dict[str, Any] = {
        "benchmark": "shard_model",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": __import__("torch").__version__, "machine": platform.machine()},
        "model": {"dim": args.dim, "blocks": args.blocks, "params": params,
                  "fp32_gib": round(params * 4 / (1 << 30), 3)},
        "world": args.world,
        "load_average_before": os.getloadavg(),
        "results": {},
    }
    runs = fresh_runs(_rank, args.world, args.methods, args.repeat, args.dim, args.blocks)
    finish_fresh_report(report, runs, summarize_fresh)


if __name__ == "__main__":
    main()
