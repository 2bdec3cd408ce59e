"""Planning of fully sharded units: pure functions of shapes and ranks, no communication.

A unit's parameters travel in one flat buffer. Each parameter is split on dim 0 like
``torch.chunk`` over the unit's ``world`` data-parallel ranks (``chunk = ceil(rows / world)``
rows per rank, trailing ranks possibly short or empty). Every rank contributes one *segment*
to the all-gather: for each parameter in turn, its own rows padded to ``chunk`` rows. The
gathered buffer is then ``world`` segments; each parameter is copied out of it into the
*unsharded* buffer, where it occupies ``world * chunk`` rows and its first ``rows`` rows are
the whole parameter, contiguous. The gradients travel the same way back (a reduce-scatter
of ``world`` segments)::

    2 ranks, a (3, 2) weight w and a (3,) bias b; chunk 2 rows for both
    segment of rank 0:  w[0] w[1] | b[0] b[1]        segment of rank 1:  w[2] pad | b[2] pad
    unsharded buffer:   w[0] w[1] w[2] pad | b[0] b[1] b[2] pad
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sharding import (
    EnumerableShardingSpec,
    PlacementSpec,
    RemoteDevice,
    ShardedTensorMetadata,
    ShardMetadata,
    single_split,
)

__all__ = ["FlatParam", "UnitPlan", "plan_unit", "partition", "shard_spec"]


@dataclass(frozen=True, slots=True)
class FlatParam:
    """Where one parameter sits in its unit's flat buffers.

    Attributes:
        name: the parameter's name in the model (for messages).
        shape: its global shape.
        chunk: rows per rank in a segment (``ceil(rows / world)``).
        offset: its first element in a rank's segment; in the unsharded buffer it starts at
            ``world * offset``.
    """

    name: str
    shape: tuple[int, ...]
    chunk: int
    offset: int

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row(self) -> int:
        """Elements per row."""
        return math.prod(self.shape[1:])

    @property
    def padded(self) -> int:
        """Elements it takes in a segment (``chunk`` rows)."""
        return self.chunk * self.row

    @property
    def numel(self) -> int:
        return self.rows * self.row

    def rows_of(self, group_rank: int) -> tuple[int, int]:
        """``(start, length)`` of the rows ``group_rank`` holds (``torch.chunk``; may be empty)."""
        start = min(group_rank * self.chunk, self.rows)
        return start, min(start + self.chunk, self.rows) - start

    def local_shape(self, group_rank: int) -> tuple[int, ...]:
        return (self.rows_of(group_rank)[1], *self.shape[1:])


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """The flat layout of one unit over ``world`` ranks (see the module docstring)."""

    params: tuple[FlatParam, ...]
    world: int

    @property
    def segment(self) -> int:
        """Elements each rank sends in the all-gather and receives from the reduce-scatter."""
        return sum(p.padded for p in self.params)

    @property
    def flat_numel(self) -> int:
        """Elements of the gathered (and of the unsharded) buffer."""
        return self.world * self.segment

    def full_slice(self, param: FlatParam) -> slice:
        """The whole parameter's elements in the unsharded buffer."""
        start = self.world * param.offset
        return slice(start, start + param.numel)


