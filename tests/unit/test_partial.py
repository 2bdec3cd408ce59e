"""PartialSpec and the pure planning of reductions, without a process group."""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch

import sharded_tensor as st
from sharded_tensor._plan import keeper_layout, plan_reduce, plan_reshard, reduce_layout
from sharding import (
    CompositeShardingSpec,
    DevicePlacement,
    PartialSpec,
    ShardedTensorMetadata,
    ShardMetadata,
    mesh,
    partial,
    single_split,
    spec_from_dict,
)
from sharding.layout import Partial

R2 = ["rank:0/cpu", "rank:1/cpu"]
R4 = [f"rank:{r}/cpu" for r in range(4)]


@pytest.mark.parametrize("spec", [
    pytest.param(partial(R2), id="sum"),
    pytest.param(partial(R4, reduce_op="avg"), id="avg"),
    pytest.param(PartialSpec("cpu", reduce_op="max"), id="every-rank-max"),
    pytest.param(PartialSpec(["rank:1/cuda:0"], reduce_op="min"), id="one-rank-min"),
])
def test_partial_spec_is_a_value(spec):
    assert spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert hash(pickle.loads(pickle.dumps(spec))) == hash(spec)
    with pytest.raises(AttributeError):
        spec.reduce_op = "sum"  # type: ignore[misc]


def test_partial_metadata_lists_one_full_shard_per_holder():
    md = partial(R4, reduce_op="max").build_metadata((3, 5), torch.int64)
    assert [(s.offsets, s.dims, s.rank) for s in md.shards] == [((0, 0), (3, 5), r) for r in range(4)]
    assert md.placement == Partial("max") and md.dtype == torch.int64
    every = partial("cpu").build_metadata((2,), world_size=3)
    assert [s.rank for s in every.shards] == [0, 1, 2] and every.placement == Partial("sum")
    assert ShardedTensorMetadata.from_dict(json.loads(json.dumps(md.to_dict()))) == md
    assert pickle.loads(pickle.dumps(md)) == md


def test_plain_metadata_is_unchanged():
    md = single_split(0, R2).build_metadata((4, 2))
    assert md.pending is None and "partial" not in md.to_dict()
    assert md != ShardedTensorMetadata(md.shards, md.size, md.dtype, placement=Partial("sum"))


@pytest.mark.parametrize(("make", "error", "match"), [
    pytest.param(lambda: partial([]), ValueError, "empty", id="empty"),
    pytest.param(lambda: partial(R2, reduce_op="prod"), ValueError, r"reduce_op='prod'.*'sum', 'avg', 'max', 'min'",
                 id="unknown-op"),
    pytest.param(lambda: partial(["rank:0/cpu", "rank:0/cpu"]), ValueError, r"rank\(s\) \[0\] more than once",
                 id="repeated-rank"),
    pytest.param(lambda: partial(["cpu", "rank:0/cpu"]), ValueError, "without a rank", id="mixed-rankless"),
    pytest.param(lambda: partial([3]), TypeError, "shard_placement", id="not-a-placement"),
    pytest.param(lambda: partial(R2, reduce_op="avg").build_metadata((2,), torch.int64), ValueError,
                 "floating-point", id="avg-of-ints"),
    pytest.param(lambda: partial(R2).build_metadata((2,), torch.bool), ValueError, "'max' \\(logical or\\)",
                 id="sum-of-bools"),
    pytest.param(lambda: partial(R2, reduce_op="max").build_metadata((2,), torch.complex64), ValueError,
                 "complex", id="max-of-complex"),
    pytest.param(lambda: partial(["rank:4/cpu"]).build_metadata((2,), world_size=4), ValueError,
                 r"rank 4 .* ranks 0..3", id="rank-outside-world"),
    pytest.param(lambda: partial("cpu").build_metadata((2,)), ValueError, "world_size", id="rankless-no-world"),
    pytest.param(lambda: CompositeShardingSpec({"w": partial(R2)}), TypeError, "partial values", id="in-composite"),
    pytest.param(lambda: ShardedTensorMetadata([], (2,), None, placement=Partial("mean")), ValueError,
                 "Partial reduce_op='mean'",
                 id="metadata-op"),
])
def test_partial_spec_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _bytes(src, dst, world):
    return {r: sum(dst_shard.numel for peer, blocks in plan_reduce(src, dst, r).sends.items()
                   for dst_shard in (dst.shards[i] for i in blocks)) for r in range(world)}


