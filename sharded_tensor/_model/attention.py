"""Head-parallel ``nn.MultiheadAttention``: a registration of the sharded-module extension point.

``nn.MultiheadAttention`` keeps q, k and v in one fused ``in_proj_weight`` of shape
``(3 * embed_dim, embed_dim)`` and calls a fused kernel that reads ``out_proj.weight``
directly, so neither a plain split nor the Linear registration can compute it. Head
parallelism needs each rank to hold *its heads* of q, k and v: three slices of dim 0, one in
each third. That is a packed layout, which a spec states by naming each rank three times::

    ranks = ["rank:0/cpu", "rank:1/cpu"]
    composite(**{"in_proj_weight": single_split(0, ranks * 3),   # q0 q1 k0 k1 v0 v1
                 "in_proj_bias": single_split(0, ranks * 3),     # or keep it whole
                 "out_proj.weight": single_split(1, ranks)})     # the same heads' columns

Each rank then projects its heads, runs ``scaled_dot_product_attention`` on them, applies its
columns of ``out_proj`` and all-reduces once. The attention weights, when asked for
(``need_weights=True``, the module's default), are computed from the local heads and gathered
(one all-gather); ``nn.TransformerEncoderLayer`` and friends ask for none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import registry as _registry
from .engine.placements import Intervals

__all__ = ["ShardedMultiheadAttention", "MHAPlan"]


@dataclass(frozen=True)
class MHAPlan:
    """Per rank, ``(start, length)`` of its heads along the embedding dimension; how the biases are held."""

    heads: Intervals
    in_bias: str  # "none", "replicated" or "split"


def _slices(layout: Any, rank: int) -> list[tuple[int, int]]:
    if layout.pieces is not None:
        found = list(layout.pieces[rank])
    else:
        found = [layout.intervals[rank]] if layout.intervals[rank][1] else []
    merged: list[tuple[int, int]] = []
    for start, length in found:  # adjacent slices read as one (e.g. a rank's k and v heads back to back)
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    return merged


def _thirds(layout: Any, rank: int, embed: int) -> tuple[int, int] | None:
    """``(start, length)`` of rank's heads if it holds the same rows of q, k and v, else ``None``."""
    pieces: list[tuple[int, int]] = []
    for start, length in _slices(layout, rank):
        while length:  # cut at the q/k and k/v boundaries
            end = min(start + length, (start // embed + 1) * embed)
            pieces.append((start, end - start))
            length -= end - start
            start = end
    if len(pieces) != 3:
        return None
    (a, n), (b, m), (c, k) = pieces
    if (b, m) != (a + embed, n) or (c, k) != (a + 2 * embed, n) or a >= embed:
        return None
    return a, n


class ShardedMultiheadAttention(_registry.ShardedModule):
    """``nn.MultiheadAttention`` with its heads split over ranks (see the module docstring)."""

    subtree = True

    def plan(self, module: nn.Module, layouts: Mapping[str, Any], *, name: str) -> MHAPlan | None:
        mha: nn.MultiheadAttention = module  # type: ignore[assignment]
        if all(layout.kind == "replicated" for layout in layouts.values()):
            return None
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            msg = (f"{name}: head parallelism covers attention whose q, k and v share embed_dim, without "
                   f"add_bias_kv or add_zero_attn; keep this module's parameters whole on every rank.")
            raise ValueError(msg)
        embed, head = mha.embed_dim, mha.head_dim
        world = len(next(iter(layouts.values())).boxes)
        hint = ("split its heads: in_proj_weight with single_split(0, ranks * 3) (each rank named three times, "
                "for its rows of q, k and v), out_proj.weight with single_split(1, ranks), the biases whole "
                "(in_proj_bias may be split like in_proj_weight)")
        w = layouts.get("in_proj_weight")
        out = layouts.get("out_proj.weight")
        if w is None or w.kind != "split" or w.dim != 0 or out is None or out.kind != "split" or out.dim != 1 \
                or out.pieces is not None:
            msg = f"{name}: {self._describe(layouts)}; {hint}."
            raise ValueError(msg)
        heads = []
        for rank in range(world):
            mine = _thirds(w, rank, embed)
            if mine is None or mine[1] == 0:
                msg = (f"{name}: rank {rank} holds rows {_slices(w, rank)} of in_proj_weight, not the same "
                       f"non-empty rows of q, k and v; {hint}.")
                raise ValueError(msg)
            if mine[0] % head or mine[1] % head:
                msg = (f"{name}: rank {rank} holds embedding rows {mine} of q, k and v, which cut a head (head "
                       f"size {head}); split on multiples of {head}, e.g. an even split when num_heads="
                       f"{mha.num_heads} is divisible by the number of ranks.")
                raise ValueError(msg)
            if out.intervals[rank] != mine:
                msg = (f"{name}: out_proj.weight columns {out.intervals[rank]} on rank {rank} do not match its "
                       f"heads {mine} ((start, length)); {hint}.")
                raise ValueError(msg)
            heads.append(mine)
        bias = layouts.get("in_proj_bias")
        if mha.in_proj_bias is None:
            in_bias = "none"
        elif bias is None or bias.kind == "replicated":
            in_bias = "replicated"
        elif all(_thirds(bias, r, embed) == heads[r] for r in range(world)):
            in_bias = "split"
        else:
            msg = f"{name}: in_proj_bias is split unlike in_proj_weight; split it the same way or keep it whole."
            raise ValueError(msg)
        out_bias = layouts.get("out_proj.bias")
        if out_bias is not None and out_bias.kind != "replicated":
            msg = f"{name}: out_proj.bias must stay whole on every rank (it is added once, after the reduction)."
            raise ValueError(msg)
        return MHAPlan(tuple(heads), in_bias)

    @staticmethod
    def _describe(layouts: Mapping[str, Any]) -> str:
        parts = []
        for key, layout in layouts.items():
            if layout.kind == "replicated":
                parts.append(f"{key} whole")
            else:
                parts.append(f"{key} {layout.kind} along dim {layout.dim}")
        return ", ".join(parts)

    def forward(self, call: _registry.ShardedCall, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        mha: nn.MultiheadAttention = module  # type: ignore[assignment]
        plan: MHAPlan = call.plan
        start, length = plan.heads[call.rank]
        embed, head = mha.embed_dim, mha.head_dim
        local_heads = length // head
        unbatched = query.dim() == 2
        q_in, k_in, v_in = (call.enter(t) for t in (query, key, value))
        if unbatched:
            q_in, k_in, v_in = (t.unsqueeze(1 if not mha.batch_first else 0) for t in (q_in, k_in, v_in))
        if not mha.batch_first:
            q_in, k_in, v_in = (t.transpose(0, 1) for t in (q_in, k_in, v_in))
        weight = mha.in_proj_weight
        if plan.in_bias == "split":
            biases: list[torch.Tensor | None] = list(mha.in_proj_bias.split(length))
        elif plan.in_bias == "replicated":
            full = call.enter(mha.in_proj_bias)
            biases = [full.narrow(0, i * embed + start, length) for i in range(3)]
        else:
            biases = [None, None, None]
        w_q, w_k, w_v = weight.split(length)
        batch, q_len, k_len = q_in.shape[0], q_in.shape[1], k_in.shape[1]
        q = F.linear(q_in, w_q, biases[0]).view(batch, q_len, local_heads, head).transpose(1, 2)
        k = F.linear(k_in, w_k, biases[1]).view(batch, k_len, local_heads, head).transpose(1, 2)
        v = F.linear(v_in, w_v, biases[2]).view(batch, k_len, local_heads, head).transpose(1, 2)
        mask = _additive_mask(attn_mask, key_padding_mask, batch, mha.num_heads, start // head, local_heads,
                              q_len, k_len, q.dtype)
        causal = is_causal and mask is None
        dropout = mha.dropout if mha.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
        out = out.transpose(1, 2).reshape(batch, q_len, length)
        y = call.reduce(F.linear(out, mha.out_proj.weight))
        if mha.out_proj.bias is not None:
            y = y + mha.out_proj.bias
        if not mha.batch_first:
            y = y.transpose(0, 1)
        if unbatched:
            y = y.squeeze(1 if not mha.batch_first else 0)
        if not need_weights:
            return y, None
        scores = q @ k.transpose(-1, -2) / math.sqrt(head)
        if causal:
            scores = scores + torch.full((q_len, k_len), float("-inf"), dtype=scores.dtype).triu(1)
        if mask is not None:
            scores = scores + mask
        weights = call.gather(scores.softmax(-1), 1, tuple((s // head, n // head) for s, n in plan.heads))
        if average_attn_weights:
            weights = weights.mean(1)
        return y, weights.squeeze(0) if unbatched else weights


def _additive_mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, batch: int,
                   heads: int, first: int, count: int, q_len: int, k_len: int,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """MultiheadAttention's masks as one float mask for this rank's heads (``True`` means masked out)."""
    mask = None
    if attn_mask is not None:
        m = _as_float(attn_mask, dtype)
        if m.dim() == 3:  # (batch * heads, q, k): keep this rank's heads
            m = m.view(batch, heads, q_len, k_len)[:, first:first + count]
        mask = m
    if key_padding_mask is not None:
        kp = _as_float(key_padding_mask, dtype).view(batch, 1, 1, k_len)
        mask = kp if mask is None else mask + kp
    return mask


def _as_float(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


_registry.register_sharded_module(nn.MultiheadAttention, ShardedMultiheadAttention())
