"""The guards readers and writers use: regular-file opens, strict JSON, the save lease (local and memory://)."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from pathlib import Path

import fsspec
import pytest

from checkpoint import CheckpointError
from checkpoint._lease import LOCK_FILE, SaveLease
from checkpoint._safe_open import check_regular, open_regular, read_regular
from checkpoint._strict_json import loads

# -- regular files -------------------------------------------------------------------------------


def test_regular_file_opens_and_reads(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(b"0123456789")
    fd, size = open_regular(str(f))
    os.close(fd)
    assert size == 10
    assert read_regular(str(f)) == b"0123456789"
    assert read_regular(str(f), 3, 6) == b"345"
    assert read_regular(str(f), 8, 100) == b"89"  # short at the end: the caller checks lengths
    assert check_regular(fsspec.filesystem("file"), str(f)) == 10


def test_non_regular_files_are_refused_without_blocking(tmp_path: Path) -> None:
    target = tmp_path / "target.bin"
    target.write_bytes(b"secret")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    fifo = tmp_path / "pipe.bin"
    os.mkfifo(fifo)
    folder = tmp_path / "dir.bin"
    folder.mkdir()
    sock_path = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        for path, kind in ((link, "symlink"), (fifo, "FIFO"), (folder, "directory"), (sock_path, "")):
            for call in (lambda p=path: open_regular(str(p)), lambda p=path: read_regular(str(p)),
                         lambda p=path: check_regular(fsspec.filesystem("file"), str(p))):
                with pytest.raises(CheckpointError, match="not a regular file") as info:
                    call()
                assert str(path) in str(info.value) and kind in str(info.value)
    finally:
        sock.close()
    with pytest.raises(FileNotFoundError):
        open_regular(str(tmp_path / "missing"))


def test_memory_file_system_types_are_checked() -> None:
    fs = fsspec.filesystem("memory")
    root = f"/guards-{uuid.uuid4().hex}"
    fs.pipe_file(f"{root}/f", b"abc")
    fs.makedirs(f"{root}/d", exist_ok=True)
    fs.pipe_file(f"{root}/d/x", b"")
    assert check_regular(fs, f"{root}/f") == 3
    with pytest.raises(CheckpointError, match="not a regular file"):
        check_regular(fs, f"{root}/d")


# -- strict JSON -----------------------------------------------------------------------------------


def test_strict_json() -> None:
    assert loads('{"a": [1, {"b": null}], "c": NaN}', source="x.json")["a"] == [1, {"b": None}]
    with pytest.raises(ValueError, match="'a' appears twice") as info:
        loads('{"a": 1, "b": {"c": 2}, "a": 1}', source="dir/x.json")
    assert "dir/x.json" in str(info.value)
    with pytest.raises(ValueError, match="'c' appears twice"):
        loads('{"b": [{"c": 1, "c": 1}]}', source="x.json")
    with pytest.raises(ValueError, match="more than 100 levels deep") as info:
        loads("[" * 100_000 + "]" * 100_000, source="deep.json")
    assert "deep.json" in str(info.value)
    for bad in (b"\xff\xfe", "{", '{"a": 1} x', ""):
        with pytest.raises(ValueError, match="not valid JSON"):
            loads(bad, source="x.json")


# -- the save lease --------------------------------------------------------------------------------


def _filesystems(tmp_path: Path) -> list[tuple[fsspec.AbstractFileSystem, str]]:
    memory = fsspec.filesystem("memory")
    root = f"/lease-{uuid.uuid4().hex}"
    memory.makedirs(root, exist_ok=True)
    return [(fsspec.filesystem("file"), str(tmp_path)), (memory, root)]


def test_lease_is_exclusive_and_reusable(tmp_path: Path) -> None:
    for fs, root in _filesystems(tmp_path):
        first = SaveLease.acquire(fs, root, "aa", ttl=60)
        assert first.orphans == []
        with pytest.raises(CheckpointError, match="another save") as info:
            SaveLease.acquire(fs, root, "bb", ttl=60)
        assert root in str(info.value) and "'aa'" in str(info.value)
        first.check()
        first.release(finished=True)
        # ttl=-1: on file systems without locks a dead save's lease blocks others until it expires
        second = SaveLease.acquire(fs, root, "bb", ttl=-1)
        assert second.orphans == []  # "aa" finished: nothing of it is left to clean
        second.release(finished=False)  # as if it died while writing
        third = SaveLease.acquire(fs, root, "cc", ttl=-1)
        assert third.orphans == ["bb"]
        third.release(finished=False)  # died too, before removing bb's files: both are remembered
        fourth = SaveLease.acquire(fs, root, "dd", ttl=60)
        assert fourth.orphans == ["bb", "cc"]
        fourth.release(finished=True)
        assert fs.exists(f"{root}/{LOCK_FILE}")  # still lists "bb" and "cc"
        fourth = SaveLease.acquire(fs, root, "dd", ttl=60)
        fourth.orphans = []  # as a save does once it has removed them
        fourth.release(finished=True)
        fifth = SaveLease.acquire(fs, root, "ee", ttl=60)
        assert fifth.orphans == []
        fifth.release(finished=True)
        assert not fs.exists(f"{root}/{LOCK_FILE}")  # a clean finish leaves only the checkpoint


def test_lease_is_exclusive_between_threads(tmp_path: Path) -> None:
    fs = fsspec.filesystem("file")
    won: list[str] = []
    lost: list[str] = []
    barrier = threading.Barrier(8)
    leases: list[SaveLease] = []

    def take(i: int) -> None:
        barrier.wait()
        try:
            leases.append(SaveLease.acquire(fs, str(tmp_path), f"{i:02x}", ttl=60))
            won.append(f"{i:02x}")
        except CheckpointError:
            lost.append(f"{i:02x}")

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 7
    leases[0].release(finished=True)


def test_lost_lease_fails_the_check(tmp_path: Path) -> None:
    for fs, root in _filesystems(tmp_path):
        lease = SaveLease.acquire(fs, root, "aa", ttl=60)
        fs.rm_file(f"{root}/{LOCK_FILE}")  # someone removed the lock file
        if fs.protocol == "memory" or "memory" in fs.protocol:
            other = SaveLease.acquire(fs, root, "bb", ttl=60)  # no lock file: another save takes over
            other.release(finished=True)
        with pytest.raises(CheckpointError, match="lost its save lease"):
            lease.check()
        lease.release(finished=False)


def test_expired_remote_lease_can_be_taken_over() -> None:
    fs = fsspec.filesystem("memory")
    root = f"/lease-{uuid.uuid4().hex}"
    fs.makedirs(root, exist_ok=True)
    stale = SaveLease.acquire(fs, root, "aa", ttl=-1)  # already expired
    taker = SaveLease.acquire(fs, root, "bb", ttl=60)
    assert taker.orphans == ["aa"]
    with pytest.raises(CheckpointError, match="lost its save lease"):
        stale.check()
    taker.check()
    taker.release(finished=True)
