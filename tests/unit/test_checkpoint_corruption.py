"""A flipped byte is caught on every read path: target layout x storage x ``mmap``, regions of 8 chunks.

``load`` reads a saved region by one of several paths, chosen by the target's layout and the
storage (see ``checkpoint/_files.py``): whole regions read straight into the target (direct),
row blocks streamed through a small buffer (local), other blocks through a memory map
(local), blocks mapped onto the file's pages (``mmap=True``), and batches of rows widened to
whole chunks (``memory://``, S3). Each path must verify the chunk checksums of what it reads,
including the chunks a partial read only touches at its ends.

The chunk size is made small (1 KiB: 4 rows of the 64 x 64 float32 tensor, 8 chunks per
saved region) and so are the read buffers, so every path reads several chunks in several
pieces. One byte is flipped either in a chunk that a target block reads whole ("inner") or in
one that target blocks cut at rows 5 and 21 read only partly ("edge"). Every case first
loads the intact checkpoint bit for bit, then the corrupt one must raise, naming the file,
and leave no corrupt value in the target.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import checkpoint
import sharded_tensor as st
from checkpoint import CheckpointError, _files, _save
from sharding import EnumerableShardingSpec, ShardMetadata
from tests import _metadata_edit as edit
from tests._s3 import S3, s3, s3_endpoint  # noqa: F401 - fixtures are found by name

R0 = "rank:0/cpu"
SIZE = (64, 64)
CHUNK = 1024  # bytes: 4 rows of the tensor
ROW = SIZE[1] * 4

SAVED = [((0, 0), (32, 64)), ((32, 0), (32, 64))]  # two regions of 8 chunks each
TARGETS = {
    # whole regions: the direct path (mmap: mapped onto the file)
    "same": SAVED,
    # row blocks cut inside chunks 1 and 5 (rows 4-8, 20-24): the streaming path locally
    # (mmap: [5, 21) is mapped), batches of rows elsewhere
    "rows": [((0, 0), (5, 64)), ((5, 0), (16, 64)), ((21, 0), (43, 64))],
    # column blocks: the memory-mapped copy locally, batches of rows elsewhere
    "cols": [((0, 0), (64, 24)), ((0, 24), (64, 40))],
    # a 2 x 2 mesh whose row cut is inside a chunk
    "mesh": [((0, 0), (21, 24)), ((0, 24), (21, 40)), ((21, 0), (43, 24)), ((21, 24), (43, 40))],
}
FLIPS = {"inner": (13, 30), "edge": (5, 50)}  # (row, column) of the flipped element, in region 0


@pytest.fixture(autouse=True)
def _small_chunks_and_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_save, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(_files, "_SCRATCH_BYTES", 2 * CHUNK)  # streaming: several pieces per block
    monkeypatch.setattr(_files, "_VERIFY_PIECE", 1000)  # direct reads: pieces that straddle chunks
    monkeypatch.setattr(_files, "_SLAB_BYTES", 7 * ROW)  # other file systems: batches of 7 rows


def _full() -> torch.Tensor:
    return (torch.arange(SIZE[0] * SIZE[1], dtype=torch.float64) * 0.25 - 100.0).float().reshape(SIZE)


def _sharded(boxes: list[tuple[tuple[int, int], tuple[int, int]]], full: torch.Tensor | None = None,
             fill: float = 0.0) -> st.ShardedTensor:
    spec = EnumerableShardingSpec([ShardMetadata(o, d, R0) for o, d in boxes])
    t = st.full(SIZE, fill, sharding_spec=spec)
    if full is not None:
        for shard in t.local_shards():
            (r, c), (h, w) = shard.metadata.offsets, shard.metadata.dims
            shard.tensor.copy_(full[r:r + h, c:c + w])
    return t


# S3 reads by the same path as memory:// ("batches of rows"); its cases start a server and make
# a few hundred requests each, so they run in the full suite, not in the quick tier.
_S3 = pytest.param("s3", marks=pytest.mark.slow)


@pytest.fixture(params=["local", "memory", _S3])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(checkpoint url, storage_options)`` on one of the three kinds of storage."""
    yield from _storage(request.param, request, tmp_path)


# mmap=True maps local files only; elsewhere it copies (checked once, on memory://, not again on S3).
WHERE = ["local-copy", "local-mmap", "memory-copy", "memory-mmap", pytest.param("s3-copy", marks=pytest.mark.slow)]


