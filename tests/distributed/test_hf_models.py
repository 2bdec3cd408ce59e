"""transformers models sharded tensor-parallel on 2 Gloo ranks: Llama (grouped-query) and BERT.

One spawn checks a lot, each rank against an unsharded copy of the same model that it builds
itself (tiny configs, no downloads):

* logits and loss equal the unsharded model's, and so does every local gradient (each rank's
  block of the full gradient);
* a decoder layer's forward does exactly 2 all-reduces and no all-gather, and so does its
  backward (q, k and v share one input copy);
* 3 AdamW steps give the same losses as the unsharded model;
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
from sharding import composite, single_split  # noqa: E402
from tests.distributed._grads import local_grad_mismatches  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed
VOCAB, LAYERS = 96, 2


def _llama_config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       use_cache=False, attention_dropout=0.0)


def _bert_config():  # type: ignore[no-untyped-def]
    from transformers import BertConfig
    return BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


def llama_spec(world: int, *, lm_head: bool = False, q_split: list[int] | None = None):  # type: ignore[no-untyped-def]
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
    if lm_head:
        parts["lm_head"] = col
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

    # Generation with a key/value cache: the cached keys and values stay split by heads.
    model.eval()
    ref.eval()
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    out["generate"] = (model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True).tolist(),
                       ref.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True).tolist())

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


def test_generation_with_a_cache_matches(hf_runs):
    for out in hf_runs:
        got, want = out["generate"]
        assert got == want


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
