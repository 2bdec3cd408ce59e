"""Every torch op of a zone: straight through, or through its rule, decided once per kind of call.

A zone's forward runs under :class:`ZoneMode`, a ``TorchFunctionMode`` that sees every torch
call. Most calls touch neither a placed activation nor a split parameter: they run as written.
A call that does (:func:`dispatch`):

1. reads what it is: its op, grad mode and, per argument, a tensor's placement, local shape,
   dtype and ``requires_grad``, or any other value as given (the *key*). A pending sum whose
   sum was taken already stands as that sum (``placements.Partial.whole``). A split parameter
   read directly by the model's code (not through its module) is refused: the op would see
   only this rank's block.
2. looks the key up in the decision cache (one per thread, bounded, least recently used
   out). On a miss, the op's rule for the leading placement (the first one that is not a
   plain ``Split``, else ``Split``) decides from metadata alone (``rules.Call``); without a rule,
   or when the rule cannot prove the call, the decision is the fallback: every placed argument
   made whole (gathered or summed), the op run on whole tensors. A fallback that would write a
   whole copy in place of a placed tensor is refused with what to write instead.
3. runs the decision: moves, the op (or the rule's own computation), the outputs placed.

Every rank sees the same shapes and placements, so it takes the same decision, and the
collectives of the moves match across ranks. Metadata reads (``x.shape``, ``x.dtype``) run as
written, except the sizes of a split activation, which are marked as this rank's
(``split.LocalSize``), and those of a strided one, which read whole (``strided.global_sizes``).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from . import loss as _loss  # noqa: F401 - declares its rule
from . import pending as _pending  # noqa: F401 - declares its rules
from . import split as _split
from . import strided as _strided
from .placements import SUM, TAG, Packed, Partial, Split, Strided, placement_of
from .rules import (
    METADATA,
    Call,
    Decision,
    Each,
    Fallback,
    OpRules,
    flatten,
    generation,
    in_place,
    rules_of,
    table,
    unflatten,
)
from .state import STATE

__all__ = ["ZoneMode", "dispatch", "RECORD", "split_label", "CACHE_SIZE", "cache_info"]

# A sharded parameter carries its record (``record.ShardedParameter``) under this attribute. An op
# that reads a parameter whose record has a ``label`` directly (not through its module) would see
# only this rank's block, so it is refused.
RECORD = "_shardkit_record"

CACHE_SIZE = 4096
"""Decisions kept per thread (a model sees a few hundred kinds of call; varying sequence lengths add some)."""

_SIDE_EFFECTS = {"copy_", "__setitem__", "index_put_", "scatter_", "scatter_add_", "masked_scatter_", "index_copy_",
                 "index_add_", "index_fill_", "put_", "resize_", "set_", "uniform_", "normal_"}
_SIZE_READS = ("shape", "size")


def split_label(tensor: Tensor) -> str | None:
    """How messages name ``tensor`` when it is a split parameter only its module may use, else ``None``."""
    label: str | None = getattr(getattr(tensor, RECORD, None), "label", None)
    return label


class _Cache:
    """The decision cache: keys to decisions, least recently used out beyond ``CACHE_SIZE``."""

    __slots__ = ("decisions", "generation", "hits", "misses")

    def __init__(self) -> None:
        self.decisions: OrderedDict[Any, Decision] = OrderedDict()
        self.generation = generation()
        self.hits = self.misses = 0


def _cache() -> _Cache:
    cache: _Cache | None = getattr(STATE, "cache", None)
    if cache is None or cache.generation != generation():  # a rule registered since: decisions may differ
        cache = STATE.cache = _Cache()
    return cache


def cache_info() -> dict[str, int]:
    """This thread's decision cache: ``{"size", "hits", "misses"}``."""
    cache = _cache()
    return {"size": len(cache.decisions), "hits": cache.hits, "misses": cache.misses}


