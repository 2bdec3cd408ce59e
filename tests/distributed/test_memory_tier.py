"""The memory tier's fault model, with real processes: each failure, what the restarted job loads, bit for bit.

One job (``_memory_job``: a tensor-parallel MLP with AdamW, a memory checkpoint every step
replicated once to another "host", storage every 5 steps) is started six times. Each start is a
"life" of 4 Gloo ranks (2 in life 4) whose hosts are memory folders under ``tmp_path`` (plus
torchrun's node number); lives end by SIGKILL at chosen points:

====  ============  ===========================================  ==============================================
life  hosts         ends with                                    the next life loads
====  ============  ===========================================  ==============================================
1     A A B B       rank 1 killed in step 5                      step 4 from memory, each rank from its own host
2     A A B B       ranks 2, 3 killed in step 8; host B's        step 7 from memory: ranks 2, 3 receive their
                    folder deleted (the host is lost)            parts from A's replicas over the process group
3     A A B B       rank 3 killed as replication of step 10      step 9 (10 is half replicated: never chosen,
                    starts                                       and 9 was kept by the ranks that committed 10)
4     A C           2 ranks, another layout; a clean end         step 12 from memory, into 4 ranks, two of them
                    without close()                              on new hosts
5     A C D E       ranks 1, 2 killed in step 17; C and D        step 15 from storage (two hosts lost with one
                    deleted                                      replica each), the fallback logged
6     A C' D E      C' is a tmpfs too small for a part; close()  (nothing left in any memory folder)
                    after step 20
====  ============  ===========================================  ==============================================

Every resume: the whole training state right after loading equals, bit for bit, the state the
life that saved that step logged at it (the same as an uninterrupted run's: training is
deterministic given the state), whatever world size and layout load it. Memory reads: nothing
from storage when memory had the step. Memory use: at most ``keep_last_memory + 1`` steps per
rank folder (committed, or being staged), and no more files than the parts of that many steps;
the first commit of a life reclaims what earlier lives left. In life 6 (where a tmpfs can be
mounted) rank 1's memory is full: every step is skipped in memory, logged, and training goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import _memory_job as job
from tests.distributed._launch import DistributedTestError, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _records(out: Path, life: int, rank: int) -> list[dict[str, Any]]:
    path = out / f"life-{life}-r{rank}.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:  # a killed rank's last line may be cut short
            continue
    return found


def _run(out: Path, root: Path, life: int, hosts: list[tuple[str, int]], steps: int, *,
         kill: dict[str, Any] | None = None, close: bool = False) -> None:
    args = {"out": str(out), "root": str(root), "life": life, "hosts": hosts, "steps": steps, "kill": kill,
            "close": close}
    if kill is None:
        run_distributed(job.job, len(hosts), args, timeout=240)
        return
    with pytest.raises(DistributedTestError) as failed:
        run_distributed(job.job, len(hosts), args, timeout=240, grace=15)
    for rank in kill["ranks"]:  # died by its own SIGKILL; the others failed on losing it
        assert "exited with code -9" in failed.value.failures.get(rank, ""), str(failed.value)[-3000:]


def _mount_small_tmpfs(path: Path) -> bool:
    """A 16 KiB tmpfs at ``path`` (too small for a part), where this process may mount one."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(path)], capture_output=True,
                          check=False)
    return done.returncode == 0


