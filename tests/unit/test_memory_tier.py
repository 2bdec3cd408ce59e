"""The memory tier in one process, and its decisions as pure functions (no process group).

The decisions (``_memory_plan``) are table-driven: where replicas go, which step a restart
loads from what each host holds, the ranges fetched. The tier itself runs here as rank 0 of a
world of one, in a private memory folder: a save round trip read from memory (nothing from
storage), a torn step (killed while committing) never chosen, a corrupt memory copy removed
and the load falling back to storage bit for bit, what a dead job left reclaimed by the next
manager's first commit, nothing left after ``close()``, and the arguments refused clearly.
The multi-process fault model is in tests/distributed/test_memory_tier.py.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import checkpoint
from checkpoint._memory_plan import choose_step, merge_ranges, replica_targets


@pytest.mark.parametrize(("domains", "replicas", "expected"), [
    pytest.param(["a", "a", "b", "b"], 1, [[2], [3], [0], [1]], id="two-hosts"),
    pytest.param(["a", "b", "c", "d"], 1, [[1], [2], [3], [0]], id="host-per-rank"),
    pytest.param(["a", "b", "c", "d"], 2, [[1, 2], [2, 3], [3, 0], [0, 1]], id="two-replicas"),
    pytest.param(["a", "a", "b", "b"], 3, [[2], [3], [0], [1]], id="capped-at-other-hosts"),
    pytest.param(["a", "a", "a", "b"], 1, [[3], [3], [3], [0]], id="uneven-hosts"),
    pytest.param(["a", "a", "a", "a"], 1, [[], [], [], []], id="one-host-no-replica"),
    pytest.param(["a", "b"], 0, [[], []], id="no-replicas"),
])
def test_replica_targets(domains: list[str], replicas: int, expected: list[list[int]]) -> None:
    targets = replica_targets(domains, replicas)
    assert targets == expected
    for rank, peers in enumerate(targets):
        assert all(domains[p] != domains[rank] for p in peers)


def _held(step: int, have: list[int], need: tuple[int, ...] = (0, 1, 2, 3), gen: str = "g",
          digest: str = "d") -> dict[str, Any]:
    return {"step": step, "generation": gen, "digest": digest, "need": list(need), "have": have}


def _hosts(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks 0, 1 on host A holding ``a``; ranks 2, 3 on host B holding ``b``."""
    return [{"host": "A", "held": a}, {"host": "A", "held": a}, {"host": "B", "held": b}, {"host": "B", "held": b}]


@pytest.mark.parametrize(("reports", "storage", "step", "tier", "chosen", "reason"), [
    pytest.param(_hosts([_held(7, [0, 1, 2, 3])], []), [5], None, "memory", 7, "", id="one-host-holds-all"),
    pytest.param(_hosts([_held(7, [0, 1])], [_held(7, [2, 3])]), [5], None, "memory", 7, "", id="split-over-hosts"),
    pytest.param(_hosts([_held(7, [0, 1]), _held(6, [0, 1, 2, 3])], [_held(6, [2, 3])]), [5], None, "memory", 6, "",
                 id="torn-newest-not-chosen"),
    pytest.param(_hosts([_held(7, [0, 1])], []), [5], None, "storage", 5, "memory step 7 lacks the parts of ranks 2, 3",
                 id="host-lost-falls-back"),
    pytest.param(_hosts([_held(7, [0, 1, 2, 3], digest="x")], [_held(7, [0, 1, 2, 3], digest="y")]), [5], None,
                 "storage", 5, "different metadata", id="metadata-disagrees"),
    pytest.param(_hosts([_held(10, [0, 1, 2, 3])], []), [10], None, "memory", 10, "", id="tie-prefers-memory"),
    pytest.param(_hosts([_held(8, [0, 1, 2, 3])], []), [10], None, "storage", 10, "older than storage's",
                 id="storage-newer"),
    pytest.param(_hosts([_held(8, [0, 1, 2, 3])], []), [5, 10], 5, "storage", 5, "memory holds no step 5",
                 id="asked-step-in-storage"),
    pytest.param(_hosts([_held(8, [0, 1, 2, 3])], []), [10], 8, "memory", 8, "", id="asked-step-in-memory"),
    pytest.param(_hosts([_held(8, [0, 1, 2, 3])], []), [10], 9, "none", None, "step=9 is neither", id="asked-nowhere"),
    pytest.param(_hosts([_held(8, [0, 1])], []), [], None, "none", None, "lacks the parts of ranks 2, 3",
                 id="nothing-complete"),
    pytest.param(_hosts([], []), [], None, "none", None, "no step in memory", id="empty"),
])
def test_choose_step(reports: list[dict[str, Any]], storage: list[int], step: int | None, tier: str,
                     chosen: int | None, reason: str) -> None:
    choice = choose_step(reports, storage, step)
    assert (choice.tier, choice.step) == (tier, chosen)
    assert reason in choice.reason
    if tier == "memory":
        assert choice.reason == "" and set(choice.holders) == {0, 1, 2, 3}
        assert all(choice.holders[p] for p in choice.holders)


