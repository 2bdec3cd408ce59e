"""Layout-invariant initialization, without a process group.

The generator: every block of a tensor gets exactly the values the whole tensor has there,
bit-identical to ``_random`` (the package's reference implementation). The init interception:
``torch.nn.init`` rules fill registered blocks with the distribution of the *global* tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst
from torch import nn

import sharded_tensor as st
from sharded_tensor import _fill, _random
from sharded_tensor._model import init as _init_model
from sharding import DevicePlacement
from tests._examples import examples


def _slice(t: torch.Tensor, offsets: tuple[int, ...], dims: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, dims))]


@pytest.mark.parametrize(("global_shape", "offsets", "dims"), [
    pytest.param((6, 10), (0, 0), (6, 10), id="whole"),
    pytest.param((6, 10), (2, 0), (3, 10), id="rows"),
    pytest.param((6, 10), (0, 3), (6, 4), id="columns"),
    pytest.param((6, 10), (1, 2), (4, 5), id="block"),
    pytest.param((40000,), (12345, ), (20000,), id="1d-several-chunks"),
    pytest.param((3, 4, 5), (1, 1, 0), (2, 2, 5), id="3d"),
    pytest.param((3, 4, 5), (0, 0, 2), (3, 4, 2), id="3d-last-dim"),
    pytest.param((), (), (), id="scalar"),
    pytest.param((5, 0), (0, 0), (5, 0), id="empty"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fills_are_bit_identical_to_random(global_shape, offsets, dims, dtype):
    for ours, reference, args in ((_fill.fill_uniform_, _random.uniform_, (-0.3, 0.7)),
                                  (_fill.fill_normal_, _random.normal_, (0.5, 2.0))):
        got = ours(torch.empty(dims, dtype=dtype), 77, offsets, global_shape, *args)
        want = reference(torch.empty(dims, dtype=dtype), 77, offsets, global_shape, *args)
        assert torch.equal(got, want), ours.__name__


@settings(max_examples=examples(40), deadline=None)
@given(hst.data())
def test_any_block_equals_the_same_block_of_the_whole(data):
    ndim = data.draw(hst.integers(1, 3))
    shape = tuple(data.draw(hst.integers(1, 9)) for _ in range(ndim))
    offsets = tuple(data.draw(hst.integers(0, n - 1)) for n in shape)
    dims = tuple(data.draw(hst.integers(0, n - o)) for n, o in zip(shape, offsets))
    seed = data.draw(hst.integers(0, 2**63 - 1))
    for fill in (_fill.fill_uniform_, _fill.fill_normal_, _fill.fill_trunc_normal_):
        whole = fill(torch.empty(shape, dtype=torch.float64), seed, (0,) * ndim, shape)
        block = fill(torch.empty(dims, dtype=torch.float64), seed, offsets, shape)
        assert torch.equal(block, _slice(whole, offsets, dims)), fill.__name__


def test_non_contiguous_target_gets_the_same_values():
    whole = _fill.fill_uniform_(torch.empty(4, 6), 3, (0, 0), (4, 6))
    target = torch.empty(6, 4).t()
    _fill.fill_uniform_(target, 3, (0, 0), (4, 6))
    assert torch.equal(target, whole)


def test_distributions():
    u = _fill.fill_uniform_(torch.empty(200_000), 1, (0,), (200_000,), -2.0, 4.0)
    assert -2.0 <= u.min() and u.max() < 4.0 and abs(u.mean().item() - 1.0) < 0.02
    n = _fill.fill_normal_(torch.empty(200_000), 2, (0,), (200_000,), 1.0, 3.0)
    assert abs(n.mean().item() - 1.0) < 0.03 and abs(n.std().item() - 3.0) < 0.03
    t = _fill.fill_trunc_normal_(torch.empty(200_000), 3, (0,), (200_000,), 0.0, 1.0, -2.0, 2.0)
    assert -2.0 <= t.min() and t.max() <= 2.0 and abs(t.std().item() - 0.8796) < 0.01


# -- torch.nn.init interception ---------------------------------------------------------------------

def _full_and_block(rule, global_shape, offsets, dims):  # type: ignore[no-untyped-def]
    """``rule`` applied to the whole registered tensor and to one registered block of it."""
    values = []
    for o, d in (((0,) * len(global_shape), global_shape), (offsets, dims)):
        t = torch.empty(d)
        ctx = _init_model.LayoutInvariantInit(seed=5)
        ctx.register(t, "w", global_shape, o)
        with ctx:
            rule(t)
        values.append(t)
    return values


@pytest.mark.parametrize("rule", [
    pytest.param(lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)), id="kaiming_uniform"),
    pytest.param(lambda t: nn.init.kaiming_normal_(t, mode="fan_out"), id="kaiming_normal"),
    pytest.param(nn.init.xavier_uniform_, id="xavier_uniform"),
    pytest.param(nn.init.xavier_normal_, id="xavier_normal"),
    pytest.param(lambda t: nn.init.trunc_normal_(t, std=0.02), id="trunc_normal"),
    pytest.param(lambda t: nn.init.uniform_(t, -1, 1), id="uniform"),
    pytest.param(nn.init.normal_, id="normal"),
    pytest.param(lambda t: t.data.normal_(0, 0.1), id="tensor-normal-on-data"),
    pytest.param(lambda t: t.uniform_(), id="tensor-uniform"),
    pytest.param(lambda t: nn.init.constant_(t, 0.5), id="constant"),
])
@pytest.mark.parametrize(("offsets", "dims"), [((0, 16), (64, 16)), ((40, 0), (24, 32))], ids=["cols", "rows"])
def test_rules_fill_blocks_as_slices_of_the_global_tensor(rule, offsets, dims):
    whole, block = _full_and_block(rule, (64, 32), offsets, dims)
    assert torch.equal(block, _slice(whole, offsets, dims))


def test_fans_come_from_the_global_shape():
    ctx = _init_model.LayoutInvariantInit(seed=0)
    block = torch.empty(64, 8)  # 8 of 512 input features
    ctx.register(block, "fc.weight", (64, 512), (0, 504))
    with ctx:
        assert nn.init._calculate_fan_in_and_fan_out(block) == (512, 64)
        assert nn.init._calculate_fan_in_and_fan_out(block.data) == (512, 64)
        nn.init.kaiming_uniform_(block, a=math.sqrt(5))
    bound = 1 / math.sqrt(512)
    assert block.abs().max() <= bound and block.abs().max() > 0.9 * bound
    assert nn.init._calculate_fan_in_and_fan_out(block) == (8, 64)  # patches are gone


@pytest.mark.parametrize("rule", [
    pytest.param(lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)), id="kaiming_uniform"),
    pytest.param(lambda t: nn.init.trunc_normal_(t, std=0.02, a=-0.04, b=0.04), id="trunc_normal"),
    pytest.param(lambda t: nn.init.normal_(t, 0.0, 0.01), id="normal"),
])
def test_unseeded_mode_draws_blocks_with_torch_rng_and_global_fans(rule):
    def draw(offsets):  # type: ignore[no-untyped-def]
        block = nn.Parameter(torch.empty(64, 8))
        ctx = _init_model.LayoutInvariantInit(seed=11, invariant=False)
        ctx.register(block, "fc.weight", (64, 512), offsets)
        with ctx:
            rule(block)
        return block

    first, again, other = draw((0, 0)), draw((0, 0)), draw((0, 8))
    assert torch.equal(first, again) and not torch.equal(first, other)  # replicas agree, blocks differ
    assert not first.requires_grad or first.grad_fn is None
    assert first.abs().max() <= max(1 / math.sqrt(512), 0.04)


def test_linear_bias_bound_uses_the_global_fan_in():
    layer = nn.Linear(8, 4)
    weight = nn.Parameter(torch.empty(4, 2))  # columns 6..7 of an (4, 8) weight
    layer.weight = weight
    ctx = _init_model.LayoutInvariantInit(seed=0)
    ctx.register(weight, "weight", (4, 8), (0, 6))
    ctx.register(layer.bias, "bias", (4,), (0,))
    with ctx:
        layer.reset_parameters()
    full = nn.Linear(8, 4)
    ctx = _init_model.LayoutInvariantInit(seed=0)
    ctx.register(full.weight, "weight", (4, 8), (0, 0))
    ctx.register(full.bias, "bias", (4,), (0,))
    with ctx:
        full.reset_parameters()
    assert torch.equal(layer.bias, full.bias) and torch.equal(layer.weight, full.weight[:, 6:])


@pytest.mark.parametrize("rule", [lambda t: nn.init.orthogonal_(t), lambda t: nn.init.eye_(t),
                                  lambda t: nn.init.sparse_(t, 0.5)], ids=["orthogonal", "eye", "sparse"])
def test_whole_tensor_rules_are_refused_for_blocks_and_run_on_whole_tensors(rule):
    block = torch.empty(4, 8)
    ctx = _init_model.LayoutInvariantInit(seed=0)
    ctx.register(block, "proj.weight", (8, 8), (4, 0))
    with ctx, pytest.raises(ValueError, match=r"needs the whole of parameter 'proj.weight' \(shape \(8, 8\)\)"):
        rule(block)
    whole = torch.empty(8, 8)
    ctx = _init_model.LayoutInvariantInit(seed=0)
    ctx.register(whole, "proj.weight", (8, 8), (0, 0))
    with ctx:
        rule(whole)


def test_unregistered_tensors_use_torch_rng():
    ctx = _init_model.LayoutInvariantInit(seed=0)
    with ctx:
        torch.manual_seed(0)
        a = nn.init.uniform_(torch.empty(5))
    torch.manual_seed(0)
    assert torch.equal(a, nn.init.uniform_(torch.empty(5)))


def test_repeated_rules_on_one_parameter_draw_new_values():
    t = torch.empty(100)
    ctx = _init_model.LayoutInvariantInit(seed=0)
    ctx.register(t, "p", (100,), (0,))
    with ctx:
        first = nn.init.normal_(t).clone()
        second = nn.init.normal_(t).clone()
    assert not torch.equal(first, second)


# -- shard_model in a world of one ---------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=2)
        self.fc = nn.Linear(6, 9)
        self.norm = nn.LayerNorm(9)
        self.register_buffer("scale", torch.ones(9))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(self.emb(idx))) * self.scale


def _meta_net(seed: int) -> Net:
    with torch.device("meta"):
        net = Net()
    return st.shard_model(net, DevicePlacement("cpu"), seed=seed)  # type: ignore[return-value]


def test_meta_model_is_materialized_by_its_own_init_rules():
    net = _meta_net(3)
    assert all(not p.is_meta and isinstance(p, nn.Parameter) for p in net.parameters())
    assert torch.equal(net.emb.weight[2], torch.zeros(6))
    assert torch.equal(net.norm.weight, torch.ones(9)) and torch.equal(net.norm.bias, torch.zeros(9))
    assert net.fc.weight.abs().max() <= 1 / math.sqrt(6) and net.fc.bias.abs().max() <= 1 / math.sqrt(6)
    assert abs(net.emb.weight.std().item() - 1.0) < 0.35
    assert torch.equal(net.scale, torch.ones(9))  # a buffer-only module's reset_parameters runs too
    assert net(torch.tensor([[1, 2]])).shape == (1, 2, 9)


def test_seeded_values_depend_only_on_the_seed():
    a, b, c = _meta_net(3), _meta_net(3), _meta_net(4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.numel() > 9:
            assert not torch.equal(pa, pc), name
    assert torch.equal(a.fc.weight, _random.uniform_(torch.empty(9, 6), _random.derive_seed(3, "fc.weight"),
                                                     (0, 0), (9, 6), -1 / math.sqrt(6), 1 / math.sqrt(6)))


def test_state_dict_round_trip_in_a_world_of_one():
    net = _meta_net(3)
    sd = net.state_dict()
    assert isinstance(sd["fc.weight"], st.ShardedTensor) and torch.equal(sd["scale"], net.scale)
    other = _meta_net(4)
    other.load_state_dict(sd)
    assert torch.equal(other.fc.weight, net.fc.weight)
    other.load_state_dict({k: v.full_tensor() if isinstance(v, st.ShardedTensor) else v for k, v in
                           _meta_net(5).state_dict().items()})
    assert torch.equal(other.fc.weight, _meta_net(5).fc.weight)


def test_meta_buffers_without_an_init_rule_become_zeros_with_a_warning():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("factor", torch.full((3,), 2.0))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.warns(UserWarning, match=r"module '1' \(Scale\): buffers \['factor'\] were on the meta device"):
        st.shard_model(model, DevicePlacement("cpu"), seed=0)
    assert torch.equal(model[1].factor, torch.zeros(3))


def test_seed_needs_a_meta_model():
    with pytest.raises(ValueError, match="seed= initializes parameters on the meta device"):
        st.shard_model(Net(), DevicePlacement("cpu"), seed=1)


@pytest.mark.parametrize("make", [
    pytest.param(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), id="sgd-momentum"),
    pytest.param(lambda p: torch.optim.Adam(p, lr=0.01), id="adam"),
    pytest.param(lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), id="adamw"),
])
def test_optimizer_state_round_trip_in_a_world_of_one(make):
    net = _meta_net(3)
    optim = make(net.parameters())
    template = st.optim_state_dict(net, optim)
    assert not optim.state  # the template leaves a fresh optimizer fresh
    assert set(template["state"]) == {n for n, _ in net.named_parameters()}
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())
    for _ in range(2):
        optim.zero_grad()
        net(torch.tensor([[1, 3, 5]])).square().mean().backward()
        optim.step()
    state = st.optim_state_dict(net, optim)
    entry = state["state"]["fc.weight"]
    assert any(isinstance(v, st.ShardedTensor) for v in entry.values())
    if "step" in entry:
        assert entry["step"] == 2.0 and isinstance(entry["step"], float)
    assert state["param_groups"][0]["params"] == [n for n, _ in net.named_parameters()]

    copy = _meta_net(9)
    copy.load_state_dict(net.state_dict())
    copy_optim = make(copy.parameters())
    st.load_optim_state_dict(copy, copy_optim, state)
    for model, opt in ((net, optim), (copy, copy_optim)):
        opt.zero_grad()
        model(torch.tensor([[4, 2]])).square().mean().backward()
        opt.step()
    for (name, p), q in zip(net.named_parameters(), copy.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(("dtype", "shape", "contiguous"), [
    pytest.param(torch.float32, (300, 700), True, id="float32-numpy"),
    pytest.param(torch.float64, (100_000,), True, id="float64-numpy"),
    pytest.param(torch.float16, (300, 70), True, id="float16-torch-generator"),
    pytest.param(torch.float32, (70, 300), False, id="strided-torch-generator"),
])
def test_draw_uniform_is_seeded_bounded_and_uniform(dtype, shape, contiguous):  # type: ignore[no-untyped-def]
    def draw(seed: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        if not contiguous:
            t = torch.empty(tuple(reversed(shape)), dtype=dtype).t()
        return _fill.draw_uniform_(t, seed, -0.25, 0.75)

    first, again, other = draw(5), draw(5), draw(6)
    assert torch.equal(first, again) and not torch.equal(first, other)
    values = first.double()
    assert values.min() >= -0.25 and values.max() < 0.75
    # Mean and spread of U[-0.25, 0.75): 0.25 and 1/sqrt(12); 5 standard errors of slack.
    n = values.numel()
    assert abs(values.mean().item() - 0.25) < 5 / math.sqrt(12 * n)
    assert abs(values.std().item() - 1 / math.sqrt(12)) < 0.01
    # Every tenth of the range gets its share, within 5 standard deviations of a bin count.
    counts = torch.histc(values, bins=10, min=-0.25, max=0.75)
    assert (counts - n / 10).abs().max() < 5 * math.sqrt(n / 10)


# -- which code initializes a meta model ----------------------------------------------------------------

class _Titan(torch.nn.Module):
    """A torchtitan-style model: plain parameters, one init_weights() for the whole model."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(4, 3))
        self.b = torch.nn.Parameter(torch.empty(3))

    def init_weights(self) -> None:
        torch.nn.init.normal_(self.w, std=0.5)
        torch.nn.init.constant_(self.b, 2.0)


