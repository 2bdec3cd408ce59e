"""Large CPU tensors that are about to be filled: where their memory comes from, and where it goes.

For a large new tensor, the memory behind it can cost more than filling it: pages faulted in
one by one as the fill first writes them (what ``torch.empty`` gets) were slower, and less
steady, than a range committed by the ``mmap`` call (``MAP_POPULATE``), and both were slower
than a buffer the process already holds (figures in docs/benchmarks-history.md, "memory", measured
with ``scripts/bench/memory.py``).

So a large tensor gets a populated anonymous mapping of its own, and once every tensor on it
is gone the mapping is kept for the next request of exactly that size (a reshard done in a
loop, the staging buffers of the next call), up to a per-process cap:
``SHARDKIT_CPU_CACHE_MB`` in the environment, 1024 by default, 0 to give memory back at once.

``SHARDKIT_PLAIN_MEMORY=1`` in the environment turns all of this off: every tensor comes from
``torch.empty``, nothing is kept for reuse or released early, and the reference counts below
are never consulted (``unshared`` and ``sole_owner`` answer False, so callers copy instead of
reusing memory in place). Results are the same, only slower and larger. Both variables are
read at each call, not at import: setting one in a running process affects the tensors
allocated from then on (tensors already on a mapping keep it until they are freed).

Only :func:`unshared` relies on torch internals; see the section above it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from . import env

__all__ = ["empty_for_fill", "plain", "unshared", "sole_owner", "release_outside", "wait_for_releases",
           "cached_bytes", "empty_cache", "cyclic_gc_paused"]

# Below this size a tensor is allocated the usual way; from it on, by this module.
_MIN_BYTES = 8 << 20

_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def plain() -> bool:
    """True if ``SHARDKIT_PLAIN_MEMORY`` asks for ordinary ``torch.empty`` memory (read at each call)."""
    return env.flag("SHARDKIT_PLAIN_MEMORY", default=False,
                    on="to allocate every tensor with torch.empty (no mappings, reuse or early release)",
                    off="for the default")


def _cache_limit() -> int:
    text = os.environ.get("SHARDKIT_CPU_CACHE_MB", "1024")
    try:
        megabytes = int(text)
    except ValueError:
        megabytes = -1
    if megabytes < 0:
        msg = (f"SHARDKIT_CPU_CACHE_MB={text!r} is not a whole number of MiB; set it to 0 (keep no freed "
               f"buffers) or to the most memory freed buffers may hold per process, e.g. 1024.")
        raise ValueError(msg)
    return megabytes << 20


_lock = threading.Lock()
# Mappings that back a live storage, by address. Only these may have pages released: their
# memory is ours alone, while a tensor from elsewhere may view a numpy array, a user's buffer
# or a file mapping.
_live: dict[int, mmap.mmap] = {}
# Mappings no tensor uses any more, oldest first.
_free: list[mmap.mmap] = []
# Page releases still running in the background, by ``id`` of the mapping.
_releasing: dict[int, list[Future[None]]] = {}


def empty_for_fill(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu", *,
                   populate: bool = True) -> torch.Tensor:
    """An uninitialized tensor; a large CPU one on memory that is committed or reused (see above).

    Like ``torch.empty``, the contents are undefined (a reused mapping holds old data), so the
    caller must write every element. Elsewhere (other devices, tensors under 8 MiB, platforms
    without anonymous mappings, ``SHARDKIT_PLAIN_MEMORY=1``) this is ``torch.empty``. ``populate=False`` leaves a new
    mapping's pages to be faulted in by the first write: cheaper when that write is the
    kernel's (a file read straight into the tensor), where committing first would touch
    every page twice.
    """
    shape = tuple(shape)
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if plain() or device.type != "cpu" or nbytes < _MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    _cache_limit()  # a bad setting is reported here, to the caller, not when memory is freed
    buffer = _reuse(nbytes)
    if buffer is None:
        try:
            buffer = mmap.mmap(-1, nbytes, flags=_FLAGS if populate else _FLAGS & ~getattr(mmap, "MAP_POPULATE", 0))
        except (OSError, ValueError):
            return torch.empty(shape, dtype=dtype, device=device)
    # The storage holds this memoryview for as long as any tensor uses the memory; its end
    # hands the mapping back. The result is set on the storage rather than viewed from the
    # bytes, so it is not a view of another tensor and sole_owner can tell when nothing else
    # uses the memory.
    exported = memoryview(buffer)
    storage = torch.frombuffer(exported, dtype=torch.uint8).untyped_storage()
    address = storage.data_ptr()
    with _lock:
        _live[address] = buffer
    # Not at interpreter exit: the tensor may still be alive then, and the OS takes the memory back anyway.
    weakref.finalize(exported, _release_mapping, address).atexit = False
    # The stubs lack set_(source, offset, size) (contiguous strides), which torch has.
    return torch.empty((0,), dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload,no-any-return]


def _reuse(nbytes: int) -> mmap.mmap | None:
    with _lock:
        for i in range(len(_free) - 1, -1, -1):
            if len(_free[i]) == nbytes:
                buffer = _free.pop(i)
                break
        else:
            return None
    _settle(buffer)
    return buffer


def _release_mapping(address: int) -> None:
    """The last tensor on the mapping at ``address`` is gone: keep it for reuse, or unmap it."""
    try:
        limit = _cache_limit()
    except ValueError:  # raised to the caller of empty_for_fill; here, keep nothing
        limit = 0
    with _lock:
        buffer = _live.pop(address)
        _free.append(buffer)
        held = sum(len(b) for b in _free)
        dropped = []
        while _free and held > limit:
            oldest = _free.pop(0)
            held -= len(oldest)
            dropped.append(oldest)
    _unmap(dropped)


def _settle(buffer: mmap.mmap) -> None:
    """Wait for the background page releases of ``buffer``: its memory is about to be reused or unmapped."""
    with _lock:
        pending = _releasing.pop(id(buffer), [])
    for future in pending:
        future.result()


def empty_cache() -> None:
    """Unmap every freed mapping kept for reuse (the next large tensors get fresh memory)."""
    with _lock:
        dropped = _free[:]
        _free.clear()
    _unmap(dropped)


def _unmap(buffers: list[mmap.mmap]) -> None:
    for buffer in buffers:
        _settle(buffer)
        buffer.close()


def cached_bytes() -> int:
    """Bytes of freed mappings kept for reuse in this process."""
    with _lock:
        return sum(len(b) for b in _free)


# -- is a tensor referred to by one dict entry and nothing else? (torch internals) ----------------
#
# Why: two optimizations reuse memory in place and are only safe when nothing else can see it.
# reshard keeps a block of an old shard as a new shard and gives the old shard's other pages
# back to the OS (sole_owner, release_outside), and a partial value is all-reduced in its own
# buffer (sharded_tensor._partial). A view, a parameter, an autograd graph or a user's variable
# holding the tensor or its memory would see that memory change. No public torch API answers
# the question, so three counts are compared with what they read for a fresh tensor held by one
# dict entry:
#
#   sys.getrefcount(tensor)        Python references to the tensor object (CPython, public);
#   tensor._use_count()            C++ references to its TensorImpl, e.g. an autograd graph
#                                  that saved it (private torch API);
#   torch._C._storage_Use_Count()  tensors using its storage, i.e. views and aliases (private).
#
# The baseline is measured at import through the same function, rather than assumed, since
# it includes the probes' own temporaries. At the same time a self-check makes sure a view, an
# extra reference and an autograd graph holding the tensor still move the counts. If torch
# renames or removes either private call, or stops counting what is checked, the self-check
# fails and ``unshared`` answers False for
# every tensor: reshard then copies and keeps every page, a partial value is reduced in a new
# buffer. That is slower and uses more memory, never a wrong result. SHARDKIT_PLAIN_MEMORY=1
# has the same effect on purpose.


def _counts(holder: dict[int, torch.Tensor], key: int) -> tuple[int, int, int]:
    references = sys.getrefcount(holder[key])  # before a local name adds one
    tensor = holder[key]
    storage_users = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
    return references, int(tensor._use_count()), int(storage_users)  # type: ignore[attr-defined]  # not in stubs


def _measure_alone() -> tuple[int, int, int] | None:
    """The counts of a tensor nothing else refers to, or ``None`` if the counts cannot tell."""
    try:
        probe = {0: torch.empty(1)}
        alone = _counts(probe, 0)
        view = probe[0][:]
        with_view = _counts(probe, 0)
        del view
        extra = probe[0]
        with_extra = _counts(probe, 0)
        del extra
        again = _counts(probe, 0)
        leaf = {0: torch.ones(1, requires_grad=True)}
        saved = leaf[0] * leaf[0]  # autograd keeps the input for the backward
        in_graph = _counts(leaf, 0)
        del saved
        leaf_alone = _counts(leaf, 0)
    except (AttributeError, TypeError, RuntimeError):
        return None
    tells = alone == again == leaf_alone and alone not in (with_view, with_extra, in_graph)
    return alone if tells else None


_ALONE = _measure_alone()


def unshared(holder: dict[int, torch.Tensor], key: int) -> bool:
    """True if ``holder[key]`` and its memory are referred to by ``holder`` and nothing else.

    Then no other tensor, view, parameter, autograd graph or user variable can see its memory,
    and the caller may overwrite it or give pages of it back. False whenever that cannot be
    told (see above) or ``SHARDKIT_PLAIN_MEMORY=1``. The caller must not hold
    ``holder[key]`` in a variable of its own while asking.
    """
    try:
        if _ALONE is None or plain():
            return False
    except ValueError:  # a bad SHARDKIT_PLAIN_MEMORY is reported by empty_for_fill; here, play safe
        return False
    return _counts(holder, key) == _ALONE


def storage_alone(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is the only tensor using its storage: no view, alias or detached copy.

    Then pointing ``tensor`` at other memory (``Tensor.set_``) leaves nothing behind that
    still sees the old memory; Python references to ``tensor`` itself see the change. False
    whenever that cannot be told (see above) or ``SHARDKIT_PLAIN_MEMORY=1``.
    """
    try:
        if _ALONE is None or plain():
            return False
        return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)) == _ALONE[2]
    except (AttributeError, TypeError, RuntimeError, ValueError):
        return False


