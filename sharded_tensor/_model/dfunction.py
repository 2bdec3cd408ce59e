"""Custom functions on ShardedTensors: ``DFunction``, written on local tensors, with a layout rule.

A ``DFunction`` subclass is written like a ``torch.autograd.Function``: ``forward(ctx,
*args)`` and ``backward(ctx, *grads)`` on plain local tensors. It also names a *layout rule*,
which decides, from the layouts of the ``ShardedTensor`` arguments alone, where each input
must be and what layout the output has. ``apply`` then:

* with no ``ShardedTensor`` among the arguments, runs the plain autograd path: the function
  behaves exactly like the ``torch.autograd.Function`` it is;
* otherwise asks the rule, reshards a copy of any input whose layout the rule wants changed
  (the caller's tensor is left as it was; the bytes moved show in ``CommCounter``), runs
  ``forward`` on each local shard, and wraps the results as a ``ShardedTensor`` with the
  rule's output layout.

Rules are pure functions registered by name (:func:`register_layout_rule`), so one rule
serves many functions. Two ship with shardkit: ``"elementwise"`` (every sharded input in the
first one's layout, output alike) and ``"replicate"`` (every sharded input whole on every
rank, output replicated).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sharding import DevicePlacement, PlacementSpec, ShardedTensorMetadata

from .._reshard import redistribute
from .._tensor import ShardedTensor, from_local, local_by_index, rank_of, world_of
from .engine import split as _split
from .engine.dispatch import dispatch
from .engine.placements import Split, placement_of
from .engine.rules import RULES, LayoutRuleName, OpRules, rules_of
from .engine.zone import in_zone, outside_propagation

__all__ = ["DFunction", "LayoutDecision", "register_layout_rule"]


@dataclass(frozen=True)
class LayoutDecision:
    """What a layout rule decides.

    Attributes:
        inputs: per ``ShardedTensor`` argument (in order), the layout it must have (``None``:
            as it is).
        output: the spec of the output (``None``: the first sharded input's, after resharding).
    """

    inputs: tuple[PlacementSpec | None, ...]
    output: PlacementSpec | None = None


LayoutRule = Callable[[Sequence[ShardedTensorMetadata], Sequence[PlacementSpec | None]], LayoutDecision]


class _LayoutRules:
    """Layout rules by name, kept in the one table of sharded compute rules (``engine.rules``)."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and LayoutRuleName(name) in RULES

    def get(self, name: str) -> LayoutRule | None:
        return RULES.get(LayoutRuleName(name))

    def __setitem__(self, name: str, rule: LayoutRule) -> None:
        RULES[LayoutRuleName(name)] = rule


_RULES = _LayoutRules()


def register_layout_rule(name: str, rule: LayoutRule, *, replace: bool = False) -> None:
    """Register a layout rule under ``name`` for ``DFunction.layout_rule``.

    ``rule(layouts, specs)`` gets the ``ShardedTensorMetadata`` and spec of every
    ``ShardedTensor`` argument, in order, and returns a :class:`LayoutDecision`. It must be
    pure: every rank calls it with the same layouts and must get the same answer.

    Raises:
        ValueError: ``name`` is taken and ``replace`` is false.

    Example:
        >>> def rows(layouts, specs):  # doctest: +SKIP
        ...     return LayoutDecision(inputs=(single_split(0, RANKS),) * len(layouts))
        >>> st.register_layout_rule("rows", rows)  # doctest: +SKIP
    """
    if name in _RULES and not replace:
        msg = f"a layout rule named {name!r} is registered already; pass replace=True to replace it."
        raise ValueError(msg)
    _RULES[name] = rule


def _elementwise(layouts: Sequence[ShardedTensorMetadata], specs: Sequence[PlacementSpec | None]) -> LayoutDecision:
    if any(layout.pending is not None for layout in layouts):
        # A function of partial values is not the partial values of the function (tanh(a) + tanh(b)
        # is not tanh(a + b)): the inputs are reduced first, to a replica on every rank.
        return _replicate(layouts, specs)
    first = layouts[0]
    wanted = tuple(None if layout.shards == first.shards else specs[0] for layout in layouts)
    return LayoutDecision(inputs=wanted)


def _replicate(layouts: Sequence[ShardedTensorMetadata], specs: Sequence[PlacementSpec | None]) -> LayoutDecision:
    whole = DevicePlacement("cpu")
    return LayoutDecision(inputs=(whole,) * len(layouts), output=whole)


register_layout_rule("elementwise", _elementwise)
register_layout_rule("replicate", _replicate)


class DFunction:
    """A function on ShardedTensors written on local tensors; subclass it.

    Define ``forward(ctx, *args)`` and ``backward(ctx, *grads)`` as for a
    ``torch.autograd.Function`` (static methods), and set ``layout_rule`` to the name of a
    registered rule (``"elementwise"``, ``"replicate"``, or your own from
    :func:`register_layout_rule`).

    Example:
        >>> class ScaledTanh(st.DFunction):  # doctest: +SKIP
        ...     layout_rule = "elementwise"
        ...     @staticmethod
        ...     def forward(ctx, x, scale):
        ...         y = torch.tanh(x) * scale
        ...         ctx.save_for_backward(y)
        ...         ctx.scale = scale
        ...         return y
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         (y,) = ctx.saved_tensors
        ...         return grad * (ctx.scale - y * y / ctx.scale), None
        >>> out = ScaledTanh.apply(sharded_x, 2.0)  # a ShardedTensor in sharded_x's layout
    """

    layout_rule: ClassVar[str | None] = None
    _autograd: ClassVar[type[torch.autograd.Function] | None] = None

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def _function(cls) -> type[torch.autograd.Function]:
        if cls.__dict__.get("_autograd") is None:
            fn = type(f"{cls.__name__}Function", (torch.autograd.Function,),
                      {"forward": staticmethod(cls.forward), "backward": staticmethod(cls.backward)})
            cls._autograd = fn
        return cls.__dict__["_autograd"]  # type: ignore[no-any-return]

    @classmethod
    def apply(cls, *args: Any) -> Any:
        """Run on plain tensors (autograd as usual) or on ShardedTensors (see the class)."""
        sharded = [a for a in args if isinstance(a, ShardedTensor)]
        if not sharded:
            if in_zone() and any(placement_of(a) is not None for a in args):
                return _on_slices(cls, args)
            return cls._function().apply(*args)
        rule = _RULES.get(cls.layout_rule) if cls.layout_rule is not None else None
        if rule is None:
            msg = (f"{cls.__name__}.layout_rule is {cls.layout_rule!r}, which names no registered layout rule, so "
                   f"shardkit cannot tell the layout of its output on ShardedTensors; set layout_rule to "
                   f"'elementwise' or 'replicate', or register one with "
                   f"sharded_tensor.register_layout_rule(name, rule).")
            raise ValueError(msg)
        decision = rule([t.sharding_metadata() for t in sharded], [t.sharding_spec() for t in sharded])
        if len(decision.inputs) != len(sharded):
            msg = (f"layout rule {cls.layout_rule!r} returned {len(decision.inputs)} input layouts for "
                   f"{len(sharded)} ShardedTensor arguments of {cls.__name__}.")
            raise ValueError(msg)
        moved = iter([_resharded(t, spec) for t, spec in zip(sharded, decision.inputs)])
        args = tuple(next(moved) if isinstance(a, ShardedTensor) else a for a in args)
        first = next(a for a in args if isinstance(a, ShardedTensor))
        layout = first.sharding_metadata()
        for other in (a for a in args if isinstance(a, ShardedTensor)):
            if other.sharding_metadata().shards != layout.shards or other.sharding_metadata().pending != layout.pending:
                msg = (f"layout rule {cls.layout_rule!r} left the ShardedTensor arguments of {cls.__name__} in "
                       f"different layouts; a rule must put every input where the local forward can combine them.")
                raise ValueError(msg)
        rank = rank_of(first)
        outputs: dict[int, torch.Tensor] = {}
        locals_by_arg = [local_by_index(a) if isinstance(a, ShardedTensor) else None for a in args]
        for index, _ in layout.shards_on(rank):
            local_args = [m[index] if m is not None else a for a, m in zip(args, locals_by_arg)]
            outputs[index] = cls._function().apply(*local_args)
        dtype = next(iter(outputs.values())).dtype if outputs else layout.dtype
        result_layout = layout.with_dtype(dtype)  # partial inputs a rule kept (a linear function) give partial values
        result = from_local(outputs, result_layout, first.sharding_spec(), rank=rank, group=first.process_group)
        if decision.output is not None and first.sharding_spec() != decision.output:
            result.reshard(decision.output)
        return result


# The rules a DFunction follows on split activations when none is registered for it: the one its
# layout rule describes ("elementwise" acts slice by slice); otherwise its inputs are made whole.
_RULES_OF_LAYOUT: dict[str, OpRules] = {"elementwise": OpRules({Split: _split.elementwise})}


def _on_slices(cls: type[DFunction], args: tuple[Any, ...]) -> Any:
    """``cls`` inside a sharded model, on placed activations: through its rules, as a torch op would be.

    Its rules are the ones registered for ``cls`` (``st.register_split_rule(cls, ...)``), or, for
    split activations, the one its layout rule names; without one, or where the rule cannot
    keep the placement, the placed inputs are made whole and the function runs on whole
    tensors (exact, at an all-gather's cost).
    """
    rules = rules_of(cls) or _RULES_OF_LAYOUT.get(cls.layout_rule or "") or OpRules()
    with outside_propagation():  # its forward runs on the local tensors the decision hands it
        return dispatch(cls._function().apply, args, {}, rules=rules)


def _resharded(tensor: ShardedTensor, spec: PlacementSpec | None) -> ShardedTensor:
    """``tensor`` itself, or a copy of it laid out as ``spec`` (collective; the original is untouched)."""
    if spec is None:
        return tensor
    target = spec.build_metadata(tensor.shape, tensor.dtype, world_size=world_of(tensor))
    if target == tensor.sharding_metadata():  # the same shards holding the same kind of values (partial or not)
        return tensor
    rank, group = rank_of(tensor), tensor.process_group
    local = redistribute(local_by_index(tensor), tensor.sharding_metadata(), target, rank=rank, group=group)
    return from_local(local, target, spec, rank=rank, group=group)
