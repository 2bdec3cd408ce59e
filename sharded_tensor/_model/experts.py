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
slice of every chosen expert, or its own experts' contributions), and the partial sums are
added up once per layer. The inputs are replicated and consumed by every rank, so their
gradients (the hidden states, flowing back into attention, and the routing weights, flowing
back into the router) are summed over ranks in backward (one all-reduce for both): the router,
which runs on every rank on the same replicated input, then gets the exact gradient.

Adding up: tensor-parallel experts all-reduce the dense ``[T, H]`` partial sums (every rank
contributes to every token). In expert parallel a rank contributes only to the tokens that
chose one of its experts, so the layer combines with an all-to-all of those rows (each to the
rank owning the token, ``T/k`` tokens each) and an all-gather of the owned sums, which moves
fewer bytes than the all-reduce whenever some token skips some rank's experts. Inside a
tensor-parallel model the tokens are already on every rank, so the dispatch itself (tokens to
their experts' ranks) moves nothing. :func:`combine_bytes` counts the ways; the layer takes
the all-to-all only when it moves fewer bytes in total (the routing is replicated, so every
rank decides the same). That choice reads the routing on the host; under ``torch.compile``,
where the routing has no value while tracing, the layer always takes the all-reduce.

Computing: a rank's (token, chosen expert) pairs are sorted by expert, and each expert
matrix is one grouped product over the sorted rows (``grouped_mm``, an operator with a fake
implementation and its own backward), so the shapes in the layer do not depend on the
routing's values and ``torch.compile`` traces it whole, with the code eager runs. The one
difference: eager keeps only the pairs of this rank's experts (their number is read once per
layer), the compiled layer keeps all ``T * k`` (a static shape), those of other ranks' experts
sorted last and adding exact zeros. Llama 4's stacked experts need no routing: every expert
runs on its own block of rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from _shardkit import comm as _comm

from . import registry as _registry
from .engine.placements import Intervals, copy_to_ranks, gather
from .grouped_mm import grouped_mm

__all__ = ["ExpertsPlan", "ShardedExperts", "ShardedBiasedExperts", "ShardedStackedExperts", "biased_experts_layout",
           "is_biased_experts", "is_fused_experts", "is_stacked_experts", "register_experts_of", "combine_bytes"]


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
    num, two_inter, hidden = gate_up.shape
    if tuple(down.shape) != (num, hidden, two_inter // 2) or two_inter % 2:
        return False
    return (getattr(module, "is_concatenated", True) and not getattr(module, "is_transposed", False)
            and not getattr(module, "has_bias", False) and getattr(module, "has_gate", True)
            and not getattr(module, "has_post_expert_norm", False))


def is_biased_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds GPT-OSS's experts: transposed, gate and up interleaved, with biases.

    ``gate_up_proj`` ``[E, H, 2I]`` (columns alternate gate, up), ``gate_up_proj_bias``
    ``[E, 2I]``, ``down_proj`` ``[E, I, H]``, ``down_proj_bias`` ``[E, H]``, and the module's
    own ``_apply_gate`` (its clamped gated activation) on the ``[.., 2I]`` products.
    """
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    params = [getattr(module, n, None) for n in names]
    if not all(isinstance(p, nn.Parameter) for p in params) or not callable(getattr(module, "_apply_gate", None)):
        return False
    gate_up, gate_up_bias, down, down_bias = cast("list[torch.Tensor]", params)
    if (gate_up.dim(), gate_up_bias.dim(), down.dim(), down_bias.dim()) != (3, 2, 3, 2):
        return False
    num, hidden, two_inter = gate_up.shape
    return (tuple(down.shape) == (num, two_inter // 2, hidden) and tuple(gate_up_bias.shape) == (num, two_inter)
            and tuple(down_bias.shape) == (num, hidden) and two_inter % 2 == 0)


def biased_experts_layout(module: nn.Module, experts: Literal["tensor", "expert"]) -> dict[str, int] | None:
    """The split dimension of each of a GPT-OSS experts module's parameters, or ``None`` for another module.

    ``"tensor"``: each expert's intermediate features; gate and up alternate column by
    column in ``gate_up_proj``, so a rank's features are one contiguous run of its columns
    (``[2s, 2s + 2n)``) and of its bias, and rows ``[s, s + n)`` of ``down_proj``; ``down_proj_bias``
    stays whole (added once, after the sum over ranks). ``"expert"``: the experts (dim 0 of all four).
    """
    if not is_biased_experts(module):
        return None
    if experts == "expert":
        return {"gate_up_proj": 0, "gate_up_proj_bias": 0, "down_proj": 0, "down_proj_bias": 0}
    return {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}


def is_stacked_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds Llama 4's experts: every expert applied to its own block of rows.

    ``gate_up_proj`` ``[E, H, 2I]`` (each expert's gate columns, then its up columns),
    ``down_proj`` ``[E, I, H]``, an ``act_fn``, and a forward taking only the hidden states,
    already stacked expert by expert (``[E * T, H]``).
    """
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)) or is_fused_experts(module):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or not callable(getattr(module, "act_fn", None)):
        return False
    num, hidden, two_inter = gate_up.shape
    if tuple(down.shape) != (num, two_inter // 2, hidden) or two_inter % 2:
        return False
    try:
        params = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) == 2


