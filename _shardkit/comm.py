"""Every call into ``torch.distributed`` goes through here.

Keeping communication in one module makes it easy to count (``CommCounter``) and keeps the
rest of the package pure. Tensors travel on their own device: Gloo for CPU, NCCL for CUDA.
"""

from __future__ import annotations

import datetime
import json
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import teardown  # noqa: F401 - binds torch's default-group arguments before any group exists; exit hook

__all__ = ["CommCounter", "rank_and_world", "default_device", "exchange", "start_exchange", "all_gather_json",
           "gather_json", "broadcast_json", "all_gather_tensor", "CollectiveError",
           "broadcast_int", "all_reduce", "all_reduce_values", "barrier", "ProcessGroup", "agree", "DEFAULT_TIMEOUT"]

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group
"""A ``torch.distributed.ProcessGroup``; ``None`` means the default group."""

DEFAULT_TIMEOUT = 600.0
"""Seconds a collective entry point waits for its peers before raising ``CollectiveError``."""

T = TypeVar("T")

_active: list[CommCounter] = []
_lock = threading.Lock()


@dataclass
class CommCounter:
    """Count collectives and the bytes this rank sends inside a ``with`` block.

    Every communication shardkit does passes through one module, so the counts are exact.

    Example:
        >>> with CommCounter() as comm:
        ...     t.reshard(spec)  # doctest: +SKIP
        >>> comm.counts, comm.bytes_sent  # doctest: +SKIP
        (Counter({'send/recv': 1}), 8388608)
    """

    counts: Counter[str] = field(default_factory=Counter)
    bytes_by_op: Counter[str] = field(default_factory=Counter)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank put on the wire (payloads only)."""
        return sum(self.bytes_by_op.values())

    def __enter__(self) -> CommCounter:
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            _active.remove(self)

    def __str__(self) -> str:
        ops = ", ".join(f"{op}: {n} ({self.bytes_by_op[op]} B)" for op, n in sorted(self.counts.items()))
        return f"CommCounter({ops or 'no communication'})"


def _record(op: str, nbytes: int) -> None:
    for counter in _active:
        counter.counts[op] += 1
        counter.bytes_by_op[op] += nbytes


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group: ProcessGroup = None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; ``(0, 1)`` with no process group."""
    if not _initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def default_device(group: ProcessGroup = None) -> torch.device:
    """The device that collectives of ``group`` use for small tensors."""
    if _initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global(group: ProcessGroup, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def exchange(sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor],
             group: ProcessGroup = None) -> None:
    """Send ``sends[peer]`` to each peer and receive into ``recvs[peer]``, all at once.

    Collective over the peers named: the two sides of each transfer must name each other with
    tensors of equal byte size. Tensors must be contiguous.
    """
    start_exchange(sends, recvs, group).wait()


# Messages travel in pieces of at most this many bytes, so that a sender can put the first
# piece of a message on the wire while it is still packing the rest.
_PIECE_BYTES = 8 << 20


def _pieces(wire: torch.Tensor) -> list[torch.Tensor]:
    # The same rule on both sides of a transfer, so piece k meets piece k (tag k).
    return [wire[start:start + _PIECE_BYTES] for start in range(0, max(wire.numel(), 1), _PIECE_BYTES)]


class PendingExchange:
    """Transfers posted by ``start_exchange`` or ``send_ready``; ``wait()`` returns once all are complete."""

    __slots__ = ("_works", "_group", "_posted", "_recv_works")

    def __init__(self, group: ProcessGroup) -> None:
        self._works: list[Any] = []
        self._group = group
        self._posted: dict[int, int] = {}
        self._recv_works: dict[int, list[Any]] | None = {}

    def wait_recv(self, peer: int) -> None:
        """Wait until the message from ``peer`` has arrived (others may still be in flight).

        Lets a caller use messages in a fixed order as they come, e.g. to reduce partial
        values in rank order while later ones are still on the wire. Where the backend gives
        one handle for the whole batch (NCCL), this waits for everything.
        """
        if self._recv_works is None:
            self.wait()
            return
        done = self._recv_works.pop(peer, [])
        for work in done:
            work.wait()
        # A Gloo work must be waited for once only (a second wait waits for another message).
        self._works = [w for w in self._works if all(w is not d for d in done)]

    def send_ready(self, peer: int, message: torch.Tensor, ready: int) -> None:
        """Send the pieces of ``message`` that lie within its first ``ready`` bytes and are not sent yet.

        For a message being packed: call it as the packed prefix grows, and with
        ``ready = message.nbytes`` at the end. The receiver posts the whole message in
        ``start_exchange`` as usual. CPU (Gloo) only: on NCCL, sends posted one by one could
        queue behind receives on the same stream, so there the whole message goes in
        ``start_exchange``.
        """
        wire = _wire(message)
        pieces = _pieces(wire)
        done = self._posted.get(peer, 0)
        while done < len(pieces) and done * _PIECE_BYTES + pieces[done].numel() <= ready:
            self._works.append(dist.isend(pieces[done], _global(self._group, peer), group=self._group, tag=done))
            done += 1
            if done == len(pieces):
                _record("send/recv", wire.numel())
        self._posted[peer] = done

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()


