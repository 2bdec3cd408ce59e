#!/usr/bin/env python
"""Soak: a 4-rank training job saving every step, one rank SIGKILLed again and again, resumed each time.

    python scripts/soak.py                  # 240 steps, 10 kills (the figures in docs/benchmarks.md)
    python scripts/soak.py --memory         # the same with the memory tier, kills of ranks and of hosts
    python scripts/soak.py --short --memory # 40 steps, 2 kills: the test suite's form (tests/distributed)
    python scripts/soak.py --steps 400 --kills 20 --seed 3 --keep DIR

The job (4 ranks started by ``_shardkit.launch``, Gloo) trains a tensor-parallel MLP
(first Linear split on its outputs, second on its inputs, AdamW) on data derived from the step
number, and after every step calls ``CheckpointManager.save(step, ..., async_=True)`` with
``keep_last``. A first, uninterrupted run (no checkpoints) records a SHA-256 of every rank's
parameters and optimizer state at every step. Then the soak run: the driver waits until the
job is a random number of steps past its resume point, sleeps a random fraction of a step and
SIGKILLs one random rank (the others get ``--grace`` seconds to fail on their own, then are
killed), and starts the job again; the job
resumes from ``latest_step()``. Checked, and reported as JSON (exit 1 if any fails):

- every resume, on every rank: the loaded state equals the uninterrupted run's at that step,
  bit for bit; so does the final state;
- the resume steps never go back (a committed step is never lost);
- disk: the root, sampled every 50 ms, never holds more than ``keep_last + 2`` step folders or
  checkpoints' worth of bytes (the kept ones, the one being written, and one a kill left:
  committed but not yet pruned, or half written, until the restarted job removes it);
- memory, in every form (``--short`` and ``--memory`` too): after a warm-up of 3 steps (the
  first asynchronous saves allocate their staging buffers), each rank's RSS grows by at most a
  quarter of its share of a checkpoint per step (the median slope between every two steps of
  the rest of the life, with free heap pages returned to the OS before each sample; lives of at
  least 8 steps after warm-up are judged, and the last life always is): a save that kept its
  snapshot would grow it by a whole share per step, while the allocator's own growth early in a
  life measures 0.04-0.07 of a share. Lives of at least 30 steps after a warm-up of 10 are also
  judged by their total growth, at most 5%;
- no stray files: at the end the root holds the last ``keep_last`` step folders, each with
  ``shardkit.json`` and data files only.

With ``--memory`` the manager also keeps every step in memory (``memory_every=1``, one replica,
``keep_last_memory=1``) and writes to the root every ``--storage-every`` steps (10; 2 with
``--short``). The 4 ranks are two "hosts" of two ranks, each with its own memory folder (and
torchrun's node number): a kill takes one rank, or (the second kill, and every third after it)
both ranks of a random host, whose memory folder is then deleted before the restart. Checked
besides:

- every resume reads from memory, nothing from storage (one host at most is lost at a time,
  and every part has a replica on the other);
- work lost per failure: the last step every rank had finished minus the step resumed from
  is at most 1;
- memory: every rank folder, sampled every 50 ms, holds at most ``keep_last_memory + 1``
  steps, and each host's folder at most the parts of that many steps for two starts of the job
  (the one running and the one it recovered from, until its first step in memory), plus the
  parts fetched by a recovery; nothing is left once the last run closed its manager.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _shardkit.launch import launch  # noqa: E402 - after the repository is on the path

WORLD = 4
DIM, HIDDEN, BATCH = 128, 512, 32
WARMUP, JUDGED = 10, 30  # RSS: steps after each start before the baseline; lives shorter than this are not judged
RSS_LIMIT = 0.05
HOSTS = 2  # with --memory: ranks 0, 1 on the first "host", 2, 3 on the second
KEEP_LAST_MEMORY = 1
SLOPE_WARMUP, SLOPE_JUDGED = 3, 8  # RSS per step: the same, for the slope (the short form's lives are short)
LEAK_SHARE = 0.25  # RSS may grow by this share of one rank's checkpoint bytes per step


# -- the job (one process per rank) -------------------------------------------------------------------

def _rss_bytes() -> int:
    """This process's resident memory, less its pages of shared-memory files: with ``--memory`` those
    are the memory tier's parts, mapped as they are first used and bounded by their own check."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc
    if trim is not None:  # free heap pages go back to the OS first: RSS then counts what is live
        trim(0)
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024  # in kB
    return fields["VmRSS"] - fields.get("RssShmem", 0)


