"""Griffe extension for the API reference: show public types where the code uses private aliases.

The packages annotate process groups with ``_comm.ProcessGroup``, a private alias (the
packages outside ``_shardkit`` never import ``torch.distributed``). A reader should see the
type they pass, ``torch.distributed.ProcessGroup`` (``None``: the default group). Type
aliases private to a module are spelled out the same way.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_PUBLIC = {
    "_comm.ProcessGroup": "ProcessGroup | None",
    # Aliases private to one module, spelled out.
    "InitArg": "Callable[[nn.Module], object] | Literal[False] | None",
    "Intervals": "tuple[tuple[int, int], ...]",
}


def _public(annotation: object) -> object:
    if annotation is None:
        return None
    text = str(annotation)
    if not any(re.search(rf"\b{re.escape(private)}\b", text) for private in _PUBLIC):
        return annotation
    for private, public in _PUBLIC.items():
        text = re.sub(rf"(?<![\w.]){re.escape(private)}\b", public, text)
    return text


class PublicTypes(griffe.Extension):
    """Replace private type aliases in signatures, return types and attributes."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if isinstance(obj, griffe.Function):
            for parameter in obj.parameters:
                parameter.annotation = _public(parameter.annotation)  # type: ignore[assignment]
            obj.returns = _public(obj.returns)  # type: ignore[assignment]
        elif isinstance(obj, griffe.Attribute):
            obj.annotation = _public(obj.annotation)  # type: ignore[assignment]
