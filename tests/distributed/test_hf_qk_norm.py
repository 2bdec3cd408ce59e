"""Decoders with q/k norms, sharded tensor-parallel on 2 Gloo ranks, against the unsharded model.

Qwen3 and Gemma3 normalize each head over ``head_dim`` with one weight shared by all heads
(whole on every rank, applied to this rank's heads only: its gradient is a sum over ranks);
OLMo2 normalizes q and k over all heads at once (a mean across the split). One spawn checks,
for each, on every rank: logits, every parameter's gradient (split ones gathered), the logits
after 3 SGD steps, and that no activation is gathered (OLMo2's mean across heads is a local
sum and an all-reduce).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import sharded_tensor as st  # noqa: E402
from sharding import composite, single_split  # noqa: E402
from tests.distributed._grads import assert_like_unsharded, compare_with_unsharded  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed
VOCAB, LAYERS = 96, 2
ARCHS = ("qwen3", "gemma3", "olmo2")


def _model(arch: str):  # type: ignore[no-untyped-def]
    import transformers as tf
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": LAYERS,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
              "use_cache": False, "attention_dropout": 0.0}
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common))
    if arch == "gemma3":
        config = tf.Gemma3TextConfig(**common, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
        return tf.Gemma3ForCausalLM(config)
    return tf.Olmo2ForCausalLM(tf.Olmo2Config(**common))


def _spec(world: int):  # type: ignore[no-untyped-def]
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    col, row = single_split(0, ranks), single_split(1, ranks)
    parts = {}
    for i in range(LAYERS):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        parts.update({f"{attn}.q_proj": col, f"{attn}.k_proj": col, f"{attn}.v_proj": col, f"{attn}.o_proj": row,
                      f"{mlp}.gate_proj": col, f"{mlp}.up_proj": col, f"{mlp}.down_proj": row})
    return composite(**parts)


def _run(rank: int, world: int) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for arch in ARCHS:
        torch.manual_seed(0)
        ref = _model(arch)
        with torch.no_grad():  # norm weights away from their init, so their gradients matter
            for name, p in ref.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn(p.shape) * 0.3)
        model = _model(arch)
        model.load_state_dict(ref.state_dict())
        st.shard_model(model, _spec(world), src_rank=0)
        out[arch] = compare_with_unsharded(model, ref, rank, x, VOCAB)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, object]]]:
    return run_distributed(_run, 2, timeout=300)


@pytest.mark.parametrize("arch", ARCHS)
def test_qk_norm_decoder_equals_unsharded(runs, arch):
    for out in runs:
        assert_like_unsharded(out[arch])
        assert any("q_norm" in name for name in out[arch]["grads"])


def test_norms_across_heads_need_no_gather(runs):
    # Qwen3/Gemma3 normalize within a head; OLMo2's mean over all heads is a local sum and one all-reduce
    for out in runs:
        assert out["qwen3"]["comm"] == out["gemma3"]["comm"] == {"all_reduce": 2 * LAYERS}
        assert out["olmo2"]["comm"] == {"all_reduce": 4 * LAYERS}
