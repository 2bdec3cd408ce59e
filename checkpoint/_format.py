"""The on-disk checkpoint format (version 1): safetensors data files plus one JSON metadata file.

A checkpoint is a folder (local or any fsspec URL)::

    ckpt/
      shardkit.json                          metadata, written last: its presence commits the save
      data-3f9a2c1b-r00000.safetensors       rank 0's regions of generation 3f9a2c1b
      data-3f9a2c1b-r00001.safetensors       rank 1's regions ...

``shardkit.json`` (every key required unless marked optional)::

    {"format": "shardkit-checkpoint",
     "version": 1,
     "generation": "3f9a2c1b",               # random hex, unique per save; data file names carry it
     "world_size": 4,                        # informative: ranks that saved it
     "files": {"data-3f9a2c1b-r00000.safetensors": {"bytes": 1234}, ...},
     "tensors": {"layer.weight": {"dtype": "float32", "size": [10, 4], "shards": [
         {"offsets": [0, 0], "dims": [3, 4],
          "file": "data-3f9a2c1b-r00000.safetensors", "key": "layer.weight@0,0",
          "byte_range": [96, 144],           # absolute [start, end) of the data inside the file
          "checksum": "crc32c:1a2b3c4d"}, ...]}},
     "values": {"epoch": 3, "optim.param_groups": [{"lr": 0.1}]}}

Names are dotted paths of the (possibly nested) state_dict. The saved regions of a tensor
tile it exactly once (replicated regions are written once). A region's data is its block of
the global tensor in row-major (C) order, little-endian, as in safetensors. The full
specification is ``docs/format.md``; this module is the reference implementation of its
reading and validation side, shared by save, load, consolidate and the CLI.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import crc32c
import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from _shardkit.memory import cyclic_gc_paused
from sharding.layout import Box, RegionIndex, check_tiling

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "METADATA_FILE", "CHECKSUM_ALGORITHM",
    "CheckpointError", "CheckpointMetadata", "TensorEntry", "SavedShard",
    "read_metadata", "parse_metadata", "resolve", "member", "is_local",
    "data_file_name", "check_file_name", "dtype_from_name", "dtype_name", "safetensors_dtype",
    "checksum", "Checksum", "verify_checksum", "build_safetensors_header", "parse_safetensors_header",
    "read_safetensors_header", "read_range", "read_saved_shard", "flatten_state_dict", "check_json_value",
]

FORMAT_NAME = "shardkit-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "shardkit.json"
CHECKSUM_ALGORITHM = "crc32c"
_DATA_FILE = re.compile(r"^data-(?P<generation>[0-9a-f]+)-r(?P<rank>\d{5,})(?:-p(?P<part>\d+))?\.safetensors$")
_GENERATION = re.compile(r"^[0-9a-f]{1,64}$")
_CHECKSUM = re.compile(r"crc32c:[0-9a-f]{8}")  # CHECKSUM_ALGORITHM, then 8 lowercase hex digits
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


class CheckpointError(RuntimeError):
    """A problem with a checkpoint's content: incomplete, corrupt, unsafe, or not matching the target.

    The message names the file and, where one is involved, the tensor. When the checkpoint's
    names do not match the state_dict under ``strict=True``, ``missing`` (in the state_dict,
    not in the checkpoint) and ``unexpected`` (the other way round) list them; otherwise
    both are empty.
    """

    def __init__(self, message: str, *, missing: Sequence[str] = (), unexpected: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)


# -- dtypes ------------------------------------------------------------------------------------

# torch dtype -> (name in shardkit.json, safetensors dtype code)
_DTYPES: dict[torch.dtype, tuple[str, str]] = {
    torch.float64: ("float64", "F64"), torch.float32: ("float32", "F32"),
    torch.float16: ("float16", "F16"), torch.bfloat16: ("bfloat16", "BF16"),
    torch.int64: ("int64", "I64"), torch.int32: ("int32", "I32"),
    torch.int16: ("int16", "I16"), torch.int8: ("int8", "I8"),
    torch.uint64: ("uint64", "U64"), torch.uint32: ("uint32", "U32"),
    torch.uint16: ("uint16", "U16"), torch.uint8: ("uint8", "U8"),
    torch.bool: ("bool", "BOOL"), torch.complex64: ("complex64", "C64"),
    torch.float8_e4m3fn: ("float8_e4m3fn", "F8_E4M3"), torch.float8_e5m2: ("float8_e5m2", "F8_E5M2"),
}
_BY_NAME = {name: dtype for dtype, (name, _) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, *, tensor: str = "?") -> str:
    """The name of ``dtype`` in ``shardkit.json`` (``"float32"``); ``TypeError`` if unsupported."""
    try:
        return _DTYPES[dtype][0]
    except KeyError:
        msg = (f"tensor {tensor!r} has dtype {dtype}, which safetensors cannot store; convert it to one "
               f"of {sorted(_BY_NAME)} before saving.")
        raise TypeError(msg) from None


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype code of a supported torch dtype (``"F32"``)."""
    return _DTYPES[dtype][1]


