"""What the README states about shardkit and its set-up stays true.

The README's examples run in tests/test_docs.py; these check its claims:

- every ``st.NAME``, ``checkpoint.NAME`` and ``sharding.NAME`` it mentions is public;
- "How it compares" names shardkit's counterpart of each PyTorch tool it discusses, and
  claims no missing counterpart;
- set-up: the first commands are the demo, then the quick tier, then the whole suite; the
  quick tier's command selects about the number of tests the README states; pip shows its
  progress (``scripts/setup_env.sh`` passes no ``--quiet``), as the README says.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
ALIASES = {"st": "sharded_tensor", "checkpoint": "checkpoint", "sharding": "sharding"}
# PyTorch's tool as the comparison names it -> shardkit's counterpart the comparison must name.
COUNTERPARTS = {
    "`torch.distributed.tensor` (DTensor)": "`ShardedTensor`",
    "`parallelize_module`": "`shard_model`",
    "FSDP2 (`torch.distributed.fsdp.fully_shard`)": "`st.fully_shard`",
    "`torch.distributed.checkpoint` (DCP)": "`checkpoint.save`",
}


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def test_every_name_the_readme_mentions_is_public() -> None:
    mentioned = set(re.findall(r"\b(st|checkpoint|sharding)\.([A-Za-z_]\w*)", README))
    assert ("st", "fully_shard") in mentioned
    missing = sorted(f"{alias}.{name}" for alias, name in mentioned
                     if name not in importlib.import_module(ALIASES[alias]).__all__)
    assert not missing, f"README.md mentions names that are not public: {missing}"


def test_the_comparison_names_a_counterpart_for_each_pytorch_tool() -> None:
    section = _section("How it compares")
    for tool, ours in COUNTERPARTS.items():
        assert tool in section and ours in section, (tool, ours)
    assert "no counterpart" not in section


def test_set_up_runs_the_demo_then_the_quick_tier_then_the_suite() -> None:
    section = _section("Set up")
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block[1].strip().splitlines()]
    assert commands[0] == "./scripts/demo.sh"
    assert commands[1] == 'SHARDKIT_SKIP_LINT=1 ./scripts/test.sh tests/unit tests/test_layering.py -m "not slow"'
    assert commands[2] == "./scripts/test.sh"
    assert re.search(r"1\.8 GB on disk", section) and re.search(r"\d+ to \d+ minutes", section)
    assert "pip's progress is printed" in section


def test_pip_shows_its_progress() -> None:
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    installs = [line for line in setup.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert len(installs) == 2 and not any("--quiet" in line or " -q" in line for line in installs), installs


@pytest.mark.slow
def test_the_quick_tier_selects_the_number_of_tests_the_readme_states() -> None:
    stated = re.search(r"one to run between edits: (\d+) tests", README)
    assert stated is not None
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/unit",
                             "tests/test_layering.py", "-m", "not slow"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=False)
    counted = re.search(r"(\d+)/\d+ tests collected|(\d+) tests collected", result.stdout)
    assert counted is not None, result.stdout[-2000:]
    selected = int(counted[1] or counted[2])
    assert abs(selected - int(stated[1])) <= 0.1 * int(stated[1]), (selected, stated[1])
