"""Shard modules: ``shard_parameter`` and ``shard_model``.

After sharding, a parameter is an ordinary ``nn.Parameter`` holding this rank's block of the
global tensor (so ``model.parameters()`` and any ``torch.optim`` optimizer work unchanged),
and it carries its record (``record.ShardedParameter``). Three things follow from that
record:

* compute: ``nn.Linear`` / ``nn.Embedding`` get a sharded forward (see ``_parallel``);
  anything else with a split parameter is refused at shard time;
* ``model.state_dict()`` holds a ``ShardedTensor`` under each sharded parameter's name (a
  state-dict post-hook wraps the local block, no copy, no communication);
* ``model.load_state_dict(sd)`` accepts ``ShardedTensor`` entries in any layout (a
  load pre-hook reshards them into the parameter's layout; collective when the layouts
  differ) and full tensors (each rank copies its block).

Each rank keeps exactly one local tensor per parameter. A spec that gives a rank several
shards of one parameter is accepted when those shards form one block (they are adjacent),
and refused otherwise, since ``model.parameters()`` must yield one tensor per parameter.

Meta-device models are materialized module by module: each rank allocates only its blocks
and runs the module's own ``reset_parameters()`` under ``_init.LayoutInvariantInit``, so
the full model never exists anywhere and the values do not depend on the layout.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from _shardkit import comm as _comm
from _shardkit import unfilled as _unfilled
from _shardkit.memory import empty_for_fill
from sharding import (
    CompositeShardingSpec,
    DevicePlacement,
    EnumerableShardingSpec,
    MeshShardingSpec,
    PlacementSpec,
    RemoteDevice,
    ShardedTensorMetadata,
    ShardMetadata,
    SingleSplitShardingSpec,
)
from sharding.layout import box_slices

from .._reshard import redistribute
from . import drift as _drift
from . import experts as _experts
from . import guard as _guard
from . import hf_modules as _hf_modules
from . import parallel as _parallel
from .init import LayoutInvariantInit
from .parallel import ParamLayout, Plan
from .record import ShardedParameter, assemble, attach, install_hooks, sharded_parameters

__all__ = ["shard_parameter", "shard_model"]

_TENSOR_SPECS = (DevicePlacement, SingleSplitShardingSpec, MeshShardingSpec, EnumerableShardingSpec)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


# -- collecting what is to be sharded -------------------------------------------------------------

Source = Literal["init", "local", "src", "keep"]


@dataclass
class _Entry:
    """One parameter object, with every name and module it appears under."""

    name: str
    param: nn.Parameter
    owners: list[tuple[str, nn.Module, str]] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    spec: PlacementSpec | None = None
    layout: ParamLayout | None = None
    source: Source = "keep"
    new: nn.Parameter | None = None
    compute_dim: int | None = None
    # A meta parameter fully_shard already laid out (its rows): materialized here, computed by fully_shard.
    recorded: ShardedParameter | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's global shape."""
        return tuple(self.layout.global_shape) if self.recorded is not None else tuple(self.param.shape)  # type: ignore[union-attr]

    def sharded(self, group: _comm.ProcessGroup) -> ShardedParameter:
        if self.recorded is not None:
            return self.recorded
        assert self.layout is not None and self.spec is not None
        label = None
        if self.layout.kind != "replicated":
            mod_name, module, _ = self.owners[0]
            label = f"{self.name!r} of {_label(mod_name, module)}"
        return ShardedParameter(self.layout, self.spec, group, self.compute_dim, label)

    def box(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self.layout is None:
            shape = tuple(self.param.shape)
            return (0,) * len(shape), shape
        return self.sharded(None).box(rank)


def _collect(model: nn.Module) -> list[_Entry]:
    entries: dict[int, _Entry] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            entry = entries.setdefault(id(param), _Entry(full, param))
            entry.aliases.append(full)
            if not any(m is module and a == attr for _, m, a in entry.owners):
                entry.owners.append((mod_name, module, attr))
    return list(entries.values())


def _label(name: str, module: nn.Module) -> str:
    return f"module {name!r} ({type(module).__name__})" if name else f"the root module ({type(module).__name__})"


def _resolve(spec: PlacementSpec, entries: Sequence[_Entry]) -> None:
    names = [a for e in entries for a in e.aliases]
    if isinstance(spec, CompositeShardingSpec):
        resolved = spec.resolve(names)
    elif isinstance(spec, _TENSOR_SPECS):
        resolved = {n: spec for n in names}
    else:
        msg = (f"sharding_spec must be a CompositeShardingSpec or a tensor spec (SingleSplitShardingSpec, "
               f"MeshShardingSpec, DevicePlacement, EnumerableShardingSpec), got {type(spec).__name__} {spec!r}.")
        raise TypeError(msg)
    for entry in entries:
        given = {a: resolved[a] for a in entry.aliases if a in resolved}
        if len(set(given.values())) > 1:
            msg = (f"parameter {entry.name!r} is shared (tied) under the names {entry.aliases}, and the spec gives "
                   f"them different specs {given}; a tied parameter has one layout, so give one spec (or the same) "
                   f"for all its names.")
            raise ValueError(msg)
        if given:
            entry.spec = next(iter(given.values()))


def _layout(entry: _Entry, world: int) -> ParamLayout:
    shape = tuple(entry.param.shape)
    try:
        metadata = entry.spec.build_metadata(shape, entry.param.dtype, world_size=world)  # type: ignore[union-attr]
    except ValueError as exc:
        msg = f"parameter {entry.name!r} (size {shape}): {exc}"
        raise ValueError(msg) from exc
    return _parallel.classify(entry.name, metadata, world)


def _check_ancestors(model: nn.Module, module_name: str, module: nn.Module, owners: set[int]) -> None:
    """Refuse sharded layers inside built-in torch.nn modules that read their weights directly."""
    parts = module_name.split(".") if module_name else []
    for i in range(len(parts)):
        name = ".".join(parts[:i])
        ancestor = model.get_submodule(name)
        if id(ancestor) in owners or isinstance(ancestor, (*_CONTAINERS, *_parallel.TRANSPARENT)):
            continue
        if type(ancestor).__module__.startswith("torch."):
            msg = (f"{_label(module_name, module)} is inside {_label(name, ancestor)}, a built-in module whose "
                   f"forward may use its submodules' weights directly (e.g. fused attention kernels), where "
                   f"shardkit cannot insert communication; keep the parameters under {name!r} whole on every rank.")
            raise ValueError(msg)


def _plans(model: nn.Module, entries: Sequence[_Entry],
           group: _comm.ProcessGroup) -> dict[int, tuple[str, nn.Module, Plan | None]]:
    """Plan every module owning a sharded parameter (validation only; nothing changes).

    A module whose registration covers its whole subtree (``ShardedModule.subtree``, e.g.
    ``nn.MultiheadAttention`` with its ``out_proj``) is planned with the layouts of every
    parameter below it, named relative to it, and its descendants are not planned on their own.
    """
    _experts.register_experts_of(model)  # transformers' fused experts, found by their parameters
    _hf_modules.register_modules_of(model)  # transformers' scaled embeddings and Conv1D
    per_module: dict[int, tuple[str, nn.Module, dict[str, ParamLayout]]] = {}
    named = list(model.named_modules())
    owners: dict[int, tuple[str, nn.Module]] = {}
    covered: set[int] = set()
    for mod_name, module in named:
        if id(module) in covered:
            continue
        handler, _ = _parallel.handler_of(module)
        if handler is not None and handler.subtree:
            owners[id(module)] = (mod_name, module)
            covered.update(id(m) for m in module.modules() if m is not module)
    owner_of = {}
    for key, (_, module) in owners.items():
        for sub_name, sub in module.named_modules():
            owner_of[id(sub)] = (key, sub_name)
    for entry in entries:
        if entry.layout is None or entry.recorded is not None:
            continue
        for mod_name, module, attr in entry.owners:
            if id(module) in owner_of:
                key, sub_name = owner_of[id(module)]
                name, owner = owners[key]
                slot = per_module.setdefault(key, (name, owner, {}))
                slot[2][f"{sub_name}.{attr}" if sub_name else attr] = entry.layout
            else:
                slot = per_module.setdefault(id(module), (mod_name, module, {}))
                slot[2][attr] = entry.layout
    plans = {}
    for key, (mod_name, module, layouts) in per_module.items():
        existing = {a: s.layout for a, s in sharded_parameters(module).items()}
        plan = _parallel.plan_module(mod_name, module, {**existing, **layouts}, group)
        if plan is not None:
            _check_ancestors(model, mod_name, module, set(owners))
        plans[key] = (mod_name, module, plan)
        # A rank holding nothing of a weight gets an empty tensor along the dim compute splits.
        if plan is not None:
            for attr, dim in plan.handler.empty_dims(plan.inner).items():
                for entry in entries:
                    if any(m is module and a == attr for _, m, a in entry.owners):
                        entry.compute_dim = dim
    return plans


# -- moving and creating data ---------------------------------------------------------------------

def _full_metadata(shape: tuple[int, ...], dtype: torch.dtype, ranks: Sequence[int]) -> ShardedTensorMetadata:
    # Devices in these layouts only matter for the local rank's allocations (the planner
    # looks at regions and ranks), and each rank allocates on its own default device.
    return ShardedTensorMetadata([ShardMetadata((0,) * len(shape), shape, RemoteDevice.of(r, "cpu"))
                                  for r in ranks], shape, dtype)


def _from_src(tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
              target: ShardedTensorMetadata, src: int, rank: int,
              group: _comm.ProcessGroup) -> dict[int, torch.Tensor]:
    source = _full_metadata(shape, dtype, [src])
    local = {0: tensor.detach()} if rank == src and tensor is not None else {}
    return redistribute(local, source, target.with_dtype(dtype), rank=rank, group=group)


def _device_for(layout: ParamLayout | None, rank: int, default: torch.device) -> torch.device:
    if layout is not None:
        mine = layout.metadata.shards_on(rank)
        if mine:
            return mine[0][1].device.device
    return default


def _reset_method(module: nn.Module) -> Callable[[], object] | None:
    method: Callable[[], object] | None = (getattr(module, "reset_parameters", None)
                                           or getattr(module, "_reset_parameters", None))
    return method


InitArg = Callable[[nn.Module], object] | Literal[False] | None


class _Initializers:
    """Which code initializes each module of a model built on the meta device.

    ``init`` given as a callable: ``init(module)`` for every module with something to
    initialize. ``init=None``: a transformers ``PreTrainedModel`` (recognized by its
    ``_init_weights`` and ``config``, without importing transformers) initializes every module
    below it with its own ``_init_weights(module)``, as ``from_config`` does; other modules use
    their ``reset_parameters()``; a model whose root has ``init_weights()`` and whose modules
    have no ``reset_parameters()`` (torchtitan style) is initialized by that one call.
    ``init=False``: parameters are left uninitialized (a load follows); modules with buffers
    on the meta device still run their initialization for those.
    """

    def __init__(self, model: nn.Module, init: InitArg) -> None:
        self.init = init
        self.owner: dict[int, nn.Module] = {}
        if init is None or init is False:  # with False, buffers on meta still need the model's init
            def visit(module: nn.Module, owner: nn.Module | None) -> None:
                if hasattr(module, "_init_weights") and hasattr(module, "config"):
                    owner = module
                if owner is not None:
                    self.owner.setdefault(id(module), owner)
                for child in module.children():
                    visit(child, owner)
            visit(model, None)
        root_init = getattr(model, "init_weights", None)
        self.whole = (init is None and not self.owner and callable(root_init)
                      and _reset_method(model) is None)

    def for_module(self, module: nn.Module) -> Callable[[], object] | None:
        """The call that initializes ``module``'s own parameters and buffers, or ``None``."""
        if callable(self.init):
            fn = self.init
            return lambda: fn(module)
        owner = self.owner.get(id(module))
        if owner is not None:
            return lambda: owner._init_weights(module)  # type: ignore[operator]
        return _reset_method(module)


def _agree(payload: dict[str, Any], group: _comm.ProcessGroup, caller: str) -> list[dict[str, Any]]:
    """Every rank's ``payload``; raises the same ``ValueError`` everywhere if the models differ. Collective."""
    _, everyone = _comm.agree(caller, lambda: payload, group, share=lambda p: p, error=ValueError)
    first = everyone[0]
    for rank, other in enumerate(everyone):
        for key in ("params", "spec", "src_rank", "seed_given"):
            if other[key] != first[key]:
                msg = (f"{caller} must be called with the same model and arguments on every rank, but {key} "
                       f"differs between rank 0 and rank {rank}: {_short(first[key])} vs {_short(other[key])}.")
                raise ValueError(msg)
    return everyone


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) < 300 else text[:300] + "..."


