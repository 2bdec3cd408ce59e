"""Rules for pending sums (``Partial``): a row-parallel result left unreduced until something needs it whole.

A Linear split on its input features (``o_proj``, ``down_proj``) computes on each rank one
addend of its output. Inside a zone it hands out that addend tagged ``Partial`` instead of
all-reducing it at once, and the ops below keep it pending because they are linear in it:

========================================  ==========================================================
op on a pending ``p`` (``r`` whole)       each rank computes / gradient (``g``: the output's)
========================================  ==========================================================
``p + q``, ``p - q`` (both pending)       its addends' sum; ``g`` for each (replicated)
``p + r``, ``r - p``, ``p + 1``           ``r`` added on rank 0 only; ``r`` gets ``g`` on every rank
``p * c``, ``p / c``, ``-p``              its addend scaled (``c`` a number, or a whole tensor that
                                          needs no gradient)
views, reshapes, transposes, indexing     its addend reshaped
``dropout`` with ``p=0`` or in eval       the identity
========================================  ==========================================================

An in-place op that none of these keeps pending (``p.mul_(w)``, ``w`` needing a gradient)
runs on the sum, and ``p`` becomes an addend of the result again (``dispatch``'s fallback).

Any other op sums the addends first (``Partial.whole``: one all-reduce forward, the identity
backward), once per tensor: the sum is kept on the tensor until it is written to, and once
taken it is what every later op reads (the dispatcher puts it in place of the tensor before
deciding), so a norm's ``x.pow(2)`` sums ``x`` and its ``x * rsqrt(...)`` reads the sum
instead of scaling the addends, which would need a second all-reduce. Reductions (``mean``,
``sum``) sum first for the same reason: their input is nearly always used again (a
LayerNorm's ``x - x.mean()``). So ``attention(x) + mlp(x) + x`` (parallel attention and MLP:
GPT-J, GPT-NeoX, Cohere, Falcon) costs one all-reduce instead of two.

Why the gradients are exact: the gradient of a pending sum is the gradient of the whole value,
replicated: the all-reduce that ends it has the identity as its backward, and every op above
maps a replicated gradient to a replicated one. A whole tensor added once still gets that
whole gradient on every rank (the rank that did not add it too: ``Partial.add_once``). A whole
tensor that needs a gradient and scales a pending sum (Qwen2-MoE's gate on its shared expert)
sums it first: scaling the addends would leave each rank a share of its gradient to all-reduce
in backward, so a pending sum never costs a collective more than summing at once.

:func:`linear_in_one` is also the named rule ``"linear"`` of ``st.register_split_rule``: an op
linear in its one pending input.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .placements import Partial, SplitSize, placement_of
from .rules import Call, Decision, Each, Fallback, declare, in_place

__all__ = ["linear_in_one"]


def _only_pending(values: list[Any]) -> Partial:
    """The one pending placement among ``values``; ``Fallback`` on any other tag or two groups."""
    found = None
    for v in values:
        placement = placement_of(v)
        if placement is None:
            continue
        if type(placement) is not Partial or (found is not None and placement != found):
            raise Fallback
        found = placement
    assert found is not None
    return found


def _once(call: Call, position: int, pending: Partial) -> tuple[int, Any]:
    """The move of a whole value (positional argument ``position``) added to a pending sum: kept on rank 0,
    zero elsewhere."""
    value = call.args[position]
    if isinstance(value, bool) or not isinstance(value, (Tensor, int, float, complex)) or type(value) is SplitSize:
        raise Fallback  # a split dimension's size added: summed first, the size read whole
    return call.arg_index(position), pending.add_once


def _add(call: Call) -> Decision:
    """add / sub in their forms (``+``, ``-``, reflected, in place): pending + pending, pending + whole once."""
    bound = call.bound()
    if "other" not in bound or isinstance(bound.get("alpha", 1), Tensor):
        raise Fallback
    a, b = bound["self"], bound["other"]
    if len(call.args) < 2 or call.args[0] is not a or call.args[1] is not b:
        raise Fallback  # given by name: rare, summed first
    pending = _only_pending([a, b])
    if placement_of(a) is None and in_place(call.func):
        raise Fallback  # a whole tensor updated in place must receive whole values
    moves = [_once(call, i, pending) for i, v in enumerate((a, b)) if placement_of(v) is None]
    return Decision(tuple(moves), out=pending)


def _scale(call: Call) -> Decision:
    """mul / div by a whole tensor or number (the pending one the numerator): each addend scaled."""
    bound = call.bound()
    if "other" not in bound or bound.get("rounding_mode") is not None:
        raise Fallback
    a, b = bound["self"], bound["other"]
    pending = _only_pending([a, b])
    pending_a, pending_b = placement_of(a) is not None, placement_of(b) is not None
    if pending_a == pending_b or (pending_b and call.name.startswith("div")):
        raise Fallback  # a product of two sums, or a division by one
    if in_place(call.func) and not pending_a:
        raise Fallback
    scale = b if pending_a else a
    if isinstance(scale, Tensor) and scale.requires_grad and call.grad:
        # Its gradient would be a per-rank part to all-reduce in backward: summing first costs no more.
        raise Fallback
    return Decision(out=pending)


def linear_in_one(call: Call) -> Decision:
    """Ops linear in their one pending input, with no other placed tensor (shapes, negation, copies)."""
    x = call.args[0] if call.args else None
    pending = placement_of(x)
    if type(pending) is not Partial or not isinstance(x, Tensor):
        raise Fallback
    if any(placement_of(t) is not None for t in call.tensors() if t is not x):
        raise Fallback
    out = call.meta_out()
    if out is None:  # an op with no meta kernel (a custom op without a fake one): one output, as said
        return Decision(out=pending)
    if isinstance(out, Tensor):
        if not out.is_floating_point() or out.dtype != x.dtype:
            raise Fallback  # a cast: sum in the addends' own precision first
        return Decision(out=pending)
    if isinstance(out, (tuple, list)) and all(isinstance(o, Tensor) for o in out):
        return Decision(out=Each(pending))
    raise Fallback


def _dropout(call: Call) -> Decision:
    """Dropout that drops nothing (``p=0``, or not training) is the identity; any other sums first."""
    bound = call.bound()
    if bound.get("p", 0.5) != 0 and bound.get("train", bound.get("training", True)):
        raise Fallback
    return linear_in_one(call)


_SHAPES = ("view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as", "transpose",
           "swapaxes", "swapdims", "permute", "t", "contiguous", "clone", "narrow", "split", "chunk", "unbind",
           "expand", "expand_as", "__getitem__", "neg", "__neg__", "negative", "to", "type_as", "float", "detach")

declare(("add", "sub", "subtract", "__add__", "__radd__", "__sub__", "__rsub__", "add_", "sub_", "__iadd__",
         "__isub__"), Partial, _add)
declare(("mul", "multiply", "div", "divide", "true_divide", "__mul__", "__rmul__", "__truediv__", "__div__", "mul_",
         "div_", "__imul__", "__itruediv__"), Partial, _scale)
declare(_SHAPES, Partial, linear_in_one)
declare(("dropout",), Partial, _dropout)
