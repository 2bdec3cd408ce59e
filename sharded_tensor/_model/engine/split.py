"""Rules for split activations (``Split``) and packed ones (``Packed``).

A Linear split on its output features hands out this rank's slice of its output, tagged
``Split``; the model's own code then runs on that slice. Each rule below proves an op acts
slice by slice and says where the split lands:

* element-wise ops with broadcasting (a whole operand is cut to this rank's slice, or, when
  it broadcasts along the split, used whole by every rank through ``copy_to_ranks``); dropout
  draws the whole mask on every rank, as the unsharded op would, and keeps this rank's slice;
* reshapes that keep the split the outermost dimension of its group (sizes read first as the
  unsharded program reads them, against the whole tensor; a merge with outer dimensions gives
  a strided split, see ``strided``), transposes, ``expand``, indexing that leaves the split
  dimension whole, complex views;
* ops along another dimension (softmax, cumsum, concatenation, splitting), reductions over
  other dimensions, and a sum or mean across the split (local sums, one all-reduce);
* batched matmuls, ``linear`` and normalizations with the split on a batch dimension,
  ``scaled_dot_product_attention`` over split heads (grouped key/value heads included);
* writes into a split buffer (a key/value cache): values split alike, whole ones cut to the
  slice or broadcast, and writes at positions along the split, each rank its own positions;
  an in-place op brings an operand split otherwise to the written tensor's split.

A ``Packed`` activation (a fused q/k/v projection's output) is taken apart by ``split``,
``chunk`` or indexing at its slices' boundaries, into ordinary splits; any other op gathers
it. Any op without a rule, or a call a rule cannot prove, runs on gathered tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import shapes as _shapes
from . import state as _state
from .placements import (
    Packed,
    Split,
    SplitSize,
    Strided,
    copy_to_ranks,
    placement_of,
    reduce_from_ranks,
    shared_copy,
)
from .rules import Call, Decision, Each, Fallback, declare, in_place, norm_dim, pointwise_names

__all__ = ["elementwise", "whole_operand", "sizes_read", "whole_sizes", "reshape", "first_split", "along_dim",
           "indexed", "packed_parts"]


def _split_of(x: Any) -> Split | None:
    found = placement_of(x)
    return found if type(found) is Split else None


def first_split(call: Call) -> tuple[Tensor, Split]:
    x = call.args[0] if call.args else None
    split = _split_of(x)
    if split is None:
        raise Fallback
    return x, split  # type: ignore[return-value]


def whole_operand(call: Call, t: Tensor, group: Any) -> tuple[tuple[int, Any], ...]:
    """The move of a whole operand that every rank combines, whole, with its own slice.

    Each rank's gradient for it then covers only that rank's slice, so its backward sums the
    gradients over the ranks (``copy_to_ranks``, shared by every use in the zone call); no move
    when it needs no gradient.
    """
    if isinstance(t, Tensor) and t.requires_grad and call.grad and placement_of(t) is None:
        return ((call.index(t), functools.partial(shared_copy, group=group)),)
    return ()


def _cut(call: Call, t: Tensor, dim: int, split: Split) -> tuple[int, Any]:
    """The move of a whole operand cut to this rank's slice along ``dim`` (its gradient gathered back)."""
    return call.index(t), functools.partial(split.cut, dim=dim)


# -- element-wise -----------------------------------------------------------------------------------

def elementwise(call: Call) -> Decision:
    """Ops that act element by element, with broadcasting (add, mul, silu, where, ...), on split or strided
    activations (every placed operand placed alike)."""
    tensors = [(i, t) for i, t in enumerate(call.leaves) if isinstance(t, Tensor)]
    if call.name in ("to", "type_as") and call.args:
        tensors = tensors[:1]  # ``x.to(other)`` reads other's dtype and device, not its values
    out_ndim = max(t.dim() for _, t in tensors)
    first = call.args[0] if call.args else None
    # In place on a placed tensor: the result keeps its placement, and an operand placed otherwise is brought to it.
    written = placement_of(first) if in_place(call.func) and isinstance(first, Tensor) else None
    found: Split | Strided | None = None
    if type(written) is Split or type(written) is Strided:
        if first.dim() != out_ndim:  # type: ignore[union-attr]
            raise Fallback
        found = written
    elsewhere: list[tuple[int, Tensor]] = []  # operands placed otherwise than the written tensor
    for i, t in tensors:
        placement = placement_of(t)
        if placement is None:
            continue
        if type(placement) is not Split and type(placement) is not Strided:
            raise Fallback
        aligned = placement if out_ndim == t.dim() else placement.moved(out_ndim - t.dim() + placement.dim)
        if found is not None and aligned != found:
            if written is None:
                raise Fallback
            elsewhere.append((i, t))
            continue
        found = aligned
    if found is None:
        raise Fallback  # only a size read off a split dimension: it stands for the whole size
    if isinstance(first, Tensor) and placement_of(first) is None and in_place(call.func):
        raise Fallback  # a whole tensor updated in place must receive whole values
    moves: list[tuple[int, Any]] = list(whole_sizes(call))  # a split dimension's size as an operand: the whole
    local: dict[int, Tensor] = {}
    length = found.length()
    for i, t in elsewhere:
        local_dim = found.dim - (out_ndim - t.dim())
        size = _whole_shape(t)[local_dim] if local_dim >= 0 else 1
        if size not in (1, found.extent()):
            raise Fallback
        moves.append((i, _brought(placement_of(t), found, local_dim, size != found.extent())))
        shape = _whole_shape(t)
        if size == found.extent():
            shape[local_dim] = length
        local[i] = torch.empty(shape, dtype=t.dtype, device="meta")
    for i, t in tensors:
        if placement_of(t) is not None:
            continue
        local_dim = found.dim - (out_ndim - t.dim())
        if local_dim < 0 or t.shape[local_dim] == 1:
            moves.extend(whole_operand(call, t, found.group))  # broadcast against every rank's slice
            continue
        if t.shape[local_dim] != found.extent():
            raise Fallback
        moves.append((call.index(t), functools.partial(found.cut, dim=local_dim)))
        shape = list(t.shape)
        shape[local_dim] = length
        local[i] = torch.empty(shape, dtype=t.dtype, device="meta")
    out = call.meta_out(local)
    if out is not None and not (isinstance(out, Tensor) and out.dim() == out_ndim):
        raise Fallback  # not one tensor of the broadcast shape: an op that only looks element-wise
    return Decision(tuple(moves), out=found)


