"""Conversions between ``ShardedTensor`` and PyTorch's ``DTensor``, sharing local data.

A DTensor describes its layout as a ``DeviceMesh`` plus one placement per mesh axis; the
layout of every rank follows from the global shape alone (``Shard`` splits like
``torch.chunk``, applied axis by axis from left to right). That is exactly the information a
``ShardedTensorMetadata`` holds, so both directions are metadata computations done on every
rank without communication, and the local tensor is handed over as it is: a view of the
same storage, never a copy.

Only layouts both sides can describe convert. DTensor cannot describe several shards per
rank, arbitrary block positions or uneven splits other than ``torch.chunk``'s. Pending
reductions convert when every mesh axis is ``Partial`` with one reduce op: that is a
``PartialSpec`` over the mesh's ranks. shardkit cannot describe ``_StridedShard``
(interleaved rows) or ``Partial`` beside ``Shard``/``Replicate`` axes (a reduction over only
some ranks). Those raise ``ValueError`` naming the layout and the way out.

``torch.distributed.tensor`` is imported lazily: importing ``sharded_tensor`` stays cheap and
works where DTensor is unavailable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from _shardkit import comm as _comm
from _shardkit.dtensor import is_dtensor
from sharding import RemoteDevice, ShardedTensorMetadata, ShardMetadata

from ._dtensor_layout import _check_placements, _describe, _device_name, _mesh_ranks, _partial_op, dtensor_layout
from ._tensor import ShardedTensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["from_dtensor", "is_dtensor"]


def from_dtensor(dtensor: DTensor, *, process_group: _comm.ProcessGroup = None) -> ShardedTensor:
    """A ``ShardedTensor`` with a DTensor's layout, sharing its local data (no copy, no communication).

    Every mesh rank gets one shard: the block its placements give it, computed like DTensor
    does (``Shard(d)`` splits like ``torch.chunk``, mesh axes apply left to right, so
    uneven last shards and empty shards match). ``Replicate`` axes become explicit replicas.
    ``Partial(op)`` on every mesh axis becomes a ``PartialSpec`` over the mesh's ranks.
    The local shard *is* the DTensor's local tensor (a detached view of the same storage):
    writing into one writes into the other, which is how ``checkpoint.load`` fills a DTensor
    state_dict in place.

    Args:
        dtensor: a ``torch.distributed.tensor.DTensor`` with ``Shard`` and ``Replicate``
            placements in the default (left-to-right) order, or ``Partial`` on every axis.
        process_group: the group the mesh's ranks belong to; ``None`` means the default group,
            whose ranks are the mesh's global ranks.

    Returns:
        A ``ShardedTensor`` whose shard ``i`` lives on the rank at flat mesh position ``i``.

    Raises:
        TypeError: ``dtensor`` is not a DTensor.
        ValueError: a ``_StridedShard`` placement, ``Partial`` beside other placements, a
            non-default shard order, a mesh whose ranks are not ranks of the group, or a local
            tensor whose shape is not the one DTensor's rules give (a ``DTensor.from_local``
            with custom shapes).

    Example:
        >>> # 4 ranks: a (10, 4) DTensor with Shard(0) -> rows 3/3/3/1, shared with the DTensor
        >>> dt = distribute_tensor(full, init_device_mesh("cpu", (4,)), [Shard(0)])  # doctest: +SKIP
        >>> t = st.from_dtensor(dt)  # doctest: +SKIP
        >>> t.local_shard().data_ptr() == dt.to_local().data_ptr()  # doctest: +SKIP
        True
    """
    if not is_dtensor(dtensor):
        msg = (f"from_dtensor expects a torch.distributed.tensor.DTensor, got {type(dtensor).__name__}; "
               f"use st.shard_tensor for a plain tensor.")
        raise TypeError(msg)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    spec = dtensor._spec
    where = f"from_dtensor(size={tuple(dtensor.shape)}, placements={_describe(spec.placements)})"
    _check_placements(spec.placements, dtensor.dim(), where)
    shard_order = getattr(spec, "shard_order", None)
    if shard_order is not None and not DTensorSpec.is_default_device_order(shard_order):
        msg = (f"{where}: the DTensor shards a dimension over mesh axes in a non-default order "
               f"(shard_order={shard_order!r}), which a ShardedTensor cannot describe; redistribute it "
               f"to the default left-to-right order first, or use dt.full_tensor().")
        raise ValueError(msg)
    mesh = dtensor.device_mesh
    rank, _ = _comm.rank_and_world(process_group)
    ranks = _mesh_ranks(mesh, process_group, where)
    local = dtensor._local_tensor.detach()
    partial = _partial_op(spec.placements)
    if partial is not None:
        return _from_partial(dtensor, local, ranks, partial, rank, process_group, where)
    layout = dtensor_layout(tuple(dtensor.shape), tuple(mesh.shape), spec.placements)
    shards: list[ShardMetadata] = []
    mine: int | None = None
    for coord, (offsets, sizes) in layout.items():
        owner = int(ranks[coord])
        if owner == rank:
            mine = len(shards)
            if tuple(local.shape) != sizes:
                msg = (f"{where}: rank {rank}'s local tensor has shape {tuple(local.shape)}, but DTensor's "
                       f"torch.chunk rule gives {sizes} at mesh coordinate {coord}; this DTensor was built "
                       f"with custom local shapes (DTensor.from_local(..., shape=...)). Redistribute it, or "
                       f"build the ShardedTensor with ShardedTensor.from_local_shards.")
                raise ValueError(msg)
        shards.append(ShardMetadata(offsets, sizes, RemoteDevice.of(owner, _device_name(mesh, owner, local, rank))))
    metadata = ShardedTensorMetadata(shards, tuple(dtensor.shape), dtensor.dtype)
    tensors = {} if mine is None else {mine: local}
    from sharding import EnumerableShardingSpec

    return ShardedTensor._make(tensors, metadata, EnumerableShardingSpec(metadata.shards), rank=rank,
                               group=process_group, requires_grad=dtensor.requires_grad)


def _from_partial(dtensor: DTensor, local: torch.Tensor, ranks: torch.Tensor, op: str, rank: int,
                  group: _comm.ProcessGroup, where: str) -> ShardedTensor:
    """Every mesh rank holds a full-size value pending ``op``: a ``PartialSpec`` over the mesh ranks."""
    from sharding import PartialSpec

    size = tuple(dtensor.shape)
    if tuple(local.shape) != size:
        msg = (f"{where}: rank {rank}'s local tensor has shape {tuple(local.shape)}, but a Partial DTensor "
               f"holds a full-size value {size} on every rank; rebuild it with DTensor.from_local(..., "
               f"shape=local.shape).")
        raise ValueError(msg)
    mesh = dtensor.device_mesh
    owners = [int(r) for r in ranks.flatten()]
    devices = [RemoteDevice.of(r, _device_name(mesh, r, local, rank)) for r in owners]
    spec = PartialSpec([str(d) for d in devices], reduce_op=op)
    metadata = spec.build_metadata(size, dtype=dtensor.dtype)
    tensors = {owners.index(rank): local} if rank in owners else {}
    return ShardedTensor._make(tensors, metadata, spec, rank=rank, group=group,
                               requires_grad=dtensor.requires_grad)
