"""The engine's placements, each with its moves, and the collectives those moves are made of.

Inside a sharded model an activation is an ordinary local tensor *tagged* with how the
ranks of a process group hold the logical tensor it is part of: one of four placements of
``sharding.layout`` plus that group.

=============  ================================================  ====================================
placement      this rank's local tensor                          to whole (``whole``)
=============  ================================================  ====================================
``Split``      its slice along ``dim`` (``intervals[rank]``)     all-gather; backward keeps the slice
``Packed``     several slices side by side (a fused q/k/v)       one all-gather per slice
``Strided``    its slice of each of ``blocks`` blocks            all-gather of the unflattened blocks
``Partial``    one addend of a sum over the ranks                all-reduce; backward the identity
=============  ================================================  ====================================

A placement also cuts a whole tensor to this rank's part (``cut``: no communication forward,
an all-gather of the gradient backward), and ``Partial`` adds a whole value once
(``add_once``). Two more moves concern whole tensors: ``copy_to_ranks`` (identity forward,
the sum of every rank's gradient backward) for a whole operand each rank combines with its
own slice, and ``reduce_from_ranks`` (all-reduce forward, identity backward).

Why the adjoints are exact: a whole tensor (a parameter kept whole, a gathered activation)
holds its complete gradient on every rank. A gather's backward then only has to keep this
rank's slice of it; a cut's backward gathers the slices back; a whole operand that every rank
combines with its own slice collects only its share of the gradient on each rank, which
``copy_to_ranks`` sums; a sum's backward passes the complete gradient through.

Every collective goes through ``_shardkit.comm`` (so ``CommCounter`` and ``st.explain`` see
it), on the tensor's own device: Gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from _shardkit import comm as _comm
from sharding import layout

from . import state as _state

__all__ = ["Intervals", "Split", "Packed", "Partial", "Strided", "Placement", "TAG", "SUM",
           "SplitSize", "tag", "placement_of", "to_whole", "shared_copy", "copy_to_ranks", "reduce_from_ranks",
           "gather", "scatter", "share_gradient", "tie"]

Intervals = tuple[tuple[int, int], ...]
"""``(start, length)`` along one dimension for each group rank (length may be 0)."""

# A placement lives on the tensor object itself, under one attribute: reading it costs far
# less per op than a weak dictionary lookup, and it goes away with the tensor just the same.
TAG = "_shardkit_placement"
# A pending sum's sum once taken: ``(the addend's version when summed, the sum)``.
SUM = "_shardkit_sum"


# -- the collectives, with their adjoints -----------------------------------------------------------

def _all_reduce(tensor: Tensor, group: _comm.ProcessGroup) -> Tensor:
    # Out of place: autograd (or a pending sum's later reader) may still need the input.
    return _comm.all_reduced(tensor, group)


def _gather(tensor: Tensor, dim: int, intervals: Intervals, group: _comm.ProcessGroup) -> Tensor:
    _, world = _comm.rank_and_world(group)
    if world == 1:
        return tensor
    dim = dim % tensor.dim()
    longest = max(n for _, n in intervals)
    piece = tensor.contiguous()
    if piece.size(dim) < longest:
        pad = list(piece.shape)
        pad[dim] = longest - piece.size(dim)
        piece = torch.cat([piece, piece.new_zeros(pad)], dim)
    pieces = _comm.all_gather_tensor(piece, group)
    shape = list(tensor.shape)
    shape[dim] = max(s + n for s, n in intervals)
    out = tensor.new_empty(shape)
    for (start, length), got in zip(intervals, pieces):
        if length:  # ranks holding the same slice (replicas) write the same values
            out.narrow(dim, start, length).copy_(got.narrow(dim, 0, length))
    return out


def _slice(tensor: Tensor, dim: int, intervals: Intervals, group: _comm.ProcessGroup) -> Tensor:
    rank, _ = _comm.rank_and_world(group)
    start, length = intervals[rank]
    return tensor.narrow(dim, start, length).contiguous()


def _owner_slice(tensor: Tensor, dim: int, intervals: Intervals, group: _comm.ProcessGroup) -> Tensor:
    """This rank's slice if it is the first of the ranks holding it, else zeros: the gradient of slices held by
    replicas, each of which holds a share of it (the shares sum to the whole gradient)."""
    rank, _ = _comm.rank_and_world(group)
    start, length = intervals[rank]
    if intervals.index(intervals[rank]) != rank and length:
        return tensor.new_zeros((*tensor.shape[:dim], length, *tensor.shape[dim + 1:]))
    return tensor.narrow(dim, start, length).contiguous()


def _summed_slices(tensor: Tensor, dim: int, intervals: Intervals, group: _comm.ProcessGroup) -> Tensor:
    """The whole tensor from every rank's slice, replicas' slices summed (a zero-padded all-reduce): the
    gradient of a whole tensor cut to slices that replicas hold, each a share of it."""
    _, world = _comm.rank_and_world(group)
    if world == 1:
        return tensor
    rank, _ = _comm.rank_and_world(group)
    dim = dim % tensor.dim()
    shape = list(tensor.shape)
    shape[dim] = max(s + n for s, n in intervals)
    out = tensor.new_zeros(shape)
    start, length = intervals[rank]
    if length:
        out.narrow(dim, start, length).copy_(tensor)
    return _all_reduce(out, group)


def _has_replicas(intervals: Intervals) -> bool:
    live = [s for s in intervals if s[1] > 0]
    return len(set(live)) != len(live)


def _where(ctx: Any) -> None:
    """Keep on ``ctx`` where the forward ran, for ``st.explain`` to attribute the backward's collective."""
    explaining = _state.STATE.explaining
    ctx.explained = None if explaining is None else (explaining, explaining.current())


