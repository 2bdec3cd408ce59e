"""keep_last / keep_every hold when the process saving with a CheckpointManager is SIGKILLed
at any phase of a save or of the retention that follows it; the restarted job resumes from
the latest step, bit for bit, and leaves exactly the steps the policy keeps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint
from tests.distributed import _manager_crash as job

REPO = Path(__file__).resolve().parents[2]
PHASES = ["planned", "writing", "data_written", "before_commit", "committed", "pruning", "pruned"]
KILL_STEP = job.BASE + 3  # its retention deletes a step
COMMITTED_AT = {"committed", "pruning", "pruned"}


def _manager(root: Path) -> checkpoint.CheckpointManager:
    return checkpoint.CheckpointManager(root, keep_last=job.KEEP_LAST, keep_every=job.KEEP_EVERY)


def _assert_loads(manager: checkpoint.CheckpointManager, steps: list[int]) -> None:
    for step in steps:
        loaded = manager.load({"w": torch.zeros(7, 4), "step": None}, step=step)
        assert torch.equal(loaded["w"], job.state(step)["w"]) and loaded["step"] == step


def test_retention_holds_when_killed_at_every_phase(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    roots = {phase: tmp_path / phase for phase in PHASES}
    # The steps before the killed one, saved by the job itself (a kill at a step never reached).
    procs = {}
    for phase, root in roots.items():
        procs[phase] = subprocess.Popen(
            [sys.executable, "-m", "tests.distributed._manager_crash", str(root), str(KILL_STEP), phase],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for phase, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, (phase, proc.returncode, out.decode()[-2000:])
    before = [s for s in job.STEPS if s < KILL_STEP]
    for phase, root in roots.items():
        manager = _manager(root)  # the restarted job
        on_disk = manager.steps()
        history = before + ([KILL_STEP] if phase in COMMITTED_AT else [])
        assert (KILL_STEP in on_disk) == (phase in COMMITTED_AT), (phase, on_disk)
        assert job.kept(history) <= set(on_disk) <= set(history), (phase, on_disk)
        assert manager.latest_step() == history[-1]
        _assert_loads(manager, on_disk)
        # Nothing else is left: the dead save's or deletion's folder went with the restart.
        assert sorted(os.listdir(root)) == sorted(f"step-{s:010d}" for s in on_disk), (phase, os.listdir(root))
        # Resume and finish the run: exactly the policy's steps remain, no lock files.
        for step in job.STEPS:
            if step > manager.latest_step():
                manager.save(step, job.state(step))
        assert manager.steps() == sorted(job.kept(job.STEPS)), phase
        assert sorted(os.listdir(root)) == sorted(f"step-{s:010d}" for s in job.kept(job.STEPS))
        assert not list(root.glob("*/shardkit.lock")), phase
        _assert_loads(manager, manager.steps())


pytestmark = pytest.mark.distributed
