"""Zone bodies with data-dependent branches, compiled, on 2 Gloo ranks: each call against eager and unsharded.

Fixed bodies of ``tests/unit/test_zone_bodies.py`` (a residual stream around an MLP split as
tensor parallelism splits it, with branches on a module attribute, on ``self.training`` with
dropout ``p > 0``, on a value and on grad mode), sharded by ``st.shard_model``. Each runs every call
of that file's ``CALLS`` (the attribute, the input, training and grad mode changing from call to
call) three ways: unsharded, sharded in eager, and sharded compiled (``torch.compile``,
``aot_eager``: the graph inductor would receive). On every rank and call, the compiled outputs and
gradients (input, every parameter) must equal eager's and the unsharded module's (this rank's slice
of a split parameter's) within ``TOL``, and eager's the unsharded module's.

Every call must follow its own path: the zone is one opaque call for dynamo, so the zone's
forward reads (a module attribute, ``self.training``) are guarded where dynamo sees them
(``ZoneForward``), and a call that changes one recompiles; grad mode dynamo guards itself; a branch
on a value cannot be traced, so dynamo runs that zone eagerly (a graph break), with eager's numbers.

Simulated ranks (threads of one process) cannot run this: dynamo traces one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sharded_tensor as st
from sharding import composite, single_split
from tests.distributed._launch import run_distributed
from tests.unit.test_zone_bodies import CALLS, SPLITS, TOL, _call, _local, _reference

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # compiles: tens of seconds of tracing

SLICES = ((0, 3), (3, 2))
BODIES: dict[str, tuple[Any, ...]] = {
    "grad-mode": (("keep",), ("if-grad", 1), ("residual",), ("center",)),
    "pending-through-shapes": (("iadd", 1), ("round-trip", "transpose", "scale"), ("if-flag", 2), ("sum2",)),
    "dropout-off": (("add", 1), ("dropout",), ("rms-norm",), ("round-trip", "permute", "clone"), ("add", 2)),
    # ``if self.flag:``: compiled with flag False, then called with True
    "attribute": (("add", 1), ("if-flag", 2), ("rms-norm",)),
    # dropout (p > 0) on the split hidden activation and on the stream; compiled in eval, then in training
    "training": (("if-training-hidden",), ("add", 1), ("if-training-stream",), ("layer-norm",)),
    # ``if x.sum() > 0`` on a pending sum
    "value": (("add", 1), ("if-value", 2)),
}


def _body(steps: tuple[Any, ...]) -> dict[str, Any]:
    return {"steps": steps, "returns": "tuple", "hidden": 5, "seq": 3, "input_grad": True, "slices": SLICES,
            "seed": 3}


def _mismatches(found: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rank: int, split: bool) -> list[str]:
    """Names whose values differ; a gradient one side lacks counts as zeros (a compiled backward gives every
    parameter of the traced zone a gradient, zeros for one the call did not use)."""
    bad = []
    for name in sorted(set(found) | set(want)):
        value, other = found.get(name), want.get(name)
        if value is None or other is None:
            if name not in SPLITS and name not in ("input",) and "." not in name and name != "rms_weight":
                bad.append(name)  # an output or the loss on one side only
                continue
            value = torch.zeros_like(other) if value is None else value
            other = torch.zeros_like(value) if other is None else other
            if split and name in SPLITS and other.shape != value.shape:
                other = torch.zeros_like(value) if want.get(name) is None else other
        local = _local(rank, SLICES, name, other) if split and want.get(name) is not None else other
        if value.shape != local.shape or not bool(((value - local).abs() <= TOL * (1 + local.abs())).all()):
            bad.append(name)
    return bad


def _run(rank: int, world: int, bodies: dict[str, tuple[Any, ...]]) -> dict[str, list[dict[str, Any]]]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    spec = composite(**{"up": single_split(0, ranks), "down1.weight": single_split(1, ranks),
                        "down2.weight": single_split(1, ranks)})
    results: dict[str, list[dict[str, Any]]] = {}
    for name, steps in bodies.items():
        body = _body(steps)
        x = torch.randn(2, body["seq"], body["hidden"], generator=torch.Generator().manual_seed(body["seed"]),
                        dtype=torch.float64)
        whole = _reference(body)
        model = _reference(body)
        st.shard_model(model, spec)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        rows = []
        for call in range(len(CALLS)):
            want = _call(whole, x, call, True)
            eager = _call(model, x, call, True)
            try:
                got = _call(model, x, call, True, forward=compiled)
            except Exception as exc:  # noqa: BLE001 - reported, with the call, to the test
                rows.append({"call": call, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            rows.append({"call": call, "error": None,
                         "compiled vs eager": _mismatches(got, eager, rank, split=False),
                         "compiled vs unsharded": _mismatches(got, want, rank, split=True),
                         "eager vs unsharded": _mismatches(eager, want, rank, split=True)})
        results[name] = rows
    return results


@pytest.fixture(scope="module")
def calls() -> list[dict[str, list[dict[str, Any]]]]:
    """Every body run on 2 Gloo ranks in one spawn: per rank, per body, per call, what differs."""
    return run_distributed(_run, 2, BODIES, timeout=900)


def _wrong(calls: list[dict[str, list[dict[str, Any]]]], body: str) -> list[str]:
    found = []
    for rank, results in enumerate(calls):
        for row in results[body]:
            differs = {k: v for k, v in row.items() if k != "call" and v}
            if differs:
                found.append(f"rank {rank}, call {CALLS[row['call']]}: {differs}")
    return found


@pytest.mark.parametrize("body", sorted(BODIES))
def test_compiled_zone_bodies_match_eager_and_the_unsharded_module_on_every_call(calls, body: str) -> None:
    assert not _wrong(calls, body)
    assert all(len(results[body]) == len(CALLS) for results in calls)
