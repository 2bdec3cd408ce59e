"""async_save and CheckpointManager on 4 Gloo ranks: snapshot semantics, retention, crashes.

- every tensor is mutated right after ``async_save`` returns, while user collectives run on
  the default group during the background write; the files hold the values at the call
  (also with ``max_staging_bytes``, staged and written in waves);
- a manager saves steps (sync and async) with retention, and loads under another layout;
- rank 3 is SIGKILLed while its background write is in progress: the survivors get a
  ``CheckpointError`` from ``result()``/``wait()`` within the timeout, the partial step is
  never listed, and every earlier step still loads bit-exactly;
- the whole job is killed mid-write and restarted: the manager resumes from the last
  committed step.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import checkpoint
import sharded_tensor as st
from checkpoint import CheckpointError, _save
from sharding import single_split
from tests.distributed._launch import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed


def _reference(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + len(name))
    return torch.randn(48, 20, generator=g) if name == "w" else torch.randn(33, generator=g)


def _state(rank: int, world: int, step: int, dim: int = 0) -> dict:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    w = st.shard_tensor(_reference("w", step) if rank == 0 else None, single_split(dim, ranks))
    return {"w": w, "b": _reference("b", step), "step": step}


def _empty(rank: int, world: int, dim: int = 0) -> dict:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    return {"w": st.zeros(48, 20, sharding_spec=single_split(dim, ranks)), "b": torch.zeros(33), "step": None}


def _snapshot_and_manager(rank: int, world: int, root: str) -> None:
    # 1. Mutate every tensor right after the call; run user collectives during the write.
    state = _state(rank, world, 1)
    handle = checkpoint.async_save(state, f"{root}/snap", timeout=30)
    state["w"].local_shard().add_(100.0)
    state["b"].mul_(-1.0)
    for _ in range(20):
        t = torch.ones(1000)
        dist.all_reduce(t)
        assert t[0].item() == world
    handle.result(timeout=60)
    loaded = checkpoint.load(_empty(rank, world, dim=1), f"{root}/snap")  # another layout
    assert torch.equal(loaded["w"].full_tensor(), _reference("w", 1))
    assert torch.equal(loaded["b"], _reference("b", 1))

    # 1b. Capped staging: written in waves through a buffer of one region, same snapshot.
    state = _state(rank, world, 2)
    handle = checkpoint.async_save(state, f"{root}/waves", timeout=30, max_staging_bytes=12 * 20 * 4)
    state["w"].local_shard().add_(100.0)
    state["b"].mul_(-1.0)
    handle.result(timeout=60)
    loaded = checkpoint.load(_empty(rank, world), f"{root}/waves")
    assert torch.equal(loaded["w"].full_tensor(), _reference("w", 2))
    assert torch.equal(loaded["b"], _reference("b", 2))

    # 2. Manager: sync and async saves, retention after each commit.
    manager = checkpoint.CheckpointManager(f"{root}/run", keep_last=2, keep_every=3, timeout=30)
    for step in range(1, 8):
        manager.save(step, _state(rank, world, step), async_=step % 2 == 1)
    manager.wait()
    assert manager.steps() == [3, 6, 7], manager.steps()
    for step in manager.steps():
        got = manager.load(_empty(rank, world), step=step)
        assert torch.equal(got["w"].full_tensor(), _reference("w", step)) and got["step"] == step
    assert manager.load(_empty(rank, world))["step"] == 7


def test_async_snapshot_and_manager(tmp_path):
    run_distributed(_snapshot_and_manager, 4, str(tmp_path), timeout=120)


def _kill_rank_3(phase: str) -> None:
    if phase == "data_written" and dist.get_rank() == 3:
        os.kill(os.getpid(), signal.SIGKILL)


def _kill_everyone(phase: str) -> None:
    if phase == "data_written":
        os.kill(os.getpid(), signal.SIGKILL)


def _crash_job(rank: int, world: int, root: str, hook_name: str) -> None:
    # timeout=600 is far beyond the launcher's (90 s): a survivor can only raise by noticing
    # the dead peer at once, else the launcher kills it first.
    manager = checkpoint.CheckpointManager(root, keep_last=3, timeout=600)
    first = (manager.latest_step() or 0) + 1
    for step in (first, first + 1):
        manager.save(step, _state(rank, world, step), async_=True)
    manager.wait()
    _save._test_hook = {"rank3": _kill_rank_3, "all": _kill_everyone}[hook_name]
    start = time.monotonic()
    manager.save(first + 2, _state(rank, world, first + 2), async_=True)
    try:
        manager.wait()
    except CheckpointError as exc:
        msg = f"{exc} [after {time.monotonic() - start:.1f} s]"
        raise CheckpointError(msg) from None


def _resume(rank: int, world: int, root: str) -> list[int]:
    manager = checkpoint.CheckpointManager(root, keep_last=3, timeout=30)
    steps = manager.steps()
    for step in steps:
        got = manager.load(_empty(rank, world, dim=1), step=step)
        assert torch.equal(got["w"].full_tensor(), _reference("w", step)), step
        assert torch.equal(got["b"], _reference("b", step)) and got["step"] == step
    resumed = manager.load(_empty(rank, world))["step"]
    assert resumed == steps[-1]
    return steps


def test_crashes_mid_async_write(tmp_path):
    root = str(tmp_path / "run")
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_crash_job, 4, root, "rank3", timeout=90)
    assert "rank 3 exited with code -9" in info.value.failures[3], info.value
    survivors = {r: t for r, t in info.value.failures.items() if r != 3}
    assert sorted(survivors) == [0, 1, 2], info.value
    for text in survivors.values():
        assert "CheckpointError" in text and "not every one of the 4 ranks finished writing" in text, text
        assert "did not finish" not in text, text  # raised by the save itself, not stopped by the launcher
    # The partial step 3 has data files but no metadata: never listed, removed on restart.
    assert sorted(os.listdir(root)) == ["step-0000000001", "step-0000000002", "step-0000000003"]
    assert run_distributed(_resume, 4, root, timeout=90) == [[1, 2]] * 4
    assert sorted(os.listdir(root)) == ["step-0000000001", "step-0000000002"]

    # The whole job killed mid-write, then restarted: it resumes from the last committed step.
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_crash_job, 4, root, "all", timeout=90)
    assert all("exited with code -9" in info.value.failures[r] for r in range(4)), info.value
    assert run_distributed(_resume, 4, root, timeout=90) == [[2, 3, 4]] * 4