@pytest.mark.parametrize(("target", "world"), [
    pytest.param(single_split(0, R4), 4, id="rows"),
    pytest.param(single_split(1, R4), 4, id="cols"),
    pytest.param(single_split(0, R4, [1, 4, 0, 3]), 4, id="uneven"),
    pytest.param(mesh([R4[:2], R4[2:]]), 4, id="mesh"),
    pytest.param(single_split(0, R2), 2, id="rows-2"),
])
def test_reduce_onto_a_split_is_a_reduce_scatter(target, world):
    src = partial(R4[:world]).build_metadata((8, 12))
    dst = target.build_metadata((8, 12))
    assert reduce_layout(src, dst) == dst
    for rank, sent in _bytes(src, dst, world).items():
        own = sum(s.numel for s in dst.shards if s.rank == rank)
        assert sent == 8 * 12 - own  # every block but its own, once
    # Both sides of every transfer agree.
    for r in range(world):
        for peer, blocks in plan_reduce(src, dst, r).sends.items():
            assert plan_reduce(src, dst, peer).recvs[r] == blocks


def test_reduce_onto_a_replica_is_reduce_scatter_then_all_gather():
    src = partial(R4).build_metadata((8, 12))
    dst = DevicePlacement("cpu").build_metadata((8, 12), world_size=4)
    middle = reduce_layout(src, dst)
    assert [(s.offsets, s.dims, s.rank) for s in middle.shards] == [((2 * r, 0), (2, 12), r) for r in range(4)]
    gathered = sum(plan_reshard(middle, dst, r).elements_sent() for r in range(4))
    reduced = sum(_bytes(src, middle, 4).values())
    assert reduced == gathered == 4 * 3 * 24  # 2 (w-1)/w of the tensor per rank in all


def test_reduce_prefers_reducers_holding_partial_values():
    src = partial(R4[2:]).build_metadata((8,))
    dst = DevicePlacement("cpu").build_metadata((8,), world_size=4)
    assert {s.rank for s in reduce_layout(src, dst).shards} == {2, 3}


def test_plan_reshard_refuses_partial_layouts():
    src = partial(R2).build_metadata((4,))
    with pytest.raises(ValueError, match="plan_reduce"):
        plan_reshard(src, single_split(0, R2).build_metadata((4,)), 0)


@pytest.mark.parametrize(("source", "keepers"), [
    pytest.param(DevicePlacement("cpu"), [0], id="replica-lowest-holder"),
    pytest.param(single_split(0, R4), [0, 1, 2, 3], id="split-stays"),
    pytest.param(single_split(0, R4[2:]), [2, 3], id="split-outside-round-robin"),
])
def test_keeper_layout_moves_nothing_already_on_a_holder(source, keepers):
    src = source.build_metadata((8,), world_size=4)
    dst = partial(R4 if keepers != [2, 3] else R2).build_metadata((8,))
    keep = keeper_layout(src, dst)
    expected = keepers if keepers != [2, 3] else [0, 1]
    assert sorted({s.rank for s in keep.shards}) == expected
    moved = sum(plan_reshard(src, keep, r).elements_sent() for r in range(4))
    assert moved == (0 if keepers != [2, 3] else 8)


def test_one_process_partial_round_trip():
    t = st.ShardedTensor.from_local_shards(
        [st.Shard(torch.arange(6.0).reshape(2, 3), ShardMetadata((0, 0), (2, 3), "rank:0/cpu"))], (2, 3),
        reduce_op="max")
    assert t.sharding_spec() == partial(["rank:0/cpu"], reduce_op="max")
    picture = st.visualize_sharding(t, file=io.StringIO())
    assert "partial(max) rank 0" in picture and picture.splitlines()[0].endswith("partial(max)")
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded.sharding_metadata() == t.sharding_metadata() and torch.equal(loaded.full_tensor(), t.full_tensor())
    with pytest.raises(ValueError, match="must be full-size"):
        st.ShardedTensor.from_local_shards(
            [st.Shard(torch.zeros(1, 3), ShardMetadata((0, 0), (1, 3), "rank:0/cpu")),
             st.Shard(torch.zeros(1, 3), ShardMetadata((1, 0), (1, 3), "rank:0/cpu"))], (2, 3), reduce_op="sum")
    with pytest.raises(ValueError, match="reduce_op='median'"):
        st.ShardedTensor.from_local_shards(t.local_shards(), (2, 3), reduce_op="median")
    t.reshard(single_split(1, ["rank:0/cpu", "rank:0/cpu"]))
    assert t.sharding_metadata().pending is None and torch.equal(t.full_tensor(), torch.arange(6.0).reshape(2, 3))