@pytest.fixture(params=WHERE)
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """``(checkpoint url, storage_options, mmap)``."""
    kind, mode = request.param.split("-")
    for url, options in _storage(kind, request, tmp_path):
        yield url, options, mode == "mmap"


def _storage(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if kind == "local":
        yield str(tmp_path / "ck"), {}
    elif kind == "memory":
        root = f"/corrupt-{uuid.uuid4().hex}"
        yield f"memory://{root}/ck", {}
        fsspec.filesystem("memory").rm(root, recursive=True)
    else:
        bucket: S3 = request.getfixturevalue("s3")
        yield bucket.url("ck"), dict(bucket.storage_options)


def _flip(url: str, options: dict[str, Any], row: int, col: int) -> tuple[str, float]:
    """Flip every bit of one byte of element ``(row, col)`` (in region 0); its file and its corrupt value."""
    fs, root = fsspec.core.url_to_fs(url, **options)
    md = json.loads(fs.cat_file(f"{root}/shardkit.json"))
    edit.widen(edit.regions(md, "w"))
    region = edit.region(md, "w", 0)
    assert region.offsets == (0, 0) and len(region.crcs) == 8  # the layout the cases are built on
    where = region.start + (row * SIZE[1] + col) * 4
    path = f"{root}/{region.file}"
    data = bytearray(fs.cat_file(path))
    data[where + 1] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    return region.file, torch.frombuffer(bytearray(data[where:where + 4]), dtype=torch.float32).item()


def _mapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is a mapping of a file (``mmap=True`` pointed it at the file's pages)."""
    start = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, last = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= start < hi:
            return last.endswith(".safetensors")
    return False


@pytest.mark.parametrize("flip", list(FLIPS))
@pytest.mark.parametrize("layout", list(TARGETS))
def test_a_flipped_byte_is_caught_on_every_read_path(where: tuple[str, dict[str, Any], bool], layout: str,
                                                      flip: str) -> None:
    url, options, mmap = where
    full = _full()
    checkpoint.save({"w": _sharded(SAVED, full)}, url, storage_options=options, quiet=True)

    intact = _sharded(TARGETS[layout], fill=7.0)
    checkpoint.load({"w": intact}, url, storage_options=options, mmap=mmap)
    for shard in intact.local_shards():
        (r, c), (h, w) = shard.metadata.offsets, shard.metadata.dims
        assert torch.equal(shard.tensor, full[r:r + h, c:c + w]), shard.metadata
    if mmap and url.startswith("/") and layout == "same":
        assert all(_mapped(s.tensor) for s in intact.local_shards())  # the mapped path was taken

    file, corrupt = _flip(url, options, *FLIPS[flip])
    assert corrupt != full[FLIPS[flip]].item()
    target = _sharded(TARGETS[layout], fill=7.0)
    with pytest.raises(CheckpointError, match="checksum mismatch") as info:
        checkpoint.load({"w": target}, url, storage_options=options, mmap=mmap)
    assert file in str(info.value) and "'w'" in str(info.value)
    for shard in target.local_shards():  # each element: untouched, right, or cleared; never corrupt
        (r, c), (h, w) = shard.metadata.offsets, shard.metadata.dims
        got, want = shard.tensor, full[r:r + h, c:c + w]
        assert bool(((got == 7.0) | (got == want) | (got == 0)).all()), shard.metadata
        assert not bool((got == corrupt).any()), shard.metadata
        assert not _mapped(got) or torch.equal(got, want)  # only a block whose chunks all passed is mapped


def test_a_flipped_byte_of_a_scalar_is_caught(storage: tuple[str, dict[str, Any]]) -> None:
    url, options = storage
    checkpoint.save({"s": torch.tensor(2.5)}, url, storage_options=options, quiet=True)
    fs, root = fsspec.core.url_to_fs(url, **options)
    md = json.loads(fs.cat_file(f"{root}/shardkit.json"))
    edit.widen(edit.regions(md, "s"))
    region = edit.region(md, "s", 0)
    path = f"{root}/{region.file}"
    data = bytearray(fs.cat_file(path))
    data[region.start + 3] ^= 0x01
    fs.pipe_file(path, bytes(data))
    target = {"s": torch.tensor(0.0)}
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        checkpoint.load(target, url, storage_options=options)
    assert target["s"].item() == 0.0
