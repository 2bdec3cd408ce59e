"""The sharded-module registry: registration rules and which registration applies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sharded_tensor as st
from sharded_tensor._model.registry import ShardedCall, handler_for


class _Noop(st.ShardedModule):
    def plan(self, module, layouts, *, name):  # type: ignore[no-untyped-def]
        return None


class _Custom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _OwnForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class _SameForward(nn.Linear):
    pass


@pytest.mark.parametrize(("module_type", "handler", "error", "pattern"), [
    pytest.param(int, _Noop(), TypeError, r"module_type must be an nn.Module subclass, got <class 'int'>",
                 id="not-a-module"),
    pytest.param(_Custom, object(), TypeError, r"handler must be a ShardedModule instance, got object",
                 id="not-a-handler"),
    pytest.param(nn.Linear, _Noop(), ValueError, r"Linear already has a sharded registration \(ShardedLinear\); "
                                                 r"pass replace=True", id="twice"),
])
def test_bad_registrations_are_refused(module_type, handler, error, pattern):
    with pytest.raises(error, match=pattern):
        st.register_sharded_module(module_type, handler)


def test_a_registration_applies_to_subclasses_that_keep_its_forward():
    assert type(handler_for(_SameForward(2, 2))[0]).__name__ == "ShardedLinear"
    handler, why = handler_for(_OwnForward(2, 2))
    assert handler is None and "_OwnForward overrides the forward of Linear" in str(why)
    assert handler_for(_Custom()) == (None, None)


def test_sharded_call_in_a_world_of_one_moves_nothing():
    call = ShardedCall(plan=None, group=None)
    x = torch.randn(3, 4)
    with st.CommCounter() as comm:
        assert torch.equal(call.reduce(x), x)
        assert torch.equal(call.split_input(x, ((0, 4),)), x)
        assert torch.equal(call.split_output(x, ((0, 4),)), x)
    assert (call.rank, call.world_size) == (0, 1)
    assert not comm.counts


def test_sharded_call_builds_an_output_tag_once_and_keeps_few():
    """``split_output`` builds a split's tag on first use; a forward that makes its split anew on
    every call (a fresh list) does not make the call hold every one of them."""
    from sharded_tensor._model.engine.placements import placement_of
    from sharded_tensor._model.engine.zone import zone
    call = ShardedCall(plan=None, group=None)
    split = ((0, 4),)
    with zone():
        first = placement_of(call.split_output(torch.randn(3, 4), split))
        again = placement_of(call.split_output(torch.randn(3, 4), split))
        assert again is first and (first.dim, first.intervals) == (1, split)
        for _ in range(40):
            tag = placement_of(call.split_output(torch.randn(2, 3, 4), [[0, 4]]))
            assert (tag.dim, tag.intervals) == (2, split)
    assert len(call._tags) <= 16
