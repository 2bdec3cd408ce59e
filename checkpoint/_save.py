"""``checkpoint.save``: every rank writes its share of the regions, rank 0 commits the metadata last.

Phases (every rank, in order)::

    plan      pure: flatten the state_dict, list each tensor's distinct regions and pick one
              writer per region among its holders (greedy by bytes, identical on every rank)
    prepare   rank 0 creates the folder and draws a fresh generation id; one small all_gather
              checks that every rank saves the same structure and shares the id
    write     each rank writes data-<generation>-r<rank>.safetensors (new names: the previous
              checkpoint at the path is untouched), checksumming while writing
    exchange  gather what was written to rank 0 (doubles as a barrier with a timeout)
    commit    rank 0 writes shardkit.json atomically (temp file + rename): the commit point;
              then removes the files of older generations
    report    rank 0 broadcasts success or the error, so every rank returns or raises together
"""

from __future__ import annotations

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch

from _shardkit import comm as _comm
from _shardkit.memory import cyclic_gc_paused
from sharded_tensor import ShardedTensor
from sharding.layout import Box

from ._dtensor import dtensor_views
from ._format import (
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    Checksum,
    SavedShard,
    TensorEntry,
    _list_names,
    build_safetensors_header,
    check_json_value,
    data_file_generation,
    data_file_name,
    dtype_name,
    flatten_state_dict,
    is_local,
    parse_metadata,
    resolve,
)
from ._progress import progress

