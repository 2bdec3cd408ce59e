"""Single-process tests of ``sharding``: devices, specs, metadata, serialization, errors.

No process group anywhere: a spec is a pure function of the global shape.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharding
from sharding import (
    CompositeShardingSpec,
    DevicePlacement,
    EnumerableShardingSpec,
    MeshShardingSpec,
    PartialSpec,
    PlacementSpec,
    RemoteDevice,
    ShardedTensorMetadata,
    ShardMetadata,
    SingleSplitShardingSpec,
    composite,
    mesh,
    single_split,
    spec_from_dict,
)
from sharding._placement import register_spec
from sharding.layout import check_tiling
from tests._examples import examples


def ranks(n: int, device: str = "cpu") -> list[str]:
    return [f"rank:{r}/{device}" for r in range(n)]


def layout(md: ShardedTensorMetadata) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """``(offsets, dims, device)`` of every shard, in placement order."""
    return [(s.offsets, s.dims, str(s.device)) for s in md.shards]


def chunk_lengths(n: int, k: int) -> list[int]:
    """Lengths ``torch.chunk`` gives for ``n`` elements in ``k`` parts, padded with empty parts."""
    lengths = [len(c) for c in torch.arange(n).chunk(k)]
    return lengths + [0] * (k - len(lengths))


# --------------------------------------------------------------------------- RemoteDevice

@pytest.mark.parametrize(("text", "rank", "device"), [
    pytest.param("rank:0/cuda:0", 0, torch.device("cuda", 0), id="rank-cuda"),
    pytest.param("rank:1/cpu", 1, torch.device("cpu"), id="rank-cpu"),
    pytest.param("rank:12/cuda:3", 12, torch.device("cuda", 3), id="two-digit-rank"),
    pytest.param("rank:0/cuda", 0, torch.device("cuda"), id="rank-cuda-no-index"),
    pytest.param("cuda:1", None, torch.device("cuda", 1), id="no-rank-cuda"),
    pytest.param("cpu", None, torch.device("cpu"), id="no-rank-cpu"),
    pytest.param("rank:2/meta", 2, torch.device("meta"), id="meta"),
])
def test_remote_device_parses_and_round_trips(text, rank, device):
    d = RemoteDevice(text)
    assert d.rank == rank
    assert d.device == device
    assert str(d) == text
    assert RemoteDevice(str(d)) == d
    assert RemoteDevice(d) == d


@pytest.mark.parametrize(("text", "match"), [
    pytest.param("rank:x/cpu", "malformed RemoteDevice 'rank:x/cpu'", id="non-int-rank"),
    pytest.param("rank:0", "malformed RemoteDevice 'rank:0'", id="rank-without-device"),
    pytest.param("rank:0/", "RemoteDevice 'rank:0/'", id="empty-device"),
    pytest.param("bogus", "malformed RemoteDevice 'bogus'", id="not-a-device"),
    pytest.param("", "malformed RemoteDevice ''", id="empty"),
    pytest.param("cpu/", "malformed RemoteDevice 'cpu/'", id="trailing-slash"),
    pytest.param("rank:0/cuda:0/x", "RemoteDevice 'rank:0/cuda:0/x'", id="extra-part"),
    pytest.param("rank:-1/cpu", "RemoteDevice 'rank:-1/cpu' has a negative rank", id="negative-rank"),
    pytest.param("worker0/cpu", "malformed RemoteDevice 'worker0/cpu'", id="worker-name"),
])
def test_remote_device_malformed_quotes_the_string_and_the_form(text, match):
    with pytest.raises(ValueError, match=match) as info:
        RemoteDevice(text)
    assert "rank:<r>/<device>" in str(info.value)  # shows the expected form


@pytest.mark.parametrize("value", [3, None, torch.device("cpu"), ["rank:0/cpu"]], ids=repr)
def test_remote_device_wrong_type(value):
    with pytest.raises(TypeError, match="RemoteDevice expects a string"):
        RemoteDevice(value)


def test_remote_device_is_immutable():
    d = RemoteDevice("rank:0/cpu")
    with pytest.raises(AttributeError, match="immutable"):
        d._rank = 3  # type: ignore[misc]
    assert d.rank == 0


def test_remote_device_is_a_frozen_value():
    d = RemoteDevice("rank:2/cpu")
    assert dataclasses.is_dataclass(d)
    assert [f.name for f in dataclasses.fields(d)] == ["rank", "device"]
    with pytest.raises(dataclasses.FrozenInstanceError, match="immutable"):
        d.rank = 3  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del d.device
    assert d == RemoteDevice("rank:2/cpu") and hash(d) == hash(RemoteDevice("rank:2/cpu"))
    assert d != RemoteDevice("rank:3/cpu") and d != RemoteDevice("cpu") and d != "rank:2/cpu"
    assert len({d, RemoteDevice("rank:2/cpu"), RemoteDevice("cpu")}) == 2
    assert pickle.loads(pickle.dumps(d)) == d
    assert repr(d) == "RemoteDevice('rank:2/cpu')"


def test_remote_device_of():
    assert RemoteDevice.of(3, "cpu") == RemoteDevice("rank:3/cpu")
    assert RemoteDevice.of(None, torch.device("cuda", 1)) == RemoteDevice("cuda:1")


# --------------------------------------------------------------------------- DevicePlacement

def test_device_placement_with_rank_is_one_full_shard():
    md = DevicePlacement("rank:1/cpu").build_metadata((2, 3), torch.float16)
    assert layout(md) == [((0, 0), (2, 3), "rank:1/cpu")]
    assert md.size == torch.Size([2, 3]) and md.dtype == torch.float16
    assert md.shards[0].rank == 1


def test_device_placement_without_rank_lists_one_replica_per_rank():
    md = DevicePlacement("cpu").build_metadata((2, 3), world_size=3)
    assert layout(md) == [((0, 0), (2, 3), f"rank:{r}/cpu") for r in range(3)]
    assert md.ranks == (0, 1, 2)
    check_tiling(md.shards, md.size)  # identical regions are replicas, not overlaps


def test_device_placement_without_rank_needs_world_size():
    with pytest.raises(ValueError, match=r"'cpu', a device without a rank.*pass world_size="):
        DevicePlacement("cpu").build_metadata((2, 3))


def test_device_placement_rank_beyond_world():
    with pytest.raises(ValueError, match=r"rank 1 \('rank:1/cpu'\) but the world has 1 ranks; use ranks 0\.\.0"):
        DevicePlacement("rank:1/cpu").build_metadata((2, 3), world_size=1)


def test_device_placement_accepts_each_device_form():
    expected = DevicePlacement("rank:0/cpu")
    assert DevicePlacement(RemoteDevice("rank:0/cpu")) == expected
    assert DevicePlacement(expected) == expected
    assert expected.device == RemoteDevice("rank:0/cpu")


# --------------------------------------------------------------------------- SingleSplit

@pytest.mark.parametrize(("size", "shards", "expected"), [
    pytest.param(8, 4, (2, 2, 2, 2), id="even"),
    pytest.param(10, 4, (3, 3, 3, 1), id="uneven"),
    pytest.param(3, 4, (1, 1, 1, 0), id="more-shards-than-rows"),
    pytest.param(5, 4, (2, 2, 1, 0), id="chunk-leaves-an-empty-tail"),
    pytest.param(6, 4, (2, 2, 2, 0), id="chunk-not-balanced"),
    pytest.param(1, 3, (1, 0, 0), id="one-row"),
    pytest.param(0, 3, (0, 0, 0), id="empty-dim"),
    pytest.param(7, 1, (7,), id="single-shard"),
])
def test_single_split_sizes_follow_torch_chunk(size, shards, expected):
    md = single_split(0, ranks(shards)).build_metadata((size, 2))
    assert tuple(s.dims[0] for s in md.shards) == expected
    assert all(s.dims[1] == 2 and s.offsets[1] == 0 for s in md.shards)
    assert tuple(s.dims[0] for s in md.shards) == tuple(chunk_lengths(size, shards))


def test_single_split_trailing_empty_shards_keep_their_placement_and_clamp_offsets():
    md = single_split(0, ranks(4)).build_metadata((3,))
    assert layout(md) == [((0,), (1,), "rank:0/cpu"), ((1,), (1,), "rank:1/cpu"),
                          ((2,), (1,), "rank:2/cpu"), ((3,), (0,), "rank:3/cpu")]
    md = single_split(0, ranks(5)).build_metadata((3,))
    assert [s.offsets for s in md.shards] == [(0,), (1,), (2,), (3,), (3,)]  # clamped to n


def test_single_split_rfc_row_wise_over_four_ranks():
    spec = SingleSplitShardingSpec(["rank:0/cuda:0", "rank:1/cuda:1", "rank:2/cuda:2", "rank:3/cuda:3"], 0)
    assert spec.devices == spec.shard_placement
    md = spec.build_metadata((10, 4), world_size=4)
    assert layout(md) == [((0, 0), (3, 4), "rank:0/cuda:0"), ((3, 0), (3, 4), "rank:1/cuda:1"),
                          ((6, 0), (3, 4), "rank:2/cuda:2"), ((9, 0), (1, 4), "rank:3/cuda:3")]


@pytest.mark.parametrize(("dim", "expected"), [
    pytest.param(1, [((0, 0, 0), (2, 2, 4), "rank:0/cpu"), ((0, 2, 0), (2, 1, 4), "rank:1/cpu")], id="dim1"),
    pytest.param(-1, [((0, 0, 0), (2, 3, 2), "rank:0/cpu"), ((0, 0, 2), (2, 3, 2), "rank:1/cpu")], id="dim-1"),
    pytest.param(-3, [((0, 0, 0), (1, 3, 4), "rank:0/cpu"), ((1, 0, 0), (1, 3, 4), "rank:1/cpu")], id="dim-3"),
])
def test_single_split_dims_including_negative(dim, expected):
    assert layout(single_split(dim, ranks(2)).build_metadata((2, 3, 4))) == expected


def test_single_split_uneven_shard_sizes():
    md = single_split(1, ranks(3), shard_sizes=[1, 0, 4]).build_metadata((2, 5))
    assert layout(md) == [((0, 0), (2, 1), "rank:0/cpu"), ((0, 1), (2, 0), "rank:1/cpu"),
                          ((0, 1), (2, 4), "rank:2/cpu")]
    check_tiling(md.shards, md.size)


def test_single_split_named_dimension():
    spec = single_split("cols", ranks(2))
    md = spec.build_metadata((3, 4), names=("rows", "cols"))
    assert layout(md) == [((0, 0), (3, 2), "rank:0/cpu"), ((0, 2), (3, 2), "rank:1/cpu")]
    assert spec.resolve_dim((3, 4), ("rows", "cols")) == 1


def test_single_split_same_rank_several_times_holds_several_shards():
    md = single_split(0, ["rank:0/cpu", "rank:1/cpu", "rank:0/cpu"]).build_metadata((6,))
    assert [i for i, _ in md.shards_on(0)] == [0, 2]
    assert [s.offsets for _, s in md.shards_on(0)] == [(0,), (4,)]


def test_single_split_rankless_placement_replicates_that_chunk():
    md = single_split(0, ["rank:0/cpu", "cpu"]).build_metadata((4,), world_size=2)
    assert layout(md) == [((0,), (2,), "rank:0/cpu"), ((2,), (2,), "rank:0/cpu"), ((2,), (2,), "rank:1/cpu")]


@pytest.mark.parametrize(("spec", "size", "kwargs", "error", "match"), [
    pytest.param(single_split(0, ranks(2), [1, 1]), (3, 4), {}, ValueError,
                 r"shard_sizes=\[1, 1\] sum to 2 but dimension 0 of size=\(3, 4\) has 3 elements; make them sum to 3",
                 id="sizes-do-not-sum"),
    pytest.param(single_split(2, ranks(2)), (3, 4), {}, ValueError,
                 r"split_dimension=2 is out of range for a tensor of rank 2 \(size=\(3, 4\)\); "
                 r"use a dimension in \[-2, 1\]",
                 id="dim-too-large"),
    pytest.param(single_split(-3, ranks(2)), (3, 4), {}, ValueError,
                 r"split_dimension=-3 is out of range", id="dim-too-negative"),
    pytest.param(single_split("x", ranks(2)), (3, 4), {}, ValueError,
                 r"split_dimension='x' is a dimension name but the tensor's names are None", id="name-without-names"),
    pytest.param(single_split("x", ranks(2)), (3, 4), {"names": ("a", "b")}, ValueError,
                 r"split_dimension='x' is a dimension name but the tensor's names are \('a', 'b'\)",
                 id="unknown-name"),
    pytest.param(single_split("c", ranks(2)), (3, 4), {"names": ("a", "b", "c")}, ValueError,
                 r"names", id="more-names-than-dims"),
    pytest.param(single_split(0, ["rank:0/cpu", "rank:3/cpu"]), (3, 4), {"world_size": 2}, ValueError,
                 r"rank 3 \('rank:3/cpu'\) but the world has 2 ranks; use ranks 0\.\.1", id="rank-beyond-world"),
    pytest.param(single_split(0, ["rank:0/cpu", "cpu"]), (3, 4), {}, ValueError,
                 r"'cpu', a device without a rank", id="replica-without-world-size"),
    pytest.param(single_split(0, ranks(2)), (-1, 4), {}, ValueError,
                 r"size=\(-1, 4\) has a negative dimension", id="negative-size"),
    pytest.param(single_split(0, ranks(2)), 4, {}, TypeError, r"size must be a sequence of ints", id="int-size"),
])
def test_single_split_build_errors(spec, size, kwargs, error, match):
    with pytest.raises(error, match=match):
        spec.build_metadata(size, **kwargs)


@pytest.mark.parametrize(("args", "error", "match"), [
    pytest.param((ranks(2), 0, [1]), ValueError,
                 r"shard_sizes=\[1\] has 1 entries but shard_placement has 2; give one size per placement",
                 id="sizes-wrong-length"),
    pytest.param((ranks(2), 0, [3, -1]), ValueError, r"shard_sizes=\[3, -1\] has a negative size",
                 id="negative-shard-size"),
    pytest.param((ranks(2), 0, [1.5, 1]), TypeError, r"shard_sizes must be ints", id="float-shard-size"),
    pytest.param(([], 0), ValueError, r"shard_placement is empty", id="no-placements"),
    pytest.param(("rank:0/cpu", 0), TypeError, r"shard_placement must be a list of placements, got 'rank:0/cpu'",
                 id="single-string"),
    pytest.param(([0, 1], 0), TypeError, r"shard_placement\[0\] must be a device string.*got int 0",
                 id="int-placement"),
    pytest.param((["rank:0/cpu", "nonsense"], 0), ValueError, r"malformed RemoteDevice 'nonsense'",
                 id="bad-device"),
    pytest.param((ranks(2), 1.0), TypeError, r"split_dimension must be an int or a dimension name, got float 1\.0",
                 id="float-dim"),
    pytest.param((ranks(2), True), TypeError, r"split_dimension must be an int.*got bool True", id="bool-dim"),
])
def test_single_split_construction_errors(args, error, match):
    with pytest.raises(error, match=match):
        SingleSplitShardingSpec(*args)


# --------------------------------------------------------------------------- Mesh

RFC_MESH = [
    ["rank:0/cuda:0", "rank:0/cuda:1", "rank:0/cuda:2", "rank:0/cuda:3"],
    ["rank:1/cuda:4", "rank:1/cuda:5", "rank:1/cuda:6", "rank:1/cuda:7"],
]


def test_mesh_rfc_4x8_tensor_on_2x4_array_gives_2x2_blocks():
    md = mesh(RFC_MESH).build_metadata((4, 8), world_size=2)
    expected = [((2 * i, 2 * j), (2, 2), f"rank:{i}/cuda:{4 * i + j}") for i in range(2) for j in range(4)]
    assert layout(md) == expected
    # The RFC's picture: cuda:0 holds the 1s, cuda:1 the 2s, cuda:4 the 5s.
    picture = torch.tensor([[1, 1, 2, 2, 3, 3, 4, 4], [1, 1, 2, 2, 3, 3, 4, 4],
                            [5, 5, 6, 6, 7, 7, 8, 8], [5, 5, 6, 6, 7, 7, 8, 8]])
    for k, s in enumerate(md.shards):
        block = picture[s.offsets[0]:s.offsets[0] + s.dims[0], s.offsets[1]:s.offsets[1] + s.dims[1]]
        assert torch.equal(block, torch.full((2, 2), k + 1)), s
    assert [i for i, _ in md.shards_on(0)] == [0, 1, 2, 3]
    assert md.ranks == (0, 1)


def test_mesh_shape_and_placement_array():
    spec = MeshShardingSpec(RFC_MESH)
    assert spec.mesh_shape == (2, 4)
    assert [[str(p.device) for p in row] for row in spec.placement_array()] == RFC_MESH
    assert spec == mesh(RFC_MESH)


def test_mesh_3d_uneven_chunks():
    placements = [[[f"rank:{4 * i + 2 * j + k}/cpu" for k in range(2)] for j in range(2)] for i in range(2)]
    md = mesh(placements).build_metadata((3, 1, 5))
    assert layout(md) == [
        ((0, 0, 0), (2, 1, 3), "rank:0/cpu"), ((0, 0, 3), (2, 1, 2), "rank:1/cpu"),
        ((0, 1, 0), (2, 0, 3), "rank:2/cpu"), ((0, 1, 3), (2, 0, 2), "rank:3/cpu"),
        ((2, 0, 0), (1, 1, 3), "rank:4/cpu"), ((2, 0, 3), (1, 1, 2), "rank:5/cpu"),
        ((2, 1, 0), (1, 0, 3), "rank:6/cpu"), ((2, 1, 3), (1, 0, 2), "rank:7/cpu"),
    ]


def test_mesh_1d_matches_single_split_on_dim_0():
    assert layout(mesh(ranks(3)).build_metadata((7,))) == layout(single_split(0, ranks(3)).build_metadata((7,)))


@pytest.mark.parametrize(("placements", "size", "kwargs", "error", "match"), [
    pytest.param([ranks(2)], (3,), {}, ValueError,
                 r"the mesh has 2 dimensions \(shape \(1, 2\)\) but the tensor has 1 \(size=\(3,\)\)",
                 id="mesh-rank-mismatch"),
    pytest.param(ranks(2), (3, 4), {}, ValueError, r"the mesh has 1 dimensions .* but the tensor has 2",
                 id="mesh-rank-too-small"),
    pytest.param([["rank:0/cpu", "rank:4/cpu"]], (2, 2), {"world_size": 4}, ValueError,
                 r"rank 4 \('rank:4/cpu'\) but the world has 4 ranks", id="rank-beyond-world"),
])
def test_mesh_build_errors(placements, size, kwargs, error, match):
    with pytest.raises(error, match=match):
        mesh(placements).build_metadata(size, **kwargs)


@pytest.mark.parametrize(("placements", "error", "match"), [
    pytest.param([ranks(2), ranks(1)], ValueError, r"ragged \(sub-shapes \[\(1,\), \(2,\)\]\)", id="ragged"),
    pytest.param([[ranks(1), ranks(1)], [ranks(1), ranks(2)]], ValueError, r"shard_placement\[1\] is ragged",
                 id="ragged-inner"),
    pytest.param([ranks(2), "rank:0/cpu"], ValueError, r"ragged", id="mixed-depth"),
    pytest.param([], ValueError, r"non-empty nested list", id="empty"),
    pytest.param([[]], ValueError, r"shard_placement\[0\] must be a non-empty nested list", id="empty-row"),
    pytest.param("rank:0/cpu", ValueError, r"is a single placement; a mesh needs a nested list", id="scalar"),
    pytest.param([[1, 2]], TypeError, r"shard_placement\[0\]\[0\] must be a non-empty nested list.*got 1",
                 id="int-entry"),
])
def test_mesh_construction_errors(placements, error, match):
    with pytest.raises(error, match=match):
        mesh(placements)


# --------------------------------------------------------------------------- Composite

LINEAR3 = ["net1.weight", "net1.bias", "net2.weight", "net2.bias", "net3.weight", "net3.bias"]


def test_composite_rfc_example_1_device_strings():
    spec = composite(net1="cuda:0", net2="cuda:1", net3="cuda:0")
    assert spec.param_placement == {"net1": DevicePlacement("cuda:0"), "net2": DevicePlacement("cuda:1"),
                                    "net3": DevicePlacement("cuda:0")}
    resolved = spec.resolve(LINEAR3)
    assert list(resolved) == LINEAR3
    assert resolved["net1.bias"] == resolved["net3.weight"] == DevicePlacement("cuda:0")
    assert resolved["net2.weight"] == DevicePlacement("cuda:1")


def test_composite_rfc_example_2_nested_specs():
    weight_only = composite(weight=single_split(0, ["cuda:0", "cuda:1"]))
    spec = composite(net1=weight_only, net2=weight_only, net3=single_split(0, ["cuda:2", "cuda:3"]))
    resolved = spec.resolve(LINEAR3)
    assert resolved == {
        "net1.weight": single_split(0, ["cuda:0", "cuda:1"]),
        "net2.weight": single_split(0, ["cuda:0", "cuda:1"]),
        "net3.weight": single_split(0, ["cuda:2", "cuda:3"]),
        "net3.bias": single_split(0, ["cuda:2", "cuda:3"]),
    }
    md = resolved["net1.weight"].build_metadata((20, 20), world_size=2)
    # Rankless placements: each chunk is replicated on every rank, on that device.
    assert layout(md) == [((0, 0), (10, 20), "rank:0/cuda:0"), ((0, 0), (10, 20), "rank:1/cuda:0"),
                          ((10, 0), (10, 20), "rank:0/cuda:1"), ((10, 0), (10, 20), "rank:1/cuda:1")]


NET1 = ["net1.weight", "net1.bias"]


@pytest.mark.parametrize(("mapping", "names", "expected"), [
    pytest.param({"net1.weight": "rank:1/cpu", "net1": "rank:0/cpu"}, NET1,
                 {"net1.weight": "rank:1/cpu", "net1.bias": "rank:0/cpu"}, id="dotted-beats-module"),
    pytest.param({"net1": "rank:0/cpu", "net1.weight": "rank:1/cpu"}, NET1,
                 {"net1.weight": "rank:1/cpu", "net1.bias": "rank:0/cpu"}, id="order-does-not-matter"),
    pytest.param({"net1": composite(weight="rank:1/cpu")}, NET1, {"net1.weight": "rank:1/cpu"},
                 id="nested-composes-paths"),
    pytest.param({"a": composite(b=composite(c="rank:2/cpu"))}, ["a.b.c.weight", "a.x"],
                 {"a.b.c.weight": "rank:2/cpu"}, id="deep-nesting"),
    pytest.param({"a.b": "rank:0/cpu"}, ["a.b.c.weight", "a.b.d", "a.e"],
                 {"a.b.c.weight": "rank:0/cpu", "a.b.d": "rank:0/cpu"}, id="dotted-submodule"),
])
def test_composite_resolution(mapping, names, expected):
    resolved = CompositeShardingSpec(mapping).resolve(names)
    assert resolved == {n: DevicePlacement(d) for n, d in expected.items()}


def test_equal_composites_resolve_equally():
    # Two keys naming the same path ("a" -> "b" and "a.b"): equal specs must not resolve
    # differently depending on the order the keys were written in; refusing is also fine.
    first = CompositeShardingSpec({"a": composite(b="rank:0/cpu"), "a.b": "rank:1/cpu"})
    second = CompositeShardingSpec({"a.b": "rank:1/cpu", "a": composite(b="rank:0/cpu")})
    assert first == second and hash(first) == hash(second)
    outcomes = []
    for spec in (first, second):
        try:
            outcomes.append(spec.resolve(["a.b.weight"]))
        except ValueError as exc:
            assert "'a.b'" in str(exc)
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1]


def test_composite_prefix_is_a_path_component_not_a_string_prefix():
    with pytest.raises(ValueError, match=r"key 'net' matches no parameter"):
        composite(net="cpu").resolve(["net1.weight"])


@pytest.mark.parametrize(("spec", "match"), [
    pytest.param(composite(net4="cpu"), r"key 'net4' matches no parameter or submodule; .*parameters: \[.*'net1.bias'",
                 id="unknown-module"),
    pytest.param(CompositeShardingSpec({"net1.scale": "cpu"}), r"key 'net1.scale' matches no parameter",
                 id="unknown-parameter"),
    pytest.param(composite(net1=composite(scale="cpu")), r"key 'net1.scale' matches no parameter",
                 id="unknown-nested"),
])
def test_composite_unknown_names_list_the_real_names(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        spec.resolve(LINEAR3)
    assert "net1.weight" in str(info.value)


LLAMA_NAMES = [f"model.layers.{i}.{part}.weight" for i in range(40)
               for part in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj",
                            "input_layernorm")] + ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def test_composite_wildcard_matches_one_component():
    col, row = single_split(0, ["rank:0/cpu", "rank:1/cpu"]), single_split(1, ["rank:0/cpu", "rank:1/cpu"])
    spec = CompositeShardingSpec({"model.layers.*.self_attn.q_proj": col, "model.layers.*.mlp.down_proj": row})
    resolved = spec.resolve(LLAMA_NAMES)
    assert sorted(resolved) == sorted(n for n in LLAMA_NAMES if "q_proj" in n or "down_proj" in n)
    assert len(resolved) == 80
    assert resolved["model.layers.39.self_attn.q_proj.weight"] == col
    assert resolved["model.layers.0.mlp.down_proj.weight"] == row
    # One component only: '*' does not stand for 'layers.0'.
    with pytest.raises(ValueError, match=r"key 'model.\*.self_attn.q_proj' matches no parameter"):
        CompositeShardingSpec({"model.*.self_attn.q_proj": col}).resolve(LLAMA_NAMES)


def test_composite_wildcards_at_any_place_and_nested():
    spec = CompositeShardingSpec({"*.layers.*.mlp": composite(**{"*.weight": "rank:1/cpu"}),
                                  "model.*.7.input_layernorm": "rank:0/cpu"})
    resolved = spec.resolve(LLAMA_NAMES)
    assert resolved["model.layers.3.mlp.up_proj.weight"] == DevicePlacement("rank:1/cpu")
    assert resolved["model.layers.7.input_layernorm.weight"] == DevicePlacement("rank:0/cpu")
    assert len(resolved) == 81


def test_composite_literal_key_beats_wildcard_at_equal_depth():
    col = single_split(0, ["rank:0/cpu", "rank:1/cpu"])
    spec = CompositeShardingSpec({"model.layers.*.mlp.up_proj": col, "model.layers.5.mlp.up_proj": "cpu",
                                  "model.layers.*.mlp.up_proj.weight": "rank:1/cpu"})
    resolved = spec.resolve(LLAMA_NAMES)
    assert resolved["model.layers.5.mlp.up_proj.weight"] == DevicePlacement("rank:1/cpu")  # deeper wins
    spec = CompositeShardingSpec({"model.layers.*.mlp.up_proj": col, "model.layers.5.mlp.up_proj": "cpu"})
    resolved = spec.resolve(LLAMA_NAMES)
    assert resolved["model.layers.5.mlp.up_proj.weight"] == DevicePlacement("cpu")
    assert resolved["model.layers.6.mlp.up_proj.weight"] == col


def test_composite_two_wildcards_disagreeing_on_one_name_are_refused():
    spec = CompositeShardingSpec({"model.layers.*.mlp": "rank:0/cpu", "model.*.3.mlp": "rank:1/cpu"})
    with pytest.raises(ValueError, match=r"gives 'model.layers.3.mlp.up_proj.weight' two different specs.*"
                                         r"'model.\*.3.mlp'"):
        spec.resolve(LLAMA_NAMES)


def test_composite_unmatched_wildcard_key_suggests_close_names_not_every_name():
    with pytest.raises(ValueError) as info:
        CompositeShardingSpec({"model.layers.*.mlp.dwn_proj": "cpu"}).resolve(LLAMA_NAMES)
    msg = str(info.value)
    assert "key 'model.layers.*.mlp.dwn_proj' matches no parameter or submodule" in msg
    assert "closest names: ['model.layers.*.mlp.down_proj'" in msg
    assert "model.layers.17." not in msg  # layer numbers are folded, not listed 40 times
    assert len(msg) < 1000


def test_composite_unmatched_key_in_a_large_model_lists_what_lies_under_its_matching_part():
    names = [f"model.layers.{i}.block{j}.weight" for i in range(30) for j in range(60)]
    with pytest.raises(ValueError) as info:
        CompositeShardingSpec({"model.layers.*.zzz": "cpu"}).resolve(names)
    msg = str(info.value)
    assert "under 'model.layers.*': ['model.layers.*.block0', " in msg
    assert "and 20 more" in msg
    with pytest.raises(ValueError, match=r"the top-level names are \['model'\]"):
        CompositeShardingSpec({"decoder.zzz": "cpu"}).resolve(names)


@pytest.mark.parametrize("key", ["model.layers.1*", "model.*layers", "q_*"])
def test_composite_star_inside_a_component_is_refused(key):
    with pytest.raises(ValueError, match=r"has a '\*' inside a name component"):
        CompositeShardingSpec({key: "cpu"})


@pytest.mark.parametrize(("mapping", "error", "match"), [
    pytest.param({"": "cpu"}, ValueError, r"param_placement key '' is not a parameter or module name", id="empty-key"),
    pytest.param({"net1..weight": "cpu"}, ValueError, r"key 'net1..weight' is not a parameter", id="empty-component"),
    pytest.param({"net1": 3}, TypeError, r"param_placement\['net1'\] is int 3; expected a sharding spec",
                 id="bad-value"),
    pytest.param(["net1"], TypeError, r"param_placement must be a mapping", id="not-a-mapping"),
])
def test_composite_construction_errors(mapping, error, match):
    with pytest.raises(error, match=match):
        CompositeShardingSpec(mapping)


def test_composite_is_read_only_and_refuses_build_metadata():
    spec = composite(net1="cpu")
    with pytest.raises(TypeError, match="read-only"):
        spec.param_placement["net2"] = DevicePlacement("cpu")  # type: ignore[index]
    with pytest.raises(TypeError, match="applies to a module"):
        spec.build_metadata((2, 2))


# --------------------------------------------------------------------------- value semantics

ALL_SPECS = [
    pytest.param(DevicePlacement("rank:0/cuda:1"), id="device-ranked"),
    pytest.param(DevicePlacement("cpu"), id="device-replicated"),
    pytest.param(single_split(0, ranks(4)), id="single-split"),
    pytest.param(single_split(-1, ["rank:0/cpu", "cpu"], shard_sizes=[3, 1]), id="single-split-uneven"),
    pytest.param(single_split("cols", ranks(2)), id="single-split-named"),
    pytest.param(mesh(RFC_MESH), id="mesh-rfc"),
    pytest.param(mesh([[["rank:0/cpu"], ["rank:1/cpu"]]]), id="mesh-3d"),
    pytest.param(EnumerableShardingSpec([ShardMetadata((0, 0), (1, 2), "rank:0/cpu"),
                                         ShardMetadata((1, 0), (1, 2), "rank:1/cpu")]), id="enumerable"),
    pytest.param(composite(net1=composite(weight=single_split(0, ["cuda:0", "cuda:1"])), net2="cuda:1",
                           net3=mesh([ranks(2)])), id="composite-nested"),
    pytest.param(CompositeShardingSpec({"net1.weight": single_split(1, ranks(2))}), id="composite-dotted"),
]


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_spec_to_dict_round_trips_through_json(spec):
    data = spec.to_dict()
    assert json.loads(json.dumps(data)) == data  # JSON-safe
    rebuilt = spec_from_dict(json.loads(json.dumps(data)))
    assert rebuilt == spec
    assert type(rebuilt) is type(spec)
    assert hash(rebuilt) == hash(spec)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_spec_is_a_value_equal_hashable_picklable(spec):
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec and hash(clone) == hash(spec)
    assert len({spec, clone}) == 1
    assert spec != DevicePlacement("rank:7/cpu")


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_spec_repr_round_trips(spec):
    namespace = {name: getattr(sharding, name) for name in sharding.__all__} | {"torch": torch}
    assert eval(repr(spec), namespace) == spec


def test_equal_specs_from_different_spellings():
    assert single_split(0, ["rank:0/cpu", RemoteDevice("rank:1/cpu"), DevicePlacement("rank:2/cpu")]) == \
        SingleSplitShardingSpec(tuple(ranks(3)), 0)
    assert single_split(0, ranks(2)) != single_split(0, ranks(2), [1, 1])
    assert single_split(0, ranks(2)) != single_split(1, ranks(2))
    assert mesh([ranks(2)]) != mesh([[r] for r in ranks(2)])  # same placements, different mesh shape
    assert composite(a="cpu", b="rank:0/cpu") == composite(b="rank:0/cpu", a="cpu")


@pytest.mark.parametrize("value", [
    pytest.param(RemoteDevice("rank:3/cuda:1"), id="remote-device"),
    pytest.param(RemoteDevice("cpu"), id="remote-device-rankless"),
    pytest.param(ShardMetadata((0, 2), (3, 4), "rank:1/cpu"), id="shard-metadata"),
    pytest.param(single_split(1, ranks(2)).build_metadata((3, 5), torch.bfloat16), id="sharded-tensor-metadata"),
])
def test_metadata_value_types(value):
    namespace = {name: getattr(sharding, name) for name in sharding.__all__} | {"torch": torch}
    clone = pickle.loads(pickle.dumps(value))
    assert clone == value and hash(clone) == hash(value)
    assert eval(repr(value), namespace) == value
    if hasattr(value, "to_dict"):
        assert type(value).from_dict(json.loads(json.dumps(value.to_dict()))) == value


def test_shard_metadata_fields():
    s = ShardMetadata([0, 2], [3, 4], "rank:1/cpu")
    assert s.offsets == (0, 2) and s.dims == (3, 4)
    assert s.device == RemoteDevice("rank:1/cpu") and s.rank == 1
    assert s.numel == 12
    with pytest.raises(AttributeError):
        s.offsets = (1, 1)  # type: ignore[misc]


@pytest.mark.parametrize(("args", "match"), [
    pytest.param(((0,), (1, 2), "rank:0/cpu"), r"offsets=\(0,\) and dims=\(1, 2\) have different lengths",
                 id="length-mismatch"),
    pytest.param(((-1,), (1,), "rank:0/cpu"), r"must not be negative", id="negative-offset"),
    pytest.param(((0,), (-1,), "rank:0/cpu"), r"must not be negative", id="negative-size"),
])
def test_shard_metadata_errors(args, match):
    with pytest.raises(ValueError, match=match):
        ShardMetadata(*args)


def test_sharded_tensor_metadata_fields():
    md = single_split(0, ranks(2)).build_metadata([4, 3])
    assert md.size == torch.Size([4, 3]) and isinstance(md.size, torch.Size)
    assert md.dtype == torch.get_default_dtype()
    assert isinstance(md.shards, tuple) and all(isinstance(s, ShardMetadata) for s in md.shards)
    with pytest.raises(ValueError, match=r"shards\[0\] has 1 dimensions"):
        ShardedTensorMetadata([ShardMetadata((0,), (4,), "rank:0/cpu")], (4, 3))


def test_spec_from_dict_errors():
    with pytest.raises(ValueError, match=r"unknown spec type 'zzz'") as info:
        spec_from_dict({"type": "zzz"})
    for tag in ("'device'", "'single_split'", "'mesh'", "'enumerable'", "'partial'", "'composite'"):
        assert tag in str(info.value)  # lists every known tag
    with pytest.raises(ValueError, match=r"expects a mapping with a 'type' key"):
        spec_from_dict({"device": "cpu"})


# --------------------------------------------------------------------------- check_tiling

def _md(*regions: tuple[tuple[int, ...], tuple[int, ...]]) -> list[ShardMetadata]:
    return [ShardMetadata(o, d, f"rank:{i}/cpu") for i, (o, d) in enumerate(regions)]


@pytest.mark.parametrize(("shards", "size", "match"), [
    pytest.param(_md(((0,), (2,)), ((3,), (1,))), (4,), r"shards leave a gap at element \(2,\).*no shard covers it",
                 id="gap-1d"),
    pytest.param(_md(((0,), (3,)), ((2,), (2,))), (4,), r"shards overlap at element \(2,\).*shards\[0\].*shards\[1\]",
                 id="overlap-1d"),
    pytest.param(_md(((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 3))), (4, 4),
                 r"gap at element \(2, 3\)", id="gap-2d"),
    pytest.param(_md(((0, 0), (2, 3)), ((0, 2), (2, 2)), ((2, 0), (2, 4))), (4, 4),
                 r"overlap at element \(0, 2\)", id="overlap-2d"),
    pytest.param(_md(((1,), (2,)), ((2,), (2,))), (4,), r"shards leave a gap at element \(0,\)",
                 id="gap-before-overlap"),
    pytest.param(_md(((0,), (3,)), ((2,), (3,))), (4,), r"shards\[1\] .* reaches past the tensor's size \(4,\)",
                 id="out-of-bounds"),
    pytest.param(_md(((0, 0), (4, 4))), (4,), r"shards\[0\] has 2 dimensions but the tensor has 1",
                 id="wrong-ndim"),
    pytest.param(_md(), (4,), r"leave a gap", id="nothing"),
])
def test_check_tiling_errors(shards, size, match):
    with pytest.raises(ValueError, match=match):
        check_tiling(shards, size)


def _rows(n: int, *extra: tuple[tuple[int, ...], tuple[int, ...]], drop: int | None = None) -> list[ShardMetadata]:
    """``n`` one-row shards of an (n, 3) tensor (enough to take the vectorized path), changed as asked."""
    regions = [((r, 0), (1, 3)) for r in range(n) if r != drop]
    return _md(*regions, *extra)


@pytest.mark.parametrize(("shards", "match"), [
    pytest.param(_rows(100, drop=37), r"shards leave a gap at element \(37, 0\) .*no shard covers it", id="gap"),
    pytest.param(_rows(100, ((10, 1), (2, 1))), r"shards overlap at element \(10, 1\)", id="overlap"),
    pytest.param(_rows(100, ((99, 0), (2, 3))), r"shards\[100\] .* reaches past the tensor's size \(100, 3\)",
                 id="past-the-end"),
    pytest.param(_rows(100, ((0, 0), (0, 4))), r"shards\[100\] .* reaches past .* along dimension 1",
                 id="empty-but-too-wide"),
    pytest.param(_rows(100, ((0,), (1,))), r"shards\[100\] has 1 dimensions but the tensor has 2", id="wrong-ndim"),
])
def test_check_tiling_of_many_shards_finds_what_few_would(shards, match):
    # Past a few dozen shards the check is vectorized; a problem is then reported as before.
    with pytest.raises(ValueError, match=match):
        check_tiling(shards, (100, 3))


def test_check_tiling_of_many_shards_accepts_replicas_empty_shards_and_uneven_blocks():
    check_tiling(_rows(100, ((5, 0), (1, 3)), ((100, 0), (0, 3))), (100, 3))
    mesh_like = _md(*[((r, c), (1, 1)) for r in range(10) for c in range(3)],
                    *[((r, 0), (1, 3)) for r in range(10, 100)])
    check_tiling(mesh_like, (100, 3))


def test_check_tiling_accepts_replicas_and_empty_shards():
    check_tiling(_md(((0,), (4,)), ((0,), (4,)), ((4,), (0,))), (4,))
    check_tiling([], (0, 3))


def test_enumerable_spec_checks_tiling():
    with pytest.raises(ValueError, match=r"gap at element \(2,\)"):
        EnumerableShardingSpec(_md(((0,), (2,)))).build_metadata((4,))
    with pytest.raises(ValueError, match=r"without a rank"):
        EnumerableShardingSpec([ShardMetadata((0,), (4,), "cpu")])


# --------------------------------------------------------------------------- properties

WORLD = 4


@st.composite
def placements(draw: st.DrawFn, n: int) -> list[str]:
    """``n`` placements: mostly ranked (repeats allowed), sometimes a rankless replica."""
    return [draw(st.sampled_from([*ranks(WORLD), "cpu"])) for _ in range(n)]


@st.composite
def split_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], SingleSplitShardingSpec]:
    size = tuple(draw(st.lists(st.integers(0, 20), min_size=1, max_size=3)))
    dim = draw(st.integers(-len(size), len(size) - 1))
    k = draw(st.integers(1, 6))
    sizes = None
    if draw(st.booleans()):  # a random uneven composition of size[dim] into k parts
        cuts = sorted(draw(st.lists(st.integers(0, size[dim]), min_size=k - 1, max_size=k - 1)))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, size[dim]])]
    return size, single_split(dim, draw(placements(k)), sizes)


@st.composite
def mesh_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], MeshShardingSpec]:
    size = tuple(draw(st.lists(st.integers(0, 20), min_size=1, max_size=3)))
    shape = [draw(st.integers(1, 4)) for _ in size]
    flat = draw(placements(math.prod(shape)))

    def nest(level: int, start: int) -> list[object]:
        stride = math.prod(shape[level + 1:])
        if level == len(shape) - 1:
            return flat[start:start + shape[level]]
        return [nest(level + 1, start + i * stride) for i in range(shape[level])]

    return size, mesh(nest(0, 0))


def _per_placement(md: ShardedTensorMetadata, placement_list: tuple[DevicePlacement, ...]) -> list[ShardMetadata]:
    """The shard of each placement, in placement order; checks that replicas are explicit.

    A ranked placement yields one shard on its rank; a rankless one yields one shard per rank
    of the world (ranks 0..WORLD-1, same region, same device type), adjacent.
    """
    shards = list(md.shards)
    assert len(shards) == sum(1 if p.device.rank is not None else WORLD for p in placement_list)
    result, i = [], 0
    for p in placement_list:
        if p.device.rank is not None:
            assert shards[i].device == p.device
            result.append(shards[i])
            i += 1
        else:
            group = shards[i:i + WORLD]
            assert [s.rank for s in group] == list(range(WORLD))
            assert {s.region for s in group} == {group[0].region}
            assert {s.device.device for s in group} == {p.device.device}
            result.append(group[0])
            i += WORLD
    return result


def _assert_tiles_exactly(md: ShardedTensorMetadata, per_placement: list[ShardMetadata]) -> None:
    """Painting each placement's region once covers every element exactly once."""
    counts = torch.zeros(tuple(md.size), dtype=torch.int32)
    for s in per_placement:
        assert len(s.offsets) == len(md.size)
        counts[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.dims))] += 1
    assert bool((counts == 1).all()), (layout(md), counts)
    # Empty shards sit inside the tensor too (offsets clamped to the size).
    assert all(o + n <= m for s in per_placement for o, n, m in zip(s.offsets, s.dims, md.size))
    check_tiling(md.shards, md.size)


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_cases())
def test_property_single_split_tiles_and_follows_chunk(case):
    size, spec = case
    md = spec.build_metadata(size, world_size=WORLD)
    assert md.size == torch.Size(size)
    per_placement = _per_placement(md, spec.shard_placement)
    _assert_tiles_exactly(md, per_placement)
    dim = spec.split_dimension % len(size)
    lengths = [s.dims[dim] for s in per_placement]
    expected = list(spec.shard_sizes) if spec.shard_sizes is not None else chunk_lengths(size[dim], len(lengths))
    assert lengths == expected
    assert [s.offsets[dim] for s in per_placement] == [min(sum(expected[:i]), size[dim]) for i in range(len(expected))]
    for s in md.shards:
        assert all(s.offsets[d] == 0 and s.dims[d] == size[d] for d in range(len(size)) if d != dim)


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mesh_cases())
def test_property_mesh_tiles_and_follows_chunk(case):
    size, spec = case
    md = spec.build_metadata(size, world_size=WORLD)
    per_placement = _per_placement(md, spec.shard_placement)
    _assert_tiles_exactly(md, per_placement)
    # Along every tensor dim, the block lengths are torch.chunk's (padded), in mesh order.
    for d, k in enumerate(spec.mesh_shape):
        stride = math.prod(spec.mesh_shape[d + 1:])
        assert [per_placement[j * stride].dims[d] for j in range(k)] == chunk_lengths(size[d], k)


