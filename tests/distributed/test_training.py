"""Training a sharded model on real Gloo ranks, against single-process references.

* clipping: ``st.clip_grad_norm_`` on 3 ranks (uneven splits on both dimensions of Linear
  and Embedding weights, a replicated placement, whole layer-norm parameters) gives the
  unsharded model's norm and clipped gradients for the 1-, 2-, 3- and inf-norms; the norm is
  bit-identical on every rank and replicated gradients stay bit-identical, while
  ``torch.nn.utils.clip_grad_norm_`` gives each rank a different norm; in the same spawn,
  ``copy.deepcopy`` of that sharded model keeps every parameter's record: the copy's logits
  and gradients are the original's bit for bit (and the unsharded model's), its state_dict
  holds the same ShardedTensors, and it owns its data; partial values loaded into a parameter
  whole on every rank are summed first;
* the training state: train on 2 ranks, ``get_state_dict`` + ``checkpoint.save``; resume with
  ``checkpoint.load`` + ``set_state_dict`` on 2 ranks (same layout: losses bit for bit those
  of an uninterrupted run) and on 4 ranks with another layout (losses equal within float
  rounding), all matching a single-process run;
* 2-D parallelism: 4 ranks = 2 data-parallel replicas of a 2-rank tensor-parallel model,
  gradients averaged with ``st.all_reduce_grads``, match the unsharded model trained on the
  global batch over several steps, replicas bit-identical; one replica saves the training
  state in its tensor-parallel group and every replica loads it back exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import checkpoint
import sharded_tensor as st
from sharded_tensor._model.record import record_of, sharded_parameters
from sharding import ShardMetadata, composite, single_split
from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed

VOCAB, DIM, HIDDEN = 29, 12, 20
NORMS = (2.0, 1.0, 3.0, float("inf"))


def _lm() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM),
                         nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))


def _build(spec, *, seed: int = 0, group=None) -> nn.Module:  # noqa: ANN001
    with torch.device("meta"):
        model = _lm()
    st.shard_model(model, spec, seed=seed, process_group=group)
    return model


def _tokens(step: int, n: int = 24) -> torch.Tensor:
    return (torch.arange(n + 1) * (step + 3) + step) % VOCAB


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:-1]), tokens[1:])


def _full_grads(model: nn.Module, group=None) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Every parameter's full gradient (split ones gathered), by name."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    out = {}
    for mod_name, module in model.named_modules():
        sharded = sharded_parameters(module)
        for attr, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{attr}" if mod_name else attr
            sp = sharded.get(attr)
            out[name] = sp.wrap(p.grad, rank).full_tensor() if sp is not None else p.grad.clone()
    return out


def _uneven_spec(ranks: list[str]):  # noqa: ANN202
    return composite(**{
        "0.weight": single_split(0, ranks, [13, 0, 16]),  # vocabulary rows, one rank holds none
        "1": single_split(0, ranks, [9, 7, 4]),          # output features
        "3.weight": single_split(1, ranks, [9, 7, 4]),   # input features
        "5.weight": single_split(1, ranks),              # chunked: 4/4/4
        "5.bias": "cpu",                                 # a replica on every rank
    })


def _reference_clip(norm_type: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _build(composite())
    _loss(model, _tokens(0)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type)
    return norm, {n: p.grad for n, p in model.named_parameters()}


def _clip_on_ranks(rank: int, world_size: int) -> dict[str, object]:
    ranks = [f"rank:{r}/cpu" for r in range(world_size)]
    results: dict[str, object] = {}
    for norm_type in NORMS:
        model = _build(_uneven_spec(ranks))
        _loss(model, _tokens(0)).backward()
        as_list = _build(_uneven_spec(ranks))
        _loss(as_list, _tokens(0)).backward()
        torch_norm = torch.nn.utils.clip_grad_norm_(_build(_uneven_spec(ranks)).parameters(), 1e9)  # no grads: 0
        assert torch_norm == 0
        local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad, norm_type)
                                                      for p in model.parameters() if p.numel()]), norm_type)
        norm = st.clip_grad_norm_(model, 0.05, norm_type)
        same = st.clip_grad_norm_(list(as_list.parameters()), 0.05, norm_type)
        assert torch.equal(norm, same)
        everyone = [torch.empty_like(norm) for _ in range(world_size)]
        dist.all_gather(everyone, norm)
        assert all(torch.equal(n, norm) for n in everyone), everyone  # bit-identical on every rank
        for p_a, p_b in zip(model.parameters(), as_list.parameters()):
            assert torch.equal(p_a.grad, p_b.grad)
        # Whole parameters (layer norm, "5.bias" replica, ...) keep bit-identical gradients.
        whole = {n: p.grad for n, p in model.named_parameters() if n.startswith("4.") or n == "5.bias"}
        for name, grad in whole.items():
            copies = [torch.empty_like(grad) for _ in range(world_size)]
            dist.all_gather(copies, grad)
            assert all(torch.equal(c, grad) for c in copies), name
        results[str(norm_type)] = (norm, local, _full_grads(model))
    results["copy"] = _deepcopy_on_ranks(ranks)
    return results


def _deepcopy_on_ranks(ranks: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``copy.deepcopy`` of a sharded model (an EMA or teacher copy) keeps every parameter's record."""
    model = _build(_uneven_spec(ranks))
    twin = copy.deepcopy(model)
    tokens = _tokens(1)
    logits, twin_logits = model(tokens[:-1]), twin(tokens[:-1])
    assert torch.equal(twin_logits, logits)
    F.cross_entropy(logits, tokens[1:]).backward()
    F.cross_entropy(twin_logits, tokens[1:]).backward()
    split = 0
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert q is not p and (q.numel() == 0 or q.data_ptr() != p.data_ptr()), name
        assert torch.equal(q.grad, p.grad), name
        assert record_of(q) is record_of(p), name  # a record names a layout: original and copy share it
        split += record_of(p) is not None
    assert split == 6  # every parameter of _uneven_spec
    state, twin_state = model.state_dict(), twin.state_dict()
    assert sum(isinstance(v, st.ShardedTensor) for v in twin_state.values()) == 6
    for key, value in state.items():
        assert type(twin_state[key]) is type(value), key
        if isinstance(value, st.ShardedTensor):
            assert twin_state[key].sharding_metadata() == value.sharding_metadata(), key
            assert torch.equal(twin_state[key].full_tensor(), value.full_tensor()), key
    with torch.no_grad():
        twin[1].weight.add_(1.0)  # the copy owns its data
    assert not torch.equal(twin[1].weight, model[1].weight)
    # Partial values loaded into a parameter whole on every rank ("5.bias") are summed first, not
    # taken addend by addend (their full-size shards are the replicas' shards).
    want = torch.arange(float(VOCAB))
    addend = want * (0.5 if dist.get_rank() == 0 else 0.25)
    pending = st.ShardedTensor.from_local_shards(
        [st.Shard(addend, ShardMetadata((0,), (VOCAB,), ranks[dist.get_rank()]))], (VOCAB,), reduce_op="sum")
    twin.load_state_dict({**twin_state, "5.bias": pending})
    assert torch.equal(twin[5].bias, want)
    return twin_logits.detach(), _full_grads(twin)


