"""Chunked checksums (``checkpoint._chunks``): incremental chunking, combination, read planning, verification."""

from __future__ import annotations

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint._chunks import (
    ChunkedChecksum,
    ChunkMismatch,
    chunk_checksums,
    chunk_count,
    combine_chunks,
    crc32c_combine,
    decode_chunks,
    encode_chunks,
    plan_read,
    verify_chunks,
)
from tests._examples import examples


def _bytes(n: int) -> bytes:
    return bytes((i * 131 + 7) % 251 for i in range(n))


@settings(max_examples=examples(150), deadline=None)
@given(st.binary(max_size=600), st.binary(max_size=600))
def test_combine_equals_crc_of_concatenation(a: bytes, b: bytes) -> None:
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


@settings(max_examples=examples(150), deadline=None)
@given(st.integers(0, 3000), st.integers(1, 257), st.lists(st.integers(1, 400), min_size=1, max_size=20))
def test_incremental_matches_direct(n: int, chunk: int, pieces: list[int]) -> None:
    data = _bytes(n)
    c = ChunkedChecksum(chunk)
    position, i = 0, 0
    while position < n:  # feed in arbitrary piece sizes that ignore chunk boundaries
        step = pieces[i % len(pieces)]
        c.update(memoryview(data)[position:position + step])
        position += step
        i += 1
    assert c.nbytes == n
    assert c.values() == chunk_checksums(data, chunk)
    assert len(c.values()) == chunk_count(n, chunk)
    assert c.whole() == crc32c.crc32c(data)
    assert combine_chunks(c.values(), n, chunk) == crc32c.crc32c(data)


def test_large_chunk_lengths_combine() -> None:
    data = _bytes(5 << 20)
    for chunk in (1 << 20, (1 << 20) + 3, 3 << 20):
        assert combine_chunks(chunk_checksums(data, chunk), len(data), chunk) == crc32c.crc32c(data)


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_plan_read_is_minimal_and_aligned(data: st.DataObject) -> None:
    chunk = data.draw(st.integers(1, 64))
    size = data.draw(st.integers(0, 1000))
    start = data.draw(st.integers(0, size))
    end = data.draw(st.integers(start, size))
    plan = plan_read(start, end, size, chunk)
    assert plan.read_start <= start <= end <= plan.read_end <= size
    if start == end:
        assert plan.read_start == plan.read_end and plan.first_chunk == plan.last_chunk
        return
    assert plan.read_start % chunk == 0
    assert plan.read_end % chunk == 0 or plan.read_end == size
    assert start - plan.read_start < chunk and plan.read_end - end < chunk  # at most one chunk extra per end
    assert plan.first_chunk == plan.read_start // chunk
    assert plan.last_chunk == chunk_count(plan.read_end, chunk)
    # every chunk that holds a wanted byte is verified, and no other
    touched = {i // chunk for i in range(start, end)}
    assert set(range(plan.first_chunk, plan.last_chunk)) == touched
    assert plan.extra_bytes == (start - plan.read_start) + (plan.read_end - end)


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_verify_chunks_catches_any_flip_in_read_and_ignores_others(data: st.DataObject) -> None:
    chunk = data.draw(st.integers(1, 50))
    size = data.draw(st.integers(1, 600))
    region = bytearray(_bytes(size))
    sums = chunk_checksums(region, chunk)
    start = data.draw(st.integers(0, size - 1))
    end = data.draw(st.integers(start + 1, size))
    plan = plan_read(start, end, size, chunk)
    verify_chunks(region[plan.read_start:plan.read_end], plan, sums, chunk)
    flip = data.draw(st.integers(0, size - 1))
    region[flip] ^= 1 << data.draw(st.integers(0, 7))
    piece = region[plan.read_start:plan.read_end]
    if plan.read_start <= flip < plan.read_end:
        with pytest.raises(ChunkMismatch) as info:
            verify_chunks(piece, plan, sums, chunk)
        assert info.value.index == flip // chunk
        assert info.value.start <= flip < info.value.end
        assert "checksum mismatch" in str(info.value)
    else:
        verify_chunks(piece, plan, sums, chunk)  # a flip outside the read is not this read's business


def test_plan_and_verify_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="region of 10 bytes"):
        plan_read(5, 11, 10, 4)
    with pytest.raises(ValueError, match="positive chunk"):
        plan_read(0, 1, 10, 0)
    with pytest.raises(ValueError, match="must be positive"):
        ChunkedChecksum(0)
    plan = plan_read(0, 8, 10, 4)
    with pytest.raises(ValueError, match="got 3 bytes"):
        verify_chunks(b"abc", plan, [0, 0], 4)
    with pytest.raises(ValueError, match="only 1 chunk"):
        verify_chunks(b"\0" * 8, plan, [0], 4)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=30))
def test_encode_decode_round_trip(values: list[int]) -> None:
    text = encode_chunks(values)
    assert len(text) == 8 * len(values)
    assert decode_chunks(text, len(values)) == values


@pytest.mark.parametrize("text,count", [("abc", 1), ("0000000g", 1), ("0000000A", 1), (5, 1), ("00000000", 2),
                                        (None, 0), (["00000000"], 1), ("+0000000", 1)])
def test_decode_rejects_malformed(text: object, count: int) -> None:
    with pytest.raises(ValueError, match="lowercase hex"):
        decode_chunks(text, count)
