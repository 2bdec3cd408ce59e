"""``checkpoint.load``: fill a state_dict in place, for its current layout, reading only needed bytes.

For every local target block (a ``ShardedTensor``'s local shard, or a whole plain tensor),
the saved regions that overlap it come from ``sharding.layout.RegionIndex`` (the same
overlap search the reshard planner uses). Each overlap is then read in one of three ways,
chosen from where its bytes sit inside the saved region (row-major):

- one range: the overlap is contiguous in the file (e.g. whole saved regions, or row blocks)
  and in the target: it is read straight into the target's memory (``os.preadv`` for local
  files, no intermediate buffer);
- local files, anything else: the file is memory mapped and one strided ``copy_`` moves the
  overlap into the target; the kernel reads only the pages the copy touches;
- other file systems: one range per contiguous run (e.g. per row of a column block, fetched
  concurrently with ``cat_ranges``) when runs are at least ``_MIN_RUN`` bytes, else the
  covering rows of the saved region in batches of at most ``_SLAB_BYTES``, then a copy.

A checksum covers a whole saved region, so it is verified whenever a region is read whole
(always the case when loading into the layout that saved it, or a coarser one). Partial reads
are checked for length (truncation) but not against the checksum; ``python -m checkpoint
verify`` checks every byte.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import posixpath
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from _shardkit import comm as _comm
from sharded_tensor import ShardedTensor
from sharding.layout import box_slices

from ._dcp import is_dcp_checkpoint, load_dcp
from ._dtensor import dtensor_views
from ._format import (
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    SavedShard,
    TensorEntry,
    _read_metadata,
    flatten_state_dict,
    is_local,
    member,
    resolve,
    verify_checksum,
)
from ._hf import KeyMap, apply_key_map, find_hf, read_hf_metadata
from ._progress import progress

__all__ = ["load"]

_MIN_RUN = 64 << 10       # runs shorter than this are read as covering slabs instead
_SLAB_BYTES = 64 << 20    # largest single covering read


@dataclass(slots=True)
class _Task:
    """One overlap: the part ``common`` of saved region ``shard`` goes into ``dest``."""

    name: str
    path: str
    entry: TensorEntry
    shard: SavedShard
    common: tuple[tuple[int, ...], tuple[int, ...]]
    dest: torch.Tensor  # view of the target with shape common dims

    @property
    def whole(self) -> bool:
        return self.common == self.shard.region

    @property
    def nbytes(self) -> int:
        return math.prod(self.common[1]) * self.entry.dtype.itemsize


def _raw(tensor: torch.Tensor, dtype: torch.dtype) -> memoryview | None:
    """Writable bytes of ``tensor``'s memory if data of ``dtype`` can be read straight into it."""
    if tensor.device.type != "cpu" or tensor.dtype != dtype or not tensor.is_contiguous():
        return None
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


