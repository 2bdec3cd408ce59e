"""Committed checkpoints of older format versions (``tests/data/v<N>``, see ``make_fixtures.py``) load bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

import checkpoint
import sharded_tensor as st
from checkpoint._cli import verify
from sharding import single_split
from tests.data.make_fixtures import (
    ONE_RANK_VALUES,
    TWO_RANK_VALUES,
    one_rank_tensors,
    two_rank_tensors,
)

DATA = Path(__file__).parent.parent / "data"
VERSIONS = ["v1", "v2", "v3"]


def _copy(name: str, tmp_path: Path, version: str) -> Path:
    """A private copy, so no test can ever change the committed files."""
    return Path(shutil.copytree(DATA / version / name, tmp_path / name))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _full(t: st.ShardedTensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype)
    for shard in t.local_shards():
        out[tuple(slice(o, o + n) for o, n in zip(shard.metadata.offsets, shard.metadata.dims))] = shard.tensor
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_fixtures_have_their_version(version: str) -> None:
    for name in ("one_rank", "two_ranks"):
        text = (DATA / version / name / "shardkit.json").read_text()
        assert f'"version":{version[1:]},' in text.replace(" ", ""), name


@pytest.mark.parametrize("version", VERSIONS)
def test_one_rank_loads_into_plain_tensors(tmp_path: Path, version: str) -> None:
    folder = _copy("one_rank", tmp_path, version)
    expected = one_rank_tensors()
    state = {name: torch.full_like(t, 0) for name, t in expected.items()}
    state.update({name: None for name in ONE_RANK_VALUES})
    checkpoint.load(state, folder)
    for name, t in expected.items():
        assert state[name].dtype == t.dtype and state[name].shape == t.shape, name
        assert torch.equal(_bits(state[name]), _bits(t)), name
    for name, v in ONE_RANK_VALUES.items():
        assert state[name] == v, name


@pytest.mark.parametrize("version", VERSIONS)
def test_one_rank_loads_into_another_layout(tmp_path: Path, version: str) -> None:
    folder = _copy("one_rank", tmp_path, version)
    expected = one_rank_tensors()
    target = st.zeros(9, 4, sharding_spec=single_split(1, ["rank:0/cpu"] * 2))
    state = {"model": {"sharded": target, "w": None}}
    checkpoint.load(state, folder, strict=False)
    assert torch.equal(_bits(_full(target)), _bits(expected["model.sharded"]))
    assert torch.equal(_bits(state["model"]["w"]), _bits(expected["model.w"]))


@pytest.mark.parametrize("version", VERSIONS)
def test_two_ranks_load_into_one_process(tmp_path: Path, version: str) -> None:
    folder = _copy("two_ranks", tmp_path, version)
    expected = two_rank_tensors()
    state: dict = {name: None for name in expected} | {"step": None}
    checkpoint.load(state, folder)
    for name, t in expected.items():
        assert torch.equal(_bits(state[name]), _bits(t)), name
    assert state["step"] == TWO_RANK_VALUES["step"]
    # column blocks of the row split and row blocks of the column split: partial reads
    rows = st.zeros(8, 6, sharding_spec=single_split(1, ["rank:0/cpu"] * 3))
    cols = st.zeros(5, 8, sharding_spec=single_split(0, ["rank:0/cpu"] * 2), dtype=torch.bfloat16)
    checkpoint.load({"rows": rows, "cols": cols}, folder, strict=False)
    assert torch.equal(_bits(_full(rows)), _bits(expected["rows"]))
    assert torch.equal(_bits(_full(cols)), _bits(expected["cols"]))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", ["one_rank", "two_ranks"])
def test_consolidate_and_verify(tmp_path: Path, name: str, version: str) -> None:
    folder = _copy(name, tmp_path, version)
    expected = one_rank_tensors() if name == "one_rank" else two_rank_tensors()
    checkpoint.consolidate(folder, tmp_path / "out.safetensors", quiet=True)
    out = safetensors.torch.load_file(tmp_path / "out.safetensors")
    assert set(out) == set(expected)
    for key, t in expected.items():
        assert torch.equal(_bits(out[key]), _bits(t)), key
    _, problems = verify(str(folder), quiet=True)
    assert problems == []
