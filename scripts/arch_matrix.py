"""The extended architecture matrix: transformers models planned in one call, on 2 Gloo ranks, against themselves.

Each architecture is built from a tiny config with transformers' defaults otherwise (no
downloads, ``use_cache`` as the config has it), twice from one seed. One copy stays whole;
the other is planned by ``st.tensor_parallel_spec(model, ranks)`` (for a mixture of experts,
once with ``experts="tensor"`` and once with ``experts="expert"``) and sharded from rank 0's
weights with ``st.shard_model``. On every rank, as users call models:

* the forward with ``labels=`` (and an attention mask with padding): the logits and the loss
  against the unsharded model's, with the collectives of that forward counted
  (``st.CommCounter``: all-reduces, all-gathers, and the all-to-all messages of expert parallel);
* the backward of that loss: every parameter's gradient, split ones gathered whole,
  replicated ones (norms, routers) included;
* 3 SGD steps: every parameter after them;
* for decoders, greedy ``generate`` of a few tokens with the config's cache: the tokens, and the
  collectives of each decode step.

A model passes (``exact``) when every difference is float rounding (relative to the largest
value, below ``TOL``). A plan may also be refused (``refused``: ``tensor_parallel_spec`` or
``shard_model`` raises ``ValueError``, whose message says what to write by hand). Anything
else is a failure: ``error`` (an exception during the run: its type and message) or ``WRONG``
(numbers that differ). The exit status is 1 if any architecture is ``WRONG``.

    python scripts/arch_matrix.py                    # every architecture, JSON lines on stdout
    python scripts/arch_matrix.py --only llama,phi3  # some of them
    python scripts/arch_matrix.py --list             # the architectures and their configs' classes
    python scripts/arch_matrix.py --table docs/huggingface.md   # and write the table into that page
    python scripts/arch_matrix.py --from rows.jsonl --table docs/huggingface.md   # the table of a saved run

``--table`` writes the Markdown table between the page's ``<!-- arch_matrix:start -->`` and
``<!-- arch_matrix:end -->`` lines (or, for a file without them, the table alone), with the
command that produced it.

Each group of architectures runs in one spawn of 2 ranks (``--per-spawn``); a spawn that dies
(a crash, a timeout) is run again one architecture per spawn, so one bad model costs only its
own row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

TOL = 1e-5  # relative to the largest magnitude (plus one); float rounding is ~1e-7 here
STEPS, LR, NEW_TOKENS = 3, 0.1, 4
VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 96, 64, 96, 4, 2, 16, 2
BATCH, SEQ = 2, 8
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DECODER = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "max_position_embeddings": 64, **TOKEN_IDS}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
ENCODER = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "max_position_embeddings": 64, **TOKEN_IDS}


@dataclass(frozen=True)
class Arch:
    """One architecture: its config class, model class, tiny config and what it is fed.

    ``inputs``: ``"causal"`` (ids, a padded mask, ``labels=``; greedy generation too),
    ``"masked"`` (an encoder with a masked-language-model head, ``labels=``), ``"seq2seq"``,
    ``"pixels"`` (image classification, ``labels=``), ``"hidden"`` (a model without a loss of
    its own: a fixed weighting of its last hidden state is differentiated).
    """

    name: str
    config: str
    model: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    inputs: str = "causal"
    moe: bool = False
    note: str = ""


def _decoder(**extra: Any) -> dict[str, Any]:
    return {**DECODER, **extra}


def _drop(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in keys}


ARCHS: list[Arch] = [
    # -- decoders with a transformers plan -------------------------------------------------------
    Arch("llama", "LlamaConfig", "LlamaForCausalLM", _decoder()),
    Arch("mistral", "MistralConfig", "MistralForCausalLM", _decoder(sliding_window=4)),
    Arch("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _decoder()),
    Arch("qwen3", "Qwen3Config", "Qwen3ForCausalLM", _decoder()),
    Arch("gemma", "GemmaConfig", "GemmaForCausalLM", _decoder()),
    Arch("gemma2", "Gemma2Config", "Gemma2ForCausalLM", _decoder(sliding_window=4)),
    Arch("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
         _decoder(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    Arch("cohere", "CohereConfig", "CohereForCausalLM", _decoder()),
    Arch("cohere2", "Cohere2Config", "Cohere2ForCausalLM",
         _decoder(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    Arch("granite", "GraniteConfig", "GraniteForCausalLM", _decoder(embedding_multiplier=2.0,
                                                                    residual_multiplier=0.5, logits_scaling=4.0)),
    Arch("olmo", "OlmoConfig", "OlmoForCausalLM", _decoder()),
    Arch("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _decoder()),
    Arch("olmo3", "Olmo3Config", "Olmo3ForCausalLM",
         _decoder(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    Arch("phi", "PhiConfig", "PhiForCausalLM", _drop(_decoder(), "head_dim")),
    Arch("phi3", "Phi3Config", "Phi3ForCausalLM", _drop(_decoder(), "head_dim")),
    Arch("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", _drop(_decoder(), "head_dim")),
    Arch("glm", "GlmConfig", "GlmForCausalLM", _decoder()),
    Arch("glm4", "Glm4Config", "Glm4ForCausalLM", _decoder()),
    Arch("apertus", "ApertusConfig", "ApertusForCausalLM", _decoder()),
    Arch("helium", "HeliumConfig", "HeliumForCausalLM", _decoder()),
    Arch("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", _decoder()),
    Arch("exaone4", "Exaone4Config", "Exaone4ForCausalLM",
         _decoder(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    Arch("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", _decoder()),
    Arch("arcee", "ArceeConfig", "ArceeForCausalLM", _decoder()),
    Arch("seed_oss", "SeedOssConfig", "SeedOssForCausalLM", _decoder()),
    Arch("nemotron", "NemotronConfig", "NemotronForCausalLM", _decoder()),
    Arch("hunyuan_dense", "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", _decoder()),
    Arch("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
         {**_drop(_decoder(), "head_dim", "num_key_value_heads"), "rotary_pct": 0.5}),
    Arch("gptj", "GPTJConfig", "GPTJForCausalLM", {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_inner": FFN,
                                                   "n_layer": LAYERS, "n_head": HEADS, "rotary_dim": 8,
                                                   "n_positions": 64, **TOKEN_IDS}),
    Arch("codegen", "CodeGenConfig", "CodeGenForCausalLM", {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_inner": FFN,
                                                            "n_layer": LAYERS, "n_head": HEADS, "rotary_dim": 8,
                                                            "n_positions": 64, "n_ctx": 64, **TOKEN_IDS}),
    Arch("diffllama", "DiffLlamaConfig", "DiffLlamaForCausalLM", _decoder()),
    # -- decoders without a plan: block structure ------------------------------------------------
    Arch("persimmon", "PersimmonConfig", "PersimmonForCausalLM",
         _drop(_decoder(), "head_dim", "num_key_value_heads")),
    Arch("stablelm", "StableLmConfig", "StableLmForCausalLM", _drop(_decoder(partial_rotary_factor=0.5), "head_dim")),
    Arch("gpt_bigcode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
         {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_inner": FFN, "n_layer": LAYERS, "n_head": HEADS,
          "n_positions": 64, **TOKEN_IDS}, note="multi-query attention (one key/value head)"),
    Arch("gpt_bigcode_mha", "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
         {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_inner": FFN, "n_layer": LAYERS, "n_head": HEADS,
          "n_positions": 64, "multi_query": False, **TOKEN_IDS}, note="multi-head attention"),
    Arch("gpt2", "GPT2Config", "GPT2LMHeadModel", {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_inner": FFN,
                                                   "n_layer": LAYERS, "n_head": HEADS, "n_positions": 64,
                                                   **TOKEN_IDS}),
    Arch("opt", "OPTConfig", "OPTForCausalLM", {"vocab_size": VOCAB, "hidden_size": HIDDEN, "ffn_dim": FFN,
                                                "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
                                                "word_embed_proj_dim": HIDDEN, "max_position_embeddings": 64,
                                                **TOKEN_IDS}),
    Arch("falcon", "FalconConfig", "FalconForCausalLM",
         {"vocab_size": VOCAB, "hidden_size": HIDDEN, "ffn_hidden_size": FFN, "num_hidden_layers": LAYERS,
          "num_attention_heads": HEADS, **TOKEN_IDS}, note="multi-query attention (the config's default)"),
    Arch("falcon_gqa", "FalconConfig", "FalconForCausalLM",
         {"vocab_size": VOCAB, "hidden_size": HIDDEN, "ffn_hidden_size": FFN, "num_hidden_layers": LAYERS,
          "num_attention_heads": HEADS, "num_kv_heads": KV_HEADS, "new_decoder_architecture": True,
          **TOKEN_IDS}, note="new architecture, grouped-query attention"),
    Arch("bloom", "BloomConfig", "BloomForCausalLM", {"vocab_size": VOCAB, "hidden_size": HIDDEN,
                                                      "n_layer": LAYERS, "n_head": HEADS, **TOKEN_IDS}),
    Arch("biogpt", "BioGptConfig", "BioGptForCausalLM", _drop(_decoder(), "head_dim", "num_key_value_heads")),
    Arch("xglm", "XGLMConfig", "XGLMForCausalLM", {"vocab_size": VOCAB, "d_model": HIDDEN, "ffn_dim": FFN,
                                                   "num_layers": LAYERS, "attention_heads": HEADS,
                                                   "max_position_embeddings": 64, **TOKEN_IDS}),
    Arch("mpt", "MptConfig", "MptForCausalLM", {"vocab_size": VOCAB, "d_model": HIDDEN, "n_layers": LAYERS,
                                                "n_heads": HEADS, "expansion_ratio": 2, "max_seq_len": 64,
                                                **TOKEN_IDS}),
    Arch("mamba", "MambaConfig", "MambaForCausalLM", {"vocab_size": VOCAB, "hidden_size": HIDDEN,
                                                      "state_size": 8, "num_hidden_layers": LAYERS,
                                                      "intermediate_size": 2 * HIDDEN, **TOKEN_IDS}),
    # -- mixtures of experts ----------------------------------------------------------------------
    Arch("mixtral", "MixtralConfig", "MixtralForCausalLM", _decoder(num_local_experts=4, num_experts_per_tok=2),
         moe=True),
    Arch("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
         _decoder(num_experts=4, shared_expert_intermediate_size=32, **MOE), moe=True),
    Arch("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", _decoder(num_experts=4, **MOE), moe=True),
    Arch("olmoe", "OlmoeConfig", "OlmoeForCausalLM", _drop(_decoder(num_experts=4, num_experts_per_tok=2),
                                                          "head_dim"), moe=True),
    Arch("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM",
         _drop(_decoder(num_local_experts=4, num_experts_per_tok=2), "head_dim"), moe=True),
    Arch("granitemoeshared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
         _drop(_decoder(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32), "head_dim"),
         moe=True),
    Arch("phimoe", "PhimoeConfig", "PhimoeForCausalLM", _drop(_decoder(num_local_experts=4, num_experts_per_tok=2),
                                                             "head_dim"), moe=True),
    Arch("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
         _drop(_decoder(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                        topk_group=1, **MOE), "head_dim", "num_key_value_heads"), moe=True),
    Arch("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
         _drop(_decoder(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                        topk_group=1, **MOE), "head_dim", "num_key_value_heads"), moe=True),
    Arch("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
         _decoder(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                  moe_layer_start_index=0), moe=True),
    Arch("hunyuan_moe", "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
         _decoder(num_experts=4, moe_topk=2, moe_intermediate_size=32), moe=True),
    Arch("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
         _decoder(num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"]), moe=True),
    Arch("dots1", "Dots1Config", "Dots1ForCausalLM",
         _decoder(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                  **MOE), moe=True),
    Arch("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM",
         _decoder(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                  **MOE), moe=True),
    Arch("minimax_m2", "MiniMaxM2Config", "MiniMaxM2ForCausalLM", _decoder(num_local_experts=4, **MOE), moe=True),
    Arch("flex_olmo", "FlexOlmoConfig", "FlexOlmoForCausalLM", _decoder(num_experts=4, num_experts_per_tok=2),
         moe=True),
    Arch("llama4", "Llama4TextConfig", "Llama4ForCausalLM",
         _decoder(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=FFN, interleave_moe_layer_step=1,
                  no_rope_layers=[1, 1], attention_chunk_size=64), moe=True),
    Arch("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
         _decoder(num_experts=4, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
                  shared_expert_intermediate_size=32, **MOE), moe=True),
    # -- encoders, encoder-decoders, vision -------------------------------------------------------
    Arch("bert", "BertConfig", "BertForMaskedLM", ENCODER, inputs="masked"),
    Arch("roberta", "RobertaConfig", "RobertaForMaskedLM", ENCODER, inputs="masked"),
    Arch("xlm_roberta", "XLMRobertaConfig", "XLMRobertaForMaskedLM", ENCODER, inputs="masked"),
    Arch("electra", "ElectraConfig", "ElectraForMaskedLM", {**ENCODER, "embedding_size": HIDDEN}, inputs="masked"),
    Arch("deberta_v2", "DebertaV2Config", "DebertaV2ForMaskedLM", ENCODER, inputs="masked"),
    Arch("distilbert", "DistilBertConfig", "DistilBertForMaskedLM",
         {"vocab_size": VOCAB, "dim": HIDDEN, "hidden_dim": FFN, "n_layers": LAYERS, "n_heads": HEADS,
          "pad_token_id": 0}, inputs="masked"),
    Arch("t5", "T5Config", "T5ForConditionalGeneration",
         {"vocab_size": VOCAB, "d_model": HIDDEN, "d_kv": HEAD_DIM, "d_ff": FFN, "num_layers": LAYERS,
          "num_heads": HEADS, "relative_attention_num_buckets": 8, "decoder_start_token_id": 0, "pad_token_id": 0,
          "eos_token_id": 2}, inputs="seq2seq"),
    Arch("vit", "ViTConfig", "ViTForImageClassification",
         {"image_size": 16, "patch_size": 4, "num_channels": 3, "hidden_size": HIDDEN, "intermediate_size": FFN,
          "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_labels": 5}, inputs="pixels"),
    Arch("clip_text", "CLIPTextConfig", "CLIPTextModel", ENCODER, inputs="hidden"),
]
BY_NAME = {a.name: a for a in ARCHS}


# -- one rank -------------------------------------------------------------------------------------


def _build(arch: Arch) -> torch.nn.Module:
    import transformers
    config = getattr(transformers, arch.config)(**arch.kwargs)
    # Dropout and router jitter off (random in training), before the modules copy them: both copies compute alike.
    for key, value in list(vars(config).items()):
        if any(w in key for w in ("dropout", "pdrop", "jitter")) and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return getattr(transformers, arch.model)(config)


def _batch(arch: Arch, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    if arch.inputs == "pixels":
        return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=gen),
                "labels": torch.randint(0, 5, (BATCH,), generator=gen)}
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones_like(tokens)
    mask[1, SEQ - 3:] = 0  # the second sequence is shorter: padding on the right
    if arch.inputs == "hidden":
        return {"input_ids": tokens, "attention_mask": mask}
    labels = tokens.masked_fill(mask == 0, -100)
    if arch.inputs == "seq2seq":
        return {"input_ids": tokens, "attention_mask": mask, "labels": labels[:, :SEQ - 2].contiguous()}
    if arch.name.startswith("mamba"):  # no attention mask
        return {"input_ids": tokens, "labels": tokens}
    return {"input_ids": tokens, "attention_mask": mask, "labels": labels}


def _objective(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    hidden = out.last_hidden_state
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(7))
    return (hidden * weights).mean()


def _output(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / (1 + want.abs().max())) if want.numel() else 0.0


def _whole(model: torch.nn.Module, rank: int, grad: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) whole, split ones gathered (collective: the same order on every rank)."""
    from sharded_tensor._model.record import sharded_parameters

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        sharded = sharded_parameters(module)
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{mod_name}.{attr}" if mod_name else attr
            value = param.grad if grad else param.detach()
            if value is None:
                value = torch.zeros_like(param)
            out[name] = sharded[attr].wrap(value, rank).full_tensor() if attr in sharded else value.clone()
    return out


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, value in want.items():
        err = _rel(got[name], value) if name in got else float("inf")
        if err > worst:
            worst, where = err, name
    return worst, where


