"""Random zone bodies, with data-dependent branches, on 2 simulated ranks: every call equals the unsharded module's.

Hypothesis draws a small zone body: 2 to 7 steps over a residual stream ``x`` (float64, hidden
size 5 or 6) around an MLP split as tensor parallelism splits it (``up`` on its output features,
``down1`` and ``down2`` on their input features, over uneven slices, one of them possibly empty),
so each ``down`` hands out a pending sum that the next steps add to the stream (also in place),
subtract, scale, combine, multiply, normalize (LayerNorm, an RMSNorm as transformers writes it),
center, gate, view, reshape, flatten, transpose, permute and unsqueeze (and back), cut and
concatenate, drop out, keep and add again later. Some steps branch on what a call brings: a module
attribute set between calls (``self.flag``), a value of the input (``x.sum() > 0``), ``self.training``
(dropout with ``p > 0`` on the split hidden activation or on the stream) and grad mode. The body
returns ``x``, ``(x, norm(x))`` or a dict (with plain values).

Each body runs unsharded, and as a zone on each of 2 ranks (``_simulated_ranks``: threads of one
process), for every call of ``CALLS``: the attribute, the input's sign and scale, training and grad
mode change from call to call, each call seeded alike on both sides (dropout draws the unsharded
mask). On every rank and call, the outputs (every leaf), a scalar loss made from them and the
gradients of the input and of every parameter equal the unsharded module's (this rank's slice of
a split parameter's) within ``TOL``, and whole values are equal on both ranks bit for bit.

The same zone compiled (``torch.compile``) is checked against eager by
``tests/distributed/test_zone_bodies_compiled.py`` on 2 Gloo ranks: dynamo traces one process, not
ranks simulated as threads sharing it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402

from sharded_tensor._model import parallel as _parallel  # noqa: E402
from sharded_tensor._model.engine.zone import ZoneForward  # noqa: E402
from tests._examples import examples  # noqa: E402
from tests.unit._simulated_ranks import simulated  # noqa: E402

WORLD, BATCH, EPS = 2, 2, 1e-6
# The split parameters: name -> dimension (each split over the FFN's slices). The downs' biases stay
# whole: each is added once to its layer's pending sum.
SPLITS = {"up.weight": 0, "up.bias": 0, "down1.weight": 1, "down2.weight": 1}
# The sharded module adds each ``down``'s products over the ranks' features in another order than one
# matmul adds them, and adds a whole tensor to a pending sum's addend on one rank where the unsharded
# module adds it to the whole sum, so its float64 values differ from the unsharded ones in the last
# bits (at most ~1e-14 times 1 + the value's size). TOL times that allows for it, and is 11 orders of
# magnitude below what a whole tensor added on every rank costs.
TOL = 1e-12
# (flag, input scale, training, grad mode) of each call: every call changes something a branch reads.
CALLS: tuple[tuple[bool, float, bool, bool], ...] = (
    (False, 1.0, False, True),
    (True, 1.0, False, True),     # a module attribute
    (False, -3.0, False, True),   # the input's values: x.sum() changes sign
    (False, 1.0, True, True),     # training: dropout with p > 0
    (True, -3.0, True, True),
    (False, 1.0, False, False),   # no gradients
    (True, -1.0, True, False),
    (False, 1.0, False, True),    # back to the first
)
DROP = 0.25

Step = tuple[Any, ...]
# What the engine says of an in-place op on a pending sum that no rule keeps pending (after its sum was taken).
REFUSED = r"in-place op '(add|sub|mul)_' on a pending sum .* make the op out-of-place"


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
        self.flag = False  # set between calls: a config switch the forward reads
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
            elif kind == "h-mean":  # a reduction over the split features: the engine all-reduces
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
            # -- branches on what the call brings --------------------------------------------------------
            elif kind == "if-flag":  # a module attribute set between calls
                if self.flag:
                    x = x - x.mean(-1, keepdim=True)
                else:
                    x = x + latest(step[1])
            elif kind == "if-value":  # a value of the input
                if x.sum() > 0:
                    x = x * 0.5 + latest(step[1])
                else:
                    x = self.norm(x)
            elif kind == "if-training-hidden":  # dropout with p > 0 on the split hidden activation
                h = F.dropout(hidden(), DROP, self.training)
                if self.training:
                    h = h * 2.0
            elif kind == "if-training-stream":  # dropout with p > 0 on the stream (a pending sum, or not)
                x = F.dropout(x, DROP, self.training)
            elif kind == "if-grad":  # grad mode
                if torch.is_grad_enabled():
                    x = x * 1.5 + latest(step[1])
                else:
                    x = x - 0.5
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
_BRANCHES = hs.one_of(
    hs.tuples(hs.sampled_from(["if-flag", "if-value", "if-grad"]), _DOWN),
    hs.tuples(hs.sampled_from(["if-training-hidden", "if-training-stream"])),
)


@hs.composite
def _bodies(draw: Any) -> dict[str, Any]:
    # Uneven slices; one rank may hold none of the FFN's features.
    lengths = draw(hs.sampled_from([(1, 4), (3, 2), (0, 5), (5, 0), (2, 3)]), label="slices")
    steps = draw(hs.lists(_STEPS, min_size=1, max_size=5), label="steps")
    branches = draw(hs.lists(_BRANCHES, min_size=1, max_size=2), label="branches")
    for branch in branches:  # every body has at least one branch, anywhere among its steps
        steps.insert(draw(hs.integers(0, len(steps)), label="at"), branch)
    return {"steps": tuple(steps),
            "returns": draw(hs.sampled_from(["x", "tuple", "dict"])),
            "hidden": draw(hs.sampled_from([5, 6])), "seq": draw(hs.integers(1, 4)),
            "input_grad": draw(hs.booleans()),
            "slices": ((0, lengths[0]), (lengths[0], lengths[1])), "seed": draw(hs.integers(0, 2**16))}


def _reference(body: dict[str, Any], kind: type[_Body] = _Body) -> _Body:
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


def sharded(rank: int, whole: _Body, slices: tuple[tuple[int, int], ...]) -> _Body:
    """Rank ``rank``'s zone cut from ``whole``: its slices of the split layers, their plans installed, its forward
    a zone's (as ``shard_model`` makes them)."""
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
    block.__dict__["forward"] = ZoneForward(type(block).forward.__get__(block))
    return block


