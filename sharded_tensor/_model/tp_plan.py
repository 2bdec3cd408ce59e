"""``tensor_parallel_spec``: the usual tensor-parallel layout of a model, as a composite spec.

Pure planning: it reads the model's module tree (and, for a transformers model, the plan its
config ships) and returns a composite spec with ``*`` keys that the user can print, edit and
pass to ``shard_model``. Nothing is sharded and nothing communicates here.

Two sources, in order:

1. transformers' own plan (``config.base_model_tp_plan``, full names in ``model.tp_plan``):
   each of its styles becomes the shardkit spec of the same parameter layout (see ``_STYLES``).
   transformers attaches forward hooks for each style; shardkit needs none, since the sharded
   model inserts its communication from the parameters' layouts, so only the layout is taken.
   A style that gathers a layer's output (``colwise_gather_output``, ``colwise_rep``) does so
   because the model's code slices that output; a fused projection whose slices are known
   (``qkv_proj``: q, k and v by heads; ``gate_up_proj``: gate and up) is split so that each rank
   holds its share of every slice (a packed split), which the model's slicing then keeps split;
   a gated delta net's projections (Qwen3-Next's linear attention) are split by key heads.
2. for architectures whose config has no plan (GPT-2, OPT, Falcon, BLOOM, BERT and RoBERTa,
   DistilBERT, T5, ViT, ...), the projections are recognised by the block structure
   (``_BLOCKS``): attention inputs and the first MLP projection split on output features, the
   attention output and the second MLP projection on input features.

Where the plan leaves a block whole that has a known structure (attention whose q/k/v/o or
multi-head latent projections are not in the plan, a gated MLP, GPT-OSS's experts), the block
is split the usual way too, when its heads divide over the ranks (``_complete``). Everything
inferred beyond the source, and everything kept whole for a reason, is listed on the returned
``TensorParallelSpec`` (``inferred``, ``kept_whole``) and shown in its ``repr``.

Anything else is refused with a ``ValueError`` that shows the spec to write by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from sharding import (
    CompositeShardingSpec,
    DevicePlacement,
    EnumerableShardingSpec,
    PlacementSpec,
    RemoteDevice,
    ShardMetadata,
    SingleSplitShardingSpec,
)

from . import experts as _experts

__all__ = ["TensorParallelSpec", "tensor_parallel_spec"]

Experts = Literal["tensor", "expert"]


@dataclass(frozen=True, slots=True, init=False, eq=False, repr=False)
class TensorParallelSpec(CompositeShardingSpec):
    """The composite spec ``tensor_parallel_spec`` returns, with what it was planned from.

    It is an ordinary ``CompositeShardingSpec`` (equal to one with the same entries, edited the
    same way); the attributes only explain it:

    Attributes:
        source: where the layout comes from: ``"transformers' plan"`` (the config's
            ``base_model_tp_plan``) or ``"block structure (<names>)"`` for a model without one.
        inferred: what was planned beyond the source, one line each (a block the plan leaves
            whole split the usual way, a fused projection read as packed, ...).
        kept_whole: blocks left whole on every rank that a plan could otherwise split, and why.
    """

    source: str
    inferred: tuple[str, ...]
    kept_whole: tuple[str, ...]

    def __init__(self, param_placement: Mapping[str, PlacementSpec | str | RemoteDevice], *, source: str = "",
                 inferred: Iterable[str] = (), kept_whole: Iterable[str] = ()) -> None:
        CompositeShardingSpec.__init__(self, param_placement)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "inferred", tuple(inferred))
        object.__setattr__(self, "kept_whole", tuple(kept_whole))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompositeShardingSpec):
            return NotImplemented
        return dict(self.param_placement) == dict(other.param_placement)

    def __hash__(self) -> int:
        return hash((self.param_placement,))

    def __repr__(self) -> str:
        extra = f", source={self.source!r}"
        if self.inferred:
            extra += f", inferred={self.inferred!r}"
        if self.kept_whole:
            extra += f", kept_whole={self.kept_whole!r}"
        return f"TensorParallelSpec(param_placement={dict(self.param_placement)!r}{extra})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (dict(self.param_placement), self.source, self.inferred, self.kept_whole))


def _rebuild(placement: dict[str, PlacementSpec], source: str, inferred: tuple[str, ...],
             kept_whole: tuple[str, ...]) -> TensorParallelSpec:
    return TensorParallelSpec(placement, source=source, inferred=inferred, kept_whole=kept_whole)


@dataclass(frozen=True, slots=True)
class _Style:
    """How a transformers plan style lays out parameters.

    ``weight`` / ``bias``: ``"out"`` split on output features, ``"in"`` on input features,
    ``"rows"`` / ``"cols"`` on dim 0 / 1 whatever the module, ``"experts"`` on the experts
    (dim 0 of a 3-D parameter), ``"whole"`` replicated, ``None`` no layout of its own (the
    style only changes the forward, which shardkit derives from the layouts). ``gathered``:
    transformers gathers the output, because the model's code slices it (see ``_fused``).
    """

    weight: str | None
    bias: str | None = None
    packed: bool = False
    gathered: bool = False


_COLWISE = _Style("out", "out")
_ROWWISE = _Style("in")  # the bias is added once, after the reduction: whole, the default
_REPLICATED = _Style("whole", "whole")
_HOOK_ONLY = _Style(None, None)

# transformers style names -> parameter layouts (transformers/distributed/tensor_parallel.py; the
# ``local_*``, ``gather``, ``isolated`` and ``ep_router`` names are those of transformers 4).
_STYLES: dict[str, _Style] = {
    "colwise": _COLWISE, "local_colwise": _COLWISE,
    "colwise_rep": _Style("out", "out", gathered=True), "colwise_gather_output": _Style("out", "out", gathered=True),
    "rowwise": _ROWWISE, "rowwise_rep": _ROWWISE, "rowwise_split_input": _ROWWISE, "local_rowwise": _ROWWISE,
    "packed_colwise": _Style("out", "out", packed=True), "local_packed_colwise": _Style("out", "out", packed=True),
    "packed_rowwise": _Style("in", packed=True), "local_packed_rowwise": _Style("in", packed=True),
    "embedding_rowwise": _Style("rows"), "embedding_colwise": _Style("cols"),
    # Replicated parameters: q_norm/k_norm see only this rank's heads, so their gradient is a
    # partial sum; the sharded model's engine owns that reduction, the layout is just "whole".
    # Sequence parallel splits the activations around norms, not their parameters.
    "replicated_with_grad_allreduce": _REPLICATED, "sequence_parallel": _REPLICATED, "replicate": _REPLICATED,
    # Forward-only styles: their parameters (if any) have entries of their own.
    "moe_tp_experts": _HOOK_ONLY, "moe_identity_expert": _HOOK_ONLY, "all_reduce": _HOOK_ONLY,
    "local_params": _HOOK_ONLY, "mla_kv_a_proj": _HOOK_ONLY, "ep_dispatch_experts": _HOOK_ONLY,
    "local": _HOOK_ONLY, "gather": _HOOK_ONLY, "isolated": _HOOK_ONLY, "ep_router": _HOOK_ONLY,
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
    # Persimmon's query_key_value is laid out by heads too (viewed as [heads, 3, head_dim]).
    "Persimmon": {"layers.*.self_attn.query_key_value": "colwise", "layers.*.self_attn.dense": "rowwise",
                  "layers.*.mlp.dense_h_to_4h": "colwise", "layers.*.mlp.dense_4h_to_h": "rowwise"},
    "Llama-like": {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                   "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                   "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                   "layers.*.mlp.down_proj": "rowwise"},
    "CLIP": {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
             "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.out_proj": "rowwise",
             "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"},
    # MPT's Wqkv holds q, k and v one after the other (chunked in three).
    "MPT": {"blocks.*.attn.Wqkv": ("packed_colwise", 3), "blocks.*.attn.out_proj": "rowwise",
            "blocks.*.ffn.up_proj": "colwise", "blocks.*.ffn.down_proj": "rowwise"},
    "BERT/RoBERTa": {"encoder.layer.*.attention.self.query": "colwise",
                     "encoder.layer.*.attention.self.key": "colwise",
                     "encoder.layer.*.attention.self.value": "colwise",
                     "encoder.layer.*.attention.output.dense": "rowwise",
                     "encoder.layer.*.intermediate.dense": "colwise", "encoder.layer.*.output.dense": "rowwise"},
    "DeBERTa-v2": {"encoder.layer.*.attention.self.query_proj": "colwise",
                   "encoder.layer.*.attention.self.key_proj": "colwise",
                   "encoder.layer.*.attention.self.value_proj": "colwise",
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

# Blocks a plan may leave whole, recognised by their children (``_complete``): attention as
# (queries, keys, values, output) names, multi-head latent attention (DeepSeek) as (queries,
# key/value up-projection, output), and MLPs as (column-parallel, row-parallel) names; a fused
# gate-and-up projection (its output chunked in two) is split in both halves.
_ATTENTION = (("q_proj",), ("k_proj",), ("v_proj",), ("o_proj", "out_proj", "dense"))
_LATENT_ATTENTION = (("q_b_proj", "q_proj"), ("kv_b_proj",), ("o_proj",))
_MLPS = ((("gate_proj", "up_proj"), "down_proj"), (("gate_up_proj",), "down_proj"),
         (("input_linear",), "output_linear"))
_FUSED_HALVES = {"gate_up_proj", "input_linear"}


@dataclass
class _Context:
    """What planning reads: the model's modules and parameters, its heads, the ranks, and the notes taken."""

    model: nn.Module
    placements: list[DevicePlacement]
    modules: dict[str, nn.Module]
    params: dict[str, nn.Parameter]
    inferred: list[str] = field(default_factory=list)
    kept_whole: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return len(self.placements)

    def heads(self) -> tuple[int, int, int] | None:
        """(query heads, key/value heads, head size) from the model's config, or ``None`` if it does not say."""
        config = getattr(self.model, "config", None)
        if config is None:
            return None
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        heads = next((getattr(config, k) for k in ("num_attention_heads", "n_head", "num_heads")
                      if isinstance(getattr(config, k, None), int)), None)
        if heads is None:
            return None
        kv = getattr(config, "num_key_value_heads", None)
        if getattr(config, "multi_query", False):
            kv = 1
        kv = kv if isinstance(kv, int) else heads
        hidden = next((getattr(config, k) for k in ("hidden_size", "n_embd", "d_model")
                       if isinstance(getattr(config, k, None), int)), None)
        head_dim = getattr(config, "head_dim", None)
        if not isinstance(head_dim, int):
            head_dim = hidden // heads if hidden else 0
        return heads, kv, head_dim

    def heads_divide(self) -> str | None:
        """``None`` if query and key/value heads divide evenly over the ranks, else why not."""
        found = self.heads()
        if found is None:
            return "the config does not give the number of heads"
        heads, kv, _ = found
        if heads % self.world or (kv % self.world and not (kv < self.world and self.world % kv == 0)):
            return (f"{heads} query heads and {kv} key/value heads do not divide evenly over {self.world} ranks "
                    f"(each rank needs whole query heads, and whole key/value heads or a share of one: the ranks "
                    f"must divide evenly among fewer key/value heads)")
        return None


