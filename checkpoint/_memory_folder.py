"""The memory tier's files on one host: each step's parts in shared memory, found and reclaimed by name.

Local file system work only; nothing here communicates. Layout, under
``<memory_dir>/shardkit-<key>/`` (``key``: 16 hex digits of the SHA-256 of the manager's root
URL, so every manager on one root finds the same folder)::

    host.json                        {"id": <random hex>, "root": <url>}: ranks that read the same id
                                     share this folder (one host, or one memory folder of a host)
    <life>-r<rank>.lock              locked (flock) by that rank's process for as long as it lives
    <life>-r<rank>/                  the folder of one rank in one start ("life") of the job, its only writer
        step-<step>/                 a step committed in memory (the step as in the manager's root)
            data-<gen>-r<k>.safetensors    part k: the regions rank k wrote (its own, or a replica)
            shardkit.json            the step's metadata, as a storage checkpoint's; renamed in last
        .staging-<what>              a part being copied or received; never read by a recovery
        .spare-<n>                   files of reclaimed steps, kept to be reused by the next parts
    .recover-<life>-r<rank>/         a load's checkpoint folder: links to parts held here, and the byte
                                     ranges received from other hosts (removed when the load ends)

A part is in memory once it sits in a ``step-<step>`` folder under its final name and that
folder's ``shardkit.json`` exists; both arrive by rename, the metadata last. A process killed at
any moment therefore leaves committed steps and files no recovery reads, never a torn step.

The parts are files mapped into the process (``Slot``): a reclaimed step's files become spares
and the next step is copied into them, so their pages stay allocated and mapped from step to
step (a copy into fresh shared memory pages costs two to three times a copy into mapped
ones). Space is reserved with ``posix_fallocate`` before a file is mapped: a full memory file
system raises ``OSError`` (ENOSPC) there instead of killing the process with SIGBUS on a write.

Lives: each start of the job gets a fresh random ``life`` id, so folders of a previous start
(whose ranks may now run on other hosts) are never written again; they are read by a recovery
and then reclaimed (``reclaim_lives``) once their owners are gone (their lock is free).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass

import torch

from ._memory_plan import part_ranks
from ._schema import METADATA_FILE, CheckpointError, parse_metadata

__all__ = ["MEMORY_DIR_ENV", "default_memory_dir", "job_folder", "host_identity", "Slot", "RankFolder", "Held",
           "scan", "reclaim_lives", "remove_steps", "step_name", "remove_job"]

MEMORY_DIR_ENV = "SHARDKIT_MEMORY_DIR"
"""Environment variable: the folder under which the memory tier keeps its files (default ``/dev/shm``)."""

_LIFE = re.compile(r"^(?P<life>[0-9a-f]{8})-r(?P<rank>\d{5,})$")
_STEP = re.compile(r"^step-(?P<step>\d{10,40})$")
_HOST_FILE = "host.json"

# Life folders created by this process: alive whatever their lock says (two managers of one
# process on one root would otherwise take each other's lock test for a dead owner).
_own_lives: set[str] = set()


def default_memory_dir() -> str:
    """``$SHARDKIT_MEMORY_DIR``, else ``/dev/shm`` (shared memory), else the temporary folder."""
    text = os.environ.get(MEMORY_DIR_ENV, "").strip()
    if text:
        return text
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def step_name(step: int) -> str:
    return f"step-{step:010d}"


def job_folder(memory_dir: str, root_url: str) -> str:
    """The folder of the manager on ``root_url`` under ``memory_dir``, created private to this user.

    Raises:
        OSError: ``memory_dir`` cannot hold it, or a path of that name exists that is not this
            user's own folder (a symlink or another user's: refused, never followed).
    """
    key = hashlib.sha256(root_url.encode()).hexdigest()[:16]
    path = os.path.join(os.path.abspath(memory_dir), f"shardkit-{key}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        what = "a symlink" if stat.S_ISLNK(info.st_mode) else ("not a folder" if not stat.S_ISDIR(info.st_mode)
                                                                 else f"owned by uid {info.st_uid}")
        msg = (f"the memory tier's folder {path!r} is {what}; it must be a folder of this user (uid "
               f"{os.getuid()}). Remove it, or pass another memory_dir= (or ${MEMORY_DIR_ENV}).")
        raise OSError(errno.EPERM, msg)
    return path


def host_identity(job: str, root_url: str) -> str:
    """The id of ``job``'s folder, created by the first rank that asks: ranks reading one id share the folder."""
    path = os.path.join(job, _HOST_FILE)
    for _ in range(3):
        try:
            with open(path) as f:
                return str(json.load(f)["id"])
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError):
            os.replace(path, f"{path}.bad-{secrets.token_hex(4)}")  # a torn write of a killed process
            continue
        temporary = f"{path}.{secrets.token_hex(4)}"
        with open(temporary, "w") as f:
            json.dump({"id": secrets.token_hex(8), "root": root_url}, f)
        try:
            os.link(temporary, path)  # atomic, and fails if another rank was first
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
    msg = f"cannot read or create {path!r}, the memory tier's host id."
    raise OSError(errno.EIO, msg)


