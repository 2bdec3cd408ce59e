"""A counter-based random generator: each element's value depends only on (seed, global index).

Any rank can fill any block of a tensor without generating the rest, and the values do not
depend on how the tensor is split or how many ranks there are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["uniform_", "normal_", "derive_seed"]

_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 20  # elements per step: bounds the int64 temporaries


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    # Logical shift right on int64 (torch's >> is arithmetic).
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer: a bijective 64-bit hash (int64 arithmetic wraps)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def derive_seed(seed: int, *parts: str | int) -> int:
    """A 63-bit seed from ``seed`` and names (e.g. a parameter's name), stable across runs."""
    x = torch.tensor([_signed(seed)], dtype=torch.int64)
    for part in parts:
        data = str(part).encode()
        for i in range(0, len(data), 7):
            x = _mix(x ^ _signed(int.from_bytes(data[i:i + 7], "little") + (len(data) << 56)))
    return int(x.item()) & ((1 << 63) - 1)


def _bits(seed: int, index: torch.Tensor) -> torch.Tensor:
    return _mix(index * _GOLDEN + _signed(seed))


def _global_index(offsets: Sequence[int], dims: Sequence[int], global_shape: Sequence[int],
                  first_row: int, rows: int) -> torch.Tensor:
    """Row-major global linear index of every element of rows [first_row, first_row+rows)."""
    strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    index = torch.zeros((), dtype=torch.int64)
    local_dims = (rows, *dims[1:])
    start = (offsets[0] + first_row, *offsets[1:])
    for d, (o, n, s) in enumerate(zip(start, local_dims, strides)):
        shape = [1] * len(local_dims)
        shape[d] = n
        index = index + (torch.arange(o, o + n, dtype=torch.int64) * s).view(shape)
    return index.expand(local_dims)


def _fill(tensor: torch.Tensor, seed: int, offsets: Sequence[int], global_shape: Sequence[int],
          transform: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if tensor.dim() == 0:
        tensor.copy_(transform(_bits(seed, torch.zeros((), dtype=torch.int64))))
        return tensor
    if tensor.numel() == 0:
        return tensor
    dims = tuple(tensor.shape)
    row = max(1, math.prod(dims[1:]))
    step = max(1, _CHUNK // row)
    with torch.no_grad():
        for first in range(0, dims[0], step):
            rows = min(step, dims[0] - first)
            bits = _bits(seed, _global_index(offsets, dims, global_shape, first, rows))
            tensor[first:first + rows].copy_(transform(bits))
    return tensor


def uniform_(tensor: torch.Tensor, seed: int, offsets: Sequence[int], global_shape: Sequence[int],
             low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    """Fill ``tensor``, the block at ``offsets`` of a ``global_shape`` tensor, with U[low, high)."""
    # Keep only as many random bits as the dtype's significand holds, so that u stays below 1
    # after rounding to that dtype (as torch.rand promises [0, 1)).
    precision = 1 - round(math.log2(torch.finfo(tensor.dtype).eps)) if tensor.dtype.is_floating_point else 53

    def transform(bits: torch.Tensor) -> torch.Tensor:
        u = _shr(bits, 64 - precision).to(torch.float64) * 2.0 ** -precision
        return u * (high - low) + low
    return _fill(tensor, seed, offsets, global_shape, transform)


def normal_(tensor: torch.Tensor, seed: int, offsets: Sequence[int], global_shape: Sequence[int],
            mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Fill ``tensor``, the block at ``offsets`` of a ``global_shape`` tensor, with N(mean, std²)."""
    def transform(bits: torch.Tensor) -> torch.Tensor:
        # Box-Muller on the two 32-bit halves of each element's 64 random bits.
        u1 = (_shr(bits, 32).to(torch.float64) + 1.0) * 2.0 ** -32
        u2 = (bits & 0xFFFFFFFF).to(torch.float64) * 2.0 ** -32
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        return z * std + mean
    return _fill(tensor, seed, offsets, global_shape, transform)
