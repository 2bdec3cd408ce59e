"""The layout vocabulary shared by every package: placements, boxes, tiling checks, chunk bounds.

A *placement* says how the ranks of a group hold one tensor, in four frozen values:
:class:`Split` (one slice per rank along a dimension, even or uneven), :class:`Packed`
(several slices per rank along a dimension, side by side in the local tensor, as a fused
q/k/v weight split by heads holds them), :class:`Replicated` (the whole tensor on every rank)
and :class:`Partial` (a full-size value on every rank, pending a reduction). Specs attach the
placement to the metadata they build (``ShardedTensorMetadata.placement``); metadata built
from a shard list gets it from :func:`placement_of`, the one place that reads a placement
off shards. Rank ``r`` of a placement is rank ``r`` of the metadata's shards (the group
rank, for a model sharded over a group). :class:`Strided` is the regular case of ``Packed``
(equal blocks, each split alike) in the form compute reads; metadata states it as its
``Packed``, so a layout has one placement.

A *box* is ``(offsets, dims)``, a block of a global tensor (a shard's *region*). Nothing here
communicates.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, Self, TypeVar

import torch

__all__ = ["Split", "Packed", "Strided", "Replicated", "Partial", "Placement", "placement_of",
           "Box", "box_slices", "intersect", "RegionIndex", "check_tiling", "chunk_bounds", "REDUCE_OPS",
           "check_reduce_op"]

REDUCE_OPS = ("sum", "avg", "max", "min")
"""Reductions a partial tensor may be pending (element-wise, like ``torch.distributed.ReduceOp``)."""


def check_reduce_op(reduce_op: object, *, where: str = "reduce_op") -> str:
    """Return ``reduce_op`` if it names a supported reduction; raise ``ValueError`` otherwise."""
    if not isinstance(reduce_op, str) or reduce_op not in REDUCE_OPS:
        msg = (f"{where}={reduce_op!r} is not a supported reduction; use one of "
               f"{', '.join(repr(op) for op in REDUCE_OPS)}.")
        raise ValueError(msg)
    return reduce_op


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each of ``parts`` chunks of ``n``, like ``torch.chunk``.

    chunk = ceil(n / parts); chunk i covers ``[min(i*chunk, n), min((i+1)*chunk, n))``, so
    trailing chunks may be empty (offset clamped to ``n``).
    """
    chunk = -(-n // parts) if parts else 0
    return [(min(i * chunk, n), min((i + 1) * chunk, n) - min(i * chunk, n)) for i in range(parts)]


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, dims)`` of a block of the global tensor."""


# -- placements ----------------------------------------------------------------------------------

_Self = TypeVar("_Self")


def _int(value: object) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def _check_dim(owner: str, dim: object) -> None:
    if not _int(dim) or dim < 0:  # type: ignore[operator]
        msg = (f"{owner} dim={dim!r} must be a non-negative int (the tensor dimension that is split); "
               f"resolve a negative dimension against the tensor's rank first.")
        raise ValueError(msg) if _int(dim) else TypeError(msg)


def _as_slices(owner: str, value: object, where: str) -> tuple[tuple[int, int], ...]:
    """``value`` as a tuple of ``(start, length)`` pairs of non-negative ints, or a clear error."""
    if type(value) is tuple and all(type(p) is tuple and len(p) == 2 and type(p[0]) is int and type(p[1]) is int
                                    and p[0] >= 0 and p[1] >= 0 for p in value):
        return value  # already in shape: the common case, checked without the generic path below
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        msg = f"{owner} {where}={value!r} must be a sequence of (start, length) pairs, e.g. ((0, 4), (4, 4))."
        raise TypeError(msg)
    out = []
    for i, pair in enumerate(value):
        if (not isinstance(pair, Sequence) or len(pair) != 2 or not all(_int(x) for x in pair)):
            msg = f"{owner} {where}[{i}]={pair!r} is not a (start, length) pair of ints."
            raise TypeError(msg)
        start, length = int(pair[0]), int(pair[1])
        if start < 0 or length < 0:
            msg = f"{owner} {where}[{i}]=({start}, {length}) has a negative start or length; both must be >= 0."
            raise ValueError(msg)
        out.append((start, length))
    return tuple(out)


def _check_cover(owner: str, slices: Sequence[tuple[int, int]], what: str, replicas: bool = False) -> None:
    """The non-empty ``(start, length)`` slices must tile ``[0, size)``: every index on exactly one rank (with
    ``replicas``, identical slices count once: the ranks holding one hold replicas of it)."""
    live = {s for s in slices if s[1] > 0} if replicas else [s for s in slices if s[1] > 0]
    ordered = sorted(live)
    end = 0
    for start, length in ordered:
        if start != end:
            problem = "overlap" if start < end else "leave a gap"
            rule = "identical slices are replicas; others" if replicas else "the non-empty (start, length) slices"
            msg = (f"{owner} {what}={tuple(slices)!r}: the slices {problem} at index {min(start, end)}; {rule} must "
                   f"cover 0..size-1 exactly once (each index on one rank).")
            raise ValueError(msg)
        end = start + length


@dataclass(frozen=True, slots=True)
class Split:
    """One slice per rank along dimension ``dim``: rank ``r`` holds ``intervals[r] = (start, length)``.

    Even (like ``torch.chunk``, see :meth:`even`) or uneven. A rank with length 0 holds none of
    it. The distinct non-empty intervals tile ``[0, size)``; ranks with identical intervals hold
    replicas of that slice (:attr:`replicas`: a key/value head shared by the ranks of its query
    heads), so every index along ``dim`` is on one rank or on each of one group of ranks. Other
    dimensions are whole on every rank.

    Args:
        dim: the split dimension (non-negative).
        intervals: per rank, its ``(start, length)`` along ``dim``.

    Raises:
        ValueError: a negative ``dim``, start or length, or intervals that overlap or leave a gap.
        TypeError: ``dim`` or an interval is not made of ints.

    Example:
        >>> Split.even(0, 10, 4).intervals
        ((0, 3), (3, 3), (6, 3), (9, 1))
    """

    dim: int
    intervals: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        _check_dim("Split", self.dim)
        intervals = _as_slices("Split", self.intervals, "intervals")
        _check_cover("Split", intervals, "intervals", replicas=True)
        object.__setattr__(self, "intervals", intervals)

    @property
    def replicas(self) -> bool:
        """Whether some ranks hold the same slice (replicas of it)."""
        live = [s for s in self.intervals if s[1] > 0]
        return len(set(live)) != len(live)

    @classmethod
    def even(cls, dim: int, size: int, parts: int) -> Split:
        """``size`` split into ``parts`` like ``torch.chunk`` (trailing ranks may get length 0)."""
        return cls(dim, tuple(chunk_bounds(size, parts)))

    @property
    def size(self) -> int:
        """The global size along ``dim``."""
        return max((s + n for s, n in self.intervals), default=0)

    def moved(self, dim: int) -> Self:
        """The same intervals on another dimension (after a transpose or a reshape)."""
        if dim == self.dim:
            return self
        if type(dim) is not int or dim < 0:
            _check_dim("Split", dim)
        return _split_with(self, dim, self.intervals)

    def scaled(self, dim: int, num: int, den: int) -> Self | None:
        """On ``dim``, every interval multiplied by ``num / den``; ``None`` where that is not exact."""
        out = []
        for start, length in self.intervals:
            if (start * num) % den or (length * num) % den:
                return None
            out.append((start * num // den, length * num // den))
        if type(dim) is not int or dim < 0:
            _check_dim("Split", dim)
        return _split_with(self, dim, tuple(out))

    def over(self, ranks: int) -> Split:
        """The split over ``ranks`` ranks: ranks beyond the intervals hold nothing (``(0, 0)``).

        Raises:
            ValueError: a rank at or beyond ``ranks`` holds part of the tensor.
        """
        beyond = [r for r, (_, n) in enumerate(self.intervals) if r >= ranks and n > 0]
        if beyond:
            msg = (f"Split intervals={self.intervals!r} give rank {beyond[0]} a slice, but the group has {ranks} "
                   f"ranks; place the tensor on ranks 0..{ranks - 1}.")
            raise ValueError(msg)
        if len(self.intervals) == ranks:
            return self
        return Split(self.dim, self.intervals[:ranks] + ((0, 0),) * (ranks - len(self.intervals)))


@dataclass(frozen=True, slots=True)
class Packed:
    """Several slices per rank along ``dim``, side by side in the rank's local tensor.

    ``pieces[r]`` lists rank ``r``'s ``(start, length)`` slices in increasing order; its local
    tensor is their concatenation along ``dim``. A fused q/k/v weight split by heads holds this
    way: each rank its rows of q, then of k, then of v. The non-empty slices of all ranks tile
    ``[0, size)``.

    Args:
        dim: the dimension the slices are cut from (non-negative).
        pieces: per rank, its slices in increasing order.

    Raises:
        ValueError: a negative ``dim``, start or length, slices of a rank out of order, or
            slices that overlap or leave a gap.
        TypeError: ``dim`` or a slice is not made of ints.

    Example:
        >>> Packed(0, (((0, 2), (4, 2)), ((2, 2), (6, 2)))).coalesced() is None
        True
    """

    dim: int
    pieces: tuple[tuple[tuple[int, int], ...], ...]

    def __post_init__(self) -> None:
        _check_dim("Packed", self.dim)
        if isinstance(self.pieces, (str, bytes)) or not isinstance(self.pieces, Sequence):
            msg = f"Packed pieces={self.pieces!r} must be a sequence with one tuple of (start, length) slices per rank."
            raise TypeError(msg)
        pieces = tuple(_as_slices("Packed", p, f"pieces[{r}]") for r, p in enumerate(self.pieces))
        for r, slices in enumerate(pieces):
            if any(a + n > b for (a, n), (b, _) in zip(slices, slices[1:])):
                msg = (f"Packed pieces[{r}]={slices!r} are not in increasing order without overlap; list a rank's "
                       f"slices by their start.")
                raise ValueError(msg)
        _check_cover("Packed", [s for slices in pieces for s in slices], "pieces")
        object.__setattr__(self, "pieces", pieces)

    @property
    def size(self) -> int:
        """The global size along ``dim``."""
        return max((s + n for slices in self.pieces for s, n in slices), default=0)

    def local_length(self, rank: int) -> int:
        """The size of ``rank``'s local tensor along ``dim``."""
        return sum(n for _, n in self.pieces[rank]) if rank < len(self.pieces) else 0

    def coalesced(self) -> Split | None:
        """The same layout as a :class:`Split` when every rank's slices are adjacent, else ``None``."""
        intervals = []
        for slices in self.pieces:
            live = [s for s in slices if s[1] > 0]
            if any(a + n != b for (a, n), (b, _) in zip(live, live[1:])):
                return None
            intervals.append((live[0][0], sum(n for _, n in live)) if live else (0, 0))
        return Split(self.dim, tuple(intervals))

    def strided(self) -> Strided | None:
        """The same layout as a :class:`Strided` when it is one (equal blocks, each split alike), else ``None``.

        Example:
            >>> Packed(0, (((0, 2), (4, 2)), ((2, 2), (6, 2)))).strided()
            Strided(dim=0, intervals=((0, 2), (2, 2)), blocks=2)
        """
        counts = {len(slices) for slices in self.pieces if slices}
        if len(counts) != 1:
            return None
        blocks = counts.pop()
        size, rest = divmod(self.size, blocks)
        if rest:
            return None
        intervals = []
        for slices in self.pieces:
            if not slices:
                intervals.append((0, 0))
                continue
            start, length = slices[0]
            if start + length > size or any(slices[b] != (start + b * size, length) for b in range(blocks)):
                return None
            intervals.append((start, length))
        return Strided(self.dim, tuple(intervals), blocks)


