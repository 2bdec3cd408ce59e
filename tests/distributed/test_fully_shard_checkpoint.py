"""Checkpoints of fully sharded models move between layouts and world sizes, with the optimizer state.

An MLP with uneven sizes (its blocks fully sharded, then the root; with 4 ranks the last
layer's 3 rows leave one rank without any) and AdamW, the training state from
``st.get_state_dict`` (the transformers Llama trains in ``test_fully_shard``):

1. one process (a plain model) trains 2 steps on the whole batch and saves;
2. 4 ranks, fully sharded within {0, 1} and {2, 3} (``ranks=``) with gradients averaged
   across the two groups by ``st.all_reduce_grads``, load it (bit for bit), train 1 step on
   a quarter of the batch each (within 1e-6 of one process) and save; one process loads that
   bit for bit;
3. the same on 4 ranks as 2 x 2: tensor parallel within {0, 1} and {2, 3} (``shard_model``),
   fully sharded over {0, 2} and {1, 3} (the default ``ranks`` of a tensor-parallel model);
4. 4 fully sharded ranks load it (every tensor of model and optimizer state equal to the
   saved one, bit for bit, on every rank), train 2 steps on a quarter of the batch each
   and save; loading it into a bfloat16 model raises ``CheckpointError`` naming the dtypes;
5. one process loads that checkpoint into a plain model: bit for bit what the 4 ranks held,
   and within 1e-6 of one process trained 4 steps without interruption; ``consolidate``
   writes the same values;
6. 2 fully sharded ranks load it (bit for bit again), ``collect_state_dict`` gives the same
   full tensors, train 1 step on half the batch each and save; one process loads that:
   bit for bit what the 2 ranks held, within 1e-6 of the uninterrupted 5-step run;
7. FSDP2 (torch's ``fully_shard`` over the 4 ranks, its DTensor state dicts from
   ``get_model_state_dict`` / ``get_optimizer_state_dict``) loads the checkpoint of step 4
   with ``checkpoint.load``: model and AdamW state bit for bit; its next step is the
   uninterrupted run's (1e-6); ``checkpoint.save`` of its state dicts loads back into 4 fully
   sharded shardkit ranks and into one process, bit for bit.

In the same spawn a transformers Llama is sharded 2 x 2 (its own tensor-parallel plan,
``st.tensor_parallel_spec``, within {0, 1} and {2, 3}; fully sharded over {0, 2} and
{1, 3}), trains 3 AdamW steps like one process on the whole batch (1e-6), and its
checkpoint holds each parameter as one layout over the 4 ranks (``q_proj``'s rows in 4
blocks), which one process loads bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import checkpoint
import sharded_tensor as st
from tests.distributed._fully_shard_models import (
    fully_shard_llama,
    fully_shard_mlp,
    tensor_parallel_mlp,
    tiny_llama,
    uneven_mlp,
)
from tests.distributed._grads import whole_state
from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed

BATCH = 4


def _sharded(dtype: torch.dtype = torch.float32, ranks: list[int] | None = None) -> nn.Module:
    return fully_shard_mlp(uneven_mlp(dtype), ranks)


def _optim(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


def _steps(model: nn.Module, optim: torch.optim.Optimizer, steps: range, rank: int = 0,
           world: int = 1) -> list[float]:
    losses = []
    per = BATCH // world
    for step in steps:
        x, y = _batch(step)
        optim.zero_grad()
        loss = F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def _load(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> dict[str, torch.Tensor]:
    state = st.get_state_dict(model, optim)
    checkpoint.load(state, path)
    st.set_state_dict(model, optim, state)
    return whole_state(st.get_state_dict(model, optim))


def _hybrid(rank: int, world: int, src: str, dst: str) -> dict[str, object]:
    """Fully sharded within {0, 1} and {2, 3}, replicated across them: load, one step, save."""
    import torch.distributed as dist

    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = _sharded(ranks=[0, 1] if rank < 2 else [2, 3])
    optim = _optim(model)
    loaded = _load(model, optim, src)
    x, y = _batch(2)
    optim.zero_grad()
    F.mse_loss(model(x[rank:rank + 1]), y[rank:rank + 1]).backward()
    st.all_reduce_grads(model, replicas[rank % 2])  # average over the replicas too: the whole batch
    optim.step()
    checkpoint.save(st.get_state_dict(model, optim), dst)
    return {"loaded": loaded, "after": whole_state(st.get_state_dict(model, optim)),
            "local": [tuple(p.shape) for p in model.parameters()]}


def _two_by_two(rank: int, world: int, src: str, dst: str) -> dict[str, object]:
    """Tensor parallel within {0, 1} and {2, 3} (shard_model), fully sharded over {0, 2} and {1, 3}."""
    import torch.distributed as dist

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = tensor_parallel_mlp(uneven_mlp(), tp_groups[rank // 2])
    tp_local = tuple(model[0].weight.shape)
    fully_shard_mlp(model)  # ranks=None: the data-parallel groups of a tensor-parallel model
    optim = _optim(model)
    loaded = _load(model, optim, src)
    x, y = _batch(2)
    rows = slice(rank // 2 * 2, rank // 2 * 2 + 2)  # a tensor-parallel group shares its half of the batch
    optim.zero_grad()
    F.mse_loss(model(x[rows]), y[rows]).backward()
    optim.step()
    checkpoint.save(st.get_state_dict(model, optim), dst)
    return {"loaded": loaded, "after": whole_state(st.get_state_dict(model, optim)), "tp_local": tp_local,
            "local": [tuple(p.shape) for p in model.parameters()]}


LLAMA_BATCH, LLAMA_STEPS = 4, 3


def _llama() -> nn.Module:
    return tiny_llama(vocab=40)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 40, (LLAMA_BATCH, 9), generator=torch.Generator().manual_seed(300 + step))


def _train_llama(model: nn.Module, optim: torch.optim.Optimizer, rows: slice = slice(None)) -> list[float]:
    """``LLAMA_STEPS`` steps on ``rows`` of each step's batch (all of it by default); the losses."""
    losses = []
    for step in range(LLAMA_STEPS):
        x = _tokens(step)[rows]
        optim.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def _llama_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch: the losses and the parameters after training."""
    model = _llama()
    losses = _train_llama(model, _optim(model))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _llama_two_by_two(rank: int, world: int, dst: str) -> dict[str, object]:
    """A transformers Llama, tensor parallel (its own plan) within {0, 1} and {2, 3}, fully sharded over
    {0, 2} and {1, 3}: trained on the whole batch, saved as one mesh split."""
    import torch.distributed as dist

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = _llama()
    spec = st.tensor_parallel_spec(model, [0, 1])
    st.shard_model(model, spec, process_group=tp_groups[rank // 2])
    tp_local = tuple(model.model.layers[0].self_attn.q_proj.weight.shape)
    fully_shard_llama(model)
    optim = _optim(model)
    rows = slice(rank // 2 * 2, rank // 2 * 2 + 2)  # each data-parallel rank: half the batch
    losses = _train_llama(model, optim, rows)
    state = st.get_state_dict(model, optim)
    checkpoint.save(state, dst)
    q = state["model"]["model.layers.0.self_attn.q_proj.weight"]
    blocks = sorted((s.offsets, s.dims, s.rank) for s in q.sharding_metadata().shards)
    full = {k: v.full_tensor() if isinstance(v, st.ShardedTensor) else v.detach().clone()
            for k, v in model.state_dict().items()}
    return {"losses": losses, "params": full, "tp_local": tp_local,
            "q_local": tuple(model.model.layers[0].self_attn.q_proj.weight.shape), "q_blocks": blocks,
            "after": whole_state(state)}


def _fsdp2(rank: int, world: int, src: str, dst: str) -> dict[str, object]:
    """FSDP2 (torch's fully_shard, DTensors) loads the 4-rank shardkit checkpoint with its optimizer state,
    trains a step and saves its own state dict; shardkit, fully sharded over 4, loads that."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = uneven_mlp()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = _optim(model)
    _steps(model, optim, range(0, 1), rank, world)  # the optimizer state exists; the load overwrites it

    def state() -> dict[str, object]:
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}

    def whole(tree: dict) -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
        out = {f"model.{k}": v.full_tensor() for k, v in tree["model"].items()}
        for name, entry in tree["optim"]["state"].items():
            for key, value in entry.items():
                full = value.full_tensor() if hasattr(value, "full_tensor") else torch.as_tensor(value)
                out[f"optim.{name}.{key}"] = full.detach().clone()
        return out

    loading = state()
    checkpoint.load(loading, src)
    set_model_state_dict(model, loading["model"])  # type: ignore[arg-type]
    set_optimizer_state_dict(model, optim, loading["optim"])  # type: ignore[arg-type]
    loaded = whole(state())
    losses = _steps(model, optim, range(4, 5), rank, world)
    checkpoint.save(state(), dst)
    after = whole(state())
    back = _sharded()
    back_optim = _optim(back)
    back_loaded = _load(back, back_optim, dst)
    return {"loaded": loaded, "after": after, "losses": losses, "back": back_loaded}


