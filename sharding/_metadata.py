"""Shard metadata: frozen values describing where every block of a global tensor lives."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ._device import RemoteDevice
from .layout import Packed, Partial, Placement, Replicated, Split, Strided, placement_of

__all__ = ["ShardMetadata", "ShardedTensorMetadata"]

_UNKNOWN = object()  # a metadata's placement not given: read off its shards when first asked for


@dataclass(frozen=True, slots=True)
class ShardMetadata:
    """One shard of a global tensor: where it starts, its size, and who holds it.

    ``offsets[d]`` is the first index of the shard along dimension ``d`` and ``dims[d]``
    its length there (the RFC's names). ``device`` is a ``RemoteDevice``.

    Args:
        offsets: the shard's first index along each dimension.
        dims: the shard's size along each dimension.
        device: the ``RemoteDevice`` (or its string) that holds it.
    """

    offsets: tuple[int, ...]
    dims: tuple[int, ...]
    device: RemoteDevice

    def __init__(self, offsets: Sequence[int], dims: Sequence[int], device: str | RemoteDevice) -> None:
        offsets, dims = tuple(int(o) for o in offsets), tuple(int(s) for s in dims)
        if len(offsets) != len(dims):
            msg = (f"ShardMetadata offsets={offsets!r} and dims={dims!r} have different lengths; "
                   f"give one offset and one size per tensor dimension.")
            raise ValueError(msg)
        if any(o < 0 for o in offsets) or any(s < 0 for s in dims):
            msg = f"ShardMetadata offsets={offsets!r} and dims={dims!r} must not be negative."
            raise ValueError(msg)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "device", RemoteDevice(device))

    @property
    def rank(self) -> int | None:
        """The rank that holds this shard (``device.rank``)."""
        return self.device.rank

    @property
    def numel(self) -> int:
        """Number of elements in the shard."""
        return math.prod(self.dims)

    @property
    def region(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, dims)``: the block of the global tensor, without the device."""
        return (self.offsets, self.dims)

    def to_dict(self) -> dict[str, object]:
        """JSON-safe form."""
        return {"offsets": list(self.offsets), "dims": list(self.dims), "device": str(self.device)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ShardMetadata:
        """Inverse of ``to_dict``."""
        return cls(data["offsets"], data["dims"], data["device"])  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[type[ShardMetadata], tuple[object, ...]]:
        return (ShardMetadata, (self.offsets, self.dims, str(self.device)))


@dataclass(frozen=True, slots=True, eq=False)
class ShardedTensorMetadata:
    """The full layout of a sharded tensor: every shard (placement order), size and dtype.

    ``placement`` says how the ranks hold it, in the words of ``sharding.layout``: a ``Split``,
    ``Packed``, ``Replicated`` or ``Partial``, or ``None`` when none of them fits. Specs give
    it; otherwise it is read off the shards once, when first asked for. The one thing shards
    cannot say is a pending reduction: a partial tensor (every shard full-size, one per
    holding rank, its value that reduction of the holders' local values; see ``PartialSpec``)
    is one whose metadata was given ``placement=Partial(reduce_op)``. Equality compares
    shards, size, dtype and that reduction: two metadata with the same shards are the same
    layout, unless one of them is partial.

    Args:
        shards: every ``ShardMetadata``, in placement order.
        size: the global size (stored as ``torch.Size``).
        dtype: the element type.
        placement: the layout's placement when the caller knows it (a spec), and always for
            partial values (``Partial(reduce_op)``); by default it is derived from ``shards``
            (``sharding.layout.placement_of``).

    Raises:
        TypeError: ``placement`` is not a ``sharding.layout`` placement, or a shard is not a
            ``ShardMetadata``.
        ValueError: a shard's number of dimensions differs from the tensor's.
    """

    shards: tuple[ShardMetadata, ...]
    size: torch.Size
    dtype: torch.dtype
    _placement: object = field(repr=False)

    def __init__(self, shards: Iterable[ShardMetadata], size: Sequence[int],
                 dtype: torch.dtype | None = None, *, placement: Placement | None | object = _UNKNOWN) -> None:
        object.__setattr__(self, "shards", tuple(shards))
        object.__setattr__(self, "size", torch.Size(size))
        object.__setattr__(self, "dtype", dtype if dtype is not None else torch.get_default_dtype())
        if placement is not _UNKNOWN and placement is not None and not isinstance(placement, _PLACEMENTS):
            hint = " (metadata states a Strided layout as its Packed: placement.packed())" \
                if isinstance(placement, Strided) else ""
            msg = (f"placement={placement!r} is not a metadata placement{hint}; give a sharding.layout Split, "
                   f"Packed, Replicated or Partial (or None, or leave it out to read it off the shards).")
            raise TypeError(msg)
        object.__setattr__(self, "_placement", placement)
        for i, shard in enumerate(self.shards):
            if not isinstance(shard, ShardMetadata):
                msg = f"shards[{i}] is {type(shard).__name__} {shard!r}; expected a ShardMetadata."
                raise TypeError(msg)
            if len(shard.dims) != len(self.size):
                msg = (f"shards[{i}] has {len(shard.dims)} dimensions (dims={shard.dims!r}) but the "
                       f"tensor has {len(self.size)} (size={tuple(self.size)!r}).")
                raise ValueError(msg)

    @property
    def placement(self) -> Placement | None:
        """How the ranks hold this tensor (``sharding.layout``): ``Split``, ``Packed``, ``Replicated``,
        ``Partial``, or ``None`` (blocks along several dimensions, copies on some ranks only, or the
        whole tensor on one rank)."""
        if self._placement is _UNKNOWN:
            object.__setattr__(self, "_placement", placement_of(self.shards, self.size))
        return self._placement  # type: ignore[return-value]

    @property
    def pending(self) -> Partial | None:
        """The ``Partial`` placement of partial values, else ``None`` (never derives the placement)."""
        found = self._placement
        return found if isinstance(found, Partial) else None

    def with_dtype(self, dtype: torch.dtype) -> ShardedTensorMetadata:
        """The same layout, placement included, of a tensor of another dtype."""
        if dtype == self.dtype:
            return self
        return ShardedTensorMetadata(self.shards, self.size, dtype, placement=self._placement)

    def _key(self) -> tuple[object, ...]:
        return (self.shards, self.size, self.dtype, self.pending)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardedTensorMetadata):
            return NotImplemented
        return self is other or self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        pending = "" if self.pending is None else f", placement={self.pending!r}"
        return f"ShardedTensorMetadata(shards={self.shards!r}, size={self.size!r}, dtype={self.dtype!r}{pending})"

    def shards_on(self, rank: int) -> list[tuple[int, ShardMetadata]]:
        """``(index, shard)`` for every shard held by ``rank``, in placement order."""
        return [(i, s) for i, s in enumerate(self.shards) if s.rank == rank]

    @property
    def ranks(self) -> tuple[int, ...]:
        """Sorted distinct ranks holding at least one shard."""
        return tuple(sorted({s.rank for s in self.shards if s.rank is not None}))

    def to_dict(self) -> dict[str, object]:
        """JSON-safe form (dtype as its short name, e.g. ``"float32"``; a pending reduction as ``"partial"``)."""
        data: dict[str, object] = {"size": list(self.size), "dtype": str(self.dtype).removeprefix("torch."),
                                   "shards": [s.to_dict() for s in self.shards]}
        if self.pending is not None:  # absent otherwise, so non-partial metadata reads as before
            data["partial"] = self.pending.reduce_op
        return data

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ShardedTensorMetadata:
        """Inverse of ``to_dict``."""
        dtype = getattr(torch, str(data["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            msg = f"unknown dtype {data['dtype']!r} in sharded tensor metadata."
            raise ValueError(msg)
        shards = [ShardMetadata.from_dict(s) for s in data["shards"]]  # type: ignore[attr-defined]
        reduce_op = data.get("partial")
        if reduce_op is None:
            return cls(shards, data["size"], dtype)  # type: ignore[arg-type]
        return cls(shards, data["size"], dtype, placement=Partial(reduce_op))  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        reduce_op = None if self.pending is None else self.pending.reduce_op
        return (_restore, (self.shards, tuple(self.size), self.dtype, reduce_op))


_PLACEMENTS = (Split, Packed, Replicated, Partial)


def _restore(shards: tuple[ShardMetadata, ...], size: tuple[int, ...], dtype: torch.dtype,
             reduce_op: str | None) -> ShardedTensorMetadata:
    """Inverse of ``ShardedTensorMetadata.__reduce__``."""
    if reduce_op is None:
        return ShardedTensorMetadata(shards, size, dtype)
    return ShardedTensorMetadata(shards, size, dtype, placement=Partial(reduce_op))
