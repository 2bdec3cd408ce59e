"""The public registry of split rules: how an op computes on split activations inside a zone.

Every rule lives in the one table of ``rule_table``, keyed by what the model calls: shardkit's
own rules for torch ops (put there by ``zones``), module registrations (``registry``) and
``DFunction`` rules alike. :func:`register_split_rule` writes into that table, so a rule
registered here is found exactly as the built-in ones are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import dfunction as _dfunction
from . import registry as _registry
from . import rule_table as _rule_table
from . import zones as _zones

__all__ = ["register_split_rule"]

_NAMED = {"elementwise": _zones._elementwise}


def _op_objects(op: Any) -> list[Any]:
    """The objects through which torch hands ``op`` to the engine; ``TypeError`` if it is not a torch op."""
    if isinstance(op, torch._library.custom_ops.CustomOpDef):
        op = op._opoverload.overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [op, *(getattr(op, name) for name in op.overloads())]
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    if callable(op) and (torch.overrides.is_tensor_method_or_property(op) or op in _overridable()):
        return [op]
    msg = (f"op must be a torch function (torch.*, torch.nn.functional.*), a Tensor method or a torch.ops / "
           f"torch.library operator, got {op!r} ({type(op).__name__}); a plain Python function is never seen by the "
           f"engine: register the torch ops it calls, or make it a custom op with torch.library.custom_op.")
    raise TypeError(msg)


def _overridable() -> set[Any]:
    return {f for funcs in torch.overrides.get_overridable_functions().values() for f in funcs}


def _decomposed(decomposition: Callable[..., Any]) -> Callable[..., Any]:
    """A rule that runs ``decomposition`` with every op it calls propagated by its own rule."""
    def rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with _zones._Propagate():
            return decomposition(*args, **kwargs)
    rule.__name__ = getattr(decomposition, "__name__", "decomposition")
    return rule


def _resolve(rule: Any, objects: Sequence[Any] = ()) -> Callable[..., Any]:
    """The rule function a rule name or a decomposition stands for; ``objects`` are the op's own objects."""
    if isinstance(rule, str):
        if rule not in _NAMED:
            msg = f"rule {rule!r} names no split rule; use one of {sorted(_NAMED)} or a decomposition (a callable)."
            raise ValueError(msg)
        return _NAMED[rule]
    if not callable(rule):
        msg = f"rule must be 'elementwise' or a callable decomposition, got {rule!r} ({type(rule).__name__})."
        raise TypeError(msg)
    if any(rule is o for o in objects):
        msg = (f"rule {rule!r} is the op itself, which would call its own rule forever; give a decomposition "
               f"into other torch ops, or 'elementwise'.")
        raise ValueError(msg)
    return _decomposed(rule)


def _register_dfunction(op: type[_dfunction.DFunction], rule: Any, replace: bool) -> None:
    resolved = _resolve(rule)
    if op in _rule_table.RULES and not replace:
        msg = f"{op.__qualname__} already has a split rule; pass replace=True to replace it."
        raise ValueError(msg)
    _rule_table.RULES[op] = resolved


def register_split_rule(op: Any, rule: Any, *, replace: bool = False) -> None:
    """Say how ``op`` computes on split activations inside a sharded model.

    Inside a module whose forward runs on split activations (a *zone*: ``LlamaAttention``,
    an MLP), every op on a split tensor goes through its rule; an op without one gathers its
    split inputs and runs on whole tensors (exact, at the cost of an all-gather). A rule is
    either:

    - ``"elementwise"``: ``op`` acts element by element with broadcasting (every tensor
      argument broadcasts against the output and the output has the broadcast shape). Each
      rank computes its slice; a replicated operand is cut to the rank's slice (its gradient
      gathered back) or, if it broadcasts along the split dimension, used whole (its gradient
      summed over the ranks).
    - a *decomposition*: a function with ``op``'s arguments computing the same values from
      other torch ops. It runs on the local slices, each op it calls going through its own
      rule, and autograd differentiates it; it must not call ``op`` itself.

    The rule must give ``op``'s values forward and backward; prove it as the property test of
    docs/extending.md does. Decisions depend only on shapes and splits, so every rank takes
    the same path.

    Every rule lives in one table keyed by what the model calls (``rule_table``): torch ops,
    and also the two other things a sharded model calls, which this function registers too:

    - an ``nn.Module`` type with a ``ShardedModule`` as ``rule``: how the module computes
      with split parameters (what ``st.register_sharded_module`` does);
    - a ``DFunction`` subclass with ``"elementwise"`` or a decomposition: how the function
      runs on split activations inside a sharded model (without one, the split rule its
      ``layout_rule`` names, else its split inputs are gathered).

    Args:
        op: a torch function (``torch.*``, ``torch.nn.functional.*``), a Tensor method
            (``torch.Tensor.xlogy``), or an operator of ``torch.ops`` / ``torch.library``
            (a packet registers every overload); an ``nn.Module`` type; or a ``DFunction``
            subclass. Only the object given is registered: a function and its Tensor-method
            form are two ops.
        rule: ``"elementwise"`` or a decomposition (a callable); a ``ShardedModule`` for a
            module type.
        replace: replace the rule ``op`` already has (shardkit's own included); without it,
            registering an op that has a rule raises ``ValueError``.

    Raises:
        TypeError: ``op`` is not a torch op, or ``rule`` is neither a rule name nor callable.
        ValueError: ``op`` already has a rule and ``replace`` is false, ``rule`` names no
            rule, or ``rule`` is ``op`` itself.

    Example:
        >>> @torch.library.custom_op("mylib::scaled_tanh", mutates_args=())  # doctest: +SKIP
        ... def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
        ...     return torch.tanh(x) * scale
        >>> st.register_split_rule(scaled_tanh, lambda x, scale: torch.tanh(x) * scale)  # doctest: +SKIP
    """
    if isinstance(op, type) and issubclass(op, nn.Module):
        _registry.register_sharded_module(op, rule, replace=replace)
        return
    if isinstance(op, type) and issubclass(op, _dfunction.DFunction):
        _register_dfunction(op, rule, replace)
        return
    objects = _op_objects(op)
    resolved = _resolve(rule, (op, *objects))
    rules = _zones._tables()[0]
    taken = [o for o in objects if o in rules]
    if taken and not replace:
        msg = (f"op {op!r} already has a split rule ({getattr(rules[taken[0]], '__name__', rules[taken[0]])}); "
               f"pass replace=True to replace it.")
        raise ValueError(msg)
    for o in objects:
        rules[o] = resolved
