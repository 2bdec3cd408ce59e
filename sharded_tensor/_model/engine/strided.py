"""Rules for a head split that survives ``reshape(batch * num_heads, ...)``: the strided split (``Strided``).

BLOOM (and code written like it) merges the batch with the heads before its batched matmuls::

    q = q.reshape(batch * num_heads, seq, head_dim)      # q split on its heads
    scores = alibi.baddbmm(q, k.transpose(-1, -2), ...)  # [batch * num_heads, seq, seq]
    probs = softmax(scores.view(batch, num_heads, seq, seq) + mask)
    context = torch.bmm(probs.view(batch * num_heads, seq, seq), v)

The merged dimension is split in blocks: for each batch row, this rank holds its heads (the
Split rule of ``view``/``reshape`` makes such a tensor, see ``split.reshape``). These ops keep
it so, each on its local blocks:

* reshapes: a strided tensor reshaped to sizes that separate the blocks again
  (``view(batch, num_heads, ...)``) gives an ordinary split;
* transposes and permutations (the strided dimension moves);
* ``bmm``, ``baddbmm``, ``matmul`` with the strided dimension a batch dimension: every strided
  operand split alike; a whole operand of the full size along it (BLOOM's ``alibi``,
  ``[batch * num_heads, 1, seq]``) is cut to this rank's rows of each block (its gradient
  gathered back), one that broadcasts along it is used whole (its gradient summed).

The model's code reads a strided tensor's sizes as the unsharded program would (BLOOM's
``x.shape[0] // num_heads`` is the batch): :func:`global_sizes`. Any other op gathers the
blocks first (one all-gather), exact forward and backward as every fallback.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from . import split as _split
from . import state as _state
from .placements import Split, Strided, placement_of, tag
from .rules import Call, Decision, Fallback, declare

__all__ = ["global_sizes"]


def _strided_of(x: Any) -> Strided:
    found = placement_of(x)
    if type(found) is not Strided:
        raise Fallback
    return found


def _unmerged_then(x: Tensor, *args: Any, placement: Strided, inner: Any, **kwargs: Any) -> Tensor:
    return inner(placement.unmerged(x), *args, **kwargs)  # type: ignore[no-any-return]


def _reshape(call: Call) -> Decision:
    """view / reshape of a strided tensor: its blocks unflattened (an ordinary split), then reshaped."""
    x = call.args[0] if call.args else None
    placement = _strided_of(x)
    assert isinstance(x, Tensor)
    if any(isinstance(a, Tensor) for a in call.args[1:]):
        raise Fallback
    local = list(x.shape)
    local[placement.dim: placement.dim + 1] = [placement.blocks, x.shape[placement.dim] // placement.blocks]
    split = Split(placement.dim + 1, placement.intervals, placement.group)
    unmerged = tag(torch.empty(local, dtype=x.dtype, device="meta"), split)
    inner_call = Call(call.func, (unmerged, *call.args[1:]), call.kwargs, [unmerged, *call.leaves[1:]], call.grad)
    decision = _split.reshape(inner_call)
    if decision.moves or decision.run is None:
        raise Fallback
    return Decision(run=functools.partial(_unmerged_then, placement=placement, inner=decision.run), out=decision.out)


def _permuted(call: Call) -> Decision:
    """transpose / permute / t: where the strided dimension goes, read from the op on distinct sizes."""
    x = call.args[0]
    placement = _strided_of(x)
    probe = torch.empty([d + 2 for d in range(x.dim())], device="meta")
    args, kwargs = call.rebuilt({0: probe})
    try:
        sizes = list(call.func(*args, **kwargs).shape)
    except (RuntimeError, ValueError, TypeError, IndexError):
        raise Fallback from None
    return Decision(out=placement.moved(sizes.index(placement.dim + 2)))


def _batched(call: Call) -> Decision:
    """bmm / baddbmm / matmul with the strided dimension a batch dimension of every operand."""
    if call.name == "matmul" and getattr(call.func, "__name__", "") == "__rmatmul__":
        raise Fallback
    tensors = call.tensors()
    placements = {placement_of(t) for t in tensors} - {None}
    if len(placements) != 1:
        raise Fallback
    placement = placements.pop()
    ndim = max(t.dim() for t in tensors)
    if type(placement) is not Strided or placement.dim >= ndim - 2:
        raise Fallback
    moves: list[tuple[int, Any]] = []
    rank = _state.rank(placement.group)
    replaced = {}
    for t in tensors:
        if placement_of(t) is not None:
            if t.dim() != ndim:
                raise Fallback
            continue
        local = placement.dim - (ndim - t.dim())
        # The strided dimension's whole extent is cut, 1 included (``bmm``'s batches do not broadcast).
        if local >= 0 and t.shape[local] == placement.extent():
            moves.append((call.index(t), functools.partial(placement.cut, dim=local)))
            shape = list(t.shape)
            shape[local] = placement.blocks * placement.intervals[rank][1]  # this rank's rows of each block
            replaced[call.index(t)] = torch.empty(shape, dtype=t.dtype, device="meta")
        elif local < 0 or t.shape[local] == 1:
            moves.extend(_split.whole_operand(call, t, placement.group))
        else:
            raise Fallback
    out = call.meta_out(replaced)
    if out is not None and (not isinstance(out, Tensor) or out.dim() != ndim):
        raise Fallback
    return Decision(tuple(moves), out=placement)


def global_sizes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x.shape``, ``x.size()``, ``x.numel()`` of a strided tensor as the unsharded program sees them."""
    x = args[0]
    placement = _strided_of(x)
    shape = list(x.shape)
    shape[placement.dim] = placement.blocks * placement.size
    owner = getattr(getattr(func, "__self__", None), "__name__", "")
    name = owner if owner == "shape" else getattr(func, "__name__", "")
    if name in ("shape", "size"):
        whole = torch.Size(shape)
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        return whole if dim is None else whole[dim]
    if name in ("numel", "nelement"):
        return math.prod(shape)
    return func(*args, **kwargs)


declare(("view", "reshape"), Strided, _reshape)
declare(("transpose", "swapaxes", "swapdims", "permute", "t"), Strided, _permuted)
declare(("bmm", "baddbmm", "matmul", "__matmul__"), Strided, _batched)