def _dropout(call: Call) -> Decision:
    """Dropout on a split activation: the whole mask drawn on every rank, this rank's slice of it applied.

    The unsharded op draws one Bernoulli mask of the whole tensor's shape from the generator;
    drawing the same on every rank (the same generator state, as tensor-parallel ranks seed
    alike) gives each rank its slice of that very mask, so the values equal the unsharded
    model's and the generator advances as it would.
    """
    x, split = first_split(call)
    bound = call.bound()
    p = bound.get("p", 0.5)
    train = bound.get("train", bound.get("training", True))
    if bound.get("inplace", False) or not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
        raise Fallback
    if p == 0 or not train:
        return Decision(out=split)  # the identity
    return Decision(run=functools.partial(_masked, split=split, p=float(p)), out=split)


def _masked(x: Tensor, *args: Any, split: Split, p: float, **kwargs: Any) -> Tensor:
    """``x`` times this rank's slice of a whole dropout mask, laid out in memory as ``x`` is (as
    ``torch.empty_like`` lays out the unsharded op's mask, whose memory order the draw follows)."""
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    whole = list(x.shape)
    whole[split.dim] = split.size
    strides = x.stride()
    order = sorted(range(x.dim()), key=lambda d: (-strides[d], d))
    noise = torch.empty([whole[d] for d in order], dtype=x.dtype, device=x.device)
    noise = noise.permute([order.index(d) for d in range(len(order))])
    noise.bernoulli_(1 - p)
    noise.div_(1 - p)
    start, length = split.intervals[_state.rank(split.group)]
    return x * noise.narrow(split.dim, start, length)


# -- shapes -----------------------------------------------------------------------------------------

_VIEWS = {"view", "view_as", "unflatten", "squeeze", "unsqueeze"}  # the others may copy: reshape, flatten
# The ones given sizes (which code may compute from a split dimension's local size), not dimensions: the shape of
# their output follows from the sizes alone (``squeeze``'s, from which dimensions have size 1).
_SIZED = {"view", "reshape", "unflatten"}


def _to_shape(x: Tensor, *args: Any, shape: tuple[int, ...], view: bool, **kwargs: Any) -> Tensor:
    return x.view(shape) if view else x.reshape(shape)


def _meta(x: Tensor, shape: Sequence[int]) -> Tensor:
    return torch.empty(tuple(shape), dtype=x.dtype, device="meta")


def sizes_read(func: Any, args: tuple[Any, ...], value: Any, split: Split) -> Any:
    """``x.shape``, ``x.size()`` or ``x.size(d)`` of a split activation as the model's code reads it: this rank's
    sizes, the split dimension's a :class:`SplitSize` (symbolic sizes of a trace as they are)."""
    if type(value) is int:
        dim = args[1] if len(args) > 1 else None
        return SplitSize(value, split) if isinstance(dim, int) and norm_dim(dim, args[0].dim()) == split.dim else value
    if type(value) is torch.Size and split.dim < len(value) and type(value[split.dim]) is int:
        sizes = list(value)
        sizes[split.dim] = SplitSize(sizes[split.dim], split)
        return torch.Size(sizes)
    return value


def _whole_size(size: SplitSize) -> int:
    return size.whole()


def whole_sizes(call: Call) -> tuple[tuple[int, Any], ...]:
    """The moves that make every :class:`SplitSize` among the call's arguments the whole size it stands for."""
    return tuple((i, _whole_size) for i, v in enumerate(call.leaves) if type(v) is SplitSize)


def reshape(call: Call) -> Decision:
    """view / reshape / flatten / unflatten / (un)squeeze / view_as, on this rank's slice.

    Sizes are read as the unsharded program reads them, against the whole tensor (``view(b, s,
    num_heads, 3, head_dim)`` with a fixed ``num_heads``; ``view(-1, 1, x.shape[1])``): a size read
    off a split dimension (:class:`SplitSize`) stands for that dimension's whole size, so every
    rank reads the same call and decides alike. Sizes computed from a split dimension's size
    (plain numbers: this rank's) are read against the local slice where the whole reading fails
    (:func:`shapes.local_readings`), only when every rank's reading is unambiguous. A split merged
    with dimensions outside it (``reshape(batch * heads, ...)``, by ``view`` or ``reshape``) gives
    a strided split.
    """
    x, split = first_split(call)
    view = call.name in _VIEWS
    found = _read_whole(call, x, split, view)
    if found is None and call.name in _SIZED and not any(type(v) is SplitSize for v in call.leaves[1:]):
        found = _read_locally(call, x, split, view)
    if found is None:
        raise Fallback
    return found


def _read_whole(call: Call, x: Tensor, split: Split, view: bool) -> Decision | None:
    whole = list(x.shape)
    whole[split.dim] = split.size
    replaced: dict[int, Any] = {i: v.whole() for i, v in enumerate(call.leaves) if type(v) is SplitSize}
    for i, v in enumerate(call.leaves[1:], 1):  # a split shape to take (view_as, reshape_as): its whole one
        other = placement_of(v)
        if type(other) is Split and isinstance(v, Tensor):
            replaced[i] = _meta(v, [other.size if d == other.dim else n for d, n in enumerate(v.shape)])
    replaced[0] = _meta(x, whole)
    out = call.meta_out(replaced)
    if not isinstance(out, Tensor):
        return None
    shape = list(out.shape)
    if call.name in ("view", "reshape"):
        merge = _shapes.merged(whole, shape, split.dim)
        if merge is not None:
            dim, blocks, inner = merge
            intervals = tuple((s * inner, n * inner) for s, n in split.intervals)
            local = list(shape)
            local[dim] = blocks * x.shape[split.dim] * inner
            return Decision(run=functools.partial(_to_shape, shape=tuple(local), view=view),
                            out=Strided(dim, intervals, blocks, split.group))
    found = _shapes.moved(whole, shape, split)
    if found is None:
        return None
    local = list(shape)
    local[found.dim] = found.length()
    if math.prod(local) != x.numel():
        return None
    return Decision(run=functools.partial(_to_shape, shape=tuple(local), view=view), out=found)


