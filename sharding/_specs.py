"""Sharding specs: pure descriptions of how a tensor is split over ranks and devices.

A spec answers ``build_metadata(size)`` identically on every rank, with no communication.
"""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Union, cast

import torch

from ._device import RemoteDevice
from ._metadata import ShardedTensorMetadata, ShardMetadata
from ._placement import PlacementSpec, register_spec, spec_from_dict
from .layout import Packed, Partial, Placement, Replicated, Split, check_reduce_op, check_tiling, chunk_bounds

__all__ = [
    "DevicePlacement", "ShardingSpec", "SingleSplitShardingSpec", "MeshShardingSpec", "CompositeShardingSpec",
    "EnumerableShardingSpec", "PartialSpec", "single_split", "mesh", "composite", "partial", "spec_from_dict",
    "chunk_bounds",
]


DeviceLike = Union[str, RemoteDevice, "DevicePlacement"]


@register_spec("device")
@dataclass(frozen=True, slots=True, init=False)
class DevicePlacement(PlacementSpec):
    """The whole tensor on one device.

    With a rank (``"rank:1/cpu"``) only that rank holds it. Without one (``"cpu"``) every
    rank holds a full replica on that device.

    Args:
        device: a ``RemoteDevice`` or its string, ``"rank:1/cpu"`` or ``"cpu"``.
    """

    device: RemoteDevice

    def __init__(self, device: DeviceLike) -> None:
        if isinstance(device, DevicePlacement):
            device = device.device
        object.__setattr__(self, "device", RemoteDevice(device))

    def __repr__(self) -> str:
        return f"DevicePlacement({str(self.device)!r})"

    def build_metadata(self, size: Sequence[int], dtype: torch.dtype | None = None,
                       names: Sequence[str | None] | None = None, *,
                       world_size: int | None = None) -> ShardedTensorMetadata:
        """The whole tensor on one rank, or a full replica on every rank when no rank is given."""
        size = _check_size(size)
        shards = _expand(self, (0,) * len(size), size, world_size, "DevicePlacement")
        # A replica on every rank; the whole tensor on one rank has no placement of its own.
        return ShardedTensorMetadata(shards, size, dtype, placement=Replicated() if self.device.rank is None else None)

    def to_dict(self) -> dict[str, object]:
        """JSON-safe form; ``spec_from_dict`` rebuilds an equal spec."""
        return {"type": self.spec_type, "device": str(self.device)}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> DevicePlacement:
        """Inverse of ``to_dict``."""
        return cls(cast(str, data["device"]))

    def __reduce__(self) -> tuple[type[DevicePlacement], tuple[str]]:
        return (DevicePlacement, (str(self.device),))


def as_placement(value: object, *, where: str) -> DevicePlacement:
    """Normalize one placement entry (string, RemoteDevice or DevicePlacement)."""
    if isinstance(value, (str, RemoteDevice, DevicePlacement)):
        return DevicePlacement(value)
    msg = (f"{where} must be a device string, RemoteDevice or DevicePlacement, got "
           f"{type(value).__name__} {value!r}; write e.g. 'rank:0/cpu'.")
    raise TypeError(msg)


def _check_size(size: Sequence[int]) -> tuple[int, ...]:
    if isinstance(size, int) or not all(isinstance(s, int) and not isinstance(s, bool) for s in size):
        msg = f"size must be a sequence of ints (e.g. (4, 8)), got {size!r}."
        raise TypeError(msg)
    if any(s < 0 for s in size):
        msg = f"size={tuple(size)!r} has a negative dimension; sizes must be >= 0."
        raise ValueError(msg)
    return tuple(size)


def _alone(world_size: int) -> str:
    """The likely cause of a world of one where a spec names other ranks: no launcher."""
    if world_size != 1:
        return ""
    return (", or start the script on as many processes as the spec names, e.g. with torchrun --nproc-per-node 2 "
            "(a script started with plain python runs as one process)")


def _expand(placement: DevicePlacement, offsets: tuple[int, ...], dims: tuple[int, ...],
            world_size: int | None, what: str) -> list[ShardMetadata]:
    """One ShardMetadata for a ranked placement; one per rank for a rankless (replicated) one."""
    device = placement.device
    if device.rank is not None:
        if world_size is not None and device.rank >= world_size:
            msg = (f"{what} places a shard on rank {device.rank} ({str(device)!r}) but the world has "
                   f"{world_size} ranks; use ranks 0..{world_size - 1}{_alone(world_size)}.")
            raise ValueError(msg)
        return [ShardMetadata(offsets, dims, device)]
    if world_size is None:
        msg = (f"{what} uses {str(device)!r}, a device without a rank, which means a replica on every "
               f"rank; pass world_size= to build_metadata, or name the rank as 'rank:<r>/{device.device}'.")
        raise ValueError(msg)
    return [ShardMetadata(offsets, dims, RemoteDevice.of(r, device.device)) for r in range(world_size)]


