"""Sources read by byte ranges: shardkit checkpoints and Hugging Face safetensors checkpoints.

Both are safetensors data files described by metadata (``shardkit.json``, or the files' own
headers for Hugging Face), so both fill a target block the same way: the saved regions that
overlap it come from ``TensorEntry.overlapping`` (the same overlap search the reshard
planner uses). Planning works on blocks (``sharding.layout`` boxes), not placements: the
saved regions and the wanted block may come from any two layouts (a mesh, another world
size, a file per tensor), and the overlap of two arbitrary tilings is the general case that
a placement (``Split``, ``Packed``, ...) would only name for regular ones. Every read goes
through ``_reader.DataReader``, widened to whole checksummed spans (``_reader.covering``):
from format version 2 the chunks a read touches (at most one chunk of extra bytes at each
end), so partial reads are verified too; in version 1 whole regions only. A failed load never
leaves corrupt bytes in the target:

- an overlap that is exactly whole spans, contiguous in file and target (e.g. whole regions):
  read straight into the target and verified there; a failed check clears the block to zeros
  (one pass over memory less than staging);
- local files, contiguous overlap and target otherwise (e.g. row blocks): whole chunks
  stream through a small buffer, each verified and then copied into the target;
- local files, anything else: the covering range is memory mapped, verified, then moved into
  the target by one strided ``copy_``;
- other file systems: batches of rows of the overlap, each one range read widened to whole
  chunks (at most ``_SLAB_BYTES`` of rows), verified, then copied.

Before reading, each shardkit data file's size is compared with the metadata and its
safetensors header with the regions read from it (dtype, shape, byte range). Hugging Face
files carry no checksums: their bytes are checked for length only, and their metadata comes
from those very headers (``_hf``).
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from _shardkit.memory import storage_alone
from sharded_tensor import ShardedTensor
from sharding.layout import box_slices

from ._codec import check_header_entry, tensor_bytes, tensor_from_bytes
from ._hf import KeyMap, apply_key_map, convert_hf_names, read_hf_metadata
from ._progress import progress
from ._reader import DataReader, RegionCheck, covering, truncated_error
from ._schema import METADATA_FILE, CheckpointError, CheckpointMetadata, SavedShard, TensorEntry
from ._source import Block, Source
from ._storage import member, read_metadata_at

__all__ = ["ShardkitSource", "HuggingFaceSource"]

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


def _takes_raw(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether data of ``dtype`` can be read straight into ``tensor``'s memory (``tensor_bytes`` is a view)."""
    return tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.is_contiguous()


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
    if shard.chunks or shard.checksum:
        # Verify the whole chunks (version 2 and later) or the whole region (version 1) the block
        # covers. Files without checksums (Hugging Face) are not read here at all: mapping them
        # populated would fault in every page of the block, the cost the mapping avoids.
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


@dataclass(frozen=True, slots=True)
class _ReadPlan:
    """How ``_execute`` reads one overlap (``_plan_read``): the strategy and the byte ranges it uses.

    ``how`` names the function of ``_STRATEGIES`` that reads it; ``[first, last)`` are the bytes
    of the overlap in the file, ``[lo, hi)`` the same widened to whole checksummed spans, and
    ``span`` the largest checksummed span a read must see whole before copying (0: none).
    """

    how: str
    first: int = 0
    last: int = 0
    lo: int = 0
    hi: int = 0
    span: int = 0


def _plan_read(task: _Task, *, local: bool, scratch_bytes: int) -> _ReadPlan:
    """Choose how to read ``task`` from its layout, its target's memory and the storage; no I/O.

    - ``scalar``: a 0-d tensor, one element read and verified whole;
    - ``unchecked``: nothing to verify (a Hugging Face file) and the target takes the bytes as
      they lie in the file: read straight into it;
    - ``direct``: the target holds exactly whole checksummed spans (whole regions, aligned
      blocks), contiguous in file and target: read straight into it and verified there;
    - ``stream``: local, contiguous in file and target otherwise (row blocks): whole spans
      through a small buffer, verified before their wanted bytes are copied;
    - ``mapped``: local, anything else: the covering range is memory mapped, verified, copied;
    - ``rows``: other file systems: batches of rows, each one range widened to whole spans.
    """
    shard = task.shard
    if not task.common[1]:
        return _ReadPlan("scalar")
    first, last = _span(task)
    lo, hi = covering(shard, first, last)
    span = shard.chunk_bytes if shard.chunks else (hi - lo if (lo, hi) == shard.byte_range else 0)
    # One run of bytes in the file (leading dims of size 1 too: one expert's rows of a fused tensor).
    direct = math.prod(task.common[1][:_run_structure(task)]) == 1 and _takes_raw(task.dest, task.entry.dtype)
    if direct and not shard.checksum and not shard.chunks:
        how = "unchecked"
    elif direct and (lo, hi) == (first, last):
        how = "direct"
    elif direct and local and span <= scratch_bytes:
        how = "stream"
    elif local:
        how = "mapped"
    else:
        how = "rows"
    return _ReadPlan(how, first, last, lo, hi, span)