def dtype_from_name(name: object, *, source: str = "?", tensor: str = "?") -> torch.dtype:
    """Inverse of ``dtype_name``; an unknown name raises ``CheckpointError``."""
    dtype = _BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        msg = (f"checkpoint metadata {source!r}: tensor {tensor!r} has unknown dtype {name!r}; "
               f"known dtypes are {sorted(_BY_NAME)}.")
        raise CheckpointError(msg)
    return dtype


# -- checksums ---------------------------------------------------------------------------------

class Checksum:
    """Incremental CRC-32C (Castagnoli, hardware accelerated) over a stream of buffers."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._value = crc32c.crc32c(data, self._value)

    def hexdigest(self) -> str:
        """``"crc32c:"`` followed by 8 lowercase hex digits, as stored in ``shardkit.json``."""
        return f"{CHECKSUM_ALGORITHM}:{self._value:08x}"


def checksum(data: bytes | bytearray | memoryview) -> str:
    """The checksum string of ``data`` as stored in ``shardkit.json`` (``"crc32c:1a2b3c4d"``)."""
    c = Checksum()
    c.update(data)
    return c.hexdigest()


def verify_checksum(data: bytes | bytearray | memoryview, expected: str, *, file: str, tensor: str) -> None:
    """Raise ``CheckpointError`` naming ``file`` and ``tensor`` unless ``data`` has checksum ``expected``."""
    actual = checksum(data)
    if actual != expected:
        msg = (f"checksum mismatch in {file!r} for tensor {tensor!r}: the metadata records {expected} but "
               f"the data has {actual}; the file is corrupt (restore it or save the checkpoint again).")
        raise CheckpointError(msg)


# -- storage -----------------------------------------------------------------------------------

def resolve(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
            ) -> tuple[fsspec.AbstractFileSystem, str]:
    """``(filesystem, folder path)`` for a local path or fsspec URL, like ``fsspec.core.url_to_fs``."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        msg = f"checkpoint path must be a non-empty str or os.PathLike, got {path!r}."
        raise ValueError(msg)
    fs, root = fsspec.core.url_to_fs(text, **dict(storage_options or {}))
    root = root.rstrip("/") or root
    return fs, root


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local file system (enables os-level fast paths: fsync, os.replace)."""
    return isinstance(fs, LocalFileSystem)


def check_file_name(name: object, *, source: str = "?", tensor: str | None = None) -> str:
    """Return ``name`` if it is a plain file name inside the checkpoint folder, else ``CheckpointError``.

    A plain name has no ``/`` or ``\\``, is not ``.`` or ``..``, has no ``:`` (drive or URL
    scheme), no NUL and no leading ``~``: nothing a path join could send outside the folder.
    """
    ok = (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\:\x00")
          and not name.startswith("~") and name == name.strip())
    if not ok:
        what = f" for tensor {tensor!r}" if tensor is not None else ""
        msg = (f"checkpoint metadata {source!r} names data file {name!r}{what}, which is not a plain file "
               f"name inside the checkpoint folder; refusing to read it (the metadata is corrupt or unsafe).")
        raise CheckpointError(msg)
    return name  # type: ignore[return-value]  # checked to be a str above


def member(root: str, name: str) -> str:
    """The path of file ``name`` (validated with ``check_file_name``) inside folder ``root``."""
    check_file_name(name, source=posixpath.join(root, METADATA_FILE))
    return posixpath.join(root, name)


def data_file_name(generation: str, rank: int, part: int | None = None) -> str:
    """``data-<generation>-r<rank:05d>[-p<part>].safetensors``: the data file of one rank in one save."""
    suffix = "" if part is None else f"-p{part:03d}"
    return f"data-{generation}-r{rank:05d}{suffix}.safetensors"


def data_file_generation(name: str) -> str | None:
    """The generation of a data file name, or ``None`` if ``name`` is not one."""
    match = _DATA_FILE.match(name)
    return match.group("generation") if match else None


def read_range(fs: fsspec.AbstractFileSystem, path: str, start: int, end: int, *, tensor: str) -> bytes:
    """Bytes ``[start, end)`` of ``path``; a missing or short file raises ``CheckpointError``."""
    if end <= start:
        return b""
    try:
        data = fs.cat_file(path, start=start, end=end)
    except FileNotFoundError as exc:
        msg = (f"data file {path!r} of tensor {tensor!r} is missing; the checkpoint is incomplete or was "
               f"modified after it was saved.")
        raise CheckpointError(msg) from exc
    if len(data) != end - start:
        msg = (f"data file {path!r} of tensor {tensor!r} is truncated: needed bytes [{start}, {end}) but "
               f"only {len(data)} of {end - start} could be read.")
        raise CheckpointError(msg)
    return data  # type: ignore[no-any-return]


# -- safetensors headers -----------------------------------------------------------------------

def build_safetensors_header(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                             metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[tuple[int, int]]]:
    """The first bytes of a safetensors file holding ``entries`` back to back, in order.

    Returns ``(prefix, byte_ranges)``: ``prefix`` is the 8-byte little-endian header length
    followed by the JSON header (space padded so the data starts at a multiple of 8, as
    safetensors does); ``byte_ranges[i]`` is the absolute ``[start, end)`` of entry ``i``'s data
    in the file. Writing ``prefix`` and then each entry's raw bytes gives a valid file.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    relative = []
    position = 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": safetensors_dtype(dtype), "shape": [int(s) for s in shape],
                       "data_offsets": [position, position + nbytes]}
        relative.append((position, position + nbytes))
        position += nbytes
    if len(header) != len(entries) + (1 if metadata else 0):
        msg = "safetensors keys must be unique within one file."
        raise ValueError(msg)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, [(start + b, start + e) for b, e in relative]


