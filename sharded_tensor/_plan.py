"""Pure reshard planning: which block of which shard goes from which rank to which rank.

Nothing here communicates. Every rank computes its own part of the same global plan from the
same two layouts, so the sides of every transfer agree on sizes and order without talking.
Plans are made from blocks (boxes), not placements: any two tilings (meshes, uneven splits,
layouts read from a checkpoint) meet here, and their overlaps are the general case; only
the reductions of partial values read the placement (``Partial``).
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from _shardkit.memory import cyclic_gc_paused
from sharding import ShardedTensorMetadata, ShardMetadata
from sharding.layout import Box, RegionIndex, box_slices

__all__ = ["Box", "RegionIndex", "Piece", "ReshardPlan", "plan_reshard", "box_slices",
           "ReducePlan", "plan_reduce", "reduce_layout", "keeper_layout", "partial_holders"]

class _Regions:
    """Distinct regions of a layout and, for each, who holds it."""

    __slots__ = ("boxes", "holders", "holder_sets", "first_shard", "region_of", "mine", "_size", "_index")

    def __init__(self, metadata: ShardedTensorMetadata) -> None:
        ids: dict[Box, int] = {}
        boxes: list[Box] = []
        holders: list[list[int]] = []
        first: dict[tuple[int, int], int] = {}
        region_of: dict[int, int] = {}
        mine: dict[int, list[tuple[int, int]]] = {}   # rank -> [(shard, region)] of its non-empty shards
        for i, shard in enumerate(metadata.shards):
            dims = shard.dims
            if 0 in dims:
                continue
            box = (shard.offsets, dims)
            rank: int = shard.device.rank  # type: ignore[assignment]
            region = ids.get(box)
            if region is None:
                region = ids[box] = len(boxes)
                boxes.append(box)
                holders.append([])
            region_of[i] = region
            key = (region, rank)
            if key not in first:
                first[key] = i
                holders[region].append(rank)
            mine.setdefault(rank, []).append((i, region))
        self.boxes = boxes
        self.holders = [sorted(h) for h in holders]
        self.holder_sets = [frozenset(h) for h in holders]
        self.first_shard = first
        self.region_of = region_of
        self.mine = mine
        self._size = tuple(metadata.size)
        self._index: RegionIndex | None = None

    @property
    def index(self) -> RegionIndex:
        if self._index is None:
            self._index = RegionIndex(self.boxes, self._size)
        return self._index

    def regions_on(self, rank: int) -> list[tuple[int, int]]:
        """``(region, first shard)`` for each distinct region ``rank`` holds, by region id."""
        first = self.first_shard
        return sorted((region, i) for i, region in self.mine.get(rank, ()) if first[(region, rank)] == i)

    @classmethod
    def of(cls, metadata: ShardedTensorMetadata) -> _Regions:
        # Metadata is immutable, so the regions of one object can be reused: a reshard plans
        # from the layout the tensor already has, and total_traffic plans every rank.
        # The cache holds the metadata itself, so an id is never reused while it is cached.
        key = id(metadata)
        with _CACHE_LOCK:
            hit = _REGIONS_CACHE.get(key)
        if hit is not None and hit[0] is metadata:
            return hit[1]
        regions = cls(metadata)
        with _CACHE_LOCK:
            while len(_REGIONS_CACHE) >= _CACHE_SIZE:
                _REGIONS_CACHE.pop(next(iter(_REGIONS_CACHE)))
            _REGIONS_CACHE[key] = (metadata, regions)
        return regions


_CACHE_SIZE = 8
_CACHE_LOCK = threading.Lock()
_REGIONS_CACHE: dict[int, tuple[ShardedTensorMetadata, _Regions]] = {}


@dataclass(frozen=True, slots=True)
class Piece:
    """One block moving from a source shard to a destination shard (global coordinates)."""

    src_shard: int   # index into the source metadata's shards
    dst_shard: int   # index into the destination metadata's shards
    box: Box
    src_rank: int
    dst_rank: int

    @property
    def numel(self) -> int:
        return math.prod(self.box[1])


@dataclass(slots=True)
class ReshardPlan:
    """What one rank does in a reshard.

    ``sends[peer]`` and ``recvs[peer]`` are in the same order on both sides of each transfer.
    ``copies`` are blocks already on this rank. ``duplicates`` are ``(from, to)`` destination
    shards on this rank holding the same region: ``to`` is filled from ``from`` at the end.
    """

    rank: int
    sends: dict[int, list[Piece]] = field(default_factory=dict)
    recvs: dict[int, list[Piece]] = field(default_factory=dict)
    copies: list[Piece] = field(default_factory=list)
    duplicates: list[tuple[int, int]] = field(default_factory=list)

    def elements_sent(self) -> int:
        return sum(p.numel for pieces in self.sends.values() for p in pieces)

    def elements_received(self) -> int:
        return sum(p.numel for pieces in self.recvs.values() for p in pieces)


class _SenderChoice:
    """Who sends each transfer of a replicated source region: round robin over its holders.

    The transfers of one source region (every destination region it meets, times every rank
    holding that destination region but not the source) are numbered in a fixed order, and
    transfer k goes to holder k mod H, so the holders share the sending evenly. Both sides of a
    transfer compute the same numbering from the two layouts alone.
    """

    def __init__(self, source: _Regions, target: _Regions) -> None:
        self._source, self._target = source, target
        self._order: dict[int, dict[tuple[int, int], int]] = {}

    def __call__(self, src_region: int, dst_region: int, peer: int) -> int:
        holders = self._source.holders[src_region]
        if len(holders) == 1:
            return holders[0]
        order = self._order.get(src_region)
        if order is None:
            held = self._source.holder_sets[src_region]
            transfers = [(d, q) for d, _ in self._target.index.overlapping(self._source.boxes[src_region])
                         for q in self._target.holders[d] if q not in held]
            order = self._order[src_region] = {t: k for k, t in enumerate(sorted(transfers))}
        return holders[(order[(dst_region, peer)] + src_region) % len(holders)]


def _piece_order(p: Piece) -> tuple[int, int]:
    return (p.dst_shard, p.src_shard)


def plan_reshard(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, rank: int) -> ReshardPlan:
    """Plan ``rank``'s part of moving data laid out as ``src`` into the layout ``dst``.

    A block already on ``rank`` is copied locally; every element reaches each destination rank
    at most once; a replicated source region is sent by one holder per destination, chosen to
    spread the load. Pure and deterministic: every rank computes consistent plans.

    Cost: linear in the number of shards of the two layouts (building their region indexes)
    plus the number of pieces this rank sends and receives (timings for up to 4096 ranks:
    docs/benchmarks-history.md, "reshard planning").
    """
    if tuple(src.size) != tuple(dst.size):
        msg = f"cannot reshard a tensor of size {tuple(src.size)} into a layout of size {tuple(dst.size)}."
        raise ValueError(msg)
    if src.pending is not None or dst.pending is not None:
        msg = ("plan_reshard moves values between plain layouts; a layout with partial values is reduced "
               "with plan_reduce (see reduce_layout) or made with keeper_layout.")
        raise ValueError(msg)
    # A plan for thousands of ranks allocates tens of thousands of small objects and no cycles.
    with cyclic_gc_paused():
        return _plan(src, dst, rank)


def _plan(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, rank: int) -> ReshardPlan:
    source, target = _Regions.of(src), _Regions.of(dst)
    sender_of = _SenderChoice(source, target)
    plan = ReshardPlan(rank)
    sends, recvs, copies = plan.sends, plan.recvs, plan.copies
    # Receiving side: every distinct destination region this rank holds.
    wanted = target.regions_on(rank)
    if wanted:
        index = source.index
        for dst_region, dst_shard in wanted:
            for src_region, common in index.overlapping(target.boxes[dst_region]):
                if rank in source.holder_sets[src_region]:
                    copies.append(Piece(source.first_shard[(src_region, rank)], dst_shard, common, rank, rank))
                    continue
                sender = sender_of(src_region, dst_region, rank)
                piece = Piece(source.first_shard[(src_region, sender)], dst_shard, common, sender, rank)
                recvs.setdefault(sender, []).append(piece)
    # Sending side: every distinct source region this rank holds, to ranks lacking it.
    held = source.regions_on(rank)
    if held:
        index = target.index
        for src_region, src_shard in held:
            holders = source.holder_sets[src_region]
            for dst_region, common in index.overlapping(source.boxes[src_region]):
                for peer in target.holders[dst_region]:
                    if peer in holders or sender_of(src_region, dst_region, peer) != rank:
                        continue
                    piece = Piece(src_shard, target.first_shard[(dst_region, peer)], common, rank, peer)
                    sends.setdefault(peer, []).append(piece)
    # Both sides order a peer's pieces by (destination shard, source shard) so they agree.
    for table in (sends, recvs):
        for pieces in table.values():
            pieces.sort(key=_piece_order)
    for i, region in target.mine.get(rank, ()):
        first = target.first_shard[(region, rank)]
        if first != i:
            plan.duplicates.append((first, i))
    return plan


def total_traffic(src: ShardedTensorMetadata, dst: ShardedTensorMetadata) -> dict[int, int]:
    """Elements each rank sends in the whole reshard (planning every rank; for tests and benchmarks)."""
    ranks = sorted({s.rank for s in (*src.shards, *dst.shards) if s.rank is not None})
    sent: dict[int, int] = defaultdict(int)
    for r in ranks:
        sent[r] += plan_reshard(src, dst, r).elements_sent()
    return dict(sent)


# -- partial tensors: pure planning of reductions -------------------------------------------


def partial_holders(metadata: ShardedTensorMetadata) -> tuple[int, ...]:
    """The ranks holding a partial value, ascending: the order in which values are reduced."""
    return tuple(sorted({s.rank for s in metadata.shards if s.rank is not None}))


def reduce_layout(src: ShardedTensorMetadata, dst: ShardedTensorMetadata) -> ShardedTensorMetadata:
    """Where each block of a partial ``src`` is reduced on its way to the layout ``dst``.

    Returns a layout with one holder per block (no replicas): the reducer, which receives
    every other partial value of the block and reduces them. A ``dst`` region held by one
    rank is reduced there: ``dst`` itself is returned when all its regions are, so a split
    target is a plain reduce-scatter. A region held by several ranks (a replica) is cut
    along its first dimension long enough (else its longest) into one chunk per holder, preferring holders that have a
    partial value, so that reducing costs each rank its share and the chunks then reach the
    other holders as in an all-gather: the bandwidth-optimal all-reduce, in two steps.

    Pure: every rank computes the same layout from the two layouts.
    """
    from sharding.layout import chunk_bounds

    regions = _Regions.of(dst)
    if all(len(h) == 1 for h in regions.holders) and \
            sum(1 for s in dst.shards if s.numel) == len(regions.boxes):
        return dst
    have = set(partial_holders(src))
    device_of = {(regions.region_of[i], s.rank): s.device for i, s in enumerate(dst.shards) if i in regions.region_of}
    shards: list[ShardMetadata] = []
    for region, ((offsets, dims), holders) in enumerate(zip(regions.boxes, regions.holders)):
        reducers = [r for r in holders if r in have] or holders
        # The first dimension with a row for every reducer: contiguous chunks, no packing.
        longest = max(range(len(dims)), key=lambda d: dims[d]) if dims else 0
        dim = next((d for d, n in enumerate(dims) if n >= len(reducers)), longest)
        if len(reducers) == 1 or not dims or dims[dim] < 2:
            shards.append(ShardMetadata(offsets, dims, device_of[(region, reducers[0])]))
            continue
        for reducer, (start, length) in zip(reducers, chunk_bounds(dims[dim], len(reducers))):
            if length == 0:
                continue
            chunk_offsets = tuple(o + start if d == dim else o for d, o in enumerate(offsets))
            chunk_dims = tuple(length if d == dim else n for d, n in enumerate(dims))
            shards.append(ShardMetadata(chunk_offsets, chunk_dims, device_of[(region, reducer)]))
    return ShardedTensorMetadata(shards, dst.size, dst.dtype)


@dataclass(slots=True)
class ReducePlan:
    """What one rank does to reduce a partial tensor onto a layout with one holder per block.

    ``holders`` are the ranks with a partial value, in reduction order. ``sends[peer]`` lists
    the blocks (indices into the target's shards) whose partial value this rank sends to their
    reducer ``peer``; ``recvs[peer]`` the blocks this rank reduces and receives from ``peer``;
    both sides list a transfer's blocks in the same (ascending) order. ``reduces`` are the
    blocks this rank reduces.
    """

    rank: int
    holders: tuple[int, ...]
    sends: dict[int, list[int]] = field(default_factory=dict)
    recvs: dict[int, list[int]] = field(default_factory=dict)
    reduces: list[int] = field(default_factory=list)


def plan_reduce(src: ShardedTensorMetadata, target: ShardedTensorMetadata, rank: int) -> ReducePlan:
    """Plan ``rank``'s part of reducing the partial ``src`` onto ``target`` (see ``reduce_layout``).

    Every holder sends each block's partial value to the block's reducer, once; nothing else
    moves. For a target split over the holders this is (k-1)/k of the tensor per rank, the
    minimum for a reduce-scatter.
    """
    holders = partial_holders(src)
    plan = ReducePlan(rank, holders)
    for index, shard in enumerate(target.shards):
        if shard.numel == 0:
            continue
        reducer: int = shard.rank  # type: ignore[assignment]
        if reducer == rank:
            plan.reduces.append(index)
            for peer in holders:
                if peer != rank:
                    plan.recvs.setdefault(peer, []).append(index)
        elif rank in holders:
            plan.sends.setdefault(reducer, []).append(index)
    return plan


def keeper_layout(src: ShardedTensorMetadata, dst: ShardedTensorMetadata) -> ShardedTensorMetadata:
    """For a reshard into a partial sum: which one holder of ``dst`` keeps each block's values.

    The others hold zeros there, so the sum is the tensor. A block stays with a rank that
    holds it already when that rank is a holder of ``dst`` (the lowest such rank), so going
    from a replica or from a split over the same ranks moves nothing; other blocks go round
    robin over the holders. Pure.
    """
    source = _Regions.of(src)
    holders = partial_holders(dst)
    device_of = {s.rank: s.device for s in dst.shards}
    shards = []
    for region, (box, have) in enumerate(zip(source.boxes, source.holders)):
        keepers = [r for r in have if r in device_of]
        keeper = keepers[0] if keepers else holders[region % len(holders)]
        shards.append(ShardMetadata(box[0], box[1], device_of[keeper]))
    return ShardedTensorMetadata(shards, src.size, src.dtype)
