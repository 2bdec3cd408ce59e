"""DTensor entries at the checkpoint boundary: seen as ShardedTensor views, never copied.

``save``, ``load`` and ``collect_state_dict`` work on ``ShardedTensor``s. A state_dict from
FSDP2 (``fully_shard``), ``parallelize_module`` or ``get_state_dict`` holds ``DTensor``s
instead. Rather than teaching every phase a second type, one helper gives them a mirror of
the state_dict in which each DTensor is replaced by ``st.from_dtensor(dt)``: the same local
storage under shardkit's layout description. Saving reads that storage, loading writes into
it (so the DTensors, and the parameters behind them, are filled in place), collecting
gathers from it.

The mirror copies only the dict structure. ``load`` also replaces non-tensor values (and
``None`` placeholders) in the mapping it is given, so ``restore`` writes those back into the
caller's own mapping afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from _shardkit import comm as _comm
from _shardkit.dtensor import is_dtensor
from sharded_tensor import from_dtensor

__all__ = ["dtensor_views"]


def _has_dtensor(value: Any) -> bool:
    """Whether ``value`` holds a DTensor anywhere. Each container is looked into once, without recursion: a
    container held several times, or holding itself, or nested deeply, costs its size once (save and
    load report cycles and values too large with their names when they walk the state_dict)."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if is_dtensor(item):
            return True
        if isinstance(item, (Mapping, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            stack.extend(item.values() if isinstance(item, Mapping) else item)
    return False


def dtensor_views(state_dict: Any, process_group: _comm.ProcessGroup = None
                  ) -> tuple[Any, Callable[[], None]]:
    """``(mirror, restore)``: ``state_dict`` with every DTensor as a ShardedTensor view.

    Without DTensors the mirror is ``state_dict`` itself and ``restore`` does nothing, so
    ShardedTensor-only state_dicts take exactly the path they always did. ``restore()``
    copies every leaf the caller replaced in the mirror (non-tensor values, new tensors for
    ``None``) back into ``state_dict``; DTensor leaves need nothing, their storage was
    written directly.

    Example:
        >>> mirror, restore = dtensor_views(fsdp_model.state_dict())  # doctest: +SKIP
        >>> _load(mirror, path, ...); restore()  # doctest: +SKIP
    """
    if not _has_dtensor(state_dict):
        return state_dict, lambda: None
    pairs: list[tuple[Any, dict[Any, Any], Any, Any]] = []  # (original, mirror, key, mirrored value)

    def mirror(value: Any) -> Any:
        if is_dtensor(value):
            return from_dtensor(value, process_group=process_group)
        if isinstance(value, Mapping):
            copy = {key: mirror(item) for key, item in value.items()}
            pairs.extend((value, copy, key, copy[key]) for key in value)
            return copy
        if isinstance(value, list):
            return [mirror(item) for item in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(mirror(item) for item in value)
        return value

    top = mirror(state_dict)

    def restore() -> None:
        for original, copy, key, mirrored in pairs:
            if key in copy and copy[key] is not mirrored:
                original[key] = copy[key]

    return top, restore
