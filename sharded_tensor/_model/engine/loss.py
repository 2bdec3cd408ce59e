"""Cross-entropy over logits split on the class dimension, without gathering them.

An ``lm_head`` split on the vocabulary hands out this rank's slice of the logits. Inside the
model (``model(ids, labels=ids)``) or under ``loss_parallel``, ``F.cross_entropy`` on such
logits computes the loss over the whole vocabulary from three all-reduces of one number per
row (the row maximum, the sum of exponentials, the target's logit, which exactly one rank
holds) instead of an all-gather of the logits. The backward is local: the softmax of this
rank's slice, minus one at the target where this rank holds it.

It computes in float32, or in the logits' own precision when that is wider (float64), and
returns the loss in the logits' dtype, as ``F.cross_entropy`` does.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from _shardkit import comm as _comm

from . import state as _state
from .placements import Split, placement_of
from .rules import Call, Decision, Fallback, declare

__all__: list[str] = []


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, split: Split, ignore: int) -> Tensor:
        start, length = split.intervals[_state.rank(split.group)]
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        top = x.amax(dim=1) if length else x.new_full((x.shape[0],), float("-inf"))
        # ``all_reduced`` (a new tensor): under torch.compile a functional collective with no copy
        # around it, where an in-place reduction is functionalized as a clone and a copy back.
        top = _comm.all_reduced(top, split.group, op="max")
        shifted = x - top.unsqueeze(1)
        exp = shifted.exp()
        total = _comm.all_reduced(exp.sum(dim=1), split.group)
        inside = (target >= start) & (target < start + length)
        local = torch.where(inside, target - start, torch.zeros_like(target))
        if length:
            picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1) * inside
        else:  # a rank holding no class holds no target: its share of the sum is zero
            picked = shifted.new_zeros(target.shape)
        picked = _comm.all_reduced(picked, split.group)
        valid = target != ignore
        loss = (total.log() - picked) * valid
        ctx.save_for_backward(exp, total, local, inside, valid)
        ctx.dtype = logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        exp, total, local, inside, valid = ctx.saved_tensors
        probs = exp / total.unsqueeze(1)
        if probs.shape[1]:  # (no class here, no target to subtract one at)
            probs.scatter_add_(1, local.unsqueeze(1), -inside.to(probs.dtype).unsqueeze(1))
        scale = (grad.to(probs.dtype) * valid).unsqueeze(1)
        return (probs * scale).to(ctx.dtype), None, None, None


def _loss(logits: Tensor, *args: Any, split: Split, target_at: int | str, ignore: int, reduction: str,
          **kwargs: Any) -> Tensor:
    target = args[target_at - 1] if isinstance(target_at, int) else kwargs[target_at]
    losses = _VocabParallelCE.apply(logits, target, split, ignore)
    if reduction == "none":
        return losses  # type: ignore[no-any-return]
    if reduction == "sum":
        return losses.sum()  # type: ignore[no-any-return]
    return losses.sum() / (target != ignore).sum()  # type: ignore[no-any-return]


def _cross_entropy(call: Call) -> Decision:
    logits = call.args[0] if call.args else None
    split = placement_of(logits)
    if type(split) is not Split or not isinstance(logits, Tensor):
        raise Fallback
    bound = call.bound()
    target = bound["target"]
    plain = all(bound.get(k) is None for k in ("weight", "size_average", "reduce")) \
        and bound.get("label_smoothing", 0.0) == 0.0
    if (split.dim != 1 or logits.dim() != 2 or not plain or split.replicas or not isinstance(target, Tensor)
            or target.is_floating_point() or placement_of(target) is not None or target.dim() != 1):
        raise Fallback
    reduction = bound.get("reduction", "mean")
    if reduction not in ("none", "sum", "mean"):
        raise Fallback
    target_at: int | str = 1 if len(call.args) > 1 and call.args[1] is target else "target"
    return Decision(run=functools.partial(_loss, split=split, target_at=target_at,
                                          ignore=int(bound.get("ignore_index", -100)), reduction=reduction))


declare(("cross_entropy",), Split, _cross_entropy)
