"""Bytes inside data files: safetensors headers, tensors as raw bytes and back, checksums.

Pure (no file system). A data file is a safetensors file: an 8-byte little-endian header
length, a JSON header (``key -> {"dtype", "shape", "data_offsets"}``, plus an optional
``"__metadata__"`` of str to str), then each tensor's bytes in row-major order.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import crc32c
import torch

from . import _strict_json as strict_json
from ._schema import CHECKSUM_ALGORITHM, CheckpointError, SavedShard, safetensors_dtype
from ._strict_json import shown

__all__ = ["MAX_HEADER", "build_safetensors_header", "parse_safetensors_header", "header_length", "parse_header",
           "check_header_entry", "tensor_bytes", "tensor_from_bytes", "Checksum", "checksum"]

MAX_HEADER = 100_000_000
"""safetensors' own limit on the JSON header, in bytes."""


# -- safetensors headers -----------------------------------------------------------------------

def build_safetensors_header(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                             metadata: Mapping[str, str] | None = None, *,
                             align: int = 8) -> tuple[bytes, list[tuple[int, int]]]:
    """The first bytes of a safetensors file holding ``entries`` back to back, in order.

    Returns ``(prefix, byte_ranges)``: ``prefix`` is the 8-byte little-endian header length
    followed by the JSON header, space padded so the data starts at a multiple of ``align``
    (8, as safetensors does, or a larger multiple of 8); ``byte_ranges[i]`` is the absolute
    ``[start, end)`` of entry ``i``'s data in the file. Writing ``prefix`` and then each entry's
    raw bytes gives a valid file.
    """
    if align < 8 or align % 8:
        msg = f"build_safetensors_header: align must be a positive multiple of 8, got {align}."
        raise ValueError(msg)
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
    text += b" " * (-(8 + len(text)) % align)
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, [(start + b, start + e) for b, e in relative]


def header_length(head: bytes | bytearray, file_size: int, *, file: str) -> int:
    """The JSON header length that the first 8 bytes ``head`` of a ``file_size``-byte file announce, checked."""
    length = int.from_bytes(head[:8], "little")
    if length > MAX_HEADER or 8 + length > file_size:
        msg = (f"safetensors file {file!r} claims a {length}-byte header in a {file_size}-byte file; the file is "
               f"truncated or not a safetensors file.")
        raise CheckpointError(msg)
    return length


def parse_header(text: bytes | bytearray, *, file: str) -> dict[str, Any]:
    """The JSON object of a safetensors header; anything else raises ``CheckpointError``."""
    try:
        header = strict_json.loads(bytes(text), source=file, what="malformed safetensors header in")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(header, dict):
        msg = f"safetensors file {file!r} has a header that is not a JSON object (it is {type(header).__name__})."
        raise CheckpointError(msg)
    return header


def parse_safetensors_header(data: bytes, *, file: str = "?") -> tuple[dict[str, Any], int]:
    """``(header JSON, data start)`` from the bytes of a whole safetensors file.

    The absolute byte range of a tensor is ``data_start + data_offsets``.
    """
    if len(data) < 8:
        msg = (f"safetensors file {file!r} is truncated: it has {len(data)} bytes, fewer than the 8-byte "
               f"header length.")
        raise CheckpointError(msg)
    length = header_length(data, len(data), file=file)
    return parse_header(data[8:8 + length], file=file), 8 + length


def check_header_entry(header: Mapping[str, Any], data_start: int, shard: SavedShard, dtype: torch.dtype, *,
                       file: str, tensor: str) -> None:
    """Raise ``CheckpointError`` unless the safetensors header of ``file`` describes ``shard`` as the metadata does.

    The header's entry under ``shard.key`` must have the dtype, the shape (``shard.dims``) and
    the byte range the metadata records; otherwise one of the two was altered and the bytes
    would be reinterpreted silently (e.g. float32 read as int32).
    """
    entry = header.get(shard.key)
    where = f"safetensors file {file!r}, key {shard.key!r} of tensor {tensor!r}"
    if not isinstance(entry, dict):
        msg = (f"{where}: the header has no such entry (it has {type(entry).__name__}), but shardkit.json "
               f"places the region there; the file or the metadata is corrupt.")
        raise CheckpointError(msg)
    expected = safetensors_dtype(dtype)
    if entry.get("dtype") != expected:
        msg = (f"{where}: the header says dtype {shown(entry.get('dtype'))} but shardkit.json says {expected!r} "
               f"({dtype}); refusing to reinterpret the bytes (the file or the metadata is corrupt).")
        raise CheckpointError(msg)
    if entry.get("shape") != list(shard.dims):
        msg = (f"{where}: the header says shape {shown(entry.get('shape'))} but shardkit.json says "
               f"{list(shard.dims)}; refusing to reinterpret the bytes (the file or the metadata is corrupt).")
        raise CheckpointError(msg)
    offsets = entry.get("data_offsets")
    expected_offsets = [shard.byte_range[0] - data_start, shard.byte_range[1] - data_start]
    if offsets != expected_offsets:
        msg = (f"{where}: the header places the data at {shown(offsets)} (relative to byte {data_start}) but "
               f"shardkit.json at bytes {list(shard.byte_range)}; the file or the metadata is corrupt.")
        raise CheckpointError(msg)


# -- tensors as bytes --------------------------------------------------------------------------

def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` in row-major order (any dtype, bool and bfloat16 included).

    A contiguous CPU tensor is not copied: the view is writable and writes reach the tensor
    (reading a file straight into a target's memory). Any other tensor is first copied to a
    contiguous CPU tensor.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


def tensor_from_bytes(data: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of ``dtype`` over ``data`` without copying; read-only buffers are only ever read from."""
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(data, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype)


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
    digest = Checksum()
    digest.update(data)
    return digest.hexdigest()
