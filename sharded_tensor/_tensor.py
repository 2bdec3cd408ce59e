"""The metadata-first ShardedTensor: this rank's shards plus the whole layout."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from _shardkit import comm as _comm
from sharding import (
    DevicePlacement,
    EnumerableShardingSpec,
    PartialSpec,
    PlacementSpec,
    RemoteDevice,
    ShardedTensorMetadata,
    ShardMetadata,
)
from sharding.layout import Partial, Replicated, check_reduce_op, check_tiling

from ._dtensor_layout import to_dtensor
from ._reshard import redistribute

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["Shard", "ShardedTensor"]

_FORMAT_VERSION = 1


@dataclass(slots=True, eq=False)
class Shard:
    """One local shard: the data and where it sits in the global tensor.

    Args:
        tensor: this rank's data for the shard, of size ``metadata.dims``.
        metadata: where the shard sits in the global tensor and which rank holds it.
    """

    tensor: torch.Tensor
    metadata: ShardMetadata


class ShardedTensor:
    """A tensor split over ranks; each rank holds its own shards and knows the whole layout.

    It is not a ``torch.Tensor``: it exposes its shards and layout so that code can work on the
    shards directly, and it moves data only when asked (``reshard``, ``gather``,
    ``full_tensor``). Build one with the factories (``st.empty``, ``st.zeros``, ...),
    ``st.shard_tensor`` or ``ShardedTensor.from_local_shards``; ``ShardedTensor(...)`` itself
    raises ``TypeError``. A sharded model's ``state_dict()`` holds one per split parameter.

    Example:
        >>> t = st.zeros(10, 4, sharding_spec=single_split(0, ["rank:0/cpu", "rank:0/cpu"]))
        >>> t.size(), [s.tensor.shape for s in t.local_shards()]
        (torch.Size([10, 4]), [torch.Size([5, 4]), torch.Size([5, 4])])
    """

    __slots__ = ("_metadata", "_spec", "_local", "_group", "_rank", "_names", "_requires_grad", "__weakref__")
    _metadata: ShardedTensorMetadata
    _spec: PlacementSpec | None
    _local: list[Shard]
    _group: _comm.ProcessGroup
    _rank: int
    _names: tuple[str | None, ...] | None
    _requires_grad: bool

    def __init__(self, *args: object, **kwargs: object) -> None:
        """Not called directly (it raises ``TypeError``): see the ways to build one above."""
        msg = ("ShardedTensor is not built directly; use st.empty/zeros/ones/full/rand/randn, "
               "st.shard_tensor or ShardedTensor.from_local_shards.")
        raise TypeError(msg)

    @classmethod
    def _make(cls, tensors: dict[int, torch.Tensor], metadata: ShardedTensorMetadata,
              spec: PlacementSpec | None, *, rank: int, group: _comm.ProcessGroup,
              names: tuple[str | None, ...] | None = None, requires_grad: bool | None = None) -> ShardedTensor:
        self = object.__new__(cls)
        self._metadata = metadata
        self._spec = spec
        self._local = [Shard(tensors[i], shard) for i, shard in metadata.shards_on(rank)]
        self._group = group
        self._rank = rank
        self._names = names
        # Kept on the object rather than read off local shards: a rank holding no shard must
        # still agree with the others.
        self._requires_grad = (any(t.requires_grad for t in tensors.values()) if requires_grad is None
                               else requires_grad)
        return self

    # -- construction from shards ---------------------------------------------------------

    @classmethod
    def from_local_shards(cls, local_shards: Sequence[Shard], size: Sequence[int] | int, *,
                          process_group: _comm.ProcessGroup = None, validate: bool = True,
                          reduce_op: str | None = None) -> ShardedTensor:
        """Build a ShardedTensor from each rank's ``st.Shard`` objects. Collective.

        With ``reduce_op`` (``"sum"``, ``"avg"``, ``"max"`` or ``"min"``) the shards are
        partial values pending that reduction, as a row-parallel matmul leaves them: each
        holding rank passes one full-size shard, and the tensor's layout is a ``PartialSpec``.

        Every rank passes its own shards (possibly none) and the same global ``size``. The
        ranks exchange their shard metadata (a few bytes each) so that every rank knows the
        whole layout. With ``validate`` they also check that the shards tile the tensor (no
        gap, no overlap except identical replicas), that every tensor matches its metadata,
        and that dtypes agree; a problem raises the same ``ValueError`` on every rank.

        Example:
            >>> # 2 ranks, a (4, 2) tensor split by rows
            >>> rows = slice(2 * rank, 2 * rank + 2)  # doctest: +SKIP
            >>> md = ShardMetadata((2 * rank, 0), (2, 2), f"rank:{rank}/cpu")  # doctest: +SKIP
            >>> t = ShardedTensor.from_local_shards([Shard(full[rows], md)], (4, 2))  # doctest: +SKIP
            >>> t.size(), t.local_shard().shape  # doctest: +SKIP
            (torch.Size([4, 2]), torch.Size([2, 2]))
        """
        size = (size,) if isinstance(size, int) else tuple(size)
        rank, world = _comm.rank_and_world(process_group)
        problems: list[str] = []
        mine = []
        for i, shard in enumerate(local_shards):
            if not isinstance(shard, Shard):
                problems.append(f"rank {rank}: local_shards[{i}] is {type(shard).__name__}, expected st.Shard")
                continue
            md, tensor = shard.metadata, shard.tensor
            if validate:
                if md.rank != rank:
                    problems.append(f"rank {rank}: local_shards[{i}] says device {str(md.device)!r}, "
                                    f"but it is passed on rank {rank}")
                if tuple(tensor.shape) != md.dims:
                    problems.append(f"rank {rank}: local_shards[{i}] tensor has shape {tuple(tensor.shape)} "
                                    f"but its metadata says dims={md.dims}")
                if tensor.device.type != md.device.device.type:
                    problems.append(f"rank {rank}: local_shards[{i}] tensor is on {tensor.device} "
                                    f"but its metadata says {md.device.device}")
            mine.append({**md.to_dict(), "dtype": str(tensor.dtype), "grad": tensor.requires_grad})
        def check_local() -> dict[str, Any]:
            if problems:
                raise ValueError("from_local_shards: " + "; ".join(p.rstrip(".") for p in problems) + ".")
            return {"shards": mine, "size": list(size)}

        # Every rank learns every rank's shards, or that some rank's are invalid (then all raise).
        _, everyone = _comm.agree("ShardedTensor.from_local_shards", check_local, process_group,
                                  share=lambda local: local, error=ValueError)
        all_shards = [s for r in everyone for s in r["shards"]]
        sizes = [tuple(r["size"]) for r in everyone]
        if any(s != sizes[0] for s in sizes):
            problems.append(f"ranks pass different sizes {dict(enumerate(sizes))}; every rank must pass "
                            f"the same global size")
        dtypes = sorted({s["dtype"] for s in all_shards})
        if validate:
            if len(dtypes) > 1:
                problems.append(f"shards have different dtypes {dtypes}; convert them to one dtype first")
            metadata_list = [ShardMetadata.from_dict(s) for s in all_shards]
            bad = [str(m.device) for m in metadata_list if m.rank is None or m.rank >= world]
            if bad:
                problems.append(f"shard devices {bad} name ranks outside the world of {world}")
            if not problems:
                try:
                    check_tiling(metadata_list, size, what="local shards")
                except ValueError as exc:
                    problems.append(str(exc))
        if problems:
            msg = "from_local_shards: " + "; ".join(p.rstrip(".") for p in problems) + "."
            raise ValueError(msg)
        dtype = getattr(torch, dtypes[0].removeprefix("torch.")) if dtypes else torch.get_default_dtype()
        if reduce_op is not None:
            _check_partial_shards([ShardMetadata.from_dict(s) for s in all_shards], size, reduce_op, dtype)
        shards = [ShardMetadata.from_dict(s) for s in all_shards]
        if reduce_op is None:
            metadata = ShardedTensorMetadata(shards, size, dtype)
        else:
            metadata = ShardedTensorMetadata(shards, size, dtype, placement=Partial(reduce_op))
        # Local shards come first in rank order, so this rank's are a contiguous run.
        start = sum(len(r["shards"]) for r in everyone[:rank])
        tensors = {start + i: shard.tensor for i, shard in enumerate(local_shards)}
        spec: PlacementSpec | None = EnumerableShardingSpec(metadata.shards) if metadata.shards else None
        if reduce_op is not None:
            spec = PartialSpec([str(s.device) for s in metadata.shards], reduce_op=reduce_op)
        return cls._make(tensors, metadata, spec, rank=rank, group=process_group,
                         requires_grad=any(s["grad"] for s in all_shards))

    # -- what it is ---------------------------------------------------------------------------

    def local_shards(self) -> list[Shard]:
        """This rank's shards (possibly none), in placement order."""
        return list(self._local)

    def local_shard(self) -> torch.Tensor:
        """The tensor of this rank's only shard.

        Raises:
            RuntimeError: if this rank holds no shard or several (use ``local_shards()``).
        """
        if len(self._local) != 1:
            msg = (f"local_shard() needs exactly one shard on this rank, but rank {self._rank} holds "
                   f"{len(self._local)}; use local_shards() to get all of them.")
            raise RuntimeError(msg)
        return self._local[0].tensor

    def sharding_metadata(self) -> ShardedTensorMetadata:
        """The whole layout: every shard, the global size and the dtype."""
        return self._metadata

    def sharding_spec(self) -> PlacementSpec | None:
        """The spec this tensor is laid out by (``EnumerableShardingSpec`` when built from shards)."""
        return self._spec

    @property
    def process_group(self) -> _comm.ProcessGroup:
        """The process group whose ranks the layout names (``None``: the default group)."""
        return self._group

    def size(self, dim: int | None = None) -> torch.Size | int:
        """The global size, or its length along ``dim``."""
        return self._metadata.size if dim is None else self._metadata.size[dim]

    @property
    def shape(self) -> torch.Size:
        """The global size."""
        return self._metadata.size

    @property
    def dtype(self) -> torch.dtype:
        return self._metadata.dtype

    def dim(self) -> int:
        """Number of dimensions."""
        return len(self._metadata.size)

    @property
    def ndim(self) -> int:
        return self.dim()

    def numel(self) -> int:
        """Number of elements of the global tensor."""
        return self._metadata.size.numel()

    @property
    def names(self) -> tuple[str | None, ...] | None:
        """Dimension names given at creation, if any."""
        return self._names

    @property
    def requires_grad(self) -> bool:
        """Whether the shards require grad (the same answer on every rank)."""
        return self._requires_grad

    def requires_grad_(self, requires_grad: bool = True) -> ShardedTensor:
        """Set ``requires_grad`` on every local shard; returns self."""
        for shard in self._local:
            shard.tensor.requires_grad_(requires_grad)
        self._requires_grad = requires_grad
        return self

    def __repr__(self) -> str:
        spec = self._spec.__class__.__name__ if self._spec is not None else None
        return (f"ShardedTensor(size={tuple(self.shape)}, dtype={self.dtype}, spec={spec}, "
                f"rank={self._rank}, local_shards={[(s.metadata.offsets, s.metadata.dims) for s in self._local]})")

    # -- moving data ----------------------------------------------------------------------------

    def _local_by_index(self) -> dict[int, torch.Tensor]:
        indices = [i for i, _ in self._metadata.shards_on(self._rank)]
        return {i: shard.tensor for i, shard in zip(indices, self._local)}

    def _device_of(self, rank: int) -> torch.device:
        for shard in self._metadata.shards:
            if shard.rank == rank:
                return shard.device.device
        return _comm.default_device(self._group)

    def _world(self) -> int:
        _, world = _comm.rank_and_world(self._group)
        ranks = self._metadata.ranks
        if ranks and ranks[-1] >= world:
            msg = (f"this ShardedTensor has shards on ranks up to {ranks[-1]} but the process group has "
                   f"{world} rank(s); initialize torch.distributed with the world that created it "
                   f"(e.g. launch with torchrun --nproc-per-node {ranks[-1] + 1}).")
            raise RuntimeError(msg)
        return world

    @_comm.collective("ShardedTensor.reshard")
    def reshard(self, sharding_spec: PlacementSpec) -> ShardedTensor:
        """Lay the data out as ``sharding_spec``, in place, and return self. Collective.

        Only the blocks that change rank cross the network, each at most once per
        destination; blocks already in place are copied locally. The full tensor is never
        built. An invalid spec raises ``ValueError`` and leaves the tensor unchanged.

        A new shard that is a contiguous block of an old CPU shard nothing else refers to
        keeps that memory, without a copy; the rest of the old shard's pages are released
        (see the resharding guide).

        From partial values (``PartialSpec``) the reduction happens on the way: an
        all-reduce for a replica on every rank, a reduce-scatter for a split. Into a
        ``PartialSpec`` with ``"sum"`` one holder keeps each block and the others hold zeros;
        with ``"avg"``, ``"max"`` or ``"min"`` every holder keeps the values. Partial values
        pending one reduction cannot become partial values pending another (``ValueError``).

        A rank that died or does not answer makes the others raise ``CollectiveError`` (naming
        the operation and the ranks that did not answer) at once when its connection closes, at
        the latest after ``SHARDKIT_TIMEOUT`` seconds (default 600); see the troubleshooting guide.

        Example:
            >>> # 4 ranks, (8, 8) split by rows -> split by columns: each rank keeps its 2x2
            >>> # diagonal block and receives three 2x2 blocks.
            >>> t.reshard(single_split(1, [f"rank:{r}/cpu" for r in range(4)])).local_shard().shape  # doctest: +SKIP
            torch.Size([8, 2])
        """
        world = self._world()
        target = _build(sharding_spec, self.shape, self.dtype, self._names, world)
        requires_grad = self.requires_grad
        # The old shards are handed over (not copied from) when nothing else refers to them:
        # a new shard that is a contiguous block of an old one then keeps its memory.
        local, self._local = self._local_by_index(), []
        try:
            tensors = redistribute(local, self._metadata, target, rank=self._rank, group=self._group, reuse=True)
        except BaseException:
            self._local = [Shard(local[i], shard) for i, shard in self._metadata.shards_on(self._rank)]
            raise
        del local
        for tensor in tensors.values():
            tensor.requires_grad_(requires_grad)
        self._metadata = target
        self._spec = sharding_spec
        self._local = [Shard(tensors[i], shard) for i, shard in target.shards_on(self._rank)]
        return self

    @_comm.collective("ShardedTensor.gather")
    def gather(self, dst: int = 0) -> torch.Tensor | None:
        """The full tensor on rank ``dst`` (on its shards' device), ``None`` elsewhere. Collective.

        Partial values are reduced (each holder sends its value to ``dst``).

        A rank that died or does not answer makes the others raise ``CollectiveError`` (naming
        the operation and the ranks that did not answer) at once when its connection closes, at
        the latest after ``SHARDKIT_TIMEOUT`` seconds (default 600); see the troubleshooting guide.
        A rank that only sends to live ranks may return before noticing a dead one.
        """
        world = self._world()
        if not 0 <= dst < world:
            msg = f"gather(dst={dst!r}) is outside the world of {world} ranks; use 0..{world - 1}."
            raise ValueError(msg)
        target = DevicePlacement(RemoteDevice.of(dst, self._device_of(dst))).build_metadata(self.shape, self.dtype)
        tensors = redistribute(self._local_by_index(), self._metadata, target, rank=self._rank, group=self._group)
        return tensors.get(0)

    @_comm.collective("ShardedTensor.full_tensor")
    def full_tensor(self) -> torch.Tensor:
        """The full tensor on every rank (on each rank's own device). Collective.

        Partial values are reduced, with one all-reduce when every rank holds one.

        A rank that died or does not answer makes the others raise ``CollectiveError`` (naming
        the operation and the ranks that did not answer) at once when its connection closes, at
        the latest after ``SHARDKIT_TIMEOUT`` seconds (default 600); see the troubleshooting guide.
        """
        world = self._world()
        target = ShardedTensorMetadata(
            [ShardMetadata((0,) * self.dim(), tuple(self.shape), RemoteDevice.of(r, self._device_of(r)))
             for r in range(world)], self.shape, self.dtype, placement=Replicated())
        tensors = redistribute(self._local_by_index(), self._metadata, target, rank=self._rank, group=self._group)
        return tensors[self._rank]

    def to_dtensor(self, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None) -> DTensor:
        """The ``DTensor`` on ``device_mesh`` with this layout, sharing the local shard (no copy, no communication).

        Each mesh rank must hold exactly one block, the one DTensor's rules give its mesh
        coordinate (``Shard(d)`` splits like ``torch.chunk``, mesh axes apply left to right;
        ``Replicate`` means every rank along that axis holds the same block). With
        ``placements=None`` they are inferred from the layout (``Replicate`` preferred where
        both fit, e.g. on an axis of size 1). Partial values (``PartialSpec`` over exactly the
        mesh's ranks) become ``Partial(op)`` on every mesh axis. The DTensor's local tensor is
        this rank's shard.

        Args:
            device_mesh: the ``DeviceMesh``; its ranks are ranks of this tensor's process group.
            placements: one ``Shard``/``Replicate`` per mesh axis (``Partial`` for partial
                values), or ``None`` to infer them.

        Returns:
            A ``DTensor`` of the same global size and dtype.

        Raises:
            ValueError: the layout has no DTensor equivalent on this mesh (several blocks on a
                rank, blocks not split like ``torch.chunk``, a mesh order that does not fit), or
                does not match ``placements``; the message shows the layout and how to reshard.

        Example:
            >>> # 4 ranks, (10, 4) split by rows 3/3/3/1 -> DTensor with [Shard(0)]
            >>> spec = single_split(0, [f"rank:{r}/cpu" for r in range(4)])  # doctest: +SKIP
            >>> t = st.zeros(10, 4, sharding_spec=spec)  # doctest: +SKIP
            >>> dt = t.to_dtensor(init_device_mesh("cpu", (4,)))  # doctest: +SKIP
            >>> dt.placements  # doctest: +SKIP
            (Shard(dim=0),)
        """
        shards = self.local_shards()
        return to_dtensor(self._metadata, shards[0].tensor if shards else None, self._group, device_mesh,
                          placements)

    def reduced(self) -> ShardedTensor:
        """A new ShardedTensor with the reduced values of this partial one, split over its holders. Collective.

        This tensor is left as it is. The split is along the first dimension with a row for
        every holder (else the longest), over the holding ranks in order (one reduce-scatter); a
        tensor without partial values comes back as a copy in its own layout.

        Example:
            >>> # 2 ranks, partial sums of a (4, 4) tensor -> rows 0:2 on rank 0, 2:4 on rank 1
            >>> r = t.reduced()  # doctest: +SKIP
            >>> r.local_shard().shape  # doctest: +SKIP
            torch.Size([2, 4])
        """
        from ._partial import _split_over

        partial = self._metadata.pending is not None
        target = _split_over(self._metadata) if partial else self._metadata
        tensors = redistribute(self._local_by_index(), self._metadata, target, rank=self._rank, group=self._group)
        spec = EnumerableShardingSpec(target.shards) if partial else self._spec
        return ShardedTensor._make(tensors, target, spec, rank=self._rank, group=self._group, names=self._names,
                                   requires_grad=self._requires_grad)

    # -- torch.save / torch.load(weights_only=True) -----------------------------------------

    def __reduce_ex__(self, protocol: object) -> tuple[object, tuple[object, ...]]:
        header = json.dumps({"version": _FORMAT_VERSION, "rank": self._rank,
                             "metadata": self._metadata.to_dict(),
                             "spec": None if self._spec is None else self._spec.to_dict(),
                             "names": None if self._names is None else list(self._names),
                             "requires_grad": self._requires_grad})
        # torch.save writes whole storages; a shard that kept part of an old one goes compact.
        tensors = [s.tensor if s.tensor.untyped_storage().nbytes() == s.tensor.nbytes
                   else s.tensor.detach().clone().requires_grad_(s.tensor.requires_grad) for s in self._local]
        return (_rebuild_sharded_tensor, (header, tensors))


