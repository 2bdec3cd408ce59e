"""Random zone bodies replayed on 2 simulated ranks: every call equals the checked one bit for bit.

Hypothesis draws a small zone body: 2 to 6 steps over a residual stream ``x`` (float64, hidden
size 5 or 6) around an MLP split as tensor parallelism splits it (``up`` on its output features,
``down1`` and ``down2`` on their input features, over uneven slices), so each ``down`` hands out
a pending sum that the next steps add to the stream (also in place), subtract, scale, combine,
multiply, normalize (LayerNorm, an RMSNorm as transformers writes it), center, gate, view, reshape,
flatten, transpose, permute and unsqueeze (and back), cut and concatenate, drop out with ``p=0``,
keep and add again later; one step reduces over the split features, so that the engine intervenes
and the zone stays checked. The body returns ``x``, ``(x, norm(x))`` or a dict (with plain values).
Each body runs unsharded, and as a zone on each of 2 ranks (threads of one process,
``test_split_rules._simulated``) three times: the first call of the signature is checked, the next
ones replay it when the engine allows. On every rank and call, the outputs (every leaf), a scalar
loss made from them and the gradients of the input and of every parameter equal the checked call's
bit for bit and the unsharded module's (this rank's slice of it) within ``TOL``; whole values are
equal on both ranks; and the zone either replayed every call after the first or says why not
(``zones.zone_calls``). One more call on other values, and calls with no gradients (another
signature), are checked against the unsharded module too.

Last, the smallest bodies the generator found that the engine got wrong, each a plain test: a pending
sum written to in place after its sum was taken (the checked call raised an AttributeError; the engine
now refuses it with a clear error, and the property rejects such bodies), and a pending sum summed
first and then fed to a sharded layer (a replay fed the layer twice the sum).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402

from sharded_tensor._model import parallel as _parallel  # noqa: E402
from sharded_tensor._model import replay as _replay  # noqa: E402
from sharded_tensor._model import zones as _zones  # noqa: E402
from tests._examples import examples  # noqa: E402
from tests.unit.test_split_rules import _simulated  # noqa: E402

WORLD, CALLS, BATCH, EPS = 2, 3, 2, 1e-6
# The split parameters: name -> dimension (each split over the FFN's slices). The downs' biases stay
# whole: each is added once to its layer's pending sum.
SPLITS = {"up.weight": 0, "up.bias": 0, "down1.weight": 1, "down2.weight": 1}
# The sharded module adds each ``down``'s products over the ranks' features in another order than one
# matmul adds them, and adds a whole tensor to a pending sum's addend on one rank where the unsharded
# module adds it to the whole sum, so its float64 values differ from the unsharded ones in the last
# bits: at most 1.3e-14 times (1 + the value's size), in 2000 bodies of up to 10 steps. TOL times that
# allows for it, and is 11 orders of magnitude below what a whole tensor added on every rank costs.
TOL = 1e-12

Step = tuple[Any, ...]
# What the engine says of an in-place op on a pending sum that no rule keeps pending (after its sum was taken).
REFUSED = r"in-place op '(add|sub)_' on a pending sum .* make the op out-of-place"


class _Body(nn.Module):
    """A zone body: ``steps`` over the residual stream ``x``, then ``x`` returned as ``returns`` says.

    State: ``x``; ``h``, the MLP's hidden activation (made from ``x`` when a step needs it and none
    is made yet); ``ps``, the pending sums made so far (a step made of ``down`` uses the latest,
    or makes one); ``y``, a kept stream (the input until a ``keep``).
    """

    gate: torch.Tensor

    def __init__(self, steps: tuple[Step, ...], returns: str, hidden: int, ffn: int) -> None:
        super().__init__()
        self.steps, self.returns = steps, returns
        self.norm = nn.LayerNorm(hidden)
        self.rms_weight = nn.Parameter(torch.ones(hidden))
        self.up = nn.Linear(hidden, ffn)
        self.down1 = nn.Linear(ffn, hidden)
        self.down2 = nn.Linear(ffn, hidden)
        self.register_buffer("gate", torch.ones(hidden))  # a whole tensor that needs no gradient

    def rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Llama's RMSNorm, as transformers writes it."""
        dtype = x.dtype
        x = x.to(torch.float64)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + EPS)
        return self.rms_weight * x.to(dtype)

    def forward(self, x: torch.Tensor) -> Any:
        y = stream = x
        h: torch.Tensor | None = None
        ps: list[torch.Tensor] = []

        def hidden() -> torch.Tensor:
            nonlocal h
            if h is None:
                h = F.silu(self.up(self.norm(x)))
            return h

        def made(k: int) -> torch.Tensor:
            ps.append((self.down1 if k == 1 else self.down2)(hidden()))
            return ps[-1]

        def latest(k: int) -> torch.Tensor:
            return made(k) if k or not ps else ps[-1]

        for step in self.steps:
            kind = step[0]
            if kind == "up":
                h = F.silu(self.up(self.norm(x)))
            elif kind == "down":
                made(step[1])
            elif kind == "add":
                x = x + latest(step[1])
            elif kind == "radd":
                x = latest(step[1]) + x
            elif kind == "sub":
                x = x - latest(step[1])
            elif kind == "iadd-alias":  # in place on the stream itself (a copy if it is the input: a leaf)
                p = latest(step[1])
                x = x * 1.0 if x is stream else x
                x += p
            elif kind == "imul":
                x = x * 1.0 if x is stream else x
                x *= step[1]
            elif kind == "mul-p":  # a product with a pending sum: not linear in it
                x = x * latest(step[1])
            elif kind == "add-alpha":
                x = torch.add(x, latest(step[1]), alpha=-0.5)
            elif kind == "rsub":
                x = latest(step[1]) - x
            elif kind == "iadd":  # in place, on a copy (the stream may be the input, a leaf)
                p = latest(step[1])
                x = x * 1.0
                x += p
            elif kind == "scale":
                x = latest(0) * step[1]
            elif kind == "div":
                x = -latest(0) / step[1]
            elif kind == "add-number":
                x = 1.0 - (x + 2)
            elif kind == "h-mean":  # a reduction over the split features: the engine all-reduces (no replay)
                x = x + hidden().mean(-1, keepdim=True)
            elif kind == "mean-iadd":  # a stream summed (by a mean), then written to in place
                p = latest(step[1])
                x = x * 1.0
                m = x.mean(-1, keepdim=True)
                x += p
                x = x - m
            elif kind == "split-cat":  # cut on the sequence and put back together
                x = torch.cat([x[:, :1], x[:, 1:]], dim=1)
            elif kind == "up-raw":  # the column-parallel layer fed the stream as it is (a pending sum, or not)
                h = F.silu(self.up(x))
            elif kind == "sum2":
                while len(ps) < 2:
                    made(len(ps) + 1)
                x = ps[-2] + ps[-1]
            elif kind == "center":
                x = x - x.mean(-1, keepdim=True)
            elif kind == "gate":
                x = x * self.gate
            elif kind == "gate-param":  # a scale that needs a gradient
                x = self.rms_weight * x
            elif kind == "layer-norm":
                x = self.norm(x)
            elif kind == "rms-norm":
                x = self.rms_norm(x)
            elif kind == "dropout":
                x = F.dropout(x, 0.0)
            elif kind == "keep":
                y = x
            elif kind == "residual":
                x = x + y
            else:
                assert kind == "round-trip", kind
                x = self.round_trip(x, step[1], step[2])
        if self.returns == "x":
            return x
        if self.returns == "tuple":
            return x, self.norm(x)
        assert self.returns == "dict", self.returns
        return {"x": x, "kept": y, "eps": EPS, "none": None}

    def round_trip(self, x: torch.Tensor, how: str, between: str) -> torch.Tensor:
        """``x`` viewed, reshaped, flattened, transposed, permuted or unsqueezed, ``between`` applied, and brought
        back to its shape."""
        b, s, d = x.shape
        there: dict[str, Any] = {
            "view": lambda t: t.view(b * s, d), "reshape": lambda t: t.reshape(-1, d),
            "flatten": lambda t: t.flatten(0, 1), "transpose": lambda t: t.transpose(0, 1),
            "permute": lambda t: t.permute(2, 0, 1), "unsqueeze": lambda t: t.unsqueeze(0)}
        back: dict[str, Any] = {
            "view": lambda t: t.view(b, s, d), "reshape": lambda t: t.reshape(b, s, d),
            "flatten": lambda t: t.unflatten(0, (b, s)), "transpose": lambda t: t.transpose(0, 1),
            "permute": lambda t: t.permute(1, 2, 0), "unsqueeze": lambda t: t.squeeze(0)}
        t = there[how](x)
        if between == "scale":
            t = t * 0.5
        elif between == "dropout":
            t = F.dropout(t, 0.0)
        elif between == "index":
            t = t[..., :]
        elif between == "clone":
            t = t.clone()
        return back[how](t)  # type: ignore[no-any-return]


