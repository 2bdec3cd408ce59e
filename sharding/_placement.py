"""The base of every sharding spec (``PlacementSpec``) and the registry that rebuilds specs from JSON."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, TypeVar

import torch

from ._metadata import ShardedTensorMetadata

__all__ = ["PlacementSpec", "register_spec", "spec_from_dict"]


class PlacementSpec(ABC):
    """Base of every placement and sharding spec: something that says where data lives.

    A spec is a frozen value with two duties, both pure (same answer on every rank, no
    communication): lay out a tensor (``build_metadata``) and describe itself as JSON-safe
    data (``to_dict``), which ``spec_from_dict`` turns back into an equal spec through the
    ``type`` tag each concrete class registers with ``register_spec``.
    """

    __slots__ = ()

    spec_type: ClassVar[str]
    """The ``"type"`` tag of ``to_dict()``; set by ``register_spec``."""

    @abstractmethod
    def build_metadata(self, size: Sequence[int], dtype: torch.dtype | None = None,
                       names: Sequence[str | None] | None = None, *,
                       world_size: int | None = None) -> ShardedTensorMetadata:
        """The layout of a tensor of ``size``: every shard, its region and its holder.

        Args:
            size: the global shape.
            dtype: the tensor's dtype (default: ``torch.get_default_dtype()``).
            names: one name (or ``None``) per dimension, for specs that name a dimension.
            world_size: the number of ranks, when known; needed to expand a rankless
                placement (a replica on every rank) and to refuse ranks beyond the world.

        Returns:
            The ``ShardedTensorMetadata``, identical on every rank.

        Raises:
            ValueError: the spec does not fit ``size`` (the message names the value and the fix).
            TypeError: the spec does not lay out single tensors (a ``CompositeShardingSpec``).
        """

    @abstractmethod
    def to_dict(self) -> dict[str, object]:
        """JSON-safe form with a ``"type"`` key; ``spec_from_dict`` rebuilds an equal spec."""

    @classmethod
    @abstractmethod
    def from_dict(cls, data: Mapping[str, object]) -> PlacementSpec:
        """Inverse of ``to_dict`` for this class (``data["type"]`` already matched)."""


_SpecClass = TypeVar("_SpecClass", bound=type[PlacementSpec])
_SPEC_TYPES: dict[str, type[PlacementSpec]] = {}


def register_spec(spec_type: str) -> Callable[[_SpecClass], _SpecClass]:
    """Class decorator: make ``spec_from_dict`` rebuild ``{"type": spec_type, ...}`` with this class.

    Apply it outside ``@dataclass`` so the registered class is the final one.
    """
    def register(cls: _SpecClass) -> _SpecClass:
        known = _SPEC_TYPES.get(spec_type)
        if known is not None and known.__qualname__ != cls.__qualname__:
            msg = f"spec type {spec_type!r} is already registered by {known.__qualname__}; pick another tag."
            raise ValueError(msg)
        cls.spec_type = spec_type
        _SPEC_TYPES[spec_type] = cls
        return cls
    return register


def spec_from_dict(data: Mapping[str, object]) -> PlacementSpec:
    """Rebuild a spec from ``spec.to_dict()``."""
    if not isinstance(data, Mapping) or "type" not in data:
        msg = f"spec_from_dict expects a mapping with a 'type' key (from spec.to_dict()), got {data!r}."
        raise ValueError(msg)
    kind = data["type"]
    cls = _SPEC_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        msg = f"unknown spec type {kind!r}; expected one of {', '.join(repr(t) for t in _SPEC_TYPES)}."
        raise ValueError(msg)
    return cls.from_dict(data)
