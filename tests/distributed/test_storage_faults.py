"""Storage that fails mid-save loses nothing, and ``timeout=`` bounds storage as well as peers.

A loopback S3 server in its own process is killed (SIGKILL) or paused (SIGSTOP) while two
ranks save; a size-limited tmpfs fills up under a save. Every rank must raise a
``CheckpointError`` carrying the storage's own error within the timeout, and the previous
checkpoint must stay the committed one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid

import pytest
import torch
import torch.distributed as dist

import checkpoint
from checkpoint import CheckpointError, _save
from tests._s3 import S3Process, s3_process  # noqa: F401 - fixture, found by name
from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed

TIMEOUT = 8.0


def _values(n: int, salt: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) * 0.5 + salt).reshape(-1, 4)


def _state(n: int, salt: int, rank: int) -> dict[str, object]:
    import sharded_tensor as st
    from sharding import single_split

    spec = single_split(0, ["rank:0/cpu", "rank:1/cpu"])
    w = st.empty(n // 4, 4, sharding_spec=spec)
    rows = w.local_shard().shape[0]
    w.local_shard().copy_(_values(n, salt)[rank * rows:(rank + 1) * rows])
    return {"w": w, "step": salt}


def _storage_fault(phase: str, action: str, pid: int, at: str, when: list[float]) -> None:
    if phase == at and dist.get_rank() == 0 and not when:
        when.append(time.time())
        os.kill(pid, signal.SIGKILL if action == "kill" else signal.SIGSTOP)


def _save_while_storage_fails(rank: int, world_size: int, url: str, options: dict[str, object], action: str,
                              pid: int, at: str) -> tuple[str, str, float, float | None]:
    checkpoint.save(_state(64, 1, rank), url, storage_options=options, timeout=TIMEOUT)
    when: list[float] = []
    _save._test_hook = lambda phase: _storage_fault(phase, action, pid, at, when)
    try:
        checkpoint.save(_state(2_000_000, 2, rank), url, storage_options=options, timeout=TIMEOUT)
    except Exception as exc:  # returned so the parent sees every rank's outcome
        kind = "CheckpointError" if isinstance(exc, CheckpointError) else type(exc).__name__
        return kind, str(exc), time.time(), (when or [None])[0]
    finally:
        _save._test_hook = None
    return "no error", "", time.time(), (when or [None])[0]


@pytest.mark.parametrize(("action", "at"), [("kill", "data_written"), ("pause", "writing"),
                                            ("pause", "data_written")])
def test_s3_server_dies_or_stalls_mid_save(s3_process: S3Process, action: str, at: str) -> None:
    s3 = s3_process.bucket(f"shardkit-fault-{uuid.uuid4().hex[:8]}")
    url = s3.url("ck")
    results = run_distributed(_save_while_storage_fails, 2, url, s3.storage_options, action, s3_process.pid, at,
                              timeout=120)
    stopped = results[0][3]
    assert stopped is not None, results
    for rank, (kind, message, raised, _) in enumerate(results):
        assert kind == "CheckpointError", (rank, kind, message)
        # A safety bound, not a speed claim: every rank raises within the timeout of the
        # storage stopping (plus scheduling slack on a loaded machine), not after a retry
        # loop of the client's own.
        assert raised - stopped < TIMEOUT + 10, (rank, raised - stopped, message)
        assert "did not report" not in message, (rank, message)
        assert "checkpoint.save" in message and url.removeprefix("s3://") in message, (rank, message)
    if action == "kill":
        # The storage's own words reach every rank: the client's connection error, or, while the
        # client is still retrying when the timeout runs out, that storage did not answer.
        for _, message, _, _ in results:
            assert any(word in message for word in ("Could not connect", "refused", "no answer from storage")), message
    else:
        # The storage's own words, on every rank (a rank that did not meet the stall itself
        # carries the words of the one that did), and nothing committed.
        for rank, (_, message, _, _) in enumerate(results):
            assert "no answer from storage" in message and "stalled or unreachable" in message, (rank, message)
        s3_process.resume()
        md = checkpoint.read_metadata(url, storage_options=s3.storage_options)
        assert md.values["step"] == 1
        loaded = checkpoint.load({"w": None, "step": None}, url, storage_options=s3.storage_options)
        assert loaded["step"] == 1
        assert torch.equal(loaded["w"], _values(64, 1))


# -- a file system that fills up --------------------------------------------------------------

def _small_tmpfs(path: str, size: str) -> None:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a size-limited tmpfs needs root and mount(8)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def _fill_up(rank: int, world_size: int, root: str) -> tuple[str, str]:
    checkpoint.save(_state(4096, 1, rank), root)
    try:
        checkpoint.save(_state(2_000_000, 2, rank), root)  # 8 MB on a 4 MB file system
    except Exception as exc:
        return "CheckpointError" if isinstance(exc, CheckpointError) else type(exc).__name__, str(exc)
    return "no error", ""


def test_full_file_system_keeps_the_previous_checkpoint(tmp_path) -> None:
    mount = str(tmp_path / "small")
    _small_tmpfs(mount, "4m")
    try:
        root = os.path.join(mount, "ck")
        results = run_distributed(_fill_up, 2, root, timeout=120)
        for rank, (kind, message) in enumerate(results):
            assert kind == "CheckpointError", (rank, kind, message)
        # The rank that hit the full disk names its file and the OS error.
        assert any("No space left on device" in m and ".safetensors" in m for _, m in results), results
        md = checkpoint.read_metadata(root)
        assert md.values["step"] == 1
        loaded = checkpoint.load({"w": None, "step": None}, root)
        assert torch.equal(loaded["w"], _values(4096, 1))
        # Only the committed checkpoint's files remain: the failed save removed what it wrote.
        data = sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
        assert data == sorted(md.files), (data, sorted(md.files))
    finally:
        subprocess.run(["umount", "-l", mount], check=False)