@dataclass(frozen=True, slots=True)
class Strided:
    """``blocks`` equal blocks one after the other along ``dim``, each split alike over the ranks.

    Rank ``r`` holds ``intervals[r] = (start, length)`` of every block (block ``b`` covers
    ``[b * size, (b + 1) * size)``), its pieces side by side in its local tensor. A tensor split
    on its heads whose heads are then merged with the dimensions outside them
    (``reshape(batch * num_heads, ...)``) is laid out this way, and so is a fused q/k/v weight
    split by heads (three blocks).

    It is the regular case of :class:`Packed`, and metadata states it as that ``Packed``
    (:meth:`packed`; :meth:`Packed.strided` goes back), so ``ShardedTensorMetadata.placement``
    is never a ``Strided`` and a layout has one placement. This form is what compute needs:
    the local tensor unflattens into ``(blocks, this rank's length)`` without reading the pieces.

    Args:
        dim: the dimension holding the blocks (non-negative).
        intervals: per rank, its ``(start, length)`` within each block.
        blocks: the number of blocks (positive).

    Raises:
        ValueError: a negative ``dim``, start or length, intervals that overlap or leave a gap,
            or ``blocks`` below 1.
        TypeError: ``dim``, ``blocks`` or an interval is not made of ints.

    Example:
        >>> Strided(0, ((0, 2), (2, 2)), 2).packed()
        Packed(dim=0, pieces=(((0, 2), (4, 2)), ((2, 2), (6, 2))))
    """

    dim: int
    intervals: tuple[tuple[int, int], ...]
    blocks: int

    def __post_init__(self) -> None:
        _check_dim("Strided", self.dim)
        intervals = _as_slices("Strided", self.intervals, "intervals")
        _check_cover("Strided", intervals, "intervals", replicas=True)
        object.__setattr__(self, "intervals", intervals)
        if not _int(self.blocks) or self.blocks < 1:
            msg = (f"Strided blocks={self.blocks!r} must be a positive int (the number of blocks along dim "
                   f"{self.dim}, e.g. the batch size of a reshape(batch * num_heads, ...)).")
            raise ValueError(msg) if _int(self.blocks) else TypeError(msg)

    @property
    def size(self) -> int:
        """The global size of one block."""
        return max((s + n for s, n in self.intervals), default=0)

    def moved(self, dim: int) -> Self:
        """The same blocks on another dimension (after a transpose)."""
        return self if dim == self.dim else dataclasses.replace(self, dim=dim)

    def packed(self) -> Packed:
        """The same layout as a :class:`Packed` placement: each rank's piece of every block, in order."""
        size = self.size
        return Packed(self.dim, tuple(tuple((b * size + s, n) for b in range(self.blocks)) if n else ()
                                      for s, n in self.intervals))


