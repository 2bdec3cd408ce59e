"""The optimizer check: an optimizer holding parameters that shardkit replaced refuses to step.

``shard_model`` replaces each parameter by a new ``nn.Parameter`` holding the rank's block.
An optimizer built before that still holds the old objects (on the meta device, or the full
tensors of a model that had real weights): its ``step()`` would update tensors the model no
longer uses, and training would silently do nothing.

shardkit does not hand the old objects the new data instead (``param.data = block``): some
optimizers allocate per-parameter state when they are built (``torch.optim.Adagrad``'s
``state_sum`` has the full, meta shape), and learning rates or groups chosen for full
tensors are not always right for blocks. It makes the mistake loud instead, on the old
objects alone and with nothing installed in torch: each replaced parameter becomes a
``_Replaced`` parameter, whose ``.grad`` raises a ``RuntimeError`` when an optimizer reads
it (every ``torch.optim`` optimizer reads each parameter's ``.grad`` in ``step()`` and
``zero_grad()``); read anywhere else, it is an ordinary gradient. Parameters shardkit did
not replace, and optimizers that hold none of them, never meet the check.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch
from torch import nn

__all__ = ["retire", "check_optimizer"]

# On a replaced parameter: (its name, the function that replaced it).
_REPLACED = "_shardkit_replaced"
_ORIGINAL_GRAD: Any = vars(torch._C.TensorBase)["grad"]  # the descriptor itself


class _Replaced(nn.Parameter):
    """A parameter that shardkit replaced: its ``.grad`` refuses the optimizers that still hold it."""

    @property
    def grad(self) -> torch.Tensor | None:
        found = _optimizer_calling()
        if found is not None:
            check_optimizer(*found)
        value: torch.Tensor | None = _ORIGINAL_GRAD.__get__(self)
        return value

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _ORIGINAL_GRAD.__set__(self, value)


# Parameter type -> its subclass with the check (made once per type).
_traps: dict[type, type] = {nn.Parameter: _Replaced}


def _optimizer_calling() -> tuple[torch.optim.Optimizer, str] | None:
    """The optimizer whose method is reading a ``.grad`` now, and that method's name (``step``)."""
    frame: FrameType | None = sys._getframe(2)
    found: torch.optim.Optimizer | None = None
    method = "step"
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.optim.Optimizer) and (found is None or owner is found):
                found = owner
                if not code.co_name.startswith("_") and callable(getattr(type(owner), code.co_name, None)):
                    method = code.co_name
        frame = frame.f_back
    return (found, method) if found is not None else None


def retire(replaced: Iterable[tuple[str, torch.Tensor]], by: str = "shard_model") -> None:
    """Mark parameters that ``shard_model`` (or ``by``) replaced (``(name, old parameter)`` pairs)."""
    for name, param in replaced:
        setattr(param, _REPLACED, (name, by))
        cls = type(param)
        if cls in _traps.values():
            continue
        if cls not in _traps and issubclass(cls, nn.Parameter):
            _traps[cls] = type(f"_Replaced{cls.__name__}", (cls,), {"grad": _Replaced.grad})
        subclass = _traps.get(cls)
        if subclass is not None:
            try:
                param.__class__ = subclass
            except TypeError:  # a parameter type whose layout differs; get_state_dict still checks
                continue


def check_optimizer(optim: torch.optim.Optimizer, method: str = "step") -> None:
    """Raise if ``optim`` holds parameters that shardkit replaced.

    Raises:
        RuntimeError: the optimizer was built before ``shard_model``; the message names the
            parameters and says to build the optimizer afterwards.
    """
    stale = []
    for group in optim.param_groups:
        for param in group["params"]:
            found = getattr(param, _REPLACED, None)
            if found is not None:
                stale.append((found, param))
    if not stale:
        return
    shown = ", ".join(f"{name!r} ({'meta' if p.is_meta else p.device.type} {tuple(p.shape)})"
                      for (name, _), p in stale[:4])
    by = stale[0][0][1]
    more = f" and {len(stale) - 4} more" if len(stale) > 4 else ""
    msg = (f"{type(optim).__name__}.{method}(): this optimizer holds {len(stale)} parameter(s) that "
           f"st.{by} replaced, {shown}{more}; it was created before {by} and would update "
           f"tensors the model no longer uses. Create the optimizer after {by}, from the sharded "
           f"model: optim = {type(optim).__name__}(model.parameters(), ...).")
    raise RuntimeError(msg)
