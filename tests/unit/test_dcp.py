"""DCP folders in one process: load reads them when named (from_format="dcp"); convert and the CLI go both ways."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import checkpoint
from checkpoint._cli import main


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(5, 4, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16)},
            "optim": {"state": {"w": {"step": torch.tensor(4.0), "exp_avg": torch.randn(5, 4, generator=g)}},
                      "param_groups": [{"lr": 0.5, "betas": (0.9, 0.99), "params": ["w"]}]},
            "epoch": 3}


def _dcp_save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def test_load_reads_a_dcp_folder_and_fills_every_kind_of_entry(tmp_path: Path):
    state = _state()
    _dcp_save(state, tmp_path / "dcp")
    target = {"model": {"w": torch.zeros(5, 4), "b": None},
              "optim": {"state": {"w": {"step": 0, "exp_avg": torch.zeros(5, 4)}}, "param_groups": None},
              "epoch": 0}
    w = target["model"]["w"]
    checkpoint.load(target, tmp_path / "dcp", from_format="dcp")
    assert target["model"]["w"] is w and torch.equal(w, state["model"]["w"])
    assert torch.equal(target["model"]["b"], state["model"]["b"]) and target["model"]["b"].dtype == torch.bfloat16
    assert target["optim"]["state"]["w"]["step"] == 4 and isinstance(target["optim"]["state"]["w"]["step"], int)
    assert torch.equal(target["optim"]["state"]["w"]["exp_avg"], state["optim"]["state"]["w"]["exp_avg"])
    assert target["optim"]["param_groups"] == [{"lr": 0.5, "betas": (0.9, 0.99), "params": ["w"]}]
    assert target["epoch"] == 3


def test_dcp_mismatches_are_clear(tmp_path: Path):
    _dcp_save(_state(), tmp_path / "dcp")
    with pytest.raises(checkpoint.CheckpointError, match=r"missing=\['extra'\].*unexpected=\['epoch'"):
        checkpoint.load({"extra": None, "model": {"w": None, "b": None}}, tmp_path / "dcp", from_format="dcp")
    with pytest.raises(checkpoint.CheckpointError, match=r"'model.w' .* size \(5, 4\).* size \(4, 5\)"):
        checkpoint.load({"model": {"w": torch.zeros(4, 5)}}, tmp_path / "dcp", strict=False, from_format="dcp")
    with pytest.raises(checkpoint.CheckpointError, match="pass cast=True"):
        checkpoint.load({"model": {"w": torch.zeros(5, 4, dtype=torch.float64)}}, tmp_path / "dcp", strict=False,
                        from_format="dcp")


def test_cli_convert_both_ways(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    state = _state()
    _dcp_save(state, tmp_path / "dcp")
    assert main(["convert", "--from", "dcp", str(tmp_path / "dcp"), str(tmp_path / "ckpt")]) == 0
    meta = checkpoint.read_metadata(tmp_path / "ckpt")
    assert sorted(meta.tensors) == ["model.b", "model.w", "optim.state.w.exp_avg", "optim.state.w.step"]
    assert meta.values == {"epoch": 3, "optim.param_groups": [{"lr": 0.5, "betas": [0.9, 0.99], "params": ["w"]}]}
    full = checkpoint.load({name: None for name in meta.tensors}, tmp_path / "ckpt", strict=False)
    assert torch.equal(full["model.w"], state["model"]["w"]) and torch.equal(full["model.b"], state["model"]["b"])

    assert main(["convert", "--from", "dcp", "--to", "safetensors", str(tmp_path / "dcp"),
                 str(tmp_path / "m.safetensors")]) == 0
    flat = load_file(str(tmp_path / "m.safetensors"))
    assert torch.equal(flat["optim.state.w.exp_avg"], state["optim"]["state"]["w"]["exp_avg"])

    assert main(["convert", "--to", "dcp", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    assert "wrote" in capsys.readouterr().out
    back = {"model": {"w": torch.zeros(5, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}, "epoch": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "back")), no_dist=True)
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["epoch"] == 3


def test_convert_refuses_unsupported_pairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(ValueError, match="use checkpoint.consolidate"):
        checkpoint.convert(tmp_path, tmp_path / "x", to_format="safetensors")
    assert main(["convert", "--from", "dcp", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 1
    assert "error" in capsys.readouterr().err


def test_convert_infers_the_source_and_the_cli_agrees(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``convert(src, dst)`` with its defaults used to raise for every source while the CLI wrote a DCP
    folder; now both infer the source (shardkit or Hugging Face, never DCP) and pick the same target."""
    import safetensors.torch

    state = {"w": torch.arange(20.0).reshape(5, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
    checkpoint.save({**state, "epoch": 2}, tmp_path / "ck", quiet=True)
    (tmp_path / "hf").mkdir()
    safetensors.torch.save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    _dcp_save(state, tmp_path / "dcp")

    checkpoint.convert(tmp_path / "ck", tmp_path / "api-from-ck")  # shardkit -> DCP
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "cli-from-ck")]) == 0
    assert "(dcp)" in capsys.readouterr().out
    for out in ("api-from-ck", "cli-from-ck"):
        back = checkpoint.load({"w": None, "b": None, "epoch": None}, tmp_path / out, from_format="dcp")
        assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"]) and back["epoch"] == 2

    checkpoint.convert(tmp_path / "hf", tmp_path / "api-from-hf")  # Hugging Face -> shardkit
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "cli-from-hf")]) == 0
    assert "(shardkit)" in capsys.readouterr().out
    for out in ("api-from-hf", "cli-from-hf"):
        back = checkpoint.load({"w": None, "b": None}, tmp_path / out)
        assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])

    with pytest.raises(FileNotFoundError, match=r"from_format='dcp'"):  # never inferred: it is a pickle
        checkpoint.convert(tmp_path / "dcp", tmp_path / "never")
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "never")]) == 1
    assert "from_format='dcp'" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    checkpoint.convert(tmp_path / "dcp", tmp_path / "api-from-dcp", from_format="dcp")  # DCP -> shardkit
    back = checkpoint.load({"w": None, "b": None}, tmp_path / "api-from-dcp")
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])


