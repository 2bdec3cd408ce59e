"""Verified replay of a zone's forward: checked once per input signature, then run plainly.

A zone's forward runs under the propagation engine (``zones._Propagate``), which sees every
torch call. That costs several microseconds per op, most of it Python's dispatch to any
torch function mode. Yet for a given *signature* of the zone's inputs (each tensor's shape,
dtype, device, ``requires_grad`` and split tag; the plain values among the arguments; grad
mode; training mode), the model's code takes the same path every call, as ``torch.compile``'s
guards and CUDA graphs assume too. So:

* The first call of a signature runs checked, and records (:class:`Recording`) whether the
  engine *intervened* anywhere: any op it did not run as the caller wrote it (a gather, a
  view with rewritten sizes, a scatter or ``copy_to_ranks`` of an operand, a pending sum
  added to or summed, a rule it cannot vouch for: a registered one, a ``DFunction``). It also
  records, for each sharded layer called inside, the tags of its tensor inputs (what the
  layer's own code reads to decide how to compute), and the tag, shape and dtype of every
  output leaf.
* If the engine did not intervene, the signature gets a :class:`Plan`. Later calls with that
  signature run the module's forward with no mode: its ops are then exactly the ones the
  checked call ran. Each sharded layer's inputs get the tags they had (so a row-parallel
  layer takes its slice as it is, the same as checked), and the outputs get theirs back, so
  what follows the zone (its exit, or the enclosing zone's rules) sees what it saw.
* A replayed call checks what it can cheaply: the sharded layers are called in the recorded
  order with inputs of the recorded shapes, and the outputs have the recorded shapes and
  dtypes; else it raises :class:`ReplayMismatch`.
* A zone whose checked call intervened stays checked for that signature.

Inputs or outputs holding other objects than tensors, plain values and lists or tuples of
them (a key/value cache) are never replayed: such an object may hold split tensors the zone
reads or fills, which a signature cannot see, and a plain run would leave them untagged.
Nor is a call that receives a pending sum (a ``Partial`` tag on an input, e.g. a block fed
the residual stream of a block before it whose row-parallel result is not summed yet): the
engine runs the ops on it otherwise than written (it sums the value where a norm needs it,
adds a whole tensor once), which a plain run of the zone's code would not do.

``SHARDKIT_ENGINE_REPLAY=0`` in the environment (read at each call) runs every call checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from _shardkit import env as _env
from sharding import layout

__all__ = ["ENV", "enabled", "Recording", "Plan", "Cursor", "ReplayMismatch", "signature", "output_leaves",
           "retag_outputs", "layer_inputs", "set_tag"]

ENV = "SHARDKIT_ENGINE_REPLAY"

# The same attribute as ``zones._TAG`` (a tag lives on the tensor object itself).
_TAG = "_shardkit_split"
# A pending sum made in a recorded call: its number in each recording that counts it.
_MADE = "_shardkit_made"

_PLAIN_VALUES = (bool, int, float, str, torch.dtype, torch.device)


def enabled() -> bool:
    """Whether zones replay verified calls (``SHARDKIT_ENGINE_REPLAY``, read at each call; on by default)."""
    return _env.flag(ENV, default=True, on="to replay calls whose signature was checked already",
                     off="to run every zone call under the checking engine")


class ReplayMismatch(RuntimeError):
    """A replayed zone call did not take the path its checked call took."""


def _tag_of(x: Tensor) -> Any:
    found = x.__dict__
    return found.get(_TAG) if found else None


def set_tag(x: Tensor, tag: Any) -> None:
    """Give ``x`` exactly ``tag`` (``None``: no tag)."""
    if tag is not None:
        setattr(x, _TAG, tag)
    elif x.__dict__ and _TAG in x.__dict__:
        delattr(x, _TAG)


def _leaf(value: Any) -> Any:
    """One argument's part of a signature, or ``None`` if it cannot be part of one."""
    if isinstance(value, Tensor):
        tag = _tag_of(value)
        if isinstance(tag, layout.Partial):
            return None  # a pending sum coming in: the zone's ops on it are not the ones written
        return (value.shape, value.dtype, value.device, value.requires_grad, tag)
    if value is None or isinstance(value, _PLAIN_VALUES):
        return (type(value), value)
    return None