def tensor_parallel_spec(model: nn.Module, ranks: Sequence[str | RemoteDevice | DevicePlacement | int], *,
                         experts: Experts = "tensor") -> TensorParallelSpec:
    """The usual tensor-parallel layout of ``model`` over ``ranks``, as an editable composite spec.

    From transformers' plan when the model's config has one (``base_model_tp_plan``: Llama,
    Mistral, Qwen2/3, Gemma, Phi-3, OLMo2, Cohere, GPT-NeoX, GPT-J, Mixtral, Qwen2-MoE, ...),
    each style mapped to the spec of the same parameter layout: ``colwise`` (and
    ``local_colwise``) split weight and bias on output features, ``rowwise`` (and its variants)
    the weight on input features with the bias whole, ``packed_colwise`` splits each of the
    two packed halves (each rank named twice), ``embedding_rowwise`` splits the vocabulary,
    ``replicated_with_grad_allreduce`` (Qwen3's ``q_norm``/``k_norm``) keeps the parameter
    whole on every rank (the reduction of its gradient is the sharded model's job).
    ``colwise_gather_output`` and ``colwise_rep`` split on output features like ``colwise``; on
    a fused projection whose parts the model's code slices apart (Phi-3's ``qkv_proj``: q, k
    and v; ``gate_up_proj``: gate and up) each rank holds its share of every part, so the
    slices stay split and nothing is gathered; a gated delta net's (Qwen3-Next's linear
    attention) input projections, one group per key head, are split by key heads and its
    output projection on its input features, when the key heads divide over the ranks. As in
    transformers' own plan, the input embedding (``embed_tokens``) is split on the vocabulary
    unless the plan names it, and a head's entries are added (``lm_head`` split on the
    vocabulary: a loss computed in the forward takes the split logits, the logits returned are
    gathered, or stay split inside ``st.loss_parallel()``). Styles that only change the forward (``moe_tp_experts``,
    ``all_reduce``, ...) add nothing: shardkit derives the communication from the layouts.

    Where the plan leaves attention, an MLP or GPT-OSS's experts whole (GPT-OSS, HunYuan,
    GraniteMoE, DeepSeek-V3's attention), they are split the usual way when the model's heads
    divide over the ranks; the returned spec lists these in ``inferred`` and anything kept
    whole for a reason in ``kept_whole``. Models without a plan (GPT-2, GPT-BigCode, OPT,
    Falcon, BLOOM, Persimmon, StableLM, MPT, BERT, RoBERTa, DeBERTa-v2, DistilBERT, T5, ViT,
    CLIP) get the same layout from their block structure; multi-query attention (one key/value
    head for all query heads: GPT-BigCode's and Falcon's defaults) keeps attention whole and
    splits the MLP. Norms (and the embeddings and head of a model without a plan) stay whole
    on every rank. Keys use ``*`` for the layer number, so the spec stays short.

    Pure: reads the module tree (a model on the meta device is fine), communicates nothing.

    Args:
        model: the model, e.g. ``LlamaForCausalLM(config)`` built under ``torch.device("meta")``.
        ranks: the placements to split over, e.g. ``["rank:0/cpu", "rank:1/cpu"]``; ints mean
            ``"rank:<r>/cpu"``.
        experts: mixture-of-experts layers: ``"tensor"`` splits each expert's matrices (the
            plan's ``base_model_tp_plan``); ``"expert"`` divides the experts among the ranks
            (``base_model_ep_plan``), the rest of the model as with ``"tensor"``.

    Returns:
        A ``TensorParallelSpec`` (a ``CompositeShardingSpec``) for ``shard_model(model, spec, ...)``.

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
    ctx = _Context(model, _placements(ranks), dict(model.named_modules()),
                   dict(model.named_parameters(remove_duplicate=False)))
    planned = _transformers_plan(model, experts)
    if planned is None:
        plan, blocks = _inferred_plan(ctx)
        from_config = set(plan)
        source = f"block structure ({', '.join(blocks)})"
    else:
        plan, from_config, prefix = planned
        source = "transformers' plan"
    parts: dict[str, PlacementSpec] = {}
    for key, value in plan.items():
        style_name, factor = (value, 2) if isinstance(value, str) else value
        style = _STYLES.get(style_name)
        if style is None:
            msg = (f"the tensor-parallel plan of {type(model).__name__} gives {key!r} the style {style_name!r}, which "
                   f"shardkit does not map; known styles: {sorted(_STYLES)}. Write that entry by hand.")
            raise ValueError(msg)
        parts.update(_entries(key, style, factor if style.packed else 1, ctx))
    unmatched = [key for key in plan if key in from_config and not _matches_any(key, ctx.modules, ctx.params)]
    if unmatched and len(unmatched) == len(from_config):  # a plan for another model, not a variant of this one
        msg = (f"the tensor-parallel plan names {unmatched[0]!r}, which matches no module or parameter of the "
               f"model, and none of its other entries match either: it is not a plan for "
               f"{type(model).__name__}.")
        raise ValueError(msg)
    if planned is not None:
        parts.update(_complete(ctx, parts, experts, prefix))
    parts = _shared_key_value_heads(ctx, parts)
    return TensorParallelSpec(parts, source=source, inferred=ctx.inferred, kept_whole=ctx.kept_whole)


_KEY_VALUE = ("k_proj", "v_proj")


def _shared_key_value_heads(ctx: _Context, parts: dict[str, PlacementSpec]) -> dict[str, PlacementSpec]:
    """With fewer key/value heads than ranks (8 on 16 ranks), each key/value head held by the ranks of its query
    heads: rank ``r`` holds head ``r // (ranks / key_value_heads)`` of ``k_proj`` and ``v_proj`` (replicas, whose
    gradients the sharded layer sums over them), as Megatron and vLLM lay it out. Needs query heads that divide
    over the ranks, and ranks that divide over the key/value heads."""
    heads = ctx.heads()
    if heads is None:
        return parts
    q, kv, head_dim = heads
    world = ctx.world
    if not 0 < kv < world or q % world or world % kv:
        return parts
    share = world // kv
    out: dict[str, PlacementSpec] = {}
    for key, spec in parts.items():
        pattern = key.split(".")
        module_pattern = pattern[:-1] if pattern[-1] in ("weight", "bias") else pattern
        if not module_pattern or module_pattern[-1] not in _KEY_VALUE or not isinstance(spec, SingleSplitShardingSpec):
            out[key] = spec
            continue
        found = next((m for n, m in ctx.modules.items() if _exact(module_pattern, n)), None)
        if not isinstance(found, nn.Linear) or found.out_features != kv * head_dim:
            out[key] = spec
            continue
        prefix = ".".join(module_pattern)
        for attr, param in found.named_parameters(recurse=False):
            if prefix + "." + attr != key and prefix != key:
                continue
            shape = tuple(param.shape)
            shards = [ShardMetadata((r // share * head_dim, *([0] * (len(shape) - 1))), (head_dim, *shape[1:]),
                                    ctx.placements[r].device) for r in range(world)]
            out[f"{prefix}.{attr}"] = EnumerableShardingSpec(shards)
        ctx.inferred.append(f"{prefix}: {kv} key/value heads over {world} ranks: each head is held by the {share} "
                            f"ranks of its query heads (replicas, their gradients summed over them)")
    return out


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


def _base_prefix(model: nn.Module, base: Mapping[str, str]) -> str:
    """The name (with its dot) under which ``model`` holds the base model its config's plan names.

    Usually ``model.base_model_prefix`` (``"model."``); some heads hold the base model under
    another name than that prefix (Llama 4's ``Llama4ForCausalLM`` keeps ``model`` while its
    prefix says ``language_model``), so the names of the model's own children are tried too:
    the first under which one of the plan's keys names a module or parameter wins.
    """
    declared = getattr(model, "base_model_prefix", "")
    candidates = [declared] if declared else []
    candidates += [name for name, child in model.named_children() if hasattr(child, "config") and name != declared]
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters(remove_duplicate=False)]
    for name in candidates:
        if isinstance(getattr(model, name, None), nn.Module):
            prefix = name + "."
            if any(_exact((prefix + key).split("."), n) for key in base for n in names):
                return prefix
    # Nothing matches anywhere: the declared prefix, under which the caller says what the plan names.
    return declared + "." if declared and isinstance(getattr(model, declared, None), nn.Module) else ""


def _transformers_plan(model: nn.Module,
                       experts: Experts) -> tuple[dict[str, str | tuple[str, int]], set[str], str] | None:
    """The model's transformers plan with full parameter/module names, the keys that came from the
    config's plans (not the embedding and head added to them) and the base model's prefix, or
    ``None`` if it has none.

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
    prefix = _base_prefix(model, base)
    base_model = getattr(model, prefix[:-1]) if prefix else model
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
    return plan, from_config, prefix


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


