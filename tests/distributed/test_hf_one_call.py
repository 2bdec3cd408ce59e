"""One-call plans that need more than a style-by-style reading of transformers' plan, on 2 Gloo ranks.

Each model is built from a tiny config with transformers' defaults, planned by
``st.tensor_parallel_spec`` and sharded from rank 0's weights; on every rank, against the same
model unsharded, with ``labels=``:

* logits, loss and every parameter's gradient (split ones gathered whole, replicated ones
  included) equal the unsharded model's;
* the forward's all-gathers are only the returned logits' (lm_head split on the vocabulary),
  none at all where the plan keeps lm_head whole.

The models: Gemma and Gemma 3 (a scaled word embedding split on the vocabulary, and on the
embedding dimension by an edited spec), Phi-3 and GLM (fused ``qkv_proj`` / ``gate_up_proj``
split packed), GPT-2 (``Conv1D``, with shardkit's own registration) and GPT-BigCode with and
without multi-query attention (attention kept whole, or split by heads), GraniteMoE (attention
the plan leaves whole, split by heads), GPT-OSS with each expert layout (experts with biases,
attention with sinks), Llama 4's experts module alone, split by features and by experts; DeepSeek-V2 and Llama 4 whole
(rotary embeddings in complex numbers), and Qwen3-Next (gated delta-net linear attention).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import sharded_tensor as st  # noqa: E402
from sharding import CompositeShardingSpec, composite, single_split  # noqa: E402
from tests.distributed._grads import full_grads, full_mismatches, full_params  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed

VOCAB, BATCH, SEQ = 96, 2, 8
DECODER = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
GPT = {"vocab_size": VOCAB, "n_embd": 64, "n_inner": 96, "n_layer": 2, "n_head": 4, "n_positions": 64,
       "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 1, "eos_token_id": 2}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}

# name -> (config class, model class, config, experts layout, all-gathers in the forward)
MODELS: dict[str, tuple[str, str, dict[str, Any], str, int]] = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(DECODER, head_dim=16), "tensor", 1),
    # The tied embedding and lm_head split on the embedding dimension: the first norm gathers the embeddings.
    "gemma_dim_split": ("GemmaConfig", "GemmaForCausalLM", dict(DECODER, head_dim=16), "tensor", None),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(DECODER, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
               "tensor", 1),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", DECODER, "tensor", 1),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(DECODER, head_dim=16), "tensor", 1),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT, "tensor", 0),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", GPT, "tensor", 0),
    "gpt_bigcode_mha": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(GPT, multi_query=False), "tensor", 0),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(DECODER, **MOE), "tensor", 1),
    # GPT-OSS's attention appends its sinks (one per head, whole) to each layer's scores: each rank takes its
    # heads' sinks, no gather.
    "gpt_oss_tensor": ("GptOssConfig", "GptOssForCausalLM", dict(DECODER, head_dim=16, **MOE), "tensor", 1),
    "gpt_oss_expert": ("GptOssConfig", "GptOssForCausalLM", dict(DECODER, head_dim=16, **MOE), "expert", None),
    # Rotary embeddings in complex numbers (view_as_complex on each rank's heads), latent attention.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict({k: v for k, v in DECODER.items() if k != "num_key_value_heads"}, n_routed_experts=4,
                         n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
                         num_experts_per_tok=2, moe_intermediate_size=32), "tensor", 1),
    # Complex rotary, chunked attention, experts stacked expert by expert, its plan under another prefix.
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(DECODER, head_dim=16, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96,
                    interleave_moe_layer_step=1, no_rope_layers=[1, 1], attention_chunk_size=64), "tensor", 1),
    # Gated delta-net (linear attention) layers beside full attention: transformers' plan gathers their
    # projections' outputs; split by key heads instead (the convolution over packed q/k/v channels, the delta
    # rule per head), only the returned logits are gathered.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(DECODER, head_dim=16, num_experts=4, linear_num_value_heads=4, linear_num_key_heads=2,
                        linear_key_head_dim=16, linear_value_head_dim=16,
                        layer_types=["linear_attention", "full_attention"], shared_expert_intermediate_size=32,
                        num_experts_per_tok=2, moe_intermediate_size=32), "tensor", 1),
}


def _build(name: str) -> torch.nn.Module:
    import transformers
    config_cls, model_cls, kwargs, _, _ = MODELS[name]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config)


def _batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[1, SEQ - 3:] = 0
    return {"input_ids": tokens, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, -100)}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / (1 + want.abs().max()))


def _check(name: str, rank: int, world: int) -> dict[str, Any]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    ref, model = _build(name), _build(name)
    model.load_state_dict(ref.state_dict())
    spec = st.tensor_parallel_spec(model, ranks, experts=MODELS[name][3])  # type: ignore[arg-type]
    if name == "gemma_dim_split":  # the scaled embedding (tied to lm_head) split on the embedding dimension instead
        spec = CompositeShardingSpec({**spec.param_placement, "model.embed_tokens": single_split(1, ranks),
                                      "lm_head": single_split(1, ranks)})
    st.shard_model(model, spec, src_rank=0)
    x = _batch()
    with st.CommCounter() as comm:
        got = model(**x)
    want = ref(**x)
    got.loss.backward()
    want.loss.backward()
    return {"logits": _relative(got.logits, want.logits), "loss": (got.loss.item(), want.loss.item()),
            "grads": full_mismatches(full_grads(model, rank), {n: p.grad for n, p in ref.named_parameters()}),
            "comm": dict(comm.counts), "inferred": list(getattr(spec, "inferred", ())),
            "kept_whole": list(getattr(spec, "kept_whole", ()))}


class _Experts(torch.nn.Module):
    """Llama 4's experts module, fed the hidden states stacked expert by expert as its MoE layer feeds it."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Llama4TextConfig
        from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
        torch.manual_seed(0)
        self.experts = Llama4TextExperts(Llama4TextConfig(hidden_size=16, intermediate_size=24, num_local_experts=4))
        torch.nn.init.normal_(self.experts.gate_up_proj, std=0.2)
        torch.nn.init.normal_(self.experts.down_proj, std=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x)