class Slot:
    """A file of a rank's folder, mapped into this process (shared, read-write) as ``tensor`` (uint8).

    Reused from step to step, so its pages stay allocated and mapped. Raises ``OSError``
    (ENOSPC) when the memory file system cannot hold ``size`` bytes; nothing is mapped then.
    """

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = -1
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self.resize(size)
        except BaseException:
            self.delete()
            raise

    def resize(self, size: int) -> None:
        """Make the file ``size`` bytes, every page reserved and mapped."""
        if size == self.size:
            return
        self.tensor = torch.empty(0, dtype=torch.uint8)  # the old mapping goes before the file changes
        os.ftruncate(self._fd, size)
        self.size = size
        if size == 0:
            return
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError:
            os.ftruncate(self._fd, 0)
            self.size = 0
            raise
        mapped = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(mapped, dtype=torch.uint8)

    def rename(self, path: str) -> None:
        os.replace(self.path, path)
        self.path = path

    def delete(self) -> None:
        """Unmap (once no view of ``tensor`` is left), close and remove the file."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _lock(path: str) -> int:
    """Open and lock ``path`` exclusively without waiting; the descriptor, or raise ``BlockingIOError``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BaseException:
        os.close(fd)
        raise


class RankFolder:
    """This rank's folder for this life: parts staged, committed as steps, reclaimed into spares.

    Args:
        job: the manager's folder (``job_folder``).
        life: this start's id (8 hex digits, the same on every rank).
        rank: this rank.
        spares: files of reclaimed steps to keep for reuse (those of one step: own part and replicas).
    """

    def __init__(self, job: str, life: str, rank: int, *, spares: int) -> None:
        self.job, self.life, self.rank, self.spares = job, life, rank, spares
        self.name = f"{life}-r{rank:05d}"
        self.path = os.path.join(job, self.name)
        # The lock first, then the folder: a folder without a held lock is a dead life's.
        self._lock_path = f"{self.path}.lock"
        self._lock_fd = _lock(self._lock_path)
        _own_lives.add(self.path)
        os.makedirs(self.path, exist_ok=True)
        self._spare: list[Slot] = []
        self._staging: dict[str, Slot] = {}
        self._steps: dict[int, list[Slot]] = {}
        self._count = 0

    def staging(self, what: str, size: int) -> Slot:
        """A file of ``size`` bytes for a part being written (``what``: "own", or the rank it comes from).

        A spare of that size if there is one, else any spare resized, else a new file. Raises
        ``OSError`` when memory is full.
        """
        self.release(what)
        path = os.path.join(self.path, f".staging-{what}")
        spare = next((s for s in self._spare if s.size == size), None) or (self._spare[0] if self._spare else None)
        if spare is None:
            slot = Slot(path, size)
        else:
            self._spare.remove(spare)
            try:
                spare.resize(size)
            except OSError:
                spare.delete()
                raise
            spare.rename(path)
            slot = spare
        self._staging[what] = slot
        return slot

    def release(self, what: str) -> None:
        """The staged part ``what`` is not committed: its file becomes a spare."""
        slot = self._staging.pop(what, None)
        if slot is not None:
            self._to_spare(slot)

    def _to_spare(self, slot: Slot) -> None:
        if len(self._spare) >= self.spares:
            slot.delete()
            return
        self._count += 1
        slot.rename(os.path.join(self.path, f".spare-{self._count}"))
        self._spare.append(slot)

    def commit(self, step: int, parts: dict[str, str], text: str) -> None:
        """Commit ``step``: the staged parts (file name -> what) into ``step-<step>/``, then its metadata."""
        if step in self._steps:
            self.drop(step)  # the step saved again in this life: the new one replaces it
        folder = os.path.join(self.path, step_name(step))
        shutil.rmtree(folder, ignore_errors=True)
        os.mkdir(folder)
        slots = []
        for name, what in parts.items():
            slot = self._staging.pop(what)
            slot.rename(os.path.join(folder, name))
            slots.append(slot)
        self._steps[step] = slots
        temporary = os.path.join(folder, f".{METADATA_FILE}.tmp")
        with open(temporary, "w") as f:
            f.write(text)
        os.replace(temporary, os.path.join(folder, METADATA_FILE))

    def committed(self) -> list[int]:
        """The steps committed in this folder by this life, ascending."""
        return sorted(self._steps)

    def drop(self, step: int) -> None:
        """Remove a committed step: its metadata first (it is no longer in memory), then its files (to spares)."""
        slots = self._steps.pop(step)
        folder = os.path.join(self.path, step_name(step))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, METADATA_FILE))
        for slot in slots:
            self._to_spare(slot)
        shutil.rmtree(folder, ignore_errors=True)

    def reclaim(self, keep: int) -> None:
        """Keep the newest ``keep`` committed steps; the older ones' files become spares (or go)."""
        for step in self.committed()[:-keep] if keep else self.committed():
            self.drop(step)

    def slot_of(self, step: int, name: str) -> Slot | None:
        return next((s for s in self._steps.get(step, []) if os.path.basename(s.path) == name), None)

    def remove(self) -> None:
        """The clean finish: every file of this folder, the folder and its lock."""
        for slot in [*self._spare, *self._staging.values(), *(s for v in self._steps.values() for s in v)]:
            slot.delete()
        self._spare, self._staging, self._steps = [], {}, {}
        shutil.rmtree(self.path, ignore_errors=True)
        _own_lives.discard(self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._lock_path)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


