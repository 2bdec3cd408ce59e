"""``checkpoint.load(..., mmap=True)``: blocks contiguous in a local file map its pages instead of copying."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import checkpoint
from checkpoint import CheckpointError


def _mapped(tensor: torch.Tensor, file: str) -> bool:
    """Whether ``tensor`` lives in a mapping of the whole ``file`` (its storage is the file's size)."""
    return tensor.untyped_storage().nbytes() == os.path.getsize(file)


@pytest.fixture
def hf_file(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {"weight": torch.randn(64, 32, generator=g), "bias": torch.randn(64, generator=g),
               "half": torch.randn(10, 3, generator=g).to(torch.bfloat16)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    return path, tensors


def test_parameters_map_the_file_and_training_never_writes_it(hf_file):
    path, saved = hf_file
    before = open(path, "rb").read()
    layer = torch.nn.Linear(32, 64)
    checkpoint.load(layer.state_dict(keep_vars=True), path, strict=False, mmap=True)
    assert _mapped(layer.weight, path) and _mapped(layer.bias, path)
    assert torch.equal(layer.weight, saved["weight"]) and torch.equal(layer.bias, saved["bias"])
    assert isinstance(layer.weight, torch.nn.Parameter) and layer.weight.requires_grad
    optim = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(torch.ones(2, 32)).sum().backward()
    optim.step()
    assert not torch.equal(layer.weight, saved["weight"])  # the step changed the parameter ...
    assert open(path, "rb").read() == before                # ... and never the file


def test_a_block_another_tensor_shares_is_copied(hf_file):
    path, saved = hf_file
    layer = torch.nn.Linear(32, 64)
    state = layer.state_dict()  # detached tensors sharing the parameters' memory
    checkpoint.load(state, path, strict=False, mmap=True)
    assert not _mapped(layer.weight, path) and not _mapped(state["weight"], path)
    assert torch.equal(layer.weight, saved["weight"])  # the model sees the values


def test_cast_and_column_blocks_are_copied(hf_file, tmp_path):
    path, saved = hf_file
    target = {"half": torch.empty(10, 3)}
    checkpoint.load(target, path, strict=False, cast=True, mmap=True)
    assert not _mapped(target["half"], path)
    assert torch.equal(target["half"], saved["half"].float())

    import sharded_tensor as st
    from sharding import single_split
    columns = st.empty(64, 32, sharding_spec=single_split(1, ["rank:0/cpu", "rank:0/cpu"]))
    checkpoint.load({"weight": columns}, path, strict=False, mmap=True)
    for shard in columns.local_shards():
        assert not _mapped(shard.tensor, path)
        assert torch.equal(shard.tensor, saved["weight"][:, shard.metadata.offsets[1]:][:, :16])
    rows = st.empty(64, 32, sharding_spec=single_split(0, ["rank:0/cpu", "rank:0/cpu"]))
    checkpoint.load({"weight": rows}, path, strict=False, mmap=True)
    for shard in rows.local_shards():
        assert _mapped(shard.tensor, path)  # a row block is one contiguous range
        assert torch.equal(shard.tensor, saved["weight"][shard.metadata.offsets[0]:][:32])


def test_shardkit_checkpoints_map_after_their_checksums_pass(tmp_path):
    folder = tmp_path / "ckpt"
    w = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    checkpoint.save({"w": w, "step": 3}, folder)
    target = {"w": torch.empty(64, 64), "step": 0}
    checkpoint.load(target, folder, mmap=True)
    region = checkpoint.read_metadata(folder).tensors["w"].shards[0]
    data = str(folder / region.file)
    assert _mapped(target["w"], data) and torch.equal(target["w"], w) and target["step"] == 3
    raw = bytearray(open(data, "rb").read())
    raw[region.byte_range[0] + 100] ^= 0xFF
    open(data, "wb").write(bytes(raw))
    fresh = {"w": torch.zeros(64, 64), "step": 0}
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        checkpoint.load(fresh, folder, mmap=True)
    assert not _mapped(fresh["w"], data) and not fresh["w"].any()  # corrupt bytes never arrive


def test_other_file_systems_copy(hf_file):
    path, saved = hf_file
    url = "memory://mmap-test/model.safetensors"
    with open(path, "rb") as src:
        import fsspec
        fsspec.filesystem("memory").pipe(url, src.read())
    layer = torch.nn.Linear(32, 64)
    checkpoint.load(layer.state_dict(keep_vars=True), url, strict=False, mmap=True)
    assert torch.equal(layer.weight, saved["weight"])
    assert layer.weight.untyped_storage().nbytes() == 64 * 32 * 4
