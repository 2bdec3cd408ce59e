"""Activations that stay split between sharded layers, through the model's own code.

A Linear split on its output features (the *producer*: q/k/v, gate/up) computes only this
rank's slice of its output; a Linear split on its input features (the *consumer*: o_proj,
down_proj) needs only that slice. Between them runs ordinary model code: reshapes to heads,
rotary embeddings, attention masks, ``scaled_dot_product_attention``, grouped-query
``repeat_kv``. If that code runs on the local slices, each rank computes only its heads and
a decoder layer needs just the consumers' two all-reduces.

Whether code may run on slices depends on every op in it, so shardkit follows the split op by
op, while the code runs:

* A *zone* is the smallest module holding a producer and a consumer split the same way
  (``LlamaAttention``, ``LlamaMLP``, ``BertAttention``, an ``nn.Sequential`` MLP). Its forward
  runs under :class:`_Propagate`, a ``TorchFunctionMode`` that sees every torch call.
* A producer called inside a zone returns its local slice, *tagged* with a :class:`Split`:
  which dimension is split and every rank's ``(start, length)`` along it.
* Each op on a tagged tensor goes through a rule that either proves the op acts slice by slice
  and tags its output (element-wise ops with broadcasting, reshapes that keep the split on the
  outermost dimension of its group, transposes, indexing that leaves the split dimension
  whole, concatenation and reductions along other dimensions, batched matmuls, softmax,
  ``scaled_dot_product_attention`` over split heads), or, when no rule applies, gathers the
  full tensor first and runs the op on it. The fallback costs communication, never
  correctness. A sum or mean across the split is a local sum and one all-reduce.
* A consumer whose input is tagged the way it is split takes the slice as it is; the
  zone's outputs that are still tagged are gathered, so a zone looks replicated-in,
  replicated-out from outside.
* A consumer inside a zone hands out its partial sum tagged :class:`Partial` (``pending``):
  it stays pending through ops linear in it (another pending sum, a whole tensor added once)
  until an op needs it whole, so sums that meet first share one all-reduce.
* A reshape that merges the split heads with the batch (``reshape(batch * num_heads, ...)``)
  gives a :class:`Strided` split (``strided``), kept through batched matmuls and reshaped back.
* Producers of one zone that read the same input share one ``copy_to_ranks``: q, k and v
  then cost one all-reduce of the input's gradient in backward instead of three.

Gradients follow one rule: a replicated tensor (a parameter kept whole, or a gathered
activation) gets its complete gradient on every rank. Every transition keeps it with its
exact adjoint: a gather's backward keeps this rank's slice, a replicated operand cut to this
rank's slice gathers its gradient back, and a replicated operand that every rank combines
whole with its own slices (the weight of a per-head norm such as Qwen3's ``q_norm``, a
statistic broadcast over the split dimension) goes through ``copy_to_ranks``, whose backward
sums the ranks' partial gradients.

Decisions depend only on shapes and on the split (the same on every rank), so every rank
takes the same path and the collectives of a fallback always match.

All this runs on a zone's first call of each input signature only: where the engine ran
every op as the model wrote it, later calls of the signature replay the forward plainly,
with its sharded layers' inputs and its outputs tagged as recorded (``replay``). Ops on
pending sums still go through the engine in a replay (``_PendingTensor``).

Sizes in the model's code mean what they mean in the unsharded model: a ``view(b, s,
num_heads, 3, head_dim)`` with a fixed ``num_heads`` (BLOOM), a ``reshape(b, s, embed_dim)``
(OPT) or an ``expand`` to a whole size is read against the whole tensor and mapped to this
rank's heads; only sizes that fit the slice and not the whole (taken from the slice's own
shape) are read as local. Arguments are bound through torch's own signatures
(``signatures``), so overloads and keyword forms read alike (``x.std(1, True)`` is
``dim=1, unbiased=True``). A split that cuts a head is refused at shard time by
:func:`check_head_boundaries` for modules that declare a head size (``head_dim``,
``attention_head_size``, ``head_size``).

:func:`loss_parallel` opens a zone around the caller's own code: the split logits of an
``lm_head`` split on the vocabulary then reach ``cross_entropy`` as slices, which computes the
loss with three all-reduces of per-row numbers instead of gathering the logits.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from _shardkit import comm as _comm
from sharding import layout

from . import replay as _replay
from . import rule_table as _rule_table
from .functional import copy_to_ranks, gather, reduce_from_ranks, scatter
from .signatures import aten_name, bind

__all__ = ["Split", "Packed", "Partial", "Strided", "TAG_KINDS", "GLOBAL_SIZES",
           "split_of", "tag", "in_zone", "shared_copy",
           "ZoneForward", "loss_parallel",
           "to_replicated", "outside_propagation", "Endpoint", "find_zones", "check_head_boundaries",
           "entering_layer", "leaving_layer", "as_pending", "summed_pending", "zone_calls"]


@dataclass(frozen=True, slots=True)
class Split(layout.Split):
    """A tensor that holds this rank's slice of a logical tensor split along ``dim``: the
    placement ``sharding.layout.Split`` (``intervals[r]`` is group rank ``r``'s ``(start,
    length)``) over the process group ``group``."""

    group: _comm.ProcessGroup = None


@dataclass(frozen=True, slots=True)
class Packed(layout.Packed):
    """A tensor that holds, concatenated along ``dim``, several slices of a logical tensor: the
    placement ``sharding.layout.Packed`` over the process group ``group``.

    ``pieces[r]`` lists group rank ``r``'s ``(start, length)`` slices in order, as a fused
    projection split by heads produces them (its rows of q, then of k, then of v). The one
    op that takes such a tensor apart is ``split``/``chunk`` along ``dim`` at the slices'
    boundaries (``qkv.split(embed_dim, dim=-1)``), which gives ordinary splits; any other op
    gathers it first.
    """

    group: _comm.ProcessGroup = None


@dataclass(frozen=True, slots=True)
class Partial(layout.Partial):
    """A tensor that holds this rank's addend of a logical tensor: the placement
    ``sharding.layout.Partial`` (``reduce_op="sum"``) over the process group ``group``.

    A row-parallel projection (``o_proj``, ``down_proj``: input features split) computes one
    such addend per rank. It stays pending through ops that are linear in it (adding another
    pending sum, adding a whole tensor once, scaling by a whole tensor, reshaping) until an op
    needs its values, which sums it with one all-reduce (see ``pending``).
    """

    group: _comm.ProcessGroup = None


@dataclass(frozen=True, slots=True)
class Strided(layout.Strided):
    """A split dimension merged with dimensions outside it: the placement ``sharding.layout.Strided``
    (``blocks`` blocks, rank ``r`` holding ``intervals[r]`` of each) over the process group ``group``.

    ``reshape(batch * num_heads, ...)`` of a tensor split on its heads gives one (see ``strided``).
    """

    group: _comm.ProcessGroup = None


# Tags beyond Split and Packed, by type: (the rule for an op reading a tensor so tagged, its whole
# tensor). The modules that give their meaning fill it (``pending``, ``strided``).
TAG_KINDS: dict[type, tuple[Callable[..., Any], Callable[[torch.Tensor, Any], torch.Tensor]]] = {}


# Tags whose tensors tell the model's code their global sizes (``x.shape``, ``x.size(0)``), by type:
# the metadata read to run instead. A strided split does (see ``strided``): code such as BLOOM's
# ``x.shape[0] // num_heads`` reads the merged dimension as the whole batch times the heads.
GLOBAL_SIZES: dict[type, Callable[..., Any]] = {}


# A tag lives on the tensor object itself: reading an attribute costs far less per op than a
# weak dictionary lookup, and it goes away with the tensor just the same.
_TAG = "_shardkit_split"
# A sharded parameter carries its record (``record.ShardedParameter``) under this attribute.
# Inside a zone, an op that reads a parameter whose record has a ``label`` directly (not
# through its module's registration) would see only this rank's block, so it is refused
# instead of computing wrong numbers.
RECORD = "_shardkit_record"
_OWNED = RECORD


def _split_label(tensor: torch.Tensor) -> str | None:
    """How messages name ``tensor`` when it is a split parameter only its module may use, else ``None``."""
    label: str | None = getattr(getattr(tensor, _OWNED, None), "label", None)
    return label


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.copies: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
        self.keep_split_outputs = False
        self.ranks: dict[Any, tuple[int, int]] = {}  # rank and world per group, looked up once per zone call
        self.recorders: list[_replay.Recording] = []  # checked zone calls recording, innermost last
        self.replay: _replay.Cursor | None = None  # the zone call being replayed
        self.tracing = False  # inside torch.compile's trace of a zone: nested zones run as they are
        self.pending_op = False  # an op on pending sums only is running (checked): see ``_pending_op``


_STATE = _State()


def _rank(group: _comm.ProcessGroup) -> int:
    """This process's rank in ``group`` (``rank_and_world`` costs a microsecond or more per call)."""
    return rank_and_world(group)[0]


def rank_and_world(group: _comm.ProcessGroup) -> tuple[int, int]:
    """``_comm.rank_and_world(group)``, looked up once per outermost zone call (groups change only between)."""
    if not _STATE.depth:
        return _comm.rank_and_world(group)
    ranks = _STATE.ranks
    try:
        return ranks[group]
    except KeyError:
        found = ranks[group] = _comm.rank_and_world(group)
        return found