class ZoneMode(TorchFunctionMode):
    """Run every torch op of a zone on placed activations where a rule proves it exact, else on whole tensors."""

    zone_mode = True  # how ``state.outside_zone_mode`` knows it

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Most calls touch neither a placed activation nor a split parameter. Both marks are
        # attributes, so a tensor with no attributes of its own (an empty ``__dict__``, the usual
        # case) carries neither, which one read tells.
        for v in args:
            if isinstance(v, Tensor):
                found = v.__dict__
                if found and (TAG in found or (RECORD in found and split_label(v))):
                    return dispatch(func, args, kwargs or {})
            elif isinstance(v, (list, tuple, dict)):
                if v:
                    return dispatch(func, args, kwargs or {})
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, Tensor):
                    found = v.__dict__
                    if found and (TAG in found or (RECORD in found and split_label(v))):
                        return dispatch(func, args, kwargs)
                elif isinstance(v, (list, tuple, dict)) and v:
                    return dispatch(func, args, kwargs)
            return func(*args, **kwargs)
        return func(*args)


def _refuse_owned(func: Any, owned: Tensor) -> None:
    msg = (f"parameter {split_label(owned)} is split across ranks, but the model's code uses it directly "
           f"in {_describe(func)} instead of calling its module, so that op would see only this rank's block "
           f"(shape {tuple(owned.shape)}); keep the parameter whole on every rank, or use it only through "
           f"its module.")
    raise RuntimeError(msg)


def _describe(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return f"{name}()"


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, rules: OpRules | None = None) -> Any:
    """Run ``func`` on arguments among which (or near which) is a placed activation or a split parameter.

    ``rules``: the rules to follow instead of ``func``'s own (a ``DFunction``'s).
    """
    entry = rules_of(func) if rules is None else rules
    if entry is METADATA:
        return _metadata(func, args, kwargs)
    leaves, spec = flatten(args, kwargs)
    key: list[Any] = [func, torch.is_grad_enabled(), spec if spec is not None else (len(args), *kwargs)]
    lead: Any = None
    placed = False
    summed: dict[int, Any] | None = None
    hashable = True
    for i, v in enumerate(leaves):
        if isinstance(v, Tensor):
            attrs = v.__dict__
            placement = None
            if attrs:
                placement = attrs.get(TAG)
                if RECORD in attrs and split_label(v):
                    _refuse_owned(func, v)
                if type(placement) is Partial:
                    known = attrs.get(SUM)
                    if known is not None and known[0] == v._version:  # summed already: stands as its sum
                        if summed is None:
                            summed = {}
                        summed[i] = v = known[1]
                        placement = None
            if placement is not None:
                placed = True
                if lead is None or (type(lead) is Split and type(placement) is not Split):
                    lead = placement
            key.append((placement, v.shape, v.dtype, v.requires_grad))
        elif isinstance(v, slice):
            key.append((slice, v.start, v.stop, v.step))
        else:
            key.append((type(v), v))
    if summed is not None:
        leaves = [summed.get(i, v) for i, v in enumerate(leaves)]
        args, kwargs = unflatten(leaves, spec, len(args), tuple(kwargs))
    if not placed:
        return func(*args, **kwargs)
    decision = None
    if not STATE.tracing:  # a trace decides on symbolic sizes: nothing of it is kept
        cache = _cache()
        frozen = tuple(key)
        try:
            decision = cache.decisions.get(frozen)
        except TypeError:  # an unhashable argument: decided every time
            hashable = False
        if decision is not None:
            cache.hits += 1
            cache.decisions.move_to_end(frozen)
        else:
            decision = _decide(func, args, kwargs, leaves, spec, entry, lead)
            if hashable:
                cache.misses += 1
                cache.decisions[frozen] = decision
                if len(cache.decisions) > CACHE_SIZE:
                    cache.decisions.popitem(last=False)
    else:
        decision = _decide(func, args, kwargs, leaves, spec, entry, lead)
    return execute(decision, func, args, kwargs, leaves, spec)


