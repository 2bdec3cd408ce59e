"""The one table of how ops compute on placed activations: per op, one rule per placement kind.

A *rule* looks at an op call as metadata only (:class:`Call`: the op, its arguments with each
tensor replaced by a meta tensor of the same local shape, dtype and placement) and returns a
:class:`Decision`: which arguments move first (cut to this rank's slice, copied to the ranks,
summed, added once), what runs (the op itself, or the op with this rank's sizes), and the
placement of each output. Or it raises :class:`Fallback`: the op then runs on whole tensors
(its placed inputs gathered or summed first), which costs communication, never correctness.
Because a decision depends only on what a :class:`Call` shows, the dispatcher caches it
(``dispatch``), and every rank, seeing the same shapes and placements, decides alike, so the
collectives of a fallback always match.

The table is keyed by what the model calls (``torch.add``, ``Tensor.add``, ``Tensor.__add__``,
a ``torch.library`` operator, a ``DFunction`` subclass), and each entry holds one rule per
placement kind (``Split``, ``Packed``, ``Partial``, ``Strided``). The same dictionary also holds
the two other registrations a sharded model looks up (the keys cannot collide):

========================================  ===============================================================
key                                       value
========================================  ===============================================================
an op, or a ``DFunction`` subclass        its :class:`OpRules`: a rule per placement kind
an ``nn.Module`` type                     its ``ShardedModule``: how the module computes with split
                                          parameters (``registry``)
``LayoutRuleName(name)``                  a layout rule: where a ``DFunction``'s ``ShardedTensor``
                                          arguments must be, and its output's layout (``dfunction``)
========================================  ===============================================================

shardkit's own rules are *declared* by name by the modules that define them (``split``,
``pending``, ``strided``, ``loss``) and resolved into op objects when the table is first used
(reading ATen's op tags takes a while); ``register`` adds a rule for given op objects, which is
what ``st.register_split_rule`` does.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import SUPPORTED_NODES

from .placements import Packed, Partial, Placement, Split, Strided
from .signatures import aten_name, bind

__all__ = ["Fallback", "Decision", "Call", "Each", "OpRules", "LayoutRuleName", "RULES", "METADATA", "KINDS",
           "GENERATION", "BUILT", "VALUE_GETTERS", "is_container", "children", "leaves_of", "with_leaves",
           "declare", "register", "rules_of", "table", "generation", "op_objects", "pointwise_names", "in_place",
           "norm_dim"]

KINDS: tuple[type, ...] = (Split, Packed, Partial, Strided)
"""The placement kinds a rule is registered for."""


class Fallback(Exception):  # noqa: N818 - a signal between a rule and the dispatcher, not an error
    """No rule applies to this call: the op runs on whole tensors."""


Move = Callable[[Any], Any]


@dataclass(frozen=True)
class Each:
    """Every tensor of a tuple or list output gets ``placement``."""

    placement: Placement


def is_container(value: Any) -> bool:
    """Whether the engine walks into ``value``: ``torch.utils._pytree``'s containers (lists, tuples, named
    tuples, dicts, and any other type registered with it)."""
    return isinstance(value, (list, tuple, dict)) or type(value) in SUPPORTED_NODES


def children(value: Any) -> list[Any]:
    """The items of a container (as :func:`is_container` knows them), in order."""
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return list(SUPPORTED_NODES[type(value)].flatten_fn(value)[0])


def leaves_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The leaves of an op's arguments: every value of ``(args, kwargs)`` that is not a container, in order.

    The one walk of an op's arguments (the dispatcher's key walk follows the same order):
    containers are what ``torch.utils._pytree`` takes apart; a dict's values come in its order.
    """
    found: list[Any] = []

    def walk(value: Any) -> None:
        if is_container(value):
            for child in children(value):
                walk(child)
        else:
            found.append(value)

    for v in args:
        walk(v)
    for v in kwargs.values():
        walk(v)
    return found