def register_experts_of(model: nn.Module) -> None:
    """Register the experts computations for the transformers experts module types in ``model``.

    :class:`ShardedExperts` for fused experts (Mixtral, Qwen2-MoE, ...),
    :class:`ShardedBiasedExperts` for GPT-OSS's, :class:`ShardedStackedExperts` for Llama 4's.
    Types that already have a registration (the user's own) are left as they are.
    """
    for module in model.modules():
        cls = type(module)
        if _registry.handler_for(module) != (None, None):
            continue
        if is_fused_experts(module):
            _registry.register_sharded_module(cls, ShardedExperts())
        elif is_biased_experts(module):
            _registry.register_sharded_module(cls, ShardedBiasedExperts())
        elif is_stacked_experts(module):
            _registry.register_sharded_module(cls, ShardedStackedExperts())


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
    if all(layout.kind == "split" and layout.dim in (0, None) for layout in (gate_up, down)):
        return _expert_plan(num, gate_up.along(0), down.along(0), name)
    for pname, layout in (("gate_up_proj", gate_up), ("down_proj", down)):
        if layout.kind != "split" or layout.dim is None:
            msg = f"{name}: {pname} is split as {layout.describe()}; {how}."
            raise ValueError(msg)
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


def _expert_plan(num: int, gate_up: Intervals, down: Intervals, name: str) -> ExpertsPlan:
    for intervals in (gate_up, down):
        if len({n for _, n in intervals}) != 1:
            msg = (f"{name}: {num} experts over {len(intervals)} ranks in uneven shares {list(intervals)} "
                   f"((first, count) per rank); expert parallel gives each rank an equal share: split with "
                   f"single_split(0, ranks) (no sizes) over a number of ranks dividing {num} (the number of "
                   f"experts must be divisible by it), or use tensor-parallel experts.")
            raise ValueError(msg)
    if gate_up != down:
        msg = (f"{name}: gate_up_proj holds experts {list(gate_up)} and down_proj experts {list(down)} "
               f"((first, count) per rank); give each rank the same experts in both.")
        raise ValueError(msg)
    return ExpertsPlan("expert", gate_up)


@dataclass(frozen=True)
class _Rows:
    """The (token, slot) pairs a rank computes, one row each, grouped by its local expert.

    ``order``: each row's position among the flattened ``[T * k]`` pairs (sorted by local
    expert, stably, so a token's pairs keep their order within an expert); ``tokens``: its
    token; ``expert``: its local expert; ``counts``: rows per local expert (``[G]``), the
    grouping ``grouped_mm`` takes. ``valid`` is ``None`` when every row belongs to a local
    expert, else which do: under ``torch.compile`` the rows are all ``T * k`` pairs (a static
    shape), those of other ranks' experts sorted last, where ``grouped_mm`` leaves zeros and the
    routing weight is taken as zero.
    """

    order: torch.Tensor
    tokens: torch.Tensor
    expert: torch.Tensor
    counts: torch.Tensor
    valid: torch.Tensor | None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's token of ``x`` ``[T, ...]``."""
        return x[self.tokens]

    def weights(self, weights: torch.Tensor) -> torch.Tensor:
        """Each row's routing weight from ``weights`` ``[T, k]``, as ``[R, 1]`` (zero for another rank's expert)."""
        w = weights.reshape(-1)[self.order]
        if self.valid is not None:
            w = torch.where(self.valid, w, torch.zeros_like(w))
        return w.unsqueeze(-1)

    def add_up(self, y: torch.Tensor, tokens: int) -> torch.Tensor:
        """The ``[tokens, ...]`` sums of the rows ``y`` per token."""
        return y.new_zeros(tokens, *y.shape[1:]).index_add(0, self.tokens, y)