@settings(max_examples=examples(100), deadline=None)
@given(st.one_of(split_cases(), mesh_cases()))
def test_property_specs_round_trip(case):
    _, spec = case
    assert spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec


# --------------------------------------------------------------------------- the spec interface

SPEC_CLASSES = [DevicePlacement, SingleSplitShardingSpec, MeshShardingSpec, EnumerableShardingSpec, PartialSpec,
                CompositeShardingSpec]


def test_placement_spec_is_abstract():
    assert PlacementSpec.__abstractmethods__ == frozenset({"build_metadata", "to_dict", "from_dict"})
    with pytest.raises(TypeError, match="abstract"):
        PlacementSpec()  # type: ignore[abstract]

    class NoLayout(PlacementSpec):
        def to_dict(self) -> dict[str, object]:
            return {}

        @classmethod
        def from_dict(cls, data: object) -> NoLayout:  # type: ignore[override]
            return cls()

    with pytest.raises(TypeError, match="build_metadata"):
        NoLayout()  # type: ignore[abstract]


@pytest.mark.parametrize("cls", SPEC_CLASSES, ids=lambda c: c.__name__)
def test_every_spec_class_is_registered_under_its_tag(cls):
    assert issubclass(cls, PlacementSpec) and not cls.__abstractmethods__
    assert sharding._placement._SPEC_TYPES[cls.spec_type] is cls


