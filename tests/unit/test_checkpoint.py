"""checkpoint save/load in one process (a world of one): format, backends, every integrity error.

Multi-rank behaviour (layouts across world sizes, replicas, crashes) is in
``tests/distributed/test_checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickletools
from pathlib import Path

import fsspec
import pytest
import safetensors
import torch

import checkpoint
import sharded_tensor as st
from checkpoint import CheckpointError, _codec, _files, _save, _schema, _storage
from sharding import single_split
from tests import _metadata_edit as edit

R0 = "rank:0/cpu"


def _split(dim: int, parts: int):
    return single_split(dim, [R0] * parts)


def _sharded(full: torch.Tensor, spec) -> st.ShardedTensor:
    t = st.zeros(*full.shape, sharding_spec=spec, dtype=full.dtype)
    for shard in t.local_shards():
        box = tuple(slice(o, o + n) for o, n in zip(shard.metadata.offsets, shard.metadata.dims))
        shard.tensor.copy_(full[box])
    return t


def _full(t: st.ShardedTensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype)
    for shard in t.local_shards():
        out[tuple(slice(o, o + n) for o, n in zip(shard.metadata.offsets, shard.metadata.dims))] = shard.tensor
    return out


ALL_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.uint16, torch.uint32, torch.uint64]


def _example(dtype: torch.dtype, shape=(5, 3)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) if not dtype.is_complex else \
            torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@pytest.fixture
def memory_url(request):
    """A fresh ``memory://`` folder; its name holds glob characters on purpose (``[...]``)."""
    url = f"memory://ckpt-{request.node.name}"
    yield url
    store = fsspec.filesystem("memory").store
    for key in [k for k in store if k.startswith(url.removeprefix("memory:/"))]:
        del store[key]


