"""Where a tensor, or one shard of it, lives: ``RemoteDevice`` and ``DevicePlacement``."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import FrozenInstanceError, dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch

if TYPE_CHECKING:
    from ._metadata import ShardedTensorMetadata

__all__ = ["RemoteDevice", "PlacementSpec", "register_spec", "spec_from_dict"]

_RANK_FORM = re.compile(r"^rank:(?P<rank>-?\d+)/(?P<device>.+)$")
_EXPECTED = "expected 'rank:<r>/<device>' (e.g. 'rank:0/cuda:0', 'rank:1/cpu') or '<device>' (e.g. 'cuda:1')"


@dataclass(frozen=True, slots=True, init=False)
class RemoteDevice:
    """A device, optionally pinned to one rank: ``"rank:0/cuda:0"``, ``"rank:1/cpu"``, ``"cuda:1"``.

    Without a rank (``"cuda:1"``) the device is meant on every rank. A frozen value: equal
    strings give equal, equally hashed devices, and ``str()`` gives the string back.

    Args:
        remote_device: ``"rank:<r>/<device>"`` or ``"<device>"`` (e.g. ``"cpu"``, ``"cuda:1"``);
            a malformed string raises ``ValueError`` showing the expected form.

    Example:
        >>> d = RemoteDevice("rank:0/cuda:0")
        >>> d.rank, d.device, str(d)
        (0, device(type='cuda', index=0), 'rank:0/cuda:0')
    """

    rank: int | None
    """The rank holding the data, or ``None`` for every rank."""
    device: torch.device
    """The ``torch.device`` on that rank."""

    def __init__(self, remote_device: str | RemoteDevice) -> None:
        if isinstance(remote_device, RemoteDevice):
            rank, device = remote_device.rank, remote_device.device
        elif isinstance(remote_device, str):
            rank, device = _parse(remote_device)
        else:
            msg = (f"RemoteDevice expects a string, got {type(remote_device).__name__} "
                   f"{remote_device!r}; {_EXPECTED}.")
            raise TypeError(msg)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "device", device)

    @classmethod
    def of(cls, rank: int | None, device: torch.device | str) -> RemoteDevice:
        """Build from a rank (or ``None``) and a device, e.g. ``RemoteDevice.of(3, "cpu")``."""
        device = torch.device(device)
        return cls(f"rank:{rank}/{device}" if rank is not None else str(device))

    def __str__(self) -> str:
        return f"rank:{self.rank}/{self.device}" if self.rank is not None else str(self.device)

    def __repr__(self) -> str:
        return f"RemoteDevice({str(self)!r})"

    def __reduce__(self) -> tuple[type[RemoteDevice], tuple[str]]:
        # Rebuilt from its string, so a pickle (or torch's weights-only loader) needs nothing else.
        return (RemoteDevice, (str(self),))


def _refuse_change(self: RemoteDevice, name: str, value: object = None) -> None:
    raise FrozenInstanceError(f"RemoteDevice is immutable; cannot set {name!r}; build a new one instead.")


# dataclass forbids defining these in a frozen class body; replacing them afterwards keeps the
# frozen behaviour (FrozenInstanceError is an AttributeError) with a message that says why.
RemoteDevice.__setattr__ = _refuse_change  # type: ignore[method-assign,assignment]
RemoteDevice.__delattr__ = _refuse_change  # type: ignore[method-assign,assignment]


def _parse(text: str) -> tuple[int | None, torch.device]:
    match = _RANK_FORM.match(text.strip())
    rank: int | None = None
    device_text = text.strip()
    if match is not None:
        rank = int(match["rank"])
        device_text = match["device"]
        if rank < 0:
            msg = f"RemoteDevice {text!r} has a negative rank {rank}; ranks start at 0 ({_EXPECTED})."
            raise ValueError(msg)
    elif device_text.startswith("rank:") or "/" in device_text:
        msg = f"malformed RemoteDevice {text!r}: {_EXPECTED}."
        raise ValueError(msg)
    try:
        device = torch.device(device_text)
    except (RuntimeError, ValueError) as exc:
        msg = f"malformed RemoteDevice {text!r}: {device_text!r} is not a torch device; {_EXPECTED}."
        raise ValueError(msg) from exc
    return rank, device


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
