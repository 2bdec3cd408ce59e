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
    # (the embedding and lm_head on the vocabulary come with every plan, as in transformers' own; the attention
    # this plan leaves whole is split by heads, and said)
    spec = st.tensor_parallel_spec(model, R2)
    assert list(spec.param_placement) == [
        "model.embed_tokens", "model.layers.*.mlp.down_proj", "lm_head", "model.layers.*.self_attn.q_proj",
        "model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj", "model.layers.*.self_attn.o_proj.weight"]
    assert [line.split(":")[0] for line in spec.inferred] == ["model.layers.*.self_attn"]
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


# -- transformers' styles read as layouts, and blocks the plan leaves whole ------------------------------------

def _decoder(**extra):  # type: ignore[no-untyped-def]
    return dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


def test_fused_projections_whose_output_transformers_gathers_are_split_packed():
    # Phi-3: qkv_proj is [q | k | v] (4 query heads, 2 key/value heads of 16), gate_up_proj is [gate | up].
    model = _meta(transformers.Phi3ForCausalLM, transformers.Phi3Config(**_decoder()))
    spec = st.tensor_parallel_spec(model, R2)
    placement = spec.param_placement
    assert placement["model.layers.*.self_attn.qkv_proj"] == single_split(0, R2 * 3, [32, 32, 16, 16, 16, 16])
    assert placement["model.layers.*.mlp.gate_up_proj"] == single_split(0, R2 * 2)
    assert placement["model.layers.*.mlp.down_proj"] == ROW  # rowwise_split_input: the weight on its inputs
    assert [line.split(":")[0] for line in spec.inferred] == ["model.layers.*.self_attn.qkv_proj",
                                                               "model.layers.*.mlp.gate_up_proj"]
    assert spec.source == "transformers' plan" and spec.kept_whole == ()
    # GLM: only the MLP is fused.
    glm = st.tensor_parallel_spec(_meta(transformers.GlmForCausalLM, transformers.GlmConfig(**_decoder(head_dim=16))),
                                  R2)
    assert glm.param_placement["model.layers.*.mlp.gate_up_proj"] == single_split(0, R2 * 2)
    assert glm.param_placement["model.layers.*.self_attn.q_proj"] == COL
    # OLMo2's colwise_gather_output q/k/v are plain projections: a plain output split.
    olmo2 = st.tensor_parallel_spec(_meta(transformers.Olmo2ForCausalLM, transformers.Olmo2Config(**_decoder())), R2)
    assert olmo2.param_placement["model.layers.*.self_attn.q_proj"] == COL and olmo2.inferred == ()


def test_older_transformers_style_names_are_read():
    model = _meta(transformers.LlamaForCausalLM, _llama())
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "local_colwise", "layers.*.self_attn.k_proj":
                                       "local_colwise", "layers.*.self_attn.v_proj": "local_colwise",
                                       "layers.*.self_attn.o_proj": "local_rowwise", "layers.*.mlp": "gather",
                                       "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                                       "layers.*.mlp.down_proj": "rowwise"}
    placement = st.tensor_parallel_spec(model, R2).param_placement
    assert placement["model.layers.*.self_attn.k_proj"] == COL and placement["model.layers.*.self_attn.o_proj"] == ROW
    assert "model.layers.*.mlp" not in placement  # a forward-only style: nothing of its own


