"""Two hosts, simulated with network namespaces: ``scripts/multihost.sh`` (and its memory tier case).

Each "host" is a network namespace with its own address on a veth pair and its own
``torchrun`` agent; the ranks reach each other only over that link (c10d rendezvous, Gloo
on the veth). Needs root and iproute2; skipped, with the reason, where namespaces or veth
pairs cannot be created.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

import checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "multihost.sh"
STEPS = 2  # the script's default

pytestmark = [pytest.mark.multihost, pytest.mark.slow, pytest.mark.timeout(900)]


def _netns_unavailable() -> str | None:
    """Why two namespaces joined by a veth pair cannot be made here, or None if they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    name, veth = f"shardkit-probe-{os.getpid()}", f"skp-{os.getpid()}"
    try:
        for command in (["ip", "netns", "add", name],
                        ["ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "b"],
                        ["ip", "link", "set", veth + "b", "netns", name]):
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                return f"{' '.join(command)} failed: {result.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@pytest.fixture(scope="module")
def netns() -> None:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces are unavailable: {reason}")


def _run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SHARDKIT_PYTHON": sys.executable}
    result = subprocess.run(["bash", str(SCRIPT), "--out", str(out), *args], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=800, check=False)
    if result.returncode == 77:
        pytest.skip(f"network namespaces are unavailable: {result.stderr.strip()}")
    return result


def _demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shardkit_demo", ROOT / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_save_resume_across_two_hosts(netns: None, tmp_path: Path) -> None:
    result = _run(tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "multihost: ok" in result.stdout, log
    assert "FAILED" not in result.stdout, log
    assert "over 4 ranks" in result.stdout and "saved by 4 ranks" in result.stdout, log
    assert "restart on 2 ranks" in result.stdout, log
    assert len(re.findall(r"check: .*: ok", result.stdout)) >= 7, log

    # The checkpoint the 4 ranks on two hosts saved holds the weights of plain PyTorch
    # training for the same steps (a different summation order: a tolerance, not equality).
    demo = _demo()
    model = demo.TinyLM()
    model.load_state_dict(demo.initial_weights(0))
    optim = demo.make_optimizer(model)
    for step in range(STEPS):
        demo.train_step(model, optim, demo.batch(step, 0))
    saved: dict[str, object] = {"model": dict.fromkeys(model.state_dict())}
    checkpoint.load(saved, str(tmp_path / "checkpoints" / f"step-{STEPS:010d}"), strict=False)
    for name, expected in model.state_dict().items():
        loaded = saved["model"][name]  # type: ignore[index]
        assert loaded.shape == expected.shape, name
        assert (loaded - expected).abs().max().item() <= demo.WEIGHT_TOL, name

    # What the 2 ranks saved after resuming is, bit for bit, what the export consolidated.
    final: dict[str, object] = dict.fromkeys(model.state_dict())
    checkpoint.load(final, str(tmp_path / "model"))
    exported: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "hf-model").glob("*.safetensors")):
        exported.update(load_file(path))
    assert sorted(exported) == sorted(final)
    for name, tensor in exported.items():
        assert torch.equal(final[name], tensor), name  # type: ignore[arg-type]


def test_lost_host_fails_the_other_then_the_restart_resumes_from_its_memory(netns: None, tmp_path: Path) -> None:
    # Each host has its own memory folder; host 1 is killed (SIGKILL, every process of its
    # namespace) with it. Host 0's job must fail with an error, within the timeout; the restarted
    # job must then read host 1's parts from host 0's replicas over the veth, nothing from
    # storage, bit for bit (the script checks the digests of every rank's state), and leave both
    # memory folders empty. (``--kill-host1`` runs the same failure on the demo's job, by hand.)
    result = _run(tmp_path, "--lose-host1", "--fail-timeout", "120")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    failed = re.search(r"host 0 failed after ([0-9.]+) s with exit code (\d+)", result.stdout)
    assert failed is not None, log
    # A safety bound (the script stops waiting at --fail-timeout), not a performance claim.
    assert float(failed[1]) < 120 and int(failed[2]) != 0, log
    survivor = (tmp_path / "logs" / "lose-train-host0.log").read_text()
    assert re.search(r"Connection (reset|closed) by peer|CollectiveError", survivor), survivor
    match = re.search(r"memory check: ok: every rank resumed step (\d+) from memory, bit for bit", result.stdout)
    assert match is not None, log
    lost = re.search(r"host 1's processes killed \(SIGKILL\) after step (\d+)", result.stdout)
    assert lost is not None and int(lost[1]) - int(match[1]) <= 1, log  # at most the step in flight is lost
    assert len(re.findall(r"from memory: 0 bytes from this host's memory, [1-9]\d* from other hosts', 0 from storage",
                          result.stdout)) == 2, log
    assert "multihost: ok: host 1 lost" in result.stdout, log
