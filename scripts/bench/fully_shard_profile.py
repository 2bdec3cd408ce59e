"""Where a fully sharded step spends its time: shardkit, FSDP2 and the plain floor, side by side.

The model, batch and optimizer of ``fully_shard.py`` (transformers Llama, AdamW, fp32, Gloo),
three sides, each in fresh processes, one after the other in the same run:

* ``shardkit`` / ``fsdp2``: each decoder layer, then the model, fully sharded. Per step, the
  slowest rank's forward, backward and ``optim.step()``; on shardkit, the seconds spent
  waiting for collectives (``PendingExchange.wait``). One step under ``torch.profiler`` on rank 0: self CPU seconds by
  category (matmuls, other compute, copies into and out of flat buffers, optimizer, the
  collectives' own threads where the profiler sees them). Also each phase's peak RSS over
  the resident size at the start of the step (rank 0), to tell where the step's peak is.
* ``plain``: the floor. The whole model on every rank (no gathering), forward and backward
  on the rank's part of the batch, then AdamW on one N-th of every parameter (the rows a
  fully sharded rank holds: the same optimizer work). Then, separately and back to back,
  the collectives a fully sharded step makes, on flat buffers of the same sizes: one
  all-gather per unit for forward, one per decoder layer again for backward, one
  reduce-scatter per unit (Gloo's ``reduce_scatter_tensor`` and shardkit's). Compute
  alone is what no implementation can beat; compute plus collectives run one after the
  other is what an implementation gets with no overlap at all.

    python scripts/bench/fully_shard_profile.py --worlds 2 4
    python scripts/bench/fully_shard_profile.py --small --worlds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _harness import MiB, machine, proc_status, reset_peak, run_fresh  # noqa: E402
from fully_shard import _config  # noqa: E402

# Profiler event names (by prefix or content) -> category.
_CATEGORIES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                "aten::_scaled_dot_product", "aten::baddbmm")),
    ("copy", ("aten::copy_", "aten::cat", "aten::split_with_sizes_copy", "aten::_chunk_cat",
              "aten::clone", "aten::_to_copy", "aten::zero_", "aten::fill_", "aten::zeros")),
    ("optimizer", ("aten::_foreach", "aten::_fused_adam", "Optimizer.step")),
    ("collective", ("gloo:", "c10d::", "nccl:", "record_param_comms")),
)


def _category(name: str) -> str:
    for label, keys in _CATEGORIES:
        if any(name.startswith(k) or k in name for k in keys):
            return label
    return "other" if name.startswith("aten::") else "python/other"


class _Waits:
    """Seconds this rank blocks in shardkit's collective waits."""

    def __init__(self, side: str) -> None:
        self.seconds = 0.0
        if side == "shardkit":
            from _shardkit import comm

            original = comm.PendingExchange.wait

            def wait(pending: Any) -> None:
                t0 = time.perf_counter()
                original(pending)
                self.seconds += time.perf_counter() - t0
            comm.PendingExchange.wait = wait  # type: ignore[method-assign,assignment]
        else:
            # FSDP2 calls torch's collectives through references of its own: its waits are not
            # seen here (the profile's FSDP:: events hold them).
            self.seconds = float("nan")


def _build(rank: int, world: int, args: Any, side: str) -> tuple[Any, Any, list[torch.Tensor], Any]:
    from transformers import LlamaForCausalLM

    config = _config(args)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    shards = None
    if side == "shardkit":
        import sharded_tensor as st

        for layer in model.model.layers:
            st.fully_shard(layer)
        st.fully_shard(model)
        params = list(model.parameters())
    elif side == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
    else:
        # The rows a fully sharded rank holds of each parameter, stepped by the optimizer.
        shards = []
        for p in model.parameters():
            rows = p.detach().chunk(world)
            shards.append((p, rank, torch.nn.Parameter(rows[rank].clone()) if rank < len(rows) else None))
        params = [s for _, _, s in shards if s is not None]
    optim = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    per = args.batch // world
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)[rank * per:(rank + 1) * per]
               for _ in range(args.steps + 1)]
    return model, optim, batches, shards


