"""A save lease on an object store lives as long as its writer: renewed while the writer runs
(however long it takes), expired a short, configured time after it was SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import CheckpointError, _save
from checkpoint._lease import LEASE_ENV, LOCK_FILE
from tests._s3 import S3, s3, s3_endpoint  # noqa: F401 - fixtures, found by name

REPO = Path(__file__).resolve().parents[2]
LEASE = 6.0  # $SHARDKIT_LEASE_SECONDS for these tests
LIVE_LEASE = 8.0  # the live writer's, renewed while the test tries to save over it


def _state(version: int) -> dict:
    return {"w": torch.full((64, 8), float(version)), "version": version}


def _empty() -> dict:
    return {"w": torch.zeros(64, 8), "version": None}


def _lease(s3: S3, key: str) -> dict:
    fs = s3.filesystem()
    return json.loads(fs.cat_file(s3.url(f"{key}/{LOCK_FILE}")[5:]))


def test_a_killed_writers_lease_expires_within_its_duration(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEASE_ENV, str(LEASE))
    url = s3.url("ck")
    checkpoint.save(_state(1), url, storage_options=s3.storage_options)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    writer = subprocess.run([sys.executable, "-m", "tests.distributed._lease_writer", url, s3.endpoint_url],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    died = time.time()
    assert writer.returncode == -signal.SIGKILL, writer.stderr[-2000:]
    held = _lease(s3, "ck")
    assert held["state"] == "writing" and held["pid"] != os.getpid()
    # Renewed while the writer lived, and never promised beyond one duration after its death.
    assert held["expires"] <= died + LEASE + 1.0, (held["expires"] - died)
    if time.time() < held["expires"] - 1.0:
        with pytest.raises(CheckpointError, match="another save to this path is in progress.*expires in"):
            checkpoint.save(_state(3), url, storage_options=s3.storage_options)
    # The next save succeeds once the lease has expired: seconds, not 20 minutes. Whatever the
    # machine's load, a save that starts after the expiry the lease states is not refused.
    while True:
        started = time.time()
        try:
            checkpoint.save(_state(3), url, storage_options=s3.storage_options)
            break
        except CheckpointError as exc:
            assert "another save" in str(exc), exc
            assert started < held["expires"] + 1.0, "a save was refused after the dead writer's lease expired"
            time.sleep(0.25)
    loaded = checkpoint.load(_empty(), url, storage_options=s3.storage_options)
    assert torch.equal(loaded["w"], _state(3)["w"]) and loaded["version"] == 3
    # The dead writer's data files were removed by the save that committed after it.
    names = [p.rsplit("/", 1)[-1] for p in s3.filesystem().ls(url[5:], detail=False)]
    listed = checkpoint.read_metadata(url, storage_options=s3.storage_options).files
    assert sorted(n for n in names if n.endswith(".safetensors")) == sorted(listed)


def test_a_live_writer_is_never_preempted(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    # Renewed every third of its duration: 8 s leaves a renewal 5 s to get through on a busy
    # machine (at load average 35, a 1.5 s lease lapsed while its writer lived).
    monkeypatch.setenv(LEASE_ENV, f"{LIVE_LEASE:g}")
    url = s3.url("slow")
    written = threading.Event()
    go_on = threading.Event()
    outcome: list[object] = []

    def slow(phase: str) -> None:
        if phase == "data_written" and threading.current_thread().name == "slow-writer":
            written.set()
            go_on.wait(60)

    def write() -> None:
        try:
            checkpoint.save(_state(1), url, storage_options=s3.storage_options)
            outcome.append("committed")
        except Exception as exc:
            outcome.append(exc)

    _save._test_hook = slow
    thread = threading.Thread(target=write, name="slow-writer")
    thread.start()
    try:
        assert written.wait(600)
        # Two lease durations while the writer lives: every other save is refused.
        until = time.monotonic() + 2 * LIVE_LEASE
        refusals = 0
        while time.monotonic() < until:
            with pytest.raises(CheckpointError, match="another save to this path is in progress"):
                checkpoint.save(_state(2), url, storage_options=s3.storage_options)
            refusals += 1
            time.sleep(0.3)
        assert refusals >= 2
    finally:
        go_on.set()
        thread.join(600)
        _save._test_hook = None
    assert outcome == ["committed"]
    loaded = checkpoint.load(_empty(), url, storage_options=s3.storage_options)
    assert torch.equal(loaded["w"], _state(1)["w"]) and loaded["version"] == 1
    # A finished save leaves no lease behind: the next one takes it at once.
    checkpoint.save(_state(2), url, storage_options=s3.storage_options)
    assert checkpoint.load(_empty(), url, storage_options=s3.storage_options)["version"] == 2


pytestmark = pytest.mark.distributed
