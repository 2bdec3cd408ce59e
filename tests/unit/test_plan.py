"""The pure reshard planner: every rank's plan, checked against brute force, no process group.

The layouts are random (hypothesis): single splits (even or uneven, any dimension, negative
ones included), meshes, ``DevicePlacement`` with or without a rank, several shards per rank,
empty shards and explicit (``EnumerableShardingSpec``) layouts with replicas. For every pair
we plan every rank and check the plans against each other and against a mask-based count of
what each rank must receive.

The strategies here are shared with ``tests/distributed/test_reshard.py``.
"""

from __future__ import annotations

import math
import pickle
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from sharded_tensor._plan import plan_reshard, total_traffic
from sharding import (
    DevicePlacement,
    EnumerableShardingSpec,
    ShardedTensorMetadata,
    ShardMetadata,
    mesh,
    single_split,
)
from sharding.layout import RegionIndex
from tests._examples import examples

PLAN_SETTINGS = settings(max_examples=examples(80), deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- strategies: random layouts -----------------------------------------------------------


@hst.composite
def sizes(draw: hst.DrawFn, max_ndim: int = 3, max_dim: int = 6) -> tuple[int, ...]:
    """A global shape of 0 to ``max_ndim`` dimensions (mostly 2); zero-length dimensions included."""
    ndim = draw(hst.sampled_from([n for n in (2, 1, 3, 2, 0, 2, 3, 1) if n <= max_ndim]))
    return tuple(draw(hst.integers(0, max_dim)) for _ in range(ndim))


@hst.composite
def placements(draw: hst.DrawFn, world: int, rankless: bool = True) -> str:
    """``"rank:<r>/cpu"``, or now and then ``"cpu"`` (a replica on every rank)."""
    if rankless and draw(hst.integers(0, 7)) == 0:
        return "cpu"
    return f"rank:{draw(hst.integers(0, world - 1))}/cpu"


@hst.composite
def compositions(draw: hst.DrawFn, n: int, parts: int) -> list[int]:
    """``parts`` non-negative ints summing to ``n`` (an uneven split, zeros allowed)."""
    cuts = sorted(draw(hst.lists(hst.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, n]
    return [bounds[i + 1] - bounds[i] for i in range(parts)]


@hst.composite
def specs(draw: hst.DrawFn, size: tuple[int, ...], world: int, *, enumerable: bool = True,
          rankless: bool = True, kinds: tuple[str, ...] | None = None, min_holders: int = 1) -> object:
    """A tensor sharding spec valid for ``size`` on ``world`` ranks (of one of ``kinds``)."""
    ndim = len(size)
    allowed = (["split", "mesh"] if ndim else []) + (["enumerable"] if enumerable else []) + ["device"]
    kind = draw(hst.sampled_from([k for k in allowed if kinds is None or k in kinds]))
    place = placements(world, rankless)
    if kind == "device":
        return DevicePlacement(draw(place))
    if kind == "split":
        dim = draw(hst.integers(-ndim, ndim - 1))
        k = draw(hst.integers(1, 5))
        devices = [draw(place) for _ in range(k)]
        shard_sizes = draw(compositions(size[dim], k)) if draw(hst.booleans()) else None
        return single_split(dim, devices, shard_sizes)
    if kind == "mesh":
        shape = [draw(hst.integers(1, 3)) for _ in range(ndim)]

        def nest(level: int) -> object:
            if level == ndim:
                return draw(place)
            return [nest(level + 1) for _ in range(shape[level])]
        return mesh(nest(0))
    # Explicit shards: the regions of another layout, each held by a random set of ranks
    # (replicas), sometimes twice by the same rank, in a random order.
    base = draw(specs(size, world, enumerable=False, rankless=False))
    regions = list(dict.fromkeys(s.region for s in base.build_metadata(size).shards))
    shards = []
    for offsets, dims in regions:
        holders = draw(hst.lists(hst.integers(0, world - 1), min_size=min(min_holders, world),
                                 max_size=min(world, max(3, min_holders)), unique=True))
        shards += [ShardMetadata(offsets, dims, f"rank:{r}/cpu") for r in holders]
    if draw(hst.booleans()):
        shards.append(shards[draw(hst.integers(0, len(shards) - 1))])
    return EnumerableShardingSpec(draw(hst.permutations(shards)))


@hst.composite
def reshard_cases(draw: hst.DrawFn, worlds: tuple[int, ...] = (1, 2, 3, 4, 5),
                  src_kinds: tuple[str, ...] | None = None, src_min_holders: int = 1) -> tuple[
                      int, ShardedTensorMetadata, ShardedTensorMetadata]:
    """``(world, src, dst)``: two random layouts of one random size."""
    world = draw(hst.sampled_from(worlds))
    size = draw(sizes())
    src = draw(specs(size, world, kinds=src_kinds, min_holders=src_min_holders)).build_metadata(size, world_size=world)
    dst = draw(specs(size, world)).build_metadata(size, world_size=world)
    return world, src, dst


# -- brute-force references ---------------------------------------------------------------


def region_slices(box: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[slice, ...]:
    offsets, dims = box
    return tuple(slice(o, o + n) for o, n in zip(offsets, dims))


def held_mask(metadata: ShardedTensorMetadata, rank: int) -> torch.Tensor:
    """Boolean mask of the global tensor: the elements ``rank`` holds in ``metadata``."""
    mask = torch.zeros(tuple(metadata.size), dtype=torch.bool)
    for shard in metadata.shards:
        if shard.rank == rank:
            mask[region_slices(shard.region)] = True
    return mask


def minimum_received(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, rank: int) -> int:
    """Elements ``rank`` must receive: those of its destination regions it does not hold in ``src``."""
    return int((held_mask(dst, rank) & ~held_mask(src, rank)).sum())


def minimum_elements(src: ShardedTensorMetadata, dst: ShardedTensorMetadata) -> int:
    """Fewest elements any reshard from ``src`` to ``dst`` must put on the wire, all ranks together."""
    ranks = {s.rank for s in dst.shards}
    return sum(minimum_received(src, dst, r) for r in ranks)


def brute_overlapping(boxes, query):  # type: ignore[no-untyped-def]
    result = []
    for i, (offsets, dims) in enumerate(boxes):
        lo = [max(o, q) for o, q in zip(offsets, query[0])]
        hi = [min(o + n, q + m) for o, n, q, m in zip(offsets, dims, query[0], query[1])]
        if math.prod(dims) and math.prod(query[1]) and all(h > a for a, h in zip(lo, hi)):
            result.append((i, (tuple(lo), tuple(h - a for a, h in zip(lo, hi)))))
    return result


def all_plans(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, world: int) -> dict:  # type: ignore[type-arg]
    return {r: plan_reshard(src, dst, rank=r) for r in range(world)}


def inside(box, region) -> bool:  # type: ignore[no-untyped-def]
    return all(o <= bo and bo + bn <= o + n for bo, bn, o, n in zip(box[0], box[1], region[0], region[1]))


# -- properties -------------------------------------------------------------------------
# One hypothesis test runs every check on each random case (generation dominates the cost);
# each check's assertion message names the property it guards.


def check_coverage(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, plans: dict) -> None:  # type: ignore[type-arg]
    """Pieces received (copied or sent) by each rank cover each of its destination regions exactly once."""
    for rank, plan in plans.items():
        pieces = list(plan.copies) + [p for ps in plan.recvs.values() for p in ps]
        paint: dict = {}
        for p in pieces:
            shard = dst.shards[p.dst_shard]
            assert shard.rank == rank == p.dst_rank, ("piece lands on a shard of another rank", rank, p)
            assert src.shards[p.src_shard].rank == p.src_rank, ("piece comes from a shard of another rank", p)
            assert p.numel > 0, ("empty piece", p)
            assert inside(p.box, shard.region) and inside(p.box, src.shards[p.src_shard].region), (
                "piece outside its shards", p)
            count = paint.setdefault(shard.region, torch.zeros(tuple(dst.size), dtype=torch.int64))
            count[region_slices(p.box)] += 1
        for c in plan.copies:
            assert c.src_rank == c.dst_rank == rank, ("a local copy names another rank", rank, c)
        wanted = {s.region for _, s in dst.shards_on(rank) if s.numel > 0}
        assert set(paint) == wanted, ("regions filled differ from the rank's destination regions", rank)
        for region, count in paint.items():
            assert bool((count[region_slices(region)] == 1).all()), (
                "destination region not covered exactly once", rank, region, count)
            assert int(count.sum()) == math.prod(region[1]), ("pieces outside the region", rank, region)


def check_local_never_sent(src: ShardedTensorMetadata, plans: dict) -> None:  # type: ignore[type-arg]
    """A rank sends only what it holds, never to itself, never what the peer already holds."""
    for rank, plan in plans.items():
        assert rank not in plan.sends and rank not in plan.recvs, ("a rank sends to itself", rank)
        mine = held_mask(src, rank)
        for peer, pieces in plan.sends.items():
            peer_has = held_mask(src, peer)
            for p in pieces:
                assert p.src_rank == rank and p.dst_rank == peer, ("send piece names other ranks", rank, peer, p)
                assert bool(mine[region_slices(p.box)].all()), ("sent data the rank does not hold", rank, p)
                assert not bool(peer_has[region_slices(p.box)].any()), (
                    "sent data the peer already holds (a local copy is also sent)", rank, p)


def check_symmetric(plans: dict) -> None:  # type: ignore[type-arg]
    """What rank a sends to b is what b receives from a: same pieces, same order."""
    for a in plans:
        for b in plans:
            assert plans[a].sends.get(b, []) == plans[b].recvs.get(a, []), ("sends of a to b != recvs of b from a",
                                                                             a, b)


def check_minimum(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, plans: dict) -> None:  # type: ignore[type-arg]
    """Each rank receives exactly what it lacks; the total sent is the minimum."""
    for rank, plan in plans.items():
        assert plan.elements_received() == minimum_received(src, dst, rank), ("received != what the rank lacks",
                                                                               rank)
    total = sum(p.elements_sent() for p in plans.values())
    assert total == minimum_elements(src, dst), ("elements sent != minimum", total, minimum_elements(src, dst))
    assert sum(total_traffic(src, dst).values()) == total, "total_traffic disagrees with the plans"


def check_filled(dst: ShardedTensorMetadata, plans: dict) -> None:  # type: ignore[type-arg]
    """Every non-empty destination shard is filled: by pieces, or from a replica on the same rank."""
    for rank, plan in plans.items():
        filled = {p.dst_shard for p in plan.copies} | {p.dst_shard for ps in plan.recvs.values() for p in ps}
        for first, other in plan.duplicates:
            assert dst.shards[first].region == dst.shards[other].region, ("duplicate of another region", first, other)
            assert dst.shards[first].rank == dst.shards[other].rank == rank, ("duplicate on another rank", rank)
            filled.add(other)
        nonempty = {i for i, s in dst.shards_on(rank) if s.numel > 0}
        assert filled == nonempty, ("destination shards left unfilled or filled twice", rank, filled, nonempty)


def check_deterministic(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, plans: dict) -> None:  # type: ignore[type-arg]
    """Planning again, or from rebuilt (JSON, pickle) metadata, gives the same plan."""
    again_src = ShardedTensorMetadata.from_dict(src.to_dict())
    again_dst = pickle.loads(pickle.dumps(dst))
    for rank, plan in plans.items():
        assert plan == plan_reshard(src, dst, rank=rank), ("plan differs when computed again", rank)
        assert plan == plan_reshard(again_src, again_dst, rank=rank), ("plan differs on rebuilt metadata", rank)


@settings(PLAN_SETTINGS, max_examples=examples(100))
@given(reshard_cases())
def test_plan_properties(case):
    world, src, dst = case
    plans = all_plans(src, dst, world)
    check_coverage(src, dst, plans)
    check_local_never_sent(src, plans)
    check_symmetric(plans)
    check_minimum(src, dst, plans)
    check_filled(dst, plans)
    check_deterministic(src, dst, plans)


@PLAN_SETTINGS
@given(reshard_cases(worlds=(3, 4, 5), src_kinds=("enumerable",), src_min_holders=2))
def test_replicated_source_regions_spread_sending_over_holders(case):
    world, src, dst = case
    _check_spread(src, dst, world)


def _check_spread(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, world: int) -> None:
    """Every source region with several holders is sent by as many of them as it has transfers."""
    holders: dict = {}
    for s in src.shards:
        if s.numel > 0:
            holders.setdefault(s.region, set()).add(s.rank)
    senders: dict = {}
    transfers: Counter = Counter()
    for plan in all_plans(src, dst, world).values():
        for pieces in plan.sends.values():
            for p in pieces:
                region = src.shards[p.src_shard].region
                senders.setdefault(region, set()).add(p.src_rank)
                transfers[region] += 1
    for region, n in transfers.items():
        expected = min(len(holders[region]), n)
        assert len(senders[region]) >= expected, (
            f"source region {region} is held by ranks {sorted(holders[region])} and sent {n} times, "
            f"but only by {sorted(senders[region])}")


# -- worked examples ------------------------------------------------------------------


R4 = [f"rank:{r}/cpu" for r in range(4)]


def _md(spec: object, size: tuple[int, ...] = (8, 8), world: int = 4) -> ShardedTensorMetadata:
    return spec.build_metadata(size, world_size=world)


@pytest.mark.parametrize(("src", "dst", "expected"), [
    # Each rank keeps its 2x2 diagonal block and receives three 2x2 blocks.
    pytest.param(single_split(0, R4), single_split(1, R4), 4 * 12, id="rows-to-cols"),
    pytest.param(single_split(0, R4), single_split(-1, R4), 4 * 12, id="rows-to-cols-negative-dim"),
    pytest.param(single_split(0, R4), DevicePlacement("cpu"), 4 * 48, id="rows-to-replicated"),
    pytest.param(DevicePlacement("cpu"), single_split(0, R4), 0, id="replicated-to-rows"),
    pytest.param(single_split(0, R4), single_split(0, R4), 0, id="same-layout"),
    # rows 2/2/2/2 -> 1/3/3/1: rank 1 lacks row 1, rank 2 lacks row 6.
    pytest.param(single_split(0, R4), single_split(0, R4, [1, 3, 3, 1]), 16, id="even-to-uneven"),
    pytest.param(mesh([R4[:2], R4[2:]]), single_split(0, R4), 4 * 8, id="mesh-to-rows"),
    pytest.param(single_split(0, R4), DevicePlacement("rank:2/cpu"), 48, id="rows-to-one-rank"),
    pytest.param(DevicePlacement("rank:2/cpu"), single_split(0, R4), 48, id="one-rank-to-rows"),
    # Rank 0 holds rows 0-1 and 4-5; after the move it holds columns 0-1 and 4-5.
    pytest.param(single_split(0, [R4[0], R4[1], R4[0], R4[1]]), single_split(1, [R4[0], R4[1], R4[0], R4[1]]),
                 2 * 16, id="two-shards-per-rank"),
    pytest.param(single_split(0, [*R4, *R4]), single_split(0, R4 * 2, [0, 0, 0, 0, 8, 0, 0, 0]), 48,
                 id="empty-shards"),
])
def test_worked_examples(src, dst, expected):
    src_md, dst_md = _md(src), _md(dst)
    plans = all_plans(src_md, dst_md, 4)
    assert sum(p.elements_sent() for p in plans.values()) == expected == minimum_elements(src_md, dst_md)


def _replicas(regions_and_ranks: list[tuple[tuple[int, ...], tuple[int, ...], list[int]]]) -> EnumerableShardingSpec:
    return EnumerableShardingSpec(ShardMetadata(o, d, f"rank:{r}/cpu") for o, d, ranks in regions_and_ranks
                                  for r in ranks)


@pytest.mark.parametrize(("src", "dst"), [
    # The whole tensor on ranks 0 and 1, wanted row-split on ranks 2 and 3.
    pytest.param(_replicas([((0, 0), (8, 8), [0, 1])]), single_split(0, [R4[2], R4[3], R4[2], R4[3]]),
                 id="pair-to-split"),
    # Halves held by 0,1 and 2,3 (a 2x2 "data x tensor parallel" layout), wanted everywhere.
    pytest.param(_replicas([((0, 0), (4, 8), [0, 1]), ((4, 0), (4, 8), [2, 3])]), DevicePlacement("cpu"),
                 id="halves-to-replicated"),
    # The whole tensor on ranks 0 and 1, wanted on ranks 2 and 3.
    pytest.param(_replicas([((0, 0), (8, 8), [0, 1])]), _replicas([((0, 0), (8, 8), [2, 3])]),
                 id="pair-to-other-pair"),
])
def test_replicated_sources_spread_sending_examples(src, dst):
    _check_spread(_md(src), _md(dst), 4)


def test_plan_refuses_layouts_of_different_sizes():
    with pytest.raises(ValueError, match=r"size \(8, 8\).*size \(8, 9\)"):
        plan_reshard(_md(single_split(0, R4)), _md(single_split(0, R4), (8, 9)), rank=0)


# -- RegionIndex --------------------------------------------------------------------------


@hst.composite
def boxes_and_query(draw: hst.DrawFn) -> tuple[tuple[int, ...], list, tuple]:  # type: ignore[type-arg]
    size = draw(sizes(max_ndim=3, max_dim=7))
    spec = draw(specs(size, 3, enumerable=False))
    regions = list(dict.fromkeys(s.region for s in spec.build_metadata(size, world_size=3).shards))
    # Drop some regions: the index must work for any set of disjoint boxes, gaps included.
    boxes = [b for b in regions if draw(hst.booleans()) or math.prod(b[1]) == 0]
    offsets = tuple(draw(hst.integers(0, n)) for n in size)
    dims = tuple(draw(hst.integers(0, n - o)) for n, o in zip(size, offsets))
    return size, boxes, (offsets, dims)


@PLAN_SETTINGS
@given(boxes_and_query())
def test_region_index_matches_brute_force(case):
    size, boxes, query = case
    index = RegionIndex(boxes, size)
    assert index.overlapping(query) == brute_overlapping(boxes, query)
    for i, box in enumerate(boxes):
        expected = [(i, box)] if math.prod(box[1]) else []
        assert index.overlapping(box) == expected