def test_clip_grad_norm_matches_unsharded_model_on_three_ranks():
    results = run_distributed(_clip_on_ranks, 3)
    for norm_type in NORMS:
        expected_norm, expected_grads = _reference_clip(norm_type)
        assert expected_norm > 0.05  # clipping happens
        locals_ = []
        for rank_result in results:
            norm, local, grads = rank_result[str(norm_type)]
            locals_.append(local)
            torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
            assert grads.keys() == expected_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-8, msg=name)
        # What torch's own clipping would use: a different norm on each rank.
        assert len({float(x) for x in locals_}) == 3
        assert all(float(x) < float(expected_norm) for x in locals_) or norm_type == float("inf")
    # The deep copy of a sharded model computes the unsharded model's logits and gradients.
    reference = _build(composite())
    tokens = _tokens(1)
    expected_logits = reference(tokens[:-1])
    F.cross_entropy(expected_logits, tokens[1:]).backward()
    for rank_result in results:
        logits, grads = rank_result["copy"]
        torch.testing.assert_close(logits, expected_logits.detach(), rtol=1e-5, atol=1e-6)
        assert grads.keys() == {n for n, _ in reference.named_parameters()}
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


# -- get_state_dict / set_state_dict through a checkpoint --------------------------------------------

STEPS = 6
RESUME_AT = 3


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(model, _tokens(step))
        loss.backward()
        st.clip_grad_norm_(model, 0.5)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _spec_a(world_size: int):  # noqa: ANN202
    ranks = [f"rank:{r}/cpu" for r in range(world_size)]
    return composite(**{"0": single_split(0, ranks), "1": single_split(0, ranks), "3.weight": single_split(1, ranks),
                        "5": single_split(0, ranks)})


def _spec_b(world_size: int):  # noqa: ANN202
    ranks = [f"rank:{r}/cpu" for r in range(world_size)]
    return composite(**{"0": single_split(1, ranks), "1.weight": single_split(1, ranks),
                        "5.weight": single_split(1, ranks, [2, 3, 4, 3])})