# -- public API ------------------------------------------------------------------------------------

@_comm.collective("st.shard_model")
def shard_model(model: nn.Module, sharding_spec: PlacementSpec, *, src_rank: int | None = None,
                process_group: _comm.ProcessGroup = None, seed: int | None = None,
                init: InitArg = None) -> nn.Module:
    """Shard ``model``'s parameters as ``sharding_spec`` says, in place, and return it. Collective.

    ``sharding_spec`` is a ``CompositeShardingSpec`` (parameter or submodule names, dotted
    paths, nested composites, device strings) or one tensor spec applied to every parameter.
    Parameters the composite does not name stay whole on every rank.

    Where the values come from:

    * parameters on the meta device are allocated block by block on each rank and initialized
      by the model's own initialization (``init=None``): a transformers ``PreTrainedModel``'s
      ``_init_weights`` for every module below it (as ``from_config`` does, tied weights
      staying tied), else each module's ``reset_parameters()``, else the root's
      ``init_weights()``; or by ``init(module)`` for each module when ``init`` is a callable;
      or not at all with ``init=False`` (for a ``checkpoint.load`` that follows; buffers on
      the meta device still get the model's init). Fills use the distributions of the global
      tensors (fans from the global shapes). With ``seed``, every value depends only on
      ``seed``, the parameter's name and the init rule, never on the layout or the world size
      (a counter-based generator computes each rank's block). Without ``seed``, rank 0 draws
      one and each block is drawn from an ordinary (faster) generator seeded from it and the
      block's place: replicas agree, but values differ between layouts;
    * parameters ``st.fully_shard`` laid out on the meta device (its rows) are allocated and
      initialized the same way, each rank only its rows (leave them out of ``sharding_spec``;
      an empty ``composite()`` will do);
    * with ``src_rank``, the model on that rank is the source of truth: each rank receives only
      its blocks, and unsharded parameters are broadcast (other ranks may build on meta);
    * otherwise each rank keeps its block of its own (identical) copy.

    ``nn.Linear`` and ``nn.Embedding`` with split weights compute with the needed communication.
    Where Linears split on their outputs feed Linears split on their inputs the same way
    (q/k/v and o_proj, gate/up and down_proj), the activations between them stay split through
    the model's own code (reshapes to heads, rotary embeddings, attention), so each rank
    computes only its heads and a transformer layer's forward does two all-reduces. Buffers
    are never sharded.

    The parameters left whole on every rank must stay equal: after each step of an optimizer
    that holds some of them, the ranks compare their checksums, and a step that made them
    differ (``torch.nn.utils.clip_grad_norm_`` instead of ``st.clip_grad_norm_``, or any other
    per-rank update) raises ``RuntimeError`` on every rank, naming the parameters and the fix
    (``SHARDKIT_CHECK_REPLICAS=0`` turns the check off).

    Args:
        model: the model; modified in place.
        sharding_spec: see above.
        src_rank: group rank whose weights are the source of truth, or ``None``.
        process_group: the group the spec's ranks refer to (``None``: the default group).
        seed: seed for the layout-invariant initialization of meta parameters.
        init: how meta parameters are initialized: ``None`` (the model's own initialization, see
            above), a callable taking a module, or ``False`` (leave them uninitialized).

    Returns:
        ``model``.

    Raises:
        ValueError: a spec that cannot be laid out or computed (the message names the parameter
            or module and why), or arguments that differ between ranks. Raised identically on
            every rank, before anything changes.
        TypeError: ``sharding_spec`` is not a spec.
        CollectiveError: another rank died or did not answer within ``SHARDKIT_TIMEOUT``
            seconds (default 600); the message names the ranks (see the troubleshooting guide).

    Example:
        >>> # 2 ranks: a Megatron-style MLP, built on meta, never materialized in full
        >>> with torch.device("meta"):  # doctest: +SKIP
        ...     mlp = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
        >>> ranks = ["rank:0/cpu", "rank:1/cpu"]
        >>> spec = composite(**{"0": single_split(0, ranks), "2.weight": single_split(1, ranks)})
        >>> mlp = shard_model(mlp, spec, seed=0)  # doctest: +SKIP
        >>> mlp[0].weight.shape, mlp[2].weight.shape  # this rank's blocks  # doctest: +SKIP
        (torch.Size([1024, 512]), torch.Size([512, 1024]))
    """
    rank, world = _comm.rank_and_world(process_group)
    _check_arguments(model, src_rank, seed, world)
    entries, plans = _plan_model(model, sharding_spec, process_group, world)
    seed_value = _agree_on_model(entries, sharding_spec, src_rank, seed, process_group, world, "shard_model")
    _assign_sources(entries, src_rank)
    initializers = _check_initialization(model, entries, seed, init)
    default_device = _default_device(entries, rank)
    commit = _install_forwards(model, entries, plans)
    _materialize(model, entries, plans, rank, process_group, src_rank, seed_value, default_device,
                 invariant=seed is not None, initializers=initializers)
    _finish(model, entries, process_group)
    commit()
    _drift.watch(model, process_group)  # replicated parameters checked after each optimizer step
    return model