def _split_placement(dim: int, placements: Sequence[DevicePlacement],
                     bounds: Sequence[tuple[int, int]]) -> Placement | None:
    """The placement of a split along ``dim`` giving ``bounds[i]`` to ``placements[i]``.

    One slice per rank is a ``Split``; a rank named several times holds a ``Packed`` layout.
    ``None`` for a placement without a rank (a slice on every rank: copies, not a split).
    """
    ranks = [p.device.rank for p in placements if p.device.rank is not None]
    if len(ranks) != len(placements):
        return None
    held: list[list[tuple[int, int]]] = [[] for _ in range(max(ranks) + 1)]
    for r, bound in zip(ranks, bounds):
        held[r].append(bound)
    if all(len(h) <= 1 for h in held):
        return Split(dim, tuple(h[0] if h else (0, 0) for h in held))
    return Packed(dim, tuple(tuple(sorted(b for b in h if b[1] > 0)) for h in held))


def _rank_limit(placements: Iterable[DevicePlacement], world_size: int | None, what: str) -> None:
    if world_size is None:
        return
    for p in placements:
        if p.device.rank is not None and p.device.rank >= world_size:
            msg = (f"{what} places a shard on rank {p.device.rank} ({str(p.device)!r}) but the world has "
                   f"{world_size} ranks; use ranks 0..{world_size - 1}{_alone(world_size)}.")
            raise ValueError(msg)


