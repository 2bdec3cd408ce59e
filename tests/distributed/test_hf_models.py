"""transformers models sharded tensor-parallel on 2 Gloo ranks: Llama (grouped-query) and BERT.

One spawn checks a lot, each rank against an unsharded copy of the same model that it builds
itself (tiny configs, no downloads):

* logits and loss equal the unsharded model's, and so does every local gradient (each rank's
  block of the full gradient);
* a decoder layer's forward does exactly 2 all-reduces and no all-gather, and so does its
  backward (q, k and v share one input copy);
* 3 AdamW steps give the same losses as the unsharded model;
* greedy ``generate`` with the key/value cache (Llama, and Mistral with a sliding window; the
  dynamic cache and the static one, ``cache_implementation="static"``) gives the unsharded
  model's tokens; every decode step does 2 all-reduces per layer and no
  all-gather, and each rank's cache holds its own key/value head, tagged with the head split;
  planned by ``st.tensor_parallel_spec`` (embedding and ``lm_head`` split on the vocabulary),
  each step also does the embedding's all-reduce and one all-gather: the logits of the last
  position, which the sampler needs whole;
* a meta model initialized by the model's own ``_init_weights`` with ``seed`` holds the same
  values on 2 ranks as in a world of one;
* ``loss_parallel`` with ``lm_head`` split on the vocabulary gives the unsharded loss and
  gradients without gathering the logits;
* a split that cuts an attention head is refused at shard time.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import checkpoint  # noqa: E402
import sharded_tensor as st  # noqa: E402
from sharded_tensor._model.engine.placements import placement_of as split_of  # noqa: E402
from sharding import composite, single_split  # noqa: E402
from tests.distributed._grads import local_grad_mismatches  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed
VOCAB, LAYERS, NEW_TOKENS = 96, 2, 8


def _llama_config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       attention_dropout=0.0)


def _mistral_config():  # type: ignore[no-untyped-def]
    from transformers import MistralConfig
    # A sliding window shorter than the prompt plus the new tokens: the cache drops its oldest entries.
    return MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         sliding_window=6, attention_dropout=0.0)


def _bert_config():  # type: ignore[no-untyped-def]
    from transformers import BertConfig
    return BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


def llama_spec(world: int, *, lm_head: bool = False, q_split: list[int] | None = None,  # type: ignore[no-untyped-def]
               vocab: bool = False):
    """Attention by heads, MLPs by features; ``lm_head`` (and ``vocab``: the embedding too) on the vocabulary."""
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    col, row = single_split(0, ranks), single_split(1, ranks)
    parts = {}
    for i in range(LAYERS):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        parts[f"{attn}.q_proj"] = single_split(0, ranks, q_split) if q_split else col
        parts[f"{attn}.k_proj"] = parts[f"{attn}.v_proj"] = col
        parts[f"{attn}.o_proj"] = row
        parts[f"{mlp}.gate_proj"] = parts[f"{mlp}.up_proj"] = col
        parts[f"{mlp}.down_proj"] = row
    if lm_head or vocab:
        parts["lm_head"] = col
    if vocab:
        parts["model.embed_tokens"] = col
    return composite(**parts)


def bert_spec(world: int, *, prefix: str = "bert.", layers: int = LAYERS):  # type: ignore[no-untyped-def]
    """BERT layers tensor-parallel: q/k/v and the intermediate split on outputs, their outputs on inputs."""
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    col, row = single_split(0, ranks), single_split(1, ranks)
    parts = {}
    for i in range(layers):
        layer = f"{prefix}encoder.layer.{i}"
        for name in ("query", "key", "value"):
            parts[f"{layer}.attention.self.{name}"] = col
        parts[f"{layer}.attention.output.dense.weight"] = row
        parts[f"{layer}.intermediate.dense"] = col
        parts[f"{layer}.output.dense.weight"] = row
    return composite(**parts)


def _pair(cls, config):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    ref = cls(config)
    model = cls(config)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _sharded_pair(cls, config, world: int):  # type: ignore[no-untyped-def]
    ref, model = _pair(cls, config)
    st.shard_model(model, llama_spec(world), src_rank=0)
    return model, ref


def _generate(model, ref, **extra) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Greedy decoding of NEW_TOKENS with the cache: tokens, collectives per forward, the cache's layout."""
    model.eval()
    ref.eval()
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "use_cache": True,
              **extra}
    steps: list[st.CommCounter] = []

    def opened(module, args, kw):  # type: ignore[no-untyped-def]
        steps.append(st.CommCounter().__enter__())

    def closed(module, args, kw, output):  # type: ignore[no-untyped-def]
        steps[-1].__exit__(None, None, None)

    hooks = [model.register_forward_pre_hook(opened, with_kwargs=True),
             model.register_forward_hook(closed, with_kwargs=True)]
    try:
        got = model.generate(prompt, return_dict_in_generate=True, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    cache = []
    for layer in got.past_key_values.layers:
        splits = [split_of(t) for t in (layer.keys, layer.values)]
        cache.append([(tuple(t.shape), s.dim, s.intervals) if s else None
                      for t, s in zip((layer.keys, layer.values), splits)])
    return {"tokens": got.sequences.tolist(), "want": ref.generate(prompt, **kwargs).tolist(),
            "steps": [dict(c.counts) for c in steps], "cache": cache}


def _hf_models(rank: int, world: int) -> dict[str, object]:
    from transformers import BertForMaskedLM, LlamaForCausalLM
    out: dict[str, object] = {}
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))

    # Llama with grouped-query attention, sharded from real weights.
    ref, model = _pair(LlamaForCausalLM, _llama_config())
    st.shard_model(model, llama_spec(world), src_rank=0)
    with st.CommCounter() as fwd:
        got = model(x, labels=x)
    want = ref(x, labels=x)
    out["llama_logits"] = (got.logits - want.logits).abs().max().item()
    out["llama_loss"] = (got.loss.item(), want.loss.item())
    with st.CommCounter() as bwd:
        got.loss.backward()
    want.loss.backward()
    out["llama_forward_comm"] = dict(fwd.counts)
    out["llama_backward_comm"] = dict(bwd.counts)
    out["llama_bad_grads"] = local_grad_mismatches(model, ref, rank)

    # Three AdamW steps, sharded and unsharded.
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    losses, ref_losses = [], []
    for step in range(3):
        y = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 + step))
        for m, o, sink in ((model, opt, losses), (ref, ref_opt, ref_losses)):
            o.zero_grad()
            loss = m(y, labels=y).loss
            loss.backward()
            o.step()
            sink.append(loss.item())
    out["llama_train"] = (losses, ref_losses)

    # Greedy generation with the key/value cache: the cached keys and values stay split by heads.
    out["generate_llama"] = _generate(model, ref)
    from transformers import MistralForCausalLM
    mistral = _sharded_pair(MistralForCausalLM, _mistral_config(), world)
    out["generate_mistral"] = _generate(*mistral)
    # A static cache: buffers allocated from the first (split) keys, written in place.
    out["generate_llama_static"] = _generate(model, ref, cache_implementation="static")
    out["generate_mistral_static"] = _generate(*mistral, cache_implementation="static")
    # Planned in one call: the embedding and lm_head split on the vocabulary too.
    planned = LlamaForCausalLM(_llama_config())
    planned.load_state_dict(ref.state_dict())
    st.shard_model(planned, st.tensor_parallel_spec(planned, [f"rank:{r}/cpu" for r in range(world)]), src_rank=0)
    out["generate_llama_planned"] = _generate(planned, ref)

    # Meta init by the model's own _init_weights, layout-invariant with seed.
    with torch.device("meta"):
        meta = LlamaForCausalLM(_llama_config())
    st.shard_model(meta, llama_spec(world), seed=0)
    out["meta_state"] = checkpoint.collect_state_dict(meta.state_dict())

    # Loss parallel: lm_head split on the vocabulary, logits never gathered.
    ref, model = _pair(LlamaForCausalLM, _llama_config())
    st.shard_model(model, llama_spec(world, lm_head=True), src_rank=0)
    target = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2))
    target[3] = -100
    with st.CommCounter() as comm:
        with st.loss_parallel():
            logits = model(x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target)
        loss.backward()
    want = torch.nn.functional.cross_entropy(ref(x).logits.flatten(0, 1), target)
    want.backward()
    out["loss_parallel"] = (loss.item(), want.item())
    out["loss_parallel_comm"] = dict(comm.counts)
    out["loss_parallel_bad_grads"] = local_grad_mismatches(model, ref, rank)

    # BERT: q/k/v in one module, the output projection in a sibling.
    ref, model = _pair(BertForMaskedLM, _bert_config())
    ref.eval()
    model.eval()
    st.shard_model(model, bert_spec(world), src_rank=0)
    mask = torch.ones_like(x)
    mask[1, 8:] = 0
    with st.CommCounter() as fwd:
        got = model(x, attention_mask=mask, labels=x)
    want = ref(x, attention_mask=mask, labels=x)
    got.loss.backward()
    want.loss.backward()
    out["bert_logits"] = (got.logits - want.logits).abs().max().item()
    out["bert_forward_comm"] = dict(fwd.counts)
    out["bert_bad_grads"] = local_grad_mismatches(model, ref, rank)

    # A q_proj split that cuts a head (head_dim 16): refused before anything changes.
    _, model = _pair(LlamaForCausalLM, _llama_config())
    try:
        st.shard_model(model, llama_spec(world, q_split=[24, 40]), src_rank=0)
        out["head_error"] = None
    except ValueError as exc:
        out["head_error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def hf_runs() -> list[dict[str, object]]:
    return run_distributed(_hf_models, 2, timeout=300)


def test_llama_sharded_equals_unsharded(hf_runs):
    for out in hf_runs:
        assert out["llama_logits"] < 1e-5
        got, want = out["llama_loss"]
        assert got == pytest.approx(want, rel=1e-6)
        assert out["llama_bad_grads"] == []
        losses, ref_losses = out["llama_train"]
        assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral", "llama_static", "mistral_static", "llama_planned"])
def test_generation_with_a_cache_matches_and_gathers_nothing(hf_runs, arch):
    for out in hf_runs:
        run = out[f"generate_{arch}"]
        assert run["tokens"] == run["want"]
        assert len(run["tokens"][0]) == 5 + NEW_TOKENS
        prefill, *decode = run["steps"]
        if arch == "llama_planned":
            # the embedding's all-reduce too, and the last position's logits gathered (the sampler reads them whole)
            assert prefill == {"all_reduce": 2 * LAYERS + 1, "all_gather": 1}
            assert decode == [{"all_reduce": 2 * LAYERS + 1, "all_gather": 1}] * (NEW_TOKENS - 1)
            continue
        assert prefill == {"all_reduce": 2 * LAYERS}
        # every decode step: o_proj's and down_proj's all-reduce in each layer, no all-gather
        assert decode == [{"all_reduce": 2 * LAYERS}] * (NEW_TOKENS - 1)
        # each rank caches its own key/value head (2 of them over 2 ranks), tagged with the head split
        # (a static cache holds max_cache_len positions: the prompt and the new tokens, or the window)
        kept = {"llama": 5 + NEW_TOKENS - 1, "mistral": 6 - 1, "llama_static": 5 + NEW_TOKENS - 1,
                "mistral_static": 6}[arch]
        for keys, values in run["cache"]:
            assert keys == values == ((2, 1, kept, 16), 1, ((0, 1), (1, 1)))


def test_decoder_layer_does_two_all_reduces_each_way(hf_runs):
    for out in hf_runs:
        assert out["llama_forward_comm"] == {"all_reduce": 2 * LAYERS}
        assert out["llama_backward_comm"] == {"all_reduce": 2 * LAYERS}


def test_meta_init_uses_the_models_own_init_and_is_layout_invariant(hf_runs):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        meta = LlamaForCausalLM(_llama_config())
    st.shard_model(meta, llama_spec(1), seed=0)  # a world of one
    want = checkpoint.collect_state_dict(meta.state_dict())
    got = hf_runs[0]["meta_state"]
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    # transformers' own rules: normal(0, 0.02) weights, ones for RMSNorm, the rotary buffer computed
    assert abs(float(want["model.layers.0.self_attn.q_proj.weight"].std()) - 0.02) < 0.002
    assert torch.equal(want["model.norm.weight"], torch.ones(64))


def test_loss_parallel_never_gathers_logits(hf_runs):
    for out in hf_runs:
        got, want = out["loss_parallel"]
        assert got == pytest.approx(want, rel=1e-6)
        assert "all_gather" not in out["loss_parallel_comm"]
        assert out["loss_parallel_bad_grads"] == []


def test_bert_sharded_equals_unsharded(hf_runs):
    for out in hf_runs:
        assert out["bert_logits"] < 1e-5
        assert out["bert_bad_grads"] == []
        assert out["bert_forward_comm"] == {"all_reduce": 2 * LAYERS}


def test_split_inside_a_head_is_refused(hf_runs):
    for out in hf_runs:
        assert out["head_error"] is not None
        assert "q_proj" in out["head_error"] and "head size is 16" in out["head_error"]