def with_leaves(args: tuple[Any, ...], kwargs: dict[str, Any],
                leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with their leaves (as :func:`leaves_of` lists them) replaced by ``leaves``."""
    it = iter(leaves)

    def build(value: Any) -> Any:
        if not is_container(value):
            return next(it)
        if type(value) is tuple or type(value) is list:
            return type(value)([build(x) for x in value])
        if isinstance(value, dict):
            out = {k: build(v) for k, v in value.items()}
            return out if type(value) is dict else type(value)(out)
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*[build(x) for x in value])
        if isinstance(value, (list, tuple)):
            return type(value)([build(x) for x in value])
        node = SUPPORTED_NODES[type(value)]
        items, context = node.flatten_fn(value)
        return node.unflatten_fn([build(x) for x in items], context)

    return tuple(build(a) for a in args), {k: build(v) for k, v in kwargs.items()}


@dataclass(frozen=True, slots=True)
class Decision:
    """What the dispatcher does with one op call.

    Attributes:
        moves: ``(leaf index, move)`` for the arguments that move before the op runs (a whole
            operand cut to this rank's slice, copied to the ranks, added once, or a placed one
            made whole); leaves are the call's arguments flattened as ``Call.leaves`` lists them.
        run: what runs instead of the op, with the moved arguments (the op with this rank's
            sizes, a rule's own computation); ``None``: the op itself.
        out: the output's placement: a placement, :class:`Each`, a tuple of them (one per output
            element), or ``None`` (the output is whole, or ``run`` placed it itself).
        written: ``(leaf index, placement)`` of arguments the op writes in place and that hold
            that placement afterwards (a key/value cache filled with split keys).
        gathered: why the op runs on whole tensors (a fallback), for ``st.explain``.
        summed: the fallback only summed pending sums (what they are for), gathering nothing.
    """

    moves: tuple[tuple[int, Move], ...] = ()
    run: Callable[..., Any] | None = None
    out: Any = None
    written: tuple[tuple[int, Placement], ...] = ()
    gathered: str | None = None
    summed: bool = False
    plain: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The usual decision, which the dispatcher runs without the general path: the op as written,
        # its one output placed (or left whole).
        plain = not self.moves and self.run is None and not self.written and self.gathered is None \
            and type(self.out) is not Each and type(self.out) is not tuple
        object.__setattr__(self, "plain", plain)


@dataclass
class Call:
    """An op call as a rule sees it: metadata only.

    Each tensor among the arguments is a meta tensor with the local shape, dtype and
    ``requires_grad`` of the real one, tagged with the same placement; everything else is as
    given. ``leaves`` lists the arguments' leaves (:func:`leaves_of`): a move names an argument
    by its index there.
    """

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaves: list[Any]
    grad: bool

    def rebuilt(self, replaced: dict[int, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with the leaves at the indices of ``replaced`` replaced."""
        if not replaced:
            return self.args, self.kwargs
        return with_leaves(self.args, self.kwargs, [replaced.get(i, x) for i, x in enumerate(self.leaves)])

    def meta_out(self, replaced: dict[int, Any] | None = None) -> Any:
        """The op run on the meta arguments (leaves replaced as given); ``None`` if it cannot run on meta."""
        args, kwargs = self.rebuilt(replaced or {})
        try:
            return self.func(*args, **kwargs)
        except (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError):
            return None

    @property
    def name(self) -> str:
        """The op's ATen name (``__add__`` -> ``add``)."""
        return aten_name(self.func)

    def index(self, tensor: torch.Tensor) -> int:
        """The leaf index of ``tensor`` (found by identity: a number may stand at several places)."""
        assert isinstance(tensor, torch.Tensor), tensor
        for i, leaf in enumerate(self.leaves):
            if leaf is tensor:
                return i
        raise Fallback

    def arg_index(self, position: int) -> int:
        """The leaf index of positional argument ``position`` (which must not be a container)."""
        return len(leaves_of(self.args[:position], {}))

    def bound(self) -> dict[str, Any]:
        """The arguments by name, bound as torch binds them (``signatures``); ``Fallback`` if nothing fits."""
        found = bind(self.func, self.args, self.kwargs)
        if found is None:
            raise Fallback
        return found

    def tensors(self) -> list[torch.Tensor]:
        """The tensor arguments, in leaf order."""
        return [x for x in self.leaves if isinstance(x, torch.Tensor)]


Rule = Callable[[Call], Decision]


@dataclass
class OpRules:
    """The rules of one op (or ``DFunction``): one per placement kind it has a rule for."""

    by_kind: dict[type, Rule] = field(default_factory=dict)


@dataclass(frozen=True)
class LayoutRuleName:
    """The key of a layout rule registered under ``name``."""

    name: str


RULES: dict[Any, Any] = {}
"""The one table (see the module's docstring). Op entries appear once :func:`table` has run."""

METADATA = OpRules()
"""The entry of ops that read what a tensor is (shape, dtype, device), never its values."""

_METADATA_NAMES = {
    "size", "dim", "stride", "is_contiguous", "is_floating_point", "is_complex", "element_size", "data_ptr", "__len__",
    "storage_offset", "get_device", "untyped_storage", "__hash__", "__format__", "__repr__", "__str__", "has_names",
    "_is_view", "is_inference", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "backward",
    "__reduce_ex__", "__deepcopy__", "__setstate__", "__dlpack__", "__dlpack_device__", "nelement", "numel",
    "ndimension"}

Names = Iterable[str] | Callable[[], Iterable[str]]
_DECLARED: list[tuple[Names, type, Rule]] = []
_BUILT = False
BUILT = [False]
"""``[True]`` once :func:`table` has built the table: then ``RULES`` answers for every op directly."""
GENERATION = [0]
"""``[n]``: ``n`` changes whenever a rule is registered (decisions cached before are then stale)."""


def generation() -> int:
    """A number that changes whenever a rule is registered (cached decisions are then stale)."""
    return GENERATION[0]


def declare(names: Names, kind: type, rule: Rule) -> None:
    """shardkit's own rule for the ops named ``names`` (ATen or Python names; or a function giving
    them, called when the table is built) on ``kind``. A later declaration for the same op and
    kind replaces an earlier one (a specific rule declared after a family's)."""
    if kind not in KINDS:
        msg = f"kind must be one of {[k.__name__ for k in KINDS]}, got {kind!r}."
        raise ValueError(msg)
    if _BUILT:
        msg = "shardkit's own rules are declared when their modules are imported, before the table is built."
        raise RuntimeError(msg)
    _DECLARED.append((names, kind, rule))


def op_objects(name: str) -> list[Any]:
    """Every object through which code calls the op ``name``: Tensor method, torch and functional forms.

    A Tensor attribute that is a descriptor (``x.T``, ``x.real``) is called through its
    ``__get__``, which is what torch hands the engine.
    """
    found = []
    for owner in (torch.Tensor, torch, F, torch._C._nn, torch.special):
        obj = getattr(owner, name, None)
        if owner is torch.Tensor and isinstance(obj, types.GetSetDescriptorType):
            found.append(obj.__get__)
        elif obj is not None and callable(obj) and not isinstance(obj, type) and not _module_own(obj):
            found.append(obj)
    if name.startswith("linalg_"):  # torch.linalg.solve_triangular is ATen's linalg_solve_triangular
        obj = getattr(torch.linalg, name[len("linalg_"):], None)
        if obj is not None and callable(obj):
            found.append(obj)
    return found


def _module_own(obj: Any) -> bool:
    """Whether ``obj`` is a method of a module object itself (``torch.__eq__``, ``F.__hash__``): what a module
    inherits from ``object``, which compares or hashes the module, never a tensor."""
    return isinstance(getattr(obj, "__self__", None), types.ModuleType) and obj.__name__.startswith("__")


VALUE_GETTERS = frozenset({"T", "mT", "H", "mH", "real", "imag"})
"""Tensor attributes that read values; every other descriptor of a tensor reads what it is."""


def pointwise_names() -> set[str]:
    """Ops that ATen tags pointwise in every overload taking a tensor first, random ones aside."""
    names = {n for owner in (torch.Tensor, torch, F) for n in dir(owner) if not n.startswith("_")}
    found = set()
    for name in names:
        try:
            packet = getattr(torch.ops.aten, name)
            overloads = [getattr(packet, o) for o in packet.overloads()]
        except (AttributeError, RuntimeError):
            continue
        overloads = [o for o in overloads if o._schema.arguments and o._schema.arguments[0].type.kind() == "TensorType"
                     and not any(a.name == "out" for a in o._schema.arguments)]
        if overloads and all(torch.Tag.pointwise in o.tags and torch.Tag.nondeterministic_seeded not in o.tags
                             for o in overloads):
            found.add(name)
    return found - {"equal", "frexp"}  # a bool, a pair: not one tensor of the broadcast shape


@functools.cache
def _metadata_objects() -> tuple[Any, ...]:
    getters = {name for name in dir(torch.Tensor) if name not in VALUE_GETTERS
               and isinstance(getattr(torch.Tensor, name, None), types.GetSetDescriptorType)}
    return tuple(o for name in sorted(_METADATA_NAMES | getters) for o in op_objects(name))


def table() -> dict[Any, Any]:
    """The table with shardkit's declared rules resolved into op objects (built on first use)."""
    global _BUILT
    if not _BUILT:
        with _BUILDING:  # every thread sees the table whole: ranks simulated as threads decide alike
            if not _BUILT:
                for obj in _metadata_objects():
                    RULES.setdefault(obj, METADATA)
                for names, kind, rule in _DECLARED:
                    # In name order: a family's names may come from a set, whose order follows the hash seed.
                    for name in sorted(names() if callable(names) else names):
                        for obj in op_objects(name):
                            entry = RULES.setdefault(obj, OpRules())
                            if entry is not METADATA:
                                entry.by_kind[kind] = rule
                GENERATION[0] += 1
                _BUILT = True
                BUILT[0] = True
    return RULES


_BUILDING = threading.Lock()


def rules_of(key: Any) -> OpRules | None:
    """The rules registered for ``key`` (an op object or a ``DFunction`` subclass), if any."""
    try:
        found = table().get(key)
    except TypeError:  # an unhashable op
        return None
    return found if isinstance(found, OpRules) else None


def register(objects: Sequence[Any], kind: type, rule: Rule, *, replace: bool, label: str) -> None:
    """Put ``rule`` under each of ``objects`` for ``kind``; ``ValueError`` if one has a rule and not ``replace``."""
    rules = table()
    taken = [o for o in objects if isinstance(rules.get(o), OpRules) and kind in rules[o].by_kind]
    if taken and not replace:
        existing = rules[taken[0]].by_kind[kind]
        msg = (f"{label} already has a rule for {kind.__name__} activations "
               f"({getattr(existing, '__qualname__', existing)}); pass replace=True to replace it.")
        raise ValueError(msg)
    for o in objects:
        entry = rules.get(o)
        if not isinstance(entry, OpRules) or entry is METADATA:
            entry = rules[o] = OpRules()
        entry.by_kind[kind] = rule
    GENERATION[0] += 1


_IN_PLACE_OPERATORS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ifloordiv__", "__imod__",
                       "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def in_place(func: Any) -> bool:
    """Whether ``func`` writes its first argument (``add_``, ``x += y``)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_OPERATORS


def norm_dim(dim: int, ndim: int) -> int:
    """``dim`` as a non-negative dimension of a tensor with ``ndim`` dimensions."""
    return dim % ndim if ndim else 0
