"""A zone's verified replay, on 2 ranks simulated as threads of one process (see ``test_split_rules``).

Each rank builds a small model whose MLP is split as tensor parallelism splits it (``up`` on
its output features, ``down`` on its input features), around code that adds the MLP's pending
sum to the residual and normalizes it. Its first call of an input signature runs under the
engine; the next calls of the signature replay it plainly. Checked here: a replay gives the
checked call's values, forward and backward, bit for bit (and both equal the unsharded model);
a new sequence length, grad mode or keyword re-checks; a zone the engine intervened in (a view
to a fixed size) stays checked; a replay that takes another path raises.

Then zones nested in a zone that stays checked: the demo's TinyLM, whose first layer leaves its
output split on the hidden size (the model's zone intervenes), around residual blocks that are
zones of their own. Such a block runs under the enclosing engine, which adds the residual to the
pending sum of its row-parallel ``down`` on one rank only; a plain replay of the block's code would
add it on every rank. So every call of every zone is checked, and every call equals the first and
the unsharded model, on every rank, forward and backward.
"""

from __future__ import annotations

from typing import Any, Literal

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


# -- blocks nested in a model whose own zone stays checked -----------------------------------------

VOCAB, INPUTS, LAYERS, CALLS = 16, 6, 3, 3
# Uneven, and unlike each other, so that only a block's up and down match (the zones are the blocks,
# "blocks" and the whole model, as ``optimize`` finds them).
WIDTHS = {"hidden": ((0, 3), (3, 5)), "ffn": ((0, 5), (5, 7)), "vocab": ((0, 9), (9, 7))}
NESTED = "a zone nested in a checked one runs under that zone's engine"
GATHERED = "layer_norm() ran on gathered inputs"