def start_exchange(sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor],
                   group: ProcessGroup = None) -> PendingExchange:
    """Post the transfers of ``exchange`` and return at once; call ``wait()`` before using them.

    Collective like ``exchange``. Every send and receive goes in one ``batch_isend_irecv``
    (one NCCL group on CUDA), so no pair of ranks can block on the order of posting. The
    tensors must stay alive and untouched until ``wait()`` returns. More sends can follow
    with ``send_ready``.
    """
    pending = PendingExchange(group)
    ops = []
    recv_peers = []
    for peer, tensor in recvs.items():
        for k, piece in enumerate(_pieces(_wire(tensor))):
            ops.append(dist.P2POp(dist.irecv, piece, _global(group, peer), group, tag=k))
            recv_peers.append(peer)
    for peer, tensor in sends.items():
        for k, piece in enumerate(_pieces(_wire(tensor))):
            ops.append(dist.P2POp(dist.isend, piece, _global(group, peer), group, tag=k))
        _record("send/recv", tensor.numel() * tensor.element_size())
    if ops:
        works = dist.batch_isend_irecv(ops)
        pending._works.extend(works)
        if len(works) == len(ops):  # one handle per operation (Gloo): receives can be waited for by peer
            for peer, work in zip(recv_peers, works):
                pending._recv_works.setdefault(peer, []).append(work)  # type: ignore[union-attr]
        else:
            pending._recv_works = None
    return pending


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    # Bytes travel as uint8 so every dtype (bool, bfloat16, complex) takes the same path.
    return tensor.reshape(-1).view(torch.uint8)


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer died, left, or did not arrive within the timeout."""


def _wait(work: Any, timeout: float | None, what: str) -> None:
    """Wait for ``work``; raise ``CollectiveError`` naming ``what`` if it fails or times out."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # Gloo/NCCL raise RuntimeError or DistBackendError subclasses
        limit = f" within timeout={timeout:g} s" if timeout is not None else ""
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise CollectiveError(f"{what} did not complete{limit}: {first_line}") from exc


def _encode_json(value: object, device: torch.device) -> torch.Tensor:
    """``value`` as JSON bytes in a uint8 tensor on ``device``."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)


def _decode_json(buffers: list[torch.Tensor], lengths: list[int]) -> list[Any]:
    """Inverse of ``encode_json`` for the first ``lengths[i]`` bytes of each buffer."""
    return [json.loads(bytes(b[:n].cpu().numpy()).decode()) for b, n in zip(buffers, lengths)]


def _gather_lengths(n: int, group: ProcessGroup, timeout: float | None, what: str) -> list[int]:
    """Every rank's ``n``, in group rank order (also a barrier). Collective."""
    device = default_device(group)
    length = torch.tensor([n], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(lengths, length, group=group, async_op=True), timeout, what)
    return [int(x) for x in lengths]


def all_gather_json(value: object, group: ProcessGroup = None, *, timeout: float | None = None,
                    what: str = "all_gather") -> list[Any]:
    """Every rank's JSON-serializable ``value``, in group rank order. Collective.

    JSON rather than pickle: what one rank sends is only ever parsed as data. With
    ``timeout``, a rank that does not arrive within that many seconds (or died) makes it raise
    ``CollectiveError`` instead of hanging.
    """
    if not _initialized():
        return [json.loads(json.dumps(value))]
    payload = _encode_json(value, default_device(group))
    lengths = _gather_lengths(payload.numel(), group, timeout, what)
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=payload.device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in lengths]
    _wait(dist.all_gather(gathered, padded, group=group, async_op=True), timeout, what)
    _record("all_gather", 8 + longest)
    return _decode_json(gathered, lengths)


def broadcast_int(value: int, src: int = 0, group: ProcessGroup = None) -> int:
    """``value`` from group rank ``src`` on every rank. Collective."""
    if not _initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=default_device(group))
    dist.broadcast(tensor, _global(group, src), group=group)
    _record("broadcast", 8)
    return int(tensor.item())


