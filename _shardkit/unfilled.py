"""Parameter blocks allocated without values (``shard_model(..., init=False)``) until a load fills them.

``shard_model`` marks each block it leaves uninitialized; ``checkpoint.load`` refuses to finish
while a marked block of its state_dict gets no data (unless asked to), and unmarks what it
fills. Blocks are found by the address of their first element, since ``state_dict()`` hands out new tensor objects
(detached aliases, ``ShardedTensor`` wrappers) over the parameters' storage.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["mark", "unmark", "unmark_key", "is_marked", "key"]

# storage address -> the marked tensor (weakly: a freed parameter drops its mark).
_MARKED: dict[int, weakref.ref[torch.Tensor]] = {}


def key(tensor: torch.Tensor) -> int | None:
    """The memory ``tensor`` is known by here (``None``: empty, nothing to fill)."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None  # nothing to fill
    # The first element's address, not the storage's: blocks may be views into one shared allocation.
    return tensor.data_ptr()


def mark(tensor: torch.Tensor) -> None:
    """Record that ``tensor``'s memory holds no values yet."""
    where = key(tensor)
    if where is None:
        return

    def forget(ref: weakref.ref[torch.Tensor], where: int = where) -> None:
        if _MARKED.get(where) is ref:
            del _MARKED[where]

    _MARKED[where] = weakref.ref(tensor, forget)


def is_marked(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a view of the same memory) was marked and not unmarked since."""
    where = key(tensor)
    if where is None:
        return False
    ref = _MARKED.get(where)
    held = ref() if ref is not None else None
    return held is not None and key(held) == where


def unmark(tensor: torch.Tensor) -> None:
    """``tensor``'s memory now holds values."""
    where = key(tensor)
    if where is not None:
        unmark_key(where)


def unmark_key(where: int) -> None:
    """The memory known as ``where`` (from ``key``) now holds values."""
    _MARKED.pop(where, None)
