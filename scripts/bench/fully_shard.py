"""Fully sharded data parallel: shardkit's ``st.fully_shard`` against FSDP2's ``fully_shard``.

The same transformers Llama (each decoder layer, then the model, fully sharded over every
rank), the same global batch split over the ranks, AdamW, fp32, on Gloo. Each side runs in
fresh processes of its own (memory figures need them), one after the other in the same
run, for each world size. Reported per side and world size:

* the median step time (forward with labels, backward, AdamW step; the slowest rank's),
  with its range, and the ratio shardkit / FSDP2;
* peak RSS growth per rank during the timed steps (over the resident size before them);
* bytes each rank holds between steps: parameters, gradients and optimizer state (plus any
  gathered parameters still held), and one N-th of the unsharded total for comparison;
* bytes each rank puts on the wire per step, counted at the collectives with one rule for
  both sides (ring algorithms: an all-gather sends (N - 1) shards, a reduce-scatter
  (N - 1) pieces, an all-reduce 2 (N - 1) / N of the tensor, N the collective's group);
  shardkit's from ``CommCounter``, FSDP2's from its calls to ``all_gather_single`` /
  ``reduce_scatter_single`` / ``all_reduce`` and, for DTensor's tensor parallel, to the
  functional collectives of the same names;
* bytes each process actually wrote to its sockets during the step (``wchar`` of
  /proc/self/io: Gloo's own algorithms, whatever the rule says; Gloo's
  ``reduce_scatter_tensor``, which FSDP2 calls, is an all-reduce of the whole input, twice a
  ring reduce-scatter's bytes);
* CPU seconds of each process per step (all its threads): on a shared machine a steadier
  figure than the wall time;
* the mean over ranks of the first step's loss (the two sides must agree).

    python scripts/bench/fully_shard.py            # hidden 1024, intermediate 2816, 4 layers, vocab 32000
    python scripts/bench/fully_shard.py --small    # a quick look (hidden 256, vocab 4096, seq 64)
    python scripts/bench/fully_shard.py --worlds 1 2 4 --hybrid   # the scaling curve, and 2 x 2
    python scripts/bench/fully_shard.py --meta --layers 28 --hidden 2048 --intermediate 5632 --worlds 4
    python scripts/bench/fully_shard.py --large    # from meta, larger than one rank's share of memory

With ``--hybrid``, 2 x 2 on 4 ranks as well: shardkit's tensor parallel (transformers' plan)
within {0, 1} and {2, 3} and ``fully_shard`` over {0, 2} and {1, 3}, against FSDP2 on the
``dp`` axis of a (2, 2) mesh after ``parallelize_module`` on its ``tp`` axis. With ``--meta``,
no training: the model is built on the meta device, fully sharded, and each rank's rows are
allocated and initialized (``shard_model(model, composite(), seed=0)``); reported against
the unsharded fp32 size and one rank's share of the machine's memory. With ``--large``, on 4
ranks: a Llama (hidden 2048, intermediate 5632, 16 heads, vocabulary 32000) with the fewest
layers whose fp32 weights exceed one rank's share of the machine's memory, built on meta,
fully sharded (each layer's attention and MLP, each layer, the embedding, the head, the
root), initialized (``seed=0``), one SGD step (sequence 16, batch 1 per rank) and a
``checkpoint.save`` to a temporary folder (deleted after); per rank the bytes held, peak RSS
growth and seconds of each phase. It first compares an estimate of the memory it needs with
what the machine has free, and runs fewer layers (or none) when that is short. Hidden 2048
rather than 4096: with smaller units (one unit gathered whole on each rank) the same weights
need about 17 GiB of the machine instead of about 21.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# After the repository root: bench/checkpoint.py is not the package (the ranks import it).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _harness import GiB, PeakGrowth, machine, proc_status, run_fresh, wire_bytes  # noqa: E402

MiB = 1 << 20


def _config(args: Any) -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads, max_position_embeddings=args.seq, use_cache=False,
                       attn_implementation="sdpa")


class _Wire:
    """Bytes FSDP2 (and DTensor's tensor parallel) put on the wire, counted at the collectives.

    The same rule as ``CommCounter``, with each collective's own group size: FSDP2's calls to
    torch.distributed, and the functional collectives DTensor's redistributions run (those of
    ``parallelize_module``; they bypass ``torch.distributed``'s functions).
    """

    def __init__(self) -> None:
        import torch.distributed._functional_collectives as funcol

        self.bytes: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self.active = False
        for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
            original = getattr(dist, name)
            setattr(dist, name, self._wrap(name, original))
            functional = getattr(funcol, name, None)
            if functional is not None:  # DTensor calls them through the module: patched there
                setattr(funcol, name, self._wrap(name, functional, functional=True))

    def _count(self, name: str, tensor: torch.Tensor, world: int) -> None:
        size = tensor.numel() * tensor.element_size()
        if name == "all_gather_single":  # tensor: the shard sent
            n = (world - 1) * size
        elif name == "reduce_scatter_single":  # tensor: the whole input
            n = (world - 1) * size // world
        else:
            n = 2 * (world - 1) * size // world
        self.bytes[name] = self.bytes.get(name, 0) + n
        self.counts[name] = self.counts.get(name, 0) + 1

    def _wrap(self, name: str, original: Any, functional: bool = False) -> Any:
        signature = inspect.signature(original)
        first, second = list(signature.parameters)[:2]

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                given = signature.bind(*args, **kwargs).arguments
                if functional:
                    import torch.distributed._functional_collectives as funcol
                    from torch.distributed.distributed_c10d import _resolve_process_group

                    group = _resolve_process_group(funcol._resolve_group_name(given["group"]))
                    self._count(name, given[first], group.size())
                else:
                    world = dist.get_world_size(given.get("group"))
                    out, inp = given[first], given.get(second)
                    self._count(name, inp if name != "all_reduce" else out, world)
            return original(*args, **kwargs)
        return call


def _held(model: Any, optim: Any) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state, plus gathered parameters still held."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            total += grad.numel() * grad.element_size()
    for state in optim.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    from sharded_tensor._fsdp.unit import unit_of  # a benchmark may look inside

    for module in model.modules():
        unit = unit_of(module)
        if unit is not None:
            total += unit.unsharded.untyped_storage().nbytes()
    return total


def _rank(rank: int, world: int, args: Any, side: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import sharded_tensor as st

    config = _config(args)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    unsharded = sum(p.numel() * p.element_size() for p in model.parameters())
    # The most bytes one unit gathers: a decoder layer, or the root's own parameters (embeddings, head, norm).
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    root_bytes = unsharded - layer_bytes * len(model.model.layers)
    unit_bytes = max(layer_bytes, root_bytes)
    wire = None
    dp_index, dp_size = rank, world
    if side.endswith("2x2"):
        dp_index, dp_size = rank // 2, 2
    if side == "shardkit":
        for layer in model.model.layers:
            st.fully_shard(layer)
        st.fully_shard(model)
    elif side == "shardkit-2x2":
        tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        st.shard_model(model, st.tensor_parallel_spec(model, [0, 1]), process_group=tp_groups[rank // 2])
        for layer in model.model.layers:
            st.fully_shard(layer)  # over {0, 2} and {1, 3}: the data-parallel groups of the tensor-parallel model
        st.fully_shard(model)
    elif side == "fsdp2-2x2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # tp {0, 1}, {2, 3}; dp {0, 2}, {1, 3}
        # The layout st.tensor_parallel_spec reads from transformers' plan: the vocabulary split in the
        # embedding and the head, the decoder layers' projections split by heads and features.
        parallelize_module(model, mesh["tp"], {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                               "lm_head": ColwiseParallel(output_layouts=Replicate())})
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()})
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        wire = _Wire()
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wire = _Wire()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    per = args.batch // dp_size
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq),
                             generator=gen)[dp_index * per:(dp_index + 1) * per]
               for _ in range(args.steps + 1)]

    def step(batch: torch.Tensor) -> float:
        optim.zero_grad(set_to_none=True)
        loss = model(batch, labels=batch).loss
        loss.backward()
        optim.step()
        return float(loss)

    first = step(batches[0])  # warm-up; creates the optimizer state
    held = _held(model, optim)
    times: list[float] = []
    cpu: list[float] = []
    comm_bytes, comm_counts = 0, {}
    written = 0
    with PeakGrowth() as peak:
        rss_before = proc_status("VmRSS")
        for i, batch in enumerate(batches[1:]):
            dist.barrier()
            t0, c0, w0 = time.perf_counter(), time.process_time(), wire_bytes()
            if i == 0 and side.startswith("shardkit"):
                with st.CommCounter() as comm:
                    step(batch)
                comm_bytes, comm_counts = comm.bytes_sent, dict(comm.counts)
            elif i == 0 and wire is not None:
                wire.active = True
                step(batch)
                wire.active = False
                comm_bytes, comm_counts = sum(wire.bytes.values()), dict(wire.counts)
            else:
                step(batch)
            if i == 0:
                written = wire_bytes() - w0
            cpu.append(time.process_time() - c0)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
    loss = torch.tensor([first], dtype=torch.float64)
    dist.all_reduce(loss)
    return {"times": times, "peak_growth": peak.growth, "rss_before": rss_before, "held": held,
            "unsharded": unsharded, "unit_bytes": unit_bytes, "wire_bytes": comm_bytes, "collectives": comm_counts,
            "written": written, "cpu": cpu, "first_loss": float(loss) / world}


def _meta_rank(rank: int, world: int, args: Any) -> dict[str, Any]:
    """Build the model on meta, fully shard it, then allocate and initialize only this rank's rows."""
    from transformers import LlamaForCausalLM

    import sharded_tensor as st
    from sharding import composite

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(args))
    unsharded = sum(p.numel() * 4 for p in model.parameters())
    with PeakGrowth() as peak:
        t0 = time.perf_counter()
        for layer in model.model.layers:
            st.fully_shard(layer)
        st.fully_shard(model)
        st.shard_model(model, composite(), seed=0)
        seconds = time.perf_counter() - t0
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"unsharded": unsharded, "held": held, "peak_growth": peak.growth, "seconds": seconds}


