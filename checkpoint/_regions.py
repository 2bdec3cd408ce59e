"""The saved regions of a tensor: one region (``SavedShard``), and all of a tensor's as columns (``RegionTable``).

A checkpoint of a thousand tensors, each split over a thousand ranks, holds a million
regions, and every rank that loads it reads all of them. Format version 3 therefore stores
a tensor's regions as a few columns rather than an object per region:

- the blocks: the cut points of a grid when the regions are its cells in row-major order
  (what a regular split or mesh gives), otherwise every region's offsets and sizes;
- each region's data file (a number into the checkpoint's list of files) and first byte;
- the CRC-32C of every chunk of every region, region after region.

Columns of per-region integers are fixed-width hexadecimal strings, as the checksums are (as
few digits as the tensor's largest value needs), so neither writing nor reading them loops
over values in Python. ``RegionTable`` keeps them as arrays and builds a ``SavedShard`` only
for a region that is looked at. Pure: no file system.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from sharding import ShardMetadata
from sharding.layout import RegionIndex, check_tiling

from ._chunks import CHUNK_BYTES, decode_chunk_array, decode_hex_column, encode_chunk_array, encode_hex_column
from ._strict_json import shown

__all__ = ["SavedShard", "RegionTable", "FileList", "RegionError", "region_key", "grid_of", "region_index",
           "parse_regions"]

CHECKSUM_ALGORITHM = "crc32c"
_Cuts = Sequence[Sequence[int]] | Sequence[np.ndarray]  # a grid's cut points per dimension
MAX_INT = 1 << 63  # sizes, offsets and byte positions are int64 everywhere downstream (torch, files)
MAX_CHUNK = 1 << 30


def region_key(name: str, offsets: Sequence[int], dims: Sequence[int], size: Sequence[int]) -> str:
    """The default name of a saved region in its data file: the tensor's name, with ``@offsets`` unless whole."""
    if all(o == 0 for o in offsets) and tuple(dims) == tuple(size):
        return name
    return f"{name}@{','.join(str(o) for o in offsets)}"


@dataclass(frozen=True, slots=True)
class SavedShard:
    """One saved region of a tensor: its block, and where its bytes are.

    A region held by several replicas is saved once; the regions of a tensor tile it exactly.

    Attributes:
        offsets: where the block starts in the full tensor, one int per dimension.
        dims: the block's sizes, one int per dimension.
        file: the data file (a ``.safetensors`` file in the checkpoint folder) holding it.
        key: the block's name inside that file's safetensors header.
        byte_range: ``(start, end)`` of its bytes in the file.
        checksum: the checksum of all those bytes, ``"<algorithm>:<hex>"``, in format versions
            1 and 2; empty from version 3, where ``chunks`` cover every byte.
        chunk_bytes: the chunk size of ``chunks`` (from format version 2), 0 when there are none.
        chunks: the CRC-32C of each ``chunk_bytes`` piece of the bytes (the last may be
            shorter), so a read of part of the region verifies just the chunks it touches;
            empty in version-1 checkpoints, which have the whole-region ``checksum`` only.

    Example:
        >>> shard = checkpoint.read_metadata("ckpt").tensors["0.weight"].shards[1]  # doctest: +SKIP
        >>> shard.offsets, shard.dims  # doctest: +SKIP
        ((250, 0), (250, 64))
    """

    offsets: tuple[int, ...]
    dims: tuple[int, ...]
    file: str
    key: str
    byte_range: tuple[int, int]
    checksum: str
    chunk_bytes: int = 0
    chunks: tuple[int, ...] = ()

    @property
    def region(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, dims)``."""
        return (self.offsets, self.dims)

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        return self.byte_range[1] - self.byte_range[0]


# -- hexadecimal columns -----------------------------------------------------------------------------

_DIGITS = (2, 4, 8, 16)  # the widths of integer columns: 1, 2, 4 or 8 bytes per value


def _digits_for(*columns: np.ndarray) -> int:
    """The fewest hex digits per value (of ``_DIGITS``) that hold every value of ``columns``."""
    top = max((int(c.max()) for c in columns if c.size), default=0)
    return next(d for d in _DIGITS if top < 16 ** d)


def _grid_boxes(cuts: _Cuts) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, dims)`` of the cells of the grid with these cut points, in row-major order."""
    lows = np.meshgrid(*(np.asarray(c[:-1], dtype=np.int64) for c in cuts), indexing="ij")
    sizes = np.meshgrid(*(np.diff(np.asarray(c, dtype=np.int64)) for c in cuts), indexing="ij")
    return (np.stack([a.ravel() for a in lows], axis=1).reshape(-1, len(cuts)),
            np.stack([a.ravel() for a in sizes], axis=1).reshape(-1, len(cuts)))


