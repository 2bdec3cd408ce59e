"""Training helpers in one process (a world of one): clipping against torch, the optimizer-order check.

With nothing split, ``st.clip_grad_norm_`` must give torch's result bit for bit (it follows
torch's arithmetic). An optimizer built before ``shard_model`` must refuse to step, whether
the model was on the meta device or had real weights; one built after must train.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sharded_tensor as st
from sharding import composite


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _backward(model: nn.Module) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    (model(x) ** 3).sum().backward()


@pytest.mark.parametrize("norm_type", [pytest.param(2.0, id="l2"), pytest.param(1.0, id="l1"),
                                       pytest.param(3.0, id="l3"), pytest.param(float("inf"), id="inf")])
@pytest.mark.parametrize("as_params", [pytest.param(False, id="model"), pytest.param(True, id="parameters")])
def test_clip_grad_norm_matches_torch_bit_for_bit_when_nothing_is_split(norm_type, as_params):
    reference = _model()
    model = copy.deepcopy(reference)
    st.shard_model(model, composite())
    _backward(reference)
    _backward(model)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5, norm_type)
    got = st.clip_grad_norm_(list(model.parameters()) if as_params else model, 0.5, norm_type)
    assert expected > 0.5  # the gradients really are clipped
    assert torch.equal(got, expected)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_clip_grad_norm_options_and_errors():
    model = _model()
    with pytest.raises(ValueError, match=r"norm_type=0.0 is not supported"):
        st.clip_grad_norm_(model, 1.0, 0)
    assert torch.equal(st.clip_grad_norm_(model, 1.0), torch.tensor(0.0))  # no gradients yet
    _backward(model)
    model[0].weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"not finite; error_if_nonfinite=True"):
        st.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    with pytest.raises(TypeError, match=r"item 1 is a str"):
        st.clip_grad_norm_([model[0].weight, "bias"], 1.0)


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


@pytest.mark.parametrize("meta", [pytest.param(True, id="meta-model"), pytest.param(False, id="real-weights")])
def test_optimizer_created_before_shard_model_fails_at_first_step(meta):
    model = _meta_model() if meta else nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    st.shard_model(model, composite(), **({"seed": 0} if meta else {"src_rank": 0}))
    model(torch.ones(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\): this optimizer holds 4 parameter\(s\) that "
                                           r"st.shard_model replaced, '0.weight' \((meta|cpu) \(4, 4\)\).*"
                                           r"Create the optimizer after shard_model"):
        early.step()
    with pytest.raises(RuntimeError, match="created before shard_model"):
        st.get_state_dict(model, early)

    late = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    late.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_optimizer_check_leaves_other_optimizers_alone():
    st.shard_model(_meta_model(), composite(), seed=0)  # replaces parameters: the check is armed
    plain = nn.Linear(3, 3)
    optim = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.ones(1, 3)).sum().backward()
    before = plain.weight.detach().clone()
    optim.step()
    assert not torch.equal(plain.weight, before)


def test_set_state_dict_names_missing_entries():
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = st.get_state_dict(model, optim)
    assert sorted(state) == ["model", "optim"]
    assert sorted(st.get_state_dict(model)) == ["model"]
    with pytest.raises(KeyError, match=r"state has no \['optim'\] entry"):
        st.set_state_dict(model, optim, {"model": state["model"]})
    st.set_state_dict(model, None, {"model": state["model"]})


def _layout(shards: list[tuple[tuple[int, int], tuple[int, int], int]], size: tuple[int, int]):  # noqa: ANN202
    from sharded_tensor._model.parallel import classify
    from sharded_tensor._model.record import ShardedParameter
    from sharding import EnumerableShardingSpec, ShardMetadata

    spec = EnumerableShardingSpec([ShardMetadata(o, d, f"rank:{r}/cpu") for o, d, r in shards])
    world = 1 + max(r for _, _, r in shards)
    return ShardedParameter(classify("w", spec.build_metadata(size, torch.float32, world_size=world), world), spec,
                            None), world


@pytest.mark.parametrize(("shards", "kind"), [
    pytest.param([((0, 0), (3, 4), 0), ((3, 0), (3, 4), 1), ((6, 0), (4, 4), 2)], "split", id="rows"),
    pytest.param([((0, 0), (10, 4), 0), ((0, 0), (10, 4), 1)], "replicated", id="replicas"),
    pytest.param([((0, 0), (5, 4), 0), ((0, 0), (5, 4), 1), ((5, 0), (5, 4), 2)], "overlapping", id="half-replicated"),
    pytest.param([((0, 0), (5, 4), 0), ((0, 0), (5, 4), 1), ((5, 0), (5, 4), 1), ((0, 0), (5, 4), 2)], "overlapping",
                 id="overlapping-blocks"),  # rank 1's block covers rank 0's and more: it owns only the rest
])
def test_every_element_is_owned_by_exactly_one_rank(shards, kind):
    from sharded_tensor._model.training import _owned

    sp, world = _layout(shards, (10, 4))
    assert sp.layout.kind == kind
    full = torch.arange(40.0).reshape(10, 4)
    owned = []
    for rank in range(world):
        (r0, c0), (nr, nc) = sp.box(rank)
        mine = _owned(full[r0:r0 + nr, c0:c0 + nc], sp, rank)
        if mine is not None:
            owned.append(mine.reshape(-1))
    assert torch.equal(torch.sort(torch.cat(owned)).values, torch.arange(40.0))


def test_all_reduce_grads_in_a_world_of_one():
    model = _model()
    _backward(model)
    before = [p.grad.clone() for p in model.parameters()]
    st.all_reduce_grads(model, None)
    st.all_reduce_grads(model.parameters(), None, op="sum")
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match=r"op='max' is not supported; use 'mean' or 'sum'"):
        st.all_reduce_grads(model, None, op="max")  # type: ignore[arg-type]


def test_optimizer_check_looks_at_every_param_group():
    """A replaced parameter in the second group (the first group is fine) still refuses the step."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    old = list(model[1].parameters())
    st.shard_model(model, composite(), src_rank=0)
    model(torch.ones(3, 4)).sum().backward()
    mixed = torch.optim.SGD([{"params": list(model[0].parameters())}, {"params": old, "lr": 0.01}], lr=0.1)
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): this optimizer holds 2 parameter\(s\) that st.shard_model "
                                           r"replaced, '1.weight' \(cpu \(2, 4\)\), '1.bias'"):
        mixed.step()


