"""Reading saved bytes: the one place that opens data files, reads byte ranges and checks them.

``load``, ``consolidate``, the command line (``verify``) and the Hugging Face source all read
data files through ``DataReader``: on a local file system with ``os.preadv`` (straight into
the caller's memory) or a read-only memory map; elsewhere with fsspec range reads
(``cat_file``, and ``cat_ranges`` to fetch many ranges of a file concurrently).

Three things can be wrong with saved bytes, and each has one message, built here: the file
is **missing**, it is **truncated** (shorter than a range needs), or a **checksum mismatch**
(the bytes differ from what the metadata records).

Checksums are checked per *checksummed span*: a byte range inside a saved region that carries
its own checksum (``checksum_spans``). Today each region has one span, the whole region.
``RegionCheck`` verifies every span that a read covers whole, whether the bytes arrive in one
piece or streamed in order; a read that covers only part of a span leaves it unchecked. So
finer spans (per chunk) need a change in ``checksum_spans`` only, and every reader gains them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Sequence

import fsspec

from ._codec import Checksum, header_length, parse_header
from ._schema import CheckpointError, SavedShard
from ._storage import is_local

__all__ = ["DataReader", "RegionCheck", "checksum_spans", "missing_error", "truncated_error"]

Tensors = str | Sequence[str] | None
"""Which tensors a file or range belongs to, for messages: one name, several, or unknown (``None``)."""


def _of(tensors: Tensors) -> str:
    if tensors is None:
        return ""
    if isinstance(tensors, str):
        return f" of tensor {tensors!r}"
    names = list(tensors)
    if not names:
        return ""
    more = ", ..." if len(names) > 5 else ""
    return f" (holding tensor{'s' if len(names) != 1 else ''} {', '.join(repr(t) for t in names[:5])}{more})"


def missing_error(path: str, tensors: Tensors = None, cause: BaseException | None = None) -> CheckpointError:
    """The error for a data file that does not exist."""
    detail = f" ({cause})" if cause is not None and str(cause) else ""
    return CheckpointError(f"data file {path!r}{_of(tensors)} is missing; the checkpoint is incomplete or was "
                           f"modified after it was saved{detail}.")


def truncated_error(path: str, tensors: Tensors, start: int, end: int, got: int) -> CheckpointError:
    """The error for a data file that holds only ``got`` of the bytes ``[start, end)`` a read needs."""
    return CheckpointError(f"data file {path!r}{_of(tensors)} is truncated: needed bytes [{start}, {end}) but only "
                           f"{max(got, 0)} of {end - start} could be read.")


def checksum_spans(shard: SavedShard) -> list[tuple[int, int, str]]:
    """``(start, end, checksum)`` of each checksummed byte range of a saved region, in file order.

    One span, the whole region; none for files that carry no checksums (Hugging Face files).
    """
    if not shard.checksum:
        return []
    return [(shard.byte_range[0], shard.byte_range[1], shard.checksum)]


class RegionCheck:
    """Verifies the checksums of a saved region's bytes as they are read, in file order, from ``start``.

    Every span that begins at or after ``start`` is checked once its last byte has been fed to
    ``update``; a mismatch raises ``CheckpointError`` naming the file, the tensor, the region
    and the span. Spans that begin before ``start`` or end after the last byte fed are not
    checked (a partial read cannot check them).
    """

    __slots__ = ("_digest", "_path", "_position", "_shard", "_spans", "_tensor")

    def __init__(self, shard: SavedShard, path: str, tensor: str, start: int | None = None) -> None:
        self._shard, self._path, self._tensor = shard, path, tensor
        self._position = shard.byte_range[0] if start is None else start
        self._spans = [span for span in checksum_spans(shard) if span[0] >= self._position]
        self._digest: Checksum | None = None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Feed the next ``len(data)`` bytes of the file."""
        begin, end = self._position, self._position + len(data)
        self._position = end
        while self._spans and self._spans[0][0] < end:
            first, last, expected = self._spans[0]
            if self._digest is None:
                self._digest = Checksum()
            self._digest.update(data[max(first, begin) - begin:min(last, end) - begin])
            if last > end:
                return
            actual = self._digest.hexdigest()
            self._digest = None
            self._spans.pop(0)
            if actual != expected:
                shard = self._shard
                msg = (f"checksum mismatch in {self._path!r} for tensor {self._tensor!r} (region "
                       f"offsets={list(shard.offsets)}, dims={list(shard.dims)}, bytes [{first}, {last})): the "
                       f"metadata records {expected} but the data has {actual}; the file is corrupt (restore it "
                       f"or save the checkpoint again).")
                raise CheckpointError(msg)