def _there(ctx: Any) -> Any:
    """The block in which a backward's collective is attributed to its forward's zone (``st.explain``)."""
    explained = getattr(ctx, "explained", None)
    return contextlib.nullcontext() if explained is None else explained[0].at(explained[1])


class _CopyToRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: _comm.ProcessGroup) -> Tensor:
        ctx.group = group
        _where(ctx)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        with _there(ctx):
            return _all_reduce(grad, ctx.group), None


class _ReduceFromRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: _comm.ProcessGroup) -> Tensor:
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _Mirror(torch.autograd.Function):
    """``there`` forward, ``back`` on the gradient: a gather's backward is a slice, and the reverse."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, dim: int, intervals: Intervals, group: _comm.ProcessGroup,
                there: Callable[..., Tensor], back: Callable[..., Tensor]) -> Tensor:
        ctx.args, ctx.back = (dim, intervals, group), back
        _where(ctx)
        return there(tensor, dim, intervals, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        with _there(ctx):
            return ctx.back(grad, *ctx.args), None, None, None, None, None


def copy_to_ranks(tensor: Tensor, group: _comm.ProcessGroup = None) -> Tensor:
    """Identity forward; backward sums the gradients of all ranks. Collective in backward.

    Use it where a whole tensor enters a computation that each rank does on its own part
    (the input of a Linear split on its output features).
    """
    if _comm.rank_and_world(group)[1] == 1 or not tensor.requires_grad:
        return tensor
    return _CopyToRanks.apply(tensor, group)  # type: ignore[no-any-return]


def reduce_from_ranks(tensor: Tensor, group: _comm.ProcessGroup = None) -> Tensor:
    """Sum of every rank's ``tensor``; backward passes the gradient through. Collective.

    Example:
        >>> # 2 ranks, a Linear split on its input features: each computes a partial sum
        >>> y = reduce_from_ranks(x_local @ w_local.T)  # doctest: +SKIP
    """
    if _comm.rank_and_world(group)[1] == 1:
        return tensor
    return _ReduceFromRanks.apply(tensor, group)  # type: ignore[no-any-return]


def gather(tensor: Tensor, dim: int, intervals: Sequence[tuple[int, int]], group: _comm.ProcessGroup = None) -> Tensor:
    """Concatenate every rank's slice along ``dim``; backward keeps this rank's slice. Collective.

    ``intervals[r]`` is ``(start, length)`` of group rank ``r``'s slice in the result; slices
    may be uneven or empty (they are padded on the wire), and ranks may hold the same slice
    (replicas: it is written once).

    Example:
        >>> # 2 ranks, out features 5 split 3/2: (B, 3) and (B, 2) -> (B, 5) on both ranks
        >>> y = gather(y_local, -1, ((0, 3), (3, 2)))  # doctest: +SKIP
    """
    if _comm.rank_and_world(group)[1] == 1:
        return tensor
    intervals = tuple(intervals)
    back = _owner_slice if _has_replicas(intervals) else _slice
    return _Mirror.apply(tensor, dim, intervals, group, _gather, back)  # type: ignore[no-any-return]


def scatter(tensor: Tensor, dim: int, intervals: Sequence[tuple[int, int]], group: _comm.ProcessGroup = None) -> Tensor:
    """This rank's slice of a whole ``tensor``; backward gathers the gradient (sums it over ranks holding the
    same slice: replicas, each with a share of it). Collective in backward."""
    if _comm.rank_and_world(group)[1] == 1:
        return tensor
    intervals = tuple(intervals)
    back = _summed_slices if _has_replicas(intervals) else _gather
    return _Mirror.apply(tensor, dim, intervals, group, _slice, back)  # type: ignore[no-any-return]


def share_gradient(tensor: Tensor, dim: int, intervals: Sequence[tuple[int, int]],
                   group: _comm.ProcessGroup = None) -> Tensor:
    """Identity forward; backward sums the gradient over the ranks holding the same slice. Collective in backward.

    For a parameter held by replicas (a key/value head shared by the ranks of its query heads):
    each replica's backward computes a share of its gradient, which this makes whole on each.
    """
    if _comm.rank_and_world(group)[1] == 1 or not tensor.requires_grad:
        return tensor
    return _Mirror.apply(tensor, dim, tuple(intervals), group, _identity, _shared)  # type: ignore[no-any-return]


class _Tie(torch.autograd.Function):
    """The first ``count`` tensors as they are, made to depend on the others: their gradient is zero."""

    @staticmethod
    def forward(ctx: Any, count: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.count = count
        ctx.others = [(t.shape, t.dtype, t.device) for t in tensors[count:]]
        return tuple(t.clone() for t in tensors[:count])  # empty: a clone costs nothing

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.others]
        return (None, *grads, *zeros)


def tie(empty: Sequence[Tensor], others: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``empty`` (tensors with no element) made to depend on ``others`` in autograd, with a zero gradient.

    An op on a rank's empty slice may return a result that autograd does not connect to every
    operand (attention over no heads ignores its mask). An operand moved before the op whose
    backward is a collective (``copy_to_ranks``, a cut) must still run that backward on this
    rank, as on every other, or the ranks' collectives no longer match: tied to the empty result,
    its backward runs, with the zero gradient an empty result gives.
    """
    return _Tie.apply(len(empty), *empty, *others)  # type: ignore[no-any-return]