_DOWN = hs.sampled_from([0, 1, 2])  # 0: the latest pending sum (a new one from down1 if none); 1, 2: a new one
_STEPS = hs.one_of(
    hs.just(("up",)),
    hs.tuples(hs.just("down"), hs.sampled_from([1, 2])),
    hs.tuples(hs.sampled_from(["add", "radd", "sub", "rsub", "iadd", "iadd-alias", "mean-iadd", "add-alpha",
                               "mul-p"]), _DOWN),
    hs.tuples(hs.sampled_from(["scale", "div", "imul"]), hs.sampled_from([0.5, -2.0, 3])),
    hs.tuples(hs.sampled_from(["up-raw", "h-mean", "split-cat", "center", "sum2", "gate", "gate-param", "add-number",
                               "layer-norm", "rms-norm", "dropout", "keep", "residual"])),
    hs.tuples(hs.just("round-trip"),
              hs.sampled_from(["view", "reshape", "flatten", "transpose", "permute", "unsqueeze"]),
              hs.sampled_from(["none", "scale", "dropout", "index", "clone"])),
)


@hs.composite
def _bodies(draw: Any) -> dict[str, Any]:
    lengths = draw(hs.lists(hs.integers(1, 5), min_size=WORLD, max_size=WORLD, unique=True))  # uneven
    return {"steps": tuple(draw(hs.lists(_STEPS, min_size=2, max_size=6))),
            "returns": draw(hs.sampled_from(["x", "tuple", "dict"])),
            "hidden": draw(hs.sampled_from([5, 6])), "seq": draw(hs.integers(1, 4)),
            "input_grad": draw(hs.booleans()),
            "slices": ((0, lengths[0]), (lengths[0], lengths[1])), "seed": draw(hs.integers(0, 2**16))}


