"""``st.fully_shard`` and ``st.no_sync``: fully sharded data parallel on shardkit's parameters.

``fully_shard`` turns a module into one communication unit (see ``unit``). Each of its
parameters becomes the rank's rows of it, split on dim 0 like ``torch.chunk`` over the
data-parallel ranks, and is recorded exactly as ``shard_model`` records a split parameter
(``ShardedParameter`` on the owning module, the state-dict hooks, the optimizer-order
guard). Everything that works on a sharded model therefore works unchanged:
``model.state_dict()`` holds ``ShardedTensor`` s under the original names, checkpoints save
and load them in any layout, ``st.clip_grad_norm_`` counts each element once,
``st.get_state_dict`` / ``set_state_dict`` carry the optimizer state laid out like the
parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from _shardkit import comm as _comm
from _shardkit import flat as _flat
from sharding import EnumerableShardingSpec, RemoteDevice, ShardMetadata

from .._model import guard as _guard
from .._model.parallel import classify
from .._model.record import ShardedParameter, attach, install_hooks, sharded_parameters
from .plan import FlatParam, partition, plan_unit, shard_spec
from .unit import Unit, unit_of

__all__ = ["fully_shard", "no_sync"]

# Original parameter object -> the unit (by label) that replaced it, to refuse tied parameters across units.
_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The local parameters fully_shard created (to tell them from those shard_model split) -> the global
# ranks of the tensor-parallel group of the model they belong to, or None.
_ours: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _tensor_parallel(module: nn.Module) -> list[int] | None:
    """The global ranks of the tensor-parallel group of ``module``'s parameters, if ``shard_model`` split any."""
    for sub in module.modules():
        for attr, sp in sharded_parameters(sub).items():
            param = sub._parameters.get(attr)
            if param is None:
                continue
            if param not in _ours:
                return _flat.group_ranks(sp.group)
            if _ours[param] is not None:
                return list(_ours[param])
    return None


def _check_arguments(module: object, ranks: object, reshard_after_forward: object, param_dtype: object,
                     reduce_dtype: object) -> list[int] | None:
    if not isinstance(module, nn.Module):
        msg = f"fully_shard expects an nn.Module, got {type(module).__name__}."
        raise TypeError(msg)
    if not isinstance(reshard_after_forward, bool):
        msg = f"reshard_after_forward must be True or False, got {reshard_after_forward!r}."
        raise TypeError(msg)
    for label, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            msg = f"{label} must be a floating-point torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}."
            raise TypeError(msg)
    if ranks is None:
        return None
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) \
            or any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
        msg = f"ranks must be a list of global ranks (ints) or None, got {ranks!r}."
        raise TypeError(msg)
    return [int(r) for r in ranks]


def _check_ranks(given: list[int] | None, world: int, rank: int) -> None:
    if given is None:
        return
    outside = [r for r in given if not 0 <= r < world]
    if outside:
        msg = f"ranks={given} names ranks {outside} outside the world of {world}; use ranks in 0..{world - 1}."
        raise ValueError(msg)
    if len(set(given)) != len(given) or given != sorted(given):
        msg = f"ranks={given} must be distinct and in increasing order."
        raise ValueError(msg)
    if given and rank not in given:
        msg = (f"ranks={given} does not include this rank ({rank}); each rank passes the data-parallel group it "
               f"belongs to.")
        raise ValueError(msg)


def _collect(module: nn.Module) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """This unit's parameters: those under ``module`` outside nested units, with every owner slot."""
    nested: set[int] = set()
    found: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        if sub is not module and (unit_of(sub) is not None or id(sub) in nested):
            nested.update(id(m) for m in sub.modules())
            continue
        for attr, param in sub._parameters.items():
            if param is None:
                continue
            full = f"{name}.{attr}" if name else attr
            entry = found.setdefault(id(param), (full, param, []))
            if not any(m is sub and a == attr for m, a in entry[2]):
                entry[2].append((sub, attr))
    return list(found.values())