def split_of(tensor: object) -> Split | None:
    """The (one-slice) split ``tensor`` is tagged with, if any."""
    if isinstance(tensor, torch.Tensor):
        found = getattr(tensor, _TAG, None)
        return found if isinstance(found, Split) else None
    return None


def tag(tensor: torch.Tensor, split: Split | Packed | Partial | Strided) -> torch.Tensor:
    """Mark ``tensor`` as this rank's slice of a logical tensor split as ``split``."""
    setattr(tensor, _TAG, split)
    return tensor


def in_zone() -> bool:
    """Whether sharded layers should hand out and accept split activations."""
    return _STATE.depth > 0


def shared_copy(tensor: torch.Tensor, group: _comm.ProcessGroup) -> torch.Tensor:
    """``copy_to_ranks(tensor)``, shared by every producer of the current zone that reads it."""
    if not _STATE.copies:
        return copy_to_ranks(tensor, group)
    frame = _STATE.copies[-1]
    hit = frame.get(id(tensor))
    if hit is not None and hit[0] is tensor:
        return hit[1]
    copied = copy_to_ranks(tensor, group)
    frame[id(tensor)] = (tensor, copied)
    return copied


class _Outside:
    """Leaves the propagation mode for a ``with`` block when it is the innermost mode (once per sharded layer call)."""

    __slots__ = ("_popped", "_plain")

    def __enter__(self) -> None:
        self._popped = self._plain = None
        if _STATE.depth:
            n = torch._C._len_torch_function_stack()
            if n and isinstance(torch._C._get_function_stack_at(n - 1), _Propagate):
                self._popped = torch._C._pop_torch_function_stack()
            elif _STATE.replay is not None and _STATE.replay.plan.pending:
                # A replayed call's pending sums are ``_PendingTensor``s: a layer computes on them plainly.
                self._plain = torch._C.DisableTorchFunctionSubclass()
                self._plain.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._popped is not None:
            torch._C._push_on_torch_function_stack(self._popped)
            self._popped = None
        if self._plain is not None:
            self._plain.__exit__(None, None, None)
            self._plain = None


def outside_propagation() -> contextlib.AbstractContextManager[None]:
    """Run a sharded layer's own forward on its local tensors, unseen by the propagation."""
    return _Outside()


