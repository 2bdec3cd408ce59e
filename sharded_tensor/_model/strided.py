"""A head split that survives ``reshape(batch * num_heads, ...)``: the strided split.

BLOOM (and code written like it) merges the batch with the heads before its batched matmuls::

    q = q.reshape(batch * num_heads, seq, head_dim)      # q split on its heads
    scores = alibi.baddbmm(q, k.transpose(-1, -2), ...)  # [batch * num_heads, seq, seq]
    probs = softmax(scores.view(batch, num_heads, seq, seq) + mask)
    context = torch.bmm(probs.view(batch * num_heads, seq, seq), v)

The merged dimension is split in blocks: for each batch row, this rank holds its heads. Such a
tensor is tagged :class:`Strided`: the placement ``sharding.layout.Strided`` (``blocks`` = the
product of the merged outer dimensions, each block split by the heads' intervals) over the
zone's process group, as :class:`zones.Split` is ``sharding.layout.Split`` with one. These
ops keep it so, each on its local blocks:

* reshapes: a split merged with the dimensions outside it gives a strided split; a strided
  tensor reshaped to sizes that separate the blocks again (``view(batch, num_heads, ...)``)
  gives an ordinary split;
* transposes and permutations (the strided dimension moves);
* ``bmm``, ``baddbmm``, ``matmul`` with the strided dimension a batch dimension: every
  strided operand split alike; a whole operand of the full size along it (BLOOM's ``alibi``,
  ``[batch * num_heads, 1, seq]``) is cut to this rank's rows of each block (its gradient
  gathered back), one that broadcasts along it is used whole (its gradient summed).

Any other op gathers the blocks first (one all-gather), exact forward and backward as
every fallback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from _shardkit import comm as _comm

from . import zones as _zones
from .functional import Intervals, gather, scatter
from .signatures import aten_name

__all__ = ["Strided"]

Strided = _zones.Strided


def _tag_of(x: torch.Tensor) -> Strided:
    """The strided split ``x`` is tagged with (the dispatch routes only such tensors here)."""
    tag = getattr(x, _zones._TAG, None)
    assert isinstance(tag, Strided), tag
    return tag


def _unmerged(x: torch.Tensor, tag: Strided) -> torch.Tensor:
    """The local ``x`` with its strided dimension unflattened into ``(blocks, this rank's length)``."""
    out: torch.Tensor = x.unflatten(tag.dim, (tag.blocks, x.shape[tag.dim] // tag.blocks))
    return out


def _whole(x: torch.Tensor, tag: Strided) -> torch.Tensor:
    """The full tensor of a strided ``x``: every rank's rows of each block gathered (collective)."""
    with _zones.outside_propagation():
        return gather(_unmerged(x, tag), tag.dim + 1, tag.intervals, tag.group).flatten(tag.dim, tag.dim + 1)


def _cut(t: torch.Tensor, dim: int, tag: Strided) -> torch.Tensor:
    """This rank's rows of each block of a whole ``t`` along ``dim``; its gradient is gathered back."""
    blocks = t.unflatten(dim, (tag.blocks, tag.size))
    return scatter(blocks, dim + 1, tag.intervals, tag.group).flatten(dim, dim + 1)


_MERGES: dict[tuple[Any, ...], tuple[int, Intervals, int, tuple[int, ...]] | None] = {}


def _plan_merge(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                split: _zones.Split) -> tuple[int, Intervals, int, tuple[int, ...]] | None:
    """Where a view / reshape merges ``split`` with dimensions outside it: (dim, intervals, blocks, local shape).

    ``None`` when it does not (the split is the outermost dimension of its group, or the group
    is cut into several output dimensions): the ordinary reshape rule decides then.
    """
    x = args[0]
    whole = list(x.shape)
    whole[split.dim] = split.size
    try:
        meta = torch.empty(whole, dtype=x.dtype, device="meta")
        shape = list(func(meta, *args[1:], **kwargs).shape)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None
    groups = _zones._groups(whole, shape) if 0 not in whole else None
    if groups is None:
        return None
    gi, gj = next((gi, gj) for gi, gj in groups if split.dim in gi)
    if len(gj) != 1 or gi[0] == split.dim:
        return None
    blocks = math.prod(whole[d] for d in gi if d < split.dim)
    inner = math.prod(whole[d] for d in gi if d > split.dim)
    rank, _ = _comm.rank_and_world(split.group)
    intervals = tuple((s * inner, n * inner) for s, n in split.intervals)
    local = list(shape)
    local[gj[0]] = blocks * intervals[rank][1]
    return gj[0], intervals, blocks, tuple(local)


def _reshape(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """view / reshape of a split tensor: merged with the dimensions outside it, a strided split; else the
    reshape rule of ``zones``.

    A merge with outer dimensions of size 1 (a batch of one) is strided too, with one block: the
    model then reads the merged size as the unsharded program does (``x.shape[0] // num_heads``).
    """
    x = args[0]
    split = _zones.split_of(x)
    if split is None:
        raise _zones._Fallback
    key = _zones._reshape_key(func, args, kwargs, x, split)
    try:
        plan = _MERGES[key]
    except KeyError:
        plan = _MERGES[key] = _plan_merge(func, args, kwargs, split)
    except TypeError:  # an unhashable argument
        plan = _plan_merge(func, args, kwargs, split)
    if plan is None:
        return _zones._reshaped(func, args, kwargs, x, split, key)
    dim, intervals, blocks, local = plan
    _zones._intervene(f"{_zones._describe(func)} merged a split with other dimensions (a strided split)")
    out = x.view(local) if _zones._aten_name(func) == "view" else x.reshape(local)
    return _zones.tag(out, Strided(dim, intervals, blocks, split.group))


def _strided_reshape(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """view / reshape of a strided tensor: its blocks unflattened (an ordinary split), then reshaped."""
    x, tag = args[0], _tag_of(args[0])
    if aten_name(func) not in ("view", "reshape") or any(isinstance(a, torch.Tensor) for a in args[1:]):
        raise _zones._Fallback
    unmerged = _zones.tag(_unmerged(x, tag), _zones.Split(tag.dim + 1, tag.intervals, tag.group))
    return _reshape(func, (unmerged, *args[1:]), kwargs)


def _permuted(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """transpose / permute / t: where the strided dimension goes, read from the op on distinct sizes."""
    x, tag = args[0], _tag_of(args[0])
    probe = torch.empty([d + 2 for d in range(x.dim())], device="meta")
    try:
        sizes = list(func(probe, *args[1:], **kwargs).shape)
    except (RuntimeError, ValueError, TypeError, IndexError):
        raise _zones._Fallback from None
    return _zones.tag(func(*args, **kwargs), tag.moved(sizes.index(tag.dim + 2)))


def _batched(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """bmm / baddbmm / matmul with the strided dimension a batch dimension of every operand."""
    flat, spec = tree_flatten((args, kwargs))
    tensors = [(i, t) for i, t in enumerate(flat) if isinstance(t, torch.Tensor)]
    tags = {getattr(t, _zones._TAG, None) for _, t in tensors} - {None}
    if len(tags) != 1:
        raise _zones._Fallback
    tag = tags.pop()
    ndim = max(t.dim() for _, t in tensors)
    if not isinstance(tag, Strided) or tag.dim >= ndim - 2:
        raise _zones._Fallback
    for i, t in tensors:
        if getattr(t, _zones._TAG, None) is not None:
            if t.dim() != ndim:
                raise _zones._Fallback
            continue
        local = tag.dim - (ndim - t.dim())
        if local < 0 or t.shape[local] == 1:
            flat[i] = _zones._whole(t, tag.group)
        elif t.shape[local] == tag.blocks * tag.size:
            flat[i] = _cut(t, local, tag)
        else:
            raise _zones._Fallback
    args, kwargs = tree_unflatten(flat, spec)
    out = func(*args, **kwargs)
    if not isinstance(out, torch.Tensor) or out.dim() != ndim:
        raise _zones._Fallback
    return _zones.tag(out, tag)


_NAMED: dict[str, Callable[..., Any]] = {
    "view": _strided_reshape, "reshape": _strided_reshape,
    **{name: _permuted for name in ("transpose", "swapaxes", "swapdims", "permute", "t")},
    **{name: _batched for name in ("bmm", "baddbmm", "matmul", "__matmul__")},
}


def _rule(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    name = aten_name(func)
    if name == "matmul" and getattr(func, "__name__", "") == "__rmatmul__":
        raise _zones._Fallback
    rule = _NAMED.get(getattr(func, "__name__", "")) or _NAMED.get(name)
    if rule is None or not args or not isinstance(args[0], torch.Tensor):
        raise _zones._Fallback
    if rule is not _batched and not isinstance(getattr(args[0], _zones._TAG, None), Strided):
        raise _zones._Fallback
    return rule(func, args, kwargs)


def _global_sizes(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x.shape``, ``x.size()``, ``x.numel()`` of a strided tensor as the unsharded program sees them."""
    x = args[0]
    tag = _tag_of(x)
    shape = list(x.shape)
    shape[tag.dim] = tag.blocks * tag.size
    owner = getattr(getattr(func, "__self__", None), "__name__", "")
    name = owner if owner in ("shape",) else getattr(func, "__name__", "")
    if name in ("shape", "size"):
        whole = torch.Size(shape)
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        return whole if dim is None else whole[dim]
    if name in ("numel", "nelement"):
        return math.prod(shape)
    return func(*args, **kwargs)  # dim, dtype, device, strides, ...: as the local tensor has them


_zones.TAG_KINDS[Strided] = (_rule, _whole)
_zones.GLOBAL_SIZES[Strided] = _global_sizes
# The split engine's own view and reshape, extended with the merge into a strided split.
_zones._PLAIN_RULES.add(_reshape)  # reports its strided merges itself
for _name in ("view", "reshape"):
    _zones._NAMED_RULES[_name] = _reshape
    if _zones._tables.cache_info().currsize:
        for _obj in _zones._objects(_name):
            _zones._tables()[0][_obj] = _reshape
