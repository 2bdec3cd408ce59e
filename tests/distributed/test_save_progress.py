"""The save progress bar on rank 0 counts every rank's bytes, not rank 0's share (2 Gloo ranks)."""

from __future__ import annotations

import io
import os
import sys

import pytest

import checkpoint
import sharded_tensor as st
from sharding import single_split
from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed

ROWS, COLS = 9 << 10, 1 << 10  # 36 MiB of float32 per rank, 72 MiB in all: only the total passes 64 MiB


def _save_with_bar(rank: int, world_size: int, path: str) -> str:
    os.environ["SHARDKIT_PROGRESS"] = "1"
    os.environ.pop("SHARDKIT_QUIET", None)
    t = st.zeros(ROWS * world_size, COLS, sharding_spec=single_split(0, [f"rank:{r}/cpu" for r in range(world_size)]))
    stream, saved = io.StringIO(), sys.stderr
    sys.stderr = stream
    try:
        checkpoint.save({"t": t}, path)
    finally:
        sys.stderr = saved
    return stream.getvalue()


def test_rank0_bar_shows_the_whole_save(tmp_path):
    out = run_distributed(_save_with_bar, 2, str(tmp_path / "ckpt"))
    assert "save:" in out[0] and "/72.0M " in out[0] and "/36.0M" not in out[0], out[0][-300:]
    assert out[1] == ""  # only rank 0 shows a bar
