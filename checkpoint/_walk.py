"""The structure of a state_dict: nested mappings flattened to dotted names, and the values a checkpoint stores.

Every part of the package that walks a state_dict (save, load, async_save, DCP conversion)
does it with ``flatten_state_dict``, so a name means the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ._strict_json import MAX_DEPTH, MAX_ITEMS

__all__ = ["flatten_state_dict", "check_json_value"]

_SCALARS = (str, int, float, bool, type(None))
VALUE_DEPTH = MAX_DEPTH - 2
"""Most levels of lists and dicts in a value: ``shardkit.json`` holds it two objects deep."""


def check_json_value(name: str, value: object) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``value`` is JSON data (and not a tensor).

    JSON data: None, bool, int, float, str, and lists/tuples/dicts (str keys) of those. A list
    or dict that contains itself (directly or deeper) raises ``ValueError``: JSON cannot store it.
    So does a value that nests deeper than ``VALUE_DEPTH``, or whose JSON holds more than
    ``MAX_ITEMS`` values (a container shared by two branches is written, and counted, twice):
    every reader refuses such a file, so it is never written.
    """
    _check_expanded(name, value)
    # Depth first with an explicit stack; ``active`` holds the ids of the containers on the
    # current path, so a container met again inside itself is a cycle (a container shared by
    # two branches is not, and is simply written twice).
    stack: list[tuple[str, object, int]] = [(name, value, 0)]  # (where, value, depth; -1: leaving it)
    active: set[int] = set()
    items = 0
    while stack:
        where, v, depth = stack.pop()
        if depth < 0:
            active.discard(id(v))
            continue
        items += 1
        if items > MAX_ITEMS:
            msg = (f"state_dict entry {name!r} holds more than {MAX_ITEMS} JSON values (counting each time a shared "
                   f"list or dict is written); a checkpoint's readers refuse a file that large. Store it as a "
                   f"tensor, or make it smaller.")
            raise ValueError(msg)
        if isinstance(v, _SCALARS):
            continue
        if isinstance(v, (list, tuple, dict)):
            if id(v) in active:
                msg = (f"state_dict entry {name!r} contains itself at {where!r} (a {type(v).__name__} that holds a "
                       f"reference to itself); JSON cannot store a cycle: break it before saving.")
                raise ValueError(msg)
            if depth >= VALUE_DEPTH:
                msg = (f"state_dict entry {name!r} nests lists and dicts more than {VALUE_DEPTH} levels deep (at "
                       f"{where[:200]!r}); a checkpoint's readers refuse JSON nested deeper than that. Flatten it.")
                raise ValueError(msg)
            active.add(id(v))
            stack.append((where, v, -1))
        if isinstance(v, (list, tuple)):
            stack.extend((f"{where}[{i}]", x, depth + 1) for i, x in enumerate(v))
            continue
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    msg = (f"state_dict entry {name!r} holds a dict with key {k!r} of type {type(k).__name__} "
                           f"at {where!r}; only str keys can be stored as JSON.")
                    raise TypeError(msg)
                stack.append((f"{where}[{k!r}]", x, depth + 1))
            continue
        msg = (f"state_dict entry {name!r} is {type(v).__name__}"
               + (f" at {where!r}" if where != name else "")
               + "; a checkpoint stores tensors, ShardedTensors and JSON values (None, bool, int, float, "
               "str and lists/dicts of them), never pickled objects. Convert it, or drop it from the state_dict.")
        raise TypeError(msg)