@register_spec("single_split")
@dataclass(frozen=True, slots=True, init=False)
class SingleSplitShardingSpec(PlacementSpec):
    """Split a tensor along one dimension, one shard per placement entry.

    Without ``shard_sizes`` the split follows ``torch.chunk`` (trailing shards may be empty and
    stay listed); with ``shard_sizes`` (one per placement, summing to the dimension's size) it is
    uneven. ``split_dimension`` may be negative or the name of a named tensor dimension.

    Args:
        shard_placement: one entry per shard, in order: ``"rank:<r>/<device>"`` strings,
            ``RemoteDevice`` or ``DevicePlacement`` values; a rank may appear several times.
        split_dimension: the dimension to split: an int (negative counts from the end) or a
            dimension name of a named tensor.
        shard_sizes: the size of each shard along ``split_dimension`` (same length as
            ``shard_placement``); ``None`` splits like ``torch.chunk``.

    Example:
        >>> spec = SingleSplitShardingSpec(["rank:0/cpu", "rank:1/cpu"], 0)
        >>> [s.dims for s in spec.build_metadata((10, 4)).shards]
        [(5, 4), (5, 4)]
    """

    shard_placement: tuple[DevicePlacement, ...]
    split_dimension: int | str
    shard_sizes: tuple[int, ...] | None

    def __init__(self, shard_placement: Sequence[DeviceLike], split_dimension: int | str = 0,
                 shard_sizes: Sequence[int] | None = None) -> None:
        if isinstance(shard_placement, (str, RemoteDevice, DevicePlacement)) or not isinstance(
                shard_placement, Iterable):
            msg = (f"shard_placement must be a list of placements, got {shard_placement!r}; "
                   f"write e.g. ['rank:0/cpu', 'rank:1/cpu'].")
            raise TypeError(msg)
        placements = tuple(as_placement(p, where=f"shard_placement[{i}]")
                           for i, p in enumerate(shard_placement))
        if not placements:
            msg = "shard_placement is empty; give at least one placement, e.g. ['rank:0/cpu']."
            raise ValueError(msg)
        if isinstance(split_dimension, bool) or not isinstance(split_dimension, (int, str)):
            msg = (f"split_dimension must be an int or a dimension name, got "
                   f"{type(split_dimension).__name__} {split_dimension!r}.")
            raise TypeError(msg)
        sizes: tuple[int, ...] | None = None
        if shard_sizes is not None:
            sizes = tuple(shard_sizes)
            if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
                msg = f"shard_sizes must be ints, got {shard_sizes!r}."
                raise TypeError(msg)
            if len(sizes) != len(placements):
                msg = (f"shard_sizes={list(sizes)!r} has {len(sizes)} entries but shard_placement has "
                       f"{len(placements)}; give one size per placement.")
                raise ValueError(msg)
            if any(s < 0 for s in sizes):
                msg = f"shard_sizes={list(sizes)!r} has a negative size; sizes must be >= 0."
                raise ValueError(msg)
        object.__setattr__(self, "shard_placement", placements)
        object.__setattr__(self, "split_dimension", split_dimension)
        object.__setattr__(self, "shard_sizes", sizes)

    @property
    def devices(self) -> tuple[DevicePlacement, ...]:
        """Alias of ``shard_placement`` (the RFC's name)."""
        return self.shard_placement

    def resolve_dim(self, size: Sequence[int], names: Sequence[str | None] | None = None) -> int:
        """The split dimension as a non-negative int for a tensor of ``size``."""
        ndim = len(size)
        dim = self.split_dimension
        if ndim == 0:
            msg = ("a 0-d tensor has no dimension to split; place it whole with DevicePlacement "
                   "(e.g. DevicePlacement('rank:0/cpu'), or 'cpu' for a replica on every rank).")
            raise ValueError(msg)
        if names is not None and len(names) != ndim:
            msg = (f"names={tuple(names)!r} has {len(names)} entries but the tensor has {ndim} dimensions "
                   f"(size={tuple(size)!r}); give one name (or None) per dimension.")
            raise ValueError(msg)
        if isinstance(dim, str):
            if names is None or dim not in names:
                msg = (f"split_dimension={dim!r} is a dimension name but the tensor's names are "
                       f"{None if names is None else tuple(names)!r}; pass names= with {dim!r} in it, "
                       f"or use an int dimension.")
                raise ValueError(msg)
            return list(names).index(dim)
        if not -ndim <= dim < ndim:
            msg = (f"split_dimension={dim} is out of range for a tensor of rank {ndim} "
                   f"(size={tuple(size)}); use a dimension in [{-ndim}, {ndim - 1}].")
            raise ValueError(msg)
        return dim % ndim

    def build_metadata(self, size: Sequence[int], dtype: torch.dtype | None = None,
                       names: Sequence[str | None] | None = None, *,
                       world_size: int | None = None) -> ShardedTensorMetadata:
        """The layout for a tensor of ``size``; no communication."""
        size = _check_size(size)
        dim = self.resolve_dim(size, names)
        n = size[dim]
        if self.shard_sizes is None:
            bounds = chunk_bounds(n, len(self.shard_placement))
        else:
            if sum(self.shard_sizes) != n:
                msg = (f"shard_sizes={list(self.shard_sizes)!r} sum to {sum(self.shard_sizes)} but dimension "
                       f"{dim} of size={size!r} has {n} elements; make them sum to {n}.")
                raise ValueError(msg)
            starts = [0, *itertools.accumulate(self.shard_sizes)][:-1]
            bounds = list(zip(starts, self.shard_sizes))
        _rank_limit(self.shard_placement, world_size, "SingleSplitShardingSpec")
        shards: list[ShardMetadata] = []
        for i, (placement, (start, length)) in enumerate(zip(self.shard_placement, bounds)):
            offsets = tuple(start if d == dim else 0 for d in range(len(size)))
            dims = tuple(length if d == dim else size[d] for d in range(len(size)))
            shards += _expand(placement, offsets, dims, world_size, f"shard_placement[{i}]")
        return ShardedTensorMetadata(shards, size, dtype, placement=_split_placement(dim, self.shard_placement, bounds))

    def to_dict(self) -> dict[str, object]:
        """JSON-safe form; ``spec_from_dict`` rebuilds an equal spec."""
        return {"type": self.spec_type, "shard_placement": [str(p.device) for p in self.shard_placement],
                "split_dimension": self.split_dimension,
                "shard_sizes": None if self.shard_sizes is None else list(self.shard_sizes)}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SingleSplitShardingSpec:
        """Inverse of ``to_dict``."""
        # The constructor checks every field's type, so the casts only inform the checker.
        return cls(cast("Sequence[str]", data["shard_placement"]), cast("int | str", data["split_dimension"]),
                   cast("Sequence[int] | None", data.get("shard_sizes")))

    def __reduce__(self) -> tuple[type[SingleSplitShardingSpec], tuple[object, ...]]:
        return (SingleSplitShardingSpec, (self.shard_placement, self.split_dimension, self.shard_sizes))


