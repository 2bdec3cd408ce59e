"""A ``CheckpointManager`` root as every reader sees it: one step-name rule, steps from 0 to 10**18.

The manager, ``consolidate`` (given the root or the manager) and the command line
(``consolidate``, ``inspect``, ``verify``) list the same committed steps and pick the same
latest one, across the width change of the folder names (``step-9999999999`` has 10 digits,
``step-10000000000`` 11). A committed step is never replaced unless ``overwrite=True``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
from checkpoint import CheckpointError, CheckpointManager
from checkpoint._cli import main

STEPS = [0, 7, 10**9, 9_999_999_999, 10**10, 10**10 + 1, 10**12, 10**18 - 1, 10**18]


def _state(step: int) -> dict[str, object]:
    """A state whose tensor says which step saved it (exactly, as int64)."""
    return {"w": torch.tensor([step, step % 1000], dtype=torch.int64), "step": step}


def _saved_step(path: Path) -> int:
    return int(load_file(str(path))["w"][0])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    where = str(tmp_path_factory.mktemp("steps") / "run")
    manager = CheckpointManager(where)
    for step in STEPS[::-1]:  # newest first: nothing may depend on the order of the saves
        manager.save(step, _state(step))
    return where


def test_step_names_are_one_rule() -> None:
    from checkpoint._steps import MAX_STEP, check_step, step_name, step_of

    assert step_name(42) == "step-0000000042"
    assert step_name(9_999_999_999) == "step-9999999999"
    assert step_name(10**10) == "step-10000000000"
    assert step_name(10**18) == "step-1000000000000000000"
    for step in [*STEPS, MAX_STEP]:
        assert step_of(step_name(step)) == step
    # Only the exact name: no second name for a step, nothing else read as one.
    for name in ("step-00000000042", "step-042", "step-42", "step-0000000042 ", "step-+000000042", "step--000000001",
                 "step-0000000042.metric.json", "Step-0000000042", "step-" + "9" * 251):
        assert step_of(name) is None, name
    for bad in (-1, True, 1.0, "3", MAX_STEP + 1):
        with pytest.raises(ValueError, match=r"step"):
            check_step(bad)


def test_every_reader_lists_the_same_steps(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    manager = CheckpointManager(root)
    assert manager.steps() == STEPS
    assert manager.latest_step() == 10**18
    assert main(["inspect", root, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["manager"] == {"root": root, "steps": STEPS, "step": 10**18}
    assert info["values"] == {"step": 10**18}


def test_consolidate_exports_the_latest_step_from_the_root_the_manager_and_the_cli(root: str, tmp_path: Path) -> None:
    manager = CheckpointManager(root)
    checkpoint.consolidate(root, tmp_path / "root.safetensors")
    checkpoint.consolidate(manager, tmp_path / "manager.safetensors")
    assert main(["consolidate", root, str(tmp_path / "cli.safetensors"), "-q"]) == 0
    for name in ("root", "manager", "cli"):
        assert _saved_step(tmp_path / f"{name}.safetensors") == 10**18, name


@pytest.mark.parametrize("step", STEPS)
def test_every_step_is_exported_and_inspected_by_its_number(root: str, tmp_path: Path, step: int,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.safetensors"
    checkpoint.consolidate(root, out, step=step)
    assert _saved_step(out) == step
    checkpoint.consolidate(CheckpointManager(root), out, step=step)
    assert _saved_step(out) == step
    assert main(["consolidate", root, str(out), "--step", str(step), "-q"]) == 0
    assert _saved_step(out) == step
    state = {"w": torch.zeros(2, dtype=torch.int64), "step": None}
    CheckpointManager(root).load(state, step)
    assert int(state["w"][0]) == step and state["step"] == step
    capsys.readouterr()
    assert main(["inspect", root, "--step", str(step), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == {"step": step}


def test_the_ten_digit_boundary(tmp_path: Path) -> None:
    """The two steps on either side of the folder names' width change: the newer one is the latest."""
    root = str(tmp_path / "run")
    manager = CheckpointManager(root)
    manager.save(10**10, _state(10**10))
    manager.save(9_999_999_999, _state(9_999_999_999))
    checkpoint.consolidate(root, tmp_path / "a.safetensors")
    assert _saved_step(tmp_path / "a.safetensors") == 10**10
    checkpoint.consolidate(root, tmp_path / "b.safetensors", step=10**10)
    assert _saved_step(tmp_path / "b.safetensors") == 10**10


def test_cli_inspect_and_verify_on_a_manager_root(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", root]) == 0
    out = capsys.readouterr().out
    assert f"CheckpointManager root {root}: {len(STEPS)} committed steps" in out
    assert "step 1000000000000000000 (latest) follows" in out
    assert "w     int64  (2,)" in out  # a 1-D shape is printed as Python prints the tuple
    assert main(["inspect", root, "--step", "9999999999"]) == 0
    out = capsys.readouterr().out
    assert "step 9999999999 (chosen with --step) follows" in out and "step = 9999999999" in out
    assert main(["verify", root]) == 0
    out = capsys.readouterr().out
    assert "step 1000000000000000000 (latest)" in out and ": OK:" in out
    assert main(["verify", root, "--step", "0"]) == 0
    assert "step-0000000000: OK" in capsys.readouterr().out
    assert main(["verify", root, "--step", "5"]) == 1
    err = capsys.readouterr().err
    assert "step 5 is not a committed step" in err and "9999999999" in err


def test_cli_step_on_one_checkpoint_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint.save({"w": torch.ones(64)}, tmp_path / "ckpt")
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "(64,)" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "ckpt"), "--step", "3"]) == 1
    assert "is one checkpoint, not a CheckpointManager's root; drop step=3" in capsys.readouterr().err


def test_a_committed_step_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    first, second = CheckpointManager(root), CheckpointManager(root)  # e.g. two trainers given one root
    first.save(5, {"w": torch.ones(3)}, metric=1.0)
    with pytest.raises(CheckpointError) as info:
        second.save(5, {"w": torch.zeros(3)})
    message = str(info.value)
    assert "step 5 is already committed" in message and repr(root) in message and "overwrite=True" in message
    state = {"w": torch.empty(3)}
    second.load(state, 5)
    assert torch.equal(state["w"], torch.ones(3))  # untouched
    with pytest.raises(CheckpointError, match="step 5 is already committed"):
        second.save(5, {"w": torch.zeros(3)}, async_=True)
    second.save(5, {"w": torch.full((3,), 2.0)}, overwrite=True)
    second.load(state, 5)
    assert torch.equal(state["w"], torch.full((3,), 2.0))
    assert not (Path(root) / "step-0000000005.metric.json").exists()  # the replaced step's metric went with it
    assert second.steps() == [5]
