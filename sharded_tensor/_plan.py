"""Pure reshard planning: which block of which shard goes from which rank to which rank.

Nothing here communicates. Every rank computes its own part of the same global plan from the
same two layouts, so the sides of every transfer agree on sizes and order without talking.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sharding import ShardedTensorMetadata

__all__ = ["Box", "RegionIndex", "Piece", "ReshardPlan", "plan_reshard", "box_slices"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, dims)`` of a block of the global tensor."""


def box_slices(box: Box, origin: Sequence[int]) -> tuple[slice, ...]:
    """Index a shard whose first element sits at global ``origin`` to get the block ``box``."""
    offsets, dims = box
    return tuple(slice(o - s, o - s + n) for o, n, s in zip(offsets, dims, origin))


def intersect(a: Box, b: Box) -> Box | None:
    """The common block of two boxes, or ``None`` when they share no element."""
    offsets, dims = [], []
    for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        dims.append(hi - lo)
    return tuple(offsets), tuple(dims)


class RegionIndex:
    """Find which of a set of non-overlapping boxes meet a query box, in about log time.

    The boxes' cut points split every dimension into intervals; a grid over those intervals
    records which box owns each cell, so a query only looks at the cells it spans.
    """

    def __init__(self, boxes: Sequence[Box], size: Sequence[int]) -> None:
        self.boxes = list(boxes)
        ndim = len(size)
        self._cuts = [sorted({0, size[d], *(o[d] for o, _ in boxes), *(o[d] + n[d] for o, n in boxes)})
                      for d in range(ndim)]
        position = [{c: k for k, c in enumerate(cut)} for cut in self._cuts]
        self._grid = torch.full(tuple(max(len(c) - 1, 0) for c in self._cuts), -1, dtype=torch.int64)
        for box_id, (offsets, dims) in enumerate(self.boxes):
            if math.prod(dims) == 0:
                continue
            cells = tuple(slice(position[d][offsets[d]], position[d][offsets[d] + dims[d]])
                          for d in range(ndim))
            self._grid[cells] = box_id

    def overlapping(self, query: Box) -> list[tuple[int, Box]]:
        """``(box id, common block)`` for every box sharing an element with ``query``, by id."""
        offsets, dims = query
        if math.prod(dims) == 0:
            return []
        cells = []
        for d, cut in enumerate(self._cuts):
            lo = bisect.bisect_right(cut, offsets[d]) - 1
            hi = bisect.bisect_left(cut, offsets[d] + dims[d])
            cells.append(slice(max(lo, 0), hi))
        found = self._grid[tuple(cells)]
        ids = found.unique().tolist() if found.numel() > 1 else found.reshape(-1).tolist()
        result = []
        for box_id in ids:
            if box_id < 0:
                continue
            common = intersect(self.boxes[box_id], query)
            if common is not None:
                result.append((box_id, common))
        return result


@dataclass(frozen=True, slots=True)
class _Regions:
    """Distinct regions of a layout and, for each, who holds it."""

    boxes: list[Box]
    holders: list[list[int]]             # sorted distinct ranks per region
    first_shard: dict[tuple[int, int], int]  # (region, rank) -> first shard index on that rank
    region_of: dict[int, int]                # shard index -> region (non-empty shards only)
    index: RegionIndex

    @classmethod
    def of(cls, metadata: ShardedTensorMetadata) -> _Regions:
        ids: dict[Box, int] = {}
        boxes: list[Box] = []
        holders: list[set[int]] = []
        first: dict[tuple[int, int], int] = {}
        region_of: dict[int, int] = {}
        for i, shard in enumerate(metadata.shards):
            if shard.numel == 0:
                continue
            box = shard.region
            region = ids.get(box)
            if region is None:
                region = ids[box] = len(boxes)
                boxes.append(box)
                holders.append(set())
            region_of[i] = region
            holders[region].add(shard.rank)  # type: ignore[arg-type]
            first.setdefault((region, shard.rank), i)  # type: ignore[arg-type]
        return cls(boxes, [sorted(h) for h in holders], first, region_of, RegionIndex(boxes, metadata.size))


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
            transfers = [(d, q) for d, _ in self._target.index.overlapping(self._source.boxes[src_region])
                         for q in self._target.holders[d] if q not in holders]
            order = self._order[src_region] = {t: k for k, t in enumerate(sorted(transfers))}
        return holders[(order[(dst_region, peer)] + src_region) % len(holders)]


def plan_reshard(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, rank: int) -> ReshardPlan:
    """Plan ``rank``'s part of moving data laid out as ``src`` into the layout ``dst``.

    A block already on ``rank`` is copied locally; every element reaches each destination rank
    at most once; a replicated source region is sent by one holder per destination, chosen to
    spread the load. Pure and deterministic: every rank computes consistent plans.
    """
    if tuple(src.size) != tuple(dst.size):
        msg = f"cannot reshard a tensor of size {tuple(src.size)} into a layout of size {tuple(dst.size)}."
        raise ValueError(msg)
    source, target = _Regions.of(src), _Regions.of(dst)
    sender_of = _SenderChoice(source, target)
    plan = ReshardPlan(rank)
    # Receiving side: every distinct destination region this rank holds.
    for dst_region, box in enumerate(target.boxes):
        dst_shard = target.first_shard.get((dst_region, rank))
        if dst_shard is None:
            continue
        for src_region, common in source.index.overlapping(box):
            holders = source.holders[src_region]
            if rank in holders:
                plan.copies.append(Piece(source.first_shard[(src_region, rank)], dst_shard, common, rank, rank))
                continue
            sender = sender_of(src_region, dst_region, rank)
            piece = Piece(source.first_shard[(src_region, sender)], dst_shard, common, sender, rank)
            plan.recvs.setdefault(sender, []).append(piece)
    # Sending side: every distinct source region this rank holds, to ranks lacking it.
    for src_region, box in enumerate(source.boxes):
        src_shard = source.first_shard.get((src_region, rank))
        if src_shard is None:
            continue
        holders = source.holders[src_region]
        for dst_region, common in target.index.overlapping(box):
            for peer in target.holders[dst_region]:
                if peer in holders or sender_of(src_region, dst_region, peer) != rank:
                    continue
                piece = Piece(src_shard, target.first_shard[(dst_region, peer)], common, rank, peer)
                plan.sends.setdefault(peer, []).append(piece)
    # Both sides order a peer's pieces by (destination shard, source shard) so they agree.
    for table in (plan.sends, plan.recvs):
        for pieces in table.values():
            pieces.sort(key=lambda p: (p.dst_shard, p.src_shard))
    for i, shard in dst.shards_on(rank):
        if shard.numel > 0:
            first = target.first_shard[(target.region_of[i], rank)]
            if first != i:
                plan.duplicates.append((first, i))
    return plan


def total_traffic(src: ShardedTensorMetadata, dst: ShardedTensorMetadata) -> dict[int, int]:
    """Elements each rank sends in the whole reshard (planning every rank; for tests and benchmarks)."""
    ranks = sorted({s.rank for s in src.shards} | {s.rank for s in dst.shards})  # type: ignore[type-var]
    sent: dict[int, int] = defaultdict(int)
    for r in ranks:
        sent[r] += plan_reshard(src, dst, r).elements_sent()
    return dict(sent)
