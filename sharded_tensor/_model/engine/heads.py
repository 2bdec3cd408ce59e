"""Rules for the ops a linear-attention layer runs on split heads (Qwen3-Next's chunked gated delta rule).

The gated delta rule runs every head on its own: its queries and keys repeated to the value
heads, batched products and triangular solves per head and chunk, a state per head. On a rank
holding some heads, each op computes those heads, slice by slice:

* ``repeat_interleave`` of split heads along the split dimension (each rank's heads repeated:
  the split scaled by the repeat count, as grouped key heads are repeated to value heads) or
  along another dimension;
* ``torch.linalg.solve_triangular`` with the split on a batch dimension of the operands (a whole
  operand cut to this rank's slice, or used whole where it broadcasts), or on the columns of
  the right-hand side (its rows with ``left=False``), which are solved independently;
* ``zeros_like``, ``ones_like``, ``empty_like``, ``full_like`` of a split tensor: this rank's
  slice of the tensor the unsharded program makes (the output buffer, the initial state);
* reductions of a strided tensor over its other dimensions (the gated norm over each head's
  features, with heads merged into the rows): its rows stay where they are.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor

from . import split as _split
from .placements import Split, SplitSize, Strided, placement_of
from .rules import Call, Decision, Fallback, declare, norm_dim

__all__: list[str] = []


def _repeat_interleave(call: Call) -> Decision:
    """``x.repeat_interleave(repeats, dim)`` with an int ``repeats``: along the split, each rank's slice repeated."""
    x, split = _split.first_split(call)
    bound = call.bound()
    repeats, dim = bound.get("repeats"), bound.get("dim")
    if type(repeats) is not int or not isinstance(dim, int) or repeats < 0:
        raise Fallback  # per-element counts, a size read off a split dimension, or the flattened tensor
    d = norm_dim(dim, x.dim())
    if d != split.dim:
        return Decision(out=split)
    if bound.get("output_size") is not None:
        raise Fallback  # the whole output's size: this rank's is another
    scaled = split.scaled(d, repeats, 1)
    if scaled is None or not repeats:
        raise Fallback
    return Decision(out=scaled)


def _solve_triangular(call: Call) -> Decision:
    """``torch.linalg.solve_triangular(A, B)``: split on a batch dimension of the placed operands, or on B's
    columns (``left=True``) or rows (``left=False``) with A whole."""
    bound = call.bound()
    a, b, left = bound["self"], bound["B"], bound.get("left", True)
    if not isinstance(a, Tensor) or not isinstance(b, Tensor) or a.dim() < 2 or b.dim() < 2 or not isinstance(
            left, bool) or any(type(v) is SplitSize for v in call.leaves):
        raise Fallback
    sa, sb = placement_of(a), placement_of(b)
    if (sa is not None and type(sa) is not Split) or (sb is not None and type(sb) is not Split):
        raise Fallback
    nd = max(a.dim(), b.dim())
    independent = b.dim() - 1 if left else b.dim() - 2  # B's columns (rows) are solved each on its own
    found: Split | None = None
    for t, s in ((a, sa), (b, sb)):
        if s is None:
            continue
        if s.dim < t.dim() - 2:
            mine = s.moved(nd - t.dim() + s.dim)
        elif t is b and s.dim == independent and sa is None:
            mine = s.moved(nd - b.dim() + s.dim)
        else:
            raise Fallback  # the triangular matrix's rows or columns, or B's solved dimension
        if found is not None and mine != found:
            raise Fallback
        found = mine
    assert found is not None
    moves: list[tuple[int, Any]] = []
    for t, s in ((a, sa), (b, sb)):
        if s is not None:
            continue
        local = found.dim - (nd - t.dim())
        if found.dim < nd - 2 and local >= 0 and t.shape[local] != 1:
            if t.shape[local] != found.size:
                raise Fallback
            moves.append((call.index(t), functools.partial(found.cut, dim=local)))
        else:
            moves.extend(_split.whole_operand(call, t, found.group))  # broadcast, or the triangular matrix
    return Decision(tuple(moves), out=found)


def _like(call: Call) -> Decision:
    """``zeros_like(x)`` and its kin of a split ``x``: this rank's slice of the whole tensor they make."""
    x, split = _split.first_split(call)
    if any(isinstance(v, Tensor) and v is not x and placement_of(v) is not None for v in call.leaves) \
            or any(type(v) is SplitSize for v in call.leaves):
        raise Fallback
    return Decision(out=split)


def _strided_reduce(call: Call) -> Decision:
    """sum / mean / amax / amin / var / std / logsumexp of a strided tensor over dimensions other than its
    strided one."""
    x = call.args[0] if call.args else None
    placement = placement_of(x)
    if type(placement) is not Strided or not isinstance(x, Tensor) or any(type(v) is SplitSize
                                                                         for v in call.leaves):
        raise Fallback
    bound = call.bound()
    dims = bound.get("dim")
    if dims is None or isinstance(dims, Tensor) or (isinstance(dims, (list, tuple)) and not dims):
        raise Fallback  # every dimension
    normed = sorted(norm_dim(d, x.dim()) for d in ([dims] if isinstance(dims, int) else dims))
    if placement.dim in normed or not isinstance(call.meta_out(), Tensor):
        raise Fallback
    keepdim = bool(bound.get("keepdim", False))
    shift = 0 if keepdim else sum(1 for d in normed if d < placement.dim)
    return Decision(out=placement.moved(placement.dim - shift))


declare(("repeat_interleave",), Split, _repeat_interleave)
declare(("linalg_solve_triangular",), Split, _solve_triangular)
declare(("zeros_like", "ones_like", "empty_like", "full_like"), Split, _like)
declare(("sum", "mean", "amax", "amin", "var", "std", "logsumexp"), Strided, _strided_reduce)