def _digest(model: Any, optim: Any) -> str:
    """SHA-256 of this rank's parameters and optimizer state, in a fixed order."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for key, value in sorted(optim.state.get(p, {}).items()):
            h.update(key.encode())
            h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def job(rank: int, world: int, args: dict[str, Any]) -> None:
    """One rank's life: resume from the latest step if there is one, then train and save every step."""
    import torch
    from torch import nn

    import checkpoint
    import sharded_tensor as st
    from sharding import composite, single_split

    memory = args["memory"]
    if memory:  # this rank's "host": its memory folder, and its node number as torchrun gives it
        os.environ["SHARDKIT_MEMORY_DIR"] = memory[rank * len(memory) // world]
        os.environ["GROUP_RANK"] = str(rank * len(memory) // world)
    out = Path(args["out"])
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    log = open(out / f"log-{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the whole life
    log.write(json.dumps({"phase": "started", "t": time.time()}) + "\n")
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
    st.shard_model(model, composite(**{"0": single_split(0, ranks), "2.weight": single_split(1, ranks)}), seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log.write(json.dumps({"phase": "sharded", "t": time.time()}) + "\n")

    reference, steps = args["reference"], args["steps"]
    tier = {"memory_every": 1, "memory_replicas": 1, "keep_last_memory": KEEP_LAST_MEMORY} if memory else {}
    manager = None if reference else checkpoint.CheckpointManager(args["root"], keep_last=args["keep_last"],
                                                                  timeout=args["timeout"],
                                                                  storage_every=args["storage_every"], **tier)
    start = 0
    if manager is not None and manager.recoverable_step() is not None:
        state = {**st.get_state_dict(model, optim), "step": None}
        manager.load(state)
        st.set_state_dict(model, optim, state)
        start = state["step"]
        report = manager.last_load
        assert report is not None
        log.write(json.dumps({"resume": start, "digest": _digest(model, optim), "pid": os.getpid(),
                              "tier": report.tier, "storage_bytes": report.storage_bytes,
                              "peer_bytes": report.peer_bytes, "load_seconds": round(report.seconds, 3),
                              "t": time.time()}) + "\n")
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        record: dict[str, Any] = {"step": step, "rss": _rss_bytes(), "pid": os.getpid(), "t": time.time()}
        if manager is not None:
            manager.save(step, {**st.get_state_dict(model, optim), "step": step}, async_=True)
        if reference or step == steps:
            record["digest"] = _digest(model, optim)
        log.write(json.dumps(record) + "\n")
    if manager is not None:
        manager.close()  # the clean finish: waits for the last save, removes the memory tier's files
    log.close()


# -- the driver ------------------------------------------------------------------------------------

class _Run(threading.Thread):
    """One start of the job: ``WORLD`` ranks (``_shardkit.launch``, Gloo) on a thread; ``error`` once it ended."""

    def __init__(self, args: argparse.Namespace, out: Path, root: Path, *, reference: bool) -> None:
        super().__init__(daemon=True)
        self.error: BaseException | None = None
        self._job = {"out": str(out), "root": str(root), "steps": args.steps, "keep_last": args.keep_last,
                     "timeout": args.timeout, "reference": reference, "storage_every": args.storage_every,
                     "memory": [str(m) for m in args.memory_dirs] if args.memory and not reference else None}
        self._options = {"timeout": args.job_timeout, "collective_timeout": args.timeout, "grace": args.grace,
                         "preload": ("torch._dynamo",)}  # imported by any optimizer: once, not at each start
        self.start()

    def run(self) -> None:
        try:
            launch(job, WORLD, (self._job,), capture_output=False, threads=1, **self._options)
        except BaseException as exc:  # noqa: BLE001 - reported by the driver
            self.error = exc

    def running(self) -> bool:
        return self.is_alive()


def _records(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"log-{rank}.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a killed rank may be cut short
            continue
    return found


def _progress(out: Path) -> int:
    """The last step every rank has logged in this run directory (0 if none)."""
    steps = []
    for rank in range(WORLD):
        done = [r["step"] for r in _records(out, rank) if "step" in r]
        steps.append(done[-1] if done else 0)
    return min(steps)


def _folder_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue  # removed while walking
    return total


class _DiskSampler(threading.Thread):
    """Samples ``root`` every 50 ms: ``largest`` bytes and ``most`` step folders seen."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.largest, self.most, self._halt = root, 0, 0, threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.05):
            self.largest = max(self.largest, _folder_bytes(self.root))
            try:
                self.most = max(self.most, sum(1 for e in os.scandir(self.root) if e.name.startswith("step-")))
            except FileNotFoundError:
                continue

    def stop(self) -> None:
        self._halt.set()
        self.join()


class _MemorySampler(threading.Thread):
    """Samples the hosts' memory folders every 50 ms: ``largest`` bytes held by one host (pages, each
    file once), ``most`` steps in one rank folder, and ``part`` the largest data file seen."""

    def __init__(self, folders: list[Path]) -> None:
        super().__init__(daemon=True)
        self.folders, self.largest, self.most, self.part, self._halt = folders, 0, 0, 0, threading.Event()

    def _sample(self, folder: Path) -> None:
        seen, total = set(), 0
        for dirpath, dirnames, files in os.walk(folder):
            if os.path.basename(dirpath).count("-r") == 1 and not os.path.basename(dirpath).startswith("."):
                self.most = max(self.most, sum(1 for d in dirnames if d.startswith("step-")))
            for name in files:
                try:
                    info = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # removed while walking
                if info.st_ino not in seen:  # hard links (a recovery's) count once
                    seen.add(info.st_ino)
                    total += info.st_blocks * 512
                if name.startswith("data-"):
                    self.part = max(self.part, info.st_size)
        self.largest = max(self.largest, total)

    def run(self) -> None:
        while not self._halt.wait(0.05):
            for folder in self.folders:
                self._sample(folder)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _reference(args: argparse.Namespace, work: Path) -> dict[int, list[str]]:
    """Per step, every rank's digest in the uninterrupted run."""
    out = work / "reference"
    out.mkdir()
    run = _Run(args, out, work / "unused", reference=True)
    run.join()
    if run.error is not None:
        msg = f"the uninterrupted run failed: {run.error}"
        raise RuntimeError(msg) from run.error
    digests: dict[int, list[str]] = {}
    for rank in range(WORLD):
        for record in (r for r in _records(out, rank) if "step" in r):
            digests.setdefault(record["step"], [""] * WORLD)[rank] = record["digest"]
    return digests


def _rss_growth(records: list[dict[str, Any]]) -> float | None:
    """Growth of RSS over one process life after warm-up, or None if the life is too short to judge."""
    steps = [r for r in records if "step" in r]
    if len(steps) < WARMUP + JUDGED:
        return None
    base = steps[WARMUP - 1]["rss"]
    return max(r["rss"] for r in steps[WARMUP:]) / base - 1.0


def _rss_slope(records: list[dict[str, Any]]) -> float | None:
    """Growth of RSS per step over one life after its warm-up (bytes), or None if too short.

    The median of the slopes between every two steps (Theil-Sen): a snapshot kept by every
    save raises each of them, while one allocation made once (a staging buffer, an allocator
    arena) raises only the pairs that straddle it."""
    rss = [r["rss"] for r in records if "step" in r][SLOPE_WARMUP:]
    if len(rss) < SLOPE_JUDGED:
        return None
    return statistics.median((rss[j] - rss[i]) / (j - i) for i in range(len(rss)) for j in range(i + 1, len(rss)))


def _stray(root: Path, keep_last: int, steps: int, every: int) -> list[str]:
    """Files or folders under ``root`` that should not be there at the end."""
    wanted = {f"step-{s:010d}" for s in [s for s in range(1, steps + 1) if s % every == 0][-keep_last:]}
    stray = []
    for entry in sorted(root.iterdir()):
        if entry.name not in wanted or not entry.is_dir() or entry.is_symlink():
            stray.append(entry.name)
            continue
        for item in sorted(entry.iterdir()):
            if item.name != "shardkit.json" and not (item.name.startswith("data-")
                                                     and item.name.endswith(".safetensors")):
                stray.append(f"{entry.name}/{item.name}")
    stray += [f"missing {name}" for name in sorted(wanted - {e.name for e in root.iterdir()})]
    return stray


def soak(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="shardkit-soak-", dir=args.keep))
    try:
        reference = _reference(args, work)
        reference_seconds = time.perf_counter() - started
        root = work / "ckpt"
        sampler = _DiskSampler(root)
        sampler.start()
        args.memory_dirs = [work / f"memory-host{h}" for h in range(HOSTS)]
        for folder in args.memory_dirs:
            folder.mkdir()
        memory_sampler = _MemorySampler(args.memory_dirs)
        if args.memory:
            memory_sampler.start()
        resumes: list[dict[str, Any]] = []
        kills: list[dict[str, Any]] = []
        lives: list[list[dict[str, Any]]] = []
        final: list[str | None] = [None] * WORLD
        run = 0
        while True:
            out = work / f"run-{run}"
            out.mkdir()
            proc = _Run(args, out, root, reference=False)
            killing = len(kills) < args.kills
            if killing:
                # Kill at a random step past the resume point, at a random moment within that step.
                ahead = rng.randint(2, max(2, args.steps * 6 // (10 * args.kills)))
                victim = rng.randrange(WORLD)
                deadline = time.monotonic() + args.job_timeout
                base = None
                while proc.running() and time.monotonic() < deadline:
                    done = _progress(out)
                    if base is None and done:
                        base = done
                    if base is not None and done >= base + ahead:
                        break
                    time.sleep(0.01)
                if not proc.running():
                    raise RuntimeError(f"run {run} ended before its kill: {proc.error}")
                host = rng.randrange(HOSTS) if args.memory and len(kills) % 3 == 1 else None
                victims = [victim] if host is None else list(range(host * WORLD // HOSTS, (host + 1) * WORLD // HOSTS))
                time.sleep(rng.uniform(0.0, args.step_seconds))
                pids = [int((out / f"pid-{v}").read_text()) for v in victims]
                step = _progress(out)
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
                proc.join()
                if host is not None:  # the host is lost with its memory; it comes back empty
                    shutil.rmtree(args.memory_dirs[host])
                    args.memory_dirs[host].mkdir()
                kills.append({"run": run, "ranks": victims, "host": host, "after_step": step,
                              "finished_everywhere": _progress(out),
                              "job_end_seconds": round(time.monotonic() - killed_at, 2)})
            else:
                proc.join()
                if proc.error is not None:
                    raise RuntimeError(f"the last run failed: {proc.error}") from proc.error
            for rank in range(WORLD):
                records = _records(out, rank)
                lives.append(records)
                resumed = [r for r in records if "resume" in r]
                if resumed:
                    step = resumed[0]["resume"]
                    resumes.append({"run": run, "rank": rank, "step": step,
                                    "exact": resumed[0]["digest"] == reference[step][rank],
                                    "tier": resumed[0].get("tier"), "storage_bytes": resumed[0].get("storage_bytes"),
                                    "peer_bytes": resumed[0].get("peer_bytes"),
                                    "load_seconds": resumed[0].get("load_seconds")})
                if not killing:
                    final[rank] = next((r["digest"] for r in records if r.get("step") == args.steps), None)
            if not killing:
                break
            run += 1
        sampler.stop()
        if args.memory:
            memory_sampler.stop()
        last_storage = max(s for s in range(1, args.steps + 1) if s % args.storage_every == 0)
        checkpoint_bytes = _folder_bytes(root / f"step-{last_storage:010d}")
        resume_steps = [r["step"] for r in resumes if r["rank"] == 0]
        growth = [g for g in (_rss_growth(life) for life in lives) if g is not None]
        slopes = [s for s in (_rss_slope(life) for life in lives) if s is not None]
        per_step_limit = LEAK_SHARE * checkpoint_bytes / WORLD
        stray = _stray(root, args.keep_last, args.steps, args.storage_every)
        # Work lost by each failure: the last step every rank had finished, minus the step the next
        # run resumed from (0 when there was none yet: a kill before the first step in storage).
        resumed_in = {r["run"]: r["step"] for r in resumes if r["rank"] == 0}
        lost = [kill["finished_everywhere"] - resumed_in.get(kill["run"] + 1, 0) for kill in kills]
        report = {
            "steps": args.steps, "steps_run": sum(1 for life in lives[::WORLD] for r in life if "step" in r),
            "kills": len(kills), "keep_last": args.keep_last, "world": WORLD,
            "seed": args.seed, "resume_steps": resume_steps,
            # Every run after a kill resumes (only a root with no step yet has nothing to resume from).
            "resumes_exact": all(r["exact"] for r in resumes) and (
                len(resumes) == WORLD * len(kills) or args.storage_every > 1 and not args.memory),
            "inexact_resumes": [r for r in resumes if not r["exact"]],
            "resume_steps_monotonic": resume_steps == sorted(resume_steps),
            "final_exact": final == reference[args.steps],
            "checkpoint_bytes": checkpoint_bytes, "largest_root_bytes": sampler.largest,
            "largest_root_checkpoints": round(sampler.largest / checkpoint_bytes, 2) if checkpoint_bytes else None,
            "most_step_folders": sampler.most,
            # + 2: the step being written, and one a kill left (committed but not yet pruned, or
            # half written) until the restarted job's first save prunes it; + 2%: metadata sizes vary
            "disk_bounded": sampler.most <= args.keep_last + 2
            and sampler.largest <= (args.keep_last + 2) * checkpoint_bytes * 1.02,
            "rss_growth_max": round(max(growth), 4) if growth else None, "rss_lives_judged": len(growth),
            "rss_bytes_per_step_max": round(max(slopes)) if slopes else None,
            "rss_bytes_per_step_limit": round(per_step_limit), "rss_slopes_judged": len(slopes),
            "rss_flat": len(slopes) >= WORLD and max(slopes) <= per_step_limit
            and all(g <= RSS_LIMIT for g in growth),
            "stray": stray,
            "steps_lost": lost, "steps_lost_max": max(lost, default=0),
            "kill_points": kills,
            "reference_seconds": round(reference_seconds, 1),
            "seconds": round(time.perf_counter() - started, 1),
        }
        checks = [report["resumes_exact"], report["resume_steps_monotonic"], report["final_exact"],
                  report["disk_bounded"], report["rss_flat"], not stray]
        if args.memory:
            # Two starts' steps (the one running, the one it recovered from) of two ranks, each with a
            # replica, plus what a recovery fetched; sampled pages, so a little slack.
            parts = 2 * (WORLD // HOSTS) * (KEEP_LAST_MEMORY + 1) * 2 + WORLD // HOSTS
            report.update({
                "resumes_from_memory": all(r["tier"] == "memory" and r["storage_bytes"] == 0 for r in resumes),
                "load_seconds_max": max((r["load_seconds"] for r in resumes), default=None),
                "host_kills": sum(1 for k in kills if k["host"] is not None),
                "memory_part_bytes": memory_sampler.part, "largest_host_memory_bytes": memory_sampler.largest,
                "largest_host_memory_parts": round(memory_sampler.largest / memory_sampler.part, 2)
                if memory_sampler.part else None,
                "most_memory_steps_per_rank": memory_sampler.most,
                "memory_bounded": memory_sampler.most <= KEEP_LAST_MEMORY + 1
                and memory_sampler.largest <= parts * memory_sampler.part * 1.05 + (1 << 20),
                "memory_left": sorted(str(p.relative_to(work)) for d in args.memory_dirs for p in d.rglob("*")),
            })
            checks += [report["resumes_from_memory"], report["steps_lost_max"] <= 1, report["memory_bounded"],
                       not report["memory_left"]]
        report["ok"] = all(checks)
        return report
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked, with the defaults of ``--short`` and ``--memory`` filled in."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="40 steps, 2 kills (for the test suite)")
    parser.add_argument("--steps", type=int, help="training steps (default 240; --short: 40)")
    parser.add_argument("--kills", type=int, help="SIGKILLs, one rank each (default 10; --short: 2)")
    parser.add_argument("--keep-last", type=int, default=3, help="CheckpointManager keep_last (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points (default 0)")
    parser.add_argument("--timeout", type=float, default=30.0, help="the manager's timeout= in seconds (default 30)")
    parser.add_argument("--step-seconds", type=float, default=0.05,
                        help="the random delay before a kill is up to this long (default 0.05)")
    parser.add_argument("--job-timeout", type=float, default=600.0, help="longest wait for one run (default 600)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds the other ranks get to fail on their own after a kill before they are "
                             "killed too (default 10)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (logs, checkpoints)")
    parser.add_argument("--memory", action="store_true",
                        help="the memory tier: every step in memory, two hosts, kills of ranks and hosts")
    parser.add_argument("--storage-every", type=int,
                        help="write every this many steps to the root (default: every step; with --memory 10, "
                             "and 2 with --short)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (40 if args.short else 240)
    args.kills = args.kills if args.kills is not None else (2 if args.short else 10)
    args.storage_every = args.storage_every or ((2 if args.short else 10) if args.memory else 1)
    if args.steps < 2 * args.kills + 10 or args.kills < 0 or args.keep_last < 1:
        parser.error(f"need --steps >= 2 * --kills + 10 and --keep-last >= 1, got --steps {args.steps} "
                     f"--kills {args.kills} --keep-last {args.keep_last}")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = soak(args)
    print(json.dumps(report, indent=1), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
