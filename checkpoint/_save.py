"""``checkpoint.save``: every rank writes its share of the regions, rank 0 commits the metadata last.

Phases (every rank, in order)::

    plan      pure: flatten the state_dict, list each tensor's distinct regions and pick one
              writer per region among its holders (greedy by bytes, identical on every rank);
              regions are boxes, not placements, so any tiling (a mesh, packed slices, a
              layout read from DTensor) is saved alike and a partial value is refused first
    prepare   rank 0 creates the folder, draws a fresh generation id and takes the save lease
              (another save to the path in progress: fail now); every rank checks that all
              save the same structure (and the same plain tensors, by checksum) and learns the id
    write     each rank writes data-<generation>-r<rank>.safetensors (new names: the previous
              checkpoint at the path is untouched), checksumming each chunk while writing; every rank
              learns what each wrote (and waits for the others, with a timeout)
    commit    rank 0 checks it still holds the lease, writes shardkit.json atomically (temp
              file + rename): the commit point; then removes the files the previous
              shardkit.json listed (and those of saves that died holding the lease), no others
    cleanup   after a write or commit that failed on some rank: rank 0 removes the files of
              this generation, unless its metadata was committed

Each phase after planning runs under ``_shardkit.comm.agree``: every rank runs it, every rank
reports, and all raise together (the failing rank its own error, the others a
``CheckpointError`` naming it). A rank that never reports (crashed, stuck) makes the others
raise ``CheckpointError`` within ``timeout``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import math
import mmap
import os
import posixpath
import secrets
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import torch

from _shardkit import comm as _comm
from sharded_tensor import ShardedTensor
from sharding.layout import Box

from ._chunks import (
    CHUNK_BYTES,
    ChunkedChecksum,
    decode_chunk_array,
    encode_chunks,
)
from ._codec import build_safetensors_header, checksum, tensor_bytes
from ._dtensor import dtensor_views
from ._lease import SaveLease, lease_seconds
from ._progress import progress
from ._regions import grid_of, region_key
from ._schema import (
    CHECKSUM_ALGORITHM,
    FORMAT_VERSION,
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    RegionTable,
    TensorEntry,
    dtype_name,
    metadata_from_data,
    metadata_text,
)
from ._storage import (
    Watchdog,
    atomic_write,
    data_file_generation,
    data_file_name,
    discard,
    is_local,
    list_names,
    member,
    read_metadata_at,
    remove_quietly,
    resolve,
    run_bounded,
)
from ._walk import check_json_value, flatten_state_dict

__all__ = ["save", "run_plan", "region_keys", "data_file_about", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = _comm.DEFAULT_TIMEOUT
"""Seconds a rank waits for the others in each phase before giving up, unless ``timeout=`` or
``$SHARDKIT_TIMEOUT`` says otherwise."""

_test_hook: Callable[[str], None] | None = None
"""Private, for tests and benchmarks: called with each phase name ("planned", "writing",
"data_written", "before_commit", "committed"; the last two on rank 0 only) on the thread
running the save, so a test can crash a rank at a chosen point and a benchmark can time
the phases."""

def _hook(phase: str) -> None:
    if _test_hook is not None:
        _test_hook(phase)


@dataclass(slots=True)
class _Region:
    """One distinct region of one tensor and the rank that writes it."""

    name: str
    box: Box
    writer: int
    tensor: torch.Tensor | None  # this rank's copy, when it holds the region


@dataclass(slots=True)
class _Columns:
    """A tensor's regions in the plan as flat columns, so that rank 0 assembles a million regions with arrays."""

    offsets: list[int] = field(default_factory=list)  # every region's offsets, one after the other
    dims: list[int] = field(default_factory=list)
    writers: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Plan:
    tensors: dict[str, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    regions: list[_Region] = field(default_factory=list)  # every region of every tensor, in save order
    columns: dict[str, _Columns] = field(default_factory=dict)  # the same regions, by tensor

    def add(self, name: str, box: Box, writer: int, tensor: torch.Tensor | None) -> None:
        """Append a region of tensor ``name`` (whose ``columns`` entry exists; its regions are added one after
        the other)."""
        self.regions.append(_Region(name, box, writer, tensor))
        columns = self.columns[name]
        columns.offsets.extend(box[0])
        columns.dims.extend(box[1])
        columns.writers.append(writer)
    values: dict[str, Any] = field(default_factory=dict)
    signature: list[list[Any]] = field(default_factory=list)


def _reduce_partials(state_dict: Mapping[str, Any], reduce_partial: bool) -> dict[int, ShardedTensor]:
    """Reduced copies of the partial ``ShardedTensor`` entries, by ``id`` of the entry. Collective when any.

    Partial values are not the tensor: saving them as regions would store one holder's share.
    Refused unless ``reduce_partial``; then each is reduced into a split over its holders (a
    reduce-scatter), leaving the caller's tensor as it was.
    """
    partials = [(name, value, pending) for name, _, _, value in flatten_state_dict(state_dict)
                if isinstance(value, ShardedTensor) and (pending := value.sharding_metadata().pending) is not None]
    if partials and not reduce_partial:
        names = ", ".join(f"{name!r} (partial({pending.reduce_op}))" for name, _, pending in partials)
        what = f"entry {names} holds" if len(partials) == 1 else f"entries {names} hold"
        msg = (f"checkpoint.save: {what} partial values pending a reduction, not a tensor; reshard to a "
               f"plain layout first (e.g. t.reshard(single_split(0, ranks)) or DevicePlacement('cpu')), or pass "
               f"reduce_partial=True to save the reduced values.")
        raise ValueError(msg)
    return {id(value): value.reduced() for _, value, _ in partials}


def _plan(state_dict: Mapping[str, Any], rank: int, world: int,
          replace: Mapping[int, ShardedTensor] | None = None) -> _Plan:
    """Pure: what is saved and who writes which region. Identical on every rank for equal layouts."""
    plan = _Plan()
    load = [0] * world  # bytes assigned per rank, for greedy balancing
    for name, _, _, value in flatten_state_dict(state_dict):
        if replace:
            value = replace.get(id(value), value)
        if isinstance(value, ShardedTensor):
            metadata = value.sharding_metadata()
            size, dtype = metadata.size, metadata.dtype
            dtype_name(dtype, tensor=name)
            holders: dict[Box, list[int]] = {}
            for shard in metadata.shards:
                dims = shard.dims
                if 0 in dims:
                    continue
                holder = shard.device.rank
                if holder is None or not 0 <= holder < world:
                    msg = (f"ShardedTensor {name!r} has a shard on {str(shard.device)!r}, outside the "
                           f"process group of {world} ranks that is saving it; save it with the process "
                           f"group it was created with.")
                    raise ValueError(msg)
                ranks = holders.setdefault((shard.offsets, dims), [])
                if holder not in ranks:
                    ranks.append(holder)
            local = {s.metadata.region: s.tensor for s in value.local_shards()}
            boxes = [(box, sorted(ranks)) for box, ranks in holders.items()]
            plan.signature.append([name, "sharded", list(size), str(dtype),
                                   [[list(o), list(d), r] for (o, d), r in boxes]])
        elif isinstance(value, torch.Tensor):
            size, dtype = value.shape, value.dtype
            dtype_name(dtype, tensor=name)
            box = ((0,) * value.dim(), tuple(value.shape))
            boxes = [(box, list(range(world)))] if value.numel() > 0 else []
            local = {box: value}
            # A plain tensor is written once, from one rank: a CRC-32C of its bytes in the
            # signature makes ranks that hold different values fail the agreement step.
            values = checksum(tensor_bytes(value)) if world > 1 else ""
            plan.signature.append([name, "tensor", list(size), str(dtype), values])
        else:
            check_json_value(name, value)
            plan.values[name] = value
            plan.signature.append([name, "value"])
            continue
        plan.tensors[name] = (torch.Size(size), dtype)
        plan.columns[name] = _Columns()
        for box, ranks in boxes:
            writer = min(ranks, key=lambda r: (load[r], r))
            load[writer] += math.prod(box[1]) * dtype.itemsize
            plan.add(name, box, writer, local.get(box) if writer == rank else None)
    return plan


def _write_all(handle: Any, data: memoryview, watchdog: Watchdog | None = None) -> None:
    if watchdog is not None:
        watchdog.tick()
    while data:
        written = handle.write(data)
        if written is None:  # buffered fsspec files return None and take everything
            return
        data = data[written:]


def _find_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc ``sync_file_range`` (Linux), to start writeback early; ``None`` where unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _find_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
_CHUNK = 32 << 20   # start writeback every this many bytes
_PIECE = 1 << 20    # checksum-then-write unit, small enough to stay in the CPU cache


class _LocalFile:
    """A local file written with plain ``os.write`` calls that keeps the disk busy while writing.

    Without help the kernel starts writing dirty pages back only at ``fsync`` (for files much
    smaller than RAM), so copying into the page cache and writing to disk happen one after
    the other. After each chunk this asks for that chunk's writeback to start at once
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, asynchronous), so both overlap and the final
    ``fsync`` only waits for the tail. Where it is unavailable, writing is plain ``os.write``.
    """

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._position = 0
        self._started = 0  # writeback requested for [0, _started), always whole pages

    def write(self, data: memoryview) -> int:
        done = 0
        while done < len(data):
            done += os.write(self._fd, data[done:])
        self._position += len(data)
        if _sync_file_range is not None and self._position - self._started >= _CHUNK:
            end = self._position - self._position % mmap.PAGESIZE
            _sync_file_range(self._fd, self._started, end - self._started, _SYNC_FILE_RANGE_WRITE)
            self._started = end
        return len(data)

    def fsync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def region_keys(regions: list[_Region], plan: _Plan) -> list[str]:
    """Each region's key in its data file: ``region_key``'s, with ``#1``, ``#2``, ... where that is taken."""
    keys = []
    used = {"__metadata__"}  # safetensors' reserved key
    for region in regions:
        key = default = region_key(region.name, region.box[0], region.box[1], plan.tensors[region.name][0])
        # A tensor may be named like another tensor's region key ("w@3,0" beside a split "w"):
        # keys only need to be unique in the file, since readers take them from shardkit.json.
        suffix = 0
        while key in used:
            suffix += 1
            key = f"{default}#{suffix}"
        used.add(key)
        keys.append(key)
    return keys


def data_file_about(regions: list[_Region], keys: list[str], plan: _Plan, generation: str,
                    rank: int) -> dict[str, str]:
    """A data file's safetensors ``__metadata__``: which tensor and block each key is."""
    about = {"version": FORMAT_VERSION, "generation": generation, "rank": rank,
             "regions": {k: {"name": r.name, "offsets": list(r.box[0]), "size": list(plan.tensors[r.name][0])}
                         for k, r in zip(keys, regions)}}
    return {"format": "pt", "shardkit": json.dumps(about)}


def _write_data_file(fs: fsspec.AbstractFileSystem, path: str, regions: list[_Region],
                     plan: _Plan, generation: str, rank: int, bar: Any, feed: Any = None,
                     watchdog: Watchdog | None = None) -> tuple[int, dict[str, Any]]:
    """Write this rank's regions to one safetensors file; return its size and where each region went.

    That is, in the order of ``regions``: ``"start"``, each region's first byte in the file;
    ``"crc32c"``, the checksums of all their chunks, region after region; ``"keys"``, the
    names in the file that are not ``region_key``'s (position -> name).
    """
    keys = region_keys(regions, plan)
    entries = [(key, plan.tensors[r.name][1], r.box[1]) for key, r in zip(keys, regions)]
    prefix, ranges = build_safetensors_header(entries, data_file_about(regions, keys, plan, generation, rank))
    digests = [ChunkedChecksum(CHUNK_BYTES) for _ in regions]
    handle = _LocalFile(path) if is_local(fs) else fs.open(path, "wb")
    with _closing(handle):
        _write_all(handle, memoryview(prefix), watchdog)
        for index, (region, digest) in enumerate(zip(regions, digests)):
            tensor = region.tensor if feed is None else feed.get(index)
            assert tensor is not None and tuple(tensor.shape) == region.box[1], region
            data = tensor_bytes(tensor)
            # Checksum each piece (chunk by chunk) right before writing it: the write then reads
            # it from the CPU cache, so checksumming adds no second pass over memory. The
            # whole-region checksum is derived from the chunks' (no third pass either).
            for first in range(0, len(data), _PIECE):
                piece = data[first:first + _PIECE]
                digest.update(piece)
                _write_all(handle, piece, watchdog)
            bar.update(len(data))
            if feed is not None:
                feed.release(index)
        if isinstance(handle, _LocalFile):
            handle.fsync()
        if watchdog is not None:
            watchdog.tick("closing it")
    defaults = (region_key(r.name, r.box[0], r.box[1], plan.tensors[r.name][0]) for r in regions)
    report = {"start": [a for a, _ in ranges], "chunk_bytes": CHUNK_BYTES,
              CHECKSUM_ALGORITHM: "".join(encode_chunks(digest.values()) for digest in digests),
              "keys": {str(i): key for i, (key, default) in enumerate(zip(keys, defaults)) if key != default}}
    return len(prefix) + sum(b - a for a, b in ranges), report


@contextlib.contextmanager
def _closing(handle: Any) -> Iterator[Any]:
    """Close ``handle`` after writing; after a failure, discard it (an object store keeps no half file)."""
    try:
        yield handle
    except BaseException:
        if isinstance(handle, _LocalFile):
            handle.close()
        else:
            discard(handle)
        raise
    handle.close()


def _describe_mismatch(signatures: list[list[list[Any]]]) -> str:
    reference = {s[0]: s for s in signatures[0]}
    for r, sig in enumerate(signatures[1:], start=1):
        mine = {s[0]: s for s in sig}
        missing = sorted(set(reference) - set(mine))
        extra = sorted(set(mine) - set(reference))
        differ = sorted(n for n in set(mine) & set(reference) if mine[n] != reference[n])
        values = [n for n in differ if mine[n][:-1] == reference[n][:-1] and mine[n][1] == "tensor"]
        if values and len(values) == len(differ) and not (missing or extra):
            return (f"the plain tensor{'s' if len(values) > 1 else ''} {values[:10]} "
                    f"differ{'' if len(values) > 1 else 's'} "
                    f"between rank 0 and rank {r}: a plain torch.Tensor is saved once, from one rank, so it must "
                    f"be equal on every rank. A parameter a sharded model holds whole on every rank drifts apart "
                    f"when its ranks update it differently: most often torch.nn.utils.clip_grad_norm_ on the "
                    f"model (each rank clips by the norm of its own shards; use st.clip_grad_norm_(model, "
                    f"max_norm)), or any other per-rank change of such a parameter or its gradient (make it on "
                    f"every rank alike). Copying one rank's values over the others would hide that cause, not "
                    f"fix it. A tensor meant to differ per rank is saved as a ShardedTensor")
        if missing or extra or differ or list(mine) != list(reference):
            details = [f"missing {missing[:10]}" if missing else "", f"extra {extra[:10]}" if extra else "",
                       f"different kind, size, dtype or layout for {differ[:10]}" if differ else "",
                       "the same names in another order" if not (missing or extra or differ) else ""]
            return f"rank {r}'s state_dict differs from rank 0's: " + "; ".join(d for d in details if d)
    return "the ranks' state_dicts differ"


def _new_generation(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """Rank 0: create the folder and draw a generation id no file in it uses."""
    if fs.isfile(root):
        msg = f"cannot save a checkpoint to {root!r}: it is an existing file, and a checkpoint is a folder."
        raise FileExistsError(msg)
    fs.makedirs(root, exist_ok=True)
    used = {data_file_generation(n) for n in list_names(fs, root)}
    generation = secrets.token_hex(4)
    while generation in used:
        generation = secrets.token_hex(4)
    return generation


def _commit(fs: fsspec.AbstractFileSystem, root: str, metadata: CheckpointMetadata, text: str,
            watchdog: Watchdog | None = None) -> None:
    """Write ``text``, the ``shardkit.json`` of ``metadata``, atomically (a temporary name, then rename or
    copy over the old one)."""
    atomic_write(fs, posixpath.join(root, METADATA_FILE), [text.encode()],
                 temporary=f"{METADATA_FILE}.tmp-{metadata.generation}", watchdog=watchdog)


def _previous_files(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """The data files the committed checkpoint at ``root`` lists (empty if there is none or it is unreadable)."""
    try:
        return list(read_metadata_at(fs, root).files)
    except (CheckpointError, OSError, ValueError):
        return []


def _remove_stale(fs: fsspec.AbstractFileSystem, root: str, generation: str, previous: list[str],
                  lease: SaveLease) -> None:
    """After a commit: delete the files shardkit knows to be its own and no longer used (best effort).

    That is the data files the previous ``shardkit.json`` listed, and the data and temporary
    files of saves that died holding the lease (``lease.orphans``). Any other file in the
    folder, even one named like a data file, is left alone.
    """
    stale = {name for name in previous if data_file_generation(name) != generation}
    if lease.orphans:
        dead = set(lease.orphans) - {generation}
        stale.update(name for name in list_names(fs, root)
                     if data_file_generation(name) in dead
                     or name in {f"{METADATA_FILE}.tmp-{g}" for g in dead})
    for name in sorted(stale):
        remove_quietly(fs, member(root, name))
    lease.orphans = []


@_comm.collective("checkpoint.save")
def save(state_dict: Mapping[str, Any], path: str | os.PathLike[str], *, process_group: _comm.ProcessGroup = None,
         storage_options: Mapping[str, Any] | None = None, timeout: float | None = None,
         quiet: bool | None = None, reduce_partial: bool = False) -> None:
    """Save a (sharded) state_dict to a checkpoint folder. Collective.

    Every rank of ``process_group`` calls it with a state_dict of the same structure. Each
    rank writes the regions of ``ShardedTensor`` entries it holds (``DTensor`` entries count as
    the ShardedTensor of their layout, without a copy); a region held by several
    ranks (replicas) is written once, by one of its holders, with the writing spread over
    them. A plain ``torch.Tensor`` (the same on every rank) is written once. Non-tensor
    values (None, bool, int, float, str, lists/dicts of them) are stored as JSON. Nested
    dicts are flattened to dotted names (``{"opt": {"lr": 1}}`` -> ``"opt.lr"``).

    Complete or absent: data files get fresh names, and the checkpoint exists only once
    rank 0 has written ``shardkit.json`` last, atomically. A save that dies midway leaves
    the checkpoint previously at ``path`` (if any) loadable and unchanged; the files that
    checkpoint's metadata lists are removed only after the new metadata is committed, and no
    other file in the folder is ever removed. Two saves to one path at once cannot both
    commit: the one that finds the other's save lease (``shardkit.lock``) raises
    ``CheckpointError`` at once, and the other completes.

    Args:
        state_dict: a (possibly nested) mapping of ``ShardedTensor``, tensors and JSON values.
        path: the checkpoint folder: a local path or any fsspec URL (``"s3://bucket/ckpt"``).
        process_group: the group whose ranks the ``ShardedTensor`` layouts name; ``None``: default.
        storage_options: passed to the fsspec file system (credentials, endpoint, ...).
        timeout: seconds each rank waits for the others once its own data is written, and
            the longest storage may go without answering (a stalled server, a hung mount). A
            rank that crashed or hangs makes the others raise ``CheckpointError`` within this
            time (at once when its connection closes); storage that stops answering for
            0.8 x this time makes the rank using it raise ``CheckpointError``, and every other
            rank learns that error. The errors name the ranks that did not answer. ``None``:
            the environment variable ``SHARDKIT_TIMEOUT``, else 600 s.
        quiet: ``True`` hides the progress bar rank 0 shows on a terminal for large saves.
        reduce_partial: save ``ShardedTensor`` entries holding partial values (``PartialSpec``)
            as their reduced values (one reduce-scatter each; the entries are left as they
            are). Without it such entries are refused.

    Raises:
        TypeError: an entry is neither a tensor, a ``ShardedTensor`` nor JSON data (names the key).
        ValueError: the ranks' state_dicts differ in structure or in the values of a plain tensor,
            a JSON value contains itself, a layout names ranks outside
            the process group, or an entry holds partial values and ``reduce_partial`` is not set.
        CheckpointError: another rank failed or did not finish, or another save to ``path`` is in
            progress; nothing was committed.
        OSError: the storage failed (from fsspec), on the rank where it happened.

    Example:
        >>> # 4 ranks: a (10, 4) weight split by rows (3/3/3/1) plus a replicated bias
        >>> checkpoint.save({"w": sharded_weight, "b": bias, "epoch": 3}, "ckpt")  # doctest: +SKIP
        >>> # rank r writes ckpt/data-<id>-r0000r.safetensors; rank 0 then writes ckpt/shardkit.json
        >>> meta = checkpoint.read_metadata("ckpt")  # doctest: +SKIP
        >>> sorted(meta.tensors), meta.values  # doctest: +SKIP
        (['b', 'w'], {'epoch': 3})
    """
    rank, world = _comm.rank_and_world(process_group)
    state_dict, _ = dtensor_views(state_dict, process_group)
    fs, root = resolve(path, storage_options)
    problem: Exception | None = None
    plan = _Plan()
    try:
        plan = _plan(state_dict, rank, world, _reduce_partials(state_dict, reduce_partial))
    except Exception as exc:  # reported to every rank in run_plan, so none is left waiting
        problem = exc
    run_plan(plan, problem, fs, root, process_group=process_group, timeout=timeout, quiet=quiet)


def run_plan(plan: _Plan, problem: Exception | None, fs: fsspec.AbstractFileSystem, root: str, *,
             process_group: _comm.ProcessGroup, timeout: float | None, quiet: bool | None,
             feed: Any = None) -> None:
    """The phases of ``save`` after planning (prepare, write, commit, cleanup). Collective.

    ``plan`` holds the tensors this rank writes (``_Region.tensor``): the caller's live tensors
    for ``save``, staged copies for ``async_save``, which runs this on a background thread
    with its own process group. ``problem`` is an error raised while planning on this rank;
    it is reported to every rank before anything is written. ``feed``, when given, supplies
    the tensor of this rank's i-th written region (``feed.get(i)``, which may wait until it
    is staged, or raise if staging failed) and is told when it is written (``feed.release(i)``).
    """
    rank, world = _comm.rank_and_world(process_group)
    # The entry point's name (checkpoint.async_save's thread runs this too) goes into every error.
    job = _Job(plan, fs, root, process_group, _comm.resolve_timeout(timeout), rank, world,
               op=_comm.operation_name("checkpoint.save"))
    try:
        _prepare_phase(job, problem)
        try:
            reports = _write_phase(job, quiet=quiet, feed=feed)
            _commit_phase(job, reports)
        except Exception as exc:
            if _all_reported(exc):
                _cleanup_phase(job)
            raise
    finally:
        if job.lease is not None:
            # Not clean: data files of this save may remain (a rank died); the lease says so,
            # and the next save to commit here removes them.
            job.lease.release(finished=job.clean)
            if job.created and job.clean and is_local(job.fs):
                # This save made the folder and left nothing in it (it failed before writing):
                # the folder goes too, rather than wait for a manager's grace period.
                with contextlib.suppress(OSError):
                    os.rmdir(job.root)


def _all_reported(exc: BaseException) -> bool:
    """Whether every rank reported in the phase that raised ``exc`` (so all of them can run cleanup).

    A rank that never reported makes the phase raise a ``CheckpointError`` caused by the
    ``CollectiveError`` that found it out (``_Job.agree``).
    """
    return not isinstance(exc.__cause__, _comm.CollectiveError)


_STALL_SHARE = 0.8
"""Storage silent for this share of ``timeout`` fails: soon enough that the rank's own error, not
"did not report", reaches peers that wait ``timeout`` for it."""

_CLEANUP_LIMIT = 10.0
"""Seconds of storage silence after which best-effort cleanup gives up (the error being raised matters more)."""

_UNCHANGED = "Nothing was committed: the checkpoint previously at this path, if any, is unchanged."


@dataclass(slots=True)
class _Job:
    """One save under way: what and where, who is saving, and the generation the ranks agreed on."""

    plan: _Plan
    fs: fsspec.AbstractFileSystem
    root: str
    group: _comm.ProcessGroup
    timeout: float
    rank: int
    world: int
    generation: str = ""
    op: str = "checkpoint.save"
    lease: SaveLease | None = None  # rank 0: the right to write and commit into the folder
    clean: bool = True  # rank 0: no file of this save is left behind (nothing written, committed, or removed)
    created: bool = False  # rank 0: this save created the folder

    def storage(self, doing: str, fn: Callable[[Watchdog], Any], *, limit: float | None = None) -> Any:
        """``fn`` bounded by ``timeout`` without progress; storage errors become ``CheckpointError`` naming
        ``doing``."""
        what = f"{self.op} to {self.root!r}: {doing}"
        try:
            return run_bounded(fn, limit=self.timeout * _STALL_SHARE if limit is None else limit, what=what)
        except (CheckpointError, FileExistsError, ValueError, TypeError):  # already say what and where
            raise
        except Exception as exc:  # OSError, botocore's errors, ...: the storage's own words, with the file
            msg = f"{what} failed: {type(exc).__name__}: {exc}"
            raise CheckpointError(msg) from exc

    def agree(self, phase: str, fn: Callable[[], Any], *, lost: str, after: str = "",
              share: Callable[[Any], object] | None = None) -> tuple[Any, list[Any]]:
        """Run one phase on every rank (``_comm.agree``).

        A failure on some rank raises ``CheckpointError`` naming it on the others; a rank that
        never reports raises ``CheckpointError`` (caused by the ``CollectiveError``) saying ``lost``,
        then ``after`` (by default: nothing was committed).
        """
        def peer_lost(exc: _comm.CollectiveError) -> CheckpointError:
            return CheckpointError(f"{self.op} to {self.root!r} failed: {lost} ({exc}). {after or _UNCHANGED}")

        return _comm.agree(f"{self.op} to {self.root!r}: {phase}", fn, self.group, timeout=self.timeout,
                           share=share, error=lambda text: CheckpointError(f"{text}. {_UNCHANGED}"), lost=peer_lost)


def _prepare_phase(job: _Job, problem: Exception | None) -> None:
    """prepare: report planning errors, make the folder and the generation id, check the structure."""
    def prepare() -> str:
        if problem is not None:
            raise problem
        _hook("planned")
        if job.rank != 0:
            return ""
        job.created = is_local(job.fs) and not os.path.lexists(job.root)
        generation = job.storage("creating the folder", lambda watchdog: _new_generation(job.fs, job.root))
        # The save lease: another save to this folder in progress makes this one fail here.
        job.lease = job.storage("taking the save lease", lambda watchdog: SaveLease.acquire(
            job.fs, job.root, generation, ttl=lease_seconds()))
        return generation

    digest = hashlib.sha256(json.dumps(job.plan.signature).encode()).hexdigest()
    not_joined = (f"not every one of the {job.world} ranks joined; a rank crashed, is stuck, or is not "
                  f"calling save")
    _, everyone = job.agree("prepare", prepare, lost=not_joined, share=lambda g: {"digest": digest, "generation": g})
    if len({e["digest"] for e in everyone}) > 1:
        _, signatures = job.agree("structure check", lambda: job.plan.signature, lost=not_joined,
                                  share=lambda signature: signature)
        msg = (f"{job.op} to {job.root!r}: every rank must save a state_dict of the same structure "
               f"(names, kinds, sizes, dtypes and layouts), but {_describe_mismatch(signatures)}.")
        raise ValueError(msg)
    job.generation = everyone[0]["generation"]


def _write_phase(job: _Job, *, quiet: bool | None, feed: Any) -> list[dict[str, Any]]:
    """write: this rank's regions to a data file of the new generation; returns what every rank wrote."""
    job.clean = False  # from here on, this save's files may exist until committed or removed

    def write() -> dict[str, Any]:
        _hook("writing")
        plan = job.plan
        mine = [r for r in plan.regions if r.writer == job.rank]
        report: dict[str, Any] = {"file": None, "bytes": 0}
        if mine:
            total = sum(math.prod(r.box[1]) * plan.tensors[r.name][1].itemsize for r in mine)
            everyone_total = sum(math.prod(r.box[1]) * plan.tensors[r.name][1].itemsize for r in plan.regions)
            name = data_file_name(job.generation, job.rank)
            path = posixpath.join(job.root, name)
            # The bar counts the whole save (every rank's bytes), advanced by rank 0's share.
            with progress(everyone_total, "save", rank=job.rank, quiet=quiet, share=total) as bar:
                nbytes, columns = job.storage(f"writing {path!r}", lambda watchdog: _write_data_file(
                    job.fs, path, mine, plan, job.generation, job.rank, bar, feed, watchdog))
            report.update(file=name, bytes=nbytes, **columns)
        _hook("data_written")
        return report

    lost = (f"not every one of the {job.world} ranks finished writing its data; a rank crashed, was killed "
            f"or is stuck")
    _, reports = job.agree("write", write, lost=lost, share=lambda report: report)
    return reports


def _commit_phase(job: _Job, reports: list[dict[str, Any]]) -> None:
    """commit (rank 0): write the metadata, the commit point, then remove older generations' files."""
    def commit() -> None:
        if job.rank != 0:
            return
        _hook("before_commit")
        metadata, text = _assemble(job.plan, reports, job.generation, job.world, job.root)
        target = posixpath.join(job.root, METADATA_FILE)
        lease = job.lease
        assert lease is not None
        previous = job.storage(f"reading {target!r}", lambda watchdog: _previous_files(job.fs, job.root))
        # At most one save commits: one whose lease was taken over (or removed) fails here.
        job.storage("checking the save lease", lambda watchdog: lease.check())
        job.storage(f"writing {target!r}", lambda watchdog: _commit(job.fs, job.root, metadata, text, watchdog))
        job.clean = True
        # Files the previous checkpoint listed: best effort, and never longer than a short wait.
        with contextlib.suppress(Exception):
            job.storage("removing older files",
                        lambda watchdog: _remove_stale(job.fs, job.root, job.generation, previous, lease),
                        limit=min(job.timeout, _CLEANUP_LIMIT))
        _hook("committed")

    check = f"Whether it did: {posixpath.join(job.root, METADATA_FILE)!r} names generation {job.generation!r}."
    job.agree("commit", commit, lost="rank 0 did not report whether it committed the checkpoint", after=check)


def _cleanup_phase(job: _Job) -> None:
    """cleanup (rank 0, after every rank reported a failure): remove this generation's files unless committed."""
    def cleanup() -> None:
        if job.rank == 0 and job.generation:
            def remove(watchdog: Watchdog) -> None:
                if not _is_committed(job.fs, job.root, job.generation):
                    _remove_generation(job.fs, job.root, job.generation)

            job.storage("removing this save's files", remove, limit=min(job.timeout, _CLEANUP_LIMIT))
            job.clean = True

    # Best effort: the error that led here is the one to raise.
    with contextlib.suppress(Exception):
        job.agree("cleanup", cleanup, lost="a rank left during cleanup")


def _is_committed(fs: fsspec.AbstractFileSystem, root: str, generation: str) -> bool:
    """Whether ``shardkit.json`` at ``root`` is the one of ``generation`` (after an ambiguous failure)."""
    try:
        return read_metadata_at(fs, root).generation == generation  # never through a symlink or FIFO
    except Exception:  # unreadable or absent: not ours
        return False


def _remove_generation(fs: fsspec.AbstractFileSystem, root: str, generation: str) -> None:
    """After a failed save whose ranks all reported: remove that save's data files (best effort)."""
    for name in list_names(fs, root):
        if data_file_generation(name) == generation:
            remove_quietly(fs, posixpath.join(root, name))


def _assemble(plan: _Plan, reports: list[dict[str, Any]], generation: str, world: int,
              root: str) -> tuple[CheckpointMetadata, str]:
    """Rank 0: the metadata of the new checkpoint from every rank's report, validated, and its text.

    Column by column: a thousand tensors split over a thousand ranks are a million regions,
    assembled with array operations rather than an object per region.
    """
    n = len(plan.regions)
    files = {rep["file"]: rep["bytes"] for rep in reports if rep["file"] is not None}
    file_number = np.full(max(world, 1), -1, dtype=np.int64)  # each rank writes its own file, or none
    writing = [rank for rank, rep in enumerate(reports) if rep["file"] is not None]
    file_number[writing] = np.arange(len(writing))
    writers = np.array([w for c in plan.columns.values() for w in c.writers], dtype=np.int64)
    # Each rank reported its own regions in plan order: rank after rank, they are the plan's
    # regions in this order.
    order = np.argsort(writers, kind="stable")
    first_of_rank = np.concatenate([[0], np.cumsum(np.bincount(writers, minlength=world))])
    starts = np.empty(n, dtype=np.int64)
    starts[order] = np.array([a for rep in reports if rep["file"] is not None for a in rep["start"]], dtype=np.int64)
    keys = {int(order[first_of_rank[rank] + int(k)]): key for rank, rep in enumerate(reports)
            for k, key in rep.get("keys", {}).items()}
    # Per tensor (its regions are consecutive in the plan): the blocks and each region's chunk count.
    blocks, counts, at = [], [], 0
    for name, (size, dtype) in plan.tensors.items():
        columns = plan.columns[name]
        k, ndim = len(columns.writers), len(size)
        offsets = np.array(columns.offsets, dtype=np.int64).reshape(k, ndim)
        dims = np.array(columns.dims, dtype=np.int64).reshape(k, ndim)
        blocks.append((at, at + k, offsets, dims))
        counts.append(-(-(blocks[-1][3].prod(axis=1) * dtype.itemsize) // CHUNK_BYTES))
        at += k
    count = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    # The chunk checksums arrive in report order; put them in plan order.
    reported = [decode_chunk_array(rep[CHECKSUM_ALGORITHM], int(count[order[first_of_rank[rank]:
                                                                            first_of_rank[rank + 1]]].sum()))
                for rank, rep in enumerate(reports) if rep["file"] is not None]
    first_reported = np.empty(n, dtype=np.int64)
    first_reported[order] = np.concatenate([[0], np.cumsum(count[order])])[:-1]
    first = np.concatenate([[0], np.cumsum(count)])
    crcs = np.concatenate(reported or [np.zeros(0, dtype=np.uint32)])[
        np.repeat(first_reported - first[:-1], count) + np.arange(int(first[-1]))]
    names = list(files)
    tensors = {}
    for (name, (size, dtype)), (a, b, offsets, dims) in zip(plan.tensors.items(), blocks):
        table = RegionTable(name, size, dtype.itemsize, names, file_number[writers[a:b]], starts[a:b], CHUNK_BYTES,
                            crcs[first[a]:first[b]], keys={i - a: key for i, key in keys.items() if a <= i < b},
                            grid=grid_of(offsets, dims, size), offsets=offsets, dims=dims,
                            nbytes=dims.prod(axis=1) * dtype.itemsize)
        tensors[name] = TensorEntry(size, dtype, table)
    data = CheckpointMetadata(tensors, plan.values, files, generation, world).to_data()
    # Validate exactly what a reader will see (the data of the text written) before it becomes
    # the checkpoint.
    return metadata_from_data(data, source=posixpath.join(root, METADATA_FILE)), metadata_text(data)