def parse_safetensors_header(prefix: bytes, *, file: str = "?") -> tuple[dict[str, Any], int]:
    """``(header JSON, data start)`` from the first bytes of a safetensors file.

    ``prefix`` must hold at least ``8 + header length`` bytes. The absolute byte range of a
    tensor is ``data_start + data_offsets``.
    """
    if len(prefix) < 8:
        msg = f"safetensors file {file!r} is truncated: it has {len(prefix)} bytes, fewer than the 8-byte header length."
        raise CheckpointError(msg)
    length = int.from_bytes(prefix[:8], "little")
    if length > _MAX_HEADER or len(prefix) < 8 + length:
        msg = (f"safetensors file {file!r} has a header length of {length} bytes, but only "
               f"{len(prefix) - 8} header bytes are available; the file is truncated or not safetensors.")
        raise CheckpointError(msg)
    try:
        header = json.loads(prefix[8:8 + length])
    except (UnicodeDecodeError, ValueError) as exc:
        msg = f"safetensors file {file!r} has a malformed JSON header: {exc}."
        raise CheckpointError(msg) from exc
    if not isinstance(header, dict):
        msg = f"safetensors file {file!r} has a header that is {type(header).__name__}, not a JSON object."
        raise CheckpointError(msg)
    return header, 8 + length


def read_safetensors_header(fs: fsspec.AbstractFileSystem, path: str) -> tuple[dict[str, Any], int]:
    """Read and parse the header of safetensors file ``path`` with two range reads."""
    try:
        head = fs.cat_file(path, start=0, end=8)
        length = int.from_bytes(head[:8], "little") if len(head) == 8 else 0
        if len(head) == 8 and 0 < length <= _MAX_HEADER:
            head += fs.cat_file(path, start=8, end=8 + length)
    except FileNotFoundError as exc:
        msg = f"data file {path!r} is missing; the checkpoint is incomplete or was modified after it was saved."
        raise CheckpointError(msg) from exc
    return parse_safetensors_header(head, file=path)