def test_every_source_fills_the_same_targets_alike(tmp_path: Path):
    """One fill path for every format: a sharded target, a None entry, a Python number and a 0-d
    tensor come out the same from a shardkit, a Hugging Face and a DCP folder, bit for bit; and so do
    the mismatch errors."""
    import safetensors.torch

    import sharded_tensor as st
    from sharding import single_split

    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(7, 6, generator=g), "b": torch.randn(6, generator=g).to(torch.bfloat16),
             "s": torch.tensor(3.5)}
    checkpoint.save(state, tmp_path / "ck", quiet=True)
    (tmp_path / "hf").mkdir()
    safetensors.torch.save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    _dcp_save(state, tmp_path / "dcp")
    for folder, fmt in (("ck", None), ("hf", None), ("dcp", "dcp"), ("ck", "shardkit"), ("hf", "huggingface")):
        w = st.zeros(7, 6, sharding_spec=single_split(1, ["rank:0/cpu"] * 3))
        out = checkpoint.load({"w": w, "b": None, "s": 0.0}, tmp_path / folder, from_format=fmt)
        full = torch.cat([s.tensor for s in w.local_shards()], dim=1)
        assert torch.equal(full, state["w"]), folder
        assert out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], state["b"]), folder
        assert out["s"] == 3.5 and isinstance(out["s"], float), folder
        with pytest.raises(checkpoint.CheckpointError, match=r"missing=\['x'\].*unexpected=\['s'\]"):
            checkpoint.load({"w": None, "b": None, "x": None}, tmp_path / folder, from_format=fmt)
        with pytest.raises(checkpoint.CheckpointError, match=r"tensor 'w' in .* has size \(7, 6\).*\(6, 7\)"):
            checkpoint.load({"w": torch.zeros(6, 7)}, tmp_path / folder, strict=False, from_format=fmt)
    with pytest.raises(FileNotFoundError, match="no Hugging Face checkpoint"):
        checkpoint.load({"w": None}, tmp_path / "ck", strict=False, from_format="huggingface")


def test_verify_and_inspect_go_through_the_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """The CLI's inspect and verify open a checkpoint like load does: a Hugging Face folder is inspected
    and verified (headers and sizes); a DCP folder is not opened unless named; DCP's own verify reads it."""
    import safetensors.torch

    from checkpoint._dcp import DcpSource

    state = {"w": torch.arange(20.0).reshape(5, 4)}
    (tmp_path / "hf").mkdir()
    safetensors.torch.save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    assert main(["inspect", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "Hugging Face safetensors" in out and re.search(r"\nw +float32 +\(5, 4\)", out), out
    assert main(["verify", "-q", str(tmp_path / "hf")]) == 0
    assert "1 tensors" in capsys.readouterr().out
    raw = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (tmp_path / "hf" / "model.safetensors").write_bytes(raw[:-8])
    assert main(["verify", "-q", str(tmp_path / "hf")]) == 1
    assert "model.safetensors" in capsys.readouterr().err

    _dcp_save(state, tmp_path / "dcp")
    assert main(["verify", "-q", str(tmp_path / "dcp")]) == 1
    assert "from_format='dcp'" in capsys.readouterr().err
    with DcpSource(tmp_path / "dcp") as source:
        assert source.verify() == []
    data = next((tmp_path / "dcp").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with DcpSource(tmp_path / "dcp") as source:
        problems = source.verify()
    assert len(problems) == 1 and "tensor 'w' cannot be read" in problems[0]


def test_the_cli_help_says_dcp_metadata_is_a_pickle_read_restricted(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "only with --from dcp" in text and ".metadata file is a pickle" in text
    assert "restricted unpickler that admits DCP's own metadata classes only" in text
