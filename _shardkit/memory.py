"""Large CPU tensors that are about to be filled: where their memory comes from, and where it goes.

For a large new tensor, the memory behind it can cost more than filling it. Measured with
``scripts/bench/memory.py`` on the machines this project is tested on (a VM with 2 cores;
docs/benchmarks.md, "memory"), allocating and filling one 256 MiB buffer took, median and
worst:

- pages faulted in one by one as the fill first writes them (``torch.empty``): 0.18 s, 0.79 s;
- the same advised to use transparent huge pages: 0.61 s, 0.73 s;
- the whole range committed by the ``mmap`` call (``MAP_POPULATE``): 0.12 s, 0.71 s;
- a buffer the process already holds: 0.013 s.

So a large tensor gets a populated anonymous mapping of its own, and once every tensor on it
is gone the mapping is kept for the next request of exactly that size (a reshard done in a
loop, the staging buffers of the next call), up to a per-process cap:
``SHARDKIT_CPU_CACHE_MB`` in the environment, 1024 by default, 0 to give memory back at once.
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

__all__ = ["empty_for_fill", "sole_owner", "release_outside", "wait_for_releases", "cached_bytes",
           "empty_cache", "cyclic_gc_paused"]

# Below this size a tensor is allocated the usual way; from it on, by this module.
_MIN_BYTES = 8 << 20

_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


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
    without anonymous mappings) this is ``torch.empty``. ``populate=False`` leaves a new
    mapping's pages to be faulted in by the first write: cheaper when that write is the
    kernel's (a file read straight into the tensor), where committing first would touch
    every page twice.
    """
    shape = tuple(shape)
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _MIN_BYTES:
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
    return torch.empty((0,), dtype=dtype).set_(storage, 0, shape)


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


def _storage_users(tensor: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


# What the counts read for a tensor that nothing else refers to (the probes hold one more
# reference each, e.g. the temporary storage object); measured rather than assumed.
_PROBE = {0: torch.empty(1)}
_ALONE = (sys.getrefcount(_PROBE[0]), _PROBE[0]._use_count(), _storage_users(_PROBE[0]))
del _PROBE


def sole_owner(holder: dict[int, torch.Tensor], key: int) -> bool:
    """True if ``holder[key]`` is referred to only by ``holder`` and alone uses a mapping of ours.

    Then no other tensor, view, parameter, autograd graph or user variable can see its
    memory, and pages of it may be given back with :func:`release_outside`.
    """
    references = sys.getrefcount(holder[key])  # before a local name adds one
    tensor = holder[key]
    if tensor.device.type != "cpu" or _mapping_of(tensor) is None:
        return False
    return (references, tensor._use_count(), _storage_users(tensor)) == _ALONE


def release_outside(storage: torch.UntypedStorage, keep: Sequence[tuple[int, int]]) -> None:
    """Give the OS back the pages of ``storage`` outside the byte ranges ``keep`` (start, end).

    The storage keeps its address range; released pages read as zeros if touched again, so
    only pages no tensor will read may be released (see :func:`sole_owner`). The release
    runs on a background thread where it can (about 75 us per MiB here, the cost of a copy),
    and the mapping is not reused or unmapped before it has finished.
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