def _inferred_plan(ctx: _Context) -> tuple[dict[str, str | tuple[str, int]], list[str]]:
    """The plan of every known block structure found in the model, full names with '*', and the blocks' names."""
    plan: dict[str, str | tuple[str, int]] = {}
    found = []
    for arch, block in _BLOCKS.items():
        keys: dict[str, str | tuple[str, int]] = {}
        complete = True
        for pattern, style in block.items():
            optional = pattern.endswith("?")
            parts = pattern.rstrip("?").split(".")
            prefixes = list(dict.fromkeys(p for n in ctx.modules if (p := _suffix_matches(parts, n)) is not None))
            if not prefixes and not optional:
                complete = False
                break
            for prefix in prefixes:
                keys[prefix + ".".join(parts)] = style
        if complete and keys:
            found.append(arch)
            plan.update(_multi_query(ctx, arch, keys))
    if not plan:
        raise ValueError(_hand_written_hint(ctx.model, ctx.modules))
    return plan, found


def _multi_query(ctx: _Context, arch: str, keys: dict[str, str | tuple[str, int]]) -> dict[str, str | tuple[str, int]]:
    """The block's keys, adjusted to how its attention packs q, k and v.

    GPT-BigCode matches GPT-2's block names with another layout: with ``multi_query`` its
    ``c_attn`` holds all queries, then one key head and one value head (``[q | k | v]``, not
    thirds); without it, each head's q, k and v side by side (an output split keeps heads). Old
    Falcon models with ``multi_query`` pack one key and one value head after the queries too.
    One key/value head cannot be divided among ranks, so such attention stays whole and only
    the MLP is split.
    """
    config = getattr(ctx.model, "config", None)
    model_type = getattr(config, "model_type", None)
    multi_query = bool(getattr(config, "multi_query", False))
    if arch == "GPT-2" and model_type == "gpt_bigcode":
        attention = [k for k in keys if k.endswith((".attn.c_attn", ".attn.c_proj"))]
        if not multi_query:
            keys = {k: ("colwise" if k.endswith(".attn.c_attn") else v) for k, v in keys.items()}
            for key in (k for k in keys if k.endswith(".attn.c_attn")):
                ctx.inferred.append(f"{key}: holds each head's q, k and v side by side (GPT-BigCode without "
                                    f"multi-query attention), so it is split by heads on its output features, "
                                    f"not in thirds as GPT-2's")
            return keys
    elif arch == "BLOOM/Falcon" and model_type == "falcon" and multi_query \
            and not getattr(config, "new_decoder_architecture", False):
        attention = [k for k in keys if k.endswith((".self_attention.query_key_value", ".self_attention.dense"))]
    else:
        return keys
    heads = ctx.heads()
    count = heads[0] if heads else "all"
    for block in dict.fromkeys(k.rsplit(".", 1)[0] for k in attention):
        ctx.kept_whole.append(f"{block}: multi-query attention ({count} query heads share one key/value head, "
                              f"packed after the queries), which cannot be divided among {ctx.world} ranks; the MLP "
                              f"is split")
    return {k: v for k, v in keys.items() if k not in attention}


