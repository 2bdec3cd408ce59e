"""Benchmark: a transformers Llama built on meta, tensor-parallel on 4 Gloo ranks, initialized by its own init.

Not a test; prints JSON. ``shard_model.py`` measures plain MLP blocks whose modules
initialize themselves with ``reset_parameters()``; here the model is a transformers
``LlamaForCausalLM`` (about 2 GiB of fp32 parameters by default), whose initialization is
the model's own ``_init_weights`` (normal(0, 0.02) weights, zero biases, ones for RMSNorm,
the rotary buffer computed). Each way runs in its own fresh set of processes, so every
rank's peak resident memory (``VmHWM``, reset with ``/proc/self/clear_refs`` once the process
is warm) measures that way alone:

* ``shardkit_meta``: build on meta, ``st.shard_model(model, spec)``: each rank allocates its
  blocks and the model's ``_init_weights`` fills them (an ordinary generator per block);
* ``shardkit_meta_seeded``: the same with ``seed=0`` (values independent of the layout);
* ``torch_parallelize_module``: PyTorch's own path: build on meta, ``parallelize_module``
  (``ColwiseParallel`` / ``RowwiseParallel``, and ``RowwiseParallel`` for the embedding split
  on the vocabulary) on a 1-D CPU mesh, ``to_empty(device="cpu")``, then the model's own
  ``initialize_weights()``, which runs ``_init_weights`` on the DTensor parameters.

The layout is the same in all ways: q/k/v/gate/up split on output features, o/down on input
features, the embedding split on the vocabulary, ``lm_head`` and the norms whole on every
rank. Time is wall seconds from the start of model construction until every rank holds its
initialized parameters (the slowest rank), with each rank's CPU seconds over the same span;
``phases`` splits the time on rank 0. Growth is ``VmHWM`` minus the resident size before
construction. Each model then computes a short forward (finite logits), and
``distinct_random_blocks`` checks that the ranks' blocks of a weight hold different values,
``replicas_agree`` that every rank holds the same ``lm_head`` (whole on every rank).

Usage::

    python scripts/bench/meta_init.py                      # ~2 GiB, 4 ranks, 3 fresh runs per way
    python scripts/bench/meta_init.py --hidden 256 --layers 2 --intermediate 704 --vocab 1024 --repeat 1
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# After the repository root: bench/checkpoint.py is not the package.
sys.path.append(str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    distinct_over_ranks,
    finish_fresh_report,
    fresh_runs,
    llama_tp_names,
    local_param_bytes,
    measured,
    summarize_fresh,
)

METHODS = ("shardkit_meta", "shardkit_meta_seeded", "torch_parallelize_module")


def _config(hidden: int, layers: int, intermediate: int, vocab: int, heads: int) -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=2048, tie_word_embeddings=False, use_cache=False)


def _meta_model(config: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _shardkit(config: Any, world: int, seed: int | None, phases: dict[str, float]) -> Any:
    import sharded_tensor as st
    from sharding import composite, single_split

    t0 = time.perf_counter()
    model = _meta_model(config)
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    col, row = single_split(0, ranks), single_split(1, ranks)
    cols, rows = llama_tp_names(config.num_hidden_layers)
    spec = composite(**{n: col for n in cols}, **{n: row for n in rows}, **{"model.embed_tokens": col})
    t1 = time.perf_counter()
    st.shard_model(model, spec, seed=seed)
    phases["build_meta"] = t1 - t0
    phases["shard_model"] = time.perf_counter() - t1
    return model


def _torch_path(config: Any, world: int, phases: dict[str, float]) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    t0 = time.perf_counter()
    mesh = init_device_mesh("cpu", (world,))
    model = _meta_model(config)
    cols, rows = llama_tp_names(config.num_hidden_layers)
    plan = {**{n: ColwiseParallel() for n in cols}, **{n: RowwiseParallel() for n in rows},
            "model.embed_tokens": RowwiseParallel()}
    t1 = time.perf_counter()
    parallelize_module(model, mesh, plan)
    t2 = time.perf_counter()
    model.to_empty(device="cpu")
    t3 = time.perf_counter()
    with torch.no_grad():
        model.initialize_weights()
    phases.update(build_meta=t1 - t0, parallelize_module=t2 - t1, to_empty=t3 - t2,
                  initialize_weights=time.perf_counter() - t3)
    return model


def _local(p: Any) -> Any:
    return p.to_local() if hasattr(p, "to_local") else p


def _rank(rank: int, world: int, method: str, dims: dict[str, int]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    def run(config: Any, phases: dict[str, float]) -> Any:
        if method == "torch_parallelize_module":
            return _torch_path(config, world, phases)
        return _shardkit(config, world, 0 if method == "shardkit_meta_seeded" else None, phases)

    # Warm up on a tiny Llama: imports and one-time set-up are not what is measured.
    warm = run(_config(64, 1, 128, 256, 4), {})
    warm(torch.zeros(1, 4, dtype=torch.long))
    del warm
    config = _config(**dims)
    phases: dict[str, float] = {}
    model, elapsed, cpu, growth = measured(lambda: run(config, phases))
    with torch.no_grad():
        logits = model(torch.arange(8).reshape(1, 8) % config.vocab_size).logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        distinct = distinct_over_ranks(_local(model.model.layers[0].self_attn.q_proj.weight)[0, :64], world)
        # lm_head is whole on every rank: do the replicas hold the same values?
        head = _local(model.lm_head.weight)[0, :64].double().contiguous()
        heads = [torch.empty_like(head) for _ in range(world)]
        dist.all_gather(heads, head)
        replicas_agree = all(torch.equal(heads[0], h) for h in heads)
        std = float(_local(model.model.layers[0].mlp.down_proj.weight).std())
        norm_ones = bool((_local(model.model.norm.weight) == 1).all())
    return {"seconds": elapsed, "cpu_seconds": cpu, "peak_growth": growth,
            "shard_bytes": local_param_bytes(model), "phases": phases,
            "output_finite": bool(torch.isfinite(logits).all()), "distinct_blocks": distinct,
            "replicas_agree": replicas_agree,
            "weight_std": std, "norm_ones": norm_ones}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``summarize_fresh``, with rank 0's phases and the checks of the model's own initialization."""
    return {
        **summarize_fresh(runs),
        "phases_rank0": {k: round(statistics.median(run["ranks"][0]["phases"][k] for run in runs), 2)
                         for k in runs[0]["ranks"][0]["phases"]},
        # False would mean the ranks hold different values for one replicated parameter.
        "replicas_agree": all(r["replicas_agree"] for run in runs for r in run["ranks"]),
        "down_proj_std": round(statistics.median(r["weight_std"] for run in runs for r in run["ranks"]), 4),
        "norm_weights_ones": all(r["norm_ones"] for run in runs for r in run["ranks"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--world", type=int, default=4, help="Gloo ranks")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--repeat", type=int, default=3, help="fresh runs per way (medians are reported)")
    args = parser.parse_args()
    dims = {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate,
            "vocab": args.vocab, "heads": args.heads}
    h, i, v = args.hidden, args.intermediate, args.vocab
    params = args.layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h
    report: dict[str, Any] = {
        "benchmark": "meta_init",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": __import__("torch").__version__,
                 "transformers": __import__("transformers").__version__},
        "model": {**dims, "params": params, "fp32_gib": round(params * 4 / (1 << 30), 3),
                  "layout": "q/k/v/gate/up dim 0, o/down dim 1, embed_tokens dim 0 (vocabulary); "
                            "lm_head and norms whole on every rank"},
        "world": args.world,
        "load_average_before": os.getloadavg(),
        "results": {},
    }
    runs = fresh_runs(_rank, args.world, args.methods, args.repeat, dims)
    finish_fresh_report(report, runs, summarize)


if __name__ == "__main__":
    main()