# -- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["local", "memory"])
def test_round_trip_nested_state_dict(tmp_path, memory_url, backend):
    path = str(tmp_path / "ck") if backend == "local" else memory_url
    w = _example(torch.float32, (10, 4))
    tensors = {dtype: _example(dtype) for dtype in ALL_DTYPES}
    sd = {"model": {"w": _sharded(w, _split(0, 3)), "b": torch.arange(5.0)},
          "dtypes": {str(d).removeprefix("torch."): t for d, t in tensors.items()},
          "scalar": torch.tensor(3), "empty": torch.zeros(0, 4),
          "opt": {"state": {0: {"step": 4, "exp_avg": torch.ones(2, 2)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
          "epoch": 3, "name": "run", "flag": True, "nothing": None, "inf": float("inf")}
    checkpoint.save(sd, path)

    md = checkpoint.read_metadata(path)
    assert set(md.tensors) == {"model.w", "model.b", "scalar", "empty", "opt.state.0.exp_avg",
                               *(f"dtypes.{str(d).removeprefix('torch.')}" for d in ALL_DTYPES)}
    assert dict(md.values) == {"opt.state.0.step": 4, "opt.param_groups": [{"lr": 0.1, "betas": [0.9, 0.99],
                                                                               "params": [0]}],
                               "epoch": 3, "name": "run", "flag": True, "nothing": None, "inf": float("inf")}
    assert md.tensors["model.w"].size == torch.Size([10, 4]) and md.tensors["model.w"].dtype == torch.float32
    assert [s.region for s in md.tensors["model.w"].shards] == [((0, 0), (4, 4)), ((4, 0), (4, 4)), ((8, 0), (2, 4))]

    target = {"model": {"w": st.zeros(10, 4, sharding_spec=_split(1, 2)), "b": torch.zeros(5)},
              "dtypes": {k: torch.zeros_like(v) for k, v in sd["dtypes"].items()},
              "scalar": torch.tensor(0), "empty": torch.zeros(0, 4),
              "opt": {"state": {0: {"step": 0, "exp_avg": None}}, "param_groups": None},
              "epoch": 0, "name": "", "flag": False, "nothing": 1, "inf": 0.0}
    b_storage = target["model"]["b"].data_ptr()
    out = checkpoint.load(target, path)
    assert out is target
    assert torch.equal(_full(target["model"]["w"]), w)
    assert torch.equal(target["model"]["b"], torch.arange(5.0)) and target["model"]["b"].data_ptr() == b_storage
    for key, t in sd["dtypes"].items():
        assert torch.equal(target["dtypes"][key].view(torch.uint8), t.view(torch.uint8)), key
    assert target["scalar"].item() == 3 and target["empty"].shape == (0, 4)
    assert torch.equal(target["opt"]["state"][0]["exp_avg"], torch.ones(2, 2))  # None -> a new tensor
    assert target["opt"]["state"][0]["step"] == 4
    assert target["opt"]["param_groups"] == [{"lr": 0.1, "betas": [0.9, 0.99], "params": [0]}]
    assert (target["epoch"], target["name"], target["flag"], target["nothing"], target["inf"]) == (3, "run", True, None,
                                                                                                   float("inf"))


def test_files_are_plain_safetensors_and_json_without_pickle(tmp_path):
    sd = {"w": _sharded(_example(torch.float32, (6, 4)), _split(0, 2)), "b": torch.ones(3, dtype=torch.bfloat16),
          "meta": {"epoch": 1}}
    checkpoint.save(sd, tmp_path / "ck")
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names[-1] == "shardkit.json" and all(n.endswith(".safetensors") for n in names[:-1]), names
    meta = json.loads((tmp_path / "ck" / "shardkit.json").read_text())  # plain JSON
    assert meta["format"] == "shardkit-checkpoint" and meta["version"] == 4
    assert meta["checksum"] == edit.seal(meta)  # the checksum of its own content
    assert edit.file_names(meta) == names[:-1]
    saved = {name: edit.all_regions(meta, name) for name in meta["tensors"]}
    assert sum(len(r) for r in saved.values()) == 3  # w in two regions, b in one
    for name in names[:-1]:
        raw = (tmp_path / "ck" / name).read_bytes()
        assert edit.file_entry(meta, name)["bytes"] == len(raw)
        assert not raw.startswith(b"\x80") and b"PK\x03\x04" not in raw[:8]  # neither pickle nor torch zip
        with safetensors.safe_open(str(tmp_path / "ck" / name), "pt") as f:
            about = json.loads(f.metadata()["shardkit"])
            assert about["generation"] == meta["generation"]
            assert sorted(f.keys()) == sorted(r.key for rs in saved.values() for r in rs if r.file == name)
            for key in f.keys():
                region = about["regions"][key]
                tensor = f.get_tensor(key)
                shard = next(r for r in saved[region["name"]] if r.key == key)
                assert tensor.shape == shard.dims and tuple(region["offsets"]) == shard.offsets
                # start is exact: the bytes there are the tensor's, and each chunk's checksum matches
                data = raw[shard.start:shard.end]
                assert data == tensor.contiguous().view(torch.uint8).numpy().tobytes()
                step = edit.regions(meta, region["name"])["chunk_bytes"]
                assert [_codec.checksum(data[a:a + step]) for a in range(0, len(data), step)] == \
                    [f"crc32c:{c:08x}" for c in shard.crcs] and len(shard.crcs) >= 1
        header, data_start = _codec.parse_safetensors_header(raw, file=name)
        assert data_start == 8 + int.from_bytes(raw[:8], "little") and data_start % 8 == 0
    # Loading a file's bytes with pickle machinery would fail: there is no pickle opcode stream.
    with pytest.raises(ValueError):
        list(pickletools.genops((tmp_path / "ck" / names[0]).read_bytes()))


def test_overwrite_replaces_generation_and_never_writes_outside(tmp_path):
    path = tmp_path / "sub" / "ck"
    checkpoint.save({"w": torch.zeros(3)}, path)
    first = checkpoint.read_metadata(path).generation
    checkpoint.save({"w": torch.ones(3), "v": 2}, path)
    md = checkpoint.read_metadata(path)
    assert md.generation != first and dict(md.values) == {"v": 2}
    assert sorted(os.listdir(path)) == sorted([*md.files, "shardkit.json"])  # old files removed
    assert os.listdir(tmp_path) == ["sub"] and os.listdir(tmp_path / "sub") == ["ck"]
    assert torch.equal(checkpoint.load({"w": torch.zeros(3), "v": 0}, path)["w"], torch.ones(3))


def test_failed_commit_keeps_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save({"w": torch.zeros(3)}, tmp_path)
    before = sorted(os.listdir(tmp_path))

    def boom(phase: str) -> None:
        if phase == "before_commit":
            raise OSError("storage went away (simulated)")

    monkeypatch.setattr(_save, "_test_hook", boom)
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save({"w": torch.ones(3)}, tmp_path)
    assert sorted(os.listdir(tmp_path)) == before  # the new generation's files are gone again
    assert torch.equal(checkpoint.load({"w": torch.ones(3)}, tmp_path)["w"], torch.zeros(3))


# -- reading only what is needed ------------------------------------------------------------------

class _CountingReader(_files.DataReader):
    log: list[tuple[str, int]] = []
    _header = False  # reading a safetensors header (checked against the metadata), not tensor data

    def read_header(self, path, **kwargs):
        self._header = True
        try:
            return super().read_header(path, **kwargs)
        finally:
            self._header = False

    def readinto(self, path, start, buffer, **kwargs):
        if self.local:
            self.log.append(("header" if self._header else "read", len(buffer)))
        super().readinto(path, start, buffer, **kwargs)

    def read(self, path, start, end, **kwargs):
        if not self.local:
            self.log.append(("header" if self._header else "read", end - start))
        return super().read(path, start, end, **kwargs)

    def read_many(self, path, ranges, **kwargs):
        if not self.local and len(ranges) > 1:
            self.log.extend(("read", b - a) for a, b in ranges)
        return super().read_many(path, ranges, **kwargs)


_copy_mapped = _files._copy_mapped


def _counting_copy_mapped(task, *args):
    args[-1].log.append(("mapped", task.nbytes))  # what the strided copy touches
    return _copy_mapped(task, *args)


@pytest.mark.parametrize("backend", ["local", "memory"])
@pytest.mark.parametrize(("saved", "target", "shape", "mode"), [
    pytest.param((0, 4), (0, 2), (16, 8), "one range", id="rows-into-rows"),
    pytest.param((1, 4), (0, 2), (16, 8), "strided", id="cols-into-rows"),
    pytest.param((0, 4), (1, 2), (16, 32768), "runs", id="rows-into-cols-long-rows"),
    pytest.param((0, 4), (1, 2), (16, 8), "slabs", id="rows-into-cols-short-rows"),
])
def test_load_reads_only_needed_bytes(tmp_path, memory_url, monkeypatch, backend, saved, target, shape, mode):
    path = str(tmp_path / "ck") if backend == "local" else memory_url
    full = _example(torch.float32, shape)
    checkpoint.save({"w": _sharded(full, _split(*saved))}, path)
    log: list[tuple[str, int]] = []
    monkeypatch.setattr(_CountingReader, "log", log)
    monkeypatch.setattr(_files, "DataReader", _CountingReader)
    monkeypatch.setattr(_files, "_copy_mapped", _counting_copy_mapped)
    out = checkpoint.load({"w": st.zeros(*shape, sharding_spec=_split(*target))}, path)["w"]
    assert torch.equal(_full(out), full)
    read = sum(n for kind, n in log if kind == "read")
    mapped = sum(n for kind, n in log if kind == "mapped")
    needed = full.numel() * full.element_size()
    if backend == "local" and mode != "one range":
        # Strided overlaps are copied out of a memory map: the kernel reads only touched pages.
        assert read == 0 and mapped == needed
    elif mode == "one range":  # whole saved regions: exactly the needed bytes
        assert read == needed and mapped == 0, (read, needed)
    else:
        # Partial reads are widened to whole checksum chunks so they can be verified; these
        # regions are smaller than a chunk, so each target block reads its regions whole.
        assert needed <= read <= needed * 2 and mapped == 0, (read, needed)


def test_direct_read_into_target_memory(tmp_path, monkeypatch):
    """Whole contiguous overlaps go straight into the target tensor: no scratch buffer, no copy."""
    full = _example(torch.float32, (8, 4))
    checkpoint.save({"w": full}, tmp_path)
    copies = []
    monkeypatch.setattr(_files, "_copy", lambda dest, src: copies.append(1) or dest.copy_(src))
    target = torch.zeros(8, 4)
    checkpoint.load({"w": target}, tmp_path)
    assert torch.equal(target, full) and copies == []
    checkpoint.load({"w": torch.zeros(8, 4, dtype=torch.float64)}, tmp_path, cast=True)
    assert copies == [1]


# -- errors ---------------------------------------------------------------------------------------

def _saved(tmp_path: Path) -> tuple[Path, dict]:
    path = tmp_path / "ck"
    checkpoint.save({"w": _sharded(_example(torch.float32, (6, 4)), _split(0, 2)), "b": torch.ones(3),
                     "epoch": 1}, path)
    return path, json.loads((path / "shardkit.json").read_text())


def _target() -> dict:
    return {"w": st.zeros(6, 4, sharding_spec=_split(0, 2)), "b": torch.zeros(3), "epoch": 0}


def test_flipped_byte_names_file_and_tensor(tmp_path):
    path, meta = _saved(tmp_path)
    shard = edit.region(meta, "w", 1)
    data = bytearray((path / shard.file).read_bytes())
    data[shard.start + 3] ^= 0x10
    (path / shard.file).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in '.*{shard.file}' for tensor 'w'"):
        checkpoint.load(_target(), path)


def test_flipped_checksum_digit_names_file_and_tensor(tmp_path):
    # The other side of a flipped byte: the data is intact, the recorded chunk checksum is not.
    path, meta = _saved(tmp_path)
    shard = edit.region(meta, "w", 1)
    regions = edit.regions(meta, "w")
    digits = list(regions["crc32c"])
    at = edit.CRC_DIGITS * sum(edit.chunk_counts(meta, "w")[:1]) + 5  # a digit of region 1's first chunk
    digits[at] = "0" if digits[at] != "0" else "1"
    regions["crc32c"] = "".join(digits)
    edit.write(path, meta)  # resealed: the chunk checksum itself must catch it
    target = _target()
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in '.*{shard.file}' for tensor 'w'"):
        checkpoint.load(target, path)
    # the region's rows never reach the target
    assert not torch.equal(_full(target["w"])[3:], _example(torch.float32, (6, 4))[3:])


def test_truncated_and_missing_files(tmp_path):
    path, meta = _saved(tmp_path)
    name = edit.region(meta, "b", 0).file
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match=rf"data file '.*{name}' of tensor '(w|b)' is truncated"):
        checkpoint.load(_target(), path)
    (path / name).unlink()
    with pytest.raises(CheckpointError, match=rf"data file '.*{name}' of tensor '(w|b)' is missing"):
        checkpoint.load(_target(), path)


@pytest.mark.parametrize(("mutate", "match"), [
    pytest.param(lambda m: "{not json", "not valid JSON", id="not-json"),
    pytest.param(lambda m: json.dumps({**m, "format": "other"}), "is not shardkit checkpoint metadata", id="format"),
    pytest.param(lambda m: json.dumps({**m, "version": 99}), "format version 99, newer", id="version"),
    pytest.param(lambda m: _edited(m, lambda md: md["tensors"]["w"].update(dtype="float7")),
                 "tensor 'w' has unknown dtype 'float7'", id="dtype"),
    pytest.param(lambda m: _edited(m, edit.set_region, "w", 1, dims=(2, 4)),
                 r"tensor 'w' regions: saved regions leave a gap at element \(5, 0\)", id="gap"),
    pytest.param(lambda m: _edited(m, edit.drop_region, "w", 1),
                 r"tensor 'w' regions: (saved regions leave a gap at element \(3, 0\)|the saved regions do not tile "
                 r"the tensor's size \[6, 4\]: the only region has offsets=\[0, 0\], dims=\[3, 4\])",
                 id="region-removed"),
    pytest.param(lambda m: _edited(m, edit.set_region, "w", 0, start=0),
                 r"tensor 'w' regions\[0\] start: \[0, 48\) does not hold 48 bytes", id="byte-range"),
    pytest.param(lambda m: _edited(m, edit.set_region, "w", 1, start=m["files"][0]["bytes"] - 47),
                 r"tensor 'w' regions\[1\] start: .* inside file 'data-.*' of \d+ bytes", id="byte-range-past-end"),
    pytest.param(lambda m: _edited(m, _set_column, "w", "crc32c", "md5:0"), r"tensor 'w' regions crc32c",
                 id="checksum"),
    pytest.param(lambda m: _edited(m, _set_column, "w", "crc32c", m["tensors"]["w"]["regions"]["crc32c"][:-1]),
                 r"tensor 'w' regions crc32c: chunk checksums must be 2 x 8", id="checksum-short"),
])
def test_malformed_metadata(tmp_path, mutate, match):
    path, meta = _saved(tmp_path)
    (path / "shardkit.json").write_text(mutate(meta))
    with pytest.raises(CheckpointError, match=match) as info:
        checkpoint.load(_target(), path)
    assert "shardkit.json" in str(info.value)


def _edited(meta: dict, change, *args, **kwargs) -> str:
    """``meta`` changed and resealed (its content checksum recomputed): the defence behind it must catch it."""
    change(meta, *args, **kwargs)
    return json.dumps({**meta, "checksum": edit.seal(meta)})


def _set_column(meta: dict, name: str, column: str, value: object) -> None:
    edit.regions(meta, name)[column] = value


@pytest.mark.parametrize("name", ["../escape.safetensors", "/etc/passwd", "sub/x.safetensors", "..", "C:x",
                                  "s3://bucket/x"])
def test_file_names_outside_the_folder_are_refused(tmp_path, name):
    path, meta = _saved(tmp_path)
    old = edit.region(meta, "w", 0).file
    edit.file_entry(meta, old)["name"] = name  # the regions refer to it by its number
    assert edit.region(meta, "w", 0).file == name
    edit.write(path, meta)
    with pytest.raises(CheckpointError, match="not a plain file name inside the checkpoint folder") as info:
        checkpoint.load(_target(), path)
    assert repr(name) in str(info.value) and "shardkit.json" in str(info.value)


def test_shape_and_dtype_mismatch(tmp_path):
    path, _ = _saved(tmp_path)
    target = _target() | {"b": torch.zeros(4)}
    with pytest.raises(CheckpointError, match=r"tensor 'b' in '.*shardkit.json' has size \(3,\).* has size \(4,\)"):
        checkpoint.load(target, path)
    target = _target() | {"b": torch.zeros(3, dtype=torch.float16)}
    with pytest.raises(CheckpointError, match=r"tensor 'b' .* has dtype torch.float32.*torch.float16; pass cast=True"):
        checkpoint.load(target, path)
    checkpoint.load(target, path, cast=True)
    assert target["b"].dtype == torch.float16 and torch.equal(target["b"], torch.ones(3, dtype=torch.float16))
    with pytest.raises(CheckpointError, match="holds a tensor for 'b', but the state_dict has int"):
        checkpoint.load(_target() | {"b": 5}, path)
    with pytest.raises(CheckpointError, match="holds a non-tensor value for 'epoch', but the state_dict has a Tensor"):
        checkpoint.load(_target() | {"epoch": torch.zeros(1)}, path)


def test_strict_keys(tmp_path):
    path, _ = _saved(tmp_path)
    target = {"w": st.zeros(6, 4, sharding_spec=_split(1, 2)), "extra": torch.zeros(1), "other": 3}
    with pytest.raises(CheckpointError, match=r"missing=\['extra', 'other'\].*unexpected=\['b', 'epoch'\]") as info:
        checkpoint.load(target, path)
    assert (info.value.missing, info.value.unexpected) == (["extra", "other"], ["b", "epoch"])
    checkpoint.load(target, path, strict=False)
    assert target["other"] == 3 and torch.equal(target["extra"], torch.zeros(1))
    assert not torch.equal(_full(target["w"]), torch.zeros(6, 4))


def test_incomplete_and_absent_checkpoints(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no shardkit checkpoint at"):
        checkpoint.read_metadata(tmp_path / "nothing")

    def die(phase: str) -> None:
        if phase == "before_commit":
            raise KeyboardInterrupt  # not an Exception: like a crash, no cleanup runs

    monkeypatch.setattr(_save, "_test_hook", die)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save({"w": torch.ones(3)}, tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"checkpoint '.*ck' is incomplete: it holds 1 data file\(s\)"):
        checkpoint.load({"w": torch.zeros(3)}, tmp_path / "ck")


@pytest.mark.parametrize(("value", "where"), [
    pytest.param(object(), "'opt.thing' is object", id="object"),
    pytest.param([1, {2}], r"'opt.thing' is set at 'opt.thing\[1\]'", id="set-in-list"),
    pytest.param({"a": torch.nn.Linear(1, 1)}, "'opt.thing.a' is Linear", id="module"),
    pytest.param(b"bytes", "'opt.thing' is bytes", id="bytes"),
    pytest.param([{1: 2}], "dict with key 1 of type int", id="int-key-in-value"),
])
def test_non_json_values_raise_type_error_naming_the_key(tmp_path, value, where):
    with pytest.raises(TypeError, match=where):
        checkpoint.save({"w": torch.ones(1), "opt": {"thing": value}}, tmp_path / "ck")
    assert not (tmp_path / "ck" / "shardkit.json").exists()


def test_unsupported_dtype_and_key_collisions(tmp_path):
    with pytest.raises(TypeError, match="tensor 'c' has dtype torch.complex128, which safetensors cannot store"):
        checkpoint.save({"c": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "ck")
    with pytest.raises(ValueError, match="both flatten to the name 'a.b'"):
        checkpoint.save({"a.b": 1, "a": {"b": 2}}, tmp_path / "ck")
    with pytest.raises(TypeError, match="keys must be str"):
        checkpoint.save({("a",): 1}, tmp_path / "ck")


def test_metadata_file_is_compact_and_validated_before_commit():
    file = "data-ab-r00000.safetensors"
    x = {"count": 1, "digits": 16, "offsets": edit.encode([0], 16), "dims": edit.encode([2], 16),
         "file": edit.encode([0], 16), "start": edit.encode([64], 16), "chunk_bytes": 1 << 20, "crc32c": "0000000a"}
    y = {"count": 2, "digits": 16, "grid": [edit.encode([0, 1, 4], 16), edit.encode([0, 2], 16)],
         "file": edit.encode([0, 0], 16), "start": edit.encode([72, 80], 16),
         "chunk_bytes": 8, "crc32c": edit.encode([1, 2, 3, 4], 8),
         "keys": {"1": "y-rest"}}
    text = json.dumps({
        "format": "shardkit-checkpoint", "version": 3, "generation": "ab", "world_size": 1,
        "files": [{"name": file, "bytes": 104}],
        "tensors": {"x": {"dtype": "float32", "size": [2], "regions": x},
                    "y": {"dtype": "float32", "size": [4, 2], "regions": y}},
        "values": {"n": 1}})
    md = _schema.parse_metadata(text, source="t")
    assert md.version == 3 and dict(md.files) == {file: 104} and md.values["n"] == 1
    assert md.tensors["x"].shards[0].nbytes == 8 and md.nbytes == 8 + 32
    assert math.prod(md.tensors["x"].size) == 2
    assert list(md.tensors["y"].shards) == [
        _schema.SavedShard((0, 0), (1, 2), file, "y@0,0", (72, 80), "", 8, (1,)),
        _schema.SavedShard((1, 0), (3, 2), file, "y-rest", (80, 104), "", 8, (2, 3, 4))]
    out = md.to_json()
    assert " " not in out and "\n" not in out  # compact
    written = json.loads(out)
    assert written.pop("checksum") == edit.seal(written) and written.pop("version") == 4
    assert written["tensors"]["y"]["regions"]["digits"] == 2  # as few digits as the values need
    for entry in written["tensors"].values():
        edit.widen(entry["regions"])
    assert written == {k: v for k, v in json.loads(text).items() if k != "version"}  # the same columns written back
    assert _schema.parse_metadata(out) == dataclasses.replace(md, version=4)
    # An older version is written as the current version: the regions are the same, without the
    # whole-region checksums of version 2 (the chunk checksums cover every byte).
    v2 = _schema.parse_metadata((Path(__file__).parent.parent / "data/v2/one_rank/shardkit.json").read_text())
    assert v2.version == 2 and all(s.checksum.startswith("crc32c:") for e in v2.tensors.values() for s in e.shards)
    again = _schema.parse_metadata(v2.to_json())
    assert again.version == 4 and dict(again.files) == dict(v2.files) and again.values == v2.values
    for name, entry in v2.tensors.items():
        assert (again.tensors[name].size, again.tensors[name].dtype) == (entry.size, entry.dtype), name
        assert list(again.tensors[name].shards) == [dataclasses.replace(s, checksum="") for s in entry.shards], name
    # Version 1 has no chunk checksums, which versions 3 and 4 need: refused, not written wrong.
    v1 = _schema.parse_metadata(json.dumps({
        "format": "shardkit-checkpoint", "version": 1, "generation": "ab", "world_size": 1,
        "files": {file: {"bytes": 72}},
        "tensors": {"x": {"dtype": "float32", "size": [2], "shards": [
            {"offsets": [0], "dims": [2], "file": file, "key": "x", "byte_range": [64, 72],
             "checksum": "crc32c:00000000"}]}},
        "values": {"n": 1}}), source="t")
    assert v1.tensors["x"].shards[0].nbytes == 8 and v1.nbytes == 8 and v1.values["n"] == 1
    assert v1.tensors["x"].shards[0].checksum == "crc32c:00000000" and v1.tensors["x"].shards[0].chunks == ()
    with pytest.raises(ValueError, match="tensor 'x': only regions with chunk checksums"):
        v1.to_json()


def test_parsed_entry_finds_the_regions_a_block_needs():
    # 300 saved regions of a (600, 4) tensor, 2 rows each; the parsed entry answers from its
    # index, which must agree with intersecting every region.
    files = {_storage.data_file_name("ab", 0): 8 + 600 * 4 * 4}
    shards = [_schema.SavedShard((2 * r, 0), (2, 4), _storage.data_file_name("ab", 0), f"w@{2 * r},0",
                                 (8 + 32 * r, 8 + 32 * (r + 1)), "crc32c:00000000", 1 << 20, (0,))
              for r in range(300)]
    text = _schema.CheckpointMetadata({"w": _schema.TensorEntry(torch.Size((600, 4)), torch.float32, tuple(shards))},
                                      {}, files, "ab", 1).to_json()
    entry = _schema.parse_metadata(text).tensors["w"]
    box = ((101, 1), (6, 2))  # rows 101..106: regions 50..53
    found = entry.overlapping(box)
    assert [s.offsets for s, _ in found] == [(100, 0), (102, 0), (104, 0), (106, 0)]
    assert [c for _, c in found] == [((101, 1), (1, 2)), ((102, 1), (2, 2)), ((104, 1), (2, 2)), ((106, 1), (1, 2))]
    # An entry built by hand (no index yet) gives the same answer.
    fresh = _schema.TensorEntry(entry.size, entry.dtype, entry.shards)
    assert fresh.overlapping(box) == found and fresh == entry


def test_parse_reports_a_bad_region_among_many():
    files = {_storage.data_file_name("ab", 0): 8 + 600 * 4 * 4}
    shards = [{"offsets": [2 * r, 0], "dims": [2, 4], "file": _storage.data_file_name("ab", 0), "key": f"w{r}",
               "byte_range": [8 + 32 * r, 8 + 32 * (r + 1)], "checksum": "crc32c:00000000"} for r in range(300)]
    shards[120]["checksum"] = "crc32c:XYZ"
    data = {"format": "shardkit-checkpoint", "version": 1, "generation": "ab", "world_size": 1,
            "files": {name: {"bytes": n} for name, n in files.items()},
            "tensors": {"w": {"dtype": "float32", "size": [600, 4], "shards": shards}}, "values": {}}
    with pytest.raises(CheckpointError, match=r"tensor 'w' shards\[120\] checksum: expected"):
        _schema.parse_metadata(json.dumps(data))
    shards[120]["checksum"] = "crc32c:00000000"
    shards[121]["dims"] = [True, 4]
    with pytest.raises(CheckpointError, match=r"shards\[121\] dims: expected a list of ints in \[0, 2\*\*63\)"):
        _schema.parse_metadata(json.dumps(data))
    shards[121]["dims"] = [2, 4]
    del shards[7]
    with pytest.raises(CheckpointError, match=r"saved regions leave a gap at element \(14, 0\)"):
        _schema.parse_metadata(json.dumps(data))
