"""Shard metadata: frozen values describing where every block of a global tensor lives."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ._device import RemoteDevice
from .layout import Partial, Placement, check_reduce_op, placement_of

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


@dataclass(frozen=True, slots=True)
class ShardedTensorMetadata:
    """The full layout of a sharded tensor: every shard (placement order), size and dtype.

    ``partial`` is ``None`` for a tensor whose shards hold its values. For a partial tensor it
    names the pending reduction (``"sum"``, ``"avg"``, ``"max"`` or ``"min"``): every shard is
    then full-size, one per holding rank, and the tensor's value is that reduction of the
    holders' local values (see ``PartialSpec``).

    ``placement`` says the same layout in the words of ``sharding.layout`` (a ``Split``,
    ``Packed``, ``Replicated`` or ``Partial``, or ``None`` when none of them fits). Specs give it;
    otherwise it is read off the shards once, when first asked for. It takes no part in
    equality: two metadata with the same shards are the same layout.

    Args:
        shards: every ``ShardMetadata``, in placement order.
        size: the global size (stored as ``torch.Size``).
        dtype: the element type.
        partial: ``None``, or the pending reduction of a partial tensor.
        placement: the layout's placement when the caller knows it (a spec); by default it is
            derived from ``shards`` (``sharding.layout.placement_of``).
    """

    shards: tuple[ShardMetadata, ...]
    size: torch.Size
    dtype: torch.dtype
    partial: str | None
    _placement: object = field(compare=False, repr=False)

    def __init__(self, shards: Iterable[ShardMetadata], size: Sequence[int],
                 dtype: torch.dtype | None = None, partial: str | None = None,
                 placement: Placement | None | object = _UNKNOWN) -> None:
        object.__setattr__(self, "shards", tuple(shards))
        object.__setattr__(self, "size", torch.Size(size))
        object.__setattr__(self, "dtype", dtype if dtype is not None else torch.get_default_dtype())
        object.__setattr__(self, "partial", None if partial is None else check_reduce_op(partial, where="partial"))
        if placement is not _UNKNOWN and isinstance(placement, Partial) != (self.partial is not None) or (
                isinstance(placement, Partial) and placement.reduce_op != self.partial):
            msg = (f"placement={placement!r} does not match partial={self.partial!r}; a partial tensor's placement "
                   f"is Partial(reduce_op) with the same reduction, and only a partial tensor's.")
            raise ValueError(msg)
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
            object.__setattr__(self, "_placement", placement_of(self.shards, self.size, self.partial))
        return self._placement  # type: ignore[return-value]

    def shards_on(self, rank: int) -> list[tuple[int, ShardMetadata]]:
        """``(index, shard)`` for every shard held by ``rank``, in placement order."""
        return [(i, s) for i, s in enumerate(self.shards) if s.rank == rank]

    @property
    def ranks(self) -> tuple[int, ...]:
        """Sorted distinct ranks holding at least one shard."""
        return tuple(sorted({s.rank for s in self.shards if s.rank is not None}))

    def to_dict(self) -> dict[str, object]:
        """JSON-safe form (dtype as its short name, e.g. ``"float32"``)."""
        data: dict[str, object] = {"size": list(self.size), "dtype": str(self.dtype).removeprefix("torch."),
                                   "shards": [s.to_dict() for s in self.shards]}
        if self.partial is not None:  # absent otherwise, so non-partial metadata reads as before
            data["partial"] = self.partial
        return data

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ShardedTensorMetadata:
        """Inverse of ``to_dict``."""
        dtype = getattr(torch, str(data["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            msg = f"unknown dtype {data['dtype']!r} in sharded tensor metadata."
            raise ValueError(msg)
        shards = [ShardMetadata.from_dict(s) for s in data["shards"]]  # type: ignore[attr-defined]
        return cls(shards, data["size"], dtype, data.get("partial"))  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[type[ShardedTensorMetadata], tuple[object, ...]]:
        return (ShardedTensorMetadata, (self.shards, tuple(self.size), self.dtype, self.partial))