@dataclass(frozen=True, slots=True)
class Replicated:
    """The whole tensor on every rank (identical values)."""


@dataclass(frozen=True, slots=True)
class Partial:
    """A full-size value on every holding rank, pending an element-wise reduction across them.

    A row-parallel matmul leaves its output this way (``reduce_op="sum"``).

    Args:
        reduce_op: the pending reduction: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.

    Raises:
        ValueError: ``reduce_op`` is not one of those.
    """

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        check_reduce_op(self.reduce_op, where="Partial reduce_op")


Placement = Split | Packed | Replicated | Partial
"""How the ranks of a group hold one tensor."""


def _split_with(value: _Self, dim: int, intervals: tuple[tuple[int, int], ...]) -> _Self:
    """A copy of a checked ``Split`` (or subclass) on ``dim`` with ``intervals`` the caller vouches for.

    No re-check, and no generic copy: the split engine moves a split from dimension to
    dimension on almost every op it sees.
    """
    cls = type(value)
    new = object.__new__(cls)
    _set(new, "dim", dim)
    _set(new, "intervals", intervals)
    extra = _EXTRA.get(cls)
    if extra is None:
        extra = _EXTRA[cls] = tuple(f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                                    if f.name not in ("dim", "intervals"))
    for name in extra:
        _set(new, name, getattr(value, name))
    return new


