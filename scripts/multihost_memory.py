"""The job ``scripts/multihost.sh --lose-host1`` runs under torchrun on two hosts: training with the memory tier.

    torchrun ... scripts/multihost_memory.py --out DIR [--steps 60] [--step-seconds 0.05]

Each rank trains a tensor-parallel MLP (AdamW, data from the step number) and saves every
step with a ``CheckpointManager`` whose memory tier keeps every step in memory with one
replica on the other host (``$SHARDKIT_MEMORY_DIR``, set per host by the script); storage gets
every 10th step. A restarted job resumes with ``recoverable_step`` and ``load`` and prints
where its bytes came from. Every rank appends to ``DIR/memory-r<rank>.jsonl`` the SHA-256 of
its shards of the parameters and optimizer state after each step, and after a resume, so
the script can check that the resumed state is, bit for bit, the one saved at that step. A
run that reaches ``--steps`` closes the manager (its memory folders are then empty).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import checkpoint
import sharded_tensor as st
from sharding import composite, single_split

DIM, HIDDEN, BATCH = 128, 512, 32


def _digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for key, value in sorted(optim.state.get(p, {}).items()):
            h.update(key.encode())
            h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.05, help="a pause per step, so a kill lands mid-run")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = open(args.out / f"memory-r{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - for the whole run
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
    st.shard_model(model, composite(**{"0": single_split(0, ranks), "2.weight": single_split(1, ranks)}), seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = checkpoint.CheckpointManager(args.out / "checkpoints", keep_last=2, storage_every=10, memory_every=1,
                                           memory_replicas=1, timeout=60)
    start = 0
    if manager.recoverable_step() is not None:
        state = {**st.get_state_dict(model, optim), "step": None}
        manager.load(state)
        st.set_state_dict(model, optim, state)
        start = state["step"]
        report = manager.last_load
        assert report is not None
        print(f"rank {rank}: resumed step {start} from {report.tier}: {report.local_bytes} bytes from this host's "
              f"memory, {report.peer_bytes} from other hosts', {report.storage_bytes} from storage "
              f"in {report.seconds:.2f} s", flush=True)
        log.write(json.dumps({"resume": start, "tier": report.tier, "local": report.local_bytes,
                              "peer": report.peer_bytes, "storage": report.storage_bytes,
                              "digest": _digest(model, optim)}) + "\n")
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
        manager.save(step, {**st.get_state_dict(model, optim), "step": step}, async_=True)
        log.write(json.dumps({"step": step, "digest": _digest(model, optim)}) + "\n")
        if rank == 0:
            print(f"step {step}", flush=True)
        time.sleep(args.step_seconds)
    manager.close()
    memory = os.environ.get("SHARDKIT_MEMORY_DIR", "")
    left = [str(p) for p in Path(memory).rglob("*")] if memory else []
    print(f"rank {rank}: done at step {args.steps}; {len(left)} entries left in {memory}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
