"""A training job that saves with a ``CheckpointManager`` and SIGKILLs itself at one phase.

``python -m tests.distributed._manager_crash ROOT STEP PHASE``: saves every step of ``STEPS``
after the root's latest committed one, and dies by SIGKILL at ``PHASE`` of the save of
``STEP`` (a phase of ``checkpoint.save`` or of the manager's retention).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import checkpoint
from checkpoint import _manager, _save

BASE = 10**10 - 3  # the step names cross from 10 digits to 11
STEPS = list(range(BASE, BASE + 6))
KEEP_LAST = 2
KEEP_EVERY = 3


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step % (2**31))
    return {"w": torch.randn(7, 4, generator=g), "step": step}


def kept(history: list[int]) -> set[int]:
    """The steps the retention policy keeps out of ``history`` (every step committed so far)."""
    history = sorted(history)
    return set(history[-KEEP_LAST:]) | {s for s in history if s % KEEP_EVERY == 0}


def main(root: str, kill_step: int, kill_phase: str) -> None:
    manager = checkpoint.CheckpointManager(root, keep_last=KEEP_LAST, keep_every=KEEP_EVERY)
    latest = manager.latest_step()
    for step in STEPS:
        if latest is not None and step <= latest:
            continue
        if step == kill_step:
            def die(phase: str) -> None:
                if phase == kill_phase:
                    os.kill(os.getpid(), signal.SIGKILL)
            _save._test_hook = _manager._test_hook = die
        manager.save(step, state(step))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