# -- the steps of shard_model, in order ------------------------------------------------------------

def _check_arguments(model: object, src_rank: int | None, seed: int | None, world: int) -> None:
    """Refuse arguments that are wrong on their own (before the model is looked at)."""
    if src_rank is not None and (isinstance(src_rank, bool) or not isinstance(src_rank, int)
                                 or not 0 <= src_rank < world):
        msg = f"src_rank={src_rank!r} is outside the world of {world} ranks; use 0..{world - 1} or None."
        raise ValueError(msg)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        msg = f"seed must be an int or None, got {type(seed).__name__} {seed!r}."
        raise TypeError(msg)
    if not isinstance(model, nn.Module):
        msg = f"shard_model expects an nn.Module, got {type(model).__name__}."
        raise TypeError(msg)


def _plan_model(model: nn.Module, sharding_spec: PlacementSpec, group: _comm.ProcessGroup,
                world: int) -> tuple[list[_Entry], dict[int, tuple[str, nn.Module, Plan | None]]]:
    """Each parameter's spec and layout, and each module's compute plan (validation only; nothing changes)."""
    entries = _collect(model)
    _resolve(sharding_spec, entries)
    for entry in entries:
        _adopt_fully_sharded(entry, group)
        if entry.spec is None:
            continue
        for _, module, attr in entry.owners:
            if attr in sharded_parameters(module):
                msg = (f"parameter {entry.name!r} is already sharded; reshard its values through "
                       f"model.state_dict() / load_state_dict instead of sharding it twice.")
                raise ValueError(msg)
        entry.layout = _layout(entry, world)
    return entries, _plans(model, entries, group)