@pytest.mark.parametrize("spec", [
    pytest.param(DevicePlacement("rank:1/cpu"), id="device"),
    pytest.param(single_split(1, ranks(3), [1, 0, 2]), id="single-split"),
    pytest.param(mesh([ranks(2), ranks(2)[::-1]]), id="mesh"),
    pytest.param(EnumerableShardingSpec([ShardMetadata((0,), (2,), "rank:0/cpu"),
                                         ShardMetadata((2,), (1,), "rank:1/cpu")]), id="enumerable"),
    pytest.param(PartialSpec(ranks(2), reduce_op="max"), id="partial"),
    pytest.param(composite(a="cpu", b=composite(c=single_split(0, ranks(2)))), id="composite"),
])
def test_to_dict_carries_the_registered_tag_and_round_trips(spec):
    data = spec.to_dict()
    assert data["type"] == type(spec).spec_type
    assert spec_from_dict(json.loads(json.dumps(data))) == spec
    assert type(spec).from_dict(data) == spec


def test_register_spec_refuses_a_tag_taken_by_another_class():
    with pytest.raises(ValueError, match=r"spec type 'mesh' is already registered by MeshShardingSpec"):
        @register_spec("mesh")
        class Other(PlacementSpec):  # pragma: no cover - never built
            pass
    assert sharding._placement._SPEC_TYPES["mesh"] is MeshShardingSpec


def test_composite_refuses_build_metadata_with_the_common_signature():
    with pytest.raises(TypeError, match="applies to a module"):
        composite(a="cpu").build_metadata((2,), torch.float32, None, world_size=2)