def _mesh_shape(array: object, path: tuple[int, ...] = ()) -> tuple[int, ...]:
    if isinstance(array, (str, RemoteDevice, DevicePlacement)):
        return ()
    if not isinstance(array, Sequence) or len(array) == 0:
        msg = (f"shard_placement{''.join(f'[{i}]' for i in path)} must be a non-empty nested list of "
               f"placements, got {array!r}.")
        raise TypeError(msg) if not isinstance(array, Sequence) else ValueError(msg)
    shapes = [_mesh_shape(a, path + (i,)) for i, a in enumerate(array)]
    if any(s != shapes[0] for s in shapes):
        msg = (f"shard_placement{''.join(f'[{i}]' for i in path)} is ragged (sub-shapes "
               f"{sorted(set(shapes))!r}); every row of the mesh must have the same shape.")
        raise ValueError(msg)
    return (len(array),) + shapes[0]


def _flatten(array: object) -> list[object]:
    if isinstance(array, (str, RemoteDevice, DevicePlacement)):
        return [array]
    return [x for a in array for x in _flatten(a)]  # type: ignore[attr-defined]


@register_spec("mesh")
@dataclass(frozen=True, slots=True, init=False)
class MeshShardingSpec(PlacementSpec):
    """Split every tensor dimension: an N-d array of placements for an N-d tensor.

    Tensor dimension ``d`` is cut into ``mesh_shape[d]`` chunks (``torch.chunk`` rules) and the
    element at index ``(i, j, ...)`` holds block ``(i, j, ...)``. A 4x8 tensor on a 2x4 mesh gives
    2x2 blocks.

    Args:
        shard_placement: a nested list of placements (strings, ``RemoteDevice`` or
            ``DevicePlacement``) with one level per tensor dimension, e.g.
            ``[["rank:0/cpu", "rank:1/cpu"], ["rank:2/cpu", "rank:3/cpu"]]`` for 2x2 blocks.
    """

    shard_placement: tuple[DevicePlacement, ...]  # row-major, flattened
    mesh_shape: tuple[int, ...]

    def __init__(self, shard_placement: Sequence[object]) -> None:
        shape = _mesh_shape(shard_placement)
        if not shape:
            msg = (f"shard_placement={shard_placement!r} is a single placement; a mesh needs a nested list "
                   f"with one level per tensor dimension (use DevicePlacement for one device).")
            raise ValueError(msg)
        flat = tuple(as_placement(p, where="shard_placement entry") for p in _flatten(shard_placement))
        object.__setattr__(self, "shard_placement", flat)
        object.__setattr__(self, "mesh_shape", shape)

    def placement_array(self) -> list[object]:
        """The placements as the nested list given to the constructor."""
        def build(level: int, start: int) -> list[object]:
            stride = math.prod(self.mesh_shape[level + 1:])
            if level == len(self.mesh_shape) - 1:
                return list(self.shard_placement[start:start + self.mesh_shape[level]])
            return [build(level + 1, start + i * stride) for i in range(self.mesh_shape[level])]
        return build(0, 0)

    def build_metadata(self, size: Sequence[int], dtype: torch.dtype | None = None,
                       names: Sequence[str | None] | None = None, *,
                       world_size: int | None = None) -> ShardedTensorMetadata:
        """The layout for a tensor of ``size``; no communication."""
        size = _check_size(size)
        if len(size) != len(self.mesh_shape):
            msg = (f"the mesh has {len(self.mesh_shape)} dimensions (shape {self.mesh_shape!r}) but the "
                   f"tensor has {len(size)} (size={size!r}); a MeshShardingSpec needs one mesh dimension "
                   f"per tensor dimension (use 1 for a dimension that is not split).")
            raise ValueError(msg)
        _rank_limit(self.shard_placement, world_size, "MeshShardingSpec")
        bounds = [chunk_bounds(n, k) for n, k in zip(size, self.mesh_shape)]
        shards: list[ShardMetadata] = []
        for flat_index, placement in enumerate(self.shard_placement):
            index, rest = [], flat_index
            for k in reversed(self.mesh_shape):
                index.append(rest % k)
                rest //= k
            index.reverse()
            offsets = tuple(bounds[d][i][0] for d, i in enumerate(index))
            dims = tuple(bounds[d][i][1] for d, i in enumerate(index))
            shards += _expand(placement, offsets, dims, world_size, f"mesh element {tuple(index)!r}")
        split = [d for d, k in enumerate(self.mesh_shape) if k > 1]
        # Split along one mesh axis, the mesh is a single split; along several, blocks (no placement).
        along = _split_placement(split[0], self.shard_placement, bounds[split[0]]) if len(split) == 1 else None
        return ShardedTensorMetadata(shards, size, dtype, placement=along)

    def __repr__(self) -> str:
        return f"MeshShardingSpec({self.to_dict()['shard_placement']!r})"

    def to_dict(self) -> dict[str, object]:
        """JSON-safe form; ``spec_from_dict`` rebuilds an equal spec."""
        def strs(a: object) -> object:
            return str(a.device) if isinstance(a, DevicePlacement) else [strs(x) for x in a]  # type: ignore[attr-defined]
        return {"type": self.spec_type, "shard_placement": strs(self.placement_array())}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> MeshShardingSpec:
        """Inverse of ``to_dict``."""
        return cls(cast("Sequence[object]", data["shard_placement"]))

    def __reduce__(self) -> tuple[type[MeshShardingSpec], tuple[object, ...]]:
        return (MeshShardingSpec, (self.placement_array(),))