def plan_unit(params: Sequence[tuple[str, Sequence[int]]], world: int) -> UnitPlan:
    """The flat layout of parameters ``(name, global shape)`` over ``world`` ranks.

    Raises:
        ValueError: a 0-d parameter (there is no dim 0 to split), or ``world < 1``.

    Example:
        >>> plan = plan_unit([("w", (3, 2)), ("b", (3,))], 2)
        >>> [(p.chunk, p.offset) for p in plan.params], plan.segment
        ([(2, 0), (2, 4)], 6)
    """
    if world < 1:
        msg = f"world={world!r} must be at least 1."
        raise ValueError(msg)
    out = []
    offset = 0
    for name, shape in params:
        shape = tuple(int(s) for s in shape)
        if not shape:
            msg = (f"parameter {name!r} is 0-d (a scalar); fully_shard splits parameters on dim 0, so give it "
                   f"shape (1,) or keep it outside the module given to fully_shard.")
            raise ValueError(msg)
        flat = FlatParam(name, shape, -(-shape[0] // world), offset)
        offset += flat.padded
        out.append(flat)
    return UnitPlan(tuple(out), world)


def partition(requested: Sequence[Sequence[int] | None], world: int) -> list[tuple[int, ...]]:
    """The data-parallel groups every rank asked for, checked; ``requested[r]`` is rank ``r``'s ``ranks``.

    ``None`` everywhere means one group of the whole world. Otherwise every rank names its own
    group (global ranks, itself included) or ``[]`` (it holds no part), the members of a group
    name the same ranks, the groups are disjoint, cover every rank that named one, and have
    one size.

    Raises:
        ValueError: naming the ranks and groups at fault and the rule they break.

    Example:
        >>> partition([[0, 2], [1, 3], [0, 2], [1, 3]], 4)
        [(0, 2), (1, 3)]
    """
    if all(r is None for r in requested):
        return [tuple(range(world))]
    if any(r is None for r in requested):
        none = [i for i, r in enumerate(requested) if r is None]
        msg = (f"fully_shard(ranks=None) on ranks {none} but ranks=[...] on the others; pass ranks on every rank "
               f"or on none.")
        raise ValueError(msg)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, ranks in enumerate(requested):
        part = tuple(ranks)  # type: ignore[arg-type]
        if not part:
            continue  # ranks=[]: this rank holds no part
        if rank not in part:
            msg = (f"rank {rank} passed ranks={list(part)}, which does not include it; each rank passes the "
                   f"data-parallel group it belongs to.")
            raise ValueError(msg)
        groups.setdefault(part, []).append(rank)
    if not groups:
        msg = "ranks=[] on every rank leaves no rank to hold the parameters; name the data-parallel groups."
        raise ValueError(msg)
    for part, callers in groups.items():
        if sorted(callers) != sorted(part):
            msg = (f"ranks {sorted(callers)} passed ranks={list(part)}, but its members must be exactly the ranks "
                   f"that pass it; ranks {sorted(set(part) - set(callers))} passed another group.")
            raise ValueError(msg)
    parts = sorted(groups, key=min)
    sizes = sorted({len(p) for p in parts})
    if len(sizes) > 1:
        msg = (f"the data-parallel groups {[list(p) for p in parts]} have different sizes {sizes}; the world of "
               f"{world} ranks must divide into groups of one size.")
        raise ValueError(msg)
    return parts


def shard_spec(parts: Sequence[Sequence[int]], shape: Sequence[int], device: torch.device) -> PlacementSpec:
    """The layout of a fully sharded parameter in global ranks: split on dim 0 within each group.

    With one group it is ``single_split(0, group)``; with several, each group holds the same
    split (replicas across groups), listed explicitly.
    """
    shape = tuple(shape)
    if len(parts) == 1:
        return single_split(0, [RemoteDevice.of(r, device) for r in parts[0]])
    world = len(parts[0])
    flat = FlatParam("", shape, -(-shape[0] // world), 0)
    shards = []
    for part in parts:
        for group_rank, rank in enumerate(part):
            start, length = flat.rows_of(group_rank)
            shards.append(ShardMetadata((start,) + (0,) * (len(shape) - 1), (length, *shape[1:]),
                                        RemoteDevice.of(rank, device)))
    return EnumerableShardingSpec(shards)


def shard_metadata(parts: Sequence[Sequence[int]], shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device) -> ShardedTensorMetadata:
    """``shard_spec(...).build_metadata``, for a world of ``sum(len(part))`` ranks."""
    world = sum(len(p) for p in parts)
    return shard_spec(parts, shape, device).build_metadata(tuple(shape), dtype, world_size=world)
