"""Model code whose path changes from call to call, on 2 Gloo ranks: every call exact.

A block ``up`` (Linear 8 -> 16, split on its outputs) -> relu -> ``down`` (split on its inputs)
whose forward takes another path when a module attribute is set (``self.center``), when the
batch's values are large (``x.sum() > 1e6``), in training (dropout with ``p > 0``) and with
gradients on (``torch.is_grad_enabled()``): ordinary model code (a config switch, a
value-dependent branch, ``model.train()``/``model.eval()``, ``torch.no_grad()``). The engine
runs every call's own ops, so each call equals the same call of the unsharded block: its
output, the gradients of every parameter (the whole ``down.bias`` included) and of the
replicated input. Dropout draws the same mask as the unsharded block (the same seed before
each call), whose values the sharded one equals.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sharded_tensor as st
from sharding import composite, single_split
from tests.distributed._grads import local_grad_mismatches
from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.25)
        self.center = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.center or x.sum() > 1e6:
            h = h - h.mean(-1, keepdim=True)
        if torch.is_grad_enabled():
            h = h * 1.5
        return self.down(self.drop(h))


# (center, scale of the input, training, gradients): each call changes something the path depends on.
CALLS = [
    (False, 1.0, False, True),
    (True, 1.0, False, True),   # a module attribute
    (False, 1e7, False, True),  # a value
    (False, 1.0, True, True),   # dropout in training
    (True, 1e7, True, True),
    (False, 1.0, False, False),  # no gradients
    (True, 1.0, True, False),
    (False, 1.0, False, True),  # back to the first
]


def _run(rank: int, world: int) -> list[dict[str, object]]:
    torch.manual_seed(0)
    ref = Branchy().double()
    model = Branchy().double()
    model.load_state_dict(ref.state_dict())
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    st.shard_model(model, composite(**{"up": single_split(0, ranks), "down.weight": single_split(1, ranks)}))
    results = []
    for i, (center, scale, training, grad) in enumerate(CALLS):
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) * scale
        outs, inputs = [], []
        for m in (ref, model):
            m.center = center
            m.train(training)
            m.zero_grad()
            xin = x.clone().requires_grad_(grad)
            torch.manual_seed(100 + i)  # the same dropout mask for both
            with torch.set_grad_enabled(grad):
                out = m(xin)
                if grad:
                    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
            outs.append(out.detach())
            inputs.append(xin.grad)
        want, got = outs
        tol = 1e-9 * (1 + float(want.abs().max()))
        results.append({
            "out": float((got - want).abs().max()) <= tol,
            "input_grad": (not grad) or torch.allclose(inputs[1], inputs[0], rtol=1e-9, atol=tol),
            "grads": local_grad_mismatches(model, ref, rank) if grad else [],
        })
    return results


def test_every_call_follows_its_own_path_exactly():
    for rank, results in enumerate(run_distributed(_run, 2)):
        for call, got in zip(CALLS, results):
            assert got == {"out": True, "input_grad": True, "grads": []}, f"rank {rank}, call {call}: {got}"
