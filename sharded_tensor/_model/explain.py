"""``st.explain``: the plan the engine infers for a sharded model, shown per zone, counted on a real call.

Hand-written tensor parallelism (torchtitan's ``apply_tp``, Megatron's layers) shows every
collective in its code. shardkit infers them from the parameters' layouts and the model's own
code, so it owes the reader a printout of what it inferred: which modules run as zones, which
sharded layers each holds and what they hand out, the collectives each zone's forward and
backward perform (counted on one real call, bytes included), and every op that ran on
gathered tensors because no rule kept its inputs split, with why.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from _shardkit import comm as _comm

from .engine.state import STATE
from .engine.zone import ZoneForward

__all__ = ["explain", "Explanation", "ZoneReport"]

OUTSIDE = "(outside any zone)"


@dataclass
class ZoneReport:
    """One zone (or ``count`` alike: the same layers, collectives and fallbacks each) in an :class:`Explanation`.

    The numbers are one zone's; the totals of the :class:`Explanation` count every zone.
    """

    name: str
    module_type: str
    layers: list[str] = field(default_factory=list)
    forward: Counter[str] = field(default_factory=Counter)
    forward_bytes: Counter[str] = field(default_factory=Counter)
    backward: Counter[str] = field(default_factory=Counter)
    backward_bytes: Counter[str] = field(default_factory=Counter)
    gathered: Counter[str] = field(default_factory=Counter)
    summed: Counter[str] = field(default_factory=Counter)
    count: int = 1

    def lines(self) -> list[str]:
        title = f"zone {self.name!r} ({self.module_type})" if self.name != OUTSIDE else OUTSIDE
        if self.count > 1:
            title += f", {self.count} alike"
        out = [title]
        if self.layers:
            out.append(f"  sharded layers: {'; '.join(self.layers)}")
        out.append(f"  forward:  {_comm_line(self.forward, self.forward_bytes)}")
        out.append(f"  backward: {_comm_line(self.backward, self.backward_bytes)}")
        if self.summed:
            out.append("  pending sums summed by: " + ", ".join(f"{op} ({n})" for op, n in sorted(self.summed.items())))
        if self.gathered:
            out.append("  ran on gathered tensors: " + "; ".join(f"{why} ({n})"
                                                                  for why, n in sorted(self.gathered.items())))
        return out


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _comm_line(counts: Counter[str], nbytes: Counter[str]) -> str:
    if not counts:
        return "no communication"
    return ", ".join(f"{op} {n} ({_size(nbytes[op])})" for op, n in sorted(counts.items()))


@dataclass
class Explanation:
    """What ``st.explain`` found: one report per zone (zones alike merged), and the totals.

    ``str()`` gives the printout; the fields hold the same numbers for code that checks them.
    """

    model_type: str
    world: int
    backward: bool
    zones: list[ZoneReport]
    forward_total: Counter[str]
    backward_total: Counter[str]
    forward_bytes: Counter[str]
    backward_bytes: Counter[str]

    def __str__(self) -> str:
        what = "one forward and backward" if self.backward else "one forward (its output gives no backward)"
        lines = [f"{self.model_type} on {self.world} ranks: {what}, as rank 0 saw it"]
        for zone in self.zones:
            lines.extend(zone.lines())
        lines.append(f"total forward:  {_comm_line(self.forward_total, self.forward_bytes)}")
        if self.backward:
            lines.append(f"total backward: {_comm_line(self.backward_total, self.backward_bytes)}")
        return "\n".join(lines)


class Recorder:
    """What the engine tells while ``explain`` runs (``engine.state.STATE.explaining``)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.stack: list[str] = []
        self.backward = False
        self.zones: dict[str, ZoneReport] = {}
        self.layer_roles = _layer_roles(model)

    def _zone(self, name: str) -> ZoneReport:
        found = self.zones.get(name)
        if found is None:
            found = self.zones[name] = ZoneReport(name, "")
        return found

    def current(self) -> str:
        """The innermost zone open now."""
        return self.stack[-1] if self.stack else OUTSIDE

    def enter(self, module: nn.Module) -> None:
        name = self.names.get(id(module), type(module).__name__)
        self._zone(name).module_type = type(module).__name__
        self.stack.append(name)

    def leave(self, module: nn.Module) -> None:
        self.stack.pop()

    def layer(self, module: nn.Module) -> None:
        zone = self._zone(self.current())
        name = self.names.get(id(module), type(module).__name__)
        prefix = f"{zone.name}." if zone.name and zone.name != OUTSIDE else ""
        shown = f"{name[len(prefix):] if name.startswith(prefix) else name} {self.layer_roles.get(id(module), '')}"
        if shown.strip() not in [entry.strip() for entry in zone.layers]:
            zone.layers.append(shown.strip())

    def fallback(self, func: Any, why: str, summed: bool) -> None:
        zone = self._zone(self.current())
        if summed:
            zone.summed[_op_name(func)] += 1
        else:
            zone.gathered[why] += 1

    def collective(self, op: str, nbytes: int) -> None:
        zone = self._zone(self.current())
        if self.backward:
            zone.backward[op] += 1
            zone.backward_bytes[op] += nbytes
        else:
            zone.forward[op] += 1
            zone.forward_bytes[op] += nbytes

    @contextlib.contextmanager
    def at(self, zone: str) -> Iterator[None]:
        """Attribute what happens in the block (a collective of a backward) to ``zone``."""
        self.stack.append(zone)
        try:
            yield
        finally:
            self.stack.pop()


