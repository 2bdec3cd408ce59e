"""The extension point for sharded compute: how a module type computes with split parameters.

``shard_model`` never guesses how a module computes: a module whose parameters are split
must have a registered :class:`ShardedModule`, and ``nn.Linear`` and ``nn.Embedding`` are
simply the two registrations that ship with shardkit (``_parallel``). A registration says

* which parameter layouts it accepts: :meth:`ShardedModule.plan` turns the layouts of the
  module's parameters (:class:`ParamLayout`: replicated, or split along one dimension with
  each rank's ``(start, length)``) into a plan, or raises ``ValueError`` naming the module and
  why. It runs at shard time, on every rank, before any data moves;
* how split activations flow: :meth:`ShardedModule.activations` gives the split of its input
  and of its output along the last dimension (``None``: replicated). Where one module's
  output split equals another's input split, the activation between them stays split
  through the model's own code (see ``engine``);
* how it computes: :meth:`ShardedModule.forward` runs on this rank's local parameters and
  uses the :class:`ShardedCall` it is given for every communication (gather, scatter,
  all-reduce, with their autograd). Code after ``call.reduce(...)`` is the place for pieces
  that must be added once, after the reduction (a bias).

Why a registry rather than subclass detection or tracing: the meaning of a parameter's
dimensions (is dim 0 of this weight the output features?) belongs to the module's code, which
shardkit cannot read reliably; the registration states it once, next to that code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from _shardkit import comm as _comm
from sharding.layout import Packed, Split

from .engine import placements as _placements
from .engine.placements import Intervals, copy_to_ranks, gather, reduce_from_ranks, scatter, shared_copy, to_whole
from .engine.rules import RULES
from .engine.state import rank_and_world
from .engine.zone import in_zone
from .param_layout import ParamLayout, split_placement

__all__ = ["ShardedModule", "ShardedCall", "register_sharded_module", "handler_for", "registered_types"]

# Module types live in the one table of sharded compute rules, next to the ops' rules.
_REGISTRY: dict[Any, Any] = RULES


class ShardedModule:
    """How one module type computes with split parameters; subclass and register it.

    Example:
        >>> class ShardedScale(st.ShardedModule):  # doctest: +SKIP
        ...     def plan(self, module, layouts, *, name):
        ...         w = layouts["weight"]
        ...         if w.kind != "split" or w.dim != 0:
        ...             raise ValueError(f"{name}: split the scale on dim 0")
        ...         return w.intervals
        ...     def activations(self, plan):
        ...         return plan, plan  # a split input gives a split output
        ...     def forward(self, call, module, x):
        ...         x = call.split_input(x, call.plan)
        ...         return call.split_output(x * module.weight, call.plan)
        >>> st.register_sharded_module(Scale, ShardedScale())  # doctest: +SKIP
    """

    subtree: bool = False
    """Whether the registration computes the module's whole subtree (its children's parameters
    come to :meth:`plan` as ``"child.weight"``, and the children get no plan of their own)."""

    def plan(self, module: nn.Module, layouts: Mapping[str, Any], *, name: str) -> object:
        """A plan for ``module`` given its parameters' layouts, or ``ValueError`` saying why not.

        Args:
            module: the module (possibly still on the meta device).
            layouts: the module's own parameters (``"weight"``, ...) that are sharded, each a
                ``ParamLayout`` with its ``placement`` (``sharding.layout``), read through
                ``kind`` (``"replicated"``, ``"split"``, ``"blocks"``, ``"overlapping"``), ``dim``
                and ``intervals`` (per rank ``(start, length)``).
            name: a label for messages, e.g. ``"module 'h.0.attn.c_attn' (Conv1D)"``.

        Returns:
            Any value; :meth:`forward` reads it as ``call.plan``. ``None`` means the module
            computes as if unsharded (only replicated parameters).
        """
        raise NotImplementedError

    def activations(self, plan: Any) -> tuple[Intervals | None, Intervals | None]:
        """The split of the input and of the output along their last dimension (``None``: whole)."""
        return None, None

    def describe(self, plan: Any) -> str:
        """What the layer takes and hands out, in a few words (for ``st.explain``)."""
        takes, gives = self.activations(plan)
        if gives is not None:
            return "output split"
        if takes is not None:
            return "input split, output a pending sum"
        return "whole activations, its own communication"

    def empty_dims(self, plan: Any) -> Mapping[str, int]:
        """For a rank holding none of a parameter: the dimension its empty local tensor has size 0 in."""
        return {}

    def forward(self, call: ShardedCall, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The module's forward on this rank's local parameters; communicate through ``call``."""
        raise NotImplementedError

    def computes_alike(self, module: nn.Module) -> bool:
        """Whether ``module``, of a subclass that overrides the registered type's forward, computes the same.

        The default says no, so such a subclass needs a registration of its own.
        """
        return False


