"""The pure planning of fully sharded units: flat layouts, data-parallel groups, shard layouts."""

from __future__ import annotations

import pytest
import torch

from sharded_tensor._fsdp.plan import partition, plan_unit, shard_spec


@pytest.mark.parametrize(("rows", "world", "expected"), [
    pytest.param(8, 4, [(0, 2), (2, 2), (4, 2), (6, 2)], id="even"),
    pytest.param(10, 4, [(0, 3), (3, 3), (6, 3), (9, 1)], id="uneven"),
    pytest.param(3, 4, [(0, 1), (1, 1), (2, 1), (3, 0)], id="more-ranks-than-rows"),
    pytest.param(5, 3, [(0, 2), (2, 2), (4, 1)], id="short-last"),
    pytest.param(7, 1, [(0, 7)], id="one-rank"),
])
def test_rows_follow_torch_chunk(rows: int, world: int, expected: list[tuple[int, int]]) -> None:
    flat = plan_unit([("w", (rows, 3))], world).params[0]
    assert [flat.rows_of(r) for r in range(world)] == expected
    chunks = torch.arange(rows).chunk(world)
    assert [(int(c[0]), len(c)) for c in chunks] == [e for e in expected if e[1]]


def test_segments_pack_every_parameter_padded_to_its_chunk() -> None:
    plan = plan_unit([("w", (3, 2)), ("b", (3,)), ("e", (10, 4))], 2)
    assert [(p.chunk, p.row, p.padded, p.offset) for p in plan.params] == [(2, 2, 4, 0), (2, 1, 2, 4),
                                                                            (5, 4, 20, 6)]
    assert plan.segment == 26 and plan.flat_numel == 52
    # In the unsharded buffer a parameter starts at world * offset and is contiguous.
    assert [plan.full_slice(p) for p in plan.params] == [slice(0, 6), slice(8, 11), slice(12, 52)]
    assert plan.params[2].local_shape(1) == (5, 4)


def test_a_flat_layout_round_trips_through_segments() -> None:
    """Packing each rank's rows into segments and copying out gives back every parameter."""
    shapes = [("a", (5, 3)), ("b", (2,)), ("c", (1, 2, 2))]
    world = 3
    plan = plan_unit(shapes, world)
    values = [torch.randn(s) for _, s in shapes]
    segments = torch.zeros(world, plan.segment)
    for r in range(world):
        for flat, v in zip(plan.params, values):
            start, length = flat.rows_of(r)
            segments[r, flat.offset:flat.offset + length * flat.row] = v[start:start + length].reshape(-1)
    unsharded = torch.empty(plan.flat_numel)
    for flat in plan.params:
        start = world * flat.offset
        unsharded[start:start + world * flat.padded].view(world, flat.padded).copy_(
            segments[:, flat.offset:flat.offset + flat.padded])
    for flat, v in zip(plan.params, values):
        assert torch.equal(unsharded[plan.full_slice(flat)].view(flat.shape), v)


def test_a_scalar_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match=r"parameter 'scale' is 0-d .* give it shape \(1,\)"):
        plan_unit([("w", (2, 2)), ("scale", ())], 2)


@pytest.mark.parametrize(("requested", "world", "expected"), [
    pytest.param([None, None, None], 3, [(0, 1, 2)], id="world"),
    pytest.param([[0, 2], [1, 3], [0, 2], [1, 3]], 4, [(0, 2), (1, 3)], id="columns"),
    pytest.param([[0, 1], [0, 1], [2, 3], [2, 3]], 4, [(0, 1), (2, 3)], id="rows"),
    pytest.param([[0], [1]], 2, [(0,), (1,)], id="singletons"),
    pytest.param([[0, 1, 2], [0, 1, 2], [0, 1, 2], []], 4, [(0, 1, 2)], id="three-of-four"),
])
def test_partition(requested: list, world: int, expected: list) -> None:  # type: ignore[type-arg]
    assert partition(requested, world) == expected


@pytest.mark.parametrize(("requested", "world", "message"), [
    pytest.param([[0, 1], [0, 1], [2]], 3, r"groups \[\[0, 1\], \[2\]\] have different sizes \[1, 2\]",
                 id="not-dividing"),
    pytest.param([None, [0, 1]], 2, r"ranks=None\) on ranks \[0\] but ranks=\[...\] on the others", id="mixed"),
    pytest.param([[1], [1]], 2, r"rank 0 passed ranks=\[1\], which does not include it", id="not-including"),
    pytest.param([[0, 1], [1]], 2, r"ranks \[0\] passed ranks=\[0, 1\], but its members must be exactly",
                 id="disagreeing"),
    pytest.param([[], []], 2, r"ranks=\[\] on every rank leaves no rank", id="nobody"),
    pytest.param([[0, 1], [0, 1], [], [3]], 4, r"different sizes \[1, 2\]", id="uneven-with-absent"),
])
def test_partition_refuses(requested: list, world: int, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        partition(requested, world)


def test_shard_spec_is_a_dim_0_split_and_lists_replicas_across_groups() -> None:
    one = shard_spec([(0, 1, 2)], (7, 2), torch.device("cpu")).build_metadata((7, 2), torch.float32)
    assert [(s.offsets, s.dims, s.rank) for s in one.shards] == [((0, 0), (3, 2), 0), ((3, 0), (3, 2), 1),
                                                                  ((6, 0), (1, 2), 2)]
    two = shard_spec([(0, 2), (1, 3)], (3,), torch.device("cpu")).build_metadata((3,), torch.float32)
    assert [(s.offsets, s.dims, s.rank) for s in two.shards] == [((0,), (2,), 0), ((2,), (1,), 2),
                                                                  ((0,), (2,), 1), ((2,), (1,), 3)]
