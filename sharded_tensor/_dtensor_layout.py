"""DTensor's placements as shardkit layouts, and a shardkit layout as a DTensor (``to_dtensor``).

Pure metadata computations plus ``DTensor.from_local``: no communication, and the local
tensor is handed over as it is. ``from_dtensor``, which builds a ``ShardedTensor``, lives in
``_dtensor``; this module does not need the ``ShardedTensor`` class, so the class can call
into it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from _shardkit import comm as _comm
from sharding import ShardedTensorMetadata

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["dtensor_layout", "to_dtensor"]

Region = tuple[tuple[int, ...], tuple[int, ...]]


def _describe(placements: Sequence[Any]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def _check_placements(placements: Sequence[Any], ndim: int, where: str) -> None:
    """Refuse placements shardkit cannot express, with the way out."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for axis, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            msg = (f"{where}: placement {placement!r} on mesh axis {axis} (placements "
                   f"{_describe(placements)}) interleaves rows across ranks, which a ShardedTensor cannot "
                   f"describe; redistribute the DTensor to plain Shard/Replicate placements first "
                   f"(dt.redistribute(mesh, [Shard(d) or Replicate(), ...])) or use dt.full_tensor().")
            raise ValueError(msg)
        if isinstance(placement, Shard):
            if not -ndim <= placement.dim < ndim:
                msg = (f"{where}: placement {placement!r} on mesh axis {axis} names a dimension outside a "
                       f"tensor of {ndim} dimensions.")
                raise ValueError(msg)
            continue
        if isinstance(placement, Replicate):
            continue
        if _partial_op(placements) is not None:
            continue
        kind = type(placement).__name__
        msg = (f"{where}: placement {placement!r} ({kind}) on mesh axis {axis} (placements "
               f"{_describe(placements)}) holds values pending a reduction over only some of the ranks, "
               f"which a ShardedTensor cannot describe (its PartialSpec reduces over every holder: "
               f"Partial on every mesh axis with one reduce op); reduce it first with "
               f"dt.redistribute(dt.device_mesh, [Replicate() or Shard(d) for each axis]) or dt.full_tensor().")
        raise ValueError(msg)


def _partial_op(placements: Sequence[Any]) -> str | None:
    """The reduce op when every placement is ``Partial`` with the same op, else ``None``."""
    from torch.distributed.tensor import Partial

    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    if len(ops) != 1 or not all(isinstance(p, Partial) for p in placements):
        return None
    op = str(ops.pop())
    return op if op in ("sum", "avg", "max", "min") else None


def dtensor_layout(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any]
                   ) -> dict[tuple[int, ...], Region]:
    """``{mesh coordinate: (offsets, sizes)}`` of every rank's block under DTensor's rules. Pure.

    Placements apply axis by axis from left to right, each ``Shard(d)`` splitting the block
    the previous axes left like ``torch.chunk`` (so trailing blocks may be empty; their offset
    is clamped to the end of the range). ``Replicate`` leaves the block whole.

    Example:
        >>> from torch.distributed.tensor import Shard, Replicate
        >>> dtensor_layout((10, 4), (4,), [Shard(0)])[(3,)]
        ((9, 0), (1, 4))
    """
    from torch.distributed.tensor import Shard

    ndim = len(global_shape)
    layout = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        offsets, sizes = [0] * ndim, list(global_shape)
        for axis, placement in enumerate(placements):
            if not isinstance(placement, Shard):
                continue
            d = placement.dim % ndim
            chunks = mesh_shape[axis]
            chunk = math.ceil(sizes[d] / chunks) if sizes[d] else 0
            start = min(coord[axis] * chunk, sizes[d])
            stop = min(start + chunk, sizes[d])
            offsets[d] += start
            sizes[d] = stop - start
        layout[coord] = (tuple(offsets), tuple(sizes))
    return layout


