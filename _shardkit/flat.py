"""Collectives of fully sharded data parallel: flat buffers, posted asynchronously, and its groups.

A fully sharded unit moves all its parameters in one collective each way: an all-gather
of every rank's (padded) shards into one buffer before compute, and a reduce-scatter of one
buffer of gradients after backward. Both are posted without waiting, so that the next
unit's parameters travel while this one computes (on Gloo the work runs on the process
group's own threads); ``PendingCollective.wait()`` completes them within the timeout rules of
``comm`` and raises ``CollectiveError`` like every other collective here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import comm, teardown

# Newer torch names these ``*_single`` and deprecates the ``*_tensor`` names; older torch has only those.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["PendingCollective", "start_all_gather", "start_reduce_scatter", "partition_group", "group_ranks"]


class PendingCollective:
    """A collective posted by ``start_all_gather`` / ``start_reduce_scatter``; ``wait()`` completes it.

    ``wait()`` may be called several times (later calls return at once). The buffers passed
    to the collective must stay alive and untouched until it returns.
    """

    __slots__ = ("_work", "_what", "_group", "_limit", "_started", "_count")

    def __init__(self, work: Any, what: str, group: comm.ProcessGroup, limit: float, count: int | None) -> None:
        self._work = work
        self._what = what
        self._group = group
        self._limit = limit
        self._started = time.monotonic()
        self._count = count

    def done(self) -> bool:
        """Whether ``wait()`` would return at once."""
        return self._work is None

    def wait(self) -> None:
        """Wait until the data has arrived; ``CollectiveError`` if a peer died or did not answer in time."""
        work, self._work = self._work, None
        if work is None:
            return
        try:
            comm._wait_work(work, self._started + self._limit, comm.default_device(self._group).type == "cpu")
        except Exception as exc:  # Gloo/NCCL raise RuntimeError or DistBackendError subclasses
            settle = min(max(self._started + self._limit - time.monotonic(), 0.0), comm._SETTLE_SECONDS)
            ranks = comm._arrivals.missing(self._group, self._count, settle) if self._count is not None else None
            raise comm._fail(self._what, exc, self._started, self._limit, ranks) from exc


_DONE = PendingCollective(None, "", None, 0.0, None)


def _post(what: str, group: comm.ProcessGroup, timeout: float | None, post: Any) -> PendingCollective:
    limit = comm.resolve_timeout(timeout)
    comm._begin(what)
    # Called in forward and backward passes: announce the arrival only inside an entry point,
    # as ``comm.all_reduce`` does (elsewhere a failure cannot name the missing ranks anyway).
    count = comm._arrivals.arrive(group) if comm._scopes() else None
    started = time.monotonic()
    try:
        work = post()
    except Exception as exc:
        raise comm._fail(what, exc, started, limit, None) from exc
    return PendingCollective(work, what, group, limit, count)


def _world(group: comm.ProcessGroup) -> int:
    return comm.rank_and_world(group)[1]


def start_all_gather(output: torch.Tensor, shard: torch.Tensor, group: comm.ProcessGroup = None, *,
                     timeout: float | None = None, what: str = "all_gather") -> PendingCollective:
    """Post an all-gather of every rank's ``shard`` into ``output`` (group-rank order); return at once. Collective.

    ``shard`` is 1-d and the same size on every rank; ``output`` is 1-d and ``world`` times
    as long. ``CommCounter`` records the bytes a ring all-gather puts on the wire from each
    rank, ``(world - 1)`` times the shard.
    """
    return _start("all_gather", _all_gather, output, shard, shard, group, timeout, what)


def start_reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: comm.ProcessGroup = None, *,
                         timeout: float | None = None, what: str = "reduce_scatter") -> PendingCollective:
    """Post a sum over ranks of ``full``, rank ``r`` receiving piece ``r`` into ``output``; return at once. Collective.

    ``full`` is 1-d and ``world`` times as long as ``output``. ``CommCounter`` records the
    bytes a ring reduce-scatter puts on the wire from each rank, ``(world - 1)`` pieces.
    """
    return _start("reduce_scatter", _reduce_scatter, output, full, output, group, timeout, what)


def _start(kind: str, collective: Any, output: torch.Tensor, source: torch.Tensor, piece: torch.Tensor,
           group: comm.ProcessGroup, timeout: float | None, what: str) -> PendingCollective:
    """Post ``collective(output, source)``; a ring moves ``piece`` ``world - 1`` times from each rank."""
    world = _world(group)
    if world == 1:
        output.copy_(source)
        return _DONE
    comm._record(kind, (world - 1) * piece.numel() * piece.element_size())
    return _post(what, group, timeout, lambda: collective(output, source, group=group, async_op=True))


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
