"""Rules for a depthwise convolution over split channels, and for padding split activations.

Linear-attention and state-space layers (Qwen3-Next's gated delta net, Mamba) mix each
channel along the sequence with its own short filter: ``F.conv1d(x, weight, groups=channels)``
with ``x`` of shape ``[batch, channels, length]`` and ``weight`` of ``[channels, 1, kernel]``.
Channels never meet, so a rank holding some channels (split, or packed: the gated delta net's
queries, keys and values, each split on its heads) convolves them with their own filters:

* ``conv1d`` of split or packed channels, depthwise (``groups`` the number of channels, read
  whole or off the local tensor's shape), with a whole weight (and bias): the weight is cut to
  this rank's channels, in the input's order (its gradient gathered back whole in backward), and
  the output holds the input's channels;
* ``pad`` of a split or packed activation along other dimensions than the split one (the
  convolution's causal padding, the chunked delta rule's padding of the sequence): slice by slice
  (in a mode other than ``constant``, only where every rank holds part of the split dimension).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .placements import Packed, Split, SplitSize, placement_of, scatter
from .rules import Call, Decision, Fallback, declare, leaves_of

__all__ = ["cut_packed"]


def _placed_of(x: Any) -> Split | Packed:
    found = placement_of(x)
    if (type(found) is not Split and type(found) is not Packed) or not isinstance(x, Tensor):
        raise Fallback
    return found


def _tiling(packed: Packed) -> list[tuple[int, tuple[tuple[int, int], ...]]] | None:
    """Per slice index ``j``: where the ``j``-th slices of every rank start together, and each rank's slice from
    there; ``None`` unless every rank holds as many slices and the ``j``-th ones tile one range."""
    counts = {len(slices) for slices in packed.pieces}
    if len(counts) != 1:
        return None
    found = []
    for j in range(counts.pop()):
        live = sorted(slices[j] for slices in packed.pieces if slices[j][1])
        if not live:
            found.append((0, tuple((0, 0) for _ in packed.pieces)))
            continue
        low = live[0][0]
        if any(a + n != b for (a, n), (b, _) in zip(live, live[1:])):
            return None
        found.append((low, tuple((s - low, n) if n else (0, 0) for s, n in (sl[j] for sl in packed.pieces))))
    return found


def cut_packed(t: Tensor, *, dim: int, packed: Packed) -> Tensor:
    """This rank's slices of a whole ``t`` along ``dim``, side by side as ``packed`` holds them; the gradient of
    each slice is gathered back whole (one all-gather per slice index, in backward)."""
    tiling = _tiling(packed)
    assert tiling is not None  # checked when the rule decided
    parts = []
    for low, intervals in tiling:
        size = max(s + n for s, n in intervals)
        parts.append(scatter(t.narrow(dim, low, size), dim, intervals, packed.group))
    return torch.cat(parts, dim)


def _cut(t: Tensor, *, dim: int, placement: Split | Packed) -> Tensor:
    if type(placement) is Packed:
        return cut_packed(t, dim=dim, packed=placement)
    return placement.cut(t, dim)  # type: ignore[union-attr]


def _depthwise(*args: Any, at: tuple[int, int, int | None], stride: Any, padding: Any, dilation: Any,
               **kwargs: Any) -> Tensor:
    """The convolution of this rank's channels with their filters (the weight and bias already cut to them)."""
    leaves = leaves_of(args, kwargs)
    x, weight = leaves[at[0]], leaves[at[1]]
    bias = leaves[at[2]] if at[2] is not None else None
    channels = x.shape[-2]
    if channels:
        return F.conv1d(x, weight, bias, stride, padding, dilation, channels)
    # No channels here: the output's shape from one stand-in channel, then none of it. It is made of the input
    # and the (empty) weight so that their backward runs, with its collectives, as on the other ranks.
    shape = F.conv1d(x.new_zeros((*x.shape[:-2], 1, x.shape[-1])), weight.new_zeros((1, 1, weight.shape[-1])),
                     None, stride, padding, dilation, 1).shape
    out: Tensor = x.new_zeros((*shape[:-2], 0, shape[-1])) + (x.sum() + weight.sum()) * 0
    return out if bias is None else out + bias.sum() * 0


def _conv1d(call: Call) -> Decision:
    """``conv1d`` of split or packed channels, depthwise, with a whole weight (and bias)."""
    bound = call.bound()
    x, weight, bias = bound["self"], bound["weight"], bound.get("bias")
    placement = _placed_of(x)
    if x.dim() not in (2, 3) or placement.dim != x.dim() - 2:
        raise Fallback  # not split on the channels
    channels = placement.size
    groups = bound.get("groups", 1)
    if type(groups) is SplitSize:
        depthwise = groups.whole() == channels
    else:  # written whole, or read off the local tensor's shape (a packed tensor's sizes are this rank's)
        depthwise = isinstance(groups, int) and groups in (channels, x.shape[placement.dim])
    if not depthwise or not isinstance(weight, Tensor) or placement_of(weight) is not None \
            or tuple(weight.shape[:2]) != (channels, 1) or weight.dim() != 3:
        raise Fallback  # channels mixed in groups, or several filters per channel
    if bias is not None and (not isinstance(bias, Tensor) or placement_of(bias) is not None
                             or tuple(bias.shape) != (channels,)):
        raise Fallback
    if type(placement) is Packed and _tiling(placement) is None:
        raise Fallback
    cut = functools.partial(_cut, dim=0, placement=placement)
    moves = [(call.index(weight), cut)]
    if bias is not None:
        moves.append((call.index(bias), cut))
    at = (call.index(x), call.index(weight), call.index(bias) if bias is not None else None)
    run = functools.partial(_depthwise, at=at, stride=bound.get("stride", 1), padding=bound.get("padding", 0),
                            dilation=bound.get("dilation", 1))
    return Decision(tuple(moves), run=run, out=placement)


def _holds_none(placement: Split | Packed) -> bool:
    """Whether some rank holds nothing of the placed dimension."""
    if type(placement) is Packed:
        return any(not sum(n for _, n in slices) for slices in placement.pieces)
    return any(not n for _, n in placement.intervals)  # type: ignore[union-attr]


def _pad(call: Call) -> Decision:
    """``F.pad`` along dimensions other than the split (or packed) one, in any mode: slice by slice."""
    bound = call.bound()
    x, pads = bound["self"], bound.get("pad")
    placement = _placed_of(x)
    if not isinstance(pads, (list, tuple)) or len(pads) % 2 or len(pads) // 2 > x.dim() \
            or any(type(p) is not int for p in pads):
        raise Fallback  # (a size read off a split dimension means the whole one: the fallback reads it so)
    for i in range(len(pads) // 2):
        if x.dim() - 1 - i == placement.dim and (pads[2 * i] or pads[2 * i + 1]):
            raise Fallback  # along the split: the padding is at the whole tensor's ends, not each slice's
    if isinstance(bound.get("value"), Tensor):
        raise Fallback
    if bound.get("mode", "constant") != "constant" and _holds_none(placement):
        raise Fallback  # reflect, replicate: torch refuses a tensor empty along a dimension it does not pad
    out = call.meta_out()
    if not isinstance(out, Tensor) or out.dim() != x.dim():
        raise Fallback
    return Decision(out=placement)


declare(("conv1d",), Split, _conv1d)
declare(("conv1d",), Packed, _conv1d)
declare(("pad",), Split, _pad)
declare(("pad",), Packed, _pad)
