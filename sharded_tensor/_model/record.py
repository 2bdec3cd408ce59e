"""The record of one sharded parameter: its layout, spec and group (``ShardedParameter``).

``shard_model``, ``shard_parameter`` and ``fully_shard`` attach one record per sharded
parameter to the module that owns it (``module.__dict__["_shardkit_params"]``, read with
``sharded_parameters``); the optimizer guard, the training helpers and the state-dict hooks
read the same record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from _shardkit import comm as _comm
from sharding import PlacementSpec, ShardedTensorMetadata
from sharding.layout import box_slices

from .._reshard import redistribute
from .._tensor import ShardedTensor
from .parallel import ParamLayout

__all__ = ["ShardedParameter", "assemble", "sharded_parameters"]


@dataclass(frozen=True)
class ShardedParameter:
    """What a module remembers about one of its sharded parameters."""

    layout: ParamLayout
    spec: PlacementSpec
    group: _comm.ProcessGroup
    compute_dim: int | None = None

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
            metadata = ShardedTensorMetadata(metadata.shards, metadata.size, local.dtype)
        return ShardedTensor._make(tensors, metadata, self.spec, rank=rank, group=self.group)

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
            if source.shards == self.metadata.shards:
                pieces = value._local_by_index()
            else:
                target = ShardedTensorMetadata(self.metadata.shards, shape, source.dtype)
                pieces = redistribute(value._local_by_index(), source, target, rank=rank, group=self.group)
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


def sharded_parameters(module: nn.Module) -> dict[str, ShardedParameter]:
    """The sharded parameters of ``module`` itself (not its children), by attribute name."""
    return dict(module.__dict__.get("_shardkit_params", {}))