def _rows(index: torch.Tensor, first: int, count: int, every: bool) -> _Rows:
    """The rows of the pairs routed to experts ``first .. first + count`` (``every``: all experts are local).

    The pairs are sorted by expert, those of other ranks' experts last. Eager keeps only the
    local ones, their number read on the host (no read when every expert is local). Traced
    (``torch.compile``), no value exists yet: all ``T * k`` pairs stay, a static shape; the
    others add zeros (see :class:`_Rows`), so the compiled layer computes what eager does, row
    for row.
    """
    flat = index.reshape(-1)
    local = flat - first if first else flat
    key = local if every else torch.where((local >= 0) & (local < count), local, torch.full_like(local, count))
    groups = count if every else count + 1
    counts = key.new_zeros(groups).index_add_(0, key, torch.ones_like(key))
    sorted_key, order = torch.sort(key, stable=True)
    valid = None
    if not every:
        counts = counts[:count]
        if torch.compiler.is_compiling():
            valid = sorted_key < count
        else:
            kept = int(counts.sum())
            order, sorted_key = order[:kept], sorted_key[:kept]
    tokens = torch.div(order, index.shape[-1], rounding_mode="floor")
    expert = sorted_key if valid is None else sorted_key.clamp(max=count - 1)
    return _Rows(order, tokens, expert, counts, valid)


def _mix(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
         down: torch.Tensor, first: int, act: Any, every: bool) -> torch.Tensor:
    """Sum over the local experts ``first..`` of their weighted outputs, per token.

    The (token, slot) pairs are sorted by expert and each matrix is one grouped product over
    them (``grouped_mm``). Every local expert's parameters get a gradient, zero for an expert
    no token chose, as in the unsharded model, so an optimizer updates them the same way.
    """
    rows = _rows(index, first, gate_up.shape[0], every)
    gate, up = grouped_mm(rows.take(x), gate_up, rows.counts, linear=True).chunk(2, dim=-1)
    y = grouped_mm(act(gate) * up, down, rows.counts, linear=True) * rows.weights(weights)
    return rows.add_up(y.to(x.dtype), x.shape[0])


