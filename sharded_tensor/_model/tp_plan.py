"""``tensor_parallel_spec``: the usual tensor-parallel layout of a model, as a composite spec.

Pure planning: it reads the model's module tree (and, for a transformers model, the plan its
config ships) and returns a ``CompositeShardingSpec`` with ``*`` keys that the user can print,
edit and pass to ``shard_model``. Nothing is sharded and nothing communicates here.

Two sources, in order:

1. transformers' own plan (``config.base_model_tp_plan``, full names in ``model.tp_plan``):
   each of its styles becomes the shardkit spec of the same layout (see ``_STYLES``). transformers
   attaches forward hooks for each style; shardkit needs none, since the sharded model inserts
   its communication from the parameters' layouts, so only the parameter layout is taken.
2. for architectures whose config has no plan (GPT-2, OPT, Falcon, BLOOM, BERT and RoBERTa,
   DistilBERT, T5, ViT), the projections are recognised by the block structure (``_BLOCKS``):
   attention inputs and the first MLP projection split on output features, the attention
   output and the second MLP projection on input features.

Anything else is refused with a ``ValueError`` that shows the spec to write by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from sharding import (
    CompositeShardingSpec,
    DevicePlacement,
    PlacementSpec,
    RemoteDevice,
    SingleSplitShardingSpec,
)

__all__ = ["tensor_parallel_spec"]

Experts = Literal["tensor", "expert"]


@dataclass(frozen=True, slots=True)
class _Style:
    """How a transformers plan style lays out parameters.

    ``weight`` / ``bias``: ``"out"`` split on output features, ``"in"`` on input features,
    ``"rows"`` / ``"cols"`` on dim 0 / 1 whatever the module, ``"experts"`` on the experts
    (dim 0 of a 3-D parameter), ``"whole"`` replicated, ``None`` no layout of its own (the
    style only changes the forward, which shardkit derives from the layouts).
    """

    weight: str | None
    bias: str | None = None
    packed: bool = False


_COLWISE = _Style("out", "out")
_ROWWISE = _Style("in")  # the bias is added once, after the reduction: whole, the default
_REPLICATED = _Style("whole", "whole")
_HOOK_ONLY = _Style(None, None)

# transformers 5 style names -> parameter layouts (transformers/distributed/tensor_parallel.py).
_STYLES: dict[str, _Style] = {
    "colwise": _COLWISE, "colwise_rep": _COLWISE, "colwise_gather_output": _COLWISE,
    "rowwise": _ROWWISE, "rowwise_rep": _ROWWISE, "rowwise_split_input": _ROWWISE,
    "packed_colwise": _Style("out", "out", packed=True), "packed_rowwise": _Style("in", packed=True),
    "embedding_rowwise": _Style("rows"), "embedding_colwise": _Style("cols"),
    # Replicated parameters: q_norm/k_norm see only this rank's heads, so their gradient is a
    # partial sum; the sharded model's engine owns that reduction, the layout is just "whole".
    "replicated_with_grad_allreduce": _REPLICATED, "sequence_parallel": _REPLICATED, "replicate": _REPLICATED,
    # Forward-only styles: their parameters (if any) have entries of their own.
    "moe_tp_experts": _HOOK_ONLY, "moe_identity_expert": _HOOK_ONLY, "all_reduce": _HOOK_ONLY,
    "local_params": _HOOK_ONLY, "mla_kv_a_proj": _HOOK_ONLY, "ep_dispatch_experts": _HOOK_ONLY,
    # Expert parallel (config.base_model_ep_plan): the experts are divided among the ranks.
    "grouped_gemm": _Style("experts", "experts"),
}

# Architectures without a transformers plan, recognised by their blocks. Keys are name
# suffixes ('*' for one component) found under any prefix; '?' marks a projection only some
# variants have. A value is a style of _STYLES, or (style, n) for n tensors packed side by side.
_BLOCKS: dict[str, dict[str, str | tuple[str, int]]] = {
    "GPT-2": {"h.*.attn.c_attn": ("packed_colwise", 3), "h.*.attn.c_proj": "rowwise",
              "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
    "OPT": {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.out_proj": "rowwise",
            "layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"},
    # BLOOM and Falcon: query_key_value holds each head's q, k and v side by side (Falcon's new
    # architecture: each key/value group's queries, key and value), so an output split keeps heads.
    "BLOOM/Falcon": {"h.*.self_attention.query_key_value": "colwise", "h.*.self_attention.dense": "rowwise",
                     "h.*.mlp.dense_h_to_4h": "colwise", "h.*.mlp.dense_4h_to_h": "rowwise"},
    "BERT/RoBERTa": {"encoder.layer.*.attention.self.query": "colwise",
                     "encoder.layer.*.attention.self.key": "colwise",
                     "encoder.layer.*.attention.self.value": "colwise",
                     "encoder.layer.*.attention.output.dense": "rowwise",
                     "encoder.layer.*.intermediate.dense": "colwise", "encoder.layer.*.output.dense": "rowwise"},
    "DistilBERT": {"transformer.layer.*.attention.q_lin": "colwise", "transformer.layer.*.attention.k_lin": "colwise",
                   "transformer.layer.*.attention.v_lin": "colwise", "transformer.layer.*.attention.out_lin": "rowwise",
                   "transformer.layer.*.ffn.lin1": "colwise", "transformer.layer.*.ffn.lin2": "rowwise"},
    "T5": {"block.*.layer.*.SelfAttention.q": "colwise", "block.*.layer.*.SelfAttention.k": "colwise",
           "block.*.layer.*.SelfAttention.v": "colwise", "block.*.layer.*.SelfAttention.o": "rowwise",
           "block.*.layer.*.EncDecAttention.q?": "colwise", "block.*.layer.*.EncDecAttention.k?": "colwise",
           "block.*.layer.*.EncDecAttention.v?": "colwise", "block.*.layer.*.EncDecAttention.o?": "rowwise",
           "block.*.layer.*.DenseReluDense.wi?": "colwise", "block.*.layer.*.DenseReluDense.wi_0?": "colwise",
           "block.*.layer.*.DenseReluDense.wi_1?": "colwise", "block.*.layer.*.DenseReluDense.wo": "rowwise"},
    "ViT": {"layers.*.attention.q_proj": "colwise", "layers.*.attention.k_proj": "colwise",
            "layers.*.attention.v_proj": "colwise", "layers.*.attention.o_proj": "rowwise",
            "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"},
}


def tensor_parallel_spec(model: nn.Module, ranks: Sequence[str | RemoteDevice | DevicePlacement | int], *,
                         experts: Experts = "tensor") -> CompositeShardingSpec:
    """The usual tensor-parallel layout of ``model`` over ``ranks``, as an editable composite spec.

    From transformers' plan when the model's config has one (``base_model_tp_plan``: Llama,
    Mistral, Qwen2/3, Gemma, Phi-3, OLMo2, Cohere, GPT-NeoX, GPT-J, Mixtral, Qwen2-MoE, ...),
    each style mapped to the spec of the same parameter layout: ``colwise`` (and
    ``colwise_rep``) split weight and bias on output features, ``rowwise`` (and ``rowwise_rep``)
    the weight on input features with the bias whole, ``packed_colwise`` splits each of the
    two packed halves (each rank named twice), ``embedding_rowwise`` splits the vocabulary,
    ``replicated_with_grad_allreduce`` (Qwen3's ``q_norm``/``k_norm``) keeps the parameter
    whole on every rank (the reduction of its gradient is the sharded model's job). As in
    transformers' own plan, the input embedding (``embed_tokens``) is split on the vocabulary
    unless the plan names it, and a head's entries are added (``lm_head`` split on the
    vocabulary: a loss computed in the forward takes the split logits, the logits returned
    are gathered, or stay split inside ``st.loss_parallel()``). Styles that only change the
    forward (``moe_tp_experts``, ``all_reduce``, ...) add nothing: shardkit derives the
    communication from the layouts. Models without a plan (GPT-2, OPT, Falcon, BLOOM, BERT,
    RoBERTa, DistilBERT, T5, ViT) get the same layout from their block structure. Norms (and
    the embeddings and head of a model without a plan) stay whole on every rank. Keys use
    ``*`` for the layer number, so the spec stays short.

    Pure: reads the module tree (a model on the meta device is fine), communicates nothing.

    Args:
        model: the model, e.g. ``LlamaForCausalLM(config)`` built under ``torch.device("meta")``.
        ranks: the placements to split over, e.g. ``["rank:0/cpu", "rank:1/cpu"]``; ints mean
            ``"rank:<r>/cpu"``.
        experts: mixture-of-experts layers: ``"tensor"`` splits each expert's matrices (the
            plan's ``base_model_tp_plan``); ``"expert"`` divides the experts among the ranks
            (``base_model_ep_plan``), the rest of the model as with ``"tensor"``.

    Returns:
        A ``CompositeShardingSpec`` for ``shard_model(model, spec, ...)``.

    Raises:
        ValueError: the model has no plan and no known block structure (the message shows the
            spec to write by hand), the plan uses a style shardkit does not know, or a planned
            module is not a linear layer or embedding.

    Example:
        >>> with torch.device("meta"):  # doctest: +SKIP
        ...     model = LlamaForCausalLM(config)
        >>> spec = st.tensor_parallel_spec(model, ["rank:0/cpu", "rank:1/cpu"])  # doctest: +SKIP
        >>> st.shard_model(model, spec, init=False)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        msg = f"tensor_parallel_spec expects an nn.Module, got {type(model).__name__}."
        raise TypeError(msg)
    if experts not in ("tensor", "expert"):
        msg = (f"experts={experts!r} is not one of 'tensor' (split each expert's matrices) or 'expert' "
               f"(expert parallel).")
        raise ValueError(msg)
    placements = _placements(ranks)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    planned = _transformers_plan(model, experts)
    if planned is None:
        plan = _inferred_plan(model, modules)
        from_config = set(plan)
    else:
        plan, from_config = planned
    parts: dict[str, PlacementSpec] = {}
    for key, value in plan.items():
        style_name, factor = (value, 2) if isinstance(value, str) else value
        style = _STYLES.get(style_name)
        if style is None:
            msg = (f"the tensor-parallel plan of {type(model).__name__} gives {key!r} the style {style_name!r}, which "
                   f"shardkit does not map; known styles: {sorted(_STYLES)}. Write that entry by hand.")
            raise ValueError(msg)
        parts.update(_entries(key, style, factor if style.packed else 1, placements, modules, params))
    unmatched = [key for key in plan if key in from_config and not _matches_any(key, modules, params)]
    if unmatched and len(unmatched) == len(from_config):  # a plan for another model, not a variant of this one
        msg = (f"the tensor-parallel plan names {unmatched[0]!r}, which matches no module or parameter of the "
               f"model, and none of its other entries match either: it is not a plan for "
               f"{type(model).__name__}.")
        raise ValueError(msg)
    return CompositeShardingSpec(parts)


def _matches_any(key: str, modules: Mapping[str, nn.Module], params: Mapping[str, nn.Parameter]) -> bool:
    pattern = key.split(".")
    return any(_exact(pattern, n) for n in (*modules, *params))


def _placements(ranks: Sequence[str | RemoteDevice | DevicePlacement | int]) -> list[DevicePlacement]:
    if isinstance(ranks, (str, int)) or not isinstance(ranks, Sequence) or not ranks:
        msg = f"ranks must be a non-empty list of placements such as ['rank:0/cpu', 'rank:1/cpu'], got {ranks!r}."
        raise ValueError(msg)
    out = []
    for r in ranks:
        if isinstance(r, int) and not isinstance(r, bool):
            r = f"rank:{r}/cpu"
        placement = DevicePlacement(r)  # type: ignore[arg-type]
        if placement.device.rank is None:
            msg = f"ranks entry {str(placement.device)!r} has no rank; name it as 'rank:<r>/{placement.device.device}'."
            raise ValueError(msg)
        out.append(placement)
    return out


def _transformers_plan(model: nn.Module, experts: Experts) -> tuple[dict[str, str | tuple[str, int]], set[str]] | None:
    """The model's transformers plan with full parameter/module names and the keys that came from
    the config's plans (not the embedding and head added to them), or ``None`` if it has none.

    Put together as transformers puts its full plan together (``init_parallel_plans``), but from
    the config as it is now: the config's ``base_model_tp_plan`` under the base model's prefix,
    the base model's ``embed_tokens`` split on the vocabulary unless the plan names it, and the
    model class's own entries (a head's: ``lm_head`` split on the vocabulary).
    """
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base:
        return None
    # The base model's plan names are relative to the base model: prefix them as the model nests it.
    prefix = ""
    base_model = model
    base_name = getattr(model, "base_model_prefix", "")
    if base_name and isinstance(getattr(model, base_name, None), nn.Module):
        prefix = base_name + "."
        base_model = getattr(model, base_name)
    plan: dict[str, str | tuple[str, int]] = {}
    if isinstance(getattr(base_model, "embed_tokens", None), nn.Embedding) and "embed_tokens" not in base:
        plan[prefix + "embed_tokens"] = "embedding_rowwise"
    plan.update({prefix + k: v for k, v in base.items()})
    from_config = {prefix + k for k in base}
    if base_model is not model:
        plan.update(dict(getattr(type(model), "_tp_plan", None) or {}))
    if experts == "expert":
        ep = dict(getattr(config, "base_model_ep_plan", None) or {})
        if not ep:
            msg = (f"experts='expert' needs an expert-parallel plan, but {type(config).__name__} has no "
                   f"base_model_ep_plan (the model has no mixture-of-experts layers transformers can divide); "
                   f"use experts='tensor'.")
            raise ValueError(msg)
        plan.update({prefix + k: v for k, v in ep.items()})
        from_config.update(prefix + k for k in ep)
    return plan, from_config


def _suffix_matches(pattern: list[str], name: str) -> str | None:
    """The prefix (with its trailing dot) under which ``name`` ends with ``pattern``, else ``None``."""
    parts = name.split(".")
    if len(parts) < len(pattern):
        return None
    tail = parts[len(parts) - len(pattern):]
    if all(p == "*" or p == q for p, q in zip(pattern, tail)):
        head = parts[:len(parts) - len(pattern)]
        return ".".join(head) + "." if head else ""
    return None


def _inferred_plan(model: nn.Module, modules: Mapping[str, nn.Module]) -> dict[str, str | tuple[str, int]]:
    """The plan of every known block structure found in ``model``, full names with '*'."""
    plan: dict[str, str | tuple[str, int]] = {}
    for arch, block in _BLOCKS.items():
        keys: dict[str, str | tuple[str, int]] = {}
        complete = True
        for pattern, style in block.items():
            optional = pattern.endswith("?")
            parts = pattern.rstrip("?").split(".")
            prefixes = list(dict.fromkeys(p for n in modules if (p := _suffix_matches(parts, n)) is not None))
            if not prefixes and not optional:
                complete = False
                break
            for prefix in prefixes:
                keys[prefix + ".".join(parts)] = style
        if complete and keys:
            _check_falcon(model, arch)
            plan.update(keys)
    if not plan:
        raise ValueError(_hand_written_hint(model, modules))
    return plan


def _check_falcon(model: nn.Module, arch: str) -> None:
    config = getattr(model, "config", None)
    if arch != "BLOOM/Falcon" or getattr(config, "model_type", None) != "falcon":
        return
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        msg = ("this Falcon model uses multi-query attention (config.multi_query=True): all heads share one key and "
               "one value head packed at the end of query_key_value, which an output split cannot divide by heads. "
               "Split only the MLP by hand: {'transformer.h.*.mlp.dense_h_to_4h': single_split(0, ranks), "
               "'transformer.h.*.mlp.dense_4h_to_h': single_split(1, ranks)}.")
        raise ValueError(msg)


def _hand_written_hint(model: nn.Module, modules: Mapping[str, nn.Module]) -> str:
    linears = [n for n, m in modules.items() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
    # Layer numbers folded to '*' (a module's own index, as in nn.Sequential, kept).
    folded = list(dict.fromkeys(".".join([*("*" if p.isdigit() else p for p in n.split(".")[:-1]), n.split(".")[-1]])
                                for n in linears))
    shown = folded[:12]
    more = f" and {len(folded) - len(shown)} more" if len(folded) > len(shown) else ""
    return (f"tensor_parallel_spec does not know the layout of {type(model).__name__}: it has no transformers "
            f"plan (config.base_model_tp_plan) and its blocks match none of {sorted(_BLOCKS)}. Write the spec by "
            f"hand: split the attention's q/k/v and the first MLP projection on output features "
            f"(single_split(0, ranks)) and the attention output and second MLP projection on input features "
            f"({{'<name>.weight': single_split(1, ranks)}}), with '*' for the layer number. Its linear layers: "
            f"{shown}{more}.")


def _entries(key: str, style: _Style, packed: int, placements: list[DevicePlacement],
             modules: Mapping[str, nn.Module], params: Mapping[str, nn.Parameter]) -> dict[str, PlacementSpec]:
    """The spec entries of one plan entry: the module's key when one spec covers all its parameters."""
    pattern = key.split(".")
    matched_params = [n for n in params if _exact(pattern, n)]
    if matched_params:  # the plan names a parameter (e.g. a 3-D experts tensor)
        spec = _param_spec(style.weight if not key.endswith("bias") else style.bias, params[matched_params[0]],
                           None, packed, placements, key)
        return {} if spec is None else {key: spec}
    matched = [(n, m) for n, m in modules.items() if _exact(pattern, n)]
    if not matched:
        # A model's plan covers every variant of its architecture (Qwen2-MoE's plan names the
        # dense MLP that only layers listed in mlp_only_layers have): what this model lacks is
        # skipped, as from_pretrained(tp_plan="auto") skips it (a plan matching nothing at all
        # is refused by the caller).
        return {}
    name, module = matched[0]
    own = dict(module.named_parameters(recurse=False))
    specs: dict[str, PlacementSpec | None] = {}
    for attr, param in own.items():
        layout = style.weight if attr == "weight" else style.bias
        specs[attr] = _param_spec(layout, param, module, packed, placements, f"{name}.{attr}")
    for other_name, other in matched[1:]:
        if set(dict(other.named_parameters(recurse=False))) != set(own):
            msg = (f"the plan entry {key!r} covers modules with different parameters ({name!r} has {sorted(own)}, "
                   f"{other_name!r} has {sorted(dict(other.named_parameters(recurse=False)))}); write it by hand.")
            raise ValueError(msg)
    given = {attr: spec for attr, spec in specs.items() if spec is not None}
    if given and len(given) == len(specs) and len(set(given.values())) == 1:
        return {key: next(iter(given.values()))}
    return {f"{key}.{attr}": spec for attr, spec in given.items()}


def _exact(pattern: list[str], name: str) -> bool:
    parts = name.split(".")
    return len(parts) == len(pattern) and all(p == "*" or p == q for p, q in zip(pattern, parts))


def _param_spec(layout: str | None, param: nn.Parameter, module: nn.Module | None, packed: int,
                placements: list[DevicePlacement], where: str) -> PlacementSpec | None:
    """The spec of one parameter for a layout of ``_Style``; ``None`` leaves it to its default (whole)."""
    if layout is None:
        return None
    if layout == "whole":
        devices = {str(p.device.device) for p in placements}
        return DevicePlacement(devices.pop()) if len(devices) == 1 else None
    ndim = param.dim()
    # transformers' Conv1D (GPT-2) stores its weight as (in_features, out_features).
    transposed = module is not None and type(module).__name__ == "Conv1D"
    if layout == "out":
        dim = 0 if ndim == 1 else (ndim - 1 if transposed else ndim - 2)
    elif layout == "in":
        if ndim < 2:
            msg = f"the plan splits {where!r} (size {tuple(param.shape)}) on input features, but it has one dimension."
            raise ValueError(msg)
        dim = ndim - 2 if transposed else ndim - 1
    elif layout == "experts":
        dim = 0
    else:
        dim = 0 if layout == "rows" else 1
    if dim >= ndim:
        msg = f"the plan splits {where!r} (size {tuple(param.shape)}) on dim {dim}, which it does not have."
        raise ValueError(msg)
    return SingleSplitShardingSpec(placements * packed, dim)
