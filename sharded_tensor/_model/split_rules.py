"""The public registry of rules: how an op computes on placed activations inside a sharded model.

Every rule lives in the one table of ``engine.rules``, keyed by what the model calls, one rule
per placement kind: shardkit's own rules for torch ops, module registrations (``registry``) and
``DFunction`` rules alike. :func:`register_split_rule` writes into that table, so a rule
registered here is found exactly as the built-in ones are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from sharding import layout

from . import dfunction as _dfunction
from . import registry as _registry
from .engine import pending as _pending
from .engine import placements as _placements
from .engine import split as _split
from .engine.dispatch import ZoneMode
from .engine.rules import Call, Decision, register

__all__ = ["register_split_rule"]

# What ``placement=`` accepts, and the engine's placement kind each stands for.
_KINDS: dict[type, type] = {layout.Split: _placements.Split, layout.Packed: _placements.Packed,
                            layout.Partial: _placements.Partial, layout.Strided: _placements.Strided}
# Rules by name: the placement kind they are for, and the rule.
_NAMED: dict[str, tuple[type, Callable[[Call], Decision]]] = {
    "elementwise": (layout.Split, _split.elementwise),
    "linear": (layout.Partial, _pending.linear_in_one),
}


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


@functools.cache
def _overridable() -> frozenset[Any]:
    return frozenset(f for funcs in torch.overrides.get_overridable_functions().values() for f in funcs)


def _decomposed(decomposition: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with ZoneMode():  # every op the decomposition calls goes through its own rule
        return decomposition(*args, **kwargs)


def _decomposition_rule(decomposition: Callable[..., Any]) -> Callable[[Call], Decision]:
    """A rule that runs ``decomposition`` on the local tensors, each op it calls through its own rule."""
    decision = Decision(run=functools.partial(_decomposed, decomposition))

    def rule(call: Call) -> Decision:
        return decision

    rule.__qualname__ = rule.__name__ = getattr(decomposition, "__name__", "decomposition")
    return rule


def _resolve(rule: Any, placement: type | None, objects: Sequence[Any]) -> tuple[type, Callable[[Call], Decision]]:
    """The engine's placement kind and rule function that ``rule`` and ``placement`` stand for."""
    if placement is not None and placement not in _KINDS:
        msg = (f"placement={placement!r} is not a placement kind; use one of sharding.layout's "
               f"{', '.join(k.__name__ for k in _KINDS)}.")
        raise ValueError(msg)
    if isinstance(rule, str):
        if rule not in _NAMED:
            msg = (f"rule {rule!r} names no rule; use one of {sorted(_NAMED)} or a decomposition (a callable "
                   f"computing the op from other torch ops).")
            raise ValueError(msg)
        kind, found = _NAMED[rule]
        if placement is not None and placement is not kind:
            msg = (f"rule {rule!r} is for {kind.__name__} activations, not {placement.__name__}; give a "
                   f"decomposition for {placement.__name__} activations.")
            raise ValueError(msg)
        return _KINDS[kind], found
    if not callable(rule):
        msg = (f"rule must be one of {sorted(_NAMED)} or a callable decomposition, got {rule!r} "
               f"({type(rule).__name__}).")
        raise TypeError(msg)
    if any(rule is o for o in objects):
        msg = (f"rule {rule!r} is the op itself, which would call its own rule forever; give a decomposition "
               f"into other torch ops, or a named rule.")
        raise ValueError(msg)
    return _KINDS[placement or layout.Split], _decomposition_rule(rule)


