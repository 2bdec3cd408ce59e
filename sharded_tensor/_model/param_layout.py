"""How one sharded parameter is laid out for compute (``ParamLayout``), read from its metadata.

The placement (``sharding.layout``: ``Split``, ``Packed``, ``Replicated``) is the one the
spec attached to the parameter's metadata; :func:`classify` adds what compute needs on top:
each rank's block (``boxes``) and a packed placement whose slices are adjacent read as a
split. The placement is the one statement of the layout: ``kind`` is read off it (and, for
the layouts no placement describes, off the boxes), never stored beside it. The propagation
engine tags split activations with the same placements, plus their process group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from sharding import ShardedTensorMetadata
from sharding.layout import Box, Packed, Replicated, Split

from .engine.placements import Intervals

__all__ = ["ParamLayout", "classify", "split_placement"]


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is laid out over the ranks of a group, as compute sees it.

    Attributes:
        name: the parameter's full name in the model (the first one, for tied parameters).
        metadata: the full shard layout.
        boxes: per group rank, the block its shards form together (``None``: it holds none).
        placement: the layout over the group's ranks: ``Replicated()``, a ``Split`` (one slice
            per rank) or a ``Packed`` placement (several non-adjacent slices per rank, e.g. its
            heads of q, k and v in one fused weight; its local tensor is their concatenation);
            ``None`` for a split whose one rank holds everything, and for the layouts no
            placement describes (see ``kind``).
    """

    name: str
    metadata: ShardedTensorMetadata
    boxes: tuple[Box | None, ...]
    placement: Split | Packed | Replicated | None

    @property
    def kind(self) -> Literal["replicated", "split", "blocks", "overlapping"]:
        """The layout in one word, read off ``placement``: ``"replicated"`` (``Replicated``),
        ``"split"`` (a ``Split`` or ``Packed``, or one rank holding everything); ``"overlapping"``
        (some elements on several ranks but not all: a split with replicas, see :attr:`replicas`,
        or a layout no placement describes); ``"blocks"`` (split along several dimensions)."""
        if isinstance(self.placement, Replicated):
            return "replicated"
        if isinstance(self.placement, Split) and self.placement.replicas:
            return "overlapping"  # only registrations that read ``replicas`` compute with it
        if self.placement is not None:
            return "split"
        live = [b for b in self.boxes if b is not None]
        if sum(_volume(b) for b in live) != math.prod(self.global_shape):
            return "overlapping"
        return "blocks" if any(_volume(b) > 0 and b[1] != self.global_shape for b in live) else "split"

    @property
    def dim(self) -> int | None:
        """The split dimension for ``"split"``; ``None`` when one rank holds everything."""
        return self.placement.dim if isinstance(self.placement, (Split, Packed)) else None

    @property
    def replicas(self) -> bool:
        """Whether it is a split some of whose slices several ranks hold (replicas: a key/value head
        shared by the ranks of its query heads)."""
        return isinstance(self.placement, Split) and self.placement.replicas

    @property
    def intervals(self) -> Intervals | None:
        """Per group rank, ``(start, length)`` along ``dim`` (``None`` unless one slice per rank)."""
        return self.placement.intervals if isinstance(self.placement, Split) else None

    @property
    def pieces(self) -> tuple[Intervals, ...] | None:
        """Per group rank, its slices along ``dim`` in order, for a packed layout (else ``None``)."""
        return self.placement.pieces if isinstance(self.placement, Packed) else None

    def local_region(self, rank: int, region: Box) -> Box:
        """Where the global ``region`` (one of ``rank``'s shards) sits in ``rank``'s local tensor."""
        box = self.boxes[rank]
        assert box is not None
        if not isinstance(self.placement, Packed):
            return tuple(o - b for o, b in zip(region[0], box[0])), region[1]
        dim = self.placement.dim
        local = 0
        for start, length in self.placement.pieces[rank]:
            if start == region[0][dim]:
                offsets = [o - b for o, b in zip(region[0], box[0])]
                offsets[dim] = local
                return tuple(offsets), region[1]
            local += length
        raise KeyError(region)

    def local_of(self, rank: int, full: torch.Tensor) -> torch.Tensor:
        """``rank``'s local tensor cut from the full tensor (a view when it is one block)."""
        box = self.boxes[rank]
        assert box is not None
        if not isinstance(self.placement, Packed):
            return full[tuple(slice(o, o + n) for o, n in zip(*box))]
        dim = self.placement.dim
        return torch.cat([full.narrow(dim, start, length) for start, length in self.placement.pieces[rank]], dim)

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(self.metadata.size)

    def owner(self) -> int | None:
        """The only rank holding any element, for a split with ``dim is None``."""
        holders = [r for r, box in enumerate(self.boxes) if box is not None and _volume(box) > 0]
        return holders[0] if len(holders) == 1 else None

    def along(self, dim: int) -> Intervals:
        """Per-rank ``(start, length)`` along ``dim`` (for a one-owner layout too)."""
        if isinstance(self.placement, Split) and self.placement.dim == dim:
            return self.placement.intervals
        size = self.global_shape[dim]
        return tuple((0, size) if box is not None and _volume(box) > 0 else (0, 0) for box in self.boxes)

    def local_shape(self, rank: int, compute_dim: int | None = None) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor (empty along the split dimension if it holds nothing)."""
        box = self.boxes[rank]
        if box is not None:
            return box[1]
        shape = list(self.global_shape)
        dim = compute_dim if compute_dim is not None else (self.dim if self.dim is not None else 0)
        if shape:
            shape[dim] = 0
        return tuple(shape)

    def describe(self) -> str:
        """A short human-readable account of who holds what."""
        parts = [f"rank {r}: offsets {b[0]} sizes {b[1]}" for r, b in enumerate(self.boxes) if b is not None]
        return "; ".join(parts) if parts else "no rank holds it"


def _volume(box: Box) -> int:
    n = 1
    for s in box[1]:
        n *= s
    return n


def _union_box(regions: Sequence[Box]) -> Box | None:
    """The block covered by ``regions`` (distinct, disjoint) if they form one block, else ``None``."""
    ndim = len(regions[0][0])
    lo = tuple(min(o[d] for o, _ in regions) for d in range(ndim))
    hi = tuple(max(o[d] + s[d] for o, s in regions) for d in range(ndim))
    box = (lo, tuple(high - low for high, low in zip(hi, lo)))
    return box if _volume(box) == sum(_volume(r) for r in regions) else None


def _over(placement: Split | Packed, world: int) -> Split | Packed:
    if isinstance(placement, Split):
        return placement.over(world)
    return Packed(placement.dim, placement.pieces[:world] + ((),) * (world - len(placement.pieces)))


def classify(name: str, metadata: ShardedTensorMetadata, world: int) -> ParamLayout:
    """Read ``metadata`` as a compute layout over ``world`` group ranks. Pure; identical on every rank.

    Raises:
        ValueError: if some rank's shards do not form a single block (the model keeps one local
            tensor per parameter and rank), or the placement gives a rank outside the group a slice.
    """
    size = tuple(metadata.size)
    placement = metadata.placement
    boxes: list[Box | None] = []
    for rank in range(world):
        regions = list(dict.fromkeys(s.region for _, s in metadata.shards_on(rank)))
        if not regions:
            boxes.append(None)
            continue
        nonempty = [r for r in regions if _volume(r) > 0]
        box = _union_box(nonempty) if nonempty else regions[0]
        if box is None:
            if not isinstance(placement, Packed):
                shown = ", ".join(f"offsets {o} sizes {s}" for o, s in nonempty)
                msg = (f"parameter {name!r} (size {size}): rank {rank} would hold shards [{shown}], which neither "
                       f"form one block nor differ along a single dimension; a sharded model keeps one local "
                       f"tensor per parameter on each rank, so give each rank one shard (or slices of one "
                       f"dimension) of every parameter.")
                raise ValueError(msg)
            # Packed: the local tensor is the rank's slices side by side along the packed dimension.
            sizes, offsets = list(nonempty[0][1]), list(nonempty[0][0])
            sizes[placement.dim] = placement.local_length(rank)
            offsets[placement.dim] = placement.pieces[rank][0][0]
            box = (tuple(offsets), tuple(sizes))
        boxes.append(box)
    full: Box = ((0,) * len(size), size)
    if isinstance(placement, Packed):
        placement = placement.coalesced() or placement  # adjacent slices on each rank: one block each
    if all(b == full for b in boxes) and not isinstance(placement, Packed):
        return ParamLayout(name, metadata, tuple(boxes), Replicated())
    if isinstance(placement, (Split, Packed)):
        placement = _over(placement, world)
        lengths = ([n for _, n in placement.intervals] if isinstance(placement, Split)
                   else [placement.local_length(r) for r in range(world)])
        if sorted(lengths)[-2:] == [0, size[placement.dim]] or lengths == [size[placement.dim]]:
            placement = None  # one rank holds everything: no split dimension to speak of
        return ParamLayout(name, metadata, tuple(boxes), placement)
    # No placement describes it (``kind`` says how it is held): compute reads the blocks.
    return ParamLayout(name, metadata, tuple(boxes), None)


def split_placement(value: Intervals | Split | Packed | ParamLayout, dim: int) -> Split | Packed:
    """The split of an activation along ``dim``: given as per-rank intervals, a placement, or the
    ``ParamLayout`` of the weight whose split it follows (a packed weight gives packed slices)."""
    placement = value.placement if isinstance(value, ParamLayout) else value
    if isinstance(placement, (Split, Packed)):
        return placement.moved(dim) if isinstance(placement, Split) else Packed(dim, placement.pieces)
    if isinstance(value, ParamLayout):
        return Split(dim, value.along(value.dim if value.dim is not None else 0))
    if isinstance(value, (tuple, list)):
        return Split(dim, tuple(value))
    msg = (f"a split must be per-rank (start, length) intervals, a sharding.layout Split or Packed, or a "
           f"ParamLayout; got {type(value).__name__} {value!r}.")
    raise TypeError(msg)