def flatten_state_dict(state_dict: Mapping[Any, Any]) -> Iterator[tuple[str, Mapping[Any, Any], Any, Any]]:
    """Yield ``(dotted name, parent mapping, key, value)`` for every leaf of a nested state_dict.

    A non-empty nested ``Mapping`` is a state_dict level and is descended into; keys are ``str``
    or ``int`` (as in optimizer state: ``{"opt": {"state": {0: ...}}}`` gives ``"opt.state.0"``).
    Every other value, an empty mapping included, is a leaf. Two leaves with the same dotted
    name (``{"a.b": x}`` and ``{"a": {"b": y}}``) raise ``ValueError``, and so does a mapping
    that contains itself.
    """
    seen: dict[str, str] = {}
    active: set[int] = set()  # ids of the mappings on the current path: one met again is a cycle

    def walk(prefix: str, where: str, mapping: Mapping[Any, Any]
             ) -> Iterator[tuple[str, Mapping[Any, Any], Any, Any]]:
        if id(mapping) in active:
            msg = (f"state_dict entry {where!r} ({prefix.rstrip('.')!r}) contains itself: a mapping that holds a "
                   f"reference to itself cannot be saved; break the cycle before saving.")
            raise ValueError(msg)
        active.add(id(mapping))
        try:
            yield from walk_items(prefix, where, mapping)
        finally:
            active.discard(id(mapping))

    def walk_items(prefix: str, where: str, mapping: Mapping[Any, Any]
                   ) -> Iterator[tuple[str, Mapping[Any, Any], Any, Any]]:
        for key, value in mapping.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                msg = (f"state_dict key {key!r} at {where or 'the top level'} is {type(key).__name__}; "
                       f"keys must be str (or int, as in optimizer state).")
                raise TypeError(msg)
            name, path = f"{prefix}{key}", f"{where}[{key!r}]"
            if isinstance(value, Mapping) and value:
                yield from walk(f"{name}.", path, value)
                continue
            if name in seen:
                msg = (f"state_dict entries {seen[name]} and {path} both flatten to the name {name!r}; "
                       f"rename one of them.")
                raise ValueError(msg)
            seen[name] = path
            yield name, mapping, key, value

    yield from walk("", "", state_dict)


def _children(v: object) -> Any:
    return v.values() if isinstance(v, dict) else v


def _check_expanded(name: str, value: object) -> None:
    """Refuse ``value`` if its JSON would hold more than ``MAX_ITEMS`` values or nest deeper than ``VALUE_DEPTH``.

    Counted once per distinct list or dict (each one's written size remembered), so a value
    whose shared containers would expand to 2**40 JSON values is refused in time linear in
    the objects it really holds, never by writing them out. Cycles are left to the caller.
    """
    if not isinstance(value, (list, tuple, dict)):
        return
    sizes: dict[int, tuple[int, int]] = {}  # id -> (values written, levels of containers)
    keep: list[object] = []  # the containers measured, alive while their ids are keys
    on_path: set[int] = set()
    stack: list[tuple[object, bool]] = [(value, False)]
    while stack:
        v, done = stack.pop()
        key = id(v)
        if done:
            count, depth = 1, 1
            for child in _children(v):
                inner = sizes.get(id(child)) if isinstance(child, (list, tuple, dict)) else None
                count += 1 if inner is None else inner[0]
                depth = depth if inner is None else max(depth, inner[1] + 1)
            sizes[key] = (count, depth)
            keep.append(v)
            on_path.discard(key)
            if count > MAX_ITEMS or depth > VALUE_DEPTH:
                break
            continue
        if key in sizes:
            continue
        if key in on_path:
            return  # a cycle: the walk that follows names it
        on_path.add(key)
        stack.append((v, True))
        stack.extend((c, False) for c in _children(v) if isinstance(c, (list, tuple, dict)) and id(c) not in sizes)
    count, depth = max(sizes.values(), default=(1, 0))
    if count > MAX_ITEMS:
        msg = (f"state_dict entry {name!r} would be written as at least {count} JSON values (lists or dicts it holds "
               f"several times are written each time), more than the {MAX_ITEMS} a checkpoint's readers accept; "
               f"store it as a tensor, or make it smaller.")
        raise ValueError(msg)
    if depth > VALUE_DEPTH:
        msg = (f"state_dict entry {name!r} nests lists and dicts {depth} levels deep; a checkpoint's readers refuse "
               f"JSON nested deeper than {VALUE_DEPTH} levels in a value. Flatten it.")
        raise ValueError(msg)
