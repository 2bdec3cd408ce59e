"""Names of ``save_pretrained`` folders converted as ``from_pretrained`` converts them (one process, real files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import checkpoint  # noqa: E402
import sharded_tensor as st  # noqa: E402
from sharding import DevicePlacement  # noqa: E402


def _llama_config():  # type: ignore[no-untyped-def]
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2)


def _neox():  # type: ignore[no-untyped-def]
    config = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                        intermediate_size=64)
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(config)


def _zeros(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def test_the_base_models_prefix_is_dropped_or_added(tmp_path: Path):
    torch.manual_seed(0)
    head = transformers.LlamaForCausalLM(_llama_config())
    head.save_pretrained(tmp_path / "head")
    base = _zeros(transformers.LlamaModel(_llama_config()))
    checkpoint.load(base.state_dict(), tmp_path / "head", strict=False)  # lm_head.weight has no place here
    assert torch.equal(base.layers[0].mlp.up_proj.weight, head.model.layers[0].mlp.up_proj.weight)

    head.model.save_pretrained(tmp_path / "base")  # names without "model."
    again = _zeros(transformers.LlamaForCausalLM(_llama_config()))
    with pytest.raises(checkpoint.CheckpointError, match=r"missing=\['lm_head.weight'\] .*unexpected=\[\] "):
        checkpoint.load(again.state_dict(), tmp_path / "base")
    checkpoint.load(again.state_dict(), tmp_path / "base", strict=False)
    assert torch.equal(again.model.norm.weight, head.model.norm.weight)


def test_tensors_from_pretrained_skips_are_not_unexpected(tmp_path: Path):
    model = _neox()
    model.save_pretrained(tmp_path / "neox")
    file = tmp_path / "neox" / "model.safetensors"
    tensors = load_file(file)
    tensors["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)  # what older checkpoints hold
    save_file(tensors, file, metadata={"format": "pt"})
    target = _zeros(_neox())
    checkpoint.load(target.state_dict(), tmp_path / "neox")  # strict
    assert torch.equal(target.lm_head.weight, model.lm_head.weight)  # from embed_out.weight


def test_without_config_json_the_names_stay_as_saved(tmp_path: Path):
    _neox().save_pretrained(tmp_path / "neox")
    (tmp_path / "neox" / "config.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"missing=\['lm_head.weight'\] .*"
                                                         r"unexpected=\['embed_out.weight'\] "):
        checkpoint.load(_neox().state_dict(), tmp_path / "neox")


def test_an_untied_head_is_never_filled_from_the_embedding(tmp_path: Path):
    _neox().save_pretrained(tmp_path / "neox")
    target = _zeros(_neox())
    checkpoint.load(target.state_dict(), tmp_path / "neox", strict=False,
                    key_map=lambda name: None if name == "embed_out.weight" else name)
    assert not target.lm_head.weight.any()
    assert target.gpt_neox.embed_in.weight.any()


def test_a_tied_head_shares_the_embedding_and_is_not_read_twice(tmp_path: Path):
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    st.shard_model(model, DevicePlacement("cpu"), init=False)
    state = model.state_dict()
    assert "lm_head.weight" in state
    checkpoint.load(state, tmp_path / "gpt2")  # strict, though the folder has no lm_head.weight
    assert model.lm_head.weight is model.transformer.wte.weight
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


def test_parameters_filled_by_load_state_dict_count_as_filled(tmp_path: Path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    checkpoint.save({"1.weight": torch.ones(2, 4)}, tmp_path / "part")
    with torch.device("meta"):
        target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    st.shard_model(target, DevicePlacement("cpu"), init=False)
    with pytest.raises(checkpoint.CheckpointError, match=r"would leave 3 parameter\(s\) uninitialized: "
                                                         r"\['0.bias', '0.weight', '1.bias'\]"):
        checkpoint.load(target.state_dict(), tmp_path / "part", strict=False)
    target.load_state_dict(model.state_dict())
    checkpoint.load(target.state_dict(), tmp_path / "part", strict=False)  # the rest is filled now
    assert torch.equal(target[1].weight, torch.ones(2, 4)) and torch.equal(target[0].weight, model[0].weight)


def _mixtral():  # type: ignore[no-untyped-def]
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=3)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def test_per_expert_tensors_load_into_fused_experts_and_gaps_are_named(tmp_path: Path):
    model = _mixtral()
    model.save_pretrained(tmp_path / "mixtral")  # experts.N.w1/w2/w3 under block_sparse_moe
    file = tmp_path / "mixtral" / "model.safetensors"
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in load_file(file)
    target = _zeros(_mixtral())
    checkpoint.load(target.state_dict(), tmp_path / "mixtral")
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(target.model.layers[0].mlp.experts.gate_up_proj, experts.gate_up_proj)
    assert torch.equal(target.model.layers[0].mlp.experts.down_proj, experts.down_proj)

    tensors = load_file(file)
    del tensors["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(checkpoint.CheckpointError, match=r"gate_up_proj.*numbered \[0, 2\]; \[1\] are missing"):
        checkpoint.load(_zeros(_mixtral()).state_dict(), tmp_path / "mixtral")

    tensors["model.layers.0.block_sparse_moe.experts.1.w3.weight"] = torch.zeros(16, 32, dtype=torch.float16)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(checkpoint.CheckpointError, match=r"gate_up_proj' have different dtypes"):
        checkpoint.load(_zeros(_mixtral()).state_dict(), tmp_path / "mixtral")