class ShardedExperts(_registry.ShardedModule):
    """transformers' fused experts (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) split by features or by experts.

    The layer traces whole under ``torch.compile`` (static shapes: see the module's docstring);
    split by experts, the compiled layer sums the ranks' outputs with an all-reduce, where eager
    may choose an all-to-all (:func:`_combine`).
    """

    def plan(self, module: nn.Module, layouts: Mapping[str, Any], *, name: str) -> ExpertsPlan:
        return _plan(module, layouts, name)

    def empty_dims(self, plan: ExpertsPlan) -> Mapping[str, int]:
        if plan.mode == "expert":
            return {"gate_up_proj": 0, "down_proj": 0}
        return {"gate_up_proj": 1, "down_proj": 2}

    def forward(self, call: _registry.ShardedCall, module: nn.Module, hidden_states: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        plan: ExpertsPlan = call.plan
        x, weights = _shared_inputs(call, hidden_states, top_k_weights)
        first = plan.intervals[call.rank][0] if plan.mode == "expert" else 0
        gate_up, down = cast(torch.Tensor, module.gate_up_proj), cast(torch.Tensor, module.down_proj)
        partial = _mix(x, top_k_index, weights, gate_up, down, first, module.act_fn, plan.mode == "tensor")
        return _combine(call, plan, partial, top_k_index)


def _shared_inputs(call: _registry.ShardedCall, hidden_states: torch.Tensor,
                   weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The replicated hidden states and routing weights, their gradients summed over the ranks in backward."""
    if call.world_size > 1 and hidden_states.dtype == weights.dtype and torch.is_grad_enabled():
        return _SharedInputs.apply(call.replicated(hidden_states), weights, call.group)  # type: ignore[no-any-return]
    return call.enter(hidden_states), copy_to_ranks(weights, call.group)


def _combine(call: _registry.ShardedCall, plan: ExpertsPlan, partial: torch.Tensor,
             top_k_index: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of every rank's partial ``[T, H]`` output: all-reduce, or all-to-all where cheaper.

    Which moves fewer bytes depends on the routing's values (:func:`combine_bytes`), read on the
    host in eager. Under ``torch.compile`` they have no value while tracing, and the all-to-all's
    message sizes would depend on them: the compiled layer always takes the all-reduce (the
    same sum), with no value taken to the host.
    """
    if plan.mode == "expert" and call.world_size > 1 and not torch.compiler.is_compiling():
        hits = _hits(top_k_index, plan.intervals)
        bytes_ = [combine_bytes(top_k_index, plan.intervals, partial.shape[1], partial.element_size(), r)
                  for r in range(call.world_size)]
        # The routing is the same on every rank, so every rank makes the same choice.
        if sum(b.all_to_all for b in bytes_) < sum(b.all_reduce for b in bytes_):
            return _Combine.apply(partial, hits, call.group)  # type: ignore[no-any-return]
    return call.reduce(partial)


def _biased_plan(module: nn.Module, layouts: Mapping[str, Any], name: str) -> ExpertsPlan:
    """GPT-OSS's experts split on each expert's features (``"tensor"``) or on the experts (``"expert"``)."""
    num, _, two_inter = cast(torch.Tensor, module.gate_up_proj).shape
    how = ("split either each expert's features (gate_up_proj on dim 2, gate_up_proj_bias on dim 1, down_proj on "
           "dim 1, each rank's share of every expert's features, down_proj_bias whole) or the experts (all four on "
           "dim 0, single_split(0, ranks))")
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    got = {n: layouts.get(n) for n in names}
    split = {n: v for n, v in got.items() if v is not None and v.kind != "replicated"}
    for pname, layout in split.items():
        if layout.kind != "split" or layout.pieces is not None:
            msg = f"{name}: {pname} is split as {layout.describe()}; {how}."
            raise ValueError(msg)
    if set(split) == set(names) and all(v.dim in (0, None) for v in split.values()):
        intervals = [v.along(0) for v in split.values()]
        if any(i != intervals[0] for i in intervals):
            msg = (f"{name}: the four experts parameters hold different experts "
                   f"{ {n: list(v.along(0)) for n, v in split.items()} } ((first, count) per rank); give each rank the "
                   f"same experts in all four.")
            raise ValueError(msg)
        return _expert_plan(num, intervals[0], intervals[0], name)
    dims = {n: v.dim for n, v in split.items()}
    if dims != {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}:
        msg = f"{name}: the experts parameters are split as {dims} (dimension per parameter); {how}."
        raise ValueError(msg)
    columns = split["gate_up_proj"].intervals
    if split["gate_up_proj_bias"].intervals != columns or any(s % 2 or n % 2 for s, n in columns):
        msg = (f"{name}: gate_up_proj's columns alternate gate and up, so each rank needs whole (gate, up) pairs: an "
               f"even start and length, the same for gate_up_proj_bias; they are split as {list(columns)} and "
               f"{list(split['gate_up_proj_bias'].intervals)} ((start, length) per rank). Split both on "
               f"{two_inter} columns over a number of ranks dividing {two_inter // 2}.")
        raise ValueError(msg)
    features = tuple((s // 2, n // 2) for s, n in columns)
    if split["down_proj"].intervals != features:
        msg = (f"{name}: down_proj's rows must be the features of this rank's gate_up_proj columns {list(features)}; "
               f"they are split as {list(split['down_proj'].intervals)} ((start, length) per rank).")
        raise ValueError(msg)
    return ExpertsPlan("tensor", features)


class ShardedBiasedExperts(_registry.ShardedModule):
    """GPT-OSS's experts (interleaved gate and up, biases) split by features or by experts.

    Each rank runs the module's own ``_apply_gate`` on its columns of every chosen expert (its
    features: an even run of the interleaved columns), so the clamped activation is the
    module's. Split by features, the down projection's bias is added once after the sum over
    ranks, weighted by the routing weights as in the module; split by experts, each expert
    adds its own. Like :class:`ShardedExperts`, it traces whole under ``torch.compile``.
    """

    def plan(self, module: nn.Module, layouts: Mapping[str, Any], *, name: str) -> ExpertsPlan:
        return _biased_plan(module, layouts, name)

    def empty_dims(self, plan: ExpertsPlan) -> Mapping[str, int]:
        if plan.mode == "expert":
            return {"gate_up_proj": 0, "gate_up_proj_bias": 0, "down_proj": 0, "down_proj_bias": 0}
        return {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}

    def forward(self, call: _registry.ShardedCall, module: nn.Module, hidden_states: torch.Tensor,
                router_indices: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        plan: ExpertsPlan = call.plan
        x, weights = _shared_inputs(call, hidden_states, routing_weights)
        first = plan.intervals[call.rank][0] if plan.mode == "expert" else 0
        gate_up, gate_up_bias = cast(torch.Tensor, module.gate_up_proj), cast(torch.Tensor, module.gate_up_proj_bias)
        down, down_bias = cast(torch.Tensor, module.down_proj), cast(torch.Tensor, module.down_proj_bias)
        apply_gate = cast(Any, module)._apply_gate
        rows = _rows(router_indices, first, gate_up.shape[0], plan.mode == "tensor")
        h = grouped_mm(rows.take(x), gate_up, rows.counts, linear=False) + gate_up_bias[rows.expert]
        y = grouped_mm(apply_gate(h), down, rows.counts, linear=False)
        if plan.mode == "expert":
            y = y + down_bias[rows.expert]
        partial = rows.add_up((y * rows.weights(weights)).to(x.dtype), x.shape[0])
        if plan.mode == "expert":
            return _combine(call, plan, partial, router_indices)
        total = call.reduce(partial)
        # Each chosen expert's bias, weighted as in the module; from the routing weights as they come
        # (not the shared copy above, whose gradient is summed over the ranks), the same on every rank.
        bias = down_bias[rows.expert] * rows.weights(routing_weights)
        return total + rows.add_up(bias.to(x.dtype), x.shape[0])


def _stacked_plan(module: nn.Module, layouts: Mapping[str, Any], name: str) -> ExpertsPlan:
    """Llama 4's experts split by features (``gate_up_proj`` packed on dim 2, ``down_proj`` on dim 1) or experts."""
    num, _, two_inter = cast(torch.Tensor, module.gate_up_proj).shape
    inter = two_inter // 2
    gate_up, down = layouts.get("gate_up_proj"), layouts.get("down_proj")
    how = ("split either each expert's features (gate_up_proj with single_split(2, ranks * 2), each of the gate and "
           "up halves split the same way, and down_proj with single_split(1, ranks)) or the experts "
           "(single_split(0, ranks) on both)")
    if gate_up is None or down is None or gate_up.kind != "split" or down.kind != "split":
        msg = f"{name}: gate_up_proj and down_proj must both be split; {how}."
        raise ValueError(msg)
    if gate_up.dim in (0, None) and down.dim in (0, None):
        return _expert_plan(num, gate_up.along(0), down.along(0), name)
    if (gate_up.dim, down.dim) != (2, 1):
        msg = f"{name}: gate_up_proj split on dim {gate_up.dim} and down_proj on dim {down.dim}; {how}."
        raise ValueError(msg)
    own = down.intervals
    want = tuple(((s, n), (inter + s, n)) if n else () for s, n in own)
    got = gate_up.pieces if gate_up.pieces is not None else tuple(((s, n),) if n else () for s, n in gate_up.intervals)
    if tuple(tuple(p) for p in got) != want:
        msg = (f"{name}: gate_up_proj packs each expert's gate ({inter} columns) and up ({inter} columns), so each "
               f"rank needs the same slice of both halves as of down_proj's rows {list(own)}; gate_up_proj is split "
               f"as {[list(p) for p in got]} ((start, length) per rank). Split it with single_split(2, ranks * 2).")
        raise ValueError(msg)
    return ExpertsPlan("tensor", own)


class ShardedStackedExperts(_registry.ShardedModule):
    """Llama 4's experts (the hidden states stacked expert by expert) split by features or by experts.

    Split by features, every rank runs every expert on its features and the partial outputs
    are summed; split by experts, each rank runs its experts on their own rows and the rows
    are gathered.
    """

    def plan(self, module: nn.Module, layouts: Mapping[str, Any], *, name: str) -> ExpertsPlan:
        return _stacked_plan(module, layouts, name)

    def empty_dims(self, plan: ExpertsPlan) -> Mapping[str, int]:
        return {"gate_up_proj": 0, "down_proj": 0} if plan.mode == "expert" else {"gate_up_proj": 2, "down_proj": 1}

    def forward(self, call: _registry.ShardedCall, module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        plan: ExpertsPlan = call.plan
        gate_up, down = cast(torch.Tensor, module.gate_up_proj), cast(torch.Tensor, module.down_proj)
        num = down.shape[0] if plan.mode == "tensor" else sum(n for _, n in plan.intervals)
        hidden = down.shape[-1]
        x = call.enter(hidden_states).view(num, -1, hidden)
        if plan.mode == "expert":
            first, count = plan.intervals[call.rank]
            x = x[first:first + count]
        gate, up = torch.bmm(x, gate_up).chunk(2, dim=-1)
        y = torch.bmm(up * cast(Any, module).act_fn(gate), down)
        if plan.mode == "expert":
            return gather(y, 0, plan.intervals, call.group).view(-1, hidden)
        return call.reduce(y.view(-1, hidden))


class _SharedInputs(torch.autograd.Function):
    """Identity on the hidden states and routing weights; backward sums both gradients over ranks at once.

    Every rank consumes both whole, so each gradient is the sum of the ranks' contributions:
    one all-reduce of the two, side by side, instead of one each.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: torch.Tensor,
                group: _comm.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.group = group
        return x.view_as(x), weights.view_as(weights)

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor, grad_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        both = torch.cat([grad_x.reshape(-1), grad_w.reshape(-1)])
        if torch.compiler.is_compiling():  # a functional all-reduce returns a new tensor: no copy back into ``both``
            both = _comm.all_reduced(both, ctx.group, what="experts backward (all_reduce)")
        else:
            _comm.all_reduce(both, ctx.group, what="experts backward (all_reduce)")
        n = grad_x.numel()
        return both[:n].view_as(grad_x), both[n:].view_as(grad_w), None


def _hits(index: torch.Tensor, intervals: Intervals) -> list[torch.Tensor]:
    """Per rank, which tokens chose at least one of its experts."""
    return [((index >= a) & (index < a + n)).any(-1) for a, n in intervals]


def _bounds(tokens: int, world: int) -> list[int]:
    """The tokens each rank owns while combining: contiguous, as even as possible."""
    return [tokens * q // world for q in range(world + 1)]


class _Combine(torch.autograd.Function):
    """Sum of every rank's partial expert outputs, replicated: all-to-all of the rows, then all-gather.

    Each rank owns a contiguous share of the tokens. Every rank sends each owner only the
    rows of that owner's tokens its experts produced (which rows is known everywhere: the
    routing is replicated, so no indices travel), the owner adds them up, and an all-gather
    makes the sums replicated. Backward passes the gradient through, as for an all-reduce:
    the output's gradient is the same on every rank, and each rank's partial sum enters the
    output as it is.
    """

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, hits: list[torch.Tensor], group: _comm.ProcessGroup) -> torch.Tensor:
        rank, world = _comm.rank_and_world(group)
        bounds = _bounds(partial.shape[0], world)
        own = slice(bounds[rank], bounds[rank + 1])
        sends, recvs = {}, {}
        for peer in range(world):
            if peer == rank:
                continue
            theirs = slice(bounds[peer], bounds[peer + 1])
            rows = partial[theirs][hits[rank][theirs]]
            if rows.shape[0]:
                sends[peer] = rows.contiguous()
            count = int(hits[peer][own].sum())
            if count:
                recvs[peer] = partial.new_empty(count, partial.shape[1])
        _comm.exchange(sends, recvs, group, what="experts combine (all-to-all)")
        mine = partial[own].clone()
        for peer in sorted(recvs):
            mine[hits[peer][own]] += recvs[peer]
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        padded = partial.new_zeros(longest, partial.shape[1])
        padded[:mine.shape[0]] = mine
        pieces = _comm.all_gather_tensor(padded, group, what="experts combine (all-gather)")
        return torch.cat([piece[:b - a] for piece, a, b in zip(pieces, bounds, bounds[1:])])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


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
    hits = _hits(top_k_index, intervals)
    row = hidden * element_size
    bounds = _bounds(tokens, world)
    owned = slice(bounds[rank], bounds[rank + 1])
    reduce = 2 * (world - 1) * tokens * row // world
    to_all = sum(int(hits[q][owned].sum()) for q in range(world) if q != rank) * row
    to_all += (tokens - (bounds[rank + 1] - bounds[rank])) * row
    gather = sum(int(hits[q].sum()) for q in range(world) if q != rank) * row
    return CombineBytes(reduce, to_all, gather)