def _reference(body: dict[str, Any], kind: type[_Body]) -> _Body:
    ffn = sum(length for _, length in body["slices"])
    gen = torch.Generator().manual_seed(body["seed"])
    whole = kind(body["steps"], body["returns"], body["hidden"], ffn).double()
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        whole.norm.weight.add_(1.0)
        whole.rms_weight.add_(1.0)
        whole.gate.copy_(torch.rand(whole.gate.shape, generator=gen, dtype=torch.float64) + 0.5)
    return whole


def _local(rank: int, slices: tuple[tuple[int, int], ...], name: str, value: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s part of the unsharded parameter (or gradient) ``name``."""
    dim = SPLITS.get(name)
    if dim is None:
        return value
    start, length = slices[rank]
    return value.narrow(dim, start, length)


def _sharded(rank: int, whole: _Body, slices: tuple[tuple[int, int], ...]) -> _Body:
    """Rank ``rank``'s zone cut from ``whole``: its slices of the split layers, their plans installed."""
    block = type(whole)(whole.steps, whole.returns, whole.norm.normalized_shape[0], slices[rank][1]).double()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(_local(rank, slices, name, whole.get_parameter(name)))
        block.gate.copy_(whole.gate)
    linear = _parallel.ShardedLinear()
    for name in ("up", "down1", "down2"):
        dim = SPLITS[f"{name}.weight"]
        mode: Literal["out", "in"] = "out" if dim == 0 else "in"
        _parallel.install(block.get_submodule(name), _parallel.Plan(linear, _parallel.LinearPlan(
            mode, slices, "local" if mode == "out" else "replicated", None, dim)))
    block.__dict__["forward"] = _zones.ZoneForward(type(block).forward.__get__(block))  # as shard_model does
    return block


def _leaves(out: Any) -> dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {"out": out}
    if isinstance(out, tuple):
        return {f"out[{i}]": v for i, v in enumerate(out)}
    assert out["eps"] == EPS and out["none"] is None, out
    return {f"out[{k!r}]": v for k, v in out.items() if isinstance(v, torch.Tensor)}


def _step(module: nn.Module, x: torch.Tensor, seed: int, input_grad: bool) -> dict[str, torch.Tensor]:
    """Every output leaf, a loss made from them, and the gradients of the input (if ``input_grad``) and of every
    parameter that has one."""
    module.zero_grad()
    x = x.clone().requires_grad_(input_grad)
    leaves = _leaves(module(x))
    gen = torch.Generator().manual_seed(seed)
    loss = sum((v * torch.randn(v.shape, generator=gen, dtype=torch.float64)).sum() for v in leaves.values())
    assert isinstance(loss, torch.Tensor)
    if loss.requires_grad:  # not when the body returns its input untouched, which needs no gradient
        loss.backward()
    found = {name: v.detach().clone() for name, v in leaves.items()}
    found["loss"] = loss.detach()
    if input_grad:
        assert x.grad is not None
        found["input"] = x.grad
    found.update({name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None})
    return found


def _outputs(module: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every output leaf of a call with no gradients."""
    with torch.no_grad():
        return {name: v.clone() for name, v in _leaves(module(x.clone())).items()}


def _check_body(body: dict[str, Any], kind: type[_Body] = _Body) -> None:
    """Run ``body`` unsharded and as a zone on 2 simulated ranks; assert as the module says.

    Per rank: ``CALLS`` calls with gradients on the same input (the first checked); one more on other
    values (a replay must not keep anything of the call it replays but the path); then ``CALLS`` calls
    with no gradients (another signature: checked, then replayed).
    """
    slices, seed, grad = body["slices"], body["seed"], body["input_grad"]
    gen = torch.Generator().manual_seed(seed)
    x, other = (torch.randn(BATCH, body["seq"], body["hidden"], generator=gen, dtype=torch.float64) for _ in range(2))
    whole = _reference(body, kind)
    try:
        want, want_other = _step(whole, x, seed, grad), _step(whole, other, seed, grad)
    except RuntimeError as exc:  # a stream written in place after an op saved it, or a view of the input
        if "inplace operation" not in str(exc) and "in-place operation" not in str(exc):
            raise
        hypothesis.reject()  # not a body torch can run either
    blocks = [_sharded(rank, whole, slices) for rank in range(WORLD)]  # before the ranks start: one generator

    def close(where: str, found: dict[str, torch.Tensor], unsharded: dict[str, torch.Tensor], rank: int) -> None:
        assert found.keys() <= unsharded.keys(), f"{where}: {sorted(found)} is not in {sorted(unsharded)}"
        for name, value in found.items():
            local = _local(rank, slices, name, unsharded[name])
            assert ((value - local).abs() <= TOL * (1 + local.abs())).all(), (
                f"{where}: {name} differs from the unsharded module's by {(value - local).abs().max().item():.3g}")

    def same(where: str, found: dict[str, torch.Tensor], first: dict[str, torch.Tensor]) -> None:
        for name, value in found.items():
            assert torch.equal(value, first[name]), (f"{where}: {name} differs from the first (checked) call's by "
                                                     f"{(value - first[name]).abs().max().item():.3g}")

    def rank_fn(rank: int) -> list[dict[str, torch.Tensor]]:
        block = blocks[rank]
        calls = [_step(block, x, seed, grad) for _ in range(CALLS)]
        for call, values in enumerate(calls):
            where = f"rank {rank}, call {call + 1} of {CALLS}"
            assert values.keys() == want.keys(), f"{where}: {sorted(values)} != {sorted(want)}"
            same(where, values, calls[0])
            close(where, values, want, rank)
        values = _step(block, other, seed, grad)
        assert values.keys() == want_other.keys(), f"rank {rank}, other values: {sorted(values)}"
        close(f"rank {rank}, a call on other values", values, want_other, rank)
        calls.append(values)
        no_grad = [_outputs(block, x) for _ in range(CALLS)]
        for call, values in enumerate(no_grad):
            where = f"rank {rank}, call {call + 1} of {CALLS} with no gradients"
            same(where, values, no_grad[0])
            close(where, values, want, rank)
        calls.extend(no_grad)
        # Per signature (grad mode: CALLS + 1 calls with gradients, CALLS without): a plan, replayed by every
        # call after the first, or the reason it stays checked, every call checked.
        plans = block.__dict__["forward"]._plans
        assert len(plans) == 2, f"rank {rank}: {plans}"
        replayed = sum(CALLS if key[0] else CALLS - 1 for key, plan in plans.items() if isinstance(plan, _replay.Plan))
        reasons = sorted({plan for plan in plans.values() if isinstance(plan, str)})
        counts = _zones.zone_calls(block)[""]
        assert counts == {"checked": 2 * CALLS + 1 - replayed, "replayed": replayed, "not_replayed_because": reasons}, \
            f"rank {rank}: {counts}, plans {plans}"
        return calls

    with _simulated(WORLD) as ranks:
        try:
            results = ranks.run(rank_fn)
        except RuntimeError as exc:  # a limit the engine states (``test_a_pending_sum_written_in_place_...``)
            if not re.search(REFUSED, str(exc)):
                raise
            hypothesis.reject()
    for rank, calls in enumerate(results):
        for call, values in enumerate(calls):
            for name, value in values.items():
                if name not in SPLITS:  # outputs, loss, input, whole parameters
                    assert torch.equal(value, results[0][call][name]), \
                        f"{name}: rank {rank}'s call {call + 1} differs from rank 0's"


@settings(max_examples=examples(250), deadline=None, derandomize=True)
@given(body=_bodies())
def test_a_random_zone_body_replays_its_checked_call_bit_for_bit(body: dict[str, Any]) -> None:
    _check_body(body)


class _SummedThenAddedTo(_Body):
    """A body the generator found: a pending sum, its mean (unused), another pending sum added to it in place."""

    def forward(self, x: torch.Tensor) -> Any:
        h = F.silu(self.up(x))
        y = self.down1(h)  # a pending sum
        y.mean(-1, keepdim=True)  # its sum taken, kept on it until it is written to
        y += self.down2(h)  # written to: another pending sum added in place
        return y


def test_a_pending_sum_written_in_place_after_its_sum_is_refused_clearly() -> None:
    """Found by the steps "mean-iadd" and "iadd-alias" (shrunk: ``(("add", 0), ("mean-iadd", 0))``): the checked
    call raised ``AttributeError: 'Partial' object has no attribute 'dim'``; the engine now says what to change."""
    slices = ((0, 4), (4, 3))
    whole = _reference({"steps": (), "returns": "x", "hidden": 5, "seed": 1, "slices": slices}, _SummedThenAddedTo)
    x = torch.randn(BATCH, 3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _step(whole, x, 1, True)  # torch runs it
    blocks = [_sharded(rank, whole, slices) for rank in range(WORLD)]

    def rank_fn(rank: int) -> None:
        with pytest.raises(RuntimeError, match=REFUSED):
            blocks[rank](x.clone().requires_grad_())

    with _simulated(WORLD) as ranks:
        ranks.run(rank_fn)


class _SummedFirstThenFedToALayer(_Body):
    """A body the generator found: a pending sum normalized (its first use: its sum), then fed to ``up``."""

    def forward(self, x: torch.Tensor) -> Any:
        y = self.down1(F.silu(self.up(x)))  # a pending sum
        self.norm(y)  # its first use is its sum: a replay sums it where it is made (sum first)
        return self.norm(self.down2(F.silu(self.up(y))))  # then up takes it


def test_a_pending_sum_summed_first_then_fed_to_a_layer() -> None:
    """Found by the step "up-raw" (shrunk: ``(("add", 0), ("up",), ("up-raw",), ("iadd", 1))``): every replay fed
    ``up`` twice the sum (the plain sum was tagged a pending sum again and summed again), 0.56 away from the
    checked call's output, with 3 all-reduces in its forward where the checked call made 2."""
    _check_body({"steps": (), "returns": "x", "hidden": 5, "seq": 3, "input_grad": True,
                 "slices": ((0, 4), (4, 3)), "seed": 1}, _SummedFirstThenFedToALayer)
