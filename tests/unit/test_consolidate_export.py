"""Model-only export from a training checkpoint: ``consolidate(include=..., strip_prefix=...)`` and the CLI flags.

A training checkpoint holds ``{"model": ..., "optim": ..., "step": ...}``; the export must
hold exactly the model's tensors under the model's own names, so that
``load_state_dict(strict=True)`` and ``transformers``' ``from_pretrained`` accept it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import checkpoint
import sharded_tensor as st
from checkpoint._cli import main
from checkpoint._consolidate import INDEX_FILE, VALUES_KEY
from sharding import composite, single_split

R0 = "rank:0/cpu"


def _trained(tmp_path: Path) -> tuple[nn.Module, str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
    model_ema = nn.Sequential(nn.Linear(2, 2))
    st.shard_model(model, composite(**{"0.weight": single_split(0, [R0, R0]), "1.weight": single_split(1, [R0] * 3)}))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.arange(5)).sum().backward()
    optim.step()
    path = str(tmp_path / "ckpt")
    checkpoint.save({**st.get_state_dict(model, optim), "model_ema": model_ema.state_dict(), "step": 1,
                     "data": {"epoch": 0}}, path)
    return model, path


def _plain(model: nn.Module) -> nn.Module:
    fresh = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    return fresh


def _expected(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (v.full_tensor() if isinstance(v, st.ShardedTensor) else v) for name, v in model.state_dict().items()}


@pytest.mark.parametrize("include", [pytest.param("model", id="prefix"), pytest.param("model.", id="dotted"),
                                     pytest.param(["model"], id="list"),
                                     pytest.param(lambda name: name.startswith("model."), id="predicate")])
def test_single_file_export_loads_strictly(tmp_path: Path, include: object) -> None:
    model, path = _trained(tmp_path)
    out = tmp_path / "model.safetensors"
    checkpoint.consolidate(path, out, include=include, strip_prefix="model")
    weights = load_file(out)
    expected = _expected(model)
    assert sorted(weights) == sorted(expected)  # not model_ema.*, not optim.*
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name
    with safe_open(out, "pt") as f:
        assert VALUES_KEY not in (f.metadata() or {})  # the step and the optimizer's hyper-parameters stay out
    fresh = _plain(model)
    fresh.load_state_dict(weights, strict=True)
    assert all(torch.equal(fresh.state_dict()[n], v) for n, v in expected.items())


def test_folder_export_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, path = _trained(tmp_path)
    folder = tmp_path / "hf"
    assert main(["consolidate", path, str(folder), "--max-shard-size", "600B", "--include", "model",
                 "--strip-prefix", "model", "--quiet"]) == 0
    index = json.loads((folder / INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(_expected(model))
    assert VALUES_KEY not in index["metadata"]
    weights = {}
    for name in sorted(set(index["weight_map"].values())):
        weights.update(load_file(folder / name))
    _plain(model).load_state_dict(weights, strict=True)

    # Several prefixes, values renamed along with the tensors.
    out = tmp_path / "two.safetensors"
    assert main(["consolidate", path, str(out), "--include", "optim", "--include", "step", "-q"]) == 0
    with safe_open(out, "pt") as f:
        names = set(f.keys())
        values = json.loads(f.metadata()[VALUES_KEY])
    assert names and all(n.startswith("optim.state.") for n in names)
    assert values["step"] == 1 and "data.epoch" not in values and values["optim.param_groups"][0]["lr"] == 0.01


@pytest.mark.parametrize(("kwargs", "message"), [
    pytest.param({"include": "modle"}, r"include='modle' selects none of the \d+ tensors of checkpoint .*; its names "
                                       r"start with \['data', 'model', 'model_ema', 'optim', 'step'\]", id="typo"),
    pytest.param({"include": "mod"}, r"selects none", id="partial-component"),
    pytest.param({"include": "step"}, r"include='step' selects none of the", id="only-values"),
    pytest.param({"include": "model", "strip_prefix": "optim"}, r"strip_prefix='optim' begins none of the 3 "
                                                                r"selected tensor names", id="strip-nothing"),
    pytest.param({"include": ["model", "model_ema"], "strip_prefix": ""}, r"strip_prefix='': expected a non-empty",
                 id="empty-strip"),
    pytest.param({"include": []}, r"expected a non-empty name prefix", id="empty-include"),
])
def test_bad_selection_is_refused_before_writing(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    _, path = _trained(tmp_path)
    out = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match=message):
        checkpoint.consolidate(path, out, **kwargs)
    assert not out.exists()


def test_strip_prefix_collision_names_both(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    checkpoint.save({"model": {"w": torch.ones(2)}, "w": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match=r"gives tensors 'model.w' and 'w' the same name 'w'|"
                                         r"gives tensors 'w' and 'model.w' the same name 'w'"):
        checkpoint.consolidate(path, tmp_path / "out.safetensors", strip_prefix="model")


def test_cli_reports_a_bad_include(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, path = _trained(tmp_path)
    assert main(["consolidate", path, str(tmp_path / "o.safetensors"), "--include", "nothing"]) == 1
    assert "include=['nothing'] selects none" in capsys.readouterr().err


@pytest.mark.slow  # fresh interpreters
def test_transformers_from_pretrained_accepts_the_export(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    optim.step()
    path = str(tmp_path / "ckpt")
    checkpoint.save({**st.get_state_dict(model, optim), "step": 1}, path)

    folder = tmp_path / "hf"
    checkpoint.consolidate(path, folder, max_shard_size="20KB", include="model", strip_prefix="model")
    config.save_pretrained(folder)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder)
    expected = model.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name
    ids = torch.arange(6)[None]
    assert torch.equal(loaded.eval()(ids).logits, model.eval()(ids).logits)