def _leaves(out: Any) -> dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {"out": out}
    if isinstance(out, tuple):
        return {f"out[{i}]": v for i, v in enumerate(out)}
    assert out["eps"] == EPS and out["none"] is None, out
    return {f"out[{k!r}]": v for k, v in out.items() if isinstance(v, torch.Tensor)}


def _call(module: nn.Module, x: torch.Tensor, call: int, input_grad: bool, forward: Any = None
          ) -> dict[str, torch.Tensor]:
    """Call ``call`` of ``CALLS``: the module's attribute and mode set, the input scaled, the generator seeded; every
    output leaf, and with gradients a loss made from them and the gradients of the input (if ``input_grad``) and
    of every parameter that has one. ``forward``: what to call instead of ``module`` (its compiled form)."""
    flag, scale, training, grad = CALLS[call]
    module.flag = flag
    module.train(training)
    module.zero_grad()
    x = (x * scale).requires_grad_(input_grad and grad)
    torch.manual_seed(1000 + call)  # the same dropout masks on every side
    with torch.set_grad_enabled(grad):
        leaves = _leaves((module if forward is None else forward)(x))
        found = {name: v.detach().clone() for name, v in leaves.items()}
        if not grad:
            return found
        gen = torch.Generator().manual_seed(call)
        loss = sum((v * torch.randn(v.shape, generator=gen, dtype=torch.float64)).sum() for v in leaves.values())
        assert isinstance(loss, torch.Tensor)
        if loss.requires_grad:  # not when the body returns its input untouched, which needs no gradient
            loss.backward()
    found["loss"] = loss.detach()
    if input_grad and x.grad is not None:
        found["input"] = x.grad
    found.update({name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None})
    return found