_EXTRA: dict[type, tuple[str, ...]] = {}
_set = object.__setattr__


class _Shard(Protocol):
    """A shard as :func:`placement_of` reads it: its block and its rank (``ShardMetadata``)."""

    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def dims(self) -> tuple[int, ...]: ...

    @property
    def rank(self) -> int | None: ...


def placement_of(shards: Sequence[_Shard], size: Sequence[int]) -> Placement | None:
    """The placement of a tensor laid out as ``shards`` (one ``ShardMetadata`` per block), if it has one.

    Rank ``r`` of the result is rank ``r`` of the shards; ranks below the highest one that hold
    nothing get length 0. ``None`` when no placement describes the layout: blocks split along
    several dimensions, elements held by some ranks and not others, a shard without a rank, or
    no dimension to split (the whole tensor on one rank). Pure; used for metadata no spec built
    (from local shards, a checkpoint, a DTensor): specs state their placement themselves. Never
    a ``Partial``: shards do not say that their values are pending a reduction, so partial
    metadata is always given its placement.
    """
    size = tuple(size)
    ranks = [s.rank for s in shards]
    known = [r for r in ranks if r is not None]
    if not shards or len(known) != len(ranks):
        return None
    mine: list[list[_Shard]] = [[] for _ in range(max(known) + 1)]
    for s, r in zip(shards, known):
        mine[r].append(s)
    full = (0,) * len(size)
    if all(len(held) == 1 and held[0].offsets == full and held[0].dims == size for held in mine):
        return Replicated()
    live = [s for s in shards if 0 not in s.dims]
    dims = {d for s in live for d in range(len(size)) if s.dims[d] != size[d]}
    if len(dims) != 1:
        return None
    dim = dims.pop()
    if any(s.offsets[d] != 0 for s in live for d in range(len(size)) if d != dim):
        return None
    try:
        if all(len(held) <= 1 for held in mine):
            return Split(dim, tuple((held[0].offsets[dim], held[0].dims[dim]) if held else (0, 0) for held in mine))
        return Packed(dim, tuple(tuple(sorted((s.offsets[dim], s.dims[dim]) for s in held if 0 not in s.dims))
                                 for held in mine))
    except ValueError:
        return None  # overlapping copies: some ranks hold an element, others not


