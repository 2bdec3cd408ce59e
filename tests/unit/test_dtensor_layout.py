"""DTensor layout math without a process group: shardkit's block per mesh coordinate equals DTensor's own."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from sharded_tensor._dtensor import dtensor_layout


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), [
    pytest.param((8, 4), (4,), [Shard(0)], id="even-rows"),
    pytest.param((10, 4), (4,), [Shard(0)], id="uneven-rows-3-3-3-1"),
    pytest.param((5, 3), (4,), [Shard(1)], id="more-ranks-than-columns"),
    pytest.param((2, 3), (4,), [Shard(0)], id="empty-trailing-shards"),
    pytest.param((7, 9), (2, 2), [Shard(0), Shard(1)], id="2d-blocks"),
    pytest.param((7, 9), (2, 2), [Replicate(), Shard(1)], id="hsdp-like"),
    pytest.param((11, 3), (2, 3), [Shard(0), Shard(0)], id="same-dim-twice-nested"),
    pytest.param((6,), (3, 2), [Replicate(), Replicate()], id="replicated"),
    pytest.param((5, 6, 7), (2, 2), [Shard(2), Shard(0)], id="3d-tensor"),
])
def test_layout_matches_dtensor(shape, mesh_shape, placements):
    ours = dtensor_layout(shape, mesh_shape, placements)
    for coord, (offsets, sizes) in ours.items():
        local_shape, global_offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), placements)
        assert tuple(local_shape) == sizes, coord
        if all(s > 0 for s in sizes):  # DTensor and shardkit place empty blocks differently
            assert tuple(global_offset) == offsets, coord


def test_layout_example_uneven_last_shard():
    layout = dtensor_layout((10, 4), (4,), [Shard(0)])
    assert [layout[(r,)] for r in range(4)] == [((0, 0), (3, 4)), ((3, 0), (3, 4)), ((6, 0), (3, 4)), ((9, 0), (1, 4))]