class _Reader:
    """Range reads from one file system.

    Local files: ``os.preadv`` straight into the target, or a read-only memory map of the file
    that a strided copy reads from (only the pages it touches are read). Other file systems:
    fsspec range reads (``cat_file``, ``cat_ranges``).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self._fs = fs
        self.local = is_local(fs)
        self._files: dict[str, tuple[int, int]] = {}  # path -> (fd, size)

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    @staticmethod
    def _missing(task: _Task, exc: BaseException) -> CheckpointError:
        return CheckpointError(f"data file {task.path!r} of tensor {task.name!r} is missing; the checkpoint is "
                               f"incomplete or was modified after it was saved ({exc}).")

    @staticmethod
    def _short(task: _Task, start: int, wanted: int, got: int) -> CheckpointError:
        return CheckpointError(f"data file {task.path!r} of tensor {task.name!r} is truncated: needed bytes "
                               f"[{start}, {start + wanted}) but only {max(got, 0)} of {wanted} could be read.")

    def _open(self, task: _Task, start: int, end: int) -> int:
        """The local file's descriptor, after checking that it holds bytes ``[start, end)``."""
        entry = self._files.get(task.path)
        if entry is None:
            try:
                fd = os.open(task.path, os.O_RDONLY)
            except FileNotFoundError as exc:
                raise self._missing(task, exc) from exc
            entry = self._files[task.path] = (fd, os.fstat(fd).st_size)
        fd, size = entry
        if size < end:
            raise self._short(task, start, end - start, size - start)
        return fd

    def readinto(self, task: _Task, start: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the file's bytes from ``start``."""
        if not self.local:
            buffer[:] = self.read(task, start, start + len(buffer))
            return
        fd = self._open(task, start, start + len(buffer))
        done = 0
        while done < len(buffer):
            n = os.preadv(fd, [buffer[done:]], start + done)
            if n <= 0:
                raise self._short(task, start, len(buffer), done)
            done += n

    def copy_mapped(self, task: _Task, inner: tuple[slice, ...]) -> None:
        """Local only: copy block ``inner`` of the task's saved region into ``task.dest`` via a memory map.

        Only the region's pages are mapped, and only while copying, so the pages the copy
        touches are read from the page cache and resident memory grows by at most one region.
        """
        start, end = task.shard.byte_range
        fd = self._open(task, start, end)
        first = start - start % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, end - first, access=mmap.ACCESS_READ, offset=first)
        try:
            region = memoryview(mapping)[start - first:]
            if task.whole and task.shard.checksum:  # files of other tools carry none
                verify_checksum(region, task.shard.checksum, file=task.path, tensor=task.name)
            source = _view(region, task.entry.dtype).reshape(task.shard.dims)
            _copy(task.dest, source[inner])
            del source  # drop every export of the mapping before unmapping it
            region.release()
        finally:
            mapping.close()

    def read(self, task: _Task, start: int, end: int) -> bytes | bytearray:
        """The file's bytes ``[start, end)``."""
        if self.local:
            buffer = bytearray(end - start)
            self.readinto(task, start, memoryview(buffer))
            return buffer
        try:
            data = self._fs.cat_file(task.path, start=start, end=end)
        except FileNotFoundError as exc:
            raise self._missing(task, exc) from exc
        if len(data) != end - start:
            raise self._short(task, start, end - start, len(data))
        return data  # type: ignore[no-any-return]

    def read_many(self, task: _Task, ranges: list[tuple[int, int]]) -> list[bytes | bytearray]:
        """Several ranges of one file; concurrent on asynchronous file systems (``cat_ranges``)."""
        if self.local or len(ranges) == 1:
            return [self.read(task, a, b) for a, b in ranges]
        try:
            out = self._fs.cat_ranges([task.path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges],
                                      on_error="raise")
        except FileNotFoundError as exc:
            raise self._missing(task, exc) from exc
        for (a, b), data in zip(ranges, out):
            if isinstance(data, BaseException):
                raise data
            if len(data) != b - a:
                raise self._short(task, a, b - a, len(data))
        return out  # type: ignore[no-any-return]


def _run_structure(task: _Task) -> int:
    """``k``: the overlap spans whole dims after ``k`` of its saved region, so it is ``prod(dims[:k])`` runs."""
    dims, full = task.common[1], task.shard.dims
    for d in range(len(dims) - 1, -1, -1):
        if dims[d] != full[d]:
            return d
    return 0


