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
   made whole (gathered or summed), the op run on whole tensors. An op that writes a placed
   tensor in place runs on the whole tensor, which then takes its part of the result
   (:func:`_in_place_on_whole`); one that writes it as its ``out=`` tensor is refused with
   what to write instead.
3. runs the decision: moves, the op (or the rule's own computation), the outputs placed; an
   empty result (a rank holding an empty slice) tied to the moved arguments (:func:`_tied`).

Every rank sees the same whole shapes and placements, and rules decide from those (never from
one rank's local sizes), so every rank takes the same path, and the collectives of the moves,
forward and backward, match across ranks. Metadata reads (``x.shape``, ``x.dtype``) run as
written, except the sizes of a split activation, which are marked as this rank's
(``placements.SplitSize``), and those of a strided one, which read whole (``strided.global_sizes``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from . import conv as _conv  # noqa: F401 - declares its rules
from . import heads as _heads  # noqa: F401 - declares its rules
from . import loss as _loss  # noqa: F401 - declares its rule
from . import packed as _packed  # noqa: F401 - declares its rules
from . import pending as _pending  # noqa: F401 - declares its rules
from . import split as _split
from . import strided as _strided
from .placements import SUM, TAG, Packed, Partial, Split, SplitSize, Strided, placement_of, tie
from .rules import (
    GENERATION,
    METADATA,
    RULES,
    Call,
    Decision,
    Each,
    Fallback,
    OpRules,
    children,
    in_place,
    is_container,
    leaves_of,
    table,
    with_leaves,
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


def split_label(tensor: Tensor) -> str | None:
    """How messages name ``tensor`` when it is a split parameter only its module may use, else ``None``."""
    label: str | None = getattr(getattr(tensor, RECORD, None), "label", None)
    return label


def cache_info() -> dict[str, int]:
    """This thread's decision cache: ``{"size": decisions kept, "misses": decisions made}``."""
    cache = STATE.cache
    if cache is None or cache.generation != GENERATION[0]:
        return {"size": 0, "misses": 0}
    return {"size": len(cache), "misses": cache.misses}


# Values that are never containers: a call whose arguments are tensors and these is walked on the fast path.
_SCALARS = frozenset({int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype, torch.device,
                      torch.layout, torch.memory_format})
# What a call may pass that holds no tensor (a slice is a leaf, but not hashable in its key as it is).
_PLAIN = _SCALARS | {slice}


class ZoneMode(TorchFunctionMode):
    """Run every torch op of a zone on placed activations where a rule proves it exact, else on whole tensors."""

    zone_mode = True  # how ``state.outside_zone_mode`` knows it

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Most calls touch neither a placed activation nor a split parameter. Both marks are
        # attributes, so a tensor with no attributes of its own (an empty ``__dict__``, the usual
        # case) carries neither, which one read tells. A torch op takes tensors, numbers, and
        # sequences or dicts of them; a sequence of numbers (a shape, an index) is looked into.
        for v in args:
            if isinstance(v, Tensor):
                if v.__dict__:
                    return dispatch(func, args, kwargs or {})
            elif type(v) in _MARKS and (type(v) is SplitSize or type(v) is dict or _marked(v)):
                return dispatch(func, args, kwargs or {})
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, Tensor):
                    if v.__dict__:
                        return dispatch(func, args, kwargs)
                elif type(v) in _MARKS and (type(v) is SplitSize or type(v) is dict or _marked(v)):
                    return dispatch(func, args, kwargs)
            return func(*args, **kwargs)
        return func(*args)


_CONTAINERS = frozenset({tuple, list, dict, torch.Size})
_MARKS = _CONTAINERS | {SplitSize}  # what may hold or be a mark, besides a tensor


def _marked(items: tuple[Any, ...] | list[Any]) -> bool:
    """Whether a sequence argument (a shape, an index, a list of tensors) may hold a placed tensor, a split
    parameter or a split dimension's size: one of its tensors has attributes, or it holds one of the others."""
    for x in items:
        if isinstance(x, Tensor):
            if x.__dict__:
                return True
        elif type(x) in _MARKS:
            return True
    return False


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

    ``rules``: the rules to follow instead of ``func``'s own (a ``DFunction``'s). Inside a zone
    only (the rule table is built and the decision cache made when the outermost zone opens).

    The key of the usual call (tensors, numbers, flat shapes and indices) is read here; any
    other call is walked by :class:`_Walk`, which gives the same key.
    """
    if rules is None:
        try:
            entry = RULES.get(func)
        except TypeError:  # an unhashable op
            entry = None
        if entry is METADATA:
            return _metadata(func, args, kwargs)
    else:
        entry = rules
    key: list[Any] = [func, _grad_enabled(), len(args)]
    lead = None
    if kwargs:
        key.append(tuple(kwargs))
        values: tuple[Any, ...] = (*args, *kwargs.values())
    else:
        values = args
    for v in values:
        if isinstance(v, Tensor):
            attrs = v.__dict__
            if attrs:
                placement = attrs.get(TAG)
                if placement is None:
                    if RECORD in attrs and split_label(v):  # a split parameter: refused, or a compiled graph's op
                        return _dispatch_walked(func, args, kwargs, entry)
                elif type(placement) is Partial and SUM in attrs:  # maybe summed already: it may stand as its sum
                    return _dispatch_walked(func, args, kwargs, entry)
                elif lead is None or type(lead) is Split:
                    lead = placement
                key += (placement, v.shape, v.dtype, v.requires_grad)
            else:
                key += (None, v.shape, v.dtype, v.requires_grad)
        elif type(v) in _SCALARS:
            key += (type(v), v)
        else:
            part = _sequence_part(v)
            if part is None:
                return _dispatch_walked(func, args, kwargs, entry)
            key.append(part)
    if lead is None:
        return func(*args, **kwargs)
    cache = STATE.cache
    frozen = tuple(key)
    try:
        decision = cache.hot.get(frozen)
    except TypeError:  # an unhashable argument: decided every time
        return execute(_decide(func, args, kwargs, entry, lead), func, args, kwargs)
    if decision is None:
        decision = cache.cold_or_new(frozen, func, args, kwargs, entry, lead)
    try:
        if decision.plain:  # the usual decision: the op as written, its output placed
            out = func(*args, **kwargs)
            if decision.out is not None:
                out.__dict__[TAG] = decision.out
            return out
        return execute(decision, func, args, kwargs)
    except Exception as exc:
        _note(exc, func, args, kwargs)
        raise


def _note(exc: BaseException, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Say, on an exception raised by an op the engine ran, which op and on what (once: the innermost op)."""
    if any(note.startswith("shardkit's engine ran") for note in getattr(exc, "__notes__", ())):
        return
    shown = []
    for v in leaves_of(args, kwargs):
        if isinstance(v, Tensor):
            placement = placement_of(v)
            shown.append(f"{tuple(v.shape)} {v.dtype}" + (f" {placement}" if placement is not None else " whole"))
    exc.add_note(f"shardkit's engine ran {_describe(func)} on this rank's tensors: {'; '.join(shown) or 'none'}")


def _sequence_part(v: Any) -> tuple[Any, ...] | None:
    """The key part of a tuple or list of numbers and slices (a shape, an index), as :class:`_Walk` gives it;
    ``None`` for anything else."""
    if type(v) is not tuple and type(v) is not list and type(v) is not torch.Size:
        return None
    part: list[Any] = [type(v), len(v)]
    for x in v:
        if type(x) in _SCALARS:
            part += (type(x), x)
        elif type(x) is slice:
            part += (slice, x.start, x.stop, x.step)
        else:
            return None
    return tuple(part)


def _dispatch_walked(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], entry: OpRules | None) -> Any:
    """``dispatch`` of any call: its arguments walked by :class:`_Walk`."""
    walk = _Walk([func, _grad_enabled(), len(args)])
    walk.walk(args, walk.key)
    if kwargs:
        walk.key.append(tuple(kwargs))
        walk.walk(kwargs.values(), walk.key)
    lead, owned = walk.lead, walk.owned
    if owned is not None and (lead is not None or type(func) is not torch._ops.OpOverload):
        # (An operator on unplaced tensors may be a compiled graph's, a model compiled and called inside
        # ``loss_parallel``, run on the split parameters themselves: one of the local ops and collectives
        # the rules chose while tracing, not a use of a split parameter to refuse.)
        _refuse_owned(func, owned)
    if walk.summed:
        args, kwargs = with_leaves(args, kwargs, walk.leaves)
    if lead is None:
        return func(*args, **kwargs)
    cache = STATE.cache
    key = tuple(walk.key)
    try:
        decision = cache.hot.get(key)
    except TypeError:  # an unhashable argument: decided every time
        return execute(_decide(func, args, kwargs, entry, lead), func, args, kwargs)
    if decision is None:
        decision = cache.cold_or_new(key, func, args, kwargs, entry, lead)
    return execute(decision, func, args, kwargs)


_grad_enabled = torch.is_grad_enabled


class _Walk:
    """The one walk of an op's arguments: the leaves (``rules.leaves_of``'s, in its order), the key, and the
    placement that picks the rule.

    A tensor's part of the key is its placement, local shape, dtype and ``requires_grad``; a
    container's, its type, its size or keys, and its items' parts; a slice's, its bounds; any
    other value's, its type and itself (a ``True`` is not a ``1``). The parts lie flat in the
    key, but a container's, which is one tuple: a tensor's first item is a placement or ``None``,
    another value's a type. A pending sum whose sum was taken stands as that sum.
    """

    __slots__ = ("key", "leaves", "lead", "owned", "summed")

    def __init__(self, key: list[Any]) -> None:
        self.key = key
        self.leaves: list[Any] = []
        self.lead: Any = None  # what picks the rule: the first placement that is not a Split, else a Split
        self.owned: Tensor | None = None  # a split parameter among the arguments
        self.summed = False

    def walk(self, values: Any, key: list[Any]) -> None:
        leaves = self.leaves
        for v in values:
            if isinstance(v, Tensor):
                attrs = v.__dict__
                placement = None
                if attrs:
                    placement = attrs.get(TAG)
                    if placement is not None:
                        if type(placement) is Partial:
                            known = attrs.get(SUM)
                            if known is not None and known[0] == v._version:  # summed already: stands as its sum
                                v = known[1]
                                placement = None
                                self.summed = True
                        if placement is not None and (self.lead is None or type(self.lead) is Split):
                            self.lead = placement
                    elif RECORD in attrs and split_label(v):
                        self.owned = v
                leaves.append(v)
                key += (placement, v.shape, v.dtype, v.requires_grad)
            elif type(v) in _SCALARS:
                leaves.append(v)
                key += (type(v), v)
            elif type(v) is SplitSize:
                leaves.append(v)
                key += (SplitSize, int(v), v.placement)
                if self.lead is None:
                    self.lead = v.placement
            elif type(v) is slice:
                leaves.append(v)
                key += (slice, v.start, v.stop, v.step)
            elif is_container(v):
                inner: list[Any] = [type(v), tuple(v) if isinstance(v, dict) else len(v)]
                self.walk(children(v), inner)
                key.append(tuple(inner))
            else:
                leaves.append(v)
                key += (type(v), v)


class _Cache:
    """The decision cache: keys to decisions, bounded by ``CACHE_SIZE``, least recently used out.

    Recency is kept by generations: decisions live in ``hot`` (used since the last turn) or
    ``cold`` (used in the turn before); a hit in ``cold`` moves to ``hot``; when ``hot`` holds
    half the bound, it becomes ``cold`` and what was cold goes. A hit in ``hot`` costs the
    dispatcher one lookup.
    """

    __slots__ = ("hot", "cold", "generation", "misses")

    def __init__(self) -> None:
        self.hot: dict[Any, Decision] = {}
        self.cold: dict[Any, Decision] = {}
        self.generation = GENERATION[0]
        self.misses = 0

    def cold_or_new(self, key: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], entry: OpRules | None,
                    lead: Any) -> Decision:
        """The decision for ``key`` not in ``hot``: moved from ``cold``, or decided now."""
        decision = self.cold.pop(key, None)
        if decision is None:
            self.misses += 1
            decision = _decide(func, args, kwargs, entry, lead)
        if len(self.hot) >= CACHE_SIZE // 2:
            self.cold, self.hot = self.hot, {}
        self.hot[key] = decision
        return decision

    def __len__(self) -> int:
        return len(self.hot) + len(self.cold)