# -- metadata ------------------------------------------------------------------------------------

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
        checksum: the checksum of those bytes, ``"<algorithm>:<hex>"``, verified on load.

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

    def to_dict(self) -> dict[str, Any]:
        return {"offsets": list(self.offsets), "dims": list(self.dims), "file": self.file, "key": self.key,
                "byte_range": list(self.byte_range), "checksum": self.checksum}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A saved tensor: its global size, dtype and the saved regions that tile it.

    Attributes:
        size: the full tensor's size.
        dtype: its dtype.
        shards: the saved regions ([`SavedShard`][checkpoint._format.SavedShard]), in save order.

    Example:
        >>> entry = checkpoint.read_metadata("ckpt").tensors["0.weight"]  # doctest: +SKIP
        >>> entry.size, entry.dtype, len(entry.shards)  # doctest: +SKIP
        (torch.Size([1000, 64]), torch.float32, 4)
    """

    size: torch.Size
    dtype: torch.dtype
    shards: tuple[SavedShard, ...]
    # Built while the tiling is checked, so that finding the regions a block needs never
    # looks at the others (a million-region checkpoint is read by every rank).
    _index: RegionIndex | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * self.dtype.itemsize

    def overlapping(self, box: Box) -> list[tuple[SavedShard, Box]]:
        """``(saved region, common block)`` for every saved region sharing an element with ``box``."""
        index = self._index
        if index is None:
            index = RegionIndex([s.region for s in self.shards], self.size)
            object.__setattr__(self, "_index", index)  # a cache: equality and the data are unchanged
        return [(self.shards[i], common) for i, common in index.overlapping(box)]

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": dtype_name(self.dtype), "size": list(self.size),
                "shards": [s.to_dict() for s in self.shards]}


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """What ``shardkit.json`` says: tensors (name -> ``TensorEntry``), values, data files.

    Returned by ``checkpoint.read_metadata``; reading it reads no tensor data.

    Attributes:
        tensors: dotted name -> [`TensorEntry`][checkpoint._format.TensorEntry] (``.size``,
            ``.dtype``, ``.shards``).
        values: dotted name -> the non-tensor value (JSON data).
        files: data file name -> size in bytes.
        generation: the unique id of the save that wrote the checkpoint.
        world_size: number of ranks that saved it.
        version: format version of ``shardkit.json``.

    Example:
        >>> meta = checkpoint.read_metadata("ckpt")  # doctest: +SKIP
        >>> meta.tensors["0.weight"].size, meta.values["step"]  # doctest: +SKIP
        (torch.Size([1000, 64]), 3)
    """

    tensors: Mapping[str, TensorEntry]
    values: Mapping[str, Any]
    files: Mapping[str, int]
    generation: str
    world_size: int
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        """The text of ``shardkit.json``."""
        data = {"format": FORMAT_NAME, "version": self.version, "generation": self.generation,
                "world_size": self.world_size,
                "files": {name: {"bytes": n} for name, n in sorted(self.files.items())},
                "tensors": {name: entry.to_dict() for name, entry in self.tensors.items()},
                "values": dict(self.values)}
        return json.dumps(data, separators=(",", ":"))

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return sum(e.nbytes for e in self.tensors.values())

    def __repr__(self) -> str:
        return (f"CheckpointMetadata(version={self.version}, tensors={len(self.tensors)}, "
                f"values={len(self.values)}, files={len(self.files)}, nbytes={self.nbytes})")


def _fail(source: str, where: str, problem: str) -> CheckpointError:
    return CheckpointError(f"malformed checkpoint metadata {source!r}: {where}: {problem}.")


def _int_list(value: object, source: str, where: str, length: int | None = None) -> tuple[int, ...]:
    if (not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)
            or (length is not None and len(value) != length)):
        expected = "a list of non-negative ints" + (f" of length {length}" if length is not None else "")
        raise _fail(source, where, f"expected {expected}, got {value!r}")
    return tuple(value)


def parse_metadata(text: str | bytes, *, source: str = "?") -> CheckpointMetadata:
    """Parse and fully validate the text of ``shardkit.json``; any problem raises ``CheckpointError``.

    Checks the format name and version, every type, that file names are plain names listed in
    ``files``, that byte ranges match dims and dtype and lie inside their file, that checksums
    name a known algorithm, and that each tensor's regions tile it exactly once.
    """
    with cyclic_gc_paused():  # a million regions are millions of small objects, none in a cycle
        return _parse_metadata(text, source)


def _parse_metadata(text: str | bytes, source: str) -> CheckpointMetadata:
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        msg = f"malformed checkpoint metadata {source!r}: not valid JSON ({exc})."
        raise CheckpointError(msg) from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        msg = (f"{source!r} is not shardkit checkpoint metadata: expected \"format\": {FORMAT_NAME!r}, "
               f"found {found!r}.")
        raise CheckpointError(msg)
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _fail(source, "version", f"expected a positive int, got {version!r}")
    if version > FORMAT_VERSION:
        msg = (f"checkpoint metadata {source!r} has format version {version}, newer than the version "
               f"{FORMAT_VERSION} this shardkit reads; upgrade shardkit to load it.")
        raise CheckpointError(msg)
    generation = data.get("generation")
    if not isinstance(generation, str) or not _GENERATION.match(generation):
        raise _fail(source, "generation", f"expected a lowercase hex string, got {generation!r}")
    world_size = data.get("world_size")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise _fail(source, "world_size", f"expected a positive int, got {world_size!r}")
    raw_files = data.get("files")
    if not isinstance(raw_files, dict):
        raise _fail(source, "files", f"expected an object, got {type(raw_files).__name__}")
    files: dict[str, int] = {}
    for name, info in raw_files.items():
        check_file_name(name, source=source)
        nbytes = info.get("bytes") if isinstance(info, dict) else None
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise _fail(source, f"files[{name!r}]", f"expected {{\"bytes\": <non-negative int>}}, got {info!r}")
        files[name] = nbytes
    raw_tensors, values = data.get("tensors"), data.get("values")
    if not isinstance(raw_tensors, dict):
        raise _fail(source, "tensors", f"expected an object, got {type(raw_tensors).__name__}")
    if not isinstance(values, dict):
        raise _fail(source, "values", f"expected an object, got {type(values).__name__}")
    both = sorted(set(raw_tensors) & set(values))
    if both:
        raise _fail(source, "tensors and values", f"names {both} appear in both")
    tensors = {name: _parse_tensor(name, entry, files, source) for name, entry in raw_tensors.items()}
    return CheckpointMetadata(MappingProxyType(tensors), MappingProxyType(values), MappingProxyType(files),
                              generation, world_size, version)


def _well_formed_shard(raw: object, ndim: int, files: Mapping[str, int], itemsize: int) -> SavedShard | None:
    """The shard ``raw`` describes if it passes every check of ``_parse_tensor``, else ``None``.

    The common case, checked without building any message: a checkpoint of a million regions
    spends most of its parsing here. ``None`` sends the shard through the checks one by one,
    which say what is wrong.
    """
    if type(raw) is not dict:
        return None
    offsets, dims, byte_range = raw.get("offsets"), raw.get("dims"), raw.get("byte_range")
    if (type(offsets) is not list or type(dims) is not list or type(byte_range) is not list
            or len(offsets) != ndim or len(dims) != ndim or len(byte_range) != 2):
        return None
    numbers = offsets + dims + byte_range
    if set(map(type, numbers)) != {int} or min(numbers) < 0:  # bool is not int here
        return None
    file, key, digest = raw.get("file"), raw.get("key"), raw.get("checksum")
    if type(file) is not str or file not in files or type(key) is not str or not key:
        return None
    if type(digest) is not str or not _CHECKSUM.fullmatch(digest):
        return None
    start, end = byte_range
    if end - start != math.prod(dims) * itemsize or end > files[file] or start < 8:
        return None
    return SavedShard(tuple(offsets), tuple(dims), file, key, (start, end), digest)


def _parse_tensor(name: str, entry: object, files: Mapping[str, int], source: str) -> TensorEntry:
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        raise _fail(source, where, f"expected an object, got {type(entry).__name__}")
    dtype = dtype_from_name(entry.get("dtype"), source=source, tensor=name)
    size = _int_list(entry.get("size"), source, f"{where} size")
    raw_shards = entry.get("shards")
    if not isinstance(raw_shards, list):
        raise _fail(source, f"{where} shards", f"expected a list, got {type(raw_shards).__name__}")
    shards = []
    for i, raw in enumerate(raw_shards):
        quick = _well_formed_shard(raw, len(size), files, dtype.itemsize)
        if quick is not None:
            shards.append(quick)
            continue
        at = f"{where} shards[{i}]"
        if not isinstance(raw, dict):
            raise _fail(source, at, f"expected an object, got {type(raw).__name__}")
        offsets = _int_list(raw.get("offsets"), source, f"{at} offsets", len(size))
        dims = _int_list(raw.get("dims"), source, f"{at} dims", len(size))
        file = raw.get("file")
        # Names listed in "files" were checked above; only others need a look (and an error).
        if not isinstance(file, str) or file not in files:
            file = check_file_name(file, source=source, tensor=name)
            raise _fail(source, at, f"file {file!r} is not listed in \"files\"")
        key = raw.get("key")
        if not isinstance(key, str) or not key:
            raise _fail(source, f"{at} key", f"expected a non-empty string, got {key!r}")
        byte_range = _int_list(raw.get("byte_range"), source, f"{at} byte_range", 2)
        nbytes = math.prod(dims) * dtype.itemsize
        if byte_range[1] - byte_range[0] != nbytes or byte_range[1] > files[file] or byte_range[0] < 8:
            raise _fail(source, f"{at} byte_range",
                        f"{list(byte_range)} does not hold {nbytes} bytes (dims {list(dims)} of {dtype}) inside "
                        f"file {file!r} of {files[file]} bytes")
        digest = raw.get("checksum")
        if not isinstance(digest, str) or not _CHECKSUM.fullmatch(digest):
            raise _fail(source, f"{at} checksum", f"expected \"{CHECKSUM_ALGORITHM}:<8 hex digits>\", got {digest!r}")
        shards.append(SavedShard(offsets, dims, file, key, (byte_range[0], byte_range[1]), digest))
    regions = [s for s in shards if 0 not in s.dims]
    if len({s.region for s in regions}) != len(regions):
        raise _fail(source, f"{where} shards", "a region is listed twice")
    index = RegionIndex([s.region for s in shards], size)
    if not index.tiles(size):
        try:
            check_tiling(regions, size, what="saved regions")
        except ValueError as exc:
            raise _fail(source, where, str(exc).rstrip(".")) from None
    return TensorEntry(torch.Size(size), dtype, tuple(shards), index)


def read_metadata(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
                  ) -> CheckpointMetadata:
    """Read a checkpoint's metadata without reading tensor data.

    Args:
        path: the checkpoint folder, a local path or fsspec URL (``"s3://bucket/ckpt"``).
        storage_options: passed to the fsspec file system (credentials, endpoint, ...).

    Returns:
        ``CheckpointMetadata``: ``.tensors`` (name -> ``.size``, ``.dtype``, ``.shards``) and
        ``.values`` (the non-tensor entries), with nested state_dicts flattened to dotted names.

    Raises:
        CheckpointError: the folder holds data files but no committed metadata (an incomplete
            save), or the metadata is malformed.
        FileNotFoundError: there is no checkpoint at ``path``.

    Example:
        >>> md = checkpoint.read_metadata("ckpt")  # doctest: +SKIP
        >>> md.tensors["fc.weight"].size, md.values["epoch"]  # doctest: +SKIP
        (torch.Size([10, 4]), 3)
    """
    fs, root = resolve(path, storage_options)
    return _read_metadata(fs, root)


def _read_metadata(fs: fsspec.AbstractFileSystem, root: str) -> CheckpointMetadata:
    source = posixpath.join(root, METADATA_FILE)
    try:
        text = fs.cat_file(source)
    except FileNotFoundError:
        text = None
    except (IsADirectoryError, NotADirectoryError) as exc:
        msg = f"{source!r} is not a readable checkpoint metadata file ({exc})."
        raise CheckpointError(msg) from exc
    if text is None:
        leftovers = _list_names(fs, root)
        data = sorted(n for n in leftovers if data_file_generation(n) is not None)
        if data:
            msg = (f"checkpoint {root!r} is incomplete: it holds {len(data)} data file(s) (e.g. {data[0]!r}) "
                   f"but no {METADATA_FILE!r}, so the save that wrote them never committed (it crashed "
                   f"or is still running); save it again.")
            raise CheckpointError(msg)
        msg = f"no shardkit checkpoint at {root!r}: {source!r} does not exist."
        raise FileNotFoundError(msg)
    return parse_metadata(text, source=source)


def _list_names(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Plain names of the entries of folder ``root`` (empty if it does not exist)."""
    fs.invalidate_cache(root)  # other processes write here: a cached listing (s3fs) may be stale
    try:
        entries = fs.ls(root, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [posixpath.basename(str(e).rstrip("/")) for e in entries]


def read_saved_shard(fs: fsspec.AbstractFileSystem, root: str, name: str, entry: TensorEntry,
                     shard: SavedShard, *, verify: bool = True) -> torch.Tensor:
    """One whole saved region as a CPU tensor of shape ``shard.dims``, checksum verified.

    For offline tools (consolidate, verify): one exact range read, one buffer, no extra copy.
    """
    path = member(root, shard.file)
    data = bytearray(read_range(fs, path, *shard.byte_range, tensor=name))
    if verify:
        verify_checksum(data, shard.checksum, file=path, tensor=name)
    if not data:
        return torch.empty(shard.dims, dtype=entry.dtype)
    return torch.frombuffer(data, dtype=entry.dtype).reshape(shard.dims)


# -- state_dict structure ------------------------------------------------------------------------

_SCALARS = (str, int, float, bool, type(None))


def check_json_value(name: str, value: object) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``value`` is JSON data (and not a tensor).

    JSON data: None, bool, int, float, str, and lists/tuples/dicts (str keys) of those.
    """
    stack: list[tuple[str, object]] = [(name, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, _SCALARS):
            continue
        if isinstance(v, (list, tuple)):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
            continue
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    msg = (f"state_dict entry {name!r} holds a dict with key {k!r} of type {type(k).__name__} "
                           f"at {where!r}; only str keys can be stored as JSON.")
                    raise TypeError(msg)
                stack.append((f"{where}[{k!r}]", x))
            continue
        msg = (f"state_dict entry {name!r} is {type(v).__name__}"
               + (f" at {where!r}" if where != name else "")
               + "; a checkpoint stores tensors, ShardedTensors and JSON values (None, bool, int, float, "
               "str and lists/dicts of them), never pickled objects. Convert it, or drop it from the state_dict.")
        raise TypeError(msg)


def flatten_state_dict(state_dict: Mapping[Any, Any]) -> Iterator[tuple[str, Mapping[Any, Any], Any, Any]]:
    """Yield ``(dotted name, parent mapping, key, value)`` for every leaf of a nested state_dict.

    A non-empty nested ``Mapping`` is a state_dict level and is descended into; keys are ``str``
    or ``int`` (as in optimizer state: ``{"opt": {"state": {0: ...}}}`` gives ``"opt.state.0"``).
    Every other value, an empty mapping included, is a leaf. Two leaves with the same dotted
    name (``{"a.b": x}`` and ``{"a": {"b": y}}``) raise ``ValueError``.
    """
    seen: dict[str, str] = {}

    def walk(prefix: str, where: str, mapping: Mapping[Any, Any]
             ) -> Iterator[tuple[str, Mapping[Any, Any], Any, Any]]:
        for key, value in mapping.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                msg = (f"state_dict key {key!r} at {where or 'the top level'} is {type(key).__name__}; "
                       f"keys must be str (or int, as in optimizer state).")
                raise TypeError(msg)
            name, path = f"{prefix}{key}", f"{where}[{key!r}]"
            if isinstance(value, Mapping) and value:
                yield from walk(f"{name}.", path, value)
                continue
            if name in seen:
                msg = (f"state_dict entries {seen[name]} and {path} both flatten to the name {name!r}; "
                       f"rename one of them.")
                raise ValueError(msg)
            seen[name] = path
            yield name, mapping, key, value

    yield from walk("", "", state_dict)