def _read_locally(call: Call, x: Tensor, split: Split, view: bool) -> Decision | None:
    """Sizes computed from this rank's length (``x.view(b, s, x.shape[-1] // d, d)``): read against the local
    slice. Each rank checks that every rank, reading its own sizes so, lands the split at the one same place:
    the empty slice's rank and a rank of length 1 next to dimensions of size 1 may read several."""
    if any(v == -1 for v in call.leaves[1:] if type(v) is int) and any(n == 0 for _, n in split.intervals):
        return None  # a -1 against an empty slice reads nothing: that rank could not read it
    out = call.meta_out()
    if not isinstance(out, Tensor):
        return None
    found = _shapes.local_reading(list(x.shape), list(out.shape), split)
    if found is None:
        return None
    return Decision(run=functools.partial(_to_shape, shape=tuple(out.shape), view=view), out=found)


def _transpose(call: Call) -> Decision:
    x, split = first_split(call)
    ndim = x.dim()
    order = list(range(ndim))
    if call.name == "t":
        order = order[::-1]
    else:
        bound = call.bound()
        if call.name == "permute":
            order = [norm_dim(d, ndim) for d in bound["dims"]]
        else:  # transpose, swapdims (dim0, dim1), swapaxes (axis0, axis1)
            d0 = norm_dim(bound["dim0"] if "dim0" in bound else bound["axis0"], ndim)
            d1 = norm_dim(bound["dim1"] if "dim1" in bound else bound["axis1"], ndim)
            order[d0], order[d1] = order[d1], order[d0]
    return Decision(out=split.moved(order.index(split.dim)))


def _getter(call: Call) -> Decision:
    """``x.T``, ``x.mT`` (the split moves), ``x.real``, ``x.imag`` (it stays)."""
    x, split = first_split(call)
    attr = getattr(getattr(call.func, "__self__", None), "__name__", "")
    if attr in ("real", "imag"):
        return Decision(out=split)
    order = list(range(x.dim()))
    if attr in ("T", "H"):
        order = order[::-1]
    elif attr in ("mT", "mH"):
        order[-1], order[-2] = order[-2], order[-1]
    else:
        raise Fallback
    return Decision(out=split.moved(order.index(split.dim)))


def _complex_view(call: Call) -> Decision:
    """``view_as_complex`` (the last dimension of size 2 folds into the dtype) and ``view_as_real``
    (it unfolds): slice by slice when the split is on another dimension."""
    x, split = first_split(call)
    if split.dim >= x.dim() - (1 if call.name == "view_as_complex" else 0):
        raise Fallback
    return Decision(out=split)


def _index_positions(x: Tensor, index: Any) -> tuple[list[Any], int] | None:
    """``index`` with the ellipsis expanded to full slices, and how many dimensions of ``x`` it uses."""
    index = index if isinstance(index, tuple) else (index,)
    used = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in index:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.dim() - used))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (x.dim() - sum(1 for i in expanded if i is not None)))
    return expanded, used


def indexed(x: Tensor, index: Any, split: Split) -> Split:
    """Where the split lands after basic indexing that leaves the split dimension whole; ``Fallback`` otherwise."""
    items = index if isinstance(index, tuple) else (index,)
    listed = [i for i in items if isinstance(i, (list, Tensor))]
    if listed:  # one list of positions keeps its place among slices (qkv[:, :, :, [-2]])
        picked = listed[0]
        if len(listed) > 1 or any(isinstance(i, int) for i in items) or not (
                (isinstance(picked, list) and all(type(p) is int for p in picked))
                or (isinstance(picked, Tensor) and picked.dim() == 1 and placement_of(picked) is None
                    and not picked.is_floating_point() and picked.dtype != torch.bool)):
            raise Fallback
    elif any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool) for i in items):
        raise Fallback
    found = _index_positions(x, index)
    assert found is not None
    src = out_dim = 0
    for i in found[0]:
        if i is None:
            out_dim += 1
            continue
        if src == split.dim:
            if not (isinstance(i, slice) and i == slice(None)):
                raise Fallback
            return split.moved(out_dim)
        if not isinstance(i, int):
            out_dim += 1
        src += 1
    raise Fallback


def _getitem(call: Call) -> Decision:
    """Basic indexing that leaves the split dimension whole (``x[..., :half]``, ``x[:, None]``)."""
    x, split = first_split(call)
    return Decision(out=indexed(x, call.args[1], split))


def _size_list(sizes: Any) -> list[Any]:
    """Sizes as an op was given them, as a list: one int (``x.expand(2)``, ``torch.zeros(n)``) is one size."""
    if isinstance(sizes, int):
        return [sizes]
    if isinstance(sizes, (list, tuple)):
        return list(sizes)
    raise Fallback


def _expand_to(x: Tensor, *args: Any, sizes: tuple[int, ...], **kwargs: Any) -> Tensor:
    return x.expand(sizes)


def _expand_whole(call: Call, x: Tensor) -> Decision:
    """A whole ``x`` expanded to sizes among which one was read off a split dimension (``k_pe.expand(
    *k.shape[:-1], -1)``): this rank's slice of what the unsharded program expands, ``x`` cut to it (or, where
    it broadcasts, used whole by every rank)."""
    sizes = _size_list(call.bound().get("size"))
    marked = [i for i, v in enumerate(sizes) if type(v) is SplitSize]
    if len(marked) != 1:
        raise Fallback
    at = marked[0]
    split = sizes[at].placement
    local = at - (len(sizes) - x.dim())
    if local >= 0 and x.shape[local] != 1:
        if x.shape[local] != split.size:
            raise Fallback
        moves: tuple[tuple[int, Any], ...] = (_cut(call, x, local, split),)
    else:
        moves = whole_operand(call, x, split.group)
    return Decision(moves, out=split.moved(at))


def _factory(call: Call) -> Decision:
    """``torch.zeros(..)``, ``x.new_empty(..)`` and the like given a size read off a split dimension: this rank's
    slice of the tensor the unsharded program makes."""
    bound = call.bound()
    sizes = _size_list(bound.get("size"))
    source = bound.get("self")  # ``x.new_empty``: x gives only its dtype and device
    if any(isinstance(v, Tensor) and v is not source and placement_of(v) is not None for v in call.leaves):
        raise Fallback
    marked = [i for i, v in enumerate(sizes) if type(v) is SplitSize]
    if len(marked) != 1:
        raise Fallback
    split = sizes[marked[0]].placement
    return Decision(out=split.moved(marked[0]))


