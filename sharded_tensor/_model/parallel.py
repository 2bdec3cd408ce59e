"""Compute layouts of sharded parameters, planning per module, and the built-in registrations.

From data to execution:

1. :func:`classify` (``param_layout``) reads a parameter's metadata as a compute layout: the
   placement the spec attached to it (``sharding.layout``): *replicated* (whole on every
   rank), a ``Split`` along one dimension (``intervals`` give each rank's slice) or a
   ``Packed`` one (``pieces`` give each rank's several slices, as a fused q/k/v weight split
   by heads holds them), or something no registration here computes with (blocks split along
   several dimensions, or elements held by some ranks but not all).
2. :func:`plan_module` hands the layouts of one module's parameters to the module type's
   registration (``_registry``), which returns a plan or refuses with a ``ValueError`` that
   names the module and says why. Refusal happens at shard time: a layout that cannot be
   computed correctly never produces numbers. ``nn.Linear`` and ``nn.Embedding`` are the
   registrations defined here (``nn.MultiheadAttention`` is in ``_attention``).
3. :func:`install` gives the module the registration's forward, and :func:`optimize` finds
   the zones where activations stay split between modules (``zone_plan``): the smallest
   module holding a layer split on its outputs and one split on its inputs the same way.
   Where ``torch.fx`` can trace a module, it also checks that no code reads a split
   parameter directly (such an op would see only this rank's shard).

Communication per forward (``k`` = number of ranks): Linear split on outputs: none while
the output stays split, else an all-gather; Linear split on inputs: one all-reduce;
Embedding split on the vocabulary: one all-reduce; Embedding split on the embedding
dimension: like a Linear split on outputs. Backward mirrors this (see ``_functional``).
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from _shardkit import comm as _comm
from sharding.layout import Packed

from . import registry as _registry
from . import zone_plan as _zone_plan
from .engine.placements import Intervals, copy_to_ranks, share_gradient
from .engine.state import STATE
from .engine.zone import ZoneForward, in_zone, outside_propagation
from .param_layout import ParamLayout, classify, split_placement

__all__ = ["ParamLayout", "classify", "LinearPlan", "EmbeddingPlan", "plan_module", "install",
           "optimize"]

# -- 2. plans -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinearPlan:
    """How a sharded ``nn.Linear`` computes.

    ``mode``: ``"out"`` (weight split on dim 0, output features), ``"in"`` (split on dim 1,
    input features) or ``"bias"`` (weight whole, bias split). ``bias``: ``"none"``,
    ``"replicated"``, ``"local"`` (split like the output features) or ``"disjoint"`` (split
    its own way; added once, before the all-reduce).
    """

    mode: Literal["out", "in", "bias"]
    intervals: Intervals
    bias: Literal["none", "replicated", "local", "disjoint"]
    bias_intervals: Intervals | None
    weight_dim: int | None
    pieces: tuple[Intervals, ...] | None = None  # "out" packed: each rank's slices of the output features
    replicas: bool = False  # "out" with slices several ranks hold (a key/value head shared by its query heads)

    @property
    def output_split(self) -> Intervals | Packed:
        """The split of the output features: one slice per rank, or several (packed)."""
        return Packed(0, self.pieces) if self.pieces is not None else self.intervals


@dataclass(frozen=True)
class EmbeddingPlan:
    """How a sharded ``nn.Embedding`` computes: ``"vocab"`` (rows split) or ``"dim"`` (columns split)."""

    mode: Literal["vocab", "dim"]
    intervals: Intervals
    weight_dim: int


@dataclass(frozen=True)
class Plan:
    """A module's registration with the plan it made for this module's layouts."""

    handler: _registry.ShardedModule
    inner: Any
    group: _comm.ProcessGroup = None

    @property
    def activations(self) -> tuple[Intervals | None, Intervals | None]:
        return self.handler.activations(self.inner)


def _what(layout: ParamLayout) -> str:
    if layout.kind == "blocks":
        return f"split into blocks along several dimensions ({layout.describe()})"
    if layout.kind == "overlapping":
        return (f"held by some ranks but not all, with overlapping copies ({layout.describe()}); every "
                f"element must be on exactly one rank or on every rank")
    return f"split ({layout.describe()})"


def handler_of(module: nn.Module) -> tuple[_registry.ShardedModule | None, str | None]:
    """The registration that applies to ``module`` (see ``register_sharded_module``)."""
    return _registry.handler_for(module)


def plan_module(module_name: str, module: nn.Module, layouts: Mapping[str, ParamLayout],
                group: _comm.ProcessGroup = None) -> Plan | None:
    """The compute plan for ``module`` given its parameters' layouts; ``None`` if nothing is split.

    ``layouts`` maps the module's own parameter names (``"weight"``, ``"bias"``) to layouts;
    parameters not in it are whole on every rank. The module's registration
    (``register_sharded_module``) decides.

    Raises:
        ValueError: the layout cannot be computed correctly; the message names the module and why.
    """
    split = {p: layout for p, layout in layouts.items() if layout.kind != "replicated"}
    if not split:
        return None
    kind = type(module).__name__
    label = f"module {module_name!r} ({kind})" if module_name else f"the root module ({kind})"
    handler, why = _registry.handler_for(module)
    if handler is not None:
        inner = handler.plan(module, layouts, name=label)
        return None if inner is None else Plan(handler, inner, group)
    names = ", ".join(f"{p!r} is {_what(layout)}" for p, layout in split.items())
    because = f" ({why})" if why else ""
    msg = (f"{label}: {names}; shardkit computes with split parameters only in modules with a sharded "
           f"registration{because}: {', '.join(_registry.registered_types())} (whose forward is not overridden), "
           f"so this module would compute wrong numbers. Keep its parameters whole on every rank with a rankless "
           f"placement such as 'cpu', or register how it computes with st.register_sharded_module.")
    raise ValueError(msg)


def _refuse_packed(label: str, layouts: Mapping[str, ParamLayout], what: str) -> None:
    for name, layout in layouts.items():
        if layout.pieces is not None:
            shown = "; ".join(f"rank {r}: {list(p)}" for r, p in enumerate(layout.pieces) if p)
            msg = (f"{label}: {name} is split into several non-adjacent slices per rank along dimension "
                   f"{layout.dim} ({shown}; (start, length)); {what} computes with one slice per rank, so give "
                   f"each rank one contiguous slice.")
            raise ValueError(msg)


def _plan_packed_linear(label: str, module: nn.Linear, weight: ParamLayout, bias: ParamLayout | None) -> LinearPlan:
    """A Linear whose weight holds several slices of the output features per rank (a fused q/k/v)."""
    pieces = weight.pieces
    assert pieces is not None
    if weight.dim != 0:
        _refuse_packed(label, {"weight": weight}, "a Linear split on its input features")
    if bias is not None and bias.kind != "replicated" and bias.pieces != pieces:
        msg = (f"{label}: the weight's output features are packed as {[list(p) for p in pieces]} ((start, length) "
               f"slices per rank) but the bias is laid out otherwise ({bias.describe()}); split the bias into the "
               f"same slices as dim 0 of the weight, or keep it whole on every rank.")
        raise ValueError(msg)
    kind = "none" if module.bias is None else "replicated" if bias is None or bias.kind == "replicated" else "local"
    return LinearPlan("out", (), kind, None, 0, pieces)  # type: ignore[arg-type]


def _plan_replicated_linear(label: str, module: nn.Linear, weight: ParamLayout, bias: ParamLayout | None) -> LinearPlan:
    """A Linear split on its output features with slices held by several ranks (replicas)."""
    if weight.dim != 0 or weight.intervals is None:
        msg = (f"{label}: the weight is split along dimension {weight.dim} with slices several ranks hold "
               f"({weight.describe()}); a Linear shares a slice between ranks only along its output features "
               f"(dim 0): split on inputs, the partial sums of replicas would be counted twice.")
        raise ValueError(msg)
    if bias is not None and bias.kind != "replicated" and bias.intervals != weight.intervals:
        msg = (f"{label}: the weight's output features are held as {list(weight.intervals)} ((start, length) per "
               f"rank, replicas shared) but the bias as {bias.describe()}; split the bias like dim 0 of the weight, "
               f"or keep it whole on every rank.")
        raise ValueError(msg)
    kind = "none" if module.bias is None else "replicated" if bias is None or bias.kind == "replicated" else "local"
    return LinearPlan("out", weight.intervals, kind, None, 0, replicas=True)  # type: ignore[arg-type]


def _plan_linear(label: str, module: nn.Linear, layouts: Mapping[str, ParamLayout]) -> LinearPlan:
    weight = layouts.get("weight")
    if weight is not None and weight.pieces is not None:
        return _plan_packed_linear(label, module, weight, layouts.get("bias") if module.bias is not None else None)
    if weight is not None and weight.replicas:
        return _plan_replicated_linear(label, module, weight, layouts.get("bias") if module.bias is not None else None)
    _refuse_packed(label, layouts, "a Linear")
    bias = layouts.get("bias") if module.bias is not None else None
    for name, layout in (("weight", weight), ("bias", bias)):
        if layout is not None and layout.kind in ("blocks", "overlapping"):
            msg = (f"{label}: {name} is {_what(layout)}; a Linear computes with its weight split along one "
                   f"dimension only: 0 (output features) or 1 (input features), each rank holding a slice.")
            raise ValueError(msg)
    if weight is None or weight.kind == "replicated":
        assert bias is not None
        return LinearPlan("bias", (), "disjoint", bias.along(0), None)
    if module.bias is None:
        bias_kind = "none"
    elif bias is None or bias.kind == "replicated":
        bias_kind = "replicated"
    else:
        bias_kind = "split"
    dim = weight.dim
    if dim is None:  # one rank holds the whole weight: split on outputs if the bias allows it
        owner_out = weight.along(0)
        dim = 0 if bias_kind != "split" or bias.along(0) == owner_out else 1  # type: ignore[union-attr]
    intervals = weight.along(dim)
    if dim == 0:
        if bias_kind == "split" and bias.along(0) != intervals:  # type: ignore[union-attr]
            msg = (f"{label}: the bias is split as {list(bias.along(0))} ((start, length) per rank) but the weight's "  # type: ignore[union-attr]
                   f"output features as {list(intervals)}; split the bias the same way as dim 0 of the weight, "
                   f"or keep the bias whole on every rank.")
            raise ValueError(msg)
        return LinearPlan("out", intervals, "local" if bias_kind == "split" else bias_kind, None, 0)  # type: ignore[arg-type]
    if dim == 1:
        kind = "disjoint" if bias_kind == "split" else bias_kind
        return LinearPlan("in", intervals, kind, bias.along(0) if bias_kind == "split" else None, 1)  # type: ignore[arg-type, union-attr]
    msg = f"{label}: weight split along dimension {dim}, which a Linear weight does not have."
    raise ValueError(msg)


def _plan_embedding(label: str, module: nn.Embedding, layouts: Mapping[str, ParamLayout]) -> EmbeddingPlan:
    _refuse_packed(label, layouts, "an Embedding")
    weight = layouts["weight"]
    if weight.kind in ("blocks", "overlapping"):
        msg = (f"{label}: weight is {_what(weight)}; an Embedding computes with its weight split along one "
               f"dimension only: 0 (the vocabulary) or 1 (the embedding dimension).")
        raise ValueError(msg)
    dim = weight.dim if weight.dim is not None else 0
    if module.max_norm is not None:
        msg = (f"{label}: max_norm={module.max_norm} renormalizes whole embedding rows in place during "
               f"forward, which a split weight cannot do exactly; keep this Embedding whole on every rank.")
        raise ValueError(msg)
    if dim == 0 and module.scale_grad_by_freq:
        msg = (f"{label}: scale_grad_by_freq=True counts index frequencies over the whole vocabulary, which "
               f"a vocabulary split cannot reproduce; split the embedding dimension (dim 1) instead.")
        raise ValueError(msg)
    return EmbeddingPlan("vocab" if dim == 0 else "dim", weight.along(dim), dim)


# -- 3. the built-in registrations -----------------------------------------------------------------

class ShardedLinear(_registry.ShardedModule):
    """``nn.Linear`` split on its output features (``"out"``), input features (``"in"``) or bias only."""

    def plan(self, module: nn.Module, layouts: Mapping[str, Any], *, name: str) -> LinearPlan:
        return _plan_linear(name, module, layouts)  # type: ignore[arg-type]

    def activations(self, plan: LinearPlan) -> tuple[Intervals | None, Intervals | None]:
        if plan.mode == "out":
            return None, plan.output_split  # type: ignore[return-value]
        if plan.mode == "in":
            return plan.intervals, None
        return None, None

    def empty_dims(self, plan: LinearPlan) -> Mapping[str, int]:
        return {} if plan.weight_dim is None else {"weight": plan.weight_dim}

    def computes_alike(self, module: nn.Module) -> bool:
        """A Linear subclass whose own forward is ``input @ weight.T (+ bias)`` (Falcon's ``FalconLinear``)."""
        return _forward_is_linear(type(module), getattr(module, "bias", None) is not None, module)

    def forward(self, call: _registry.ShardedCall, module: nn.Module, input: torch.Tensor) -> torch.Tensor:
        plan: LinearPlan = call.plan
        module = cast(nn.Linear, module)  # registered for nn.Linear
        weight: torch.Tensor = module.weight
        bias: torch.Tensor = module.bias  # read only where the plan says the module has one
        if plan.mode == "bias":
            return F.linear(call.replicated(input), weight) + call.gather(bias, 0, plan.bias_intervals)  # type: ignore[arg-type]
        if plan.mode == "out":
            if plan.replicas:  # each replica computes a share of its slice's gradient: summed over them
                weight = share_gradient(weight, 0, plan.intervals, call.group)
                if plan.bias == "local":
                    bias = share_gradient(bias, 0, plan.intervals, call.group)
            y = F.linear(call.enter(input), weight, bias if plan.bias == "local" else None)
            if plan.bias == "replicated":
                if in_zone():
                    return call.split_output(y + _local_bias(call, bias, plan), plan.output_split)
                return call.split_output(y, plan.output_split) + bias
            return call.split_output(y, plan.output_split)
        y = F.linear(call.split_input(input, plan.intervals), weight)
        if plan.bias == "disjoint":
            start, length = plan.bias_intervals[call.rank]  # type: ignore[index]
            y = y + F.pad(bias, (start, module.out_features - start - length))
        return call.pending_sum(y, bias if plan.bias == "replicated" else None)


_TRANSPOSES = {("T",), ("mT",), ("t",), ("transpose", 0, 1), ("transpose", 1, 0), ("transpose", -1, -2),
               ("transpose", -2, -1)}


def _forward_is_linear(cls: type, has_bias: bool, module: nn.Module) -> bool:
    """Whether ``module``'s forward, traced with ``torch.fx``, is ``F.linear`` or ``input @ weight.T (+ bias)``.

    Decided once per class and bias presence; anything fx cannot trace, or any other op, is no.
    """
    key = (cls, has_bias)
    if key not in _LINEAR_FORWARDS:
        try:
            graph = torch.fx.Tracer().trace(module)
        except Exception:  # noqa: BLE001 - a forward fx cannot trace is simply not recognized
            _LINEAR_FORWARDS[key] = False
        else:
            _LINEAR_FORWARDS[key] = _is_linear_graph(graph, has_bias)
    return _LINEAR_FORWARDS[key]


_LINEAR_FORWARDS: dict[tuple[type, bool], bool] = {}


def _is_linear_graph(graph: torch.fx.Graph, has_bias: bool) -> bool:
    nodes = [n for n in graph.nodes if n.op != "output"]
    output = next(n for n in graph.nodes if n.op == "output")
    inputs = [n for n in nodes if n.op == "placeholder"]
    attrs = {n.target: n for n in nodes if n.op == "get_attr"}
    if len(inputs) != 1 or set(attrs) != ({"weight", "bias"} if has_bias else {"weight"}):
        return False
    x, weight, bias = inputs[0], attrs["weight"], attrs.get("bias")
    ops = [n for n in nodes if n.op in ("call_function", "call_method")]
    result = output.args[0]
    if len(ops) == 1 and ops[0] is result and ops[0].target in (F.linear, torch._C._nn.linear):
        return list(ops[0].args) + list(ops[0].kwargs.values()) == ([x, weight, bias] if has_bias else [x, weight])
    if len(ops) != (3 if has_bias else 2):
        return False
    transpose, product = ops[0], ops[1]
    if transpose.op == "call_function" and transpose.target is getattr:
        form = (transpose.args[1],)
        source = transpose.args[0]
    else:
        form = (transpose.target, *transpose.args[1:])
        source = transpose.args[0]
    if source is not weight or form not in _TRANSPOSES:
        return False
    if product.target not in (operator.matmul, torch.matmul) or list(product.args) != [x, transpose]:
        return False
    if not has_bias:
        return result is product
    add = ops[2]
    return result is add and add.target in (operator.add, torch.add) and set(add.args) == {product, bias} \
        and not add.kwargs


def _local_bias(call: _registry.ShardedCall, bias: torch.Tensor, plan: LinearPlan) -> torch.Tensor:
    """This rank's slices of a whole bias, laid out as its output features (one slice, or packed)."""
    if plan.pieces is None:
        return call.local_slice(bias, plan.intervals)
    whole = copy_to_ranks(bias, call.group)
    return torch.cat([whole.narrow(0, s, n) for s, n in plan.pieces[call.rank]])


class ShardedEmbedding(_registry.ShardedModule):
    """``nn.Embedding`` split on the vocabulary (``"vocab"``) or on the embedding dimension (``"dim"``)."""

    def plan(self, module: nn.Module, layouts: Mapping[str, Any], *, name: str) -> EmbeddingPlan:
        return _plan_embedding(name, module, layouts)  # type: ignore[arg-type]

    def activations(self, plan: EmbeddingPlan) -> tuple[Intervals | None, Intervals | None]:
        return (None, plan.intervals) if plan.mode == "dim" else (None, None)

    def describe(self, plan: EmbeddingPlan) -> str:
        return "output split" if plan.mode == "dim" else "vocabulary split, its lookups summed"

    def empty_dims(self, plan: EmbeddingPlan) -> Mapping[str, int]:
        return {"weight": plan.weight_dim}

    def forward(self, call: _registry.ShardedCall, module: nn.Module, input: torch.Tensor) -> torch.Tensor:
        plan: EmbeddingPlan = call.plan
        module = cast(nn.Embedding, module)  # registered for nn.Embedding
        input = call.replicated(input)
        weight = module.weight
        if plan.mode == "dim":
            y = F.embedding(input, weight, module.padding_idx, None, module.norm_type, module.scale_grad_by_freq,
                            module.sparse)
            return call.split_output(y, plan.intervals)
        msg = f"index out of range in self: indices must be in [0, {module.num_embeddings}) for this Embedding."
        if torch.compiler.is_compiling():
            # Traced, the ids have no values yet: reading one in Python (``bool``) would break the graph
            # or fail on fake tensors. The check goes into the graph instead and runs with it (an
            # out-of-range id would otherwise silently embed as zeros on every rank).
            torch._assert_async(((input >= 0) & (input < module.num_embeddings)).all(), msg)
        elif input.numel() and (bool((input < 0).any()) or bool((input >= module.num_embeddings).any())):
            raise IndexError(msg)
        start, length = plan.intervals[call.rank]
        if length == 0:
            # Nothing local; keep the (empty) weight in the graph so every rank has a gradient for it.
            y = weight.new_zeros((*input.shape, module.embedding_dim)) + weight.sum()
        else:
            inside = (input >= start) & (input < start + length)
            local = torch.where(inside, input - start, torch.zeros_like(input))
            pad = module.padding_idx
            local_pad = pad - start if pad is not None and start <= pad < start + length else None
            y = F.embedding(local, weight, local_pad, None, module.norm_type, False, module.sparse)
            y = y * inside.unsqueeze(-1).to(y.dtype)
        return call.reduce(y)


_registry.register_sharded_module(nn.Linear, ShardedLinear())
_registry.register_sharded_module(nn.Embedding, ShardedEmbedding())


class _ShardedForward:
    """``forward`` of a module with split parameters: its registration's forward."""

    def __init__(self, module: nn.Module, plan: Plan) -> None:
        self._module = module
        self._plan = plan
        self._call = _registry.ShardedCall(plan.inner, plan.group)
        self._forward = plan.handler.forward
        functools.update_wrapper(self, type(module).forward)  # keeps inspect.signature(module.forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if STATE.explaining is not None:
            STATE.explaining.layer(self._module)
        with outside_propagation():
            return self._forward(self._call, self._module, *args, **kwargs)


def install(module: nn.Module, plan: Plan | None) -> None:
    """Give ``module`` its sharded forward for ``plan`` (``None``: restore the class's forward)."""
    if plan is None:
        if "_shardkit_plan" in module.__dict__:
            del module.__dict__["_shardkit_plan"]
            module.__dict__.pop("forward", None)
        return
    module.__dict__["_shardkit_plan"] = plan
    module.__dict__["forward"] = _ShardedForward(module, plan)


# -- zones: keep activations split between layers ----------------------------------------------

class _Tracer(torch.fx.Tracer):
    def __init__(self, sharded: set[nn.Module]) -> None:
        super().__init__()
        self._sharded = sharded

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return m in self._sharded or super().is_leaf_module(m, module_qualified_name)


_METADATA_ATTRS = frozenset({"dtype", "device", "shape", "ndim", "layout", "is_cuda", "is_meta", "is_sparse",
                             "is_quantized", "requires_grad", "is_leaf"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "nelement", "ndimension", "is_floating_point", "is_complex",
                               "element_size", "get_device", "is_contiguous"})


def _reads_metadata(node: torch.fx.Node) -> bool:
    """Whether ``node`` only reads what a tensor is (dtype, device, shape), not its values.

    T5's feed-forward casts its input to ``self.wo.weight.dtype``: a split ``wo`` still has
    the dtype and device of the whole, so such a read is no use of its values.
    """
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in _METADATA_ATTRS
    return node.op == "call_method" and node.target in _METADATA_METHODS


def _check_direct_uses(graph: torch.fx.Graph, root: nn.Module, root_name: str,
                       split_params: Mapping[str, str]) -> None:
    """Refuse code that reads a split parameter directly (not through its module's forward)."""
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        full = f"{root_name}.{node.target}" if root_name else str(node.target)
        if full in split_params and not all(_reads_metadata(user) for user in node.users):
            users = ", ".join(str(u.format_node()) for u in node.users) or "nothing"
            where = f"module {root_name!r}" if root_name else "the root module"
            msg = (f"{split_params[full]}: parameter {full!r} is split across ranks, but the forward of {where} "
                   f"({type(root).__name__}) uses it directly ({users}) instead of calling its module; that op would "
                   f"see only this rank's shard. Keep {full!r} whole on every rank, or use it only through its module.")
            raise ValueError(msg)


def _trace(module: nn.Module, sharded: set[nn.Module]) -> list[torch.fx.Graph] | None:
    original = type(module).forward.__get__(module)
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return None
    params = signature.parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    concrete = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    graphs = []
    was_training = module.training
    try:
        for training in (True, False):
            module.train(training)
            graphs.append(_Tracer(sharded).trace(module, concrete_args=concrete or None))
    except Exception:  # noqa: BLE001 - anything fx cannot trace is simply not checked here
        return None
    finally:
        module.train(was_training)
    return graphs


# Built-in modules whose Python forward calls their submodules, with fused fast paths that read
# the weights directly. Run as zones: the fast paths step aside while a torch function mode is
# active, so split layers inside them are computed by their registrations.
TRANSPARENT = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
               nn.TransformerDecoder, nn.Transformer)


