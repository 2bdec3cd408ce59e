"""Autograd-aware collectives for sharded compute (tensor parallelism).

Sharded layers run SPMD: every rank executes the same forward on the same (replicated)
input, each with its own shard of the weights. Four functions move activations between a
*replicated* value (identical on every rank) and a *sharded* one (each rank holds a slice
along one dimension, or a partial sum), and give autograd the matching backward:

=====================  =====================================  ========================================
function               forward                                backward
=====================  =====================================  ========================================
``copy_to_ranks``      identity (input is replicated)         all-reduce (sum) of the gradients
``reduce_from_ranks``  all-reduce (sum) of partial results    identity
``gather``             concatenate every rank's slice         this rank's slice of the gradient
``scatter``            this rank's slice (no communication)   gather every rank's gradient slice
=====================  =====================================  ========================================

Why these backwards are right: a replicated activation feeds computations on every rank,
and each rank only sees the part of the loss that flows through its own shard, so the true
gradient is the sum over ranks (``copy_to_ranks``). Conversely the gradient arriving at a
replicated output is the same on every rank, so the gradient of a slice is just the slice
of it (``gather``). As a consequence, every replicated tensor (activations, and parameters
that are kept whole on every rank such as LayerNorm weights) receives an identical, complete
gradient on every rank: no extra gradient all-reduce is needed for them. This holds as long
as all ranks feed the same data, which is what tensor parallelism means; combining it with
data parallelism needs a separate gradient reduction over the data-parallel group.

All communication goes through ``_comm`` (so ``CommCounter`` sees it), on the tensor's own
device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from _shardkit import comm as _comm

__all__ = ["copy_to_ranks", "reduce_from_ranks", "gather", "scatter", "Intervals"]

Intervals = tuple[tuple[int, int], ...]
"""``(start, length)`` along one dimension for each group rank (length may be 0)."""


def _all_reduce(tensor: torch.Tensor, group: _comm.ProcessGroup) -> torch.Tensor:
    # Out of place: autograd (or a pending sum's later reader) may still need the input.
    return _comm.all_reduced(tensor, group)


def _gather(tensor: torch.Tensor, dim: int, intervals: Intervals, group: _comm.ProcessGroup) -> torch.Tensor:
    rank, world = _comm.rank_and_world(group)
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
    shape[dim] = sum(n for _, n in intervals)
    out = tensor.new_empty(shape)
    for (start, length), got in zip(intervals, pieces):
        if length:
            out.narrow(dim, start, length).copy_(got.narrow(dim, 0, length))
    return out


def _slice(tensor: torch.Tensor, dim: int, intervals: Intervals, group: _comm.ProcessGroup) -> torch.Tensor:
    rank, _ = _comm.rank_and_world(group)
    start, length = intervals[rank]
    return tensor.narrow(dim, start, length).contiguous()


class _CopyToRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: _comm.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: _comm.ProcessGroup) -> torch.Tensor:
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Mirror(torch.autograd.Function):
    """``there`` forward, ``back`` on the gradient: a gather's backward is a slice, and the reverse."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, intervals: Intervals, group: _comm.ProcessGroup,
                there: Callable[..., torch.Tensor], back: Callable[..., torch.Tensor]) -> torch.Tensor:
        ctx.args, ctx.back = (dim, intervals, group), back
        return there(tensor, dim, intervals, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.back(grad, *ctx.args), None, None, None, None, None


def copy_to_ranks(tensor: torch.Tensor, group: _comm.ProcessGroup = None) -> torch.Tensor:
    """Identity forward; backward sums the gradients of all ranks. Collective in backward.

    Use it where a replicated tensor enters a computation that each rank does on its own shard
    (the input of a Linear split on its output features).
    """
    if _comm.rank_and_world(group)[1] == 1 or not tensor.requires_grad:
        return tensor
    return _CopyToRanks.apply(tensor, group)  # type: ignore[no-any-return]


def reduce_from_ranks(tensor: torch.Tensor, group: _comm.ProcessGroup = None) -> torch.Tensor:
    """Sum of every rank's ``tensor``; backward passes the gradient through. Collective.

    Example:
        >>> # 2 ranks, a Linear split on its input features: each computes a partial sum
        >>> y = reduce_from_ranks(x_local @ w_local.T)  # doctest: +SKIP
    """
    if _comm.rank_and_world(group)[1] == 1:
        return tensor
    return _ReduceFromRanks.apply(tensor, group)  # type: ignore[no-any-return]


def gather(tensor: torch.Tensor, dim: int, intervals: Sequence[tuple[int, int]],
           group: _comm.ProcessGroup = None) -> torch.Tensor:
    """Concatenate every rank's slice along ``dim``; backward keeps this rank's slice. Collective.

    ``intervals[r]`` is ``(start, length)`` of group rank ``r``'s slice in the result; slices
    may be uneven or empty (they are padded on the wire).

    Example:
        >>> # 2 ranks, out features 5 split 3/2: (B, 3) and (B, 2) -> (B, 5) on both ranks
        >>> y = gather(y_local, -1, ((0, 3), (3, 2)))  # doctest: +SKIP
    """
    if _comm.rank_and_world(group)[1] == 1:
        return tensor
    return _Mirror.apply(tensor, dim, tuple(intervals), group, _gather, _slice)  # type: ignore[no-any-return]


def scatter(tensor: torch.Tensor, dim: int, intervals: Sequence[tuple[int, int]],
            group: _comm.ProcessGroup = None) -> torch.Tensor:
    """This rank's slice of a replicated ``tensor``; backward gathers the gradient. Collective in backward."""
    if _comm.rank_and_world(group)[1] == 1:
        return tensor
    return _Mirror.apply(tensor, dim, tuple(intervals), group, _slice, _gather)  # type: ignore[no-any-return]
