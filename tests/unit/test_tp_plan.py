"""``st.tensor_parallel_spec`` without a process group: the specs it plans for meta models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import sharded_tensor as st  # noqa: E402
from sharding import CompositeShardingSpec, DevicePlacement, single_split, spec_from_dict  # noqa: E402
from tests.distributed._archs import gpt2_spec  # noqa: E402
from tests.distributed.test_hf_models import bert_spec, llama_spec  # noqa: E402

R2 = ["rank:0/cpu", "rank:1/cpu"]
COL, ROW = single_split(0, R2), single_split(1, R2)


def _meta(cls, config):  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        return cls(config)


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def _llama(**extra):  # type: ignore[no-untyped-def]
    return transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, **extra)


@pytest.mark.parametrize(("build", "hand"), [
    pytest.param(lambda: _meta(transformers.LlamaForCausalLM, _llama()), llama_spec(2, vocab=True), id="llama"),
    pytest.param(lambda: _meta(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)), llama_spec(2, vocab=True), id="qwen2"),
    pytest.param(lambda: _meta(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4)), gpt2_spec(2, 2), id="gpt2"),
    pytest.param(lambda: _meta(transformers.BertForMaskedLM, transformers.BertConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)),
        bert_spec(2), id="bert"),
])
def test_planned_layout_is_the_hand_written_one(build, hand):
    model = build()
    spec = st.tensor_parallel_spec(model, R2)
    names = _names(model)
    planned, written = spec.resolve(names), hand.resolve(names)
    # The hand-written BERT spec leaves the output biases out; the plan leaves them out too.
    assert planned == written
    # one key per projection, not per layer
    assert all("*" in key for key in spec.param_placement if "layer" in key or ".h." in key)
    assert spec_from_dict(spec.to_dict()) == spec


def test_plan_keys_come_from_the_config_and_follow_the_base_model_prefix():
    model = _meta(transformers.LlamaForCausalLM, _llama())
    spec = st.tensor_parallel_spec(model, [0, 1])  # ints mean rank:<r>/cpu
    assert spec.param_placement["model.layers.*.self_attn.q_proj"] == COL
    assert spec.param_placement["model.layers.*.mlp.down_proj"] == ROW
    base = _meta(transformers.LlamaModel, _llama())  # the base model itself: no prefix
    assert "layers.*.self_attn.o_proj" in st.tensor_parallel_spec(base, R2).param_placement


def test_qwen3_norms_are_replicated_and_biases_follow_their_weights():
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      attention_bias=True)
    model = _meta(transformers.Qwen3ForCausalLM, config)
    spec = st.tensor_parallel_spec(model, R2)
    assert spec.param_placement["model.layers.*.self_attn.q_norm"] == DevicePlacement("cpu")
    resolved = spec.resolve(_names(model))
    assert resolved["model.layers.1.self_attn.q_proj.bias"] == COL  # colwise: the bias is split too
    assert resolved["model.layers.1.self_attn.o_proj.weight"] == ROW
    assert "model.layers.1.self_attn.o_proj.bias" not in resolved  # rowwise: added once, whole


def test_mixture_of_experts_tensor_and_expert_layouts():
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = _meta(transformers.MixtralForCausalLM, config)
    tensor = st.tensor_parallel_spec(model, R2).param_placement
    # gate_up_proj (experts, 2 * intermediate, hidden) holds gate and up: each rank gets its slice of both.
    assert tensor["model.layers.*.mlp.experts.gate_up_proj"] == single_split(1, R2 * 2)
    assert tensor["model.layers.*.mlp.experts.down_proj"] == single_split(2, R2)
    expert = st.tensor_parallel_spec(model, R2, experts="expert").param_placement
    assert expert["model.layers.*.mlp.experts.gate_up_proj"] == single_split(0, R2)
    assert expert["model.layers.*.mlp.experts.down_proj"] == single_split(0, R2)
    assert expert["model.layers.*.self_attn.q_proj"] == COL
    with pytest.raises(ValueError, match=r"experts='expert' needs an expert-parallel plan.*LlamaConfig"):
        st.tensor_parallel_spec(_meta(transformers.LlamaForCausalLM, _llama()), R2, experts="expert")
    with pytest.raises(ValueError, match=r"experts='both' is not one of"):
        st.tensor_parallel_spec(model, R2, experts="both")  # type: ignore[arg-type]


@pytest.mark.parametrize(("cls", "config", "keys"), [
    pytest.param("OPTForCausalLM", dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, ffn_dim=32,
                                        vocab_size=40, word_embed_proj_dim=16),
                 {"model.decoder.layers.*.self_attn.k_proj": COL, "model.decoder.layers.*.fc2.weight": ROW},
                 id="opt"),
    pytest.param("FalconForCausalLM", dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=4,
                                           num_kv_heads=2, new_decoder_architecture=True, vocab_size=40),
                 {"transformer.h.*.self_attention.query_key_value": COL, "transformer.h.*.mlp.dense_4h_to_h": ROW},
                 id="falcon"),
    pytest.param("BloomForCausalLM", dict(n_layer=1, hidden_size=16, n_head=2, vocab_size=40),
                 {"transformer.h.*.self_attention.query_key_value": COL,
                  "transformer.h.*.self_attention.dense.weight": ROW}, id="bloom"),
    pytest.param("RobertaForMaskedLM", dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                            intermediate_size=32, vocab_size=40),
                 {"roberta.encoder.layer.*.attention.self.value": COL,
                  "roberta.encoder.layer.*.output.dense.weight": ROW}, id="roberta"),
    pytest.param("DistilBertForMaskedLM", dict(n_layers=1, dim=16, n_heads=2, hidden_dim=32, vocab_size=40),
                 {"distilbert.transformer.layer.*.ffn.lin1": COL,
                  "distilbert.transformer.layer.*.attention.out_lin.weight": ROW}, id="distilbert"),
    pytest.param("T5ForConditionalGeneration", dict(num_layers=1, d_model=16, num_heads=2, d_ff=32, d_kv=8,
                                                    vocab_size=40, feed_forward_proj="gated-gelu"),
                 {"encoder.block.*.layer.*.SelfAttention.q": COL, "decoder.block.*.layer.*.EncDecAttention.o": ROW,
                  "decoder.block.*.layer.*.DenseReluDense.wi_1": COL}, id="t5-gated"),
    pytest.param("ViTForImageClassification", dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                                   intermediate_size=32, image_size=8, patch_size=4),
                 {"vit.layers.*.attention.q_proj": COL, "vit.layers.*.mlp.fc2.weight": ROW}, id="vit"),
    pytest.param("GPTNeoXForCausalLM", dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                            intermediate_size=32, vocab_size=40),
                 {"gpt_neox.embed_in": COL, "gpt_neox.layers.*.attention.dense.weight": ROW}, id="gpt-neox-plan"),
])
def test_architectures_get_a_layout(cls, config, keys):
    model_cls = getattr(transformers, cls)
    model = _meta(model_cls, model_cls.config_class(**config))
    spec = st.tensor_parallel_spec(model, R2)
    for key, want in keys.items():
        assert spec.param_placement[key] == want
    resolved = spec.resolve(_names(model))  # every key matches the model
    assert resolved


def test_multi_query_falcon_is_refused_with_the_spec_to_write():
    model = _meta(transformers.FalconForCausalLM, transformers.FalconConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=40))
    with pytest.raises(ValueError, match=r"multi-query attention.*'transformer.h.\*.mlp.dense_h_to_4h': single_split"):
        st.tensor_parallel_spec(model, R2)


def test_unknown_models_are_refused_naming_what_to_write():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError) as info:
        st.tensor_parallel_spec(model, R2)
    msg = str(info.value)
    assert "does not know the layout of Sequential" in msg and "single_split(0, ranks)" in msg
    assert "Its linear layers: ['0', '2']" in msg


def test_unknown_styles_and_bad_ranks_are_refused():
    model = _meta(transformers.LlamaForCausalLM, _llama())
    model.config.base_model_tp_plan = {"layers.*.mlp.down_proj": "rowwise_by_magic"}
    with pytest.raises(ValueError, match=r"gives 'model.layers.\*.mlp.down_proj' the style 'rowwise_by_magic'"):
        st.tensor_parallel_spec(model, R2)
    model.config.base_model_tp_plan = {"layers.*.mlp.nothing": "colwise"}
    with pytest.raises(ValueError, match=r"names 'model.layers.\*.mlp.nothing', which matches no module"):
        st.tensor_parallel_spec(model, R2)
    # An entry for a variant of the architecture this model lacks is skipped, as from_pretrained does.
    model.config.base_model_tp_plan = {"layers.*.mlp.nothing": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    # (the embedding and lm_head on the vocabulary come with every plan, as in transformers' own)
    assert list(st.tensor_parallel_spec(model, R2).param_placement) == [
        "model.embed_tokens", "model.layers.*.mlp.down_proj", "lm_head"]
    with pytest.raises(ValueError, match=r"ranks must be a non-empty list"):
        st.tensor_parallel_spec(model, "rank:0/cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ranks entry 'cpu' has no rank"):
        st.tensor_parallel_spec(model, ["cpu"])
    with pytest.raises(TypeError, match=r"expects an nn.Module"):
        st.tensor_parallel_spec({"w": torch.ones(1)}, R2)  # type: ignore[arg-type]


def test_the_spec_is_an_ordinary_editable_composite():
    model = _meta(transformers.LlamaForCausalLM, _llama())
    spec = st.tensor_parallel_spec(model, R2)
    edited = CompositeShardingSpec({**spec.param_placement, "model.layers.1.mlp.up_proj": "cpu",
                                    "model.layers.1.mlp": "rank:0/cpu", "lm_head": COL})
    resolved = edited.resolve(_names(model))
    assert resolved["model.layers.1.mlp.up_proj.weight"] == DevicePlacement("cpu")  # literal beats '*'
    assert resolved["model.layers.0.mlp.up_proj.weight"] == COL
    assert resolved["model.layers.1.mlp.down_proj.weight"] == ROW  # the deeper key wins over 'model.layers.1.mlp'
    assert resolved["lm_head.weight"] == COL