def signature(training: bool, keep_split: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a zone call's path depends on, hashable; ``None`` if the call holds other objects (never replayed).

    Arguments are walked one level deep (a tuple of tensors such as ``position_embeddings``).
    """
    key: list[Any] = [torch.is_grad_enabled(), training, keep_split]
    for value in (*args, *kwargs.values()):
        found = _leaf(value)
        if found is None:
            if not isinstance(value, (list, tuple)) or hasattr(value, "_fields"):
                return None
            inner = []
            for item in value:
                leaf = _leaf(item)
                if leaf is None:
                    return None
                inner.append(leaf)
            found = (type(value), tuple(inner))
        key.append(found)
    key.append(tuple(kwargs))
    return tuple(key)


def output_leaves(value: Any, found: list[Any]) -> bool:
    """Append ``value``'s leaves (walked as a zone's exit walks them) to ``found``; ``False`` if one is an object."""
    if isinstance(value, Tensor):
        found.append(value)
        return True
    if value is None or isinstance(value, _PLAIN_VALUES):
        found.append(value)
        return True
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return all(output_leaves(v, found) for v in value)
    if isinstance(value, dict):  # plain dicts and transformers' ModelOutput
        return all(output_leaves(v, found) for v in value.values())
    return False


def layer_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """A sharded layer's tensor inputs, one level deep."""
    found = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(x for x in v if isinstance(x, Tensor))
    return found


@dataclass(frozen=True)
class LayerCall:
    """A sharded layer called inside a zone: the module, and its tensor inputs' tags and shapes."""

    module: torch.nn.Module
    tags: tuple[Any, ...]
    shapes: tuple[torch.Size, ...]


@dataclass(frozen=True)
class OutputLeaf:
    """One leaf of a zone's output: a tensor's tag, shape and dtype, or a plain value's type."""

    kind: type
    tag: Any = None
    shape: torch.Size | None = None
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Plan:
    """How to replay one signature of a zone: its sharded layers' input tags, its outputs' tags."""

    layers: tuple[LayerCall, ...]
    outputs: tuple[OutputLeaf, ...]
    pending: bool = False  # pending sums met whole tensors or were summed: ops on them go through the engine
    # The pending sums made in the call (by a sharded layer or an op on pending sums, counted in order)
    # whose first use was their sum: a replay sums them where they are made and hands out the sum.
    sum_first: frozenset[int] = frozenset()


@dataclass
class Recording:
    """What a checked zone call saw: the first intervention (why it cannot replay), its sharded layer calls."""

    reason: str | None = None
    pending: bool = False  # pending sums were made: a replay hands them out as ``_PendingTensor``s
    layers: list[LayerCall] = field(default_factory=list)
    # Per pending sum made, in order: how it was first used ("summed", "consumed"), or "unused" yet.
    made: list[str] = field(default_factory=list)
    # What this recording's numbers on the pending sums' tensors are filed under. A tensor holds its
    # number itself (``_MADE``): the recording keeps no tensor alive, its memory is the forward's own.
    _key: object = field(default_factory=object)

    def layer(self, module: torch.nn.Module, inputs: list[Tensor]) -> None:
        self.layers.append(LayerCall(module, tuple(_tag_of(x) for x in inputs), tuple(x.shape for x in inputs)))

    def made_pending(self, tensor: Tensor) -> None:
        """A new pending sum, ``tensor``, was made (by a sharded layer or an op on pending sums).

        A replay then hands out its pending sums as ``_PendingTensor``s: whatever the zone does with
        one (adds a whole tensor to it, on one rank only) goes through the engine as it did here.
        """
        numbers = tensor.__dict__.get(_MADE)
        if numbers is None:
            numbers = {}
            setattr(tensor, _MADE, numbers)
        numbers[self._key] = len(self.made)
        self.made.append("unused")
        self.pending = True

    def first_use(self, tensor: Tensor, how: str) -> None:
        """``tensor`` was used (``"summed"``, or ``"consumed"`` by anything else); only its first use counts."""
        numbers = tensor.__dict__.get(_MADE)
        i = numbers.get(self._key) if numbers else None
        if i is not None and self.made[i] == "unused":
            self.made[i] = how

    def plan(self, out: Any, outermost: bool) -> Plan | str:
        """The plan of this call given its output ``out``, or why it is not replayable.

        Only an outermost zone replays: a nested one runs under its enclosing zone's engine,
        which resolves the pending sums it receives and hands out rank by rank (a whole tensor
        added on one rank only); a plain run of the nested zone's code would not.
        """
        if self.reason is not None:
            return self.reason
        if not outermost:
            return "a zone nested in a checked one runs under that zone's engine"
        leaves: list[Any] = []
        if not output_leaves(out, leaves):
            return "it returns objects other than tensors, plain values and containers of them"
        outputs = tuple(OutputLeaf(Tensor, _tag_of(x), x.shape, x.dtype) if isinstance(x, Tensor)
                        else OutputLeaf(type(x)) for x in leaves)
        # A pending sum handed out of the zone is summed by its exit: it must leave a replay pending too.
        handed_out = any(isinstance(leaf.tag, layout.Partial) for leaf in outputs)
        sum_first = frozenset() if handed_out else frozenset(i for i, how in enumerate(self.made) if how == "summed")
        return Plan(tuple(self.layers), outputs, self.pending, sum_first)