def fresh_cache(tracing: bool = False) -> Any:
    """The cache a zone call starts with: the thread's own, made anew after a rule was registered; or,
    for a trace (which decides on symbolic sizes), one that lives for the trace only."""
    if tracing:
        return _Cache()
    cache = STATE.cache
    if cache is None or cache.generation != GENERATION[0]:
        cache = STATE.cache = _Cache()
    return cache


def _metadata(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A read of what a tensor is (shape, dtype, device, ...): as written; sizes marked or read whole."""
    placement = args[0].__dict__.get(TAG) if args and isinstance(args[0], Tensor) else None
    if placement is None:
        return func(*args, **kwargs)
    if type(placement) is Strided:
        return _strided.global_sizes(func, args, kwargs)
    if func in _SIZE_READS and type(placement) is Split:
        return _split.sizes_read(func, args, func(*args, **kwargs), placement)
    return func(*args, **kwargs)


_SIZE_READS = frozenset({vars(torch._C.TensorBase)["shape"].__get__, torch.Tensor.size})


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


def _decide(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], entry: OpRules | None, lead: Any) -> Decision:
    """The decision for a call not seen before: its rule's, or the fallback."""
    leaves = leaves_of(args, kwargs)
    rule = entry.by_kind.get(type(lead)) if entry is not None else None
    why = f"no rule for {_describe(func)} on a {type(lead).__name__} activation"
    if rule is not None:
        metas = [_meta_leaf(x) for x in leaves]
        margs, mkwargs = with_leaves(args, kwargs, metas)
        sizes = tuple((i, _whole_size) for i, x in enumerate(leaves) if type(x) is SplitSize)
        try:
            if sizes and type(lead) is not Split and type(lead) is not Partial and not _read_alike(lead, leaves):
                raise Fallback  # a split's size beside another placement's local shape: no rule reads both
            decision = rule(Call(func, margs, mkwargs, metas, torch.is_grad_enabled()))
        except Fallback:
            why = f"{_describe(func)} on a {type(lead).__name__} activation: its rule does not apply to this call"
        else:
            if sizes and type(lead) is Partial:
                # A pending sum has the whole shape: a size read off a split dimension stands for its whole size.
                decision = dataclasses.replace(decision, moves=decision.moves + sizes)
            return decision
    return _fallback(func, args, kwargs, leaves, why)


def _read_alike(lead: Any, leaves: list[Any]) -> bool:
    """Whether every split dimension's size among ``leaves`` was read off a split of the strided ``lead``'s heads
    (the same intervals): its rules read such a size as this rank's extent, as a split's rules do
    (``x.reshape(x_split.shape)`` once the heads merged with the rows are separated again)."""
    return type(lead) is Strided and all(x.placement.intervals == lead.intervals and x.placement.group == lead.group
                                         for x in leaves if type(x) is SplitSize)


def _fallback(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], why: str) -> Decision:
    """Every placed argument made whole, the op run on whole tensors.

    An op that writes a placed argument in place (``x.add_(y)``, ``x[i] = v``) runs on a whole
    copy of it, whose result is then written back as that argument's placement holds it
    (:func:`_in_place_on_whole`). Refused: an ``out=`` tensor that is placed, a packed one, and
    an in-place op that changes its tensor's shape.
    """
    written = kwargs.get("out")
    name = getattr(func, "__name__", "")
    if written is None and args and (name in _SIDE_EFFECTS or in_place(func)):
        written = args[0]
    placement = placement_of(written)
    # A split dimension's size read off a split activation, given to an op no rule reads it for: the whole size.
    sizes = tuple((i, _whole_size) for i, x in enumerate(leaves) if type(x) is SplitSize)
    if placement is not None and isinstance(written, Tensor):
        if written is kwargs.get("out") or type(placement) not in (Split, Strided, Partial) or name in _RESHAPING:
            return Decision(run=functools.partial(_refuse_in_place, name=name or repr(func),
                                                  shape=tuple(written.shape), placement=placement), gathered=why)
        at = next(i for i, x in enumerate(leaves) if x is written)
        moves = tuple((i, p.whole) for i, x in enumerate(leaves) if i != at and (p := placement_of(x)) is not None)
        summed = type(placement) is Partial and all(type(placement_of(leaves[i])) is Partial for i, _ in moves)
        return Decision(moves + sizes, run=functools.partial(_in_place_on_whole, func=func, placement=placement),
                        gathered=why, summed=summed)
    moves = tuple((i, p.whole) for i, x in enumerate(leaves) if (p := placement_of(x)) is not None)
    summed = all(type(placement_of(leaves[i])) is Partial for i, _ in moves)
    if not moves:
        return Decision(sizes)
    return Decision(moves + sizes, gathered=why, summed=summed)


