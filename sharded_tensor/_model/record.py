"""The record of one sharded parameter: its layout, spec and group (``ShardedParameter``).

``shard_model``, ``shard_parameter`` and ``fully_shard`` make one record per sharded
parameter and :func:`attach` it to the parameter object, the one place it is kept. Every
part reads it from there: :func:`record_of` for a parameter (``clip_grad_norm_`` given a
list of parameters; the engine, which refuses a direct use of a split parameter), and
:func:`sharded_parameters` for a module's own parameters (the state-dict hooks here, the
optimizer state, ``fully_shard``). A parameter replaced in its module
(``load_state_dict(assign=True)`` included, see ``_load_hook``) takes its record along or
is no longer sharded; there is no second table to fall out of step. ``copy.deepcopy`` of a
sharded model (an EMA or teacher copy) gives the copy's parameters the same records
(``_KeepRecords``): a record names a layout, not a tensor, so original and copy share it.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from _shardkit import comm as _comm
from _shardkit import unfilled as _unfilled
from sharding import PlacementSpec, ShardedTensorMetadata
from sharding.layout import box_slices

from .._reshard import redistribute
from .._tensor import ShardedTensor, from_local, local_by_index
from .engine.dispatch import RECORD
from .parallel import ParamLayout

__all__ = ["ShardedParameter", "assemble", "attach", "record_of", "sharded_parameters", "install_hooks"]



@dataclass(frozen=True)
class ShardedParameter:
    """What shardkit knows about one sharded parameter.

    ``label`` names the parameter in messages (``"'0.weight' of module '0' (Linear)"``) when only
    its module may compute with it (a split parameter of ``shard_model``): the model's code
    using it directly would see this rank's block alone, so the engine refuses that. ``None``
    for parameters whose module gets them whole before computing (``fully_shard``'s) or that
    are whole on every rank.
    """

    layout: ParamLayout
    spec: PlacementSpec
    group: _comm.ProcessGroup
    compute_dim: int | None = None
    label: str | None = None

    @property
    def metadata(self) -> ShardedTensorMetadata:
        return self.layout.metadata

    def box(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, sizes)`` of ``rank``'s local tensor in the global tensor."""
        box = self.layout.boxes[rank]
        if box is not None:
            return box
        shape = self.layout.local_shape(rank, self.compute_dim)
        return ((0,) * len(shape), shape)

    def wrap(self, local: torch.Tensor, rank: int) -> ShardedTensor:
        """A ShardedTensor whose local shards are views of ``local`` (no copy, no communication)."""
        offsets, _ = self.box(rank)
        tensors = {}
        for i, shard in self.metadata.shards_on(rank):
            if self.layout.boxes[rank] is None:
                tensors[i] = local[box_slices(shard.region, offsets)]
                continue
            where = self.layout.local_region(rank, shard.region)
            whole = where == ((0,) * local.dim(), tuple(local.shape))
            tensors[i] = local if whole else local[box_slices(where, (0,) * local.dim())]
        metadata = self.metadata
        if local.dtype != metadata.dtype:  # e.g. model.double() after sharding
            metadata = metadata.with_dtype(local.dtype)
        return from_local(tensors, metadata, self.spec, rank=rank, group=self.group)

    def local_from(self, value: object, key: str, rank: int) -> torch.Tensor:
        """This rank's block of ``value`` (a ShardedTensor in any layout, or the full tensor)."""
        shape = self.layout.global_shape
        offsets, sizes = self.box(rank)
        if isinstance(value, ShardedTensor):
            if tuple(value.shape) != shape:
                msg = (f"size mismatch for {key}: the ShardedTensor has shape {tuple(value.shape)}, the model's "
                       f"parameter has {shape}.")
                raise ValueError(msg)
            source = value.sharding_metadata()
            if source == self.metadata.with_dtype(source.dtype):  # same shards, no pending reduction: ours as is
                pieces = local_by_index(value)
            else:
                target = self.metadata.with_dtype(source.dtype)
                pieces = redistribute(local_by_index(value), source, target, rank=rank, group=self.group)
            return assemble(pieces, self.layout, rank, sizes, source.dtype)
        if isinstance(value, torch.Tensor):
            if tuple(value.shape) != shape:
                msg = (f"size mismatch for {key}: got a tensor of shape {tuple(value.shape)}; this sharded "
                       f"parameter takes the full tensor of shape {shape} or a ShardedTensor.")
                raise ValueError(msg)
            if self.layout.boxes[rank] is None:
                return value[box_slices((offsets, sizes), (0,) * len(shape))]
            return self.layout.local_of(rank, value)
        msg = f"{key}: expected a ShardedTensor or a torch.Tensor, got {type(value).__name__}."
        raise ValueError(msg)


def assemble(pieces: Mapping[int, torch.Tensor], layout: ParamLayout, rank: int,
              sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``rank``'s local tensor from its shards (keyed by index in the layout's metadata)."""
    mine = layout.metadata.shards_on(rank)
    if len(mine) == 1 and layout.boxes[rank] is not None and tuple(mine[0][1].dims) == tuple(sizes):
        return pieces[mine[0][0]]
    device = mine[0][1].device.device if mine else torch.device("cpu")
    out = torch.empty(sizes, dtype=dtype, device=device)
    for i, shard in mine:
        out[box_slices(layout.local_region(rank, shard.region), (0,) * len(sizes))] = pieces[i]
    return out


def attach(param: torch.Tensor, record: ShardedParameter) -> None:
    """Record that ``param`` (this rank's local tensor) is laid out as ``record`` says."""
    setattr(param, RECORD, record)


def record_of(param: torch.Tensor) -> ShardedParameter | None:
    """The record of ``param``, or ``None`` for a parameter shardkit did not shard."""
    found = getattr(param, RECORD, None)
    return found if isinstance(found, ShardedParameter) else None


def sharded_parameters(module: nn.Module) -> dict[str, ShardedParameter]:
    """The sharded parameters of ``module`` itself (not its children), by attribute name."""
    return {attr: record for attr, param in module._parameters.items()
            if param is not None and (record := record_of(param)) is not None}


def install_hooks(module: nn.Module) -> None:
    """Make ``module``'s ``state_dict()`` and ``load_state_dict()`` read its records, and
    ``copy.deepcopy`` keep them (once per module)."""
    if "_shardkit_hooks" not in module.__dict__:
        module.__dict__["_shardkit_hooks"] = (module.register_state_dict_post_hook(_state_dict_hook),
                                              module.register_load_state_dict_pre_hook(_load_hook))
        module.__dict__["_shardkit_records"] = _KeepRecords(module)


class _KeepRecords:
    """Carries a module's records over ``copy.deepcopy`` of the module.

    ``nn.Parameter.__deepcopy__`` copies a parameter's data and ``requires_grad`` only, so the
    copy of a sharded parameter would lose its record (and the copy's ``state_dict`` its
    ``ShardedTensor``s). Kept in the module's ``__dict__``, this object is copied with the
    module: it then attaches each record to the copy of its parameter, found through the
    copy's own memo, so the copy's records are on the copy's parameters (whichever the
    module holds at copy time).
    """

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module | None) -> None:
        # A weak reference: a strong one would make every sharded module a reference cycle,
        # freed only by the cyclic garbage collector.
        self._module = weakref.ref(module) if module is not None else None

    def __reduce__(self) -> tuple[type[_KeepRecords], tuple[nn.Module | None]]:
        # Pickled with its module (torch.save(model)), it is rebuilt around the unpickled module.
        return (_KeepRecords, (self._module() if self._module is not None else None,))

    def __deepcopy__(self, memo: dict[int, Any]) -> _KeepRecords | None:
        module = self._module() if self._module is not None else None
        copied = memo.get(id(module)) if module is not None else None
        if module is None or not isinstance(copied, nn.Module):
            return None  # copied without its module: nothing to keep
        for param in module._parameters.values():
            record = record_of(param) if param is not None else None
            if param is not None and record is not None:
                attach(copy.deepcopy(param, memo), record)
        return _KeepRecords(copied)


def _state_dict_hook(module: nn.Module, state_dict: dict[str, object], prefix: str, local_metadata: object) -> None:
    for attr, sp in sharded_parameters(module).items():
        key = prefix + attr
        if key in state_dict:
            rank, _ = _comm.rank_and_world(sp.group)
            state_dict[key] = sp.wrap(state_dict[key], rank)  # type: ignore[arg-type]


def _load_hook(module: nn.Module, state_dict: dict[str, object], prefix: str, local_metadata: dict[str, object],
               strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    sharded = sharded_parameters(module)
    for attr, param in module._parameters.items():
        key = prefix + attr
        if param is None or key not in state_dict:
            continue
        value = state_dict[key]
        _unfilled.unmark(param)  # load_state_dict fills it (or raises)
        try:
            if attr in sharded:
                rank, _ = _comm.rank_and_world(sharded[attr].group)
                local = sharded[attr].local_from(value, key, rank)
                if local_metadata.get("assign_to_params_buffers"):
                    # load_state_dict(assign=True) installs this object as the parameter: it carries the record.
                    local = nn.Parameter(local, requires_grad=param.requires_grad)
                    attach(local, sharded[attr])
                state_dict[key] = local
            elif isinstance(value, ShardedTensor):
                state_dict[key] = value.full_tensor()
        except ValueError as exc:
            error_msgs.append(str(exc))
            del state_dict[key]
