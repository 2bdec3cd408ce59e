"""Checkpoints are never silently wrong: each test pins one way a checkpoint could be destroyed,
misread or turned into a hang, and checks that it is refused with a clear error instead.

Multi-rank cases (plain tensors that differ across ranks, a flipped byte seen through a
partial read) are in ``tests/distributed/test_checkpoint_defects.py``; random corruption
of the metadata and headers is in ``tests/unit/test_checkpoint_fuzz.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import checkpoint
import sharded_tensor as st
from checkpoint import CheckpointError
from checkpoint.__main__ import main
from sharding import single_split
from tests import _metadata_edit as edit

R0 = "rank:0/cpu"


def _ramp(*shape: int, dtype: torch.dtype = torch.float32, shift: float = 0.0) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * 0.5 + shift).to(dtype).reshape(shape)


def _sharded(full: torch.Tensor, dim: int, parts: int) -> st.ShardedTensor:
    t = st.zeros(*full.shape, sharding_spec=single_split(dim, [R0] * parts), dtype=full.dtype)
    for shard in t.local_shards():
        box = tuple(slice(o, o + n) for o, n in zip(shard.metadata.offsets, shard.metadata.dims))
        shard.tensor.copy_(full[box])
    return t


def _data_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("data-*.safetensors"))


def _mapped_in(folder: Path) -> list[str]:
    """Lines of /proc/self/maps that map a file of ``folder`` (memory maps left open)."""
    text = Path("/proc/self/maps").read_text()
    return [line for line in text.splitlines() if str(folder) in line]


def _run_with_timeout(fn: Any, seconds: float = 30.0) -> BaseException | None:
    """Run ``fn`` on a thread; fail the test if it has not returned within ``seconds``. Returns its exception."""
    box: dict[str, BaseException | None] = {"exc": None}

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001  # handed to the test
            box["exc"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} did not return within {seconds} s (it blocks)"
    return box["exc"]


# -- 1. concurrent saves to one path ----------------------------------------------------------

def test_concurrent_saves_never_destroy_the_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    checkpoint.save({"w": _ramp(64, 1024, shift=-1.0)}, folder, quiet=True)
    shifts = [-1.0]
    for round_ in range(6):
        results: dict[float, BaseException | None] = {}
        barrier = threading.Barrier(2)

        def job(shift: float, barrier: threading.Barrier, results: dict[float, BaseException | None]) -> None:
            sd = {"w": _ramp(64, 1024, shift=shift)}
            barrier.wait()
            try:
                checkpoint.save(sd, folder, quiet=True)
                results[shift] = None
            except BaseException as exc:  # noqa: BLE001  # examined below
                results[shift] = exc

        threads = [threading.Thread(target=job, args=(float(2 * round_ + k), barrier, results)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for error in results.values():
            if error is not None:  # the loser fails clearly, naming the folder
                assert isinstance(error, CheckpointError), repr(error)
                assert str(folder) in str(error)
        ok = [s for s, e in results.items() if e is None]
        out = {"w": torch.zeros(64, 1024)}
        checkpoint.load(out, folder)  # always loadable
        candidates = ok or [shifts[-1]]  # both failed: the previous checkpoint survives
        matches = [s for s in candidates if torch.equal(out["w"], _ramp(64, 1024, shift=s))]
        assert matches, f"round {round_}: the checkpoint holds none of the successful saves {ok}"
        shifts.append(matches[0])


_JOB = """
import sys, time, os, torch, checkpoint
folder, go, shift, ready = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
sd = {"w": (torch.arange(64 * 4096, dtype=torch.float64) * 0.5 + shift).float().reshape(64, 4096)}
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
try:
    checkpoint.save(sd, folder, quiet=True)
    print("saved")
except checkpoint.CheckpointError as exc:
    print("refused:", exc)
