"""Checkpoint integrity on real Gloo ranks: divergent plain tensors, a flipped byte seen by a partial read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed._launch import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed

R = ["rank:0/cpu", "rank:1/cpu"]


def _save_divergent(rank: int, world_size: int, folder: str) -> str:
    import checkpoint

    same = torch.arange(6, dtype=torch.float32)
    differs = torch.arange(6, dtype=torch.float32) + (0.5 if rank == 1 else 0.0)
    try:
        checkpoint.save({"same": same, "opt": {"differs": differs}, "step": 1}, folder, quiet=True)
    except ValueError as exc:
        return str(exc)
    return "saved"


def test_plain_tensors_that_differ_across_ranks_are_refused(tmp_path: Path) -> None:
    results = run_distributed(_save_divergent, 2, str(tmp_path / "ck"))
    for message in results:
        assert "opt.differs" in message and "differ" in message, message
        # The likely causes and their fix; not a copy of one rank's values, which would hide them.
        assert "torch.nn.utils.clip_grad_norm_" in message and "st.clip_grad_norm_(model, max_norm)" in message
        assert "broadcast" not in message
        assert "same" not in message.replace("the same", "")
    assert not (tmp_path / "ck" / "shardkit.json").exists()


def _load_rows(rank: int, world_size: int, folder: str) -> str:
    import checkpoint
    import sharded_tensor as st
    from sharding import single_split

    target = st.zeros(1024, 64, sharding_spec=single_split(0, R))
    try:
        checkpoint.load({"w": target}, folder)
    except Exception as exc:  # noqa: BLE001  # compared by the test
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_flipped_byte_is_caught_by_a_partial_read(tmp_path: Path) -> None:
    import checkpoint
    from tests import _metadata_edit as edit

    folder = tmp_path / "ck"
    full = torch.arange(1024 * 64, dtype=torch.float32).reshape(1024, 64)
    checkpoint.save({"w": full}, folder, quiet=True)  # one process: one region of 256 KiB
    shard = edit.region(edit.read(folder), "w", 0)
    assert shard.end - shard.start == full.numel() * 4 and len(shard.crcs) == 1
    path = folder / shard.file
    data = bytearray(path.read_bytes())
    data[shard.start + 10 * 64 * 4 + 5] ^= 0x01  # a byte inside row 10
    path.write_bytes(bytes(data))
    try:
        results = run_distributed(_load_rows, 2, str(folder))
    except DistributedTestError as exc:  # a rank that raised is reported here too
        pytest.fail(str(exc))
    # rank 0 reads rows 0..511 (a partial read of the region): its own check fails. Rank 1
    # fails too: its rows share the region's only chunk (256 KiB < one chunk), and in any case
    # a failure on one rank is raised on every rank.
    assert results[0].startswith("CheckpointError") and "checksum mismatch" in results[0], results[0]
    assert shard.file in results[0] and "'w'" in results[0]
    assert results[1].startswith("CheckpointError"), results[1]
