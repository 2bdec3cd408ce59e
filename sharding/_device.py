"""Where a tensor, or one shard of it, lives: ``RemoteDevice``."""

from __future__ import annotations

import re
from dataclasses import FrozenInstanceError, dataclass

import torch

__all__ = ["RemoteDevice"]

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