def _counts(counter: Any) -> dict[str, int]:
    c = dict(counter.counts)
    return {"all_reduce": c.get("all_reduce", 0), "all_gather": c.get("all_gather", 0),
            "all_to_all": c.get("send/recv", 0)}


def _plan_source(spec: Any, model: torch.nn.Module) -> str:
    """Where the plan came from, in short: transformers' plan (with what was inferred), or block structure."""
    source = getattr(spec, "source", "")
    if source.startswith("block structure"):
        return source
    return "transformers" + (" + inferred" if getattr(spec, "inferred", ()) else "")


def _notes(row: dict[str, Any]) -> str:
    """What the plan inferred or kept whole, by block: ``qkv_proj`` packed, ``self_attn`` split or whole."""
    def blocks(lines: list[str]) -> list[str]:
        return [line.split(":")[0].replace(".*.", ".").split("layers.")[-1].split("h.")[-1] for line in lines]
    parts = []
    if row.get("inferred"):
        parts.append("split: " + ", ".join(f"`{b}`" for b in blocks(row["inferred"])))
    if row.get("kept_whole"):
        parts.append("whole: " + ", ".join(f"`{b}`" for b in blocks(row["kept_whole"])))
    return "; ".join(parts)


def _check(arch: Arch, experts: str, rank: int, world: int, out: dict[str, Any]) -> dict[str, Any]:
    """Fill ``out`` as the run goes (a failure keeps what was found before it)."""
    import sharded_tensor as st

    ranks = [f"rank:{r}/cpu" for r in range(world)]
    ref, model = _build(arch), _build(arch)
    model.load_state_dict(ref.state_dict())
    try:
        spec = st.tensor_parallel_spec(model, ranks, experts=experts)  # type: ignore[arg-type]
    except ValueError as exc:
        out.update(plan_source="refused", status="refused", message=str(exc))
        return out
    out["plan_source"] = _plan_source(spec, model)
    out["inferred"] = list(getattr(spec, "inferred", ()))
    out["kept_whole"] = list(getattr(spec, "kept_whole", ()))
    try:
        st.shard_model(model, spec, src_rank=0)
    except ValueError as exc:
        out.update(status="refused", message=f"shard_model: {exc}")
        return out
    out["split_parameters"] = sum(1 for v in model.state_dict().values() if isinstance(v, st.ShardedTensor))

    x = _batch(arch, 0)
    with st.CommCounter() as fwd:
        got = model(**x)
    out["forward"] = _counts(fwd)
    want = ref(**x)
    errors = {"logits": _rel(_output(got), _output(want)), "loss": _rel(_objective(got), _objective(want))}
    _objective(got).backward()
    _objective(want).backward()
    errors["grads"], worst_grad = _worst(_whole(model, rank, grad=True),
                                         {n: p.grad if p.grad is not None else torch.zeros_like(p)
                                          for n, p in ref.named_parameters()})

    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(1, STEPS + 1):
        x = _batch(arch, step)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _objective(m(**x)).backward()
            o.step()
    errors["params"], worst_param = _worst(_whole(model, rank, grad=False), dict(ref.named_parameters()))
    out["max_errors"] = errors
    out["worst"] = {"grads": worst_grad, "params": worst_param}

    if arch.inputs == "causal":
        out["generate"] = _generate(model, ref)
    bad = [k for k, v in errors.items() if not v < TOL]
    if "generate" in out and not out["generate"]["same_tokens"]:
        bad.append("generate")
    out["status"] = "WRONG" if bad else "exact"
    if bad:
        out["differs"] = bad
    return out


