"""Run a short 2-rank train-and-save job many times and count the runs that did not exit cleanly.

    python scripts/stress_exit.py [--runs 200] [--nproc 2] [--keep-logs DIR]

Each run is ``torchrun --standalone --nproc-per-node 2`` on the README's training script
("A sharded model and its checkpoint"): import shardkit, ``init_process_group``, shard a
model from the meta device, train 3 steps, ``checkpoint.save``, ``destroy_process_group``.
``--async-save`` adds a background save with ``CheckpointManager``. A run fails if torchrun exits non-zero;
an abort is a failed run whose output shows a rank killed by SIGABRT or the C++ runtime's
``terminate called``. The driver lowers its own priority (``nice``): the job is short and
the machine may be shared. Prints one JSON line and exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# The README's training script, run as a user's script is: module-level code, its objects
# alive until the interpreter exits. The checkpoint folder comes from the environment.
JOB = """\
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import checkpoint
import sharded_tensor as st
from sharding import composite, single_split

dist.init_process_group("gloo")
ranks = [f"rank:{r}/cpu" for r in range(dist.get_world_size())]

with torch.device("meta"):
    model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1000))
spec = composite(**{"0": single_split(0, ranks), "1": single_split(0, ranks), "3.weight": single_split(1, ranks)})
st.shard_model(model, spec, seed=0)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

tokens = torch.arange(129) % 1000
for step in range(3):
    loss = F.cross_entropy(model(tokens[:-1]), tokens[1:])
    loss.backward()
    optim.step()
    optim.zero_grad()

state = {**st.get_state_dict(model, optim), "step": 3}
checkpoint.save(state, os.path.join(os.environ["STRESS_OUT"], "ckpt"), quiet=True)
if os.environ.get("STRESS_ASYNC") == "1":
    manager = checkpoint.CheckpointManager(os.path.join(os.environ["STRESS_OUT"], "managed"), keep_last=1)
    manager.save(3, state, async_=True)
    manager.wait()
dist.destroy_process_group()
"""


def drive(args: argparse.Namespace) -> int:
    os.nice(10)
    env = {**os.environ, "STRESS_ASYNC": "1" if args.async_save else "0",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    failed: list[int] = []
    aborted: list[int] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stress-exit-") as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(JOB)
        for run in range(1, args.runs + 1):
            out = Path(tmp) / f"run-{run}"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(args.nproc), str(script)]
            result = subprocess.run(command, env={**env, "STRESS_OUT": str(out)}, cwd=ROOT, capture_output=True,
                                    text=True, check=False)
            if result.returncode != 0:
                failed.append(run)
                text = result.stdout + result.stderr
                if "terminate called" in text or "SIGABRT" in text:
                    aborted.append(run)
                if args.keep_logs is not None:
                    args.keep_logs.mkdir(parents=True, exist_ok=True)
                    (args.keep_logs / f"run-{run}.log").write_text(text)
            outcome = "ok" if result.returncode == 0 else f"exit code {result.returncode}"
            print(f"run {run}/{args.runs}: {outcome}{' (abort)' if run in aborted else ''}; "
                  f"{len(failed)} failed so far", file=sys.stderr, flush=True)
            subprocess.run(["rm", "-rf", str(out)], check=False)
    summary = {"runs": args.runs, "nproc": args.nproc, "async_save": args.async_save, "failed": len(failed),
               "aborted": len(aborted),
               "failed_runs": failed, "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(summary), flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200,
                        help="torchrun jobs to start, one after another (default: 200)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per job (default: 2)")
    parser.add_argument("--async-save", action="store_true",
                        help="also save in the background with CheckpointManager")
    parser.add_argument("--keep-logs", type=Path, help="folder to write the output of each failed run to")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.nproc < 1:
        parser.error(f"--runs and --nproc must be at least 1, got --runs {args.runs} --nproc {args.nproc}")
    return drive(args)


if __name__ == "__main__":
    raise SystemExit(main())
