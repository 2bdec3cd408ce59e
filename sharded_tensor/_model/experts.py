"""Mixture-of-experts layers with split experts: tensor-parallel experts and expert parallel.

transformers 5 keeps a layer's experts as two fused 3-D parameters, ``gate_up_proj``
``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``down_proj`` ``[E, H, I]``,
in one module whose forward takes the replicated hidden states ``[T, H]``, the router's
choices ``top_k_index`` ``[T, k]`` and weights ``top_k_weights`` ``[T, k]``. Two layouts
compute it exactly:

* **tensor-parallel experts** (``"tensor"``): every rank holds every expert, with its slice
  ``(s, n)`` of the intermediate features: rows ``s..s+n`` of the gate half and of the up half
  of ``gate_up_proj`` (a *packed* split on dim 1: name each rank twice,
  ``single_split(1, ranks * 2)``) and columns ``s..s+n`` of ``down_proj`` (dim 2);
* **expert parallel** (``"expert"``): each rank holds whole experts, an equal share of them
  (``single_split(0, ranks)`` on both parameters).

Either way a rank computes a partial sum of the layer's output for every token (its feature
slice of every chosen expert, or its own experts' contributions), and one all-reduce per layer
adds them up. The inputs are replicated and consumed by every rank, so their gradients (the
hidden states, flowing back into attention, and the routing weights, flowing back into the
router) are summed over ranks in backward: the router, which runs on every rank on the same
replicated input, then gets the exact gradient.

Why an all-reduce and not an all-to-all in expert parallel: inside a tensor-parallel model the
tokens are already on every rank, so dispatching them moves nothing, and the combined output
must end up on every rank again. :func:`combine_bytes` counts both ways for a given routing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from . import registry as _registry
from .functional import Intervals, copy_to_ranks

__all__ = ["ExpertsPlan", "ShardedExperts", "is_fused_experts", "register_experts_of", "combine_bytes"]


@dataclass(frozen=True)
class ExpertsPlan:
    """How a sharded experts module computes.

    ``mode``: ``"tensor"`` (``intervals``: each rank's slice of the intermediate features) or
    ``"expert"`` (``intervals``: each rank's experts, ``(first, count)``).
    """

    mode: Literal["tensor", "expert"]
    intervals: Intervals


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers fused-experts module this registration computes.

    It has 3-D ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` in the
    concatenated (gate rows, then up rows), untransposed, bias-free layout.
    """
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or not callable(getattr(module, "act_fn", None)):
        return False
    return (getattr(module, "is_concatenated", True) and not getattr(module, "is_transposed", False)
            and not getattr(module, "has_bias", False) and getattr(module, "has_gate", True)
            and not getattr(module, "has_post_expert_norm", False))


def register_experts_of(model: nn.Module) -> None:
    """Register :class:`ShardedExperts` for the fused-experts module types in ``model``.

    Types that already have a registration (the user's own) are left as they are.
    """
    for module in model.modules():
        cls = type(module)
        if is_fused_experts(module) and _registry.handler_for(module) == (None, None):
            _registry.register_sharded_module(cls, ShardedExperts())


def _plan(module: nn.Module, layouts: Mapping[str, Any], name: str) -> ExpertsPlan:
    num, two_inter, _ = cast(torch.Tensor, module.gate_up_proj).shape
    inter = two_inter // 2
    gate_up, down = layouts.get("gate_up_proj"), layouts.get("down_proj")
    how = ("split either each expert's intermediate features (gate_up_proj with single_split(1, ranks * 2), "
           "each half split the same way, and down_proj with single_split(2, ranks)) or the experts "
           "(single_split(0, ranks) on both)")
    if gate_up is None or down is None or gate_up.kind == "replicated" or down.kind == "replicated":
        which = "gate_up_proj" if gate_up is None or gate_up.kind == "replicated" else "down_proj"
        msg = f"{name}: {which} is whole on every rank while the other experts parameter is split; {how}."
        raise ValueError(msg)
    for pname, layout in (("gate_up_proj", gate_up), ("down_proj", down)):
        if layout.kind != "split" or layout.dim is None:
            msg = f"{name}: {pname} is split as {layout.describe()}; {how}."
            raise ValueError(msg)
    if gate_up.dim == 0 and down.dim == 0:
        for layout in (gate_up, down):
            if len({n for _, n in layout.intervals}) != 1:
                ranks = len(layout.intervals)
                msg = (f"{name}: {num} experts over {ranks} ranks in uneven shares {list(layout.intervals)} "
                       f"((first, count) per rank); expert parallel needs the number of experts divisible by the "
                       f"number of ranks, each rank holding as many: use a number of ranks dividing {num}, or "
                       f"tensor-parallel experts.")
                raise ValueError(msg)
        if gate_up.intervals != down.intervals:
            msg = (f"{name}: gate_up_proj holds experts {list(gate_up.intervals)} and down_proj experts "
                   f"{list(down.intervals)} ((first, count) per rank); give each rank the same experts in both.")
            raise ValueError(msg)
        return ExpertsPlan("expert", gate_up.intervals)
    if gate_up.dim == 1 and down.dim == 2:
        own = down.intervals
        pieces = gate_up.pieces
        want = tuple(((s, n), (inter + s, n)) if n else () for s, n in own)
        got = pieces if pieces is not None else tuple(((s, n),) if n else () for s, n in gate_up.intervals)
        if tuple(tuple(p) for p in got) != want:
            msg = (f"{name}: gate_up_proj packs each expert's gate ({inter} rows) and up ({inter} rows) "
                   f"projections, so each rank needs the same slice of both halves as of down_proj's inputs "
                   f"{list(own)}; gate_up_proj is split as {[list(p) for p in got]} ((start, length) per rank). "
                   f"Split it with single_split(1, ranks * 2) (each rank named twice).")
            raise ValueError(msg)
        return ExpertsPlan("tensor", own)
    msg = (f"{name}: gate_up_proj split on dim {gate_up.dim} and down_proj on dim {down.dim}; {how}.")
    raise ValueError(msg)


def _mix(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
         down: torch.Tensor, first: int, act: Any) -> torch.Tensor:
    """Sum over the local experts ``first..`` of their weighted outputs, per token.

    Every local expert runs, even on no token: its parameters then get a zero gradient, as
    in the unsharded model, so an optimizer updates them the same way.
    """
    out = x.new_zeros(x.shape[0], down.shape[1])
    for local in range(gate_up.shape[0]):
        token, slot = torch.where(index == first + local)
        gate, up = F.linear(x[token], gate_up[local]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down[local]) * weights[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out


class ShardedExperts(_registry.ShardedModule):
    """transformers' fused experts (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) split by features or by experts."""

    def plan(self, module: nn.Module, layouts: Mapping[str, Any], *, name: str) -> ExpertsPlan:
        return _plan(module, layouts, name)

    def empty_dims(self, plan: ExpertsPlan) -> Mapping[str, int]:
        if plan.mode == "expert":
            return {"gate_up_proj": 0, "down_proj": 0}
        return {"gate_up_proj": 1, "down_proj": 2}

    def forward(self, call: _registry.ShardedCall, module: nn.Module, hidden_states: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        plan: ExpertsPlan = call.plan
        x = call.enter(hidden_states)
        weights = copy_to_ranks(top_k_weights, call.group)
        first = plan.intervals[call.rank][0] if plan.mode == "expert" else 0
        gate_up, down = cast(torch.Tensor, module.gate_up_proj), cast(torch.Tensor, module.down_proj)
        partial = _mix(x, top_k_index, weights, gate_up, down, first, module.act_fn)
        return call.reduce(partial)


@dataclass(frozen=True)
class CombineBytes:
    """Bytes one rank receives to combine an expert-parallel layer's output, two ways.

    ``all_reduce``: a ring all-reduce of the dense ``[T, H]`` partial sums, ``2 (k-1)/k T H``
    elements. ``all_to_all``: each rank sends every other rank, for the tokens that rank owns
    (``T/k`` of them), only the rows its experts produced (``n_r`` of ``T`` tokens hit), then
    an all-gather makes the output replicated again, ``((k-1)/k) (mean n_r + T) H`` elements.
    ``all_gather``: every rank gathers the others' compact rows, ``sum_{q != r} n_q H``.
    """

    all_reduce: int
    all_to_all: int
    all_gather: int


def combine_bytes(top_k_index: torch.Tensor, intervals: Intervals, hidden: int, element_size: int,
                  rank: int) -> CombineBytes:
    """Count :class:`CombineBytes` for one layer's routing (``top_k_index`` ``[T, k]``) on ``rank``."""
    tokens = top_k_index.shape[0]
    world = len(intervals)
    hit = [((top_k_index >= a) & (top_k_index < a + n)).any(-1) for a, n in intervals]
    row = hidden * element_size
    # Tokens owned for the all-to-all: contiguous, as even as possible.
    bounds = [tokens * q // world for q in range(world + 1)]
    owned = slice(bounds[rank], bounds[rank + 1])
    reduce = 2 * (world - 1) * tokens * row // world
    to_all = sum(int(hit[q][owned].sum()) for q in range(world) if q != rank) * row
    to_all += (tokens - (bounds[rank + 1] - bounds[rank])) * row
    gather = sum(int(hit[q].sum()) for q in range(world) if q != rank) * row
    return CombineBytes(reduce, to_all, gather)