# -- for the package's other modules: no checks, no communication ------------------------------

def from_local(tensors: dict[int, torch.Tensor], metadata: ShardedTensorMetadata, spec: PlacementSpec | None, *,
               rank: int, group: _comm.ProcessGroup) -> ShardedTensor:
    """A ShardedTensor of ``rank``'s ``tensors`` (keyed by shard index in ``metadata``), taken as they are."""
    return ShardedTensor._make(tensors, metadata, spec, rank=rank, group=group)


def local_by_index(tensor: ShardedTensor) -> dict[int, torch.Tensor]:
    """``tensor``'s local tensors, keyed by their shard's index in its metadata."""
    return tensor._local_by_index()


def rank_of(tensor: ShardedTensor) -> int:
    """The rank, in ``tensor.process_group``, whose shards ``tensor`` holds."""
    return tensor._rank


def world_of(tensor: ShardedTensor) -> int:
    """The size of ``tensor.process_group``; raises if its layout names ranks outside it."""
    return tensor._world()


def _rebuild_sharded_tensor(header: str, tensors: list[torch.Tensor]) -> ShardedTensor:
    """Inverse of ``ShardedTensor.__reduce_ex__``; safe for ``torch.load(weights_only=True)``."""
    from sharding import spec_from_dict

    data = json.loads(header)
    if data.get("version") != _FORMAT_VERSION:
        msg = f"saved ShardedTensor has format version {data.get('version')!r}; this shardkit reads {_FORMAT_VERSION}."
        raise ValueError(msg)
    metadata = ShardedTensorMetadata.from_dict(data["metadata"])
    saved_rank = int(data["rank"])
    rank, _ = _comm.rank_and_world(None)
    if _comm.rank_and_world(None)[1] > 1 and rank != saved_rank:
        msg = (f"this ShardedTensor was saved by rank {saved_rank} and holds that rank's shards, but it is "
               f"loaded on rank {rank}; load each rank's file on the rank that saved it.")
        raise ValueError(msg)
    indices = [i for i, _ in metadata.shards_on(saved_rank)]
    if len(indices) != len(tensors):
        msg = f"saved ShardedTensor lists {len(indices)} local shards but carries {len(tensors)} tensors."
        raise ValueError(msg)
    spec = spec_from_dict(data["spec"]) if data["spec"] is not None else None
    names = tuple(data["names"]) if data["names"] is not None else None
    return ShardedTensor._make(dict(zip(indices, tensors)), metadata, spec, rank=saved_rank, group=None,
                               names=names, requires_grad=bool(data.get("requires_grad", False)))