@register_spec("enumerable")
@dataclass(frozen=True, slots=True, init=False)
class EnumerableShardingSpec(PlacementSpec):
    """An explicit list of shards; their distinct regions must tile the tensor.

    This is the spec of a ``ShardedTensor`` built from arbitrary local shards, and lets any
    layout be the target of a reshard.

    Args:
        shards: every shard's ``ShardMetadata`` (offsets, sizes, device), in order.
    """

    shards: tuple[ShardMetadata, ...]

    def __init__(self, shards: Iterable[ShardMetadata]) -> None:
        shards = tuple(shards)
        if not shards:
            msg = "EnumerableShardingSpec needs at least one ShardMetadata."
            raise ValueError(msg)
        for i, s in enumerate(shards):
            if not isinstance(s, ShardMetadata):
                msg = f"shards[{i}] is {type(s).__name__} {s!r}; expected a ShardMetadata."
                raise TypeError(msg)
            if s.rank is None:
                msg = f"shards[{i}] has device {str(s.device)!r} without a rank; name it as 'rank:<r>/<device>'."
                raise ValueError(msg)
        object.__setattr__(self, "shards", shards)

    def build_metadata(self, size: Sequence[int], dtype: torch.dtype | None = None,
                       names: Sequence[str | None] | None = None, *,
                       world_size: int | None = None) -> ShardedTensorMetadata:
        """Check that the shards tile ``size`` and return them as metadata."""
        size = _check_size(size)
        _rank_limit((DevicePlacement(s.device) for s in self.shards), world_size, "EnumerableShardingSpec")
        check_tiling(self.shards, size)
        return ShardedTensorMetadata(self.shards, size, dtype)

    def to_dict(self) -> dict[str, object]:
        """JSON-safe form; ``spec_from_dict`` rebuilds an equal spec."""
        return {"type": self.spec_type, "shards": [s.to_dict() for s in self.shards]}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> EnumerableShardingSpec:
        """Inverse of ``to_dict``."""
        return cls(ShardMetadata.from_dict(s) for s in cast("list[dict[str, object]]", data["shards"]))

    def __reduce__(self) -> tuple[type[EnumerableShardingSpec], tuple[object, ...]]:
        return (EnumerableShardingSpec, (self.shards,))