def grid_of(offsets: np.ndarray, dims: np.ndarray, size: Sequence[int]) -> tuple[tuple[int, ...], ...] | None:
    """The cut points of the grid whose cells, in row-major order, are exactly these regions; else ``None``."""
    n, ndim = offsets.shape
    if n == 0 or ndim == 0 or not (dims > 0).all():
        return None
    cuts = []
    for d in range(ndim):
        ordered = np.sort(offsets[:, d])
        distinct = ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])]
        cuts.append(np.append(distinct, size[d]))
    shape = [len(c) - 1 for c in cuts]
    if math.prod(shape) != n or any(int(c[0]) != 0 for c in cuts):
        return None
    cell = np.arange(n)
    for d in range(ndim - 1, -1, -1):  # region i is cell (i // stride_d) % shape_d along dimension d
        along = cell % shape[d]
        if not (np.array_equal(offsets[:, d], cuts[d][along])
                and np.array_equal(dims[:, d], np.diff(cuts[d])[along])):
            return None
        cell = cell // shape[d]
    return tuple(tuple(c.tolist()) for c in cuts)


@dataclass(frozen=True)
class FileList:
    """A checkpoint's data files in the order that regions number them: names, sizes and numbers."""

    names: list[str]
    sizes: np.ndarray  # int64, bytes of each file
    number: dict[str, int]

    @classmethod
    def of(cls, files: Mapping[str, int]) -> FileList:
        """``files`` (name -> size in bytes), numbered in its order."""
        names = list(files)
        return cls(names, np.array(list(files.values()), dtype=np.int64), {f: i for i, f in enumerate(names)})


