"""``st.tensor_parallel_spec`` on real transformers models, 2 Gloo ranks, one spawn.

For each architecture (Llama and Qwen2 from transformers' plan: ``base_model_tp_plan``, the
embedding and ``lm_head`` split on the vocabulary; GPT-2, BERT, OPT, DistilBERT and ViT from
their block structure; GPT-NeoX with its plan's vocabulary-split embedding and head), one
model is sharded with the plan's spec and one with the hand-written spec of the docs and
tests: logits and the loss are equal bit for bit between the two, and logits, loss and every
local gradient equal the unsharded model's. Qwen3's plan (``replicated_with_grad_allreduce``
for ``q_norm``/``k_norm``) and OLMo2's (q/k normalized over all their split features) give the
unsharded logits and every gradient.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import sharded_tensor as st  # noqa: E402
from sharding import composite, single_split  # noqa: E402
from tests.distributed._archs import gpt2_spec  # noqa: E402
from tests.distributed._grads import local_grad_mismatches  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402
from tests.distributed.test_extension import ShardedConv1D  # noqa: E402
from tests.distributed.test_hf_models import bert_spec, llama_spec  # noqa: E402

pytestmark = pytest.mark.distributed
VOCAB, LAYERS = 96, 2


def _ranks(world: int) -> list[str]:
    return [f"rank:{r}/cpu" for r in range(world)]


def _col_row_spec(world: int, prefix: str, cols: tuple[str, ...], rows: tuple[str, ...]):  # type: ignore[no-untyped-def]
    col, row = single_split(0, _ranks(world)), single_split(1, _ranks(world))
    parts = {}
    for i in range(LAYERS):
        parts.update({f"{prefix}.{i}.{c}": col for c in cols})
        parts.update({f"{prefix}.{i}.{r}.weight": row for r in rows})
    return composite(**parts)


def _models(world: int):  # type: ignore[no-untyped-def]
    """``name -> (model class, config, hand-written spec, inputs)``."""
    import transformers as tf

    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    text = {"input_ids": tokens, "labels": tokens}
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    small = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": LAYERS, "vocab_size": VOCAB}
    decoder = dict(small, intermediate_size=96, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    bert = dict(small, intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
    return {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**decoder, head_dim=16), llama_spec(world, vocab=True), text),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(**decoder), llama_spec(world, vocab=True), text),
        # lm_head is the embedding: one parameter split on the vocabulary, used at both ends
        "llama_tied": (tf.LlamaForCausalLM, tf.LlamaConfig(**decoder, head_dim=16, tie_word_embeddings=True),
                       llama_spec(world, vocab=True), text),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=LAYERS,
                                                   n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                   bos_token_id=0, eos_token_id=0),
                 gpt2_spec(world, LAYERS), text),
        "bert": (tf.BertForMaskedLM, tf.BertConfig(**bert), bert_spec(world), text),
        "opt": (tf.OPTForCausalLM, tf.OPTConfig(**small, ffn_dim=128, word_embed_proj_dim=64, dropout=0.0,
                                                attention_dropout=0.0, max_position_embeddings=64),
                _col_row_spec(world, "model.decoder.layers", ("self_attn.q_proj", "self_attn.k_proj",
                                                              "self_attn.v_proj", "fc1"),
                              ("self_attn.out_proj", "fc2")), text),
        "distilbert": (tf.DistilBertForMaskedLM, tf.DistilBertConfig(vocab_size=VOCAB, dim=64, n_heads=4,
                                                                     n_layers=LAYERS, hidden_dim=128, dropout=0.0,
                                                                     attention_dropout=0.0,
                                                                     max_position_embeddings=64),
                       _col_row_spec(world, "distilbert.transformer.layer",
                                     ("attention.q_lin", "attention.k_lin", "attention.v_lin", "ffn.lin1"),
                                     ("attention.out_lin", "ffn.lin2")), text),
        "vit": (tf.ViTForImageClassification, tf.ViTConfig(hidden_size=64, num_attention_heads=4,
                                                            num_hidden_layers=LAYERS, intermediate_size=128,
                                                            image_size=8, patch_size=4, num_labels=3,
                                                            hidden_dropout_prob=0.0,
                                                            attention_probs_dropout_prob=0.0),
                _col_row_spec(world, "vit.layers", ("attention.q_proj", "attention.k_proj", "attention.v_proj",
                                                    "mlp.fc1"), ("attention.o_proj", "mlp.fc2")),
                {"pixel_values": pixels, "labels": torch.tensor([0, 2])}),
        "gpt_neox": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**dict(small, intermediate_size=128,
                                                                    max_position_embeddings=64, use_cache=False)),
                     composite(**{"gpt_neox.embed_in": single_split(0, _ranks(world)),
                                  "lm_head": single_split(0, _ranks(world))},
                               **_col_row_spec(world, "gpt_neox.layers",
                                               ("attention.query_key_value", "mlp.dense_h_to_4h"),
                                               ("attention.dense", "mlp.dense_4h_to_h")).param_placement),
                     text),
    }


def _logits(out) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return out.logits


def _plans(rank: int, world: int) -> dict[str, object]:
    import transformers as tf
    from transformers.pytorch_utils import Conv1D

    st.register_sharded_module(Conv1D, ShardedConv1D(), replace=True)
    out: dict[str, object] = {}
    for name, (cls, config, hand_spec, inputs) in _models(world).items():
        torch.manual_seed(0)
        ref = cls(config).eval()
        planned, hand = cls(config).eval(), cls(config).eval()
        planned.load_state_dict(ref.state_dict())
        hand.load_state_dict(ref.state_dict())
        spec = st.tensor_parallel_spec(planned, _ranks(world))
        try:
            st.shard_model(planned, spec, src_rank=0)
            st.shard_model(hand, hand_spec, src_rank=0)
            got, by_hand, want = planned(**inputs), hand(**inputs), ref(**inputs)
        except Exception as exc:  # reported per model by the test
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        got.loss.backward()
        want.loss.backward()
        same = torch.equal(_logits(got), _logits(by_hand)) and got.loss.item() == by_hand.loss.item()
        out[name] = {"same_as_hand": same,
                     "logits": (_logits(got) - _logits(want)).abs().max().item(),
                     "loss": (got.loss.item(), want.loss.item()),
                     "bad_grads": local_grad_mismatches(planned, ref, rank),
                     "sharded": sorted(n for n, v in planned.state_dict().items() if isinstance(v, st.ShardedTensor))}

    # Qwen3: q_norm and k_norm are replicated_with_grad_allreduce in transformers' plan.
    config = tf.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_hidden_layers=LAYERS, vocab_size=VOCAB, intermediate_size=96,
                            max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    ref, model = tf.Qwen3ForCausalLM(config), tf.Qwen3ForCausalLM(config)
    model.load_state_dict(ref.state_dict())
    st.shard_model(model, st.tensor_parallel_spec(model, _ranks(world)), src_rank=0)
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    got, want = model(tokens, labels=tokens), ref(tokens, labels=tokens)
    got.loss.backward()
    want.loss.backward()
    out["qwen3_logits"] = (got.logits - want.logits).abs().max().item()
    out["qwen3_bad_grads"] = local_grad_mismatches(model, ref, rank)

    # OLMo2: q_norm/k_norm normalize over all of q's (k's) features, which q_proj splits.
    config = tf.Olmo2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=LAYERS,
                            vocab_size=VOCAB, intermediate_size=96, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    ref, model = tf.Olmo2ForCausalLM(config), tf.Olmo2ForCausalLM(config)
    model.load_state_dict(ref.state_dict())
    st.shard_model(model, st.tensor_parallel_spec(model, _ranks(world)), src_rank=0)
    got, want = model(tokens, labels=tokens), ref(tokens, labels=tokens)
    got.loss.backward()
    want.loss.backward()
    out["olmo2_logits"] = (got.logits - want.logits).abs().max().item()
    out["olmo2_bad_grads"] = local_grad_mismatches(model, ref, rank)
    return out


@pytest.fixture(scope="module")
def plan_runs() -> list[dict[str, object]]:
    return run_distributed(_plans, 2, timeout=400)


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "gpt2", "bert", "opt", "distilbert", "vit",
                                  "gpt_neox"])
def test_planned_spec_equals_hand_written_and_unsharded(plan_runs, name):
    for out in plan_runs:
        result = out[name]
        assert "error" not in result, result
        assert result["same_as_hand"]
        assert result["logits"] < 1e-5
        got, want = result["loss"]
        assert got == pytest.approx(want, rel=1e-5)
        assert result["bad_grads"] == []
        assert result["sharded"], "the plan split nothing"


def test_qwen3_and_olmo2_plans_give_the_unsharded_logits(plan_runs):
    for out in plan_runs:
        assert out["qwen3_logits"] < 1e-5
        assert out["olmo2_logits"] < 1e-5


def test_qwen3_norm_gradients(plan_runs):
    for out in plan_runs:
        assert out["qwen3_bad_grads"] == []


def test_olmo2_gradients(plan_runs):
    for out in plan_runs:
        assert out["olmo2_bad_grads"] == []
