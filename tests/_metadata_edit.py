"""Read and edit the regions of a version-3 ``shardkit.json`` in tests (the JSON data, as ``json.loads`` gives it).

A tensor's ``"regions"`` object holds columns (see ``checkpoint/_regions.py``): the blocks as
``"grid"`` cut points or as ``"offsets"``/``"dims"``, and ``"file"``, ``"start"``, ``"crc32c"``,
each a string of fixed-width lowercase hex values (``"digits"`` wide, ``"crc32c"`` 8). These
helpers decode and encode those columns on their own (not with the library's parser, which
is what the tests check) so a test can change one region's start, file or block, switch a
grid to explicit blocks, or remove a region, and write the result back. ``read`` rewrites the
integer columns 16 digits wide (the widest; the library writes as few as the values need and
reads any of 2, 4, 8 and 16), so an edit may put any value in them::

    md = read(folder)
    r = region(md, "w", 1)                     # offsets, dims, file, start, end, key, crcs
    set_region(md, "w", 0, start=0)            # claim bytes before the data
    write(folder, md)
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["OFFSET_DIGITS", "FILE_DIGITS", "CRC_DIGITS", "Region", "read", "write", "decode", "encode", "regions",
           "file_names", "file_entry", "itemsize", "grid_cells", "blocks", "chunk_counts", "region", "all_regions",
           "explicit", "set_region", "drop_region", "shift_file", "default_key", "widen",
           "seal"]

OFFSET_DIGITS = 16  # "grid", "offsets", "dims", "start" after ``read``: 16 hex digits per value
FILE_DIGITS = 16  # "file" after ``read``
CRC_DIGITS = 8  # "crc32c": 8 hex digits per chunk


@dataclass(frozen=True)
class Region:
    """One region of a tensor, as ``shardkit.json`` says."""

    offsets: tuple[int, ...]
    dims: tuple[int, ...]
    file: str  # the data file's name
    file_number: int  # its position in "files"
    start: int  # first byte in the file
    end: int  # one past the last byte
    key: str  # its name in the data file
    crcs: tuple[int, ...]  # the CRC-32C of each chunk


def read(folder: str | Path) -> dict[str, Any]:
    """The JSON data of ``folder/shardkit.json``, its integer columns 16 hex digits wide."""
    md = json.loads((Path(folder) / "shardkit.json").read_text())
    for entry in md["tensors"].values():
        widen(entry["regions"])
    return md


def widen(raw: dict[str, Any], digits: int = 16) -> None:
    """Rewrite the integer columns of a ``"regions"`` object ``digits`` hex digits wide."""
    old = raw["digits"]
    if old == digits:
        return
    for column in ("offsets", "dims", "file", "start"):
        if column in raw:
            raw[column] = encode(decode(raw[column], old), digits)
    if "grid" in raw:
        raw["grid"] = [encode(decode(c, old), digits) for c in raw["grid"]]
    raw["digits"] = digits


def write(folder: str | Path, md: dict[str, Any], *, reseal: bool = True) -> None:
    """Write ``md`` as ``folder/shardkit.json``, with the checksum of its new content (version 4 on)
    unless ``reseal=False``: a test of a defence behind the checksum edits as a writer would."""
    if reseal and md.get("version", 0) >= 4:
        md = {**md, "checksum": seal(md)}
    (Path(folder) / "shardkit.json").write_text(json.dumps(md))


def seal(md: dict[str, Any]) -> str:
    """The ``"checksum"`` a version-4 ``shardkit.json`` holding ``md`` records (docs/format.md)."""
    content = {k: v for k, v in md.items() if k != "checksum"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# -- hex columns ------------------------------------------------------------------------------------

def decode(text: str, digits: int) -> list[int]:
    """The values of a column of ``digits`` hex digits each (big-endian), as ints."""
    assert len(text) % digits == 0, (len(text), digits)
    return [int(text[i:i + digits], 16) for i in range(0, len(text), digits)]


def encode(values: Sequence[int], digits: int) -> str:
    """Inverse of ``decode``: each value as ``digits`` lowercase hex digits."""
    return "".join(f"{v:0{digits}x}" for v in values)


# -- reading ------------------------------------------------------------------------------------------

def regions(md: dict[str, Any], name: str) -> dict[str, Any]:
    """Tensor ``name``'s ``"regions"`` object (edits to it change ``md``)."""
    return md["tensors"][name]["regions"]


def file_names(md: dict[str, Any]) -> list[str]:
    """The data files, in the order the regions' file numbers index."""
    return [f["name"] for f in md["files"]]


