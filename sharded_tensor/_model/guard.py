"""Which parameter objects shardkit created and which it replaced, and the optimizer check.

``shard_model`` replaces each parameter by a new ``nn.Parameter`` holding the rank's block.
An optimizer built before that still holds the old objects (on the meta device, or the full
tensors of a model that had real weights): its ``step()`` would update tensors the model no
longer uses, and training would silently do nothing.

shardkit does not hand the old objects the new data instead (``param.data = block``): some
optimizers allocate per-parameter state when they are built (``torch.optim.Adagrad``'s
``state_sum`` has the full, meta shape), and learning rates or groups chosen for full
tensors are not always right for blocks. It makes the mistake loud instead: the first time
shardkit replaces a parameter, it registers one global ``torch.optim`` step pre-hook that
raises a ``RuntimeError`` when an optimizer is about to step a replaced parameter. The
hook costs one dictionary lookup per parameter and step, and never fires for parameters
shardkit did not replace.

The same module remembers, for each new parameter, its ``ShardedParameter`` (layout and
process group), so helpers given a plain iterable of parameters (``clip_grad_norm_``)
still know how each one is laid out. Both tables hold their keys weakly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from .record import ShardedParameter

__all__ = ["remember", "retire", "layout_of", "check_optimizer"]

_layouts: WeakIdKeyDictionary = WeakIdKeyDictionary()   # new parameter -> ShardedParameter
_retired: WeakIdKeyDictionary = WeakIdKeyDictionary()   # replaced parameter -> (its name, what replaced it)
_hook_handle: Any = None


def remember(param: torch.Tensor, sharded: ShardedParameter) -> None:
    """Record that ``param`` is the local block of a parameter laid out as ``sharded`` says."""
    _layouts[param] = sharded


def layout_of(param: torch.Tensor) -> ShardedParameter | None:
    """The layout recorded for ``param``, or ``None`` for a parameter shardkit did not shard."""
    found: ShardedParameter | None = _layouts.get(param)
    return found


def retire(replaced: Iterable[tuple[str, torch.Tensor]], by: str = "shard_model") -> None:
    """Record parameters that ``shard_model`` (or ``by``) replaced (``(name, old parameter)`` pairs)."""
    global _hook_handle
    for name, param in replaced:
        _retired[param] = (name, by)
    if _hook_handle is None and len(_retired):
        _hook_handle = register_optimizer_step_pre_hook(_step_pre_hook)


def check_optimizer(optim: torch.optim.Optimizer) -> None:
    """Raise if ``optim`` holds parameters that shardkit replaced.

    Raises:
        RuntimeError: the optimizer was built before ``shard_model``; the message names the
            parameters and says to build the optimizer afterwards.
    """
    stale = []
    for group in optim.param_groups:
        for param in group["params"]:
            found = _retired.get(param)
            if found is not None:
                stale.append((found, param))
    if not stale:
        return
    shown = ", ".join(f"{name!r} ({'meta' if p.is_meta else p.device.type} {tuple(p.shape)})"
                      for (name, _), p in stale[:4])
    by = stale[0][0][1]
    more = f" and {len(stale) - 4} more" if len(stale) > 4 else ""
    msg = (f"{type(optim).__name__}.step(): this optimizer holds {len(stale)} parameter(s) that "
           f"st.{by} replaced, {shown}{more}; it was created before {by} and would update "
           f"tensors the model no longer uses. Create the optimizer after {by}, from the sharded "
           f"model: optim = {type(optim).__name__}(model.parameters(), ...).")
    raise RuntimeError(msg)


def _step_pre_hook(optim: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    check_optimizer(optim)
