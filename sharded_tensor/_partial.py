"""Reshards that start or end with partial values (``PartialSpec``).

From partial values, the data is reduced on its way to the new layout, and every element is
reduced exactly once:

- to a full replica on every rank of the group, one ``all_reduce`` (the backend's own,
  bandwidth-optimal algorithm, in place when nothing else refers to the local values);
- to any other layout, each holder sends each block's partial value straight to the rank
  that reduces that block (``reduce_layout``): for a split that is the block's owner, so a
  split costs each rank (k-1)/k of the tensor, the minimum of a reduce-scatter, and works
  for uneven splits, meshes and any dimension alike; replicas then receive the reduced
  chunks as in an all-gather.

Reductions run in holder rank order, each message used as soon as it has arrived, so the
result is the same on every rank and across runs.

To partial values, nothing is reduced: for ``"sum"`` one holder keeps each block's values
and the others hold zeros (a block already on a holder stays there, so a replica or a split
over the same ranks moves nothing); for ``"avg"``, ``"max"`` and ``"min"`` every holder
keeps the full values, as in a replica.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from _shardkit import comm as _comm
from _shardkit.memory import empty_for_fill, unshared
from sharding import ShardedTensorMetadata, ShardMetadata
from sharding.layout import Partial, Replicated, chunk_bounds

from ._move import _direct_or_staged, _Staging, move
from ._plan import (
    box_slices,
    keeper_layout,
    partial_holders,
    plan_reduce,
    reduce_layout,
)

__all__ = ["redistribute_partial"]

_FOLD: dict[str, Callable[..., torch.Tensor]] = {"sum": torch.add, "avg": torch.add, "max": torch.maximum,
                                                  "min": torch.minimum}


def redistribute_partial(local: dict[int, torch.Tensor], src: ShardedTensorMetadata, dst: ShardedTensorMetadata,
                         *, rank: int, group: _comm.ProcessGroup = None, reuse: bool = False
                         ) -> dict[int, torch.Tensor]:
    """``redistribute`` where ``src`` or ``dst`` (or both) hold partial values. Collective."""
    if src.pending is not None and dst.pending is not None:
        if src.pending != dst.pending:
            msg = (f"cannot reshard values pending reduce_op={src.pending.reduce_op!r} into partial values pending "
                   f"reduce_op={dst.pending.reduce_op!r}; reshard to a plain layout first (e.g. DevicePlacement('cpu') "
                   f"or a split), then to the new PartialSpec.")
            raise ValueError(msg)
        if src.shards == dst.shards:
            return local if reuse else {i: t.clone() for i, t in local.items()}
        # Other holders: reduce onto a split over the new holders, then spread it as partial values.
        middle = _split_over(dst)
        values = reduce_partial(local, src, middle, rank=rank, group=group, reuse=reuse)
        return to_partial(values, middle, dst, rank=rank, group=group, reuse=True)
    if src.pending is not None:
        return reduce_partial(local, src, dst, rank=rank, group=group, reuse=reuse)
    return to_partial(local, src, dst, rank=rank, group=group, reuse=reuse)


def _split_over(metadata: ShardedTensorMetadata) -> ShardedTensorMetadata:
    """A plain layout over the holders of a partial layout: the first dimension with room (else the longest) split."""
    size = tuple(metadata.size)
    devices = [s.device for s in sorted(metadata.shards, key=lambda s: s.rank)]  # type: ignore[arg-type, return-value]
    if not size:
        return ShardedTensorMetadata([ShardMetadata((), (), devices[0])], size, metadata.dtype)
    longest = max(range(len(size)), key=lambda d: size[d])
    dim = next((d for d, n in enumerate(size) if n >= len(devices)), longest)  # contiguous chunks when it can
    shards = [ShardMetadata(tuple(start if d == dim else 0 for d in range(len(size))),
                            tuple(length if d == dim else n for d, n in enumerate(size)), device)
              for device, (start, length) in zip(devices, chunk_bounds(size[dim], len(devices)))]
    return ShardedTensorMetadata(shards, size, metadata.dtype)


def _all_reduce_applies(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, world: int) -> bool:
    """Every rank of the group holds a partial value and wants the whole tensor on the same device."""
    if world == 1 or len(src.shards) != world or not isinstance(dst.placement, Replicated) \
            or len(dst.shards) != world:
        return False
    src_device = {s.rank: s.device.device for s in src.shards}
    dst_device = {s.rank: s.device.device for s in dst.shards}
    return set(src_device) == set(range(world)) and src_device == dst_device


def reduce_partial(local: dict[int, torch.Tensor], src: ShardedTensorMetadata, dst: ShardedTensorMetadata,
                   *, rank: int, group: _comm.ProcessGroup = None, reuse: bool = False) -> dict[int, torch.Tensor]:
    """Reduce the partial values laid out as ``src`` into the plain layout ``dst``. Collective.

    Returns this rank's shards of ``dst`` by index. With ``reuse`` the caller gives up
    ``local``: an all-reduce then runs in place on it when nothing else refers to it.
    """
    assert src.pending is not None
    op = src.pending.reduce_op
    holders = partial_holders(src)
    _, world = _comm.rank_and_world(group)
    mine_index = next((i for i, _ in src.shards_on(rank)), None)
    with torch.no_grad():
        if _all_reduce_applies(src, dst, world):
            in_place = reuse and mine_index is not None and unshared(local, mine_index)
            buffer = local[mine_index] if in_place else local[mine_index].clone()  # type: ignore[index]
            (dst_index, _), = dst.shards_on(rank)
            return {dst_index: _comm.all_reduce_values(buffer, group, op=op)}
        target = reduce_layout(src, dst)
        plan = plan_reduce(src, target, rank)
        mine = local[mine_index] if mine_index is not None else None
        zero = (0,) * len(src.size)

        def own_part(i: int) -> torch.Tensor:
            return mine[box_slices(target.shards[i].region, zero)]  # type: ignore[index]

        out = {i: empty_for_fill(target.shards[i].dims, src.dtype, target.shards[i].device.device)
               for i in plan.reduces}
        sends, packs = _direct_or_staged({peer: [own_part(i) for i in blocks] for peer, blocks in plan.sends.items()})
        staging = _Staging(views for _, views in packs)
        for peer, views in packs:
            sends[peer] = staging.pack(views)
        device = target.shards[plan.reduces[0]].device.device if plan.reduces else torch.device("cpu")
        recvs = {peer: empty_for_fill((sum(target.shards[i].numel for i in blocks),), src.dtype, device)
                 for peer, blocks in plan.recvs.items()}
        pending = _comm.start_exchange(sends, recvs, group)
        parts: dict[int, dict[int, torch.Tensor]] = {i: {} for i in plan.reduces}
        for peer, blocks in plan.recvs.items():
            start = 0
            for i in blocks:
                n = target.shards[i].numel
                parts[i][peer] = recvs[peer][start:start + n].view(target.shards[i].dims)
                start += n
        if mine is not None:
            for i in plan.reduces:
                parts[i][rank] = own_part(i).to(out[i].device)
        fold = _FOLD[op]
        # In holder order, each message as soon as it is in: the same order on every rank.
        for position, holder in enumerate(holders):
            if holder != rank and plan.reduces:
                pending.wait_recv(holder)
            for i in plan.reduces:
                if len(holders) == 1:
                    out[i].copy_(parts[i][holder])
                elif position == 1:
                    fold(parts[i][holders[0]], parts[i][holder], out=out[i])
                elif position > 1:
                    fold(out[i], parts[i][holder], out=out[i])
        if op == "avg":
            for i in plan.reduces:
                out[i].div_(len(holders))
        pending.wait()
        del parts, recvs, sends, packs
    if target.shards == dst.shards:
        for i, shard in dst.shards_on(rank):
            if i not in out:
                out[i] = torch.empty(shard.dims, dtype=dst.dtype, device=shard.device.device)
        return out
    return move(out, target, dst, rank=rank, group=group, reuse=True)


def to_partial(local: dict[int, torch.Tensor], src: ShardedTensorMetadata, dst: ShardedTensorMetadata,
               *, rank: int, group: _comm.ProcessGroup = None, reuse: bool = False) -> dict[int, torch.Tensor]:
    """Turn the plain layout ``src`` into partial values laid out as ``dst``. Collective.

    ``"sum"``: one holder keeps each block, the others hold zeros there. Other reductions:
    every holder keeps the full values.
    """
    replicas = ShardedTensorMetadata(dst.shards, dst.size, dst.dtype)
    if dst.pending != Partial("sum"):
        return move(local, src, replicas, rank=rank, group=group, reuse=reuse)
    keep = keeper_layout(src, dst)
    kept = move(local, src, keep, rank=rank, group=group, reuse=reuse)
    out: dict[int, torch.Tensor] = {}
    for i, shard in dst.shards_on(rank):
        blocks = keep.shards_on(rank)
        if len(blocks) == 1 and blocks[0][1].dims == shard.dims:
            out[i] = kept[blocks[0][0]]
            continue
        full = torch.zeros(shard.dims, dtype=dst.dtype, device=shard.device.device)
        for j, block in blocks:
            full[box_slices(block.region, (0,) * len(shard.dims))].copy_(kept[j])
        out[i] = full
    return out