def test_a_models_init_weights_initializes_it_and_is_layout_invariant_with_seed():
    with torch.device("meta"):
        model = _Titan()
    st.shard_model(model, DevicePlacement("cpu"), seed=3)
    assert torch.equal(model.b.detach(), torch.full((3,), 2.0))
    expected = torch.empty(4, 3)
    _fill.fill_normal_(expected, _random.derive_seed(3, "w"), (0, 0), (4, 3), 0.0, 0.5)
    assert torch.equal(model.w.detach(), expected)


def test_init_callable_runs_for_every_module_and_init_false_leaves_parameters_alone():
    seen = []

    def init(module: torch.nn.Module) -> None:
        seen.append(type(module).__name__)
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.ones_(module.weight)
            torch.nn.init.zeros_(module.bias)

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    st.shard_model(model, DevicePlacement("cpu"), init=init)
    assert seen == ["Linear", "Linear"]
    assert torch.equal(model[0].weight.detach(), torch.ones(2, 3))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    st.shard_model(model, DevicePlacement("cpu"), init=False)
    assert model[0].weight.shape == (2, 3) and not model[0].weight.is_meta
    with pytest.raises(TypeError, match=r"init must be None, False or a callable taking a module, got str"):
        st.shard_model(torch.nn.Linear(2, 2, device="meta"), DevicePlacement("cpu"), init="normal")
