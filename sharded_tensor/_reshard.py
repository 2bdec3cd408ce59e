"""Execute a reshard plan: local copies, one packed message per peer, unpack."""

from __future__ import annotations


import torch

from sharding import ShardedTensorMetadata

from . import _comm
from ._plan import Piece, ReshardPlan, box_slices, plan_reshard

__all__ = ["redistribute"]


def redistribute(local: dict[int, torch.Tensor], src: ShardedTensorMetadata, dst: ShardedTensorMetadata,
                 *, rank: int, group: _comm.ProcessGroup = None) -> dict[int, torch.Tensor]:
    """Move data laid out as ``src`` into new tensors laid out as ``dst``. Collective.

    Args:
        local: this rank's source shards, keyed by their index in ``src.shards``.
        src: the current layout.
        dst: the wanted layout (same size and dtype).
        rank: this process's rank in ``group``.
        group: the process group whose ranks the layouts name.

    Returns:
        This rank's destination shards, keyed by their index in ``dst.shards``.

    Peak extra memory is this rank's packing buffers, never the whole tensor: a block that is
    contiguous on both sides travels without any buffer.
    """
    plan = plan_reshard(src, dst, rank)
    out = {i: torch.empty(shard.dims, dtype=dst.dtype, device=shard.device.device)
           for i, shard in dst.shards_on(rank)}

    def src_view(p: Piece) -> torch.Tensor:
        return local[p.src_shard][box_slices(p.box, src.shards[p.src_shard].offsets)]

    def dst_view(p: Piece) -> torch.Tensor:
        return out[p.dst_shard][box_slices(p.box, dst.shards[p.dst_shard].offsets)]

    with torch.no_grad():
        sends = {peer: _pack([src_view(p) for p in pieces]) for peer, pieces in plan.sends.items()}
        recvs: dict[int, torch.Tensor] = {}
        unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for peer, pieces in plan.recvs.items():
            views = [dst_view(p) for p in pieces]
            if len(views) == 1 and views[0].is_contiguous():
                recvs[peer] = views[0]
            else:
                recvs[peer] = torch.empty(sum(v.numel() for v in views), dtype=dst.dtype, device=views[0].device)
                unpack.append((recvs[peer], views))
        # Local copies overlap with the transfers in flight on the wire.
        for p in plan.copies:
            dst_view(p).copy_(src_view(p))
        _comm.exchange(sends, recvs, group)
        for buffer, views in unpack:
            start = 0
            for view in views:
                view.copy_(buffer[start:start + view.numel()].view(view.shape))
                start += view.numel()
        for first, other in plan.duplicates:
            out[other].copy_(out[first])
    return out


def _pack(views: list[torch.Tensor]) -> torch.Tensor:
    if len(views) == 1 and views[0].is_contiguous():
        return views[0]
    buffer = torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype, device=views[0].device)
    start = 0
    for view in views:
        buffer[start:start + view.numel()].view(view.shape).copy_(view)
        start += view.numel()
    return buffer


def plan_bytes(plan: ReshardPlan, dtype: torch.dtype) -> int:
    """Bytes ``plan`` puts on the wire from its rank."""
    return plan.elements_sent() * torch.empty((), dtype=dtype).element_size()