def to_replicated(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a tagged slice (collective); an untagged tensor as it is."""
    found = getattr(tensor, _TAG, None) if isinstance(tensor, torch.Tensor) else None
    if found is None:
        return tensor
    if isinstance(found, Split):
        return gather(tensor, found.dim, found.intervals, found.group)
    kind = TAG_KINDS.get(type(found))
    if kind is not None:
        return kind[1](tensor, found)
    # Packed: the j-th slices of all ranks are gathered together, then laid side by side.
    counts = {len(slices) for slices in found.pieces}
    if len(counts) != 1:
        msg = (f"cannot gather an activation packed as {list(found.pieces)} ((start, length) slices per rank): "
               f"every rank must hold the same number of slices.")
        raise ValueError(msg)
    rank, _ = _comm.rank_and_world(found.group)
    offset, parts = 0, []
    for j in range(counts.pop()):
        length = found.pieces[rank][j][1]
        piece = tensor.narrow(found.dim, offset, length)
        offset += length
        intervals = tuple(slices[j] for slices in found.pieces)
        low = min(s for s, _ in intervals)
        parts.append((low, gather(piece, found.dim, tuple((s - low, n) for s, n in intervals), found.group)))
    return torch.cat([p for _, p in sorted(parts, key=lambda x: x[0])], found.dim)


def _to_local(tensor: torch.Tensor, dim: int, split: Split) -> torch.Tensor:
    """This rank's slice of a replicated ``tensor`` along ``dim``, tagged."""
    _intervene("a whole operand was cut to this rank's slice")
    return tag(scatter(tensor, dim, split.intervals, split.group), split.moved(dim))


def _whole(tensor: Any, group: _comm.ProcessGroup) -> Any:
    """A replicated ``tensor`` that each rank combines, whole, with its own slices.

    Each rank's gradient for it then covers only that rank's slices, so its backward sums the
    gradients over the ranks; that keeps the rule every transition here obeys: a replicated
    tensor gets the complete gradient on every rank (which is what makes a gather's backward,
    a slice, exact).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad or not torch.is_grad_enabled() \
            or hasattr(tensor, _TAG):
        return tensor
    _intervene("a whole operand that needs a gradient went through copy_to_ranks")
    return shared_copy(tensor, group)


def _intervene(reason: str) -> None:
    """The engine ran an op otherwise than the caller wrote it: the zone calls being checked cannot replay
    (unless the op was on pending sums only, which a replay hands to the engine too: ``_PendingTensor``;
    the recording knows of them from the pending sums made, ``Recording.made_pending``)."""
    if _STATE.pending_op:
        return
    for recording in _STATE.recorders:
        if recording.reason is None:
            recording.reason = reason


class _PendingTensor(torch.Tensor):
    """A pending sum (``Partial``) in a replayed zone call: every op on it goes through the engine, as when checked.

    A zone whose code adds a row-parallel result to the residual stream and normalizes it (a
    decoder layer) makes ops on pending sums that the engine runs otherwise than written (the
    whole tensor added on one rank, the sum taken when a norm needs it). A replay cannot run
    those plainly, but only they need the engine: the consumers' pending sums are handed out
    as this subclass, whose ``__torch_function__`` sends the ops that touch one through the
    engine's dispatch, while every other op of the zone runs plainly.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        with torch._C.DisableTorchFunctionSubclass():
            try:
                metadata = _KINDS.get(func) is _METADATA_KIND
            except TypeError:  # an unhashable op
                metadata = False
            if metadata:  # shape, dtype, ...: a pending sum's are its addends'
                return func(*args, **(kwargs or {}))
            if not kwargs and _pending_only(args) and _KINDS.get(func) is _OP_KIND:
                # What ``_dispatch`` decides for it, without its general walk: the pending sums' rule.
                try:
                    return as_pending(TAG_KINDS[Partial][0](func, args, {}))
                except _Fallback:
                    return as_pending(_gathered(func, args, {}))
            return as_pending(_dispatch(func, args, kwargs or {}))


def _pending_only(args: tuple[Any, ...]) -> bool:
    """Whether ``args`` hold a pending sum, no other tag, no split parameter and no nested containers."""
    found = False
    for v in args:
        if isinstance(v, Tensor):
            attrs = v.__dict__
            if attrs:
                if _OWNED in attrs:
                    return False
                t = attrs.get(_TAG)
                if type(t) is Partial:
                    found = True
                elif t is not None:
                    return False
        elif isinstance(v, (list, tuple, dict)):
            return False
    return found


def as_pending(value: Any) -> Any:
    """A replayed call's result (of a sharded layer, or of an op on pending sums): each new pending sum
    in it made a ``_PendingTensor`` (its attributes kept), or summed where it is made if the checked
    call's first use of it was its sum (``Plan.sum_first``): then nothing of it needs the engine."""
    if isinstance(value, Tensor):
        found = value.__dict__
        if found and type(found.get(_TAG)) is Partial and type(value) is not _PendingTensor:
            cursor = _STATE.replay
            if cursor is not None:
                made = cursor.made
                cursor.made = made + 1
                if made in cursor.plan.sum_first:
                    return TAG_KINDS[Partial][1](value, found[_TAG])
            pending = value.as_subclass(_PendingTensor)
            pending.__dict__.update(found)
            return pending
        return value
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(as_pending(v) for v in value)
    return value


# -- what a recorded call does with the pending sums it makes (``replay.Recording.made``) ----------

def _unsummed_pending(x: Tensor) -> bool:
    """Whether ``x`` is a pending sum whose sum was not taken (or was, before ``x`` was written to)."""
    attrs = x.__dict__
    if not attrs or type(attrs.get(_TAG)) is not Partial:
        return False
    cached = attrs.get(_SUM)
    return cached is None or cached[0] != x._version


_SUM = "_shardkit_sum"  # ``pending``'s cache of a pending tensor's sum: (its version when summed, the sum)


def _made_pending(value: Any, inputs: list[Tensor]) -> None:
    """Record the new pending sums in ``value`` (walked as ``as_pending`` walks it) made in a recorded call."""
    if not _STATE.recorders:
        return
    if isinstance(value, Tensor):
        if type(getattr(value, _TAG, None)) is Partial and not any(value is x for x in inputs):
            for recording in _STATE.recorders:
                recording.made_pending(value)
    elif isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        for v in value:
            _made_pending(v, inputs)


def _first_use(tensors: list[Tensor], how: str) -> None:
    for recording in _STATE.recorders:
        for x in tensors:
            recording.first_use(x, how)


def summed_pending(tensor: Tensor) -> None:
    """``pending`` took the sum of ``tensor`` (its first use, if nothing used it before)."""
    _first_use([tensor], "summed")


# -- rules ----------------------------------------------------------------------------------------

class _Fallback(Exception):
    """The op cannot run on slices: gather its split inputs and run it on full tensors."""


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _tensors(flat: Sequence[object]) -> list[tuple[int, torch.Tensor]]:
    return [(i, x) for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]


def _elementwise(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Ops that act element by element, with broadcasting (add, mul, silu, where, dropout, ...)."""
    keys = tuple(kwargs)
    nested = any(isinstance(v, (list, tuple, dict)) for v in (*args, *kwargs.values()))
    if nested:
        flat, spec = tree_flatten((args, kwargs))
    else:  # the usual call, tensors and numbers side by side: no pytree needed
        flat, spec = [*args, *kwargs.values()], None
    tensors = [(i, x, getattr(x, _TAG, None)) for i, x in enumerate(flat) if isinstance(x, Tensor)]
    out_ndim = max(t.dim() for _, t, _ in tensors)
    found: Split | None = None
    for _, t, split in tensors:
        if split is None:
            continue
        if not isinstance(split, Split):
            raise _Fallback
        aligned = split if out_ndim == t.dim() else split.moved(out_ndim - t.dim() + split.dim)
        if found is not None and aligned != found:
            raise _Fallback
        found = aligned
    assert found is not None
    if isinstance(args[0], Tensor) and not hasattr(args[0], _TAG) and _in_place(func):
        raise _Fallback  # a replicated tensor updated in place must receive whole values
    for i, t, split in tensors:
        if split is not None:
            continue
        local_dim = found.dim - (out_ndim - t.dim())
        if local_dim < 0 or t.shape[local_dim] == 1:
            flat[i] = _whole(t, found.group)  # broadcast against every rank's slice
            continue
        if t.shape[local_dim] != found.size:
            raise _Fallback
        flat[i] = _to_local(t, local_dim, found)  # a replicated operand: take this rank's slice
    if spec is None:
        n = len(args)
        out = func(*flat[:n], **dict(zip(keys, flat[n:])))
    else:
        args, kwargs = tree_unflatten(flat, spec)
        out = func(*args, **kwargs)
    if isinstance(out, Tensor) and out.dim() == out_ndim:
        return tag(out, found)
    raise _Fallback


_IN_PLACE_OPERATORS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ifloordiv__", "__imod__",
                       "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def _in_place(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_OPERATORS


def _first_split(args: tuple[Any, ...]) -> tuple[torch.Tensor, Split]:
    x = args[0]
    split = getattr(x, _TAG, None)
    if not isinstance(split, Split):
        raise _Fallback
    return x, split


_MOVES: dict[tuple[Split, int], Split] = {}


def _move(split: Split, dim: int) -> Split:
    """``split.moved(dim)``, built once per split and dimension (a lookup costs less than a new split)."""
    if split.dim == dim:
        return split
    try:
        return _MOVES[split, dim]
    except KeyError:
        if len(_MOVES) > 4096:  # many distinct layouts (e.g. changing groups): start over
            _MOVES.clear()
        found = _MOVES[split, dim] = split.moved(dim)
        return found


_NAMES: dict[Any, str] = {}


def _aten_name(func: Any) -> str:
    """``aten_name(func)``, worked out once per op object."""
    try:
        return _NAMES[func]
    except KeyError:
        found = _NAMES[func] = aten_name(func)
        return found
    except TypeError:  # an unhashable op
        return aten_name(func)


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of dimensions of ``a`` and ``b`` with equal products (how a reshape regroups)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi: list[int] = []
        gj: list[int] = []
        pa = pb = 1
        if i < len(a):
            gi.append(i)
            pa = a[i]
            i += 1
        if j < len(b):
            gj.append(j)
            pb = b[j]
            j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa *= a[i]
                i += 1
            elif pb < pa and j < len(b):
                gj.append(j)
                pb *= b[j]
                j += 1
            else:
                return None
        groups.append((gi, gj))
    return groups


def _moved(a: Sequence[int], b: Sequence[int], split: Split) -> Split | None:
    """Where ``split`` of a tensor of shape ``a`` lands once it is reshaped to ``b``; ``None`` if not slice-exact.

    The split must be the outermost dimension of its group (the dimensions a reshape merges or
    cuts together); it then lands on the outermost output dimension that holds whole slices.
    """
    groups = _groups(a, b) if 0 not in a else None
    if groups is None:
        return None
    for gi, gj in groups:
        if split.dim not in gi:
            continue
        if any(a[d] != 1 for d in gi if d < split.dim):
            return None  # the split is not the outermost dimension of its group
        inner_in = math.prod(a[d] for d in gi if d > split.dim)
        for o in gj:  # the outermost output dimension that holds whole slices (constants sit inside)
            moved = split.scaled(o, inner_in, math.prod(b[d] for d in gj if d > o))
            if moved is not None:
                return moved
            if b[o] != 1:
                return None
        return None
    return None


_VIEWS = {"view", "view_as", "unflatten", "squeeze", "unsqueeze"}  # the others may copy: reshape, flatten
_RESHAPE_PLANS: dict[tuple[Any, ...], tuple[tuple[int, ...], Split, bool] | None] = {}


def _meta(value: Any) -> Any:
    """A meta tensor of ``value``'s global shape (tensors only)."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = list(value.shape)
    split = split_of(value)
    if split is not None:
        shape[split.dim] = split.size
    return torch.empty(shape, dtype=value.dtype, device="meta")


def _plan_reshape(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor,
                  split: Split) -> tuple[tuple[int, ...], Split, bool] | None:
    """The output's global shape and split (and whether it is a view), or ``None`` (not slice-exact: gather).

    The sizes a model passes are read first as the unsharded program reads them, against the
    whole tensor (``view(b, s, num_heads, 3, head_dim)`` with a fixed ``num_heads``), then,
    failing that, against the local slice (sizes the code took from the slice's own shape).
    """
    view = aten_name(func) in _VIEWS
    rank, _ = _comm.rank_and_world(split.group)
    length = split.intervals[rank][1]
    whole = list(x.shape)
    whole[split.dim] = split.size
    try:
        shape = list(func(*[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()}).shape)
    except (RuntimeError, ValueError, TypeError, IndexError):
        shape = None
    if shape is not None:
        moved = _moved(whole, shape, split)
        if moved is not None and math.prod(shape) // max(moved.size, 1) * moved.intervals[rank][1] == x.numel():
            return tuple(shape), moved, view
    try:
        out = func(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None
    if not isinstance(out, torch.Tensor):
        return None
    moved = _moved(list(x.shape), list(out.shape), split)
    if moved is None or x.shape[split.dim] != length:
        return None
    shape = list(out.shape)
    shape[moved.dim] = moved.size
    return tuple(shape), moved, view


def _shape_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, split_of(value))
    if isinstance(value, (list, tuple)):
        return tuple(_shape_key(v) for v in value)
    return value


def _reshape_key(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor,
                 split: Any) -> tuple[Any, ...]:
    """What a reshape's decision depends on: the op, the shapes, dtypes and splits of its tensors, its sizes."""
    if not kwargs and all(type(a) is int for a in args[1:]):  # x.view(b, s, -1, d): the sizes as given
        return (func, x.shape, x.dtype, split, args[1:])
    return (func, _shape_key(args), _shape_key(tuple(kwargs.items())))


def _reshape(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """view / reshape / flatten / unflatten / (un)squeeze / view_as, decided once per shapes and split."""
    x, split = _first_split(args)
    return _reshaped(func, args, kwargs, x, split, _reshape_key(func, args, kwargs, x, split))


def _reshaped(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor, split: Split,
              key: tuple[Any, ...]) -> Any:
    """``_reshape`` with its key already worked out."""
    try:
        plan = _RESHAPE_PLANS[key]
    except KeyError:
        plan = _RESHAPE_PLANS[key] = _plan_reshape(func, args, kwargs, x, split)
    except TypeError:  # an unhashable argument
        plan = _plan_reshape(func, args, kwargs, x, split)
    if plan is None:
        raise _Fallback
    shape, moved, view = plan
    local = list(shape)
    local[moved.dim] = moved.intervals[_rank(split.group)][1]
    if _STATE.recorders and not _runs_as_written(func, args, kwargs, local):
        _intervene(f"{_describe(func)} was given this rank's sizes {local} instead of the model's")
    return tag(x.view(local) if view else x.reshape(local), moved)


def _runs_as_written(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                     local: list[int]) -> bool:
    """Whether the reshape as the model wrote it gives the local shape the rule chose."""
    try:
        out = func(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False
    return isinstance(out, torch.Tensor) and list(out.shape) == local


def _named(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, bound as torch binds them (see ``signatures``)."""
    bound = bind(func, args, kwargs)
    if bound is None:
        raise _Fallback
    return bound


def _transpose(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, split = _first_split(args)
    ndim = x.dim()
    name = _aten_name(func)
    order = list(range(ndim))
    if name == "t":
        order = order[::-1]
    elif len(args) == 3 and not kwargs and type(args[1]) is int and type(args[2]) is int and name != "permute":
        d0, d1 = _norm(args[1], ndim), _norm(args[2], ndim)  # x.transpose(1, 2): no binding needed
        order[d0], order[d1] = order[d1], order[d0]
    else:
        bound = _named(func, args, kwargs)
        if name == "permute":
            order = [_norm(d, ndim) for d in bound["dims"]]
        else:  # transpose, swapdims (dim0, dim1), swapaxes (axis0, axis1)
            d0 = _norm(bound["dim0"] if "dim0" in bound else bound["axis0"], ndim)
            d1 = _norm(bound["dim1"] if "dim1" in bound else bound["axis1"], ndim)
            order[d0], order[d1] = order[d1], order[d0]
    out = func(*args, **kwargs)
    return tag(out, _move(split, order.index(split.dim)))


def _getter(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    owner = getattr(func, "__self__", None)
    attr = getattr(owner, "__name__", "")
    out = func(*args, **kwargs)
    if not isinstance(out, torch.Tensor):
        return out  # shape, dtype, device, requires_grad, ...: the local slice's own metadata
    x, split = _first_split(args)
    if attr in ("T", "mT", "mH", "H"):
        ndim = x.dim()
        order = list(range(ndim))
        if attr in ("T", "H"):
            order = order[::-1]
        else:
            order[-1], order[-2] = order[-2], order[-1]
        return tag(out, split.moved(order.index(split.dim)))
    raise _Fallback


def _getitem(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Basic indexing that leaves the split dimension whole (``x[..., :half]``, ``x[:, None]``)."""
    x, split = _first_split(args)
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    listed = [i for i in index if isinstance(i, (list, torch.Tensor))]
    if listed:  # one list of positions keeps its place among slices (qkv[:, :, :, [-2]])
        picked = listed[0]
        if len(listed) > 1 or any(isinstance(i, int) for i in index) or not (
                (isinstance(picked, list) and all(type(p) is int for p in picked))
                or (isinstance(picked, torch.Tensor) and picked.dim() == 1 and not hasattr(picked, _TAG)
                    and not picked.is_floating_point() and picked.dtype != torch.bool)):
            raise _Fallback
    elif any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool) for i in index):
        raise _Fallback
    used = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded: list[object] = []
    for i in index:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.dim() - used))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (x.dim() - sum(1 for i in expanded if i is not None)))
    src = out_dim = 0
    for i in expanded:
        if i is None:
            out_dim += 1
            continue
        if src == split.dim:
            if not (isinstance(i, slice) and i == slice(None)):
                raise _Fallback
            return tag(func(*args, **kwargs), split.moved(out_dim))
        if not isinstance(i, int):
            out_dim += 1
        src += 1
    raise _Fallback


