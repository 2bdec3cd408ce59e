"""Where checkpoints live: fsspec file systems, folder listings, data file names, and atomic writes.

Storage is an fsspec URL or local path; there is no storage abstraction beyond what fsspec
gives. Local file systems get os-level fast paths (``fsync``, ``os.replace``).
"""

from __future__ import annotations

import os
import posixpath
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ._safe_open import read_regular
from ._schema import (
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    check_file_name,
    parse_metadata,
)

__all__ = ["resolve", "is_local", "member", "data_file_name", "data_file_generation", "list_names",
           "read_metadata", "read_metadata_at", "atomic_write", "discard", "remove_quietly", "Watchdog",
           "run_bounded"]

T = TypeVar("T")

_DATA_FILE = re.compile(r"^data-(?P<generation>[0-9a-f]+)-r(?P<rank>\d{5,})(?:-p(?P<part>\d+))?\.safetensors$")


def resolve(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
            ) -> tuple[fsspec.AbstractFileSystem, str]:
    """``(filesystem, folder path)`` for a local path or fsspec URL, like ``fsspec.core.url_to_fs``."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        msg = f"checkpoint path must be a non-empty str or os.PathLike, got {path!r}."
        raise ValueError(msg)
    fs, root = fsspec.core.url_to_fs(text, **dict(storage_options or {}))
    root = root.rstrip("/") or root
    return fs, root


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local file system (enables os-level fast paths: fsync, os.replace)."""
    return isinstance(fs, LocalFileSystem)



def member(root: str, name: str) -> str:
    """The path of file ``name`` (validated with ``check_file_name``) inside folder ``root``."""
    check_file_name(name, source=posixpath.join(root, METADATA_FILE))
    return posixpath.join(root, name)


def data_file_name(generation: str, rank: int, part: int | None = None) -> str:
    """``data-<generation>-r<rank:05d>[-p<part>].safetensors``: the data file of one rank in one save."""
    suffix = "" if part is None else f"-p{part:03d}"
    return f"data-{generation}-r{rank:05d}{suffix}.safetensors"


def data_file_generation(name: str) -> str | None:
    """The generation of a data file name, or ``None`` if ``name`` is not one."""
    match = _DATA_FILE.match(name)
    return match.group("generation") if match else None