def _adopt_fully_sharded(entry: _Entry, group: _comm.ProcessGroup) -> None:
    """Take the layout ``fully_shard`` gave a parameter still on the meta device (its rows, to materialize)."""
    _, module, attr = entry.owners[0]
    recorded = sharded_parameters(module).get(attr)
    if recorded is None or not entry.param.is_meta:
        return
    if entry.spec is not None:
        msg = (f"parameter {entry.name!r} is fully sharded (st.fully_shard on the meta device); leave it out of the "
               f"spec, and shard_model allocates and initializes this rank's rows of it.")
        raise ValueError(msg)
    if group is not None:
        msg = (f"parameter {entry.name!r} is fully sharded over global ranks; materialize it with shard_model "
               f"over the whole world (process_group=None), not over a subgroup.")
        raise ValueError(msg)
    entry.layout = recorded.layout
    entry.recorded = recorded


def _agree_on_model(entries: Sequence[_Entry], sharding_spec: PlacementSpec, src_rank: int | None,
                    seed: int | None, group: _comm.ProcessGroup, world: int, caller: str) -> int:
    """Agree across ranks on the model, the arguments and the seed before any data moves.

    ``caller`` (``shard_model`` or ``shard_parameter``) names the function in messages.
    Returns the seed every rank uses (``seed``, or rank 0's draw when meta parameters need one).
    """
    is_meta = [e.param.is_meta for e in entries]
    needs_draw = seed is None and src_rank is None and any(is_meta)  # with src_rank nothing is initialized
    proposal = seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()) if needs_draw else 0
    payload: dict[str, Any] = {"params": [[e.name, list(e.shape), str(e.param.dtype)] for e in entries],
               "spec": sharding_spec.to_dict(),
               "src_rank": src_rank, "seed_given": seed is not None, "meta": is_meta, "seed": proposal}
    everyone = _agree(payload, group, caller) if world > 1 else [payload]
    if src_rank is None:
        for r, other in enumerate(everyone):
            if other["meta"] != is_meta:
                names = [e.name for e, a, b in zip(entries, is_meta, other["meta"]) if a != b][:5]
                msg = (f"parameters {names} are on the meta device on some ranks and not on others (ranks 0 and "
                       f"{r} differ); build the model the same way everywhere, or pass src_rank= to take the "
                       f"values from one rank.")
                raise ValueError(msg)
    else:
        src_meta = [e.name for e, m in zip(entries, everyone[src_rank]["meta"]) if m]
        if src_meta:
            instead = ("pass src_rank=None to initialize meta parameters" if caller == "shard_model" else
                       "for a model built on meta, use shard_model(), which initializes it shard by shard")
            msg = (f"src_rank={src_rank} has parameters on the meta device ({src_meta[:5]}); {caller} takes the "
                   f"values from the source rank, which must hold real values; {instead}.")
            raise ValueError(msg)
    return int(everyone[0]["seed"])