def _expand(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """expand / broadcast_to / expand_as with the split dimension kept: given its local or its whole size."""
    x, split = _first_split(args)
    bound = _named(func, args, kwargs)
    other = bound.get("other")
    if isinstance(other, torch.Tensor):
        if split_of(other) is not None:
            raise _Fallback
        sizes = list(other.shape)
    else:
        sizes = list(bound["size"])
    new = len(sizes) - x.dim()
    at = new + split.dim
    if new < 0 or sizes[at] not in (-1, x.shape[split.dim], split.size):
        raise _Fallback
    if sizes[at] not in (-1, x.shape[split.dim]):
        _intervene(f"{_describe(func)} was given this rank's size along the split instead of the whole")
    sizes[at] = x.shape[split.dim]
    return tag(x.expand(sizes), split.moved(at))


def _along_dim(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Ops that work along one dimension (softmax, cat, split, cumsum): fine along any other."""
    name = _aten_name(func)
    if (name in ("cat", "stack") and len(args) in (1, 2) and isinstance(args[0], (list, tuple))
            and (len(args) == 1 or type(args[1]) is int)
            and (not kwargs or (len(args) == 1 and list(kwargs) == ["dim"]))):  # cat((a, b), dim=-1): no binding
        bound = {"tensors": args[0], "dim": args[1] if len(args) == 2 else kwargs.get("dim", 0)}
    else:
        bound = _named(func, args, kwargs)
    if name in ("cat", "concat", "concatenate", "stack"):
        # torch.cat skips 1-d empty tensors (a cache's first state): they take no part in the split.
        tensors = [t for t in bound["tensors"] if not (name != "stack" and t.dim() == 1 and t.numel() == 0)]
        dim = bound.get("dim", 0)
        splits = {split_of(t) for t in tensors}
        if None in splits or len(splits) != 1 or not isinstance(dim, int):
            raise _Fallback
        split = splits.pop()
        assert split is not None
        ndim = tensors[0].dim()
        if name == "stack":
            d = _norm(dim, ndim + 1)
            out = func(*args, **kwargs)
            return tag(out, split.moved(split.dim + (1 if d <= split.dim else 0)))
        if _norm(dim, ndim) == split.dim:
            raise _Fallback
        return tag(func(*args, **kwargs), split)
    x, split = _first_split(args)
    dim = bound.get("dim")
    if not isinstance(dim, int) or _norm(dim, x.dim()) == split.dim:
        raise _Fallback  # along the split, or softmax's legacy implicit dimension
    if name in ("split", "chunk", "unbind"):
        parts = func(*args, **kwargs)
        moved = split.moved(split.dim - 1) if name == "unbind" and _norm(dim, x.dim()) < split.dim else split
        return tuple(tag(p, moved) for p in parts)
    return tag(func(*args, **kwargs), split)


def _setitem(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``buffer[key] = value`` where ``key`` leaves the buffer's split whole and ``value`` is split alike."""
    if len(args) != 3 or kwargs or split_of(args[0]) is None:
        raise _Fallback
    view = _getitem(torch.Tensor.__getitem__, args[:2], {})
    if not isinstance(args[2], torch.Tensor) or split_of(args[2]) != split_of(view) or args[2].dim() != view.dim():
        raise _Fallback
    return func(*args, **kwargs)


def _roll(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``roll`` along dimensions other than the split."""
    x, split = _first_split(args)
    dims = _named(func, args, kwargs).get("dims")
    dims = (dims,) if isinstance(dims, int) else dims
    if not dims or not all(isinstance(d, int) for d in dims) or split.dim in {_norm(d, x.dim()) for d in dims}:
        raise _Fallback
    return tag(func(*args, **kwargs), split)


def _write_split(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``buffer.index_copy_(dim, index, source)`` (along another dimension than the split) and
    ``buffer.copy_(source)`` (same shape) of a split source into a buffer.

    A buffer tagged with the source's split takes its slice as is. An untagged buffer whose
    extent along the split is this rank's slice, not the whole, can only have been sized from
    split tensors' shapes (which read local): a static key/value cache allocated from the first
    keys. The whole tensor would not fit in it, so the unsharded program cannot mean that: it
    takes this rank's slice and is tagged with the split from then on.
    """
    bound = _named(func, args, kwargs)
    dest = bound.get("self")
    if aten_name(func) == "copy_":
        source, dim, index = bound.get("src"), None, None
    else:
        source, dim, index = bound.get("source"), bound.get("dim"), bound.get("index")
    split = split_of(source)
    if (split is None or not isinstance(dest, torch.Tensor) or not isinstance(source, torch.Tensor)
            or hasattr(index, _TAG) or dest.dim() != source.dim()
            or (dim is None and dest.shape != source.shape)
            or (dim is not None and (not isinstance(dim, int) or _norm(dim, dest.dim()) == split.dim))):
        raise _Fallback
    held = getattr(dest, _TAG, None)
    if held is None:
        local = source.shape[split.dim]
        if dest.shape[split.dim] != local or local == split.size:
            raise _Fallback
    elif held != split:
        raise _Fallback
    out = func(*args, **kwargs)
    tag(dest, split)
    return out


def _reduce(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """sum / mean / amax / amin / var / std / logsumexp over dimensions other than the split one."""
    x, split = _first_split(args)
    bound = _named(func, args, kwargs)
    dims = bound.get("dim")
    if dims is None or isinstance(dims, torch.Tensor) or (isinstance(dims, (list, tuple)) and not dims):
        raise _Fallback  # every dimension (an empty list means every dimension too)
    dims = [dims] if isinstance(dims, int) else list(dims)
    normed = sorted(_norm(d, x.dim()) for d in dims)
    if split.dim in normed:
        return _sum_across(aten_name(func), x, split, normed, bound)
    out = func(*args, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise _Fallback
    shift = 0 if bound.get("keepdim", False) else sum(1 for d in normed if d < split.dim)
    return tag(out, split.moved(split.dim - shift))


def _sum_across(name: str, x: torch.Tensor, split: Split, dims: list[int], bound: dict[str, Any]) -> torch.Tensor:
    """sum / mean over dimensions that include the split one: local sums, then one all-reduce.

    The result is whole on every rank; the all-reduce's adjoint is the identity, since its
    gradient is complete on every rank and each element of every slice enters the sum once.
    """
    if name not in ("sum", "mean") or bound.get("dtype") is not None or not x.is_floating_point():
        raise _Fallback  # amax, var, std, logsumexp: not a plain sum of the slices
    _intervene(f"{name} across the split dimension summed over the ranks")
    keepdim = bool(bound.get("keepdim", False))
    total = reduce_from_ranks(x.sum(dims, keepdim=keepdim), split.group)
    if name == "mean":
        count = math.prod(split.size if d == split.dim else x.shape[d] for d in dims)
        total = total / count
    return total


def _matmul(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Batched matmul with the split on a batch dimension, a row of the left or a column of the right."""
    a, b = args[0], args[1]
    if kwargs or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() < 2 or b.dim() < 2:
        raise _Fallback
    sa, sb = split_of(a), split_of(b)
    out = None
    nd = max(a.dim(), b.dim())

    def batch_dim(t: torch.Tensor, s: Split) -> int | None:
        d = nd - t.dim() + s.dim
        return d if s.dim < t.dim() - 2 else None

    found: Split | None = None
    if sa is not None:
        if sa.dim == a.dim() - 1:
            raise _Fallback  # contraction dimension: a partial sum
        found = sa.moved(nd - 2) if sa.dim == a.dim() - 2 else sa.moved(batch_dim(a, sa))  # type: ignore[arg-type]
    if sb is not None:
        if sb.dim == b.dim() - 2:
            raise _Fallback
        mine = sb.moved(nd - 1) if sb.dim == b.dim() - 1 else sb.moved(batch_dim(b, sb))  # type: ignore[arg-type]
        if found is not None and found != mine:
            raise _Fallback
        found = mine
    assert found is not None
    operands = [a, b]
    if found.dim < nd - 2:  # a batch split: the other operand broadcasts along it, or takes its slice
        for i, (t, s) in enumerate(((a, sa), (b, sb))):
            if s is None:
                local = found.dim - (nd - t.dim())
                if local >= 0 and t.shape[local] != 1:
                    if t.shape[local] != found.size:
                        raise _Fallback
                    operands[i] = _to_local(t, local, found)
                else:
                    operands[i] = _whole(t, found.group)
    elif (found.dim == nd - 2 and sb is not None) or (found.dim == nd - 1 and sa is not None):
        raise _Fallback
    else:  # rows of a split, or columns of b: the other operand is used whole by every rank
        operands = [_whole(t, found.group) for t in operands]
    out = func(*operands, *args[2:])
    return tag(out, found)


def _linear(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = _named(func, args, kwargs)["self"]
    split = split_of(x)
    others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor) and a is not x]
    if split is None or split.dim == x.dim() - 1 or any(split_of(t) is not None for t in others):
        raise _Fallback
    args = tuple(_whole(a, split.group) for a in args)
    kwargs = {k: _whole(v, split.group) for k, v in kwargs.items()}
    return tag(func(*args, **kwargs), split)


def _norm_last(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """layer_norm / rms_norm: normalize over the last dimensions, which must not be split."""
    x, split = _first_split(args)
    bound = _named(func, args, kwargs)
    shape = bound["normalized_shape"]
    count = 1 if isinstance(shape, int) else len(shape)
    others = [bound.get(k) for k in ("weight", "bias") if isinstance(bound.get(k), torch.Tensor)]
    if split.dim >= x.dim() - count or any(split_of(t) is not None for t in others):
        raise _Fallback
    args = tuple(_whole(a, split.group) for a in args)
    kwargs = {k: _whole(v, split.group) for k, v in kwargs.items()}
    return tag(func(*args, **kwargs), split)


def _sdpa(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """scaled_dot_product_attention with q, k and v split on the same head (batch) dimension."""
    bound = _named(func, args, kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    sq, sk, sv = split_of(q), split_of(k), split_of(v)
    if sq is None or sk is None or sv is None or sk != sv or not sq.dim == sk.dim < q.dim() - 2:
        raise _Fallback
    ratio = sq.size // sk.size if sk.size else 0
    if ratio == 0 or sq.size % sk.size or sk.scaled(sq.dim, ratio, 1) != sq:
        raise _Fallback
    if ratio > 1 and not bound["enable_gqa"]:
        raise _Fallback
    if len(args) < 3:
        raise _Fallback  # q, k and v given by name: rare, computed whole
    mask = bound["attn_mask"]
    if isinstance(mask, torch.Tensor):
        if split_of(mask) is not None:
            raise _Fallback
        local = sq.dim - (q.dim() - mask.dim())
        if local >= 0 and mask.shape[local] != 1:
            if mask.shape[local] != sq.size:
                raise _Fallback
            _intervene("an attention mask was cut to this rank's heads")
            mask = scatter(mask, local, sq.intervals, sq.group)
        else:
            mask = _whole(mask, sq.group)
        if len(args) > 3:
            args = (*args[:3], mask, *args[4:])
        else:
            kwargs = {**kwargs, "attn_mask": mask}
    return tag(func(*args, **kwargs), sq)


def _cross_entropy(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Cross-entropy over logits split on the class dimension, without gathering them."""
    logits, split = _first_split(args)
    bound = _named(func, args, kwargs)
    target = bound["target"]
    class_dim = 1 if logits.dim() > 1 else 0
    plain = all(bound.get(k) is None for k in ("weight", "size_average", "reduce")) \
        and bound.get("label_smoothing", 0.0) == 0.0
    if (split.dim != class_dim or not plain or not isinstance(target, torch.Tensor)
            or target.is_floating_point() or split_of(target) is not None or logits.dim() != 2):
        raise _Fallback
    ignore = bound.get("ignore_index", -100)
    reduction = bound.get("reduction", "mean")
    losses = _VocabParallelCE.apply(logits, target, split, ignore)
    valid = target != ignore
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum()


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, split: Split,
                ignore: int) -> torch.Tensor:
        rank, _ = _comm.rank_and_world(split.group)
        start, length = split.intervals[rank]
        x = logits.float()
        top = x.amax(dim=1) if length else x.new_full((x.shape[0],), float("-inf"))
        # ``all_reduced`` (a new tensor): under torch.compile a functional collective with no copy
        # around it, where an in-place reduction is functionalized as a clone and a copy back.
        top = _comm.all_reduced(top, split.group, op="max")
        shifted = x - top.unsqueeze(1)
        exp = shifted.exp()
        total = _comm.all_reduced(exp.sum(dim=1), split.group)
        inside = (target >= start) & (target < start + length)
        local = torch.where(inside, target - start, torch.zeros_like(target))
        picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1) * inside
        picked = _comm.all_reduced(picked, split.group)
        valid = target != ignore
        loss = (total.log() - picked) * valid
        ctx.save_for_backward(exp, total, local, inside, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        exp, total, local, inside, valid = ctx.saved_tensors
        probs = exp / total.unsqueeze(1)
        probs.scatter_add_(1, local.unsqueeze(1), -inside.to(probs.dtype).unsqueeze(1))
        scale = (grad * valid).unsqueeze(1)
        return (probs * scale).to(ctx.dtype), None, None, None


def _split_packed(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``split``/``chunk`` of a packed tensor at its slices' boundaries: one ordinary split per part."""
    x = args[0]
    packed = getattr(x, _TAG, None)
    if not isinstance(packed, Packed):
        raise _Fallback
    name = aten_name(func)
    total = packed.size
    if name == "getitem":
        return _packed_getitem(x, args[1], packed)
    named = _named(func, args, kwargs)
    dim = named.get("dim", 0)
    if not isinstance(dim, int) or _norm(dim, x.dim()) != packed.dim:
        raise _Fallback
    if name == "chunk":
        count = named["chunks"]
        step = -(-total // count)
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
    rank, _ = _comm.rank_and_world(packed.group)
    per_part: list[list[tuple[int, int]]] = [[] for _ in bounds]
    for slices in packed.pieces:
        for j, (low, high) in enumerate(bounds):
            inside = [(s, n) for s, n in slices if low <= s and s + n <= high]
            if sum(n for a, n in slices if a < high and a + n > low) != sum(n for _, n in inside) or len(inside) != 1:
                raise _Fallback  # a slice straddles a boundary, or a part holds several slices
            per_part[j].append((inside[0][0] - low, inside[0][1]))
    local = x.split([part[rank][1] for part in per_part], packed.dim)
    return tuple(tag(t, Split(packed.dim, tuple(part), packed.group)) for t, part in zip(local, per_part))


def _packed_getitem(x: torch.Tensor, index: Any, packed: Packed) -> torch.Tensor:
    """``qkv[..., low:high]``: one slice of each rank's along the packed dimension, as an ordinary split."""
    index = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in index if i is Ellipsis) > 1 or any(
            not (i is Ellipsis or isinstance(i, slice)) for i in index):
        raise _Fallback
    before = index.index(Ellipsis) if Ellipsis in index else len(index)
    positions = list(range(before)) + [x.dim() - (len(index) - j) for j in range(before + 1, len(index))]
    picked = None
    for position, i in zip(positions, (i for i in index if i is not Ellipsis)):
        if i == slice(None):
            continue
        if position != packed.dim or picked is not None:
            raise _Fallback
        picked = i
    if picked is None or picked.step not in (None, 1):
        raise _Fallback
    low, high, _ = picked.indices(packed.size)
    rank, _ = _comm.rank_and_world(packed.group)
    part, offset = [], 0
    for r, slices in enumerate(packed.pieces):
        inside = [(s, n) for s, n in slices if low <= s and s + n <= high]
        if len(inside) != 1 or sum(n for s, n in slices if s < high and s + n > low) != inside[0][1]:
            raise _Fallback  # a slice straddles a boundary, or the part holds several of a rank's slices
        part.append((inside[0][0] - low, inside[0][1]))
        if r == rank:
            offset = sum(n for s, n in slices if s < inside[0][0])
    return tag(x.narrow(packed.dim, offset, part[rank][1]), Split(packed.dim, tuple(part), packed.group))


_ELEMENTWISE = {
    # Elementwise for shardkit's purpose though ATen does not tag them pointwise (composites, casts, copies).
    "where", "masked_fill", "masked_fill_", "true_divide", "rsub", "hardswish", "logsigmoid", "softsign",
    "tanhshrink", "float", "half", "bfloat16", "double", "to", "type_as", "contiguous", "detach", "dropout",
    "requires_grad_", "fill_", "zero_", "__rsub__", "__radd__", "__rmul__", "__rtruediv__", "__rdiv__",
    "__rpow__", "__add__", "__sub__", "__mul__", "__truediv__", "__div__", "__neg__", "__pow__", "__iadd__",
    "__isub__", "__imul__", "__itruediv__", "__and__", "__or__", "__xor__", "__invert__", "__eq__", "__ne__",
    "__lt__", "__le__", "__gt__", "__ge__", "__abs__", "__mod__",
}
_RESHAPES = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as"}
_NAMED_RULES: dict[str, Callable[..., Any]] = {
    **{name: _reshape for name in _RESHAPES},
    **{name: _transpose for name in ("transpose", "swapaxes", "swapdims", "permute", "t")},
    "__getitem__": _getitem,
    "expand": _expand, "expand_as": _expand, "broadcast_to": _expand,
    **{name: _along_dim for name in ("softmax", "log_softmax", "cumsum", "cat", "concat", "concatenate",
                                     "stack", "split", "chunk", "unbind")},
    **{name: _reduce for name in ("sum", "mean", "amax", "amin", "var", "std", "logsumexp")},
    **{name: _matmul for name in ("matmul", "__matmul__", "bmm")},
    "linear": _linear,
    "layer_norm": _norm_last, "rms_norm": _norm_last,
    "scaled_dot_product_attention": _sdpa,
    "cross_entropy": _cross_entropy,
    "index_copy_": _write_split, "copy_": _write_split, "__setitem__": _setitem, "roll": _roll,
}
# Rules that run the op as the caller wrote it and tag its output, reporting any other way they
# run it (``_intervene``); any other rule (a pending sum's, a strided split's, a packed tensor's,
# a registered one) may change the op's arguments, so a zone call that uses one is not replayed.
_PLAIN_RULES: set[Callable[..., Any]] = {_elementwise, _reshape, _transpose, _getitem, _expand, _along_dim, _reduce,
                                         _matmul, _linear, _norm_last, _sdpa, _setitem, _roll, _getter}
_METADATA = {"size", "dim", "stride", "is_contiguous", "is_floating_point", "is_complex", "element_size",
             "data_ptr", "__len__", "storage_offset", "get_device", "untyped_storage", "__hash__", "__format__",
             "__repr__", "__str__", "has_names", "_is_view", "is_inference", "register_hook",
             "register_post_accumulate_grad_hook", "retain_grad", "backward", "__reduce_ex__", "__deepcopy__",
             "__setstate__", "__dlpack__", "__dlpack_device__", "nelement", "numel", "ndimension"}
_SIDE_EFFECTS = {"copy_", "__setitem__", "index_put_", "scatter_", "scatter_add_", "masked_scatter_", "index_copy_",
                 "index_add_", "index_fill_", "put_", "resize_", "set_", "uniform_", "normal_"}


def _pointwise() -> set[str]:
    """Ops that ATen tags pointwise in every overload taking a tensor first, random ones aside."""
    names = {n for owner in (torch.Tensor, torch, F) for n in dir(owner) if not n.startswith("_")}
    found = set()
    for name in names:
        try:
            packet = getattr(torch.ops.aten, name)
            overloads = [getattr(packet, o) for o in packet.overloads()]
        except (AttributeError, RuntimeError):
            continue
        overloads = [o for o in overloads if o._schema.arguments and o._schema.arguments[0].type.kind() == "TensorType"
                     and not any(a.name == "out" for a in o._schema.arguments)]
        if overloads and all(torch.Tag.pointwise in o.tags and torch.Tag.nondeterministic_seeded not in o.tags
                             for o in overloads):
            found.add(name)
    return found - {"equal", "frexp"}  # a bool, a pair: not one tensor of the broadcast shape


def _objects(name: str) -> list[Any]:
    """Every object through which code calls the op ``name``: Tensor method, torch and functional forms."""
    found = []
    for owner in (torch.Tensor, torch, F, torch._C._nn, torch.special):
        obj = getattr(owner, name, None)
        if obj is not None and callable(obj) and not isinstance(obj, type):
            found.append(obj)
    return found


@functools.cache
def _tables() -> tuple[dict[Any, Callable[..., Any]], frozenset[Any], frozenset[Any]]:
    """Rules, metadata reads and side-effecting ops, keyed by the op objects torch hands the mode.

    Built on the first op inside a zone, not at import (reading ATen's op tags takes a while).
    The rules go into the one table of every sharded compute rule (``rule_table``).
    """
    rules: dict[Any, Callable[..., Any]] = _rule_table.RULES
    for name in _ELEMENTWISE | _pointwise():
        for obj in _objects(name):
            rules[obj] = _elementwise
    for name, rule in _NAMED_RULES.items():
        for obj in _objects(name):
            rules[obj] = rule
    metadata = frozenset(o for name in _METADATA for o in _objects(name))
    effects = frozenset(o for name in _SIDE_EFFECTS for o in _objects(name))
    return rules, metadata, effects


def _tag_among(values: Any) -> bool:
    """Whether a tagged tensor is among ``values`` or one level down (split parameters aside)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if hasattr(v, _TAG):
                return True
        elif isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) and hasattr(x, _TAG) for x in v):
            return True
    return False


def _any_tagged(values: Any) -> bool:
    """Whether a tagged tensor or a split parameter is among ``values`` or one level down."""
    for v in values:
        if isinstance(v, torch.Tensor):
            # A split parameter's record has a label (_split_label, inlined: this runs on every op).
            if hasattr(v, _TAG) or getattr(getattr(v, _OWNED, None), "label", None):
                return True
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, (list, tuple, dict)) or (
                        isinstance(x, torch.Tensor) and (hasattr(x, _TAG) or _split_label(x))):
                    return True  # deeper structures take the full look
        elif isinstance(v, dict):
            return True
    return False


def _shallow_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
    """The tensors among the arguments and one level down (lists of tensors); ``None`` if nested deeper."""
    found = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor):
                    found.append(x)
                elif isinstance(x, (list, tuple, dict)):
                    return None
        elif isinstance(v, dict):
            return None
    return found


_VALUE_GETTERS = {"T", "mT", "H", "mH", "real", "imag"}


def _reads_values(getter: Any) -> bool:
    """Whether a ``Tensor`` attribute getter returns the tensor's values (``.T``) rather than metadata."""
    return getattr(getattr(getter, "__self__", None), "__name__", "") in _VALUE_GETTERS


def _describe(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return f"{name}()"


class _Propagate(TorchFunctionMode):
    """Run every torch op on split slices where a rule proves it exact, else on gathered tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Every torch call of a zone's code lands here, and most touch neither a tagged
        # activation nor a split parameter: they go straight through. Both marks are
        # attributes, so a tensor with no attributes of its own (an empty ``__dict__``, the
        # usual case) carries neither, which one read tells.
        if type(func) is torch._ops.OpOverload and not _tag_among((*args, *(kwargs or {}).values())):
            # An operator on untagged tensors may be a compiled graph's (a model compiled and called inside
            # ``loss_parallel``), run on the split parameters themselves: one of the local ops and collectives
            # the rules chose while tracing, not a use of a split parameter to refuse.
            return func(*args, **(kwargs or {}))
        for v in args:
            if isinstance(v, Tensor):
                found = v.__dict__
                if found and (_TAG in found or (_OWNED in found and _split_label(v))):
                    break
            elif isinstance(v, (list, tuple)):
                if v and _any_tagged(v):
                    break
            elif isinstance(v, dict):
                break
        else:
            if not kwargs:
                return func(*args)
            if not _any_tagged(kwargs.values()):
                return func(*args, **kwargs)
        return _dispatch(func, args, kwargs or {})


# What an op object is, decided once per object: a metadata read (no values read), an
# attribute getter that returns values (``.T``), or any other op (whose rule is looked up
# each time: ``register_split_rule`` may add one later).
_KINDS: dict[Any, str] = {}
_METADATA_KIND, _GETTER_KIND, _OP_KIND = "metadata", "getter", "op"


def _kind_of(func: Any) -> str:
    try:
        return _KINDS[func]
    except KeyError:
        pass
    except TypeError:  # an unhashable op
        return _find_kind(func)
    found = _KINDS[func] = _find_kind(func)
    return found


def _find_kind(func: Any) -> str:
    getter = getattr(func, "__name__", "") == "__get__"
    if func in _tables()[1] or (getter and not _reads_values(func)):
        return _METADATA_KIND  # shape, dtype, device, ...: no values read
    return _GETTER_KIND if getter else _OP_KIND


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An op with a tagged tensor or a split parameter among (or near) its arguments."""
    kind = _kind_of(func)
    if kind is _METADATA_KIND:
        found = getattr(args[0], _TAG, None) if args and isinstance(args[0], Tensor) else None
        if found is not None and type(found) in GLOBAL_SIZES:
            if _STATE.recorders:
                _intervene(f"{_describe(func)} read the global sizes of a {type(found).__name__} tensor")
            return GLOBAL_SIZES[type(found)](func, args, kwargs)
        return func(*args, **kwargs)  # shape, dtype, device, ...: no values read
    flat = _shallow_tensors(args, kwargs)
    if flat is None:
        flat = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)]
    tags = []
    tagged = pending_only = False
    for x in flat:
        found = x.__dict__
        if found:
            if _OWNED in found and _split_label(x):
                _refuse_owned(func, x)
            t = found.get(_TAG)
            tags.append(t)
            if t is not None:
                pending_only = (pending_only or not tagged) and type(t) is Partial
                tagged = True
    if not tagged:
        return func(*args, **kwargs)
    if pending_only and _STATE.recorders and not _STATE.pending_op:
        return _pending_op(func, args, kwargs, kind, tags, flat)
    return _tagged_op(func, args, kwargs, kind, tags)


def _pending_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], kind: str, tags: list[Any],
                flat: list[Tensor]) -> Any:
    """``_tagged_op`` of an op whose tagged inputs (among ``flat``, its tensors) are all pending sums, in a
    recorded call.

    A replay runs such an op through the engine too (``_PendingTensor``), so what the engine
    does in it does not make the call unreplayable; unless its output holds another tag than a
    pending sum, which a replay would not give it.
    """
    unsummed = list({id(x): x for x in flat if _unsummed_pending(x)}.values())
    if len(unsummed) > 1:  # combined with another before (or while) summed: a replay must keep them pending
        _first_use(unsummed, "consumed")
    versions = [x._version for x in unsummed]
    _STATE.pending_op = True
    try:
        out = _tagged_op(func, args, kwargs, kind, tags)
    finally:
        _STATE.pending_op = False
    # Not a use: an op that hands back its pending operand untouched (``.to`` its own dtype). Written to in
    # place, the operand holds new addends, which a sum taken where it was made would not see.
    _first_use([x for x, version in zip(unsummed, versions)
                if _unsummed_pending(x) and (x is not out or x._version != version)], "consumed")
    _made_pending(out, flat)
    leaves: list[Any] = []
    if not _replay.output_leaves(out, leaves) or any(
            isinstance(x, Tensor) and x.__dict__ and x.__dict__.get(_TAG) is not None
            and type(x.__dict__[_TAG]) is not Partial for x in leaves):
        _intervene(f"{_describe(func)} on a pending sum gave another split")
    return out


def _tagged_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], kind: str, tags: list[Any]) -> Any:
    """An op with a tagged tensor among its arguments: through its rule, else on gathered inputs."""
    other = None
    for t in tags:  # the first tag that is not a plain split decides
        if t is not None and type(t) is not Split:
            other = t
            break
    if other is not None:
        if type(other) is Packed:
            rule = _split_packed if _aten_name(func) in ("split", "chunk", "getitem") else None
        else:
            rule = TAG_KINDS[type(other)][0]
    else:
        rule = _getter if kind is _GETTER_KIND else _tables()[0].get(func)
    if rule is _elementwise and other is None:
        out = _same_split(func, args, kwargs)
        if out is not None:
            return out
    if rule is not None:
        if _STATE.recorders and rule not in _PLAIN_RULES and not _STATE.pending_op:
            _intervene(f"{_describe(func)} went through a rule that may change its arguments "
                       f"({getattr(rule, '__qualname__', rule)})")
        try:
            return rule(func, args, kwargs)
        except _Fallback:
            pass
    return _gathered(func, args, kwargs)


def _same_split(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An element-wise op whose tensors are all split alike (same split, same rank) among plain numbers.

    The output is split the same way, whatever the op: the common case (``q * cos`` aside) of
    activations combined with each other or with constants, decided without the general rule.
    ``None`` when the call is not of that form.
    """
    found = None
    ndim = -1
    for a in args:
        if isinstance(a, Tensor):
            split = a.__dict__.get(_TAG) if a.__dict__ else None
            if split is None or a.dim() != ndim and ndim >= 0:
                return None
            if found is None:
                found, ndim = split, a.dim()
            elif split is not found and split != found:
                return None
        elif not isinstance(a, (int, float, bool)):
            return None
    if not isinstance(found, Split):
        return None
    for v in kwargs.values():  # options (inplace=False, alpha=2) only
        if not (v is None or isinstance(v, (int, float, bool, str))):
            return None
    out = func(*args, **kwargs)
    if isinstance(out, Tensor) and out.dim() == ndim:
        return tag(out, found)
    return _gathered(func, args, kwargs)


def _refuse_owned(func: Any, owned: Tensor) -> None:
    msg = (f"parameter {_split_label(owned)} is split across ranks, but the model's code uses it directly "
           f"in {_describe(func)} instead of calling its module, so that op would see only this rank's block "
           f"(shape {tuple(owned.shape)}); keep the parameter whole on every rank, or use it only through "
           f"its module.")
    raise RuntimeError(msg)


def _gathered(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The op on whole tensors: every split input gathered (collective), unless it writes a split tensor."""
    _, _, effects = _tables()
    written = kwargs.get("out")
    if written is None and args and (func in effects or _in_place(func)):
        written = args[0]
    if isinstance(written, Tensor) and hasattr(written, _TAG):  # a gathered copy would take the write
        owner = written
        split = getattr(owner, _TAG)
        name = getattr(func, '__name__', func)
        if isinstance(split, Partial):
            msg = (f"in-place op {name!r} on a pending sum (the output of a layer split on its input features, "
                   f"shape {tuple(owner.shape)}, of which each rank holds one addend until it is summed) cannot be "
                   f"run on the addends, nor on their sum in their place; make the op out-of-place "
                   f"(y = y + z instead of y += z).")
        elif isinstance(split, Split):
            msg = (f"in-place op {name!r} on an activation split across ranks along dimension {split.dim} "
                   f"(shape {tuple(owner.shape)} here, {split.size} in full) cannot be run slice by slice; keep the "
                   f"layers that produce it whole, or make the op out-of-place.")
        else:
            msg = (f"in-place op {name!r} on an activation split across ranks as {type(split).__name__} "
                   f"(shape {tuple(owner.shape)} here) cannot be run on this rank's slices; keep the layers that "
                   f"produce it whole, or make the op out-of-place.")
        raise RuntimeError(msg)
    if _STATE.recorders:
        _intervene(f"{_describe(func)} ran on gathered inputs")
    if not any(isinstance(v, (list, tuple, dict)) for v in (*args, *kwargs.values())):
        # The usual call (a norm's ``x.pow(2)`` summing a pending sum): no pytree needed.
        args = tuple(to_replicated(x) if isinstance(x, Tensor) and hasattr(x, _TAG) else x for x in args)
        kwargs = {k: to_replicated(v) if isinstance(v, Tensor) and hasattr(v, _TAG) else v
                  for k, v in kwargs.items()}
        return func(*args, **kwargs)
    flat_all, spec = tree_flatten((args, kwargs))
    flat_all = [to_replicated(x) if isinstance(x, Tensor) and hasattr(x, _TAG) else x for x in flat_all]
    args, kwargs = tree_unflatten(flat_all, spec)
    return func(*args, **kwargs)


@contextlib.contextmanager
def _zone() -> Iterator[None]:
    if not _STATE.depth:
        _STATE.ranks = {}  # groups may change between calls, never during one
    _STATE.depth += 1
    _STATE.copies.append({})
    try:
        if _STATE.depth == 1:
            with _Propagate():
                yield
        else:
            yield
    finally:
        _STATE.copies.pop()
        _STATE.depth -= 1


def _gather_outputs(value: Any, pending_only: bool = False) -> Any:
    """``value`` with its tagged tensors whole (with ``pending_only``, its pending sums only: splits stay)."""
    if isinstance(value, torch.Tensor):
        if pending_only and not isinstance(getattr(value, _TAG, None), Partial):
            return value
        return to_replicated(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_gather_outputs(v, pending_only) for v in value)
    if isinstance(value, list):
        return [_gather_outputs(v, pending_only) for v in value]
    if isinstance(value, dict) and type(value) is dict:
        return {k: _gather_outputs(v, pending_only) for k, v in value.items()}
    if isinstance(value, dict):  # e.g. transformers' ModelOutput: update in place, keep the type
        for k, v in list(value.items()):
            found = _gather_outputs(v, pending_only)
            if found is not v:  # a ModelOutput's item assignment is slow: only what changed
                value[k] = found
        return value
    return value


class ZoneForward:
    """``forward`` of a zone's root module: the module's own forward, run on split activations.

    The first call of each input signature runs checked (under :class:`_Propagate`, nested in
    the enclosing zone's when there is one); later calls of a signature whose checked call
    the engine ran as written replay it plainly (``replay``).
    """

    _MAX_SIGNATURES = 64  # more distinct signatures than this (varying lengths): start over

    def __init__(self, original: Callable[..., Any]) -> None:
        self._original = original
        functools.update_wrapper(self, original)  # inspect.signature(model.forward) keeps working
        self._module: torch.nn.Module = original.__self__  # type: ignore[attr-defined]
        self._ties = _ties(self._module)
        self._plans: dict[Any, _replay.Plan | str] = {}  # signature -> its plan, or why it stays checked
        self.checked = 0  # calls run under the engine
        self.replayed = 0  # calls replayed plainly

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = _STATE
        if state.replay is not None or state.tracing:  # inside a replayed or traced zone: as the enclosing one runs
            return self._original(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Outermost in the compiled region, even inside a zone opened outside it (``loss_parallel``):
            # dynamo must not trace the propagation op by op, it cannot (it reads tensors' ``__dict__``).
            return _traced_zone(self._module, self._ties, *args, **kwargs)
        key = None
        if _replay.enabled():
            key = _replay.signature(self._module.training, state.keep_split_outputs, args, kwargs)
        plan = self._plans.get(key) if key is not None else None
        if isinstance(plan, _replay.Plan) and not state.depth:
            self.replayed += 1
            return self._replayed(plan, args, kwargs)
        self.checked += 1
        recording = _replay.Recording() if key is not None and plan is None else None
        if recording is not None:
            state.recorders.append(recording)
        try:
            if state.depth:
                out = self._original(*args, **kwargs)
            else:
                with _zone():
                    out = self._original(*args, **kwargs)
        finally:
            if recording is not None:
                state.recorders.pop()
        if recording is not None:
            if len(self._plans) >= self._MAX_SIGNATURES:
                self._plans.clear()
            self._plans[key] = recording.plan(out, outermost=not state.depth)
        return out if state.depth else _exit(out)

    def _replayed(self, plan: _replay.Plan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module's forward run plainly, its sharded layers' inputs and its outputs tagged as recorded.

        Only an outermost zone replays: a zone nested in a checked one receives and hands out
        values whose pending sums the enclosing engine resolves per rank (a whole tensor added
        once), which a plain run of the nested zone's code does not reproduce.
        """
        state = _STATE
        cursor = _replay.Cursor(plan, self._module)
        state.ranks = {}
        state.copies.append({})
        state.depth += 1
        state.replay = cursor
        try:
            out = self._original(*args, **kwargs)
            with torch._C.DisableTorchFunctionSubclass() if plan.pending else contextlib.nullcontext():
                cursor.finish(out)
        finally:
            state.replay = None
            state.depth -= 1
            state.copies.pop()
        if plan.pending:  # pending sums handed out are summed here: plainly, as the checked call's exit does
            with torch._C.DisableTorchFunctionSubclass():
                return _exit(out)
        return _exit(out)

    def calls(self) -> dict[str, Any]:
        """How many calls ran checked and replayed, and why signatures stay checked."""
        reasons = sorted({p for p in self._plans.values() if isinstance(p, str)})
        return {"checked": self.checked, "replayed": self.replayed, "not_replayed_because": reasons}


def _exit(out: Any) -> Any:
    """An outermost zone's outputs as it hands them out: gathered (pending sums only under ``loss_parallel``)."""
    if _STATE.keep_split_outputs:
        return _gather_outputs(out, pending_only=True)
    return _gather_outputs(out)


def entering_layer(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A sharded layer is called in a checked zone call that records: its inputs' tags are recorded
    (and a pending sum among them is used by the layer: a replay hands it to the layer pending)."""
    if not _STATE.recorders:
        return
    inputs = _replay.layer_inputs(args, kwargs)
    for recording in _STATE.recorders:
        recording.layer(module, inputs)
    _first_use([x for x in inputs if _unsummed_pending(x)], "consumed")


def leaving_layer(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A sharded layer's output in a checked zone call that records: the pending sums it makes are recorded."""
    _made_pending(out, _replay.layer_inputs(args, kwargs))
    return out


def zone_calls(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Per zone of ``model`` (by module name): calls checked, calls replayed, why signatures stay checked."""
    return {name: forward.calls() for name, module in model.named_modules()
            if isinstance(forward := module.__dict__.get("forward"), ZoneForward)}


def _ties(module: torch.nn.Module) -> tuple[tuple[str, ...], ...]:
    """Names under which ``module`` holds one parameter or buffer several times (tied embeddings), in order."""
    names: dict[int, list[str]] = {}
    held = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    for name, value in held:
        names.setdefault(id(value), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def _attribute(module: torch.nn.Module, name: str) -> Any:
    owner, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner), attr)


@torch._dynamo.nonstrict_trace
def _traced_zone(module: torch.nn.Module, ties: tuple[tuple[str, ...], ...], *args: Any, **kwargs: Any) -> Any:
    """A zone's forward under ``torch.compile``: one opaque call for dynamo, traced by AOTAutograd.

    Dynamo does not step into the propagation (its tags and rules are plain Python, decided
    from shapes); AOTAutograd runs it on fake tensors instead, so the graph receives only the
    local ops and the collectives each rule chose, and their backward.

    AOTAutograd swaps each parameter for its traced value under its first name only; a tied
    parameter's other names (an ``lm_head`` tied to the embedding) would keep the real tensor,
    a constant without gradient, so they are pointed at the traced value too.
    """
    aliases = {alias: _attribute(module, group[0]) for group in ties for alias in group[1:]}
    state = _STATE
    previous = state.tracing, state.depth
    state.tracing, state.depth = True, 0
    try:
        with _without_propagation(), torch.nn.utils.stateless._reparametrize_module(module, aliases), _zone():
            out = type(module).forward(module, *args, **kwargs)
        # Outputs leave the graph as plain tensors, where a split one would lose its tag (and pass
        # for a whole one): they are gathered whole, under ``loss_parallel`` too.
        return _gather_outputs(out)
    finally:
        state.tracing, state.depth = previous


@contextlib.contextmanager
def _without_propagation() -> Iterator[None]:
    """The torch function mode stack without the propagation of a zone opened outside the compiled region
    (``loss_parallel``): the traced zone runs as an outermost one, its ops seen by its own propagation only.
    Tracing may have pushed modes above it, so it is taken out wherever it sits."""
    modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())][::-1]
    for mode in modes:
        if not isinstance(mode, _Propagate):
            torch._C._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        for mode in modes:
            torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Keep outputs split inside the ``with`` block: logits of a vocabulary-split ``lm_head`` stay slices.

    Inside the block, a Linear split on its output features (such as an ``lm_head`` split on
    the vocabulary) returns this rank's slice, and ``F.cross_entropy`` on such logits computes
    the loss over the whole vocabulary with three all-reduces of one number per row instead of
    gathering the logits. Any other op on the slices gathers them first, so results do not
    change; only the communication does. Call ``backward()`` inside or after the block.

    Example:
        >>> with st.loss_parallel():  # doctest: +SKIP
        ...     loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        >>> loss.backward()  # doctest: +SKIP
    """
    previous = _STATE.keep_split_outputs
    _STATE.keep_split_outputs = True
    try:
        with _zone():
            yield
    finally:
        _STATE.keep_split_outputs = previous


# -- finding zones at shard time ------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    """A sharded layer seen from the zones: its module name, role and the split of that activation.

    ``split`` is along the activation's last dimension, given as dimension 0: a producer's
    output may be packed (a fused projection's heads of q, k and v), a consumer's input is one
    slice per rank.
    """

    name: str
    role: Literal["produces", "consumes"]
    split: layout.Split | layout.Packed

    def slices(self) -> list[tuple[int, int]]:
        if isinstance(self.split, layout.Packed):
            return [p for slices in self.split.pieces for p in slices]
        return list(self.split.intervals)


def _matches(producer: Endpoint, consumer: Endpoint) -> bool:
    """Whether the producer's split output is what the consumer takes, directly or once unpacked
    (each of the packed blocks split as the consumer's input: ``qkv.split(...)`` then gives it)."""
    assert isinstance(consumer.split, layout.Split)
    given = producer.split
    if isinstance(given, layout.Packed):
        strided = given.strided()
        return strided is not None and strided.intervals == consumer.split.intervals
    return given.intervals == consumer.split.intervals


def _ancestor(a: str, b: str) -> str:
    pa, pb = a.split(".") if a else [], b.split(".") if b else []
    common: list[str] = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def find_zones(endpoints: Sequence[Endpoint]) -> list[str]:
    """Names of the modules whose forward runs on split activations: for every consumer and a
    producer split the same way, their closest common ancestor. Pure."""
    producers = [e for e in endpoints if e.role == "produces"]
    roots: dict[str, None] = {}
    for consumer in (e for e in endpoints if e.role == "consumes"):
        if any(length == 0 for _, length in consumer.slices()):
            continue  # a rank without a slice would take other code paths than its peers
        for producer in producers:
            if _matches(producer, consumer):
                root = _ancestor(producer.name, consumer.name)
                if root not in (producer.name, consumer.name):
                    roots.setdefault(root)
    return list(roots)


_HEAD_ATTRS = ("head_dim", "attention_head_size", "head_size")


def check_head_boundaries(root_name: str, root: torch.nn.Module, endpoints: Sequence[Endpoint]) -> None:
    """Refuse splits of attention projections that cut a head.

    Every module under ``root`` that declares a head size (``head_dim``, ``attention_head_size``
    or ``head_size``) must have each sharded projection below it split on multiples of it.
    """
    for mod_name, module in root.named_modules():
        size = next((getattr(module, a) for a in _HEAD_ATTRS if isinstance(getattr(module, a, None), int)), None)
        if not size:
            continue
        full = f"{root_name}.{mod_name}".strip(".") if mod_name else root_name
        for e in endpoints:
            if full and not e.name.startswith(full + "."):
                continue
            bad = [(s, n) for s, n in e.slices() if s % size or n % size]
            if bad:
                msg = (f"module {e.name!r} is split as {e.slices()} ((start, length) per rank) inside "
                       f"{full or 'the root module'!r} ({type(module).__name__}), whose head size is {size}; "
                       f"split attention projections on head boundaries (multiples of {size}), e.g. an even "
                       f"split when the number of heads is divisible by the number of ranks.")
                raise ValueError(msg)