@register_spec("partial")
@dataclass(frozen=True, slots=True, init=False)
class PartialSpec(PlacementSpec):
    """Full-size partial values on several ranks, pending one element-wise reduction.

    Each rank of ``shard_placement`` holds a tensor of the full size, and the tensor's value
    is the reduction (``reduce_op``: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``) of those
    local tensors, as a row-parallel matmul leaves it: every rank multiplies its columns of
    the input by its rows of the weight and holds a full-size partial sum. ``reshard`` to any
    other layout reduces (an all-reduce for a replica, a reduce-scatter for a split); no data
    moves until then. A placement without a rank (``"cpu"``) means every rank of the world.

    The same idea as DTensor's ``Partial`` placement, with the holders named explicitly.

    Args:
        shard_placement: the holding ranks' devices, one full-size partial tensor each.
        reduce_op: the pending reduction: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.

    Example:
        >>> spec = PartialSpec(["rank:0/cpu", "rank:1/cpu"], reduce_op="sum")
        >>> md = spec.build_metadata((4, 2))
        >>> [s.dims for s in md.shards], md.placement
        ([(4, 2), (4, 2)], Partial(reduce_op='sum'))
    """

    shard_placement: tuple[DevicePlacement, ...]
    reduce_op: str

    def __init__(self, shard_placement: Sequence[DeviceLike] | DeviceLike, *, reduce_op: str = "sum") -> None:
        if isinstance(shard_placement, (str, RemoteDevice, DevicePlacement)):
            shard_placement = [shard_placement]
        if not isinstance(shard_placement, Iterable):
            msg = (f"shard_placement must be a list of placements, got {shard_placement!r}; "
                   f"write e.g. ['rank:0/cpu', 'rank:1/cpu'], or 'cpu' for every rank.")
            raise TypeError(msg)
        placements = tuple(as_placement(p, where=f"shard_placement[{i}]") for i, p in enumerate(shard_placement))
        if not placements:
            msg = ("PartialSpec shard_placement is empty; name the ranks that hold partial values, "
                   "e.g. ['rank:0/cpu', 'rank:1/cpu'], or 'cpu' for every rank.")
            raise ValueError(msg)
        ranks = [p.device.rank for p in placements if p.device.rank is not None]
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        if repeated:
            msg = (f"PartialSpec names rank(s) {repeated} more than once in {[str(p.device) for p in placements]!r}; "
                   f"each rank holds one partial value, so list each rank once.")
            raise ValueError(msg)
        if len(placements) > 1 and any(p.device.rank is None for p in placements):
            msg = (f"PartialSpec mixes a device without a rank (which means every rank) with other placements "
                   f"in {[str(p.device) for p in placements]!r}; give either one rankless device or ranked ones.")
            raise ValueError(msg)
        object.__setattr__(self, "shard_placement", placements)
        object.__setattr__(self, "reduce_op", check_reduce_op(reduce_op))

    def build_metadata(self, size: Sequence[int], dtype: torch.dtype | None = None,
                       names: Sequence[str | None] | None = None, *,
                       world_size: int | None = None) -> ShardedTensorMetadata:
        """One full-size shard per holding rank, with ``partial`` set to the pending reduction."""
        size = _check_size(size)
        _check_reduce_dtype(self.reduce_op, dtype if dtype is not None else torch.get_default_dtype())
        shards: list[ShardMetadata] = []
        for i, placement in enumerate(self.shard_placement):
            shards += _expand(placement, (0,) * len(size), size, world_size, f"PartialSpec shard_placement[{i}]")
        return ShardedTensorMetadata(shards, size, dtype, placement=Partial(self.reduce_op))

    def to_dict(self) -> dict[str, object]:
        """JSON-safe form; ``spec_from_dict`` rebuilds an equal spec."""
        return {"type": self.spec_type, "shard_placement": [str(p.device) for p in self.shard_placement],
                "reduce_op": self.reduce_op}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> PartialSpec:
        """Inverse of ``to_dict``."""
        return cls(cast("Sequence[str]", data["shard_placement"]), reduce_op=cast(str, data.get("reduce_op", "sum")))

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (spec_from_dict, (self.to_dict(),))


def _check_reduce_dtype(reduce_op: str, dtype: torch.dtype) -> None:
    """Refuse reductions that have no meaning for ``dtype`` (before any data exists)."""
    if dtype == torch.bool and reduce_op in ("sum", "avg"):
        msg = (f"reduce_op={reduce_op!r} is not defined for dtype=torch.bool; use 'max' (logical or) or "
               f"'min' (logical and), or convert the values to an integer dtype.")
        raise ValueError(msg)
    if reduce_op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        msg = (f"reduce_op='avg' needs a floating-point dtype, got {dtype}; use 'sum' and divide yourself, "
               f"or convert the values to a floating-point dtype.")
        raise ValueError(msg)
    if reduce_op in ("max", "min") and dtype.is_complex:
        msg = f"reduce_op={reduce_op!r} is not defined for the complex dtype {dtype}; use 'sum' or 'avg'."
        raise ValueError(msg)


ShardingSpec = DevicePlacement | SingleSplitShardingSpec | MeshShardingSpec | EnumerableShardingSpec | PartialSpec
"""A spec that lays out one tensor."""

_TENSOR_SPECS = (DevicePlacement, SingleSplitShardingSpec, MeshShardingSpec, EnumerableShardingSpec)