# In-place ops that change their tensor's shape or storage: a placed tensor cannot take a whole result's part.
_RESHAPING = {"resize_", "resize_as_", "set_", "squeeze_", "unsqueeze_", "transpose_", "t_", "swapaxes_",
              "swapdims_", "as_strided_"}


def _whole_size(size: SplitSize) -> int:
    return size.whole()


def _in_place_on_whole(x: Tensor, *args: Any, func: Any, placement: Any, **kwargs: Any) -> Any:
    """``func`` writing ``x`` in place, run on the whole tensor ``x`` is part of; ``x`` then takes its part of the
    result and keeps its placement.

    A pending sum is summed first (one all-reduce, or the sum already taken), the op runs on a
    copy of the sum, and ``x`` becomes an addend of the result again: the result on the group's
    first rank, zeros elsewhere (``Partial.add_once``), the result kept as its sum. A split (or
    strided) ``x`` is gathered, the op runs on the gathered copy, and ``x`` takes its slice of the
    result (``cut``). Exact forward and backward, as every fallback: the gradient that reaches
    the result is whole on every rank.
    """
    whole = placement.whole(x)
    if type(placement) is Partial:
        whole = whole.clone()  # (the sum may be kept on x, and read by other ops already)
    out = func(whole, *args, **kwargs)
    if type(placement) is Partial:
        x.copy_(placement.add_once(whole))
        x.__dict__[SUM] = (x._version, whole)
    else:
        x.copy_(placement.cut(whole, placement.dim))
    return x if out is whole else out


