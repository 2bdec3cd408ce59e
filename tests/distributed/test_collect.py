"""collect_state_dict on Gloo ranks: full tensors bit for bit on dst, None elsewhere, bounded memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sharded_tensor as st
from checkpoint._collect import collect_state_dict
from sharding import DevicePlacement, mesh, single_split
from tests.distributed._launch import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed

WORLD = 4


def _reference() -> dict[str, object]:
    """The full state dict every case is built from (same values on every rank)."""
    g = torch.Generator().manual_seed(1234)
    return {
        "rows": torch.randn(10, 6, generator=g),                    # dim 0, uneven 3/3/3/1
        "cols": torch.randn(5, 9, generator=g).to(torch.bfloat16),  # dim 1, 3/3/3/0
        "grid": torch.randint(0, 1000, (4, 8), generator=g),        # 2x2 mesh, int64
        "replica": torch.randn(3, 3, generator=g),                  # full replica on every rank
        "on_rank_2": torch.randn(7, generator=g),                   # one rank only
        "mask": torch.rand(6, 2, generator=g) > 0.5,                # bool, dim 0
        "plain": torch.arange(5.0),
        "step": 7,
        "name": "adam",
        "nested": {"inner": torch.randn(8, 2, generator=g), "lr": 0.1},
    }


def _specs(world: int) -> dict[str, object]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    return {
        "rows": single_split(0, ranks),
        "cols": single_split(1, ranks),
        "grid": mesh([[ranks[0], ranks[1]], [ranks[2 % world], ranks[3 % world]]]),
        "replica": DevicePlacement("cpu"),
        "on_rank_2": DevicePlacement(ranks[2 % world]),
        "mask": single_split(0, ranks),
        "nested.inner": single_split(0, list(reversed(ranks))),
    }


def _sharded_state_dict(rank: int, world: int) -> dict[str, object]:
    ref = _reference()
    specs = _specs(world)
    sd: dict[str, object] = {}
    for key, value in ref.items():
        if key == "nested":
            inner = value["inner"]  # type: ignore[index]
            sd[key] = {"inner": st.shard_tensor(inner if rank == 0 else None, specs["nested.inner"]),
                       "lr": value["lr"]}  # type: ignore[index]
        elif key in specs:
            sd[key] = st.shard_tensor(value if rank == 0 else None, specs[key])
        else:
            sd[key] = value
    return sd


def _collect(rank: int, world: int, dst: int) -> object:
    return collect_state_dict(_sharded_state_dict(rank, world), dst=dst)


@pytest.mark.parametrize("dst", [0, 2])
def test_collect_equals_full_tensors_on_dst_only(dst: int) -> None:
    results = run_distributed(_collect, WORLD, dst)
    assert [r is None for r in results] == [r != dst for r in range(WORLD)]
    got, ref = results[dst], _reference()
    assert isinstance(got, dict)
    assert list(got) == list(ref)
    for key in ("rows", "cols", "grid", "replica", "on_rank_2", "mask", "plain"):
        assert got[key].device.type == "cpu"
        assert got[key].dtype == ref[key].dtype, key
        # Bit for bit: compare the raw bytes, not values (NaN-safe, -0.0-safe).
        assert torch.equal(got[key].view(-1).view(torch.uint8) if got[key].dtype != torch.bool else got[key],
                           ref[key].view(-1).view(torch.uint8) if ref[key].dtype != torch.bool else ref[key]), key
    assert got["step"] == 7 and got["name"] == "adam"
    assert set(got["nested"]) == {"inner", "lr"} and got["nested"]["lr"] == 0.1
    assert torch.equal(got["nested"]["inner"], ref["nested"]["inner"])


def _mismatched(rank: int, world: int) -> object:
    sd = {"a": st.zeros(4, 4, sharding_spec=single_split(0, [f"rank:{r}/cpu" for r in range(world)]))}
    if rank == 1:
        sd["b"] = st.zeros(2, sharding_spec=DevicePlacement("rank:0/cpu"))
    return collect_state_dict(sd)


def test_mismatched_state_dicts_fail_on_every_rank_without_hanging() -> None:
    with pytest.raises(DistributedTestError, match=r"unexpected=\['b'\]") as info:
        run_distributed(_mismatched, 2, timeout=60)
    assert len(info.value.failures) == 2


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _collect_memory(rank: int, world: int, n_tensors: int, rows: int, cols: int) -> dict[str, int]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    specs = [single_split(0, ranks), single_split(1, ranks)]
    sd = {f"t{i}": st.rand(rows, cols, sharding_spec=specs[i % 2]) for i in range(n_tensors)}
    torch.distributed.barrier()
    # Writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS (Linux >= 4.0).
    Path("/proc/self/clear_refs").write_text("5")
    before = _vm("VmRSS")
    out = collect_state_dict(sd)
    peak = _vm("VmHWM")
    full = sum(t.numel() * t.element_size() for t in out.values()) if out is not None else 0
    return {"growth": peak - before, "collected": full}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_collect_memory_is_streamed() -> None:
    # 8 tensors of 8 MiB (64 MiB in all), split on dim 0 and dim 1 alternately.
    n, rows, cols = 8, 1024, 2048
    tensor_bytes = rows * cols * 4
    results = run_distributed(_collect_memory, WORLD, n, rows, cols)
    assert results[0]["collected"] == n * tensor_bytes
    # interpreter, Gloo bookkeeping, allocator rounding, thread stacks; far below a second copy of the state dict
    slack = 10 << 20
    # dst: the full state dict plus at most two tensors' receive buffers (the peer-death watch
    # waits on each receive from a pool thread, which can release the previous tensor's buffer
    # just after the next one is posted); a second copy of the state dict would be 8 more.
    assert results[0]["growth"] <= n * tensor_bytes + 2 * tensor_bytes + slack, results
    # Others: only one tensor's send buffers at a time (a column shard must be packed),
    # never anything of the size of the whole state dict.
    for rank in range(1, WORLD):
        assert results[rank]["growth"] <= tensor_bytes + slack, (rank, results)
