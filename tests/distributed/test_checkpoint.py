"""checkpoint.save / load on real Gloo ranks: any layout and world size in, any out; crashes mid-save.

Few spawns, each checking a lot (every rank compares its result with a single-process
reference computed from the same seeds):

- 4 ranks save ``ck4``; 2 ranks load it into other specs, save ``ck2``, and check that one
  rank's error reaches every rank; 4 ranks load ``ck2`` into yet other specs.
- 4 ranks where rank 3 SIGKILLs itself after writing its data: the survivors raise a clear
  error at once, the previous checkpoint still loads, the partial save is refused.
- 4 ranks where rank 3 hangs after writing: the survivors raise within ``timeout``.
- 2 ranks where rank 1 never calls load: rank 0 raises within load's ``timeout``.

No assertion reads a clock against a budget (this machine's load varies too much): "at once"
is shown by a ``timeout=`` longer than the launcher's own, and a hung rank stays hung until
it sees every survivor's file saying it gave up.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
import torch.distributed as dist

import checkpoint
import sharded_tensor as st
from checkpoint import CheckpointError, _save
from sharding import (
    DevicePlacement,
    EnumerableShardingSpec,
    ShardMetadata,
    mesh,
    single_split,
)
from tests.distributed._launch import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed

# name -> (size, dtype): the tensors of every state_dict below.
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "big0": ((4096,), torch.float32), "big1": ((4096,), torch.float32),
    "big2": ((4096,), torch.float32), "big3": ((4096,), torch.float32),
    "w_rows": ((10, 4), torch.float32),
    "w_mesh": ((6, 8), torch.float32),
    "w_rep": ((8, 6), torch.float32),
    "w_full": ((4, 4), torch.bfloat16),
    "emb": ((64, 32), torch.float32),
    "wide": ((8, 32768), torch.float32),     # 128 KiB rows: column blocks are read run by run
    "opt.state.0.exp_avg": ((10, 4), torch.float32),
    "step": ((), torch.int64),
    "mask": ((5,), torch.bool),
    "empty": ((0, 3), torch.float32),
}
VALUES = {"epoch": 7, "lr": 0.5, "name": "run-1", "betas": [0.9, 0.999], "sched.milestones": [1, 2],
          "none": None, "opt.param_groups": [{"lr": 0.1, "params": [0]}]}


def reference(name: str) -> torch.Tensor:
    size, dtype = TENSORS[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype == torch.bool:
        return torch.rand(size, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(0, 1000, size, generator=g)
    return torch.randn(size, generator=g).to(dtype)


def _cpu(rank: int) -> str:
    return f"rank:{rank}/cpu"


def _replicas(rows: list[tuple[int, int, list[int]]], cols: int) -> EnumerableShardingSpec:
    """Row blocks ``(start, stop, holders)``: each block held by every rank in ``holders``."""
    return EnumerableShardingSpec([ShardMetadata((a, 0), (b - a, cols), _cpu(r))
                                   for a, b, ranks in rows for r in ranks])


def _layout(which: str) -> dict[str, Any]:
    """name -> spec (None: a plain tensor) for the three layouts the spawns use."""
    r4, r2 = [_cpu(r) for r in range(4)], [_cpu(r) for r in range(2)]
    if which == "A4":  # saved by 4 ranks
        return {"w_rows": single_split(0, r4), "w_mesh": mesh([[r4[0], r4[1]], [r4[2], r4[3]]]),
                "w_rep": _replicas([(0, 4, [0, 1]), (4, 8, [2, 3])], 6), "w_full": DevicePlacement("cpu"),
                "emb": single_split(1, r4), "wide": single_split(0, r4),
                "opt.state.0.exp_avg": single_split(0, [r4[3], r4[2], r4[1], r4[0]])}
    if which == "B2":  # loaded by 2 ranks from A4, then saved
        return {"big0": single_split(0, r2), "w_rows": single_split(1, r2), "w_mesh": single_split(0, [r2[1], r2[0]]),
                "w_rep": DevicePlacement(_cpu(1)), "w_full": single_split(0, r2),
                "emb": single_split(0, [r2[0], r2[1], r2[0]]), "wide": single_split(1, r2),
                "opt.state.0.exp_avg": mesh([[r2[0]], [r2[1]]])}
    assert which == "C4"  # loaded by 4 ranks from B2
    return {"w_rows": mesh([[r4[0], r4[1]], [r4[2], r4[3]]]), "w_mesh": single_split(1, r4),
            "w_rep": single_split(0, [r4[3], r4[2], r4[1], r4[0]]), "w_full": DevicePlacement("cpu"),
            "big2": single_split(0, r4),
            "wide": _replicas([(0, 3, [0, 2]), (3, 8, [1, 3])], 32768),
            "opt.state.0.exp_avg": single_split(1, [r4[1], r4[0]])}


def _state_dict(which: str, *, filled: bool) -> dict[str, Any]:
    """A nested state_dict in layout ``which``: filled from the reference, or zeros/None to load into."""
    layout = _layout(which)
    flat: dict[str, Any] = {}
    for name, (size, dtype) in TENSORS.items():
        spec = layout.get(name)
        if spec is None:
            flat[name] = reference(name).clone() if filled else torch.zeros(size, dtype=dtype)
            continue
        t = st.zeros(*size, sharding_spec=spec, dtype=dtype)
        if filled:
            full = reference(name)
            for shard in t.local_shards():
                box = tuple(slice(o, o + n) for o, n in zip(shard.metadata.offsets, shard.metadata.dims))
                shard.tensor.copy_(full[box])
        flat[name] = t
    for name, value in VALUES.items():
        flat[name] = value if filled else None
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(int(p) if p.isdigit() else p, {})
        node[int(leaf) if leaf.isdigit() else leaf] = value
    return nested


def _mismatches(state_dict: dict[str, Any]) -> list[str]:
    """Names whose local data differs from the reference (each rank checks its own shards)."""
    bad = []
    for name in TENSORS:
        node: Any = state_dict
        for p in name.split("."):
            node = node[int(p) if p.isdigit() else p]
        full = reference(name)
        if isinstance(node, st.ShardedTensor):
            for shard in node.local_shards():
                box = tuple(slice(o, o + n) for o, n in zip(shard.metadata.offsets, shard.metadata.dims))
                if not torch.equal(shard.tensor, full[box]):
                    bad.append(name)
        elif not torch.equal(node, full):
            bad.append(name)
    for name, value in VALUES.items():
        node = state_dict
        for p in name.split("."):
            node = node[p]
        if node != value:
            bad.append(name)
    return bad


def _save_a4(rank: int, world_size: int, root: str) -> None:
    checkpoint.save(_state_dict("A4", filled=True), f"{root}/ck4", timeout=60)


def _flip_byte(path: str, position: int) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0xFF]))


def _load_b2_save_b2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sd = _state_dict("B2", filled=False)
    checkpoint.load(sd, f"{root}/ck4")
    out["bad_after_load"] = _mismatches(sd)
    checkpoint.save(sd, f"{root}/ck2")  # what was loaded, saved again from 2 ranks

    # One rank's checksum error reaches every rank: only rank 1 reads w_rep (held whole by it).
    if rank == 0:
        shutil.copytree(f"{root}/ck4", f"{root}/ck4-bad")
        md = checkpoint.read_metadata(f"{root}/ck4-bad")
        shard = md.tensors["w_rep"].shards[1]
        _flip_byte(f"{root}/ck4-bad/{shard.file}", shard.byte_range[0] + 5)
    dist.barrier()
    try:
        checkpoint.load(_state_dict("B2", filled=False), f"{root}/ck4-bad")
    except CheckpointError as exc:
        out["corrupt_error"] = str(exc)

    # Different structures on different ranks: the same ValueError everywhere, nothing written.
    extra = {"x": torch.ones(3)} if rank == 0 else {"x": torch.ones(3), "y": 1}
    try:
        checkpoint.save(extra, f"{root}/mismatch")
    except ValueError as exc:
        out["mismatch_error"] = str(exc)

    # A rank that fails while writing: every rank raises, the new files are removed, ck2 intact.
    def fail_on_rank_1(phase: str) -> None:
        if phase == "data_written" and rank == 1:
            raise OSError("disk full (simulated)")
    _save._test_hook = fail_on_rank_1
    try:
        checkpoint.save(_state_dict("B2", filled=False), f"{root}/ck2")
    except (CheckpointError, OSError) as exc:
        out["write_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _save._test_hook = None
    sd = _state_dict("B2", filled=False)
    checkpoint.load(sd, f"{root}/ck2")
    out["bad_after_failed_overwrite"] = _mismatches(sd)
    return out


def _load_c4(rank: int, world_size: int, root: str) -> list[str]:
    sd = _state_dict("C4", filled=False)
    checkpoint.load(sd, f"{root}/ck2")
    bad = _mismatches(sd)
    # A process group of global ranks 1 and 3: layouts name group ranks 0 and 1.
    sub = dist.new_group([1, 3])
    if rank in (1, 3):
        full = torch.arange(24.0).reshape(6, 4)
        group_cpus = ["rank:0/cpu", "rank:1/cpu"]
        t = st.zeros(6, 4, sharding_spec=single_split(0, group_cpus), process_group=sub)
        t.local_shard().copy_(full[3 * dist.get_rank(sub):3 * dist.get_rank(sub) + 3])
        checkpoint.save({"t": t, "v": rank}, f"{root}/sub", process_group=sub)
        out = {"t": st.zeros(6, 4, sharding_spec=single_split(1, group_cpus), process_group=sub), "v": None}
        checkpoint.load(out, f"{root}/sub", process_group=sub)
        mine = out["t"].local_shards()[0]
        if not torch.equal(mine.tensor, full[:, mine.metadata.offsets[1]:mine.metadata.offsets[1] + 2]):
            bad.append("subgroup")
        if out["v"] != 1 or checkpoint.read_metadata(f"{root}/sub").world_size != 2:
            bad.append("subgroup values")
    dist.barrier()
    return bad


def test_save_4_load_2_save_2_load_4(tmp_path):
    root = str(tmp_path)
    run_distributed(_save_a4, 4, root, timeout=90)

    # The folder: committed metadata plus one safetensors file per rank; nothing else, no pickle.
    names = sorted(os.listdir(tmp_path / "ck4"))
    assert names[-1] == "shardkit.json" and len(names) == 5, names
    md = checkpoint.read_metadata(tmp_path / "ck4")
    assert md.world_size == 4 and dict(md.values) == VALUES
    assert set(md.tensors) == set(TENSORS)
    # A replicated region is written exactly once, by one of its holders, spread over them.
    writer = {name: [int(s.file.split("-r")[1][:5]) for s in md.tensors[name].shards] for name in md.tensors}
    assert len(md.tensors["w_full"].shards) == 1                     # replicated on all 4 ranks
    assert [s.offsets for s in md.tensors["w_rep"].shards] == [(0, 0), (4, 0)]
    assert writer["w_rep"][0] in (0, 1) and writer["w_rep"][1] in (2, 3)
    assert sorted(writer[f"big{i}"][0] for i in range(4)) == [0, 1, 2, 3]  # plain tensors spread
    assert len(md.tensors["w_rows"].shards) == 4 and md.tensors["empty"].shards == ()
    # Each data file stands alone: safetensors reads it, and its regions match the reference.
    for name, entry in md.tensors.items():
        for shard in entry.shards:
            with safetensors.safe_open(str(tmp_path / "ck4" / shard.file), "pt") as f:
                data = f.get_tensor(shard.key)
            box = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.dims))
            assert torch.equal(data, reference(name)[box]), (name, shard)

    b2 = run_distributed(_load_b2_save_b2, 2, root, timeout=90)
    assert [r["bad_after_load"] for r in b2] == [[], []]
    assert "checksum mismatch" in b2[1]["corrupt_error"] and "'w_rep'" in b2[1]["corrupt_error"]
    assert "ck4-bad/data-" in b2[1]["corrupt_error"]
    assert "failed on rank 1" in b2[0]["corrupt_error"] and "checksum mismatch" in b2[0]["corrupt_error"]
    for r in b2:
        assert "rank 1's state_dict differs from rank 0's" in r["mismatch_error"]
        assert "extra ['y']" in r["mismatch_error"]
    assert b2[1]["write_error"] == "OSError: disk full (simulated)"
    assert b2[0]["write_error"].startswith("CheckpointError") and "rank 1: OSError: disk full" in b2[0]["write_error"]
    assert [r["bad_after_failed_overwrite"] for r in b2] == [[], []]
    assert len(os.listdir(tmp_path / "ck2")) == 3  # the failed save's files are gone
    assert checkpoint.read_metadata(tmp_path / "ck2").world_size == 2

    c4 = run_distributed(_load_c4, 4, root, timeout=90)
    assert c4 == [[], [], [], []]


# -- crashes in the middle of a save ------------------------------------------------------------

def _die_after_writing(phase: str) -> None:
    if phase == "data_written" and dist.get_rank() == 3:
        os.kill(os.getpid(), signal.SIGKILL)


_HUNG_EXIT = 5  # rank 3's exit code if the survivors never gave up (a safety net, not a wait)
_save_root: list[str] = []  # this rank's test folder, where survivors say they gave up


def _hang_after_writing(phase: str) -> None:
    """Rank 3 stays stuck until every survivor has given up on it, then dies as if killed."""
    if phase == "data_written" and dist.get_rank() == 3:
        root = Path(_save_root[0])
        deadline = time.monotonic() + 120
        while not all((root / f"gave-up-rank{r}").exists() for r in range(3)):
            if time.monotonic() > deadline:
                os._exit(_HUNG_EXIT)
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


def _save_then_crash(rank: int, world_size: int, root: str, mode: str, timeout: float) -> None:
    path = f"{root}/ck"
    _save_root[:] = [root]
    if mode == "kill":  # a complete checkpoint exists at the path first
        checkpoint.save(_state_dict("A4", filled=True), path, timeout=timeout)
    sd = _state_dict("A4", filled=True)
    sd["epoch"] = 8
    _save._test_hook = _die_after_writing if mode == "kill" else _hang_after_writing
    start = time.monotonic()
    try:
        checkpoint.save(sd, path, timeout=timeout)
    except CheckpointError as exc:
        (Path(root) / f"gave-up-rank{rank}").touch()  # releases the hung rank
        msg = f"{exc} [after {time.monotonic() - start:.1f} s]"
        raise CheckpointError(msg) from None


def _survivor_errors(info: pytest.ExceptionInfo[DistributedTestError]) -> dict[int, str]:
    return {r: text for r, text in info.value.failures.items() if r != 3}


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
    # save's timeout (600 s) is far beyond the launcher's (60 s): a survivor can only raise
    # CheckpointError by noticing the dead peer at once, else the launcher kills it first.
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_save_then_crash, 4, str(tmp_path), "kill", 600.0, timeout=60)
    assert "rank 3 exited with code -9" in info.value.failures[3], info.value
    survivors = _survivor_errors(info)
    assert sorted(survivors) == [0, 1, 2], info.value
    for text in survivors.values():
        assert "CheckpointError: checkpoint.save to" in text, text
        assert "not every one of the 4 ranks finished writing" in text, text
        assert "Nothing was committed" in text, text
        assert "did not finish" not in text, text  # raised by save itself, not stopped by the launcher

    # The previous checkpoint is still the committed one, with identical data.
    ck = tmp_path / "ck"
    md = checkpoint.read_metadata(ck)
    assert md.values["epoch"] == 7
    loaded = checkpoint.load({name: None for name in md.tensors} | {name: None for name in md.values}, ck)
    for name in TENSORS:
        assert torch.equal(loaded[name], reference(name)), name
    # The partial save left data files of a newer generation next to it ...
    partial = [n for n in os.listdir(ck) if n.endswith(".safetensors") and md.generation not in n]
    assert len(partial) == 4, sorted(os.listdir(ck))
    # ... which, on their own, are refused as an incomplete checkpoint.
    alone = tmp_path / "partial"
    alone.mkdir()
    for name in partial:
        shutil.copy(ck / name, alone / name)
    with pytest.raises(CheckpointError, match=r"is incomplete: it holds 4 data file\(s\).*no 'shardkit.json'"):
        checkpoint.read_metadata(alone)
    with pytest.raises(CheckpointError, match="is incomplete"):
        checkpoint.load({"epoch": None}, alone, strict=False)
    # The next successful save (here from one process) removes every stale file.
    checkpoint.save({"x": torch.ones(2)}, ck)
    assert len(os.listdir(ck)) == 2


def test_hung_rank_mid_save_times_out(tmp_path):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_save_then_crash, 4, str(tmp_path), "hang", 3.0, timeout=60)
    # Rank 3 was still stuck when the survivors gave up: it left only on seeing that (or was
    # killed by the launcher while still stuck), never through its safety-net exit.
    hung = info.value.failures[3]
    assert "exited with code -9" in hung or "did not finish (killed)" in hung, info.value
    survivors = _survivor_errors(info)
    assert sorted(survivors) == [0, 1, 2], info.value
    waited = []
    for text in survivors.values():
        assert "not every one of the 4 ranks finished writing" in text and "within timeout=3 s" in text, text
        waited.append(float(text.split("[after ")[1].split(" s]")[0]))
    # The first survivor to give up waited the timeout; the others may then see its exit first.
    # A lower bound only: a timeout cannot fire early, while load can only make it later.
    assert max(waited) >= 2.5, waited
    with pytest.raises(CheckpointError, match="is incomplete"):
        checkpoint.read_metadata(tmp_path / "ck")


def _load_without_peer(rank: int, world_size: int, root: str) -> str | None:
    path = f"{root}/ck"
    checkpoint.save({"w": torch.arange(4.0)}, path)
    if rank == 1:
        time.sleep(6)  # never calls load: as if stuck elsewhere
        return None
    with pytest.raises(CheckpointError) as info:
        checkpoint.load({"w": torch.zeros(4)}, path, timeout=2)
    return str(info.value)


def test_load_times_out_on_a_missing_peer(tmp_path):
    text, _ = run_distributed(_load_without_peer, 2, str(tmp_path), timeout=60)
    assert "checkpoint.load from" in text and "not every one of the 2 ranks finished loading" in text, text
    assert "within timeout=2 s" in text, text
