"""The metadata of a checkpoint: the JSON model of ``shardkit.json`` (format version 4) and its validation.

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

(The layout above is version 1's; version 3 stores a tensor's regions as columns, see
``_regions``, and version 4 adds ``"checksum"``, the SHA-256 of the file's own canonical
content, checked by every reader: an edited file is refused, a re-indented one is not.)
Names are dotted paths of the (possibly nested) state_dict. The saved regions of a tensor
tile it exactly once (replicated regions are written once). A region's data is its block of
the global tensor in row-major (C) order, little-endian, as in safetensors. The full
specification is ``docs/format.md``. This module is pure (no file system): the values below,
``parse_metadata`` (the reference validation, shared by every reader) and the dtype names;
``_storage`` reads and writes the files, ``_codec`` the bytes inside data files.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from _shardkit.memory import cyclic_gc_paused
from sharding import ShardMetadata
from sharding.layout import Box, RegionIndex, check_tiling

from . import _strict_json as strict_json
from ._chunks import chunk_count, decode_chunks
from ._regions import (
    CHECKSUM_ALGORITHM,
    MAX_CHUNK,
    MAX_INT,
    FileList,
    RegionError,
    RegionTable,
    SavedShard,
    parse_regions,
    region_index,
)
from ._strict_json import shown

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "CHECKSUMMED_VERSION", "METADATA_FILE", "CHECKSUM_ALGORITHM",
    "CheckpointError", "CheckpointMetadata", "TensorEntry", "SavedShard", "RegionTable", "parse_metadata",
    "metadata_from_data", "metadata_text", "content_checksum", "CONTENT_CHECKSUM", "check_file_name",
    "dtype_from_name", "dtype_from_code", "dtype_name", "safetensors_dtype",
]

FORMAT_NAME = "shardkit-checkpoint"
FORMAT_VERSION = 4
CHECKSUMMED_VERSION = 4
"""The first format version whose ``shardkit.json`` carries the checksum of its own content."""
CONTENT_CHECKSUM = "checksum"
"""Key of ``shardkit.json``'s checksum of its own canonical content (from format version 4)."""
_CONTENT_ALGORITHM = "sha256"
METADATA_FILE = "shardkit.json"
_GENERATION = re.compile(r"^[0-9a-f]{1,64}$")


class CheckpointError(RuntimeError):
    """A problem with a checkpoint's content: incomplete, corrupt, unsafe, or not matching the target.

    The message names the file and, where one is involved, the tensor. When the checkpoint's
    names do not match the state_dict under ``strict=True``, ``missing`` (in the state_dict,
    not in the checkpoint) and ``unexpected`` (the other way round) list them; otherwise
    both are empty.

    Args:
        message: what is wrong, naming the file and the tensor.
        missing: names in the state_dict that the checkpoint lacks (strict loads).
        unexpected: names in the checkpoint that the state_dict lacks (strict loads).
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
        msg = (f"tensor {shown(tensor)} has dtype {dtype}, which safetensors cannot store; convert it to one "
               f"of {sorted(_BY_NAME)} before saving.")
        raise TypeError(msg) from None


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype code of a supported torch dtype (``"F32"``)."""
    return _DTYPES[dtype][1]


def dtype_from_name(name: object, *, source: str = "?", tensor: str = "?") -> torch.dtype:
    """Inverse of ``dtype_name``; an unknown name raises ``CheckpointError``."""
    dtype = _BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        msg = (f"checkpoint metadata {source!r}: tensor {shown(tensor)} has unknown dtype {shown(name)}; "
               f"known dtypes are {sorted(_BY_NAME)}.")
        raise CheckpointError(msg)
    return dtype


_BY_CODE = {code: dtype for dtype, (_, code) in _DTYPES.items()}