def _execute(task: _Task, reader: DataReader, scratch: memoryview, mmap: bool = False) -> None:
    """Copy the overlap ``task.common`` of a saved region into ``task.dest``, verified before it is copied
    (or, with ``mmap``, map the target onto the file's verified pages where ``_map_into`` can).

    Every read is widened to whole checksummed spans (``covering``) and verified; a failed load
    never leaves corrupt bytes in the target (verified before copying, or cleared on failure). Version-1
    regions have one span, so only whole regions are verified there, as version 1 specified.
    """
    if mmap and _map_into(task, reader):
        return
    plan = _plan_read(task, local=reader.local, scratch_bytes=len(scratch))
    _STRATEGIES[plan.how](task, plan, reader, scratch)


def _read_scalar(task: _Task, plan: _ReadPlan, reader: DataReader, scratch: memoryview) -> None:
    shard = task.shard
    data = reader.read(task.path, *shard.byte_range, tensors=task.name)
    RegionCheck(shard, task.path, task.name).update(data)
    _copy(task.dest, tensor_from_bytes(data, task.entry.dtype).reshape(()))


def _read_unchecked(task: _Task, plan: _ReadPlan, reader: DataReader, scratch: memoryview) -> None:
    reader.readinto(task.path, plan.first, tensor_bytes(task.dest), tensors=task.name)


def _read_direct(task: _Task, plan: _ReadPlan, reader: DataReader, scratch: memoryview) -> None:
    # One pass over memory less than staging; if a span is corrupt, the target's bytes are
    # zeroed before the error propagates, so none of them stay.
    direct = tensor_bytes(task.dest)
    check = RegionCheck(task.shard, task.path, task.name, plan.first, reader.verified)
    try:
        # Piece by piece, each checked right after it arrives, while it is still in the CPU cache.
        for start in range(0, len(direct), _VERIFY_PIECE):
            piece = direct[start:start + _VERIFY_PIECE]
            reader.readinto(task.path, plan.first + start, piece, tensors=task.name)
            check.update(piece)
    except CheckpointError:
        with torch.no_grad():
            task.dest.zero_()
        raise


def _read_stream(task: _Task, plan: _ReadPlan, reader: DataReader, scratch: memoryview) -> None:
    # The buffer is kept small enough for the CPU cache; each piece is whole spans.
    direct = tensor_bytes(task.dest)
    first, last, span = plan.first, plan.last, plan.span
    check = RegionCheck(task.shard, task.path, task.name, plan.lo, reader.verified)
    step = len(scratch) - (len(scratch) % span if span else 0)
    for start in range(plan.lo, plan.hi, step):
        piece = scratch[:min(step, plan.hi - start)]
        reader.readinto(task.path, start, piece, tensors=task.name)
        check.update(piece)
        a, b = max(start, first), min(start + len(piece), last)
        direct[a - first:b - first] = piece[a - start:b - start]


def _read_mapped(task: _Task, plan: _ReadPlan, reader: DataReader, scratch: memoryview) -> None:
    _copy_mapped(task, (plan.lo, plan.hi, plan.first), reader)