@dataclass(frozen=True)
class ShardedCall:
    """What a sharded forward needs: its plan, its group, and the communication primitives.

    Every primitive is differentiable with the matching backward, and counted by
    ``CommCounter``. An activation is *split* when each rank holds its slice along the last
    dimension (inside a zone of the model) and *replicated* when every rank holds all of it.

    Args:
        plan: the module's ``ParamLayout`` plan: how each of its parameters is split.
        group: the process group the split spans (``None``: the default group).
    """

    plan: Any
    group: _comm.ProcessGroup
    # The engine's placement per (output split, dimension), built once: a layer hands out the same split
    # every call.
    _tags: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict, init=False, repr=False,
                                                          compare=False)
    _partial: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return rank_and_world(self.group)[0]

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return rank_and_world(self.group)[1]

    def replicated(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` whole on every rank (gathers it if it arrives split)."""
        return to_whole(x)  # type: ignore[no-any-return]

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated ``x`` about to meet this rank's weight slice: its gradient is summed over ranks."""
        return shared_copy(to_whole(x), self.group)

    def split_input(self, x: torch.Tensor, intervals: Intervals) -> torch.Tensor:
        """This rank's slice of ``x`` along the last dimension (as it arrives when already split so)."""
        split = _placements.placement_of(x)
        if (type(split) is _placements.Split and split.dim == x.dim() - 1 and split.intervals == intervals
                and split.group is self.group):
            return x
        return scatter(to_whole(x), -1, intervals, self.group)

    def split_output(self, y: torch.Tensor, split: Intervals | Split | Packed | ParamLayout) -> torch.Tensor:
        """Hand out this rank's slice ``y`` of the output: kept split inside a zone, else gathered.

        ``split`` is the output's split along its last dimension: per-rank ``(start, length)``,
        a ``sharding.layout`` ``Split`` or ``Packed``, or the ``ParamLayout`` of the weight whose
        split it follows (a packed layout gives a packed output: this rank's slices side by side).
        """
        key = (id(split), y.dim())
        hit = self._tags.get(key)
        if hit is not None and hit[0] is split:
            tag = hit[1]
        else:
            tag = _as_tag(split, y.dim() - 1, self.group)
            if len(self._tags) >= 16:  # a forward that builds its split anew each call: no use keeping them
                self._tags.clear()
            self._tags[key] = (split, tag)
        _placements.tag(y, tag)
        return y if in_zone() else to_whole(y)

    def local_slice(self, t: torch.Tensor, intervals: Intervals, dim: int = -1) -> torch.Tensor:
        """This rank's slice of a replicated ``t`` (e.g. a whole bias added to a split output)."""
        start, length = intervals[self.rank]
        return copy_to_ranks(t, self.group).narrow(dim, start, length)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of the partial results ``y``: one all-reduce, replicated after."""
        return reduce_from_ranks(y, self.group)

    def pending_sum(self, y: torch.Tensor, once: torch.Tensor | None = None) -> torch.Tensor:
        """The sum over ranks of the partial results ``y``, plus ``once`` (whole on every rank, e.g. a bias).

        Inside a zone the sum stays pending (each rank keeps its addend, ``once`` added on one
        rank) until an op needs it whole, so sums that meet first (attention and MLP in parallel)
        share one all-reduce; outside, it is :meth:`reduce` then ``+ once``.
        """
        if not in_zone() or self.world_size == 1:
            y = self.reduce(y)
            return y if once is None else y + once
        if not self._partial:
            self._partial.append(_placements.Partial(group=self.group))
        partial = self._partial[0]
        if once is not None:
            y = y + partial.add_once(once)
        return _placements.tag(y, partial)

    def gather(self, y: torch.Tensor, dim: int, intervals: Intervals) -> torch.Tensor:
        """Concatenate every rank's slice ``y`` along ``dim``."""
        return gather(y, dim, intervals, self.group)


def _as_tag(split: Intervals | Split | Packed | ParamLayout, dim: int,
            group: _comm.ProcessGroup) -> _placements.Split | _placements.Packed:
    if isinstance(split, ParamLayout):
        return _tag(split_placement(split, 0), dim, group)
    if isinstance(split, list):  # intervals as lists: hashable for the cache
        split = tuple(tuple(pair) for pair in split)
    return _tag(split, dim, group)


def _tag(split: Intervals | Split | Packed, dim: int,
         group: _comm.ProcessGroup) -> _placements.Split | _placements.Packed:
    """The engine's placement for an output split as ``split`` along ``dim``."""
    if isinstance(split, Packed):
        return _placements.Packed(dim, split.pieces, group)
    if isinstance(split, Split):
        return _placements.Split(dim, split.intervals, group)
    return _placements.Split(dim, split, group)  # per-rank intervals; checked there


def register_sharded_module(module_type: type[nn.Module], handler: ShardedModule, *, replace: bool = False) -> None:
    """Teach ``shard_model`` how ``module_type`` computes with split parameters.

    The registration applies to ``module_type`` and to subclasses that do not override its
    ``forward``.

    Args:
        module_type: an ``nn.Module`` subclass.
        handler: a :class:`ShardedModule` instance.
        replace: allow replacing an existing registration (including the built-in ones).

    Raises:
        TypeError: ``module_type`` is not an ``nn.Module`` subclass, or ``handler`` not a
            ``ShardedModule``.
        ValueError: ``module_type`` is registered already and ``replace`` is false.

    Example:
        >>> st.register_sharded_module(Conv1D, ShardedConv1D())  # doctest: +SKIP
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        msg = f"module_type must be an nn.Module subclass, got {module_type!r}."
        raise TypeError(msg)
    if not isinstance(handler, ShardedModule):
        msg = (f"handler must be a ShardedModule instance, got {type(handler).__name__}; subclass "
               f"sharded_tensor.ShardedModule and pass an instance.")
        raise TypeError(msg)
    if module_type in _REGISTRY and not replace:
        msg = (f"{module_type.__qualname__} already has a sharded registration "
               f"({type(_REGISTRY[module_type]).__name__}); pass replace=True to replace it.")
        raise ValueError(msg)
    _REGISTRY[module_type] = handler


def handler_for(module: nn.Module) -> tuple[ShardedModule | None, str | None]:
    """The registration that applies to ``module``, or ``(None, why not)``."""
    cls = type(module)
    for base in cls.__mro__:
        handler = _REGISTRY.get(base)
        if not isinstance(handler, ShardedModule):
            continue
        if base is not cls and cls.forward is not cast("type[nn.Module]", base).forward \
                and not handler.computes_alike(module):
            return None, (f"{cls.__name__} overrides the forward of {base.__name__}, whose registration "
                          f"therefore does not apply")
        return handler, None
    return None, None


def registered_types() -> list[str]:
    """Names of the registered module types, for messages."""
    return sorted(t.__name__ for t in list(_REGISTRY) if isinstance(t, type) and issubclass(t, nn.Module))
