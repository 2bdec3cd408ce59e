"""The few collectives checkpoint needs, each with a timeout so that a dead rank never hangs a save.

Small JSON payloads only (metadata about what was written, error reports); tensor data never
travels between ranks in save or load. Every wait is bounded: ``timeout`` seconds after this
rank enters the collective, it raises ``CollectiveTimeout`` instead of hanging, and a peer
that died (its connection closed) makes it raise at once.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

from sharded_tensor._comm import ProcessGroup, default_device, rank_and_world

__all__ = ["CollectiveError", "ProcessGroup", "rank_and_world", "gather_json", "broadcast_json",
           "all_gather_json"]


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer died, left, or did not arrive within the timeout."""


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _global(group: ProcessGroup, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _wait(work: Any, timeout: float | None, what: str) -> None:
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # Gloo/NCCL raise RuntimeError or DistBackendError subclasses
        limit = f" within timeout={timeout:g} s" if timeout is not None else ""
        msg = f"{what} did not complete{limit}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
        raise CollectiveError(msg) from exc


def _encode(value: object, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)


def _lengths(n: int, group: ProcessGroup, timeout: float | None, what: str) -> list[int]:
    device = default_device(group)
    world = dist.get_world_size(group)
    length = torch.tensor([n], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    _wait(dist.all_gather(lengths, length, group=group, async_op=True), timeout, what)
    return [int(x) for x in lengths]


def all_gather_json(value: object, group: ProcessGroup = None, *, timeout: float | None = None,
                    what: str = "all_gather") -> list[Any]:
    """Every rank's JSON ``value``, in group rank order. Collective, bounded by ``timeout``."""
    if not _initialized():
        return [json.loads(json.dumps(value))]
    payload = _encode(value, default_device(group))
    lengths = _lengths(payload.numel(), group, timeout, what)
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=payload.device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in lengths]
    _wait(dist.all_gather(gathered, padded, group=group, async_op=True), timeout, what)
    return [json.loads(bytes(g[:n].cpu().numpy()).decode()) for g, n in zip(gathered, lengths)]


def gather_json(value: object, dst: int = 0, group: ProcessGroup = None, *, timeout: float | None = None,
                what: str = "gather") -> list[Any] | None:
    """Every rank's JSON ``value`` on group rank ``dst`` (in rank order), ``None`` elsewhere. Collective.

    The first step (an all_gather of payload sizes) is also a barrier: it completes only when
    every rank has arrived, or raises ``CollectiveError`` after ``timeout`` seconds.
    """
    if not _initialized():
        return [json.loads(json.dumps(value))]
    rank = dist.get_rank(group)
    payload = _encode(value, default_device(group))
    lengths = _lengths(payload.numel(), group, timeout, what)
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=payload.device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in lengths] if rank == dst else None
    _wait(dist.gather(padded, gathered, dst=_global(group, dst), group=group, async_op=True), timeout, what)
    if gathered is None:
        return None
    return [json.loads(bytes(g[:n].cpu().numpy()).decode()) for g, n in zip(gathered, lengths)]


def broadcast_json(value: object, src: int = 0, group: ProcessGroup = None, *, timeout: float | None = None,
                   what: str = "broadcast") -> Any:
    """Group rank ``src``'s JSON ``value`` on every rank (others pass anything). Collective."""
    if not _initialized():
        return json.loads(json.dumps(value))
    device = default_device(group)
    rank = dist.get_rank(group)
    payload = _encode(value if rank == src else None, device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    _wait(dist.broadcast(length, _global(group, src), group=group, async_op=True), timeout, what)
    buffer = payload if rank == src else torch.empty(int(length), dtype=torch.uint8, device=device)
    _wait(dist.broadcast(buffer, _global(group, src), group=group, async_op=True), timeout, what)
    return json.loads(bytes(buffer.cpu().numpy()).decode())
