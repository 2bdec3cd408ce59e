"""Training helpers for sharded models: gradient clipping, the training state, data-parallel gradients.

``torch.nn.utils.clip_grad_norm_`` only sees the tensors it is given. On a sharded model
each rank holds a different block of every split parameter, so each rank would compute the
norm of its own blocks and scale its gradients by a different factor: the blocks of one
weight would be clipped inconsistently, replicated parameters (biases, layer norms) would
drift apart between ranks, and the result would not be the norm of the model's gradient.
``clip_grad_norm_`` here computes the norm of the *global* gradient, counting every
element exactly once (a split parameter's blocks summed over the ranks of its group, a
replicated parameter once), and gives every rank the same bits, so all ranks scale by the
same factor.

The per-parameter norms follow ``torch.nn.utils.clip_grad_norm_`` step by step (the norm of
each parameter's gradient, then the norm of those norms, then ``max_norm / (norm + 1e-6)``
clamped to 1): on a model with nothing split, the result is bit for bit torch's.

``get_state_dict`` / ``set_state_dict`` bundle ``model.state_dict()`` and
``optim_state_dict`` into the one nested dict a training job saves and
resumes from. ``all_reduce_grads`` averages gradients over a data-parallel group, for
data-parallel replicas of a tensor-parallel model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from _shardkit import comm as _comm
from sharding.layout import Box

from . import guard as _guard
from .optim import load_optim_state_dict, optim_state_dict
from .record import ShardedParameter, record_of, sharded_parameters

__all__ = ["clip_grad_norm_", "get_state_dict", "set_state_dict", "all_reduce_grads"]

# -- gradient clipping ---------------------------------------------------------------------------

def _parameters_and_layouts(parameters_or_model: nn.Module | torch.Tensor | Iterable[torch.Tensor]
                            ) -> tuple[list[torch.Tensor], dict[int, ShardedParameter]]:
    if isinstance(parameters_or_model, nn.Module):
        params: list[torch.Tensor] = list(parameters_or_model.parameters())
        layouts: dict[int, ShardedParameter] = {}
        for module in parameters_or_model.modules():
            for attr, sp in sharded_parameters(module).items():
                param = module._parameters.get(attr)
                if param is not None:
                    layouts[id(param)] = sp
        return params, layouts
    if isinstance(parameters_or_model, torch.Tensor):
        params = [parameters_or_model]
    else:
        params = list(dict.fromkeys(parameters_or_model))
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            msg = (f"clip_grad_norm_ takes a model, a tensor or an iterable of tensors; item {i} is a "
                   f"{type(p).__name__}.")
            raise TypeError(msg)
    found = {id(p): layout for p in params if (layout := record_of(p)) is not None}
    return params, found


def _intersect(a: Box, b: Box) -> Box | None:
    starts = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    ends = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(e <= s for s, e in zip(starts, ends)):
        return None
    return starts, tuple(e - s for s, e in zip(starts, ends))


def _owned(grad: torch.Tensor, sp: ShardedParameter, rank: int) -> torch.Tensor | None:
    """The elements of this rank's block that no lower group rank also holds (``None``: none)."""
    boxes = sp.layout.boxes
    mine = boxes[rank]
    if mine is None or grad.numel() == 0:
        return None
    overlaps = [o for box in boxes[:rank] if box is not None and (o := _intersect(mine, box)) is not None]
    if not overlaps:
        return grad
    if any(o == mine for o in overlaps):
        return None
    keep = torch.ones(mine[1], dtype=torch.bool, device=grad.device)
    for offsets, sizes in overlaps:
        keep[tuple(slice(o - m, o - m + n) for o, m, n in zip(offsets, mine[0], sizes))] = False
    return grad[keep]


def _partial(values: torch.Tensor | None, norm_type: float) -> torch.Tensor:
    """This rank's share of a global norm, in float64: ``sum |x|^p``, or ``max |x|`` for inf."""
    if values is None or values.numel() == 0:
        return torch.zeros((), dtype=torch.float64)
    if math.isinf(norm_type):
        return values.detach().abs().max().to(torch.float64).cpu()
    share: torch.Tensor = torch.linalg.vector_norm(values.detach(), norm_type, dtype=torch.float64).pow(norm_type)
    return share.cpu()