@pytest.mark.parametrize(("cls", "config", "inferred", "keys"), [
    pytest.param("GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2),
                 ["model.layers.*.self_attn"],
                 {"model.layers.*.self_attn.q_proj": COL, "model.layers.*.self_attn.o_proj.weight": ROW,
                  "model.layers.*.block_sparse_moe.experts.down_proj": single_split(2, R2)}, id="granitemoe"),
    pytest.param("HunYuanDenseV1ForCausalLM", dict(head_dim=16), ["model.layers.*.self_attn", "model.layers.*.mlp"],
                 {"model.layers.*.self_attn.v_proj": COL, "model.layers.*.mlp.gate_proj": COL,
                  "model.layers.*.mlp.down_proj.weight": ROW}, id="hunyuan-dense"),
    pytest.param("GraniteMoeSharedForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                     shared_intermediate_size=32),
                 ["model.layers.*.self_attn", "model.layers.*.shared_mlp"],
                 {"model.layers.*.shared_mlp.input_linear": single_split(0, R2 * 2),
                  "model.layers.*.shared_mlp.output_linear.weight": ROW}, id="granitemoe-shared-mlp-packed"),
    pytest.param("GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
                 ["model.layers.*.self_attn", "model.layers.*.mlp.experts"],
                 {"model.layers.*.mlp.experts.gate_up_proj": single_split(2, R2),
                  "model.layers.*.mlp.experts.gate_up_proj_bias": single_split(1, R2),
                  "model.layers.*.mlp.experts.down_proj": single_split(1, R2)}, id="gpt-oss"),
])
def test_blocks_the_plan_leaves_whole_are_split_and_listed(cls, config, inferred, keys):
    model_cls = getattr(transformers, cls)
    model = _meta(model_cls, model_cls.config_class(**_decoder(**config)))
    spec = st.tensor_parallel_spec(model, R2)
    for key, want in keys.items():
        assert spec.param_placement[key] == want, key
    assert [line.split(":")[0] for line in spec.inferred] == inferred
    assert all("leaves whole" in line for line in spec.inferred)
    assert "inferred=" in repr(spec) and spec.resolve(_names(model))
    # GPT-OSS's expert bias is added once, after the sum over ranks: whole
    assert "model.layers.*.mlp.experts.down_proj_bias" not in spec.param_placement


def test_gpt_oss_expert_parallel_splits_the_biases_with_their_experts():
    config = transformers.GptOssConfig(**_decoder(num_local_experts=4, num_experts_per_tok=2, head_dim=16))
    spec = st.tensor_parallel_spec(_meta(transformers.GptOssForCausalLM, config), R2, experts="expert")
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert spec.param_placement[f"model.layers.*.mlp.experts.{name}"] == COL


def test_attention_that_cannot_be_split_by_heads_is_kept_whole_and_says_why():
    diff = st.tensor_parallel_spec(_meta(transformers.DiffLlamaForCausalLM,
                                         transformers.DiffLlamaConfig(**_decoder(head_dim=16))), R2)
    assert not any(".self_attn." in k for k in diff.param_placement)
    assert diff.kept_whole == ("model.layers.*.self_attn: attention, whole because differential attention pairs "
                               "each head with the head half the heads away, which a split by heads would put on "
                               "another rank",)
    assert "kept_whole=" in repr(diff)
    # Four query heads over 8 ranks: not split, and said.
    eight = [f"rank:{r}/cpu" for r in range(8)]
    hunyuan = st.tensor_parallel_spec(_meta(transformers.HunYuanDenseV1ForCausalLM,
                                            transformers.HunYuanDenseV1Config(**_decoder(head_dim=16))), eight)
    assert any("4 query heads and 2 key/value heads do not divide evenly over 8 ranks" in k for k in hunyuan.kept_whole)
    deepseek = st.tensor_parallel_spec(_meta(transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1, moe_intermediate_size=32)),
        R2)
    assert [k.split(":")[0] for k in deepseek.kept_whole] == ["model.layers.*.self_attn"]
    assert "multi-head latent attention" in deepseek.kept_whole[0]


@pytest.mark.parametrize(("cls", "config", "attention", "mlp"), [
    pytest.param("GPTBigCodeForCausalLM", {}, ("transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj"),
                 {"transformer.h.*.mlp.c_fc": COL}, id="gpt-bigcode-multi-query"),
    pytest.param("FalconForCausalLM", {}, ("transformer.h.*.self_attention.query_key_value",
                                           "transformer.h.*.self_attention.dense"),
                 {"transformer.h.*.mlp.dense_h_to_4h": COL}, id="falcon-multi-query"),
])
def test_multi_query_attention_is_kept_whole_and_the_mlp_split(cls, config, attention, mlp):
    model_cls = getattr(transformers, cls)
    sizes = {"GPTBigCodeForCausalLM": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=96),
             "FalconForCausalLM": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=96)}
    model = _meta(model_cls, model_cls.config_class(**sizes[cls], **config))
    spec = st.tensor_parallel_spec(model, R2)
    for key, want in mlp.items():
        assert spec.param_placement[key] == want
    assert not any(k.startswith(attention) for k in spec.param_placement)
    assert len(spec.kept_whole) == 1 and "multi-query attention (4 query heads share one key/value head" \
        in spec.kept_whole[0] and spec.kept_whole[0].startswith(attention[0].rsplit(".", 1)[0] + ": ")


