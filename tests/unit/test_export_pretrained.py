"""A training run to a folder ``from_pretrained`` loads, in one call: ``consolidate(manager, ..., config=)``.

A real ``CheckpointManager`` holds ``{"model": ..., "optim": ..., "step": ...}`` steps of a
Llama (and a GPT-2) trained a little; the export of a step gives the logits of the model at
that step through transformers' own ``from_pretrained``, with the config and generation config
written beside the weights, from the Python API and from the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import checkpoint  # noqa: E402
import sharded_tensor as st  # noqa: E402
from checkpoint._cli import main  # noqa: E402

VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))


def _llama_config():  # type: ignore[no-untyped-def]
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    bos_token_id=1, eos_token_id=2)


def _train(model, manager, steps):  # type: ignore[no-untyped-def]
    """Train, saving every step; returns the logits after each step."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits = {}
    for step in steps:
        optim.zero_grad()
        model(TOKENS, labels=TOKENS).loss.backward()
        optim.step()
        manager.save(step, {"model": model.state_dict(), "optim": st.get_state_dict(model, optim)["optim"],
                            "step": step})
        with torch.no_grad():
            logits[step] = model(TOKENS).logits
    return logits


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("run")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_llama_config())
    st.shard_model(model, st.tensor_parallel_spec(model, ["rank:0/cpu"]), seed=0)
    manager = checkpoint.CheckpointManager(root / "ckpts")
    return model, manager, _train(model, manager, [10, 20]), root


def _logits(folder: Path) -> torch.Tensor:
    again = transformers.LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return again(TOKENS).logits


def test_latest_step_of_a_manager_in_one_call(run):
    model, manager, logits, root = run
    out = root / "latest"
    checkpoint.consolidate(manager, out, include="model", strip_prefix="model", config=model)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert torch.allclose(_logits(out), logits[20], atol=1e-6)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 32
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1 and generation["eos_token_id"] == 2


def test_a_chosen_step_from_the_managers_root_with_a_config_object_and_shards(run):
    model, _, logits, root = run
    out = root / "step10"
    checkpoint.consolidate(root / "ckpts", out, step=10, max_shard_size="20KB", include="model",
                           strip_prefix="model", config=model.config)
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and "config.json" in names and "generation_config.json" in names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1
    assert torch.allclose(_logits(out), logits[10], atol=1e-6)
    assert not torch.allclose(logits[10], logits[20], atol=1e-3)  # the step matters


def test_the_command_line_copies_a_pretrained_folders_config(run, capsys):
    model, _, logits, root = run
    pretrained = root / "pretrained"
    model.config.save_pretrained(pretrained)
    model.generation_config.save_pretrained(pretrained)
    out = root / "cli"
    assert main(["consolidate", str(root / "ckpts"), str(out), "--include", "model", "--strip-prefix", "model",
                 "--config", str(pretrained), "--step", "20", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "config.json" in printed and "generation_config.json" in printed
    assert (out / "config.json").read_bytes() == (pretrained / "config.json").read_bytes()
    assert torch.allclose(_logits(out), logits[20], atol=1e-6)


def test_a_model_that_does_not_generate_gets_no_generation_config(tmp_path):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4)
    model = transformers.BertForMaskedLM(config)
    checkpoint.save({"model": model.state_dict()}, tmp_path / "ckpt")
    checkpoint.consolidate(tmp_path / "ckpt", tmp_path / "out", include="model", strip_prefix="model", config=model)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    again = transformers.BertForMaskedLM.from_pretrained(tmp_path / "out").eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(again(TOKENS).logits, model(TOKENS).logits)


def test_bad_exports_are_refused_before_writing(run, tmp_path):
    _, manager, _, root = run
    with pytest.raises(FileNotFoundError, match=r"step 15 is not a committed step .*\[10, 20\]"):
        checkpoint.consolidate(manager, tmp_path / "a", step=15, config=tmp_path)
    with pytest.raises(ValueError, match=r"is one checkpoint, not a CheckpointManager's root; drop step=10"):
        checkpoint.consolidate(manager.path(10) if hasattr(manager, "path") else root / "ckpts" / "step-0000000010",
                               tmp_path / "b", step=10)
    with pytest.raises(FileNotFoundError, match=r"config=.* holds no config.json"):
        checkpoint.consolidate(manager, tmp_path / "c", config=tmp_path)
    with pytest.raises(TypeError, match=r"config must be a transformers config"):
        checkpoint.consolidate(manager, tmp_path / "d", config={"hidden_size": 3})
    with pytest.raises(ValueError, match=r"step=-1 must be a non-negative int"):
        checkpoint.consolidate(manager, tmp_path / "e", step=-1)
    assert not any((tmp_path / n).exists() for n in "abcde")
    assert main(["consolidate", str(root / "ckpts"), str(tmp_path / "f"), "--step", "15"]) == 1