def _expand(call: Call) -> Decision:
    """expand / broadcast_to / expand_as with the split dimension kept: given its local or its whole size;
    a whole tensor expanded to a split dimension's size read off a split activation gives this rank's slice."""
    x = call.args[0] if call.args else None
    if isinstance(x, Tensor) and placement_of(x) is None:
        return _expand_whole(call, x)
    x, split = first_split(call)
    bound = call.bound()
    other = bound.get("other")
    if isinstance(other, Tensor):
        if placement_of(other) is not None:
            raise Fallback
        sizes = list(other.shape)
    else:
        sizes = _size_list(bound["size"])
    new = len(sizes) - x.dim()
    at = new + split.dim
    if new < 0:
        raise Fallback
    given = sizes[at]
    # The split dimension kept: -1, its whole size, or a size read off it; a plain int equal to this rank's length
    # is read the same way (sizes read locally), except where the whole size is 1, which expands to any size: only
    # -1, 1 or a size read off it say the dimension is kept, on every rank alike.
    if type(given) is SplitSize:
        kept = given.whole() == split.size
    else:
        kept = given in (-1, split.size) or (split.size != 1 and given == x.shape[split.dim])
    if not kept:
        raise Fallback
    sizes[at] = x.shape[split.dim]
    return Decision(run=functools.partial(_expand_to, sizes=tuple(sizes)), out=split.moved(at))


# -- along a dimension ------------------------------------------------------------------------------

def _concatenated(call: Call) -> Decision:
    """cat / stack along another dimension than the split; a whole operand is cut to this rank's slice."""
    bound = call.bound()
    dim = bound.get("dim", 0)
    # torch.cat skips 1-d empty tensors (a cache's first state): they take no part in the split. (Whole ones only:
    # a placed one's slice is empty on some ranks, not on every one, which must decide alike.)
    tensors = [t for t in bound["tensors"] if not (call.name != "stack" and t.dim() == 1 and t.numel() == 0
                                                   and placement_of(t) is None)]
    placements = {placement_of(t) for t in tensors} - {None}
    if len(placements) != 1 or not isinstance(dim, int):
        raise Fallback
    split = placements.pop()
    if type(split) is not Split or any(t.dim() != tensors[0].dim() for t in tensors):
        raise Fallback
    ndim = tensors[0].dim()
    if call.name == "stack":
        d = norm_dim(dim, ndim + 1)
        out = split.moved(split.dim + (1 if d <= split.dim else 0))
    elif norm_dim(dim, ndim) == split.dim:
        raise Fallback
    else:
        out = split
    moves = []
    for t in tensors:
        if placement_of(t) is None:
            if t.shape[split.dim] != split.size:
                raise Fallback
            moves.append(_cut(call, t, split.dim, split))
    return Decision(tuple(moves), out=out)


def along_dim(call: Call) -> Decision:
    """Ops that work along one dimension (softmax, cumsum, split, chunk, unbind): fine along any other."""
    if call.name in ("cat", "concat", "concatenate", "stack"):
        return _concatenated(call)
    x, split = first_split(call)
    dim = call.bound().get("dim")
    if not isinstance(dim, int) or norm_dim(dim, x.dim()) == split.dim:
        raise Fallback  # along the split, or softmax's legacy implicit dimension
    if call.name in ("split", "chunk", "unbind", "tensor_split"):
        moved = split.moved(split.dim - 1) if call.name == "unbind" and norm_dim(dim, x.dim()) < split.dim else split
        return Decision(out=Each(moved))
    return Decision(out=split)


def _roll(call: Call) -> Decision:
    """``roll`` along dimensions other than the split."""
    x, split = first_split(call)
    dims = call.bound().get("dims")
    dims = (dims,) if isinstance(dims, int) else dims
    if not dims or not all(isinstance(d, int) for d in dims) or split.dim in {norm_dim(d, x.dim()) for d in dims}:
        raise Fallback
    return Decision(out=split)


# -- writes -----------------------------------------------------------------------------------------

def _setitem(call: Call) -> Decision:
    """``buffer[key] = value`` on a split buffer.

    A key that leaves the split dimension whole writes each rank's slice of the view: a whole
    value of the view's size along the split is cut to the slice; one that broadcasts along it is
    written whole by every rank (its gradient summed over the ranks, each holding its slice's
    share); a value placed as the view is written as it is, one placed otherwise is brought to the
    view's placement. A key that picks positions along the split dimension (``b[0:1]``,
    ``b[:, :, pos]``, ``b[:, [2, 0]]``) has each rank write the positions it holds, the matching
    part of the value (:func:`_write_positions`).
    """
    if len(call.args) != 3 or call.kwargs:
        raise Fallback
    buffer, index, value = call.args
    split = _split_of(buffer)
    if split is None or not isinstance(buffer, Tensor):
        raise Fallback
    whole = list(buffer.shape)
    whole[split.dim] = split.size
    try:
        view = _meta(buffer, whole)[index]  # the whole view's shape, read as torch reads the key
    except (IndexError, RuntimeError, TypeError, ValueError):
        raise Fallback from None
    found = _split_item(buffer, index, split)
    if found is None:
        raise Fallback
    item, at, view_dim = found
    if isinstance(item, slice) and item == slice(None):
        return _write_slices(call, view, value, split.moved(view_dim))
    return _write_positions_decision(call, buffer, view, value, split, item, at, view_dim)


def _split_item(x: Tensor, index: Any, split: Split) -> tuple[Any, int, int] | None:
    """``(the key's item at the split dimension, its place in the key with the ellipsis expanded, the view's
    dimension it gives or would give)``; ``None`` for a key the writes below do not read (several lists of
    positions, a list with integers, a mask)."""
    items = index if isinstance(index, tuple) else (index,)
    listed = [i for i in items if isinstance(i, (list, Tensor))]
    for i in items:
        if isinstance(i, bool) or not (i is None or i is Ellipsis or isinstance(i, (int, slice, list, Tensor))):
            return None
        if isinstance(i, list) and not all(type(p) is int for p in i):
            return None
        if isinstance(i, Tensor) and (i.dim() != 1 or placement_of(i) is not None or i.is_floating_point()
                                      or i.is_complex() or i.dtype == torch.bool):
            return None
    if len(listed) > 1 or (listed and any(isinstance(i, int) for i in items)):
        return None  # positions that torch pairs, or moves to the front: not this rank's part of one dimension
    if sum(1 for i in items if i is Ellipsis) > 1:
        return None
    found = _index_positions(x, index)
    assert found is not None
    src = out_dim = 0
    for at, i in enumerate(found[0]):
        if i is None:
            out_dim += 1
            continue
        if src == split.dim:
            if isinstance(i, slice) and (i.step or 1) <= 0:
                return None
            if isinstance(i, int) and not -split.size <= i < split.size:
                return None  # out of range: the whole tensor's own error, from the gathered one
            return i, at, out_dim
        if not isinstance(i, int):
            out_dim += 1
        src += 1
    return None