def _identity(tensor: Tensor, dim: int, intervals: Intervals, group: _comm.ProcessGroup) -> Tensor:
    return tensor.view_as(tensor)


def _shared(tensor: Tensor, dim: int, intervals: Intervals, group: _comm.ProcessGroup) -> Tensor:
    return _slice(_summed_slices(tensor, dim, intervals, group), dim, intervals, group)


# -- the placements ---------------------------------------------------------------------------------

def _hashed(value: Any) -> None:
    # A placement is part of every decision-cache key; its hash is computed once.
    object.__setattr__(value, "_hash", hash((type(value), *(getattr(value, f) for f in value._fields))))


@dataclass(frozen=True, slots=True)
class Split(layout.Split):
    """This rank's slice along ``dim`` (``intervals[r]`` is group rank ``r``'s ``(start, length)``)
    of a logical tensor, over the process group ``group``."""

    group: _comm.ProcessGroup = None
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    _fields = ("dim", "intervals", "group")

    def __post_init__(self) -> None:
        layout.Split.__post_init__(self)
        _hashed(self)

    def __hash__(self) -> int:
        return self._hash

    def moved(self, dim: int) -> Split:
        """The same intervals on another dimension (after a transpose or a reshape)."""
        return self if dim == self.dim else Split(dim, self.intervals, self.group)

    def scaled(self, dim: int, num: int, den: int) -> Split | None:
        """On ``dim``, every interval multiplied by ``num / den``; ``None`` where that is not exact."""
        out = []
        for start, length in self.intervals:
            if (start * num) % den or (length * num) % den:
                return None
            out.append((start * num // den, length * num // den))
        return Split(dim, tuple(out), self.group)

    def length(self) -> int:
        """This rank's length along ``dim``."""
        return self.intervals[_state.rank(self.group)][1]

    def extent(self) -> int:
        """The whole tensor's size along ``dim``."""
        return self.size

    def whole(self, x: Tensor) -> Tensor:
        """The full tensor of this rank's slice ``x``: all-gather (collective)."""
        return gather(x, self.dim, self.intervals, self.group)

    def cut(self, t: Tensor, dim: int) -> Tensor:
        """This rank's slice of a whole ``t`` along ``dim`` (its gradient gathered back)."""
        return scatter(t, dim, self.intervals, self.group)


@dataclass(frozen=True, slots=True)
class Packed(layout.Packed):
    """Several slices of a logical tensor side by side along ``dim`` (``pieces[r]``: group rank ``r``'s
    ``(start, length)`` slices, in order), over the process group ``group``.

    A fused projection split by heads produces it (its rows of q, then of k, then of v). The
    one op that takes it apart is ``split``/``chunk``/indexing along ``dim`` at the slices'
    boundaries (``qkv.split(embed_dim, dim=-1)``), which gives ordinary splits; any other op
    gathers it first.
    """

    group: _comm.ProcessGroup = None
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    _fields = ("dim", "pieces", "group")

    def __post_init__(self) -> None:
        layout.Packed.__post_init__(self)
        _hashed(self)

    def __hash__(self) -> int:
        return self._hash

    def whole(self, x: Tensor) -> Tensor:
        """The full tensor: the ``j``-th slices of every rank gathered together, then laid side by side."""
        counts = {len(slices) for slices in self.pieces}
        if len(counts) != 1:
            msg = (f"cannot gather an activation packed as {list(self.pieces)} ((start, length) slices per rank): "
                   f"every rank must hold the same number of slices.")
            raise ValueError(msg)
        rank = _state.rank(self.group)
        offset, parts = 0, []
        for j in range(counts.pop()):
            length = self.pieces[rank][j][1]
            piece = x.narrow(self.dim, offset, length)
            offset += length
            intervals = tuple(slices[j] for slices in self.pieces)
            low = min(s for s, _ in intervals)
            parts.append((low, gather(piece, self.dim, tuple((s - low, n) for s, n in intervals), self.group)))
        return torch.cat([p for _, p in sorted(parts, key=lambda x: x[0])], self.dim)


@dataclass(frozen=True, slots=True)
class Strided(layout.Strided):
    """A split dimension merged with dimensions outside it (``blocks`` blocks, group rank ``r``
    holding ``intervals[r]`` of each), over the process group ``group``.

    ``reshape(batch * num_heads, ...)`` of a tensor split on its heads gives one.
    """

    group: _comm.ProcessGroup = None
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    _fields = ("dim", "intervals", "blocks", "group")

    def __post_init__(self) -> None:
        layout.Strided.__post_init__(self)
        _hashed(self)

    def __hash__(self) -> int:
        return self._hash

    def moved(self, dim: int) -> Strided:
        """The same blocks on another dimension (after a transpose)."""
        return self if dim == self.dim else Strided(dim, self.intervals, self.blocks, self.group)

    def length(self) -> int:
        """This rank's length along ``dim``: its slice of every block."""
        return self.blocks * self.intervals[_state.rank(self.group)][1]

    def extent(self) -> int:
        """The whole tensor's size along ``dim``: every block."""
        return self.blocks * self.size

    def unmerged(self, x: Tensor) -> Tensor:
        """The local ``x`` with its strided dimension unflattened into ``(blocks, this rank's length)``."""
        out: Tensor = x.unflatten(self.dim, (self.blocks, x.shape[self.dim] // self.blocks))
        return out

    def whole(self, x: Tensor) -> Tensor:
        """The full tensor: every rank's rows of each block gathered (collective)."""
        return gather(self.unmerged(x), self.dim + 1, self.intervals, self.group).flatten(self.dim, self.dim + 1)

    def cut(self, t: Tensor, dim: int) -> Tensor:
        """This rank's rows of each block of a whole ``t`` along ``dim``; its gradient is gathered back."""
        blocks = t.unflatten(dim, (self.blocks, self.size))
        return scatter(blocks, dim + 1, self.intervals, self.group).flatten(dim, dim + 1)


@dataclass(frozen=True, slots=True)
class Partial(layout.Partial):
    """This rank's addend of a logical tensor (``reduce_op="sum"``) over the process group ``group``.

    A row-parallel projection (``o_proj``, ``down_proj``: input features split) computes one
    addend per rank. It stays pending through ops linear in it until an op needs its values,
    which sums it with one all-reduce (``whole``), once: the sum is kept on the tensor until
    the tensor is written to.
    """

    group: _comm.ProcessGroup = None
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    _fields = ("reduce_op", "group")

    def __post_init__(self) -> None:
        layout.Partial.__post_init__(self)
        _hashed(self)

    def __hash__(self) -> int:
        return self._hash

    def whole(self, x: Tensor) -> Tensor:
        """The sum over the ranks of the addend ``x``: one all-reduce, kept until ``x`` is written to."""
        attrs = x.__dict__
        cached = attrs.get(SUM)
        if cached is not None and cached[0] == x._version:
            return cached[1]  # type: ignore[no-any-return]
        total = reduce_from_ranks(x, self.group)
        attrs[SUM] = (x._version, total)
        return total

    def add_once(self, value: Any) -> Any:
        """``value`` (whole on every rank) as an addend: itself on rank 0, zero elsewhere; its gradient
        whole on every rank."""
        keep = _state.rank(self.group) == 0
        if isinstance(value, Tensor):
            if keep:
                return value
            if value.requires_grad and torch.is_grad_enabled():
                return _Once.apply(value)
            return torch.zeros_like(value)
        return value if keep else type(value)(0)


class _Once(torch.autograd.Function):
    """Zeros on a rank that does not add a whole tensor; its gradient passes whole on every rank."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        return torch.zeros_like(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


Placement = Split | Packed | Strided | Partial
"""A placement of the engine: how the ranks of its group hold an activation."""


class SplitSize(int):
    """The size of a split dimension as the model's code reads it (``x.shape[d]``, ``x.size(d)``): this rank's.

    It carries the split it was read from (``placement``), so that where the code passes it on,
    the engine knows what it measured: to ``view``/``reshape`` it means this rank's extent; to
    ``expand`` or a factory (``torch.zeros``, ``x.new_empty``) it makes this rank's slice of the
    tensor the unsharded program makes; anywhere else (an operand, a size no rule reads) it
    stands for the whole size. A multiple or an exact quotient of it by a plain number
    (``heads // n_rep``, ``heads * head_dim``) is such a size too, of the split scaled alike
    (every rank's interval scaled exactly), so the engine reads it as the unsharded program
    does; any other arithmetic on it gives a plain ``int``.
    """

    placement: Split

    def __new__(cls, value: Any = 0, placement: Split | None = None) -> Any:
        if placement is None:  # ``type(size)(n)``, as code that rebuilds a number does: a plain int
            return int(value)
        size = int.__new__(cls, value)
        size.placement = placement
        return size

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        return int, (int(self),)

    def whole(self) -> int:
        """The whole tensor's size along the split dimension."""
        return self.placement.size

    def _scaled(self, value: int, num: int, den: int) -> int:
        split = self.placement.scaled(self.placement.dim, num, den) if num > 0 and den > 0 else None
        return value if split is None else SplitSize(value, split)

    def __mul__(self, other: Any) -> Any:
        product = int(self) * other
        return self._scaled(product, other, 1) if type(other) is int else product

    __rmul__ = __mul__

    def __floordiv__(self, other: Any) -> Any:
        quotient = int(self) // other
        return self._scaled(quotient, 1, other) if type(other) is int else quotient


def tag(x: Tensor, placement: Placement) -> Tensor:
    """Mark ``x`` as this rank's part of a logical tensor held as ``placement``; returns ``x``."""
    x.__dict__[TAG] = placement
    return x


def placement_of(x: object) -> Placement | None:
    """The placement ``x`` is tagged with, if it is a tagged tensor."""
    if isinstance(x, Tensor):
        attrs = x.__dict__
        return attrs.get(TAG) if attrs else None
    return None


def to_whole(x: Any) -> Any:
    """The full tensor of a tagged ``x`` (collective); anything else as it is."""
    placement = placement_of(x)
    if placement is None:
        return x
    with _state.outside_zone_mode():
        return placement.whole(x)


def shared_copy(tensor: Tensor, group: _comm.ProcessGroup) -> Tensor:
    """``copy_to_ranks(tensor)``, shared by every use in the current zone call that reads the same tensor."""
    copies = _state.STATE.copies
    if not copies:
        return copy_to_ranks(tensor, group)
    frame = copies[-1]
    hit = frame.get(id(tensor))
    if hit is not None and hit[0] is tensor:
        return hit[1]
    copied = copy_to_ranks(tensor, group)
    frame[id(tensor)] = (tensor, copied)
    return copied