@dataclass(frozen=True, slots=True)
class Held:
    """A step some folder of this host holds in memory: its metadata and the parts present here.

    ``need``: the parts (saving ranks) its metadata lists; ``have``: part -> path of a complete
    copy on this host; ``metadata``: the path of one copy of its ``shardkit.json``.
    """

    step: int
    generation: str
    digest: str
    need: tuple[int, ...]
    have: dict[int, str]
    metadata: str

    def report(self) -> dict[str, object]:
        """What the other ranks learn about it (``_memory_plan.choose_step``)."""
        return {"step": self.step, "generation": self.generation, "digest": self.digest,
                "need": list(self.need), "have": sorted(self.have)}


def _lives(job: str) -> list[str]:
    try:
        return sorted(name for name in os.listdir(job) if _LIFE.match(name))
    except FileNotFoundError:
        return []


def _step_folders(job: str, lives: Iterable[str]) -> Iterator[tuple[int, str]]:
    """``(step, folder)`` of every step folder in the folders of ``lives`` (a life folder gone meanwhile: none)."""
    for life in lives:
        folder = os.path.join(job, life)
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            match = _STEP.match(name)
            if match is not None:
                yield int(match["step"]), os.path.join(folder, name)


def scan(job: str, *, skip: Container[str] = ()) -> list[Held]:
    """Every committed step the folders of ``job`` hold (those named in ``skip`` left out), one entry per step.

    A step is listed with the parts present under their final names with the size its metadata
    records; copies in several folders are merged. Metadata that does not parse (edited,
    truncated) is skipped, as is a step whose copies disagree on it.
    """
    found: dict[tuple[int, str], Held] = {}
    conflicted: set[tuple[int, str]] = set()
    for step, step_folder in _step_folders(job, (life for life in _lives(job) if life not in skip)):
        source = os.path.join(step_folder, METADATA_FILE)
        try:
            with open(source, "rb") as f:
                text = f.read()
            metadata = parse_metadata(text, source=source)
        except (OSError, CheckpointError, ValueError):
            continue
        key = (step, metadata.generation)
        digest = hashlib.sha256(text).hexdigest()
        parts = part_ranks(list(metadata.files))
        have = {}
        for part, file in parts.items():
            path = os.path.join(step_folder, file)
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_size == metadata.files[file]:
                have[part] = path
        previous = found.get(key)
        if previous is None:
            found[key] = Held(key[0], key[1], digest, tuple(sorted(parts)), have, source)
        elif previous.digest != digest:
            conflicted.add(key)
        else:
            previous.have.update({p: path for p, path in have.items() if p not in previous.have})
    return [held for key, held in sorted(found.items()) if key not in conflicted]