def _refuse(module: nn.Module, params: Sequence[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]) -> None:
    """Refuse what cannot be fully sharded, before anything changes."""
    if unit_of(module) is not None:
        msg = (f"this {type(module).__name__} is already fully sharded; apply fully_shard once per module (each block, "
               f"then the root).")
        raise ValueError(msg)
    for name, param, owners in params:
        if param in _replaced:
            msg = (f"parameter {name!r} is shared with {_replaced[param]}, which is fully sharded on its own; a "
                   f"parameter shared (tied) across units cannot be gathered by both. Apply fully_shard to a module "
                   f"that holds every use of it (e.g. leave the tied modules to the root).")
            raise ValueError(msg)
        if param in _ours:
            msg = (f"parameter {name!r} is already fully sharded (by an enclosing fully_shard); apply fully_shard "
                   f"to submodules before their parent.")
            raise ValueError(msg)
        for owner, attr in owners:
            sp = sharded_parameters(owner).get(attr)
            if sp is None:
                continue
            if sp.group is None:
                msg = (f"parameter {name!r} is split by shard_model over the whole world, which leaves no "
                       f"data-parallel ranks; shard_model over a tensor-parallel group (process_group=) to combine "
                       f"it with fully_shard.")
                raise ValueError(msg)
            if sp.layout.pieces is not None or any(box is None for box in sp.layout.boxes):
                msg = (f"parameter {name!r}: its tensor-parallel layout ({sp.layout.describe()}) is not one block "
                       f"on every rank of its group, which fully_shard cannot split further; give every rank one "
                       f"block of it.")
                raise ValueError(msg)


def _data_parallel_groups(tp_of: Sequence[list[int] | None], world: int) -> list[list[int]]:
    """Each rank's data-parallel group on a tensor-parallel model: the ranks at its place in the other groups."""
    if any(t is None for t in tp_of):
        missing = [r for r, t in enumerate(tp_of) if t is None]
        msg = (f"ranks {missing} see no tensor-parallel parameter under the module while the others do; shard the "
               f"same model with shard_model on every rank, or pass ranks=.")
        raise ValueError(msg)
    place = [t.index(r) for r, t in enumerate(tp_of)]  # type: ignore[union-attr]
    return [[w for w in range(world) if place[w] == place[r]] for r in range(world)]


