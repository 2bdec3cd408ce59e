"""A script that calls ``init_process_group()`` but was started with plain ``python`` (``_shardkit/standalone.py``).

Each case runs a real script in a fresh interpreter with no launcher's variables in its
environment: it runs as one process with a warning that says how to start N processes (a spec
naming more ranks says the same), and a launch gone wrong (part of the variables set) still gets
torch's own error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _shardkit.standalone import LAUNCH_VARIABLES

# A fresh interpreter importing torch and shardkit: seconds on a quiet machine, minutes at load average 35.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(700)]

ROOT = Path(__file__).resolve().parents[2]

_TRAIN = """
import torch
import torch.distributed as dist
from torch import nn

import checkpoint
import sharded_tensor as st
from sharding import composite, single_split

dist.init_process_group("gloo")
ranks = [f"rank:{r}/cpu" for r in range(dist.get_world_size())]
with torch.device("meta"):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
st.shard_model(model, composite(**{"0": single_split(0, ranks), "2.weight": single_split(1, ranks)}), seed=0)
optim = torch.optim.AdamW(model.parameters())
model(torch.ones(2, 8)).sum().backward()
optim.step()
checkpoint.async_save(st.get_state_dict(model, optim), "ck").result()
saved = sorted(checkpoint.read_metadata("ck").tensors)[:2]
print("world", dist.get_world_size(), "rank", dist.get_rank(), "saved", saved)
try:
    st.zeros(4, 4, sharding_spec=single_split(0, ["rank:0/cpu", "rank:1/cpu"]))
except ValueError as exc:
    print(exc)
dist.destroy_process_group()
"""

_TWO_RANKS = """
import torch.distributed as dist
import sharded_tensor as st
from sharding import single_split
dist.init_process_group("gloo")
st.zeros(4, 4, sharding_spec=single_split(0, ["rank:0/cpu", "rank:1/cpu"]))
"""


def _run(tmp_path: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(code))
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    clean["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**clean, **env}, capture_output=True,
                          text=True, timeout=600, check=False)


def test_plain_python_runs_the_script_as_one_process_and_says_how_to_launch(tmp_path: Path) -> None:
    result = _run(tmp_path, _TRAIN)
    assert result.returncode == 0, result.stderr
    saved, refused = result.stdout.strip().split("\n")
    assert saved == "world 1 rank 0 saved ['model.0.bias', 'model.0.weight']", result.stdout
    # A spec naming more ranks than the world of one has says the same.
    assert "places a shard on rank 1 ('rank:1/cpu') but the world has 1 ranks" in refused
    assert "torchrun --nproc-per-node 2" in refused and "plain python runs as one process" in refused
    assert "job.py:10: UserWarning: torch.distributed.init_process_group(): no launcher started this process" \
        in result.stderr, result.stderr
    assert "runs as one process, rank 0 of a world of 1" in result.stderr
    assert "start it with torchrun --nproc-per-node N job.py" in result.stderr


def test_a_partial_launch_environment_keeps_torchs_error(tmp_path: Path) -> None:
    result = _run(tmp_path, _TWO_RANKS, RANK="0")
    assert result.returncode != 0
    assert "environment variable WORLD_SIZE expected, but not set" in result.stderr, result.stderr
    assert "no launcher started this process" not in result.stderr