def test_one_record_per_parameter_and_nothing_installed_in_torch():
    """The parameter and its module hold the same record; load_state_dict(assign=True) keeps it; no torch hook."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from sharded_tensor._model.record import record_of, sharded_parameters
    from sharding import single_split

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    st.shard_model(model, composite(**{"0.weight": single_split(0, ["rank:0/cpu"])}), src_rank=0)
    assert not _global_optimizer_pre_hooks
    record = record_of(model[0].weight)
    assert record is not None and sharded_parameters(model[0])["weight"] is record
    assert record_of(model[0].bias) is None and sharded_parameters(model[1]) == {}
    state = model.state_dict()
    assert isinstance(state["0.weight"], st.ShardedTensor)
    model.load_state_dict(state, assign=True)
    assert record_of(model[0].weight) is record
    assert isinstance(model.state_dict()["0.weight"], st.ShardedTensor)
    with pytest.raises(RuntimeError, match=r"SGD.zero_grad\(\): this optimizer holds 4 parameter\(s\) that "
                                           r"st.shard_model replaced"):
        early.zero_grad()


def test_shard_parameter_refuses_meta_values_on_the_source_rank():
    from sharding import single_split

    layer = _meta_model()[0]
    with pytest.raises(ValueError, match=r"src_rank=0 has parameters on the meta device \(\['weight'\]\); "
                                         r"shard_parameter takes the values from the source rank.*use shard_model\(\)"):
        st.shard_parameter(layer, "weight", single_split(0, ["rank:0/cpu"]))
    assert layer.weight.is_meta


def test_deepcopy_and_pickle_keep_every_record():
    """An EMA or teacher copy (``copy.deepcopy``) and ``pickle`` keep the records (state_dicts of ShardedTensors)."""
    import pickle

    from sharded_tensor._model.record import record_of
    from sharding import single_split

    ranks = ["rank:0/cpu"]
    model = _model()
    st.shard_model(model, composite(**{"0": single_split(0, ranks), "3.weight": single_split(1, ranks)}))
    split = [n for n, p in model.named_parameters() if record_of(p) is not None]
    assert split == ["0.weight", "0.bias", "3.weight"]
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), copy.deepcopy(model[0])):
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert q is not p and (record_of(q) is not None) == (name in split), name
        state = twin.state_dict()
        assert isinstance(state["weight" if isinstance(twin, nn.Linear) else "0.weight"], st.ShardedTensor)
    # The copy's record follows the parameter its module holds at copy time.
    model[3].weight = nn.Parameter(torch.zeros(4, 16))
    assert record_of(copy.deepcopy(model)[3].weight) is None