def check_body(body: dict[str, Any], kind: type[_Body] = _Body) -> None:
    """Run ``body`` unsharded and as a zone on 2 simulated ranks, call after call; assert as the module says."""
    slices, seed, grad = body["slices"], body["seed"], body["input_grad"]
    x = torch.randn(BATCH, body["seq"], body["hidden"], generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    whole = _reference(body, kind)
    saved = torch.get_rng_state()
    try:
        want = [_call(whole, x, call, grad) for call in range(len(CALLS))]
    except RuntimeError as exc:  # a stream written in place after an op saved it, or a view of the input
        if "inplace operation" not in str(exc) and "in-place operation" not in str(exc):
            raise
        hypothesis.reject()  # not a body torch can run either
    finally:
        torch.set_rng_state(saved)
    blocks = [sharded(rank, whole, slices) for rank in range(WORLD)]  # before the ranks start: one generator

    def rank_fn(rank: int) -> list[dict[str, torch.Tensor]]:
        calls = []
        for call in range(len(CALLS)):
            values = _call(blocks[rank], x, call, grad)
            where = f"rank {rank}, call {call} {CALLS[call]}"
            assert values.keys() == want[call].keys(), f"{where}: {sorted(values)} != {sorted(want[call])}"
            for name, value in values.items():
                local = _local(rank, slices, name, want[call][name])
                assert value.shape == local.shape, f"{where}: {name} is {tuple(value.shape)}, want {tuple(local.shape)}"
                assert ((value - local).abs() <= TOL * (1 + local.abs())).all(), (
                    f"{where}: {name} differs from the unsharded module's by {(value - local).abs().max().item():.3g}")
            calls.append(values)
        return calls

    with simulated(WORLD) as ranks:
        try:
            results = ranks.run(rank_fn, seed=0)
        except RuntimeError as exc:  # a limit the engine states (``test_a_pending_sum_written_in_place_...``)
            if not re.search(REFUSED, str(exc)):
                raise
            hypothesis.reject()
    for rank, calls in enumerate(results):
        for call, values in enumerate(calls):
            for name, value in values.items():
                if name not in SPLITS:  # outputs, loss, input, whole parameters
                    assert torch.equal(value, results[0][call][name]), \
                        f"{name}: rank {rank}'s call {call} differs from rank 0's"


@settings(max_examples=examples(40), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(body=_bodies())
def test_a_random_zone_body_equals_the_unsharded_module_on_every_call(body: dict[str, Any]) -> None:
    check_body(body)


@pytest.mark.parametrize("steps", [
    pytest.param((("if-flag", 1), ("add", 2)), id="attribute"),
    pytest.param((("add", 1), ("if-value", 2)), id="value"),
    pytest.param((("if-training-hidden",), ("add", 1), ("if-training-stream",)), id="training"),
    pytest.param((("if-grad", 1), ("layer-norm",)), id="grad-mode"),
])
def test_each_branch_follows_every_call(steps: tuple[Step, ...]) -> None:
    """Each kind of branch alone, on slices of 3 and 2 features: the path each call takes is its own."""
    check_body({"steps": steps, "returns": "x", "hidden": 5, "seq": 3, "input_grad": True,
                "slices": ((0, 3), (3, 2)), "seed": 1})


class _SummedThenAddedTo(_Body):
    """A body the generator found: a pending sum, its mean (unused), another pending sum added to it in place."""

    def forward(self, x: torch.Tensor) -> Any:
        h = F.silu(self.up(x))
        y = self.down1(h)  # a pending sum
        y.mean(-1, keepdim=True)  # its sum taken, kept on it until it is written to
        y += self.down2(h)  # written to: another pending sum added in place
        return y


def test_a_pending_sum_written_in_place_after_its_sum_is_taken() -> None:
    """Found by the steps "mean-iadd" and "iadd-alias" (once an AttributeError, then a refusal): a pending sum whose
    sum was taken, then added to in place by another pending sum, is exact on every call."""
    check_body({"steps": (), "returns": "x", "hidden": 5, "seq": 3, "input_grad": True,
                "slices": ((0, 4), (4, 3)), "seed": 1}, _SummedThenAddedTo)


class _SummedFirstThenFedToALayer(_Body):
    """A body the generator found: a pending sum normalized (its first use: its sum), then fed to ``up``."""

    def forward(self, x: torch.Tensor) -> Any:
        y = self.down1(F.silu(self.up(x)))  # a pending sum
        self.norm(y)  # its first use is its sum
        return self.norm(self.down2(F.silu(self.up(y))))  # then up takes it


def test_a_pending_sum_summed_first_then_fed_to_a_layer() -> None:
    """Found by the step "up-raw": the layer must take the sum once (a replay once fed it twice the sum)."""
    check_body({"steps": (), "returns": "x", "hidden": 5, "seq": 3, "input_grad": True,
                "slices": ((0, 4), (4, 3)), "seed": 1}, _SummedFirstThenFedToALayer)