def _mesh_ranks(mesh: DeviceMesh, group: _comm.ProcessGroup, where: str) -> torch.Tensor:
    """The mesh's ranks as ranks of ``group`` (the default group unless given)."""
    import torch.distributed as dist

    ranks = mesh.mesh
    _, world = _comm.rank_and_world(group)
    if group is not None and dist.is_initialized():
        ranks = torch.tensor([dist.get_group_rank(group, int(r)) for r in ranks.flatten()]).reshape(ranks.shape)
    for axis in range(ranks.dim()):
        steps = ranks.movedim(axis, -1).diff(dim=-1) if ranks.shape[axis] > 1 else None
        if steps is not None and bool((steps <= 0).any()):
            msg = (f"{where}: the device mesh {mesh.mesh.tolist()} lists ranks in decreasing order along mesh "
                   f"axis {axis}; DTensor's collectives follow each axis's process group, whose ranks are "
                   f"sorted, so such a mesh order has no consistent DTensor layout. Build the mesh with "
                   f"increasing ranks along every axis, and reshard the ShardedTensor so that its blocks "
                   f"follow that order.")
            raise ValueError(msg)
    flat = sorted(int(r) for r in ranks.flatten())
    if flat[-1] >= world or flat[0] < 0 or len(set(flat)) != len(flat):
        msg = (f"{where}: the device mesh holds ranks {flat}, which are not distinct ranks of the process "
               f"group of {world} ranks; pass process_group= the group the mesh was built from (or build "
               f"the mesh over the whole world).")
        raise ValueError(msg)
    return ranks


def _device_name(mesh: DeviceMesh, rank: int, local: torch.Tensor, my_rank: int) -> str:
    if mesh.device_type == "cpu":
        return "cpu"
    if rank == my_rank and local.device.index is not None:
        return f"{local.device.type}:{local.device.index}"
    count = getattr(torch, mesh.device_type).device_count() if hasattr(torch, mesh.device_type) else 0
    return f"{mesh.device_type}:{rank % count}" if count else mesh.device_type


def _candidates(ndim: int, axes: int) -> list[tuple[Any, ...]]:
    from torch.distributed.tensor import Replicate, Shard

    options = [Replicate(), *(Shard(d) for d in range(ndim))]
    return list(itertools.product(options, repeat=axes))


def _layout_of(metadata: ShardedTensorMetadata) -> dict[int, list[Region]]:
    by_rank: dict[int, list[Region]] = {}
    for shard in metadata.shards:
        by_rank.setdefault(int(shard.rank if shard.rank is not None else -1), []).append(shard.region)
    return by_rank


def _same_region(a: Region, b: Region) -> bool:
    # Empty blocks hold no data: where DTensor and shardkit clamp their offset does not matter.
    if math.prod(a[1]) == 0 and math.prod(b[1]) == 0:
        return True
    return a == b


def _matches(layout: dict[tuple[int, ...], Region], ranks: torch.Tensor,
             held: dict[int, list[Region]]) -> bool:
    owners = set()
    for coord, region in layout.items():
        owner = int(ranks[coord])
        owners.add(owner)
        regions = held.get(owner, [])
        if len(regions) != 1 or not _same_region(regions[0], region):
            return False
    return set(held) <= owners