def _assign_sources(entries: Sequence[_Entry], src_rank: int | None) -> None:
    """Where each parameter's values come from: ``src_rank``, its own init, this rank's copy, or nowhere."""
    for entry in entries:
        if src_rank is not None:
            entry.source = "src"
        elif entry.param.is_meta:
            entry.source = "init"
        else:
            entry.source = "local" if entry.layout is not None else "keep"


def _check_initialization(model: nn.Module, entries: Sequence[_Entry], seed: int | None,
                          init: InitArg) -> _Initializers:
    """What initializes each meta parameter; refuse a meta parameter nothing can initialize."""
    if init is not None and init is not False and not callable(init):
        msg = f"init must be None, False or a callable taking a module, got {type(init).__name__} {init!r}."
        raise TypeError(msg)
    initializers = _Initializers(model, init)
    if seed is not None and not any(e.source == "init" for e in entries):
        msg = ("seed= initializes parameters on the meta device, but this model has none; its real values "
               "are sharded as they are (drop seed=, or build the model under torch.device('meta')).")
        raise ValueError(msg)
    for entry in entries:
        mod_name, module, _ = entry.owners[0]
        if entry.source == "init" and init is not False and not initializers.whole \
                and initializers.for_module(module) is None:
            msg = (f"{_label(mod_name, module)} has parameters on the meta device and nothing to initialize them: "
                   f"no reset_parameters(), no transformers _init_weights above it, no init_weights() on the "
                   f"model; pass init=fn (called as fn(module) for each module), add a reset_parameters() "
                   f"method, pass init=False to leave them uninitialized for a checkpoint.load, or build the "
                   f"model with real weights and pass src_rank=.")
            raise ValueError(msg)
    return initializers


