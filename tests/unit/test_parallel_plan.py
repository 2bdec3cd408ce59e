"""Compute layouts and plans for sharded modules: pure functions, no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharded_tensor._model.parallel import (
    EmbeddingPlan,
    LinearPlan,
    classify,
    plan_module,
)
from sharding import DevicePlacement, mesh, single_split
from sharding.layout import Packed

R4 = [f"rank:{r}/cpu" for r in range(4)]


def layout(spec, size, world=4, name="w"):  # type: ignore[no-untyped-def]
    return classify(name, spec.build_metadata(size, world_size=world), world)


@pytest.mark.parametrize(("spec", "size", "kind", "dim", "intervals"), [
    pytest.param(DevicePlacement("cpu"), (8, 4), "replicated", None, None, id="replicated"),
    pytest.param(single_split(0, R4), (10, 4), "split", 0, ((0, 3), (3, 3), (6, 3), (9, 1)), id="rows-uneven"),
    pytest.param(single_split(1, R4[::-1]), (4, 8), "split", 1, ((6, 2), (4, 2), (2, 2), (0, 2)), id="cols-permuted"),
    pytest.param(single_split(0, R4), (3, 4), "split", 0, ((0, 1), (1, 1), (2, 1), (3, 0)), id="empty-trailing"),
    pytest.param(single_split(0, R4[:2]), (4, 4), "split", 0, ((0, 2), (2, 2), (0, 0), (0, 0)), id="two-of-four"),
    pytest.param(DevicePlacement("rank:2/cpu"), (4, 4), "split", None, None, id="one-owner"),
    pytest.param(mesh([R4[:2], R4[2:]]), (4, 4), "blocks", None, None, id="mesh"),
    pytest.param(mesh([[R4[0]], [R4[1]], [R4[2]], [R4[3]]]), (8, 4), "split", 0,
                 ((0, 2), (2, 2), (4, 2), (6, 2)), id="mesh-one-axis"),
    pytest.param(single_split(0, ["cpu", R4[1]]), (4, 4), "overlapping", None, None, id="overlapping"),
    pytest.param(single_split(0, [R4[0], R4[0], R4[1], R4[1]]), (8, 4), "split", 0,
                 ((0, 4), (4, 4), (0, 0), (0, 0)), id="adjacent-repeats"),
])
def test_classify(spec, size, kind, dim, intervals):
    got = layout(spec, size)
    assert (got.kind, got.dim, got.intervals) == (kind, dim, intervals)


def test_slices_of_one_dimension_form_a_packed_layout():
    got = layout(single_split(0, R4[:2] * 2), (8, 4), name="fc.weight")
    assert (got.kind, got.dim, got.intervals) == ("split", 0, None)
    assert got.pieces == (((0, 2), (4, 2)), ((2, 2), (6, 2)), (), ())
    full = torch.arange(32.0).reshape(8, 4)
    assert torch.equal(got.local_of(1, full), torch.cat([full[2:4], full[6:8]]))
    assert got.local_region(1, ((6, 0), (2, 4))) == ((2, 0), (2, 4))


def test_linear_packed_on_its_outputs_gives_packed_outputs():
    pieces = (((0, 2), (4, 2)), ((2, 2), (6, 2)), (), ())
    plan = _plan(nn.Linear(4, 8), weight=single_split(0, R4[:2] * 2))
    assert plan == LinearPlan("out", (), "replicated", None, 0, pieces)
    assert plan.output_split == Packed(0, pieces)
    both = _plan(nn.Linear(4, 8), weight=single_split(0, R4[:2] * 2), bias=single_split(0, R4[:2] * 2))
    assert both == LinearPlan("out", (), "local", None, 0, pieces)


def test_packed_layouts_linear_cannot_compute_are_refused():
    with pytest.raises(ValueError, match=r"weight is split into several non-adjacent slices per rank along dimension "
                                         r"1 \(rank 0: \[\(0, 1\), \(2, 1\)\]"):
        _plan(nn.Linear(4, 8), weight=single_split(1, R4[:2] * 2))
    with pytest.raises(ValueError, match=r"output features are packed as \[\[\(0, 2\), \(4, 2\)\], .* but the bias "
                                         r"is laid out otherwise .* split the bias into the same slices"):
        _plan(nn.Linear(4, 8), weight=single_split(0, R4[:2] * 2), bias=single_split(0, R4))


def test_classify_refuses_shards_that_differ_along_several_dimensions():
    spec = mesh([[R4[0], R4[1]], [R4[1], R4[0]]])
    with pytest.raises(ValueError, match=r"parameter 'fc.weight' .* rank 0 would hold shards .* which neither form one "
                                         r"block nor differ along a single dimension"):
        layout(spec, (8, 4), name="fc.weight")


def _plan(module, **specs):  # type: ignore[no-untyped-def]
    layouts = {n: layout(s, tuple(getattr(module, n).shape), name=n) for n, s in specs.items()}
    plan = plan_module("layer", module, layouts)
    return None if plan is None else plan.inner


@pytest.mark.parametrize(("specs", "expected"), [
    pytest.param({"weight": single_split(0, R4)},
                 LinearPlan("out", ((0, 2), (2, 2), (4, 2), (6, 2)), "replicated", None, 0), id="out-bias-whole"),
    pytest.param({"weight": single_split(0, R4), "bias": single_split(0, R4)},
                 LinearPlan("out", ((0, 2), (2, 2), (4, 2), (6, 2)), "local", None, 0), id="out-bias-split"),
    pytest.param({"weight": single_split(1, R4)},
                 LinearPlan("in", ((0, 3), (3, 3), (6, 3), (9, 3)), "replicated", None, 1), id="in-bias-whole"),
    pytest.param({"weight": single_split(1, R4), "bias": single_split(0, R4[::-1])},
                 LinearPlan("in", ((0, 3), (3, 3), (6, 3), (9, 3)), "disjoint", ((6, 2), (4, 2), (2, 2), (0, 2)), 1),
                 id="in-bias-split-its-own-way"),
    pytest.param({"bias": single_split(0, R4)},
                 LinearPlan("bias", (), "disjoint", ((0, 2), (2, 2), (4, 2), (6, 2)), None), id="only-bias-split"),
    pytest.param({"weight": DevicePlacement("rank:1/cpu"), "bias": DevicePlacement("rank:3/cpu")},
                 LinearPlan("in", ((0, 0), (0, 12), (0, 0), (0, 0)), "disjoint", ((0, 0), (0, 0), (0, 0), (0, 8)), 1),
                 id="owned-by-different-ranks"),
    pytest.param({"weight": DevicePlacement("rank:1/cpu")},
                 LinearPlan("out", ((0, 0), (0, 8), (0, 0), (0, 0)), "replicated", None, 0), id="owned-by-one"),
    pytest.param({"weight": DevicePlacement("cpu")}, None, id="replicated"),
])
def test_linear_plans(specs, expected):
    assert _plan(nn.Linear(12, 8), **specs) == expected


@pytest.mark.parametrize(("module", "specs", "pattern"), [
    pytest.param(nn.Linear(12, 8), {"weight": mesh([R4[:2], R4[2:]])}, r"weight is split into blocks", id="mesh"),
    pytest.param(nn.Linear(12, 8), {"weight": single_split(0, R4), "bias": single_split(0, R4[::-1])},
                 r"the bias is split as \[\(6, 2\), \(4, 2\), \(2, 2\), \(0, 2\)\] .* output features as "
                 r"\[\(0, 2\), \(2, 2\), \(4, 2\), \(6, 2\)\]", id="bias-mismatch"),
    pytest.param(nn.LayerNorm(8), {"weight": single_split(0, R4)},
                 r"module 'layer' \(LayerNorm\): 'weight' is split .* only in modules with a sharded registration: "
                 r"(\w+, )*Embedding, (\w+, )*Linear", id="layernorm"),
    pytest.param(nn.Embedding(10, 8, max_norm=2.0), {"weight": single_split(1, R4)}, r"max_norm=2.0", id="max-norm"),
    pytest.param(nn.Conv1d(4, 8, 3), {"weight": single_split(0, R4)}, r"\(Conv1d\)", id="conv"),
])
def test_uncomputable_plans_are_refused(module, specs, pattern):
    with pytest.raises(ValueError, match=pattern):
        _plan(module, **specs)


def test_embedding_plans():
    assert _plan(nn.Embedding(10, 8), weight=single_split(0, R4)) == EmbeddingPlan(
        "vocab", ((0, 3), (3, 3), (6, 3), (9, 1)), 0)
    assert _plan(nn.Embedding(10, 8), weight=single_split(1, R4)) == EmbeddingPlan(
        "dim", ((0, 2), (2, 2), (4, 2), (6, 2)), 1)


class _Lin(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # an overridden forward is not ours to shard
        return super().forward(x) * 2


def test_linear_subclass_with_its_own_forward_is_refused():
    with pytest.raises(ValueError, match=r"\(_Lin\).*\(whose forward is not overridden\)"):
        _plan(_Lin(12, 8), weight=single_split(0, R4))


class _MatmulLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:  # Falcon's FalconLinear
        hidden_states = input @ self.weight.T
        if self.bias is None:
            return hidden_states
        return hidden_states + self.bias


class _ScaledMatmulLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input @ self.weight.T * 2


@pytest.mark.parametrize("bias", [True, False])
def test_linear_subclass_whose_forward_is_a_matmul_plus_bias_is_a_linear(bias):
    with torch.device("meta"):  # recognized by tracing, without computing
        module = _MatmulLinear(12, 8, bias=bias)
    assert _plan(module, weight=single_split(1, R4)) == _plan(nn.Linear(12, 8, bias=bias), weight=single_split(1, R4))
    with pytest.raises(ValueError, match=r"\(_ScaledMatmulLinear\).*\(whose forward is not overridden\)"):
        _plan(_ScaledMatmulLinear(12, 8), weight=single_split(0, R4))


def test_multihead_attention_split_inside_a_head_is_refused():
    """embed_dim 8 in 2 heads of 4: each rank must hold whole heads of q, k and v (and their out_proj columns)."""
    mha = nn.MultiheadAttention(8, 2, bias=False)
    ranks = R4[:2]

    def layouts(sizes):  # type: ignore[no-untyped-def]
        w = single_split(0, ranks * 3, sizes * 3)
        out = single_split(1, ranks, sizes)
        return {"in_proj_weight": layout(w, (24, 8), world=2, name="in_proj_weight"),
                "out_proj.weight": layout(out, (8, 8), world=2, name="out_proj.weight")}

    plan = plan_module("attn", mha, layouts([4, 4]))
    assert plan is not None and plan.inner.heads == ((0, 4), (4, 4))
    with pytest.raises(ValueError, match=r"rank 0 holds embedding rows \(0, 2\) of q, k and v, which cut a head "
                                         r"\(head size 4\)"):
        plan_module("attn", mha, layouts([2, 6]))
