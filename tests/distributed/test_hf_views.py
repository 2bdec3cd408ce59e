"""transformers models whose code views with a fixed number of heads or reads a split weight's dtype.

2 Gloo ranks, the usual tensor-parallel layout (attention and MLP inputs split on output
features, their outputs on input features), each rank against the unsharded model:

* BLOOM views its fused q/k/v as ``(batch, seq, num_heads, 3, head_dim)`` and Falcon (new
  decoder architecture, grouped-query) as ``(batch, seq, -1, heads per kv + 2, head_dim)`` then
  picks k and v with a list index; OPT reshapes with ``num_heads`` and ``embed_dim``: the
  global sizes map to each rank's heads;
* T5's feed-forward casts its input to ``self.wo.weight.dtype`` (a metadata read of a split
  weight, not a use of its values).

Checked on every rank: logits, every parameter's gradient (split ones gathered), and the
logits after 3 SGD steps.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import sharded_tensor as st  # noqa: E402
from sharded_tensor._model.parallel import ShardedLinear  # noqa: E402
from sharded_tensor._model.registry import handler_for  # noqa: E402
from sharding import composite, single_split  # noqa: E402
from tests.distributed._grads import assert_like_unsharded, compare_with_unsharded  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed
VOCAB = 96
ARCHS = ("bloom", "falcon", "opt", "t5")


def _build(arch: str):  # type: ignore[no-untyped-def]
    """The model and its (column-split, row-split) module names."""
    import transformers as tf
    if arch == "bloom":
        model = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4,
                                                   hidden_dropout=0.0, attention_dropout=0.0))
        layers = [f"transformer.h.{i}" for i in range(2)]
        cols = [f"{p}.{m}" for p in layers for m in ("self_attention.query_key_value", "mlp.dense_h_to_4h")]
        rows = [f"{p}.{m}" for p in layers for m in ("self_attention.dense", "mlp.dense_4h_to_h")]
    elif arch == "falcon":
        from transformers.models.falcon.modeling_falcon import FalconLinear
        if handler_for(FalconLinear(1, 1))[0] is None:  # FalconLinear computes as nn.Linear does
            st.register_sharded_module(FalconLinear, ShardedLinear())
        model = tf.FalconForCausalLM(tf.FalconConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
            new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False, hidden_dropout=0.0,
            attention_dropout=0.0))
        layers = [f"transformer.h.{i}" for i in range(2)]
        cols = [f"{p}.{m}" for p in layers for m in ("self_attention.query_key_value", "mlp.dense_h_to_4h")]
        rows = [f"{p}.{m}" for p in layers for m in ("self_attention.dense", "mlp.dense_4h_to_h")]
    elif arch == "opt":
        model = tf.OPTForCausalLM(tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                               num_attention_heads=4, word_embed_proj_dim=64, dropout=0.0,
                                               attention_dropout=0.0, max_position_embeddings=64))
        layers = [f"model.decoder.layers.{i}" for i in range(2)]
        cols = [f"{p}.{m}" for p in layers for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1")]
        rows = [f"{p}.{m}" for p in layers for m in ("self_attn.out_proj", "fc2")]
    else:
        model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                          num_decoder_layers=1, num_heads=4, dropout_rate=0.0,
                                                          decoder_start_token_id=0))
        cols, rows = [], []
        for stack, ff in (("encoder", 1), ("decoder", 2)):
            attn = f"{stack}.block.0.layer.0.SelfAttention"
            cols += [f"{attn}.q", f"{attn}.k", f"{attn}.v", f"{stack}.block.0.layer.{ff}.DenseReluDense.wi"]
            rows += [f"{attn}.o", f"{stack}.block.0.layer.{ff}.DenseReluDense.wo"]
    return model, cols, rows


def _run(rank: int, world: int) -> dict[str, dict[str, object]]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    out: dict[str, dict[str, object]] = {}
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    dec = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    for arch in ARCHS:
        torch.manual_seed(0)
        ref, cols, rows = _build(arch)
        model, _, _ = _build(arch)
        model.load_state_dict(ref.state_dict())
        spec = composite(**{n: single_split(0, ranks) for n in cols},
                         **{f"{n}.weight": single_split(1, ranks) for n in rows})
        st.shard_model(model, spec, src_rank=0)
        out[arch] = compare_with_unsharded(model, ref, rank, x, VOCAB, labels=dec if arch == "t5" else None)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, object]]]:
    return run_distributed(_run, 2, timeout=300)


@pytest.mark.parametrize("arch", ARCHS)
def test_model_equals_unsharded(runs, arch):
    for out in runs:
        assert_like_unsharded(out[arch])


@pytest.mark.parametrize("arch", ["falcon", "opt"])
def test_heads_stay_split(runs, arch):
    # no all-gather: the fixed-num_heads views keep each rank's heads
    for out in runs:
        assert "all_gather" not in out[arch]["comm"], out[arch]["comm"]