def _llama_params(hidden: int, intermediate: int, layers: int, vocab: int) -> int:
    """Parameters of a Llama with as many key/value heads as heads and untied embeddings."""
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def _large_need(args: Any, layers: int, world: int) -> int:
    """Bytes the large run needs on the machine, all ranks together (an estimate).

    Each rank holds its share of the fp32 parameters and of their gradients (SGD keeps no
    state), and during backward up to three times the largest unit's whole size more (the
    unit's gradients, the next unit's prefetched parameters, the pieces the other ranks
    send), plus the interpreter with torch and transformers (about 0.5 GiB). For one layer
    it gives 2.9 GiB per rank; a rank of such a run was at 3.0 GiB resident when the
    kernel's OOM killer stopped it on a machine short of memory.
    """
    weights = 4 * _llama_params(args.hidden, args.intermediate, layers, args.vocab)
    unit = 4 * max(3 * args.hidden * args.intermediate, args.vocab * args.hidden)
    return 2 * weights + world * (3 * unit + GiB // 2)


def _large_rank(rank: int, world: int, args: Any, folder: str) -> dict[str, Any]:
    """From meta: fully shard, materialize this rank's rows, one SGD step, save a checkpoint."""
    from transformers import LlamaForCausalLM

    import checkpoint
    import sharded_tensor as st
    from sharding import composite

    rss_start = proc_status("VmRSS")
    with PeakGrowth() as build_peak:
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(_config(args))
        unsharded = sum(p.numel() * 4 for p in model.parameters())
        # Small units keep what a rank gathers at once small: each layer's attention and MLP, the
        # layer (its norms), the embedding and the head, then the root (the final norm).
        for layer in model.model.layers:
            st.fully_shard(layer.self_attn)
            st.fully_shard(layer.mlp)
            st.fully_shard(layer)
        st.fully_shard(model.model.embed_tokens)
        st.fully_shard(model.lm_head)
        st.fully_shard(model)
        st.shard_model(model, composite(), seed=0)
        build = time.perf_counter() - t0
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    optim = torch.optim.SGD(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (args.batch * world, args.seq),
                           generator=torch.Generator().manual_seed(1))[rank * args.batch:(rank + 1) * args.batch]
    dist.barrier()
    with PeakGrowth() as step_peak:
        t0 = time.perf_counter()
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optim.step()
        step = time.perf_counter() - t0
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    dist.barrier()
    with PeakGrowth() as save_peak:
        t0 = time.perf_counter()
        checkpoint.save(model.state_dict(), folder)
        save = time.perf_counter() - t0
    total = torch.tensor([float(loss.detach())], dtype=torch.float64)
    dist.all_reduce(total)
    return {"unsharded": unsharded, "held": held, "grads": grads, "build_seconds": build, "step_seconds": step,
            "save_seconds": save, "build_peak": build_peak.growth, "step_peak": step_peak.growth,
            "save_peak": save_peak.growth, "rss_start": rss_start, "vm_hwm": proc_status("VmHWM"),
            "loss": float(total) / world}


def _large(args: Any, report: dict[str, Any]) -> None:
    import shutil
    import tempfile

    world = 4
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total, available = (int(info[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
    share = total // world
    # The fewest layers whose fp32 weights exceed one rank's share of the machine's memory.
    wanted = args.layers
    if wanted is None:
        wanted = 1
        while 4 * _llama_params(args.hidden, args.intermediate, wanted, args.vocab) <= share:
            wanted += 1
    layers = wanted
    # A run that does not fit would bring the kernel's OOM killer onto every process of the machine.
    margin = 0.9 * available
    while layers > 0 and _large_need(args, layers, world) > margin:
        layers -= 1  # the largest that fits what the machine has free now
    if layers == 0:
        weights = 4 * _llama_params(args.hidden, args.intermediate, wanted, args.vocab)
        report["large"] = {"ranks": world, "machine_memory_mib": round(total / MiB),
                           "available_before_mib": round(available / MiB), "one_rank_share_mib": round(share / MiB),
                           "layers_wanted": wanted, "unsharded_fp32_weights_mib": round(weights / MiB),
                           "estimated_need_mib": round(_large_need(args, wanted, world) / MiB), "layers_run": 0,
                           "not_run": f"even one layer needs about {_large_need(args, 1, world) / GiB:.1f} GiB; "
                                      f"{available / GiB:.1f} GiB are free"}
        return
    args.layers = layers
    report["model"].update(layers=layers, seq=args.seq, batch=args.batch * world, optimizer="SGD",
                           heads=args.heads)
    folder = tempfile.mkdtemp(prefix="shardkit-large-")
    try:
        results = run_fresh(_large_rank, world, args, folder, what=f"large model on {world} ranks")
        saved = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    weights = results[0]["unsharded"]
    report["large"] = {
        "ranks": world,
        "machine_memory_mib": round(total / MiB), "available_before_mib": round(available / MiB),
        "one_rank_share_mib": round(share / MiB),
        "layers_wanted": wanted, "layers_run": layers,
        "estimated_need_mib": round(_large_need(args, layers, world) / MiB),
        "unsharded_fp32_weights_mib": round(weights / MiB),
        "weights_over_one_rank_share": round(weights / share, 3),
        "held_params_mib_per_rank": [round(r["held"] / MiB, 1) for r in results],
        "held_over_one_nth": round(max(r["held"] for r in results) / (weights / world), 4),
        "grads_mib_per_rank": [round(r["grads"] / MiB, 1) for r in results],
        "rss_at_start_mib_per_rank": [round(r["rss_start"] / MiB) for r in results],
        "peak_rss_growth_mib_per_rank": {
            "build": [round(r["build_peak"] / MiB) for r in results],
            "step": [round(r["step_peak"] / MiB) for r in results],
            "save": [round(r["save_peak"] / MiB) for r in results]},
        "peak_rss_mib_per_rank": [round(r["vm_hwm"] / MiB) for r in results],
        "seconds": {"build": [round(r["build_seconds"], 1) for r in results],
                    "step": [round(r["step_seconds"], 1) for r in results],
                    "save": [round(r["save_seconds"], 1) for r in results]},
        "checkpoint_mib": round(saved / MiB),
        "loss": results[0]["loss"],
    }


def _summary(results: list[dict[str, Any]], world: int) -> dict[str, Any]:
    times = results[0]["times"]
    over_world = 4 * results[0]["unsharded"] / world
    return {
        "step_seconds_median": round(statistics.median(times), 3),
        "step_seconds_range": [round(min(times), 3), round(max(times), 3)],
        "peak_rss_growth_mib_per_rank": [round(r["peak_growth"] / MiB) for r in results],
        "held_mib_per_rank": [round(r["held"] / MiB, 1) for r in results],
        # parameters, gradients and the two AdamW moments, unsharded, over the world
        "unsharded_over_world_mib": round(over_world / MiB, 1),
        "held_over_one_nth": round(max(r["held"] for r in results) / over_world, 3),
        # what a rank holds at most during a step: its share plus one unit's gathered parameters
        "one_nth_plus_one_unit_mib": round((over_world + results[0]["unit_bytes"]) / MiB, 1),
        "wire_mib_per_step_per_rank": [round(r["wire_bytes"] / MiB, 1) for r in results],
        # what the process (Gloo's threads included) handed to the sockets in the first timed step
        "written_mib_per_step_per_rank": [round(r["written"] / MiB, 1) for r in results],
        # CPU seconds of the process per step (median over the timed steps; less sensitive to a shared machine)
        "cpu_seconds_per_step_per_rank": [round(statistics.median(r["cpu"]), 2) for r in results],
        "collectives_per_step": results[0]["collectives"],
        "first_loss": results[0]["first_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=None, help="default 4; with --large, the fewest whose fp32 "
                        "weights exceed one rank's share of the machine's memory")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--small", action="store_true", help="hidden 256, intermediate 704, vocab 4096, seq 64")
    parser.add_argument("--hybrid", action="store_true",
                        help="also 2 x 2 on 4 ranks: shardkit's tensor parallel + fully_shard against FSDP2 + "
                             "parallelize_module on a (dp, tp) mesh")
    parser.add_argument("--meta", action="store_true",
                        help="only build the model on meta and materialize each rank's rows (no training); "
                             "reports held bytes and peak RSS growth against the unsharded fp32 size")
    parser.add_argument("--large", action="store_true",
                        help="on 4 ranks, a Llama (hidden 2048, intermediate 5632, 16 heads, vocab 32000) built "
                             "from meta whose fp32 weights exceed one rank's share of the machine's memory: fully "
                             "shard, initialize (seed=0), one SGD step (seq 16, batch 1 per rank), save a "
                             "checkpoint to a temporary folder (deleted); fewer layers if the free memory is short")
    args = parser.parse_args()
    if args.large:
        args.hidden, args.intermediate, args.heads, args.vocab, args.seq, args.batch = 2048, 5632, 16, 32000, 16, 1
    elif args.layers is None:
        args.layers = 4
    if args.small:
        args.hidden, args.intermediate, args.vocab, args.seq = 256, 704, 4096, 64
    report: dict[str, Any] = {
        "benchmark": "fully_shard", "machine": machine(),
        "model": {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
                  "heads": args.heads, "seq": args.seq, "batch": args.batch, "vocab": args.vocab,
                  "dtype": "float32", "optimizer": "AdamW"},
        "timed_steps": args.steps, "worlds": {},
    }
    if args.large:
        _large(args, report)
        print(json.dumps(report, indent=2))
        return
    if args.meta:
        total_kib = int(Path("/proc/meminfo").read_text().split()[1])
        for world in args.worlds:
            results = run_fresh(_meta_rank, world, args, what=f"meta build on {world} ranks")
            report["worlds"][str(world)] = {
                "unsharded_fp32_mib": round(results[0]["unsharded"] / MiB),
                "machine_memory_share_per_rank_mib": round(total_kib / 1024 / world),
                "held_mib_per_rank": [round(r["held"] / MiB, 1) for r in results],
                "peak_rss_growth_mib_per_rank": [round(r["peak_growth"] / MiB) for r in results],
                "build_seconds": [round(r["seconds"], 1) for r in results]}
        print(json.dumps(report, indent=2))
        return
    for world in args.worlds:
        sides = {}
        for side in ("shardkit", "fsdp2"):
            results = run_fresh(_rank, world, args, side, what=f"{side} on {world} ranks")
            sides[side] = _summary(results, world)
        sk, f2 = sides["shardkit"], sides["fsdp2"]
        sides["step_time_ratio_shardkit_over_fsdp2"] = round(sk["step_seconds_median"] / f2["step_seconds_median"], 3)
        sides["cpu_ratio_shardkit_over_fsdp2"] = round(statistics.median(sk["cpu_seconds_per_step_per_rank"])
                                                       / statistics.median(f2["cpu_seconds_per_step_per_rank"]), 3)
        sides["first_loss_relative_difference"] = abs(sk["first_loss"] - f2["first_loss"]) / abs(f2["first_loss"])
        report["worlds"][str(world)] = sides
        print(json.dumps({str(world): sides}), file=sys.stderr, flush=True)
    if args.hybrid:
        sides = {}
        for side in ("shardkit-2x2", "fsdp2-2x2"):
            results = run_fresh(_rank, 4, args, side, what=f"{side} on 4 ranks")
            sides[side] = _summary(results, 4)
        sk, f2 = sides["shardkit-2x2"], sides["fsdp2-2x2"]
        sides["step_time_ratio_shardkit_over_fsdp2"] = round(sk["step_seconds_median"] / f2["step_seconds_median"], 3)
        sides["first_loss_relative_difference"] = abs(sk["first_loss"] - f2["first_loss"]) / abs(f2["first_loss"])
        sides["cpu_ratio_shardkit_over_fsdp2"] = round(statistics.median(sk["cpu_seconds_per_step_per_rank"])
                                                       / statistics.median(f2["cpu_seconds_per_step_per_rank"]), 3)
        report["hybrid_2x2"] = sides
        print(json.dumps({"2x2": sides}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
