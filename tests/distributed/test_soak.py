"""The soak's short form: 4 ranks on two "hosts" checkpointing every step in memory, a rank and then a host killed.

``scripts/soak.py --short --memory`` (40 steps, storage every 2, 2 kills: one rank, then both
ranks of a host with its memory folder; the long forms' figures are in docs/benchmarks.md).
Every rank's resumed state must equal the uninterrupted run's at the resume step bit for bit,
read from memory with nothing from storage; each failure loses at most one step; the steps
never go back; the root never holds more than ``keep_last + 2`` checkpoints and a rank's memory
folder more than ``keep_last_memory + 1`` steps; at the end the root holds the last
``keep_last`` storage steps and the memory folders nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distributed


def test_short_soak_resumes_from_memory_after_every_kill(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--short", "--memory", "--seed", "1",
                           "--keep", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["kills"] == 2 and len(report["kill_points"]) == 2
    assert len(report["resume_steps"]) == 2 and report["resume_steps_monotonic"], report["resume_steps"]
    assert report["resumes_exact"] and report["inexact_resumes"] == [], report["inexact_resumes"]
    assert report["final_exact"]
    assert report["disk_bounded"], (report["largest_root_bytes"], report["checkpoint_bytes"],
                                    report["most_step_folders"])
    assert report["stray"] == []
    assert report["host_kills"] == 1 and report["resumes_from_memory"], report["kill_points"]
    assert report["steps_lost_max"] <= 1, report["steps_lost"]
    assert report["memory_bounded"], (report["largest_host_memory_parts"], report["most_memory_steps_per_rank"])
    assert report["memory_left"] == []
    assert report["ok"] and done.returncode == 0
