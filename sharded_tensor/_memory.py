"""Allocation of large new tensors that are about to be filled, and release of their pages."""

from __future__ import annotations

import math
import mmap
import sys
import weakref
from collections.abc import Sequence

import torch

__all__ = ["empty_for_fill", "sole_owner", "release_outside"]

# Below this size a tensor is allocated the usual way; above it, on transparent huge pages.
_HUGE_PAGE_MIN = 8 << 20

# The anonymous mappings empty_for_fill made and that are still alive, by address. Only
# these may have pages released: their memory is ours alone, while a tensor from elsewhere
# may view a numpy array, a user's buffer or a file mapping.
_MAPPINGS: dict[int, weakref.ref[mmap.mmap]] = {}


def empty_for_fill(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialized tensor; large CPU ones on memory advised to use transparent huge pages.

    Filling fresh memory is dominated by page faults (one per 4 KiB page, each zeroing it;
    about 0.5-1 s/GiB here). With 2 MiB pages the kernel takes 512 times fewer faults, which
    made first writes about 2.5x faster. The memory is an anonymous private mapping released
    with the tensor's storage. Elsewhere (other devices, small tensors, no huge page advice)
    this is ``torch.empty``.
    """
    shape = tuple(shape)
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if device.type != "cpu" or nbytes < _HUGE_PAGE_MIN or advice is None:
        return torch.empty(shape, dtype=dtype, device=device)
    try:
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer.madvise(advice)
    except (OSError, ValueError):
        return torch.empty(shape, dtype=dtype, device=device)
    # frombuffer keeps ``buffer`` alive as long as the storage. The result is set on that
    # storage rather than viewed from the bytes, so it is not a view of another tensor and
    # sole_owner can tell when nothing else uses the memory.
    storage = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()
    address = storage.data_ptr()
    _MAPPINGS[address] = weakref.ref(buffer)
    weakref.finalize(buffer, _MAPPINGS.pop, address, None)
    return torch.empty((0,), dtype=dtype).set_(storage, 0, shape)


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
    only pages no tensor will read may be released (see :func:`sole_owner`).
    """
    buffer = _MAPPINGS[storage.data_ptr()]()
    assert buffer is not None
    page = mmap.PAGESIZE
    start = 0
    for lo, hi in sorted(keep):
        _release(buffer, start, lo // page * page)
        start = max(start, -(-hi // page) * page)
    _release(buffer, start, len(buffer))


def _release(buffer: mmap.mmap, start: int, end: int) -> None:
    if end > start:
        buffer.madvise(mmap.MADV_DONTNEED, start, end - start)


def _mapping_of(tensor: torch.Tensor) -> mmap.mmap | None:
    storage = tensor.untyped_storage()
    ref = _MAPPINGS.get(storage.data_ptr())
    buffer = ref() if ref is not None else None
    return buffer if buffer is not None and len(buffer) == storage.nbytes() else None