def to_dtensor(metadata: ShardedTensorMetadata, local: torch.Tensor | None, group: _comm.ProcessGroup,
               device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None) -> DTensor:
    """The ``DTensor`` on ``device_mesh`` with the layout ``metadata``, sharing ``local`` (no copy).

    ``local`` is this rank's one shard (``None`` when it holds none); ``group`` is the process
    group the layout's ranks belong to. See ``ShardedTensor.to_dtensor``.
    """
    from torch.distributed.tensor import DTensor

    size = tuple(metadata.size)
    where = f"to_dtensor(size={size}, mesh shape={tuple(device_mesh.shape)})"
    ranks = _mesh_ranks(device_mesh, group, where)
    held = _layout_of(metadata)
    pending = metadata.pending
    wanted = None if placements is None else _partial_op(tuple(placements))
    if pending is not None or wanted is not None:
        return _to_partial(metadata, local, device_mesh, ranks, held, placements, where)
    if placements is not None:
        placements = tuple(placements)
        if len(placements) != device_mesh.ndim:
            msg = (f"{where}: {len(placements)} placements {_describe(placements)} given for a mesh with "
                   f"{device_mesh.ndim} axes; give one placement per mesh axis.")
            raise ValueError(msg)
        _check_placements(placements, len(size), where)
        if not _matches(dtensor_layout(size, tuple(device_mesh.shape), placements), ranks, held):
            msg = (f"{where}: placements {_describe(placements)} give a layout other than this tensor's "
                   f"({_summary(held)}); reshard it first, e.g. "
                   f"t.reshard(single_split(0, [mesh ranks in mesh order])), or pass placements=None to infer "
                   f"them.")
            raise ValueError(msg)
        chosen = placements
    else:
        chosen = None
        for option in _candidates(len(size), device_mesh.ndim):
            if _matches(dtensor_layout(size, tuple(device_mesh.shape), option), ranks, held):
                chosen = option
                break
        if chosen is None:
            msg = (f"{where}: this ShardedTensor's layout ({_summary(held)}) has no DTensor equivalent on "
                   f"this mesh (DTensor needs exactly one block per mesh rank, split like torch.chunk along "
                   f"mesh axes in order); reshard it first to a spec DTensor can express, e.g. "
                   f"single_split(0, [f'rank:{{r}}/cpu' for r in mesh ranks]) for [Shard(0)], or use "
                   f"full_tensor().")
            raise ValueError(msg)
    if local is None:
        local = torch.empty((0,) * len(size), dtype=metadata.dtype, device=device_mesh.device_type)
    if local.device.type != device_mesh.device_type:
        msg = (f"{where}: the local shard is on {local.device} but the mesh is a {device_mesh.device_type!r} "
               f"mesh; reshard onto {device_mesh.device_type} devices or build the mesh for {local.device.type}.")
        raise ValueError(msg)
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(local, device_mesh, chosen, run_check=False, shape=torch.Size(size), stride=stride)


def _to_partial(metadata: ShardedTensorMetadata, local: torch.Tensor | None, device_mesh: DeviceMesh,
                ranks: torch.Tensor, held: dict[int, list[Region]], placements: Sequence[Placement] | None,
                where: str) -> DTensor:
    """Partial values on exactly the mesh's ranks become ``Partial(op)`` on every mesh axis."""
    from torch.distributed.tensor import DTensor, Partial

    found = metadata.pending
    if found is None:
        msg = (f"{where}: placements {_describe(tuple(placements or ()))} declare values pending a reduction, "
               f"but this ShardedTensor holds plain values; a DTensor built that way would reduce them "
               f"again. Pass placements=None (or Shard/Replicate placements).")
        raise ValueError(msg)
    pending = found.reduce_op
    expected = tuple(Partial(pending) for _ in range(device_mesh.ndim))
    if placements is not None and tuple(placements) != expected:
        msg = (f"{where}: this ShardedTensor holds values pending reduce_op={pending!r}, which only the "
               f"placements {_describe(expected)} describe, not {_describe(tuple(placements))}; reshard it to "
               f"a plain layout first to use Shard/Replicate placements.")
        raise ValueError(msg)
    size = tuple(metadata.size)
    mesh_ranks = sorted(int(r) for r in ranks.flatten())
    full = ((0,) * len(size), size)
    if sorted(held) != mesh_ranks or any(len(v) != 1 or v[0] != full for v in held.values()):
        msg = (f"{where}: the partial values are held by ranks {sorted(held)}, but a Partial DTensor needs one "
               f"full-size value on each mesh rank {mesh_ranks}; reshard it to PartialSpec over the mesh's "
               f"ranks first.")
        raise ValueError(msg)
    if local is None:  # not a mesh rank: an empty stand-in, as for plain layouts
        local = torch.empty((0,) * len(size), dtype=metadata.dtype, device=device_mesh.device_type)
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(local, device_mesh, expected, run_check=False, shape=torch.Size(size), stride=stride)


def _summary(held: dict[int, list[Region]]) -> str:
    parts = []
    for rank in sorted(held)[:8]:
        regions = held[rank]
        blocks = ", ".join(f"offsets={o} sizes={s}" for o, s in regions[:3]) + (" ..." if len(regions) > 3 else "")
        parts.append(f"rank {rank}: {len(regions)} block(s) {blocks}")
    return "; ".join(parts) + ("; ..." if len(held) > 8 else "")
