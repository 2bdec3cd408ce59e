"""A torch call's arguments by name, resolved through torch's own signatures.

The engine's rules need to know what an argument means (``x.std(1, True)`` is
``dim=1, unbiased=True``; ``x.var(False)`` reduces every dimension), which position alone does
not tell: many ops have overloads that give the same position a different meaning. So a
call is bound the way torch binds it: against the op's ATen schemas, the first whose
parameter types accept the arguments (a ``bool`` is not an ``int``), or against the Python
signature of a function written in Python (``F.softmax``, ``Tensor.split``). Which overload
fits depends only on the op and the kinds of its arguments; rules bind only when the engine
decides a call it has not seen, so nothing here is cached.

Names are canonical across the spellings of an op: the first tensor is ``self`` whether torch
calls it ``input`` or ``tensor``, and ``split_size_or_sections`` is ``split_size``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["bind", "aten_name"]

_ALIASES = {"input": "self", "tensor": "self", "split_size_or_sections": "split_size"}


@dataclass(frozen=True)
class _Binder:
    """How one overload names a call's arguments."""

    names: tuple[str, ...]  # positional parameters, canonical names
    defaults: tuple[tuple[str, Any], ...]
    pack_from: int | None  # positional arguments from here on form one list (``x.view(2, 3)``)
    renames: tuple[tuple[str, str], ...]  # keyword names as given -> canonical

    def __call__(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        out = dict(self.defaults)
        if self.pack_from is not None and len(args) > self.pack_from:
            args = (*args[:self.pack_from], tuple(args[self.pack_from:]))
        out.update(zip(self.names, args))
        if self.renames:
            renames = dict(self.renames)
            out.update((renames.get(k, k), v) for k, v in kwargs.items())
        else:
            out.update(kwargs)
        return out


def aten_name(func: Callable[..., Any]) -> str:
    """The ATen name of a torch function or Tensor method (``__add__`` -> ``add``)."""
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("i") and hasattr(torch.Tensor, f"{name[1:]}_"):
            return f"{name[1:]}_"
        return {"truediv": "div", "matmul": "matmul", "and": "bitwise_and", "or": "bitwise_or",
                "invert": "bitwise_not", "xor": "bitwise_xor"}.get(name, name)
    return name


def _fits(value: Any, typ: Any) -> bool:
    """Whether torch's argument parser would accept ``value`` for a parameter of schema type ``typ``."""
    kind = typ.kind()
    if kind == "OptionalType":
        return value is None or _fits(value, typ.getElementType())
    if kind == "TensorType":
        return isinstance(value, torch.Tensor)
    if kind == "BoolType":
        return isinstance(value, bool)
    if kind in ("IntType", "SymIntType"):  # TorchScript spells ScalarType, Layout and MemoryFormat as int
        return (isinstance(value, (int, torch.SymInt, torch.dtype, torch.layout, torch.memory_format))
                and not isinstance(value, bool))
    if kind == "FloatType":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "NumberType":
        return isinstance(value, (int, float, complex, bool)) or (isinstance(value, torch.Tensor) and value.dim() == 0)
    if kind == "ListType":
        element = typ.getElementType()
        if isinstance(value, (list, tuple)):
            return all(_fits(v, element) for v in value)
        return element.kind() in ("IntType", "SymIntType") and _fits(value, element)  # int[1] takes an int
    if kind == "StringType":
        return isinstance(value, str)
    if kind == "DeviceObjType":
        return isinstance(value, (torch.device, str, int))
    return not isinstance(value, torch.Tensor) and not isinstance(value, str)


def _from_schema(schema: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> _Binder | None:
    params = [a for a in schema.arguments if a.name != "out"]
    positional = [a for a in params if not a.kwarg_only]
    by_name = {a.name: a for a in params}
    pack_from = None
    if len(args) > len(positional):
        last = positional[-1] if positional else None
        # torch takes one trailing list of ints as separate arguments: x.view(2, 3), x.permute(0, 2, 1)
        if last is None or last.type.kind() != "ListType" or len(args) <= len(positional) - 1 \
                or not all(_fits(v, last.type.getElementType()) for v in args[len(positional) - 1:]):
            return None
        pack_from = len(positional) - 1
        args = (*args[:pack_from], tuple(args[pack_from:]))
    for value, param in zip(args, positional):
        if not _fits(value, param.type):
            return None
    for key, value in kwargs.items():
        param = by_name.get(key)
        if param is None or not _fits(value, param.type):
            return None
    given = {a.name for a in positional[:len(args)]} | set(kwargs)
    if any(a.name not in given and not a.has_default_value() for a in params):
        return None
    return _Binder(names=tuple(_ALIASES.get(a.name, a.name) for a in positional),
                   defaults=tuple((_ALIASES.get(a.name, a.name), a.default_value) for a in params
                                  if a.has_default_value() and a.name not in given),
                   pack_from=pack_from,
                   renames=tuple((k, _ALIASES[k]) for k in kwargs if k in _ALIASES))


def _from_python(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> _Binder | None:
    try:
        signature = inspect.signature(func)
        signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = next((i for i, p in enumerate(params) if p.kind is p.VAR_POSITIONAL), None)
    given = {p.name for p in positional[:len(args)]} | set(kwargs)
    return _Binder(names=tuple(_ALIASES.get(p.name, p.name) for p in positional),
                   defaults=tuple((_ALIASES.get(p.name, p.name), p.default) for p in params
                                  if p.default is not p.empty and p.name not in given),
                   pack_from=varargs,
                   renames=tuple((k, _ALIASES[k]) for k in kwargs if k in _ALIASES))


def _resolve(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> _Binder | None:
    if inspect.isfunction(func):
        return _from_python(func, args, kwargs)
    try:
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{aten_name(func)}")
    except RuntimeError:
        return None
    for schema in schemas:
        if schema.overload_name.endswith("out") or any(a.name == "out" for a in schema.arguments):
            continue
        found = _from_schema(schema, args, kwargs)
        if found is not None:
            return found
    return None


def bind(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The call's arguments by canonical name, defaults included; ``None`` when no signature fits."""
    binder = _resolve(func, args, kwargs)
    return None if binder is None else binder(args, kwargs)