"""


@pytest.mark.slow  # fresh interpreters
@pytest.mark.timeout(1500)
def test_two_jobs_saving_to_one_path_at_once(tmp_path: Path) -> None:
    """Two independent 1-rank processes, released together: at most one commits, the other fails clearly."""
    import subprocess
    import sys

    folder = tmp_path / "ck"
    checkpoint.save({"w": _ramp(64, 4096, shift=-1.0)}, folder, quiet=True)
    last = -1.0
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for round_ in range(2):
        go = tmp_path / f"go{round_}"
        shifts = [float(2 * round_ + k) for k in range(2)]
        ready = [tmp_path / f"ready{round_}-{k}" for k in range(2)]
        jobs = [subprocess.Popen([sys.executable, "-c", _JOB, str(folder), str(go), str(shift), str(flag)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for shift, flag in zip(shifts, ready)]
        try:
            # Starting an interpreter that imports torch: a second or two on a quiet machine,
            # minutes at load average 35 on 2 cores.
            deadline = time.monotonic() + 600
            while not all(flag.exists() for flag in ready):  # both interpreters are up, state built, waiting
                assert all(job.poll() is None for job in jobs), "a job exited before it was ready"
                assert time.monotonic() < deadline, "a job did not start within 600 s"
                time.sleep(0.01)
            go.touch()
            outs = [job.communicate(timeout=600) for job in jobs]
        finally:
            for job in jobs:  # none outlives a failed round
                if job.poll() is None:
                    job.kill()
                    job.wait()
        for job, (out, err) in zip(jobs, outs):
            assert job.returncode == 0, err
            assert out.startswith(("saved", "refused:")), (out, err)
            if out.startswith("refused:"):
                assert "another save" in out and str(folder) in out, out
        saved = [shift for shift, (out, _) in zip(shifts, outs) if out.startswith("saved")]
        target = {"w": torch.zeros(64, 4096)}
        checkpoint.load(target, folder)  # always loadable
        matches = [shift for shift in (saved or [last]) if torch.equal(target["w"], _ramp(64, 4096, shift=shift))]
        assert matches, f"round {round_}: the checkpoint holds none of the successful saves {saved}"
        last = matches[0]
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("data-")) == ["shardkit.json"]
        assert len(_data_files(folder)) == 1


def test_a_save_in_progress_makes_a_second_save_fail_and_keeps_the_previous(tmp_path: Path) -> None:
    """Deterministic: the second save starts while the first is blocked between writing and committing."""
    from checkpoint import _save

    folder = tmp_path / "ck"
    checkpoint.save({"w": _ramp(4, 4)}, folder, quiet=True)
    entered, release = threading.Event(), threading.Event()
    first: dict[str, BaseException | None] = {}

    def hook(phase: str) -> None:
        if phase == "data_written" and threading.current_thread().name == "first":
            entered.set()
            release.wait(30)

    def run_first() -> None:
        try:
            checkpoint.save({"w": _ramp(4, 4, shift=1.0)}, folder, quiet=True)
            first["exc"] = None
        except BaseException as exc:  # noqa: BLE001
            first["exc"] = exc

    _save._test_hook = hook
    try:
        thread = threading.Thread(target=run_first, name="first")
        thread.start()
        assert entered.wait(30)
        with pytest.raises(CheckpointError, match="another save"):
            checkpoint.save({"w": _ramp(4, 4, shift=2.0)}, folder, quiet=True)
        release.set()
        thread.join(30)
    finally:
        _save._test_hook = None
        release.set()
    assert first["exc"] is None
    out = {"w": torch.zeros(4, 4)}
    checkpoint.load(out, folder)
    assert torch.equal(out["w"], _ramp(4, 4, shift=1.0))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_save_that_lost_its_lease_before_commit_commits_nothing(tmp_path: Path, where: str) -> None:
    """The lease is checked right before the commit: a save whose lease was taken over fails, and the
    save that took it over is the one the folder holds (without the check, both report success)."""
    import uuid

    import fsspec

    from checkpoint import _save

    url = str(tmp_path / "ck") if where == "local" else f"memory://lease-{uuid.uuid4().hex}/ck"
    checkpoint.save({"w": _ramp(4, 4)}, url, quiet=True)
    fs, root = fsspec.core.url_to_fs(url)
    state = {"first": True}

    def hook(phase: str) -> None:
        if phase == "before_commit" and state["first"]:
            state["first"] = False
            fs.rm_file(f"{root}/shardkit.lock")  # removed by hand: the next save may take the lease
            checkpoint.save({"w": _ramp(4, 4, shift=2.0)}, url, quiet=True)

    _save._test_hook = hook
    try:
        with pytest.raises(CheckpointError, match="lost its save lease"):
            checkpoint.save({"w": _ramp(4, 4, shift=1.0)}, url, quiet=True)
    finally:
        _save._test_hook = None
    out = {"w": torch.zeros(4, 4)}
    checkpoint.load(out, url)
    assert torch.equal(out["w"], _ramp(4, 4, shift=2.0))
    left = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert [n for n in left if n.startswith("data-")] == sorted(checkpoint.read_metadata(url).files)


# -- 2. files save does not own ----------------------------------------------------------------

def test_save_never_deletes_files_it_did_not_write(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    folder.mkdir()
    mine = folder / "data-0000000a-r00000.safetensors"
    mine.write_bytes(b"user data")
    other = folder / "shardkit.json.tmp-0000000b"
    other.write_bytes(b"also the user's")
    checkpoint.save({"w": _ramp(3)}, folder, quiet=True)
    first = _data_files(folder)
    checkpoint.save({"w": _ramp(3, shift=1.0)}, folder, quiet=True)
    assert mine.read_bytes() == b"user data"
    assert other.read_bytes() == b"also the user's"
    # the previous save's own file is gone, as its metadata listed it
    assert [p for p in first if p != mine and p.exists()] == []


# -- 3. corrupt regions never reach the target ------------------------------------------------

@pytest.mark.parametrize("dim", [0, 1])
def test_corrupt_region_raises_and_leaves_the_target_untouched(tmp_path: Path, dim: int) -> None:
    folder = tmp_path / "ck"
    full = _ramp(64, 256)
    checkpoint.save({"w": _sharded(full, dim, 2)}, folder, quiet=True)
    md = edit.read(folder)
    shard = edit.region(md, "w", 1)
    path = folder / shard.file
    data = bytearray(path.read_bytes())
    flip = (shard.start + shard.end) // 2
    data[flip] ^= 0xFF
    path.write_bytes(bytes(data))
    target = torch.full((64, 256), 7.0)
    with pytest.raises(CheckpointError, match="checksum mismatch") as info:
        checkpoint.load({"w": target}, folder)
    assert shard.file in str(info.value)
    # nothing corrupt stays: each element is the old value, the right one, or zero (a block read
    # straight into the target whose bytes fail verification is cleared), and the flipped
    # element is not the corrupt value
    assert bool(((target == 7.0) | (target == full) | (target == 0)).all())
    word = flip - (flip - shard.start) % 4
    corrupt = torch.frombuffer(bytearray(data[word:word + 4]), dtype=torch.float32)[0]
    assert not bool((target == corrupt).any()), corrupt
    assert _mapped_in(folder) == []


# -- 4. non-regular files -----------------------------------------------------------------------

def _checkpoint_with(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "ck"
    checkpoint.save({"w": _ramp(8, 4)}, folder, quiet=True)
    return folder, _data_files(folder)[0]


def _every_reader(folder: Path, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "out.safetensors"
    return {
        "load": lambda: checkpoint.load({"w": torch.zeros(8, 4)}, folder),
        "consolidate": lambda: checkpoint.consolidate(folder, out, quiet=True),
        "verify": lambda: main(["verify", "-q", str(folder)]),
        "inspect": lambda: main(["inspect", str(folder)]),
    }


def _refuses(fn: Any, name: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run a reader that must refuse the checkpoint promptly, naming file ``name``; return the message."""
    capsys.readouterr()
    exc = _run_with_timeout(fn)
    if exc is None:  # the CLI reports instead of raising: exit status and one line
        err = capsys.readouterr().err
        assert name in err and "Traceback" not in err, err
        return err
    assert isinstance(exc, CheckpointError), repr(exc)
    assert name in str(exc)
    return str(exc)