def _alive(job: str, life: str) -> bool:
    """Whether the process owning folder ``life`` still runs (holds its lock)."""
    path = os.path.join(job, life)
    if path in _own_lives:
        return True
    try:
        fd = _lock(f"{path}.lock")
    except BlockingIOError:
        return True
    except FileNotFoundError:
        return False
    os.close(fd)
    return False


def reclaim_lives(job: str, *, keep: Container[str] = ()) -> list[str]:
    """Delete the folders (and locks) of lives whose process is gone, except those named in ``keep``."""
    removed = []
    for life in _lives(job):
        if life in keep or _alive(job, life):
            continue
        shutil.rmtree(os.path.join(job, life), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(job, f"{life}.lock"))
        removed.append(life)
    try:
        names = os.listdir(job)
    except FileNotFoundError:
        return removed
    for name in names:
        life = name.removesuffix(".lock")
        if name.endswith(".lock") and _LIFE.match(life) and life not in names and not _alive(job, life):
            # A lock whose folder is gone (a life that died right after taking its lock).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(job, name))
        life = name.removeprefix(".recover-")
        if name.startswith(".recover-") and _LIFE.match(life) and life not in keep and not _alive(job, life):
            # A load cut short: its links keep parts of reclaimed steps in memory.
            shutil.rmtree(os.path.join(job, name), ignore_errors=True)
    return removed


def remove_steps(job: str, doomed: Callable[[int, str], bool]) -> None:
    """Delete the steps ``doomed(step, generation)`` names from the folders of lives whose process is gone."""
    for step, step_folder in _step_folders(job, (life for life in _lives(job) if not _alive(job, life))):
        try:
            with open(os.path.join(step_folder, METADATA_FILE), "rb") as f:
                generation = str(json.loads(f.read()).get("generation", ""))
        except (OSError, ValueError, AttributeError):
            generation = ""
        if doomed(step, generation):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(step_folder, METADATA_FILE))
            shutil.rmtree(step_folder, ignore_errors=True)


def remove_job(job: str) -> None:
    """Remove ``job``'s folder once no life folder is left in it (its host id and stray files go with it)."""
    try:
        names = os.listdir(job)
    except FileNotFoundError:
        return
    if not any(_LIFE.match(n.removesuffix(".lock")) for n in names):
        shutil.rmtree(job, ignore_errors=True)