def test_gpt_bigcode_without_multi_query_splits_c_attn_by_heads():
    model = _meta(transformers.GPTBigCodeForCausalLM, transformers.GPTBigCodeConfig(
        n_embd=64, n_layer=2, n_head=4, vocab_size=96, multi_query=False))
    spec = st.tensor_parallel_spec(model, R2)
    assert spec.param_placement["transformer.h.*.attn.c_attn"] == COL  # each head's q, k, v side by side
    assert spec.source == "block structure (GPT-2)"


def test_llama4_plan_is_found_under_the_heads_own_name():
    config = transformers.Llama4TextConfig(**_decoder(head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                                                      intermediate_size_mlp=96, interleave_moe_layer_step=1))
    model = _meta(transformers.Llama4ForCausalLM, config)  # base_model_prefix 'language_model', but self.model
    placement = st.tensor_parallel_spec(model, R2).param_placement
    assert placement["model.layers.*.self_attn.q_proj"] == COL
    assert placement["model.layers.*.feed_forward.experts.gate_up_proj"] == single_split(2, R2 * 2)  # packed_rowwise
    assert placement["model.layers.*.feed_forward.experts.down_proj"] == single_split(1, R2)  # colwise on 3-D
    assert placement["lm_head"] == COL and placement["model.embed_tokens"] == COL


@pytest.mark.parametrize(("cls", "config", "keys"), [
    pytest.param("PersimmonForCausalLM", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                              intermediate_size=96, vocab_size=96),
                 {"model.layers.*.self_attn.query_key_value": COL, "model.layers.*.mlp.dense_4h_to_h.weight": ROW},
                 id="persimmon"),
    pytest.param("StableLmForCausalLM", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                             intermediate_size=96, vocab_size=96),
                 {"model.layers.*.self_attn.k_proj": COL, "model.layers.*.mlp.down_proj": ROW}, id="stablelm"),
    pytest.param("CLIPTextModel", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       intermediate_size=96, vocab_size=96),
                 {"encoder.layers.*.self_attn.q_proj": COL, "encoder.layers.*.mlp.fc2.weight": ROW}, id="clip-text"),
    pytest.param("DebertaV2ForMaskedLM", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                              intermediate_size=96, vocab_size=96),
                 {"deberta.encoder.layer.*.attention.self.value_proj": COL,
                  "deberta.encoder.layer.*.output.dense.weight": ROW}, id="deberta-v2"),
    pytest.param("MptForCausalLM", dict(d_model=64, n_layers=1, n_heads=4, vocab_size=96),
                 {"transformer.blocks.*.attn.Wqkv": single_split(0, R2 * 3),
                  "transformer.blocks.*.ffn.down_proj": ROW}, id="mpt"),
])
def test_more_block_structures(cls, config, keys):
    model_cls = getattr(transformers, cls)
    model = _meta(model_cls, model_cls.config_class(**config))
    spec = st.tensor_parallel_spec(model, R2)
    for key, want in keys.items():
        assert spec.param_placement[key] == want, key
    assert spec.resolve(_names(model))


def test_state_space_models_are_refused_with_what_to_do():
    model = _meta(transformers.MambaForCausalLM, transformers.MambaConfig(hidden_size=32, num_hidden_layers=1,
                                                                        vocab_size=40, state_size=4))
    with pytest.raises(ValueError, match=r"no layout for MambaForCausalLM: its layers mix tokens with a depthwise "
                                         r"convolution and a state-space scan.*st.fully_shard\(model\)"):
        st.tensor_parallel_spec(model, R2)


def test_the_planned_spec_is_a_composite_value():
    import pickle
    model = _meta(transformers.Phi3ForCausalLM, transformers.Phi3Config(**_decoder()))
    spec = st.tensor_parallel_spec(model, R2)
    plain = CompositeShardingSpec(dict(spec.param_placement))
    assert spec == plain and plain == spec and hash(spec) == hash(plain)
    assert spec_from_dict(spec.to_dict()) == spec
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and again.inferred == spec.inferred and again.source == spec.source
    text = repr(spec)
    assert text.startswith("TensorParallelSpec(param_placement={") and "source=\"transformers' plan\"" in text