def _check_partial_shards(shards: list[ShardMetadata], size: tuple[int, ...], reduce_op: str,
                          dtype: torch.dtype) -> None:
    """Partial values: one full-size shard per rank, at least one; the same ``ValueError`` on every rank."""
    check_reduce_op(reduce_op)
    if not shards:
        msg = (f"from_local_shards(reduce_op={reduce_op!r}): no rank passed a shard; every holder passes its "
               f"partial value.")
        raise ValueError(msg)
    not_full = [str(s.device) for s in shards if s.dims != size or any(s.offsets)]
    if not_full:
        msg = (f"from_local_shards(reduce_op={reduce_op!r}): partial values must be full-size (offsets 0, dims "
               f"{size}), but the shards on {not_full} are not; pass each rank's whole partial result.")
        raise ValueError(msg)
    ranks = [s.rank for s in shards]
    repeated = sorted({r for r in ranks if ranks.count(r) > 1})  # type: ignore[type-var]
    if repeated:
        msg = (f"from_local_shards(reduce_op={reduce_op!r}): rank(s) {repeated} pass several partial values; "
               f"pass one per rank (add them first).")
        raise ValueError(msg)
    PartialSpec([str(s.device) for s in shards], reduce_op=reduce_op).build_metadata(size, dtype)  # dtype checks


