"""Execute a reshard plan: one message per peer, posted before the local copies, then unpack.

Copies are the cost to beat (on loopback Gloo a memory copy is about as fast as the wire), so
every block moves with as few of them as the layouts allow:

- the blocks for one peer that already lie back to back in memory (one contiguous block,
  or consecutive rows of one shard) travel straight from the shard, without packing;
- the blocks one peer sends that land back to back in a destination shard are received
  straight into it, without unpacking;
- only the rest goes through one staging buffer per device (for the whole call), packed and
  unpacked with one ``copy_`` per block (never a Python loop over elements).

All sends and receives are posted at once (``batch_isend_irecv``, so NCCL gets them as one
group); the local copies then run while the data is on the wire.

Measured alternatives (docs/benchmarks-history.md): one ``all_to_all_single`` over packed buffers
needs a copy on both sides for every block, and Gloo's ring ``all_gather_into_tensor`` moves
the same bytes in w-1 dependent steps; both were slower than direct point-to-point here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from _shardkit import comm as _comm
from _shardkit.memory import empty_for_fill, release_outside, sole_owner
from sharding import ShardedTensorMetadata

from ._plan import Piece, ReshardPlan, box_slices, plan_reshard

__all__ = ["move"]


def move(local: dict[int, torch.Tensor], src: ShardedTensorMetadata, dst: ShardedTensorMetadata,
         *, rank: int, group: _comm.ProcessGroup = None, reuse: bool = False) -> dict[int, torch.Tensor]:
    """Move data laid out as ``src`` into new tensors laid out as ``dst`` (both plain). Collective.

    The arguments and the result are ``_reshard.redistribute``'s. With ``reuse``, a destination
    shard that is a contiguous block of a source shard nothing else refers to keeps that
    memory, without a copy, and the rest of the source shard's pages go back to the OS. Peak
    extra memory is this rank's staging buffers (only for blocks that are not contiguous on
    their side), never the whole tensor.
    """
    plan = _plan_for(src, dst, rank)
    kept, spans = _blocks_to_keep(plan, local, src, dst) if reuse else ({}, {})
    out = {i: kept[i] if i in kept else empty_for_fill(shard.dims, dst.dtype, shard.device.device)
           for i, shard in dst.shards_on(rank)}

    def src_view(p: Piece) -> torch.Tensor:
        return local[p.src_shard][box_slices(p.box, src.shards[p.src_shard].offsets)]

    def dst_view(p: Piece) -> torch.Tensor:
        return out[p.dst_shard][box_slices(p.box, dst.shards[p.dst_shard].offsets)]

    with torch.no_grad():
        sends, packs = _direct_or_staged({peer: [src_view(p) for p in pieces]
                                          for peer, pieces in plan.sends.items()})
        recvs, unpacks = _direct_or_staged({peer: [dst_view(p) for p in pieces]
                                            for peer, pieces in plan.recvs.items()})
        staging = _Staging(views for _, views in (*packs, *unpacks))
        for peer, views in unpacks:
            recvs[peer] = staging.take(views)
        # On CPU, the pieces of a packed message go out as they are packed; NCCL needs every
        # send and receive in one group.
        progressive = bool(packs) and packs[0][1][0].device.type == "cpu"
        if not progressive:
            for peer, views in packs:
                sends[peer] = staging.pack(views)
        # No message in the plan (e.g. replicate -> split): no communication at all.
        pending = _comm.start_exchange(sends, recvs, group) if plan.sends or plan.recvs else None
        if pending is not None and progressive:
            for peer, views in packs:
                message = staging.take(views)
                for ready in _pack(message, views):
                    pending.send_ready(peer, message, ready)
        # Blocks already on this rank are copied while the others are on the wire.
        for p in plan.copies:
            if p.dst_shard not in kept:
                dst_view(p).copy_(src_view(p))
        if pending is not None:
            pending.wait()
        for peer, views in unpacks:
            _unpack(recvs[peer], views)
        for first, other in plan.duplicates:
            out[other].copy_(out[first])
    # Only now: sends and copies above read the source shards' other blocks.
    for index, keep in spans.items():
        release_outside(local[index].untyped_storage(), keep)
    return out


# Recent plans by (source layout, destination layout, rank): a training loop reshards between
# the same layouts every step, and planning is most of the cost of a reshard that moves little
# (replicate -> split moves nothing). Layouts are frozen values, compared by value; plans are
# only read by ``move``.
_PLANS: dict[tuple[ShardedTensorMetadata, ShardedTensorMetadata, int], ReshardPlan] = {}
_PLANS_KEPT = 16


def _plan_for(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, rank: int) -> ReshardPlan:
    key = (src, dst, rank)
    plan = _PLANS.get(key)
    if plan is None:
        plan = plan_reshard(src, dst, rank)
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.pop(next(iter(_PLANS)), None)  # the oldest
        _PLANS[key] = plan
    return plan


def _blocks_to_keep(plan: ReshardPlan, local: dict[int, torch.Tensor], src: ShardedTensorMetadata,
                    dst: ShardedTensorMetadata
                    ) -> tuple[dict[int, torch.Tensor], dict[int, list[tuple[int, int]]]]:
    """Destination shards that can stay where their data is: a contiguous block of one source shard.

    Returns those shards by destination index, and by source index the byte ranges of its
    storage they keep.

    Taking a row block out of a replica (or out of a coarser row split) then costs no copy.
    Only source shards whose memory nobody else can see qualify, since the pages around the
    kept blocks are released afterwards.
    """
    kept: dict[int, torch.Tensor] = {}
    spans: dict[int, list[tuple[int, int]]] = {}
    owned: dict[int, bool] = {}
    for p in plan.copies:
        if p.numel != math.prod(dst.shards[p.dst_shard].dims):
            continue  # only part of this destination shard is here
        if p.src_shard not in owned:
            owned[p.src_shard] = sole_owner(local, p.src_shard)
        if not owned[p.src_shard]:
            continue
        block = local[p.src_shard][box_slices(p.box, src.shards[p.src_shard].offsets)]
        start = int(block.storage_offset()) * block.element_size()
        end = start + block.numel() * block.element_size()
        taken = spans.setdefault(p.src_shard, [])
        if not block.is_contiguous() or any(lo < end and start < hi for lo, hi in taken):
            continue  # two destination shards must not share memory
        taken.append((start, end))
        # A fresh tensor on the same storage rather than a view: no ``_base`` pins the source
        # tensor, and autograd sees a leaf.
        kept[p.dst_shard] = torch.empty((0,), dtype=block.dtype).set_(
            block.untyped_storage(), block.storage_offset(), block.shape, block.stride())
    return kept, {i: taken for i, taken in spans.items() if taken}


def _direct_or_staged(views_by_peer: dict[int, list[torch.Tensor]]
                      ) -> tuple[dict[int, torch.Tensor], list[tuple[int, list[torch.Tensor]]]]:
    """Split peers into those whose blocks travel in place (one span) and those needing a buffer."""
    direct: dict[int, torch.Tensor] = {}
    staged: list[tuple[int, list[torch.Tensor]]] = []
    for peer, views in views_by_peer.items():
        span = _span(views)
        if span is None:
            staged.append((peer, views))
        else:
            direct[peer] = span
    return direct, staged


def _span(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat tensor over ``views`` if they lie back to back in one storage, in order; else None."""
    first = views[0]
    if not first.is_contiguous():
        return None
    if len(views) == 1:
        return first.reshape(-1)
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr() + first.numel() * first.element_size()
    total = first.numel()
    for view in views[1:]:
        if (not view.is_contiguous() or view.device != first.device
                or view.untyped_storage().data_ptr() != storage or view.data_ptr() != end):
            return None
        end += view.numel() * view.element_size()
        total += view.numel()
    return first.as_strided((total,), (1,), first.storage_offset())