def test_choose_step_names_holders_and_metadata_ranks() -> None:
    choice = choose_step(_hosts([_held(7, [0, 1, 3])], [_held(7, [2, 3])]), [], None)
    assert choice.holders == {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (0, 1, 2, 3)}
    assert choice.metadata_ranks == (0, 1, 2, 3)


@pytest.mark.parametrize(("ranges", "gap", "expected"), [
    pytest.param([(10, 20), (0, 8), (15, 30)], 0, [(0, 8), (10, 30)], id="overlap"),
    pytest.param([(10, 20), (0, 8)], 2, [(0, 20)], id="gap"),
    pytest.param([(5, 5), (1, 2)], 0, [(1, 2)], id="empty-dropped"),
    pytest.param([], 0, [], id="none"),
])
def test_merge_ranges(ranges: list[tuple[int, int]], gap: int, expected: list[tuple[int, int]]) -> None:
    assert merge_ranges(ranges, gap=gap) == expected


# -- the tier in one process ---------------------------------------------------------------------

def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(33, 17, generator=g), "h": torch.randn(9, generator=g).to(torch.bfloat16),
                      "flags": torch.arange(5) % 2 == 0}, "step": step}


def _empty() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(33, 17), "h": torch.zeros(9, dtype=torch.bfloat16),
                      "flags": torch.zeros(5, dtype=torch.bool)}, "step": None}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def _manager(tmp_path: Path, **kwargs: Any) -> checkpoint.CheckpointManager:
    options = {"keep_last": 2, "storage_every": 4, "memory_every": 1, "memory_dir": tmp_path / "memory", **kwargs}
    return checkpoint.CheckpointManager(tmp_path / "run", **options)


def _files(tmp_path: Path) -> list[str]:
    # os.walk, not rglob: a step folder the background work reclaims while this lists is skipped, not an error.
    memory = tmp_path / "memory"
    return sorted(str((Path(folder) / name).relative_to(memory)) for folder, _, names in os.walk(memory)
                  for name in names)


