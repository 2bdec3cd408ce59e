"""``checkpoint.load``: fill a state_dict in place, for its current layout, reading only needed bytes.

For every local target block (a ``ShardedTensor``'s local shard, or a whole plain tensor),
the saved regions that overlap it come from ``sharding.layout.RegionIndex`` (the same
overlap search the reshard planner uses). Every read goes through ``_reader.DataReader`` and
is widened to whole checksummed spans (``_reader.covering``): in format version 2 the
chunks a read touches (at most one chunk of extra bytes at each end), so partial reads are
verified too; in version 1 whole regions only. A failed load never leaves corrupt bytes in
the target:

- an overlap that is exactly whole spans, contiguous in file and target (e.g. whole regions):
  read straight into the target and verified there; a failed check clears the block to zeros
  (one pass over memory less than staging);
- local files, contiguous overlap and target otherwise (e.g. row blocks): whole chunks
  stream through a small buffer, each verified and then copied into the target;
- local files, anything else: the covering range is memory mapped, verified, then moved into
  the target by one strided ``copy_``;
- other file systems: batches of rows of the overlap, each one range read widened to whole
  chunks (at most ``_SLAB_BYTES`` of rows), verified, then copied.

Before reading, each data file's size is compared with the metadata and its safetensors
header with the regions read from it (dtype, shape, byte range), and targets on the meta
device or with overlapping memory (``expand``) are refused.
"""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from _shardkit import comm as _comm
from _shardkit.memory import storage_alone
from sharded_tensor import ShardedTensor
from sharding.layout import box_slices

from ._codec import tensor_bytes, tensor_from_bytes
from ._dcp import is_dcp_checkpoint, load_dcp
from ._dtensor import dtensor_views
from ._hf import KeyMap, apply_key_map, convert_hf_names, find_hf, read_hf_metadata
from ._progress import progress
from ._reader import DataReader, RegionCheck, covering
from ._schema import (
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    SavedShard,
    TensorEntry,
)
from ._storage import member, read_metadata_at, resolve
from ._unfilled import check_filled, mark_filled
from ._walk import flatten_state_dict

__all__ = ["load"]

_SLAB_BYTES = 64 << 20    # largest single covering read
_VERIFY_PIECE = 1 << 20   # read-then-checksum unit of a direct read: stays in the CPU cache
_SCRATCH_BYTES = 4 << 20  # streaming buffer of contiguous reads: a few chunks, small enough for the CPU cache


@dataclass(slots=True)
class _Task:
    """One overlap: the part ``common`` of saved region ``shard`` goes into ``dest``."""

    name: str
    path: str
    entry: TensorEntry
    shard: SavedShard
    common: tuple[tuple[int, ...], tuple[int, ...]]
    dest: torch.Tensor  # view of the target with shape common dims
    target: torch.Tensor | None = None  # the whole target block, when this overlap covers all of it

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
    return tensor_bytes(tensor)


def _run_structure(task: _Task) -> int:
    """``k``: the overlap spans whole dims after ``k`` of its saved region, so it is ``prod(dims[:k])`` runs."""
    dims, full = task.common[1], task.shard.dims
    for d in range(len(dims) - 1, -1, -1):
        if dims[d] != full[d]:
            return d
    return 0


def _span(task: _Task, first_row: int = 0, rows: int | None = None) -> tuple[int, int]:
    """Absolute ``[start, end)`` from the first to the last byte of rows ``first_row ..`` (dim 0) of the overlap."""
    shard, item = task.shard, task.entry.dtype.itemsize
    dims = task.common[1]
    rows = dims[0] - first_row if rows is None else rows
    rel = [c - o for c, o in zip(task.common[0], shard.offsets)]
    strides = [math.prod(shard.dims[d + 1:]) for d in range(len(shard.dims))]
    lo = list(rel)
    lo[0] += first_row
    hi = [r + n - 1 for r, n in zip(rel, dims)]
    hi[0] = rel[0] + first_row + rows - 1
    base = shard.byte_range[0]
    return (base + sum(i * s for i, s in zip(lo, strides)) * item,
            base + (sum(i * s for i, s in zip(hi, strides)) + 1) * item)


