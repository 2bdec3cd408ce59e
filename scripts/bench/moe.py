"""Mixture-of-experts training step: expert parallel against tensor-parallel experts (Mixtral).

Both layouts shard the same Mixtral the same way apart from the experts (attention split by
heads) on the same Gloo ranks, and run the same training steps (forward with labels and the
router's load-balancing loss, backward, AdamW), alternating, so the ratio compares like with
like on a shared machine. Reported per layout: collectives and bytes of one forward and one
backward (shardkit's ``CommCounter``: bytes of the tensors handed to each collective), the
bytes this rank put on the wire during a step, and the median step time with its range; the
first loss of both layouts must agree.

    python scripts/bench/moe.py                       # 4 ranks, hidden 256, 8 experts, 2 layers, seq 128, batch 4
    python scripts/bench/moe.py --hidden 64 --steps 3 # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

# after the repository root: bench/checkpoint.py is not the package
sys.path.append(str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _harness import launch, machine, timed  # noqa: E402


def _config(args: Any) -> Any:
    from transformers import MixtralConfig
    return MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=args.world * 2,
                         num_key_value_heads=args.world, head_dim=args.hidden // (args.world * 2),
                         num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=args.seq,
                         use_cache=False, router_aux_loss_coef=0.02)


def _spec(world: int, layers: int, experts: str) -> Any:
    from sharding import composite, single_split
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    col, row = single_split(0, ranks), single_split(1, ranks)
    parts = {}
    for i in range(layers):
        layer = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            parts[f"{layer}.self_attn.{name}"] = col
        parts[f"{layer}.self_attn.o_proj"] = row
        if experts == "tensor":
            parts[f"{layer}.mlp.experts.gate_up_proj"] = single_split(1, ranks * 2)
            parts[f"{layer}.mlp.experts.down_proj"] = single_split(2, ranks)
        else:
            parts[f"{layer}.mlp.experts.gate_up_proj"] = parts[f"{layer}.mlp.experts.down_proj"] = col
    return composite(**parts)


def _rank(rank: int, world: int, args: Any) -> dict[str, Any]:
    from transformers import MixtralForCausalLM

    import sharded_tensor as st

    torch.manual_seed(0)
    state = MixtralForCausalLM(_config(args)).state_dict()
    models, opts = {}, {}
    for layout in ("tensor", "expert"):
        model = MixtralForCausalLM(_config(args))
        model.load_state_dict(state)
        st.shard_model(model, _spec(world, args.layers, layout), src_rank=0)
        models[layout] = model
        opts[layout] = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for layout, model in models.items():
        with st.CommCounter() as fwd:
            loss = model(batch, labels=batch, output_router_logits=True).loss
        with st.CommCounter() as bwd:
            loss.backward()
        opts[layout].zero_grad()
        out[layout] = {"first_loss": loss.item(),
                       "forward": {"counts": dict(fwd.counts), "bytes": dict(fwd.bytes_by_op)},
                       "backward": {"counts": dict(bwd.counts), "bytes": dict(bwd.bytes_by_op)},
                       "step_s": [], "wire_bytes": []}

    def step(layout: str) -> None:
        opts[layout].zero_grad()
        models[layout](batch, labels=batch, output_router_logits=True).loss.backward()
        opts[layout].step()

    for _ in range(args.steps):
        for layout in models:
            seconds, sent = timed(lambda layout=layout: step(layout))
            out[layout]["step_s"].append(seconds)
            out[layout]["wire_bytes"].append(sent)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    results = launch(_rank, args.world, args)
    report: dict[str, Any] = {"benchmark": "moe", "machine": machine(), "config": vars(args)}
    for layout in ("tensor", "expert"):
        per_rank = [r[layout] for r in results]
        steps = per_rank[0]["step_s"]
        report[f"{layout}_experts" if layout == "tensor" else "expert_parallel"] = {
            "first_loss": per_rank[0]["first_loss"],
            "step_s_median": round(statistics.median(steps), 4),
            "step_s_range": [round(min(steps), 4), round(max(steps), 4)],
            "forward_per_rank": [r["forward"] for r in per_rank],
            "backward_per_rank": [r["backward"] for r in per_rank],
            "wire_bytes_per_step_median_per_rank": [int(statistics.median(r["wire_bytes"])) for r in per_rank],
        }
    tp, ep = report["tensor_experts"], report["expert_parallel"]
    report["losses_agree"] = abs(tp["first_loss"] - ep["first_loss"]) <= 1e-5 * abs(tp["first_loss"])
    report["step_ratio_expert_over_tensor"] = round(ep["step_s_median"] / tp["step_s_median"], 3)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
