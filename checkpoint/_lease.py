"""The save lease: at most one save writes into a checkpoint folder at a time, and at most one commits.

Without it, two saves to one path (two jobs, or two threads with separate groups) each
commit and then delete "older" data files, which are the other save's: both report success
and the folder is left with a ``shardkit.json`` whose data files are gone.

``shardkit.lock`` in the folder holds the lease. Its content names the save that holds it::

    {"generation": "3f9a2c1b", "token": "<random>", "pid": 1234, "host": "node7",
     "state": "writing" | "done", "expires": 1732350000.0, "orphans": ["9c0d1e2f"]}

Local folders: the lease is an exclusive ``flock`` on the open lock file, taken without
waiting; the kernel releases it when the holder exits or crashes, so a dead save never
blocks the next one. A save that finishes cleanly removes the file (so a folder holds only
the checkpoint between saves); a save that locked a file just as it was removed notices
that the path no longer names its file and tries again. Other file systems (object stores,
``memory://``) have no locks: the lease is the file's content, valid until ``expires``. A
thread of the holder renews it every third of its duration (``lease_seconds()``, 30 s by
default, ``$SHARDKIT_LEASE_SECONDS``) for as long as the save runs, so a live writer keeps
it however long it takes, and a writer that died blocks the next save for at most that
duration. The holder checks at commit time that the file still names it (``check``), so a
save whose lease was taken over (its renewals failed for a whole duration, e.g. storage
stalled) fails instead of committing. On object stores this narrows the window to the time
between that check and the commit; it does not close it.

A lease left in state ``writing`` names a save that died before finishing: its data files
(``data-<generation>-r*``) were written by shardkit and may be removed by the next save
after it commits (``orphans``, kept in the lease until a save has removed them). Nothing
else in the folder is ever inferred to be shardkit's.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import posixpath
import secrets
import socket
import threading
import time
from typing import Any

import fsspec

from . import _strict_json as strict_json
from ._schema import CheckpointError
from ._storage import is_local, list_names

__all__ = ["LOCK_FILE", "LEASE_ENV", "DEFAULT_LEASE_SECONDS", "SaveLease", "claim_abandoned", "lease_seconds"]

LOCK_FILE = "shardkit.lock"

LEASE_ENV = "SHARDKIT_LEASE_SECONDS"
"""Environment variable: seconds a lease on a file system without locks lasts after its last renewal."""

DEFAULT_LEASE_SECONDS = 30.0
"""How long a lease on a file system without locks (object stores, ``memory://``) outlives the
last renewal by its holder, which renews it every third of that while it lives: a save that
died blocks the next save to its folder for at most this long."""


_RENEWAL_WAIT = 2.0


def lease_seconds() -> float:
    """``$SHARDKIT_LEASE_SECONDS`` if set, else ``DEFAULT_LEASE_SECONDS``.

    Raises:
        ValueError: the variable is not a positive, finite number of seconds.
    """
    text = os.environ.get(LEASE_ENV, "").strip()
    if not text:
        return DEFAULT_LEASE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        msg = f"{LEASE_ENV}={text!r} is not a lease duration; use a positive, finite number of seconds."
        raise ValueError(msg)
    return value


class SaveLease:
    """The right to write and commit into one checkpoint folder; see the module docstring.

    Attributes:
        generation: the generation of the save holding it.
        orphans: generations of earlier saves that died holding the lease: their data files
            are shardkit's to remove once a save has committed (then clear this list).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, generation: str, token: str,
                 fd: int | None, orphans: list[str], ttl: float) -> None:
        self._fs, self._root, self._token, self._fd, self._ttl = fs, root, token, fd, ttl
        self.generation = generation
        self.orphans = orphans
        self._writing = threading.Lock()  # the renewing thread and the holder write the same file
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def path(self) -> str:
        return posixpath.join(self._root, LOCK_FILE)

    # -- taking it --------------------------------------------------------------------------

    @classmethod
    def acquire(cls, fs: fsspec.AbstractFileSystem, root: str, generation: str, *, ttl: float) -> SaveLease:
        """Take the lease on folder ``root`` (which exists) for the save ``generation``, or raise.

        Raises ``CheckpointError`` naming the folder when another save holds it. ``ttl`` is
        how long the lease lasts on file systems without locks (renewed by ``check``).
        """
        token = secrets.token_hex(8)
        path = posixpath.join(root, LOCK_FILE)
        if is_local(fs):
            return cls._acquire_local(fs, root, path, generation, token, ttl)
        previous = _parse(_read_remote(fs, path))
        now = time.time()
        if previous is not None and previous.get("state") == "writing" and float(previous.get("expires", 0)) > now:
            raise _busy(root, previous)
        lease = cls(fs, root, generation, token, None, _orphans(previous), ttl)
        lease._write("writing")
        if ttl <= 0:
            return lease  # expired from the start (tests): nothing to renew
        lease._renewer = threading.Thread(target=lease._renew, name=f"shardkit-lease {path}", daemon=True)
        lease._renewer.start()
        return lease

    @classmethod
    def _acquire_local(cls, fs: fsspec.AbstractFileSystem, root: str, path: str, generation: str, token: str,
                       ttl: float) -> SaveLease:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            msg = (f"cannot take the save lease {path!r} of checkpoint {root!r}: {exc}; the folder must be "
                   f"writable and {LOCK_FILE!r} a regular file.")
            raise CheckpointError(msg) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = _parse(_read_fd(fd))
                if held is not None:
                    held.pop("expires", None)  # a lock, held until its process exits: it does not expire
                raise _busy(root, held) from None
            if not _same_file(fd, path):  # the holder removed it as it finished: take a fresh one
                os.close(fd)
                return cls._acquire_local(fs, root, path, generation, token, ttl)
            previous = _parse(_read_fd(fd))
        except BaseException:
            os.close(fd)
            raise
        lease = cls(fs, root, generation, token, fd, _orphans(previous), ttl)
        lease._write("writing")
        return lease

    # -- holding it -------------------------------------------------------------------------

    def _content(self, state: str) -> bytes:
        return json.dumps({"generation": self.generation, "token": self._token, "pid": os.getpid(),
                           "host": socket.gethostname(), "state": state,
                           "expires": time.time() + self._ttl, "orphans": self.orphans}).encode()

    def _write(self, state: str) -> None:
        with self._writing:
            data = self._content(state)
            if self._fd is not None:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, data, 0)
            else:
                self._fs.pipe_file(self.path, data)

    def _renew(self) -> None:
        """Thread: push ``expires`` forward every third of the duration while the lease is held."""
        while not self._stop.wait(self._ttl / 3):
            try:
                current = _parse(_read_remote(self._fs, self.path))
                if current is None or current.get("token") != self._token:
                    return  # taken over or removed: ``check`` says so before any commit
                with self._writing:
                    if self._stop.is_set():
                        return
                    self._fs.pipe_file(self.path, self._content("writing"))
            except Exception:  # a failed renewal is retried; the lease lasts a whole duration
                continue

    def _stop_renewing(self) -> None:
        self._stop.set()
        renewer, self._renewer = self._renewer, None
        # Taking the write lock waits for a renewal in flight, so none lands after release;
        # not for long: a stalled storage must not stall the save's own failure.
        if renewer is not None and self._writing.acquire(timeout=_RENEWAL_WAIT):
            self._writing.release()

    def check(self) -> None:
        """Raise ``CheckpointError`` unless this save still holds the lease (call right before committing)."""
        if self._fd is not None:
            current = _parse(_read_fd(self._fd)) if _same_file(self._fd, self.path) else None
        else:
            current = _parse(_read_remote(self._fs, self.path))
        if current is None or current.get("token") != self._token:
            msg = (f"checkpoint.save to {self._root!r} lost its save lease {self.path!r} before committing "
                   f"(another save took it over: {_who(current)}); nothing was committed by this save.")
            raise CheckpointError(msg)
        if self._fd is None:
            self._write("writing")  # renew

    def drop(self) -> None:
        """Give the lease up without touching the lock file (its folder was removed under it)."""
        self._stop_renewing()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self, *, finished: bool) -> None:
        """Give the lease up. ``finished=False`` leaves it marked ``writing`` (this save's data files
        may remain, for the next save to remove); a finished save with no orphans left removes the file."""
        self._stop_renewing()
        try:
            if finished and not self.orphans:
                # Removed while still locked: a save waiting on this file sees it is gone and retries.
                if self._fd is not None:
                    os.unlink(self.path)
                else:
                    self._fs.rm_file(self.path)
            elif finished:
                self._write("done")
        except OSError:
            pass  # the lease is released below either way; a stale "writing" only marks an orphan
        finally:
            if self._fd is not None:
                os.close(self._fd)  # also drops the flock
                self._fd = None