def test_round_trip_from_memory_and_nothing_left_after_close(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    for step in range(1, 7):
        manager.save(step, _state(step), async_=step % 2 == 0)
        # One committed step, one being staged at most: the parts of two steps, and their metadata.
        assert len([f for f in _files(tmp_path) if f.endswith(".safetensors") or ".spare-" in f]) <= 2
    manager.wait()
    assert manager.steps() == [4]
    restarted = _manager(tmp_path)  # a restarted job on the same root
    assert restarted.recoverable_step() == 6
    state = restarted.load(_empty())
    assert _equal(state, _state(6))
    report = restarted.last_load
    assert report is not None and (report.step, report.tier, report.storage_bytes, report.peer_bytes) == (
        6, "memory", 0, 0)
    assert report.local_bytes >= 33 * 17 * 4
    assert _equal(restarted.load(_empty(), step=4), _state(4))
    assert restarted.last_load is not None and restarted.last_load.tier == "storage"
    restarted.save(7, _state(7))
    restarted.close()
    manager.close()
    assert _files(tmp_path) == []
    assert not list((tmp_path / "memory").iterdir())


def test_a_memory_part_is_safetensors_with_its_data_on_cache_lines(tmp_path: Path) -> None:
    # The training thread copies into these offsets: one off a 64-byte line copies 10-20% slower.
    state = {**_state(1), "extra": {"x": torch.randn(16, 8, dtype=torch.float64), "y": torch.randn(3)}}
    manager = _manager(tmp_path, storage_every=100)
    manager.save(1, state)
    (part,) = [Path(folder) / name for folder, _, names in os.walk(tmp_path / "memory") for name in names
               if name.endswith(".safetensors")]
    raw = part.read_bytes()
    data_start = 8 + int.from_bytes(raw[:8], "little")
    assert data_start % 64 == 0
    header = json.loads(raw[8:data_start])
    itemsize = {"F64": 8, "F32": 4, "BF16": 2, "BOOL": 1}
    spans = sorted(tuple(e["data_offsets"]) + (itemsize[e["dtype"]],) for k, e in header.items()
                   if k != "__metadata__")
    assert len(spans) == 5 and spans[0][0] == 0 and spans[-1][1] == len(raw) - data_start
    for (begin, end, size), after in zip(spans, [*spans[1:], None]):
        assert begin % (64 if (end - begin) % 64 == 0 else size) == 0, (begin, end, size)
        assert after is None or after[0] == end  # back to back, as safetensors requires
    with safe_open(str(part), "pt") as f:
        values = sorted(f.get_tensor(k).double().sum().item() for k in f.keys())
    expected = [state["model"][k].double().sum().item() for k in ("w", "h", "flags")]
    assert values == sorted([*expected, state["extra"]["x"].sum().item(), state["extra"]["y"].double().sum().item()])
    manager.close()


def test_torn_memory_step_is_never_chosen(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    for step in range(1, 6):
        manager.save(step, _state(step))
    # A process killed while committing step 6: its part is in place but not its metadata.
    (job,) = (tmp_path / "memory").iterdir()
    (folder,) = [p for p in job.iterdir() if p.is_dir()]
    (committed,) = folder.glob("step-*")
    torn = folder / "step-0000000006"
    torn.mkdir()
    for part in committed.glob("*.safetensors"):
        (torn / part.name.replace(f"{5:x}-", f"{6:x}-")).write_bytes(part.read_bytes())
    restarted = _manager(tmp_path)
    assert restarted.recoverable_step() == 5
    assert _equal(restarted.load(_empty()), _state(5))
    assert restarted.last_load is not None and restarted.last_load.tier == "memory"
    manager.close()
    restarted.close()


def test_corrupt_memory_copy_falls_back_to_storage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = _manager(tmp_path, storage_every=2)
    for step in range(1, 5):
        manager.save(step, _state(step))
    manager.save(5, _state(5))
    (part,) = (tmp_path / "memory").rglob("step-0000000005/*.safetensors")
    raw = bytearray(part.read_bytes())
    raw[-3] ^= 0xFF  # the last region's last bytes: the header still parses, a checksum does not match
    part.write_bytes(bytes(raw))
    restarted = _manager(tmp_path, storage_every=2)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        state = restarted.load(_empty())
    assert _equal(state, _state(4))  # storage's newest: memory's step 5 is gone with its only copy
    assert restarted.last_load is not None and restarted.last_load.tier == "storage"
    assert "corrupt; removed" in caplog.text and "loading step 4 from storage" in caplog.text
    assert not part.exists()
    manager.close()
    restarted.close()


def test_a_dead_jobs_memory_is_reclaimed_by_the_next_managers_first_commit(tmp_path: Path) -> None:
    dead = _manager(tmp_path)
    for step in range(1, 4):
        dead.save(step, _state(step))
    (job,) = (tmp_path / "memory").iterdir()
    old = [p.name for p in job.iterdir() if p.is_dir()]
    # The job died: its lock is released with its process (here: closed by hand), its files stay.
    assert dead._memory is not None
    os.close(dead._memory.folder._lock_fd)
    dead._memory.folder._lock_fd = -1
    from checkpoint import _memory_folder
    _memory_folder._own_lives.discard(dead._memory.folder.path)
    fresh = _manager(tmp_path)
    assert _equal(fresh.load(_empty()), _state(3))
    assert all((job / name).exists() for name in old)  # still there: the new job has no step in memory yet
    fresh.save(4, _state(4))
    assert not any((job / name).exists() for name in old)
    fresh.close()
    assert not (tmp_path / "memory").exists() or not list((tmp_path / "memory").iterdir())


@pytest.mark.parametrize(("kwargs", "message"), [
    pytest.param({"memory_every": 0}, "memory_every=0 must be an int >= 1 or None", id="every-zero"),
    pytest.param({"memory_every": True}, "memory_every=True must be an int", id="every-bool"),
    pytest.param({"memory_every": 1, "memory_replicas": -1}, "memory_replicas=-1 must be an int >= 0",
                 id="replicas-negative"),
    pytest.param({"memory_every": 1, "keep_last_memory": 0}, "keep_last_memory=0 must be an int >= 1",
                 id="keep-zero"),
    pytest.param({"storage_every": 2.5}, "storage_every=2.5 must be an int >= 1 or None", id="storage-float"),
])
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint.CheckpointManager(tmp_path / "run", **kwargs)


def test_a_memory_folder_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    (tmp_path / "memory").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    from checkpoint._memory_folder import job_folder

    name = Path(job_folder(str(tmp_path / "probe"), manager._memory.root_url)).name  # type: ignore[union-attr]
    (tmp_path / "memory" / name).symlink_to(elsewhere)
    with pytest.raises(OSError, match="is a symlink; it must be a folder of this user"):
        manager.save(1, _state(1))
    assert not list(elsewhere.iterdir())
