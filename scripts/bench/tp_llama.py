"""Tensor-parallel training of a transformers Llama: shardkit against DTensor's parallelize_module.

Both sides shard the same model the same way on 2 Gloo ranks (q/k/v/gate/up split on output
features, o/down on input features, the rest replicated) and run the same training steps
(forward with labels, backward, AdamW) in the same processes, alternating, so the ratios
compare like with like on a shared machine. Reported per side: collectives and bytes of one
forward (shardkit's ``CommCounter``; ``CommDebugMode`` for DTensor, which counts calls, with
bytes from the tensors it sees), of one backward, and the median step time; the loss of the
first step must agree.

    python scripts/bench/tp_llama.py                  # hidden 1024, 4 layers, 16 heads, seq 256, batch 4
    python scripts/bench/tp_llama.py --hidden 256 --seq 64 --steps 3   # a quick look
    python scripts/bench/tp_llama.py --compile --steps 6   # both sides under torch.compile (inductor)

With ``--compile`` both models are wrapped in ``torch.compile`` (inductor) after sharding; one
untimed step per side compiles forward and backward (its time is reported as
``compile_seconds``), and the graph breaks dynamo recorded on each side are reported. The
collectives are not counted then: the compiled graphs run them outside the counters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))  # after the repository root: bench/checkpoint.py is not the package
import torch  # noqa: E402
from _harness import launch, llama_tp_names, machine  # noqa: E402


def _config(args: Any) -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads, max_position_embeddings=args.seq, use_cache=False,
                       attn_implementation="sdpa")


def _shardkit(model: Any, world: int, layers: int) -> Any:
    import sharded_tensor as st
    from sharding import composite, single_split
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    cols, rows = llama_tp_names(layers)
    spec = composite(**{n: single_split(0, ranks) for n in cols}, **{n: single_split(1, ranks) for n in rows})
    return st.shard_model(model, spec)


def _dtensor(model: Any, world: int, layers: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (world,))
    cols, rows = llama_tp_names(layers)
    plan = {**{n: ColwiseParallel() for n in cols}, **{n: RowwiseParallel() for n in rows}}
    parallelize_module(model, mesh, plan)
    return model


def _comm_dtensor(fn: Any) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode
    with CommDebugMode() as debug:
        fn()
    return {str(op).split(".")[-1]: n for op, n in debug.get_comm_counts().items()}


def _rank(rank: int, world: int, args: Any) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    config = _config(args)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    models = {}
    for side, shard in (("shardkit", _shardkit), ("dtensor", _dtensor)):
        m = LlamaForCausalLM(config)
        m.load_state_dict(base.state_dict())
        models[side] = shard(m, world, args.layers)
    del base
    if args.compile:
        models = {side: torch.compile(m) for side, m in models.items()}
    opts = {side: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False) for side, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
               for _ in range(args.steps + 1)]
    out: dict[str, Any] = {}
    if args.compile:
        out.update(_compile_warmup(models, opts, batches[0]))
    else:
        out.update(_count_collectives(models, batches[0]))
    # Training steps, alternating sides.
    times: dict[str, list[float]] = {"shardkit": [], "dtensor": []}
    losses: dict[str, list[float]] = {"shardkit": [], "dtensor": []}
    for step, batch in enumerate(batches[1:]):
        order = ("shardkit", "dtensor") if step % 2 == 0 else ("dtensor", "shardkit")
        for side in order:
            model, opt = models[side], opts[side]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = model(batch, labels=batch).loss
            loss.backward()
            opt.step()
            elapsed = time.perf_counter() - t0
            times[side].append(elapsed)
            losses[side].append(float(loss.detach()))
    out["times"] = times
    out["losses"] = losses
    return out


def _compile_warmup(models: dict[str, Any], opts: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
    """One untimed step per side, which compiles forward and backward; graph breaks and the time it took."""
    from torch._dynamo.utils import counters
    out: dict[str, Any] = {"compile_seconds": {}, "graph_breaks": {}, "graphs": {}}
    for side, model in models.items():
        counters.clear()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        model(x, labels=x).loss.backward()
        opts[side].zero_grad()
        out["compile_seconds"][side] = time.perf_counter() - t0
        out["graph_breaks"][side] = sum(counters["graph_break"].values())
        out["graphs"][side] = counters["stats"]["unique_graphs"]
    return out


def _count_collectives(models: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
    """Collectives of one forward and one backward, per side."""
    import sharded_tensor as st
    out: dict[str, Any] = {}
    m = models["shardkit"]
    with st.CommCounter() as fwd:
        loss = m(x, labels=x).loss
    with st.CommCounter() as bwd:
        loss.backward()
    m.zero_grad()
    out["shardkit_forward"] = {"counts": dict(fwd.counts), "bytes": dict(fwd.bytes_by_op)}
    out["shardkit_backward"] = {"counts": dict(bwd.counts), "bytes": dict(bwd.bytes_by_op)}
    m = models["dtensor"]
    holder: dict[str, Any] = {}
    out["dtensor_forward"] = {"counts": _comm_dtensor(lambda: holder.setdefault("loss", m(x, labels=x).loss))}
    out["dtensor_backward"] = {"counts": _comm_dtensor(lambda: holder["loss"].backward())}
    m.zero_grad()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="torch.compile (inductor) both sides")
    args = parser.parse_args()
    results = launch(_rank, 2, args)
    # The slowest rank's time per step, then the median over steps.
    per_side = {side: statistics.median(max(r["times"][side][i] for r in results) for i in range(args.steps))
                for side in ("shardkit", "dtensor")}
    slowest = {side: [max(r["times"][side][i] for r in results) for i in range(args.steps)]
               for side in ("shardkit", "dtensor")}
    ratios = [a / b for a, b in zip(slowest["shardkit"], slowest["dtensor"])]
    r0 = results[0]
    report = {
        "benchmark": "tp_llama", "machine": machine(), "world": 2, "compile": args.compile,
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "seq": args.seq,
                  "batch": args.batch, "vocab": args.vocab},
        **({"compile_seconds": r0["compile_seconds"], "graph_breaks": [r["graph_breaks"] for r in results],
            "graphs": r0["graphs"]} if args.compile else
           {"forward_collectives": {"shardkit": r0["shardkit_forward"], "dtensor": r0["dtensor_forward"]},
            "backward_collectives": {"shardkit": r0["shardkit_backward"], "dtensor": r0["dtensor_backward"]}}),
        "step_seconds_median": per_side,
        "step_seconds_range": {side: [min(t), max(t)] for side, t in slowest.items()},
        "step_time_ratio_shardkit_over_dtensor": per_side["shardkit"] / per_side["dtensor"],
        "step_time_ratio_range": [min(ratios), max(ratios)],
        "first_loss": {"shardkit": r0["losses"]["shardkit"][0], "dtensor": r0["losses"]["dtensor"][0]},
        "steps": args.steps,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