# A save creates its folder and takes the lease at once: a folder without a lease file and
# without any entry is left alone this long after its last change (a save may be between
# the two), then it counts as abandoned.
_UNLEASED_GRACE = 60.0


def claim_abandoned(fs: fsspec.AbstractFileSystem, root: str, *, ttl: float) -> SaveLease | None:
    """The lease of folder ``root`` when no live save can hold it, for removing the folder; else ``None``.

    Proven gone means: the lock file is not locked (local folders: its holder's process
    exited), or its lease expired (other file systems), or there is no lock file while the
    folder holds files (a save holds its lease from right after creating the folder until
    its files are committed or removed). A save that arrives while the folder is being
    removed finds the lease taken and fails cleanly.
    """
    if not list_names(fs, root) and not _older_than(fs, root, _UNLEASED_GRACE):
        return None
    try:
        return SaveLease.acquire(fs, root, secrets.token_hex(4), ttl=ttl)
    except (CheckpointError, OSError):
        return None


def _older_than(fs: fsspec.AbstractFileSystem, path: str, seconds: float) -> bool:
    if not is_local(fs):
        return False  # an empty folder of an object store does not exist; memory:// ones are harmless
    try:
        return time.time() - os.stat(path, follow_symlinks=False).st_mtime > seconds
    except OSError:
        return False


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed or replaced since)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
    except OSError:
        return False


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)