def test_symlinked_data_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, data = _checkpoint_with(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data.read_bytes())  # the same bytes: only the link itself is wrong
    data.unlink()
    data.symlink_to(outside)
    for what, fn in _every_reader(folder, tmp_path).items():
        if what == "inspect":
            continue  # inspect reads no data file
        assert "symlink" in _refuses(fn, data.name, capsys), what


def test_symlinked_metadata_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, _ = _checkpoint_with(tmp_path)
    outside = tmp_path / "outside.json"
    shutil.copy(folder / "shardkit.json", outside)
    (folder / "shardkit.json").unlink()
    (folder / "shardkit.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="symlink"):
        checkpoint.read_metadata(folder)
    for fn in _every_reader(folder, tmp_path).values():
        _refuses(fn, "shardkit.json", capsys)


@pytest.mark.parametrize("which", ["data", "metadata"])
def test_fifo_never_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str) -> None:
    folder, data = _checkpoint_with(tmp_path)
    victim = data if which == "data" else folder / "shardkit.json"
    victim.unlink()
    os.mkfifo(victim)
    try:
        for what, fn in _every_reader(folder, tmp_path).items():
            if what == "inspect" and which == "data":
                continue
            _refuses(fn, victim.name, capsys)
    finally:
        # unblock a reader that did open the FIFO, so no thread stays stuck
        try:
            fd = os.open(victim, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass


@pytest.mark.parametrize("which", ["data", "metadata"])
def test_directory_in_place_of_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 which: str) -> None:
    folder, data = _checkpoint_with(tmp_path)
    victim = data if which == "data" else folder / "shardkit.json"
    victim.unlink()
    victim.mkdir()
    for what, fn in _every_reader(folder, tmp_path).items():
        if what == "inspect" and which == "data":
            continue
        _refuses(fn, victim.name, capsys)


