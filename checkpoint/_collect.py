"""Gather a sharded state_dict into full CPU tensors on one rank, one tensor at a time."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from _shardkit import comm as _comm
from _shardkit.memory import empty_for_fill
from sharded_tensor import ShardedTensor
from sharded_tensor._plan import Piece, plan_reshard
from sharding import RemoteDevice, ShardedTensorMetadata, ShardMetadata
from sharding.layout import box_slices

from ._dtensor import dtensor_views

__all__ = ["collect_state_dict"]


def collect_state_dict(state_dict: Mapping[str, Any], dst: int = 0, *,
                       process_group: _comm.ProcessGroup = None) -> dict[str, Any] | None:
    """Full CPU tensors on rank ``dst`` as a plain dict; ``None`` on every other rank. Collective.

    Every rank of ``process_group`` calls it with a state_dict of the same structure (the
    same keys, with ``ShardedTensor`` entries of equal size and dtype, in the same order), as
    ``model.state_dict()`` of a sharded model gives. The result keeps the state_dict's own
    structure: nested dicts stay nested, lists and tuples stay lists and tuples.

    - A ``ShardedTensor`` is gathered like ``ShardedTensor.gather(dst)`` (the same reshard
      plan): each rank sends its pieces straight to ``dst`` (a replicated region once), which
      receives them into place in the full tensor. For CPU shards ``dst`` copies its own
      pieces while the others arrive, into memory committed in one step rather than page by
      page as it is first written (see ``_shardkit.memory``); shards on another device
      go through ``gather`` and the result is moved to the CPU.
    - A ``DTensor`` (FSDP2, ``get_state_dict``) is gathered like the ``ShardedTensor`` of its
      layout (``st.from_dtensor``, no copy).
    - A plain ``torch.Tensor`` on ``dst`` is detached and moved to the CPU; like
      ``Module.state_dict()``, a tensor that already is on the CPU is returned as is (it
      shares storage with the caller's; ``clone()`` it to keep a snapshot).
    - Any other value (numbers, strings, ``None``, ...) is kept as is.

    Memory: tensors travel one at a time. On ``dst`` the peak is the full state dict plus
    one tensor's receive buffers; on other ranks it is their own shards plus one tensor's
    send buffers. Nothing full-size is ever allocated off ``dst``.

    Args:
        state_dict: a (possibly nested) mapping with ``ShardedTensor``, tensor and other values.
        dst: rank in ``process_group`` that receives the result.
        process_group: the group to collect over; ``None`` means the default group (or a
            world of one without ``torch.distributed``).

    Returns:
        On ``dst`` a new plain ``dict`` with full CPU tensors; ``None`` elsewhere.

    Raises:
        ValueError: ``dst`` outside the group, or the ranks passed state_dicts whose sharded
            entries differ (names, sizes or dtypes); raised on every rank, before any
            tensor is sent.
        TypeError: ``state_dict`` is not a mapping.

    Example:
        >>> # 4 ranks, a (10, 4) "w" split on dim 0 -> rows 3/3/3/1 gathered on rank 0
        >>> full = collect_state_dict(model.state_dict())  # doctest: +SKIP
        >>> full["w"].shape if rank == 0 else full  # doctest: +SKIP
        torch.Size([10, 4])       # on rank 0; None on ranks 1-3
    """
    if not isinstance(state_dict, Mapping):
        msg = (f"state_dict must be a mapping (e.g. model.state_dict()), got "
               f"{type(state_dict).__name__}.")
        raise TypeError(msg)
    rank, world = _comm.rank_and_world(process_group)
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world:
        msg = f"dst={dst!r} is outside the process group of {world} ranks; use a rank in 0..{world - 1}."
        raise ValueError(msg)

    state_dict, _ = dtensor_views(state_dict, process_group)
    sharded = list(_sharded_entries(state_dict))
    for name, value in sharded:
        _check_group(name, value, process_group)
    _check_same_everywhere(sharded, rank, world, process_group)

    gathered: dict[int, torch.Tensor | None] = {}
    scratch = _Scratch()
    # One tensor at a time: each allocates only its own full tensor (on dst), and the
    # pack/receive buffers are one scratch area reused from tensor to tensor.
    for _, value in sharded:
        metadata = value.sharding_metadata()
        if metadata.partial is None and all(s.device.device.type == "cpu" for s in metadata.shards):
            full = _gather_cpu(value, dst, rank, scratch)
        else:
            full = value.gather(dst)
            if full is not None and full.device.type != "cpu":
                full = full.cpu()
        gathered[id(value)] = full
    if rank != dst:
        return None
    return _rebuild(state_dict, gathered)  # type: ignore[no-any-return]


def _sharded_entries(value: Any, prefix: str = "") -> Iterator[tuple[str, ShardedTensor]]:
    """Every ``ShardedTensor`` in a nested state_dict, with its dotted name, in order."""
    if isinstance(value, ShardedTensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _sharded_entries(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _sharded_entries(item, f"{prefix}.{i}" if prefix else str(i))


def _check_same_everywhere(sharded: list[tuple[str, ShardedTensor]], rank: int, world: int,
                           group: _comm.ProcessGroup) -> None:
    """Refuse, on every rank, state_dicts whose sharded entries differ (instead of hanging)."""
    if world == 1:
        return
    mine = [[name, list(value.shape), str(value.dtype)] for name, value in sharded]
    everyone = _comm.all_gather_json(mine, group)
    for other, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            names0 = [e[0] for e in everyone[0]]
            names = [e[0] for e in theirs]
            if names != names0:
                missing = [n for n in names0 if n not in names]
                extra = [n for n in names if n not in names0]
                what = (f"rank {other} has sharded entries missing={missing}, unexpected={extra} "
                        f"compared with rank 0" if missing or extra else
                        f"rank {other} lists the sharded entries in another order than rank 0")
            else:
                diff = next(f"{a[0]!r} is {tuple(b[1])} {b[2]} on rank {other} but {tuple(a[1])} {a[2]} on rank 0"
                            for a, b in zip(everyone[0], theirs) if a != b)
                what = diff
            msg = (f"collect_state_dict: every rank must pass a state_dict with the same ShardedTensor "
                   f"entries in the same order, but {what}; pass each rank its model.state_dict() "
                   f"(this rank is {rank}).")
            raise ValueError(msg)


def _check_group(name: str, value: ShardedTensor, group: _comm.ProcessGroup) -> None:
    """``dst`` is a rank of ``group``, so every tensor must live on that very group."""
    own = value.process_group
    if own is group:
        return
    # None means the default group; an explicit group as large as the world is that group.
    world = _comm.rank_and_world(None)[1]
    other = group if own is None else own if group is None else None
    if other is not None and _comm.rank_and_world(other)[1] == world:
        return
    msg = (f"collect_state_dict: {name!r} lives on process group {own!r}, not on "
           f"process_group={group!r}; pass the group its ShardedTensors were created with.")
    raise ValueError(msg)


class _Scratch:
    """Pack and receive buffers reused from one tensor to the next (fresh memory is slow to fill).

    It grows to the largest need of any single tensor: at most one tensor's worth of bytes.
    """

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def reset(self, nbytes: int) -> None:
        """Start a new tensor needing ``nbytes`` of buffers in all."""
        if nbytes > self._buffer.numel():
            self._buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._buffer = empty_for_fill((nbytes,), torch.uint8)
        self._used = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat uninitialized tensor of ``numel`` elements from the buffer."""
        nbytes = numel * dtype.itemsize
        piece = self._buffer[self._used:self._used + nbytes]
        self._used += -(-nbytes // 64) * 64  # keep every piece 64-byte aligned
        return piece.view(dtype)


def _gather_cpu(value: ShardedTensor, dst: int, rank: int, scratch: _Scratch) -> torch.Tensor | None:
    """``value.gather(dst)`` for CPU shards, into a committed buffer, copying while receiving.

    Same plan as ``ShardedTensor.gather`` (``plan_reshard`` to one full shard on ``dst``: each
    region crosses the wire once, straight into its place when it is contiguous there); two
    differences make it faster on ``dst``: the full tensor comes from ``empty_for_fill``, and
    ``dst``'s own blocks are copied on a second thread while the peers' blocks arrive.
    """
    src = value.sharding_metadata()
    size, dtype = src.size, src.dtype
    origin = (0,) * len(size)
    target = ShardedTensorMetadata([ShardMetadata(origin, tuple(size), RemoteDevice.of(dst, "cpu"))], size, dtype)
    plan = plan_reshard(src, target, rank)
    indices = [i for i, _ in src.shards_on(rank)]
    local = {i: shard.tensor.detach() for i, shard in zip(indices, value.local_shards())}
    out = empty_for_fill(size, dtype) if rank == dst else None

    def src_view(p: Piece) -> torch.Tensor:
        return local[p.src_shard][box_slices(p.box, src.shards[p.src_shard].offsets)]

    def dst_view(p: Piece) -> torch.Tensor:
        assert out is not None
        return out[box_slices(p.box, origin)]

    with torch.no_grad():
        send_views = {peer: [src_view(p) for p in pieces] for peer, pieces in plan.sends.items()}
        recv_views = {peer: [dst_view(p) for p in pieces] for peer, pieces in plan.recvs.items()}
        packed = [views for views in (*send_views.values(), *recv_views.values()) if not _direct(views)]
        scratch.reset(sum(-(-sum(v.numel() for v in views) * dtype.itemsize // 64) * 64 for views in packed))
        sends = {peer: _pack(views, scratch) for peer, views in send_views.items()}
        recvs: dict[int, torch.Tensor] = {}
        unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for peer, views in recv_views.items():
            if _direct(views):
                recvs[peer] = views[0]
            else:
                recvs[peer] = scratch.take(sum(v.numel() for v in views), dtype)
                unpack.append((recvs[peer], views))

        def copy_local() -> None:
            with torch.no_grad():
                for p in plan.copies:
                    dst_view(p).copy_(src_view(p))

        copier = threading.Thread(target=copy_local, name="collect-local-copy") if plan.copies else None
        if copier is not None:
            copier.start()
        try:
            _comm.exchange(sends, recvs, value.process_group)
        finally:
            if copier is not None:
                copier.join()
        for buffer, views in unpack:
            start = 0
            for view in views:
                view.copy_(buffer[start:start + view.numel()].view(view.shape))
                start += view.numel()
    return out


def _direct(views: list[torch.Tensor]) -> bool:
    """Whether a peer's blocks can travel without a buffer (one contiguous block)."""
    return len(views) == 1 and views[0].is_contiguous()


def _pack(views: list[torch.Tensor], scratch: _Scratch) -> torch.Tensor:
    if _direct(views):
        return views[0]
    buffer = scratch.take(sum(v.numel() for v in views), views[0].dtype)
    start = 0
    for view in views:
        buffer[start:start + view.numel()].view(view.shape).copy_(view)
        start += view.numel()
    return buffer


def _rebuild(value: Any, gathered: dict[int, torch.Tensor | None]) -> Any:
    if isinstance(value, ShardedTensor):
        return gathered[id(value)]
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {key: _rebuild(item, gathered) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_rebuild(item, gathered) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(item, gathered) for item in value)
    return value