def _on_four(rank: int, world: int, src: str, dst: str) -> dict[str, object]:
    llama = _llama_two_by_two(rank, world, dst + "-llama")
    hybrid = _hybrid(rank, world, src, dst + "-hybrid")
    two_by_two = _two_by_two(rank, world, src, dst + "-2x2")
    model = _sharded()
    optim = _optim(model)
    loaded = _load(model, optim, src)
    losses = _steps(model, optim, range(2, 4), rank, world)
    checkpoint.save(st.get_state_dict(model, optim), dst)
    try:
        bf16 = _sharded(torch.bfloat16)
        checkpoint.load({"model": bf16.state_dict()}, dst, strict=False)
        mismatch = "no error"
    except checkpoint.CheckpointError as exc:
        mismatch = str(exc)
    local = [tuple(p.shape) for p in model.parameters()]
    fsdp2 = _fsdp2(rank, world, dst, dst + "-fsdp2")
    return {"loaded": loaded, "losses": losses, "after": whole_state(st.get_state_dict(model, optim)),
            "mismatch": mismatch, "local": local, "hybrid": hybrid, "2x2": two_by_two, "llama": llama,
            "fsdp2": fsdp2}


def _on_two(rank: int, world: int, src: str, dst: str) -> dict[str, object]:
    model = _sharded()
    optim = _optim(model)
    loaded = _load(model, optim, src)
    collected = checkpoint.collect_state_dict(st.get_state_dict(model, optim)["model"])
    losses = _steps(model, optim, range(4, 5), rank, world)
    checkpoint.save(st.get_state_dict(model, optim), dst)
    return {"loaded": loaded, "collected": collected, "losses": losses,
            "after": whole_state(st.get_state_dict(model, optim))}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    bad = [k for k in want if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]
    assert not bad, f"{what}: not bit for bit {bad[:5]}"


