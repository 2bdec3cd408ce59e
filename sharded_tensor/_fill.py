"""Fast fills from the counter-based generator: any block of a tensor, as a slice of the global one.

``fill_uniform_``, ``fill_normal_`` and ``fill_trunc_normal_`` give each element of a block the
value the *global* tensor holds at that element's global index: the generator of ``_random``
(SplitMix64 of ``index * golden + seed``) evaluated in fixed-size, vector-aligned chunks with
numpy's uint64 arithmetic, much faster than ``_random``'s int64 torch ops (which have no
vector multiply on CPU) and as fast as ``torch.Tensor.uniform_`` (docs/benchmarks-history.md,
"Figures behind implementation choices"). Without numpy they fall back to ``_random``
itself. The chunks are always processed at full width, so no element ever takes a scalar
code path that another layout would take vectorized. ``draw_uniform_`` is the faster,
layout-dependent fill (numpy's PCG64 per block). ``st.randn``/``st.rand`` and the
layout-invariant init of ``shard_model`` (``_model.init``) use them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from . import _random

try:  # numpy is optional: it only makes the generator faster, never changes its values.
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only without numpy
    _np = None  # type: ignore[assignment]

__all__ = ["fill_uniform_", "fill_normal_", "fill_trunc_normal_", "draw_uniform_"]

# Elements per step. Transforms that call torch's transcendental kernels (normal, trunc_normal)
# use _CHUNK: a multiple of every SIMD width and below torch's parallel grain size, so every
# element takes the same vectorized code path whatever the layout. The uniform transform is
# exact integer and IEEE arithmetic, identical on any code path, so it takes longer steps.
_CHUNK = 1 << 14
_EXACT_CHUNK = 1 << 15
# Elements per step of draw_uniform_ (256 KiB of float32: stays in cache between draw and scale).
_DRAW_CHUNK = 1 << 16
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

Transform = Callable[["_np.ndarray", "_np.ndarray", torch.Tensor, torch.Tensor], torch.Tensor]


# -- the generator ------------------------------------------------------------------------------

def _runs(offsets: Sequence[int], dims: Sequence[int], global_shape: Sequence[int]) -> tuple[list[int], int]:
    """Global start index of each contiguous run of the block, and the run length.

    The block's row-major order is also global order within a run, so run ``r`` fills local
    elements ``[r * length, (r + 1) * length)``.
    """
    ndim = len(global_shape)
    if ndim == 0:
        return [0], 1
    strides = [math.prod(global_shape[d + 1:]) for d in range(ndim)]
    split = [d for d in range(ndim) if dims[d] != global_shape[d]]
    k = split[-1] if split else 0
    length = dims[k] * strides[k]
    starts = [offsets[k] * strides[k]]
    for d in reversed(range(k)):
        starts = [(offsets[d] + i) * strides[d] + s for i in range(dims[d]) for s in starts]
    return starts, length


def _fill_fast(tensor: torch.Tensor, seed: int, offsets: Sequence[int], global_shape: Sequence[int],
               transform: Transform, chunk: int = _CHUNK) -> None:
    assert _np is not None
    u64 = _np.uint64
    starts, length = _runs(offsets, tuple(tensor.shape), global_shape)
    out = tensor.view(-1)
    # Small tensors use a narrower chunk, still a multiple of 64 so no element takes a
    # scalar tail path. Garbage past the end of a chunk is harmless but must be a number.
    width = min(chunk, -(-out.numel() // 64) * 64)
    x = _np.zeros(width, dtype=u64)
    t = _np.zeros(width, dtype=u64)
    f1 = torch.zeros(width, dtype=torch.float64)
    f2 = torch.zeros(width, dtype=torch.float64)
    steps = _np.arange(width, dtype=u64) * u64(_GOLDEN)
    shifts = {k: u64(k) for k in (27, 30, 31)}
    mix1, mix2 = u64(_MIX1), u64(_MIX2)

    def produce(n: int) -> None:
        # SplitMix64's finalizer, in place on the whole chunk (for vector alignment).
        for shift, mult in ((30, mix1), (27, mix2), (31, None)):
            _np.right_shift(x, shifts[shift], out=t)
            _np.bitwise_xor(x, t, out=x)
            if mult is not None:
                _np.multiply(x, mult, out=x)
        values = transform(x, t, f1, f2)
        out[position:position + n].copy_(values[:n])

    position = 0
    if length >= width:
        for start in starts:
            for piece in range(0, length, width):
                n = min(width, length - piece)
                _np.add(steps, u64(((start + piece) * _GOLDEN + seed) & _MASK64), out=x)
                produce(n)
                position += n
        return
    per_chunk = width // length
    for first in range(0, len(starts), per_chunk):
        group = starts[first:first + per_chunk]
        bases = _np.array([(s * _GOLDEN + seed) & _MASK64 for s in group], dtype=u64)
        n = len(group) * length
        _np.add(bases[:, None], steps[None, :length], out=x[:n].reshape(len(group), length))
        produce(n)
        position += n


def _precision(dtype: torch.dtype) -> int:
    """Random bits kept for a uniform draw in ``dtype``: its significand, as ``_random`` does."""
    return 1 - round(math.log2(torch.finfo(dtype).eps)) if dtype.is_floating_point else 53


def _uniform_transform(low: float, high: float, precision: int = 53) -> Transform:
    scale = 2.0 ** -precision * (high - low)  # a power-of-two rescale: rounds exactly as u * (high - low)
    if _np is None:  # pragma: no cover
        return None
    shift = _np.uint64(64 - precision)
    # An integer m < 2**52 becomes a double exactly as (2**52 + m) - 2**52, where 2**52 + m is
    # m's bits under the exponent of 2**52: two cheap vector ops instead of a slow conversion.
    exponent = _np.uint64(0x4330000000000000)
    two52 = float(2 ** 52)

    def transform(x, t, f1, f2):  # type: ignore[no-untyped-def]
        _np.right_shift(x, shift, out=t)
        f = f1.numpy()
        if precision <= 52:
            _np.bitwise_or(t, exponent, out=t)
            _np.subtract(t.view(_np.float64), two52, out=f)
            _np.multiply(f, scale, out=f)
        else:
            _np.multiply(t.view(_np.int64), scale, out=f, casting="unsafe")
        _np.add(f, low, out=f)
        return f1
    return transform


def _normal_transform(mean: float, std: float) -> Transform:
    def transform(x, t, f1, f2):  # type: ignore[no-untyped-def]
        # Box-Muller on the two 32-bit halves of each element's 64 bits, exactly as _random does.
        _np.right_shift(x, _np.uint64(32), out=t)
        _np.add(t.view(_np.int64), 1.0, out=f1.numpy(), casting="unsafe")
        f1.mul_(2.0 ** -32)
        _np.bitwise_and(x, _np.uint64(0xFFFFFFFF), out=t)
        _np.multiply(t.view(_np.int64), 2.0 ** -32, out=f2.numpy(), casting="unsafe")
        torch.log(f1, out=f1)
        f1.mul_(-2.0).sqrt_()
        f2.mul_(2.0 * math.pi).cos_()
        return f1.mul_(f2).mul_(std).add_(mean)
    return transform


def trunc_bounds(mean: float, std: float, a: float, b: float) -> tuple[float, float]:
    def cdf(v: float) -> float:
        return (1.0 + math.erf(v / math.sqrt(2.0))) / 2.0
    return 2.0 * cdf((a - mean) / std) - 1.0, 2.0 * cdf((b - mean) / std) - 1.0


def _trunc_transform(mean: float, std: float, a: float, b: float) -> Transform:
    low, high = trunc_bounds(mean, std, a, b)
    uniform = _uniform_transform(low, high)

    def transform(x, t, f1, f2):  # type: ignore[no-untyped-def]
        return uniform(x, t, f1, f2).erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(a, b)
    return transform


def _fill(tensor: torch.Tensor, seed: int, offsets: Sequence[int], global_shape: Sequence[int],
          transform: Transform, fallback: Callable[[torch.Tensor], object], chunk: int = _CHUNK) -> torch.Tensor:
    if tensor.numel() == 0:
        return tensor
    with torch.no_grad():
        target = tensor if tensor.is_contiguous() and tensor.device.type == "cpu" else None
        work = target if target is not None else torch.empty(tensor.shape, dtype=tensor.dtype)
        if _np is not None:
            _fill_fast(work, seed & _MASK64, offsets, global_shape, transform, chunk)
        else:  # pragma: no cover
            fallback(work)
        if target is None:
            tensor.copy_(work)
    return tensor


def fill_uniform_(tensor: torch.Tensor, seed: int, offsets: Sequence[int], global_shape: Sequence[int],
                  low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    """Fill the block at ``offsets`` of a ``global_shape`` tensor with U[low, high).

    Bit-identical to ``_random.uniform_``: each element depends only on ``seed``, its global
    index and the dtype (which sets how many random bits a draw keeps).
    """
    return _fill(tensor, seed, offsets, global_shape, _uniform_transform(low, high, _precision(tensor.dtype)),
                 lambda t: _random.uniform_(t, seed, offsets, global_shape, low, high), _EXACT_CHUNK)


def fill_normal_(tensor: torch.Tensor, seed: int, offsets: Sequence[int], global_shape: Sequence[int],
                 mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Fill the block with N(mean, std^2), the same values as ``_random.normal_``."""
    return _fill(tensor, seed, offsets, global_shape, _normal_transform(mean, std),
                 lambda t: _random.normal_(t, seed, offsets, global_shape, mean, std))


