"""Recognizing PyTorch's ``DTensor`` without importing it where nothing could be one."""

from __future__ import annotations

import torch

__all__ = ["is_dtensor"]


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``DTensor`` (without importing DTensor when nothing could be one)."""
    if not isinstance(value, torch.Tensor) or type(value) is torch.Tensor:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without distributed support
        return False
    return isinstance(value, DTensor)