def _block(data: memoryview | bytes | bytearray, task: _Task, offset: int, rows: int) -> torch.Tensor:
    """``rows`` rows of the overlap as a strided view of ``data``, whose byte ``offset`` is the first of them."""
    shard, dtype = task.shard, task.entry.dtype
    strides = tuple(math.prod(shard.dims[d + 1:]) for d in range(len(shard.dims)))
    flat = tensor_from_bytes(data, dtype)
    return flat.as_strided((rows, *task.common[1][1:]) if task.common[1] else (), strides,
                           offset // dtype.itemsize)


def _map_into(task: _Task, reader: DataReader) -> bool:
    """Point the whole target block at the file's pages instead of copying; False where it cannot.

    Possible when the block lies in one contiguous range of a local file, has the file's dtype,
    sits on the CPU in row-major order, is aligned for its dtype, and is the only tensor using
    its memory (otherwise a view or alias, e.g. the parameter behind a ``state_dict()`` entry,
    would keep the old memory). The mapping is private: writes (an optimizer step) copy the
    page they touch and never reach the file. Checksummed spans the block covers are
    verified first, from the same pages.
    """
    target, shard, dtype = task.target, task.shard, task.entry.dtype
    if (target is None or not reader.local or target.device.type != "cpu" or target.dtype != dtype
            or not target.is_contiguous() or target.storage_offset() != 0
            or target.untyped_storage().nbytes() != target.numel() * dtype.itemsize
            or math.prod(task.common[1][:_run_structure(task)]) != 1
            or not storage_alone(target)):
        return False
    rel = tuple(c - o for c, o in zip(task.common[0], shard.offsets))
    strides = [math.prod(shard.dims[d + 1:]) for d in range(len(shard.dims))]
    start = shard.byte_range[0] + sum(r * s for r, s in zip(rel, strides)) * dtype.itemsize
    if start % dtype.itemsize:
        return False
    storage = reader.file_storage(task.path, tensors=task.name)
    if storage.nbytes() < start + task.nbytes:
        return False  # a short file: the ordinary read reports it as truncated
    # Verify the whole chunks (version 2) or the whole region (version 1) the block covers.
    lo, hi = covering(shard, start, start + task.nbytes)
    with reader.mapped(task.path, lo, hi, tensors=task.name, populate=True) as data:
        RegionCheck(shard, task.path, task.name, lo, reader.verified).update(data)
    with torch.no_grad():
        target.set_(storage, start // dtype.itemsize, target.shape, target.stride())
    return True


def _copy_mapped(task: _Task, where: tuple[int, int, int], reader: DataReader) -> None:
    """Local: map bytes ``[lo, hi)`` of the file, verify them, then copy the overlap (from byte ``first``)
    into ``task.dest`` with one strided ``copy_``; the kernel reads only the pages that are touched."""
    lo, hi, first = where
    verifying = bool(task.shard.chunks) or (lo, hi) == task.shard.byte_range  # every byte is read then
    with reader.mapped(task.path, lo, hi, tensors=task.name, populate=verifying) as view:
        RegionCheck(task.shard, task.path, task.name, lo, reader.verified).update(view)
        source = _block(view, task, first - lo, task.common[1][0])
        try:
            _copy(task.dest, source)
        finally:
            del source  # drop every export of the mapping before it is unmapped


def _execute(task: _Task, reader: DataReader, scratch: memoryview, mmap: bool = False) -> None:
    """Copy the overlap ``task.common`` of a saved region into ``task.dest``, verified before it is copied
    (or, with ``mmap``, map the target onto the file's verified pages where ``_map_into`` can).

    Every read is widened to whole checksummed spans (``covering``) and verified; a failed load
    never leaves corrupt bytes in the target (verified before copying, or cleared on failure). Version-1
    regions have one span, so only whole regions are verified there, as version 1 specified.
    """
    if mmap and _map_into(task, reader):
        return
    shard, dtype = task.shard, task.entry.dtype
    if not task.common[1]:  # 0-d tensor: one element
        data = reader.read(task.path, *shard.byte_range, tensors=task.name)
        RegionCheck(shard, task.path, task.name).update(data)
        _copy(task.dest, tensor_from_bytes(data, dtype).reshape(()))
        return
    first, last = _span(task)
    lo, hi = covering(shard, first, last)
    direct = _raw(task.dest, dtype) if _run_structure(task) == 0 else None
    if direct is not None and not shard.checksum and not shard.chunks:
        # Nothing to verify (a Hugging Face file): straight from the file into the target.
        reader.readinto(task.path, first, direct, tensors=task.name)
        return
    # The largest checksummed span the read must see whole before copying (0: none to check).
    span = shard.chunk_bytes if shard.chunks else (hi - lo if (lo, hi) == shard.byte_range else 0)
    if direct is not None and (lo, hi) == (first, last):
        # The target holds exactly whole checksummed spans (whole regions, aligned blocks): read
        # straight into it and verify there, one pass less than staging; if a span is corrupt,
        # the target's bytes are zeroed before the error propagates, so none of them stay.
        check = RegionCheck(shard, task.path, task.name, first, reader.verified)
        try:
            # Piece by piece, each checked right after it arrives, while it is still in the CPU cache.
            for start in range(0, len(direct), _VERIFY_PIECE):
                piece = direct[start:start + _VERIFY_PIECE]
                reader.readinto(task.path, first + start, piece, tensors=task.name)
                check.update(piece)
        except CheckpointError:
            with torch.no_grad():
                task.dest.zero_()
            raise
        return
    if direct is not None and reader.local and span <= len(scratch):
        # Contiguous in file and target: stream whole spans through a small buffer (kept in
        # the CPU cache), verifying each piece before copying its wanted bytes into the target.
        check = RegionCheck(shard, task.path, task.name, lo, reader.verified)
        step = len(scratch) - (len(scratch) % span if span else 0)
        for start in range(lo, hi, step):
            piece = scratch[:min(step, hi - start)]
            reader.readinto(task.path, start, piece, tensors=task.name)
            check.update(piece)
            a, b = max(start, first), min(start + len(piece), last)
            direct[a - first:b - first] = piece[a - start:b - start]
        return
    if reader.local:
        _copy_mapped(task, (lo, hi, first), reader)
        return
    # Other file systems: batches of rows (dim 0), each read as one range widened to whole spans.
    row_bytes = max(1, math.prod(shard.dims[1:]) * dtype.itemsize)
    per_batch = task.common[1][0] if not shard.chunks else max(1, _SLAB_BYTES // row_bytes)
    for row in range(0, task.common[1][0], per_batch):
        count = min(per_batch, task.common[1][0] - row)
        a, b = _span(task, row, count)
        ca, cb = covering(shard, a, b) if shard.chunks else (lo, hi)
        data = reader.read(task.path, ca, cb, tensors=task.name)
        RegionCheck(shard, task.path, task.name, ca, reader.verified).update(data)
        _copy(task.dest[row:row + count], _block(data, task, a - ca, count))
        if not shard.chunks:
            return


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
         key_map: KeyMap | None = None, quiet: bool | None = None,
         timeout: float | None = None, mmap: bool = False,
         allow_uninitialized: bool = False) -> dict[str, Any]:
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
    carry no checksums: their bytes are checked for length only. Names are converted as
    ``from_pretrained`` converts them (with transformers installed and a ``config.json`` in the
    folder: older names such as GPT-NeoX's ``embed_out``, the base model's prefix), and a tied
    weight the folder omits (GPT-2's ``lm_head``) is filled through the name it is tied to.

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
        timeout: seconds a rank waits for the others once its own part is read; a rank that
            crashed or hangs makes the others raise ``CheckpointError`` within this time (at
            once when its connection closes), naming the ranks that did not answer. ``None``:
            the environment variable ``SHARDKIT_TIMEOUT``, else 600 s.
        allow_uninitialized: parameters that ``shard_model(..., init=False)`` allocated without
            values and that this load does not fill are an error naming them, whatever
            ``strict`` says (their memory holds garbage); ``True`` allows it, for a model filled
            from several sources (the unfilled ones stay refused by a later load until filled).
        mmap: local files only: a target block that lies in one contiguous range of a file
            (whole saved regions, row blocks, the output-feature blocks of a Hugging Face
            weight), with the file's dtype, and that no other tensor shares, is pointed at the
            file's pages (a private, copy-on-write mapping) instead of receiving a copy; other
            blocks are copied as usual. Loading then costs almost nothing and pages are read
            when first used; a write (an optimizer step) copies the page it touches and never
            reaches the file. A ``model.state_dict()`` entry shares its parameter's memory, so
            pass ``model.state_dict(keep_vars=True)`` to map the parameters themselves. The
            files must not be modified or truncated while the tensors live (replacing them with
            new files, as ``checkpoint.save`` does, is fine).

    Returns:
        ``state_dict`` itself.

    Raises:
        CheckpointError: the checkpoint is incomplete (no committed metadata), corrupt
            (checksum, truncated or missing file, malformed metadata, unsafe file name), or does
            not match the state_dict (missing/unexpected names under ``strict``, size, dtype);
            the message names the file and the tensor; parameters left uninitialized by
            ``shard_model(..., init=False)`` that this load would not fill (unless
            ``allow_uninitialized``). A failure on any rank raises on all,
            as does a rank that does not finish within ``timeout``.
        FileNotFoundError: there is no checkpoint at ``path``.

    Example:
        >>> # saved by 4 ranks split by rows; loaded by 2 ranks split by columns
        >>> sd = {"w": st.empty(10, 4, single_split(1, ["rank:0/cpu", "rank:1/cpu"]))}  # doctest: +SKIP
        >>> checkpoint.load(sd, "ckpt")  # rank r reads columns 2r..2r+1 of every row  # doctest: +SKIP
    """
    def read() -> None:
        views, restore = dtensor_views(state_dict, process_group)
        if is_dcp_checkpoint(path, storage_options):
            load_dcp(views, path, strict=strict, cast=cast)
        else:
            _load(views, path, storage_options, strict, cast, key_map, quiet, process_group, mmap,
                  allow_uninitialized)
        restore()

    step = f"checkpoint.load from {os.fspath(path) if isinstance(path, (str, os.PathLike)) else path!r}"
    _, world = _comm.rank_and_world(process_group)

    def peer_lost(exc: _comm.CollectiveError) -> CheckpointError:
        return CheckpointError(f"{step} failed: not every one of the {world} ranks finished loading ({exc}); a rank "
                               f"crashed, is stuck, or is not calling load.")

    _comm.agree(step, read, process_group, timeout=timeout, error=CheckpointError, lost=peer_lost)
    return state_dict


def _load(state_dict: dict[str, Any], path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None,
          strict: bool, cast: bool, key_map: KeyMap | None, quiet: bool | None,
          process_group: _comm.ProcessGroup, mmap: bool = False, allow_uninitialized: bool = False) -> None:
    rank, _ = _comm.rank_and_world(process_group)
    fs, root = resolve(path, storage_options)
    metadata, root, source = _read_source(fs, root, key_map)
    leaves = list(flatten_state_dict(state_dict))
    names = {name for name, *_ in leaves}
    tied: set[str] = set()
    if not source.endswith(METADATA_FILE):  # a Hugging Face checkpoint
        metadata, tied = convert_hf_names(fs, root, metadata, ((name, value) for name, _, _, value in leaves))
    saved = set(metadata.tensors) | set(metadata.values) | tied
    if not allow_uninitialized:  # before strict's report: the more precise one after init=False
        check_filled(leaves, saved, source)
    if strict:
        missing, unexpected = sorted(names - saved), sorted(saved - names)
        if missing or unexpected:
            msg = (f"checkpoint {source!r} does not match the state_dict: missing={missing} (in the "
                   f"state_dict, not in the checkpoint), unexpected={unexpected} (in the checkpoint, not in "
                   f"the state_dict); pass strict=False to load only what matches.")
            raise CheckpointError(msg, missing=missing, unexpected=unexpected)
    settle = mark_filled(leaves, saved)
    with DataReader(fs) as reader:
        checks = _FileChecks(reader, metadata, root, enabled=source.endswith(METADATA_FILE))
        _fill(leaves, metadata, source, root, cast, reader, checks, rank, quiet, mmap)
    settle()


def _fill(leaves: list[tuple[str, Any, Any, Any]], metadata: CheckpointMetadata, source: str, root: str,
          cast: bool, reader: DataReader, checks: _FileChecks, rank: int, quiet: bool | None,
          mmap: bool) -> None:
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
            parent[key] = metadata.values[name]
            continue
        entry = metadata.tensors.get(name)
        if entry is None:
            continue
        if _is_number(value) and len(entry.size) == 0:
            tensor = torch.empty((), dtype=entry.dtype)
            scalars.append((parent, key, type(value), tensor))
            value = tensor
        if value is None:
            # Every file of the tensor must hold what the metadata claims before its memory is allocated.
            checks.check(name, entry, entry.shards)
            value = torch.empty(entry.size, dtype=entry.dtype)
            parent[key] = value
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
        _check_target(name, value, source)
        planned = _plan_tensor(name, entry, value, root)
        checks.check(name, entry, [t.shard for t in planned])
        tasks.extend(planned)
    tasks.sort(key=lambda t: (t.path, t.shard.byte_range[0]))
    with progress(sum(t.nbytes for t in tasks), "load", rank=rank, quiet=quiet) as bar:
        scratch = memoryview(bytearray(_SCRATCH_BYTES))
        for task in tasks:
            _execute(task, reader, scratch, mmap)
            bar.update(task.nbytes)
    for parent, key, kind, tensor in scalars:
        parent[key] = kind(tensor.item())


class _FileChecks:
    """Each data file a load reads is checked once (size, header entries of the regions read), before use."""

    def __init__(self, reader: DataReader, metadata: CheckpointMetadata, root: str, *, enabled: bool) -> None:
        self._reader, self._metadata, self._root, self._enabled = reader, metadata, root, enabled
        self._done: set[tuple[str, str]] = set()

    def check(self, name: str, entry: TensorEntry, shards: Any) -> None:
        if not self._enabled:  # Hugging Face files: their metadata comes from these very headers
            return
        by_file: dict[str, list[tuple[str, SavedShard, torch.dtype]]] = {}
        for shard in shards:
            if (shard.file, shard.key) not in self._done:
                by_file.setdefault(shard.file, []).append((name, shard, entry.dtype))
        for file, regions in by_file.items():
            self._reader.check_data_file(member(self._root, file), self._metadata.files[file], regions)
            self._done.update((file, shard.key) for _, shard, _ in regions)


def _check_target(name: str, value: Any, source: str) -> None:
    """Refuse targets a load cannot fill: on the meta device (no memory) or with overlapping memory."""
    blocks = [s.tensor for s in value.local_shards()] if isinstance(value, ShardedTensor) else [value]
    for block in blocks:
        if block.device.type == "meta":
            msg = (f"cannot load {name!r} from {source!r} into a tensor on the meta device: it has no memory to "
                   f"fill. Materialize it first (e.g. model.to_empty(device='cpu'), or shard_model(..., init=False)).")
            raise CheckpointError(msg)
        if torch._debug_has_internal_overlap(block) == 1:  # 1: definitely overlaps (stride 0, expand)
            msg = (f"cannot load {name!r} from {source!r} into a tensor whose elements overlap in memory (stride "
                   f"{tuple(block.stride())} for size {tuple(block.shape)}, e.g. from expand()); load into a tensor "
                   f"with its own memory (.clone() or .contiguous()).")
            raise CheckpointError(msg)


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
        metadata = read_metadata_at(fs, root)
    return apply_key_map(metadata, key_map, source=source), folder, source


def _plan_tensor(name: str, entry: TensorEntry, value: Any, root: str) -> list[_Task]:
    """The overlaps between the saved regions of ``name`` and this rank's blocks of ``value``."""
    tasks = []
    for offsets, tensor in _targets(value):
        # The entry's index: no look at the saved regions this block does not need.
        for shard, common in entry.overlapping((tuple(offsets), tuple(tensor.shape))):
            if common == (tuple(offsets), tuple(tensor.shape)):
                # The whole block from one region: the block itself (a view would share its memory).
                tasks.append(_Task(name, member(root, shard.file), entry, shard, common, tensor, tensor))
            else:
                tasks.append(_Task(name, member(root, shard.file), entry, shard, common,
                                   tensor[box_slices(common, offsets)]))
    return tasks
