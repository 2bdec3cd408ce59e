"""Large CPU buffers: committed mappings, reuse after free, the cache cap, background page release."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from _shardkit import memory as _memory

MiB = 1 << 20


@pytest.fixture(autouse=True, scope="module")
def _small_heap():  # type: ignore[no-untyped-def]
    """The heap other tests left (torch, transformers, ...) collected once and frozen, so each
    test's own collections below walk only what was made since (a few ms, not most of a second)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _empty_cache(_small_heap):  # type: ignore[no-untyped-def]
    """Each test starts and ends with no freed mappings kept."""
    gc.collect()
    _memory.empty_cache()
    yield
    gc.collect()
    _memory.empty_cache()


def _resident(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s pages in RAM (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    pages = -(-tensor.untyped_storage().nbytes() // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(tensor.untyped_storage().data_ptr()), ctypes.c_size_t(pages * page), vec) == 0
    return sum(b & 1 for b in vec) * page


@pytest.mark.parametrize(("shape", "dtype", "mapped"), [
    pytest.param((1024,), torch.float32, False, id="small-is-torch-empty"),
    pytest.param((2 * MiB,), torch.float32, True, id="8MiB-float32"),
    pytest.param((3, 1024, 1024), torch.bfloat16, False, id="6MiB-bf16-below-threshold"),
    pytest.param((5, MiB), torch.int16, True, id="10MiB-int16"),
])
def test_empty_for_fill_shape_dtype_and_mapping(shape, dtype, mapped):  # type: ignore[no-untyped-def]
    t = _memory.empty_for_fill(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert (_memory._mapping_of(t) is not None) == mapped
    if mapped:  # committed when allocated, not page by page on first write
        assert _resident(t) == t.untyped_storage().nbytes()


def test_freed_mapping_is_reused_for_the_same_size_only():
    a = _memory.empty_for_fill((4 * MiB,), torch.float32)
    a.fill_(7.0)
    address = a.data_ptr()
    view = a[10:]
    del a
    assert _memory.cached_bytes() == 0  # a view still uses it
    del view
    assert _memory.cached_bytes() == 16 * MiB
    other = _memory.empty_for_fill((5 * MiB,), torch.float32)  # another size: a new mapping
    assert other.data_ptr() != address and _memory.cached_bytes() == 16 * MiB
    again = _memory.empty_for_fill((2 * MiB, 2), torch.float32)  # same bytes, other shape
    assert again.data_ptr() == address and _memory.cached_bytes() == 0
    assert again[0, 0].item() == 7.0  # uninitialized, like torch.empty: old contents


def test_cache_cap_drops_the_oldest(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SHARDKIT_CPU_CACHE_MB", "20")
    first = _memory.empty_for_fill((12 * MiB,), torch.uint8)
    second = _memory.empty_for_fill((16 * MiB,), torch.uint8)
    del first
    assert _memory.cached_bytes() == 12 * MiB
    del second  # 28 MiB > 20: the older one goes
    assert _memory.cached_bytes() == 16 * MiB
    fresh = _memory.empty_for_fill((12 * MiB,), torch.uint8)  # nothing of that size is kept now
    assert _memory.cached_bytes() == 16 * MiB
    del fresh
    monkeypatch.setenv("SHARDKIT_CPU_CACHE_MB", "0")
    third = _memory.empty_for_fill((8 * MiB,), torch.uint8)
    del third
    assert _memory.cached_bytes() == 0


@pytest.mark.parametrize("value", ["-1", "lots", "1.5"])
def test_bad_cache_setting_is_named(monkeypatch: pytest.MonkeyPatch, value: str):
    t = _memory.empty_for_fill((8 * MiB,), torch.uint8)
    monkeypatch.setenv("SHARDKIT_CPU_CACHE_MB", value)
    with pytest.raises(ValueError, match=rf"SHARDKIT_CPU_CACHE_MB='{value}' is not a whole number of MiB"):
        _memory.empty_for_fill((8 * MiB,), torch.uint8)
    del t  # freed under the bad setting: unmapped, not kept
    assert _memory.cached_bytes() == 0


def test_release_outside_keeps_the_ranges_and_gives_back_the_rest():
    t = _memory.empty_for_fill((32 * MiB,), torch.uint8)
    t.fill_(3)
    sole = {0: t}
    del t
    assert _memory.sole_owner(sole, 0)  # as reshard checks before keeping a block
    storage = sole[0].untyped_storage()
    kept = torch.empty((0,), dtype=torch.uint8).set_(storage, 8 * MiB, (4 * MiB,))
    _memory.release_outside(storage, [(8 * MiB, 12 * MiB)])
    _memory.wait_for_releases()
    assert _resident(sole[0]) == 4 * MiB
    assert bool((kept == 3).all())
    assert sole[0][0].item() == 0  # released pages read as zeros
    del sole, storage
    assert _memory.cached_bytes() == 0  # ``kept`` still uses the mapping
    del kept
    assert _memory.cached_bytes() == 32 * MiB
    reused = _memory.empty_for_fill((32 * MiB,), torch.uint8)  # waits for the release first
    reused.fill_(1)
    assert _resident(reused) == 32 * MiB and bool((reused == 1).all())


def test_sole_owner_refuses_shared_or_foreign_memory():
    mine = {0: _memory.empty_for_fill((8 * MiB,), torch.uint8)}
    assert _memory.sole_owner(mine, 0)
    alias = mine[0][1:]
    assert not _memory.sole_owner(mine, 0)
    del alias
    assert _memory.sole_owner(mine, 0)
    foreign = {0: torch.empty(8 * MiB, dtype=torch.uint8)}
    assert not _memory.sole_owner(foreign, 0)


def test_a_forked_child_releases_and_reuses_on_its_own_thread():
    import os
    import signal
    import time

    t = _memory.empty_for_fill((16 * MiB,), torch.uint8)
    t.fill_(1)
    holder = {0: t}
    del t
    _memory.release_outside(holder[0].untyped_storage(), [(0, MiB)])  # a pending release in the parent
    pid = os.fork()
    if pid == 0:  # child: a release and a reuse must complete without the parent's thread
        # (no torch kernels here: a forked child may hang in torch's own thread pool)
        code = 1
        try:
            mine = {0: _memory.empty_for_fill((8 * MiB,), torch.uint8)}
            _memory.release_outside(mine[0].untyped_storage(), [(0, MiB)])
            _memory.wait_for_releases()
            address = mine[0].data_ptr()
            del mine
            code = 0 if _memory.empty_for_fill((8 * MiB,), torch.uint8).data_ptr() == address else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung releasing or reusing memory (the parent's release thread?)")
    _memory.wait_for_releases()
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert _resident(holder[0]) == MiB


@pytest.mark.slow  # fresh interpreters
def test_exit_with_live_buffers_is_quiet():
    import subprocess
    import sys

    code = ("import torch\nfrom _shardkit.memory import empty_for_fill\n"
            "kept = [empty_for_fill((4 << 20,), torch.float32) for _ in range(2)]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "SHARDKIT_CPU_CACHE_MB": "0"})
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_unshared_sees_views_references_and_autograd():
    mine = {0: torch.empty(4)}
    assert _memory.unshared(mine, 0)
    alias = mine[0].view(2, 2)
    assert not _memory.unshared(mine, 0)
    del alias
    name = mine[0]
    assert not _memory.unshared(mine, 0)
    del name
    leaf = {0: torch.ones(4, requires_grad=True)}
    saved = leaf[0] * leaf[0]  # autograd keeps the input for the backward
    assert not _memory.unshared(leaf, 0)
    del saved
    assert _memory.unshared(leaf, 0)


_PLAIN_CHECK = """
import gc, json, torch
from _shardkit import memory
big = memory.empty_for_fill((4 << 20,), torch.float32)
big.fill_(3.0)
holder = {0: big}
del big
report = {
    "mapped": memory._mapping_of(holder[0]) is not None,
    "resizable": holder[0].untyped_storage().resizable(),  # False for storage on a mapping
    "sole_owner": memory.sole_owner(holder, 0),
    "unshared": memory.unshared(holder, 0),
    "sum": holder[0].sum().item(),
}
del holder
gc.collect()
report["cached"] = memory.cached_bytes()
print(json.dumps(report))
"""


@pytest.mark.slow  # fresh interpreters
@pytest.mark.parametrize(("value", "expected"), [
    pytest.param("1", {"mapped": False, "resizable": True, "sole_owner": False, "unshared": False,
                       "sum": 12.0 * MiB, "cached": 0}, id="plain"),
    pytest.param("0", {"mapped": True, "resizable": False, "sole_owner": True, "unshared": True,
                       "sum": 12.0 * MiB, "cached": 16 * MiB}, id="default"),
])
def test_plain_memory_switch_in_a_fresh_process(value: str, expected: dict[str, object]):
    import json
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[2])  # this checkout, not an installed copy
    env = {**os.environ, "SHARDKIT_PLAIN_MEMORY": value,
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.pop("SHARDKIT_CPU_CACHE_MB", None)
    done = subprocess.run([sys.executable, "-c", _PLAIN_CHECK], capture_output=True, text=True, timeout=120,
                          env=env, cwd=root)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == expected


def test_plain_memory_is_read_at_each_call(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SHARDKIT_PLAIN_MEMORY", "1")
    plain = _memory.empty_for_fill((8 * MiB,), torch.uint8)
    assert _memory._mapping_of(plain) is None and plain.untyped_storage().resizable()
    monkeypatch.setenv("SHARDKIT_PLAIN_MEMORY", "0")
    assert _memory._mapping_of(_memory.empty_for_fill((8 * MiB,), torch.uint8)) is not None
    monkeypatch.setenv("SHARDKIT_PLAIN_MEMORY", "yes")
    with pytest.raises(ValueError, match=r"SHARDKIT_PLAIN_MEMORY='yes' is neither 1 nor 0"):
        _memory.empty_for_fill((8 * MiB,), torch.uint8)
    assert not _memory.unshared({0: torch.empty(1)}, 0)  # deep inside a reshard: the safe answer, no error


@pytest.mark.slow  # fresh interpreters
def test_without_the_torch_internals_nothing_counts_as_unshared():
    """A torch without the private reference counts (simulated by removing one): the probe
    disables itself at import, and every tensor is treated as shared (copied, never released)."""
    import os
    import subprocess
    import sys

    code = ("import torch\ndel torch._C._storage_Use_Count\n"
            "from _shardkit import memory\n"
            "holder = {0: memory.empty_for_fill((4 << 20,), torch.float32)}\n"
            "assert memory._ALONE is None\n"
            "assert memory._mapping_of(holder[0]) is not None  # allocation itself is unaffected\n"
            "assert not memory.unshared(holder, 0) and not memory.sole_owner(holder, 0)\n")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.pop("SHARDKIT_PLAIN_MEMORY", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=root)
    assert done.returncode == 0, done.stderr