class Cursor:
    """A replay in progress: the next sharded layer call expected."""

    __slots__ = ("plan", "root", "next", "made")

    def __init__(self, plan: Plan, root: torch.nn.Module) -> None:
        self.plan, self.root, self.next = plan, root, 0
        self.made = 0  # pending sums made so far (as counted by ``Recording.made``)

    def _mismatch(self, what: str) -> ReplayMismatch:
        zone = f"{type(self.root).__name__} ({type(self.root).__module__})"
        return ReplayMismatch(
            f"zone {zone}: a replayed call {what}, unlike the checked call of the same input signature; the "
            f"zone's code takes another path for the same input shapes, dtypes, tags and flags (it depends on "
            f"something else: values, global state). Set {ENV}=0 to check every call of every zone.")

    def layer(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Give a sharded layer's inputs (its call's ``args`` and ``kwargs``) the tags they had in the checked call."""
        layers = self.plan.layers
        if self.next >= len(layers):
            raise self._mismatch(f"called sharded layer {type(module).__name__} after the {len(layers)} the "
                                 f"checked call made")
        want = layers[self.next]
        if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):  # the usual ``layer(x)``: no walk
            x = args[0]
            if want.module is module and len(want.shapes) == 1 and x.shape == want.shapes[0]:
                self.next += 1
                _retag_input(x, want.tags[0])
                return
        inputs = layer_inputs(args, kwargs)
        if want.module is not module or len(inputs) != len(want.shapes) or any(
                x.shape != shape for x, shape in zip(inputs, want.shapes)):
            raise self._mismatch(
                f"called sharded layer {type(module).__name__} with inputs of shapes "
                f"{[tuple(x.shape) for x in inputs]} as call {self.next + 1}, where the checked call called "
                f"{type(want.module).__name__} with {[tuple(s) for s in want.shapes]}")
        self.next += 1
        for x, tag in zip(inputs, want.tags):
            _retag_input(x, tag)

    def finish(self, out: Any) -> None:
        """Check the layer calls are all made and the outputs are as recorded; tag the outputs."""
        if self.next != len(self.plan.layers):
            raise self._mismatch(f"made {self.next} sharded layer calls where the checked call made "
                                 f"{len(self.plan.layers)}")
        retag_outputs(out, self.plan.outputs, self._mismatch)


def _retag_input(x: Tensor, tag: Any) -> None:
    """Give a replayed sharded layer's input ``x`` the tag it had in the checked call.

    Except a pending sum's: a replay hands every pending sum out tagged already, or, where the
    checked call summed it first, as its plain sum, which the checked call's layer read too (the
    sum it took is kept); tagged again, the sum would be summed once more.
    """
    if isinstance(tag, layout.Partial):
        return
    if tag is not None or x.__dict__:
        set_tag(x, tag)


def retag_outputs(out: Any, outputs: tuple[OutputLeaf, ...], mismatch: Any) -> None:
    leaves: list[Any] = []
    if not output_leaves(out, leaves) or len(leaves) != len(outputs):
        raise mismatch(f"returned {len(leaves)} output leaves where the checked call returned {len(outputs)}")
    for i, (x, want) in enumerate(zip(leaves, outputs)):
        if isinstance(x, Tensor):
            if want.kind is not Tensor or x.shape != want.shape or x.dtype != want.dtype:
                raise mismatch(f"returned a tensor of shape {tuple(x.shape)} and dtype {x.dtype} as output leaf "
                               f"{i}, where the checked call returned {want.kind.__name__} {want.shape} {want.dtype}")
            set_tag(x, want.tag)
        elif type(x) is not want.kind:
            raise mismatch(f"returned a {type(x).__name__} as output leaf {i}, where the checked call returned a "
                           f"{want.kind.__name__}")
