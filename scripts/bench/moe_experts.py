"""One mixture-of-experts layer's experts, forward and backward: sharded two ways against transformers' own.

Every rank builds the same Mixtral experts module (transformers 5 fused experts) and the same
routing (``--tokens`` tokens, top-``--top-k`` of ``--experts``), then times, interleaved in the
same processes, a forward and backward of:

* ``unsharded``: the whole module on every rank, transformers' default experts implementation
  (``grouped_mm``);
* ``unsharded_eager``: the same with transformers' per-expert loop (``experts_implementation="eager"``);
* ``tensor``: shardkit's experts split on each expert's features (one all-reduce of the output);
* ``expert``: shardkit's experts divided among the ranks (all-reduce or all-to-all, as the
  layer chooses).

Reported per way: the step's median seconds with their range (the slowest rank's), the median
CPU seconds of rank 0, and the bytes autograd keeps between forward and backward (saved tensors
other than the parameters, each storage counted once: the layer's activation memory), rank 0's. The sharded outputs and
gradients are checked against the unsharded module's before timing.

    python scripts/bench/moe_experts.py                  # 2 ranks, 512 tokens, hidden 256, 8 experts, top 2
    python scripts/bench/moe_experts.py --reps 3 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _harness import Interleaved, launch, machine  # noqa: E402

WAYS = ("unsharded", "unsharded_eager", "tensor", "expert")


class _Layer(torch.nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
        self.experts = MixtralExperts(config)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.experts(x, index, weights)  # type: ignore[no-any-return]


def _saved_bytes(fn: Any, params: set[int]) -> tuple[Any, int]:
    """``fn()`` and the bytes of the distinct storages autograd saved for backward meanwhile, parameters left out."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _rank(rank: int, world: int, args: Any) -> dict[str, Any]:
    from transformers import MixtralConfig

    import sharded_tensor as st
    from sharding import composite, single_split

    ranks = [f"rank:{r}/cpu" for r in range(world)]
    layouts = {"tensor": {"experts.gate_up_proj": single_split(1, ranks * 2),
                          "experts.down_proj": single_split(2, ranks)},
               "expert": {"experts.gate_up_proj": single_split(0, ranks), "experts.down_proj": single_split(0, ranks)}}
    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_local_experts=args.experts,
                           num_experts_per_tok=args.top_k)
    torch.manual_seed(0)
    ref = _Layer(config)
    torch.nn.init.normal_(ref.experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(ref.experts.down_proj, std=0.05)
    models: dict[str, torch.nn.Module] = {}
    for way in WAYS:
        implementation = "eager" if way == "unsharded_eager" else "grouped_mm"
        model = _Layer(MixtralConfig(**{**config.to_dict(), "experts_implementation": implementation}))
        model.load_state_dict(ref.state_dict())
        if way in layouts:
            st.shard_model(model, composite(**layouts[way]), src_rank=0)
        models[way] = model
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=g)
    top = torch.randn(args.tokens, args.experts, generator=g).softmax(-1).topk(args.top_k, dim=-1)
    index, weights = top.indices, top.values
    grad_out = torch.randn(args.tokens, args.hidden, generator=g)

    def step(way: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        model = models[way]
        model.zero_grad(set_to_none=True)
        xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        y, saved = _saved_bytes(lambda: model(xs, index, ws), params)
        y.backward(grad_out)
        return y.detach(), xs.grad, ws.grad, saved  # type: ignore[return-value]

    want = step("unsharded")
    errors = {}
    saved = {}
    for way in WAYS:
        got = step(way)
        saved[way] = got[3]
        errors[way] = max(float((a - b).abs().max() / (1e-12 + b.abs().max())) for a, b in zip(got[:3], want[:3]))
    timer = Interleaved()
    timer.run([lambda way=way: timer.measure(way, lambda: step(way)) for way in WAYS], args.reps)
    return {"runs": timer.runs, "cpu": timer.cpu, "saved_bytes": saved, "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    load_before = machine()["load_average"]
    results = launch(_rank, args.world, args)
    report: dict[str, Any] = {"benchmark": "moe_experts", "machine": machine(), "load_average_start": load_before,
                              "config": vars(args)}
    first = results[0]
    for way in WAYS:
        steps = first["runs"][way]
        report[way] = {"step_s_median": round(statistics.median(steps), 5),
                       "step_s_range": [round(min(steps), 5), round(max(steps), 5)],
                       "cpu_s_median_rank0": round(statistics.median(first["cpu"][way]), 5),
                       "saved_mib_rank0": round(first["saved_bytes"][way] / 2**20, 3),
                       "max_relative_error": max(r["errors"][way] for r in results)}
    base = report["unsharded"]["step_s_median"]
    report["step_ratio_over_unsharded"] = {way: round(report[way]["step_s_median"] / base, 3) for way in WAYS}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