class _Staging:
    """The messages of the blocks that are not contiguous on their side, carved out of one buffer per device.

    One allocation per call rather than one per message: a gather of many tensors in a row
    (``collect_state_dict``) then asks for buffers of one size again and again, which
    ``empty_for_fill`` hands back from its cache once they are large, and the allocator
    reuses whole when they are small.
    """

    def __init__(self, messages: Iterable[list[torch.Tensor]]) -> None:
        need: dict[torch.device, int] = {}
        for views in messages:
            device = views[0].device
            need[device] = need.get(device, 0) + _aligned(_nbytes(views))
        self._buffers = {device: empty_for_fill((n,), torch.uint8, device) for device, n in need.items()}
        self._used = dict.fromkeys(need, 0)

    def take(self, views: list[torch.Tensor]) -> torch.Tensor:
        """A flat uninitialized tensor with room for ``views``, of their dtype, on their device."""
        first = views[0]
        start, nbytes = self._used[first.device], _nbytes(views)
        self._used[first.device] = start + _aligned(nbytes)
        return self._buffers[first.device][start:start + nbytes].view(first.dtype)

    def pack(self, views: list[torch.Tensor]) -> torch.Tensor:
        buffer = self.take(views)
        for _ in _pack(buffer, views):
            pass
        return buffer


def _nbytes(views: list[torch.Tensor]) -> int:
    return sum(v.numel() for v in views) * views[0].element_size()


def _aligned(nbytes: int) -> int:
    # Every message starts on a 64-byte boundary: any dtype can view it, and copies stay aligned.
    return -(-nbytes // 64) * 64


# Packing goes in slabs of about this many bytes, each followed by a chance to send.
_SLAB_BYTES = 8 << 20


def _pack(buffer: torch.Tensor, views: list[torch.Tensor]) -> Iterator[int]:
    """Copy ``views`` one after another into ``buffer``; yield the bytes packed so far after each slab."""
    start = 0
    for view in views:
        if view.dim() == 0 or view.numel() == 0:
            buffer[start:start + view.numel()].view(view.shape).copy_(view)
            start += view.numel()
            yield start * buffer.element_size()
            continue
        per_row = view.numel() // view.shape[0]
        rows = max(1, _SLAB_BYTES // max(1, per_row * view.element_size()))
        for first in range(0, view.shape[0], rows):
            slab = view[first:first + rows]
            buffer[start:start + slab.numel()].view(slab.shape).copy_(slab)
            start += slab.numel()
            yield start * buffer.element_size()


def _unpack(buffer: torch.Tensor, views: list[torch.Tensor]) -> None:
    start = 0
    for view in views:
        view.copy_(buffer[start:start + view.numel()].view(view.shape))
        start += view.numel()


def plan_bytes(plan: ReshardPlan, dtype: torch.dtype) -> int:
    """Bytes ``plan`` puts on the wire from its rank."""
    return plan.elements_sent() * torch.empty((), dtype=dtype).element_size()