def _build(spec: PlacementSpec, size: Sequence[int], dtype: torch.dtype | None,
           names: Sequence[str | None] | None, world: int) -> ShardedTensorMetadata:
    """``spec.build_metadata`` with the world size known, refusing non-tensor specs clearly."""
    if not isinstance(spec, PlacementSpec):
        msg = (f"sharding_spec must be a SingleSplitShardingSpec, MeshShardingSpec, DevicePlacement or "
               f"EnumerableShardingSpec, got {type(spec).__name__} {spec!r}.")
        raise TypeError(msg)
    dtype = dtype if dtype is not None else torch.get_default_dtype()  # the default may change between calls
    key = (spec, tuple(size), dtype, None if names is None else tuple(names), world)
    try:
        built = _BUILT.get(key)
    except TypeError:  # a spec holding something unhashable: build it every time
        return spec.build_metadata(tuple(size), dtype, names, world_size=world)
    if built is None:
        built = spec.build_metadata(tuple(size), dtype, names, world_size=world)
        if len(_BUILT) >= _BUILT_KEPT:
            _BUILT.pop(next(iter(_BUILT)), None)  # the oldest
        _BUILT[key] = built
    return built


# Recent layouts by (spec, size, dtype, names, world): specs and layouts are frozen values, and
# a loop that reshards every step asks for the same few again and again. Only layouts that
# built (passed every check) are kept.
_BUILT: dict[tuple[Any, ...], ShardedTensorMetadata] = {}
_BUILT_KEPT = 64


torch.serialization.add_safe_globals([_rebuild_sharded_tensor])