def test_fully_sharded_checkpoints_move_between_world_sizes(tmp_path: Path) -> None:
    # 1. One process, plain model: 2 steps, save. The reference continues without interruption.
    ref = uneven_mlp()
    ref_optim = _optim(ref)
    _steps(ref, ref_optim, range(0, 2))
    plain = str(tmp_path / "plain")
    checkpoint.save(st.get_state_dict(ref, ref_optim), plain)
    saved = whole_state(st.get_state_dict(ref, ref_optim))
    ref_losses = _steps(ref, ref_optim, range(2, 3))
    after_three = whole_state(st.get_state_dict(ref, ref_optim))
    ref_losses += _steps(ref, ref_optim, range(3, 4))
    after_four = whole_state(st.get_state_dict(ref, ref_optim))
    ref_losses += _steps(ref, ref_optim, range(4, 5))
    after_five = whole_state(st.get_state_dict(ref, ref_optim))

    llama_losses, llama_params = _llama_reference()

    # 2. Four fully sharded ranks resume from it, train 2 steps, save.
    four = str(tmp_path / "four")
    results = run_distributed(_on_four, 4, plain, four, timeout=300)
    # A transformers Llama as 2 x 2 (its tensor-parallel plan within {0, 1} and {2, 3}, fully sharded
    # over {0, 2} and {1, 3}) trains like one process on the whole batch.
    for rank, res in enumerate(results):
        llama = res["llama"]
        # Ranks 0 and 2 trained on the two halves of the batch (1 and 3 on the same halves).
        mean = [(results[0]["llama"]["losses"][i] + results[2]["llama"]["losses"][i]) / 2
                for i in range(LLAMA_STEPS)]
        assert all(a == b for a, b in zip(llama["losses"], results[rank ^ 1]["llama"]["losses"]))  # tp pair
        assert max(abs(a - b) / b for a, b in zip(mean, llama_losses)) <= 1e-6
        for name, value in llama["params"].items():
            assert _rel(value, llama_params[name]) <= 1e-6, (rank, name, _rel(value, llama_params[name]))
        assert llama["tp_local"] == (16, 32)  # 4 heads of 8 split over 2 tensor-parallel ranks
        assert llama["q_local"] == (8, 32)  # then its rows over 2 data-parallel ranks
        # The checkpoint sees one layout over the 4 ranks: the (32, 32) weight in 4 row blocks.
        assert llama["q_blocks"] == [((0, 0), (8, 32), 0), ((8, 0), (8, 32), 2), ((16, 0), (8, 32), 1),
                                     ((24, 0), (8, 32), 3)], llama["q_blocks"]
        _assert_equal(llama["after"], results[0]["llama"]["after"], f"rank {rank} 2 x 2 Llama against rank 0")
    model = _llama()
    optim = _optim(model)
    _assert_equal(_load(model, optim, four + "-llama"), results[0]["llama"]["after"],
                  "one process loading the 2 x 2 Llama checkpoint")
    for rank, res in enumerate(results):
        _assert_equal(res["loaded"], saved, f"rank {rank} of 4 after loading the one-process checkpoint")
        for name, value in res["after"].items():
            assert _rel(value, after_four[name]) <= 1e-6, (rank, name, _rel(value, after_four[name]))
        _assert_equal(res["after"], results[0]["after"], f"rank {rank} of 4 against rank 0")
        assert "has dtype torch.float32, but the state_dict's has torch.bfloat16" in res["mismatch"], res["mismatch"]
    # Fully sharded in groups {0, 1} and {2, 3}: the same loads and the whole batch's step.
    for rank, res in enumerate(results):
        hybrid = res["hybrid"]
        _assert_equal(hybrid["loaded"], saved, f"rank {rank} of 2 x 2 after loading the one-process checkpoint")
        for name, value in hybrid["after"].items():
            assert _rel(value, after_three[name]) <= 1e-6, (rank, name, _rel(value, after_three[name]))
        assert hybrid["local"][0] == ((4, 5) if rank % 2 == 0 else (3, 5))  # 7 rows over 2 ranks
    model = uneven_mlp()
    optim = _optim(model)
    _assert_equal(_load(model, optim, four + "-hybrid"), results[0]["hybrid"]["after"],
                  "one process loading the 2 x 2 checkpoint")

    # Tensor parallel 2 x fully sharded 2: the same loads, the whole batch's step, one checkpoint.
    for rank, res in enumerate(results):
        grid = res["2x2"]
        _assert_equal(grid["loaded"], saved, f"rank {rank} of 2 x 2 (tensor parallel) after loading")
        for name, value in grid["after"].items():
            assert _rel(value, after_three[name]) <= 1e-6, (rank, name, _rel(value, after_three[name]))
        # model[0].weight (7, 5): tensor-parallel blocks of 4 and 3 rows, each split over 2 ranks by rows.
        assert grid["tp_local"] == ((4, 5) if rank % 2 == 0 else (3, 5))
        assert grid["local"][0] == [(2, 5), (2, 5), (2, 5), (1, 5)][rank]
    model = uneven_mlp()
    optim = _optim(model)
    _assert_equal(_load(model, optim, four + "-2x2"), results[0]["2x2"]["after"],
                  "one process loading the 2 x 2 (tensor parallel) checkpoint")

    # The last layer's (3, 2) weight split on dim 0 over 4 ranks like torch.chunk: 1/1/1/0 rows.
    assert [res["local"][-2] for res in results] == [(1, 2), (1, 2), (1, 2), (0, 2)]
    # The mean over ranks of their losses is the whole batch's loss.
    mean = [sum(res["losses"][i] for res in results) / 4 for i in range(2)]
    assert max(abs(a - b) / b for a, b in zip(mean, ref_losses[:2])) <= 1e-6

    # 3. One process loads what 4 ranks saved: their values, bit for bit; consolidate agrees.
    model = uneven_mlp()
    optim = _optim(model)
    _assert_equal(_load(model, optim, four), results[0]["after"], "one process loading the 4-rank checkpoint")
    merged = tmp_path / "merged.safetensors"
    checkpoint.consolidate(four, str(merged))
    from safetensors.torch import load_file

    consolidated = load_file(str(merged))
    model_entries = {k: v for k, v in results[0]["after"].items() if k.startswith("model.")}
    assert len(model_entries) == len(dict(model.named_parameters()))
    for name, value in model_entries.items():
        assert torch.equal(consolidated[name], value), name

    # FSDP2 (torch's fully_shard) loads the 4-rank checkpoint, model and AdamW state, bit for bit; its step
    # after that is the uninterrupted run's; what it saves loads into shardkit bit for bit.
    for rank, res in enumerate(results):
        fsdp2 = res["fsdp2"]
        _assert_equal(fsdp2["loaded"], results[0]["after"], f"FSDP2 rank {rank} loading the shardkit checkpoint")
        for name, value in fsdp2["after"].items():
            assert _rel(value, after_five[name]) <= 1e-6, (rank, name, _rel(value, after_five[name]))
        _assert_equal(fsdp2["back"], fsdp2["after"], f"shardkit rank {rank} loading the FSDP2 checkpoint")
    model = uneven_mlp()
    optim = _optim(model)
    _assert_equal(_load(model, optim, four + "-fsdp2"), results[0]["fsdp2"]["after"],
                  "one process loading the FSDP2 checkpoint")

    # 4. Two fully sharded ranks load it, train 1 step, save; one process loads that.
    two = str(tmp_path / "two")
    pair = run_distributed(_on_two, 2, four, two, timeout=300)
    for rank, res in enumerate(pair):
        _assert_equal(res["loaded"], results[0]["after"], f"rank {rank} of 2 after loading the 4-rank checkpoint")
        for name, value in res["after"].items():
            assert _rel(value, after_five[name]) <= 1e-6, (rank, name, _rel(value, after_five[name]))
    collected = pair[0]["collected"]
    assert pair[1]["collected"] is None
    for name, value in collected.items():
        assert torch.equal(value, results[0]["after"][f"model.{name}"]), name
    mean = sum(res["losses"][0] for res in pair) / 2
    assert abs(mean - ref_losses[2]) / ref_losses[2] <= 1e-6
    model = uneven_mlp()
    optim = _optim(model)
    _assert_equal(_load(model, optim, two), pair[0]["after"], "one process loading the 2-rank checkpoint")
