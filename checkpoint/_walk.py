"""The structure of a state_dict: nested mappings flattened to dotted names, and the values a checkpoint stores.

Every part of the package that walks a state_dict (save, load, async_save, DCP conversion)
does it with ``flatten_state_dict``, so a name means the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["flatten_state_dict", "check_json_value"]

_SCALARS = (str, int, float, bool, type(None))


def check_json_value(name: str, value: object) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``value`` is JSON data (and not a tensor).

    JSON data: None, bool, int, float, str, and lists/tuples/dicts (str keys) of those. A list
    or dict that contains itself (directly or deeper) raises ``ValueError``: JSON cannot store it.
    """
    # Depth first with an explicit stack; ``active`` holds the ids of the containers on the
    # current path, so a container met again inside itself is a cycle (a container shared by
    # two branches is not, and is simply written twice).
    stack: list[tuple[str, object, bool]] = [(name, value, False)]
    active: set[int] = set()
    while stack:
        where, v, leaving = stack.pop()
        if leaving:
            active.discard(id(v))
            continue
        if isinstance(v, _SCALARS):
            continue
        if isinstance(v, (list, tuple, dict)):
            if id(v) in active:
                msg = (f"state_dict entry {name!r} contains itself at {where!r} (a {type(v).__name__} that holds a "
                       f"reference to itself); JSON cannot store a cycle: break it before saving.")
                raise ValueError(msg)
            active.add(id(v))
            stack.append((where, v, True))
        if isinstance(v, (list, tuple)):
            stack.extend((f"{where}[{i}]", x, False) for i, x in enumerate(v))
            continue
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    msg = (f"state_dict entry {name!r} holds a dict with key {k!r} of type {type(k).__name__} "
                           f"at {where!r}; only str keys can be stored as JSON.")
                    raise TypeError(msg)
                stack.append((f"{where}[{k!r}]", x, False))
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