def clip_grad_norm_(parameters_or_model: nn.Module | torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, *, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a sharded model by their global norm, like ``torch.nn.utils.clip_grad_norm_``. Collective.

    The norm is that of the whole model's gradient, every element counted once: the blocks
    of a split parameter are combined over the ranks of its process group, a replicated
    parameter counts once. Every rank gets the same norm, bit for bit, and scales its
    gradients by the same factor ``min(1, max_norm / (norm + 1e-6))``, so replicas stay
    identical and the result equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model
    (within float rounding; exactly when nothing is split). Do not use
    ``torch.nn.utils.clip_grad_norm_`` on a sharded model: each rank would clip by the norm
    of its own blocks.

    Every rank of the parameters' groups must call it, with the same parameters in the same
    order (parameters without a gradient are skipped, as in torch, so they must lack one
    on every rank). One all-gather per process group, of one number per split parameter.

    Args:
        parameters_or_model: a model (its parameters and their recorded layouts), or
            parameters (a tensor or an iterable; layouts are found for parameters that
            ``shard_model`` created; any other is taken as whole on every rank).
        max_norm: the largest allowed norm of the gradient.
        norm_type: ``p`` of the p-norm, a positive number or ``float("inf")``.
        error_if_nonfinite: raise if the norm is ``nan`` or ``inf`` (on every rank alike).

    Returns:
        The norm of the global gradient before clipping (a scalar tensor, identical on every rank).

    Raises:
        ValueError: ``norm_type`` is not positive.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.

    Example:
        >>> # 2 ranks, "0.weight" split on dim 0: rows 0-31 on rank 0, 32-63 on rank 1
        >>> loss.backward()  # doctest: +SKIP
        >>> norm = st.clip_grad_norm_(model, max_norm=1.0)  # doctest: +SKIP
        >>> optim.step()  # doctest: +SKIP
    """
    norm_type = float(norm_type)
    if not (norm_type > 0):
        msg = (f"norm_type={norm_type!r} is not supported; use a positive p (2.0 for the Euclidean norm) or "
               f"float('inf').")
        raise ValueError(msg)
    params, layouts = _parameters_and_layouts(parameters_or_model)
    with_grad = [(p.grad, layouts.get(id(p))) for p in params if p.grad is not None]
    if not with_grad:
        return torch.tensor(0.0)
    inf = math.isinf(norm_type)
    norms: list[torch.Tensor | None] = [None] * len(with_grad)
    by_group: dict[int, tuple[Any, list[int], list[torch.Tensor]]] = {}
    for i, (grad, sp) in enumerate(with_grad):
        if sp is None or sp.layout.kind == "replicated":
            norms[i] = torch.linalg.vector_norm(grad.detach(), norm_type)
            continue
        rank, _ = _comm.rank_and_world(sp.group)
        slot = by_group.setdefault(id(sp.group), (sp.group, [], []))
        slot[1].append(i)
        slot[2].append(_partial(_owned(grad, sp, rank), norm_type))
    for group, indices, partials in by_group.values():
        # On the group's own device: NCCL gathers CUDA tensors only.
        gathered = _comm.all_gather_tensor(torch.stack(partials).to(_comm.default_device(group)), group)
        combined = gathered[0].clone()
        for other in gathered[1:]:  # in rank order, so every rank computes the same bits
            combined = torch.maximum(combined, other) if inf else combined + other
        if not inf:
            combined = combined.pow(1.0 / norm_type)
        for k, i in enumerate(indices):
            grad = with_grad[i][0]
            norms[i] = combined[k].to(dtype=grad.dtype, device=grad.device)
    first = with_grad[0][0].device
    total: torch.Tensor = torch.linalg.vector_norm(
        torch.stack([n.to(first) for n in norms]), norm_type)  # type: ignore[union-attr]  # every slot is filled above
    if error_if_nonfinite and not torch.isfinite(total):
        msg = (f"the total norm of order {norm_type} of the gradients is {total.item()}, not finite; "
               f"error_if_nonfinite=True refuses to clip them (check the loss, or pass "
               f"error_if_nonfinite=False).")
        raise RuntimeError(msg)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad, _ in with_grad:
            grad.mul_(coef.to(grad.device))
    return total


# -- the training state ---------------------------------------------------------------------------

def get_state_dict(model: nn.Module, optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """The training state, ``{"model": ..., "optim": ...}``, ready for ``checkpoint.save`` / ``load``.

    ``"model"`` is ``model.state_dict()`` (a ``ShardedTensor`` per split parameter, sharing
    the parameters' memory) and ``"optim"`` is [`optim_state_dict`][sharded_tensor.optim_state_dict]
    (state keyed by parameter name, laid out like the parameters; for an optimizer that has
    not stepped yet, a template of the state its first step creates, so ``checkpoint.load``
    can fill it). No communication. Add your own entries (the step, the data position)
    next to these two before saving.

    Args:
        model: a model, sharded or not.
        optim: its optimizer, or ``None`` for the model alone (then there is no ``"optim"``).

    Example:
        >>> state = st.get_state_dict(model, optim)  # doctest: +SKIP
        >>> sorted(state)  # doctest: +SKIP
        ['model', 'optim']
        >>> checkpoint.save({**state, "step": step}, "ckpt")  # doctest: +SKIP
    """
    state: dict[str, Any] = {"model": model.state_dict()}
    if optim is not None:
        _guard.check_optimizer(optim)
        state["optim"] = optim_state_dict(model, optim)
    return state


def set_state_dict(model: nn.Module, optim: torch.optim.Optimizer | None, state: Mapping[str, Any], *,
                   strict: bool = True) -> None:
    """Load a ``get_state_dict`` result into ``model`` and ``optim``, in their current layouts. Collective.

    The entries may come from any layout or world size (as ``checkpoint.load`` fills
    them, or another model's [`get_state_dict`][sharded_tensor.get_state_dict]): ``ShardedTensor`` s are resharded into
    each parameter's layout and full tensors give each rank its block.

    Args:
        model: the model to fill.
        optim: its optimizer, or ``None`` to load the model alone.
        state: ``{"model": ..., "optim": ...}``; other keys are ignored.
        strict: as in ``model.load_state_dict``.

    Raises:
        KeyError: ``state`` lacks ``"model"``, or ``"optim"`` while ``optim`` is given.
        ValueError: the optimizer state does not match the optimizer (names, groups, shapes).

    Example:
        >>> state = st.get_state_dict(model, optim)  # doctest: +SKIP
        >>> checkpoint.load(state, "ckpt")  # doctest: +SKIP
        >>> st.set_state_dict(model, optim, state)  # doctest: +SKIP
    """
    wanted = ["model"] + (["optim"] if optim is not None else [])
    missing = [k for k in wanted if k not in state]
    if missing:
        msg = (f"state has no {missing} entry (it has {sorted(state)}); pass the dict returned by "
               f"st.get_state_dict(model, optim), after checkpoint.load filled it.")
        raise KeyError(msg)
    model.load_state_dict(state["model"], strict=strict)
    if optim is not None:
        _guard.check_optimizer(optim)
        load_optim_state_dict(model, optim, state["optim"])


# -- data parallel ----------------------------------------------------------------------------------

def all_reduce_grads(model: nn.Module | Iterable[torch.Tensor], group: _comm.ProcessGroup, *,
                     op: Literal["mean", "sum"] = "mean") -> None:
    """Average (or sum) the gradients over ``group``, the data-parallel replicas. Collective.

    For data parallelism on top of a sharded model: each replica of a tensor-parallel model
    (``shard_model(..., process_group=tp_group)``) computes gradients on its part of the
    batch, and this makes them those of the whole batch. Gradients are packed into one
    buffer per dtype and device, so it costs one all-reduce each. Parameters without a
    gradient are skipped (they must lack one on every rank of ``group``).

    Args:
        model: a model or its parameters.
        group: the data-parallel group: the ranks holding the same blocks.
        op: ``"mean"`` (the default, for a loss averaged over each replica's batch) or ``"sum"``.

    Example:
        >>> # 4 ranks: tp groups {0, 1} and {2, 3}; dp groups {0, 2} and {1, 3}
        >>> loss.backward()  # doctest: +SKIP
        >>> st.all_reduce_grads(model, dp_group)  # doctest: +SKIP
        >>> optim.step()  # doctest: +SKIP
    """
    if op not in ("mean", "sum"):
        msg = f"op={op!r} is not supported; use 'mean' or 'sum'."
        raise ValueError(msg)
    params = model.parameters() if isinstance(model, nn.Module) else model
    grads = [p.grad for p in dict.fromkeys(params) if p.grad is not None]
    _, world = _comm.rank_and_world(group)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        buckets.setdefault((grad.dtype, grad.device), []).append(grad)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        _comm.all_reduce(flat, group)
        if op == "mean":
            flat.div_(world)
        start = 0
        with torch.no_grad():
            for g in bucket:
                g.copy_(flat[start:start + g.numel()].view_as(g))
                start += g.numel()