def _unit_sizes(model: Any) -> tuple[list[int], int]:
    """Elements of each decoder layer, and of the root's own parameters."""
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    return layers, sum(p.numel() for p in model.parameters()) - sum(layers)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _collectives(world: int, layers: list[int], root: int) -> dict[str, float]:
    """The collectives of one fully sharded step on flat buffers of the units' sizes, back to back.

    Gloo's ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, and the direct exchanges
    ``st.fully_shard`` uses (``_shardkit.flat``), each rank's piece a single tensor. Two rounds
    (the first touches fresh memory); the second round's seconds, the slowest rank's.
    """
    from _shardkit import flat

    rank = dist.get_rank()
    gathers = [root, *layers, *layers[:-1]]  # forward: every unit; backward: the layers again (last one kept)
    reduces = [*reversed(layers), root]

    def gloo_gather(n: int) -> None:
        dist.all_gather_into_tensor(torch.empty(n * world), torch.empty(n))

    def direct_gather(n: int) -> None:
        full = torch.empty(n * world)
        places = [[full[r * n:(r + 1) * n] for r in range(world)]]
        flat.start_gather([torch.empty(n)], places, None, rank, counted=0, what="gather").wait()

    def gloo_reduce(n: int) -> None:
        dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * world))

    def direct_reduce(n: int) -> None:
        full, received = torch.ones(n * world), torch.empty(world - 1, n)
        theirs = iter(received)
        places = [[None if r == rank else next(theirs) for r in range(world)]]
        flat.start_scatter([list(full.chunk(world))], places, None, rank, counted=0, what="reduce").wait()
        torch.sum(received, 0).add_(full[rank * n:(rank + 1) * n])

    out: dict[str, float] = {}
    for _ in range(2):
        for label, fn, sizes in (("all_gathers_gloo", gloo_gather, gathers),
                                 ("all_gathers_direct", direct_gather, gathers),
                                 ("reduce_scatters_gloo", gloo_reduce, reduces),
                                 ("reduce_scatters_direct", direct_reduce, reduces)):
            dist.barrier()
            t0 = time.perf_counter()
            for n in sizes:
                fn(-(-n // world))
            out[label] = _slowest(time.perf_counter() - t0)
    return out


def _rank(rank: int, world: int, args: Any, side: str) -> dict[str, Any]:
    model, optim, batches, shards = _build(rank, world, args, side)
    waits = _Waits(side)

    def step(batch: torch.Tensor, phases: dict[str, list[float]] | None) -> None:
        optim.zero_grad(set_to_none=True)
        if shards is not None:
            model.zero_grad(set_to_none=True)
        base = reset_peak()
        t0 = time.perf_counter()
        loss = model(batch, labels=batch).loss
        t1 = time.perf_counter()
        forward_peak = proc_status("VmHWM") - base
        reset_peak()
        loss.backward()
        if shards is not None:
            for p, r, shard in shards:
                if shard is not None:
                    shard.grad = p.grad.chunk(world)[r]
        t2 = time.perf_counter()
        backward_peak = proc_status("VmHWM") - base
        reset_peak()
        optim.step()
        t3 = time.perf_counter()
        optimizer_peak = proc_status("VmHWM") - base
        if phases is not None:
            for key, value in (("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2), ("step", t3 - t0)):
                phases[key].append(_slowest(value))
            # Peak RSS in each phase over the resident size when the step began (this rank's), MiB.
            for key, value in (("forward", forward_peak), ("backward", backward_peak), ("optimizer", optimizer_peak)):
                phases[f"{key}_peak_mib"].append(value / MiB)

    step(batches[0], None)
    phases: dict[str, list[float]] = defaultdict(list)
    wait_seconds = []
    for batch in batches[1:-1]:
        dist.barrier()
        before = waits.seconds
        step(batch, phases)
        wait_seconds.append(waits.seconds - before)
    out: dict[str, Any] = {key: round(statistics.median(v), 1 if key.endswith("mib") else 3)
                           for key, v in phases.items()}
    out["collective_wait"] = None if side != "shardkit" else round(statistics.median(wait_seconds), 3)
    dist.barrier()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batches[-1], None)
    if rank == 0:
        by_category: dict[str, float] = defaultdict(float)
        top = []
        for event in prof.key_averages():
            by_category[_category(event.key)] += event.self_cpu_time_total / 1e6
            top.append((event.self_cpu_time_total / 1e6, event.key, event.count))
        out["profile_self_cpu_seconds"] = {k: round(v, 3) for k, v in sorted(by_category.items())}
        out["profile_top"] = [f"{s:.3f} s {k} x{c}" for s, k, c in sorted(top, reverse=True)[:args.top]]
    if side == "plain":
        layers, root = _unit_sizes(model)
        out.update({k: round(v, 3) for k, v in _collectives(world, layers, root).items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up step (one more profiled)")
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--sides", nargs="*", default=["shardkit", "fsdp2", "plain"])
    parser.add_argument("--top", type=int, default=12, help="profiler events listed per side")
    parser.add_argument("--small", action="store_true", help="hidden 256, intermediate 704, vocab 4096, seq 64")
    args = parser.parse_args()
    if args.small:
        args.hidden, args.intermediate, args.vocab, args.seq = 256, 704, 4096, 64
    report: dict[str, Any] = {"benchmark": "fully_shard_profile", "machine": machine(), "worlds": {}}
    for world in args.worlds:
        sides = {}
        for side in args.sides:
            sides[side] = run_fresh(_rank, world, args, side, what=f"{side} on {world} ranks")[0]
            print(json.dumps({str(world): {side: sides[side]}}), file=sys.stderr, flush=True)
        report["worlds"][str(world)] = sides
    report["machine"]["load_average_after"] = machine()["load_average"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