def _read_remote(fs: fsspec.AbstractFileSystem, path: str) -> bytes | None:
    try:
        fs.invalidate_cache(posixpath.dirname(path))
        return fs.cat_file(path)  # type: ignore[no-any-return]
    except FileNotFoundError:
        return None


def _parse(data: bytes | None) -> dict[str, Any] | None:
    if not data:
        return None
    try:
        value = strict_json.loads(data, source="shardkit.lock")
    except ValueError:  # unreadable: not a lease (a crafted one is bounded like every checkpoint JSON file)
        return None
    return value if isinstance(value, dict) else None


def _is_generation(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 64 and all(c in "0123456789abcdef" for c in value)


def _orphans(previous: dict[str, Any] | None) -> list[str]:
    """Generations whose data files an earlier save left behind, from the lease file's last content."""
    if previous is None:
        return []
    listed = previous.get("orphans")
    out = [g for g in listed if _is_generation(g)] if isinstance(listed, list) else []
    if previous.get("state") == "writing" and _is_generation(previous.get("generation")):
        out.append(previous["generation"])
    return sorted(set(out))[:1000]


def _who(content: dict[str, Any] | None) -> str:
    if content is None:
        return "the lease file is gone or unreadable"
    who = (f"generation {content.get('generation')!r}, process {content.get('pid')!r} on host "
           f"{content.get('host')!r}")
    expires = content.get("expires")
    if isinstance(expires, (int, float)) and not isinstance(expires, bool) and math.isfinite(expires):
        left = expires - time.time()
        if 0 < left < 1e6:
            who += f"; its lease expires in {left:.0f} s unless that process renews it"
    return who


def _busy(root: str, content: dict[str, Any] | None) -> CheckpointError:
    return CheckpointError(
        f"checkpoint.save to {root!r}: another save to this path is in progress ({_who(content)}); two saves "
        f"to one path at once are refused so that neither destroys the other. Wait for it to finish, or save "
        f"to another path. The checkpoint previously at this path, if any, is unchanged.")
