"""``SHARDKIT_PLAIN_MEMORY=1`` on real Gloo ranks: ordinary torch memory, bit-identical results.

The same job (a replica resharded to rows, then to columns, then a partial sum all-reduced)
runs once with the default allocation and once with the switch; every rank returns digests
of its results and where their memory came from.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import sharded_tensor as st
from _shardkit import memory as _memory
from sharding import DevicePlacement, ShardMetadata, single_split
from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed

ROWS, COLS = 2048, 2048  # 16 MiB of float32: above the size _shardkit.memory maps on its own


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _job(rank: int, world: int) -> dict[str, object]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    found: dict[str, object] = {}
    torch.manual_seed(0)
    t = st.rand(ROWS, COLS, sharding_spec=DevicePlacement("cpu"))
    found["replica_mapped"] = _memory._mapping_of(t.local_shard()) is not None
    t.reshard(single_split(0, ranks))  # may keep a block of the replica and release the rest
    found["rows"] = _digest(t.local_shard())
    t.reshard(single_split(1, ranks))
    found["cols"] = _digest(t.local_shard())
    found["cols_mapped"] = _memory._mapping_of(t.local_shard()) is not None
    part = torch.full((ROWS, COLS), float(rank + 1)) * t.full_tensor()
    p = st.ShardedTensor.from_local_shards([st.Shard(part, ShardMetadata((0, 0), (ROWS, COLS), ranks[rank]))],
                                           (ROWS, COLS), reduce_op="sum")
    del part
    address = p.local_shard().data_ptr()
    p.reshard(DevicePlacement("cpu"))  # an all-reduce, in place when nothing else sees the buffer
    found["reduced"] = _digest(p.local_shard())
    found["reduced_in_place"] = p.local_shard().data_ptr() == address
    _memory.wait_for_releases()
    found["live_mappings"] = len(_memory._live)
    return found


def test_plain_memory_gives_identical_results(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("SHARDKIT_PLAIN_MEMORY", raising=False)
    default = run_distributed(_job, 2, timeout=120)
    monkeypatch.setenv("SHARDKIT_PLAIN_MEMORY", "1")  # the ranks take the parent's environment
    plain = run_distributed(_job, 2, timeout=120)
    for r in range(2):
        for key in ("rows", "cols", "reduced"):
            assert plain[r][key] == default[r][key], (r, key)
        # The default run used mappings and reduced in place; the plain one did neither.
        assert default[r]["replica_mapped"] and default[r]["cols_mapped"] and default[r]["reduced_in_place"]
        assert default[r]["live_mappings"] > 0
        assert not plain[r]["replica_mapped"] and not plain[r]["cols_mapped"]
        assert not plain[r]["reduced_in_place"] and plain[r]["live_mappings"] == 0