class _Block(Protocol):
    """Anything with a block's ``offsets`` and ``dims``: ``ShardMetadata``, a checkpoint's saved region."""

    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def dims(self) -> tuple[int, ...]: ...


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
    records which box owns each cell, so a query only looks at the cells it spans. Building
    the grid is vectorized (one ``searchsorted`` per dimension and one scatter), so building
    it costs no Python loop over cells (planning timings that include it: docs/benchmarks-history.md,
    "reshard planning").
    """

    def __init__(self, boxes: Sequence[Box], size: Sequence[int]) -> None:
        self._boxes: Sequence[Box] | None = list(boxes)
        self._grid_shape: tuple[int, ...] | None = None  # set for the index of a grid's cells (of_grid)
        ndim = len(size)
        live = [i for i, (_, dims) in enumerate(self._boxes) if 0 not in dims]
        self._lo: torch.Tensor | None = None
        self._hi: torch.Tensor | None = None
        self._cells: tuple[torch.Tensor, torch.Tensor] | None = None  # grid cells each live box spans
        if not live or ndim == 0:
            self._cuts: list[list[int]] = [[0, int(n)] for n in size]
            self._grid = torch.full((1,) * ndim, live[-1] if live else -1, dtype=torch.int64)
            return
        if len(live) <= _SMALL:
            self._build_small(live, size)
            return
        # Corners of every box (empty ones too, so rows are indexed by box id).
        lo = torch.tensor([offsets for offsets, _ in self._boxes], dtype=torch.int64).reshape(-1, ndim)
        dims = torch.tensor([dims for _, dims in self._boxes], dtype=torch.int64).reshape(-1, ndim)
        self._build(lo, dims, size)

    @classmethod
    def _without_boxes(cls) -> RegionIndex:
        """An index not built from a list of boxes; the caller fills in its grid or its columns."""
        index = cls.__new__(cls)
        index._boxes = None
        index._grid_shape = None
        index._lo = index._hi = None
        index._cells = None
        return index

    @classmethod
    def of_columns(cls, offsets: torch.Tensor, dims: torch.Tensor, size: Sequence[int]) -> RegionIndex:
        """The index of ``n`` boxes given as two ``(n, ndim)`` int64 tensors (a million boxes need no tuples)."""
        ndim = len(size)
        if ndim == 0 or offsets.shape[0] <= _SMALL:
            return cls(list(zip(map(tuple, offsets.tolist()), map(tuple, dims.tolist()))), size)
        if not bool((dims > 0).all(dim=1).any()):
            return cls([], size)
        index = cls._without_boxes()
        index._build(offsets, dims, size)
        return index

    @classmethod
    def of_grid(cls, cuts: Sequence[Sequence[int]]) -> RegionIndex:
        """The index of the cells of a grid, numbered in row-major order.

        ``cuts[d]`` are the strictly increasing cut points of dimension ``d``, from 0 to its size:
        the boxes of a regular split or mesh. Nothing is built per cell: a query finds its cells
        by bisecting the cut points, so it costs the same for ten cells or a million.
        """
        index = cls._without_boxes()
        index._cuts = [list(cut) for cut in cuts]
        index._grid_shape = tuple(len(c) - 1 for c in index._cuts)
        return index

    def _build(self, lo: torch.Tensor, dims: torch.Tensor, size: Sequence[int]) -> None:
        ndim = len(size)
        self._lo, self._hi = lo, lo + dims
        ids = (dims > 0).all(dim=1).nonzero().flatten()
        lo, hi = self._lo[ids].T.contiguous(), self._hi[ids].T.contiguous()
        bounds = torch.tensor([[0, int(n)] for n in size], dtype=torch.int64)
        cuts = [torch.unique(torch.cat([bounds[d], lo[d], hi[d]])) for d in range(ndim)]
        self._cuts = [c.tolist() for c in cuts]
        cell_lo = torch.stack([torch.searchsorted(cuts[d], lo[d]) for d in range(ndim)], dim=1)
        cell_hi = torch.stack([torch.searchsorted(cuts[d], hi[d]) for d in range(ndim)], dim=1)
        self._cells = (cell_lo, cell_hi)
        self._grid = torch.full(tuple(len(c) - 1 for c in self._cuts), -1, dtype=torch.int64)
        single = ((cell_hi - cell_lo) == 1).all(dim=1)
        # Regular layouts (splits, meshes) give one cell per box: a single scatter fills the grid.
        # Identical boxes (replicas) keep the last one, as a loop assigning in order would.
        strides = torch.tensor(self._grid.stride(), dtype=torch.int64)
        flat = (cell_lo[single] * strides).sum(dim=1)
        self._grid.view(-1).scatter_reduce_(0, flat, ids[single], reduce="amax")
        for k in (~single).nonzero().flatten().tolist():
            cells = tuple(slice(a, b) for a, b in zip(cell_lo[k].tolist(), cell_hi[k].tolist()))
            self._grid[cells].clamp_(min=int(ids[k]))

    def box(self, box_id: int) -> Box:
        """The box with id ``box_id`` (its position in the boxes the index was built from)."""
        if self._boxes is not None:
            return self._boxes[box_id]
        if self._grid_shape is not None:
            cells = torch.unravel_index(torch.tensor(box_id), self._grid_shape)
            return (tuple(cut[int(c)] for cut, c in zip(self._cuts, cells)),
                    tuple(cut[int(c) + 1] - cut[int(c)] for cut, c in zip(self._cuts, cells)))
        assert self._lo is not None and self._hi is not None
        lo, hi = self._lo[box_id].tolist(), self._hi[box_id].tolist()
        return tuple(lo), tuple(b - a for a, b in zip(lo, hi))

    def tiles(self, size: Sequence[int]) -> bool:
        """Whether the boxes lie inside ``size`` and cover each of its elements exactly once.

        Identical boxes count twice here (``check_tiling`` takes them as replicas). ``False``
        also means "not checked" (a few boxes): ``check_tiling`` then decides, and says what is
        wrong. Vectorized, from the grid built for the index: one count per box of a regular
        layout.
        """
        if self._grid_shape is not None:
            return [cut[-1] for cut in self._cuts] == list(size) and all(cut[0] == 0 for cut in self._cuts)
        if self._cells is None or self._lo is None or self._hi is None:
            return False
        limit = torch.tensor(tuple(size), dtype=torch.int64)
        if bool((self._hi > limit).any()) or bool((self._lo > limit).any()):
            return False
        cell_lo, cell_hi = self._cells
        shape = tuple(self._grid.shape)
        strides = torch.tensor(self._grid.stride(), dtype=torch.int64)
        single = ((cell_hi - cell_lo) == 1).all(dim=1)
        cover = torch.bincount((cell_lo[single] * strides).sum(dim=1), minlength=math.prod(shape))
        grid = cover.view(shape)
        for k in (~single).nonzero().flatten().tolist():
            grid[tuple(slice(a, b) for a, b in zip(cell_lo[k].tolist(), cell_hi[k].tolist()))] += 1
        return bool((cover == 1).all())

    def _build_small(self, live: list[int], size: Sequence[int]) -> None:
        # A few boxes: plain Python beats the fixed cost of a dozen tensor operations.
        boxes = self._boxes
        assert boxes is not None
        self._cuts = [sorted({0, int(size[d]), *(boxes[i][0][d] for i in live),
                              *(boxes[i][0][d] + boxes[i][1][d] for i in live)}) for d in range(len(size))]
        position = [{c: k for k, c in enumerate(cut)} for cut in self._cuts]
        self._grid = torch.full(tuple(len(c) - 1 for c in self._cuts), -1, dtype=torch.int64)
        for i in live:  # in order, so the last of identical boxes wins
            offsets, dims = boxes[i]
            self._grid[tuple(slice(position[d][o], position[d][o + n])
                             for d, (o, n) in enumerate(zip(offsets, dims)))] = i

    def overlapping(self, query: Box) -> list[tuple[int, Box]]:
        """``(box id, common block)`` for every box sharing an element with ``query``, by id."""
        offsets, dims = query
        if 0 in dims:
            return []
        if self._grid_shape is not None:
            return self._grid_overlapping(query)
        cells = []
        for d, cut in enumerate(self._cuts):
            lo = bisect.bisect_right(cut, offsets[d]) - 1
            hi = bisect.bisect_left(cut, offsets[d] + dims[d])
            cells.append(slice(max(lo, 0), hi))
        found = self._grid[tuple(cells)]
        if found.numel() > 1:
            found = found.unique()
            found = found[found >= 0]
        ids = found.reshape(-1).tolist()
        if len(ids) > 16 and self._lo is not None and self._hi is not None:
            # Many boxes (e.g. every shard of another split): intersect them all at once.
            start = torch.tensor(offsets, dtype=torch.int64)
            low = torch.maximum(self._lo[found], start)
            high = torch.minimum(self._hi[found], start + torch.tensor(dims, dtype=torch.int64))
            return [(box_id, (tuple(o), tuple(n))) for box_id, o, n in zip(ids, low.tolist(), (high - low).tolist())
                    if min(n) > 0]
        result = []
        for box_id in ids:
            if box_id < 0:
                continue
            common = intersect(self.box(box_id), query)
            if common is not None:
                result.append((box_id, common))
        return result

    def _grid_overlapping(self, query: Box) -> list[tuple[int, Box]]:
        offsets, dims = query
        shape = self._grid_shape
        assert shape is not None
        spans = []  # per dimension: (cell, common offset, common length) of every cell the query meets
        for cut, o, n in zip(self._cuts, offsets, dims):
            first, last = bisect.bisect_right(cut, o) - 1, bisect.bisect_left(cut, o + n)
            spans.append([(c, max(cut[c], o), min(cut[c + 1], o + n) - max(cut[c], o))
                          for c in range(max(first, 0), min(last, len(cut) - 1))])
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        return [(sum(c * s for (c, _, _), s in zip(cells, strides)),
                 (tuple(o for _, o, _ in cells), tuple(n for _, _, n in cells)))
                for cells in itertools.product(*spans)]


# Up to this many boxes an index is built in plain Python; beyond, vectorized.
_SMALL = 64


def check_tiling(shards: Sequence[_Block], size: Sequence[int], *, what: str = "shards") -> None:
    """Raise ``ValueError`` unless the distinct regions of ``shards`` tile ``size`` exactly.

    ``shards`` are blocks with ``offsets`` and ``dims`` (``ShardMetadata``, or a checkpoint's
    saved regions). Shards with identical regions are replicas and allowed; partial overlaps
    and gaps are not. Linear in the number of shards for regular layouts (splits, meshes):
    beyond a few dozen shards the check runs as a handful of tensor operations.
    """
    size = tuple(size)
    if len(shards) > _SMALL and len(size) > 0 and _tiles_exactly(shards, size):
        return
    _check_tiling_one_by_one(shards, size, what)


def _tiles_exactly(shards: Sequence[_Block], size: tuple[int, ...]) -> bool:
    """Vectorized: whether the distinct regions of ``shards`` lie inside ``size`` and tile it once.

    ``False`` means "not proven": the caller then checks shard by shard and says what is wrong.
    """
    ndim = len(size)
    offsets = [s.offsets for s in shards]
    dims = [s.dims for s in shards]
    if any(len(o) != ndim or len(n) != ndim for o, n in zip(offsets, dims)):
        return False
    # Empty shards must lie inside too; the index only looks at the others.
    limit = torch.tensor(size, dtype=torch.int64)
    lo = torch.tensor(offsets, dtype=torch.int64).reshape(-1, ndim)
    hi = lo + torch.tensor(dims, dtype=torch.int64).reshape(-1, ndim)
    if bool((lo > limit).any()) or bool((hi > limit).any()):
        return False
    if math.prod(size) == 0:
        return True
    # Replicas count once.
    distinct = list(dict.fromkeys((tuple(o), tuple(n)) for o, n in zip(offsets, dims) if 0 not in n))
    return RegionIndex(distinct, size).tiles(size)


def _check_tiling_one_by_one(shards: Sequence[_Block], size: tuple[int, ...], what: str) -> None:
    """``check_tiling`` in plain Python: for a few shards, and to say what is wrong."""
    ndim = len(size)
    for i, s in enumerate(shards):
        if len(s.offsets) != ndim:
            msg = (f"{what}[{i}] has {len(s.offsets)} dimensions but the tensor has {ndim} "
                   f"(size={size!r}).")
            raise ValueError(msg)
        for d in range(ndim):
            if s.offsets[d] + s.dims[d] > size[d] or (s.offsets[d] > size[d]):
                msg = (f"{what}[{i}] (offsets={s.offsets!r}, dims={s.dims!r}) reaches past the tensor's "
                       f"size {size!r} along dimension {d}; shards must lie inside the tensor.")
                raise ValueError(msg)
    regions: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    for i, s in enumerate(shards):
        if 0 not in s.dims:
            regions.setdefault((tuple(s.offsets), tuple(s.dims)), i)
    numel = math.prod(size)
    if numel == 0:
        return
    # Count coverage on the grid of all cut points: one cell per piece of every region, so
    # regular layouts cost one increment per region.
    cuts = [sorted({0, size[d], *(o[d] for o, _ in regions), *(o[d] + n[d] for o, n in regions)})
            for d in range(ndim)]
    index = [{c: k for k, c in enumerate(cut)} for cut in cuts]
    grid_shape = tuple(len(c) - 1 for c in cuts)
    cover = torch.zeros(grid_shape, dtype=torch.int32)
    for (offsets, dims) in regions:
        cell = tuple(slice(index[d][offsets[d]], index[d][offsets[d] + dims[d]]) for d in range(ndim))
        cover[cell] += 1
    if bool((cover == 1).all()):
        return
    bad = (cover != 1).nonzero()[0].tolist()
    where = tuple(cuts[d][bad[d]] for d in range(ndim))
    problem = "overlap" if int(cover[tuple(bad)]) > 1 else "leave a gap"
    owners = [f"{what}[{i}] (offsets={o!r}, dims={n!r})" for (o, n), i in regions.items()
              if all(o[d] <= where[d] < o[d] + n[d] for d in range(ndim))]
    msg = (f"{what} {problem} at element {where!r} of a tensor of size {size!r}"
           + (f" (covered by {', '.join(owners)})" if owners else " (no shard covers it)")
           + "; shards must cover every element exactly once (identical regions are replicas).")
    raise ValueError(msg)
