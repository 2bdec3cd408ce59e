"""Opening checkpoint files safely: regular files only, never through a symlink, never blocking.

A checkpoint folder may have been tampered with: a data file or ``shardkit.json`` replaced by
a symlink (to bytes outside the folder), a FIFO (whose ``open`` blocks until a writer comes),
a directory or a device. Every read of a checkpoint file goes through here first: local
files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` on the open
descriptor (no window between the check and the use); other file systems are asked for
the entry's type.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ._schema import CheckpointError

__all__ = ["open_regular", "read_regular", "check_regular"]

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


def open_regular(path: str) -> tuple[int, int]:
    """``(descriptor, size)`` of local regular file ``path``, opened read-only without following a symlink.

    A symlink, FIFO, directory or device raises ``CheckpointError`` naming ``path`` at once
    (a FIFO is opened non-blocking, so no writer is awaited). A missing file raises
    ``FileNotFoundError``. The caller closes the descriptor.
    """
    try:
        fd = os.open(path, _FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW on a symlink
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


def read_regular(path: str, start: int = 0, end: int | None = None) -> bytes:
    """Bytes ``[start, end)`` (``end=None``: to the end) of local regular file ``path``; may be short at EOF."""
    fd, size = open_regular(path)
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


def check_regular(fs: fsspec.AbstractFileSystem, path: str) -> int:
    """The size of ``path`` after checking that it is a regular file (``CheckpointError`` if not).

    Local files are checked on an opened descriptor (see ``open_regular``); on other file
    systems the entry's ``type`` must be ``"file"``. ``FileNotFoundError`` if it is missing.
    """
    if isinstance(fs, LocalFileSystem):
        fd, size = open_regular(path)
        os.close(fd)
        return size
    info: dict[str, Any] = fs.info(path)
    if info.get("type") not in ("file", None):
        raise _refuse(path, f"a {info.get('type')}")
    return int(info.get("size") or 0)

