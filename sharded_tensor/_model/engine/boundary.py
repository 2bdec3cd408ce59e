"""Objects that cross a compiled zone's boundary: a model's key/value cache.

Under ``torch.compile`` a zone is one opaque call for dynamo (``zone._traced_zone``), whose
arguments and results dynamo takes apart with ``torch.utils._pytree``. A model's forward may
take or return an object pytree does not know: transformers builds a ``DynamicCache`` when
``use_cache=True`` (the default) and returns it, and ``generate`` passes it back in. Such a
type, registered here, is taken apart into its tensors and rebuilt around them: its
attributes, and those of the objects it holds (a cache's layers), walked as lists, tuples,
dicts and objects with a ``__dict__``; anything else is kept as it is.

Its class is found again by name in :data:`CLASSES`, a dictionary of this module: dynamo
rebuilds an object of a class it can name (a global), not one carried in a pytree context.
In eager mode these objects are not walked: a zone hands them out as they are, their tensors
placed, for the next call to read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["CLASSES", "OPAQUE", "register"]

CLASSES: dict[str, type] = {}
"""The classes of the objects a flattened context names, by qualified name."""

OPAQUE: set[type] = set()
"""The registered types: a zone's exit in eager mode keeps them whole (it does not walk into them)."""


def _name(cls: type) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    CLASSES.setdefault(name, cls)
    return name


def _context(value: Any, leaves: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return ("tensor",)
    if type(value) is list:
        return ("list", tuple(_context(v, leaves) for v in value))
    if type(value) is tuple:
        return ("tuple", tuple(_context(v, leaves) for v in value))
    if type(value) is dict:
        return ("dict", tuple((k, _context(v, leaves)) for k, v in value.items()))
    if hasattr(value, "__dict__") and not isinstance(value, (type, int, float, str)) and not callable(value):
        return ("object", _name(type(value)), tuple((k, _context(v, leaves)) for k, v in vars(value).items()))
    return ("value", value)


def _rebuilt(context: Any, leaves: Iterator[torch.Tensor]) -> Any:
    kind = context[0]
    if kind == "tensor":
        return next(leaves)
    if kind == "list":
        return [_rebuilt(c, leaves) for c in context[1]]
    if kind == "tuple":
        return tuple(_rebuilt(c, leaves) for c in context[1])
    if kind == "dict":
        return {k: _rebuilt(c, leaves) for k, c in context[1]}
    if kind == "object":
        cls: Any = CLASSES[context[1]]
        obj = cls.__new__(cls)
        for k, c in context[2]:
            setattr(obj, k, _rebuilt(c, leaves))
        return obj
    return context[1]


def _flatten(obj: Any) -> tuple[list[torch.Tensor], Any]:
    leaves: list[torch.Tensor] = []
    return leaves, _context(obj, leaves)


def _unflatten(leaves: Iterable[torch.Tensor], context: Any) -> Any:
    return _rebuilt(context, iter(leaves))


def register(types: Iterable[type]) -> None:
    """Let objects of ``types`` cross a compiled zone's boundary (each type once; one pytree already knows is
    left to it)."""
    for cls in types:
        if cls in OPAQUE or cls in pytree.SUPPORTED_NODES:
            continue
        pytree.register_pytree_node(cls, _flatten, _unflatten)
        OPAQUE.add(cls)