def dtype_from_code(code: object, *, where: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (``"F32"``); an unknown code raises ``CheckpointError``."""
    dtype = _BY_CODE.get(code) if isinstance(code, str) else None
    if dtype is None:
        msg = f"{where} has dtype {shown(code)}, which shardkit does not read; known: {sorted(_BY_CODE)}."
        raise CheckpointError(msg)
    return dtype


def check_file_name(name: object, *, source: str = "?", tensor: str | None = None) -> str:
    """Return ``name`` if it is a plain file name inside the checkpoint folder, else ``CheckpointError``.

    A plain name has no ``/`` or ``\\``, is not ``.`` or ``..``, has no ``:`` (drive or URL
    scheme), no NUL and no leading ``~``: nothing a path join could send outside the folder.
    """
    ok = (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\:\x00")
          and not name.startswith("~") and name == name.strip())
    if not ok:
        what = f" for tensor {shown(tensor)}" if tensor is not None else ""
        msg = (f"checkpoint metadata {source!r} names data file {shown(name)}{what}, which is not a plain file "
               f"name inside the checkpoint folder; refusing to read it (the metadata is corrupt or unsafe).")
        raise CheckpointError(msg)
    return name  # type: ignore[return-value]  # checked to be a str above


# -- metadata ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A saved tensor: its global size, dtype and the saved regions that tile it.

    Attributes:
        size: the full tensor's size.
        dtype: its dtype.
        shards: the saved regions ([`SavedShard`][checkpoint._schema.SavedShard]), in save order
            (from format version 3 a read-only sequence of them, built from columns on access).

    Example:
        >>> entry = checkpoint.read_metadata("ckpt").tensors["0.weight"]  # doctest: +SKIP
        >>> entry.size, entry.dtype, len(entry.shards)  # doctest: +SKIP
        (torch.Size([1000, 64]), torch.float32, 4)
    """

    size: torch.Size
    dtype: torch.dtype
    shards: Sequence[SavedShard]
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
            index = region_index(self.shards, self.size)
            object.__setattr__(self, "_index", index)  # a cache: equality and the data are unchanged
        return [(self.shards[i], common) for i, common in index.overlapping(box)]

    def to_dict(self, name: str, files: FileList) -> dict[str, Any]:
        """Tensor ``name``'s object in ``shardkit.json`` (current version), file ids in ``files``' order."""
        table = self.shards
        if not isinstance(table, RegionTable):
            table = RegionTable.of_shards(name, self.size, self.dtype, self.shards, files.names)
        return {"dtype": dtype_name(self.dtype), "size": list(self.size), "regions": table.to_dict(files)}


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """What ``shardkit.json`` says: tensors (name -> ``TensorEntry``), values, data files.

    Returned by ``checkpoint.read_metadata``; reading it reads no tensor data.

    Attributes:
        tensors: dotted name -> [`TensorEntry`][checkpoint._schema.TensorEntry] (``.size``,
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

    def to_data(self) -> dict[str, Any]:
        """The JSON data of ``shardkit.json``, in the current format version, its checksum last."""
        files = FileList.of(self.files)
        data = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "generation": self.generation,
                "world_size": self.world_size,
                "files": [{"name": name, "bytes": n} for name, n in self.files.items()],
                "tensors": {name: entry.to_dict(name, files) for name, entry in self.tensors.items()},
                "values": dict(self.values)}
        data[CONTENT_CHECKSUM] = content_checksum(data)
        return data

    def to_json(self) -> str:
        """The text of ``shardkit.json``, in the current format version."""
        return metadata_text(self.to_data())

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
    if (not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_INT
                                           for v in value)
            or (length is not None and len(value) != length)):
        expected = ("a list of ints in [0, 2**63)" + (f" of length {length}" if length is not None else ""))
        raise _fail(source, where, f"expected {expected}, got {shown(value)}")
    return tuple(value)


def parse_metadata(text: str | bytes, *, source: str = "?") -> CheckpointMetadata:
    """Parse and fully validate the text of ``shardkit.json``; any problem raises ``CheckpointError``.

    Checks the format name and version, every type, that file names are plain names listed in
    ``files``, that byte ranges match dims and dtype and lie inside their file, that checksums
    name a known algorithm, and that each tensor's regions tile it exactly once.
    """
    with cyclic_gc_paused():  # a million regions are millions of small objects, none in a cycle
        return _parse_metadata(text, source)


def metadata_text(data: Mapping[str, Any]) -> str:
    """The text of ``shardkit.json`` holding ``data``."""
    return json.dumps(data, separators=(",", ":"))


def content_checksum(data: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of the canonical JSON of ``data`` without its ``"checksum"`` key.

    Canonical: keys sorted, no spaces, ASCII only (``json.dumps(..., sort_keys=True,
    separators=(",", ":"))``), so the checksum depends on the content, never on how the
    file is laid out: a re-indented file still matches, an edited value never does.
    """
    content = {key: value for key, value in data.items() if key != CONTENT_CHECKSUM}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{_CONTENT_ALGORITHM}:{hashlib.sha256(text.encode()).hexdigest()}"


def _check_content(data: Mapping[str, Any], source: str) -> None:
    """Refuse a version-4 ``shardkit.json`` whose recorded checksum is not its content's."""
    recorded = data.get(CONTENT_CHECKSUM)
    if not isinstance(recorded, str) or not re.fullmatch(rf"{_CONTENT_ALGORITHM}:[0-9a-f]{{64}}", recorded):
        msg = (f"checkpoint metadata {source!r} was edited or is corrupt: its {CONTENT_CHECKSUM!r} field is "
               f"{shown(recorded)}, not \"{_CONTENT_ALGORITHM}:<64 hex digits>\" (format version {data.get('version')} "
               f"records the checksum of its own content); restore the file or save the checkpoint again.")
        raise CheckpointError(msg)
    actual = content_checksum(data)
    if actual != recorded:
        msg = (f"checkpoint metadata {source!r} was edited or is corrupt: its content has checksum {actual}, but "
               f"the file records {recorded}. shardkit.json must not be changed after a save (a changed value, "
               f"size or name would load silently otherwise); restore the file or save the checkpoint again.")
        raise CheckpointError(msg)


def metadata_from_data(data: object, *, source: str = "?") -> CheckpointMetadata:
    """``parse_metadata`` of the JSON data itself (``data`` as ``json.loads`` returns it), as fully checked."""
    with cyclic_gc_paused():
        return _from_data(data, source)


def _parse_metadata(text: str | bytes, source: str) -> CheckpointMetadata:
    try:
        data = strict_json.loads(text, source=source, what="malformed checkpoint metadata")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return _from_data(data, source)


def _from_data(data: object, source: str) -> CheckpointMetadata:
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        msg = (f"{source!r} is not shardkit checkpoint metadata: expected \"format\": {FORMAT_NAME!r}, "
               f"found {shown(found)}.")
        raise CheckpointError(msg)
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _fail(source, "version", f"expected a positive int, got {shown(version)}")
    if version > FORMAT_VERSION:
        msg = (f"checkpoint metadata {source!r} has format version {version}, newer than the version "
               f"{FORMAT_VERSION} this shardkit reads; upgrade shardkit to load it.")
        raise CheckpointError(msg)
    _check_writer(data, version, source)
    if version >= CHECKSUMMED_VERSION:
        _check_content(data, source)
    generation = data.get("generation")
    if not isinstance(generation, str) or not _GENERATION.match(generation):
        raise _fail(source, "generation", f"expected a lowercase hex string, got {shown(generation)}")
    world_size = data.get("world_size")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise _fail(source, "world_size", f"expected a positive int, got {shown(world_size)}")
    files = _parse_files(data.get("files"), source, version)
    raw_tensors, values = data.get("tensors"), data.get("values")
    if not isinstance(raw_tensors, dict):
        raise _fail(source, "tensors", f"expected an object, got {type(raw_tensors).__name__}")
    if not isinstance(values, dict):
        raise _fail(source, "values", f"expected an object, got {type(values).__name__}")
    both = sorted(set(raw_tensors) & set(values))
    if both:
        raise _fail(source, "tensors and values", f"names {both} appear in both")
    if version < 3:
        tensors = {name: _parse_tensor(name, entry, files, source, version) for name, entry in raw_tensors.items()}
    else:
        numbered = FileList.of(files)
        tensors = {name: _parse_table(name, entry, numbered, source) for name, entry in raw_tensors.items()}
    return CheckpointMetadata(MappingProxyType(tensors), MappingProxyType(values), MappingProxyType(files),
                              generation, world_size, version)


def _writer_version(data: Mapping[str, Any]) -> tuple[int, str]:
    """``(version, field)``: the oldest format version whose writer writes every field of ``data``, and the
    field that requires it (``(1, "")`` when any version's writer could have written it)."""
    if CONTENT_CHECKSUM in data:
        return CHECKSUMMED_VERSION, f"the top-level {CONTENT_CHECKSUM!r}"
    if isinstance(data.get("files"), list):
        return 3, "\"files\" as a list"
    tensors = data.get("tensors")
    chunked = ""
    for name, entry in tensors.items() if isinstance(tensors, dict) else ():
        if not isinstance(entry, dict):
            continue
        if "regions" in entry:
            return 3, f"tensor {shown(name)}'s \"regions\""
        shards = entry.get("shards")
        if not chunked and isinstance(shards, list) and any(isinstance(r, dict) and "chunks" in r for r in shards):
            chunked = f"tensor {shown(name)}'s \"chunks\""
    return (2, chunked) if chunked else (1, "")


def _check_writer(data: Mapping[str, Any], version: int, source: str) -> None:
    """Refuse a file that claims an older format version than its own fields prove its writer had.

    A writer of version ``v`` writes only version ``v``'s fields, so a file carrying a later
    version's field was written by that later writer and had its ``version`` lowered since: the
    classic way to shed the checks of the newer version (a version-4 file edited, set to version 3
    and keeping its ``checksum``). It is checked by the rules of the newest version its fields
    show, which refuse it.
    """
    writer, field = _writer_version(data)
    if writer > version:
        msg = (f"checkpoint metadata {source!r} was edited or is corrupt: it says format version {version}, but it "
               f"carries {field}, which only a version-{writer} writer writes, so its \"version\" was changed "
               f"after the save (checked as version {writer}, it is refused); restore the file or save the "
               f"checkpoint again.")
        raise CheckpointError(msg)


def _parse_files(raw: object, source: str, version: int) -> dict[str, int]:
    """Data file name -> size: an object ``{name: {"bytes": n}}`` up to version 2, a list of
    ``{"name": name, "bytes": n}`` from version 3 (whose order the regions' file numbers index)."""
    if version < 3:
        if not isinstance(raw, dict):
            raise _fail(source, "files", f"expected an object, got {type(raw).__name__}")
        items = [(name, info.get("bytes") if isinstance(info, dict) else None, info) for name, info in raw.items()]
    else:
        if not isinstance(raw, list):
            raise _fail(source, "files", f"expected a list, got {type(raw).__name__}")
        items = [(item.get("name") if isinstance(item, dict) else None,
                  item.get("bytes") if isinstance(item, dict) and set(item) == {"name", "bytes"} else None, item)
                 for item in raw]
    files: dict[str, int] = {}
    for name, nbytes, info in items:
        check_file_name(name, source=source)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes < MAX_INT:
            expected = ("{\"bytes\": <non-negative int>}" if version < 3
                        else "{\"name\": <file>, \"bytes\": <non-negative int>}")
            raise _fail(source, f"files[{shown(name)}]", f"expected {expected}, got {shown(info)}")
        if name in files:
            raise _fail(source, "files", f"{shown(name)} is listed twice")
        files[name] = nbytes
    return files


def _parse_table(name: str, entry: object, files: FileList, source: str) -> TensorEntry:
    """A tensor of format version 3: its regions as columns (``_regions.parse_regions``)."""
    where = f"tensor {shown(name)}"
    if not isinstance(entry, dict):
        raise _fail(source, where, f"expected an object, got {type(entry).__name__}")
    dtype = dtype_from_name(entry.get("dtype"), source=source, tensor=name)
    size = _int_list(entry.get("size"), source, f"{where} size")
    if math.prod(size) * dtype.itemsize >= MAX_INT:
        raise _fail(source, f"{where} size", f"{list(size)} of {dtype} is more than 2**63 bytes")
    try:
        table, index = parse_regions(name, entry.get("regions"), size, dtype, files)
    except RegionError as exc:
        raise _fail(source, f"{where} regions{exc.where and ' ' + exc.where}".replace(" [", "["), exc.problem) from None
    return TensorEntry(torch.Size(size), dtype, table, index)


def _parse_tensor(name: str, entry: object, files: Mapping[str, int], source: str, version: int) -> TensorEntry:
    where = f"tensor {shown(name)}"
    if not isinstance(entry, dict):
        raise _fail(source, where, f"expected an object, got {type(entry).__name__}")
    dtype = dtype_from_name(entry.get("dtype"), source=source, tensor=name)
    size = _int_list(entry.get("size"), source, f"{where} size")
    raw_shards = entry.get("shards")
    if not isinstance(raw_shards, list):
        raise _fail(source, f"{where} shards", f"expected a list, got {type(raw_shards).__name__}")
    shards = []
    for i, raw in enumerate(raw_shards):
        at = f"{where} shards[{i}]"
        if not isinstance(raw, dict):
            raise _fail(source, at, f"expected an object, got {type(raw).__name__}")
        offsets = _int_list(raw.get("offsets"), source, f"{at} offsets", len(size))
        dims = _int_list(raw.get("dims"), source, f"{at} dims", len(size))
        file = check_file_name(raw.get("file"), source=source, tensor=name)
        if file not in files:
            raise _fail(source, at, f"file {file!r} is not listed in \"files\"")
        key = raw.get("key")
        if not isinstance(key, str) or not key:
            raise _fail(source, f"{at} key", f"expected a non-empty string, got {shown(key)}")
        byte_range = _int_list(raw.get("byte_range"), source, f"{at} byte_range", 2)
        nbytes = math.prod(dims) * dtype.itemsize
        if byte_range[1] - byte_range[0] != nbytes or byte_range[1] > files[file] or byte_range[0] < 8:
            raise _fail(source, f"{at} byte_range",
                        f"{list(byte_range)} does not hold {nbytes} bytes (dims {list(dims)} of {dtype}) inside "
                        f"file {file!r} of {files[file]} bytes")
        digest = raw.get("checksum")
        if (not isinstance(digest, str) or not digest.startswith(f"{CHECKSUM_ALGORITHM}:")
                or not re.fullmatch(r"[0-9a-f]{8}", digest.removeprefix(f"{CHECKSUM_ALGORITHM}:"))):
            raise _fail(source, f"{at} checksum",
                        f"expected \"{CHECKSUM_ALGORITHM}:<8 hex digits>\", got {shown(digest)}")
        chunk_bytes, chunks = _parse_chunks(raw.get("chunks"), nbytes, version, source, f"{at} chunks")
        shards.append(SavedShard(offsets, dims, file, key, (byte_range[0], byte_range[1]), digest, chunk_bytes,
                                 chunks))
    regions = [s.region for s in shards if s.numel > 0]
    if len(set(regions)) != len(regions):
        raise _fail(source, f"{where} shards", "a region is listed twice")
    index = RegionIndex([s.region for s in shards], size)
    if not index.tiles(size):
        try:
            check_tiling([ShardMetadata(o, d, "cpu") for o, d in regions], size, what="saved regions")
        except ValueError as exc:
            raise _fail(source, where, str(exc).rstrip(".")) from None
    return TensorEntry(torch.Size(size), dtype, tuple(shards), index)




def _parse_chunks(raw: object, nbytes: int, version: int, source: str, where: str) -> tuple[int, tuple[int, ...]]:
    """``(chunk_bytes, chunk checksums)`` of a region: required from version 2, absent before."""
    if version < 2:
        return 0, ()
    if not isinstance(raw, dict):
        raise _fail(source, where, f"expected {{\"bytes\": <chunk size>, \"{CHECKSUM_ALGORITHM}\": <hex>}}, got "
                                   f"{type(raw).__name__}")
    chunk_bytes = raw.get("bytes")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or not 0 < chunk_bytes <= MAX_CHUNK:
        raise _fail(source, f"{where} bytes", f"expected a chunk size in [1, {MAX_CHUNK}], got {shown(chunk_bytes)}")
    try:
        chunks = decode_chunks(raw.get(CHECKSUM_ALGORITHM), chunk_count(nbytes, chunk_bytes))
    except ValueError as exc:
        raise _fail(source, f"{where} {CHECKSUM_ALGORITHM}", str(exc).rstrip(".")) from None
    return chunk_bytes, tuple(chunks)
