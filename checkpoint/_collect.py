"""Gather a sharded state_dict into full CPU tensors on one rank, one tensor at a time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from _shardkit import comm as _comm
from sharded_tensor import ShardedTensor

from ._dtensor import dtensor_views

__all__ = ["collect_state_dict"]


@_comm.collective("checkpoint.collect_state_dict")
def collect_state_dict(state_dict: Mapping[str, Any], dst: int = 0, *,
                       process_group: _comm.ProcessGroup = None) -> dict[str, Any] | None:
    """Full CPU tensors on rank ``dst`` as a plain dict; ``None`` on every other rank. Collective.

    Every rank of ``process_group`` calls it with a state_dict of the same structure (the
    same keys, with ``ShardedTensor`` entries of equal size and dtype, in the same order), as
    ``model.state_dict()`` of a sharded model gives. The result keeps the state_dict's own
    structure: nested dicts stay nested, lists and tuples stay lists and tuples.

    - A ``ShardedTensor`` is gathered by ``ShardedTensor.gather(dst)``: each rank sends its
      pieces straight to ``dst`` (a replicated region once), which receives them into place
      in the full tensor, copies its own pieces while the others arrive, and unpacks only
      blocks that are not contiguous there. Partial values are reduced on the way; shards on
      another device are gathered there and the result is moved to the CPU.
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
        ValueError: ``dst`` outside the group, an entry on another process group, or the
            ranks passed state_dicts whose sharded entries differ (names, sizes or dtypes);
            raised on every rank, before any tensor is sent.
        TypeError: ``state_dict`` is not a mapping.
        CollectiveError: a rank did not arrive within ``SHARDKIT_TIMEOUT``
            seconds (it died, or is not calling ``collect_state_dict``).

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

    def survey() -> tuple[Any, list[tuple[str, ShardedTensor]]]:
        views, _ = dtensor_views(state_dict, process_group)
        sharded = list(_sharded_entries(views))
        for name, value in sharded:
            _check_group(name, value, process_group)
        return views, sharded

    # Every rank learns every rank's sharded entries before any tensor is sent: a rank that
    # failed, or entries that differ, stop every rank here rather than leave one waiting.
    (views, sharded), everyone = _comm.agree(
        "collect_state_dict", survey, process_group, error=ValueError,
        share=lambda found: [[name, list(value.shape), str(value.dtype)] for name, value in found[1]])
    _check_same_everywhere(everyone, rank)

    gathered: dict[int, torch.Tensor | None] = {}
    # One tensor at a time, each gathered by its own reshard plan, so that only dst allocates
    # and only one tensor's messages are in flight.
    for _, value in sharded:
        full = value.gather(dst)
        if full is not None and full.device.type != "cpu":
            full = full.cpu()
        gathered[id(value)] = full
    if rank != dst:
        return None
    return _rebuild(views, gathered)  # type: ignore[no-any-return]


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


def _check_same_everywhere(everyone: list[Any], rank: int) -> None:
    """Refuse, on every rank, state_dicts whose sharded entries differ (instead of hanging)."""
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
                what = next(f"{a[0]!r} is {tuple(b[1])} {b[2]} on rank {other} but {tuple(a[1])} {a[2]} on rank 0"
                            for a, b in zip(everyone[0], theirs) if a != b)
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