def _brought(placement: Any, target: Split | Strided, dim: int, broadcast: bool) -> Any:
    """The move bringing a value placed as ``placement`` to ``target`` along its dimension ``dim``: made whole,
    then cut to this rank's slice (its gradient gathered back) or, where it broadcasts, used whole by every rank
    (its gradient summed over the ranks)."""
    if broadcast:
        return functools.partial(_whole_copied, placement=placement, group=target.group)
    return functools.partial(_whole_cut, placement=placement, target=target, dim=dim)


def _whole_cut(x: Tensor, *, placement: Any, target: Split | Strided, dim: int) -> Tensor:
    return target.cut(placement.whole(x), dim)


def _whole_copied(x: Tensor, *, placement: Any, group: Any) -> Tensor:
    return copy_to_ranks(placement.whole(x), group)


def _whole_shape(t: Tensor) -> list[int]:
    """The whole tensor's shape of a placed (or whole) ``t``."""
    placement = placement_of(t)
    shape = list(t.shape)
    if type(placement) is Split:
        shape[placement.dim] = placement.size
    elif type(placement) is Strided:
        shape[placement.dim] = placement.extent()
    elif type(placement) is Packed:
        shape[placement.dim] = placement.size
    return shape


def _write_slices(call: Call, view: Tensor, value: Any, target: Split) -> Decision:
    """``buffer[key] = value`` with the split dimension whole in the view: each rank writes its slice."""
    if not isinstance(value, Tensor):
        return Decision()  # a number written everywhere
    if value.dim() > view.dim():
        raise Fallback
    local_dim = target.dim - (view.dim() - value.dim())  # the value's dimensions count from the view's
    held = placement_of(value)
    if held is not None:
        if type(held) is Split and local_dim >= 0 and held == target.moved(local_dim):
            return Decision()
        if type(held) is Packed:
            raise Fallback
        size = _whole_shape(value)[local_dim] if local_dim >= 0 else 1
        if size not in (1, target.size):
            raise Fallback
        return Decision(((call.index(value), _brought(held, target, local_dim, size != target.size)),))
    if local_dim >= 0 and value.shape[local_dim] == target.size:
        return Decision((_cut(call, value, local_dim, target),))
    if local_dim < 0 or value.shape[local_dim] == 1:
        # Every rank writes it whole into its slice: each holds its slice's share of its gradient.
        return Decision(whole_operand(call, value, target.group))
    raise Fallback


def _write_positions_decision(call: Call, buffer: Tensor, view: Tensor, value: Any, split: Split, item: Any,
                              at: int, view_dim: int) -> Decision:
    """``buffer[key] = value`` with the key picking positions along the split dimension: each rank writes those
    it holds. A value is used whole by every rank (a placed one made whole first), each taking the part that
    goes to its positions; the ranks' shares of its gradient are summed."""
    moves: tuple[tuple[int, Any], ...] = ()
    if isinstance(value, Tensor):
        held = placement_of(value)
        if value.dim() > view.dim():
            raise Fallback
        if held is not None:
            if type(held) is Packed:
                raise Fallback
            moves = ((call.index(value), functools.partial(_whole_copied, placement=held, group=split.group)),)
        else:
            moves = whole_operand(call, value, split.group)
    return Decision(moves, run=functools.partial(_write_positions, split=split, at=at, view_dim=view_dim,
                                                 view_ndim=view.dim()))