def endpoints(model: nn.Module) -> list[_zone_plan.Endpoint]:
    """The sharded layers of ``model`` that produce or consume split activations."""
    found = []
    for name, module in model.named_modules():
        plan = module.__dict__.get("_shardkit_plan")
        if not isinstance(plan, Plan):
            continue
        takes, gives = plan.activations
        if gives is not None:
            found.append(_zone_plan.Endpoint(name, "produces", split_placement(gives, 0)))
        if takes is not None:
            split = split_placement(takes, 0)
            if isinstance(split, Packed):
                msg = (f"module {name!r}: its registration says it takes an input packed as {split.pieces!r}; a "
                       f"sharded layer takes its input split with one slice per rank.")
                raise ValueError(msg)
            found.append(_zone_plan.Endpoint(name, "consumes", split))
    return found


def optimize(model: nn.Module, split_params: Mapping[str, str]) -> Callable[[], list[str]]:
    """Find the zones of ``model`` whose activations stay split, and check its code.

    Runs before any data moves (on a meta model too); nothing changes until the returned
    function installs the zones' forwards (see ``engine.zone``).

    Args:
        model: a model whose sharded layers already have their plans installed.
        split_params: full names of split parameters -> label of their module, for the check
            that no code reads a split parameter directly (where ``torch.fx`` can trace it).

    Returns:
        A function that installs the zones and returns their module names.

    Raises:
        ValueError: a traced forward reads a split parameter directly, or an attention
            projection is split inside a head.
    """
    named = dict(model.named_modules())
    sharded = {m for m in named.values() if "_shardkit_plan" in m.__dict__}
    ends = endpoints(model)
    roots = _zone_plan.find_zones(ends)
    for name, module in named.items():
        if isinstance(module, TRANSPARENT) and name not in roots \
                and any(m in sharded for m in module.modules()):
            roots.append(name)
    for root in roots:
        inside = [e for e in ends if not root or e.name.startswith(root + ".")]
        _zone_plan.check_head_boundaries(root, named[root], inside)

    def visit(name: str, module: nn.Module) -> None:
        inside = [m for _, m in module.named_modules() if m in sharded]
        if not inside or module in sharded:
            return
        graphs = _trace(module, sharded)
        if graphs is None:
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
            return
        for graph in graphs:
            _check_direct_uses(graph, module, name, split_params)

    if sharded:
        visit("", model)

    # The whole model runs as a zone too: besides keeping split outputs split until they are
    # needed whole, that lets every op be checked for a direct read of a split parameter.
    if sharded and model not in sharded and "" not in roots:
        roots.append("")

    def commit() -> list[str]:
        for root in roots:
            module = named[root]
            module.__dict__["forward"] = ZoneForward(type(module).forward.__get__(module))
        return roots
    return commit
