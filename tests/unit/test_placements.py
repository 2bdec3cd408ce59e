"""The placement vocabulary of ``sharding.layout``: values, errors, and what specs attach."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from sharded_tensor._model.engine import placements as _zones
from sharded_tensor._model.param_layout import classify, split_placement
from sharding import (
    DevicePlacement,
    EnumerableShardingSpec,
    ShardedTensorMetadata,
    ShardMetadata,
    mesh,
    partial,
    single_split,
)
from sharding.layout import Packed, Partial, Replicated, Split, Strided, placement_of

R4 = [f"rank:{r}/cpu" for r in range(4)]


@pytest.mark.parametrize(("make", "error", "match"), [
    pytest.param(lambda: Split(-1, ((0, 2),)), ValueError, r"Split dim=-1 must be a non-negative int", id="neg-dim"),
    pytest.param(lambda: Split(True, ((0, 2),)), TypeError, r"Split dim=True must be a non-negative int",
                 id="bool-dim"),
    pytest.param(lambda: Split(0, ((0, 2), (1, 2))), ValueError,
                 r"intervals=\(\(0, 2\), \(1, 2\)\): the slices overlap at index 1", id="overlap"),
    pytest.param(lambda: Split(0, ((0, 2), (3, 2))), ValueError,
                 r"intervals=\(\(0, 2\), \(3, 2\)\): the slices leave a gap at index 2", id="gap"),
    pytest.param(lambda: Split(0, ((1, 2),)), ValueError, r"leave a gap at index 0", id="not-from-zero"),
    pytest.param(lambda: Split(0, ((0, -1),)), ValueError, r"intervals\[0\]=\(0, -1\) has a negative", id="negative"),
    pytest.param(lambda: Split(0, ((0, 1, 2),)), TypeError, r"intervals\[0\]=\(0, 1, 2\) is not a \(start, length\)",
                 id="triple"),
    pytest.param(lambda: Split(0, "ab"), TypeError, r"must be a sequence of \(start, length\) pairs", id="string"),
    pytest.param(lambda: Packed(0, (((2, 2), (0, 2)),)), ValueError,
                 r"Packed pieces\[0\]=\(\(2, 2\), \(0, 2\)\) are not in increasing order", id="packed-order"),
    pytest.param(lambda: Packed(0, (((0, 2),), ((1, 2),))), ValueError, r"Packed pieces=.* overlap at index 1",
                 id="packed-overlap"),
    pytest.param(lambda: Partial("prod"), ValueError, r"Partial reduce_op='prod' is not a supported reduction",
                 id="reduce-op"),
])
def test_bad_placements_are_refused_with_the_value(make, error, match):  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("value", [
    pytest.param(Split(1, ((0, 3), (3, 3), (6, 3), (9, 1))), id="split"),
    pytest.param(Packed(0, (((0, 2), (4, 2)), ((2, 2), (6, 2)))), id="packed"),
    pytest.param(Replicated(), id="replicated"),
    pytest.param(Partial("max"), id="partial"),
])
def test_placements_are_values(value):  # type: ignore[no-untyped-def]
    assert pickle.loads(pickle.dumps(value)) == value
    assert hash(pickle.loads(pickle.dumps(value))) == hash(value)
    assert eval(repr(value)) == value  # noqa: S307 - the repr of our own value type
    for field in dataclasses.fields(value):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field.name, getattr(value, field.name))


def test_split_arithmetic():
    split = Split.even(0, 10, 4)
    assert split.intervals == ((0, 3), (3, 3), (6, 3), (9, 1)) and split.size == 10
    assert Split(0, [[0, 2], [2, 2]]) == Split(0, ((0, 2), (2, 2)))  # sequences are stored as tuples
    assert split.moved(2) == Split(2, split.intervals) and split.moved(0) is split
    assert Split(0, ((0, 2), (2, 2))).scaled(1, 3, 1) == Split(1, ((0, 6), (6, 6)))
    assert Split(0, ((0, 3), (3, 3))).scaled(1, 1, 2) is None  # 3 / 2 is not an exact size
    assert Split(0, ((0, 2), (2, 2))).over(4) == Split(0, ((0, 2), (2, 2), (0, 0), (0, 0)))
    with pytest.raises(ValueError, match=r"give rank 2 a slice, but the group has 2 ranks"):
        Split(0, ((0, 1), (1, 1), (2, 1))).over(2)
    assert Split(0, ((0, 2), (2, 2))) != Replicated() and Split(0, ((0, 2), (2, 2))) != Split(1, ((0, 2), (2, 2)))


def test_packed_coalesces_into_a_split_when_each_rank_holds_adjacent_slices():
    assert Packed(0, (((0, 2), (2, 2)), ((4, 4),), ())).coalesced() == Split(0, ((0, 4), (4, 4), (0, 0)))
    assert Packed(0, (((0, 2), (4, 2)), ((2, 2), (6, 2)))).coalesced() is None
    assert Packed(0, (((0, 2), (4, 2)), ((2, 2), (6, 2)))).local_length(1) == 4


def test_engine_tags_are_the_layout_placements_with_a_group():
    group = object()
    tag = _zones.Split(0, ((0, 2), (2, 2)), group)
    assert isinstance(tag, Split) and tag.group is group
    assert tag.moved(1) == _zones.Split(1, ((0, 2), (2, 2)), group)
    assert tag.scaled(2, 2, 1) == _zones.Split(2, ((0, 4), (4, 4)), group)
    assert tag != Split(0, ((0, 2), (2, 2)))  # a tag also says which group the ranks belong to
    assert isinstance(_zones.Packed(0, (((0, 1), (2, 1)), ((1, 1), (3, 1)))), Packed)
    with pytest.raises(ValueError, match="overlap"):
        _zones.Split(0, ((0, 2), (1, 2)))
    strided = _zones.Strided(1, ((0, 2), (2, 2)), 3, group)
    assert isinstance(strided, Strided) and strided.moved(0) == _zones.Strided(0, ((0, 2), (2, 2)), 3, group)
    assert (strided.size, strided.packed().strided()) == (4, Strided(1, ((0, 2), (2, 2)), 3))


def test_strided_is_the_regular_case_of_packed():
    strided = Strided(0, ((0, 1), (1, 3)), 2)
    assert strided.packed() == Packed(0, (((0, 1), (4, 1)), ((1, 3), (5, 3))))
    assert strided.packed().strided() == strided
    assert Packed(0, (((0, 2), (6, 2)), ((2, 4),))).strided() is None  # not in equal blocks
    assert Packed(0, (((0, 2), (5, 1)), ((2, 3),))).strided() is None
    # Metadata states a strided layout as its Packed placement: one placement per layout.
    assert single_split(0, R4[:2] * 2).build_metadata((8, 4)).placement == Strided(0, ((0, 2), (2, 2)), 2).packed()
    with pytest.raises(ValueError, match="blocks=0 must be a positive int"):
        Strided(0, ((0, 2),), 0)
    with pytest.raises(ValueError, match="overlap"):
        Strided(0, ((0, 2), (1, 2)), 2)


@pytest.mark.parametrize(("spec", "size", "world", "expected"), [
    pytest.param(single_split(0, R4), (10, 4), None, Split(0, ((0, 3), (3, 3), (6, 3), (9, 1))), id="even"),
    pytest.param(single_split(1, R4[:2], [1, 7]), (2, 8), None, Split(1, ((0, 1), (1, 7))), id="uneven"),
    pytest.param(single_split(-1, R4[::-1]), (4, 8), None, Split(1, ((6, 2), (4, 2), (2, 2), (0, 2))),
                 id="permuted-negative-dim"),
    pytest.param(single_split(0, [R4[0], R4[2]]), (4, 4), None, Split(0, ((0, 2), (0, 0), (2, 2))),
                 id="rank-without-a-shard"),
    pytest.param(single_split(0, R4[:2] * 2), (8, 4), None, Packed(0, (((0, 2), (4, 2)), ((2, 2), (6, 2)))),
                 id="packed"),
    pytest.param(single_split(0, ["cpu", R4[1]]), (4, 4), 2, None, id="copies-on-some-ranks"),
    pytest.param(DevicePlacement("cpu"), (4, 4), 3, Replicated(), id="replicated"),
    pytest.param(DevicePlacement("rank:1/cpu"), (4, 4), None, None, id="one-rank"),
    pytest.param(mesh([[R4[0]], [R4[1]]]), (4, 4), None, Split(0, ((0, 2), (2, 2))), id="mesh-one-axis"),
    pytest.param(mesh([R4[:2], R4[2:]]), (4, 4), None, None, id="mesh-blocks"),
    pytest.param(partial(R4[:2], reduce_op="avg"), (4, 4), None, Partial("avg"), id="partial"),
    pytest.param(EnumerableShardingSpec([ShardMetadata((0, 0), (1, 4), R4[1]), ShardMetadata((1, 0), (3, 4), R4[0])]),
                 (4, 4), None, Split(0, ((1, 3), (0, 1))), id="enumerable"),
])
def test_specs_attach_their_placement_to_the_metadata(spec, size, world, expected):  # type: ignore[no-untyped-def]
    metadata = spec.build_metadata(size, world_size=world)
    assert metadata.placement == expected
    # The shards say the same: metadata rebuilt from them (a checkpoint, local shards) agrees.
    if isinstance(expected, Partial):  # shards cannot say that values are pending: partial metadata states it
        rebuilt = ShardedTensorMetadata(metadata.shards, metadata.size, metadata.dtype, placement=expected)
        assert placement_of(metadata.shards, size) == Replicated()
    else:
        rebuilt = ShardedTensorMetadata(metadata.shards, metadata.size, metadata.dtype)
        assert placement_of(metadata.shards, size) == expected
    assert rebuilt.placement == expected and rebuilt == metadata


def test_metadata_placement_does_not_change_equality_or_serialization():
    metadata = single_split(0, R4[:2]).build_metadata((4, 2))
    assert ShardedTensorMetadata.from_dict(metadata.to_dict()) == metadata
    assert "placement" not in metadata.to_dict()  # the format is unchanged; placements are derived
    assert pickle.loads(pickle.dumps(metadata)).placement == metadata.placement
    with pytest.raises(TypeError, match=r"placement='sum' is not a metadata placement; give a sharding.layout"):
        ShardedTensorMetadata(metadata.shards, (4, 2), torch.float32, placement="sum")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"states a Strided layout as its Packed: placement.packed\(\)"):
        ShardedTensorMetadata(metadata.shards, (4, 2), placement=Strided(0, ((0, 2),), 2))  # type: ignore[arg-type]
    # The placement is the one source of a pending reduction: it takes part in equality and survives copies.
    pending = ShardedTensorMetadata(metadata.shards, (4, 2), placement=Partial("max"))
    assert pending != metadata and pending.pending == Partial("max") and metadata.pending is None
    assert ShardedTensorMetadata.from_dict(pending.to_dict()) == pending and pending.to_dict()["partial"] == "max"
    assert pickle.loads(pickle.dumps(pending)).placement == Partial("max")
    assert hash(pickle.loads(pickle.dumps(pending))) == hash(pending)
    assert pending.with_dtype(torch.float64).placement == Partial("max")
    assert "Partial(reduce_op='max')" in repr(pending) and "placement" not in repr(metadata)


def test_parameter_layouts_read_the_placement_the_spec_attached():
    layout = classify("w", single_split(0, R4[:2] * 2).build_metadata((8, 4), world_size=4), 4)
    assert layout.placement == Packed(0, (((0, 2), (4, 2)), ((2, 2), (6, 2)), (), ()))
    assert (layout.kind, layout.dim, layout.pieces) == ("split", 0, layout.placement.pieces)
    adjacent = classify("w", single_split(0, [R4[0], R4[0], R4[1]]).build_metadata((6, 4), world_size=2), 2)
    assert adjacent.placement == Split(0, ((0, 4), (4, 2)))  # a rank's adjacent slices are one block
    assert classify("w", DevicePlacement("cpu").build_metadata((2,), world_size=2), 2).placement == Replicated()
    assert split_placement(layout, 2) == Packed(2, layout.placement.pieces)
    assert split_placement(((0, 1), (1, 1)), 1) == Split(1, ((0, 1), (1, 1)))
    with pytest.raises(TypeError, match=r"a split must be per-rank \(start, length\) intervals.* got str 'x'"):
        split_placement("x", 0)  # type: ignore[arg-type]


def test_a_layer_output_split_is_given_in_any_of_its_forms():
    from sharded_tensor._model.registry import _as_tag

    tag = _zones.Split(1, ((0, 2), (2, 2)), None)
    assert _as_tag(((0, 2), (2, 2)), 1, None) == tag
    assert _as_tag([[0, 2], [2, 2]], 1, None) == tag
    assert _as_tag(Split(0, ((0, 2), (2, 2))), 1, None) == tag
    layout = classify("w", single_split(0, R4[:2] * 2).build_metadata((8, 4), world_size=2), 2)
    assert _as_tag(layout, 1, None) == _zones.Packed(1, (((0, 2), (4, 2)), ((2, 2), (6, 2))), None)
    with pytest.raises(TypeError, match=r"Split intervals=5 must be a sequence of \(start, length\) pairs"):
        _as_tag(5, 1, None)  # type: ignore[arg-type]