def _read_rows(task: _Task, plan: _ReadPlan, reader: DataReader, scratch: memoryview) -> None:
    # Batches bound the memory of one read; without chunks the region is only verifiable whole.
    shard = task.shard
    row_bytes = max(1, math.prod(shard.dims[1:]) * task.entry.dtype.itemsize)
    rows = task.common[1][0]
    per_batch = rows if not shard.chunks else max(1, _SLAB_BYTES // row_bytes)
    for row in range(0, rows, per_batch):
        count = min(per_batch, rows - row)
        a, b = _span(task, row, count)
        ca, cb = covering(shard, a, b) if shard.chunks else (plan.lo, plan.hi)
        data = reader.read(task.path, ca, cb, tensors=task.name)
        RegionCheck(shard, task.path, task.name, ca, reader.verified).update(data)
        _copy(task.dest[row:row + count], _block(data, task, a - ca, count))


_STRATEGIES = {"scalar": _read_scalar, "unchecked": _read_unchecked, "direct": _read_direct,
               "stream": _read_stream, "mapped": _read_mapped, "rows": _read_rows}


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dest.copy_(src)




def _plan_block(block: Block, root: str) -> list[_Task]:
    """The overlaps between the saved regions of ``block.name`` and the target block."""
    tasks = []
    offsets, tensor, entry = block.offsets, block.tensor, block.entry
    box = (tuple(offsets), tuple(tensor.shape))
    # The entry's index: no look at the saved regions this block does not need.
    for shard, common in entry.overlapping(box):
        if common == box:
            # The whole block from one region: the block itself (a view would share its memory).
            tasks.append(_Task(block.name, member(root, shard.file), entry, shard, common, tensor, tensor))
        else:
            tasks.append(_Task(block.name, member(root, shard.file), entry, shard, common,
                               tensor[box_slices(common, offsets)]))
    return tasks


def _plan_tensor(name: str, entry: TensorEntry, value: Any, root: str) -> list[_Task]:
    """``_plan_block`` for every local block of ``value`` (a tensor or ``ShardedTensor``)."""
    if isinstance(value, ShardedTensor):
        blocks = [(tuple(s.metadata.offsets), s.tensor) for s in value.local_shards()]
    else:
        blocks = [((0,) * value.dim(), value)]
    return [task for offsets, tensor in blocks for task in _plan_block(Block(name, entry, offsets, tensor), root)]


class _FileSource(Source):
    """Safetensors data files in ``folder`` on ``fs``, described by ``metadata``."""

    def __init__(self, fs: fsspec.AbstractFileSystem, folder: str, where: str, metadata: CheckpointMetadata,
                 *, checked: bool, cache_links: bool = False) -> None:
        super().__init__(where)
        self._fs, self._folder, self._metadata = fs, folder, metadata
        self._reader = DataReader(fs, cache_links=cache_links)
        self._checks = _FileChecks(self._reader, metadata, folder, enabled=checked)

    def describe(self, names: Collection[str] | None = None) -> CheckpointMetadata:
        return self._metadata

    def prepare(self, name: str, entry: TensorEntry) -> None:
        # Every file of the tensor must hold what the metadata claims before its memory is allocated.
        self._checks.check(name, entry, entry.shards)

    def read(self, blocks: Sequence[Block], *, rank: int = 0, quiet: bool | None = None,
             mmap: bool = False) -> None:
        tasks: list[_Task] = []
        for block in blocks:
            tasks.extend(_plan_block(block, self._folder))
        # All regions at once: each data file's header is then read and parsed once per load,
        # not once per tensor that has regions in it.
        self._checks.check_all((t.name, t.entry, t.shard) for t in tasks)
        tasks.sort(key=lambda t: (t.path, t.shard.byte_range[0]))
        with progress(sum(t.nbytes for t in tasks), "load", rank=rank, quiet=quiet) as bar:
            scratch = memoryview(bytearray(_SCRATCH_BYTES))
            for task in tasks:
                _execute(task, self._reader, scratch, mmap)
                bar.update(task.nbytes)

    def close(self) -> None:
        self._reader.close()


class ShardkitSource(_FileSource):
    """A shardkit checkpoint: ``shardkit.json`` plus data files, every chunk checksum verified."""

    format = "shardkit"

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, key_map: KeyMap | None = None) -> None:
        where = posixpath.join(root, METADATA_FILE)
        metadata = apply_key_map(read_metadata_at(fs, root), key_map, source=where)
        super().__init__(fs, root, where, metadata, checked=True)

    def verify(self, *, quiet: bool | None = None) -> list[str]:
        """Re-read every data file and region; every problem found (empty if the checkpoint is valid)."""
        return _verify_files(self._reader, self._folder, self._metadata, quiet)


