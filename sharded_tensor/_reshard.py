"""Reshard data between any two layouts of one tensor.

Plain layouts move by the plan executor (``_move``); partial values are reduced, or made, on
the way (``_partial``, which moves plain data with the same executor).
"""

from __future__ import annotations

import torch

from _shardkit import comm as _comm
from sharding import ShardedTensorMetadata

from ._move import move
from ._partial import redistribute_partial

__all__ = ["redistribute"]


def redistribute(local: dict[int, torch.Tensor], src: ShardedTensorMetadata, dst: ShardedTensorMetadata,
                 *, rank: int, group: _comm.ProcessGroup = None, reuse: bool = False) -> dict[int, torch.Tensor]:
    """Move data laid out as ``src`` into new tensors laid out as ``dst``. Collective.

    Args:
        local: this rank's source shards, keyed by their index in ``src.shards``.
        src: the current layout.
        dst: the wanted layout (same size and dtype).
        rank: this process's rank in ``group``.
        group: the process group whose ranks the layouts name.
        reuse: the caller gives up ``local``; a destination shard may then keep a source
            shard's memory instead of a copy (see ``_move.move``).

    Returns:
        This rank's destination shards, keyed by their index in ``dst.shards``. Without
        ``reuse`` they never share memory with ``local``.

    Either layout may hold partial values (a ``Partial`` placement): they are then reduced, or
    made, on the way.
    """
    if src.pending is not None or dst.pending is not None:
        return redistribute_partial(local, src, dst, rank=rank, group=group, reuse=reuse)
    return move(local, src, dst, rank=rank, group=group, reuse=reuse)
