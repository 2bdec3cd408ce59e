"""A grouped matrix product: consecutive runs of rows, each multiplied by its own matrix.

The experts of a mixture-of-experts layer each multiply the rows routed to them. With the
rows sorted by expert, that is one call: ``x`` ``[R, in]``, ``weight`` ``[G, out, in]``
(``linear=True``, as ``F.linear`` takes it) or ``[G, in, out]``, and ``counts`` ``[G]``:
group ``g``'s rows follow group ``g - 1``'s. Rows past ``counts.sum()`` belong to no group
and come out as zeros (their gradient too), so ``R`` may be a static bound on the number of
rows, as a compiled graph needs, while the counts depend on the routing.

It is a ``torch.library`` operator with a fake implementation (output shape from the input
shapes alone) and a registered backward that is itself an operator: traced under
``torch.compile``, each is one node of the graph, and the slicing by counts (shapes that depend
on values) happens only when the graph runs. Eager runs the same operators.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["grouped_mm"]


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *, linear: bool) -> torch.Tensor:
    """Rows of ``x`` times their group's matrix of ``weight``; ``[R, out]``, zeros past ``counts.sum()``.

    Args:
        x: ``[R, in]``, the rows of group 0 first, then group 1's, ...
        weight: ``[G, out, in]`` (``linear=True``: each row ``r`` of group ``g`` gives
            ``weight[g] @ x[r]``, as ``F.linear``) or ``[G, in, out]`` (``x[r] @ weight[g]``).
        counts: ``[G]`` integers, the number of rows of each group; ``counts.sum() <= R``.
        linear: which of the two layouts ``weight`` has.

    The gradient of ``weight`` is zero for a group with no rows.
    """
    return torch.ops.shardkit.grouped_mm(x, weight, counts, linear)  # type: ignore[no-any-return]


def _check(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, linear: bool) -> int:
    """The output features; a clear error for shapes that do not fit."""
    fits = x.dim() == 2 and weight.dim() == 3 and counts.dim() == 1 and counts.shape[0] == weight.shape[0]
    if not fits or x.shape[1] != weight.shape[2 if linear else 1] or x.dtype != weight.dtype:
        layout = "[G, out, in]" if linear else "[G, in, out]"
        msg = (f"grouped_mm takes x [R, in], weight {layout} of x's dtype and counts [G]; got x {tuple(x.shape)} "
               f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, counts {tuple(counts.shape)}.")
        raise ValueError(msg)
    return int(weight.shape[1] if linear else weight.shape[2])


@torch.library.custom_op("shardkit::grouped_mm", mutates_args=())
def _forward(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, linear: bool) -> torch.Tensor:
    out = x.new_empty(x.shape[0], _check(x, weight, counts, linear))
    start = 0
    for group, n in enumerate(counts.tolist()):  # one read of the counts, not one per group
        if n:
            rows = slice(start, start + n)
            torch.mm(x[rows], weight[group].T if linear else weight[group], out=out[rows])
            start += n
    out[start:].zero_()
    return out


@_forward.register_fake
def _forward_fake(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, linear: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], _check(x, weight, counts, linear))


@torch.library.custom_op("shardkit::grouped_mm_backward", mutates_args=())
def _backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                 linear: bool) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = x.new_empty(x.shape)
    grad_w = weight.new_empty(weight.shape)
    start = 0
    for group, n in enumerate(counts.tolist()):
        if not n:
            grad_w[group].zero_()
            continue
        rows = slice(start, start + n)
        if linear:  # y = x W^T: dx = dy W, dW = dy^T x
            torch.mm(grad[rows], weight[group], out=grad_x[rows])
            torch.mm(grad[rows].T, x[rows], out=grad_w[group])
        else:  # y = x W: dx = dy W^T, dW = x^T dy
            torch.mm(grad[rows], weight[group].T, out=grad_x[rows])
            torch.mm(x[rows].T, grad[rows], out=grad_w[group])
        start += n
    grad_x[start:].zero_()
    return grad_x, grad_w


@_backward_op.register_fake
def _backward_fake(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                   linear: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, counts, linear = inputs
    ctx.save_for_backward(x, weight, counts)
    ctx.linear = linear


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
    x, weight, counts = ctx.saved_tensors
    grad_x, grad_w = torch.ops.shardkit.grouped_mm_backward(grad, x, weight, counts, ctx.linear)
    return grad_x, grad_w, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)
