"""collect_state_dict in a world of one (no process group) and the progress-bar rule."""

from __future__ import annotations

import io
from collections import OrderedDict

import pytest
import torch

import sharded_tensor as st
from checkpoint import _progress
from checkpoint._collect import collect_state_dict
from sharding import single_split


def test_world_of_one_returns_full_cpu_tensors_and_keeps_structure() -> None:
    full = torch.arange(24.0).reshape(6, 4)
    sd = OrderedDict(w=st.shard_tensor(full, single_split(1, ["rank:0/cpu", "rank:0/cpu"])),
                     b=torch.ones(3), opt={"step": 3, "buffers": [torch.zeros(2), "x"]}, none=None)
    out = collect_state_dict(sd)
    assert type(out) is dict and list(out) == ["w", "b", "opt", "none"]
    assert torch.equal(out["w"], full) and out["w"].device.type == "cpu"
    assert torch.equal(out["b"], torch.ones(3))
    assert out["opt"]["step"] == 3 and out["opt"]["buffers"][1] == "x"
    assert torch.equal(out["opt"]["buffers"][0], torch.zeros(2))
    assert out["none"] is None


@pytest.mark.parametrize(("dst", "match"), [
    pytest.param(1, "outside the process group of 1 ranks", id="beyond-world"),
    pytest.param(-1, "outside the process group", id="negative"),
    pytest.param(True, "outside the process group", id="bool"),
])
def test_bad_dst(dst: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        collect_state_dict({}, dst=dst)


def test_not_a_mapping() -> None:
    with pytest.raises(TypeError, match="must be a mapping"):
        collect_state_dict([torch.ones(1)])  # type: ignore[arg-type]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("rank", "total", "tty", "quiet", "env", "shown"), [
    pytest.param(0, 1 << 30, True, None, {}, True, id="rank0-tty-large"),
    pytest.param(1, 1 << 30, True, None, {}, False, id="other-rank"),
    pytest.param(0, 1 << 20, True, None, {}, False, id="small"),
    pytest.param(0, 1 << 30, False, None, {}, False, id="not-a-terminal"),
    pytest.param(0, 1 << 30, True, True, {}, False, id="quiet-keyword"),
    pytest.param(0, 1 << 30, True, None, {"SHARDKIT_QUIET": "1"}, False, id="quiet-env"),
    pytest.param(0, 1 << 30, True, False, {"SHARDKIT_QUIET": "1"}, True, id="keyword-beats-env"),
    pytest.param(0, 1 << 30, False, None, {"SHARDKIT_PROGRESS": "1"}, True, id="forced"),
])
def test_progress_rule(monkeypatch: pytest.MonkeyPatch, rank: int, total: int, tty: bool,
                       quiet: bool | None, env: dict[str, str], shown: bool) -> None:
    for key in ("SHARDKIT_QUIET", "SHARDKIT_PROGRESS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    stream = _Tty() if tty else io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    assert _progress.progress_enabled(total, rank=rank, quiet=quiet) is shown
    with _progress.progress(total, "test", rank=rank, quiet=quiet) as bar:
        bar.update(total)
    assert ("test" in stream.getvalue()) is shown
