"""A load must not leave parameters that ``shard_model(..., init=False)`` allocated without values.

``shard_model`` marks such blocks (``_shardkit.unfilled``). Before reading anything, a load
checks that every marked entry of its state_dict gets data (``strict=False`` included, since
skipping a name would leave garbage that computes silently); after a successful load the
filled entries are unmarked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from _shardkit import unfilled
from sharded_tensor import ShardedTensor

from ._schema import CheckpointError

__all__ = ["check_filled", "mark_filled"]

_SHOWN = 20  # names listed in the error; the count says how many more


def _blocks(value: Any) -> list[torch.Tensor]:
    if isinstance(value, ShardedTensor):
        return [s.tensor for s in value.local_shards()]
    return [value] if isinstance(value, torch.Tensor) else []


def check_filled(leaves: Iterable[tuple[str, Any, Any, Any]], filled: set[str], source: str) -> None:
    """Raise ``CheckpointError`` naming every uninitialized entry that ``filled`` does not cover."""
    empty = [name for name, _, _, value in leaves
             if name not in filled and any(unfilled.is_marked(b) for b in _blocks(value))]
    if not empty:
        return
    shown = sorted(empty)[:_SHOWN]
    more = f" and {len(empty) - len(shown)} more" if len(empty) > len(shown) else ""
    msg = (f"checkpoint {source!r} would leave {len(empty)} parameter(s) uninitialized: {shown}{more}. "
           f"shard_model(..., init=False) allocated them without values and this checkpoint has no data for "
           f"them, so they would hold garbage. Load a checkpoint that has them (key_map= renames names), "
           f"initialize them, or pass allow_uninitialized=True to load what there is and fill them yourself.")
    raise CheckpointError(msg, missing=sorted(empty), unexpected=[])


def mark_filled(leaves: Iterable[tuple[str, Any, Any, Any]], filled: set[str]) -> Callable[[], None]:
    """A function to call once the load succeeded: the entries in ``filled`` hold values then.

    Taken before the load reads anything, since a mapped load (``mmap=True``) points the blocks
    at other memory.
    """
    blocks = [block for name, _, _, value in leaves if name in filled for block in _blocks(value)]
    keys = [key for block in blocks if (key := unfilled.key(block)) is not None]

    def settle() -> None:
        for key in keys:
            unfilled.unmark_key(key)
    return settle
