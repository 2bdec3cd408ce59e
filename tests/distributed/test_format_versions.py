"""Committed checkpoints of older format versions (``tests/data/v<N>``) load bit for bit into other 2-rank layouts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed

DATA = Path(__file__).parent.parent / "data"


def _load_all(rank: int, world_size: int, parent: str, versions: list[str]) -> list[str]:
    done = []
    for version in versions:
        done += [f"{version}/{name}" for name in _load_both(f"{parent}/{version}")]
    return done


def _load_both(root: str) -> list[str]:
    import checkpoint
    import sharded_tensor as st
    from sharding import single_split
    from tests.data.make_fixtures import (
        ONE_RANK_VALUES,
        TWO_RANK_VALUES,
        R,
        one_rank_tensors,
        two_rank_tensors,
    )

    def check(t: st.ShardedTensor, full: torch.Tensor, name: str) -> None:
        shards = t.local_shards()
        assert shards, name
        for shard in shards:
            box = tuple(slice(o, o + n) for o, n in zip(shard.metadata.offsets, shard.metadata.dims))
            got, want = shard.tensor.contiguous(), full[box].contiguous()
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name

    done = []
    one = one_rank_tensors()
    state = {"model": {"sharded": st.zeros(9, 4, sharding_spec=single_split(1, R)),
                       "w": st.zeros(6, 5, sharding_spec=single_split(0, R)),
                       "c": st.zeros(2, 2, sharding_spec=single_split(1, R), dtype=torch.complex64),
                       "bf": st.zeros(4, 3, sharding_spec=single_split(0, R), dtype=torch.bfloat16)},
             "epoch": None, "meta": {"name": None}}
    checkpoint.load(state, f"{root}/one_rank", strict=False)
    for key in ("sharded", "w", "c", "bf"):
        check(state["model"][key], one[f"model.{key}"], key)
    assert state["epoch"] == ONE_RANK_VALUES["epoch"] and state["meta"]["name"] == ONE_RANK_VALUES["meta.name"]
    done.append("one_rank")

    two = two_rank_tensors()
    state = {"rows": st.zeros(8, 6, sharding_spec=single_split(1, R)),          # saved split by rows
             "cols": st.zeros(5, 8, sharding_spec=single_split(0, R), dtype=torch.bfloat16),  # saved by columns
             "bias": st.zeros(6, sharding_spec=single_split(0, R[::-1])), "step": None}
    checkpoint.load(state, f"{root}/two_ranks")
    for key in ("rows", "cols", "bias"):
        check(state[key], two[key], key)
    assert state["step"] == TWO_RANK_VALUES["step"]
    done.append("two_ranks")
    return done


def test_older_versions_load_into_two_ranks(tmp_path: Path) -> None:
    for version in ("v1", "v2", "v3"):
        for name in ("one_rank", "two_ranks"):
            shutil.copytree(DATA / version / name, tmp_path / version / name)
    results = run_distributed(_load_all, 2, str(tmp_path), ["v1", "v2", "v3"])
    assert results == [[f"{v}/{n}" for v in ("v1", "v2", "v3") for n in ("one_rank", "two_ranks")]] * 2
