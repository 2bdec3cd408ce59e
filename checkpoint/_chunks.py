"""Chunked checksums: a CRC-32C per fixed-size chunk of a region, so a partial read can be verified.

Format version 2 stores, for each saved region, the CRC-32C of every ``chunk_bytes`` piece of
its bytes (the last piece may be shorter). A reader that needs bytes ``[start, end)`` of a
region widens the range to whole chunks (``plan_read``: at most one chunk's worth of extra
bytes at each end), reads that, and checks exactly the chunks it read (``verify_chunks``).
The writer computes the chunk checksums while it writes (``ChunkedChecksum``), and the
checksum of the whole region follows from them without another pass over the data
(``crc32c_combine``), which keeps version 1's whole-region ``checksum`` available.

Pure functions over bytes, integers and numpy arrays: no file system, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
import numpy as np

__all__ = [
    "CHUNK_BYTES",
    "ChunkMismatch",
    "ChunkPlan",
    "ChunkedChecksum",
    "chunk_checksums",
    "chunk_count",
    "combine_chunks",
    "crc32c_combine",
    "decode_chunk_array",
    "decode_chunks",
    "decode_hex_column",
    "encode_chunk_array",
    "encode_hex_column",
    "encode_chunks",
    "plan_read",
    "verify_chunks",
]

CHUNK_BYTES = 1 << 20
"""Default chunk size. Chosen by ``scripts/bench/chunk_size.py`` (see ``docs/benchmarks-history.md``):
CRC-32C costs the same per byte from 256 KiB up, while a partial read pays up to two chunks
of extra bytes and the metadata grows by 8 hex digits per chunk; 1 MiB keeps both small."""

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """Number of chunks of a region of ``nbytes`` bytes (0 for an empty region)."""
    return -(-nbytes // chunk_bytes)


def chunk_checksums(data: bytes | bytearray | memoryview, chunk_bytes: int) -> list[int]:
    """The CRC-32C of each ``chunk_bytes`` piece of ``data``, in order."""
    view = memoryview(data).cast("B")
    return [crc32c.crc32c(view[i:i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]


class ChunkedChecksum:
    """Incremental chunk checksums over a stream of buffers of any sizes.

    ``update`` may be called with pieces that do not line up with chunk boundaries; a piece
    is checksummed in place (no copy), split at the boundaries it crosses.
    """

    __slots__ = ("_current", "_done", "_filled", "chunk_bytes", "nbytes")

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            msg = f"chunk_bytes must be positive, got {chunk_bytes!r}."
            raise ValueError(msg)
        self.chunk_bytes = chunk_bytes
        self._done: list[int] = []
        self._current = 0
        self._filled = 0
        self.nbytes = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.nbytes += len(view)
        while view:
            take = min(len(view), self.chunk_bytes - self._filled)
            self._current = crc32c.crc32c(view[:take], self._current)
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self._done.append(self._current)
                self._current, self._filled = 0, 0

    def values(self) -> list[int]:
        """The checksum of every chunk so far, the last one possibly partial."""
        return self._done + ([self._current] if self._filled else [])

    def whole(self) -> int:
        """The CRC-32C of all the bytes so far, derived from the chunk checksums."""
        return combine_chunks(self.values(), self.nbytes, self.chunk_bytes)


# -- CRC-32C of a concatenation ------------------------------------------------------------------
# A CRC is linear over GF(2): crc(A + B) = Z_len(B)(crc(A)) ^ crc(B), where Z_n is the 32x32
# bit matrix that "appends n zero bytes" to a CRC state. Matrices are lists of 32 column ints.

def _times(matrix: Sequence[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _compose(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """The matrix of ``a`` after ``b``."""
    return [_times(a, column) for column in b]


_ONE_BIT = [_POLY] + [1 << n for n in range(31)]
_POWERS: list[list[int]] = []  # _POWERS[k]: append 2**k zero bytes


def _power(k: int) -> list[int]:
    while len(_POWERS) <= k:
        if not _POWERS:
            m = _ONE_BIT
            for _ in range(3):  # 1 bit -> 2 -> 4 -> 8 bits: one byte
                m = _compose(m, m)
            _POWERS.append(m)
        else:
            _POWERS.append(_compose(_POWERS[-1], _POWERS[-1]))
    return _POWERS[k]


def _shift(crc: int, nbytes: int) -> int:
    """The CRC state ``crc`` after ``nbytes`` zero bytes: one matrix-vector product per set bit of ``nbytes``."""
    k = 0
    while nbytes:
        if nbytes & 1:
            crc = _times(_power(k), crc)
        nbytes >>= 1
        k += 1
    return crc


def crc32c_combine(first: int, second: int, second_bytes: int) -> int:
    """The CRC-32C of ``A + B`` from ``first = crc(A)``, ``second = crc(B)`` and ``len(B)``."""
    return _shift(first, second_bytes) ^ second


def combine_chunks(checksums: Sequence[int], nbytes: int, chunk_bytes: int) -> int:
    """The CRC-32C of a whole region from its chunk checksums (each step costs a few hundred bit operations)."""
    if not checksums:
        return 0
    last = nbytes - chunk_bytes * (len(checksums) - 1)
    crc = checksums[0]
    for value in checksums[1:-1]:
        crc = _shift(crc, chunk_bytes) ^ value
    if len(checksums) > 1:
        crc = _shift(crc, last) ^ checksums[-1]
    return crc


# -- partial reads -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """What to read for bytes ``[start, end)`` of a region: ``[read_start, read_end)`` (region-relative,
    chunk-aligned except at the region's end), holding chunks ``first_chunk .. last_chunk - 1``.

    The wanted bytes are ``data[start - read_start : end - read_start]`` of what was read.
    """

    start: int
    end: int
    read_start: int
    read_end: int
    first_chunk: int
    last_chunk: int

    @property
    def extra_bytes(self) -> int:
        return (self.read_end - self.read_start) - (self.end - self.start)


def plan_read(start: int, end: int, region_bytes: int, chunk_bytes: int) -> ChunkPlan:
    """The chunk-aligned read that covers bytes ``[start, end)`` of a region of ``region_bytes`` bytes.

    At most ``chunk_bytes - 1`` extra bytes are read at each end. An empty range reads nothing.
    """
    if chunk_bytes <= 0 or not 0 <= start <= end <= region_bytes:
        msg = (f"cannot plan a read of bytes [{start}, {end}) of a region of {region_bytes} bytes with "
               f"chunks of {chunk_bytes} bytes: need 0 <= start <= end <= region size and a positive chunk size.")
        raise ValueError(msg)
    if start == end:
        return ChunkPlan(start, end, start, start, start // chunk_bytes, start // chunk_bytes)
    first = start // chunk_bytes
    last = -(-end // chunk_bytes)
    return ChunkPlan(start, end, first * chunk_bytes, min(last * chunk_bytes, region_bytes), first, last)


class ChunkMismatch(ValueError):
    """Chunk ``index`` (bytes ``[start, end)`` of its region) does not have its recorded checksum."""

    def __init__(self, index: int, start: int, end: int, expected: int, actual: int) -> None:
        self.index, self.start, self.end, self.expected, self.actual = index, start, end, expected, actual
        super().__init__(f"checksum mismatch in chunk {index} (bytes [{start}, {end}) of the region): recorded "
                         f"crc32c:{expected:08x}, data has crc32c:{actual:08x}")


def verify_chunks(data: bytes | bytearray | memoryview, plan: ChunkPlan, checksums: Sequence[int],
                  chunk_bytes: int) -> None:
    """Raise ``ChunkMismatch`` unless every chunk ``plan`` read (``data``) has its checksum.

    ``data`` holds the region's bytes ``[plan.read_start, plan.read_end)``.
    """
    view = memoryview(data).cast("B")
    if len(view) != plan.read_end - plan.read_start:
        msg = f"verify_chunks got {len(view)} bytes for a planned read of {plan.read_end - plan.read_start}."
        raise ValueError(msg)
    if plan.last_chunk > len(checksums):
        msg = f"the read covers chunk {plan.last_chunk - 1} but only {len(checksums)} chunk checksums are recorded."
        raise ValueError(msg)
    for index in range(plan.first_chunk, plan.last_chunk):
        a = index * chunk_bytes - plan.read_start
        piece = view[a:a + chunk_bytes]
        actual = crc32c.crc32c(piece)
        if actual != checksums[index]:
            start = index * chunk_bytes
            raise ChunkMismatch(index, start, start + len(piece), checksums[index], actual)


# -- storage in shardkit.json --------------------------------------------------------------------

def encode_chunks(checksums: Sequence[int]) -> str:
    """The checksums as one string of 8 lowercase hex digits each (compact in JSON)."""
    return "".join(f"{c:08x}" for c in checksums)


def decode_chunks(text: object, count: int) -> list[int]:
    """Inverse of ``encode_chunks``, for exactly ``count`` chunks; ``ValueError`` if malformed."""
    if not isinstance(text, str) or len(text) != 8 * count or (text and not _is_hex(text)):
        shown = text if not isinstance(text, str) or len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
        msg = f"chunk checksums must be {count} x 8 lowercase hex digits, got {shown!r}."
        raise ValueError(msg)
    return [int(text[i:i + 8], 16) for i in range(0, len(text), 8)]


def _is_hex(text: str) -> bool:
    return _HEX.fullmatch(text) is not None


_HEX = re.compile(r"[0-9a-f]*")


def encode_hex_column(column: np.ndarray, digits: int) -> str:
    """Non-negative integers as ``digits`` (2, 4, 8 or 16) lowercase hex digits each, without a Python loop."""
    return column.astype(f">u{digits // 2}").tobytes().hex()


def decode_hex_column(text: object, count: int, digits: int) -> np.ndarray | None:
    """Inverse of ``encode_hex_column`` as int64, or ``None`` unless ``text`` is exactly ``count`` values in
    the canonical spelling (no capitals, no spaces); 16-digit values must be below 2**63."""
    if not isinstance(text, str) or len(text) != digits * count:
        return None
    try:
        data = bytes.fromhex(text)
    except ValueError:
        return None
    if data.hex() != text:
        return None
    column = np.frombuffer(data, dtype=f">u{digits // 2}").astype(np.int64)
    return None if digits == 16 and count and int(column.min()) < 0 else column  # >= 2**63 wraps below 0


def encode_chunk_array(checksums: np.ndarray) -> str:
    """``encode_chunks`` of an array of checksums, without a Python loop over them."""
    return encode_hex_column(checksums, 8)


def decode_chunk_array(text: object, count: int) -> np.ndarray:
    """Inverse of ``encode_chunk_array`` (a ``uint32`` array of ``count``); ``ValueError`` if malformed."""
    column = decode_hex_column(text, count, 8)
    if column is None:
        decode_chunks(text, count)  # raises, with the message
    assert column is not None
    return column.astype(np.uint32)