# -- 5. state_dicts and metadata that used to be mishandled ------------------------------------

def test_plain_tensor_named_like_a_region_key(tmp_path: Path) -> None:
    full = _ramp(6, 2)
    other = _ramp(3, 2, shift=100.0)
    checkpoint.save({"w": _sharded(full, 0, 2), "w@3,0": other}, tmp_path / "ck", quiet=True)
    out = {"w": torch.zeros(6, 2), "w@3,0": torch.zeros(3, 2)}
    checkpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["w"], full) and torch.equal(out["w@3,0"], other)


def test_self_referencing_value_is_refused(tmp_path: Path) -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    exc = _run_with_timeout(lambda: checkpoint.save({"w": _ramp(2), "cfg": {"loop": loop}}, tmp_path / "ck",
                                                    quiet=True))
    assert isinstance(exc, (TypeError, ValueError)), repr(exc)
    assert "cfg.loop" in str(exc) and "itself" in str(exc)
    cyclic: dict[str, Any] = {"a": _ramp(2)}
    cyclic["self"] = cyclic
    exc = _run_with_timeout(lambda: checkpoint.save(cyclic, tmp_path / "ck2", quiet=True))
    assert isinstance(exc, (TypeError, ValueError)), repr(exc)
    assert "self" in str(exc) and "itself" in str(exc)


def _saved(tmp_path: Path) -> Path:
    folder = tmp_path / "ck"
    checkpoint.save({"w": _ramp(8, 4), "b": _ramp(4, dtype=torch.float64), "epoch": 1}, folder, quiet=True)
    return folder


def _cli_refuses(folder: Path, capsys: pytest.CaptureFixture[str], *commands: str) -> None:
    for command in commands:
        argv = [command, str(folder)] if command != "consolidate" else [command, str(folder),
                                                                         str(folder.parent / "o.safetensors")]
        status = main(argv)
        err = capsys.readouterr().err
        assert status != 0, command
        lines = [line for line in err.splitlines() if line.strip()]
        assert "Traceback" not in err and "error" in lines[0] and "shardkit.json" in lines[0], err