def _execute(task: _Task, reader: _Reader) -> None:
    """Copy the overlap ``task.common`` of a saved region into ``task.dest``."""
    shard, dtype, item = task.shard, task.entry.dtype, task.entry.dtype.itemsize
    rel = tuple(c - o for c, o in zip(task.common[0], shard.offsets))
    strides = [math.prod(shard.dims[d + 1:]) for d in range(len(shard.dims))]
    base = shard.byte_range[0]
    dims = task.common[1]
    k = _run_structure(task)
    runs = math.prod(dims[:k])
    direct = _raw(task.dest, dtype) if runs == 1 else None
    if direct is not None or (runs == 1 and not reader.local):
        # One contiguous range, straight into the target when its memory is contiguous too.
        start = base + sum(r * s for r, s in zip(rel, strides)) * item
        buffer = direct if direct is not None else memoryview(bytearray(task.nbytes))
        reader.readinto(task, start, buffer)
        if task.whole and shard.checksum:  # files of other tools carry none
            verify_checksum(buffer, shard.checksum, file=task.path, tensor=task.name)
        if direct is None:
            _copy(task.dest, _view(buffer, dtype).reshape(dims))
        return
    inner = tuple(slice(r, r + n) for r, n in zip(rel, dims))
    if reader.local:
        # Strided: one copy out of the memory-mapped region touches only the pages it needs.
        reader.copy_mapped(task, inner)
        return
    run = math.prod(dims[k:]) * item
    if run >= _MIN_RUN:
        # Long runs (e.g. rows of a column block): one range each, fetched concurrently.
        indices = list(itertools.product(*(range(n) for n in dims[:k])))
        starts = [base + (sum((r + i) * s for r, i, s in zip(rel, index, strides)) + rel[k] * strides[k]) * item
                  for index in indices]
        pieces = reader.read_many(task, [(s, s + run) for s in starts])
        for index, data in zip(indices, pieces):
            _copy(task.dest[index], _view(data, dtype).reshape(dims[k:]))
        return
    # Tiny runs: the covering rows of the saved region (along dim 0), in bounded batches.
    slab = strides[0] * item
    per_batch = max(1, _SLAB_BYTES // max(slab, 1))
    for first in range(0, dims[0], per_batch):
        count = min(per_batch, dims[0] - first)
        start = base + (rel[0] + first) * slab
        rows = _view(reader.read(task, start, start + count * slab), dtype).reshape(count, *shard.dims[1:])
        _copy(task.dest[first:first + count], rows[(slice(None), *inner[1:])])


def _view(data: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor over ``data`` without copying; read-only buffers are only ever read from."""
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(data, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype)


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dest.copy_(src)


def _targets(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``(global offsets, tensor)`` of every local block to fill."""
    if isinstance(value, ShardedTensor):
        return [(s.metadata.offsets, s.tensor) for s in value.local_shards()]
    return [((0,) * value.dim(), value)]


def load(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: _comm.ProcessGroup = None,
         storage_options: Mapping[str, Any] | None = None, strict: bool = True, cast: bool = False,
         key_map: KeyMap | None = None, quiet: bool | None = None) -> dict[str, Any]:
    """Fill ``state_dict`` in place from a checkpoint, whatever layout and world size saved it. Collective.

    A ``ShardedTensor`` entry is filled for its current layout: each rank reads, for each of
    its local shards, only the bytes of the saved regions that overlap it (fsspec range reads).
    A plain tensor receives the full tensor (in place); a ``None`` entry is replaced by a new
    CPU tensor. Non-tensor values replace the entry. Nested dicts match dotted names.
    ``DTensor`` entries (FSDP2, ``parallelize_module``, ``get_state_dict``) are filled in place
    like ``ShardedTensor``s of their layout.

    A folder written by ``torch.distributed.checkpoint.save`` (DCP: ``.metadata`` plus
    ``.distcp`` files) is detected and read with torch's ``FileSystemReader``, into any layout.
    DCP's ``.metadata`` is pickled: load only DCP folders you trust.

    ``path`` may also be a Hugging Face safetensors checkpoint: one ``.safetensors`` file, or a
    folder with ``model.safetensors.index.json`` (or a single ``model.safetensors``) and no
    ``shardkit.json``. Each rank then parses every file's header once and reads only the byte
    ranges of its own blocks, so ``shard_model(model, spec, init=False)`` followed by
    ``load(model.state_dict(), hf_folder)`` never holds the full model anywhere. Such files
    carry no checksums: their bytes are checked for length only.

    Args:
        state_dict: the (possibly nested) state_dict to fill, e.g. ``model.state_dict()`` of the
            sharded model, with tensors of the right sizes and dtypes.
        path: the checkpoint folder: a local path or any fsspec URL.
        process_group: the group that loads; every rank of it calls ``load``.
        storage_options: passed to the fsspec file system.
        strict: names in the state_dict but not in the checkpoint (missing) or the other way
            round (unexpected) are an error; with ``False`` they are skipped.
        cast: allow a target dtype other than the saved one (values are converted like
            ``Tensor.copy_``, e.g. a bfloat16 file into float32 parameters); without it a dtype
            difference is an error.
        key_map: renames the checkpoint's tensors before they are matched with the
            state_dict: a dict (names it lacks stay as they are) or a callable taking a
            checkpoint name and returning the state_dict name, or ``None`` to skip the tensor
            (e.g. ``lambda k: "model." + k`` to add a prefix).
        quiet: ``True`` hides the progress bar rank 0 shows on a terminal for large loads.

    Returns:
        ``state_dict`` itself.

    Raises:
        CheckpointError: the checkpoint is incomplete (no committed metadata), corrupt
            (checksum, truncated or missing file, malformed metadata, unsafe file name), or does
            not match the state_dict (missing/unexpected names under ``strict``, size, dtype);
            the message names the file and the tensor. A failure on any rank raises on all.
        FileNotFoundError: there is no checkpoint at ``path``.

    Example:
        >>> # saved by 4 ranks split by rows; loaded by 2 ranks split by columns
        >>> sd = {"w": st.empty(10, 4, single_split(1, ["rank:0/cpu", "rank:1/cpu"]))}  # doctest: +SKIP
        >>> checkpoint.load(sd, "ckpt")  # rank r reads columns 2r..2r+1 of every row  # doctest: +SKIP
    """
    failure: BaseException | None = None
    try:
        views, restore = dtensor_views(state_dict, process_group)
        if is_dcp_checkpoint(path, storage_options):
            load_dcp(views, path, strict=strict, cast=cast)
        else:
            _load(views, path, storage_options, strict, cast, key_map, quiet, process_group)
        restore()
    except Exception as exc:
        failure = exc
    reports = _comm.all_gather_json(None if failure is None else f"{type(failure).__name__}: {failure}",
                                    process_group, what="checkpoint.load")
    if failure is not None:
        raise failure
    errors = [(r, e) for r, e in enumerate(reports) if e is not None]
    if errors:
        msg = f"checkpoint.load from {os.fspath(path)!r} failed on " + "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise CheckpointError(msg)
    return state_dict


def _load(state_dict: dict[str, Any], path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None,
          strict: bool, cast: bool, key_map: KeyMap | None, quiet: bool | None,
          process_group: _comm.ProcessGroup) -> None:
    rank, _ = _comm.rank_and_world(process_group)
    fs, root = resolve(path, storage_options)
    metadata, root, source = _read_source(fs, root, key_map)
    leaves = list(flatten_state_dict(state_dict))
    names = {name for name, *_ in leaves}
    saved = set(metadata.tensors) | set(metadata.values)
    if strict:
        missing, unexpected = sorted(names - saved), sorted(saved - names)
        if missing or unexpected:
            msg = (f"checkpoint {source!r} does not match the state_dict: missing={missing} (in the "
                   f"state_dict, not in the checkpoint), unexpected={unexpected} (in the checkpoint, not in "
                   f"the state_dict); pass strict=False to load only what matches.")
            raise CheckpointError(msg, missing=missing, unexpected=unexpected)
    tasks: list[_Task] = []
    scalars: list[tuple[Any, Any, type, torch.Tensor]] = []
    for name, parent, key, value in leaves:
        if name in metadata.values:
            if _is_scalar_tensor(value) and _is_number(metadata.values[name]):
                # Optimizer steps: a number in shardkit's optimizer state, a 0-dim tensor in torch's.
                value.fill_(metadata.values[name])
                continue
            if isinstance(value, (torch.Tensor, ShardedTensor)):
                msg = (f"checkpoint {source!r} holds a non-tensor value for {name!r}, but the state_dict has a "
                       f"{type(value).__name__} there.")
                raise CheckpointError(msg)
            parent[key] = metadata.values[name]  # type: ignore[index]
            continue
        entry = metadata.tensors.get(name)
        if entry is None:
            continue
        if _is_number(value) and len(entry.size) == 0:
            tensor = torch.empty((), dtype=entry.dtype)
            scalars.append((parent, key, type(value), tensor))
            value = tensor
        if value is None:
            value = torch.empty(entry.size, dtype=entry.dtype)
            parent[key] = value  # type: ignore[index]
        if not isinstance(value, (torch.Tensor, ShardedTensor)):
            msg = (f"checkpoint {source!r} holds a tensor for {name!r}, but the state_dict has "
                   f"{type(value).__name__} {value!r} there; put a tensor (or None) under that name.")
            raise CheckpointError(msg)
        if isinstance(value, ShardedTensor) and value.sharding_metadata().partial is not None:
            msg = (f"cannot load {name!r} from {source!r} into a ShardedTensor holding partial values "
                   f"(partial({value.sharding_metadata().partial})): every holder would get the whole tensor; "
                   f"reshard it to a plain layout (a split or DevicePlacement) before loading.")
            raise ValueError(msg)
        if tuple(value.shape) != tuple(entry.size):
            msg = (f"tensor {name!r} in {source!r} has size {tuple(entry.size)}, but the state_dict's "
                   f"{type(value).__name__} has size {tuple(value.shape)}; load into a tensor of the saved size.")
            raise CheckpointError(msg)
        if value.dtype != entry.dtype and not cast:
            msg = (f"tensor {name!r} in {source!r} has dtype {entry.dtype}, but the state_dict's has "
                   f"{value.dtype}; pass cast=True to convert on load.")
            raise CheckpointError(msg)
        tasks.extend(_plan_tensor(name, entry, value, root))
    tasks.sort(key=lambda t: (t.path, t.shard.byte_range[0]))
    reader = _Reader(fs)
    try:
        with progress(sum(t.nbytes for t in tasks), "load", rank=rank, quiet=quiet) as bar:
            for task in tasks:
                _execute(task, reader)
                bar.update(task.nbytes)
    finally:
        reader.close()
    for parent, key, kind, tensor in scalars:
        parent[key] = kind(tensor.item())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_scalar_tensor(value: Any) -> bool:
    return type(value) is torch.Tensor and value.dim() == 0


def _read_source(fs: fsspec.AbstractFileSystem, root: str, key_map: KeyMap | None
                 ) -> tuple[CheckpointMetadata, str, str]:
    """``(metadata, folder of the data files, path to name in messages)`` of a shardkit or Hugging Face checkpoint."""
    found = find_hf(fs, root)
    if found is not None:
        folder, files, source = found
        metadata = read_hf_metadata(fs, folder, files, source)
    else:
        folder, source = root, posixpath.join(root, METADATA_FILE)
        metadata = _read_metadata(fs, root)
    return apply_key_map(metadata, key_map, source=source), folder, source


def _plan_tensor(name: str, entry: TensorEntry, value: Any, root: str) -> list[_Task]:
    """The overlaps between the saved regions of ``name`` and this rank's blocks of ``value``."""
    tasks = []
    for offsets, tensor in _targets(value):
        # The entry's index: no look at the saved regions this block does not need.
        for shard, common in entry.overlapping((tuple(offsets), tuple(tensor.shape))):
            dest = tensor[box_slices(common, offsets)]
            tasks.append(_Task(name, member(root, shard.file), entry, shard, common, dest))
    return tasks