class DataReader:
    """Byte ranges of the data files on one file system; close it (or use ``with``) when done.

    Every method takes the file's full ``path`` and, for messages, the ``tensors`` it belongs
    to. Local files are opened once and kept open until ``close``.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self._fs = fs
        self.local = is_local(fs)
        self._files: dict[str, tuple[int, int]] = {}  # local path -> (fd, size)

    def __enter__(self) -> DataReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def _open(self, path: str, tensors: Tensors) -> tuple[int, int]:
        entry = self._files.get(path)
        if entry is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError as exc:
                raise missing_error(path, tensors, exc) from exc
            entry = self._files[path] = (fd, os.fstat(fd).st_size)
        return entry

    def _descriptor(self, path: str, start: int, end: int, tensors: Tensors) -> int:
        """The local file's descriptor, after checking that it holds bytes ``[start, end)``."""
        fd, size = self._open(path, tensors)
        if size < end:
            raise truncated_error(path, tensors, start, end, size - start)
        return fd

    def size(self, path: str, *, tensors: Tensors = None) -> int:
        """The file's size in bytes."""
        if self.local:
            return self._open(path, tensors)[1]
        try:
            return int(self._fs.size(path))
        except FileNotFoundError as exc:
            raise missing_error(path, tensors, exc) from exc

    def readinto(self, path: str, start: int, buffer: memoryview, *, tensors: Tensors = None) -> None:
        """Fill ``buffer`` with the file's bytes from ``start``."""
        end = start + len(buffer)
        if not self.local:
            buffer[:] = self.read(path, start, end, tensors=tensors)
            return
        fd = self._descriptor(path, start, end, tensors)
        done = 0
        while done < len(buffer):
            n = os.preadv(fd, [buffer[done:]], start + done)
            if n <= 0:
                raise truncated_error(path, tensors, start, end, done)
            done += n

    def read(self, path: str, start: int, end: int, *, tensors: Tensors = None) -> bytes | bytearray:
        """The file's bytes ``[start, end)``."""
        if end <= start:
            return b""
        if self.local:
            buffer = bytearray(end - start)
            self.readinto(path, start, memoryview(buffer), tensors=tensors)
            return buffer
        try:
            data = self._fs.cat_file(path, start=start, end=end)
        except FileNotFoundError as exc:
            raise missing_error(path, tensors, exc) from exc
        if len(data) != end - start:
            raise truncated_error(path, tensors, start, end, len(data))
        return data  # type: ignore[no-any-return]

    def read_many(self, path: str, ranges: list[tuple[int, int]], *, tensors: Tensors = None
                  ) -> list[bytes | bytearray]:
        """Several ranges of one file; concurrent on asynchronous file systems (``cat_ranges``)."""
        if self.local or len(ranges) == 1:
            return [self.read(path, a, b, tensors=tensors) for a, b in ranges]
        try:
            out = self._fs.cat_ranges([path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges],
                                      on_error="raise")
        except FileNotFoundError as exc:
            raise missing_error(path, tensors, exc) from exc
        for (a, b), data in zip(ranges, out):
            if isinstance(data, BaseException):
                raise data
            if len(data) != b - a:
                raise truncated_error(path, tensors, a, b, len(data))
        return out  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def mapped(self, path: str, start: int, end: int, *, tensors: Tensors = None) -> Iterator[memoryview]:
        """Local only: a read-only view of bytes ``[start, end)`` through a memory map, while in the block.

        Only those pages are mapped, and the kernel reads only the ones the caller touches.
        Every tensor made over the view must be dropped before the block ends.
        """
        fd = self._descriptor(path, start, end, tensors)
        first = start - start % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, end - first, access=mmap.ACCESS_READ, offset=first)
        try:
            view = memoryview(mapping)[start - first:]
            try:
                yield view
            finally:
                view.release()
        finally:
            mapping.close()

    def read_header(self, path: str, *, tensors: Tensors = None) -> tuple[dict[str, object], int, int]:
        """``(header, data start, file size)`` of a safetensors file, from two small range reads."""
        size = self.size(path, tensors=tensors)
        if size < 8:
            raise truncated_error(path, tensors, 0, 8, size)
        length = header_length(self.read(path, 0, 8, tensors=tensors), size, file=path)
        return parse_header(self.read(path, 8, 8 + length, tensors=tensors), file=path), 8 + length, size

    def read_region(self, path: str, shard: SavedShard, out: memoryview, *, tensor: str) -> None:
        """A whole saved region into ``out`` (exactly ``shard.nbytes`` long), checksums verified."""
        self.readinto(path, shard.byte_range[0], out, tensors=tensor)
        RegionCheck(shard, path, tensor).update(out)

    def region_pieces(self, path: str, shard: SavedShard, buffer: memoryview, *, tensor: str
                      ) -> Iterator[memoryview]:
        """A saved region's bytes in pieces of at most ``len(buffer)``, each read into ``buffer``.

        A span's checksum is checked before the piece holding its last byte is handed out: a
        consumer that writes pieces as they come must discard its output on ``CheckpointError``.
        """
        start, end = shard.byte_range
        check = RegionCheck(shard, path, tensor)
        while start < end:
            piece = buffer[:min(len(buffer), end - start)]
            self.readinto(path, start, piece, tensors=tensor)
            check.update(piece)
            start += len(piece)
            yield piece