def _first_half(rank: int, world_size: int, path: str) -> tuple[list[float], list[float]]:
    model = _build(_spec_a(world_size))
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)
    uninterrupted = _train(model, optim, range(STEPS))

    model = _build(_spec_a(world_size))
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)
    first = _train(model, optim, range(RESUME_AT))
    checkpoint.save({**st.get_state_dict(model, optim), "step": RESUME_AT}, path)
    return uninterrupted, first


def _second_half(rank: int, world_size: int, path: str, same_layout: bool) -> list[float]:
    model = _build(_spec_a(world_size) if same_layout else _spec_b(world_size), seed=7)  # other values
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)  # the checkpoint's hyper-parameters win
    state = {**st.get_state_dict(model, optim), "step": 0}
    checkpoint.load(state, path)
    st.set_state_dict(model, optim, state)
    assert state["step"] == RESUME_AT
    return _train(model, optim, range(RESUME_AT, STEPS))


def test_resume_from_get_state_dict_on_any_layout(tmp_path):
    path = str(tmp_path / "ckpt")
    uninterrupted, first = run_distributed(_first_half, 2, path)[0]
    assert first == uninterrupted[:RESUME_AT]
    same = run_distributed(_second_half, 2, path, True)
    assert same[0] == same[1]
    assert first + same[0] == uninterrupted  # same layout: bit for bit
    other = run_distributed(_second_half, 4, path, False)
    assert all(losses == other[0] for losses in other)
    torch.testing.assert_close(torch.tensor(other[0]), torch.tensor(uninterrupted[RESUME_AT:]), rtol=1e-5, atol=0)

    # And all of it is the unsharded model's training.
    model = _build(composite())
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)
    reference = _train(model, optim, range(STEPS))
    torch.testing.assert_close(torch.tensor(uninterrupted), torch.tensor(reference), rtol=1e-5, atol=0)


# -- 2-D: data-parallel replicas of a tensor-parallel model --------------------------------------------

TP, DP, STEPS_2D, BATCH = 2, 2, 4, 16


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, 9), generator=g)


def _batch_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def _two_d(rank: int, world_size: int, path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    # rank = dp * TP + tp: tensor-parallel groups {0, 1} and {2, 3}, data-parallel groups {0, 2} and {1, 3}.
    tp_groups = [dist.new_group([d * TP + t for t in range(TP)]) for d in range(DP)]
    dp_groups = [dist.new_group([d * TP + t for d in range(DP)]) for t in range(TP)]
    dp, tp = divmod(rank, TP)
    tp_group, dp_group = tp_groups[dp], dp_groups[tp]
    ranks = [f"rank:{r}/cpu" for r in range(TP)]  # ranks of the tensor-parallel group
    spec = composite(**{"0": single_split(0, ranks), "1": single_split(0, ranks), "3.weight": single_split(1, ranks),
                        "5.weight": single_split(1, ranks)})
    model = _build(spec, group=tp_group)
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)
    losses = []
    for step in range(STEPS_2D):
        mine = _batch(step).chunk(DP)[dp]  # this replica's half of the global batch
        loss = _batch_loss(model, mine)
        loss.backward()
        st.all_reduce_grads(model, dp_group)
        st.clip_grad_norm_(model, 0.5)
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        losses.append(total.item() / DP)
    sd = model.state_dict()
    full = {name: (v.full_tensor() if isinstance(v, st.ShardedTensor) else v.clone()) for name, v in sd.items()}

    # One replica saves (the others hold the same values); every replica loads, in its own group.
    if dp == 0:
        checkpoint.save({**st.get_state_dict(model, optim), "step": STEPS_2D}, path, process_group=tp_group)
    dist.barrier()
    fresh = _build(spec, seed=9, group=tp_group)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    state = {**st.get_state_dict(fresh, fresh_optim), "step": 0}
    checkpoint.load(state, path, process_group=tp_group)
    st.set_state_dict(fresh, fresh_optim, state)
    assert state["step"] == STEPS_2D
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert all(torch.equal(a, b) for a, b in zip(optim.state[p].values(), fresh_optim.state[q].values()))
    return losses, full


def test_data_parallel_replicas_of_a_tensor_parallel_model_match_the_unsharded_model(tmp_path):
    results = run_distributed(_two_d, TP * DP, str(tmp_path / "ckpt"))
    model = _build(composite())
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)
    reference = []
    for step in range(STEPS_2D):
        loss = _batch_loss(model, _batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optim.step()
        optim.zero_grad()
        reference.append(loss.item())
    first_losses, first_weights = results[0]
    for losses, weights in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=0)
        for name, value in weights.items():
            assert torch.equal(value, first_weights[name]), name  # replicas identical, bit for bit
            torch.testing.assert_close(value, model.state_dict()[name], rtol=1e-4, atol=1e-5, msg=name)
