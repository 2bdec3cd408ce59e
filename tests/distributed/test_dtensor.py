"""DTensor interop on Gloo ranks: conversions share memory, checkpoints of DTensor state_dicts
(FSDP2 and shardkit layouts, 4 -> 2 -> 4 ranks) train on exactly where they left off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed


def _full(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def _check_conversions(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import (
        DTensor,
        Partial,
        Replicate,
        Shard,
        distribute_tensor,
    )
    from torch.distributed.tensor.placement_types import _StridedShard

    import checkpoint
    import sharded_tensor as st
    from sharding import mesh as mesh_spec
    from sharding import single_split
    from sharding.layout import Partial as LayoutPartial

    ranks = [f"rank:{r}/cpu" for r in range(world)]
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    cases = [
        (mesh1, (10, 4), [Shard(0)]),                   # uneven 3/3/3/1
        (mesh1, (8, 4), [Shard(1)]),                    # one column each
        (mesh1, (2, 3), [Shard(0)]),                    # empty trailing shards
        (mesh1, (5, 3), [Replicate()]),
        (mesh2, (7, 9), [Shard(0), Shard(1)]),
        (mesh2, (7, 9), [Replicate(), Shard(0)]),       # HSDP-like
        (mesh2, (11, 3), [Shard(0), Shard(0)]),         # one dim over both axes, nested
    ]
    for device_mesh, shape, placements in cases:
        full = _full(*shape)
        dt = distribute_tensor(full.clone(), device_mesh, placements)
        t = st.from_dtensor(dt)
        local = dt.to_local()
        assert t.local_shard().data_ptr() == local.data_ptr() or local.numel() == 0, (shape, placements)
        assert torch.equal(t.full_tensor(), full), (shape, placements)
        back = t.to_dtensor(device_mesh)
        # Inference prefers the simplest equivalent: the same placements here.
        assert tuple(back.placements) == tuple(placements), (back.placements, placements)
        assert back.to_local().data_ptr() == local.data_ptr() or local.numel() == 0
        assert torch.equal(back.full_tensor(), full)
        # Shared, not copied: a write through the ShardedTensor shows in the DTensor.
        t.local_shard().add_(1)
        assert torch.equal(dt.full_tensor(), full + 1), (shape, placements)

    # shardkit layouts -> DTensor, placements inferred.
    rows = st.shard_tensor(_full(10, 6) if rank == 0 else None, single_split(0, ranks))
    assert tuple(rows.to_dtensor(mesh1).placements) == (Shard(0),)
    blocks = st.shard_tensor(_full(6, 8) if rank == 0 else None, mesh_spec([ranks[:2], ranks[2:]]))
    dt = blocks.to_dtensor(mesh2)
    assert tuple(dt.placements) == (Shard(0), Shard(1))
    assert torch.equal(dt.full_tensor(), _full(6, 8))
    # A mesh listing the ranks in another order describes a reversed split.
    reversed_rows = st.shard_tensor(_full(8, 2) if rank == 0 else None, single_split(0, ranks[::-1]))
    with pytest.raises(ValueError, match="no DTensor equivalent"):
        reversed_rows.to_dtensor(mesh1)
    # DTensor's collectives use each axis's group in sorted rank order: a decreasing mesh has no
    # consistent DTensor layout, so neither direction accepts one.
    reversed_mesh = DeviceMesh("cpu", list(range(world))[::-1])
    with pytest.raises(ValueError, match="decreasing order along mesh axis 0"):
        reversed_rows.to_dtensor(reversed_mesh)
    with pytest.raises(ValueError, match="decreasing order"):
        st.from_dtensor(DTensor.from_local(torch.ones(2, 2), reversed_mesh, [Shard(0)], run_check=False))

    # Layouts one side cannot express: clear errors naming the layout and the fix.
    twice = st.zeros(8, 2, sharding_spec=single_split(0, [ranks[0], ranks[0], *ranks[1:3]]))
    with pytest.raises(ValueError, match=r"rank 0: 2 block\(s\).*reshard it first"):
        twice.to_dtensor(mesh1)
    uneven = st.zeros(8, 2, sharding_spec=single_split(0, ranks, shard_sizes=[1, 1, 1, 5]))
    with pytest.raises(ValueError, match="no DTensor equivalent"):
        uneven.to_dtensor(mesh1)
    with pytest.raises(ValueError, match=r"placements \(Shard\(dim=1\)\) give a layout other"):
        rows.to_dtensor(mesh1, [Shard(1)])
    # Pending reductions: Partial on every axis is a PartialSpec over the mesh ranks, both ways.
    for device_mesh, op in [(mesh1, "sum"), (mesh2, "sum"), (mesh1, "max"), (mesh2, "avg")]:
        value = _full(3, 2) * (rank + 1)
        partial = DTensor.from_local(value.clone(), device_mesh, [Partial(op)] * device_mesh.ndim)
        t = st.from_dtensor(partial)
        assert t.sharding_metadata().placement == LayoutPartial(op)
        assert t.local_shard().data_ptr() == partial.to_local().data_ptr()
        assert [s.rank for s in t.sharding_metadata().shards] == [int(r) for r in device_mesh.mesh.flatten()]
        assert torch.equal(t.full_tensor(), partial.full_tensor()), (op, device_mesh.shape)
        back = t.to_dtensor(device_mesh)
        assert tuple(back.placements) == (Partial(op),) * device_mesh.ndim
        assert back.to_local().data_ptr() == partial.to_local().data_ptr()
        assert torch.equal(back.full_tensor(), partial.full_tensor())
    with pytest.raises(ValueError, match=r"pending a reduction over only some of the ranks.*redistribute"):
        st.from_dtensor(DTensor.from_local(torch.ones(2, 2), mesh2, [Partial(), Replicate()]))
    with pytest.raises(ValueError, match=r"holds plain values.*placements=None"):
        rows.to_dtensor(mesh1, [Partial()])
    summed = st.from_dtensor(DTensor.from_local(torch.ones(2, 2), mesh1, [Partial()]))
    with pytest.raises(ValueError, match=r"pending reduce_op='sum'.*\(Partial\(sum\)\)"):
        summed.to_dtensor(mesh1, [Replicate()])
    strided = DTensor.from_local(torch.ones(2, 2), mesh2, [_StridedShard(0, split_factor=2), Shard(0)],
                                 run_check=False)
    with pytest.raises(ValueError, match="interleaves rows"):
        st.from_dtensor(strided)
    with pytest.raises(TypeError, match="expects a torch.distributed.tensor.DTensor"):
        st.from_dtensor(torch.ones(2))

    # Checkpoints: DTensor entries saved by layout, loaded into other DTensor and shardkit layouts.
    g = torch.Generator().manual_seed(7)
    w, b, e = torch.randn(10, 6, generator=g), torch.randn(6, generator=g), torch.randn(7, 9, generator=g)
    saved = {"w": distribute_tensor(w, mesh1, [Shard(0)]), "nested": {"b": distribute_tensor(b, mesh1, [Replicate()]),
             "e": distribute_tensor(e, mesh2, [Shard(1), Shard(0)])}, "step": torch.tensor(5.0), "lr": 0.5}
    checkpoint.save(saved, f"{root}/dt")
    target = {"w": distribute_tensor(torch.zeros(10, 6), mesh2, [Shard(1), Replicate()]),
              "nested": {"b": st.zeros(6, sharding_spec=single_split(0, ranks)),
                         "e": distribute_tensor(torch.zeros(7, 9), mesh1, [Shard(1)])},
              "step": 0, "lr": None}
    w_storage = target["w"].to_local().data_ptr()
    checkpoint.load(target, f"{root}/dt")
    assert target["w"].to_local().data_ptr() == w_storage  # filled in place
    assert torch.equal(target["w"].full_tensor(), w)
    assert torch.equal(target["nested"]["b"].full_tensor(), b)
    assert torch.equal(target["nested"]["e"].full_tensor(), e)
    assert target["step"] == 5 and isinstance(target["step"], int) and target["lr"] == 0.5
    full = checkpoint.collect_state_dict(saved)
    if rank == 0:
        assert torch.equal(full["w"], w) and torch.equal(full["nested"]["e"], e) and full["lr"] == 0.5
    else:
        assert full is None

    # A tensor-parallel model (parallelize_module): Shard(0) and Shard(1) weights, loaded back
    # into a differently parallelized copy.
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6))
    reference = {k: v.clone() for k, v in plain.state_dict().items()}
    tp = parallelize_module(plain, mesh1, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    checkpoint.save(tp.state_dict(), f"{root}/tp")
    torch.manual_seed(1)
    other = parallelize_module(nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6)), mesh1,
                               {"0": RowwiseParallel(), "2": ColwiseParallel()})
    checkpoint.load(other.state_dict(), f"{root}/tp")
    gathered = checkpoint.collect_state_dict(other.state_dict())
    if rank == 0:
        assert sorted(gathered) == sorted(reference)
        for name, value in reference.items():
            assert torch.equal(gathered[name], value), name
    dist.barrier()


def test_conversions_and_dtensor_checkpoints(tmp_path: Path):
    run_distributed(_check_conversions, 4, str(tmp_path), timeout=240)


# -- FSDP2 -> shard_model on 2 ranks -> FSDP2, against one uninterrupted single-process run ----------

STEPS = (3, 3, 3)


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 32))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 32, (25,), generator=g)
    return tokens[:-1], tokens[1:]


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _optim(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _fsdp2(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = _model()
    device_mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    return model, _optim(model)


def _snapshot(state: object) -> object:
    """A deep copy of a collected state_dict (plain CPU tensors in it share the live parameters)."""
    if isinstance(state, dict):
        return {key: _snapshot(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_snapshot(value) for value in state]
    return state.clone() if isinstance(state, torch.Tensor) else state


def _phase_fsdp2_start(rank: int, world: int, root: str) -> tuple[list[float], dict | None]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import checkpoint

    model, optim = _fsdp2(seed=0)
    losses = _train(model, optim, range(STEPS[0]))
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": STEPS[0]}
    checkpoint.save(state, f"{root}/fsdp2")
    return losses, checkpoint.collect_state_dict(state)


def _phase_shardkit(rank: int, world: int, root: str) -> tuple[list[float], dict | None, dict | None]:
    import checkpoint
    import sharded_tensor as st
    from sharding import composite, single_split

    ranks = [f"rank:{r}/cpu" for r in range(world)]
    with torch.device("meta"):
        model = _model()
    st.shard_model(model, composite(**{"0": single_split(1, ranks), "1": single_split(0, ranks),
                                       "3.weight": single_split(1, ranks)}), seed=5)
    optim = _optim(model)
    state = {"model": model.state_dict(), "optim": st.optim_state_dict(model, optim), "step": 0}
    checkpoint.load(state, f"{root}/fsdp2")
    st.load_optim_state_dict(model, optim, state["optim"])
    loaded = _snapshot(checkpoint.collect_state_dict(state))
    first = state["step"]
    losses = _train(model, optim, range(first, first + STEPS[1]))
    state = {"model": model.state_dict(), "optim": st.optim_state_dict(model, optim), "step": first + STEPS[1]}
    checkpoint.save(state, f"{root}/shardkit")
    return losses, loaded, checkpoint.collect_state_dict(state)


def _phase_fsdp2_resume(rank: int, world: int, root: str) -> tuple[list[float], dict | None]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import checkpoint

    model, optim = _fsdp2(seed=1)  # other initial values: the load must overwrite every one
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": 0}
    checkpoint.load(state, f"{root}/shardkit")
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(model, optim)
    loaded = _snapshot(checkpoint.collect_state_dict({"model": msd, "optim": osd}))
    first = state["step"]
    return _train(model, optim, range(first, first + STEPS[2])), loaded


def _tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            out[f"{prefix}{key}"] = value
    return out


def test_fsdp2_to_shardkit_and_back_trains_like_an_uninterrupted_run(tmp_path: Path):
    torch.manual_seed(0)
    model = _model()
    optim = _optim(model)
    reference = _train(model, optim, range(sum(STEPS)))

    (start, saved_a), *_ = run_distributed(_phase_fsdp2_start, 4, str(tmp_path), timeout=240)
    (middle, loaded_b, saved_b), _ = run_distributed(_phase_shardkit, 2, str(tmp_path), timeout=240)
    (end, loaded_c), *_ = run_distributed(_phase_fsdp2_resume, 4, str(tmp_path), timeout=240)

    # The checkpoints move state bit for bit, across layouts, world sizes and both optimizer formats.
    tensors_a, tensors_b = _tensors(saved_a), _tensors(loaded_b)
    assert sorted(tensors_a) == sorted(tensors_b) and len(tensors_a) == 3 * 5
    for name, value in tensors_a.items():
        assert torch.equal(value, tensors_b[name]), name
    assert loaded_b["step"] == STEPS[0] and loaded_b["optim"]["state"]["1.weight"]["step"] == STEPS[0]
    tensors_b, tensors_c = _tensors(saved_b), _tensors(loaded_c)
    assert sorted(tensors_b) == sorted(tensors_c)
    for name, value in tensors_b.items():
        assert torch.equal(value, tensors_c[name]), name

    # Losses. FSDP2 phase: every rank sees the same batch, and averaging 4 equal gradients is
    # exact in floating point, so it must match the single process bit for bit. Later phases:
    # shard_model splits "3.weight" by input features, so that matmul sums its halves in another
    # order than one process does; the math allows rounding differences there (none show up on
    # the machine these tests were written on, where all 9 losses are equal bit for bit).
    assert start == reference[:STEPS[0]]
    losses = start + middle + end
    assert len(losses) == len(reference)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-6, atol=0)


# -- DCP folders -------------------------------------------------------------------------------------


def _phase_dcp_save(rank: int, world: int, root: str) -> dict | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import checkpoint

    model, optim = _fsdp2(seed=0)
    _train(model, optim, range(2))
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": 2}
    dcp.save(state, checkpoint_id=f"{root}/dcp")
    return _snapshot(checkpoint.collect_state_dict(state))


def _phase_dcp_import(rank: int, world: int, root: str) -> dict | None:
    import checkpoint
    import sharded_tensor as st
    from sharding import composite, single_split

    ranks = [f"rank:{r}/cpu" for r in range(world)]
    with torch.device("meta"):
        model = _model()
    st.shard_model(model, composite(**{"0": single_split(0, ranks), "3": single_split(0, ranks)}), seed=3)
    optim = _optim(model)
    state = {"model": model.state_dict(), "optim": st.optim_state_dict(model, optim), "step": 0}
    checkpoint.load(state, f"{root}/dcp", from_format="dcp")  # a DCP folder is read only when named
    st.load_optim_state_dict(model, optim, state["optim"])
    assert state["step"] == 2 and state["optim"]["param_groups"][0]["lr"] == 1e-2
    return _snapshot(checkpoint.collect_state_dict(state))


def _phase_dcp_export_load(rank: int, world: int, root: str) -> dict | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import checkpoint

    mesh1 = init_device_mesh("cpu", (world,))
    meta = checkpoint.read_metadata(f"{root}/converted")
    state = {name: distribute_tensor(torch.zeros(entry.size, dtype=entry.dtype), mesh1, [Shard(entry.size.index(
        max(entry.size)))]) if len(entry.size) else torch.zeros((), dtype=entry.dtype)
        for name, entry in meta.tensors.items()}
    dcp.load(state, checkpoint_id=f"{root}/exported")
    return _snapshot(checkpoint.collect_state_dict(state))


def test_dcp_folders_import_convert_export(tmp_path: Path):
    from safetensors.torch import load_file

    import checkpoint

    root = str(tmp_path)
    saved, *_ = run_distributed(_phase_dcp_save, 4, root, timeout=240)
    imported, _ = run_distributed(_phase_dcp_import, 2, root, timeout=240)
    expected = _tensors(saved)
    assert len(expected) == 3 * 5
    got = _tensors(imported)
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name
    assert imported["optim"]["state"]["1.weight"]["step"] == 2  # a 0-dim tensor in DCP, a number in shardkit

    # One process: DCP -> shardkit checkpoint and -> safetensors; shardkit -> DCP, read back by dcp.load.
    checkpoint.convert(f"{root}/dcp", f"{root}/converted", from_format="dcp")
    full = {}
    meta = checkpoint.read_metadata(f"{root}/converted")
    full = checkpoint.load({name: None for name in meta.tensors}, f"{root}/converted", strict=False)
    for name, value in expected.items():
        assert torch.equal(full[name], value), name
    assert meta.values["step"] == 2 and meta.values["optim.param_groups"][0]["lr"] == 1e-2
    checkpoint.convert(f"{root}/dcp", f"{root}/model.safetensors", from_format="dcp", to_format="safetensors")
    flat = load_file(f"{root}/model.safetensors")
    for name, value in expected.items():
        assert torch.equal(flat[name], value), name
    checkpoint.convert(f"{root}/converted", f"{root}/exported", to_format="dcp")
    exported, *_ = run_distributed(_phase_dcp_export_load, 2, root, timeout=240)
    for name, value in expected.items():
        assert torch.equal(exported[name], value), name