def register_split_rule(op: Any, rule: Any, *, placement: type | None = None, replace: bool = False) -> None:
    """Say how ``op`` computes on placed activations inside a sharded model.

    Inside a sharded model, an activation may be this rank's slice of a logical tensor
    (``sharding.layout.Split``: a Linear split on its output features hands one out), a
    pending sum (``Partial``: each rank holds one addend, as a Linear split on its input
    features leaves it), several slices side by side (``Packed``: a fused q/k/v projection) or
    slices of merged blocks (``Strided``). Every op on such an activation goes through its
    rule for that placement; an op without one makes its placed inputs whole (an all-gather,
    or the all-reduce of a pending sum) and runs on whole tensors, exact at the cost of the
    communication. A rule is either:

    - ``"elementwise"`` (for ``Split``): ``op`` acts element by element with broadcasting
      (every tensor argument broadcasts against the output and the output has the broadcast
      shape). Each rank computes its slice; a whole operand is cut to the rank's slice (its
      gradient gathered back) or, if it broadcasts along the split dimension, used whole (its
      gradient summed over the ranks).
    - ``"linear"`` (for ``Partial``): ``op`` is linear in its one pending input and takes no
      other placed tensor (a reshape, a negation, a copy): each rank applies it to its addend,
      and the result is still pending.
    - a *decomposition*, for any placement: a function with ``op``'s arguments computing the
      same values from other torch ops. It runs on the local tensors, each op it calls going
      through its own rule, and autograd differentiates it; it must not call ``op`` itself.

    The rule must give ``op``'s values forward and backward; prove it by values against the
    unsharded op, as the property tests of docs/extending.md do. Decisions depend only on
    shapes and placements, so every rank takes the same path.

    The same table holds the two other things a sharded model looks up, which this function
    registers too:

    - an ``nn.Module`` type with a ``ShardedModule`` as ``rule``: how the module computes
      with split parameters (what ``st.register_sharded_module`` does);
    - a ``DFunction`` subclass with a rule as above: how the function runs on placed
      activations (without one, the rule its ``layout_rule`` names, else its placed inputs
      are made whole).

    Args:
        op: a torch function (``torch.*``, ``torch.nn.functional.*``), a Tensor method
            (``torch.Tensor.xlogy``), or an operator of ``torch.ops`` / ``torch.library``
            (a packet registers every overload); an ``nn.Module`` type; or a ``DFunction``
            subclass. Only the object given is registered: a function and its Tensor-method
            form are two ops.
        rule: ``"elementwise"``, ``"linear"`` or a decomposition (a callable); a
            ``ShardedModule`` for a module type.
        placement: the placement kind the rule is for: ``sharding.layout.Split``, ``Partial``,
            ``Packed`` or ``Strided``; by default the one the named rule is for, and ``Split``
            for a decomposition.
        replace: replace the rule ``op`` already has for that placement (shardkit's own
            included); without it, registering one raises ``ValueError``.

    Raises:
        TypeError: ``op`` is not a torch op, or ``rule`` is neither a rule name nor callable.
        ValueError: ``op`` already has a rule for the placement and ``replace`` is false,
            ``rule`` names no rule or is for another placement, or ``rule`` is ``op`` itself.

    Example:
        >>> @torch.library.custom_op("mylib::scaled_tanh", mutates_args=())  # doctest: +SKIP
        ... def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
        ...     return torch.tanh(x) * scale
        >>> st.register_split_rule(scaled_tanh, lambda x, scale: torch.tanh(x) * scale)  # doctest: +SKIP
        >>> # a pending sum goes through it as a sum of addends, each scaled alike
        >>> @torch.library.custom_op("mylib::scale", mutates_args=())  # doctest: +SKIP
        ... def scale(x: torch.Tensor, by: float) -> torch.Tensor:
        ...     return x * by
        >>> st.register_split_rule(scale, "linear")  # doctest: +SKIP
    """
    if isinstance(op, type) and issubclass(op, nn.Module):
        _registry.register_sharded_module(op, rule, replace=replace)
        return
    if isinstance(op, type) and issubclass(op, _dfunction.DFunction):
        kind, found = _resolve(rule, placement, ())
        register([op], kind, found, replace=replace, label=op.__qualname__)
        return
    objects = _op_objects(op)
    kind, found = _resolve(rule, placement, (op, *objects))
    register(objects, kind, found, replace=replace, label=f"op {op!r}")
