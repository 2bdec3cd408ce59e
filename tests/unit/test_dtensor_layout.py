"""DTensor layout math without a process group: shardkit's block per mesh coordinate equals DTensor's own."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from sharded_tensor._dtensor_layout import dtensor_layout
from tests._examples import examples


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


@hst.composite
def _cases(draw: hst.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], list[object]]:
    ndim = draw(hst.integers(1, 3))
    shape = tuple(draw(hst.lists(hst.integers(0, 13), min_size=ndim, max_size=ndim)))
    mesh_shape = tuple(draw(hst.lists(hst.integers(1, 4), min_size=1, max_size=3)))
    placements = [draw(hst.sampled_from([Replicate(), *(Shard(d) for d in range(ndim))])) for _ in mesh_shape]
    return shape, mesh_shape, placements


@settings(max_examples=examples(200), deadline=None)
@given(_cases())
def test_layout_matches_dtensor_everywhere(case):
    shape, mesh_shape, placements = case
    layout = dtensor_layout(shape, mesh_shape, placements)
    for coord, (offsets, sizes) in layout.items():
        local_shape, global_offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        assert tuple(local_shape) == sizes
        if all(s > 0 for s in sizes):
            assert tuple(global_offset) == offsets
    # Blocks of distinct coordinates tile the tensor (replicas aside): every element once per replica set.
    replicas = 1
    for axis, p in enumerate(placements):
        replicas *= 1 if isinstance(p, Shard) else mesh_shape[axis]
    assert sum(math.prod(s) for _, s in layout.values()) == math.prod(shape) * replicas