def test_memory_tier_fault_model(tmp_path: Path) -> None:
    out, root = tmp_path / "logs", tmp_path / "ckpt"
    out.mkdir()
    folder = {name: str(tmp_path / f"host-{name}") for name in "ABCDEF"}
    # step -> (world size, digest of the whole state) as the last life that saved it logged it
    digests: dict[int, tuple[int, str]] = {}

    def check_life(life: int, world: int, resume: int | None, tier: str | None = None) -> list[dict[str, Any]]:
        resumes = []
        for rank in range(world):
            records = _records(out, life, rank)
            counted = [r for r in records if "files" in r]  # at each commit in memory, and at the end
            assert counted, (life, rank, "no count of the memory folder was logged")
            for record in counted:  # memory bounds, at every commit of every life
                assert record["files"]["steps"] <= job.KEEP_LAST_MEMORY + 1, (life, rank, record)
                assert record["files"]["files"] <= (job.KEEP_LAST_MEMORY + 1) * (1 + job.REPLICAS), record
            found = [r for r in records if "resume" in r]
            if resume is None:
                assert not found, (life, rank, found)
                continue
            assert len(found) == 1 and found[0]["resume"] == resume, (life, rank, found)
            assert found[0]["tier"] == tier, (life, rank, found[0])
            resumes.append(found[0])
        if resume is not None:
            assert resumes[0]["digest"] == digests[resume][1], (life, resume)  # rank 0 holds the digest
        for record in _records(out, life, 0):
            if "digest" in record and "step" in record:
                # A step trained again on as many ranks gives the same bits; on another world size the
                # partial sums add in another order, and the later life's save is the one that counts.
                before = digests.setdefault(record["step"], (world, record["digest"]))
                assert before[0] != world or before[1] == record["digest"], (life, record)
                digests[record["step"]] = (world, record["digest"])
        return resumes

    # Life 1: rank 1 dies in step 5; its host's memory survives.
    ab = [(folder["A"], 0), (folder["A"], 0), (folder["B"], 1), (folder["B"], 1)]
    _run(out, root, 1, ab, 20, kill={"phase": "train", "step": 5, "ranks": [1]})
    check_life(1, 4, None)

    # Life 2: every rank reads its own host's memory, nothing from storage. Then host B is lost.
    _run(out, root, 2, ab, 20, kill={"phase": "train", "step": 8, "ranks": [2, 3]})
    for report in check_life(2, 4, 4, "memory"):
        assert report["storage"] == 0 and report["peer"] == 0 and report["local"] > 0, report
    shutil.rmtree(folder["B"])

    # Life 3: ranks 2 and 3 (on the new, empty host B) receive their parts from A's replicas.
    _run(out, root, 3, ab, 20, kill={"phase": "replicating", "step": 10, "ranks": [3]})
    reports = check_life(3, 4, 7, "memory")
    assert all(r["storage"] == 0 for r in reports), reports
    assert reports[0]["peer"] == reports[1]["peer"] == 0 and reports[0]["local"] > 0, reports
    assert reports[2]["peer"] > 0 and reports[3]["peer"] > 0 and reports[2]["local"] == 0, reports

    # Life 4: 2 ranks, another layout, on A and a new host C; step 10 was half replicated.
    _run(out, root, 4, [(folder["A"], 0), (folder["C"], 1)], 12)
    reports = check_life(4, 2, 9, "memory")
    assert reports[1]["peer"] > 0 and all(r["storage"] == 0 for r in reports), reports
    # Life 4's first commit in memory removed what lives 1 to 3 left on A: one life's folder is left.
    (memory_a,) = Path(folder["A"]).glob("shardkit-*")
    assert len({p.name.split("-")[0] for p in memory_a.iterdir() if p.is_dir()}) == 1, list(memory_a.iterdir())

    # Life 5: 4 ranks on A, C and new hosts D, E load life 4's step 12; then C and D are lost.
    acde = [(folder["A"], 0), (folder["C"], 1), (folder["D"], 2), (folder["E"], 3)]
    _run(out, root, 5, acde, 20, kill={"phase": "train", "step": 17, "ranks": [1, 2]})
    reports = check_life(5, 4, 12, "memory")
    assert reports[2]["peer"] > 0 and reports[3]["peer"] > 0 and all(r["storage"] == 0 for r in reports), reports
    shutil.rmtree(folder["C"])
    shutil.rmtree(folder["D"])

    # Life 6: step 16 lost part 1 with its replica (hosts C and D): storage's step 15, logged. The new
    # host C is a tmpfs too small for a part, where one can be mounted: no step is kept in memory.
    small = Path(folder["C"])
    mounted = _mount_small_tmpfs(small)
    try:
        _run(out, root, 6, [(folder["A"], 0), (folder["C"], 1), (folder["D"], 2), (folder["E"], 3)], 20, close=True)
        reports = check_life(6, 4, 15, "storage")
        assert all(r["storage"] > 0 and r["local"] == r["peer"] == 0 for r in reports), reports
        assert "memory step 16 lacks the part of rank 1" in reports[0]["reason"], reports[0]
        logged = [r["message"] for r in _records(out, 6, 0) if r.get("log") == "WARNING"]
        assert any("loading step 15 from storage" in m for m in logged), logged
        if mounted:  # rank 1's memory is full: no step in memory, training went on, storage got step 20
            full = [r["message"] for r in _records(out, 6, 1) if r.get("log") == "WARNING"]
            assert any("rank 1 cannot stage step 16" in m and "No space left" in m for m in full), full
            assert any("step 16 is not kept in memory" in m for m in logged), logged
        assert _records(out, 6, 0)[-1]["done"] == 20
        # close(): nothing is left in any memory folder of the last life.
        for name in "ACDE":
            assert not list(Path(folder[name]).iterdir()), (name, list(Path(folder[name]).rglob("*")))
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=False)
    assert sorted(os.listdir(root)) == ["step-0000000015", "step-0000000020"]
