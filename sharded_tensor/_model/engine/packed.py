"""Rules that carry a packed activation (``Packed``) through the model's code without unpacking it.

A packed activation holds, on each rank, several slices of one dimension of the logical tensor
side by side. Two things make one: a fused projection split by heads (Phi-3's ``qkv_proj``:
each rank its rows of q, of k and of v), and a concatenation along the split dimension of split
tensors: Qwen3-Next's gated delta net concatenates its queries, keys and values, each split on
its heads, into the channels of one convolution (``torch.cat((q, k, v), -1)``), and each rank
then holds its channels of each. ``split`` and indexing at the slices' bounds take a packed
tensor apart into ordinary splits (``split``); the rules here keep it packed through the ops
in between, each running on the local tensor, slice by slice:

* ``cat`` along the split or packed dimension of tensors each split or packed on it: packed,
  each rank's slices of every input in order (an ordinary split where they are adjacent); along
  another dimension, every operand packed alike;
* element-wise ops a convolution's input and output pass through (casts, copies, activations,
  arithmetic), every placed operand packed alike, a whole operand broadcast along the packed
  dimension (used whole by every rank, its gradient summed over them);
* transposes and permutations (the packed dimension moves);
* basic indexing that leaves the packed dimension whole (``x[:, :, -n:]``);
* a packed value copied into a buffer packed alike, or into a buffer sized from a packed
  tensor's local shape (a convolution's cached state, made with ``torch.zeros`` of the shape
  the model read): its extent along the packed dimension is this rank's, which the whole tensor
  would not fit, so it takes this rank's slices and holds the packing from then on.

Padding and depthwise convolution of packed channels are ``conv``'s. Any other op gathers the
slices first (``Packed.whole``), exact forward and backward as every fallback.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import split as _split
from .placements import Packed, Split, placement_of
from .rules import Call, Decision, Fallback, declare, in_place, norm_dim

__all__ = ["concatenated", "moved"]


def _packed_of(x: Any) -> Packed:
    found = placement_of(x)
    if type(found) is not Packed or not isinstance(x, Tensor):
        raise Fallback
    return found


def moved(packed: Packed, dim: int) -> Packed:
    """The same slices on another dimension (after a transpose, or with dimensions added in front)."""
    return packed if dim == packed.dim else Packed(dim, packed.pieces, packed.group)


def _slices_of(placement: Any, rank: int) -> tuple[tuple[int, int], ...]:
    if type(placement) is Split:
        return (placement.intervals[rank],)
    return placement.pieces[rank]  # type: ignore[no-any-return]


def _world_of(placement: Any) -> int:
    return len(placement.intervals) if type(placement) is Split else len(placement.pieces)


# -- cat --------------------------------------------------------------------------------------------

def _taking_part(tensors: Any) -> list[Tensor]:
    """The operands of ``cat`` but the whole 1-d empty ones (a cache's first state), which torch skips; a placed
    one is kept, empty or not (a rank holding nothing of it), so that every rank decides alike."""
    return [t for t in tensors if not (t.dim() == 1 and t.numel() == 0 and placement_of(t) is None)]


def _along_placed(call: Call) -> Decision | None:
    """``cat`` along the dimension every operand is split or packed on: packed; ``None`` along another dimension.

    The whole result is the inputs one after the other; each rank's local result is its slices
    of each, one after the other: the slices of input ``j`` offset by the sizes of the inputs
    before it.
    """
    bound = call.bound()
    dim = bound.get("dim", 0)
    tensors = _taking_part(bound["tensors"])
    if not isinstance(dim, int) or not tensors or any(t.dim() != tensors[0].dim() for t in tensors):
        raise Fallback
    d = norm_dim(dim, tensors[0].dim())
    placements = [placement_of(t) for t in tensors]
    if not any((type(p) is Split or type(p) is Packed) and p.dim == d for p in placements):
        return None
    first = next(p for p in placements if p is not None)
    world = _world_of(first)
    for p in placements:
        if type(p) is not Split and type(p) is not Packed:
            raise Fallback  # a whole operand (or another placement) along the split: no rank's slice of it
        if p.dim != d or p.group != first.group or _world_of(p) != world or (type(p) is Split and p.replicas):
            raise Fallback
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    offset = 0
    for p in placements:
        for r in range(world):
            pieces[r].extend((offset + s, n) for s, n in _slices_of(p, r))
        offset += p.size  # type: ignore[union-attr]
    packed = Packed(d, tuple(tuple(p) for p in pieces), first.group)
    adjacent = packed.coalesced()
    if adjacent is not None:
        return Decision(out=Split(d, adjacent.intervals, first.group))
    return Decision(out=packed)


def concatenated(call: Call) -> Decision:
    """``cat`` of split tensors: along the split dimension packed (see :func:`_along_placed`), along another
    dimension as ``split`` concatenates them."""
    found = _along_placed(call)
    return found if found is not None else _split.along_dim(call)


def _concatenated_packed(call: Call) -> Decision:
    """``cat`` of packed tensors: along the packed dimension packed; along another, every operand packed alike."""
    found = _along_placed(call)
    if found is not None:
        return found
    tensors = _taking_part(call.bound()["tensors"])
    placements = {placement_of(t) for t in tensors}
    if len(placements) != 1:
        raise Fallback  # a whole operand (it would need cutting to this rank's slices) or another packing
    return Decision(out=placements.pop())


# -- element by element -----------------------------------------------------------------------------

def _elementwise(call: Call) -> Decision:
    """An element-wise op with every placed operand packed alike; a whole operand broadcast along the packed
    dimension is used whole by every rank (its gradient summed over them)."""
    tensors = [t for t in call.leaves if isinstance(t, Tensor)]
    if call.name in ("to", "type_as") and call.args:
        tensors = tensors[:1]  # ``x.to(other)`` reads other's dtype and device, not its values
    out_ndim = max(t.dim() for t in tensors)
    found: Packed | None = None
    for t in tensors:
        placement = placement_of(t)
        if placement is None:
            continue
        if type(placement) is not Packed:
            raise Fallback
        aligned = moved(placement, out_ndim - t.dim() + placement.dim)
        if found is not None and aligned != found:
            raise Fallback
        found = aligned
    first = call.args[0] if call.args else None
    if found is None or (isinstance(first, Tensor) and placement_of(first) is None and in_place(call.func)):
        raise Fallback  # a whole tensor updated in place must receive whole values
    moves: list[tuple[int, Any]] = []
    for t in tensors:
        if placement_of(t) is not None:
            continue
        local_dim = found.dim - (out_ndim - t.dim())
        if local_dim >= 0 and t.shape[local_dim] != 1:
            raise Fallback  # whole along the packed dimension: each rank would need its slices of it
        moves.extend(_split.whole_operand(call, t, found.group))
    out = call.meta_out()  # (None for an op meta tensors refuse: in place on one that needs a gradient)
    if out is not None and not (isinstance(out, Tensor) and out.dim() == out_ndim):
        raise Fallback  # not one tensor of the broadcast shape: an op that only looks element-wise
    return Decision(tuple(moves), out=found)


# -- shapes -----------------------------------------------------------------------------------------

def _permuted(call: Call) -> Decision:
    """transpose / swapaxes / swapdims / permute / t: where the packed dimension goes, read from the op run on
    distinct sizes."""
    x = call.args[0] if call.args else None
    packed = _packed_of(x)
    assert isinstance(x, Tensor)
    probe = torch.empty([d + 2 for d in range(x.dim())], device="meta")
    args, kwargs = call.rebuilt({0: probe})
    try:
        sizes = list(call.func(*args, **kwargs).shape)
    except (RuntimeError, ValueError, TypeError, IndexError):
        raise Fallback from None
    return Decision(out=moved(packed, sizes.index(packed.dim + 2)))


def _getitem(call: Call) -> Decision:
    """Indexing at the slices' bounds (an ordinary split, ``split``'s rule), or indexing that leaves the packed
    dimension whole (still packed)."""
    try:
        return _split.packed_parts(call)
    except Fallback:
        pass
    x = call.args[0] if call.args else None
    packed = _packed_of(x)
    assert isinstance(x, Tensor)
    # Where the packed dimension lands is where a split of it would: one interval stands for the slices.
    probe = Split(packed.dim, ((0, x.shape[packed.dim]),), packed.group)
    return Decision(out=moved(packed, _split.indexed(x, call.args[1], probe).dim))


# -- writes -----------------------------------------------------------------------------------------

def _copied(call: Call) -> Decision:
    """``buffer.copy_(source)`` of a packed source into a buffer of its local shape, packed alike or sized from a
    packed tensor's local shape (see the module's docstring); it holds the packing from then on."""
    bound = call.bound()
    dest, source = bound.get("self"), bound.get("src")
    packed = placement_of(source)
    if type(packed) is not Packed or not isinstance(dest, Tensor) or not isinstance(source, Tensor) \
            or dest.shape != source.shape:
        raise Fallback
    # An untagged buffer of the source's local shape is this rank's part (a buffer of the whole size, on a rank
    # holding less, fails the shape check above, there and on every rank). On a rank holding every slice the two
    # sizes agree: it takes the buffer as its part too, as the ranks beside it do with theirs, made alike; a buffer
    # made whole on purpose there, beside ranks holding nothing, is the one layout read otherwise than meant.
    held = placement_of(dest)
    if held is not None and held != packed:
        raise Fallback
    return Decision(out=packed, written=((call.index(dest), packed),))


ELEMENTWISE = (
    "to type_as float double half bfloat16 contiguous clone detach zero_ silu sigmoid tanh relu gelu softplus exp "
    "neg add sub mul div").split()
"""The element-wise ops packed activations go through: a convolution's casts, activations and arithmetic."""

declare(("cat", "concat", "concatenate"), Split, concatenated)
declare(("cat", "concat", "concatenate"), Packed, _concatenated_packed)
declare(ELEMENTWISE, Packed, _elementwise)
declare(("transpose", "swapaxes", "swapdims", "permute", "t"), Packed, _permuted)
declare(("__getitem__",), Packed, _getitem)
declare(("copy_",), Packed, _copied)