def _hand_written_hint(model: nn.Module, modules: Mapping[str, nn.Module]) -> str:
    linears = [n for n, m in modules.items() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
    # Layer numbers folded to '*' (a module's own index, as in nn.Sequential, kept).
    folded = list(dict.fromkeys(".".join([*("*" if p.isdigit() else p for p in n.split(".")[:-1]), n.split(".")[-1]])
                                for n in linears))
    shown = folded[:12]
    more = f" and {len(folded) - len(shown)} more" if len(folded) > len(shown) else ""
    start = (f"tensor_parallel_spec does not know the layout of {type(model).__name__}: it has no transformers "
             f"plan (config.base_model_tp_plan) and its blocks match none of {sorted(_BLOCKS)}.")
    if any(isinstance(m, nn.Conv1d) and m.groups > 1 for m in modules.values()):
        # A state-space mixer (Mamba): its scan runs over every channel of the layer at once.
        return (f"tensor_parallel_spec has no layout for {type(model).__name__}: its layers mix tokens with a "
                f"depthwise convolution and a state-space scan over all their channels (no attention heads, no MLP "
                f"pair to split). Keep the model whole on every rank and train it data-parallel with "
                f"st.fully_shard(model), or write a spec for its linear layers by hand and register how its mixer "
                f"computes (st.register_sharded_module). It has no transformers plan (config.base_model_tp_plan) "
                f"and its blocks match none of {sorted(_BLOCKS)}; its linear layers: {shown}{more}.")
    return (f"{start} Write the spec by hand: split the attention's q/k/v and the first MLP projection on output "
            f"features (single_split(0, ranks)) and the attention output and second MLP projection on input features "
            f"({{'<name>.weight': single_split(1, ranks)}}), with '*' for the layer number. Its linear layers: "
            f"{shown}{more}.")


def _entries(key: str, style: _Style, packed: int, ctx: _Context) -> dict[str, PlacementSpec]:
    """The spec entries of one plan entry: the module's key when one spec covers all its parameters."""
    pattern = key.split(".")
    matched_params = [n for n in ctx.params if _exact(pattern, n)]
    if matched_params:  # the plan names a parameter (e.g. a 3-D experts tensor)
        spec = _param_spec(style.weight if not key.endswith("bias") else style.bias, ctx.params[matched_params[0]],
                           None, packed, ctx.placements, key)
        return {} if spec is None else {key: spec}
    matched = [(n, m) for n, m in ctx.modules.items() if _exact(pattern, n)]
    if not matched:
        # A model's plan covers every variant of its architecture (Qwen2-MoE's plan names the
        # dense MLP that only layers listed in mlp_only_layers have): what this model lacks is
        # skipped, as from_pretrained(tp_plan="auto") skips it (a plan matching nothing at all
        # is refused by the caller).
        return {}
    name, module = matched[0]
    if style.gathered:
        fused = _fused(key, module, ctx)
        if fused is None:
            fused = _linear_attention(key, name, ctx)
        if fused is not None:
            return fused
    own = dict(module.named_parameters(recurse=False))
    specs: dict[str, PlacementSpec | None] = {}
    for attr, param in own.items():
        layout = style.weight if attr == "weight" else style.bias
        specs[attr] = _param_spec(layout, param, module, packed, ctx.placements, f"{name}.{attr}")
    for other_name, other in matched[1:]:
        if set(dict(other.named_parameters(recurse=False))) != set(own):
            msg = (f"the plan entry {key!r} covers modules with different parameters ({name!r} has {sorted(own)}, "
                   f"{other_name!r} has {sorted(dict(other.named_parameters(recurse=False)))}); write it by hand.")
            raise ValueError(msg)
    given = {attr: spec for attr, spec in specs.items() if spec is not None}
    if given and len(given) == len(specs) and len(set(given.values())) == 1:
        return {key: next(iter(given.values()))}
    return {f"{key}.{attr}": spec for attr, spec in given.items()}


def _fused(key: str, module: nn.Module, ctx: _Context) -> dict[str, PlacementSpec] | None:
    """A packed split for a fused projection whose output transformers gathers because the code slices it.

    ``gate_up_proj``: gate then up, chunked in two; ``qkv_proj``: all queries, then keys, then
    values ([q | k | v], by heads). Each rank holds its share of every part, so the model's
    slicing hands each part on still split: no gather. ``None`` for anything else (a plain
    output split, computed exactly, gathering where the code needs the whole output).
    """
    if not isinstance(module, nn.Linear):
        return None
    leaf = key.rsplit(".", 1)[-1]
    ranks = ctx.placements
    if leaf in _FUSED_HALVES and module.out_features % (2 * ctx.world) == 0:
        ctx.inferred.append(f"{key}: gate and up in one projection (split in two by the model's code): each rank "
                            f"holds its share of both halves (a packed split), so nothing is gathered")
        return {key: SingleSplitShardingSpec(ranks * 2, 0)}
    if leaf == "qkv_proj":
        heads = ctx.heads()
        if heads is None:
            return None
        q, kv, head_dim = heads
        if module.out_features != (q + 2 * kv) * head_dim or ctx.heads_divide() is not None:
            return None
        q_part, kv_part = q // ctx.world * head_dim, kv // ctx.world * head_dim
        sizes = [q_part] * ctx.world + [kv_part] * ctx.world * 2
        ctx.inferred.append(f"{key}: queries, keys and values in one projection ([q | k | v], sliced apart by the "
                            f"model's code): each rank holds its heads of all three (a packed split), so nothing is "
                            f"gathered")
        return {key: SingleSplitShardingSpec(ranks * 3, 0, sizes)}
    return None


# A gated delta net (Qwen3-Next's linear attention) by the names of its projections, and the method that
# reads its fused input projections as one group per key head: [q, k, v, z] and [b, a] side by side.
_DELTA_NET = ("in_proj_qkvz", "in_proj_ba", "out_proj")
_DELTA_NET_GROUPED = "fix_query_key_value_ordering"


def _linear_attention(key: str, name: str, ctx: _Context) -> dict[str, PlacementSpec] | None:
    """A split by key heads for a gated delta net's projections, which transformers' plan gathers.

    The net's input projections hold one group per key head (its query and key, then the
    values and gates of the value heads it serves), so an output split on whole groups gives
    each rank its heads of every part, and the model's code (the grouped view, the
    convolution over q, k and v, the delta rule per head) computes them there; the output
    projection then takes those value heads, split on its input features, and hands out a
    pending sum. ``None`` (a plain output split, gathered where the code needs it whole) for
    another module, or when the key heads do not divide over the ranks.
    """
    leaf = key.rsplit(".", 1)[-1]
    if leaf not in _DELTA_NET or "." not in name:
        return None
    net = ctx.modules.get(name.rsplit(".", 1)[0])
    if net is None or not callable(getattr(type(net), _DELTA_NET_GROUPED, None)):
        return None
    layers = [getattr(net, n, None) for n in _DELTA_NET]
    heads = [getattr(net, a, None) for a in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")]
    qkvz, ba, out = layers
    if not (isinstance(qkvz, nn.Linear) and isinstance(ba, nn.Linear) and isinstance(out, nn.Linear)) or not all(
            type(v) is int and v > 0 for v in heads):
        return None
    k_heads, v_heads, k_dim, v_dim = (int(v) for v in heads)  # type: ignore[arg-type]
    if v_heads % k_heads or k_heads % ctx.world:
        return None
    if (qkvz.out_features != 2 * k_heads * k_dim + 2 * v_heads * v_dim or ba.out_features != 2 * v_heads
            or out.in_features != v_heads * v_dim):
        return None
    if leaf == "out_proj":
        ctx.inferred.append(f"{key}: a gated delta net's output projection (the plan gathers its output): split on "
                            f"its input features, the value heads of this rank's key heads, its output a pending sum")
        return {f"{key}.weight": SingleSplitShardingSpec(ctx.placements, 1)}
    ctx.inferred.append(f"{key}: a gated delta net's input projection, one group per key head (the plan gathers its "
                        f"output): split on output features by key heads, {k_heads // ctx.world} per rank")
    return {key: SingleSplitShardingSpec(ctx.placements, 0)}


def _exact(pattern: Sequence[str], name: str) -> bool:
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


# -- blocks the plan leaves whole -------------------------------------------------------------------


def _fold(name: str) -> str:
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def _covered(folded: str, parts: Mapping[str, PlacementSpec]) -> bool:
    """Whether a plan entry names the module ``folded`` (layer numbers as '*'), something under it, or above it."""
    for key in parts:
        k = _fold(key)
        if k == folded or k.startswith(folded + ".") or folded.startswith(k + "."):
            return True
    return False


def _linear_children(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}


def _complete(ctx: _Context, parts: Mapping[str, PlacementSpec], experts: Experts,
              prefix: str) -> dict[str, PlacementSpec]:
    """Entries for the blocks of the base model (under ``prefix``) transformers' plan leaves whole that split
    the usual way.

    Attention (q/k/v and an output projection, or DeepSeek's multi-head latent attention),
    gated MLPs and GPT-OSS's experts, found by their children; each kind of block is planned
    once, by its name with '*' for the layer number. Attention is split only if the heads divide
    over the ranks; the ranks' share of heads is then what each rank computes, as with a plan.
    """
    col, row = SingleSplitShardingSpec(ctx.placements, 0), SingleSplitShardingSpec(ctx.placements, 1)
    out: dict[str, PlacementSpec] = {}
    seen: set[str] = set()
    for name, module in ctx.modules.items():
        folded = _fold(name)
        if folded in seen or not name or not name.startswith(prefix):
            continue
        seen.add(folded)
        if _covered(folded, {**parts, **out}):
            continue
        linears = _linear_children(module)
        attention = _attention_of(linears)
        if attention is not None:
            kind = "multi-head latent attention" if len(attention[0]) == 2 else "attention"
            why = ctx.heads_divide() or _unsplittable_attention(module, kind)
            if why is not None:
                ctx.kept_whole.append(f"{folded}: {kind}, whole because {why}")
                continue
            inputs, output = attention
            out.update({f"{folded}.{n}": col for n in inputs})
            out[f"{folded}.{output}.weight"] = row
            ctx.inferred.append(f"{folded}: {kind} the plan leaves whole, split by heads ({', '.join(inputs)} on "
                                f"output features, {output} on input features)")
            continue
        mlp = _mlp_of(linears)
        if mlp is not None:
            inputs, output = mlp
            for n in inputs:
                out[f"{folded}.{n}"] = SingleSplitShardingSpec(ctx.placements * 2, 0) if n in _FUSED_HALVES else col
            out[f"{folded}.{output}.weight"] = row
            fused = " (gate and up packed: each rank holds its share of both)" if set(inputs) & _FUSED_HALVES else ""
            ctx.inferred.append(f"{folded}: MLP the plan leaves whole, split on its features ({', '.join(inputs)} on "
                                f"output features{fused}, {output} on input features)")
            continue
        layout = _experts.biased_experts_layout(module, experts)
        if layout is not None:
            for pname, dim in layout.items():
                out[f"{folded}.{pname}"] = SingleSplitShardingSpec(ctx.placements, dim)
            how = "each expert's features" if experts == "tensor" else "the experts"
            ctx.inferred.append(f"{folded}: experts the plan leaves whole, split on {how} "
                                f"({', '.join(f'{p} on dim {d}' for p, d in layout.items())})")
    return out


def _unsplittable_attention(module: nn.Module, kind: str) -> str | None:
    """Why an attention block the plan leaves whole cannot be split by heads today, or ``None``.

    Differential attention (DiffLlama: ``lambda_q1``...) pairs head ``h`` with head ``h + H/2``
    (``torch.chunk`` over the heads), which a split into contiguous heads would separate on
    different ranks. DeepSeek's latent attention writes its keys into a buffer it allocates
    (``new_empty``) through slices of it, which the sharded computation does not follow yet.
    """
    if isinstance(getattr(module, "lambda_q1", None), nn.Parameter):
        return "differential attention pairs each head with the head half the heads away, which a split by heads " \
               "would put on another rank"
    if kind == "multi-head latent attention":
        return "it writes its keys into a buffer through slices of it (new_empty, then copy_ into each slice), " \
               "which the sharded computation does not follow yet"
    return None


def _attention_of(linears: Mapping[str, nn.Linear]) -> tuple[list[str], str] | None:
    """(input projections, output projection) if ``linears`` are an attention block's, else ``None``."""
    for shape in (_ATTENTION, _LATENT_ATTENTION):
        names = [next((n for n in options if n in linears), None) for options in shape]
        if all(names):
            found = [n for n in names if n is not None]
            return found[:-1], found[-1]
    return None


def _mlp_of(linears: Mapping[str, nn.Linear]) -> tuple[list[str], str] | None:
    for inputs, output in _MLPS:
        if output in linears and all(n in linears for n in inputs) and len(linears) == len(inputs) + 1:
            return list(inputs), output
    return None