def _write_positions(buffer: Tensor, index: Any, value: Any, *, split: Split, at: int, view_dim: int,
                     view_ndim: int) -> None:
    """Write this rank's positions of ``buffer[index] = value`` (the key's item ``at`` picks positions along the
    split dimension): its local positions, and the value's part for them.

    A rank that holds none of them writes an empty part, which keeps the value in its autograd
    graph: its backward (a sum over the ranks) runs on every rank.
    """
    start, length = split.intervals[_state.rank(split.group)]
    items = list(_index_positions(buffer, index)[0])  # type: ignore[index]
    item = items[at]
    total = split.size
    # The value's dimension along the positions (its dimensions count from the view's).
    vdim = view_dim - (view_ndim - value.dim()) if isinstance(value, Tensor) else -1
    if isinstance(item, int):
        position = item % total
        if start <= position < start + length:
            items[at] = position - start
        else:
            items[at] = slice(0, 0)
            if isinstance(value, Tensor):
                empty = buffer[tuple(items)]
                shape = [n for d, n in enumerate(empty.shape) if d != view_dim]
                value = value.expand(shape).unsqueeze(view_dim).narrow(view_dim, 0, 0)
        buffer[tuple(items)] = value
        return
    if isinstance(item, slice):
        first, stop, step = item.indices(total)
        count = len(range(first, stop, step))
        low = max(0, -(-(start - first) // step))  # the first position at or after this rank's start
        high = min(count, max(0, -(-(start + length - first) // step)))  # past the last one before its end
        high = max(high, low)
        items[at] = slice(first + low * step - start, first + (high - 1) * step - start + 1, step) if high > low \
            else slice(0, 0)
        if isinstance(value, Tensor) and vdim >= 0 and value.shape[vdim] == count:
            value = value.narrow(vdim, low, high - low)
        buffer[tuple(items)] = value
        return
    positions = item.tolist() if isinstance(item, Tensor) else list(item)
    mine = [(j, p % total - start) for j, p in enumerate(positions) if start <= p % total < start + length]
    device = buffer.device
    items[at] = torch.tensor([p for _, p in mine], dtype=torch.long, device=device)
    if isinstance(value, Tensor) and vdim >= 0 and value.shape[vdim] == len(positions):
        value = value.index_select(vdim, torch.tensor([j for j, _ in mine], dtype=torch.long, device=value.device))
    buffer[tuple(items)] = value


def _write_split(call: Call) -> Decision:
    """``buffer.index_copy_(dim, index, source)`` (along another dimension than the split) and
    ``buffer.copy_(source)`` (same shape) of a split source into a buffer.

    A buffer tagged with the source's split takes its slice as is. An untagged buffer whose
    extent along the split is this rank's slice, not the whole, can only have been sized from
    split tensors' shapes (which read local): a static key/value cache allocated from the first
    keys. The whole tensor would not fit in it, so the unsharded program cannot mean that: it
    takes this rank's slice and holds the split from then on.
    """
    bound = call.bound()
    dest = bound.get("self")
    if call.name == "copy_":
        source, dim, index = bound.get("src"), None, None
    else:
        source, dim, index = bound.get("source"), bound.get("dim"), bound.get("index")
    split = _split_of(source)
    if (split is None or not isinstance(dest, Tensor) or not isinstance(source, Tensor)
            or placement_of(index) is not None or dest.dim() != source.dim()
            or (dim is None and dest.shape != source.shape)
            or (dim is not None and (not isinstance(dim, int) or norm_dim(dim, dest.dim()) == split.dim))):
        raise Fallback
    held = placement_of(dest)
    if held is None:
        local = source.shape[split.dim]
        if dest.shape[split.dim] != local or local == split.size:
            raise Fallback
    elif held != split:
        raise Fallback
    return Decision(out=split, written=((call.index(dest), split),))


# -- reductions and products ------------------------------------------------------------------------

def _sum_across(x: Tensor, *args: Any, dims: tuple[int, ...], keepdim: bool, split: Split, count: int,
                **kwargs: Any) -> Tensor:
    """A sum (or, with ``count``, a mean) over dimensions including the split one: local sums, one all-reduce.

    The result is whole on every rank; the all-reduce's adjoint is the identity, since its
    gradient is complete on every rank and each element of every slice enters the sum once.
    """
    total = reduce_from_ranks(x.sum(dims, keepdim=keepdim), split.group)
    return total / count if count else total


def _min_max(call: Call) -> Decision:
    """``torch.min``/``max`` in their three forms: of two tensors (element-wise), along a dimension (the values
    and the indices, along another dimension than the split), of every element (gathered)."""
    bound = call.bound()
    if isinstance(bound.get("other"), Tensor):
        return elementwise(call)
    x, split = first_split(call)
    dim = bound.get("dim")
    if not isinstance(dim, int) or norm_dim(dim, x.dim()) == split.dim:
        raise Fallback
    keepdim = bool(bound.get("keepdim", False))
    moved = split if keepdim or norm_dim(dim, x.dim()) > split.dim else split.moved(split.dim - 1)
    return Decision(out=Each(moved))


def _reduce(call: Call) -> Decision:
    """sum / mean / amax / amin / var / std / logsumexp over dimensions other than the split one."""
    x, split = first_split(call)
    bound = call.bound()
    dims = bound.get("dim")
    if dims is None or isinstance(dims, Tensor) or (isinstance(dims, (list, tuple)) and not dims):
        raise Fallback  # every dimension (an empty list means every dimension too)
    dims = [dims] if isinstance(dims, int) else list(dims)
    normed = sorted(norm_dim(d, x.dim()) for d in dims)
    keepdim = bool(bound.get("keepdim", False))
    if split.dim in normed:
        if call.name not in ("sum", "mean") or bound.get("dtype") is not None or not x.is_floating_point() \
                or split.replicas:
            raise Fallback  # amax, var, std, logsumexp: not a plain sum of the slices (nor one of replicas)
        count = math.prod(split.size if d == split.dim else x.shape[d] for d in normed) if call.name == "mean" else 0
        return Decision(run=functools.partial(_sum_across, dims=tuple(normed), keepdim=keepdim, split=split,
                                              count=count))
    if not isinstance(call.meta_out(), Tensor):
        raise Fallback
    shift = 0 if keepdim else sum(1 for d in normed if d < split.dim)
    return Decision(out=split.moved(split.dim - shift))


def _matmul(call: Call) -> Decision:
    """Batched matmul with the split on a batch dimension, a row of the left or a column of the right."""
    if call.kwargs or len(call.args) < 2:
        raise Fallback
    a, b = call.args[0], call.args[1]
    if not isinstance(a, Tensor) or not isinstance(b, Tensor) or a.dim() < 2 or b.dim() < 2:
        raise Fallback
    sa, sb = placement_of(a), placement_of(b)
    if (sa is not None and type(sa) is not Split) or (sb is not None and type(sb) is not Split):
        raise Fallback
    nd = max(a.dim(), b.dim())

    def batch_dim(t: Tensor, s: Split) -> int:
        if s.dim >= t.dim() - 2:
            raise Fallback
        return nd - t.dim() + s.dim

    found: Split | None = None
    if sa is not None:
        if sa.dim == a.dim() - 1:
            raise Fallback  # contraction dimension: a partial sum
        found = sa.moved(nd - 2) if sa.dim == a.dim() - 2 else sa.moved(batch_dim(a, sa))
    if sb is not None:
        if sb.dim == b.dim() - 2:
            raise Fallback
        mine = sb.moved(nd - 1) if sb.dim == b.dim() - 1 else sb.moved(batch_dim(b, sb))
        if found is not None and found != mine:
            raise Fallback
        found = mine
    assert found is not None
    moves: list[tuple[int, Any]] = []
    if found.dim < nd - 2:  # a batch split: the other operand takes its slice, or broadcasts along it
        for t, s in ((a, sa), (b, sb)):
            if s is None:
                local = found.dim - (nd - t.dim())
                # A batch of the split's whole size is cut, 1 included (``bmm`` does not broadcast; for
                # ``matmul`` a batch of 1 against a split of 1 is the same either way).
                if local >= 0 and t.shape[local] == found.size:
                    moves.append(_cut(call, t, local, found))
                elif local < 0 or t.shape[local] == 1:
                    moves.extend(whole_operand(call, t, found.group))
                else:
                    raise Fallback
    elif (found.dim == nd - 2 and sb is not None) or (found.dim == nd - 1 and sa is not None):
        raise Fallback
    else:  # rows of a split, or columns of b: the other operand is used whole by every rank
        for t in (a, b):
            moves.extend(whole_operand(call, t, found.group))
    return Decision(tuple(moves), out=found)


def _whole_others(call: Call, x: Tensor, split: Split) -> tuple[tuple[int, Any], ...]:
    """The moves of every tensor argument but ``x``: each used whole by every rank."""
    moves: list[tuple[int, Any]] = []
    for t in call.tensors():
        if t is not x:
            if placement_of(t) is not None:
                raise Fallback
            moves.extend(whole_operand(call, t, split.group))
    return tuple(moves)


def _linear(call: Call) -> Decision:
    """``F.linear`` of an input split on a batch dimension: every rank its rows, the weight whole."""
    x = call.bound()["self"]
    split = _split_of(x)
    if split is None or split.dim == x.dim() - 1:
        raise Fallback
    return Decision(_whole_others(call, x, split), out=split)


def _norm_last(call: Call) -> Decision:
    """layer_norm / rms_norm: normalize over the last dimensions, which must not be split."""
    x, split = first_split(call)
    shape = call.bound()["normalized_shape"]
    count = 1 if isinstance(shape, int) else len(shape)
    if split.dim >= x.dim() - count:
        raise Fallback
    return Decision(_whole_others(call, x, split), out=split)


def _sdpa(call: Call) -> Decision:
    """scaled_dot_product_attention with q, k and v split on the same head (batch) dimension.

    Grouped key/value heads (``enable_gqa``): each rank's query heads read that rank's key/value
    heads. A rank whose key/value heads go beyond what its query heads read (key/value heads held
    by replicas, or repeated to the query heads' number) narrows them to those. A mask is cut to
    this rank's heads or, when it broadcasts over them, used whole.
    """
    bound = call.bound()
    q, k, v = bound["query"], bound["key"], bound["value"]
    sq, sk, sv = _split_of(q), _split_of(k), _split_of(v)
    if sq is not None and placement_of(k) is None and placement_of(v) is None and sq.dim < q.dim() - 2 \
            and k.dim() == q.dim() and v.dim() == q.dim():
        return _sdpa_whole_key_value(call, q, k, v, sq, bound)
    if sq is None or sk is None or sv is None or sk != sv or not sq.dim == sk.dim < q.dim() - 2:
        raise Fallback
    ratio = sq.size // sk.size if sk.size else 0
    if ratio == 0 or sq.size % sk.size:
        raise Fallback
    moves: list[tuple[int, Any]] = []
    if sk.scaled(sq.dim, ratio, 1) != sq:
        moves += _narrowed_heads(call, k, v, sq, sk, ratio, bool(bound["enable_gqa"]))
    elif ratio > 1 and not bound["enable_gqa"]:
        raise Fallback
    moves += _mask_moves(call, bound["attn_mask"], q, sq)
    return Decision(tuple(moves), out=sq)


def _narrow_to(x: Tensor, *, dim: int, start: int, length: int) -> Tensor:
    return x.narrow(dim, start, length)


def _shared_narrow(x: Tensor, *, group: Any, dim: int, start: int, length: int) -> Tensor:
    return shared_copy(x, group).narrow(dim, start, length) if x.requires_grad else x.narrow(dim, start, length)


def _heads_read(qs: int, qn: int, ratio: int, gqa: bool) -> tuple[int, int]:
    """``(first, count)`` of the key/value heads that query heads ``[qs, qs + qn)`` read, ``ratio`` query heads to
    one key/value head; ``Fallback`` where their local attention would not pair them as the whole one does."""
    if not qn:
        return 0, 0
    lo, hi = qs // ratio, -(-(qs + qn) // ratio)
    if qn % (hi - lo):
        raise Fallback
    group = qn // (hi - lo)
    # (Without ``enable_gqa`` one key/value head still meets several query heads: it broadcasts.)
    if any((qs + i) // ratio - lo != i // group for i in range(qn)) or (group > 1 and not gqa and hi - lo != 1):
        raise Fallback  # the local heads would not meet as the whole ones do
    return lo, hi - lo


def _sdpa_whole_key_value(call: Call, q: Tensor, k: Tensor, v: Tensor, sq: Split, bound: dict[str, Any]) -> Decision:
    """Split queries attending whole keys and values (fewer key/value heads than ranks, kept whole: multi-query
    attention): each rank narrows them to the key/value heads its query heads read (the whole tensors' gradients
    summed over the ranks). Every rank checks every rank's heads, so that all decide alike."""
    heads, kv_heads = sq.size, k.shape[sq.dim]
    if kv_heads == 0 or heads % kv_heads or v.shape[sq.dim] != kv_heads or (
            heads != kv_heads and kv_heads != 1 and not bound["enable_gqa"]):
        raise Fallback  # (one key/value head broadcasts over every query head)
    ratio = heads // kv_heads
    read = [_heads_read(qs, qn, ratio, bool(bound["enable_gqa"])) for qs, qn in sq.intervals]
    start, length = read[_state.rank(sq.group)]
    narrow = functools.partial(_shared_narrow, group=sq.group, dim=sq.dim, start=start, length=length)
    moves: list[tuple[int, Any]] = [(call.index(k), narrow), (call.index(v), narrow)]
    moves += _mask_moves(call, bound["attn_mask"], q, sq)
    return Decision(tuple(moves), out=sq)


def _mask_moves(call: Call, mask: Any, q: Tensor, sq: Split) -> list[tuple[int, Any]]:
    """A mask cut to this rank's heads or, when it broadcasts over them, used whole by every rank."""
    if not isinstance(mask, Tensor):
        return []
    if placement_of(mask) is not None:
        raise Fallback
    local = sq.dim - (q.dim() - mask.dim())
    if local >= 0 and mask.shape[local] == sq.size:
        return [_cut(call, mask, local, sq)]
    if local < 0 or mask.shape[local] == 1:
        return list(whole_operand(call, mask, sq.group))
    raise Fallback


def _narrowed_heads(call: Call, k: Tensor, v: Tensor, sq: Split, sk: Split, ratio: int,
                    gqa: bool) -> list[tuple[int, Any]]:
    """The moves narrowing this rank's key and value heads to the ones its query heads read (a local view,
    its gradient zero elsewhere: a share of the whole, as replicas' are); ``Fallback`` if a rank does not hold
    them (every rank checks every rank's, so that all decide alike)."""
    found = []
    for (qs, qn), (ks, kn) in zip(sq.intervals, sk.intervals):
        lo, count = _heads_read(qs, qn, ratio, gqa)
        if count and (lo < ks or lo + count > ks + kn):
            raise Fallback
        found.append((lo - ks if count else 0, count))
    start, length = found[_state.rank(sq.group)]
    narrow = functools.partial(_narrow_to, dim=sk.dim, start=start, length=length)
    return [(call.index(k), narrow), (call.index(v), narrow)]


# -- packed activations -----------------------------------------------------------------------------

def _packed_parts(x: Tensor, *args: Any, sizes: tuple[int, ...], dim: int, **kwargs: Any) -> tuple[Tensor, ...]:
    return tuple(x.split(list(sizes), dim))


def _packed_narrow(x: Tensor, *args: Any, dim: int, start: int, length: int, **kwargs: Any) -> Tensor:
    return x.narrow(dim, start, length)


def packed_parts(call: Call) -> Decision:
    """``split``/``chunk`` of a packed tensor at its slices' boundaries (one ordinary split per part),
    or ``qkv[..., low:high]`` (one slice of each rank's)."""
    x = call.args[0] if call.args else None
    packed = placement_of(x)
    if type(packed) is not Packed or not isinstance(x, Tensor):
        raise Fallback
    rank = _state.rank(packed.group)
    if call.name == "getitem":
        return _packed_getitem(x, call.args[1], packed, rank)
    named = call.bound()
    dim = named.get("dim", 0)
    total = packed.size
    if not isinstance(dim, int) or norm_dim(dim, x.dim()) != packed.dim:
        raise Fallback
    if call.name == "chunk":
        step = -(-total // named["chunks"])
        bounds = [(i, min(i + step, total)) for i in range(0, total, step)]
    else:
        sizes = named["split_size"]
        if isinstance(sizes, int):
            bounds = [(i, min(i + sizes, total)) for i in range(0, total, sizes)]
        else:
            edges = [0]
            for n in sizes:
                edges.append(edges[-1] + n)
            bounds = list(zip(edges, edges[1:]))
    per_part: list[list[tuple[int, int]]] = [[] for _ in bounds]
    for slices in packed.pieces:
        for j, (low, high) in enumerate(bounds):
            inside = [(s, n) for s, n in slices if low <= s and s + n <= high]
            if sum(n for a, n in slices if a < high and a + n > low) != sum(n for _, n in inside) or len(inside) != 1:
                raise Fallback  # a slice straddles a boundary, or a part holds several slices
            per_part[j].append((inside[0][0] - low, inside[0][1]))
    splits = tuple(Split(packed.dim, tuple(part), packed.group) for part in per_part)
    return Decision(run=functools.partial(_packed_parts, sizes=tuple(part[rank][1] for part in per_part),
                                          dim=packed.dim), out=splits)


def _packed_getitem(x: Tensor, index: Any, packed: Packed, rank: int) -> Decision:
    index = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in index if i is Ellipsis) > 1 or any(not (i is Ellipsis or isinstance(i, slice)) for i in index):
        raise Fallback
    before = index.index(Ellipsis) if Ellipsis in index else len(index)
    positions = list(range(before)) + [x.dim() - (len(index) - j) for j in range(before + 1, len(index))]
    picked = None
    for position, i in zip(positions, (i for i in index if i is not Ellipsis)):
        if i == slice(None):
            continue
        if position != packed.dim or picked is not None:
            raise Fallback
        picked = i
    if picked is None or picked.step not in (None, 1):
        raise Fallback
    low, high, _ = picked.indices(packed.size)
    part, offset = [], 0
    for r, slices in enumerate(packed.pieces):
        inside = [(s, n) for s, n in slices if low <= s and s + n <= high]
        if len(inside) != 1 or sum(n for s, n in slices if s < high and s + n > low) != inside[0][1]:
            raise Fallback  # a slice straddles a boundary, or the part holds several of a rank's slices
        part.append((inside[0][0] - low, inside[0][1]))
        if r == rank:
            offset = sum(n for s, n in slices if s < inside[0][0])
    return Decision(run=functools.partial(_packed_narrow, dim=packed.dim, start=offset, length=part[rank][1]),
                    out=Split(packed.dim, tuple(part), packed.group))


_ELEMENTWISE = {
    # Elementwise for shardkit's purpose though ATen does not tag them pointwise (composites, casts, copies).
    "where", "masked_fill", "masked_fill_", "true_divide", "rsub", "hardswish", "logsigmoid", "softsign",
    "tanhshrink", "float", "half", "bfloat16", "double", "to", "type_as", "contiguous", "detach",
    "requires_grad_", "fill_", "zero_", "__rsub__", "__radd__", "__rmul__", "__rtruediv__", "__rdiv__",
    "__rpow__", "__add__", "__sub__", "__mul__", "__truediv__", "__div__", "__neg__", "__pow__", "__iadd__",
    "__isub__", "__imul__", "__itruediv__", "__and__", "__or__", "__xor__", "__invert__", "__eq__", "__ne__",
    "__lt__", "__le__", "__gt__", "__ge__", "__abs__", "__mod__", "polar", "complex",
}

declare(lambda: _ELEMENTWISE | pointwise_names(), Split, elementwise)
declare(lambda: _ELEMENTWISE | pointwise_names(), Strided, elementwise)
declare(("min", "max"), Split, _min_max)
declare(("dropout",), Split, _dropout)
declare(("view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as"), Split, reshape)
declare(("transpose", "swapaxes", "swapdims", "permute", "t"), Split, _transpose)
declare(("T", "mT", "H", "mH", "real", "imag"), Split, _getter)
declare(("view_as_complex", "view_as_real"), Split, _complex_view)
declare(("__getitem__",), Split, _getitem)
declare(("expand", "expand_as", "broadcast_to"), Split, _expand)
declare(("zeros", "ones", "empty", "full", "new_zeros", "new_ones", "new_empty", "new_full"), Split, _factory)
declare(("softmax", "log_softmax", "cumsum", "cat", "concat", "concatenate", "stack", "split", "chunk", "unbind",
         "tensor_split"), Split, along_dim)
declare(("sum", "mean", "amax", "amin", "var", "std", "logsumexp"), Split, _reduce)
declare(("matmul", "__matmul__", "bmm"), Split, _matmul)
declare(("linear",), Split, _linear)
declare(("layer_norm", "rms_norm"), Split, _norm_last)
declare(("scaled_dot_product_attention",), Split, _sdpa)
declare(("index_copy_", "copy_"), Split, _write_split)
declare(("__setitem__",), Split, _setitem)
declare(("roll",), Split, _roll)
declare(("split", "chunk", "__getitem__"), Packed, packed_parts)