def test_duplicate_keys_in_metadata_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _saved(tmp_path)
    text = (folder / "shardkit.json").read_text()
    assert text.startswith('{"format"')
    (folder / "shardkit.json").write_text('{"values":{},' + text[1:])  # "values" twice
    with pytest.raises(CheckpointError, match="duplicate") as info:
        checkpoint.read_metadata(folder)
    assert "values" in str(info.value) and "shardkit.json" in str(info.value)
    _cli_refuses(folder, capsys, "inspect", "verify")


def test_dtype_relabelled_in_metadata_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _saved(tmp_path)
    md = edit.read(folder)
    md["tensors"]["w"]["dtype"] = "int32"
    edit.write(folder, md)
    for target in (None, torch.zeros(8, 4, dtype=torch.int32)):
        with pytest.raises(CheckpointError, match="dtype") as info:
            checkpoint.load({"w": target, "b": None, "epoch": None}, folder)
        assert "F32" in str(info.value) or "float32" in str(info.value)
    with pytest.raises(CheckpointError, match="dtype"):
        checkpoint.consolidate(folder, tmp_path / "o.safetensors", quiet=True)
    status = main(["verify", "-q", str(folder)])
    assert status != 0 and "dtype" in capsys.readouterr().err


def test_shape_relabelled_in_metadata_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    md = edit.read(folder)
    md["tensors"]["w"]["size"] = [4, 8]
    edit.set_region(md, "w", 0, dims=[4, 8])
    assert edit.region(md, "w", 0).key == "w"  # still the whole tensor's key: only the shape is wrong
    edit.write(folder, md)
    with pytest.raises(CheckpointError, match="shape"):
        checkpoint.load({"w": None, "b": None, "epoch": None}, folder)


