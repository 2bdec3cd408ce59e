"""The architectures of the tensor-parallel matrix: tiny transformers models, their layouts and inputs.

Shared by the matrix (``test_arch_matrix``), which checks each one sharded against itself
unsharded, the compiled runs (``test_compile``) and, for GPT-2's layout (``gpt2_spec``), the
extension and tensor-parallel plan tests. Each ``Arch`` builds its model from a
tiny config and a fixed seed (no downloads) and gives the hand-written layout of
docs/huggingface.md over a list of ranks.

The configs keep transformers' defaults, as users build them (``use_cache`` included: a
forward in training builds and returns a key/value cache), except for their sizes and
dropout, which is off so that the sharded and the unsharded model compute the same numbers.
The batches carry ``labels``, so the models compute their own loss, as in training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import sharded_tensor as st
from sharding import CompositeShardingSpec, composite, single_split

__all__ = ["ARCHS", "BY_NAME", "LAYERS", "MOE_MODELS", "Arch", "BATCH", "SEQ", "VOCAB", "gpt2_spec", "inputs",
           "loss", "max_diff", "objective", "spec_of"]

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 96, 64, 96, 4, 2, 16, 2
BATCH, SEQ = 2, 8
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DECODER = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "max_position_embeddings": 64, "attention_dropout": 0.0, **TOKEN_IDS}

Spec = dict[str, Any]


@dataclass(frozen=True)
class Arch:
    """One row of the matrix: how to build the model, how to split it, what to feed it."""

    name: str
    features: str
    group: str
    build: Callable[[], torch.nn.Module]
    spec: Callable[[list[str]], Spec]
    all_reduces: int  # forward all-reduces: one per row-parallel projection or statistic over split features
    inputs: str = "padded"  # "padded" (tokens and an attention mask), "seq2seq" or "pixels"
    register: Callable[[], None] | None = None  # a module registration the model needs, as a user writes it
    # Backward all-reduces of a decoder beyond its forward ones: a whole parameter each rank applies to its own
    # heads only (Qwen3's and Gemma3's per-head q_norm and k_norm) has its gradient summed over the ranks.
    extra_backward_all_reduces: int = 0

    @property
    def generates(self) -> bool:
        """A decoder-only language model: ``generate`` continues a prompt token by token."""
        return self.group == "decoders" or self.name in _CAUSAL_OTHERS

    @property
    def returns_cache(self) -> bool:
        """Its forward returns transformers' key/value cache (``use_cache=True``, the config's default)."""
        return self.generates or self.inputs == "seq2seq"


_CAUSAL_OTHERS = {"gpt_neox", "gptj", "gpt2", "opt", "falcon", "bloom"}


# --- layouts -----------------------------------------------------------------------------------


def _layers(prefix: str) -> list[str]:
    return [f"{prefix}.{i}" for i in range(LAYERS)]


def _tp(ranks: list[str], prefix: str, col: tuple[str, ...], row: tuple[str, ...]) -> Spec:
    """Column-parallel ``col`` and row-parallel ``row`` modules in every layer under ``prefix``."""
    c, r = single_split(0, ranks), single_split(1, ranks)
    parts: Spec = {}
    for layer in _layers(prefix):
        parts.update({f"{layer}.{name}": c for name in col})
        parts.update({f"{layer}.{name}.weight": r for name in row})  # the bias stays whole: added once
    return parts


def _llama_like(ranks: list[str]) -> Spec:
    return _tp(ranks, "model.layers", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                               "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj"))


def _attention_only(ranks: list[str]) -> Spec:
    return _tp(ranks, "model.layers", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               ("self_attn.o_proj",))


def _phi3_spec(ranks: list[str]) -> Spec:
    # qkv_proj holds q (HEADS heads) then k and v (KV_HEADS heads each): each rank takes its
    # heads of all three, a packed split; gate_up_proj likewise holds gate then up.
    half_q, half_kv = HEADS * HEAD_DIM // 2, KV_HEADS * HEAD_DIM // 2
    qkv = single_split(0, ranks * 3, [half_q, half_q, half_kv, half_kv, half_kv, half_kv])
    parts: Spec = {}
    for layer in _layers("model.layers"):
        parts[f"{layer}.self_attn.qkv_proj"] = qkv
        parts[f"{layer}.mlp.gate_up_proj"] = single_split(0, ranks * 2)
        parts[f"{layer}.self_attn.o_proj"] = parts[f"{layer}.mlp.down_proj"] = single_split(1, ranks)
    return parts


def _gpt2(ranks: list[str], layers: int = LAYERS) -> Spec:
    parts: Spec = {}
    for block in (f"transformer.h.{i}" for i in range(layers)):
        parts[f"{block}.attn.c_attn.weight"] = single_split(1, ranks * 3)  # each rank's heads of q, k, v
        parts[f"{block}.attn.c_attn.bias"] = single_split(0, ranks * 3)
        parts[f"{block}.attn.c_proj.weight"] = single_split(0, ranks)
        parts[f"{block}.mlp.c_fc.weight"] = single_split(1, ranks)
        parts[f"{block}.mlp.c_fc.bias"] = single_split(0, ranks)
        parts[f"{block}.mlp.c_proj.weight"] = single_split(0, ranks)
    return parts


def gpt2_spec(world: int, layers: int = LAYERS) -> CompositeShardingSpec:
    """GPT-2's layout over ranks ``0..world-1`` (``layers`` blocks), for a ``Conv1D`` registration as
    test_extension writes it: ``c_attn`` each rank's heads of q, k and v, ``c_fc`` split on its
    outputs, both ``c_proj`` on their inputs."""
    return composite(**_gpt2([f"rank:{r}/cpu" for r in range(world)], layers))


def _bert(ranks: list[str], prefix: str = "bert") -> Spec:
    return _tp(ranks, f"{prefix}.encoder.layer", ("attention.self.query", "attention.self.key",
                                                  "attention.self.value", "intermediate.dense"),
               ("attention.output.dense", "output.dense"))


def _t5(ranks: list[str]) -> Spec:
    c, r = single_split(0, ranks), single_split(1, ranks)
    parts: Spec = {}
    for stack, attentions, ffn in (("encoder", ("layer.0.SelfAttention",), "layer.1"),
                                   ("decoder", ("layer.0.SelfAttention", "layer.1.EncDecAttention"), "layer.2")):
        for block in _layers(f"{stack}.block"):
            for attn in attentions:
                parts.update({f"{block}.{attn}.{n}": c for n in ("q", "k", "v")})
                parts[f"{block}.{attn}.o"] = r
            parts[f"{block}.{ffn}.DenseReluDense.wi"] = c
            parts[f"{block}.{ffn}.DenseReluDense.wo"] = r
    return parts


# --- models ------------------------------------------------------------------------------------


def _seeded(cls: type, config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(config)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return _seeded(LlamaForCausalLM, LlamaConfig(**DECODER))


def _llama_eager() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return _seeded(LlamaForCausalLM, LlamaConfig(**DECODER, attn_implementation="eager"))


def _mistral() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM
    return _seeded(MistralForCausalLM, MistralConfig(**DECODER, sliding_window=4))


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _seeded(Qwen2ForCausalLM, Qwen2Config(**DECODER))


def _qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _seeded(Qwen3ForCausalLM, Qwen3Config(**DECODER))


def _gemma2() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return _seeded(Gemma2ForCausalLM, Gemma2Config(**DECODER, sliding_window=4))


def _gemma3() -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return _seeded(Gemma3ForCausalLM, Gemma3TextConfig(**DECODER, sliding_window=4,
                                                       layer_types=["sliding_attention", "full_attention"]))


def _cohere() -> torch.nn.Module:
    from transformers import CohereConfig, CohereForCausalLM
    return _seeded(CohereForCausalLM, CohereConfig(**DECODER))


def _olmo2() -> torch.nn.Module:
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return _seeded(Olmo2ForCausalLM, Olmo2Config(**DECODER))


def _stablelm() -> torch.nn.Module:
    from transformers import StableLmConfig, StableLmForCausalLM
    return _seeded(StableLmForCausalLM, StableLmConfig(**DECODER, partial_rotary_factor=0.5))


def _granite() -> torch.nn.Module:
    from transformers import GraniteConfig, GraniteForCausalLM
    return _seeded(GraniteForCausalLM, GraniteConfig(**DECODER, embedding_multiplier=2.0, attention_multiplier=0.2,
                                                     residual_multiplier=0.5, logits_scaling=4.0))


def _mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM
    return _seeded(MixtralForCausalLM, MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2))


def _gpt_oss() -> torch.nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM
    return _seeded(GptOssForCausalLM, GptOssConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2))


def _llama4() -> torch.nn.Module:
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    return _seeded(Llama4ForCausalLM, Llama4TextConfig(**DECODER, intermediate_size_mlp=FFN, num_local_experts=4,
                                                       num_experts_per_tok=1, interleave_moe_layer_step=1))


def _phi3() -> torch.nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM
    return _seeded(Phi3ForCausalLM, Phi3Config(**{k: v for k, v in DECODER.items() if k != "head_dim"}))


def _gpt_neox() -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return _seeded(GPTNeoXForCausalLM, GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, rotary_pct=0.5, use_parallel_residual=True, hidden_dropout=0.0,
        attention_dropout=0.0, **TOKEN_IDS))


def _gptj() -> torch.nn.Module:
    from transformers import GPTJConfig, GPTJForCausalLM
    return _seeded(GPTJForCausalLM, GPTJConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_inner=FFN, n_layer=LAYERS,
                                               n_head=HEADS, rotary_dim=8, n_positions=64, resid_pdrop=0.0,
                                               embd_pdrop=0.0, attn_pdrop=0.0, **TOKEN_IDS))


def _gpt2_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    return _seeded(GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_inner=FFN, n_layer=LAYERS,
                                               n_head=HEADS, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                               attn_pdrop=0.0, **TOKEN_IDS))


def _opt() -> torch.nn.Module:
    from transformers import OPTConfig, OPTForCausalLM
    return _seeded(OPTForCausalLM, OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=FFN,
                                             num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                             word_embed_proj_dim=HIDDEN, max_position_embeddings=64, dropout=0.0,
                                             attention_dropout=0.0, **TOKEN_IDS))


def _falcon() -> torch.nn.Module:
    from transformers import FalconConfig, FalconForCausalLM
    return _seeded(FalconForCausalLM, FalconConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_kv_heads=KV_HEADS, new_decoder_architecture=True, parallel_attn=True,
        bias=False, hidden_dropout=0.0, attention_dropout=0.0, **TOKEN_IDS))


def _bloom() -> torch.nn.Module:
    from transformers import BloomConfig, BloomForCausalLM
    return _seeded(BloomForCausalLM, BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS,
                                                 n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                                 **TOKEN_IDS))


_ENCODER = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0, **TOKEN_IDS}


def _bert_model() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    return _seeded(BertForMaskedLM, BertConfig(**_ENCODER))


def _roberta() -> torch.nn.Module:
    from transformers import RobertaConfig, RobertaForMaskedLM
    return _seeded(RobertaForMaskedLM, RobertaConfig(**_ENCODER))


def _distilbert() -> torch.nn.Module:
    from transformers import DistilBertConfig, DistilBertForMaskedLM
    return _seeded(DistilBertForMaskedLM, DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, hidden_dim=FFN,
                                                           n_layers=LAYERS, n_heads=HEADS, dropout=0.0,
                                                           attention_dropout=0.0, pad_token_id=0))


def _t5_model() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration
    return _seeded(T5ForConditionalGeneration, T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HEAD_DIM, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=2))


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    return _seeded(ViTForImageClassification, ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=HIDDEN, intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


# --- registrations, as docs/extending.md writes them --------------------------------------------


def _register_conv1d() -> None:
    from transformers.pytorch_utils import Conv1D

    from tests.distributed.test_extension import ShardedConv1D
    st.register_sharded_module(Conv1D, ShardedConv1D(), replace=True)


L2 = 2 * LAYERS  # a layer with attention and an MLP: two row-parallel projections
# Attention and MLP in parallel: their two row-parallel sums stay pending (Partial), are added to
# each other and to the residual (added once), and cost one all-reduce per layer together.
PARALLEL = LAYERS
ARCHS = [
    Arch("llama", "GQA, RoPE, SwiGLU", "decoders", _llama, _llama_like, L2),
    Arch("llama_eager", "GQA, attention as matmul + softmax (eager)", "decoders", _llama_eager, _llama_like, L2),
    Arch("mistral", "GQA, sliding window", "decoders", _mistral, _llama_like, L2),
    Arch("qwen2", "GQA, q/k/v bias", "decoders", _qwen2, _llama_like, L2),
    Arch("qwen3", "GQA, qk-norm per head", "decoders", _qwen3, _llama_like, L2, extra_backward_all_reduces=2 * LAYERS),
    Arch("gemma2", "GQA, sliding window, logit soft-capping", "decoders", _gemma2, _llama_like, L2),
    Arch("gemma3", "GQA, qk-norm per head, sliding window", "decoders", _gemma3, _llama_like, L2,
         extra_backward_all_reduces=2 * LAYERS),
    Arch("cohere", "GQA, parallel attention+MLP, LayerNorm", "decoders", _cohere, _llama_like, PARALLEL),
    # The norm across all heads needs one statistic (a sum of squares) summed over the ranks: 2 more
    # all-reduces per layer, for q and for k.
    Arch("olmo2", "GQA, qk-norm across heads", "decoders", _olmo2, _llama_like, 2 * L2),
    Arch("stablelm", "GQA, partial rotary, LayerNorm, view to a fixed num_heads", "decoders", _stablelm,
         _llama_like, L2),
    Arch("granite", "GQA, scaled residuals and logits", "decoders", _granite, _llama_like, L2),
    Arch("mixtral", "GQA, MoE (attention split, experts whole)", "decoders", _mixtral, _attention_only, LAYERS),
    Arch("phi3", "fused qkv and gate/up (packed), GQA", "decoders", _phi3, _phi3_spec, L2),
    Arch("gpt_neox", "fused qkv per head, parallel attention+MLP, partial rotary", "others", _gpt_neox,
         lambda r: _tp(r, "gpt_neox.layers", ("attention.query_key_value", "mlp.dense_h_to_4h"),
                       ("attention.dense", "mlp.dense_4h_to_h")), PARALLEL),
    Arch("gptj", "parallel attention+MLP, interleaved rotary", "others", _gptj,
         lambda r: _tp(r, "transformer.h", ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"),
                       ("attn.out_proj", "mlp.fc_out")), PARALLEL),
    Arch("gpt2", "Conv1D fused qkv (packed), learned positions", "others", _gpt2_model, _gpt2, L2,
         register=_register_conv1d),
    Arch("opt", "learned positions, biases, view to a fixed num_heads", "others", _opt,
         lambda r: _tp(r, "model.decoder.layers", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "fc1"), ("self_attn.out_proj", "fc2")), L2),
    Arch("falcon", "fused qkv grouped by kv head, GQA, parallel attention+MLP", "others", _falcon,
         lambda r: _tp(r, "transformer.h", ("self_attention.query_key_value", "mlp.dense_h_to_4h"),
                       ("self_attention.dense", "mlp.dense_4h_to_h")), PARALLEL),
    Arch("bloom", "ALiBi, fused qkv per head, batch and heads merged", "others", _bloom,
         lambda r: _tp(r, "transformer.h", ("self_attention.query_key_value", "mlp.dense_h_to_4h"),
                       ("self_attention.dense", "mlp.dense_4h_to_h")), L2),
    Arch("bert", "encoder, padding mask", "others", _bert_model, _bert, L2),
    Arch("roberta", "encoder, padding mask", "others", _roberta, lambda r: _bert(r, "roberta"), L2),
    Arch("distilbert", "encoder, padding mask", "others", _distilbert,
         lambda r: _tp(r, "distilbert.transformer.layer", ("attention.q_lin", "attention.k_lin", "attention.v_lin",
                                                           "ffn.lin1"), ("attention.out_lin", "ffn.lin2")), L2),
    Arch("t5", "encoder-decoder, cross-attention, relative position bias (whole)", "others", _t5_model, _t5,
         2 * LAYERS + 3 * LAYERS, inputs="seq2seq"),
    Arch("vit", "vision encoder, patch embedding", "others", _vit,
         lambda r: _tp(r, "vit.layers", ("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"),
                       ("attention.o_proj", "mlp.fc2")), L2, inputs="pixels"),
]
BY_NAME = {arch.name: arch for arch in ARCHS}
# Mixture-of-experts models whose experts ``st.tensor_parallel_spec`` splits either way (``experts=``): Mixtral's
# fused experts, GPT-OSS's (interleaved gate and up, biases) and Llama 4's (every expert on its own block of rows).
MOE_MODELS: dict[str, Callable[[], torch.nn.Module]] = {"mixtral": _mixtral, "gpt_oss": _gpt_oss, "llama4": _llama4}


# --- one batch, one loss -----------------------------------------------------------------------


def inputs(kind: str, step: int) -> dict[str, torch.Tensor]:
    """The batch of ``step`` for an architecture fed ``kind`` (see ``Arch.inputs``), with its ``labels``.

    Language models get their tokens as labels (padding ignored: -100), a sequence-to-sequence
    model its decoder tokens, an image classifier one class per image.
    """
    gen = torch.Generator().manual_seed(100 + step)
    if kind == "pixels":
        return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=gen),
                "labels": torch.randint(0, 5, (BATCH,), generator=gen)}
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones_like(tokens)
    mask[1, SEQ - 3:] = 0  # the second sequence is shorter: padding on the right
    if kind == "padded":
        return {"input_ids": tokens, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, -100)}
    decoder = torch.randint(3, VOCAB, (BATCH, SEQ - 2), generator=gen)
    return {"input_ids": tokens, "attention_mask": mask, "decoder_input_ids": decoder, "labels": decoder}


def loss(logits: torch.Tensor) -> torch.Tensor:
    """A fixed random weighting of every logit: each one's gradient is nonzero and known."""
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    return (logits * weights).mean()


def objective(out: Any) -> torch.Tensor:
    """What a training step differentiates: the model's own loss (from ``labels``) plus ``loss`` of its logits."""
    return out.loss + loss(out.logits)


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, relative to the largest magnitude of ``want`` (plus one)."""
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / (1 + want.abs().max()))


def spec_of(arch: Arch, world: int) -> Any:
    """``arch``'s layout over ranks ``0..world-1``, as a composite spec."""
    return composite(**arch.spec([f"rank:{r}/cpu" for r in range(world)]))
