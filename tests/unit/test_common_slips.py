"""The first mistakes of a new user get errors that name the fix.

One process, no process group: each test makes the slip as a user would and checks that
the message says what to do instead.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import checkpoint
import sharded_tensor as st
from sharding import single_split

TWO = ["rank:0/cpu", "rank:1/cpu"]


@pytest.mark.parametrize("call", [
    pytest.param(lambda: st.zeros(4, 2, sharding_spec=single_split(0, TWO)), id="zeros"),
    pytest.param(lambda: st.shard_tensor(torch.zeros(4, 2), single_split(0, TWO)), id="shard_tensor"),
    pytest.param(lambda: st.shard_model(nn.Linear(2, 4), single_split(0, TWO)), id="shard_model"),
    pytest.param(lambda: checkpoint.save({"w": torch.zeros(2)}, "memory://slips/ckpt"), id="save"),
])
def test_launcher_without_process_group_says_init_process_group(call, monkeypatch: pytest.MonkeyPatch) -> None:
    # What torchrun sets for rank 1 of 2; the script forgot init_process_group.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"init_process_group\(\"gloo\"\)") as info:
        call()
    message = str(info.value)
    assert "rank 1 of 2 (WORLD_SIZE=2)" in message
    assert "use ranks 0..0" not in message  # not the spec's fault


def test_spec_beyond_the_world_still_names_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"the world has 1 ranks; use ranks 0\.\.0"):
        st.zeros(4, 2, sharding_spec=single_split(0, TWO))


def test_one_process_world_is_fine_under_world_size_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    t = st.zeros(4, 2, sharding_spec=single_split(0, ["rank:0/cpu"]))
    assert torch.equal(t.local_shard(), torch.zeros(4, 2))


@pytest.mark.parametrize(("value", "fix"), [
    pytest.param(torch.zeros(3, 4), "st.shard_tensor(tensor, spec)", id="tensor"),
    pytest.param(nn.Linear(4, 3).weight, "model.state_dict()", id="parameter"),
])
def test_visualize_sharding_of_a_plain_tensor_says_it_is_not_sharded(value: torch.Tensor, fix: str) -> None:
    with pytest.raises(TypeError, match=r"size \(3, 4\), which has no sharding to draw") as info:
        st.visualize_sharding(value)
    assert fix in str(info.value)


def test_visualize_sharding_of_something_else_names_the_type() -> None:
    with pytest.raises(TypeError, match=r"ShardedTensor or a ShardedTensorMetadata, got list \[1, 2\]"):
        st.visualize_sharding([1, 2])  # type: ignore[arg-type]
