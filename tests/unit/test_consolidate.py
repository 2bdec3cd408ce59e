"""consolidate: single safetensors file and Hugging Face style folder, round trips and failures."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file

import checkpoint
import sharded_tensor as st
from checkpoint import _consolidate
from checkpoint._consolidate import INDEX_FILE, VALUES_KEY, parse_size
from sharding import DevicePlacement, mesh, single_split

R0 = "rank:0/cpu"


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "emb.weight": torch.randn(10, 6, generator=g),
        "fc.weight": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "fc.bias": torch.randn(9, generator=g),
        "grid": torch.randint(-50, 50, (4, 8), generator=g, dtype=torch.int32),
        "mask": torch.rand(7, 3, generator=g) > 0.5,
        "cube": torch.randn(4, 3, 6, generator=g, dtype=torch.float64),
        "scale": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "replica": torch.randn(3, 3, generator=g),
    }


def _specs() -> dict[str, object]:
    return {
        "emb.weight": single_split(0, [R0] * 4),           # row blocks 3/3/3/1: streamed
        "fc.weight": single_split(1, [R0] * 3),            # column blocks: assembled
        "grid": mesh([[R0, R0], [R0, R0]]),                # 2x2 blocks: assembled
        "mask": single_split(0, [R0] * 2),
        "cube": single_split(1, [R0] * 2),
        "replica": DevicePlacement("cpu"),
    }


def _state_dict() -> dict[str, object]:
    full, specs = _full(), _specs()
    sd: dict[str, object] = {name: st.shard_tensor(t, specs[name]) if name in specs else t for name, t in full.items()}
    sd["step"] = 12
    sd["optim"] = {"lr": 0.01, "betas": [0.9, 0.999], "name": "adamw", "nesterov": False, "eps": None}
    return sd


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    checkpoint.save(_state_dict(), str(path))
    return path


def _assert_equal(got: dict[str, torch.Tensor], names: list[str] | None = None) -> None:
    full = _full()
    names = list(full) if names is None else names
    assert sorted(got) == sorted(names)
    for name in names:
        assert got[name].dtype == full[name].dtype, name
        assert got[name].shape == full[name].shape, name
        assert torch.equal(got[name], full[name]), name


def test_single_file_round_trip(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    assert checkpoint.consolidate(str(saved), str(out)) is None
    _assert_equal(load_file(str(out)))
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        assert list(f.keys()) == sorted(_full())
    assert meta["format"] == "pt"
    assert json.loads(meta[VALUES_KEY]) == {"step": 12, "optim.lr": 0.01, "optim.betas": [0.9, 0.999],
                                             "optim.name": "adamw", "optim.nesterov": False, "optim.eps": None}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def test_existing_folder_receives_model_safetensors(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    checkpoint.consolidate(saved, out)
    _assert_equal(load_file(str(out / "model.safetensors")))


@pytest.mark.parametrize("limit", [pytest.param(1, id="one-tensor-per-file"), pytest.param(300, id="300B"),
                                   pytest.param("1MB", id="everything-in-one")])
def test_sharded_folder_round_trip(saved: Path, tmp_path: Path, limit: int | str) -> None:
    out = tmp_path / "hf"
    checkpoint.consolidate(str(saved), str(out), max_shard_size=limit)
    index = json.loads((out / INDEX_FILE).read_text())
    full = _full()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in full.values())
    assert index["metadata"][VALUES_KEY]["step"] == 12
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert files == [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, INDEX_FILE])
    got: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(str(out / file))
        assert {index["weight_map"][n] for n in part} == {file}
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= parse_size(limit) or len(part) == 1, (file, size)
        got.update(part)
    _assert_equal(got)
    if limit == 1:
        assert count == len(full)
    if limit == "1MB":
        assert count == 1


def test_memory_filesystem_in_and_out() -> None:
    fs = fsspec.filesystem("memory")
    checkpoint.save(_state_dict(), "memory://consolidate-test/ckpt")
    try:
        checkpoint.consolidate("memory://consolidate-test/ckpt", "memory://consolidate-test/model.safetensors")
        _assert_equal(load(fs.cat_file("/consolidate-test/model.safetensors")))
        checkpoint.consolidate("memory://consolidate-test/ckpt", "memory://consolidate-test/hf", max_shard_size=200)
        index = json.loads(fs.cat_file(f"/consolidate-test/hf/{INDEX_FILE}"))
        got: dict[str, torch.Tensor] = {}
        for file in set(index["weight_map"].values()):
            got.update(load(fs.cat_file(f"/consolidate-test/hf/{file}")))
        _assert_equal(got)
    finally:
        fs.rm("/consolidate-test", recursive=True)


def test_memory_is_about_one_output_tensor(saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row blocks stream through a fixed chunk; other layouts reuse one full-size buffer."""
    allocated: list[int] = []
    real_empty = torch.empty

    def empty(*size: object, **kwargs: object) -> torch.Tensor:
        tensor = real_empty(*size, **kwargs)  # type: ignore[call-overload]
        allocated.append(tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(_consolidate.torch, "empty", empty)
    checkpoint.consolidate(str(saved), str(tmp_path / "m.safetensors"))
    monkeypatch.undo()
    full = _full()
    assembled = [full[n].numel() * full[n].element_size() for n in ("fc.weight", "grid", "cube")]
    # The largest buffer is the largest assembled tensor (4x3x6 float64); buffers only grow,
    # so all allocations together stay under twice (full buffer + region buffer) of it.
    assert max(allocated) == max(assembled)
    assert sum(allocated) <= 4 * max(assembled)


@pytest.mark.parametrize(("text", "expected"), [
    pytest.param(1000, 1000, id="int"),
    pytest.param("5GB", 5 * 10**9, id="GB"),
    pytest.param("500MB", 500 * 10**6, id="MB"),
    pytest.param("2GiB", 2 * 2**30, id="GiB"),
    pytest.param("1.5kb", 1500, id="fraction-lowercase"),
    pytest.param("64", 64, id="bare-number"),
    pytest.param(" 3 MiB ", 3 * 2**20, id="spaces"),
])
def test_parse_size(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", [0, -5, "5 parsecs", "GB", "", True, 1.5])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="is not a positive size"):
        parse_size(bad)  # type: ignore[arg-type]


def _flip_data_byte(path: Path, tensor: str) -> Path:
    """Flip one byte inside ``tensor``'s first saved region; return the data file."""
    shard = checkpoint.read_metadata(str(path)).tensors[tensor].shards[0]
    file = path / shard.file
    data = bytearray(file.read_bytes())
    data[shard.byte_range[0]] ^= 0xFF
    file.write_bytes(bytes(data))
    return file


@pytest.mark.parametrize("tensor", ["emb.weight", "fc.weight"])  # streamed, assembled
@pytest.mark.parametrize("limit", [None, 100])
def test_corrupt_region_fails_and_leaves_no_output(saved: Path, tmp_path: Path, tensor: str,
                                                   limit: int | None) -> None:
    file = _flip_data_byte(saved, tensor)
    out = tmp_path / ("hf" if limit else "model.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch") as info:
        checkpoint.consolidate(str(saved), str(out), max_shard_size=limit)
    assert str(file) in str(info.value) and repr(tensor) in str(info.value)
    leftovers = [p.name for p in (out.iterdir() if out.is_dir() else [out] if out.exists() else [])]
    assert leftovers == []
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_missing_data_file(saved: Path, tmp_path: Path) -> None:
    name = checkpoint.read_metadata(str(saved)).tensors["emb.weight"].shards[0].file
    (saved / name).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="is missing") as info:
        checkpoint.consolidate(str(saved), str(tmp_path / "m.safetensors"))
    assert name in str(info.value)
    assert not (tmp_path / "m.safetensors").exists()


def test_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no shardkit checkpoint"):
        checkpoint.consolidate(str(tmp_path / "nothing"), str(tmp_path / "m.safetensors"))


def test_bad_max_shard_size_is_checked_before_reading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_shard_size='lots'"):
        checkpoint.consolidate(str(tmp_path / "nothing"), str(tmp_path / "out"), max_shard_size="lots")