def test_sizes_beyond_the_files_are_refused_before_allocating(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    folder = _saved(tmp_path)
    md = edit.read(folder)
    huge = 1 << 40  # elements: 4 TiB of float32, claimed by a file of a few hundred bytes
    shard = edit.region(md, "w", 0)
    md["tensors"]["w"]["size"] = [huge]
    edit.set_region(md, "w", 0, offsets=[0], dims=[huge])
    regions = edit.regions(md, "w")
    regions["chunk_bytes"], regions["crc32c"] = 1 << 30, "0" * 8 * ((4 * huge) >> 30)
    edit.file_entry(md, shard.file)["bytes"] = shard.start + 4 * huge + 64
    assert edit.region(md, "w", 0).end == shard.start + 4 * huge  # the metadata is consistent: only the file lies
    edit.write(folder, md)
    with pytest.raises(CheckpointError, match="bytes") as info:
        checkpoint.load({"w": None, "b": None, "epoch": None}, folder)
    assert shard.file in str(info.value)
    with pytest.raises(CheckpointError, match="bytes"):
        checkpoint.consolidate(folder, tmp_path / "o.safetensors", quiet=True)


def test_deep_json_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _saved(tmp_path)
    text = (folder / "shardkit.json").read_text()
    deep = "[" * 200_000 + "]" * 200_000
    (folder / "shardkit.json").write_text(text.replace('"epoch":1', f'"epoch":{deep}'))
    with pytest.raises(CheckpointError, match="shardkit.json"):
        checkpoint.read_metadata(folder)
    _cli_refuses(folder, capsys, "inspect", "verify", "consolidate")


def test_deep_safetensors_header_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    path = _data_files(folder)[0]
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    text = json.dumps(header)[:-1] + ',"x":' + "[" * 100_000 + "]" * 100_000 + "}"
    text += " " * (-(8 + len(text)) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text.encode() + raw[8 + n:])
    _fix_sizes(folder, path, len(text) - n)
    exc = _run_with_timeout(lambda: checkpoint.load({"w": None, "b": None, "epoch": None}, folder))
    assert isinstance(exc, CheckpointError) and path.name in str(exc), repr(exc)


def _fix_sizes(folder: Path, path: Path, shift: int) -> None:
    """Move the metadata's regions in ``path`` by ``shift`` (after its header grew)."""
    md = edit.read(folder)
    edit.shift_file(md, path.name, shift)
    edit.write(folder, md)


def test_meta_device_target_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    with pytest.raises((CheckpointError, ValueError), match="meta"):
        checkpoint.load({"w": torch.empty(8, 4, device="meta"), "b": None, "epoch": None}, folder)
    meta_sharded = st.empty(8, 4, sharding_spec=single_split(0, ["rank:0/meta"] * 2))
    with pytest.raises((CheckpointError, ValueError), match="meta"):
        checkpoint.load({"w": meta_sharded, "b": None, "epoch": None}, folder)


def test_stride_zero_target_is_refused_clearly(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    checkpoint.save({"w": _ramp(4, 4)}, folder, quiet=True)
    target = torch.zeros(4).expand(4, 4)
    with pytest.raises((CheckpointError, ValueError), match="overlap") as info:
        checkpoint.load({"w": target}, folder)
    assert "'w'" in str(info.value)
    assert torch.equal(target, torch.zeros(4, 4))


def test_a_valid_checkpoint_still_round_trips_every_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The refusals above leave good checkpoints alone: load, consolidate, verify, inspect."""
    folder = _saved(tmp_path)
    out: dict[str, Any] = {"w": None, "b": None, "epoch": None}
    checkpoint.load(out, folder)
    assert torch.equal(out["w"], _ramp(8, 4)) and out["epoch"] == 1
    checkpoint.consolidate(folder, tmp_path / "o.safetensors", quiet=True)
    assert torch.equal(safetensors.torch.load_file(tmp_path / "o.safetensors")["w"], _ramp(8, 4))
    assert main(["verify", "-q", str(folder)]) == 0
    assert main(["inspect", str(folder)]) == 0
    capsys.readouterr()


# -- no pickle unless asked, and then only DCP's own classes ------------------------------------

class _Planted:
    """An object whose unpickling writes ``marker``: code execution, made visible."""

    def __init__(self, marker: Path, how: str) -> None:
        self.marker, self.how = marker, how

    def __reduce__(self) -> tuple[Any, ...]:
        if self.how == "exec":
            return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))
        # A method of an admitted module (pathlib): named "Path.write_text", never admitted.
        return (Path.write_text, (Path(self.marker), "ran"))


def _planted_pickle(marker: Path, how: str) -> bytes:
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    if how == "nested":  # DCP's own Metadata with the payload deep inside it
        return pickle.dumps(Metadata(state_dict_metadata={}, planner_data={"x": _Planted(marker, "exec")}))
    return pickle.dumps(_Planted(marker, how))


def _folder_kinds(tmp_path: Path) -> dict[str, Path]:
    """One folder of every kind: a Hugging Face folder, a shardkit checkpoint without (or with) its
    shardkit.json, a DCP folder, a CheckpointManager step."""
    import warnings

    import torch.distributed.checkpoint as dcp

    kinds = {}
    hf = tmp_path / "hf"
    hf.mkdir(parents=True)
    safetensors.torch.save_file({"w": _ramp(8, 4)}, str(hf / "model.safetensors"))
    kinds["hf"] = hf
    kinds["shardkit-without-json"] = _saved(tmp_path / "a")
    (kinds["shardkit-without-json"] / "shardkit.json").unlink()
    kinds["shardkit"] = _saved(tmp_path / "b")
    kinds["dcp"] = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": _ramp(8, 4), "b": _ramp(4, dtype=torch.float64), "epoch": 1},
                 storage_writer=dcp.FileSystemWriter(str(kinds["dcp"])), no_dist=True)
    manager = checkpoint.CheckpointManager(tmp_path / "runs")
    manager.save(3, {"w": _ramp(8, 4), "b": _ramp(4, dtype=torch.float64), "epoch": 1})
    kinds["manager-step"] = next(p.parent for p in (tmp_path / "runs").rglob("shardkit.json"))
    return kinds


def _load_target() -> dict[str, Any]:
    return {"w": torch.zeros(8, 4), "b": torch.zeros(4, dtype=torch.float64), "epoch": 0}


def _entry_points(folder: Path, out: Path) -> dict[str, Any]:
    """Every way into a checkpoint folder, as calls (``out``: where outputs may go)."""
    calls: dict[str, Any] = {
        "load": lambda: checkpoint.load(_load_target(), folder, strict=False),
        "load-mmap": lambda: checkpoint.load(_load_target(), folder, strict=False, mmap=True),
        "load-dcp": lambda: checkpoint.load(_load_target(), folder, strict=False, from_format="dcp"),
        "convert": lambda: checkpoint.convert(folder, out / "c"),
        "convert-dcp": lambda: checkpoint.convert(folder, out / "d", from_format="dcp"),
        "convert-dcp-safetensors": lambda: checkpoint.convert(folder, out / "e.safetensors", from_format="dcp",
                                                              to_format="safetensors"),
        "read_metadata": lambda: checkpoint.read_metadata(folder),
        "consolidate": lambda: checkpoint.consolidate(folder, out / "o.safetensors", quiet=True),
        "cli-inspect": lambda: main(["inspect", str(folder)]),
        "cli-verify": lambda: main(["verify", "-q", str(folder)]),
        "cli-consolidate": lambda: main(["consolidate", "-q", str(folder), str(out / "x.safetensors")]),
        "cli-convert": lambda: main(["convert", str(folder), str(out / "y")]),
        "cli-convert-dcp": lambda: main(["convert", "--from", "dcp", str(folder), str(out / "z")]),
    }
    if folder.name.startswith("step"):
        manager = checkpoint.CheckpointManager(folder.parent)
        calls["manager-load"] = lambda: manager.load(_load_target())
        calls["manager-steps"] = manager.steps
    return calls


_PAYLOADS = ("exec", "dotted-name", "nested")


def test_no_entry_point_runs_a_planted_metadata_pickle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pickle that writes a marker file, planted as ``.metadata`` in every kind of folder, never
    runs: not by default (no entry point reads ``.metadata`` unless asked for DCP), and not when
    asked (the restricted unpickler refuses the global before calling it). Each folder gets one of
    three payloads (a builtin, a method of an admitted module, a payload inside DCP's own Metadata);
    every payload also goes straight to the unpickler."""
    from checkpoint._dcp_metadata import parse_dcp_metadata

    marker = tmp_path / "marker"
    for how in _PAYLOADS:
        with pytest.raises(CheckpointError, match="refusing to unpickle"):
            parse_dcp_metadata(_planted_pickle(marker, how))
        assert not marker.exists(), how
    kinds = _folder_kinds(tmp_path / "folders")
    for k, folder in enumerate(kinds.values()):
        (folder / ".metadata").write_bytes(_planted_pickle(marker, _PAYLOADS[k % len(_PAYLOADS)]))
    out = tmp_path / "out"

    for kind, folder in kinds.items():
        calls = _entry_points(folder, out / kind)
        for name, call in calls.items():
            try:
                call()
            except (CheckpointError, FileNotFoundError, ValueError) as exc:
                assert str(exc), (kind, name)
                if name in ("load-dcp", "convert-dcp", "convert-dcp-safetensors") and kind != "hf":
                    assert "refusing to unpickle" in str(exc), (kind, name, exc)
            assert not marker.exists(), f"{name} on a {kind} folder ran the pickle planted as .metadata"
        err = capsys.readouterr().err
        if kind != "hf":
            assert "refusing to unpickle" in err, (kind, err)  # the CLI's --from dcp says why


def test_a_dcp_folder_is_read_only_when_named(tmp_path: Path) -> None:
    """Format detection never falls back to DCP's pickle: without from_format="dcp" a DCP folder is
    not a checkpoint, and the error says how to read it; with it, it loads bit for bit."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"w": _ramp(8, 4), "epoch": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    with pytest.raises(FileNotFoundError, match=r"from_format='dcp'"):
        checkpoint.load({"w": torch.zeros(8, 4), "epoch": 0}, tmp_path / "dcp")
    out = checkpoint.load({"w": torch.zeros(8, 4), "epoch": 0}, tmp_path / "dcp", from_format="dcp")
    assert torch.equal(out["w"], state["w"]) and out["epoch"] == 1
    with pytest.raises(ValueError, match="from_format='pickle'"):
        checkpoint.load({"w": torch.zeros(8, 4)}, tmp_path / "dcp", from_format="pickle")  # type: ignore[arg-type]


# -- shardkit.json cannot be edited silently; every argument checked alike -------------------------

def test_an_edited_metadata_file_is_refused_by_load_and_verify(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``"step": 5`` changed to 6 used to load silently and pass ``verify``; the content checksum catches it.
    Re-indenting the file changes no content and still loads."""
    folder = tmp_path / "ck"
    checkpoint.save({"w": _ramp(8, 4), "step": 5}, folder, quiet=True)
    text = (folder / "shardkit.json").read_text()
    pretty = json.dumps(json.loads(text), indent=2)
    (folder / "shardkit.json").write_text(pretty)
    assert checkpoint.load({"w": torch.zeros(8, 4), "step": 0}, folder)["step"] == 5
    for edited in (text.replace('"step":5', '"step":6'), text.replace('"checksum":', '"checksum_":')):
        (folder / "shardkit.json").write_text(edited)
        with pytest.raises(CheckpointError, match=r"shardkit.json' was edited or is corrupt") as info:
            checkpoint.load({"w": torch.zeros(8, 4), "step": 0}, folder)
        assert "save the checkpoint again" in str(info.value)
        assert main(["verify", "-q", str(folder)]) == 1
        assert "was edited or is corrupt" in capsys.readouterr().err
        with pytest.raises(CheckpointError, match="was edited or is corrupt"):
            checkpoint.read_metadata(folder)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), True, "10"], ids=repr)