def fill_trunc_normal_(tensor: torch.Tensor, seed: int, offsets: Sequence[int], global_shape: Sequence[int],
                       mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> torch.Tensor:
    """Fill the block with N(mean, std^2) truncated to [a, b] (inverse-CDF of a uniform draw)."""
    low, high = trunc_bounds(mean, std, a, b)

    def fallback(t: torch.Tensor) -> None:  # pragma: no cover
        u = _random.uniform_(torch.empty(t.shape, dtype=torch.float64), seed, offsets, global_shape, low, high)
        t.copy_(u.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(a, b))
    return _fill(tensor, seed, offsets, global_shape, _trunc_transform(mean, std, a, b), fallback)


def draw_uniform_(tensor: torch.Tensor, seed: int, low: float, high: float) -> torch.Tensor:
    """Fill ``tensor`` with U[low, high) from one generator seeded with ``seed`` (not layout-invariant).

    A contiguous float32/float64 CPU tensor is filled by numpy's PCG64 straight into its
    memory, in cache-sized steps that are scaled while still in cache, faster than
    ``Tensor.uniform_`` (docs/benchmarks-history.md, "Figures behind implementation choices"). Other
    tensors use ``Tensor.uniform_`` with a torch generator seeded with ``seed``. Either way
    the values depend only on ``seed``, so replicas of a block agree.
    """
    if (_np is None or tensor.device.type != "cpu" or not tensor.is_contiguous()
            or tensor.dtype not in (torch.float32, torch.float64)):
        generator = torch.Generator(device=tensor.device).manual_seed(seed & _MASK64)
        return tensor.uniform_(low, high, generator=generator)
    rng = _np.random.Generator(_np.random.PCG64(seed & _MASK64))
    flat = tensor.detach().view(-1).numpy()
    width = high - low
    for start in range(0, flat.size, _DRAW_CHUNK):
        part = flat[start:start + _DRAW_CHUNK]
        rng.random(dtype=flat.dtype, out=part)
        _np.multiply(part, width, out=part)
        _np.add(part, low, out=part)
    return tensor
