"""Where a tensor, or one shard of it, lives: ``RemoteDevice`` and ``DevicePlacement``."""

from __future__ import annotations

import re

import torch

__all__ = ["RemoteDevice", "PlacementSpec"]

_RANK_FORM = re.compile(r"^rank:(?P<rank>-?\d+)/(?P<device>.+)$")
_EXPECTED = "expected 'rank:<r>/<device>' (e.g. 'rank:0/cuda:0', 'rank:1/cpu') or '<device>' (e.g. 'cuda:1')"


class RemoteDevice:
    """A device, optionally pinned to one rank: ``"rank:0/cuda:0"``, ``"rank:1/cpu"``, ``"cuda:1"``.

    Without a rank (``"cuda:1"``) the device is meant on every rank.

    Example:
        >>> d = RemoteDevice("rank:0/cuda:0")
        >>> d.rank, d.device, str(d)
        (0, device(type='cuda', index=0), 'rank:0/cuda:0')
    """

    __slots__ = ("_rank", "_device")
    _rank: int | None
    _device: torch.device

    def __init__(self, remote_device: str | RemoteDevice) -> None:
        if isinstance(remote_device, RemoteDevice):
            rank, device = remote_device.rank, remote_device.device
        elif isinstance(remote_device, str):
            rank, device = _parse(remote_device)
        else:
            msg = (f"RemoteDevice expects a string, got {type(remote_device).__name__} "
                   f"{remote_device!r}; {_EXPECTED}.")
            raise TypeError(msg)
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_device", device)

    @classmethod
    def of(cls, rank: int | None, device: torch.device | str) -> RemoteDevice:
        """Build from a rank (or ``None``) and a device, e.g. ``RemoteDevice.of(3, "cpu")``."""
        device = torch.device(device)
        return cls(f"rank:{rank}/{device}" if rank is not None else str(device))

    @property
    def rank(self) -> int | None:
        """The rank holding the data, or ``None`` for every rank."""
        return self._rank

    @property
    def device(self) -> torch.device:
        """The ``torch.device`` on that rank."""
        return self._device

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"RemoteDevice is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RemoteDevice):
            return NotImplemented
        return self._rank == other._rank and self._device == other._device

    def __hash__(self) -> int:
        return hash((self._rank, str(self._device)))

    def __str__(self) -> str:
        return f"rank:{self._rank}/{self._device}" if self._rank is not None else str(self._device)

    def __repr__(self) -> str:
        return f"RemoteDevice({str(self)!r})"

    def __reduce__(self) -> tuple[type[RemoteDevice], tuple[str]]:
        return (RemoteDevice, (str(self),))


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


class PlacementSpec:
    """Base of every placement and sharding spec: something that says where data lives."""

    __slots__ = ()
