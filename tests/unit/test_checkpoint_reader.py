"""The reader of saved bytes and the atomic writer, on their own: local files and ``memory://``."""

from __future__ import annotations

import fsspec
import pytest

from checkpoint import CheckpointError
from checkpoint._codec import checksum
from checkpoint._reader import DataReader, RegionCheck
from checkpoint._schema import SavedShard
from checkpoint._storage import atomic_write, list_names

DATA = bytes(range(256)) * 4  # 1024 bytes; the region below is bytes [24, 1000)
REGION = SavedShard((0,), (976,), "data.safetensors", "r", (24, 1000), checksum(DATA[24:1000]))


@pytest.fixture(params=["local", "memory"])
def stored(request, tmp_path):
    """``(fs, path)`` of a file holding DATA."""
    if request.param == "local":
        fs = fsspec.filesystem("file")
        path = str(tmp_path / "data.safetensors")
    else:
        fs = fsspec.filesystem("memory")
        path = f"/reader-{request.node.name}/data.safetensors"
    fs.pipe_file(path, DATA)
    yield fs, path
    if request.param == "memory":
        fs.rm_file(path)


def test_region_pieces_verify_the_span_across_pieces(stored):
    fs, path = stored
    with DataReader(fs) as reader:
        pieces = [bytes(p) for p in reader.region_pieces(path, REGION, memoryview(bytearray(100)), tensor="w")]
        assert b"".join(pieces) == DATA[24:1000] and len(pieces) == 10
        out = bytearray(976)
        reader.read_region(path, REGION, memoryview(out), tensor="w")
        assert bytes(out) == DATA[24:1000]
        bad = SavedShard((0,), (976,), "data.safetensors", "r", (24, 1000), "crc32c:00000000")
        with pytest.raises(CheckpointError, match=r"checksum mismatch in '.*data.safetensors' for tensor 'w' "
                                                  r"\(region offsets=\[0\], dims=\[976\], bytes \[24, 1000\)\)"):
            list(reader.region_pieces(path, bad, memoryview(bytearray(100)), tensor="w"))


def test_region_check_checks_only_spans_read_whole():
    bad = SavedShard((0,), (976,), "f", "r", (24, 1000), "crc32c:00000000")
    RegionCheck(bad, "f", "w", start=25).update(DATA[25:1000])  # starts inside the span: not checked
    RegionCheck(bad, "f", "w").update(DATA[24:999])  # ends before the span does: not checked
    check = RegionCheck(REGION, "f", "w")
    for first in range(24, 1000, 300):  # in pieces that do not line up with anything
        check.update(DATA[first:min(first + 300, 1000)])
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        RegionCheck(bad, "f", "w").update(DATA[24:1000])


def test_missing_and_truncated_files(stored):
    fs, path = stored
    with DataReader(fs) as reader:
        with pytest.raises(CheckpointError, match=r"data file '.*data.safetensors' of tensor 'w' is truncated: "
                                                  r"needed bytes \[1000, 1030\) but only 24 of 30"):
            reader.read(path, 1000, 1030, tensors="w")
        with pytest.raises(CheckpointError, match=r"data file '.*other' \(holding tensors 'a', 'b'\) is missing"):
            reader.size(path.replace("data.safetensors", "other"), tensors=["a", "b"])
        assert reader.read_many(path, [(0, 4), (1020, 1024)]) == [DATA[:4], DATA[1020:]]


def test_atomic_write_is_complete_or_absent(stored):
    fs, path = stored
    folder = path.rsplit("/", 1)[0]
    target = f"{folder}/out.bin"

    def failing():
        yield b"first half"
        raise OSError("storage went away (simulated)")

    with pytest.raises(OSError, match="simulated"):
        atomic_write(fs, target, failing())
    assert sorted(list_names(fs, folder)) == ["data.safetensors"]  # no output, no temporary file
    atomic_write(fs, target, [b"a", memoryview(b"bc")])
    with pytest.raises(OSError, match="simulated"):
        atomic_write(fs, target, failing())
    assert fs.cat_file(target) == b"abc"  # a failed rewrite leaves the previous content
    assert sorted(list_names(fs, folder)) == ["data.safetensors", "out.bin"]
    fs.rm_file(target)
