"""Elastic resume through a chain of layouts, one spawn of 4 ranks, exact at every load.

An MLP with uneven sizes and AdamW trains 3 steps in each layout, is saved, and the next
layout loads it:

    fully sharded over 4 -> 2 x 2 (tensor parallel within {0, 1} and {2, 3}, fully sharded
    over {0, 2} and {1, 3}) -> tensor parallel over {0, 1} -> fully sharded over {0, 1, 2}
    (uneven: 7 rows as 3/3/1; rank 3 takes no part, ``ranks=[]``) -> DDP-style replicas on 4
    -> one process (rank 0) -> and back: replicas -> fully sharded over 3 -> tensor parallel
    -> 2 x 2 -> fully sharded over 4

That is 10 transitions. After each load every tensor of the model and of the optimizer
state, gathered whole on every participating rank, equals bit for bit what the previous
layout saved; the 3 losses after each resume (the mean over the data-parallel ranks of their
part of the batch) stay within 1e-6 relative of one process trained without interruption,
and so do the final parameters. Subgroups serve the layouts that use part of the world
(checkpoints are saved and loaded over them). A load into a bfloat16 model raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import checkpoint
import sharded_tensor as st
from tests.distributed._fully_shard_models import fully_shard_mlp, tensor_parallel_mlp, uneven_mlp
from tests.distributed._grads import whole_state
from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed

BATCH, STEPS = 12, 3  # 12 rows divide over 1, 2, 3 and 4 data-parallel ranks
CHAIN = ["fs4", "2x2", "tp2", "fs3", "ddp4", "one", "ddp4", "fs3", "tp2", "2x2", "fs4"]


def _optim(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


class _Layout:
    """One layout on this rank: the model, which part of the batch it trains on, its checkpoint group."""

    def __init__(self, name: str, rank: int, groups: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        self.name = name
        self.group: Any = None  # the group checkpoints are saved and loaded over (None: the world)
        self.reduce: Any = False  # the group gradients are averaged over by all_reduce_grads, if any
        self.part: tuple[int, int] | None = None  # (index, count) of this rank's part of the batch
        model = uneven_mlp(dtype)
        if name == "fs4":
            fully_shard_mlp(model)
            self.part = (rank, 4)
        elif name == "2x2":
            tensor_parallel_mlp(model, groups["tp"][rank // 2])
            fully_shard_mlp(model)  # over {0, 2} and {1, 3}: the data-parallel groups of the tensor-parallel model
            self.part = (rank // 2, 2)
        elif name == "tp2":
            if rank < 2:
                tensor_parallel_mlp(model, groups["01"])
                self.part = (0, 1)
            self.group = groups["01"]
        elif name == "fs3":
            fully_shard_mlp(model, [0, 1, 2] if rank < 3 else [])
            self.part = (rank, 3) if rank < 3 else None
        elif name == "ddp4":
            self.part = (rank, 4)
            self.reduce = None
        elif name == "one":
            self.part = (0, 1) if rank == 0 else None
            self.group = groups["0"]
        self.model = model
        self.optim = _optim(model)
        # Whether this rank takes part in the layout's checkpoints (those of its group).
        self.member = {"tp2": rank < 2, "one": rank == 0}.get(name, True)

    def state(self) -> dict[str, Any]:
        return st.get_state_dict(self.model, self.optim)

    def load(self, path: str) -> dict[str, torch.Tensor]:
        state = self.state()
        checkpoint.load(state, path, process_group=self.group)
        st.set_state_dict(self.model, self.optim, state)
        return whole_state(self.state())

    def train(self, steps: range) -> list[float]:
        losses = []
        if self.part is None:
            return losses
        index, count = self.part
        per = BATCH // count
        for step in steps:
            x, y = _batch(step)
            self.optim.zero_grad()
            loss = F.mse_loss(self.model(x[index * per:(index + 1) * per]), y[index * per:(index + 1) * per])
            loss.backward()
            if self.reduce is not False:
                st.all_reduce_grads(self.model, self.reduce)
            self.optim.step()
            losses.append(loss.item())
        return losses


def _chain(rank: int, world: int, root: str) -> list[dict[str, object]]:
    import torch.distributed as dist

    groups = {"tp": [dist.new_group([0, 1]), dist.new_group([2, 3])], "01": dist.new_group([0, 1]),
              "0": dist.new_group([0])}
    out: list[dict[str, object]] = []
    step = 0
    for i, name in enumerate(CHAIN):
        layout = _Layout(name, rank, groups)
        entry: dict[str, object] = {"name": name, "part": layout.part}
        if i > 0 and layout.member:
            entry["loaded"] = layout.load(f"{root}/{i - 1}")
        entry["losses"] = layout.train(range(step, step + STEPS))
        step += STEPS
        if layout.member:
            checkpoint.save(layout.state(), f"{root}/{i}", process_group=layout.group)
            entry["saved"] = whole_state(layout.state())
        out.append(entry)
        dist.barrier()
    # A dtype mismatch between the checkpoint and the model raises (nothing is cast silently).
    bf16 = _Layout("fs4", rank, groups, torch.bfloat16)
    try:
        checkpoint.load({"model": bf16.model.state_dict()}, f"{root}/{len(CHAIN) - 1}", strict=False)
        out.append({"mismatch": "no error"})
    except checkpoint.CheckpointError as exc:
        out.append({"mismatch": str(exc)})
    return out


def test_elastic_chain_resumes_bit_for_bit(tmp_path: Path) -> None:
    model = uneven_mlp()
    optim = _optim(model)
    ref_losses = []
    for step in range(len(CHAIN) * STEPS):
        x, y = _batch(step)
        optim.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        ref_losses.append(loss.item())
    ref_final = {f"model.{k}": v for k, v in model.state_dict().items()}

    results = run_distributed(_chain, 4, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        mismatch = res[-1]["mismatch"]
        assert "has dtype torch.float32, but the state_dict's has torch.bfloat16" in mismatch, (rank, mismatch)
    loads = 0
    for i, name in enumerate(CHAIN):
        saved_before = results[0][i - 1]["saved"] if i > 0 else None
        members = [rank for rank in range(4) if "saved" in results[rank][i]]
        assert members == {"tp2": [0, 1], "one": [0]}.get(name, [0, 1, 2, 3]), (name, members)
        for rank in members:
            entry = results[rank][i]
            if saved_before is not None:
                loaded = entry["loaded"]
                assert sorted(loaded) == sorted(saved_before), (i, name, rank)
                bad = [k for k in loaded if not (loaded[k].dtype == saved_before[k].dtype
                                                 and torch.equal(loaded[k], saved_before[k]))]
                assert not bad, f"step {i} ({name}) rank {rank}: not bit for bit after the load: {bad}"
                loads += 1
        # The whole batch's loss: the mean over the distinct parts of the batch.
        parts = {results[r][i]["part"]: results[r][i]["losses"] for r in range(4) if results[r][i]["part"]}
        count = next(iter(parts))[1]  # type: ignore[index]
        assert len(parts) == count, (name, parts)
        for s in range(STEPS):
            mean = sum(losses[s] for losses in parts.values()) / count  # type: ignore[index]
            want = ref_losses[i * STEPS + s]
            assert abs(mean - want) / want <= 1e-6, (i, name, s, mean, want)
    assert loads == 33  # 10 transitions, each checked on every rank that loads
    final = results[0][len(CHAIN) - 1]["saved"]
    for key, value in ref_final.items():
        rel = float((final[key].double() - value.double()).norm() / value.double().norm())
        assert rel <= 1e-6, (key, rel)