def _refuse_in_place(*args: Any, name: str, shape: tuple[int, ...], placement: Any, **kwargs: Any) -> Any:
    if type(placement) is Packed:
        msg = (f"in-place op {name!r} on a packed activation (a fused projection's output, shape {shape} here, of "
               f"which each rank holds several slices side by side) cannot be run on this rank's slices; take it "
               f"apart first (split or chunk it at its parts: q, k, v), or make the op out-of-place.")
        raise RuntimeError(msg)
    if type(placement) is Partial:
        held = (f"a pending sum (the output of a layer split on its input features, shape {shape}, of which each "
                f"rank holds one addend until it is summed)")
    elif type(placement) is Split:
        held = (f"an activation split across ranks along dimension {placement.dim} (shape {shape} here, "
                f"{placement.size} in full)")
    else:
        held = f"an activation split across ranks as {type(placement).__name__} (shape {shape} here)"
    msg = (f"op {name!r} writes into {held}, as its out= tensor or changing its shape, which this rank's part "
           f"cannot hold; make the op out-of-place (y = op(x) instead of op(x, out=y), x.reshape(...) instead "
           f"of x.resize_(...)), or keep the layers that produce it whole.")
    raise RuntimeError(msg)


def _place(out: Any, placement: Each | tuple[Any, ...]) -> None:
    """Place each tensor of a tuple or list output: all alike (``Each``), or one placement per element."""
    if isinstance(placement, Each):
        for o in out:
            if isinstance(o, Tensor):
                o.__dict__[TAG] = placement.placement
    else:
        for o, p in zip(out, placement):
            if p is not None:
                o.__dict__[TAG] = p