def _llama4_experts(rank: int, world: int) -> dict[str, Any]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    out = {}
    layouts = {"tensor": {"experts.gate_up_proj": single_split(2, ranks * 2),
                          "experts.down_proj": single_split(1, ranks)},
               "expert": {"experts.gate_up_proj": single_split(0, ranks), "experts.down_proj": single_split(0, ranks)}}
    for mode, parts in layouts.items():
        ref, model = _Experts(), _Experts()
        model.load_state_dict(ref.state_dict())
        st.shard_model(model, composite(**parts), src_rank=0)
        x = torch.randn(4 * 6, 16, generator=torch.Generator().manual_seed(2))
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        weights = torch.randn(4 * 6, 16, generator=torch.Generator().manual_seed(3))
        got, want = model(xs[0]), ref(xs[1])
        (got * weights).sum().backward()
        (want * weights).sum().backward()
        out[mode] = {"out": _relative(got, want), "input_grad": _relative(xs[0].grad, xs[1].grad),
                     "grads": full_mismatches(full_grads(model, rank), {n: p.grad for n, p in ref.named_parameters()})}
    try:  # a split of the experts parameters that does not keep gate and up together is refused at shard time
        model = _Experts()
        st.shard_model(model, composite(**{"experts.gate_up_proj": single_split(2, ranks),
                                           "experts.down_proj": single_split(1, ranks)}), src_rank=0)
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def _trains_and_generates(name: str, rank: int, world: int, steps: int = 3, new_tokens: int = 4) -> dict[str, Any]:
    """``steps`` SGD steps on the loss of ``labels=`` (the logits before each, every parameter after them), then
    greedy ``generate`` with the config's cache (the tokens, and the all-gathers of the decode steps)."""
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    ref, model = _build(name), _build(name)
    model.load_state_dict(ref.state_dict())
    st.shard_model(model, st.tensor_parallel_spec(model, ranks, experts=MODELS[name][3]), src_rank=0)
    x = _batch()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    logits = []
    for _ in range(steps):
        outs = []
        for m, optimizer in zip((model, ref), optimizers):
            optimizer.zero_grad()
            out = m(**x)
            out.loss.backward()
            optimizer.step()
            outs.append(out.logits.detach())
        logits.append(_relative(*outs))
    params = full_mismatches(full_params(model, rank), {n: p.detach() for n, p in ref.named_parameters()})
    prompt = x["input_ids"][:, :5]
    with torch.no_grad(), st.CommCounter() as comm:
        got = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    want = ref.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    return {"logits": logits, "params": params, "tokens": torch.equal(got, want), "decode": dict(comm.counts)}