def _op_name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return re.sub(r"^(TensorBase|_TensorBase|Tensor)\.", "", str(name))


def _layer_roles(model: nn.Module) -> dict[int, str]:
    """What each sharded layer hands out, in words, from its plan's activations."""
    roles = {}
    for _, module in model.named_modules():
        plan = module.__dict__.get("_shardkit_plan")
        if plan is not None:
            roles[id(module)] = f"({plan.handler.describe(plan.inner)})"
    return roles


def _scalar_loss(out: Any) -> torch.Tensor | None:
    """The tensor ``explain`` runs backward from: a scalar loss in the output, else the sum of its first
    floating tensor that needs a gradient (the same graph a loss on it would give); ``None`` if none."""
    loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else None
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.dim() == 0:
        return loss
    leaves = [out] if isinstance(out, torch.Tensor) else [
        v for v in (out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else [])
        if isinstance(v, torch.Tensor)]
    for t in leaves:
        if t.requires_grad and t.is_floating_point():
            return t if t.dim() == 0 else t.sum()
    return None


def explain(model: nn.Module, *args: Any, **kwargs: Any) -> Explanation:
    """Run one forward (and backward, where the output allows it) and report the plan the engine inferred.

    Collective: every rank calls it with its own inputs, as for a forward. Per zone (the modules
    whose forward runs on split activations), the report gives the sharded layers it holds
    and what they hand out, the collectives its forward and backward perform with their bytes
    (as this rank sends them), the ops on pending sums that summed them, and every op that ran
    on gathered tensors because no rule kept its inputs split, with why. Zones alike (the same
    layers, collectives and fallbacks) are shown once, with their number.

    The backward runs from the output's ``loss`` when it has a scalar one, else from the sum of
    its first tensor that needs a gradient; parameters' gradients and the random generators are
    left as they were.

    Args:
        model: a model sharded by ``st.shard_model``.
        *args: the forward's positional arguments.
        **kwargs: the forward's keyword arguments (``labels=`` gives a loss to run backward from).

    Returns:
        An :class:`Explanation`; ``print(st.explain(model, ids))`` shows it.

    Example:
        >>> print(st.explain(model, ids, labels=ids))  # doctest: +SKIP
        LlamaForCausalLM on 2 ranks: one forward and backward, as rank 0 saw it
        zone 'model.layers.*.self_attn' (LlamaAttention), 2 alike
          sharded layers: q_proj (output split); k_proj (output split); ...
    """
    if not any(isinstance(m.__dict__.get("forward"), ZoneForward) for m in model.modules()):
        msg = (f"explain() needs a model sharded by st.shard_model with split layers; {type(model).__name__} has "
               f"no zone (no module of it runs on split activations).")
        raise ValueError(msg)
    recorder = Recorder(model)
    grads = {p: p.grad for p in model.parameters()}
    previous = STATE.explaining
    STATE.explaining = recorder
    ran_backward = False
    try:
        with torch.random.fork_rng(devices=[]), _comm.observed(recorder.collective):
            out = model(*args, **kwargs)
            loss = _scalar_loss(out)
            if loss is not None:
                recorder.backward = True
                loss.backward()
                ran_backward = True
    finally:
        STATE.explaining = previous
        for p, g in grads.items():
            p.grad = g
    return _explanation(model, recorder, ran_backward)


def _explanation(model: nn.Module, recorder: Recorder, backward: bool) -> Explanation:
    groups: dict[Any, ZoneReport] = {}
    for report in recorder.zones.values():
        pattern = re.sub(r"\.\d+\.", ".*.", f".{report.name}.").strip(".") if report.name != OUTSIDE else OUTSIDE
        signature = (pattern, report.module_type, tuple(report.layers), *(tuple(sorted(c.items())) for c in (
            report.forward, report.forward_bytes, report.backward, report.backward_bytes, report.gathered,
            report.summed)))
        if signature in groups:
            groups[signature].count += 1
            groups[signature].name = pattern
        else:
            groups[signature] = ZoneReport(report.name, report.module_type, list(report.layers),
                                           report.forward, report.forward_bytes, report.backward,
                                           report.backward_bytes, report.gathered, report.summed)
    totals = [Counter[str]() for _ in range(4)]
    for report in recorder.zones.values():
        for total, part in zip(totals, (report.forward, report.backward, report.forward_bytes, report.backward_bytes)):
            total.update(part)
    _, world = _comm.rank_and_world(None)
    return Explanation(type(model).__name__, world, backward, list(groups.values()), *totals)
