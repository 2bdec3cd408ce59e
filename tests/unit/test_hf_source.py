"""Hugging Face safetensors checkpoints read by ``checkpoint.load`` in one process."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import checkpoint
import sharded_tensor as st
from sharding import single_split

TENSORS = {"a.weight": torch.arange(24.0).reshape(6, 4), "b": torch.arange(5, dtype=torch.int64)}


def _folder(tmp_path: Path) -> Path:
    """Two files and an index, as ``save_pretrained(max_shard_size=...)`` writes them."""
    save_file({"a.weight": TENSORS["a.weight"]}, tmp_path / "model-00001-of-00002.safetensors", {"format": "pt"})
    save_file({"b": TENSORS["b"]}, tmp_path / "model-00002-of-00002.safetensors", {"format": "pt"})
    index = {"metadata": {"total_size": 136}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                                              "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


def test_folder_with_index_loads_into_tensors_and_sharded_tensors(tmp_path):
    folder = _folder(tmp_path)
    sd = {"a.weight": st.empty(6, 4, sharding_spec=single_split(0, ["rank:0/cpu"])),
          "b": torch.empty(5, dtype=torch.int64)}
    checkpoint.load(sd, folder)
    assert torch.equal(sd["a.weight"].local_shard(), TENSORS["a.weight"])
    assert torch.equal(sd["b"], TENSORS["b"])


def test_single_file_cast_and_key_map(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"w": TENSORS["a.weight"].to(torch.bfloat16)}, path)
    sd = {"model.w": torch.empty(6, 4)}
    with pytest.raises(checkpoint.CheckpointError, match=r"has dtype torch.bfloat16.*pass cast=True"):
        checkpoint.load(sd, path, key_map=lambda k: "model." + k)
    checkpoint.load(sd, path, key_map=lambda k: "model." + k, cast=True)
    assert torch.equal(sd["model.w"], TENSORS["a.weight"])  # small integers are exact in bfloat16
    sd = {"renamed": torch.empty(6, 4, dtype=torch.bfloat16)}
    checkpoint.load(sd, path, key_map={"w": "renamed"})
    assert torch.equal(sd["renamed"].float(), TENSORS["a.weight"])


def test_missing_unexpected_and_shape_errors(tmp_path):
    folder = _folder(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=r"missing=\['c'\].*unexpected=\['b'\]"):
        checkpoint.load({"a.weight": torch.empty(6, 4), "c": torch.empty(1)}, folder)
    with pytest.raises(checkpoint.CheckpointError, match=r"'a.weight'.* has size \(6, 4\), but the state_dict's"):
        checkpoint.load({"a.weight": torch.empty(4, 6)}, folder, strict=False)
    sd = {"a.weight": torch.empty(6, 4)}
    checkpoint.load(sd, folder, strict=False)
    assert torch.equal(sd["a.weight"], TENSORS["a.weight"])


def _corrupt(path: Path, header: object, data: bytes = b"") -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(("header", "data", "pattern"), [
    pytest.param({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"1234", r"do not hold its 8 bytes",
                 id="truncated-data"),
    pytest.param({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"1234", r"dtype 'Q9'",
                 id="unknown-dtype"),
    pytest.param({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"1234", r"shape \[-1\]",
                 id="negative-shape"),
    pytest.param({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"12345678",
                 r"data_offsets \[0, 4\] do not hold its 8 bytes", id="offsets-too-short"),
    pytest.param(["not", "an", "object"], b"", r"header that is not a JSON object", id="not-an-object"),
])
def test_malformed_headers_are_refused_before_reading_data(tmp_path, header, data, pattern):
    path = tmp_path / "model.safetensors"
    _corrupt(path, header, data)
    with pytest.raises(checkpoint.CheckpointError, match=pattern):
        checkpoint.load({"w": torch.empty(2)}, tmp_path)


def test_header_longer_than_the_file_and_a_wrong_index(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 20) + b"{}")
    with pytest.raises(checkpoint.CheckpointError, match=r"claims a 1048576-byte header in a 10-byte file"):
        checkpoint.load({}, tmp_path)
    folder = tmp_path / "indexed"
    folder.mkdir()
    _folder(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"maps tensor 'b' to 'model-00001-of-00002.safetensors', which"):
        checkpoint.load({}, folder, strict=False)
    index["weight_map"]["b"] = "../outside.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(checkpoint.CheckpointError, match=r"not a plain file name"):
        checkpoint.load({}, folder, strict=False)


def test_key_map_collisions_are_refused(tmp_path):
    folder = _folder(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=r"key_map maps both 'a.weight' and 'b' .* to 'x'"):
        checkpoint.load({}, folder, key_map=lambda k: "x", strict=False)
