"""Sharded registrations for transformers' own module types that hold split parameters.

transformers builds models from ``nn.Linear`` and ``nn.Embedding`` (shardkit's built-in
registrations) and a few module types of its own, which a plan splits like them:

* scaled word embeddings (Gemma, Gemma 2 and 3, BART, ...): an ``nn.Embedding`` subclass whose
  forward multiplies the lookup by a scale (a number, or a buffer cast to the weight's dtype).
  Split on the vocabulary or on the embedding dimension, each computes as ``nn.Embedding``
  does, then scales the result exactly as the module does;
* ``Conv1D`` (GPT-2, GPT-BigCode's ancestors): a linear layer whose weight is stored
  ``(in_features, out_features)``, split on its outputs (dim 1 of the weight, packed for a
  fused q/k/v) or on its inputs (dim 0).

shardkit does not import transformers: the types are recognised in the model being sharded
(:func:`register_modules_of`, called by ``shard_model``), the scaled embeddings by tracing
their forward with ``torch.fx`` (a lookup times a scale, nothing else), ``Conv1D`` by its
forward's definition. A type that already has a registration (the user's own) keeps it.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from . import registry as _registry
from .engine import boundary as _boundary
from .engine.placements import Intervals
from .parallel import EmbeddingPlan, ShardedEmbedding

__all__ = ["Conv1DPlan", "ShardedConv1D", "ShardedScaledEmbedding", "register_modules_of", "scale_of"]


@dataclass(frozen=True)
class _Scale:
    """How a scaled embedding's forward scales its lookup: by ``value`` (a number) or by its buffer ``buffer``,
    cast to the weight's dtype when ``cast`` (Gemma's ``self.embed_scale.to(self.weight.dtype)``)."""

    value: float | None
    buffer: str | None
    cast: bool

    def of(self, module: nn.Module) -> torch.Tensor | float:
        if self.buffer is None:
            return cast(float, self.value)
        scale = cast(torch.Tensor, getattr(module, self.buffer))
        return scale.to(cast(torch.Tensor, module.weight).dtype) if self.cast else scale


_SCALES: dict[type, _Scale | None] = {}


def scale_of(module: nn.Module) -> _Scale | None:
    """How ``module`` (an ``nn.Embedding`` subclass) scales its lookup, or ``None`` if its forward does anything else.

    Decided once per class by tracing the forward with ``torch.fx``: the graph must be the
    embedding lookup of the input with the module's own options, multiplied by a number or by
    a buffer of the module (optionally ``.to(self.weight.dtype)``), and nothing else.
    """
    cls = type(module)
    if cls not in _SCALES:
        try:
            graph = torch.fx.Tracer().trace(module)
        except Exception:  # noqa: BLE001 - a forward fx cannot trace is simply not recognized
            _SCALES[cls] = None
        else:
            _SCALES[cls] = _scale_in(graph, module)
    return _SCALES[cls]


def _scale_in(graph: torch.fx.Graph, module: nn.Module) -> _Scale | None:
    nodes = [n for n in graph.nodes if n.op != "output"]
    output = next(n for n in graph.nodes if n.op == "output")
    inputs = [n for n in nodes if n.op == "placeholder"]
    lookups = [n for n in nodes if n.op == "call_function" and n.target is F.embedding]
    if len(inputs) != 1 or len(lookups) != 1:
        return None
    lookup, result = lookups[0], output.args[0]
    if not (isinstance(result, torch.fx.Node) and result.op == "call_function"
            and result.target in (operator.mul, torch.mul) and len(result.args) == 2 and not result.kwargs):
        return None
    weight = lookup.args[1] if len(lookup.args) > 1 else None
    if lookup.args[0] is not inputs[0] or not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr"
                                               and weight.target == "weight"):
        return None
    # The lookup's options are the module's own (those nn.Embedding.forward passes): the sharded one uses them.
    m = cast(nn.Embedding, module)
    options = list(lookup.args[2:]) + list(lookup.kwargs.values())
    if options != [m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse]:
        return None
    others = [a for a in result.args if a is not lookup]
    if len(others) != 1:
        return None
    scale = others[0]
    used = {lookup, result, inputs[0], weight}
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        found = _Scale(float(scale), None, False)
    elif isinstance(scale, torch.fx.Node) and scale.op == "get_attr" and "." not in str(scale.target) \
            and isinstance(getattr(module, str(scale.target), None), torch.Tensor):
        found, used = _Scale(None, str(scale.target), False), used | {scale}
    elif isinstance(scale, torch.fx.Node) and _is_cast_to_weight_dtype(scale):
        buffer = cast(torch.fx.Node, scale.args[0])
        found = _Scale(None, str(buffer.target), True)
        used = used | {scale, buffer, cast(torch.fx.Node, scale.args[1])}
        used |= {a for a in cast(torch.fx.Node, scale.args[1]).args if isinstance(a, torch.fx.Node)}
    else:
        return None
    return found if set(nodes) <= used else None


def _is_cast_to_weight_dtype(node: torch.fx.Node) -> bool:
    """``<buffer>.to(self.weight.dtype)``."""
    if node.op != "call_method" or node.target != "to" or len(node.args) != 2 or node.kwargs:
        return False
    buffer, dtype = node.args
    return (isinstance(buffer, torch.fx.Node) and buffer.op == "get_attr" and "." not in str(buffer.target)
            and isinstance(dtype, torch.fx.Node) and dtype.op == "call_function" and dtype.target is getattr
            and dtype.args[1] == "dtype" and isinstance(dtype.args[0], torch.fx.Node)
            and dtype.args[0].op == "get_attr" and dtype.args[0].target == "weight")


class ShardedScaledEmbedding(ShardedEmbedding):
    """A scaled word embedding split on the vocabulary or the embedding dimension: the lookup, then the scale.

    Split on the embedding dimension, each rank scales its columns before handing them out
    split (an op on the handed-out slice here would run outside the sharded computation and
    lose its split); split on the vocabulary, the summed lookup is whole and is scaled as it is.
    """

    def forward(self, call: _registry.ShardedCall, module: nn.Module, input: torch.Tensor) -> torch.Tensor:
        scale = scale_of(module)
        assert scale is not None  # registered only for the types it recognises
        plan: EmbeddingPlan = call.plan
        if plan.mode == "dim":
            m = cast(nn.Embedding, module)
            y = F.embedding(call.replicated(input), m.weight, m.padding_idx, None, m.norm_type, m.scale_grad_by_freq,
                            m.sparse)
            return call.split_output(y * scale.of(module), plan.intervals)
        return super().forward(call, module, input) * scale.of(module)


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: ``nf`` outputs, weight ``(nx, nf)``, forward ``addmm(bias, x, weight)``."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    return (cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")
            and isinstance(weight, nn.Parameter) and weight.dim() == 2
            and getattr(module, "nf", None) == weight.shape[1]
            and isinstance(getattr(module, "bias", None), nn.Parameter))


@dataclass(frozen=True)
class Conv1DPlan:
    """``mode`` ``"out"`` (weight split on dim 1: output features, maybe packed; the bias split alike) or
    ``"in"`` (weight split on dim 0: input features; the bias whole, added once after the sum)."""

    mode: str
    weight: Any  # the weight's ParamLayout: its output split is the activation's


class ShardedConv1D(_registry.ShardedModule):
    """transformers' ``Conv1D`` (GPT-2's projections) split on its outputs or its inputs, like ``nn.Linear``."""

    def plan(self, module: nn.Module, layouts: Mapping[str, Any], *, name: str) -> Conv1DPlan:
        weight, bias = layouts.get("weight"), layouts.get("bias")
        if weight is None or weight.kind != "split" or weight.dim not in (0, 1):
            shown = "whole" if weight is None or weight.kind == "replicated" else weight.describe()
            msg = (f"{name}: the weight (stored (in_features, out_features)) is {shown}; split it on dim 1 (output "
                   f"features, with the bias split alike) or on dim 0 (input features, with the bias whole).")
            raise ValueError(msg)
        if weight.dim == 1:
            if bias is None or (bias.pieces, bias.intervals) != (weight.pieces, weight.intervals):
                msg = (f"{name}: the weight is split on its output features ({weight.describe()}) but the bias is "
                       f"{'whole' if bias is None else bias.describe()}; split the bias the same way (dim 0, the same "
                       f"slices).")
                raise ValueError(msg)
            return Conv1DPlan("out", weight)
        if weight.pieces is not None:
            msg = f"{name}: the weight is split on its input features in several slices per rank; give each rank one."
            raise ValueError(msg)
        if bias is not None and bias.kind != "replicated":
            msg = (f"{name}: the weight is split on its input features, so the bias is added once, after the sum over "
                   f"ranks; keep it whole on every rank (it is split as {bias.describe()}).")
            raise ValueError(msg)
        return Conv1DPlan("in", weight)

    def activations(self, plan: Conv1DPlan) -> tuple[Intervals | None, Intervals | None]:
        return (None, plan.weight) if plan.mode == "out" else (plan.weight.intervals, None)

    def empty_dims(self, plan: Conv1DPlan) -> Mapping[str, int]:
        return {"weight": 1, "bias": 0} if plan.mode == "out" else {"weight": 0}

    def forward(self, call: _registry.ShardedCall, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        plan: Conv1DPlan = call.plan
        weight, bias = cast(torch.Tensor, module.weight), cast(torch.Tensor, module.bias)
        if plan.mode == "out":
            x = call.enter(x)
            y = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[1])
            return call.split_output(y, plan.weight)
        x = call.split_input(x, plan.weight.intervals)
        y = (x.reshape(-1, x.shape[-1]) @ weight).view(*x.shape[:-1], weight.shape[1])
        return call.pending_sum(y, bias)


def _subclasses(cls: type) -> list[type]:
    found = [cls]
    sub: type
    for sub in cls.__subclasses__():
        found += _subclasses(sub)
    return found


_RECOGNISED: list[tuple[Callable[[nn.Module], bool], Callable[[], _registry.ShardedModule]]] = [
    (lambda m: isinstance(m, nn.Embedding) and type(m) is not nn.Embedding and scale_of(m) is not None,
     ShardedScaledEmbedding),
    (_is_conv1d, ShardedConv1D),
]


def register_modules_of(model: nn.Module) -> None:
    """Register the computations of the transformers module types found in ``model`` that have none, and let
    transformers' key/value caches cross a compiled zone's boundary (``engine.boundary``)."""
    caches = sys.modules.get("transformers.cache_utils")
    if caches is not None and isinstance(getattr(caches, "Cache", None), type):
        _boundary.register(_subclasses(caches.Cache))
    for module in model.modules():
        handler, _ = _registry.handler_for(module)
        if handler is not None:
            continue
        for recognise, make in _RECOGNISED:
            if recognise(module):
                _registry.register_sharded_module(type(module), make())
                break