def _default_device(entries: Sequence[_Entry], rank: int) -> torch.device:
    """Where this rank puts what no layout places: the device of its first sharded block, else the CPU."""
    for entry in entries:
        if entry.layout is not None and entry.layout.metadata.shards_on(rank):
            return _device_for(entry.layout, rank, torch.device("cpu"))
    return torch.device("cpu")


def _install_forwards(model: nn.Module, entries: Sequence[_Entry],
                      plans: Mapping[int, tuple[str, nn.Module, Plan | None]]) -> Callable[[], object]:
    """Install the sharded forwards and trace the model; returns the call that makes the trace take effect.

    This runs before any data moves: fx only needs shapes, and a forward that reads a split
    parameter directly is refused with the model unchanged.
    """
    for _, module, plan in plans.values():
        _parallel.install(module, plan)
    try:
        return _parallel.optimize(model, _split_labels(entries))
    except BaseException:
        for _, module, _plan in plans.values():
            _parallel.install(module, None)
        raise



def _split_labels(entries: Sequence[_Entry]) -> dict[str, str]:
    split = {}
    for entry in entries:
        if entry.layout is not None and entry.layout.kind != "replicated" and entry.recorded is None:
            mod_name, module, _ = entry.owners[0]
            for alias in entry.aliases:
                split[alias] = _label(mod_name, module)
    return split


def _materialize(model: nn.Module, entries: Sequence[_Entry], plans: Mapping[int, tuple[str, nn.Module, Plan | None]],
                 rank: int, group: _comm.ProcessGroup, src_rank: int | None, seed: int,
                 default_device: torch.device, invariant: bool, initializers: _Initializers) -> None:
    by_param = {id(e.param): e for e in entries}
    ctx = LayoutInvariantInit(seed, invariant=invariant)
    whole: list[tuple[str, _Entry]] = []
    done_modules: set[int] = set()
    with ctx:
        for mod_name, module in model.named_modules():
            if id(module) in done_modules:
                continue
            done_modules.add(id(module))
            to_init: list[tuple[str, _Entry]] = []
            others: list[tuple[str, _Entry]] = []
            for attr, param in list(module._parameters.items()):
                if param is None:
                    continue
                entry = by_param.get(id(param))
                if entry is None:  # replaced already through another owner
                    continue
                if entry.new is None:
                    entry.new = _new_param(entry, rank, group, src_rank, default_device,
                                           populate=initializers.init is not False)
                    if initializers.init is False and entry.source == "init":
                        _unfilled.mark(entry.new)  # checkpoint.load refuses to leave it so
                    (to_init if entry.source == "init" else others).append((attr, entry))
                else:
                    others.append((attr, entry))
                module._parameters[attr] = entry.new
            meta_buffers = [b for b, t in module._buffers.items() if t is not None and t.is_meta]
            for name in meta_buffers:
                old = module._buffers[name]
                module._buffers[name] = torch.zeros(old.shape, dtype=old.dtype, device=default_device)
            if initializers.init is False:  # parameters stay uninitialized; buffers still get their values
                others, to_init = [*others, *to_init], []
            fn = None if initializers.whole else initializers.for_module(module)
            if (to_init or (meta_buffers and src_rank is None)) and fn is not None:
                _init_module(ctx, mod_name, module, to_init, others, rank, fn)
            elif to_init:
                whole.extend((attr, entry) for attr, entry in to_init)
            elif meta_buffers and src_rank is None:
                warnings.warn(f"{_label(mod_name, module)}: buffers {meta_buffers} were on the meta device and "
                              f"have no reset_parameters() to fill them; they are zeros now.", stacklevel=3)
        if whole:  # torchtitan style: one init_weights() for the whole model
            for _, entry in whole:
                ctx.register(entry.new, entry.name, entry.shape, entry.box(rank)[0])  # type: ignore[arg-type]
            with ctx.module_scope(""), torch.no_grad():
                model.init_weights()  # type: ignore[operator]
        if src_rank is not None:
            _broadcast_buffers(model, rank, group, src_rank)


