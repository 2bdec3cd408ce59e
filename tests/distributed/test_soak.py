"""The soak's short form: 4 ranks checkpointing every step, a rank and then another (or a host) killed.

``scripts/soak.py --short`` (40 steps, 2 kills, asynchronous saves to storage every step) and
``--short --memory`` (every step in memory on two "hosts", storage every 2 steps; the second
kill takes both ranks of a host with its memory folder); the long forms' figures are in
docs/benchmarks.md. Every rank's resumed state must equal the uninterrupted run's at the
resume step bit for bit; the steps never go back; the root never holds more than
``keep_last + 2`` checkpoints, and at the end only the last ``keep_last`` (storage) steps; no
rank's memory grows by more than a quarter of its share of a checkpoint per step. With the
memory tier besides: every resume reads memory and nothing from storage, each failure loses
at most one step, a rank's memory folder never holds more than ``keep_last_memory + 1``
steps, and nothing is left in memory at the end.
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


@pytest.mark.parametrize("memory", [pytest.param(False, id="storage"), pytest.param(True, id="memory-tier")])
def test_short_soak_resumes_exactly_after_every_kill(tmp_path: Path, memory: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--short", "--seed", "1",
                           *(["--memory"] if memory else []), "--keep", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["kills"] == 2 and len(report["kill_points"]) == 2
    assert len(report["resume_steps"]) == 2 and report["resume_steps_monotonic"], report["resume_steps"]
    assert report["resumes_exact"] and report["inexact_resumes"] == [], report["inexact_resumes"]
    assert report["final_exact"]
    assert report["disk_bounded"], (report["largest_root_bytes"], report["checkpoint_bytes"],
                                    report["most_step_folders"])
    assert report["stray"] == []
    # Memory, checked in this form too: every rank's last life at least (it runs to the end) is judged, and
    # none grows by more than a quarter of its share of a checkpoint per step (a kept snapshot grows it by one).
    assert report["rss_slopes_judged"] >= 4, report
    assert report["rss_flat"], (report["rss_bytes_per_step_max"], report["rss_bytes_per_step_limit"])
    if memory:
        assert report["host_kills"] == 1 and report["resumes_from_memory"], report["kill_points"]
        assert report["steps_lost_max"] <= 1, report["steps_lost"]
        assert report["memory_bounded"], (report["largest_host_memory_parts"], report["most_memory_steps_per_rank"])
        assert report["memory_left"] == []
    assert report["ok"] and done.returncode == 0
