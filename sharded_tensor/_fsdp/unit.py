"""The runtime of a fully sharded unit: gather before compute, free after, reduce gradients.

One ``Unit`` per ``fully_shard`` call. Its module's parameters are, between steps, this
rank's rows of each parameter (ordinary ``nn.Parameter`` s the optimizer steps). Around
the module's forward:

* pre-forward: the unit's parameters are gathered (one all-gather of the unit, each rank's
  rows received straight into the unsharded buffer, or the one already posted by a
  prefetch), the next unit's gather is posted, and the module's parameter slots are
  pointed at the whole parameters, views of that buffer output by ``_Unshard``;
* post-forward: the slots get the local shards back, and the unsharded buffer's storage
  is released (``reshard_after_forward``). Autograd keeps views of that buffer, so before
  the unit's backward the same storage is filled again (pre-backward hook on the unit's
  outputs), with the version counter preserved: the data is what forward saw;
* post-backward: ``_Unshard.backward`` receives the gradients of all the unit's whole
  parameters at once; each rank's rows of them are sent to it from the gradients themselves
  (one reduce-scatter of the unit, posted, waited for when the next one is posted or at the
  end of backward), summed in rank order, averaged over the ranks and added to the local
  shards' ``.grad`` (which become views of the reduced buffer when they were ``None``).

The root unit (the outermost one running forward) keeps its parameters after forward, since
backward needs them first, and at the end of backward (a callback queued on the autograd
engine) completes every reduction and frees every unit's gathered parameters.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter as _preserve_version
from torch.utils import _pytree as pytree

from _shardkit import flat as _flat

from .plan import FlatParam, UnitPlan

__all__ = ["Unit", "unit_of"]

_ATTR = "_shardkit_fsdp"


def unit_of(module: nn.Module) -> Unit | None:
    """The unit ``module`` is the root of, if ``fully_shard`` was applied to it."""
    unit: Unit | None = module.__dict__.get(_ATTR)
    return unit


class _Active(threading.local):
    root: Unit | None = None


_active = _Active()


class _Unshard(torch.autograd.Function):
    """Hands the unit's whole parameters to forward; its backward is the unit's post-backward."""

    @staticmethod
    def forward(ctx: Any, unit: Unit, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        return tuple(unit.full_views())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.unit.post_backward(grads)
        # The local shards' gradients are set when the reduce-scatter completes, not here.
        return (None,) * (len(grads) + 1)


class Unit:
    """One communication unit: a module's parameters (outside nested units), fully sharded."""

    def __init__(self, module: nn.Module, name: str, plan: UnitPlan, local: Sequence[nn.Parameter],
                 owners: Sequence[Sequence[tuple[nn.Module, str]]], *, group: Any, group_rank: int,
                 reshard_after_forward: bool, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None) -> None:
        self.module = module
        self.name = name
        self.plan = plan
        self.local = list(local)
        self.owners = [list(o) for o in owners]
        self.group = group
        self.group_rank = group_rank
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        dtypes = {p.dtype for p in self.local}
        master = next(iter(dtypes)) if len(dtypes) == 1 else torch.get_default_dtype()
        self.compute_dtype = param_dtype or master
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        device = self.local[0].device if self.local else torch.device("cpu")
        self.unsharded = torch.empty(plan.flat_numel, dtype=self.compute_dtype, device=device)
        self._release()
        self.state = "sharded"  # "sharded" -> "gathering" -> "unsharded"
        self._pending: Any = None  # the gather in flight (comm.PendingExchange)
        self._buffers: list[torch.Tensor] | None = None  # what it sends, kept alive until it completes
        self._versions: list[int] = []
        self.sync = True
        self.accumulated: torch.Tensor | None = None  # whole gradients held while not syncing
        self.accumulated_had: list[bool] = []  # which parameters those held gradients include
        self.order: list[Unit] = []  # for a root: every unit below it, itself first
        self.root: Unit | None = None  # while running: the root of the current forward / backward
        # (unit, reduce-scatter in flight, which gradients it carries, this rank's rows of them, the others'
        # parts of those rows, what it sends: kept alive until it completes)
        self._reductions: list[tuple[Unit, Any, list[bool], list[torch.Tensor], list[torch.Tensor], Any]] = []
        self._callback_queued = False
        self.handles: list[Any] = []
        self.absent = False  # this rank is in no data-parallel group (ranks=[]): it holds no rows

    # -- the unsharded buffer --------------------------------------------------------------------

    def _release(self) -> None:
        if not self.unsharded.is_meta:
            self.unsharded.untyped_storage().resize_(0)

    def adopt(self) -> None:
        """Take the local parameters now in the module's slots (``shard_model`` materializing meta rows).

        Called only while the slots hold the local rows (not inside this unit's forward).

        Raises:
            ValueError: the rows are still on the meta device.
        """
        for i, owners in enumerate(self.owners):
            owner, attr = owners[0]
            current = owner._parameters[attr]
            if current is not self.local[i] and isinstance(current, nn.Parameter):
                self.local[i] = current
        if self.unsharded.is_meta:
            meta = [flat.name for flat, p in zip(self.plan.params, self.local) if p.is_meta]
            if meta:
                msg = (f"{self.label}: parameters {meta[:4]} are still on the meta device; materialize and "
                       f"initialize this rank's rows with st.shard_model(model, composite(), seed=...) (or "
                       f"init=False followed by checkpoint.load) after fully_shard.")
                raise ValueError(msg)
            device = self.local[0].device if self.local else torch.device("cpu")
            self.unsharded = torch.empty(self.plan.flat_numel, dtype=self.compute_dtype, device=device)
            self._release()

    def full_views(self) -> list[torch.Tensor]:
        return [self.unsharded[self.plan.full_slice(p)].view(p.shape) for p in self.plan.params]

    def start_gather(self) -> None:
        """Post the all-gather of this unit's parameters unless they are gathered or on their way."""
        if self.state != "sharded" or not self.plan.params:
            if not self.plan.params:
                self.state = "unsharded"
            return
        self.adopt()
        plan = self.plan
        self.unsharded.untyped_storage().resize_(plan.flat_numel * self.unsharded.element_size())
        mine = [param.detach().reshape(-1).to(self.compute_dtype).contiguous() for param in self.local]
        places = [[self.unsharded[self._rows(flat, r)] for r in range(plan.world)] for flat in plan.params]
        self._pending = _flat.start_gather(mine, places, self.group, self.group_rank,
                                           counted=(plan.world - 1) * plan.segment * self.unsharded.element_size(),
                                           what=f"fully_shard all-gather of {self.label}")
        # This rank's own rows, copied while the others' travel. Autograd may hold views of this
        # buffer from forward; the data put back is the data they saw.
        with torch.no_grad(), _preserve_version(self.unsharded):
            for piece, place in zip(mine, places):
                place[self.group_rank].copy_(piece)
        self._buffers = mine
        self._versions = [p._version for p in self.local]
        self.state = "gathering"

    def _rows(self, flat: FlatParam, group_rank: int) -> slice:
        """Where ``group_rank``'s rows of ``flat`` sit in the unsharded buffer."""
        start, length = flat.rows_of(group_rank)
        base = self.plan.world * flat.offset
        return slice(base + start * flat.row, base + (start + length) * flat.row)

    def wait_gather(self) -> None:
        """Make the whole parameters available in the unsharded buffer (gathering now if needed)."""
        if self.state == "unsharded" and self._versions != [p._version for p in self.local]:
            self.reshard()  # the shards changed since they were gathered (an optimizer step, a load)
        self.start_gather()
        if self.state != "gathering":
            return
        self._complete_gather()
        self.state = "unsharded"

    def _complete_gather(self) -> None:
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.wait()
        finally:
            self._buffers = None

    def reshard(self) -> None:
        """Free the gathered parameters (a gather still in flight is completed first)."""
        if self.state == "gathering":
            self._complete_gather()
        self._release()
        self.state = "sharded"

    @property
    def label(self) -> str:
        return f"the fully sharded {self.name}"

    # -- forward -----------------------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.absent:
            msg = (f"{self.label}: this rank was given ranks=[] (it holds no part of the parameters), so it "
                   f"cannot run the module; run forward only on the ranks of the data-parallel groups.")
            raise ValueError(msg)
        root = _active.root
        if root is None or root is self or self not in root.order:  # (a root left over by a failed forward)
            root = self
            _active.root = self
            if not self.order:
                self.order = [u for m in module.modules() if (u := unit_of(m)) is not None]
        self.root = root
        self.wait_gather()
        order = root.order
        if self in order:
            following = order[order.index(self) + 1:]
            if following:
                following[0].start_gather()  # prefetch: it travels while this unit computes
        if self.plan.params:
            needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.local)
            fulls = _Unshard.apply(self, *self.local) if needs_grad else tuple(self.full_views())
            for full, param, owners in zip(fulls, self.local, self.owners):
                if not param.requires_grad:
                    full = full.detach()
                for owner, attr in owners:
                    owner._parameters[attr] = full
        if self.param_dtype is not None:
            args, kwargs = _cast((args, kwargs), self.param_dtype)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        for param, owners in zip(self.local, self.owners):
            for owner, attr in owners:
                owner._parameters[attr] = param
        root = self.root
        is_root = root is self
        if is_root:
            _active.root = None
        tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward_hook, mode="any")
        if not is_root and self.reshard_after_forward:
            self.reshard()
        elif is_root and not tensors:
            for unit in self.order:  # no backward follows
                unit.reshard()
        return output

    # -- backward ----------------------------------------------------------------------------------

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        root = self.root or self
        if not root._callback_queued:
            root._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root.finish_backward)
        self.wait_gather()
        order = root.order
        if self in order:
            earlier = [u for u in order[:order.index(self)] if u.state == "sharded" and u.plan.params]
            if earlier:
                earlier[-1].start_gather()

    def post_backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Reduce the unit's gradients (or hold them while not syncing), then free its parameters."""
        plan = self.plan
        root = self.root or self
        # The gathered parameters are no longer needed (the gradients do not refer to them): free
        # them before the reduction's buffers are allocated.
        self.reshard()
        if not self.sync:
            if self.accumulated is None:
                self.accumulated = torch.zeros(plan.flat_numel, dtype=self.reduce_dtype, device=self.unsharded.device)
                self.accumulated_had = [False] * len(plan.params)
            for k, (flat, grad) in enumerate(zip(plan.params, grads)):
                if grad is not None:
                    self.accumulated[plan.full_slice(flat)].add_(grad.reshape(-1))
                    self.accumulated_had[k] = True
            return
        root.complete_reductions()  # at most one reduction in flight: bounded memory
        had = [g is not None for g in grads]
        held, self.accumulated = self.accumulated, None
        if held is not None:
            # A parameter that had a gradient in an earlier micro-batch has one now; one that had
            # none in any keeps none (a zero gradient would still move it: weight decay, momentum).
            had = [now or before for now, before in zip(had, self.accumulated_had)]
        world, me = plan.world, self.group_rank
        device = self.unsharded.device
        # Even with no gradient here the reduce-scatter runs: the other ranks may have some.
        wholes = []
        for flat, grad in zip(plan.params, grads):
            whole = (grad.to(self.reduce_dtype) if grad is not None
                     else torch.zeros(flat.shape, dtype=self.reduce_dtype, device=device))
            if held is not None:
                whole = whole + held[plan.full_slice(flat)].view(flat.shape)
            wholes.append(whole)
        # The other ranks' gradients of this rank's rows: one segment per other rank, each its own
        # tensor (the first becomes the reduced buffer the gradients are views of; the others are freed).
        received = [torch.empty(plan.segment, dtype=self.reduce_dtype, device=device) for _ in range(world - 1)]
        pieces: list[list[torch.Tensor]] = []
        places: list[list[torch.Tensor | None]] = []
        for flat, whole in zip(plan.params, wholes):
            # Each other rank's rows, sent from the gradient itself: a weight's gradient often comes
            # transposed (strided), and then only the rows that travel are made contiguous; this
            # rank's own rows are summed where they are.
            pieces.append([_rows(whole, flat, r) if r == me else _rows(whole, flat, r).reshape(-1)
                           for r in range(world)])
            start, stop = _span(flat, me)
            places.append([None if r == me else part for r, part in
                           enumerate(_in_rank_order(None, received, flat.offset, stop - start, me, world))])
        pending = _flat.start_scatter(pieces, places, self.group, me,
                                      counted=(world - 1) * plan.segment * wholes[0].element_size() if wholes else 0,
                                      what=f"fully_shard reduce-scatter of {self.label}")
        root._reductions.append((self, pending, had, [piece[me] for piece in pieces], received, pieces))

    def complete_reductions(self) -> None:
        """Wait for posted reduce-scatters and add the averaged gradients to the local shards."""
        reductions, self._reductions = self._reductions, []
        for unit, pending, had, own, received, _sent in reductions:
            pending.wait()
            unit._assign(unit._reduce(own, received), had)

    def _reduce(self, own: list[torch.Tensor], received: list[torch.Tensor]) -> torch.Tensor:
        """This rank's rows of every gradient: the sum over ranks, in rank order, over the ranks.

        Summed into the first received segment (an element-wise sum may write over one of its
        inputs), so no buffer of its own is allocated.
        """
        plan, me = self.plan, self.group_rank
        out = received[0] if received else torch.empty(plan.segment, dtype=self.reduce_dtype,
                                                        device=self.unsharded.device)
        with torch.no_grad():
            for flat, rows in zip(plan.params, own):
                start, stop = _span(flat, me)
                if start == stop:
                    continue
                shape = flat.local_shape(me)
                parts = [part.view(shape) for part in _in_rank_order(None, received, flat.offset, stop - start, me,
                                                                     plan.world) if part is not None]
                parts.insert(me, rows)
                total = out[flat.offset:flat.offset + stop - start].view(shape)
                if len(parts) == 1:
                    total.copy_(parts[0])
                else:
                    torch.add(parts[0], parts[1], out=total)
                    for part in parts[2:]:
                        total.add_(part)
                total.div_(plan.world)
        return out

    def _assign(self, out: torch.Tensor, had: list[bool]) -> None:
        plan = self.plan
        with torch.no_grad():
            for param, flat, present in zip(self.local, plan.params, had):
                if not present or not param.requires_grad:
                    continue
                _, length = flat.rows_of(self.group_rank)
                grad = out[flat.offset:flat.offset + length * flat.row]
                grad = grad.view(flat.local_shape(self.group_rank)).to(param.dtype)
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)

    def finish_backward(self) -> None:
        """End of backward (root only): complete every reduction, free every unit's parameters."""
        self._callback_queued = False
        self.complete_reductions()
        for unit in self.order:
            unit.reshard()


def _rows(whole: torch.Tensor, flat: FlatParam, group_rank: int) -> torch.Tensor:
    """``group_rank``'s rows of a whole parameter (or gradient), a view."""
    start, length = flat.rows_of(group_rank)
    return whole[start:start + length]


def _span(flat: FlatParam, group_rank: int) -> tuple[int, int]:
    """The elements of ``group_rank``'s rows in a whole (flattened) parameter."""
    start, length = flat.rows_of(group_rank)
    return start * flat.row, (start + length) * flat.row


def _in_rank_order(own: torch.Tensor | None, received: list[torch.Tensor], offset: int, length: int,
                   group_rank: int, world: int) -> list[Any]:
    """Every rank's part of one parameter's rows here, by rank: ``own`` for this rank, the others from
    ``received`` (one segment per other rank, in rank order)."""
    theirs = iter([segment[offset:offset + length] for segment in received])
    return [own if r == group_rank else next(theirs) for r in range(world)]


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x
    return pytree.tree_map(cast, tree)