def _metadata(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A read of what a tensor is (shape, dtype, device, ...): as written; sizes marked or read whole."""
    placement = placement_of(args[0]) if args else None
    if placement is not None:
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        name = owner if owner == "shape" else getattr(func, "__name__", "")
        if type(placement) is Strided:
            return _strided.global_sizes(func, args, kwargs)
        if name in _SIZE_READS and type(placement) in (Split, Packed):
            return _split.local_sizes(func(*args, **kwargs))
    return func(*args, **kwargs)


def _meta_leaf(x: Any) -> Any:
    """A meta tensor with ``x``'s local shape, dtype, ``requires_grad`` and placement; other leaves as they are."""
    if not isinstance(x, Tensor):
        return x
    meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
    if x.requires_grad:
        meta.requires_grad_()
    placement = placement_of(x)
    if placement is not None:
        meta.__dict__[TAG] = placement
    return meta


def _decide(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], spec: Any,
            entry: OpRules | None, lead: Any) -> Decision:
    """The decision for a call not seen before: its rule's, or the fallback."""
    rule = entry.by_kind.get(type(lead)) if entry is not None else None
    why = f"no rule for {_describe(func)} on a {type(lead).__name__} activation"
    if rule is not None:
        metas = [_meta_leaf(x) for x in leaves]
        margs, mkwargs = unflatten(metas, spec, len(args), tuple(kwargs))
        try:
            return rule(Call(func, margs, mkwargs, metas, spec, torch.is_grad_enabled()))
        except Fallback:
            why = f"{_describe(func)} on a {type(lead).__name__} activation: its rule does not apply to this call"
    return _fallback(func, args, kwargs, leaves, why)


def _fallback(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], why: str) -> Decision:
    """Every placed argument made whole, the op run on whole tensors; refused if it writes a placed tensor."""
    written = kwargs.get("out")
    name = getattr(func, "__name__", "")
    if written is None and args and (name in _SIDE_EFFECTS or in_place(func)):
        written = args[0]
    placement = placement_of(written)
    if placement is not None:
        return Decision(run=functools.partial(_refuse_in_place, name=name or repr(func), shape=tuple(written.shape),
                                              placement=placement), gathered=why)
    moves = tuple((i, p.whole) for i, x in enumerate(leaves) if (p := placement_of(x)) is not None)
    return Decision(moves, gathered=why)


def _refuse_in_place(*args: Any, name: str, shape: tuple[int, ...], placement: Any, **kwargs: Any) -> Any:
    if type(placement) is Partial:
        msg = (f"in-place op {name!r} on a pending sum (the output of a layer split on its input features, "
               f"shape {shape}, of which each rank holds one addend until it is summed) cannot be run on the "
               f"addends, nor on their sum in their place; make the op out-of-place (y = y + z instead of y += z).")
    elif type(placement) is Split:
        msg = (f"in-place op {name!r} on an activation split across ranks along dimension {placement.dim} "
               f"(shape {shape} here, {placement.size} in full) cannot be run slice by slice; keep the layers "
               f"that produce it whole, or make the op out-of-place.")
    else:
        msg = (f"in-place op {name!r} on an activation split across ranks as {type(placement).__name__} (shape "
               f"{shape} here) cannot be run on this rank's slices; keep the layers that produce it whole, or make "
               f"the op out-of-place.")
    raise RuntimeError(msg)


def _place(out: Any, placement: Any) -> None:
    if isinstance(out, Tensor):
        out.__dict__[TAG] = placement
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, Tensor):
                o.__dict__[TAG] = placement


def execute(decision: Decision, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any],
            spec: Any) -> Any:
    """Run ``decision`` on the real arguments (flattened as ``leaves``)."""
    if decision.moves:
        leaves = list(leaves)
        for i, move in decision.moves:
            leaves[i] = move(leaves[i])
        args, kwargs = unflatten(leaves, spec, len(args), tuple(kwargs))
    run = decision.run
    out = func(*args, **kwargs) if run is None else run(*args, **kwargs)
    placement = decision.out
    if placement is not None:
        if type(placement) is Each:
            _place(out, placement.placement)
        elif type(placement) is tuple:
            for o, p in zip(out, placement):
                if p is not None:
                    o.__dict__[TAG] = p
        else:
            out.__dict__[TAG] = placement
    for i, p in decision.written:
        leaves[i].__dict__[TAG] = p
    if decision.gathered is not None and STATE.explaining is not None:
        STATE.explaining.gathered(func, decision.gathered)
    return out


def table_ready() -> None:
    """Build the rule table now (reading ATen's op tags), rather than on the first op of a zone."""
    table()