def _run(rank: int, world: int) -> dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    results: dict[str, Any] = {}
    for name in MODELS:
        try:
            results[name] = _check(name, rank, world)
        except Exception as exc:  # noqa: BLE001 - reported per model
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    results["llama4_experts"] = _llama4_experts(rank, world)
    try:
        results["qwen3_next_steps"] = _trains_and_generates("qwen3_next", rank, world)
    except Exception as exc:  # noqa: BLE001 - reported by its test
        results["qwen3_next_steps"] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


@pytest.fixture(scope="module")
def one_call_runs() -> list[dict[str, Any]]:
    return run_distributed(_run, 2, timeout=400)


@pytest.mark.parametrize("name", list(MODELS))
def test_one_call_plan_equals_unsharded(one_call_runs, name):
    for rank, run in enumerate(one_call_runs):
        out = run[name]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        assert out["logits"] < 1e-5, f"rank {rank}: logits differ by {out['logits']:.2e}"
        got, want = out["loss"]
        assert got == pytest.approx(want, rel=1e-5)
        assert out["grads"] == {}, f"rank {rank}: gradients differ: {out['grads']}"
        gathers = MODELS[name][4]
        if gathers is not None:
            assert out["comm"].get("all_gather", 0) == gathers, f"rank {rank}: {out['comm']}"


def test_what_the_plans_inferred_is_listed(one_call_runs):
    out = one_call_runs[0]
    assert [line.split(":")[0] for line in out["phi3"]["inferred"]] == [
        "model.layers.*.self_attn.qkv_proj", "model.layers.*.mlp.gate_up_proj"]
    assert [line.split(":")[0] for line in out["glm"]["inferred"]] == ["model.layers.*.mlp.gate_up_proj"]
    assert [line.split(":")[0] for line in out["granitemoe"]["inferred"]] == ["model.layers.*.self_attn"]
    assert [line.split(":")[0] for line in out["gpt_oss_tensor"]["inferred"]] == [
        "model.layers.*.self_attn", "model.layers.*.mlp.experts"]
    assert len(out["gpt_bigcode"]["kept_whole"]) == 1 and "multi-query" in out["gpt_bigcode"]["kept_whole"][0]
    assert out["gemma"]["inferred"] == [] and out["gpt2"]["inferred"] == []
    assert [line.split(":")[0] for line in out["qwen3_next"]["inferred"]] == [
        "model.layers.*.linear_attn.in_proj_qkvz", "model.layers.*.linear_attn.in_proj_ba",
        "model.layers.*.linear_attn.out_proj"]


def test_llama4_experts_split_by_features_and_by_experts(one_call_runs):
    for run in one_call_runs:
        out = run["llama4_experts"]
        for mode in ("tensor", "expert"):
            assert out[mode]["out"] < 1e-6 and out[mode]["input_grad"] < 1e-6, (mode, out[mode])
            assert out[mode]["grads"] == {}, (mode, out[mode])
        assert out["refused"] is not None and "single_split(2, ranks * 2)" in out["refused"]


def test_qwen3_next_trains_and_generates_on_split_heads(one_call_runs):
    """The gated delta net split by key heads through 3 SGD steps, and through generate's decode steps (the
    convolution's cached state packed, the recurrent rule on each rank's heads): the unsharded model's numbers and
    tokens, each decode step gathering only its logits."""
    for rank, run in enumerate(one_call_runs):
        out = run["qwen3_next_steps"]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        assert max(out["logits"]) < 1e-5, f"rank {rank}: logits differ by {out['logits']}"
        assert out["params"] == {}, f"rank {rank}: parameters after the steps differ: {out['params']}"
        assert out["tokens"], f"rank {rank}: generated tokens differ"
        assert out["decode"].get("all_gather", 0) == 1 + 3, f"rank {rank}: {out['decode']}"  # prefill, 3 decodes
