"""Reading saved bytes: the one place that opens data files, reads byte ranges and checks them.

``load``, ``consolidate``, the command line (``verify``) and the Hugging Face source all read
data files through ``DataReader``: on a local file system with ``os.preadv`` (straight into
the caller's memory) or a read-only memory map; elsewhere with fsspec range reads
(``cat_file``, and ``cat_ranges`` to fetch many ranges of a file concurrently).

Three things can be wrong with saved bytes, and each has one message, built here: the file
is **missing**, it is **truncated** (shorter than a range needs), or a **checksum mismatch**
(the bytes differ from what the metadata records).

Checksums are checked per *checksummed span*: a byte range inside a saved region that carries
its own checksum (``checksum_spans``): each chunk of the region from format version 2 on,
the whole region in version 1. ``RegionCheck`` verifies every span that a read covers whole,
whether the bytes arrive in one piece or streamed in order; ``covering`` widens a wanted
byte range to whole spans, so that a partial read can be verified (version 2 and later: at
most one chunk of extra bytes at each end; version 1: only a whole region can be).

Files are opened through ``_safe_open``: a data file that is a symlink, FIFO, directory or
device is refused without blocking, and ``check_size`` compares a file's real size with the
size the metadata records before anything is allocated for it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import typing
from collections.abc import Iterator, Sequence

import fsspec
import torch

from ._chunks import plan_read
from ._codec import Checksum, check_header_entry, header_length, parse_header
from ._safe_open import check_regular, open_regular
from ._schema import CHECKSUM_ALGORITHM, CheckpointError, SavedShard
from ._storage import is_local

__all__ = ["DataReader", "RegionCheck", "checksum_spans", "covering", "missing_error", "truncated_error"]

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
    if shard.chunks:
        start, end = shard.byte_range
        step = shard.chunk_bytes
        return [(a, min(a + step, end), f"{CHECKSUM_ALGORITHM}:{value:08x}")
                for a, value in zip(range(start, end, step), shard.chunks)]
    if not shard.checksum:
        return []
    return [(shard.byte_range[0], shard.byte_range[1], shard.checksum)]


def covering(shard: SavedShard, start: int, end: int) -> tuple[int, int]:
    """The smallest range of whole checksummed spans around bytes ``[start, end)`` of ``shard``'s region.

    Version 2: chunk-aligned (``_chunks.plan_read``). Version 1 (one span): the whole region if
    the wanted range is the whole region, else the wanted range itself, which cannot be verified.
    """
    first, last = shard.byte_range
    if shard.chunks:
        plan = plan_read(start - first, end - first, last - first, shard.chunk_bytes)
        return first + plan.read_start, first + plan.read_end
    return start, end


class RegionCheck:
    """Verifies the checksums of a saved region's bytes as they are read, in file order, from ``start``.

    Every span that begins at or after ``start`` is checked once its last byte has been fed to
    ``update``; a mismatch raises ``CheckpointError`` naming the file, the tensor, the region
    and the span. Spans that begin before ``start`` or end after the last byte fed are not
    checked (a partial read cannot check them). With ``verified`` (a set shared by the reads of
    one operation), spans already verified are skipped and the ones verified here are added:
    two target blocks reading one chunk check it once.
    """

    __slots__ = ("_digest", "_path", "_position", "_shard", "_spans", "_tensor", "_verified")

    def __init__(self, shard: SavedShard, path: str, tensor: str, start: int | None = None,
                 verified: set[tuple[str, int]] | None = None) -> None:
        self._shard, self._path, self._tensor, self._verified = shard, path, tensor, verified
        self._position = shard.byte_range[0] if start is None else start
        self._spans = [span for span in checksum_spans(shard) if span[0] >= self._position
                       and (verified is None or (path, span[0]) not in verified)]
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
                what = "" if not shard.chunks else f"chunk {(first - shard.byte_range[0]) // shard.chunk_bytes}, "
                msg = (f"checksum mismatch in {self._path!r} for tensor {self._tensor!r} (region "
                       f"offsets={list(shard.offsets)}, dims={list(shard.dims)}, {what}bytes [{first}, {last})): the "
                       f"metadata records {expected} but the data has {actual}; the file is corrupt (restore it "
                       f"or save the checkpoint again).")
                raise CheckpointError(msg)
            if self._verified is not None:
                self._verified.add((self._path, first))


class DataReader:
    """Byte ranges of the data files on one file system; close it (or use ``with``) when done.

    Every method takes the file's full ``path`` and, for messages, the ``tensors`` it belongs
    to. Local files are opened once and kept open until ``close``.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, *, cache_links: bool = False) -> None:
        self._fs = fs
        self._cache_links = cache_links  # follow a Hugging Face cache snapshot's links (``_safe_open``)
        self.local = is_local(fs)
        self._files: dict[str, tuple[int, int]] = {}  # local path -> (fd, size)
        self._sizes: dict[str, int] = {}  # other file systems: path -> size
        self.verified: set[tuple[str, int]] = set()  # (path, span start) checked by this reader's user
        self._storages: dict[str, torch.UntypedStorage] = {}

    def __enter__(self) -> DataReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        self._storages.clear()  # tensors mapped onto them keep them alive

    def _open(self, path: str, tensors: Tensors) -> tuple[int, int]:
        entry = self._files.get(path)
        if entry is None:
            try:
                entry = self._files[path] = open_regular(path, cache_links=self._cache_links)
            except FileNotFoundError as exc:
                raise missing_error(path, tensors, exc) from exc
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
        size = self._sizes.get(path)
        if size is None:
            try:
                size = self._sizes[path] = check_regular(self._fs, path, cache_links=self._cache_links)
            except FileNotFoundError as exc:
                raise missing_error(path, tensors, exc) from exc
        return size

    def check_size(self, path: str, expected: int, *, tensors: Tensors = None) -> None:
        """Raise ``CheckpointError`` unless the file has exactly the ``expected`` size the metadata records.

        Called before anything is allocated or read for the file: a metadata file claiming
        sizes its data files do not have is refused here, not by the allocator.
        """
        actual = self.size(path, tensors=tensors)
        if actual != expected:
            what = "is truncated" if actual < expected else "is longer than recorded"
            msg = (f"data file {path!r}{_of(tensors)} {what}: it has {actual} bytes, but the checkpoint metadata "
                   f"records {expected} bytes; the file was cut short or replaced, or the metadata is corrupt.")
            raise CheckpointError(msg)

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
        size = self.size(path, tensors=tensors)  # before allocating: a range past the end is refused first
        if size < end:
            raise truncated_error(path, tensors, start, end, size - start)
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
    def mapped(self, path: str, start: int, end: int, *, tensors: Tensors = None,
               populate: bool = False) -> Iterator[memoryview]:
        """Local only: a read-only view of bytes ``[start, end)`` through a memory map, while in the block.

        Only those pages are mapped, and the kernel reads only the ones the caller touches.
        ``populate=True`` (for a caller that reads every byte, e.g. to verify checksums) maps
        all pages at once instead of one page fault at a time. Every tensor made over the
        view must be dropped before the block ends.
        """
        fd = self._descriptor(path, start, end, tensors)
        first = start - start % mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        mapping = mmap.mmap(fd, end - first, flags=flags, prot=mmap.PROT_READ, offset=first)
        try:
            view = memoryview(mapping)[start - first:]
            try:
                yield view
            finally:
                view.release()
        finally:
            mapping.close()

    def file_storage(self, path: str, *, tensors: Tensors = None) -> torch.UntypedStorage:
        """Local only: the whole file as a private, copy-on-write memory mapping (one per file).

        Nothing is read until a page is touched; writes to the storage never reach the file.
        Opened through the descriptor already checked by this reader, so the mapping is of
        that very file.
        """
        if path not in self._storages:
            fd, size = self._open(path, tensors)
            through = f"/proc/self/fd/{fd}"
            name = through if os.path.exists(through) else path
            mapped = torch.UntypedStorage.from_file(name, shared=False, nbytes=size)
            self._storages[path] = typing.cast(torch.UntypedStorage, mapped)  # the stubs say _StorageBase
        return self._storages[path]

    def read_header(self, path: str, *, tensors: Tensors = None) -> tuple[dict[str, object], int, int]:
        """``(header, data start, file size)`` of a safetensors file, from two small range reads."""
        size = self.size(path, tensors=tensors)
        if size < 8:
            raise truncated_error(path, tensors, 0, 8, size)
        length = header_length(self.read(path, 0, 8, tensors=tensors), size, file=path)
        return parse_header(self.read(path, 8, 8 + length, tensors=tensors), file=path), 8 + length, size

    def check_data_file(self, path: str, expected: int, regions: Sequence[tuple[str, SavedShard, torch.dtype]],
                        *, tensors: Tensors = None) -> None:
        """Check a shardkit data file before reading from it: its size is the ``expected`` one, and its
        safetensors header describes each of ``regions`` (``(tensor, shard, dtype)``) as the metadata does.

        So a relabelled dtype or shape, or sizes the file does not have, are refused before any
        allocation or copy (``CheckpointError`` naming the file and the tensor: ``tensors``, else
        every tensor of ``regions``).
        """
        if tensors is None:
            names = sorted({name for name, _, _ in regions})
            tensors = names[0] if len(names) == 1 else names
        self.check_size(path, expected, tensors=tensors)
        header, data_start, _ = self.read_header(path, tensors=tensors)
        for name, shard, dtype in regions:
            check_header_entry(header, data_start, shard, dtype, file=path, tensor=name)

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