def list_names(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Plain names of the entries of folder ``root`` (empty if it does not exist)."""
    fs.invalidate_cache(root)  # other processes write here: a cached listing (s3fs) may be stale
    try:
        entries = fs.ls(root, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [posixpath.basename(str(e).rstrip("/")) for e in entries]


def read_metadata(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
                  ) -> CheckpointMetadata:
    """Read a checkpoint's metadata without reading tensor data.

    Args:
        path: the checkpoint folder, a local path or fsspec URL (``"s3://bucket/ckpt"``).
        storage_options: passed to the fsspec file system (credentials, endpoint, ...).

    Returns:
        ``CheckpointMetadata``: ``.tensors`` (name -> ``.size``, ``.dtype``, ``.shards``) and
        ``.values`` (the non-tensor entries), with nested state_dicts flattened to dotted names.

    Raises:
        CheckpointError: the folder holds data files but no committed metadata (an incomplete
            save), or the metadata is malformed.
        FileNotFoundError: there is no checkpoint at ``path``.

    Example:
        >>> md = checkpoint.read_metadata("ckpt")  # doctest: +SKIP
        >>> md.tensors["fc.weight"].size, md.values["epoch"]  # doctest: +SKIP
        (torch.Size([10, 4]), 3)
    """
    fs, root = resolve(path, storage_options)
    fs, root = resolve(path, storage_options)
    return read_metadata_at(fs, root)


def read_metadata_at(fs: fsspec.AbstractFileSystem, root: str) -> CheckpointMetadata:
    """``read_metadata`` of the folder ``root`` on ``fs``."""
    source = posixpath.join(root, METADATA_FILE)
    try:
        # Local: never through a symlink, never blocking on a FIFO (CheckpointError naming it).
        text = read_regular(source) if is_local(fs) else fs.cat_file(source)
    except FileNotFoundError:
        text = None
    except (IsADirectoryError, NotADirectoryError) as exc:
        msg = f"{source!r} is not a readable checkpoint metadata file ({exc})."
        raise CheckpointError(msg) from exc
    if text is None:
        leftovers = list_names(fs, root)
        data = sorted(n for n in leftovers if data_file_generation(n) is not None)
        if data:
            msg = (f"checkpoint {root!r} is incomplete: it holds {len(data)} data file(s) (e.g. {data[0]!r}) "
                   f"but no {METADATA_FILE!r}, so the save that wrote them never committed (it crashed "
                   f"or is still running); save it again.")
            raise CheckpointError(msg)
        msg = f"no shardkit checkpoint at {root!r}: {source!r} does not exist."
        if ".metadata" in leftovers:
            # Never read here: DCP's .metadata is a pickle, opened only when the caller asks for DCP.
            msg += (" The folder holds a '.metadata' file, as a torch.distributed.checkpoint (DCP) folder does; "
                    "DCP folders are read only when named: checkpoint.load(..., from_format='dcp'), "
                    "checkpoint.convert(..., from_format='dcp') or the command line's convert --from dcp.")
        raise FileNotFoundError(msg)
    return parse_metadata(text, source=source)


def remove_quietly(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete file ``path`` if it exists; best effort (cleanup must not hide the error being handled)."""
    try:
        fs.rm_file(path)
    except OSError:  # FileNotFoundError included
        pass


def discard(handle: Any) -> None:
    """Close a file being written after a failure without completing it (no half object on S3)."""
    if isinstance(handle, fsspec.spec.AbstractBufferedFile):
        handle.discard()        # s3fs: abort the multipart upload
        handle.closed = True    # and never flush the rest
    else:
        handle.close()


def atomic_write(fs: fsspec.AbstractFileSystem, path: str, pieces: Iterable[bytes | memoryview], *,
                 temporary: str | None = None, watchdog: Watchdog | None = None) -> None:
    """Write the concatenation of ``pieces`` to ``path`` so that it is complete or absent.

    The bytes go to a temporary file in the same folder (``temporary``, a plain name; by
    default ``.<name>.partial-<random>``), which is then committed: renamed over ``path`` on a
    local file system (after ``fsync``, and the rename made durable with an ``fsync`` of the
    folder where the file system allows it), copied to ``path`` elsewhere (object stores create
    an object atomically on PUT/COPY; ``cp_file``/``rm_file``, unlike ``mv``, never
    glob-expand). Whatever fails in between, the temporary file is removed and ``path`` is left
    as it was: absent, or its previous content. ``watchdog``, when given, is ticked between
    the steps, so a write abandoned after a stall never reaches the commit.
    """
    tick = watchdog.tick if watchdog is not None else (lambda doing="": None)
    folder = posixpath.dirname(path) or "."
    temp = posixpath.join(folder, temporary or f".{posixpath.basename(path)}.partial-{uuid.uuid4().hex[:8]}")
    if is_local(fs):
        fs.makedirs(folder, exist_ok=True)
        try:
            with open(temp, "wb") as handle:
                handle.writelines(pieces)
                handle.flush()
                os.fsync(handle.fileno())
            tick()
            os.replace(temp, path)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise
        try:  # make the rename durable; some file systems cannot fsync a directory
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
        return
    handle = fs.open(temp, "wb")
    try:
        for piece in pieces:
            tick()
            handle.write(piece)
    except BaseException:
        try:
            discard(handle)
        finally:
            remove_quietly(fs, temp)
        raise
    try:
        handle.close()
        tick()
        fs.cp_file(temp, path)
    finally:
        remove_quietly(fs, temp)


class Watchdog:
    """Progress of storage work running on another thread: ``tick()`` between storage calls.

    Once the waiting thread has given up, the next ``tick()`` raises, so a worker that wakes
    up when storage recovers stops there instead of carrying on (e.g. committing a checkpoint
    whose save was already reported as failed).
    """

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.doing = ""
        self.abandoned = False

    def tick(self, doing: str = "") -> None:
        if self.abandoned:
            msg = f"storage work abandoned after a stall{f' while {self.doing}' if self.doing else ''}"
            raise CheckpointError(msg)
        self.last = time.monotonic()
        if doing:
            self.doing = doing


def run_bounded(fn: Callable[[Watchdog], T], *, limit: float | None, what: str) -> T:
    """``fn(watchdog)`` on a worker thread; ``CheckpointError`` once it goes ``limit`` s without a tick.

    Storage calls cannot be interrupted (a socket read from a stopped server blocks for as
    long as the client library retries, minutes for s3fs), so the caller stops waiting
    instead: the worker is a daemon thread left to finish or fail on its own, and the caller
    raises with what the worker was doing. Exceptions from ``fn`` propagate unchanged. With
    ``limit=None`` it simply calls ``fn``.
    """
    watchdog = Watchdog()
    if limit is None:
        return fn(watchdog)
    outcome: list[Any] = []
    done = threading.Event()

    def work() -> None:
        try:
            outcome.append((True, fn(watchdog)))
        except BaseException as exc:  # handed to the waiting thread
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=work, name=f"shardkit storage: {what}", daemon=True).start()
    while not done.wait(min(1.0, limit)):
        idle = time.monotonic() - watchdog.last
        if idle >= limit:
            watchdog.abandoned = True
            doing = f" while {watchdog.doing}" if watchdog.doing else ""
            msg = (f"{what}: no answer from storage for {idle:.0f} s{doing} (timeout={limit:g} s); the storage "
                   f"server or file system is stalled or unreachable.")
            raise CheckpointError(msg)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