def _composed_spec(tp_sp: ShardedParameter, tp_of: Sequence[list[int] | None], parts: Sequence[Sequence[int]],
                   device: torch.device, name: str) -> EnumerableShardingSpec:
    """Every global rank's block of a parameter ``shard_model`` split, the block's rows split over its group."""
    shards = []
    for part in parts:
        for group_rank, rank in enumerate(part):
            ranks = tp_of[rank]
            assert ranks is not None
            box = tp_sp.layout.boxes[ranks.index(rank)]
            assert box is not None  # refused before
            offsets, sizes = box
            rows = FlatParam(name, tuple(sizes), -(-sizes[0] // len(part)), 0).rows_of(group_rank)
            shards.append(ShardMetadata((offsets[0] + rows[0], *offsets[1:]), (rows[1], *sizes[1:]),
                                        RemoteDevice.of(rank, device)))
    return EnumerableShardingSpec(shards)


@_comm.collective("st.fully_shard")
def fully_shard(module: nn.Module, ranks: Sequence[int] | None = None, *, reshard_after_forward: bool = True,
                param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """Make ``module`` one fully sharded unit, in place, and return it. Collective.

    Applied as with FSDP2: to each block first, then to the root. The unit's parameters
    (those under ``module`` not in an already fully sharded submodule) become this rank's
    rows of each, split on dim 0 like ``torch.chunk`` over the data-parallel ranks (uneven
    sizes allowed; trailing ranks may hold none). ``model.parameters()`` yields those local
    shards as ``nn.Parameter`` s, so any ``torch.optim`` optimizer, built afterwards, steps
    them; ``model.state_dict()`` holds ``ShardedTensor`` s under the original names.

    Around the module's forward its parameters are gathered with one all-gather for the
    whole unit (the next unit's is posted before this one computes: prefetch), freed after
    forward when ``reshard_after_forward`` (the root keeps them: backward starts there),
    gathered again for backward, and their gradients reduce-scattered in one collective
    per unit, averaged over the data-parallel ranks and added to the local shards' ``.grad``
    at the end of backward. For gradient accumulation without communication, see
    [`no_sync`][sharded_tensor.no_sync].

    Every rank must hold the same model with the same values (build it under the same
    seed, or load a checkpoint afterwards). A model built on the meta device is never
    materialized whole: ``fully_shard`` on meta parameters records the layout and keeps
    this rank's rows on meta (no memory); ``st.shard_model(model, composite(), seed=...)``
    afterwards allocates only those rows and initializes them with the model's own
    initialization, layout-invariant (the values of the whole model built with the same
    seed, on any number of ranks); ``init=False`` instead leaves them for a
    ``checkpoint.load``.

    Args:
        module: the block (or root) to shard; modified in place.
        ranks: the global ranks this rank's data-parallel group holds, the same list on each of
            them (``None``: the whole world). The world must divide into such groups of one
            size; gradients are averaged within a group. ``[]`` on a rank: it holds no part
            (no rows; it takes part in the state dict's collectives, never computes), so a
            model can be fully sharded over some of the ranks, e.g. 3 of 4.
        reshard_after_forward: free the gathered parameters after forward (gather again for
            backward) rather than keep them until the end of backward.
        param_dtype: gather and compute in this dtype (e.g. ``torch.bfloat16``); the local
            shards, their gradients and the optimizer state keep the parameters' dtype.
            Floating-point inputs of the module are cast to it.
        reduce_dtype: reduce gradients in this dtype (default: ``param_dtype``, else the
            parameters' dtype).

    Returns:
        ``module``.

    Raises:
        ValueError: the module is already fully sharded; a parameter is already sharded, 0-d,
            or shared with another unit; ``ranks`` do not include this rank,
            name ranks outside the world, or the groups do not divide the world; the model
            differs between ranks. Raised identically on every rank, before anything changes.
        TypeError: an argument of the wrong type.
        CollectiveError: another rank died or did not answer in time.

    Example:
        >>> # 4 ranks: each decoder layer, then the whole model
        >>> for layer in model.model.layers:  # doctest: +SKIP
        ...     st.fully_shard(layer)
        >>> st.fully_shard(model)  # doctest: +SKIP
        >>> optim = torch.optim.AdamW(model.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> # a (10, 4) weight: rows 0-2, 3-5, 6-8, 9 on ranks 0-3
        >>> # From the meta device: only each rank's rows are ever allocated.
        >>> with torch.device("meta"):  # doctest: +SKIP
        ...     model = LlamaForCausalLM(config)
        >>> for layer in model.model.layers:  # doctest: +SKIP
        ...     st.fully_shard(layer)
        >>> st.fully_shard(model)  # doctest: +SKIP
        >>> st.shard_model(model, composite(), seed=0)  # doctest: +SKIP
    """
    rank, world = _comm.rank_and_world(None)
    requested = _check_arguments(module, ranks, reshard_after_forward, param_dtype, reduce_dtype)
    params = _collect(module)
    # A parameter shard_model split (tensor parallel) is split further: its local block, by rows.
    tensor_parallel = [sharded_parameters(owners[0][0]).get(owners[0][1]) for _, _, owners in params]
    tp_ranks = _tensor_parallel(module)
    names = [(name, tuple(p.shape)) for name, p, _ in params]
    global_shapes = [list(sp.layout.global_shape) if sp is not None else list(p.shape)
                     for (_, p, _), sp in zip(params, tensor_parallel)]

    def check() -> dict[str, object]:
        _check_ranks(requested, world, rank)
        _refuse(module, params)
        plan_unit(names, 1)  # refuses 0-d parameters
        return {"ranks": requested, "tp": tp_ranks,
                "params": [[n, s, str(p.dtype)] for (n, _), s, (_, p, _) in zip(names, global_shapes, params)]}

    _, everyone = _comm.agree("st.fully_shard", check, None, share=lambda v: v, error=ValueError)
    for other, entry in enumerate(everyone):
        if entry["params"] != everyone[0]["params"]:
            diff = [a for a, b in zip(everyone[0]["params"], entry["params"]) if a != b][:3]
            msg = (f"fully_shard must be given the same module on every rank, but ranks 0 and {other} differ "
                   f"(parameters, shapes or dtypes; first differences on rank 0: {diff}).")
            raise ValueError(msg)
    requested_all = [e["ranks"] for e in everyone]
    tp_of = [e["tp"] for e in everyone]
    if all(r is None for r in requested_all) and any(t is not None for t in tp_of):
        requested_all = _data_parallel_groups(tp_of, world)
    parts = partition(requested_all, world)
    mine = next((p for p in parts if rank in p), None)
    group = _flat.partition_group(parts, rank)
    # A rank outside every group (ranks=[]) holds no rows: the place after the last group rank.
    group_rank = mine.index(rank) if mine is not None else len(parts[0])
    plan = plan_unit(names, len(parts[0]))
    local: list[nn.Parameter] = []
    label = f"another fully sharded {type(module).__name__}"
    for (pname, param, owners), flat, tp_sp in zip(params, plan.params, tensor_parallel):
        start, length = flat.rows_of(group_rank)
        with torch.no_grad():
            shard = param.detach()[start:start + length].clone()
        new = nn.Parameter(shard, requires_grad=param.requires_grad)
        # Rows on the meta device are materialized later (shard_model) on the backend's device.
        device = _comm.default_device(group) if param.is_meta else param.device
        if tp_sp is None:
            spec = shard_spec(parts, flat.shape, device)
        else:
            spec = _composed_spec(tp_sp, tp_of, parts, device, pname)
        shape = tuple(global_shapes[len(local)])
        metadata = spec.build_metadata(shape, param.dtype, world_size=world)
        sp = ShardedParameter(classify(pname, metadata, world), spec, None)
        attach(new, sp)
        _ours[new] = tp_ranks
        for owner, attr in owners:
            owner._parameters[attr] = new
            install_hooks(owner)
        _replaced[param] = label
        local.append(new)
    _guard.retire(((pname, param) for pname, param, _ in params), by="fully_shard")
    unit = Unit(module, type(module).__name__, plan, local, [owners for _, _, owners in params], group=group,
                group_rank=group_rank, reshard_after_forward=reshard_after_forward,
                param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    unit.absent = mine is None
    module.__dict__["_shardkit_fsdp"] = unit
    unit.handles = [module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True),
                    # Also after a forward that raised: the slots get the local rows back.
                    module.register_forward_hook(unit.post_forward, with_kwargs=True, always_call=True)]
    return module


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Inside the block, backward passes of fully sharded units keep their gradients, unreduced.

    Gradient accumulation with ``fully_shard``: run every micro-batch but the last inside
    ``no_sync``; each unit adds its whole (unsharded) gradients into a buffer of its own, and
    the first backward outside the block reduce-scatters the sum once, so the local shards'
    ``.grad`` become the average over ranks of the sum over micro-batches, as one large batch
    would give (scale the loss by the number of micro-batches for a mean). The price is
    memory: each unit holds a whole gradient between micro-batches. Without ``no_sync``,
    each backward reduce-scatters and the local ``.grad`` s accumulate the results, which
    costs communication per micro-batch but no memory.

    Example:
        >>> with st.no_sync(model):  # doctest: +SKIP
        ...     for batch in micro_batches[:-1]:
        ...         loss_fn(model(batch)).backward()
        >>> loss_fn(model(micro_batches[-1])).backward()  # doctest: +SKIP
        >>> optim.step()  # doctest: +SKIP
    """
    units = [u for m in model.modules() if (u := unit_of(m)) is not None]
    if not units:
        msg = f"no_sync: {type(model).__name__} has no fully sharded module; apply st.fully_shard first."
        raise ValueError(msg)
    before = [u.sync for u in units]
    for unit in units:
        unit.sync = False
    try:
        yield
    finally:
        for unit, sync in zip(units, before):
            unit.sync = sync
