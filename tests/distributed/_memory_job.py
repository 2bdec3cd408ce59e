"""A training job with the memory tier, started again and again by ``test_memory_tier.py``.

``job(rank, world, args)`` is one life: each rank takes its "host" from ``args["hosts"]`` (its
memory folder, and a node number as torchrun's ``GROUP_RANK`` would give), resumes with
``recoverable_step`` and ``load`` when there is a step, trains a tensor-parallel MLP (AdamW, data
from the step number) to ``args["steps"]``, saves every step (memory every step, storage every
``STORAGE_EVERY``), and dies by SIGKILL where ``args["kill"]`` says. It logs, as JSON lines in
``<out>/life-<n>-r<rank>.jsonl``: the resume (step, ``last_load``, the digest of the whole
training state right after loading) and every step's digest of the whole state (rank 0).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

import checkpoint
import sharded_tensor as st
from checkpoint import _memory_tier
from sharding import composite, single_split

DIM, HIDDEN, BATCH = 64, 256, 16
STORAGE_EVERY = 5
KEEP_LAST = 2
KEEP_LAST_MEMORY = 1
REPLICAS = 1


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def full_digest(model: nn.Module, optim: torch.optim.Optimizer) -> str | None:
    """SHA-256 of the whole training state (every rank's shards gathered) on rank 0; ``None`` elsewhere. Collective."""
    full = checkpoint.collect_state_dict(st.get_state_dict(model, optim))
    if full is None:
        return None
    h = hashlib.sha256()
    for name, value in sorted(_flat(full).items()):
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(str(value.dtype).encode())
            h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(json.dumps(value).encode())
    return h.hexdigest()


def own_files(root: str, memory_dir: str, life_rank: str) -> dict[str, int]:
    """What this rank's folder holds now: steps (committed, and the one being staged) and data files
    (parts, staging, spares)."""
    found = {"steps": 0, "files": 0}
    for job in Path(memory_dir).glob("shardkit-*"):
        for folder in job.glob(life_rank):
            found["steps"] += sum(1 for p in folder.glob("step-*")) + (folder / ".staging-own").exists()
            found["files"] += sum(1 for p in folder.rglob("*") if p.is_file() and p.name != "shardkit.json")
    return found


class _Capture(logging.Handler):
    def __init__(self, log: Any) -> None:
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.write(json.dumps({"log": record.levelname, "message": record.getMessage()}) + "\n")


def job(rank: int, world: int, args: dict[str, Any]) -> None:
    memory_dir, node = args["hosts"][rank]
    os.environ["SHARDKIT_MEMORY_DIR"] = memory_dir
    os.environ["GROUP_RANK"] = str(node)
    out = Path(args["out"])
    log = open(out / f"life-{args['life']}-r{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - for the whole life
    logging.getLogger("checkpoint").addHandler(_Capture(log))
    logging.getLogger("checkpoint").setLevel(logging.INFO)
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
    st.shard_model(model, composite(**{"0": single_split(0, ranks), "2.weight": single_split(1, ranks)}), seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = checkpoint.CheckpointManager(args["root"], keep_last=KEEP_LAST, storage_every=STORAGE_EVERY,
                                           memory_every=1, memory_replicas=REPLICAS,
                                           keep_last_memory=KEEP_LAST_MEMORY, timeout=30)
    kill = args.get("kill") or {}
    start = 0
    if manager.recoverable_step() is not None:
        state = {**st.get_state_dict(model, optim), "step": None}
        manager.load(state)
        st.set_state_dict(model, optim, state)
        start = state["step"]
        report = manager.last_load
        assert report is not None
        log.write(json.dumps({"resume": start, "tier": report.tier, "local": report.local_bytes,
                              "peer": report.peer_bytes, "storage": report.storage_bytes,
                              "seconds": report.seconds, "reason": report.reason,
                              "digest": full_digest(model, optim)}) + "\n")

    def folder_name() -> str:
        """This rank's folder in its host's memory folder (the tier is set up by the first save or load)."""
        ready = manager._memory is not None and manager._memory._ready
        return f"{manager._memory.life}-r{rank:05d}" if ready else ""  # type: ignore[union-attr]

    def hook(phase: str, at: int) -> None:
        if phase == kill.get("phase") == "replicating" and rank in kill["ranks"] and at == kill["step"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if phase == "committed":
            # Counted on the thread that commits, after the commit and before the step before is
            # reclaimed: the fullest this rank's folder gets, and nothing else changes it meanwhile
            # (a count taken beside the commit can meet a step half moved and count it twice).
            log.write(json.dumps({"committed": at, "files": own_files(args["root"], memory_dir, folder_name())}) + "\n")

    _memory_tier._test_hook = hook
    for step in range(start + 1, args["steps"] + 1):
        if kill.get("phase") == "train" and step == kill["step"] and rank in kill["ranks"]:
            manager.wait()  # the step before is in memory everywhere: the failure hits a step in progress
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
        manager.save(step, {**st.get_state_dict(model, optim), "step": step}, async_=True)
        digest = full_digest(model, optim)
        record: dict[str, Any] = {"step": step}
        if digest is not None:
            record["digest"] = digest
        log.write(json.dumps(record) + "\n")
    manager.wait()
    name = folder_name()  # before close(), which ends the tier
    if args.get("close"):
        manager.close()
    log.write(json.dumps({"done": args["steps"], "files": own_files(args["root"], memory_dir, name)}) + "\n")
    log.close()
