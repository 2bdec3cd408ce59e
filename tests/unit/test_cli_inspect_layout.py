"""``inspect`` shows how each tensor is split (dimension and block sizes, or a grid) and wraps long lines."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

import checkpoint
import sharded_tensor as st
from checkpoint._cli import _inspect, main, tensor_layout
from sharding import DevicePlacement, mesh, single_split

R0 = "rank:0/cpu"


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    sd = {
        "rows": st.shard_tensor(torch.randn(10, 4, generator=g), single_split(0, [R0] * 4)),      # 3/3/3/1
        "many": st.shard_tensor(torch.randn(1000, 2, generator=g), single_split(0, [R0] * 64)),   # 16 x62, 8, empty
        "cols": st.shard_tensor(torch.randn(6, 7, generator=g), single_split(1, [R0] * 3, [1, 4, 2])),
        "grid": st.shard_tensor(torch.randn(4, 8, generator=g), mesh([[R0] * 4, [R0] * 4])),
        "replica": st.shard_tensor(torch.randn(3, generator=g), DevicePlacement("cpu")),
        "plain": torch.ones(2, 2),
        "schedule": [{"step": k * 1000, "lr": 0.001 * k} for k in range(12)],
    }
    path = tmp_path / "ckpt"
    checkpoint.save(sd, str(path))
    return path


@pytest.mark.parametrize(("name", "layout", "text"), [
    pytest.param("rows", {"kind": "split", "dim": 0, "sizes": [3, 3, 3, 1]}, "dim 0: 3, 3, 3, 1", id="uneven-rows"),
    pytest.param("many", {"kind": "split", "dim": 0, "sizes": [16] * 62 + [8]}, "dim 0: 16 (x62), 8", id="long-run"),
    pytest.param("cols", {"kind": "split", "dim": 1, "sizes": [1, 4, 2]}, "dim 1: 1, 4, 2", id="columns"),
    pytest.param("grid", {"kind": "grid", "dims": [0, 1], "sizes": [[2, 2], [2, 2, 2, 2]]},
                 "grid 2x4: dim 0 [2, 2] x dim 1 [2 (x4)]", id="mesh"),
    pytest.param("replica", {"kind": "whole"}, "whole", id="replica-written-once"),
    pytest.param("plain", {"kind": "whole"}, "whole", id="plain"),
])
def test_layout_in_table_and_json(saved: Path, capsys: pytest.CaptureFixture[str], name: str,
                                  layout: dict[str, object], text: str) -> None:
    assert tensor_layout(checkpoint.read_metadata(str(saved)).tensors[name]) == layout
    out = io.StringIO()
    assert _inspect(str(saved), {}, as_json=False, out=out, width=200) == 0
    row = next(line for line in out.getvalue().splitlines() if line.startswith(name + " "))
    assert row.endswith("  " + text)
    assert main(["inspect", str(saved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"][name]["layout"] == layout


def test_long_lines_wrap_within_the_width(saved: Path) -> None:
    out = io.StringIO()
    _inspect(str(saved), {}, as_json=False, out=out, width=72)
    lines = out.getvalue().splitlines()
    body = lines[2:-1]  # the table and the values, without the title and summary sentences
    assert all(len(line) <= 72 for line in body), [line for line in body if len(line) > 72]
    # The grid's layout continues under its own column, never splitting "2 (x4)".
    start = lines[2].index("layout")
    k = next(k for k, line in enumerate(lines) if line.startswith("grid "))
    assert lines[k + 1][:start].strip() == "" and lines[k + 1][start:].strip()
    wrapped = lines[k][start:] + " " + lines[k + 1][start:]
    assert wrapped == "grid 2x4: dim 0 [2, 2] x dim 1 [2 (x4)]"
    # The schedule value wraps onto indented continuation lines and still reads as its JSON.
    head = next(k for k, line in enumerate(lines) if line.startswith("  schedule = "))
    pieces = [lines[head].split(" = ", 1)[1]]
    for line in lines[head + 1:]:
        if not line.startswith(" " * len("  schedule = ")):
            break
        pieces.append(line.strip())
    assert len(pieces) > 3
    assert json.loads(" ".join(pieces)) == [{"step": k * 1000, "lr": 0.001 * k} for k in range(12)]
