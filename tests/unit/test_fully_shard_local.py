"""``st.fully_shard`` from the meta device in one process (a world of one): materialized by ``shard_model``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sharded_tensor as st
from sharding import composite, single_split


def _meta_mlp() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Sequential(nn.Linear(7, 11), nn.LayerNorm(11)),
                             nn.Linear(11, 3))


def _fully_shard(model: nn.Module) -> nn.Module:
    st.fully_shard(model[0])  # type: ignore[arg-type]
    st.fully_shard(model[2])  # type: ignore[arg-type]
    return st.fully_shard(model)


def test_rows_from_meta_hold_the_whole_models_values() -> None:
    model = _fully_shard(_meta_mlp())
    assert all(p.is_meta for p in model.parameters())  # nothing allocated yet
    st.shard_model(model, composite(), seed=3)
    whole = st.shard_model(_meta_mlp(), composite(), seed=3)  # the same model, built whole, the same seed
    state = model.state_dict()
    for name, value in whole.state_dict().items():
        got = state[name].full_tensor() if isinstance(state[name], st.ShardedTensor) else state[name]
        assert torch.equal(got, value), name
    x = torch.randn(4, 5)
    assert torch.equal(model(x), whole(x))
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_init_false_leaves_rows_for_a_load() -> None:
    model = _fully_shard(_meta_mlp())
    st.shard_model(model, composite(), init=False)
    source = st.shard_model(_meta_mlp(), composite(), seed=1)
    model.load_state_dict(source.state_dict())
    assert torch.equal(model(torch.ones(2, 5)), source(torch.ones(2, 5)))


def test_a_forward_before_materializing_raises() -> None:
    model = _fully_shard(_meta_mlp())
    with pytest.raises(ValueError, match=r"parameters \['3.weight', '3.bias'\] are still on the meta device; "
                                         r"materialize and initialize"):
        model(torch.ones(2, 5))


def test_a_spec_naming_a_fully_sharded_parameter_is_refused() -> None:
    model = _fully_shard(_meta_mlp())
    with pytest.raises(ValueError, match=r"parameter '0.weight' is fully sharded .* leave it out of the spec"):
        st.shard_model(model, composite(**{"0.weight": single_split(0, ["rank:0/cpu"])}), seed=0)
