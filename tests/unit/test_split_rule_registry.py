"""``st.register_split_rule``: a registered rule is used, exact forward and backward, and bad input is refused.

Ranks are simulated in one process as in test_split_rules.py; the number of all-gathers shows
whether the op ran on slices (its rule) or on gathered tensors (the fallback).
"""

from __future__ import annotations

import pytest
import torch

import sharded_tensor as st
from sharded_tensor._model.engine import placements as _placements
from sharded_tensor._model.engine import rules as _rules
from sharded_tensor._model.engine.split import elementwise
from sharded_tensor._model.engine.zone import zone
from sharding import layout
from tests.unit._simulated_ranks import simulated as _simulated


@torch.library.custom_op("shardkit_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * w


def _backward(ctx, grad):  # type: ignore[no-untyped-def]
    x, w = ctx.saved_tensors
    t = torch.tanh(x)
    gw = grad * t
    return grad * w * (1 - t * t), gw.sum_to_size(w.shape)


def _setup(ctx, inputs, output):  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


scaled_tanh.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("shardkit_test::shifted", mutates_args=())
def shifted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w + 1.0


shifted.register_autograd(lambda ctx, g: (g * ctx.w, (g * ctx.x).sum_to_size(ctx.w.shape)),
                          setup_context=lambda ctx, inputs, output: ctx.__dict__.update(x=inputs[0], w=inputs[1]))


def _run(op, w_shape, world=2, shape=(2, 5, 3), dim=1):  # type: ignore[no-untyped-def]
    """Check every rank's output and gradients against the op on the whole tensor; whether each rank gathered."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    w = torch.randn(w_shape, generator=gen, dtype=torch.float64)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = op(xs, ws)
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (want * upstream).sum().backward()
    intervals = ((0, 3), (3, 2))

    def rank_fn(rank: int):  # type: ignore[no-untyped-def]
        start, length = intervals[rank]
        local = x.narrow(dim, start, length).clone().requires_grad_()
        weight = w.clone().requires_grad_()
        tagged = _placements.tag(local.view_as(local), _placements.Split(dim, intervals))
        with zone():
            out = op(tagged, weight)
        gathered = _placements.placement_of(out) is None  # the fallback gathers x and returns a whole tensor
        out = _placements.to_whole(out)
        (out * upstream).sum().backward()
        return out.detach(), local.grad, weight.grad, gathered

    with _simulated(world) as ranks:
        results = ranks.run(rank_fn)
    for rank, (out, local_grad, weight_grad, _) in enumerate(results):
        start, length = intervals[rank]
        torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12, msg=f"output on rank {rank}")
        torch.testing.assert_close(local_grad, xs.grad.narrow(dim, start, length), rtol=1e-12, atol=1e-12,
                                   msg=f"input grad on rank {rank}")
        torch.testing.assert_close(weight_grad, ws.grad, rtol=1e-12, atol=1e-12, msg=f"weight grad on rank {rank}")
    return [gathered for *_, gathered in results]


def test_a_registered_rule_keeps_the_op_on_slices_exact_forward_and_backward() -> None:
    # No rule yet: the engine gathers x and runs the op whole (exact, output no longer split).
    assert _run(scaled_tanh, (3,)) == [True, True]
    st.register_split_rule(scaled_tanh, lambda x, w: torch.tanh(x) * w)
    # A weight broadcast over the split dimension (1): used whole, its gradient summed over the ranks.
    assert _run(scaled_tanh, (3,)) == [False, False]
    # A weight along the split dimension: each rank takes its slice, its gradient gathered back.
    assert _run(scaled_tanh, (5, 1)) == [False, False]
    assert _run(shifted, (5, 3)) == [True, True]
    st.register_split_rule(torch.ops.shardkit_test.shifted, "elementwise")
    assert _run(shifted, (5, 3)) == [False, False]
    assert _run(shifted, (1, 3)) == [False, False]


def test_bad_registrations_are_refused_with_the_offending_value() -> None:
    with pytest.raises(TypeError, match=r"op must be a torch function.*got <function .*plain.*\(function\)"):
        def plain(x):  # type: ignore[no-untyped-def]
            return x
        st.register_split_rule(plain, "elementwise")
    with pytest.raises(TypeError, match=r"rule must be one of \['elementwise', 'linear'\] or a callable "
                                        r"decomposition, got 3 \(int\)"):
        st.register_split_rule(torch.special.erfcx, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rule 'pointwise' names no rule; use one of \['elementwise', 'linear'\]"):
        st.register_split_rule(torch.special.erfcx, "pointwise")
    with pytest.raises(ValueError, match=r"op <built-in method tanh .*> already has a rule for Split activations "
                                         r"\(elementwise\); pass replace=True"):
        st.register_split_rule(torch.tanh, "elementwise")
    with pytest.raises(ValueError, match=r"is the op itself"):
        st.register_split_rule(torch.special.erfcx, torch.special.erfcx)
    with pytest.raises(ValueError, match=r"rule 'linear' is for Partial activations, not Split"):
        st.register_split_rule(torch.special.erfcx, "linear", placement=layout.Split)
    with pytest.raises(ValueError, match=r"placement=<class 'int'> is not a placement kind"):
        st.register_split_rule(torch.special.erfcx, "elementwise", placement=int)
    assert _rules.rules_of(torch.tanh).by_kind[_placements.Split] is elementwise  # refusals changed nothing


class _TanhTimes(st.DFunction):
    layout_rule = "elementwise"

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        t = torch.tanh(x)
        ctx.save_for_backward(t, w)
        return t * w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        t, w = ctx.saved_tensors
        return grad * w * (1 - t * t), (grad * t).sum_to_size(w.shape)


class _TanhTimesWhole(_TanhTimes):
    layout_rule = "replicate"


def test_a_dfunction_runs_on_split_activations_through_its_split_rule() -> None:
    # "elementwise" layout: the function runs on each rank's slice, exact forward and backward.
    assert _run(_TanhTimes.apply, (3,)) == [False, False]
    assert _run(_TanhTimes.apply, (5, 1)) == [False, False]
    # "replicate": its split inputs are gathered first, until a split rule is registered for it.
    assert _run(_TanhTimesWhole.apply, (3,)) == [True, True]
    st.register_split_rule(_TanhTimesWhole, "elementwise")
    assert _run(_TanhTimesWhole.apply, (3,)) == [False, False]
    with pytest.raises(ValueError, match=r"_TanhTimesWhole already has a rule for Split activations"):
        st.register_split_rule(_TanhTimesWhole, "elementwise")


def test_one_table_holds_op_rules_module_registrations_and_dfunction_rules() -> None:
    from sharded_tensor._model import registry
    from sharded_tensor._model.parallel import ShardedLinear

    class _Scale(torch.nn.Module):
        pass

    class _ScaleHandler(st.ShardedModule):
        pass

    handler = _ScaleHandler()
    st.register_split_rule(_Scale, handler)  # a module type: its registration, as register_sharded_module
    table = _rules.table()
    assert table[_Scale] is handler and registry.handler_for(_Scale()) == (handler, None)
    assert isinstance(table[torch.nn.Linear], ShardedLinear)
    assert table[torch.tanh].by_kind[_placements.Split] is elementwise
    assert table[_rules.LayoutRuleName("elementwise")] is not None  # DFunction's layout rules
    assert "_Scale" in registry.registered_types() and "tanh" not in registry.registered_types()
    with pytest.raises(ValueError, match=r"_Scale already has a sharded registration \(_ScaleHandler\)"):
        st.register_split_rule(_Scale, handler)
    with pytest.raises(TypeError, match=r"handler must be a ShardedModule instance, got str"):
        st.register_split_rule(_Scale, "elementwise", replace=True)
