"""Replicated parameters that drift apart between ranks, caught at the optimizer step that does it.

A parameter ``shard_model`` leaves whole (a norm's weight, a bias, an embedding the spec does
not name) is one tensor held by every rank of the group, and it stays one tensor only if
every rank applies the same update to it. A per-rank update breaks that silently: most often
``torch.nn.utils.clip_grad_norm_`` on a tensor-parallel model, where each rank clips with the
norm of its own shards, so each scales the replicated gradients by a different factor. The
losses stay equal on every rank for a while, and nothing fails until a checkpoint is saved.

So ``shard_model`` registers the model's replicated parameters here, and an optimizer
step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``, installed once)
checks them after each step of an optimizer that holds some: every rank computes a CRC-32C of
the bytes of each replicated parameter it holds, the ranks of the parameter's group gather
them (one small all-gather per group and step), and a parameter whose checksums differ
raises the same ``RuntimeError`` on every rank, naming the parameters, the ranks, the likely
cause and the fix. The cost is one pass over the replicated parameters' bytes at checksum
speed, and one all-gather of a few hundred bytes (scripts/bench/tp_llama.py ``--replica-check``
measures it against the step: 0.2% of a tensor-parallel Llama step).

``SHARDKIT_CHECK_REPLICAS=0`` turns the check off (read at each step). Not checked: steps
taken under ``torch.compile``, the zero step ``optim_state_dict`` takes to build the optimizer
state's template (it restores the parameters), and blocks ``shard_model(..., init=False)``
left without values until a load fills them (they hold whatever the memory held).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from _shardkit import comm as _comm
from _shardkit import unfilled as _unfilled
from _shardkit.env import flag

from .record import record_of

__all__ = ["watch", "paused", "ENV"]

ENV = "SHARDKIT_CHECK_REPLICAS"


@dataclass(frozen=True)
class _Watched:
    """A replicated parameter: its name in the model, and the group whose ranks all hold it."""

    name: str
    group: _comm.ProcessGroup


# id(parameter) -> (a weak reference to it, what it is). Weak: a parameter replaced in its model
# (fully_shard's rows, load_state_dict(assign=True)) leaves by itself, and a new one is not
# watched. Keyed by id, since a tensor's == compares values.
_WATCHED: dict[int, tuple[weakref.ref[torch.Tensor], _Watched]] = {}
# Optimizer -> (the identities of its parameters, the watched ones among them), so a step looks
# the parameters up only when the optimizer's parameters change.
_PLANS: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple[int, ...], list[tuple[torch.Tensor, _Watched]]]]
_PLANS = weakref.WeakKeyDictionary()
_HOOK: Any = None
_PAUSED = threading.local()


def watch(model: nn.Module, group: _comm.ProcessGroup) -> None:
    """Check ``model``'s replicated parameters after each optimizer step. Called by ``shard_model``.

    A parameter is replicated when every rank of its group holds all of it: one with no
    record (left whole by the spec) on the ranks of ``group``, or one laid out as a replica.
    In a world of one there is nothing to compare, and nothing is registered.
    """
    global _HOOK
    _, world = _comm.rank_and_world(group)
    for name, param in model.named_parameters():
        record = record_of(param)
        if record is None:
            watched = _Watched(name, group) if world > 1 else None
        elif record.layout.kind == "replicated" and _comm.rank_and_world(record.group)[1] > 1:
            watched = _Watched(name, record.group)
        else:
            watched = None  # sharded now, perhaps replicated by an earlier shard_model
        _WATCHED.pop(id(param), None)
        if watched is not None:
            _WATCHED[id(param)] = (weakref.ref(param, functools.partial(_forget, id(param))), watched)
    if _HOOK is None and _WATCHED:
        _HOOK = register_optimizer_step_post_hook(_after_step)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No check in this block: for a step that restores the parameters it changed (the optimizer
    state's template, ``optim._initialize``), whose parameters may still be uninitialized."""
    before = getattr(_PAUSED, "on", False)
    _PAUSED.on = True
    try:
        yield
    finally:
        _PAUSED.on = before


def _forget(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    if key in _WATCHED and _WATCHED[key][0] is ref:
        del _WATCHED[key]


def _lookup(param: torch.Tensor) -> _Watched | None:
    found = _WATCHED.get(id(param))
    return found[1] if found is not None and found[0]() is param else None


def _plan(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, _Watched]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    key = tuple(map(id, params))
    cached = _PLANS.get(optimizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    found = [(p, w) for p in {id(p): p for p in params}.values() if (w := _lookup(p)) is not None]
    _PLANS[optimizer] = (key, found)
    return found


def _after_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    if not _WATCHED or getattr(_PAUSED, "on", False) or torch.compiler.is_compiling():
        return
    # Still watched (not sharded since by another shard_model), and filled: blocks allocated by
    # shard_model(init=False) and not loaded yet hold whatever memory held, which is no drift.
    watched = [(p, w) for p, w in _plan(optimizer) if _lookup(p) is w and not _unfilled.is_marked(p)]
    if not watched or not flag(ENV, default=True, on="to check replicated parameters after each optimizer step",
                               off="to skip the check"):
        return
    by_group: dict[int, tuple[_comm.ProcessGroup, list[tuple[torch.Tensor, _Watched]]]] = {}
    for param, w in watched:
        by_group.setdefault(id(w.group), (w.group, []))[1].append((param, w))
    for group, members in by_group.values():
        _check(optimizer, group, members)


def checksums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """A CRC-32C of each tensor's bytes (on the CPU; other devices are copied there first)."""
    out = []
    for tensor in tensors:
        data = tensor.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous().reshape(-1).view(torch.uint8)
        out.append(crc32c.crc32c(data.numpy().data))
    return out


def _check(optimizer: torch.optim.Optimizer, group: _comm.ProcessGroup,
           members: Sequence[tuple[torch.Tensor, _Watched]]) -> None:
    mine = torch.tensor(checksums(p for p, _ in members), dtype=torch.int64)
    everyone = _comm.all_gather_tensor(mine, group, what="the check of replicated parameters after an optimizer step")
    table = torch.stack(everyone)
    differ = (table != table[0]).any(dim=0)
    if not bool(differ.any()):
        return
    names = [w.name for (_, w), d in zip(members, differ.tolist()) if d]
    first = int(differ.nonzero()[0, 0])
    ranks = [r for r in range(len(everyone)) if int(table[r, first]) != int(table[0, first])]
    more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
    msg = (f"replicated parameters drifted apart between ranks in this step of {type(optimizer).__name__}: "
           f"{names[:5]}{more} of the {len(members)} parameters that are whole on every rank now differ between "
           f"rank 0 and rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of the model's group. "
           f"Each rank holds its own copy of such a parameter, and the copies stay equal only if every rank "
           f"applies the same update. The usual cause is torch.nn.utils.clip_grad_norm_ on a sharded model: each "
           f"rank clips with the norm of its own shards and scales the replicated gradients by its own factor; use "
           f"st.clip_grad_norm_(model, max_norm) instead, which clips by the norm of the whole model on every "
           f"rank. Any other update of a replicated parameter on some ranks only has the same effect (a gradient "
           f"scaled, masked or reduced per rank, a value written on one rank): make it on every rank alike, or "
           f"sum the gradients over the ranks that share the parameter (st.all_reduce_grads for data-parallel "
           f"replicas). Training on would let the copies diverge further, and checkpoint.save would refuse "
           f"them. {ENV}=0 turns this check off.")
    raise RuntimeError(msg)
