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

Last, sum first: in a checked call each pending sum made (a row-parallel layer's output, or a new
pending result of an op on pending sums) is numbered, and a replay sums those whose first use was
their sum right where it makes them, handing out the plain sum. Zone bodies over uneven splits
(residual then norm; two pending sums combined before the norm; a scaled sum; the sum handed out;
a sum fed into another sharded layer; a sum normalized and then added again) each run three times:
every call equals the checked one bit for bit and the unsharded module, on every rank, forward and
backward; the plan holds the expected ``sum_first``; a replay's forward sends the expected ops
through ``_PendingTensor`` and makes as many all-reduces as the checked call. (The all-reduces are
counted per rank by the simulated exchange: ``CommCounter`` is process-wide, and the simulated
collectives do not pass through it.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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


def _step(block: nn.Module, x: torch.Tensor, upstream: torch.Tensor, *,
          after_forward: Callable[[], None] | None = None, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The output, the loss and the gradients of the input and of every parameter, for one forward and backward.

    ``after_forward`` (if given) runs between the forward and the backward (to count what the forward did).
    """
    block.zero_grad()
    x = x.clone().requires_grad_()
    out = block(x, **kwargs)
    if after_forward is not None:
        after_forward()
    loss = (out * upstream).sum()
    loss.backward()
    found = {"out": out.detach(), "loss": loss.detach(), "x": x.grad}
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


# -- sum first: a pending sum whose first use was its sum is summed where a replay makes it -------

FFN2 = 10
# Uneven, and unlike each other: each split layer's (start, length) per rank.
CUTS = {"ffn": ((0, 7), (7, 5)), "ffn2": ((0, 4), (4, 6)), "hidden": ((0, 5), (5, 3))}
# The split parameters: name -> (dimension, ``CUTS`` key). The biases of the layers split on their
# inputs stay whole: each is added once to its layer's pending sum.
SUM_SPLITS = {"up.weight": (0, "ffn"), "up.bias": (0, "ffn"), "down.weight": (1, "ffn"), "down2.weight": (1, "ffn"),
              "mid.weight": (1, "hidden"), "up2.weight": (0, "ffn2"), "up2.bias": (0, "ffn2"),
              "down3.weight": (1, "ffn2")}


class _SumFirst(nn.Module):
    """A zone body per case, around ``h = silu(up(norm(x)))``: ``up`` split on its outputs, every ``down`` on its
    inputs (``mid`` on the hidden size it reads), so each ``down`` hands out a pending sum."""

    def __init__(self, case: str, ffn: int, ffn2: int, hidden_in: int) -> None:
        super().__init__()
        self.case = case
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, ffn)
        self.down = nn.Linear(ffn, HIDDEN)
        if case == "two-sums":
            self.down2 = nn.Linear(ffn, HIDDEN)
        if case == "into-row-parallel":
            self.mid = nn.Linear(hidden_in, HIDDEN)
        if case == "into-column-parallel":
            self.up2 = nn.Linear(HIDDEN, ffn2)
            self.down3 = nn.Linear(ffn2, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.up(self.norm(x)))
        case = self.case
        if case == "residual-norm":
            return self.norm(x + self.down(h))
        if case == "two-sums":
            return self.norm(x + self.down(h) + self.down2(h))
        if case == "scaled":
            return self.norm(0.5 * self.down(h))
        if case == "returned":
            return x + self.down(h)
        if case == "into-row-parallel":
            return self.norm(x + self.mid(self.down(h)))
        if case == "into-column-parallel":
            return self.norm(x + self.down3(F.silu(self.up2(self.down(h)))))
        if case == "scaled-in-place":
            p = self.down(h)
            p.mul_(3.0)
            return self.norm(p)
        assert case == "used-twice", case
        y = x + self.down(h)
        n = self.norm(y)
        return n + y


def _sum_first_reference(case: str) -> _SumFirst:
    torch.manual_seed(0)
    block = _SumFirst(case, FFN, FFN2, HIDDEN).double()
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.norm.bias.uniform_(-0.5, 0.5)
    return block


def _sum_first_local(rank: int, name: str, value: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s part of the unsharded parameter (or gradient) ``name``."""
    split = SUM_SPLITS.get(name)
    if split is None:
        return value
    dim, cut = split
    start, length = CUTS[cut][rank]
    return value.narrow(dim, start, length)


def _sum_first_sharded(rank: int, whole: _SumFirst) -> _SumFirst:
    """Rank ``rank``'s zone cut from ``whole``: its slices of the split layers, their plans installed."""
    block = _SumFirst(whole.case, CUTS["ffn"][rank][1], CUTS["ffn2"][rank][1], CUTS["hidden"][rank][1]).double()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(_sum_first_local(rank, name, whole.get_parameter(name)))
    linear = _parallel.ShardedLinear()
    for name, module in block.named_children():
        if isinstance(module, nn.Linear):
            dim, cut = SUM_SPLITS[f"{name}.weight"]
            mode: Literal["out", "in"] = "out" if dim == 0 else "in"
            _parallel.install(module, _parallel.Plan(linear, _parallel.LinearPlan(
                mode, CUTS[cut], "local" if mode == "out" else "replicated", None, dim)))
    block.__dict__["forward"] = _zones.ZoneForward(type(block).forward.__get__(block))  # as shard_model does
    return block


# Per case: the pending sums the checked call makes, numbered in order, and which are summed first (their first
# use was their sum); the ops a replay's forward sends through the engine (``_PendingTensor``: each op on a pending
# sum that is not summed first, and the read of its shape when a sharded layer takes it); the all-reduces of a
# forward (checked or replayed alike: sum first moves the all-reduce, it adds none).
SUM_FIRST_CASES: dict[str, tuple[frozenset[int], list[str], int]] = {
    # 0 down(h), added to x; 1 x + 0, summed by the norm.
    "residual-norm": (frozenset({1}), ["TensorBase.add"], 1),
    # 0 down(h); 1 x + 0; 2 down2(h); 3 1 + 2 (both still pending: one all-reduce), summed by the norm.
    "two-sums": (frozenset({3}), ["TensorBase.add", "TensorBase.add"], 1),
    # 0 down(h), scaled; 1 0.5 * 0, summed by the norm.
    "scaled": (frozenset({1}), ["TensorBase.mul"], 1),
    # 0 down(h); 1 x + 0, handed out of the zone (summed by its exit): nothing summed first.
    "returned": (frozenset(), ["TensorBase.add"], 1),
    # 0 down(h), given to mid (which sums it, then takes its slice; the replay's layer check reads its shape);
    # 1 mid(0); 2 x + 1, summed by the norm.
    "into-row-parallel": (frozenset({2}), ["getset_descriptor.__get__", "TensorBase.add"], 2),
    # 0 down(h), given to up2 (which sums it; the replay's layer check reads its shape); 1 down3(...); 2 x + 1,
    # summed by the norm.
    "into-column-parallel": (frozenset({2}), ["getset_descriptor.__get__", "TensorBase.add"], 2),
    # 0 down(h); 1 y = x + 0, summed by the norm, then added to its output: the add reads the sum.
    "used-twice": (frozenset({1}), ["TensorBase.add"], 1),
    # 0 down(h), scaled in place (its addends changed: a use), then summed by the norm: nothing summed first.
    "scaled-in-place": (frozenset(), ["TensorBase.mul_", "layer_norm"], 1),
}


@pytest.fixture
def engine_ops(monkeypatch: pytest.MonkeyPatch) -> threading.local:
    """Each thread's list (``.ops``, when it sets one) of the ops that reach ``_PendingTensor.__torch_function__``."""
    seen = threading.local()
    original = _zones._PendingTensor.__dict__["__torch_function__"]

    def counting(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        ops = getattr(seen, "ops", None)
        if ops is not None:
            ops.append(getattr(func, "__qualname__", None) or repr(func))
        return original.__func__(cls, func, types, args, kwargs)

    monkeypatch.setattr(_zones._PendingTensor, "__torch_function__", classmethod(counting))  # restored after
    return seen


@pytest.mark.parametrize("case", list(SUM_FIRST_CASES))
def test_a_pending_sum_first_summed_is_summed_where_a_replay_makes_it(case: str, engine_ops: threading.local) -> None:
    sum_first, replay_ops, forward_all_reduces = SUM_FIRST_CASES[case]
    x, upstream = _inputs(5)
    whole = _sum_first_reference(case)
    want = _step(whole, x, upstream)
    blocks = [_sum_first_sharded(rank, whole) for rank in range(WORLD)]

    def counted_step(block: _SumFirst) -> dict[str, Any]:
        """``_step``'s values, this rank's all-reduces (in the forward, in all) and its forward's engine ops."""
        engine_ops.ops = []
        start = getattr(ranks.local, "all_reduces", 0)
        counts: dict[str, Any] = {}

        def forward_done() -> None:
            counts["forward_all_reduces"] = getattr(ranks.local, "all_reduces", 0) - start
            counts["engine_ops"] = list(engine_ops.ops)

        values = _step(block, x, upstream, after_forward=forward_done)
        counts["all_reduces"] = getattr(ranks.local, "all_reduces", 0) - start
        engine_ops.ops = None
        return {**values, **counts}

    def rank_fn(rank: int) -> list[dict[str, Any]]:
        block = blocks[rank]
        calls = [counted_step(block) for _ in range(CALLS)]
        plans = list(block.__dict__["forward"]._plans.values())
        assert len(plans) == 1 and isinstance(plans[0], _replay.Plan), f"rank {rank}: {plans}"
        assert plans[0].sum_first == sum_first, f"rank {rank}: sum_first {set(plans[0].sum_first)}"
        assert _calls(block) == (1, CALLS - 1), f"rank {rank}: {_calls(block)}"
        for call, values in enumerate(calls):
            where = f"rank {rank}, call {call + 1} of {CALLS} ({'checked' if call == 0 else 'replayed'})"
            for name, value in values.items():
                if not isinstance(value, torch.Tensor):
                    continue
                assert torch.equal(value, calls[0][name]), (
                    f"{where}: {name} differs from the checked call's by "
                    f"{(value - calls[0][name]).abs().max().item():.3g}")
                diff = (value - _sum_first_local(rank, name, want[name])).abs().max().item()
                assert diff <= TOL, f"{where}: {name} differs from the unsharded module's by {diff:.3g}"
            assert values["engine_ops"] == ([] if call == 0 else replay_ops), f"{where}: {values['engine_ops']}"
            assert values["forward_all_reduces"] == forward_all_reduces, f"{where}: {values['forward_all_reduces']}"
            assert values["all_reduces"] == calls[0]["all_reduces"], f"{where}: {values['all_reduces']}"
        return calls

    with _simulated(WORLD) as ranks:
        results = ranks.run(rank_fn)
    whole_on_every_rank = [name for name in want if name not in SUM_SPLITS]  # output, loss, input, whole parameters
    for rank, calls in enumerate(results):
        for call, values in enumerate(calls):
            for name in whole_on_every_rank:
                assert torch.equal(values[name], results[0][0][name]), \
                    f"{name}: rank {rank}'s call {call + 1} differs from rank 0's first call"