def _generate(model: torch.nn.Module, ref: torch.nn.Module) -> dict[str, Any]:
    import sharded_tensor as st

    model.eval()
    ref.eval()
    prompt = torch.randint(3, VOCAB, (BATCH, 5), generator=torch.Generator().manual_seed(4))
    kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
    steps: list[Any] = []

    def opened(module: Any, args: Any, kw: Any) -> None:
        steps.append(st.CommCounter().__enter__())

    def closed(module: Any, args: Any, kw: Any, output: Any) -> None:
        steps[-1].__exit__(None, None, None)

    hooks = [model.register_forward_pre_hook(opened, with_kwargs=True),
             model.register_forward_hook(closed, with_kwargs=True)]
    try:
        with torch.no_grad():
            got = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        want = ref.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    decode = [_counts(c) for c in steps[1:]]
    return {"same_tokens": got.tolist() == want.tolist(), "decode_step": decode[-1] if decode else None}


def _guarded(arch: Arch, experts: str, rank: int, world: int) -> dict[str, Any]:
    started = time.perf_counter()
    out: dict[str, Any] = {"architecture": arch.name, "experts": experts if arch.moe else None}
    try:
        _check(arch, experts, rank, world, out)
    except Exception as exc:  # noqa: BLE001 - each architecture's failure is its row
        frames = traceback.extract_tb(exc.__traceback__)

        def last(part: str) -> str:
            return next((f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in reversed(frames)
                         if f"/{part}/" in f.filename), "")
        out.update(status="error", message=f"{type(exc).__name__}: {exc}"[:2000], model_code=last("transformers"),
                   shardkit_code=last("sharded_tensor"))
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def _rows(rank: int, world: int, runs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    import warnings

    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    return [_guarded(BY_NAME[name], experts, rank, world) for name, experts in runs]


# -- the driver -----------------------------------------------------------------------------------


def _merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per run: rank 0's, with the worst errors over the ranks and a failure on any rank."""
    rows = []
    for i, row in enumerate(per_rank[0]):
        row = dict(row)
        for other in per_rank[1:]:
            theirs = other[i]
            if theirs.get("status") != row.get("status") and row.get("status") == "exact":
                row = dict(theirs)
            for key, value in (theirs.get("max_errors") or {}).items():
                row.setdefault("max_errors", {})[key] = max(row["max_errors"].get(key, 0.0), value)
        rows.append(row)
    return rows


def _spawn(runs: list[tuple[str, str]], timeout: float) -> list[dict[str, Any]]:
    from _shardkit.launch import launch

    preload = ("torch._dynamo", "sharding", "sharded_tensor", "transformers")
    return _merge(launch(_rows, 2, (runs,), timeout=timeout, preload=preload))


def run(names: list[str], per_spawn: int, timeout: float) -> list[dict[str, Any]]:
    runs = [(a, e) for a in names for e in (("tensor", "expert") if BY_NAME[a].moe else ("tensor",))]
    rows: list[dict[str, Any]] = []
    for start in range(0, len(runs), per_spawn):
        chunk = runs[start:start + per_spawn]
        try:
            got = _spawn(chunk, timeout)
        except Exception:  # noqa: BLE001 - a crashed spawn: each of its runs alone
            got = []
            for one in chunk:
                try:
                    got.extend(_spawn([one], timeout))
                except Exception as exc:  # noqa: BLE001
                    got.append({"architecture": one[0], "experts": one[1] if BY_NAME[one[0]].moe else None,
                                "status": "error", "message": f"the ranks died: {type(exc).__name__}: {exc}"[:2000]})
        for row in got:
            print(json.dumps(row), flush=True)
        rows.extend(got)
    return rows


def _label(row: dict[str, Any]) -> str:
    arch = BY_NAME[row["architecture"]]
    label = arch.model.replace("ForCausalLM", "").replace("ForMaskedLM", "").replace("LMHeadModel", "")
    label = label.replace("ForConditionalGeneration", "").replace("ForImageClassification", "")
    if row.get("experts"):
        label += f" (`experts=\"{row['experts']}\"`)"
    if arch.note:
        label += f", {arch.note}"
    return label


def _comm(counts: dict[str, int] | None) -> str:
    if not counts:
        return ""
    return f"{counts['all_reduce']} / {counts['all_gather']} / {counts['all_to_all']}"


def table(rows: list[dict[str, Any]], command: str) -> str:
    lines = [f"<!-- generated by: {command} -->", "",
             "| Architecture | Plan source | Beyond the source | Status | Forward: all-reduce / all-gather / "
             "all-to-all | Decode step | Largest difference |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        status = row["status"]
        if status in ("refused", "error"):
            message = row.get("message", "").replace("|", "\\|").replace("\n", " ")
            short = message if len(message) <= 240 else message[:237] + "..."
            status = f"{status}: {short}"
        errors = row.get("max_errors") or {}
        worst = f"{max(errors.values()):.1e}" if errors else ""
        decode = _comm((row.get("generate") or {}).get("decode_step"))
        lines.append(f"| {_label(row)} | {row.get('plan_source', '')} | {_notes(row)} | {status} | "
                     f"{_comm(row.get('forward'))} | {decode} | {worst} |")
    return "\n".join(lines) + "\n"


START, END = "<!-- arch_matrix:start -->", "<!-- arch_matrix:end -->"


def write_table(path: Path, rows: list[dict[str, Any]], command: str) -> None:
    """The table into ``path``: between its markers if it has them, else as the whole file."""
    text = table(rows, command)
    if path.exists() and START in (old := path.read_text()) and END in old:
        head, rest = old.split(START, 1)
        path.write_text(f"{head}{START}\n{text}{END}{rest.split(END, 1)[1]}")
    else:
        path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated architecture names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the architectures and exit")
    parser.add_argument("--table", default="", help="also write the Markdown table into this file")
    parser.add_argument("--from", dest="saved", default="", help="render the rows of a saved run (JSON lines)")
    parser.add_argument("--per-spawn", type=int, default=8, help="runs per spawn of 2 ranks")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per spawn")
    args = parser.parse_args()
    if args.list:
        for arch in ARCHS:
            print(f"{arch.name:18} {arch.config:24} {arch.model}{'  (experts: tensor, expert)' if arch.moe else ''}")
        return 0
    names = [n for n in args.only.split(",") if n] or [a.name for a in ARCHS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"unknown architectures {unknown}; known: {sorted(BY_NAME)}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.saved:
        rows = [json.loads(line) for line in Path(args.saved).read_text().splitlines() if line.strip()]
    else:
        rows = run(names, args.per_spawn, args.timeout)
    if args.table:
        command = "python scripts/arch_matrix.py" + (f" --only {args.only}" if args.only else "") + \
            f" --table {args.table}"
        write_table(Path(args.table), rows, command)
    return 1 if any(r["status"] == "WRONG" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
