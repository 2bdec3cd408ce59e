"""consolidate a checkpoint saved by 4 Gloo ranks (row, column, mesh, replicated, single-rank layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

import checkpoint
from tests.distributed._launch import run_distributed
from tests.distributed.test_collect import WORLD, _reference, _sharded_state_dict


def _save(rank: int, world: int, path: str) -> None:
    checkpoint.save(_sharded_state_dict(rank, world), path)


def test_consolidate_four_rank_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save, WORLD, path)
    ref = _reference()
    expected = {k: v for k, v in ref.items() if isinstance(v, torch.Tensor)}
    expected["nested.inner"] = ref["nested"]["inner"]  # type: ignore[index]

    out = tmp_path / "model.safetensors"
    checkpoint.consolidate(path, out)
    got = load_file(str(out))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["shardkit.values"]) == {"step": 7, "name": "adam", "nested.lr": 0.1}

    folder = tmp_path / "hf"
    checkpoint.consolidate(path, folder, max_shard_size="200B")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(expected)
    got = {}
    for file in set(index["weight_map"].values()):
        got.update(load_file(str(folder / file)))
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())
