"""Pending sums inside a zone: a row-parallel result left unreduced until something needs it whole.

A Linear split on its input features (``o_proj``, ``down_proj``) computes on each rank one
addend of its output. Inside a zone it hands out that addend tagged :class:`Partial`
instead of all-reducing it at once, and the ops below keep it pending because they are linear
in it:

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

Any other op sums the addends first (``reduce_from_ranks``: one all-reduce forward, the
identity backward), once per tensor: the sum is kept on the tensor until it is written to,
and once taken it is what every later op uses (a norm's ``x.pow(2)`` sums ``x``, its ``x *
rsqrt(...)`` then reads the sum instead of scaling the addends, which would need a second).
Reductions (``mean``, ``sum``) sum first for the same reason: their input is nearly always
used again (a LayerNorm's ``x - x.mean()``).
So ``attention(x) + mlp(x) + x`` (parallel attention and MLP: GPT-J, GPT-NeoX, Cohere,
Falcon) costs one all-reduce instead of two.

Why the gradients are exact: the gradient of a pending sum is the gradient of the whole
value, replicated: the all-reduce that ends it has the identity as its backward, and every
op above maps a replicated gradient to a replicated one. A whole tensor added once still gets
that whole gradient on every rank (the rank that did not add it too, which is what
``_Once`` does). A whole tensor that needs a gradient and scales a pending sum (Qwen2-MoE's
gate on its shared expert) sums it first: scaling the addends would leave each rank a share
of its gradient to all-reduce in backward, so a pending sum never costs a collective more
than summing at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from _shardkit import comm as _comm

from . import zones as _zones
from .functional import reduce_from_ranks
from .signatures import aten_name, bind

__all__ = ["Partial", "pending", "add_once"]

Partial = _zones.Partial
_SUM = _zones._SUM  # (version of the addend when summed, the sum)


def pending(tensor: torch.Tensor, group: _comm.ProcessGroup) -> torch.Tensor:
    """Inside a zone, ``tensor`` (this rank's addend) tagged as a pending sum; outside, the sum (all-reduce)."""
    if not _zones.in_zone() or _zones.rank_and_world(group)[1] == 1:
        return reduce_from_ranks(tensor, group)
    tag = _PARTIALS.get(group)
    if tag is None:
        tag = _PARTIALS[group] = Partial(group=group)
    return _zones.tag(tensor, tag)


# One tag per group: every row-parallel result of a forward is tagged alike, built once.
_PARTIALS: dict[_comm.ProcessGroup, Partial] = {}


def _summed(tensor: torch.Tensor, tag: Partial) -> torch.Tensor:
    """The sum over the ranks of a pending ``tensor``: one all-reduce, kept until ``tensor`` is written to."""
    cached = tensor.__dict__.get(_SUM)
    if cached is not None and cached[0] == tensor._version:
        return cached[1]  # type: ignore[no-any-return]
    with _zones.outside_propagation():
        total = reduce_from_ranks(tensor, tag.group)
    setattr(tensor, _SUM, (tensor._version, total))
    if _zones._STATE.recorders:
        _zones.summed_pending(tensor)
    return total


class _Once(torch.autograd.Function):
    """``t`` on the rank that adds it, zeros elsewhere; the gradient passes whole on every rank."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, keep: bool) -> torch.Tensor:
        return t.view_as(t) if keep else torch.zeros_like(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def add_once(value: Any, group: _comm.ProcessGroup) -> Any:
    """``value`` (whole on every rank) as the addend of a pending sum: itself on rank 0, zero elsewhere."""
    keep = _zones.rank_and_world(group)[0] == 0
    if isinstance(value, torch.Tensor):
        if keep:
            return value  # itself, its gradient whole: what ``_Once`` does on this rank, without its node
        if not (value.requires_grad and torch.is_grad_enabled()):
            with _zones.outside_propagation():
                return torch.zeros_like(value)
        with _zones.outside_propagation():
            return _Once.apply(value, keep)
    if isinstance(value, bool) or not isinstance(value, (int, float, complex)):
        raise _zones._Fallback
    return value if keep else type(value)(0)


def _tag_of(value: Any) -> Any:
    # A tag is an attribute of the tensor object itself: its ``__dict__`` answers without a failed lookup.
    return value.__dict__.get(_zones._TAG) if isinstance(value, torch.Tensor) else None


def _only_pending(values: list[Any]) -> Partial:
    """The one group of the pending tensors among ``values``; fall back on any other tag or two groups."""
    found = None
    for v in values:
        tag = _tag_of(v)
        if tag is None:
            continue
        if not isinstance(tag, Partial) or (found is not None and tag != found):
            raise _zones._Fallback
        found = tag
    assert found is not None
    return found


def _add(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """add / sub in their forms (``+``, ``-``, reflected, in place): pending + pending, pending + whole once."""
    if not kwargs and len(args) == 2 and isinstance(args[0], torch.Tensor):
        # The usual ``x + y``: what ``bind`` gives (alpha 1), without binding.
        a, b = args
        tag_a, tag_b = _tag_of(a), _tag_of(b)
        if tag_a is not None and tag_b is not None:
            if type(tag_a) is not Partial or tag_b != tag_a:
                raise _zones._Fallback
            return _zones.tag(func(a, b), tag_a)
        tag = tag_a if tag_b is None else tag_b
        if type(tag) is not Partial:
            raise _zones._Fallback
        if tag_a is None:
            if _zones._in_place(func):
                raise _zones._Fallback  # a whole tensor updated in place must receive whole values
            a = add_once(a, tag.group)
        else:
            b = add_once(b, tag.group)
        return _zones.tag(func(a, b), tag)
    bound = bind(func, args, kwargs)
    if bound is None or "other" not in bound:
        raise _zones._Fallback
    a, b = bound["self"], bound["other"]
    if isinstance(bound.get("alpha", 1), torch.Tensor):
        raise _zones._Fallback
    if len(args) < 2 or args[0] is not a or args[1] is not b:
        raise _zones._Fallback  # given by name: rare, summed first
    tag = _only_pending([a, b])
    if _tag_of(a) is None and _zones._in_place(func):
        raise _zones._Fallback  # a whole tensor updated in place must receive whole values
    values = list(args)
    if _tag_of(a) is None:
        values[0] = add_once(a, tag.group)
    if _tag_of(b) is None:
        values[1] = add_once(b, tag.group)
    out = func(*values, **kwargs)
    return _zones.tag(out, tag)


def _scale(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """mul / div by a whole tensor or number (the pending one the numerator): each addend scaled."""
    bound = bind(func, args, kwargs)
    if bound is None or "other" not in bound or bound.get("rounding_mode") is not None:
        raise _zones._Fallback
    a, b = bound["self"], bound["other"]
    tag = _only_pending([a, b])
    pending_a, pending_b = _tag_of(a) is not None, _tag_of(b) is not None
    if pending_a == pending_b or (pending_b and aten_name(func).startswith("div")):
        raise _zones._Fallback  # a product of two sums, or a division by one
    if _zones._in_place(func) and not pending_a:
        raise _zones._Fallback
    scale = b if pending_a else a
    if isinstance(scale, torch.Tensor) and scale.requires_grad and torch.is_grad_enabled():
        # Its gradient would be a per-rank part to all-reduce in backward: summing first costs no more.
        raise _zones._Fallback
    out = func(*args, **kwargs)
    return _zones.tag(out, tag)


def _linear_in_one(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Ops linear in their one pending input, with no other tensor (shapes, sums, negation, copies)."""
    tag = _tag_of(args[0]) if args else None
    if tag is None:
        raise _zones._Fallback
    x = args[0]
    for v in args[1:]:
        if isinstance(v, torch.Tensor):
            if _tag_of(v) is not None:
                raise _zones._Fallback
        elif isinstance(v, (list, tuple)) and any(isinstance(y, torch.Tensor) and _tag_of(y) is not None for y in v):
            raise _zones._Fallback
    if kwargs and any(_tag_of(v) is not None for v in kwargs.values()):
        raise _zones._Fallback
    out = func(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        if not out.is_floating_point() or out.dtype != x.dtype:
            raise _zones._Fallback  # a cast: sum in the addends' own precision first
        return _zones.tag(out, tag)
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return type(out)(_zones.tag(o, tag) for o in out)
    raise _zones._Fallback


def _dropout(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Dropout that drops nothing (``p=0``, or not training) is the identity; any other sums first."""
    bound = bind(func, args, kwargs)
    if bound is None or (bound.get("p", 0.5) != 0 and bound.get("train", bound.get("training", True))):
        raise _zones._Fallback
    return _linear_in_one(func, args, kwargs)


_SHAPES = ("view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as", "transpose",
           "swapaxes", "swapdims", "permute", "t", "contiguous", "clone", "narrow", "split", "chunk", "unbind",
           "expand", "expand_as", "__getitem__", "neg", "__neg__", "negative", "to", "type_as", "float", "detach")
_NAMED = {
    **{name: _add for name in ("add", "sub", "subtract", "__add__", "__radd__", "__sub__", "__rsub__", "add_",
                               "sub_", "__iadd__", "__isub__")},
    **{name: _scale for name in ("mul", "multiply", "div", "divide", "true_divide", "__mul__", "__rmul__",
                                 "__truediv__", "__div__", "mul_", "div_", "__imul__", "__itruediv__")},
    **{name: _linear_in_one for name in _SHAPES},
    "dropout": _dropout,
}


@functools.cache
def _rules() -> dict[Any, Callable[..., Any]]:
    return {obj: rule for name, rule in _NAMED.items() for obj in _zones._objects(name)}


def _known_sum(value: Any) -> Any:
    """The sum of a pending ``value`` if it was taken already (and ``value`` not written since), else ``value``."""
    if isinstance(value, torch.Tensor) and isinstance(_tag_of(value), Partial):
        cached = getattr(value, _SUM, None)
        if cached is not None and cached[0] == value._version:
            return cached[1]
    return value


def _rule(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # A sum already taken is used whole: keeping its addends pending would all-reduce them again.
    flat = (*args, *kwargs.values()) if kwargs else args
    known: list[Any] | None = None
    still_pending = other_tag = False
    for i, x in enumerate(flat):  # the usual call, tensors and numbers side by side: one pass, no pytree
        if isinstance(x, torch.Tensor):
            attrs = x.__dict__
            tag = attrs.get(_zones._TAG) if attrs else None
            if tag is None:
                continue
            if not isinstance(tag, Partial):
                other_tag = True
                continue
            cached = attrs.get(_SUM)
            if cached is not None and cached[0] == x._version:
                if known is None:
                    known = list(flat)
                known[i] = cached[1]
            else:
                still_pending = True
        elif isinstance(x, (list, tuple, dict)):
            return _nested_rule(func, args, kwargs)
    if known is not None:
        args, kwargs = tuple(known[:len(args)]), dict(zip(kwargs, known[len(args):]))
    return _with_sums(func, args, kwargs, known is not None and not still_pending, other_tag)


def _nested_rule(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_rule`` of a call with lists, tuples or dicts among its arguments (walked by pytree)."""
    flat, spec = tree_flatten((args, kwargs))
    known = [_known_sum(x) for x in flat]
    if not any(k is not x for k, x in zip(known, flat)):
        return _with_sums(func, args, kwargs, False, False)
    args, kwargs = tree_unflatten(known, spec)
    tags = [_tag_of(x) for x in known]
    return _with_sums(func, args, kwargs, not any(isinstance(t, Partial) for t in tags),
                      any(t is not None for t in tags))


def _with_sums(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], all_summed: bool,
               other_tag: bool) -> Any:
    """``func`` on arguments whose pending sums already taken are in: run as written once every pending
    operand is summed (``all_summed``; a tag of another kind then sums first), else by its rule."""
    if all_summed:
        if other_tag:
            raise _zones._Fallback
        return func(*args, **kwargs)
    rule = _rules().get(func)
    if rule is None:
        raise _zones._Fallback
    return rule(func, args, kwargs)


_zones.TAG_KINDS[Partial] = (_rule, _summed)