def sole_owner(holder: dict[int, torch.Tensor], key: int) -> bool:
    """True if ``holder[key]`` is :func:`unshared` and alone uses a mapping of ours.

    Then pages of it may be given back with :func:`release_outside`.
    """
    if not unshared(holder, key):  # first: before this frame holds a reference of its own
        return False
    tensor = holder[key]
    return tensor.device.type == "cpu" and _mapping_of(tensor) is not None


def release_outside(storage: torch.UntypedStorage, keep: Sequence[tuple[int, int]]) -> None:
    """Give the OS back the pages of ``storage`` outside the byte ranges ``keep`` (start, end).

    The storage keeps its address range; released pages read as zeros if touched again, so
    only pages no tensor will read may be released (see :func:`sole_owner`). The release
    runs on a background thread where it can (it costs about as much as a copy of the same
    bytes; docs/benchmarks-history.md, "Figures behind implementation choices"), and the mapping is
    not reused or unmapped before it has finished.
    """
    address = storage.data_ptr()
    with _lock:
        buffer = _live[address]
    page = mmap.PAGESIZE
    ranges = []
    start = 0
    for lo, hi in sorted(keep):
        ranges.append((start, lo // page * page))
        start = max(start, -(-hi // page) * page)
    ranges.append((start, len(buffer)))
    ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
    if _madvise is None:
        for lo, hi in ranges:
            buffer.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        return
    future = _background().submit(_release_ranges, address, ranges)
    with _lock:
        _releasing.setdefault(id(buffer), []).append(future)


def wait_for_releases() -> None:
    """Return once every page release started by :func:`release_outside` has finished."""
    with _lock:
        pending = [future for futures in _releasing.values() for future in futures]
    for future in pending:
        future.result()


def _release_ranges(address: int, ranges: list[tuple[int, int]]) -> None:
    assert _madvise is not None
    for lo, hi in ranges:
        # Advice only: if the kernel refuses, the pages simply stay resident.
        _madvise(address + lo, hi - lo, mmap.MADV_DONTNEED)


def _load_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    # Through ctypes the call runs without the GIL, so the release overlaps the caller's work.
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_madvise = _load_madvise()
_executor: list[ThreadPoolExecutor] = []


def _background() -> ThreadPoolExecutor:
    with _lock:
        if not _executor:
            _executor.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-release"))
        return _executor[0]


def _after_fork_in_child() -> None:
    # The parent's release thread and whatever held the lock did not come along; releases the
    # parent had pending only leave some pages resident in this copy.
    global _lock
    _lock = threading.Lock()
    _executor.clear()
    _releasing.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _mapping_of(tensor: torch.Tensor) -> mmap.mmap | None:
    storage = tensor.untyped_storage()
    with _lock:
        buffer = _live.get(storage.data_ptr())
    return buffer if buffer is not None and len(buffer) == storage.nbytes() else None


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many small objects that hold no cycles.

    Layouts and checkpoint metadata of thousands of ranks are hundreds of thousands of
    tuples, dicts and dataclasses. Left on, the collector would run full passes over the
    whole heap meanwhile, costing more than the work itself (3x a reshard plan at 4096 ranks;
    more than half of parsing a million-region ``shardkit.json``). Reference counting still
    frees everything as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
