"""``checkpoint.load`` of ``save_pretrained`` folders loads what ``from_pretrained`` loads; 2 ranks, one spawn.

Each model is built on the meta device, sharded with ``st.tensor_parallel_spec`` and
``init=False``, then filled by ``checkpoint.load`` from a folder transformers'
``save_pretrained`` wrote; its logits equal ``from_pretrained``'s:

* GPT-NeoX: the folder names the output head ``embed_out.weight`` (the model: ``lm_head``);
* ViT: the folder uses the older names (``vit.encoder.layer.N.attention.attention.query``);
* GPT-2: ``lm_head.weight`` is tied to the embedding and absent from the folder; it is not
  reported missing, and stays the same memory as the embedding;
* Llama saved in bfloat16, loaded into float32 parameters with ``cast=True``.

And a load that would leave parameters allocated by ``init=False`` without values raises
naming them, with ``strict=False`` too, before reading anything; ``allow_uninitialized=True``
loads the rest, and a later load that fills the rest is accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import checkpoint  # noqa: E402
import sharded_tensor as st  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402
from tests.distributed.test_extension import ShardedConv1D  # noqa: E402

pytestmark = pytest.mark.distributed
VOCAB = 96


def _configs():  # type: ignore[no-untyped-def]
    import transformers as tf
    return {
        "gpt_neox": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                                                             num_hidden_layers=2, intermediate_size=128,
                                                             max_position_embeddings=64)),
        "vit": (tf.ViTForImageClassification, tf.ViTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                                            intermediate_size=128, image_size=8, patch_size=4,
                                                            num_labels=3)),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                                   bos_token_id=0, eos_token_id=0)),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=64)),
    }


def _inputs(name: str) -> dict[str, torch.Tensor]:
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))}
    return {"input_ids": torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))}


def _sharded(cls, config, world: int):  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        model = cls(config).eval()
    st.shard_model(model, st.tensor_parallel_spec(model, [f"rank:{r}/cpu" for r in range(world)]), init=False)
    return model


def _imports(rank: int, world: int, root: str) -> dict[str, object]:
    from transformers.pytorch_utils import Conv1D

    st.register_sharded_module(Conv1D, ShardedConv1D(), replace=True)
    out: dict[str, object] = {}
    refs = {}
    for name, (cls, config) in _configs().items():
        folder = str(Path(root) / name)
        model = _sharded(cls, config, world)
        if name == "llama":
            checkpoint.load(model.state_dict(), folder, cast=True)  # bfloat16 file, float32 model
            ref = refs[name] = cls.from_pretrained(folder, dtype=torch.float32).eval()
        else:
            checkpoint.load(model.state_dict(), folder)  # strict: nothing missing, nothing unexpected
            ref = cls.from_pretrained(folder).eval()
        with torch.no_grad():
            out[name] = (model(**_inputs(name)).logits - ref(**_inputs(name)).logits).abs().max().item()
        out[f"{name}_sharded"] = any(isinstance(v, st.ShardedTensor) for v in model.state_dict().values())
        if name == "gpt2":
            out["gpt2_tied"] = model.lm_head.weight is model.transformer.wte.weight

    # Leaving parameters unfilled: refused whatever strict says, before any byte is read.
    cls, config = _configs()["llama"]
    folder = str(Path(root) / "llama")
    model = _sharded(cls, config, world)
    norms = lambda k: None if "norm" in k else k  # noqa: E731 - drop every norm from the checkpoint
    for strict in (True, False):
        try:
            checkpoint.load(model.state_dict(), folder, cast=True, key_map=norms, strict=strict)
            out[f"unfilled_error_{strict}"] = None
        except checkpoint.CheckpointError as exc:
            out[f"unfilled_error_{strict}"] = (str(exc), exc.missing)
    q = model.model.layers[0].self_attn.q_proj.weight
    ref = refs["llama"]
    out["nothing_read"] = not torch.equal(q, ref.model.layers[0].self_attn.q_proj.weight[rank * 32:(rank + 1) * 32])
    checkpoint.load(model.state_dict(), folder, cast=True, key_map=norms, strict=False, allow_uninitialized=True)
    only_norms = lambda k: k if "norm" in k else None  # noqa: E731
    checkpoint.load(model.state_dict(), folder, cast=True, key_map=only_norms, strict=False)  # fills the rest
    with torch.no_grad():
        out["two_loads"] = (model(**_inputs("llama")).logits - ref(**_inputs("llama")).logits).abs().max().item()
    return out


@pytest.fixture(scope="module")
def import_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    root = tmp_path_factory.mktemp("pretrained")
    for name, (cls, config) in _configs().items():
        torch.manual_seed(0)
        model = cls(config)
        if name == "llama":
            model = model.to(torch.bfloat16)
        model.save_pretrained(root / name, max_shard_size="60KB")
    return run_distributed(_imports, 2, str(root), timeout=300)


def test_save_pretrained_folders_have_the_legacy_names_and_lack_the_tied_head(tmp_path):
    from safetensors import safe_open
    cls, config = _configs()["gpt_neox"]
    cls(config).save_pretrained(tmp_path / "neox")
    cls, config = _configs()["gpt2"]
    cls(config).save_pretrained(tmp_path / "gpt2")
    with safe_open(str(tmp_path / "neox" / "model.safetensors"), "pt") as f:
        assert "embed_out.weight" in f.keys() and "lm_head.weight" not in f.keys()
    with safe_open(str(tmp_path / "gpt2" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()


@pytest.mark.parametrize("name", ["gpt_neox", "vit", "gpt2", "llama"])
def test_import_gives_the_logits_of_from_pretrained(import_runs, name):
    for out in import_runs:
        assert out[name] < 1e-5
        assert out[f"{name}_sharded"]


def test_tied_head_stays_tied(import_runs):
    for out in import_runs:
        assert out["gpt2_tied"]


def test_unfilled_parameters_are_refused_whatever_strict_says(import_runs):
    for out in import_runs:
        for strict in (True, False):
            error = out[f"unfilled_error_{strict}"]
            assert error is not None
            msg, missing = error
            assert "would leave 5 parameter(s) uninitialized" in msg
            assert "'model.layers.0.input_layernorm.weight'" in msg and "allow_uninitialized=True" in msg
            assert missing == [f"model.layers.{i}.{norm}.weight" for i in range(2)
                               for norm in ("input_layernorm", "post_attention_layernorm")] + ["model.norm.weight"]
        assert out["nothing_read"]
        assert out["two_loads"] < 1e-5