def _broadcast_buffers(model: nn.Module, rank: int, group: _comm.ProcessGroup, src_rank: int) -> None:
    _, world = _comm.rank_and_world(group)
    for module in dict.fromkeys(m for _, m in model.named_modules()):
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            shape = tuple(buf.shape)
            got = _from_src(buf if rank == src_rank else None, shape, buf.dtype,
                            _full_metadata(shape, buf.dtype, range(world)), src_rank, rank, group)
            value = got[rank]
            if buf.is_meta or value.device != buf.device:
                module._buffers[name] = value.to(buf.device if not buf.is_meta else value.device)
            else:
                with torch.no_grad():
                    buf.copy_(value)


def _new_param(entry: _Entry, rank: int, group: _comm.ProcessGroup, src_rank: int | None,
               default_device: torch.device, populate: bool = True) -> nn.Parameter:
    param = entry.param
    shape, dtype = entry.shape, param.dtype
    layout = entry.layout
    _, world = _comm.rank_and_world(group)
    if entry.source == "keep":
        return param
    offsets, sizes = entry.box(rank)
    if layout is not None:
        device = _device_for(layout, rank, default_device)
    else:
        device = param.device if not param.is_meta else default_device
    if entry.source == "init":
        # A load fills blocks left uninitialized (init=False) by reading files into them.
        local = empty_for_fill(sizes, dtype, device, populate=populate)
    elif entry.source == "local":
        with torch.no_grad():
            local = empty_for_fill(sizes, dtype, device)
            if layout is not None and layout.boxes[rank] is not None:
                local.copy_(layout.local_of(rank, param.detach()))
            else:
                local.copy_(param.detach()[box_slices((offsets, sizes), (0,) * len(shape))])
    else:  # "src"
        target = layout.metadata if layout is not None else _full_metadata(shape, dtype, range(world))
        pieces = _from_src(param if rank == src_rank else None, shape, dtype, target, src_rank, rank, group)  # type: ignore[arg-type]
        if layout is not None:
            local = assemble(pieces, layout, rank, sizes, dtype)
        else:
            local = pieces[rank].to(device)
    return nn.Parameter(local, requires_grad=param.requires_grad)


def _init_module(ctx: LayoutInvariantInit, mod_name: str, module: nn.Module,
                 to_init: Sequence[tuple[str, _Entry]], others: Sequence[tuple[str, _Entry]], rank: int,
                 fn: Callable[[], object]) -> None:
    """Run ``module``'s own init on its new local blocks, leaving parameters it does not own alone."""
    spans: list[tuple[str, _Entry, nn.Parameter]] = []
    for attr, entry in to_init:
        layout = entry.layout
        if layout is not None and layout.pieces is not None and layout.boxes[rank] is not None:
            # A packed block is filled through a scratch covering the span of its slices, so the
            # init sees one block of the global tensor; then the slices are copied out.
            dim = layout.dim
            first, last = layout.pieces[rank][0], layout.pieces[rank][-1]
            offsets, sizes = list(entry.box(rank)[0]), list(entry.box(rank)[1])
            sizes[dim] = last[0] + last[1] - first[0]  # type: ignore[index]
            span = nn.Parameter(torch.empty(sizes, dtype=entry.new.dtype, device=entry.new.device),  # type: ignore[union-attr]
                                requires_grad=False)
            ctx.register(span, entry.name, entry.shape, tuple(offsets))
            spans.append((attr, entry, span))
            continue
        ctx.register(entry.new, entry.name, entry.shape, entry.box(rank)[0])  # type: ignore[arg-type]
    # Parameters initialized elsewhere (tied to an earlier module) or holding real values are
    # swapped for scratch tensors, so this module's reset cannot overwrite them.
    swapped = {}
    for attr, entry in others:
        scratch = nn.Parameter(torch.empty_like(entry.new), requires_grad=False)  # type: ignore[arg-type]
        ctx.register(scratch, f"{entry.name}#scratch", entry.shape, entry.box(rank)[0])
        swapped[attr] = module._parameters[attr]
        module._parameters[attr] = scratch
    for attr, _, span in spans:
        swapped[attr] = module._parameters[attr]
        module._parameters[attr] = span
    padding = None
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        # Embedding zeroes weight[padding_idx] by local index; do it by global index instead.
        padding, module.padding_idx = module.padding_idx, None
    try:
        with ctx.module_scope(mod_name), torch.no_grad():
            fn()
    finally:
        if padding is not None:
            module.padding_idx = padding  # type: ignore[assignment]
        module._parameters.update(swapped)
    for _, entry, span in spans:
        layout = entry.layout
        assert layout is not None and layout.pieces is not None and layout.dim is not None
        base = layout.pieces[rank][0][0]
        with torch.no_grad():
            entry.new.copy_(torch.cat([span.narrow(layout.dim, start - base, length)  # type: ignore[union-attr]
                                       for start, length in layout.pieces[rank]], layout.dim))
    if padding is not None:
        for attr, entry in to_init:
            if attr != "weight":
                continue
            box_offsets, box_sizes = entry.box(rank)
            if box_offsets[0] <= padding < box_offsets[0] + box_sizes[0]:
                with torch.no_grad():
                    entry.new[padding - box_offsets[0]].fill_(0)  # type: ignore[index]


