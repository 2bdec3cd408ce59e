"""Opening checkpoint files safely: regular files only, never through a symlink, never blocking.

A checkpoint folder may have been tampered with: a data file or ``shardkit.json`` replaced by
a symlink (to bytes outside the folder), a FIFO (whose ``open`` blocks until a writer comes),
a directory or a device. Every read of a checkpoint file goes through here first: local
files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` on the open
descriptor (no window between the check and the use); other file systems are asked for
the entry's type.

One kind of symlink is followed, and only where a reader asks for it (``cache_links=True``,
the Hugging Face source): a file of a Hugging Face cache snapshot. ``huggingface_hub`` keeps
each downloaded file once, as ``<cache>/blobs/<hash>``, and lays out each revision as
``<cache>/snapshots/<revision>/<file>``, a symlink to that blob (``../../blobs/<hash>``).
Such a link is followed when the file it resolves to is a regular file inside the same
cache's ``blobs/`` folder (``<cache>`` being the folder that holds both ``snapshots/`` and
``blobs/``); the resolved file is then opened like any other, without following anything
further. Every other symlink is refused, in a snapshot or not.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ._schema import CheckpointError

__all__ = ["open_regular", "read_regular", "check_regular", "cache_blob"]

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISLNK, "a symlink"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: str, kind: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path!r} is {kind}, not a regular file; refusing to read it "
                           f"(a checkpoint holds only regular files: replace it with the file saved there).")


def cache_blob(path: str) -> str | None:
    """The blob a Hugging Face cache snapshot's symlink ``path`` stands for, or ``None`` if it is not one.

    ``path`` must lie under ``<cache>/snapshots/<revision>/``, ``<cache>`` must hold a
    ``blobs`` folder, and the link must resolve (through any number of links) to a file
    inside that folder. Whether that file is a regular one is checked when it is opened.
    """
    where = os.path.abspath(path)
    parts = where.split(os.sep)
    # The nearest ancestor <cache>/snapshots/<revision> (a file may sit in subfolders of the revision).
    for k in range(len(parts) - 2, 1, -1):
        if parts[k - 1] == "snapshots":
            cache = os.sep.join(parts[:k - 1]) or os.sep
            break
    else:
        return None
    blobs = os.path.join(cache, "blobs")
    if not os.path.isdir(blobs):
        return None
    target = os.path.realpath(where)
    inside = os.path.realpath(blobs) + os.sep
    return target if target.startswith(inside) else None


def open_regular(path: str, *, cache_links: bool = False) -> tuple[int, int]:
    """``(descriptor, size)`` of local regular file ``path``, opened read-only without following a symlink.

    A symlink, FIFO, directory or device raises ``CheckpointError`` naming ``path`` at once
    (a FIFO is opened non-blocking, so no writer is awaited). A missing file raises
    ``FileNotFoundError``. The caller closes the descriptor. With ``cache_links``, a Hugging
    Face cache snapshot's symlink into its own cache's ``blobs/`` is followed (``cache_blob``),
    and the regular file it resolves to is opened.
    """
    try:
        fd = os.open(path, _FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW on a symlink
            blob = cache_blob(path) if cache_links else None
            if blob is not None:
                try:
                    return open_regular(blob)
                except CheckpointError as inner:
                    msg = (f"checkpoint file {path!r} is a Hugging Face cache link to {blob!r}, which is not a "
                           f"regular file ({inner}).")
                    raise CheckpointError(msg) from None
            if cache_links:
                msg = (f"checkpoint file {path!r} is a symlink, not a regular file; refusing to read it. Only a link "
                       f"of a Hugging Face cache snapshot (<cache>/snapshots/<revision>/<file>) to a file in the same "
                       f"cache's blobs/ folder is followed; replace it with the file itself.")
                raise CheckpointError(msg) from exc
            raise _refuse(path, "a symlink") from exc
        if exc.errno == errno.ENXIO:  # a socket or a FIFO some platforms refuse outright
            raise _refuse(path, "not a regular file") from exc
        if isinstance(exc, IsADirectoryError):
            raise _refuse(path, "a directory") from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(path, _kind(info.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_regular(path: str, start: int = 0, end: int | None = None, *, cache_links: bool = False) -> bytes:
    """Bytes ``[start, end)`` (``end=None``: to the end) of local regular file ``path``; may be short at EOF.

    ``cache_links`` as for ``open_regular``.
    """
    fd, size = open_regular(path, cache_links=cache_links)
    try:
        stop = size if end is None else min(end, size)
        chunks = []
        position = start
        while position < stop:
            data = os.pread(fd, stop - position, position)
            if not data:
                break
            chunks.append(data)
            position += len(data)
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_regular(fs: fsspec.AbstractFileSystem, path: str, *, cache_links: bool = False) -> int:
    """The size of ``path`` after checking that it is a regular file (``CheckpointError`` if not).

    Local files are checked on an opened descriptor (see ``open_regular``); on other file
    systems the entry's ``type`` must be ``"file"``. ``FileNotFoundError`` if it is missing.
    """
    if isinstance(fs, LocalFileSystem):
        fd, size = open_regular(path, cache_links=cache_links)
        os.close(fd)
        return size
    info: dict[str, Any] = fs.info(path)
    if info.get("type") not in ("file", None):
        raise _refuse(path, f"a {info.get('type')}")
    return int(info.get("size") or 0)

