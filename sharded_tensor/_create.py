"""Creating ShardedTensors: factories (each rank allocates only its shards) and shard_tensor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from _shardkit import comm as _comm
from _shardkit.memory import empty_for_fill
from sharding import PlacementSpec, RemoteDevice, ShardedTensorMetadata, ShardMetadata

from ._fill import fill_normal_, fill_uniform_
from ._reshard import redistribute
from ._tensor import ShardedTensor, _build

__all__ = ["empty", "zeros", "ones", "full", "rand", "randn", "shard_tensor"]


def _sizes(size: tuple[object, ...], name: str) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    for s in size:
        if isinstance(s, PlacementSpec):
            msg = (f"{name}() got the sharding spec {s!r} among the sizes; pass it by keyword: "
                   f"{name}(*size, sharding_spec=spec).")
            raise TypeError(msg)
        if isinstance(s, bool) or not isinstance(s, int):
            msg = f"{name}() sizes must be ints, got {s!r} in size={size!r}."
            raise TypeError(msg)
    return tuple(size)  # type: ignore[arg-type]


def _create(name: str, size: tuple[int, ...], sharding_spec: PlacementSpec | None, dtype: torch.dtype | None,
            requires_grad: bool, pin_memory: bool, process_group: _comm.ProcessGroup,
            names: Sequence[str | None] | None,
            fill: Callable[[torch.Tensor, ShardMetadata, ShardedTensorMetadata], object]) -> ShardedTensor:
    if sharding_spec is None:
        msg = f"{name}() needs sharding_spec=, e.g. sharding.single_split(0, ['rank:0/cpu', 'rank:1/cpu'])."
        raise TypeError(msg)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    rank, world = _comm.rank_and_world(process_group)
    metadata = _build(sharding_spec, size, dtype, names, world)
    tensors = {}
    for i, shard in metadata.shards_on(rank):
        if pin_memory and shard.device.device.type == "cpu":
            tensor = torch.empty(shard.dims, dtype=dtype, pin_memory=True)
        else:
            tensor = empty_for_fill(shard.dims, dtype, shard.device.device)
        fill(tensor, shard, metadata)
        tensors[i] = tensor.requires_grad_(requires_grad)
    return ShardedTensor._make(tensors, metadata, sharding_spec, rank=rank, group=process_group,
                               names=tuple(names) if names is not None else None, requires_grad=requires_grad)


def empty(*size: int, sharding_spec: PlacementSpec | None = None, dtype: torch.dtype | None = None,
          requires_grad: bool = False, pin_memory: bool = False, process_group: _comm.ProcessGroup = None,
          names: Sequence[str | None] | None = None) -> ShardedTensor:
    """An uninitialized ShardedTensor, like ``torch.empty``; each rank allocates only its shards.

    SPMD: every rank calls it with the same arguments. No communication.

    Example:
        >>> t = empty(10, 4, sharding_spec=single_split(0, ["rank:0/cpu"]))
        >>> t.local_shard().shape
        torch.Size([10, 4])
    """
    return _create("empty", _sizes(size, "empty"), sharding_spec, dtype, requires_grad, pin_memory,
                   process_group, names, lambda t, s, m: None)


def zeros(*size: int, sharding_spec: PlacementSpec | None = None, dtype: torch.dtype | None = None,
          requires_grad: bool = False, pin_memory: bool = False, process_group: _comm.ProcessGroup = None,
          names: Sequence[str | None] | None = None) -> ShardedTensor:
    """A ShardedTensor of zeros, like ``torch.zeros``. SPMD; no communication."""
    return _create("zeros", _sizes(size, "zeros"), sharding_spec, dtype, requires_grad, pin_memory,
                   process_group, names, lambda t, s, m: t.zero_())


def ones(*size: int, sharding_spec: PlacementSpec | None = None, dtype: torch.dtype | None = None,
         requires_grad: bool = False, pin_memory: bool = False, process_group: _comm.ProcessGroup = None,
         names: Sequence[str | None] | None = None) -> ShardedTensor:
    """A ShardedTensor of ones, like ``torch.ones``. SPMD; no communication."""
    return _create("ones", _sizes(size, "ones"), sharding_spec, dtype, requires_grad, pin_memory,
                   process_group, names, lambda t, s, m: t.fill_(1))


def full(size: Sequence[int], fill_value: float | bool, sharding_spec: PlacementSpec, *,
         dtype: torch.dtype | None = None, requires_grad: bool = False, pin_memory: bool = False,
         process_group: _comm.ProcessGroup = None, names: Sequence[str | None] | None = None) -> ShardedTensor:
    """A ShardedTensor filled with ``fill_value``, like ``torch.full``. SPMD; no communication."""
    return _create("full", _sizes((size,), "full"), sharding_spec, dtype, requires_grad, pin_memory,
                   process_group, names, lambda t, s, m: t.fill_(fill_value))


def _shared_seed(process_group: _comm.ProcessGroup) -> int:
    # Drawn from torch's default generator, then taken from the group's first rank so that
    # replicas agree even when ranks were seeded differently.
    local = int(torch.randint(0, 2**62, (1,)).item())
    return _comm.broadcast_int(local, 0, process_group)


def rand(*size: int, sharding_spec: PlacementSpec | None = None, dtype: torch.dtype | None = None,
         requires_grad: bool = False, pin_memory: bool = False, process_group: _comm.ProcessGroup = None,
         names: Sequence[str | None] | None = None) -> ShardedTensor:
    """Uniform [0, 1) values, like ``torch.rand``. Collective (one broadcast of a seed).

    The value of each element depends only on the seed and its global index, so replicas are
    identical and the values do not depend on the layout.
    """
    seed = _shared_seed(process_group)
    return _create("rand", _sizes(size, "rand"), sharding_spec, dtype, requires_grad, pin_memory,
                   process_group, names, lambda t, s, m: fill_uniform_(t, seed, s.offsets, m.size))


def randn(*size: int, sharding_spec: PlacementSpec | None = None, dtype: torch.dtype | None = None,
          requires_grad: bool = False, pin_memory: bool = False, process_group: _comm.ProcessGroup = None,
          names: Sequence[str | None] | None = None) -> ShardedTensor:
    """Standard normal values, like ``torch.randn``. Collective (one broadcast of a seed).

    Layout-invariant like ``rand``.
    """
    seed = _shared_seed(process_group)
    return _create("randn", _sizes(size, "randn"), sharding_spec, dtype, requires_grad, pin_memory,
                   process_group, names, lambda t, s, m: fill_normal_(t, seed, s.offsets, m.size))


@_comm.collective("st.shard_tensor")
def shard_tensor(tensor: torch.Tensor | None, sharding_spec: PlacementSpec, src_rank: int = 0,
                 process_group: _comm.ProcessGroup = None) -> ShardedTensor:
    """Split ``tensor`` from ``src_rank`` over the ranks as ``sharding_spec`` says. Collective.

    ``tensor`` on ``src_rank`` is the source of truth; other ranks may pass ``None``. Each rank
    receives only its own shards and ``src_rank`` sends each rank only those: the full tensor
    crosses the network at most once in total.

    A rank that died or does not answer makes the others raise ``CollectiveError`` (naming
    the operation and the ranks that did not answer) at once when its connection closes, at
    the latest after ``SHARDKIT_TIMEOUT`` seconds (default 600); see the troubleshooting guide.

    Example:
        >>> # 4 ranks, a (10, 4) tensor split on dim 0 -> rows 3/3/3/1
        >>> t = shard_tensor(x, single_split(0, [f"rank:{r}/cpu" for r in range(4)]))  # doctest: +SKIP
        >>> t.local_shard().shape  # on rank 3  # doctest: +SKIP
        torch.Size([1, 4])
    """
    rank, world = _comm.rank_and_world(process_group)
    if not isinstance(src_rank, int) or not 0 <= src_rank < world:
        msg = f"src_rank={src_rank!r} is outside the world of {world} ranks; use 0..{world - 1}."
        raise ValueError(msg)
    def describe() -> dict[str, Any] | None:
        if rank != src_rank:
            return None
        if not isinstance(tensor, torch.Tensor):
            msg = (f"shard_tensor: src_rank {src_rank} must pass a tensor, got {type(tensor).__name__}; pass the "
                   f"full tensor on src_rank (other ranks may pass None).")
            raise TypeError(msg)
        return {"size": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                "device": str(tensor.device), "grad": tensor.requires_grad, "names": _names_of(tensor)}

    # Every rank learns the source tensor's description, or that src_rank has none (then all raise).
    _, described = _comm.agree("shard_tensor", describe, process_group, share=lambda d: d, error=TypeError)
    info: dict[str, Any] = described[src_rank]
    size = tuple(info["size"])
    dtype = getattr(torch, str(info["dtype"]))
    names = tuple(info["names"]) if info["names"] is not None else None
    target = _build(sharding_spec, size, dtype, names, world)
    source = ShardedTensorMetadata([ShardMetadata((0,) * len(size), size,
                                                  RemoteDevice.of(src_rank, str(info["device"])))], size, dtype)
    local = {}
    if rank == src_rank:
        assert tensor is not None
        local = {0: tensor.rename(None) if names is not None else tensor}  # type: ignore[attr-defined]
    tensors = redistribute(local, source, target, rank=rank, group=process_group)
    for t in tensors.values():
        t.requires_grad_(bool(info["grad"]))
    return ShardedTensor._make(tensors, target, sharding_spec, rank=rank, group=process_group, names=names,
                               requires_grad=bool(info["grad"]))


def _names_of(tensor: torch.Tensor) -> list[str | None] | None:
    # Named tensors are optional in torch builds; a tensor without names has none.
    names = getattr(tensor, "names", None)
    return list(names) if names is not None and any(n is not None for n in names) else None