class _MLPBlock(nn.Module):
    """The demo's pre-norm residual block: the row-parallel ``down``'s pending sum meets the residual."""

    def __init__(self, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, ffn)
        self.down = nn.Linear(ffn, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _TinyLM(nn.Module):
    """The demo's TinyLM: a first layer (an embedding, or a Linear so the input has a gradient), blocks, norm, head."""

    def __init__(self, first: str, hidden: int, ffn: int, vocab: int) -> None:
        super().__init__()
        self.first = nn.Embedding(VOCAB, hidden) if first == "embedding" else nn.Linear(INPUTS, hidden)
        self.blocks = nn.ModuleList(_MLPBlock(ffn) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _splits(first: str) -> dict[str, tuple[int, str]]:
    """The split parameters: name -> (dimension, ``WIDTHS`` key), as the demo's first spec splits them."""
    found = {"first.weight": (1, "hidden")} if first == "embedding" else {
        "first.weight": (0, "hidden"), "first.bias": (0, "hidden")}
    for i in range(LAYERS):
        found.update({f"blocks.{i}.up.weight": (0, "ffn"), f"blocks.{i}.up.bias": (0, "ffn"),
                      f"blocks.{i}.down.weight": (1, "ffn")})  # down's bias whole: added once to the sum
    found.update({"head.weight": (0, "vocab"), "head.bias": (0, "vocab")})
    return found


def _local(rank: int, first: str, name: str, value: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s part of the unsharded parameter (or gradient) ``name``."""
    split = _splits(first).get(name)
    if split is None:
        return value
    dim, width = split
    start, length = WIDTHS[width][rank]
    return value.narrow(dim, start, length)


def _reference_lm(first: str) -> _TinyLM:
    torch.manual_seed(0)
    model = _TinyLM(first, HIDDEN, FFN, VOCAB).double()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model


def _sharded_lm(rank: int, whole: _TinyLM, first: str) -> _TinyLM:
    """Rank ``rank``'s model cut from ``whole``, its layers' plans installed and its zones found by ``optimize``.

    Built before the ranks start: ``optimize`` traces the modules with ``torch.fx``, which patches
    ``nn.Module.__call__`` process-wide while it traces.
    """
    model = _TinyLM(first, WIDTHS["hidden"][rank][1], WIDTHS["ffn"][rank][1], WIDTHS["vocab"][rank][1]).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_local(rank, first, name, whole.get_parameter(name)))
    linear = _parallel.ShardedLinear()

    def plan(mode: Literal["out", "in"], width: str, bias: Literal["local", "replicated"]) -> _parallel.Plan:
        return _parallel.Plan(linear, _parallel.LinearPlan(mode, WIDTHS[width], bias, None, 0 if mode == "out" else 1))

    if first == "embedding":  # split on the embedding dimension: its output leaves split on the hidden size
        _parallel.install(model.first, _parallel.Plan(_parallel.ShardedEmbedding(),
                                                      _parallel.EmbeddingPlan("dim", WIDTHS["hidden"], 1)))
    else:
        _parallel.install(model.first, plan("out", "hidden", "local"))
    for block in model.blocks:
        assert isinstance(block, _MLPBlock)
        _parallel.install(block.up, plan("out", "ffn", "local"))
        _parallel.install(block.down, plan("in", "ffn", "replicated"))
    _parallel.install(model.head, plan("out", "vocab", "local"))
    zones = _parallel.optimize(model, {})()
    assert sorted(zones) == ["", "blocks", *(f"blocks.{i}" for i in range(LAYERS))]
    return model


def _lm_inputs(first: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (2, 5), generator=gen) if first == "embedding" else \
        torch.randn(2, 5, INPUTS, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, VOCAB, (2, 5), generator=gen)


def _lm_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits, loss, and the gradients of every parameter and (when it has one) of the input."""
    model.zero_grad()
    x = x.clone().requires_grad_() if x.is_floating_point() else x
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    loss.backward()
    found = {"logits": logits.detach(), "loss": loss.detach()}
    if x.is_floating_point():
        assert x.grad is not None
        found["input"] = x.grad
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        found[name] = p.grad.clone()
    return found


# The sharded model adds each block's ``down`` over the ranks' features in another order than one
# matmul adds them (and sums a pending residual where the unsharded model adds it in), so its float64
# values differ from the unsharded ones in the last bits (below 1e-15 here). 1e-12 allows for that,
# and is 11 orders of magnitude below what a residual added on every rank costs (0.36 in the logits).
TOL = 1e-12


@pytest.mark.parametrize("first", ["embedding", "linear"])
def test_blocks_nested_in_a_checked_zone_are_checked_on_every_call_and_exact(first: str) -> None:
    x, target = _lm_inputs(first)
    whole = _reference_lm(first)
    want = _lm_step(whole, x, target)
    models = [_sharded_lm(rank, whole, first) for rank in range(WORLD)]

    def rank_fn(rank: int) -> list[dict[str, torch.Tensor]]:
        model = models[rank]
        got = [_lm_step(model, x, target) for _ in range(CALLS)]
        for call, values in enumerate(got):
            assert values.keys() == want.keys()
            for name, value in values.items():
                assert torch.equal(value, got[0][name]), (
                    f"rank {rank}, call {call + 1} of {CALLS}: {name} differs from the first (checked) call's by "
                    f"{(value - got[0][name]).abs().max().item():.3g}")
                diff = (value - _local(rank, first, name, want[name])).abs().max().item()
                assert diff <= TOL, (f"rank {rank}, call {call + 1} of {CALLS}: {name} differs from the unsharded "
                                     f"model's by {diff:.3g}")
        # Every call of every zone is checked, none replayed. The model's own zone intervenes (the
        # first block's norm gathers the activation the first layer leaves split on the hidden size), so
        # does the first block (that norm is its own; its residual, still split, meets the pending sum of
        # ``down`` and both are gathered). The second block gets a whole residual and hands out the
        # pending sum ``residual + down(...)``: the engine intervened only in ops on pending sums, so it
        # stays checked only because it is nested. The third gets that pending sum, which no signature
        # holds: it is never recorded.
        assert _zones.zone_calls(model) == {
            "": {"checked": CALLS, "replayed": 0, "not_replayed_because": [GATHERED]},
            "blocks": {"checked": 0, "replayed": 0, "not_replayed_because": []},  # a ModuleList is not called
            "blocks.0": {"checked": CALLS, "replayed": 0, "not_replayed_because": [GATHERED]},
            "blocks.1": {"checked": CALLS, "replayed": 0, "not_replayed_because": [NESTED]},
            "blocks.2": {"checked": CALLS, "replayed": 0, "not_replayed_because": []},
        }, f"rank {rank}: {_zones.zone_calls(model)}"
        return got

    with _simulated(WORLD) as ranks:
        results = ranks.run(rank_fn)
    whole_on_every_rank = [name for name in want if name not in _splits(first)]  # outputs, loss, whole parameters
    for rank, calls in enumerate(results):
        for call, values in enumerate(calls):
            for name in whole_on_every_rank:
                assert torch.equal(values[name], results[0][0][name]), \
                    f"{name}: rank {rank}'s call {call + 1} differs from rank 0's first call"