def file_entry(md: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``{"name": ..., "bytes": ...}`` object of data file ``name`` (edits to it change ``md``)."""
    return next(f for f in md["files"] if f["name"] == name)


def itemsize(md: dict[str, Any], name: str) -> int:
    """Bytes per element of tensor ``name`` (its dtype names are torch's)."""
    return getattr(torch, md["tensors"][name]["dtype"]).itemsize


def grid_cells(cuts: Sequence[Sequence[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, dims)`` of the cells of the grid with these cut points, in row-major order."""
    cells: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    for c in cuts:
        cells = [(o + (a,), d + (b - a,)) for o, d in cells for a, b in zip(c[:-1], c[1:])]
    return cells


def blocks(md: dict[str, Any], name: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, dims)`` of every region of tensor ``name``, from its grid or its explicit columns."""
    raw = regions(md, name)
    if "grid" in raw:
        return grid_cells([decode(c, raw["digits"]) for c in raw["grid"]])
    n = raw["count"]
    offsets, dims = decode(raw["offsets"], raw["digits"]), decode(raw["dims"], raw["digits"])
    ndim = len(offsets) // n if n else 0
    return [(tuple(offsets[i * ndim:(i + 1) * ndim]), tuple(dims[i * ndim:(i + 1) * ndim])) for i in range(n)]


def chunk_counts(md: dict[str, Any], name: str) -> list[int]:
    """How many chunk checksums each region of tensor ``name`` has."""
    step, size = regions(md, name)["chunk_bytes"], itemsize(md, name)
    return [-(-math.prod(d) * size // step) for _, d in blocks(md, name)]


def default_key(name: str, offsets: Sequence[int], dims: Sequence[int], size: Sequence[int]) -> str:
    """A region's name in its data file unless ``"keys"`` says otherwise: ``name``, or ``name@o0,o1,...``."""
    if all(o == 0 for o in offsets) and list(dims) == list(size):
        return name
    return f"{name}@{','.join(str(o) for o in offsets)}"


def all_regions(md: dict[str, Any], name: str) -> list[Region]:
    """Every region of tensor ``name``, in order."""
    raw, files = regions(md, name), file_names(md)
    numbers, starts = decode(raw["file"], raw["digits"]), decode(raw["start"], raw["digits"])
    crcs, counts = decode(raw["crc32c"], CRC_DIGITS), chunk_counts(md, name)
    size, step = md["tensors"][name]["size"], itemsize(md, name)
    out, first = [], 0
    for i, (offsets, dims) in enumerate(blocks(md, name)):
        key = raw.get("keys", {}).get(str(i)) or default_key(name, offsets, dims, size)
        out.append(Region(offsets, dims, files[numbers[i]], numbers[i], starts[i], starts[i] + math.prod(dims) * step,
                          key, tuple(crcs[first:first + counts[i]])))
        first += counts[i]
    return out


def region(md: dict[str, Any], name: str, i: int) -> Region:
    """Region ``i`` of tensor ``name``."""
    return all_regions(md, name)[i]


# -- editing ------------------------------------------------------------------------------------------

def _put_blocks(md: dict[str, Any], name: str, boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
    raw = regions(md, name)
    widen(raw)
    raw.pop("grid", None)
    raw["offsets"] = encode([v for o, _ in boxes for v in o], OFFSET_DIGITS)
    raw["dims"] = encode([v for _, d in boxes for v in d], OFFSET_DIGITS)


def explicit(md: dict[str, Any], name: str) -> None:
    """Write tensor ``name``'s blocks as ``"offsets"``/``"dims"`` (the same regions) instead of a grid."""
    _put_blocks(md, name, blocks(md, name))


def set_region(md: dict[str, Any], name: str, i: int, *, start: int | None = None, file: int | None = None,
               offsets: Sequence[int] | None = None, dims: Sequence[int] | None = None) -> None:
    """Change region ``i``'s first byte, file number or block (a grid becomes explicit blocks first)."""
    raw = regions(md, name)
    widen(raw)
    if start is not None:
        starts = decode(raw["start"], OFFSET_DIGITS)
        starts[i] = start
        raw["start"] = encode(starts, OFFSET_DIGITS)
    if file is not None:
        numbers = decode(raw["file"], FILE_DIGITS)
        numbers[i] = file
        raw["file"] = encode(numbers, FILE_DIGITS)
    if offsets is not None or dims is not None:
        boxes = [list(b) for b in blocks(md, name)]
        boxes[i] = [tuple(offsets) if offsets is not None else boxes[i][0],
                    tuple(dims) if dims is not None else boxes[i][1]]
        _put_blocks(md, name, boxes)


def drop_region(md: dict[str, Any], name: str, i: int) -> None:
    """Remove region ``i`` of tensor ``name``: its block, file, start, chunk checksums and key."""
    raw = regions(md, name)
    widen(raw)
    boxes, counts = blocks(md, name), chunk_counts(md, name)
    crcs = decode(raw["crc32c"], CRC_DIGITS)
    first = sum(counts[:i])
    raw["crc32c"] = encode(crcs[:first] + crcs[first + counts[i]:], CRC_DIGITS)
    for column, digits in (("file", FILE_DIGITS), ("start", OFFSET_DIGITS)):
        values = decode(raw[column], digits)
        raw[column] = encode(values[:i] + values[i + 1:], digits)
    _put_blocks(md, name, boxes[:i] + boxes[i + 1:])
    if "keys" in raw:
        keys = {int(k): v for k, v in raw.pop("keys").items() if int(k) != i}
        if keys:
            raw["keys"] = {str(k - (k > i)): v for k, v in sorted(keys.items())}
    raw["count"] -= 1


def shift_file(md: dict[str, Any], file: str, shift: int) -> None:
    """Move every region in data file ``file`` by ``shift`` bytes and grow the file's size by as much
    (after its safetensors header grew by ``shift``)."""
    number = file_names(md).index(file)
    file_entry(md, file)["bytes"] += shift
    for name in md["tensors"]:
        raw = regions(md, name)
        widen(raw)
        numbers, starts = decode(raw["file"], FILE_DIGITS), decode(raw["start"], OFFSET_DIGITS)
        raw["start"] = encode([s + shift if f == number else s for f, s in zip(numbers, starts)], OFFSET_DIGITS)