class RegionTable(Sequence[SavedShard]):
    """The saved regions of one tensor as columns: a sequence of ``SavedShard`` built on demand.

    Attributes (one entry per region, in save order):
        files: the data file names that ``file_ids`` number.
        file_ids: int64, each region's data file.
        starts: int64, where each region's bytes start in its file.
        nbytes: int64, each region's length in bytes.
        chunk_bytes: the chunk size of the checksums.
        crcs: ``uint32``, the CRC-32C of every chunk of every region, region after region.
        keys: region number -> its name in the data file, where that is not ``region_key``'s.
        grid: when the regions are the cells of a grid in row-major order (a regular split or
            mesh), its cut points per dimension; else ``None``.
        offsets, dims: ``(n, ndim)`` int64, the blocks (from the grid when there is one).
    """

    __slots__ = ("_dims", "_first", "_offsets", "chunk_bytes", "crcs", "file_ids", "files", "grid", "keys", "name",
                 "nbytes", "size", "starts")

    def __init__(self, name: str, size: Sequence[int], itemsize: int, files: Sequence[str], file_ids: np.ndarray,
                 starts: np.ndarray, chunk_bytes: int, crcs: np.ndarray, *, keys: Mapping[int, str] | None = None,
                 grid: _Cuts | None = None, offsets: np.ndarray | None = None,
                 dims: np.ndarray | None = None, nbytes: np.ndarray | None = None) -> None:
        self.name, self.size = name, tuple(size)
        self.files, self.file_ids, self.starts = files, file_ids, starts
        self.chunk_bytes, self.crcs, self.keys = chunk_bytes, crcs, dict(keys or {})
        self.grid = None if grid is None else tuple(tuple(np.asarray(c).tolist()) for c in grid)
        shape = (len(starts), len(self.size))
        self._offsets = None if offsets is None else offsets.reshape(shape)
        self._dims = None if dims is None else dims.reshape(shape)
        self.nbytes = _nbytes(self.grid, self._dims, itemsize) if nbytes is None else nbytes
        counts = -(-self.nbytes // chunk_bytes)
        self._first = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts)])
        if len(self.crcs) != int(self._first[-1]):
            msg = f"tensor {name!r}: {len(self.crcs)} chunk checksums for {int(self._first[-1])} chunks."
            raise ValueError(msg)

    def _blocks(self) -> tuple[np.ndarray, np.ndarray]:
        if self._offsets is None or self._dims is None:  # a grid's blocks, built when first asked for
            assert self.grid is not None
            self._offsets, self._dims = _grid_boxes(self.grid)
        return self._offsets, self._dims

    @property
    def offsets(self) -> np.ndarray:
        return self._blocks()[0]

    @property
    def dims(self) -> np.ndarray:
        return self._blocks()[1]

    @classmethod
    def of_shards(cls, name: str, size: Sequence[int], dtype: torch.dtype, shards: Sequence[SavedShard],
                  files: Sequence[str]) -> RegionTable:
        """The table of ``shards`` (every one with chunk checksums of one chunk size), files numbered in ``files``."""
        ndim, n = len(size), len(shards)
        sizes = {s.chunk_bytes for s in shards if s.nbytes}
        if any(s.nbytes and not s.chunks for s in shards) or len(sizes) > 1:
            msg = (f"tensor {name!r}: only regions with chunk checksums of one chunk size can be written as a table; "
                   f"got chunk sizes {sorted(sizes)}.")
            raise ValueError(msg)
        position = {f: i for i, f in enumerate(files)}
        offsets = np.array([s.offsets for s in shards], dtype=np.int64).reshape(n, ndim)
        dims = np.array([s.dims for s in shards], dtype=np.int64).reshape(n, ndim)
        return cls(name, size, dtype.itemsize, files, np.array([position[s.file] for s in shards], dtype=np.int64),
                   np.array([s.byte_range[0] for s in shards], dtype=np.int64), sizes.pop() if sizes else CHUNK_BYTES,
                   np.array([c for s in shards for c in s.chunks], dtype=np.uint32),
                   keys={i: s.key for i, s in enumerate(shards) if s.key != region_key(name, s.offsets, s.dims, size)},
                   grid=grid_of(offsets, dims, size), offsets=offsets, dims=dims)

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, i: int) -> SavedShard: ...

    @overload
    def __getitem__(self, i: slice) -> list[SavedShard]: ...

    def __getitem__(self, i: int | slice) -> SavedShard | list[SavedShard]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"region {i} of {len(self)}")
        i %= len(self)
        return self._shard(i, tuple(self.offsets[i].tolist()), tuple(self.dims[i].tolist()), int(self.file_ids[i]),
                           int(self.starts[i]), int(self.nbytes[i]), int(self._first[i]), int(self._first[i + 1]))

    def __iter__(self) -> Iterator[SavedShard]:
        first = self._first.tolist()
        columns = zip(self.offsets.tolist(), self.dims.tolist(), self.file_ids.tolist(), self.starts.tolist(),
                      self.nbytes.tolist())
        for i, (offsets, dims, file, start, nbytes) in enumerate(columns):
            yield self._shard(i, tuple(offsets), tuple(dims), file, start, nbytes, first[i], first[i + 1])

    def _shard(self, i: int, offsets: tuple[int, ...], dims: tuple[int, ...], file: int, start: int, nbytes: int,
               a: int, b: int) -> SavedShard:
        key = self.keys.get(i) or region_key(self.name, offsets, dims, self.size)
        return SavedShard(offsets, dims, self.files[file], key, (start, start + nbytes), "", self.chunk_bytes,
                          tuple(self.crcs[a:b].tolist()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal to tuples of its shards, which hash differently

    def __repr__(self) -> str:
        return f"RegionTable({self.name!r}, regions={len(self)})"

    def to_dict(self, files: FileList) -> dict[str, Any]:
        """The ``"regions"`` object of ``shardkit.json``, with file numbers in ``files``' order."""
        ids = self.file_ids
        if self.files is not files.names and list(self.files) != files.names:
            ids = np.array([files.number[f] for f in self.files], dtype=np.int64)[ids]
        if self.grid is not None:
            blocks = [np.asarray(cuts, dtype=np.int64) for cuts in self.grid]
        else:
            blocks = [self.offsets.ravel(), self.dims.ravel()]
        digits = _digits_for(ids, self.starts, *blocks)
        out: dict[str, Any] = {"count": len(self), "digits": digits}
        if self.grid is not None:
            out["grid"] = [encode_hex_column(cuts, digits) for cuts in blocks]
        else:
            out.update(offsets=encode_hex_column(blocks[0], digits), dims=encode_hex_column(blocks[1], digits))
        out.update({"file": encode_hex_column(ids, digits), "start": encode_hex_column(self.starts, digits),
                    "chunk_bytes": self.chunk_bytes, CHECKSUM_ALGORITHM: encode_chunk_array(self.crcs)})
        if self.keys:
            out["keys"] = {str(i): key for i, key in sorted(self.keys.items())}
        return out


def region_index(shards: Sequence[SavedShard], size: Sequence[int]) -> RegionIndex:
    """The index that finds which of a tensor's saved regions meet a block."""
    if isinstance(shards, RegionTable) and shards.grid is not None:
        return RegionIndex.of_grid(shards.grid)
    if isinstance(shards, RegionTable):
        return RegionIndex.of_columns(torch.from_numpy(shards.offsets), torch.from_numpy(shards.dims), size)
    return RegionIndex([s.region for s in shards], size)


# -- parsing -----------------------------------------------------------------------------------------

class RegionError(ValueError):
    """A malformed ``"regions"`` object: ``where`` (below the tensor) and what is wrong."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where, self.problem = where, problem


_KNOWN = {"count", "digits", "grid", "offsets", "dims", "file", "start", "chunk_bytes", CHECKSUM_ALGORITHM, "keys"}


def _column(raw: Mapping[str, Any], key: str, count: int, digits: int) -> np.ndarray:
    column = decode_hex_column(raw.get(key), count, digits)
    if column is None:
        value = raw.get(key)
        shown = value if not isinstance(value, str) or len(value) <= 40 else f"{value[:40]}... ({len(value)} chars)"
        limit = " (each below 2**63)" if digits == 16 else ""
        raise RegionError(key, f"expected {count} x {digits} lowercase hex digits{limit}, got {shown!r}")
    return column


def _parse_grid(raw: object, size: Sequence[int], count: int, digits: int) -> list[np.ndarray]:
    """Cut points per dimension, each strictly increasing from 0 to the dimension's size, with ``count`` cells."""
    cuts = []
    if isinstance(raw, list) and len(raw) == len(size) > 0:
        for text, n in zip(raw, size):
            column = decode_hex_column(text, len(text) // digits, digits) if isinstance(text, str) else None
            if column is None or len(column) < 2 or column[0] != 0 or column[-1] != n or (np.diff(column) <= 0).any():
                break
            cuts.append(column)
    if len(cuts) != len(size) or len(size) == 0 or math.prod(len(c) - 1 for c in cuts) != count:
        shown = repr(raw) if len(repr(raw)) <= 200 else f"{repr(raw)[:200]}..."
        raise RegionError("grid", f"expected, per dimension of size {list(size)}, strictly increasing cut points "
                                  f"({digits} hex digits each) from 0 to the size, with {count} cells in all; "
                                  f"got {shown}")
    return cuts


def parse_regions(name: str, raw: object, size: Sequence[int], dtype: torch.dtype,
                  files: FileList) -> tuple[RegionTable, RegionIndex | None]:
    """Check a tensor's ``"regions"`` object (format version 3) and return its table.

    Also returns the region index that checking the tiling built (``None`` for a grid, whose
    cells tile the tensor by construction). Any problem raises ``RegionError``.
    """
    if not isinstance(raw, dict):
        raise RegionError("", f"expected an object, got {type(raw).__name__}")
    if set(raw) - _KNOWN:
        raise RegionError("", f"unknown keys {sorted(set(raw) - _KNOWN)}")
    n, ndim = raw.get("count"), len(size)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < MAX_INT:
        raise RegionError("count", f"expected a non-negative int, got {shown(n)}")
    digits = raw.get("digits")
    if digits not in _DIGITS or isinstance(digits, bool):
        raise RegionError("digits", f"expected one of {list(_DIGITS)}, got {shown(digits)}")
    # First the columns of one value per region, whose length bounds the count: a 0-d tensor's
    # offsets and sizes are empty for any count, and nothing below may be built from it alone.
    ids, starts = _column(raw, "file", n, digits), _column(raw, "start", n, digits)
    grid = offsets = dims = None
    if "grid" in raw:
        grid = _parse_grid(raw["grid"], size, n, digits)
    else:
        offsets = _column(raw, "offsets", n * ndim, digits).reshape(n, ndim)
        dims = _column(raw, "dims", n * ndim, digits).reshape(n, ndim)
        limit = np.array(size, dtype=np.int64).reshape(1, ndim)
        outside = ((dims > limit) | (offsets > limit - dims)).any(axis=1)
        if outside.any():
            i = int(outside.argmax())
            raise RegionError(f"[{i}]", f"the block offsets={offsets[i].tolist()}, dims={dims[i].tolist()} lies "
                                        f"outside the tensor's size {list(size)}")
    names = files.names
    if n and int(ids.max()) >= len(names):
        i = int(ids.argmax())
        raise RegionError(f"[{i}] file", f"file number {int(ids[i])} is not in \"files\" ({len(names)} listed)")
    chunk_bytes = raw.get("chunk_bytes")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or not 0 < chunk_bytes <= MAX_CHUNK:
        raise RegionError("chunk_bytes", f"expected a chunk size in [1, {MAX_CHUNK}], got {shown(chunk_bytes)}")
    raw_keys = raw.get("keys", {})
    # Region numbers in plain decimal: str.isdigit() also takes "²" and int() refuses it, or 5000 digits.
    if not isinstance(raw_keys, dict) or not all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 20
                                                 and k == str(int(k)) and int(k) < n
                                                 and isinstance(v, str) and v for k, v in raw_keys.items()):
        raise RegionError("keys", f"expected {{\"<region number>\": <non-empty name>}}, got {shown(raw_keys)}")
    keys = {int(k): v for k, v in raw_keys.items()}
    nbytes = _nbytes(grid, dims, dtype.itemsize)
    room = files.sizes[ids] - starts if n else nbytes
    wrong = (starts < 8) | (room < nbytes)
    if wrong.any():
        i = int(wrong.argmax())
        first, file, room_of = int(starts[i]), names[int(ids[i])], int(files.sizes[ids[i]])
        shape = (dims[i].tolist() if dims is not None else "of its grid cell")
        raise RegionError(f"[{i}] start", f"[{first}, {first + int(nbytes[i])}) does not hold {int(nbytes[i])} bytes "
                                          f"(dims {shape} of {dtype}) inside file {file!r} of {room_of} bytes")
    try:
        crcs = decode_chunk_array(raw.get(CHECKSUM_ALGORITHM), int((-(-nbytes // chunk_bytes)).sum()))
    except ValueError as exc:
        raise RegionError(CHECKSUM_ALGORITHM, str(exc).rstrip(".")) from None
    table = RegionTable(name, size, dtype.itemsize, names, ids, starts, chunk_bytes, crcs, keys=keys, grid=grid,
                        offsets=offsets, dims=dims, nbytes=nbytes)
    if grid is not None:  # the cells of a grid tile the tensor by construction
        return table, None
    assert offsets is not None and dims is not None
    if n <= 1:  # the common plain tensor: no index needed to see whether it is whole
        whole = (n == 0 and 0 in size) or (n == 1 and not offsets.any() and dims.ravel().tolist() == list(size))
        if not whole:
            raise RegionError("", f"the saved regions do not tile the tensor's size {list(size)}: "
                                  + ("there are none" if n == 0 else f"the only region has offsets="
                                     f"{offsets[0].tolist()}, dims={dims[0].tolist()}"))
        return table, None
    index = region_index(table, size)
    if not index.tiles(size):  # a region listed twice does not tile: it is counted twice
        live = (dims > 0).all(axis=1)
        boxes = np.concatenate([offsets, dims], axis=1)[live]
        if len(boxes) > 1 and len(np.unique(boxes, axis=0)) != len(boxes):
            raise RegionError("", "a region is listed twice")
        blocks = [ShardMetadata(tuple(o), tuple(d), "cpu") for o, d in zip(offsets[live].tolist(), dims[live].tolist())]
        try:
            check_tiling(blocks, size, what="saved regions")
        except ValueError as exc:
            raise RegionError("", str(exc).rstrip(".")) from None
    return table, index


def _nbytes(grid: _Cuts | None, dims: np.ndarray | None, itemsize: int) -> np.ndarray:
    """Each region's length in bytes: from the grid's cells when there is one, else from ``dims``."""
    if grid is None:
        assert dims is not None
        return np.asarray(dims.prod(axis=1) * itemsize, dtype=np.int64)
    cells = np.ones(1, dtype=np.int64)
    for cuts in grid:
        cells = np.multiply.outer(cells, np.diff(np.asarray(cuts, dtype=np.int64))).ravel()
    return cells * itemsize