def _tied(out: Any, leaves: list[Any], moves: tuple[tuple[int, Any], ...]) -> Any:
    """``out`` with its empty results tied to the moved arguments that need a gradient (``placements.tie``): a
    rank whose slice is empty runs their backward (a collective, for some) as the other ranks do."""
    items = [out] if isinstance(out, Tensor) else list(out) if isinstance(out, (tuple, list)) else []
    empty = [i for i, o in enumerate(items) if isinstance(o, Tensor) and not o.numel()
             and (o.is_floating_point() or o.is_complex()) and not any(o is leaf for leaf in leaves)]
    if not empty:
        return out
    others = [leaves[i] for i, _ in moves if isinstance(leaves[i], Tensor) and leaves[i].requires_grad]
    if not others:
        return out
    for i, o in zip(empty, tie([items[i] for i in empty], others)):
        items[i] = o
    if isinstance(out, Tensor):
        return items[0]
    if isinstance(out, list) or type(out) is tuple:
        return type(out)(items)
    return type(out)(items) if not hasattr(out, "_fields") else type(out)(*items)  # a named tuple, a return type


def execute(decision: Decision, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``decision`` on the real arguments."""
    leaves: list[Any] = []
    if decision.moves or decision.written:
        leaves = leaves_of(args, kwargs)
    if decision.moves:
        for i, move in decision.moves:
            leaves[i] = move(leaves[i])
        args, kwargs = with_leaves(args, kwargs, leaves)
    run = decision.run
    out = func(*args, **kwargs) if run is None else run(*args, **kwargs)
    if decision.moves and _grad_enabled():
        out = _tied(out, leaves, decision.moves)
    placement = decision.out
    if placement is not None:
        if type(placement) is Each or type(placement) is tuple:
            _place(out, placement)
        else:
            out.__dict__[TAG] = placement
    for i, p in decision.written:
        leaves[i].__dict__[TAG] = p
    if decision.gathered is not None and STATE.explaining is not None:
        STATE.explaining.fallback(func, decision.gathered, decision.summed)
    return out


def table_ready() -> None:
    """Build the rule table now (reading ATen's op tags), rather than on the first op of a zone."""
    table()