def _finish(model: nn.Module, entries: Sequence[_Entry], group: _comm.ProcessGroup) -> None:
    """Attach the records of the new parameters, mark the ones they replace, and install the state_dict hooks."""
    _guard.retire((e.name, e.param) for e in entries if e.new is not None and e.new is not e.param)
    for entry in entries:
        if entry.layout is not None:
            attach(entry.new, entry.sharded(group))  # type: ignore[arg-type]
    for module in dict.fromkeys(m for _, m in model.named_modules()):
        if module._parameters:
            install_hooks(module)  # also unsharded ones: they take a ShardedTensor's full tensor


def shard_parameter(module: nn.Module, param_name: str, sharding_spec: PlacementSpec, src_rank: int = 0,
                    process_group: _comm.ProcessGroup = None) -> None:
    """Replace ``module``'s parameter ``param_name`` by this rank's block of it, in place. Collective.

    The parameter on ``src_rank`` is the source of truth (other ranks may hold it on the meta
    device); each rank receives only its block. ``param_name`` may be dotted
    (``"net1.weight"``). If the owning module is an ``nn.Linear`` or ``nn.Embedding`` its
    forward becomes the sharded one; a split that cannot be computed is refused.

    Raises:
        ValueError: unknown parameter, already sharded, invalid or uncomputable spec, or a
            source parameter on the meta device.
        TypeError: ``sharding_spec`` is not a tensor spec.

    Example:
        >>> # 2 ranks: split fc1 = nn.Linear(4, 10) by output features, rows 0-4 on rank 0, 5-9 on rank 1
        >>> shard_parameter(model.fc1, "weight", single_split(0, ["rank:0/cpu", "rank:1/cpu"]))  # doctest: +SKIP
        >>> model.fc1.weight.shape  # doctest: +SKIP
        torch.Size([5, 4])
    """
    rank, world = _comm.rank_and_world(process_group)
    if not isinstance(sharding_spec, _TENSOR_SPECS):
        msg = (f"shard_parameter takes a tensor spec (SingleSplitShardingSpec, MeshShardingSpec, DevicePlacement, "
               f"EnumerableShardingSpec), got {type(sharding_spec).__name__}; use shard_model for a composite spec.")
        raise TypeError(msg)
    if isinstance(src_rank, bool) or not isinstance(src_rank, int) or not 0 <= src_rank < world:
        msg = f"src_rank={src_rank!r} is outside the world of {world} ranks; use 0..{world - 1}."
        raise ValueError(msg)
    entries = [e for e in _collect(module) if param_name in e.aliases]
    if not entries:
        names = [n for n, _ in module.named_parameters()]
        msg = f"{type(module).__name__} has no parameter {param_name!r}; its parameters are {names}."
        raise ValueError(msg)
    entry = entries[0]
    for _, owner, attr in entry.owners:
        if attr in sharded_parameters(owner):
            msg = f"parameter {param_name!r} is already sharded; shard it once."
            raise ValueError(msg)
    entry.spec = sharding_spec
    entry.layout = _layout(entry, world)
    plans = _plans(module, [entry], process_group)
    _agree_on_model([entry], sharding_spec, src_rank, None, process_group, world, "shard_parameter")
    _assign_sources([entry], src_rank)
    entry.new = _new_param(entry, rank, process_group, src_rank, torch.device("cpu"))
    for _, owner, attr in entry.owners:
        owner._parameters[attr] = entry.new
    _finish(module, [entry], process_group)
    for _, owner, plan in plans.values():
        _parallel.install(owner, plan)