def test_every_entry_point_refuses_a_bad_timeout(tmp_path: Path, timeout: Any) -> None:
    """``load`` on one process accepted what ``save`` refused; now every entry point checks alike."""
    folder = tmp_path / "ck"
    checkpoint.save({"w": _ramp(2)}, folder, quiet=True)
    rule = f"timeout={timeout!r} is not a timeout; use a positive, finite number of seconds"
    calls = {
        "save": lambda: checkpoint.save({"w": _ramp(2)}, tmp_path / "other", timeout=timeout),
        "load": lambda: checkpoint.load({"w": torch.zeros(2)}, folder, timeout=timeout),
        "load-dcp": lambda: checkpoint.load({"w": torch.zeros(2)}, folder, timeout=timeout, from_format="dcp"),
        "manager": lambda: checkpoint.CheckpointManager(tmp_path / "runs", timeout=timeout),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=re.escape(rule)):
            call()
        assert not (tmp_path / "other").exists(), name


def test_crafted_dcp_metadata_made_of_admitted_classes_is_still_refused(tmp_path: Path) -> None:
    """The restricted unpickler admits DCP's classes; what is built from them is checked too: a data file
    outside the folder, a chunk outside its tensor, something other than DCP's Metadata, a broken pickle."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from checkpoint._dcp_metadata import parse_dcp_metadata

    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": _ramp(8, 4)}, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    good = (folder / ".metadata").read_bytes()
    md = parse_dcp_metadata(good)
    index = next(iter(md.storage_data))
    md.storage_data[index] = _StorageInfo("../../outside.distcp", 0, 10)
    with pytest.raises(CheckpointError, match="not a plain file name inside the checkpoint folder"):
        parse_dcp_metadata(pickle.dumps(md))
    md = parse_dcp_metadata(good)
    md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([9, 4])
    with pytest.raises(CheckpointError, match=r"malformed DCP metadata .* tensor 'w' of size \(8, 4\) has chunk"):
        parse_dcp_metadata(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="holds a dict, not DCP's Metadata"):
        parse_dcp_metadata(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointError, match="not a readable DCP metadata pickle"):
        parse_dcp_metadata(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=r"names the global torch\._utils\._rebuild_tensor_v2"):
        parse_dcp_metadata(pickle.dumps(torch.ones(2)))
    # The checks accept what DCP writes: the folder still loads.
    assert torch.equal(checkpoint.load({"w": None}, folder, from_format="dcp")["w"], _ramp(8, 4))