@register_spec("composite")
@dataclass(frozen=True, slots=True, init=False)
class CompositeShardingSpec(PlacementSpec):
    """A spec per parameter or submodule name (dotted paths allowed).

    A spec given for a submodule applies to every parameter under it; nested composites
    compose paths; a device string means ``DevicePlacement`` of it.

    Args:
        param_placement: a mapping from parameter or submodule names (dotted, ``*`` matching
            one name component) to specs or device strings.

    Example:
        >>> spec = composite(net1=single_split(0, ["rank:0/cpu", "rank:1/cpu"]), net2="rank:0/cpu")
        >>> sorted(spec.resolve(["net1.weight", "net1.bias", "net2.weight"]))
        ['net1.bias', 'net1.weight', 'net2.weight']
    """

    param_placement: Mapping[str, PlacementSpec]

    def __init__(self, param_placement: Mapping[str, PlacementSpec | str | RemoteDevice]) -> None:
        if not isinstance(param_placement, Mapping):
            msg = f"param_placement must be a mapping of names to specs, got {param_placement!r}."
            raise TypeError(msg)
        normalized: dict[str, PlacementSpec] = {}
        for name, value in param_placement.items():
            if not isinstance(name, str) or not name or any(not p for p in name.split(".")):
                msg = f"param_placement key {name!r} is not a parameter or module name like 'net1.weight'."
                raise ValueError(msg)
            if any("*" in p and p != "*" for p in name.split(".")):
                msg = (f"param_placement key {name!r} has a '*' inside a name component; a '*' stands for one "
                       f"whole component, as in 'model.layers.*.mlp.down_proj'.")
                raise ValueError(msg)
            if isinstance(value, (str, RemoteDevice)):
                value = DevicePlacement(value)
            if isinstance(value, PartialSpec):
                msg = (f"param_placement[{name!r}] is a PartialSpec; partial values are the pending result of "
                       f"a computation, not a way to store a parameter. Give it a split, a mesh or a device.")
                raise TypeError(msg)
            if not isinstance(value, (*_TENSOR_SPECS, CompositeShardingSpec)):
                msg = (f"param_placement[{name!r}] is {type(value).__name__} {value!r}; expected a sharding "
                       f"spec or a device string.")
                raise TypeError(msg)
            normalized[name] = value
        object.__setattr__(self, "param_placement", _FrozenDict(normalized))

    def resolve(self, names: Iterable[str]) -> dict[str, ShardingSpec]:
        """Map each of ``names`` (parameter paths) covered by this spec to its tensor spec.

        A ``*`` component of a key matches any one name component
        (``model.layers.*.mlp.down_proj``). The most specific key wins: the deeper one, then,
        at equal depth, the one with fewer ``*``. Keys that match none of ``names`` raise
        ``ValueError``, with the closest real names.
        """
        names = list(names)
        result: dict[str, tuple[tuple[int, int], ShardingSpec, str]] = {}
        self._resolve(names, (), result)
        return {n: result[n][1] for n in names if n in result}

    def _resolve(self, names: list[str], prefix: tuple[str, ...],
                 result: dict[str, tuple[tuple[int, int], ShardingSpec, str]]) -> None:
        for key, spec in self.param_placement.items():
            pattern = prefix + tuple(key.split("."))
            path = ".".join(pattern)
            matched = [n for n in names if _matches(pattern, n)]
            if not matched:
                raise ValueError(_no_match_message(path, names))
            if isinstance(spec, CompositeShardingSpec):
                spec._resolve(matched, pattern, result)
                continue
            rank = (len(pattern), -pattern.count("*"))
            for n in matched:
                if n in result and result[n][0] == rank and result[n][1] != spec:
                    msg = (f"CompositeShardingSpec gives {n!r} two different specs through the same path "
                           f"({result[n][2]!r} and {path!r}: {result[n][1]!r} and {spec!r}); keep one of them.")
                    raise ValueError(msg)
                if n not in result or result[n][0] < rank:
                    result[n] = (rank, spec, path)  # type: ignore[assignment]

    def build_metadata(self, size: Sequence[int], dtype: torch.dtype | None = None,
                       names: Sequence[str | None] | None = None, *,
                       world_size: int | None = None) -> ShardedTensorMetadata:
        """Refused: a composite spec applies to modules, not to one tensor."""
        msg = ("a CompositeShardingSpec maps names to specs and applies to a module (shard_model); "
               "give a tensor a SingleSplitShardingSpec, MeshShardingSpec or DevicePlacement.")
        raise TypeError(msg)

    def to_dict(self) -> dict[str, object]:
        """JSON-safe form; ``spec_from_dict`` rebuilds an equal spec."""
        return {"type": self.spec_type,
                "param_placement": {k: v.to_dict() for k, v in self.param_placement.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> CompositeShardingSpec:
        """Inverse of ``to_dict``."""
        placement = cast("Mapping[str, Mapping[str, object]]", data["param_placement"])
        return cls({k: spec_from_dict(v) for k, v in placement.items()})

    def __reduce__(self) -> tuple[type[CompositeShardingSpec], tuple[object, ...]]:
        return (CompositeShardingSpec, (dict(self.param_placement),))


_SHOWN_NAMES = 40  # beyond this many (layer numbers folded), a no-match error shows close names only


def _matches(pattern: tuple[str, ...], name: str) -> bool:
    """``name`` is the path ``pattern`` names or lies under it (``*`` matches one component)."""
    parts = name.split(".")
    return len(parts) >= len(pattern) and all(p == "*" or p == q for p, q in zip(pattern, parts))


def _folded(names: Iterable[str]) -> list[str]:
    """``names`` with numeric components written ``*`` (one entry per repeated layer), first-seen order."""
    return list(dict.fromkeys(".".join("*" if p.isdigit() else p for p in n.split(".")) for n in names))


def _no_match_message(path: str, names: list[str]) -> str:
    """Say that ``path`` matches nothing, with the real names closest to it (readable for large models)."""
    params = _folded(names)
    modules = _folded(n.rsplit(".", 1)[0] for n in names if "." in n)
    folded_key = ".".join("*" if p.isdigit() else p for p in path.split("."))
    close = difflib.get_close_matches(folded_key, modules + params, n=5, cutoff=0.6)
    msg = f"CompositeShardingSpec key {path!r} matches no parameter or submodule"
    if close:
        msg += f"; closest names: {close!r}"
    if len(params) + len(modules) <= _SHOWN_NAMES:
        note = " (a '*' stands for every layer number)" if any("*" in n for n in params) else ""
        return msg + f"; parameters{note}: {sorted(params)!r}, submodules: {sorted(modules)!r}."
    # Many names: list only what lies under the longest part of the key that does match.
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        under = [n for n in names if _matches(tuple(parts[:cut]), n)]
        if under:
            children = _folded(".".join(n.split(".")[:cut + 1]) for n in under)
            shown = children[:_SHOWN_NAMES]
            more = f" and {len(children) - len(shown)} more" if len(children) > len(shown) else ""
            return msg + f"; under {'.'.join(parts[:cut])!r}: {shown!r}{more}."
    tops = list(dict.fromkeys(n.split(".")[0] for n in names))
    return msg + f"; the top-level names are {tops[:_SHOWN_NAMES]!r}."


class _FrozenDict(dict):  # type: ignore[type-arg]
    """A dict that refuses changes and hashes by content, so composite specs stay values."""

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("CompositeShardingSpec.param_placement is read-only; build a new spec instead.")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=lambda kv: kv[0])))

    def __reduce__(self) -> tuple[type[_FrozenDict], tuple[dict[str, PlacementSpec]]]:
        return (_FrozenDict, (dict(self),))