def all_reduce(tensor: torch.Tensor, group: ProcessGroup = None, *, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over the group in place (``op``: ``"sum"`` or ``"max"``). Collective."""
    if _initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        _record("all_reduce", tensor.numel() * tensor.element_size())
    return tensor


_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def all_reduce_values(tensor: torch.Tensor, group: ProcessGroup = None, *, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place over every rank of the group (``op``: sum, avg, max, min). Collective.

    For a partial tensor held by every rank. ``"avg"`` is a sum divided by the world size
    on each rank, so it behaves the same on every backend. ``CommCounter`` records the bytes a
    bandwidth-optimal all-reduce puts on the wire from each rank, 2 (w-1)/w of the tensor
    (a reduce-scatter then an all-gather; Gloo's ring on CPU sends exactly that).
    """
    if not _initialized() or dist.get_world_size(group) == 1:
        return tensor
    world = dist.get_world_size(group)
    reduce_op = getattr(dist.ReduceOp, _REDUCE_OPS.get(op, "SUM"))
    dist.all_reduce(tensor, op=reduce_op, group=group)
    _record("all_reduce", 2 * (world - 1) * tensor.numel() // world * tensor.element_size())
    if op == "avg":
        tensor.div_(world)
    return tensor


def barrier(group: ProcessGroup = None) -> None:
    """Wait for every rank of the group. Collective."""
    if _initialized():
        dist.barrier(group=group)




# -- appended for sharded compute (sharded_tensor/_functional.py) ------------------------------

def all_gather_tensor(tensor: torch.Tensor, group: ProcessGroup = None) -> list[torch.Tensor]:
    """Every rank's ``tensor``, in group-rank order. Collective.

    All ranks pass tensors of the same shape and dtype (pad uneven pieces first); each rank
    receives every piece on ``tensor``'s own device. Without a process group (or in a world of
    one) the result is ``[tensor]``.
    """
    if not _initialized() or dist.get_world_size(group) == 1:
        return [tensor]
    tensor = tensor.contiguous()
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    _record("all_gather", tensor.numel() * tensor.element_size())
    return gathered



def gather_json(value: object, dst: int = 0, group: ProcessGroup = None, *, timeout: float | None = None,
                what: str = "gather") -> list[Any] | None:
    """Every rank's JSON ``value`` on group rank ``dst`` (in rank order), ``None`` elsewhere. Collective.

    The first step (an all_gather of payload sizes) is also a barrier: it completes only when
    every rank has arrived, or raises ``CollectiveError`` after ``timeout`` seconds.
    """
    if not _initialized():
        return [json.loads(json.dumps(value))]
    rank = dist.get_rank(group)
    payload = _encode_json(value, default_device(group))
    lengths = _gather_lengths(payload.numel(), group, timeout, what)
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=payload.device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in lengths] if rank == dst else None
    _wait(dist.gather(padded, gathered, dst=_global(group, dst), group=group, async_op=True), timeout, what)
    _record("gather", 8 + (longest if rank != dst else 0))
    if gathered is None:
        return None
    return _decode_json(gathered, lengths)


def broadcast_json(value: object, src: int = 0, group: ProcessGroup = None, *, timeout: float | None = None,
                   what: str = "broadcast") -> Any:
    """Group rank ``src``'s JSON ``value`` on every rank (others pass anything). Collective."""
    if not _initialized():
        return json.loads(json.dumps(value))
    device = default_device(group)
    rank = dist.get_rank(group)
    payload = _encode_json(value if rank == src else None, device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    _wait(dist.broadcast(length, _global(group, src), group=group, async_op=True), timeout, what)
    buffer = payload if rank == src else torch.empty(int(length), dtype=torch.uint8, device=device)
    _wait(dist.broadcast(buffer, _global(group, src), group=group, async_op=True), timeout, what)
    _record("broadcast", 8 + buffer.numel() if rank == src else 0)
    return _decode_json([buffer], [buffer.numel()])[0]


def agree(step: str, fn: Callable[[], T], group: ProcessGroup = None, *, timeout: float | None = DEFAULT_TIMEOUT,
          share: Callable[[T], object] | None = None, error: Callable[[str], Exception] = RuntimeError,
          lost: Callable[[CollectiveError], Exception] | None = None) -> tuple[T, list[Any]]:
    """Run ``fn`` on every rank, then make every rank learn every outcome. Collective.

    Each rank runs ``fn`` and reports either its failure or ``share(result)`` (JSON). A rank
    whose ``fn`` raised re-raises its own exception; every other rank raises
    ``error(message)`` naming ``step`` and each failed rank with its error, so no rank goes on
    while a peer has given up. A peer that does not report within ``timeout`` seconds (or
    died) makes every waiting rank raise ``CollectiveError`` naming ``step``, or
    ``lost(that error)`` when ``lost`` is given (so a caller can say what the lost peer means
    for its operation, in its own error type).

    Returns ``(result, shared)``: this rank's result and every rank's shared value, in group
    rank order (``None`` entries without ``share``).
    """
    result: Any = None
    failure: BaseException | None = None
    shared: object = None
    try:
        result = fn()
        shared = share(result) if share is not None else None
    except Exception as exc:  # reported to every rank below, so none is left waiting
        failure = exc
    report = {"error": None if failure is None else f"{type(failure).__name__}: {failure}", "value": shared}
    try:
        everyone = all_gather_json(report, group, timeout=timeout, what=step)
    except CollectiveError as exc:
        if failure is not None:
            raise failure from exc
        if lost is not None:
            raise lost(exc) from exc
        raise
    if failure is not None:
        raise failure
    failed = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"] is not None]
    if failed:
        raise error(f"{step} failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed))
    return result, [e["value"] for e in everyone]
