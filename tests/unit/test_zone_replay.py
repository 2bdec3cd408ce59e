"""A zone's verified replay, on 2 ranks simulated as threads of one process (see ``test_split_rules``).

Each rank builds a small model whose MLP is split as tensor parallelism splits it (``up`` on
its output features, ``down`` on its input features), around code that adds the MLP's pending
sum to the residual and normalizes it. Its first call of an input signature runs under the
engine; the next calls of the signature replay it plainly. Checked here: a replay gives the
checked call's values, forward and backward, bit for bit (and both equal the unsharded model);
a new sequence length, grad mode or keyword re-checks; a zone the engine intervened in (a view
to a fixed size) stays checked; a replay that takes another path raises.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharded_tensor._model import parallel as _parallel
from sharded_tensor._model import replay as _replay
from sharded_tensor._model import zones as _zones
from tests.unit.test_split_rules import _simulated

HIDDEN, FFN, WORLD = 8, 12, 2
SLICES = ((0, 6), (6, 6))  # each rank's (start, length) of the MLP's features


class _Block(nn.Module):
    """A residual MLP with a norm: up (split outputs), SiLU, down (split inputs), residual, norm."""

    def __init__(self, ffn: int, fixed_view: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, ffn)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)
        self.fixed_view = fixed_view  # view to the whole FFN size, as BLOOM's fixed num_heads: rewritten
        self.twice = False  # a path the input signature does not show

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = F.silu(self.up(self.norm(x))) * scale
        if self.fixed_view:
            h = h.view(*x.shape[:-1], FFN)
        y = x + self.down(h)
        if self.twice:
            y = y + self.down(h)
        return self.norm(y)


def _reference(fixed_view: bool = False) -> _Block:
    torch.manual_seed(0)
    block = _Block(FFN, fixed_view).double()
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.norm.bias.uniform_(-0.5, 0.5)
    return block


def _sharded(rank: int, whole: _Block) -> _Block:
    """This rank's block cut from ``whole``: its slices of ``up`` and ``down``, their plans installed, the root a zone.

    (The ranks are threads sharing torch's random generator: ``whole`` is built before they start.)
    """
    start, length = SLICES[rank]
    block = _Block(length, whole.fixed_view).double()
    with torch.no_grad():
        block.norm.load_state_dict(whole.norm.state_dict())
        block.up.weight.copy_(whole.up.weight[start:start + length])
        block.up.bias.copy_(whole.up.bias[start:start + length])
        block.down.weight.copy_(whole.down.weight[:, start:start + length])
    linear = _parallel.ShardedLinear()
    _parallel.install(block.up, _parallel.Plan(linear, _parallel.LinearPlan("out", SLICES, "local", None, 0)))
    _parallel.install(block.down, _parallel.Plan(linear, _parallel.LinearPlan("in", SLICES, "none", None, 1)))
    block.__dict__["forward"] = _zones.ZoneForward(type(block).forward.__get__(block))  # as shard_model does
    return block


def _inputs(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seq)
    return (torch.randn(2, seq, HIDDEN, generator=gen, dtype=torch.float64),
            torch.randn(2, seq, HIDDEN, generator=gen, dtype=torch.float64))


def _step(block: nn.Module, x: torch.Tensor, upstream: torch.Tensor, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The output and the gradients of the input and of every parameter, for one forward and backward."""
    block.zero_grad()
    x = x.clone().requires_grad_()
    out = block(x, **kwargs)
    (out * upstream).sum().backward()
    found = {"out": out.detach(), "x": x.grad}
    found.update({name: p.grad.clone() for name, p in block.named_parameters()})
    return found


def _calls(block: nn.Module) -> tuple[int, int]:
    forward = block.__dict__["forward"]
    assert isinstance(forward, _zones.ZoneForward)
    return forward.checked, forward.replayed


def _unsharded(rank: int, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s view of the unsharded gradients: its slices of the split parameters'."""
    start, length = SLICES[rank]
    found = dict(grads)
    found["up.weight"] = grads["up.weight"][start:start + length]
    found["up.bias"] = grads["up.bias"][start:start + length]
    found["down.weight"] = grads["down.weight"][:, start:start + length]
    return found


def test_a_replay_equals_the_checked_call_bit_for_bit_and_a_new_signature_is_checked() -> None:
    x, upstream = _inputs(5)
    whole = _reference()
    grads = _step(whole, x, upstream)
    want = _unsharded(0, grads), _unsharded(1, grads)

    def rank_fn(rank: int) -> None:
        block = _sharded(rank, whole)
        checked = _step(block, x, upstream)
        assert _calls(block) == (1, 0)
        for _ in range(2):
            replayed = _step(block, x, upstream)
            for name, value in checked.items():
                assert torch.equal(replayed[name], value), f"rank {rank}: {name} differs between replay and check"
        assert _calls(block) == (1, 2)
        for name, value in checked.items():  # and both are the unsharded model's
            torch.testing.assert_close(value, want[rank][name], rtol=1e-12, atol=1e-12, msg=name)

        x7, up7 = _inputs(7)  # a new sequence length: checked, then replayed
        first, again = _step(block, x7, up7), _step(block, x7, up7)
        assert _calls(block) == (2, 3)
        assert all(torch.equal(first[n], again[n]) for n in first)
        with torch.no_grad():  # grad mode is part of the signature
            out = block(x)
            assert _calls(block) == (3, 3)
            assert torch.equal(block(x), out)
            assert _calls(block) == (3, 4)
        assert torch.equal(out, checked["out"])
        _step(block, x, upstream, scale=1.0)  # a keyword the earlier calls did not pass
        assert _calls(block) == (4, 4)
        _step(block, x, upstream, scale=2.0)  # another value of it
        assert _calls(block) == (5, 4)
        assert block.__dict__["forward"].calls()["not_replayed_because"] == []

    with _simulated(WORLD) as ranks:
        ranks.run(rank_fn)


def test_a_zone_the_engine_intervened_in_stays_checked() -> None:
    x, upstream = _inputs(5)
    whole = _reference(fixed_view=True)
    grads = _step(whole, x, upstream)
    want = _unsharded(0, grads), _unsharded(1, grads)

    def rank_fn(rank: int) -> None:
        block = _sharded(rank, whole)
        for _ in range(3):
            got = _step(block, x, upstream)
            for name, value in got.items():
                torch.testing.assert_close(value, want[rank][name], rtol=1e-12, atol=1e-12, msg=name)
        assert _calls(block) == (3, 0)
        reasons = block.__dict__["forward"].calls()["not_replayed_because"]
        assert reasons == ["TensorBase.view() was given this rank's sizes [2, 5, 6] instead of the model's"]

    with _simulated(WORLD) as ranks:
        ranks.run(rank_fn)


def test_a_replay_that_takes_another_path_raises() -> None:
    x, upstream = _inputs(5)
    whole = _reference()

    def rank_fn(rank: int) -> None:
        block = _sharded(rank, whole)
        _step(block, x, upstream)
        block.twice = True  # the code now calls ``down`` twice for the same input signature
        with pytest.raises(_replay.ReplayMismatch, match=r"called sharded layer Linear after the 2 the checked"):
            _step(block, x, upstream)

    with _simulated(WORLD) as ranks:
        ranks.run(rank_fn)


def test_replay_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    x, upstream = _inputs(5)
    whole = _reference()
    monkeypatch.setenv(_replay.ENV, "0")

    def rank_fn(rank: int) -> None:
        block = _sharded(rank, whole)
        for _ in range(3):
            _step(block, x, upstream)
        assert _calls(block) == (3, 0)

    with _simulated(WORLD) as ranks:
        ranks.run(rank_fn)
    monkeypatch.setenv(_replay.ENV, "yes")
    with pytest.raises(ValueError, match=r"SHARDKIT_ENGINE_REPLAY='yes' is neither 1 nor 0"):
        _replay.enabled()
