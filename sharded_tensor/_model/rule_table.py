"""The one table of sharded compute rules, keyed by what a model calls.

Every rule shardkit follows to compute with split tensors lives in :data:`RULES`, whoever
registered it (shardkit itself or ``st.register_split_rule``), keyed by the callable it is for:

========================================  ===============================================================
key                                       value
========================================  ===============================================================
a torch op (``torch.tanh``,               its split rule ``rule(func, args, kwargs)``: the op on this
``Tensor.view``, a ``torch.library``      rank's slices, its output tagged, or ``_Fallback`` to gather
operator)                                 (``zones``)
an ``nn.Module`` type                     its ``ShardedModule``: how the module computes with split
                                          parameters (``registry``)
a ``DFunction`` subclass                  its split rule, as for a torch op: how it runs on split
                                          activations inside a sharded model (``dfunction``)
``LayoutRuleName(name)``                  a layout rule: where a ``DFunction``'s ``ShardedTensor``
                                          arguments must be, and its output's layout (``dfunction``)
========================================  ===============================================================

The keys cannot collide (an op object, a class, a name wrapped in its own type), so one
lookup answers for any of them, and one registration function writes all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RULES", "LayoutRuleName"]

RULES: dict[Any, Any] = {}


@dataclass(frozen=True)
class LayoutRuleName:
    """The key of a layout rule registered under ``name``."""

    name: str