def single_split(split_dimension: int | str, shard_placement: Sequence[DeviceLike],
                 shard_sizes: Sequence[int] | None = None) -> SingleSplitShardingSpec:
    """Helper for ``SingleSplitShardingSpec``: ``single_split(0, ["rank:0/cpu", "rank:1/cpu"])``."""
    return SingleSplitShardingSpec(shard_placement, split_dimension, shard_sizes)


def mesh(shard_placement: Sequence[object]) -> MeshShardingSpec:
    """Helper for ``MeshShardingSpec``: ``mesh([["rank:0/cpu", "rank:1/cpu"]])``."""
    return MeshShardingSpec(shard_placement)


def composite(**kwargs: PlacementSpec | str) -> CompositeShardingSpec:
    """Helper for ``CompositeShardingSpec``: ``composite(net1="rank:0/cpu", net2=single_split(...))``.

    Dotted names cannot be keyword arguments; use ``composite(**{"net1.weight": spec})``.
    """
    return CompositeShardingSpec(kwargs)


def partial(shard_placement: Sequence[DeviceLike] | DeviceLike, *, reduce_op: str = "sum") -> PartialSpec:
    """Helper for ``PartialSpec``: ``partial(["rank:0/cpu", "rank:1/cpu"], reduce_op="max")``.

    ``partial("cpu")`` means every rank.
    """
    return PartialSpec(shard_placement, reduce_op=reduce_op)
