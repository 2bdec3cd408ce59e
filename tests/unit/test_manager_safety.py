"""CheckpointManager never loses a step: step numbers of any size, foreign names, symbolic
links, and a second manager on a root another one is writing."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import _save


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step % (2**31))
    return {"w": torch.randn(6, 5, generator=g), "step": step}


def _empty() -> dict:
    return {"w": torch.zeros(6, 5), "step": None}


def _loads_exactly(manager: checkpoint.CheckpointManager, step: int) -> None:
    loaded = manager.load(_empty(), step=step)
    assert torch.equal(loaded["w"], _state(step)["w"]) and loaded["step"] == step


def test_steps_of_any_size_round_trip_and_foreign_names_are_left_alone(tmp_path: Path) -> None:
    foreign = {
        "step-00000000042": "dir",  # not the manager's name for step 42 (one zero too many)
        "step-12": "dir",            # too few digits
        "step-abc": "dir",
        "notes": "dir",
        "step-0000000007": "file",   # a file, not a checkpoint folder
        "step-0000000008.bak": "file",
    }
    for name, kind in foreign.items():
        if kind == "dir":
            (tmp_path / name).mkdir()
            (tmp_path / name / "keep.txt").write_text(name)
        else:
            (tmp_path / name).write_text(name)
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=2)
    steps = [9_999_999_999, 10**10, 10**12 + 3, 10**18]
    for i, step in enumerate(steps):
        manager.save(step, _state(step))
        assert manager.latest_step() == step
        assert manager.steps() == steps[max(0, i - 1):i + 1]
        _loads_exactly(manager, step)
        assert manager.load(_empty())["step"] == step  # the newest, never an older one
    assert (tmp_path / "step-1000000000000000000").is_dir()
    restarted = checkpoint.CheckpointManager(tmp_path, keep_last=2)
    assert restarted.steps() == [10**12 + 3, 10**18]
    _loads_exactly(restarted, 10**18)
    for name, kind in foreign.items():  # neither listed nor deleted
        assert (tmp_path / name / "keep.txt" if kind == "dir" else tmp_path / name).read_text() == name
    assert sorted(os.listdir(tmp_path)) == sorted([*foreign, "step-1000000000003", "step-1000000000000000000"])


def test_pruning_never_follows_a_symbolic_link(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    checkpoint.save(_state(1), outside / "precious")
    before = sorted(p.name for p in (outside / "precious").iterdir())
    root = tmp_path / "run"
    root.mkdir()
    (root / "step-0000000001").symlink_to(outside / "precious", target_is_directory=True)
    (root / "step-0000000002").symlink_to(outside / "missing", target_is_directory=True)  # dangling
    manager = checkpoint.CheckpointManager(root, keep_last=1)
    assert manager.steps() == []  # a link is not one of the manager's steps
    for step in (3, 4, 5):
        manager.save(step, _state(step))
    assert manager.steps() == [5]
    assert (root / "step-0000000001").is_symlink() and (root / "step-0000000002").is_symlink()
    assert sorted(p.name for p in (outside / "precious").iterdir()) == before
    loaded = checkpoint.load(_empty(), outside / "precious")
    assert torch.equal(loaded["w"], _state(1)["w"])


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_second_manager_never_deletes_the_step_another_is_writing(tmp_path: Path, where: str) -> None:
    root = str(tmp_path / "run") if where == "local" else f"memory://manager-{uuid.uuid4().hex}/run"
    writer = checkpoint.CheckpointManager(root, keep_last=2)
    writer.save(1, _state(1))
    seen: dict[str, list[int]] = {}

    def open_a_reader(phase: str) -> None:
        if phase in ("writing", "data_written", "before_commit"):
            # An evaluation job opens the same root while step 2 is being written.
            reader = checkpoint.CheckpointManager(root, keep_last=1)
            seen[phase] = reader.steps()

    _save._test_hook = open_a_reader
    try:
        writer.save(2, _state(2))
    finally:
        _save._test_hook = None
    assert seen == {"writing": [1], "data_written": [1], "before_commit": [1]}
    assert writer.steps() == [1, 2]
    _loads_exactly(writer, 2)
    _loads_exactly(checkpoint.CheckpointManager(root), 1)


def test_an_abandoned_step_is_removed_once_its_holder_is_gone(tmp_path: Path) -> None:
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=3)
    manager.save(1, _state(1))
    # A save that died after taking its lease: the lock file stays, unlocked, marked "writing".
    dead = tmp_path / "step-0000000002"
    dead.mkdir()
    (dead / "shardkit.lock").write_text('{"generation": "0badcafe", "state": "writing", "pid": 1}')
    (dead / "data-0badcafe-r00000.safetensors").write_bytes(b"\0" * 32)
    # A save that has just created its folder and not yet taken its lease: left alone.
    fresh = tmp_path / "step-0000000003"
    fresh.mkdir()
    restarted = checkpoint.CheckpointManager(tmp_path, keep_last=3)
    assert not dead.exists() and fresh.is_dir()
    assert restarted.steps() == [1]
    # The same empty folder, long abandoned, goes.
    os.utime(fresh, (1.0, 1.0))
    checkpoint.CheckpointManager(tmp_path, keep_last=3)
    assert not fresh.exists()
