"""Collectives of fully sharded data parallel, as direct exchanges between the ranks, and its groups.

A fully sharded unit gathers its parameters before compute and reduce-scatters their
gradients after backward. Both move pieces straight between the tensors that hold them,
with point-to-point transfers posted at once (``comm.start_exchange``; on Gloo the
transport's own thread carries them, so the next unit's parameters travel while this one
computes):

* all-gather: this rank's rows of each parameter go, from the local parameter itself, to
  every other rank, and each rank's rows land directly in their place in the receiver's
  unsharded buffer. No packed send buffer, no gathered buffer to copy out of (Gloo's
  ``all_gather_into_tensor`` also stages the whole result in a buffer of its own and copies
  it out).
* reduce-scatter: the rows of each whole gradient that rank ``r`` holds go, from the
  gradient itself, to rank ``r``; each rank receives the other ranks' gradients of its
  own rows and sums them in rank order (the same order on every rank). Each rank sends
  ``(N - 1) / N`` of the gradients, what a ring reduce-scatter sends; Gloo's
  ``reduce_scatter_tensor`` is a copy of the whole input and an all-reduce of it, twice
  those bytes.

Each rank sends ``N - 1`` pieces of its shard, as a ring would; ``CommCounter`` records
them as one ``all_gather`` or ``reduce_scatter`` per call, with the byte count the caller
gives (the flat, padded segments). ``wait()`` on the returned exchange completes it within
the timeout rules of ``comm`` and raises ``CollectiveError`` like every other collective.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import comm, teardown

__all__ = ["start_gather", "start_scatter", "partition_group", "group_ranks"]


def start_gather(mine: Sequence[torch.Tensor], places: Sequence[Sequence[torch.Tensor]],
                 group: comm.ProcessGroup, group_rank: int, *, counted: int,
                 what: str) -> comm.PendingExchange:
    """Post the all-gather of pieces; return at once. Collective over ``group``.

    ``mine[i]`` is this rank's piece ``i`` (contiguous); ``places[i][r]`` is where rank ``r``'s
    piece ``i`` lands here (1-d views, the same sizes on every rank; the own place is left
    to the caller, who copies ``mine[i]`` while the transfers run). Empty pieces are skipped.
    ``counted`` bytes are recorded as one ``all_gather``.
    """
    world = len(places[0]) if places else 1
    if world == 1:
        return comm.start_exchange({}, {}, group, what=what)
    comm._record("all_gather", counted)
    sends = {r: [m.reshape(-1) for m, p in zip(mine, places) if p[group_rank].numel()]
             for r in range(world) if r != group_rank}
    recvs = {r: [p[r] for p in places if p[r].numel()] for r in range(world) if r != group_rank}
    return comm.start_exchange(sends, recvs, group, what=what, counted=False)


def start_scatter(pieces: Sequence[Sequence[torch.Tensor]], places: Sequence[Sequence[torch.Tensor | None]],
                  group: comm.ProcessGroup, group_rank: int, *, counted: int,
                  what: str) -> comm.PendingExchange:
    """Post the exchange of a reduce-scatter; return at once. Collective over ``group``.

    ``pieces[i][r]`` is this rank's part of piece ``i`` that rank ``r`` reduces (contiguous,
    1-d); ``places[i][r]`` is where rank ``r``'s part of piece ``i`` for this rank lands (the
    own entry unused). After ``wait()`` the caller sums them. Empty parts are skipped.
    ``counted`` bytes are recorded as one ``reduce_scatter``.
    """
    world = len(pieces[0]) if pieces else 1
    if world == 1:
        return comm.start_exchange({}, {}, group, what=what)
    comm._record("reduce_scatter", counted)
    sends = {r: [piece[r] for piece in pieces if piece[r].numel()] for r in range(world) if r != group_rank}
    recvs: dict[int, list[torch.Tensor]] = {}
    for r in range(world):
        if r != group_rank:
            recvs[r] = [place for part in places if (place := part[r]) is not None and place.numel()]
    return comm.start_exchange(sends, recvs, group, what=what, counted=False)


_groups: dict[tuple[tuple[int, ...], ...], list[Any]] = {}
_groups_lock = threading.Lock()
teardown.on_exit(_groups.clear)  # so that the groups are freed before the interpreter finalizes


def partition_group(partition: Sequence[Sequence[int]], rank: int) -> comm.ProcessGroup:
    """The process group of the part of ``partition`` holding global ``rank``. Collective over the world.

    ``partition`` lists disjoint groups of global ranks, identical on every rank; every rank
    calls this with it (a rank in no part gets ``None`` and must not use it). Groups are created once per partition and
    reused (creating a group is a collective of the whole world). A part equal to the world
    is the default group (``None``).
    """
    key = tuple(tuple(part) for part in partition)
    if len(key) == 1 and len(key[0]) == comm.rank_and_world(None)[1]:
        return None
    with _groups_lock:
        made = _groups.get(key)
        if made is None:
            made = [teardown.created(dist.new_group(list(part))) for part in key]
            _groups[key] = made
    for part, group in zip(key, made):
        if rank in part:
            return group
    return None  # a rank in no part: it never communicates within one


def group_ranks(group: comm.ProcessGroup) -> list[int]:
    """The global ranks of ``group`` in group-rank order (the world for ``None`` or no process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))