__all__ = ["save", "run_plan", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 600.0
"""Seconds a rank waits for the others after writing its data before giving up (``timeout=``)."""

_test_hook: Callable[[str], None] | None = None
"""Private, for tests only: called with each phase name ("planned", "data_written",
"before_commit", "committed") on every rank, so a test can crash a rank at a chosen point."""

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
class _Plan:
    tensors: dict[str, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    regions: list[_Region] = field(default_factory=list)  # every region of every tensor, in save order
    values: dict[str, Any] = field(default_factory=dict)
    signature: list[list[Any]] = field(default_factory=list)


def _region_key(name: str, box: Box, size: torch.Size) -> str:
    if tuple(box[0]) == (0,) * len(size) and tuple(box[1]) == tuple(size):
        return name
    return f"{name}@{','.join(str(o) for o in box[0])}"


def _reduce_partials(state_dict: Mapping[str, Any], reduce_partial: bool) -> dict[int, ShardedTensor]:
    """Reduced copies of the partial ``ShardedTensor`` entries, by ``id`` of the entry. Collective when any.

    Partial values are not the tensor: saving them as regions would store one holder's share.
    Refused unless ``reduce_partial``; then each is reduced into a split over its holders (a
    reduce-scatter), leaving the caller's tensor as it was.
    """
    partials = [(name, value) for name, _, _, value in flatten_state_dict(state_dict)
                if isinstance(value, ShardedTensor) and value.sharding_metadata().partial is not None]
    if partials and not reduce_partial:
        names = ", ".join(f"{name!r} (partial({value.sharding_metadata().partial}))" for name, value in partials)
        what = f"entry {names} holds" if len(partials) == 1 else f"entries {names} hold"
        msg = (f"checkpoint.save: {what} partial values pending a reduction, not a tensor; reshard to a "
               f"plain layout first (e.g. t.reshard(single_split(0, ranks)) or DevicePlacement('cpu')), or pass "
               f"reduce_partial=True to save the reduced values.")
        raise ValueError(msg)
    return {id(value): value.reduced() for _, value in partials}


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
                if shard.numel == 0:
                    continue
                if shard.rank is None or not 0 <= shard.rank < world:
                    msg = (f"ShardedTensor {name!r} has a shard on {str(shard.device)!r}, outside the "
                           f"process group of {world} ranks that is saving it; save it with the process "
                           f"group it was created with.")
                    raise ValueError(msg)
                ranks = holders.setdefault(shard.region, [])
                if shard.rank not in ranks:
                    ranks.append(shard.rank)
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
            plan.signature.append([name, "tensor", list(size), str(dtype)])
        else:
            check_json_value(name, value)
            plan.values[name] = value
            plan.signature.append([name, "value"])
            continue
        plan.tensors[name] = (torch.Size(size), dtype)
        for box, ranks in boxes:
            writer = min(ranks, key=lambda r: (load[r], r))
            load[writer] += math.prod(box[1]) * dtype.itemsize
            plan.regions.append(_Region(name, box, writer, local.get(box) if writer == rank else None))
    return plan


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` in row-major order, without a copy when it is a contiguous CPU tensor."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


def _write_all(handle: Any, data: memoryview) -> None:
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
    return function  # type: ignore[no-any-return]


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

    def __enter__(self) -> _LocalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


def _write_data_file(fs: fsspec.AbstractFileSystem, path: str, regions: list[_Region],
                     plan: _Plan, generation: str, rank: int, bar: Any,
                     piece_bytes: int = _PIECE, feed: Any = None) -> tuple[int, list[dict[str, Any]]]:
    """Write this rank's regions to one safetensors file; return its size and one record per region."""
    entries, keys = [], []
    for region in regions:
        size, dtype = plan.tensors[region.name]
        keys.append(_region_key(region.name, region.box, size))
        entries.append((keys[-1], dtype, region.box[1]))
    about = {"version": 1, "generation": generation, "rank": rank,
             "regions": {k: {"name": r.name, "offsets": list(r.box[0]), "size": list(plan.tensors[r.name][0])}
                         for k, r in zip(keys, regions)}}
    prefix, ranges = build_safetensors_header(entries, {"format": "pt", "shardkit": json.dumps(about)})
    digests = [Checksum() for _ in regions]
    handle = _LocalFile(path) if is_local(fs) else fs.open(path, "wb")
    with handle:
        _write_all(handle, memoryview(prefix))
        for index, (region, digest) in enumerate(zip(regions, digests)):
            tensor = region.tensor if feed is None else feed.get(index)
            assert tensor is not None and tuple(tensor.shape) == region.box[1], region
            data = _as_bytes(tensor)
            # Checksum each piece right before writing it: the write then reads it from the
            # CPU cache, so checksumming adds no second pass over memory.
            for first in range(0, len(data), piece_bytes):
                piece = data[first:first + piece_bytes]
                digest.update(piece)
                _write_all(handle, piece)
            bar.update(len(data))
            if feed is not None:
                feed.release(index)
        if isinstance(handle, _LocalFile):
            handle.fsync()
    records = [{"name": r.name, "offsets": list(r.box[0]), "dims": list(r.box[1]), "key": key,
                "byte_range": list(byte_range), "checksum": digest.hexdigest()}
               for r, key, byte_range, digest in zip(regions, keys, ranges, digests)]
    return len(prefix) + sum(b - a for a, b in ranges), records


def _describe_mismatch(signatures: list[list[list[Any]]]) -> str:
    reference = {s[0]: s for s in signatures[0]}
    for r, sig in enumerate(signatures[1:], start=1):
        mine = {s[0]: s for s in sig}
        missing = sorted(set(reference) - set(mine))
        extra = sorted(set(mine) - set(reference))
        differ = sorted(n for n in set(mine) & set(reference) if mine[n] != reference[n])
        if missing or extra or differ or list(mine) != list(reference):
            details = [f"missing {missing[:10]}" if missing else "", f"extra {extra[:10]}" if extra else "",
                       f"different kind, size, dtype or layout for {differ[:10]}" if differ else "",
                       "the same names in another order" if not (missing or extra or differ) else ""]
            return f"rank {r}'s state_dict differs from rank 0's: " + "; ".join(d for d in details if d)
    return "the ranks' state_dicts differ"


def _prepare(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """Rank 0: create the folder and draw a generation id no file in it uses."""
    if fs.isfile(root):
        msg = f"cannot save a checkpoint to {root!r}: it is an existing file, and a checkpoint is a folder."
        raise FileExistsError(msg)
    fs.makedirs(root, exist_ok=True)
    names = _list_names(fs, root)
    used = {data_file_generation(n) for n in names}
    generation = secrets.token_hex(4)
    while generation in used:
        generation = secrets.token_hex(4)
    return generation


def _commit(fs: fsspec.AbstractFileSystem, root: str, generation: str, text: bytes) -> None:
    """Write ``text`` as ``shardkit.json`` atomically: temp file, then rename over the old one."""
    final = posixpath.join(root, METADATA_FILE)
    temp = posixpath.join(root, f"{METADATA_FILE}.tmp-{generation}")
    if is_local(fs):
        with open(temp, "wb") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, final)
        try:  # make the rename durable; some file systems cannot fsync a directory
            fd = os.open(root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
    else:
        # Object stores create an object atomically on PUT/COPY, so copying the complete temp
        # file makes the commit atomic there. (cp_file/rm_file, unlike mv, never glob-expand.)
        fs.pipe_file(temp, text)
        fs.cp_file(temp, final)
        fs.rm_file(temp)


def _remove_stale(fs: fsspec.AbstractFileSystem, root: str, generation: str) -> None:
    """After a commit: delete data and temp files of every other generation (best effort)."""
    stale = []
    for name in _list_names(fs, root):
        if name.startswith(f"{METADATA_FILE}.tmp-") or data_file_generation(name) is not None:
            if data_file_generation(name) != generation and name != f"{METADATA_FILE}.tmp-{generation}":
                stale.append(posixpath.join(root, name))
    for path in stale:
        try:
            fs.rm_file(path)
        except OSError:
            pass


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def save(state_dict: Mapping[str, Any], path: str | os.PathLike[str], *, process_group: _comm.ProcessGroup = None,
         storage_options: Mapping[str, Any] | None = None, timeout: float = DEFAULT_TIMEOUT,
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
    the checkpoint previously at ``path`` (if any) loadable and unchanged; files of older
    saves are removed only after the new metadata is committed. Saving twice to the same
    path at the same time is not supported.

    Args:
        state_dict: a (possibly nested) mapping of ``ShardedTensor``, tensors and JSON values.
        path: the checkpoint folder: a local path or any fsspec URL (``"s3://bucket/ckpt"``).
        process_group: the group whose ranks the ``ShardedTensor`` layouts name; ``None``: default.
        storage_options: passed to the fsspec file system (credentials, endpoint, ...).
        timeout: seconds each rank waits for the others once its own data is written. A rank
            that crashed or hangs makes the others raise ``CheckpointError`` within this time
            (at once when its connection closes).
        quiet: ``True`` hides the progress bar rank 0 shows on a terminal for large saves.
        reduce_partial: save ``ShardedTensor`` entries holding partial values (``PartialSpec``)
            as their reduced values (one reduce-scatter each; the entries are left as they
            are). Without it such entries are refused.

    Raises:
        TypeError: an entry is neither a tensor, a ``ShardedTensor`` nor JSON data (names the key).
        ValueError: the ranks' state_dicts differ in structure, a layout names ranks outside
            the process group, or an entry holds partial values and ``reduce_partial`` is not set.
        CheckpointError: another rank failed or did not finish; nothing was committed.
        OSError: the storage failed (from fsspec), on the rank where it happened.

    Example:
        >>> # 4 ranks: a (10, 4) weight split by rows (3/3/3/1) plus a replicated bias
        >>> checkpoint.save({"w": sharded_weight, "b": bias, "epoch": 3}, "ckpt")  # doctest: +SKIP
        >>> # rank r writes ckpt/data-<id>-r0000r.safetensors; rank 0 then writes ckpt/shardkit.json
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
             process_group: _comm.ProcessGroup, timeout: float, quiet: bool | None,
             piece_bytes: int = _PIECE, feed: Any = None) -> None:
    """The phases of ``save`` after planning (prepare, write, exchange, commit, report). Collective.

    ``plan`` holds the tensors this rank writes (``_Region.tensor``): the caller's live tensors
    for ``save``, staged copies for ``async_save``, which runs this on a background thread
    with its own process group. ``problem`` is an error raised while planning on this rank;
    it is reported to every rank before anything is written. ``piece_bytes`` is the
    checksum-then-write unit: a background thread uses larger pieces, since each piece is a
    point where it must win the interpreter lock back from the training thread. ``feed``,
    when given, supplies the tensor of this rank's i-th written region (``feed.get(i)``,
    which may wait until it is staged) and is told when it is written (``feed.release(i)``).
    """
    rank, world = _comm.rank_and_world(process_group)
    generation = ""
    if problem is None:
        try:
            _hook("planned")
            # prepare: rank 0 makes the folder and the generation id; everyone checks the structure.
            generation = _prepare(fs, root) if rank == 0 else ""
        except Exception as exc:  # reported to every rank below, so none is left waiting
            problem = exc
    digest = hashlib.sha256(json.dumps(plan.signature).encode()).hexdigest()
    hello = {"digest": digest, "generation": generation, "error": None if problem is None else _error_text(problem)}
    try:
        everyone = _comm.all_gather_json(hello, process_group, timeout=timeout, what="checkpoint.save (prepare)")
    except _comm.CollectiveError as exc:
        msg = (f"checkpoint.save to {root!r} failed before writing anything: not every one of the {world} "
               f"ranks joined ({exc}); a rank crashed, is stuck, or is not calling save.")
        raise CheckpointError(msg) from (problem or exc)
    if problem is not None:
        raise problem
    failed = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"] is not None]
    if failed:
        msg = (f"checkpoint.save to {root!r} failed before writing anything: "
               + "; ".join(f"rank {r}: {e}" for r, e in failed))
        raise CheckpointError(msg)
    if len({e["digest"] for e in everyone}) > 1:
        signatures = _comm.all_gather_json(plan.signature, process_group, timeout=timeout,
                                           what="checkpoint.save (structure check)")
        msg = (f"checkpoint.save to {root!r}: every rank must save a state_dict of the same structure "
               f"(names, kinds, sizes, dtypes and layouts), but {_describe_mismatch(signatures)}.")
        raise ValueError(msg)
    generation = everyone[0]["generation"]

    # write: this rank's regions, under a name no earlier save used.
    mine = [r for r in plan.regions if r.writer == rank]
    file_name = data_file_name(generation, rank)
    report: dict[str, Any] = {"error": None, "file": None, "bytes": 0, "records": []}
    failure: BaseException | None = None
    total = sum(math.prod(r.box[1]) * plan.tensors[r.name][1].itemsize for r in mine)
    everyone_total = sum(math.prod(r.box[1]) * plan.tensors[r.name][1].itemsize for r in plan.regions)
    try:
        if mine:
            # The bar counts the whole save (every rank's bytes), advanced by rank 0's share.
            with progress(everyone_total, "save", rank=rank, quiet=quiet, share=total) as bar:
                nbytes, records = _write_data_file(fs, posixpath.join(root, file_name), mine, plan,
                                                   generation, rank, bar, piece_bytes, feed)
            report.update(file=file_name, bytes=nbytes, records=records)
        _hook("data_written")
    except Exception as exc:
        failure = exc
        report["error"] = _error_text(exc)

    # exchange: everything written reaches rank 0; a dead or stuck rank stops the save here.
    try:
        reports = _comm.gather_json(report, 0, process_group, timeout=timeout,
                                    what="waiting for every rank to finish writing")
    except _comm.CollectiveError as exc:
        msg = (f"checkpoint.save to {root!r} failed: not every one of the {world} ranks finished writing "
               f"its data ({exc}); a rank crashed, was killed or is stuck. Nothing was committed: the "
               f"checkpoint previously at this path, if any, is unchanged.")
        raise CheckpointError(msg) from (failure or exc)

    # commit (rank 0): the metadata file is the commit point.
    status: dict[str, Any] = {"error": None}
    if rank == 0:
        assert reports is not None
        errors = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"] is not None]
        if errors:
            status["error"] = "; ".join(f"rank {r}: {e}" for r, e in errors)
            _remove_generation(fs, root, generation)
        else:
            committed = False
            try:
                _hook("before_commit")
                _, text = _assemble(plan, reports, generation, world, root)
                _commit(fs, root, generation, text)
                committed = True
                _remove_stale(fs, root, generation)
                _hook("committed")
            except Exception as exc:
                failure = failure or exc
                status["error"] = f"rank 0: {_error_text(exc)}"
                if not committed and not _is_committed(fs, root, generation):
                    _remove_generation(fs, root, generation)
    try:
        status = _comm.broadcast_json(status, 0, process_group, timeout=timeout,
                                      what="waiting for rank 0 to commit")
    except _comm.CollectiveError as exc:
        msg = (f"checkpoint.save to {root!r}: rank 0 did not report whether it committed the checkpoint "
               f"({exc}); check {posixpath.join(root, METADATA_FILE)!r}.")
        raise CheckpointError(msg) from exc
    if status["error"] is not None:
        if failure is not None:
            raise failure
        msg = (f"checkpoint.save to {root!r} failed, nothing was committed (the checkpoint previously at "
               f"this path, if any, is unchanged): {status['error']}")
        raise CheckpointError(msg)


def _is_committed(fs: fsspec.AbstractFileSystem, root: str, generation: str) -> bool:
    """Whether ``shardkit.json`` at ``root`` is the one of ``generation`` (after an ambiguous failure)."""
    try:
        return bool(json.loads(fs.cat_file(posixpath.join(root, METADATA_FILE))).get("generation") == generation)
    except Exception:  # unreadable or absent: not ours
        return False


def _remove_generation(fs: fsspec.AbstractFileSystem, root: str, generation: str) -> None:
    """After a failed save whose ranks all reported: remove that save's data files (best effort)."""
    for name in _list_names(fs, root):
        if data_file_generation(name) == generation:
            try:
                fs.rm_file(posixpath.join(root, name))
            except OSError:
                pass


def _assemble(plan: _Plan, reports: list[dict[str, Any]], generation: str, world: int,
              root: str) -> tuple[CheckpointMetadata, bytes]:
    """Rank 0: the metadata of the new checkpoint from every rank's records, validated, and its text."""
    # A million regions are millions of small objects, none in a cycle.
    with cyclic_gc_paused():
        return _assemble_metadata(plan, reports, generation, world, root)


def _assemble_metadata(plan: _Plan, reports: list[dict[str, Any]], generation: str, world: int,
                       root: str) -> tuple[CheckpointMetadata, bytes]:
    shards: dict[str, list[SavedShard]] = {name: [] for name in plan.tensors}
    files: dict[str, int] = {}
    for rep in reports:
        if rep["file"] is None:
            continue
        files[rep["file"]] = rep["bytes"]
        for rec in rep["records"]:
            shards[rec["name"]].append(SavedShard(tuple(rec["offsets"]), tuple(rec["dims"]), rep["file"],
                                                  rec["key"], tuple(rec["byte_range"]), rec["checksum"]))
    order = {(r.name, r.box): i for i, r in enumerate(plan.regions)}
    tensors = {name: TensorEntry(size, dtype, tuple(sorted(shards[name], key=lambda s: order[(name, s.region)])))
               for name, (size, dtype) in plan.tensors.items()}
    text = CheckpointMetadata(tensors, plan.values, files, generation, world).to_json().encode()
    # Validate exactly what a reader will see before it becomes the checkpoint.
    return parse_metadata(text, source=posixpath.join(root, METADATA_FILE)), text