class HuggingFaceSource(_FileSource):
    """A Hugging Face safetensors checkpoint (``_hf.find_hf``'s ``(folder, files, where)``)."""

    format = "huggingface"

    def __init__(self, fs: fsspec.AbstractFileSystem, found: tuple[str, list[str], str], *,
                 key_map: KeyMap | None = None) -> None:
        folder, files, where = found
        metadata = apply_key_map(read_hf_metadata(fs, folder, files, where), key_map, source=where)
        # No file checks: the metadata comes from these very headers, validated as they were read.
        # A Hugging Face cache snapshot's files are links into the cache's blobs/: followed there only.
        super().__init__(fs, folder, where, metadata, checked=False, cache_links=True)

    def match_names(self, targets: Iterable[tuple[str, Any]]) -> set[str]:
        """``from_pretrained``'s names: legacy renamings, the base model's prefix, tied weights (``_hf``)."""
        self._metadata, tied = convert_hf_names(self._fs, self._folder, self._metadata, targets)
        return tied

    def verify(self, *, quiet: bool | None = None) -> list[str]:
        """Nothing beyond what opening checked (headers, sizes): the files carry no checksums."""
        return []


class _FileChecks:
    """Each data file a load reads is checked once (size, header entries of the regions read), before use."""

    def __init__(self, reader: DataReader, metadata: CheckpointMetadata, root: str, *, enabled: bool) -> None:
        self._reader, self._metadata, self._root, self._enabled = reader, metadata, root, enabled
        self._done: set[tuple[str, str]] = set()

    def check(self, name: str, entry: TensorEntry, shards: Any) -> None:
        self.check_all((name, entry, shard) for shard in shards)

    def check_all(self, regions: Iterable[tuple[str, TensorEntry, SavedShard]]) -> None:
        """Check the files of ``(tensor, entry, saved region)`` triples: one header read per file."""
        if not self._enabled:  # Hugging Face files: their metadata comes from these very headers
            return
        by_file: dict[str, list[tuple[str, SavedShard, torch.dtype]]] = {}
        for name, entry, shard in regions:
            if (shard.file, shard.key) not in self._done:
                by_file.setdefault(shard.file, []).append((name, shard, entry.dtype))
        for file, found in by_file.items():
            # A file's size is reported for the first tensor that needs it, as when read one by one.
            self._reader.check_data_file(member(self._root, file), self._metadata.files[file], found,
                                         tensors=found[0][0])
            self._done.update((file, shard.key) for _, shard, _ in found)


def _verify_files(reader: DataReader, root: str, metadata: CheckpointMetadata, quiet: bool | None) -> list[str]:
    """Every data file and region of a shardkit checkpoint re-read and checked; the problems found."""
    problems: list[str] = []
    by_file: dict[str, list[str]] = {}
    for name, entry in metadata.tensors.items():
        for shard in entry.shards:
            if name not in by_file.setdefault(shard.file, []):
                by_file[shard.file].append(name)
    bad_files: set[str] = set()
    for file, expected in sorted(metadata.files.items()):
        try:
            _check_file(reader, root, file, expected, by_file.get(file, []), metadata)
        except _Unreadable as exc:
            problems.append(str(exc))
            bad_files.add(file)
        except CheckpointError as exc:
            problems.append(str(exc))
    regions = sorted(((shard.file, shard.byte_range[0], name, shard)
                      for name, entry in metadata.tensors.items() for shard in entry.shards
                      if shard.numel > 0 and shard.file not in bad_files), key=lambda r: r[:2])
    scratch = memoryview(bytearray(16 << 20))
    with progress(sum(r[3].nbytes for r in regions), "verify", quiet=quiet) as bar:
        for file, _, name, shard in regions:
            try:
                for piece in reader.region_pieces(member(root, file), shard, scratch, tensor=name):
                    bar.update(len(piece))
            except CheckpointError as exc:
                problems.append(str(exc))
    return problems


class _Unreadable(CheckpointError):
    """A data file whose regions cannot be read at all (missing or truncated): they are not checked one by one."""


def _check_file(reader: DataReader, root: str, file: str, expected: int, tensors: list[str],
                metadata: CheckpointMetadata) -> None:
    """Check that data file ``file`` has the recorded size and a safetensors header matching the metadata."""
    path = member(root, file)
    try:
        actual = reader.size(path, tensors=tensors)
    except CheckpointError as exc:
        raise _Unreadable(str(exc)) from exc
    if actual < expected:
        raise _Unreadable(str(truncated_error(path, tensors, 0, expected, actual)))
    if actual > expected:
        msg = (f"data file {path!r} has {actual} bytes but the metadata records {expected}: it is longer than "
               f"recorded (restore it or save the checkpoint again).")
        raise CheckpointError(msg)
    header, data_start, _ = reader.read_header(path, tensors=tensors)
    for name in tensors:
        entry = metadata.tensors[name]
        for shard in entry.shards:
            if shard.file == file:
                check_header_entry(header, data_start, shard, entry.dtype, file=path, tensor=name)


