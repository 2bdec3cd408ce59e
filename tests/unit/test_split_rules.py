"""Every rule of the engine's table proven by values, forward and backward, on ranks simulated in one process.

The cases are keyed by what shardkit's own rules declare: each (op, placement kind) that the
table holds a rule for (op objects grouped by their ATen name; ``x.T`` and the other tensor
attributes by the attribute's name) has a case here, and
``test_every_declared_rule_has_a_case`` fails when a rule is added without one (or a case
outlives its rule). Per op, hypothesis draws the spelling (``x.add``, ``torch.add``,
``x.__add__``), the shapes, the ranks (2 to 4) and their slices, uneven and often empty (a rank
holding nothing), and the op's arguments: other operands whole, broadcast, placed alike or
placed another way (the engine must then fall back, and stay exact), numbers, dimensions.

Each rank (``_simulated_ranks``: threads of this process with in-process collectives) holds its
part of the placed inputs, runs the op in a zone, and makes the outputs whole as a zone hands
them out. On every rank: each output equals the op on the whole tensors; each placed input's
gradient is this rank's part of the whole gradient (a pending sum's addend: the whole gradient);
each replicated input's gradient is the whole gradient, complete on every rank. All in float64
and bit for bit, except where a case states a tolerance and why (``ULP``, ``SUMMED``...).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402

from sharded_tensor._model.engine import rules  # noqa: E402
from sharded_tensor._model.engine.placements import Packed, Partial, Split, Strided, tag, to_whole  # noqa: E402
from sharded_tensor._model.engine.signatures import aten_name  # noqa: E402
from sharded_tensor._model.engine.zone import zone  # noqa: E402
from tests._examples import MINIMUM, examples  # noqa: E402
from tests.unit._simulated_ranks import simulated  # noqa: E402

Intervals = tuple[tuple[int, int], ...]
Draw = Callable[..., Any]

# Tolerances (relative, and absolute at the scale of the largest value compared), where bit for bit
# cannot hold:
ULP = 1e-15
"""float64 element-wise kernels: ATen runs most of a tensor through vectorized code (SLEEF) and its tail through the
scalar function, which differ in the last bit (exp2, sinh, sigmoid...); which elements fall in the tail depends on
where a rank's slice starts."""
SUMMED = 1e-13
"""A sum in another order: a whole operand every rank combines with its slice gets the sum of the ranks' shares of
its gradient (``copy_to_ranks``); a reduction over the split dimension adds the ranks' partial sums; a pending sum
adds a whole value on one rank's addend before the addends are summed."""
def summed(dtype: torch.dtype) -> float:
    """``SUMMED`` in ``dtype``: a few units in its last place."""
    return SUMMED if dtype == torch.float64 else 4 * DTYPE_ULP[dtype]


DTYPE_ULP = {torch.float64: ULP, torch.float32: 4e-7, torch.bfloat16: 2e-2, torch.float16: 2e-3}
"""The same, in the element-wise ops' own precision: float32 and bfloat16 kernels compute in float32 and round
(two units in the last place of the dtype, from the vector/scalar difference before the rounding)."""


def _key(obj: Any) -> str:
    """The op an object of the table calls: its ATen name, or the attribute's name for ``x.T``, ``x.real``..."""
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, types.GetSetDescriptorType):
        return owner.__name__
    return aten_name(obj)


def _declared() -> dict[tuple[str, str], list[Any]]:
    """(op, placement kind) -> the op objects shardkit's own rules are declared for (rules registered by users
    at run time, as ``st.register_split_rule`` does, left out)."""
    table = rules.table()
    found: dict[tuple[str, str], list[Any]] = {}
    for names, kind, _ in rules._DECLARED:
        for name in (names() if callable(names) else names):
            for obj in rules.op_objects(name):
                if table.get(obj) is rules.METADATA or (isinstance(obj, types.MethodWrapperType)
                                                        and isinstance(obj.__self__, types.ModuleType)):
                    # (``torch.__eq__`` and its like: a module object's own comparison, which never sees a tensor)
                    continue
                spellings = found.setdefault((_key(obj), kind.__name__), [])
                if obj not in spellings:
                    spellings.append(obj)
    for spellings in found.values():  # in an order of their own: declarations come from sets (hash-seeded order)
        spellings.sort(key=_spelling_order)
    return found


def _spelling_order(obj: Any) -> tuple[str, ...]:
    owner = getattr(obj, "__self__", None)
    return (type(obj).__name__, getattr(obj, "__module__", None) or "", getattr(obj, "__qualname__", ""),
            getattr(owner, "__name__", "") if owner is not None and not isinstance(owner, torch.Tensor) else "")


DECLARED = _declared()


# -- the harness ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placed:
    """An input the ranks hold placed: each its part of ``whole`` (a pending sum: ``addends[rank]``)."""

    whole: torch.Tensor
    placement: Any
    addends: tuple[torch.Tensor, ...] = ()

    @property
    def world(self) -> int:
        p = self.placement
        if type(p) is Partial:
            return len(self.addends)
        return len(p.pieces) if type(p) is Packed else len(p.intervals)

    def part(self, value: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of ``value`` (the whole input, or its gradient) as this placement holds it."""
        p = self.placement
        if type(p) is Split:
            start, length = p.intervals[rank]
            return value.narrow(p.dim, start, length)
        if type(p) is Packed:
            return torch.cat([value.narrow(p.dim, s, n) for s, n in p.pieces[rank]], p.dim)
        if type(p) is Strided:
            start, length = p.intervals[rank]
            blocks = value.unflatten(p.dim, (p.blocks, value.shape[p.dim] // p.blocks))
            return blocks.narrow(p.dim + 1, start, length).flatten(p.dim, p.dim + 1)
        return value  # a pending sum's addend gets the whole gradient

    def holders(self, rank: int) -> list[int]:
        """The ranks holding the same slice as ``rank`` (replicas of it, or ``rank`` alone)."""
        p = self.placement
        if type(p) not in (Split, Strided) or not p.intervals[rank][1]:
            return [rank]
        return [r for r, interval in enumerate(p.intervals) if interval == p.intervals[rank]]


@dataclass
class Case:
    """``op(*args)``: ``args`` are :class:`Placed` inputs, whole tensors (replicated on every rank) and other values."""

    op: Callable[..., Any]
    args: tuple[Any, ...]
    tol: float = 0.0  # of outputs and placed inputs' gradients; 0: bit for bit
    whole_tol: float = 0.0  # of replicated inputs' gradients
    seed: int | None = None  # the random generator's seed before the op (each rank's, and the unsharded op's)
    gathers: int | None = None  # all-gathers each rank makes inside the zone, when the case states it
    grad_mode: bool = True
    timeout: float = 10.0  # how long a rank waits for the others at a collective before the case fails

    @property
    def world(self) -> int:
        worlds = {a.world for a in self.args if isinstance(a, Placed)}
        assert len(worlds) == 1, worlds
        return worlds.pop()


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(_differentiable(t))


def _loss(outs: list[torch.Tensor], upstream: list[torch.Tensor | None]) -> torch.Tensor | None:
    terms = [((torch.view_as_real(o) if o.is_complex() else o) * u).sum() for o, u in zip(outs, upstream)
             if u is not None and o.requires_grad]
    return sum(terms[1:], terms[0]) if terms else None


def _close(got: torch.Tensor | None, want: torch.Tensor | None, tol: float, what: str) -> None:
    if want is None:
        assert got is None or not got.any(), f"{what}: a gradient where the unsharded op has none"
        return
    if got is None:
        got = torch.zeros_like(want)
    scale = float(want.abs().nan_to_num(0, 0, 0).max()) if want.numel() and _differentiable(want) else 0.0
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * max(1.0, scale), equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def check(case: Case) -> None:
    """Run ``case`` unsharded and on its ranks; assert as the module's docstring says."""
    whole_leaves = [_leaf(a.whole) if isinstance(a, Placed) else _leaf(a) if isinstance(a, torch.Tensor) else a
                    for a in case.args]
    inputs = [leaf.clone() if isinstance(a, Placed) else leaf for a, leaf in zip(case.args, whole_leaves)]
    saved = torch.get_rng_state()
    if case.seed is not None:
        torch.manual_seed(case.seed)
    try:
        with torch.set_grad_enabled(case.grad_mode):
            want_outs = [o.resolve_conj() for o in _tensors(case.op(*inputs))]
    finally:
        torch.set_rng_state(saved)
    gen = torch.Generator().manual_seed(len(want_outs))
    upstream = [torch.randn((torch.view_as_real(o) if o.is_complex() else o).shape, generator=gen,
                            dtype=o.real.dtype) if _differentiable(o) else None for o in want_outs]
    loss = _loss(want_outs, upstream)
    backward = loss is not None
    if backward:
        try:
            loss.backward()
        except (RuntimeError, NotImplementedError) as exc:  # an op torch cannot differentiate: outputs only
            if "not implemented" not in str(exc):
                raise
            backward = False
    want_grads = [leaf.grad if isinstance(leaf, torch.Tensor) else None for leaf in whole_leaves]

    def rank_fn(rank: int) -> tuple[list[torch.Tensor], list[Any], int]:
        leaves, given = [], []
        for a in case.args:
            if isinstance(a, Placed):
                local = a.addends[rank] if type(a.placement) is Partial else a.part(a.whole, rank)
                leaf = _leaf(local)
                leaves.append(leaf)
                given.append(tag(leaf.clone(), a.placement))
            elif isinstance(a, torch.Tensor):
                leaf = _leaf(a)
                leaves.append(leaf)
                given.append(leaf)
            else:
                leaves.append(None)
                given.append(a)
        with torch.set_grad_enabled(case.grad_mode), zone():
            out = case.op(*given)
        gathers = ranks.local.all_gathers
        outs = [to_whole(o).resolve_conj() for o in _tensors(out)]
        if backward:
            mine = _loss(outs, upstream)
            if mine is not None:
                mine.backward()
        return [o.detach() for o in outs], [leaf.grad if leaf is not None else None for leaf in leaves], gathers

    with simulated(case.world, timeout=case.timeout) as ranks:
        results = ranks.run(rank_fn, seed=case.seed)
    for rank, (outs, grads, gathers) in enumerate(results):
        assert len(outs) == len(want_outs), f"rank {rank}: {len(outs)} outputs, want {len(want_outs)}"
        for i, (got, want) in enumerate(zip(outs, want_outs)):
            _close(got, want.detach(), case.tol, f"rank {rank}: output {i}")
        if case.gathers is not None:
            assert gathers == case.gathers, f"rank {rank}: {gathers} all-gathers in the zone, want {case.gathers}"
        if not backward:
            continue
        for i, (a, got, want) in enumerate(zip(case.args, grads, want_grads)):
            if isinstance(a, Placed):
                holders = a.holders(rank)
                if len(holders) > 1:  # replicas of this rank's slice: each holds a share of its gradient
                    if rank != holders[0]:
                        continue
                    shares = [results[r][1][i] for r in holders]
                    got = None if all(g is None for g in shares) else sum(
                        g if g is not None else torch.zeros_like(a.part(a.whole, rank)) for g in shares)
                _close(got, None if want is None else a.part(want, rank), case.tol,
                       f"rank {rank}: placed input {i}'s gradient" + (f" (summed over ranks {holders})"
                                                                      if len(holders) > 1 else ""))
            elif isinstance(a, torch.Tensor):
                _close(got, want, case.whole_tol, f"rank {rank}: whole input {i}'s gradient")


# -- drawing ----------------------------------------------------------------------------------------------

def _generator(draw: Draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(hs.integers(0, 2**16), label="seed"))


def _intervals(draw: Draw, world: int | None = None, unit: int = 1, most: int = 3, least: int = 0,
               replicas: bool = False) -> Intervals:
    """2 to 4 ranks' slices, uneven and often empty, ``unit`` times lengths of ``least`` (0) to ``most``; with
    ``replicas``, in some draws several ranks hold the same slice (a key/value head shared by the ranks of its
    query heads)."""
    world = world or draw(hs.integers(2, 4), label="world")
    if replicas and draw(hs.sampled_from([True, False]), label="replicas"):
        parts = draw(hs.integers(1, world - 1), label="distinct slices")
        lengths = draw(hs.lists(hs.integers(max(least, 1), most), min_size=parts, max_size=parts), label="lengths")
        starts = [sum(lengths[:j]) for j in range(parts)]
        # Every slice held by one rank at least, the other ranks holding a slice again (or, with least 0, none).
        more = draw(hs.lists(hs.integers(-1 if least == 0 else 0, parts - 1), min_size=world - parts,
                             max_size=world - parts), label="slices held again")
        holds = draw(hs.permutations([*range(parts), *more]), label="slice of each rank")
        return tuple((starts[j] * unit, lengths[j] * unit) if j >= 0 else (0, 0) for j in holds)
    lengths = draw(hs.lists(hs.integers(least, most), min_size=world, max_size=world).filter(lambda n: sum(n) > 0),
                   label="lengths")
    starts = [sum(lengths[:r]) * unit for r in range(world)]
    return tuple((s, n * unit) for s, n in zip(starts, lengths))


def _randn(gen: torch.Generator, shape: Any, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(dtype)


def _split(draw: Draw, ndim: int | tuple[int, int] = (1, 4), dims: Any = None, dtype: torch.dtype = torch.float64,
           shape: list[int] | None = None, intervals: Intervals | None = None, gen: torch.Generator | None = None,
           values: Callable[[torch.Tensor], torch.Tensor] | None = None, replicas: bool = False) -> Placed:
    """A whole tensor split along one of ``dims`` (all by default), its other sizes 1 to 3 (``replicas``: see
    ``_intervals``)."""
    if shape is None:
        n = ndim if isinstance(ndim, int) else draw(hs.integers(*ndim), label="ndim")
        shape = [draw(hs.integers(1, 3)) for _ in range(n)]
    shape = list(shape)
    dim = draw(hs.sampled_from(list(range(len(shape))) if dims is None else list(dims)), label="split dim")
    dim %= len(shape)
    intervals = intervals or _intervals(draw, replicas=replicas)
    shape[dim] = max(st + n for st, n in intervals)
    gen = gen or _generator(draw)
    if dtype in (torch.int64, torch.bool):
        x = torch.randint(-3, 4, shape, generator=gen).to(dtype)
    else:
        x = _randn(gen, shape, dtype)
    if values is not None:
        x = values(x)
    return Placed(x, Split(dim, intervals))


def _partial(draw: Draw, ndim: tuple[int, int] = (1, 3), shape: list[int] | None = None,
             dtype: torch.dtype = torch.float64) -> Placed:
    """A pending sum: each of 2 to 4 ranks an addend (a rank's may be all zeros, as one with no features gives)."""
    world = draw(hs.integers(2, 4), label="world")
    if shape is None:
        shape = [draw(hs.integers(1, 3)) for _ in range(draw(hs.integers(*ndim), label="ndim"))]
    gen = _generator(draw)
    empty = draw(hs.lists(hs.booleans(), min_size=world, max_size=world), label="zero addends")
    addends = tuple(torch.zeros(shape, dtype=dtype) if e else _randn(gen, shape, dtype) for e in empty)
    total = addends[0].clone()
    for a in addends[1:]:  # in rank order, as the all-reduce adds them
        total = total + a
    return Placed(total, Partial(), addends)


def _other(draw: Draw, x: Placed, gen: torch.Generator, *, dtype: torch.dtype | None = None,
           forms: tuple[str, ...] = ("whole", "broadcast", "placed", "number", "split-otherwise")) -> Any:
    """A second operand for an element-wise op with ``x``: whole of x's shape (cut to the slices), broadcast
    (used whole), placed alike, a number, or placed another way (the engine falls back)."""
    dtype = dtype or x.whole.dtype
    shape = list(x.whole.shape)
    form = draw(hs.sampled_from(forms), label="operand")
    if form == "number":
        return draw(hs.sampled_from([2, -1.5, 0.5]) if dtype.is_floating_point else hs.sampled_from([1, 2, 3]))
    if form == "broadcast":
        keep = draw(hs.integers(0, len(shape)), label="trailing dims")
        shape = shape[len(shape) - keep:]
        shape = [1 if draw(hs.booleans()) else n for n in shape]
    made = _randn(gen, shape, dtype) if dtype.is_floating_point else torch.randint(1, 4, shape, generator=gen).to(dtype)
    if form == "placed":
        return Placed(made, x.placement)
    if form == "split-otherwise":
        p = x.placement
        if type(p) is Strided:  # the same rows split as a plain split, all on rank 0
            total = made.shape[p.dim] if made.dim() == x.whole.dim() else 0
            if not total:
                return made
            return Placed(made, Split(p.dim, ((0, total),) + ((total, 0),) * (len(p.intervals) - 1)))
        if type(p) is not Split:
            return made
        other = _intervals(draw, world=len(p.intervals))
        sizes = [n for _, n in other]
        if sum(sizes) != p.size:  # the same dimension cut elsewhere, or (if the sizes differ) another dimension
            dims = [d for d, n in enumerate(shape) if n == sum(sizes) and d != p.dim]
            if not dims:
                return Placed(made, p)
            return Placed(made, Split(dims[0], other))
        return Placed(made, Split(p.dim, other) if other != p.intervals else p)
    return made


STRIDED_ELEMENTWISE = 5
"""Examples of each element-wise op on a strided activation (in the full suite; see ``_few``)."""

CASES: dict[tuple[str, str], tuple[Callable[[Draw, Any, str], Case], int]] = {}
"""(op, placement kind) -> (draws a case from hypothesis' ``draw``, the spelling and the op's name; examples)."""


def case(*names: str, kind: type = Split, kinds: tuple[type, ...] = (), count: int = 12
         ) -> Callable[[Callable[..., Case]], Any]:
    """Register the decorated drawer for ``names`` on ``kind`` (or on each of ``kinds``, passed as ``kind=``)."""
    def register(fn: Callable[..., Case]) -> Callable[..., Case]:
        for k in kinds or (kind,):
            drawer = functools.partial(fn, kind=k) if kinds else fn
            # The strided activation goes through the split one's element-wise rule: fewer draws of its own.
            drawn = STRIDED_ELEMENTWISE if kinds and k is Strided else count
            for name in names:
                assert (name, k.__name__) not in CASES, name
                CASES[(name, k.__name__)] = (drawer, drawn)
        return fn
    return register


# -- Split and Strided: element-wise ----------------------------------------------------------------------

ELEMENTWISE_KINDS = (Split, Strided)
"""Element-wise ops have one rule for split and strided activations (heads merged with the batch)."""


def _placed(draw: Draw, kind: type, **kwargs: Any) -> Placed:
    """A split input (``_split``), or a strided one: ``[batch * heads, seq, dim]``, its heads split."""
    if kind is Split:
        return _split(draw, replicas=True, **kwargs)
    gen = kwargs.get("gen") or _generator(draw)
    dtype = kwargs.get("dtype", torch.float64)
    x, _, _ = _strided(draw, gen, replicas=True)
    whole = x.whole.to(dtype) if dtype.is_floating_point else (x.whole * 3).round().to(dtype)
    if kwargs.get("values") is not None:
        whole = kwargs["values"](whole)
    return Placed(whole, x.placement)



UNARY = (
    "abs acos acos_ acosh acosh_ angle asin asin_ asinh asinh_ atan atan_ atanh atanh_ ceil ceil_ celu celu_ "
    "conj_physical conj_physical_ cos cos_ cosh cosh_ deg2rad deg2rad_ digamma digamma_ elu elu_ erf erf_ erfc "
    "erfc_ erfinv erfinv_ exp exp2 exp2_ exp_ expm1 expm1_ floor floor_ frac frac_ gelu hardshrink hardsigmoid "
    "hardswish hardtanh hardtanh_ i0 i0_ isfinite isinf isnan isneginf isposinf leaky_relu leaky_relu_ lgamma "
    "lgamma_ log log10 log10_ log1p log1p_ log2 log2_ log_ log_sigmoid logical_not logical_not_ logit logit_ mish "
    "nan_to_num nan_to_num_ neg neg_ positive rad2deg rad2deg_ reciprocal reciprocal_ relu relu6 relu_ round round_ "
    "rsqrt rsqrt_ selu selu_ sgn sgn_ sigmoid sigmoid_ sign sign_ signbit silu sin sin_ sinc sinc_ sinh sinh_ "
    "softplus softshrink softsign special_digamma special_erf special_erfc special_erfinv special_exp2 special_expm1 "
    "special_i0 special_log1p special_logit special_round special_sinc sqrt sqrt_ square square_ tan tan_ tanh tanh_ "
    "tanhshrink trunc trunc_ clone contiguous detach requires_grad_ zero_ float double half bfloat16").split()
# Element-wise ops models run in lower precision too: drawn in float32 and bfloat16 as well.
LOW_PRECISION = {"exp", "tanh", "sigmoid", "rsqrt", "neg", "relu", "silu", "gelu", "add", "sub", "mul", "div", "pow",
                 "where", "masked_fill", "float", "to", "type_as"}


def _dtype(draw: Draw, name: str) -> torch.dtype:
    if name in LOW_PRECISION:
        return draw(hs.sampled_from([torch.float64, torch.float32, torch.bfloat16]), label="dtype")
    return torch.float64


@case(*UNARY, kinds=ELEMENTWISE_KINDS, count=8)
def _unary(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    dtype = _dtype(draw, name)
    x = _placed(draw, kind, dtype=dtype)
    return Case(lambda t: spelling(t), (x,), tol=DTYPE_ULP[dtype])


@case("bitwise_not", "bitwise_not_", kinds=ELEMENTWISE_KINDS, count=8)
def _unary_integer(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    return Case(lambda t: spelling(t), (_placed(draw, kind, dtype=torch.int64),))


BINARY = (
    "add add_ atan2 atan2_ clamp clamp_ clamp_max clamp_max_ clamp_min clamp_min_ clip clip_ copysign div div_ eq "
    "float_power float_power_ fmax fmin fmod fmod_ ge gt heaviside hypot hypot_ igamma igamma_ igammac igammac_ "
    "ldexp ldexp_ le logaddexp logaddexp2 logical_and logical_and_ logical_or logical_or_ logical_xor logical_xor_ lt "
    "maximum minimum mod mul mul_ ne nextafter nextafter_ pow pow_ radd rdiv remainder remainder_ rmul rpow rsub "
    "special_xlogy sub sub_ true_divide xlogy").split()
_TENSOR_ONLY = {"atan2", "copysign", "fmax", "fmin", "heaviside", "hypot", "igamma", "igammac", "ldexp", "logaddexp",
                "logaddexp2", "maximum", "minimum", "nextafter", "logical_and", "logical_or", "logical_xor",
                "special_xlogy", "xlogy"}
_POSITIVE = {"igamma", "igammac"}


@case(*BINARY, kinds=ELEMENTWISE_KINDS, count=12)
def _binary(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    base = name.rstrip("_")
    dtype = _dtype(draw, base)
    gen = _generator(draw)
    values = (lambda v: v.abs() + 0.5) if base in _POSITIVE else None
    x = _placed(draw, kind, dtype=dtype, gen=gen, values=values)
    forms: tuple[str, ...] = ("whole", "broadcast", "placed", "number", "split-otherwise")
    if base in _TENSOR_ONLY:
        forms = tuple(f for f in forms if f != "number")
    # (In place, an operand split another way is brought to x's placement: ``test_in_place_with_an_operand_split_
    # another_way``.)
    other = _other(draw, x, gen, forms=forms)
    if base in _POSITIVE:
        other = Placed(other.whole.abs() + 0.5, other.placement) if isinstance(other, Placed) else other.abs() + 0.5
    kwargs: dict[str, Any] = {}
    if base in ("add", "sub", "rsub") and draw(hs.booleans(), label="alpha") and spelling.__name__[:2] != "__":
        kwargs["alpha"] = 0.5 if dtype.is_floating_point else 2
    if base == "div" and spelling.__name__[:2] != "__" and draw(hs.booleans(), label="rounding"):
        kwargs["rounding_mode"] = draw(hs.sampled_from(["floor", "trunc"]))
    if base == "float_power" and name.endswith("_"):
        x = Placed(x.whole.double(), x.placement)
    return Case(lambda t, o: spelling(t, o, **kwargs), (x, other), tol=DTYPE_ULP[dtype], whole_tol=summed(dtype))


@case("bitwise_and", "bitwise_and_", "bitwise_or", "bitwise_or_", "bitwise_xor", "bitwise_xor_",
      "bitwise_left_shift", "bitwise_left_shift_", "bitwise_right_shift", "bitwise_right_shift_", "gcd", "lcm",
      kinds=ELEMENTWISE_KINDS, count=8)
def _binary_integer(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    gen = _generator(draw)
    x = _placed(draw, kind, dtype=torch.int64, gen=gen, values=lambda v: v.abs())
    forms = ("whole", "placed", "broadcast", "split-otherwise")
    if not name.startswith(("gcd", "lcm")):
        forms = (*forms, "number")
    return Case(lambda t, o: spelling(t, o), (x, _other(draw, x, gen, forms=forms)))


@case("addcdiv", "addcdiv_", "addcmul", "addcmul_", "lerp", "lerp_", kinds=ELEMENTWISE_KINDS, count=10)
def _ternary(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    gen = _generator(draw)
    x = _placed(draw, kind, gen=gen)
    forms = ("whole", "placed", "broadcast", "split-otherwise")
    a = _other(draw, x, gen, forms=forms)
    if name.startswith("lerp"):
        weight = draw(hs.sampled_from([0.25, "tensor"]), label="weight")
        b = _other(draw, x, gen, forms=forms) if weight == "tensor" else weight
        return Case(lambda t, u, w: spelling(t, u, w), (x, a, b), tol=ULP, whole_tol=SUMMED)
    b = _other(draw, x, gen, forms=forms)
    if name.startswith("addcdiv"):  # away from zero: a quotient, not a pole
        b = Placed(b.whole.abs() + 0.5, b.placement) if isinstance(b, Placed) else b.abs() + 0.5
    value = draw(hs.sampled_from([1, -0.5]), label="value")
    return Case(lambda t, u, w: spelling(t, u, w, value=value), (x, a, b), tol=ULP, whole_tol=SUMMED)


@case("fill_", kinds=ELEMENTWISE_KINDS, count=8)
def _fill(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    value = draw(hs.sampled_from([0.5, -2]))
    return Case(lambda t: spelling(t, value), (_placed(draw, kind),))


@case("mvlgamma", "mvlgamma_", kinds=ELEMENTWISE_KINDS, count=8)
def _mvlgamma(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    p = draw(hs.integers(1, 3), label="p")
    # Its domain: every element above (p - 1) / 2.
    x = _placed(draw, kind, values=lambda v: v.abs() + (p - 1) / 2 + 0.25)
    return Case(lambda t: spelling(t, p), (x,), tol=ULP)


@case("polygamma_", kinds=ELEMENTWISE_KINDS, count=8)
def _polygamma(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    n = draw(hs.integers(0, 2), label="n")
    return Case(lambda t: spelling(t, n), (_placed(draw, kind, values=lambda v: v.abs() + 0.5),), tol=ULP)


@case("to", "type_as", kinds=ELEMENTWISE_KINDS, count=10)
def _casts(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    x = _placed(draw, kind, dtype=_dtype(draw, name))
    target = draw(hs.sampled_from([torch.float64, torch.float32, torch.bfloat16]), label="to")
    if name == "type_as":
        return Case(lambda t, o: spelling(t, o), (x, torch.zeros(1, dtype=target)))
    how = draw(hs.sampled_from(["dtype", "tensor", "keyword"]), label="form")
    if how == "tensor":
        return Case(lambda t, o: spelling(t, o), (x, torch.zeros(1, dtype=target)))
    if how == "keyword":
        return Case(lambda t: spelling(t, dtype=target), (x,))
    return Case(lambda t: spelling(t, target), (x,))


@case("where", kinds=ELEMENTWISE_KINDS, count=12)
def _where(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    dtype = _dtype(draw, name)
    gen = _generator(draw)
    x = _placed(draw, kind, dtype=dtype, gen=gen)
    other = _other(draw, x, gen)
    condition = draw(hs.sampled_from(["from x", "whole"]), label="condition")
    mask = _randn(gen, x.whole.shape) > 0
    if spelling is torch.where:
        if condition == "from x":
            return Case(lambda t, o: torch.where(t > 0, t, o), (x, other), whole_tol=summed(dtype))
        return Case(lambda t, o, c: torch.where(c, t, o), (x, other, mask), whole_tol=summed(dtype))
    if condition == "from x":
        return Case(lambda t, o: spelling(t, t > 0, o), (x, other), whole_tol=summed(dtype))
    return Case(lambda t, o, c: spelling(t, c, o), (x, other, mask), whole_tol=summed(dtype))


@case("masked_fill", "masked_fill_", kinds=ELEMENTWISE_KINDS, count=10)
def _masked_fill(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    gen = _generator(draw)
    x = _placed(draw, kind, dtype=_dtype(draw, name.rstrip("_")), gen=gen)
    form = draw(hs.sampled_from(["from x", "whole", "broadcast"]), label="mask")
    value = draw(hs.sampled_from([float("-inf"), 0.0, 2.5]), label="value")
    if form == "from x":
        return Case(lambda t: spelling(t, t < 0, value), (x,))
    shape = list(x.whole.shape)
    if form == "broadcast":
        shape = [1 if draw(hs.booleans()) else n for n in shape]
    mask = _randn(gen, shape) > 0
    return Case(lambda t, m: spelling(t, m, value), (x, mask))


@case("threshold", "_threshold", kinds=ELEMENTWISE_KINDS, count=8)
def _threshold(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    return Case(lambda t: spelling(t, 0.1, -1.0), (_placed(draw, kind),))


@case("complex", "polar", kinds=ELEMENTWISE_KINDS, count=8)
def _complex_from_two(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    gen = _generator(draw)
    x = _placed(draw, kind, gen=gen)
    other = _other(draw, x, gen, forms=("whole", "placed", "split-otherwise"))
    return Case(lambda t, o: spelling(t, o), (x, other), tol=ULP, whole_tol=SUMMED)


# -- Split: shapes ----------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _regrouped(draw: Draw, shape: list[int]) -> list[int]:
    """``shape`` with dimensions merged, factored, or 1s put in or taken out: what a reshape asks for."""
    out = list(shape)
    for _ in range(draw(hs.integers(1, 2), label="regroupings")):
        how = draw(hs.sampled_from(["merge", "factor", "insert", "drop"]), label="regroup")
        if how == "merge" and len(out) >= 2:
            i = draw(hs.integers(0, len(out) - 2))
            out[i:i + 2] = [out[i] * out[i + 1]]
        elif how == "factor" and out:
            i = draw(hs.integers(0, len(out) - 1))
            f = draw(hs.sampled_from(_divisors(out[i])) if out[i] else hs.just(1))
            out[i:i + 1] = [f, out[i] // f if f else 0]
        elif how == "insert":
            out.insert(draw(hs.integers(0, len(out))), 1)
        elif how == "drop" and 1 in out:
            out.remove(1)
    return out


@case("view", "reshape", count=30)
def _reshape(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw, ndim=(1, 4), replicas=True)
    whole = list(x.whole.shape)
    how = draw(hs.sampled_from(["sizes", "minus one", "from its shape", "a 1 put in, from its shape", "packed args"]),
               label="sizes")
    if how == "from its shape":
        # Sizes read off the tensor itself (``t.reshape(*t.shape[:-1], -1, 2)``): on a rank, the split dimension's
        # its own length, which stands for the whole size.
        i = draw(hs.integers(0, len(whole) - 1), label="factored dim")
        f = draw(hs.sampled_from([f for f in (1, 2, 3) if whole[i] % f == 0]), label="factor")
        return Case(lambda t: spelling(t, (*t.shape[:i], -1, f, *t.shape[i + 1:])), (x,))
    if how == "a 1 put in, from its shape":  # ``t.view(-1, 1, t.shape[1])``: a size-1 dimension beside the split
        j = draw(hs.integers(0, len(whole)), label="at")
        first = draw(hs.booleans(), label="-1 first") and j > 0
        return Case(lambda t: spelling(t, (*((-1,) if first else ()), *t.shape[1 if first else 0:j], 1, *t.shape[j:])),
                    (x,))
    target = _regrouped(draw, whole)
    if how == "minus one" and target:
        target[draw(hs.integers(0, len(target) - 1))] = -1
    if how == "packed args" and spelling is not torch.reshape:  # x.view(2, 3): sizes as separate arguments
        return Case(lambda t: spelling(t, *target), (x,))
    return Case(lambda t: spelling(t, tuple(target)), (x,))


@case("view_as", "reshape_as", count=12)
def _reshape_as(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw)
    if draw(hs.booleans(), label="the other split alike"):  # x.view_as(x), as a module hook's identity does
        return Case(lambda t, o: spelling(t, o), (x, Placed(torch.zeros(x.whole.shape), x.placement)), gathers=0)
    return Case(lambda t, o: spelling(t, o), (x, torch.zeros(_regrouped(draw, list(x.whole.shape)))))


@case("flatten", count=12)
def _flatten(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw)
    n = x.whole.dim()
    a = draw(hs.integers(-n, n - 1), label="start")
    b = draw(hs.integers(a % n, n - 1), label="end")
    return Case(lambda t: spelling(t, a, b), (x,))


@case("unflatten", count=12)
def _unflatten(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw)
    d = draw(hs.integers(0, x.whole.dim() - 1), label="dim")
    n = x.whole.shape[d]
    f = draw(hs.sampled_from(_divisors(n)), label="factor")
    sizes = draw(hs.sampled_from([(f, n // f), (-1, n // f), (f, -1)]), label="sizes")
    return Case(lambda t: spelling(t, d, sizes), (x,))


@case("unsqueeze", count=8)
def _unsqueeze(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw)
    d = draw(hs.integers(-x.whole.dim() - 1, x.whole.dim()), label="dim")
    return Case(lambda t: spelling(t, d), (x,))


@case("squeeze", count=12)
def _squeeze(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw, ndim=(2, 4))
    d = draw(hs.sampled_from([None, *range(x.whole.dim()), tuple(range(x.whole.dim()))]), label="dim")
    if d is None:
        return Case(lambda t: spelling(t), (x,))
    return Case(lambda t: spelling(t, d), (x,))


@case("transpose", "swapaxes", "swapdims", count=10)
def _transpose(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw, ndim=(1, 4))
    n = x.whole.dim()
    a, b = draw(hs.integers(-n, n - 1), label="dim0"), draw(hs.integers(-n, n - 1), label="dim1")
    return Case(lambda t: spelling(t, a, b), (x,))


@case("permute", count=10)
def _permute(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw, ndim=(1, 4))
    order = list(draw(hs.permutations(range(x.whole.dim())), label="order"))
    if draw(hs.booleans(), label="negative dims"):
        order = [d - x.whole.dim() for d in order]
    if draw(hs.booleans(), label="unpacked") and spelling is not torch.permute:
        return Case(lambda t: spelling(t, *order), (x,))
    return Case(lambda t: spelling(t, order), (x,))


@case("t", count=8)
def _t(draw: Draw, spelling: Any, name: str) -> Case:
    return Case(lambda t: spelling(t), (_split(draw, ndim=(1, 2)),))


@case("T", "mT", "H", "mH", count=8)
def _getters(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw, ndim=(2, 2) if name in ("T", "H") else (2, 4))
    if name.endswith("H") and draw(hs.booleans(), label="complex"):
        x = Placed(torch.complex(x.whole, x.whole.flip(0)), x.placement)
    return Case(lambda t: spelling(t), (x,))


@case("real", "imag", count=8)
def _real_imag(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw)
    if name == "imag" or draw(hs.booleans(), label="complex"):
        x = Placed(torch.complex(x.whole, -2 * x.whole), x.placement)
    return Case(lambda t: spelling(t) * 1, (x,))


@case("view_as_complex", count=8)
def _view_as_complex(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    shape = [draw(hs.integers(1, 3)) for _ in range(draw(hs.integers(0, 2)))] + [2]
    if len(shape) == 1 or draw(hs.booleans(), label="split the pairs"):  # 2 values over the ranks: falls back
        x = _split(draw, shape=shape, gen=gen, dims=[len(shape) - 1], intervals=((0, 1), (1, 1)))
    else:
        x = _split(draw, shape=shape, gen=gen, dims=range(len(shape) - 1))
    return Case(lambda t: spelling(t) * 1, (x,))


@case("view_as_real", count=8)
def _view_as_real(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw)
    return Case(lambda t: spelling(t) * 1, (Placed(torch.complex(x.whole, x.whole * 0.5), x.placement),))


@case("expand", "expand_as", "broadcast_to", count=12)
def _expand(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw, ndim=(1, 3))
    whole = list(x.whole.shape)
    # A split of whole size 1 may grow too (every rank then falls back alike).
    ones = [d for d in range(len(whole)) if whole[d] == 1]
    grown = [n if d not in ones or not draw(hs.booleans()) else 3 for d, n in enumerate(whole)]
    new = [draw(hs.integers(1, 2)) for _ in range(draw(hs.integers(0, 2), label="new dims"))]
    sizes = new + grown
    if name == "expand_as":
        return Case(lambda t, o: spelling(t, o), (x, torch.zeros(sizes)))
    at = len(new) + x.placement.dim
    how = draw(hs.sampled_from(["whole", "-1", "from its shape"]), label="split size")
    if how == "-1":
        sizes[at] = -1
    if how == "from its shape" and grown[x.placement.dim] == whole[x.placement.dim]:
        return Case(lambda t: spelling(t, (*new, *[t.shape[d] if d == x.placement.dim else n
                                                   for d, n in enumerate(grown)])), (x,))
    if name == "expand" and draw(hs.booleans(), label="unpacked"):  # x.expand(2, 3), x.expand(2): sizes unpacked
        return Case(lambda t: spelling(t, *sizes), (x,))
    return Case(lambda t: spelling(t, tuple(sizes)), (x,))


def _index(draw: Draw, ndim: int, sizes: list[int], keep: int | None = None, same_dims: bool = False
           ) -> tuple[Any, ...]:
    """Basic and one-list indexing of a tensor of ``sizes`` (dimension ``keep`` left whole; with ``same_dims``, no
    integer nor new axis: the view has the tensor's dimensions)."""
    items: list[Any] = []
    for d in range(ndim):
        n = sizes[d]
        if d == keep:
            items.append(slice(None))
            continue
        items.append(draw(hs.sampled_from([slice(None), slice(0, max(1, n - 1)), slice(None, None, 2),
                                           slice(-1, None), [0], [n - 1, 0]] + ([] if same_dims else [n - 1, -1])),
                          label=f"index {d}"))
    lists = [i for i, v in enumerate(items) if isinstance(v, list)]
    for i in lists[1:]:
        items[i] = slice(None)  # one list of positions: two would be paired, advanced indexing
    if not same_dims and draw(hs.booleans(), label="new axis"):
        items.insert(draw(hs.integers(0, len(items))), None)
    if draw(hs.booleans(), label="ellipsis"):
        while items and items[-1] == slice(None):
            items.pop()
        items.append(Ellipsis)
    return tuple(items)


@case("getitem", count=30)
def _getitem(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw, ndim=(1, 3))
    index = _index(draw, x.whole.dim(), list(x.whole.shape))
    if draw(hs.booleans(), label="tensor positions"):
        index = tuple(torch.tensor(i) if isinstance(i, list) else i for i in index)
    return Case(lambda t: spelling(t, index if len(index) != 1 else index[0]), (x,))


# -- Split: along a dimension -----------------------------------------------------------------------------

@case("softmax", "log_softmax", "special_softmax", "special_log_softmax", count=10)
def _softmax(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw)
    d = draw(hs.integers(-x.whole.dim(), x.whole.dim() - 1), label="dim")
    if draw(hs.booleans(), label="dtype") and spelling is not torch._C._nn.__dict__.get(name):
        return Case(lambda t: spelling(t, d, dtype=torch.float32), (x,), tol=DTYPE_ULP[torch.float32])
    return Case(lambda t: spelling(t, d), (x,), tol=ULP)  # exp in the kernel and its backward


@case("cumsum", count=10)
def _cumsum(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw)
    d = draw(hs.integers(-x.whole.dim(), x.whole.dim() - 1), label="dim")
    if draw(hs.booleans(), label="keyword"):
        return Case(lambda t: spelling(t, dim=d), (x,))
    return Case(lambda t: spelling(t, d), (x,))


@case("roll", count=10)
def _roll(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw)
    n = x.whole.dim()
    dims = draw(hs.sampled_from([0, -1, (0, n - 1), None]), label="dims")
    shifts = 1 if not isinstance(dims, tuple) else (1, -2)
    if dims is None:
        return Case(lambda t: spelling(t, 2), (x,))
    return Case(lambda t: spelling(t, shifts, dims), (x,))


@case("cat", "concat", "concatenate", "stack", count=16)
def _cat(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    x = _split(draw, gen=gen, replicas=True)
    n = x.whole.dim()
    d = draw(hs.integers(-n - (1 if name == "stack" else 0), n - (0 if name == "stack" else 1)), label="dim")
    count = draw(hs.integers(1, 3), label="tensors")
    others = []
    for _ in range(count - 1):
        form = draw(hs.sampled_from(["placed", "whole", "split-otherwise", "longer"]), label="other")
        if form == "longer" and name != "stack":  # another size along the dimension of the concatenation
            shape = list(x.whole.shape)
            shape[d % n] += 1
            if d % n == x.placement.dim:
                others.append(_randn(gen, shape))
                continue
            others.append(Placed(_randn(gen, shape), x.placement))
            continue
        others.append(_other(draw, x, gen, forms=("placed", "whole", "split-otherwise") if form == "longer"
                             else (form,)))
    keyword = "axis" if name == "concatenate" else "dim"
    return Case(lambda t, *o: spelling([t, *o], **{keyword: d}), (x, *others), whole_tol=SUMMED)


@case("split", "chunk", "unbind", "tensor_split", count=12)
def _parts(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw)
    n = x.whole.dim()
    d = draw(hs.integers(-n, n - 1), label="dim")
    size = x.whole.shape[d]
    if name == "unbind":
        return Case(lambda t: [p * 1 for p in spelling(t, d)], (x,))
    if name == "chunk":
        chunks = draw(hs.integers(1, 3), label="chunks")
        return Case(lambda t: spelling(t, chunks, d), (x,))
    if name == "tensor_split":
        where = draw(hs.sampled_from([2, [1], [0, 2]]), label="sections")
        return Case(lambda t: spelling(t, where, d), (x,))
    sizes = draw(hs.sampled_from([1, 2, "sections"]), label="sizes")
    if sizes == "sections":
        cut = draw(hs.integers(0, size), label="cut")
        sizes = [cut, size - cut]
    return Case(lambda t: spelling(t, sizes, d), (x,))


# -- Split: reductions and products -----------------------------------------------------------------------

@case("sum", "mean", "amax", "amin", "logsumexp", "special_logsumexp", "var", "std", count=20)
def _reduce(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw, ndim=(1, 3))
    n = x.whole.dim()
    dims = draw(hs.sampled_from(["all", "one", "list", "empty list"]) if name not in ("logsumexp", "special_logsumexp")
                else hs.sampled_from(["one", "list"]), label="dims")
    keepdim = draw(hs.booleans(), label="keepdim")
    # Sums of the ranks' partial sums (the split dimension reduced): in another order than one kernel's.
    tol = SUMMED if name in ("sum", "mean", "var", "std", "logsumexp", "special_logsumexp") else 0.0
    if dims == "all":
        if name in ("var", "std") and draw(hs.booleans(), label="unbiased only"):
            return Case(lambda t: spelling(t, False) * 1, (x,), tol=tol)
        return Case(lambda t: spelling(t) * 1, (x,), tol=tol)
    if dims == "one":
        d: Any = draw(hs.integers(-n, n - 1), label="dim")
    elif dims == "list":
        d = sorted(set(draw(hs.lists(hs.integers(0, n - 1), min_size=1, max_size=n), label="dim list")))
    else:
        d = []
        if name in ("amax", "amin", "var", "std"):
            d = [0]
    if name in ("var", "std"):
        how = draw(hs.sampled_from(["unbiased", "correction", "keyword"]), label="form")
        if how == "unbiased":
            return Case(lambda t: spelling(t, d, True, keepdim), (x,), tol=tol)
        if how == "correction":
            return Case(lambda t: spelling(t, d, correction=0, keepdim=keepdim), (x,), tol=tol)
        return Case(lambda t: spelling(t, dim=d, keepdim=keepdim), (x,), tol=tol)
    if name == "sum" and draw(hs.booleans(), label="dtype"):
        return Case(lambda t: spelling(t, d, keepdim, dtype=torch.float32), (x,), tol=DTYPE_ULP[torch.float32])
    if draw(hs.booleans(), label="keywords"):
        return Case(lambda t: spelling(t, dim=d, keepdim=keepdim), (x,), tol=tol)
    return Case(lambda t: spelling(t, d, keepdim), (x,), tol=tol)


@case("matmul", "bmm", count=20)
def _matmul(draw: Draw, spelling: Any, name: str) -> Case:
    """``a @ b`` with the split on a batch dimension, a row of ``a``, a column of ``b`` or the contraction (which
    falls back), ``a``, ``b`` or both placed; batches broadcast, and vectors."""
    gen = _generator(draw)
    iv = _intervals(draw, replicas=True)
    total = max(st + n for st, n in iv)
    role = draw(hs.sampled_from(["batch", "row", "column", "contraction"]), label="split on")
    m, k, p = (total if role == r else draw(hs.integers(1, 3)) for r in ("row", "contraction", "column"))
    batch = [] if name == "matmul" and not draw(hs.booleans(), label="batched") else [draw(hs.integers(1, 2))]
    if role == "batch":
        batch = [total]
    a_shape, b_shape = [*batch, m, k], [*batch, k, p]
    if name == "matmul" and role != "column" and draw(hs.booleans(), label="vector"):
        b_shape = [k]
    elif name == "matmul" and role != "batch" and batch and draw(hs.booleans(), label="broadcast batch"):
        b_shape = b_shape[1:]
    placed = {"batch": ["a", "b", "both"], "row": ["a"], "column": ["b"], "contraction": ["a", "b", "both"]}[role]
    which = draw(hs.sampled_from(placed), label="placed")
    args: list[Any] = []
    for side, shape in (("a", a_shape), ("b", b_shape)):
        dim = {"batch": 0, "row": len(shape) - 2, "column": len(shape) - 1,
               "contraction": len(shape) - (1 if side == "a" or len(shape) == 1 else 2)}[role]
        if which in (side, "both") and not (role == "batch" and len(shape) < 3):
            args.append(_split(draw, shape=shape, dims=[dim], intervals=iv, gen=gen))
        else:
            args.append(_randn(gen, shape))
    if not any(isinstance(a, Placed) for a in args):
        args[0] = _split(draw, shape=a_shape, dims=[0], intervals=iv, gen=gen)
    # A product's sum over the contraction is in another order when the contraction is split (partial products).
    return Case(lambda a, b: spelling(a, b), tuple(args), whole_tol=SUMMED, tol=SUMMED)


@case("linear", count=12)
def _linear(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    x = _split(draw, ndim=(1, 3), gen=gen, replicas=True)
    out = draw(hs.integers(1, 3), label="out features")
    w = _randn(gen, (out, x.whole.shape[-1]))
    if draw(hs.booleans(), label="bias"):
        return Case(lambda t, w, b: spelling(t, w, b), (x, w, _randn(gen, (out,))), tol=SUMMED, whole_tol=SUMMED)
    return Case(lambda t, w: spelling(t, w), (x, w), tol=SUMMED, whole_tol=SUMMED)


@case("layer_norm", "rms_norm", count=14)
def _norm(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    dtype = draw(hs.sampled_from([torch.float64, torch.float32, torch.bfloat16]), label="dtype")
    x = _split(draw, ndim=(1, 3), gen=gen, dtype=dtype)
    count = draw(hs.integers(1, x.whole.dim()), label="normalized dims")
    shape = tuple(x.whole.shape[x.whole.dim() - count:])
    affine = draw(hs.booleans(), label="weight")
    w = _randn(gen, shape, dtype) if affine else None
    # A norm's statistics are a reduction: in float32 and bfloat16 the vectorized sum's order depends on where the
    # row starts, which is exact only in float64 (rows here are short, well inside one vector).
    tol = 0.0 if dtype == torch.float64 else DTYPE_ULP[dtype]
    if name == "layer_norm":
        b = _randn(gen, shape, dtype) if affine and draw(hs.booleans(), label="bias") else None
        return Case(lambda t, w, b: spelling(t, shape, w, b, 1e-5), (x, w, b), tol=tol, whole_tol=SUMMED + tol)
    return Case(lambda t, w: spelling(t, shape, w, 1e-6), (x, w), tol=tol, whole_tol=SUMMED + tol)


def _heads(draw: Draw) -> tuple[Intervals, Intervals, int]:
    """Query and key/value heads over the ranks: ``(query intervals, key/value intervals, query heads per key/value
    head)``. Key/value heads split as the query heads are (in proportion, replicas of them too), or, as
    ``tensor_parallel_spec`` gives fewer key/value heads than ranks, each key/value head held by the ranks of its
    query heads (replicas), which share them out (a rank may hold a key/value head and none of its query heads)."""
    groups = draw(hs.integers(1, 3), label="query heads per key/value head")
    world = draw(hs.integers(2, 4), label="world")
    if draw(hs.booleans(), label="key/value heads held by their query heads' ranks"):
        kv_heads = draw(hs.integers(1, world - 1), label="key/value heads")
        holds = draw(hs.permutations([*range(kv_heads), *draw(hs.lists(hs.integers(0, kv_heads - 1),
                                                                      min_size=world - kv_heads,
                                                                      max_size=world - kv_heads))]), label="holders")
        q: list[tuple[int, int]] = [(0, 0)] * world
        for j in range(kv_heads):
            ranks = [r for r in range(world) if holds[r] == j]
            cuts = sorted(draw(hs.lists(hs.integers(0, groups), min_size=len(ranks) - 1, max_size=len(ranks) - 1)))
            edges = [0, *cuts, groups]
            for r, a, b in zip(ranks, edges, edges[1:]):
                q[r] = (j * groups + a, b - a) if b > a else (0, 0)
        return tuple(q), tuple((j, 1) for j in holds), groups
    kv = _intervals(draw, world=world, replicas=True)
    return tuple((st * groups, n * groups) for st, n in kv), kv, groups


@case("scaled_dot_product_attention", count=20)
def _sdpa(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    qs, kv, groups = _heads(draw)
    b, s, d = draw(hs.integers(1, 2)), draw(hs.integers(1, 3)), draw(hs.integers(1, 3))
    heads = max(st + n for st, n in kv)
    q = Placed(_randn(gen, (b, heads * groups, s, d)), Split(1, qs))
    k, v = (Placed(_randn(gen, (b, heads, s, d)), Split(1, kv)) for _ in range(2))
    mask = draw(hs.sampled_from(["none", "causal", "bool", "float", "bool per head"]), label="mask")
    kwargs: dict[str, Any] = {"enable_gqa": groups > 1}
    if draw(hs.booleans(), label="scale"):
        kwargs["scale"] = 0.5
    if mask == "causal":
        kwargs["is_causal"] = True
    args: list[Any] = [q, k, v]
    if mask in ("bool", "float", "bool per head"):
        shape = (b, heads * groups if mask == "bool per head" else 1, s, s)
        m = _randn(gen, shape)
        m = (m > -0.5) | torch.eye(s, dtype=torch.bool) if mask != "float" else m  # no row fully masked
        args.append(m)
        if mask == "float" and draw(hs.booleans(), label="learned bias"):
            # A float mask that needs a gradient (a learned position bias), ranks holding no heads included.
            return Case(lambda q, k, v, m: spelling(q, k, v, attn_mask=m, **kwargs), tuple(args), tol=SUMMED,
                        whole_tol=SUMMED)
        return Case(lambda q, k, v, m: spelling(q, k, v, attn_mask=m.detach(), **kwargs), tuple(args), tol=SUMMED)
    return Case(lambda q, k, v: spelling(q, k, v, **kwargs), tuple(args), tol=SUMMED)


@case("dropout", count=16)
def _dropout(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw, ndim=(1, 3))
    p = draw(hs.sampled_from([0.0, 0.3, 0.5, 1.0]), label="p")
    training = draw(hs.booleans(), label="training")
    transposed = draw(hs.booleans(), label="transposed input")
    seed = draw(hs.integers(0, 100), label="seed")

    def op(t: torch.Tensor) -> torch.Tensor:
        if transposed:  # a non-contiguous input: the mask follows its memory order
            t = t.transpose(0, -1)
        return spelling(t, p, training)

    return Case(op, (x,), seed=seed, gathers=None)


@case("cross_entropy", count=16)
def _cross_entropy(draw: Draw, spelling: Any, name: str) -> Case:
    return _ce_case(draw)


@case("zeros", "ones", "empty", "full", "new_zeros", "new_ones", "new_empty", "new_full", count=12)
def _factory(draw: Draw, spelling: Any, name: str) -> Case:
    """A tensor made with sizes read off a split activation (``torch.zeros(x.shape)``, ``x.new_ones(b, x.size(1))``):
    the unsharded program makes it whole; each rank, its slice. Then combined with x."""
    x = _split(draw, ndim=(1, 3))
    n = x.whole.dim()
    how = draw(hs.sampled_from(["shape", "size()", "unpacked", "one by one"]), label="sizes")
    if name.endswith("full"):
        fill = draw(hs.sampled_from([2.5, -1.0]), label="fill")
    dtype = draw(hs.sampled_from([None, torch.float64, torch.float32]), label="dtype")

    def sizes(t: torch.Tensor) -> Any:
        return {"shape": lambda: (t.shape,), "size()": lambda: (t.size(),), "unpacked": lambda: tuple(t.shape),
                "one by one": lambda: (tuple(t.size(d) for d in range(n)),)}[how]()

    def op(t: torch.Tensor) -> torch.Tensor:
        kwargs = {} if dtype is None else {"dtype": dtype}
        given = sizes(t)
        if name == "new_full":  # one argument of sizes
            made = spelling(t, given[0] if len(given) == 1 and not isinstance(given[0], int) else given, fill,
                            **kwargs)
        elif name.startswith("new_"):
            made = spelling(t, *given, **kwargs)
        elif name == "full":  # one argument of sizes (a shape, or a tuple of them)
            made = spelling(given[0] if len(given) == 1 and not isinstance(given[0], int) else given, fill, **kwargs)
        else:
            made = spelling(*given, **kwargs)
        if name.endswith("empty"):
            made = made.fill_(1.5)  # its values are whatever memory held: written before they are read
        return made * 2 + t

    return Case(op, (x,))


@case("max", "min", count=14)
def _min_max(draw: Draw, spelling: Any, name: str) -> Case:
    """``x.max(dim)`` (values and indices), ``torch.max(x, other)`` (element-wise), ``x.max()`` (every element)."""
    gen = _generator(draw)
    x = _split(draw, ndim=(1, 3), gen=gen)
    n = x.whole.dim()
    form = draw(hs.sampled_from(["along a dimension", "two tensors", "every element"]), label="form")
    if form == "two tensors":
        other = _other(draw, x, gen, forms=("whole", "broadcast", "placed", "split-otherwise"))
        return Case(lambda t, o: spelling(t, o), (x, other), whole_tol=SUMMED)
    if form == "every element":
        return Case(lambda t: spelling(t) * 1, (x,))
    d = draw(hs.integers(-n, n - 1), label="dim")
    keepdim = draw(hs.booleans(), label="keepdim")
    if draw(hs.booleans(), label="keywords"):
        return Case(lambda t: tuple(spelling(t, dim=d, keepdim=keepdim)), (x,))
    return Case(lambda t: tuple(spelling(t, d, keepdim)), (x,))


# -- Split: writes ----------------------------------------------------------------------------------------

@case("index_copy_", count=12)
def _index_copy(draw: Draw, spelling: Any, name: str) -> Case:
    """The key/value cache: a buffer sized from the keys' own shape (this rank's heads) and longer along another
    dimension, filled at positions; or a buffer placed as the keys are."""
    gen = _generator(draw)
    form = draw(hs.sampled_from(["sized from keys", "placed buffer"]), label="buffer")
    intervals = _intervals(draw)
    x = _split(draw, ndim=(2, 4), dims=[1], gen=gen, intervals=intervals)
    n = x.whole.dim()
    d = draw(hs.sampled_from([d for d in range(n) if d != 1]), label="dim")
    room = draw(hs.integers(0, 2), label="room") if form == "sized from keys" else 0
    positions = torch.randperm(x.whole.shape[d] + room, generator=gen)[: x.whole.shape[d]]

    def op(t: torch.Tensor) -> torch.Tensor:
        if form == "placed buffer":
            buffer = t * 0
        else:
            shape = list(t.shape)
            shape[d] += room
            buffer = torch.zeros(shape, dtype=t.dtype)
        return spelling(buffer, d, positions, t * 2)

    return Case(op, (x,))


@case("copy_", count=10)
def _copy(draw: Draw, spelling: Any, name: str) -> Case:
    x = _split(draw, ndim=(1, 3))
    form = draw(hs.sampled_from(["sized from it", "placed buffer"]), label="buffer")

    def op(t: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(t.shape, dtype=t.dtype) if form == "sized from it" else t * 0
        return spelling(buffer, t * 2)

    return Case(op, (x,))


@case("setitem", count=20)
def _setitem(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    x = _split(draw, ndim=(1, 3), gen=gen, replicas=True)
    # The key leaves the split dimension whole, or picks positions along it (each rank writes those it holds); its
    # integers and new axes make the view's dimensions other than the buffer's.
    along = draw(hs.booleans(), label="positions along the split")
    index = _index(draw, x.whole.dim(), list(x.whole.shape), keep=None if along else x.placement.dim)
    probe = x.whole[index]
    form = draw(hs.sampled_from(["number", "whole", "broadcast", "placed"]), label="value")

    def op(t: torch.Tensor, value: Any) -> torch.Tensor:
        buffer = t * 1.0
        if form == "placed":
            value = t[index] * -2
        spelling(buffer, index, value)
        return buffer

    if form == "number":
        return Case(op, (x, 7.5))
    shape = list(probe.shape)
    if form == "broadcast":  # needing a gradient: each rank writes it whole into its part, a share of its gradient
        shape = [1 if draw(hs.booleans()) else n for n in shape][draw(hs.integers(0, len(shape))):]
    return Case(op, (x, _randn(gen, shape)), tol=SUMMED, whole_tol=SUMMED)


# -- Partial: a pending sum -------------------------------------------------------------------------------

@case("add", "add_", "sub", "sub_", "subtract", "radd", "rsub", kind=Partial, count=16)
def _pending_add(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    x = _partial(draw)
    form = draw(hs.sampled_from(["whole", "whole no grad", "broadcast", "number", "pending"]), label="operand")
    kwargs = {"alpha": 2.0} if spelling.__name__[:2] != "__" and name != "radd" and draw(hs.booleans()) else {}
    if form == "number":
        return Case(lambda p: spelling(p, 1.5, **kwargs), (x,), tol=SUMMED)
    if form == "pending":
        return Case(lambda p: spelling(p, p * 0.5, **kwargs), (x,), tol=SUMMED)
    shape = list(x.whole.shape)
    if form == "broadcast" and not name.endswith("_"):
        shape = shape[draw(hs.integers(0, len(shape))):]
    w = _randn(gen, shape)
    if form == "whole no grad":
        return Case(lambda p, w: spelling(p, w.detach(), **kwargs), (x, w), tol=SUMMED)
    return Case(lambda p, w: spelling(p, w, **kwargs), (x, w), tol=SUMMED, whole_tol=SUMMED)


@case("mul", "mul_", "multiply", "rmul", "div", "div_", "divide", "true_divide", kind=Partial, count=16)
def _pending_scale(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    x = _partial(draw)
    form = draw(hs.sampled_from(["whole", "whole no grad", "number", "pending", "divided by it"]), label="operand")
    if name.endswith("_") and form == "divided by it":
        form = "whole"  # (a whole tensor divided in place by a pending sum: a leaf written in place, on either side)
    if form == "number":
        return Case(lambda p: spelling(p, -2.5), (x,), tol=SUMMED)
    if form == "pending":
        return Case(lambda p: spelling(p, p * 0.5 + 3), (x,), tol=SUMMED)
    w = _randn(gen, x.whole.shape[draw(hs.integers(0, x.whole.dim())):]).abs() + 0.5
    if form == "divided by it" and not name.endswith("_"):
        return Case(lambda p, w: spelling(w, p), (x, w), tol=SUMMED, whole_tol=SUMMED)
    if form == "whole no grad":
        return Case(lambda p, w: spelling(p, w.detach()), (x, w), tol=SUMMED)
    return Case(lambda p, w: spelling(p, w), (x, w), tol=SUMMED, whole_tol=SUMMED)


@case("view", "reshape", kind=Partial, count=10)
def _pending_reshape(draw: Draw, spelling: Any, name: str) -> Case:
    x = _partial(draw)
    target = _regrouped(draw, list(x.whole.shape))
    return Case(lambda p: spelling(p, tuple(target)) + 1.0, (x,), tol=SUMMED)


@case("view_as", "reshape_as", "expand_as", kind=Partial, count=8)
def _pending_as(draw: Draw, spelling: Any, name: str) -> Case:
    x = _partial(draw)
    shape = [2, *x.whole.shape] if name == "expand_as" else _regrouped(draw, list(x.whole.shape))
    return Case(lambda p, o: spelling(p, o) + 1.0, (x, torch.zeros(shape)), tol=SUMMED)


@case("flatten", "unflatten", "unsqueeze", "squeeze", "transpose", "swapaxes", "swapdims", "permute", "t",
      "contiguous", "clone", "narrow", "split", "chunk", "unbind", "expand", "getitem", "neg", "negative", "to",
      "type_as", "float", "detach", kind=Partial, count=8)
def _pending_linear(draw: Draw, spelling: Any, name: str) -> Case:
    x = _partial(draw, ndim=(1, 2) if name == "t" else (1, 3))
    n = x.whole.dim()
    d = draw(hs.integers(-n, n - 1), label="dim")
    size = x.whole.shape[d]
    dtype = draw(hs.sampled_from([torch.float64, torch.float32]), label="dtype")
    calls: dict[str, Callable[[torch.Tensor], Any]] = {
        "flatten": lambda p: spelling(p, 0, -1), "unflatten": lambda p: spelling(p, d, (1, size)),
        "unsqueeze": lambda p: spelling(p, d), "squeeze": lambda p: spelling(p, d),
        "transpose": lambda p: spelling(p, 0, d), "swapaxes": lambda p: spelling(p, 0, d),
        "swapdims": lambda p: spelling(p, 0, d), "permute": lambda p: spelling(p, list(range(n))[::-1]),
        "t": lambda p: spelling(p), "contiguous": lambda p: spelling(p.transpose(0, -1)),
        "clone": lambda p: spelling(p), "narrow": lambda p: spelling(p, d, 0, max(1, size - 1)),
        "split": lambda p: spelling(p, 1, d), "chunk": lambda p: spelling(p, 2, d), "unbind": lambda p: spelling(p, d),
        "expand": lambda p: spelling(p, 2, *p.shape), "getitem": lambda p: spelling(p, (..., slice(0, 1))),
        "neg": lambda p: spelling(p), "negative": lambda p: spelling(p),
        "to": lambda p: spelling(p, dtype),
        "type_as": lambda p: spelling(p, torch.zeros(1, dtype=torch.float32)),
        "float": lambda p: spelling(p), "detach": lambda p: spelling(p)}
    call = calls[name]
    # Added to after the op: a pending result must stay exact through the next op too.
    cast = name in ("to", "type_as", "float")
    tol = SUMMED + (DTYPE_ULP[torch.float32] if cast else 0)
    return Case(lambda p: [o + 1 for o in _tensors(call(p))], (x,), tol=tol)


@case("dropout", kind=Partial, count=10)
def _pending_dropout(draw: Draw, spelling: Any, name: str) -> Case:
    x = _partial(draw)
    p = draw(hs.sampled_from([0.0, 0.5]), label="p")
    training = draw(hs.booleans(), label="training")
    return Case(lambda t: spelling(t, p, training) + 1.0, (x,), tol=SUMMED, seed=draw(hs.integers(0, 100)))


# -- Strided: heads merged with the batch -----------------------------------------------------------------

def _strided(draw: Draw, gen: torch.Generator, intervals: Intervals | None = None, trailing: int | None = None,
             replicas: bool = False) -> tuple[Placed, int, int]:
    """``[batch * heads, seq, dim]`` with the heads split: ``batch`` blocks, each rank its heads of each."""
    batch, seq = draw(hs.integers(1, 3), label="batch"), draw(hs.integers(1, 3), label="seq")
    dim = trailing or draw(hs.integers(1, 3), label="head dim")
    intervals = intervals or _intervals(draw, replicas=replicas)
    heads = max(st + n for st, n in intervals)
    x = _randn(gen, (batch * heads, seq, dim))
    return Placed(x, Strided(0, intervals, batch)), batch, heads


@case("view", "reshape", kind=Strided, count=12)
def _strided_reshape(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    x, batch, heads = _strided(draw, gen)
    _, seq, dim = x.whole.shape
    target = draw(hs.sampled_from([(batch, heads, seq, dim), (batch, heads, -1), (batch, -1, seq, dim),
                                   (-1, seq * dim), (batch * heads * seq, dim)]), label="shape")
    return Case(lambda t: spelling(t, target), (x,))


@case("transpose", "swapaxes", "swapdims", "permute", "t", kind=Strided, count=8)
def _strided_transpose(draw: Draw, spelling: Any, name: str) -> Case:
    x, _, _ = _strided(draw, _generator(draw))
    if name == "t":
        return Case(lambda t: spelling(t.flatten(1)), (x,))
    if name == "permute":
        order = list(draw(hs.permutations(range(3)), label="order"))
        return Case(lambda t: spelling(t, order), (x,))
    a, b = draw(hs.integers(-3, 2)), draw(hs.integers(-3, 2))
    return Case(lambda t: spelling(t, a, b), (x,))


@case("bmm", "matmul", "baddbmm", kind=Strided, count=12)
def _strided_batched(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    iv = _intervals(draw, replicas=True)
    q, batch, heads = _strided(draw, gen, iv)
    k, _, _ = _strided(draw, gen, iv, trailing=q.whole.shape[2])
    if k.whole.shape[0] != q.whole.shape[0] or (name == "baddbmm" and k.whole.shape != q.whole.shape):
        k = Placed(_randn(gen, q.whole.shape), q.placement)  # (baddbmm's bias is as long as the queries)
    form = draw(hs.sampled_from(["both placed", "whole full", "whole broadcast"]), label="second")
    second: Any = k
    if form == "whole full":
        second = _randn(gen, q.whole.shape)
    elif form == "whole broadcast" and name == "matmul":
        second = _randn(gen, (1, *q.whole.shape[1:]))
    elif form == "whole broadcast":
        second = _randn(gen, q.whole.shape)
    if name == "baddbmm":
        bias = draw(hs.sampled_from(["full", "broadcast"]), label="bias")
        rows = q.whole.shape[0] if bias == "full" else 1
        alibi = _randn(gen, (rows, 1, q.whole.shape[1]))
        return Case(lambda a, b, c: spelling(c, a, b.transpose(1, 2), beta=0.5, alpha=2.0), (q, second, alibi),
                    tol=SUMMED, whole_tol=SUMMED)
    return Case(lambda a, b: spelling(a, b.transpose(1, 2)), (q, second), tol=SUMMED, whole_tol=SUMMED)


# -- Packed: a fused projection's slices ------------------------------------------------------------------

def _packed(draw: Draw, gen: torch.Generator, lead: list[int] | None = None, trailing: list[int] | None = None,
            dtype: torch.dtype = torch.float64) -> tuple[Placed, list[int]]:
    """``[..., q | k | v, ...]`` with each part split over the ranks: each rank its slices of each, side by side
    (``lead`` and ``trailing``: the sizes before and after the packed dimension; 0 to 2 drawn before, none after,
    by default)."""
    world = draw(hs.integers(2, 4), label="world")
    parts = draw(hs.integers(2, 3), label="parts")
    splits = [_intervals(draw, world) for _ in range(parts)]
    sizes = [sum(n for _, n in s) for s in splits]
    offsets = [sum(sizes[:j]) for j in range(parts)]
    pieces = tuple(tuple((offsets[j] + splits[j][r][0], splits[j][r][1]) for j in range(parts)) for r in range(world))
    if lead is None:
        lead = [draw(hs.integers(1, 2)) for _ in range(draw(hs.integers(0, 2)))]
    x = _randn(gen, (*lead, sum(sizes), *(trailing or [])), dtype)
    return Placed(x, Packed(len(lead), pieces)), sizes


@case("split", "chunk", "getitem", kind=Packed, count=16)
def _packed_parts(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    x, sizes = _packed(draw, gen)
    d = x.whole.dim() - 1
    at_boundaries = draw(hs.booleans(), label="at the parts' boundaries")
    if name == "chunk":
        n = len(sizes) if at_boundaries else draw(hs.integers(1, 3))
        return Case(lambda t: [p * 1 for p in spelling(t, n, d)], (x,))
    if name == "split":
        cut = sizes if at_boundaries else draw(hs.integers(1, 3))
        return Case(lambda t: [p * 1 for p in spelling(t, cut, -1)], (x,))
    if draw(hs.booleans(), label="other dimensions"):  # the packed dimension left whole: still packed
        x, _ = _packed(draw, gen, trailing=[draw(hs.integers(1, 3)) for _ in range(draw(hs.integers(0, 1)))])
        index = _index(draw, x.whole.dim(), list(x.whole.shape), keep=x.placement.dim)
        return Case(lambda t: spelling(t, index if len(index) != 1 else index[0]), (x,))
    low = sum(sizes[:1]) if at_boundaries else draw(hs.integers(0, sum(sizes)))
    high = sum(sizes[:2]) if at_boundaries else draw(hs.integers(low, sum(sizes)))
    return Case(lambda t: spelling(t, (..., slice(low, high))) * 1, (x,))


# -- Packed: carried through the model's code (a convolution over q, k and v concatenated) -------------------

def _packed_some(draw: Draw, gen: torch.Generator, dtype: torch.dtype = torch.float64) -> Placed:
    """A packed activation with 0 to 2 dimensions before the packed one and 0 or 1 after it."""
    lead = [draw(hs.integers(1, 2)) for _ in range(draw(hs.integers(0, 2), label="dims before"))]
    trailing = [draw(hs.integers(1, 3)) for _ in range(draw(hs.integers(0, 1), label="dims after"))]
    return _packed(draw, gen, lead, trailing, dtype)[0]


def _packed_other(draw: Draw, x: Placed, gen: torch.Generator, forms: tuple[str, ...]) -> Any:
    """A second operand for an op with the packed ``x``: packed alike, whole and broadcast along the packed
    dimension (used whole), a number, or one no rule takes (whole along the packed dimension, split on it, packed
    otherwise: the engine gathers)."""
    dtype = x.whole.dtype
    shape = list(x.whole.shape)
    d = x.placement.dim
    form = draw(hs.sampled_from(forms), label="operand")
    if form == "number":
        return draw(hs.sampled_from([2, -1.5, 0.5]), label="number")
    if form == "broadcast":
        shape[d] = 1
        shape = shape[draw(hs.integers(0, d), label="dims dropped"):]
    made = _randn(gen, shape, dtype)
    if form == "packed alike":
        return Placed(made, x.placement)
    if form == "split":
        return Placed(made, Split(d, _intervals_of_size(draw, len(x.placement.pieces), shape[d])))
    if form == "packed otherwise":
        pieces = x.placement.pieces
        return Placed(made, Packed(d, pieces[1:] + pieces[:1]))  # the same slices held by other ranks
    return made


def _intervals_of_size(draw: Draw, world: int, size: int) -> Intervals:
    """``world`` ranks' slices of ``size``, cut at drawn places (some empty)."""
    cuts = sorted(draw(hs.lists(hs.integers(0, size), min_size=world - 1, max_size=world - 1), label="cuts"))
    edges = [0, *cuts, size]
    return tuple((a, b - a) for a, b in zip(edges, edges[1:]))


PACKED_ELEMENTWISE = ("to type_as float double half bfloat16 contiguous clone detach zero_ silu sigmoid tanh relu "
                      "gelu softplus exp neg add sub mul div").split()


@case(*PACKED_ELEMENTWISE, kind=Packed, count=10)
def _packed_elementwise(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    dtype = _dtype(draw, name)
    x = _packed_some(draw, gen, dtype)
    tol = DTYPE_ULP[dtype]
    if name in ("add", "sub", "mul", "div"):
        forms = ("packed alike", "broadcast", "number", "whole", "split", "packed otherwise")
        other = _packed_other(draw, x, gen, forms)
        if name == "div" and isinstance(other, Placed):  # away from zero: a quotient, not a pole
            other = Placed(other.whole.abs() + 0.5, other.placement)
        elif name == "div" and isinstance(other, torch.Tensor):
            other = other.abs() + 0.5
        return Case(lambda t, o: spelling(t, o), (x, other), tol=tol, whole_tol=summed(dtype))
    if name in ("to", "type_as"):
        target = draw(hs.sampled_from([torch.float64, torch.float32, torch.bfloat16]), label="to")
        how = "tensor" if name == "type_as" else draw(hs.sampled_from(["dtype", "tensor", "keyword"]), label="form")
        if how == "tensor":
            return Case(lambda t, o: spelling(t, o), (x, torch.zeros(1, dtype=target)))
        if how == "keyword":
            return Case(lambda t: spelling(t, dtype=target), (x,))
        return Case(lambda t: spelling(t, target), (x,))
    if name == "zero_":
        return Case(lambda t: spelling(t * 1) + t, (x,))
    return Case(lambda t: spelling(t), (x,), tol=tol)


@case("transpose", "swapaxes", "swapdims", "permute", "t", kind=Packed, count=8)
def _packed_transpose(draw: Draw, spelling: Any, name: str) -> Case:
    gen = _generator(draw)
    if name == "t":  # at most 2 dimensions
        before = draw(hs.booleans(), label="dim before")
        x, _ = _packed(draw, gen, [2] if before else [], [] if before else [draw(hs.integers(1, 3))])
        return Case(lambda t: spelling(t), (x,))
    x = _packed_some(draw, gen)
    n = x.whole.dim()
    if name == "permute":
        order = list(draw(hs.permutations(range(n)), label="order"))
        return Case(lambda t: spelling(t, order), (x,))
    a, b = draw(hs.integers(-n, n - 1), label="dim0"), draw(hs.integers(-n, n - 1), label="dim1")
    return Case(lambda t: spelling(t, a, b), (x,))


@case("cat", "concat", "concatenate", kind=Packed, count=12)
def _packed_cat(draw: Draw, spelling: Any, name: str) -> Case:
    """Along the packed dimension, with packed and split operands (still packed: each rank's slices of each, in
    order); along another, every operand packed alike; a whole operand or another packing gathers."""
    gen = _generator(draw)
    x = _packed_some(draw, gen)
    n = x.whole.dim()
    d = draw(hs.sampled_from([x.placement.dim, x.placement.dim - n, *range(n)]), label="dim")
    others = []
    for _ in range(draw(hs.integers(1, 2), label="others")):
        form = draw(hs.sampled_from(["packed alike", "split", "whole", "packed otherwise"]), label="other")
        shape = list(x.whole.shape)
        if form == "split" and d % n == x.placement.dim:  # of its own length along the concatenation
            shape[x.placement.dim] = draw(hs.integers(1, 4), label="length")
        made = _randn(gen, shape)
        if form == "packed alike":
            others.append(Placed(made, x.placement))
        elif form == "split":
            world = len(x.placement.pieces)
            others.append(Placed(made, Split(x.placement.dim, _intervals_of_size(draw, world,
                                                                                 shape[x.placement.dim]))))
        elif form == "packed otherwise":
            others.append(Placed(made, Packed(x.placement.dim, x.placement.pieces[1:] + x.placement.pieces[:1])))
        else:
            others.append(made)
    order = draw(hs.permutations(range(len(others) + 1)), label="order")
    keyword = "axis" if name == "concatenate" else "dim"

    def op(*ts: torch.Tensor) -> torch.Tensor:
        return spelling([ts[i] for i in order], **{keyword: d})

    return Case(op, (x, *others), whole_tol=SUMMED)


@case("copy_", kind=Packed, count=10)
def _packed_copy(draw: Draw, spelling: Any, name: str) -> Case:
    """A packed value written into a buffer made from its shape (a convolution's cached state: this rank's
    slices) or into one packed alike; then used as the source is."""
    x = _packed_some(draw, _generator(draw))
    form = draw(hs.sampled_from(["sized from it", "packed buffer", "whole"]), label="buffer")
    if form == "whole" and any(sum(n for _, n in slices) == x.placement.size for slices in x.placement.pieces):
        form = "sized from it"  # (a rank holding every slice reads a whole buffer as its part: see the rule)
    whole = tuple(x.whole.shape)

    def op(t: torch.Tensor) -> torch.Tensor:
        if form == "whole":  # made from the whole sizes: it gets the whole values (gathered)
            buffer = torch.zeros(whole, dtype=t.dtype)
        else:
            buffer = torch.zeros(t.shape, dtype=t.dtype) if form == "sized from it" else t * 0
        spelling(buffer, t * 2)
        return buffer.transpose(0, -1) if buffer.dim() > 1 else buffer

    return Case(op, (x,))


# -- Split and Packed: a depthwise convolution over channels, padding --------------------------------------

@case("conv1d", kinds=(Split, Packed), count=16)
def _conv1d(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    """``F.conv1d(x, weight, bias, groups=channels)`` of ``x`` ``[batch, channels, length]`` (or unbatched) split
    or packed on its channels, each channel its own filter (the weight whole, cut to this rank's channels);
    ``groups`` written whole or read off x's shape. Several filters per channel gather."""
    gen = _generator(draw)
    length = draw(hs.integers(1, 5), label="length")
    lead = [draw(hs.integers(1, 2))] if draw(hs.booleans(), label="batched") else []
    if kind is Split:
        x = _split(draw, shape=[*lead, 1, length], dims=[len(lead)], gen=gen, replicas=True)
    else:
        x, _ = _packed(draw, gen, lead, [length])
    channels = x.whole.shape[-2]
    form = draw(hs.sampled_from(["groups written", "groups read off x", "two filters per channel"]), label="form")
    per = 2 if form == "two filters per channel" else 1
    kernel = draw(hs.integers(1, 4), label="kernel")
    weight = _randn(gen, (channels * per, 1, kernel))
    bias = _randn(gen, (channels * per,)) if draw(hs.booleans(), label="bias") else None
    stride, dilation = draw(hs.integers(1, 2), label="stride"), draw(hs.integers(1, 2), label="dilation")
    padding = draw(hs.integers(0, kernel - 1), label="padding")
    if length + 2 * padding < dilation * (kernel - 1) + 1:
        padding = dilation * (kernel - 1)  # at least one output position
    keywords = draw(hs.booleans(), label="keywords")

    def op(t: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        groups = t.shape[-2] if form == "groups read off x" else channels
        if keywords:
            return spelling(t, w, bias=b, stride=stride, padding=padding, dilation=dilation, groups=groups)
        return spelling(t, w, b, stride, padding, dilation, groups)

    return Case(op, (x, weight, bias), tol=SUMMED, whole_tol=SUMMED)


@case("pad", kinds=(Split, Packed), count=14)
def _pad(draw: Draw, spelling: Any, name: str, kind: type = Split) -> Case:
    """``F.pad`` of the last dimensions (the split one among them gathers unless padded by 0), in each mode."""
    gen = _generator(draw)
    mode = draw(hs.sampled_from(["constant", "constant", "replicate", "reflect", "circular"]), label="mode")
    if mode == "constant":
        x = _split(draw, ndim=(1, 4), gen=gen, replicas=True) if kind is Split else _packed_some(draw, gen)
        padded = draw(hs.integers(1, x.whole.dim()), label="padded dims")
    else:  # [batch, channels, length]: the last dimension padded, the split or packed one anywhere
        if kind is Split:
            x = _split(draw, ndim=3, gen=gen, replicas=True)
        else:  # [batch, channels, length] or [channels, length]; or [batch, channels], channels padded: gathers
            batched = draw(hs.booleans(), label="batched")
            last = draw(hs.booleans(), label="packed dimension last")
            x, _ = _packed(draw, gen, [draw(hs.integers(1, 2))] if batched or last else [],
                           [] if last else [draw(hs.integers(2, 3))])
        padded = 1
    sizes = list(x.whole.shape)
    pads = []
    for i in range(padded):
        size = sizes[-1 - i]
        most = {"reflect": size - 1, "circular": size}.get(mode, 2)
        pads += [draw(hs.integers(0, max(0, most)), label="pad") for _ in range(2)]
    if mode == "constant":
        value = draw(hs.sampled_from([0.0, -1.5]), label="value")
        return Case(lambda t: spelling(t, pads, "constant", value), (x,))
    return Case(lambda t: spelling(t, pads, mode=mode), (x,))


# -- Split: ops of linear attention on split heads (the gated delta rule) -----------------------------------

@case("repeat_interleave", count=12)
def _repeat_interleave(draw: Draw, spelling: Any, name: str) -> Case:
    """Each of a rank's heads repeated along the split (key heads to the value heads they serve), or along another
    dimension; per-element counts and the flattened tensor gather."""
    gen = _generator(draw)
    x = _split(draw, ndim=(1, 3), gen=gen, replicas=True)
    n = x.whole.dim()
    form = draw(hs.sampled_from(["an int", "an int", "per element", "flattened", "output size"]), label="repeats")
    along = x.placement.dim
    d = draw(hs.sampled_from([along, along - n, *range(n)]), label="dim")
    repeats = draw(hs.sampled_from([2, 3, 1, 0]), label="repeats")
    if form == "flattened":
        return Case(lambda t: spelling(t, repeats), (x,))
    if form == "per element":
        counts = torch.randint(0, 3, (x.whole.shape[d],), generator=gen)
        return Case(lambda t: spelling(t, counts, d), (x,))
    if form == "output size":
        return Case(lambda t: spelling(t, repeats, dim=d, output_size=x.whole.shape[d] * repeats), (x,))
    return Case(lambda t: spelling(t, repeats, dim=d), (x,))


@case("linalg_solve_triangular", count=30)
def _solve_triangular(draw: Draw, spelling: Any, name: str) -> Case:
    """``solve_triangular(A, B)`` split on a batch dimension (A, B or both placed; the other whole, or broadcast
    along it), on B's independent columns (``left=False``: rows) with A whole, or on what the solve mixes (gathers).
    """
    gen = _generator(draw)
    iv = _intervals(draw, replicas=True)
    total = max(st + n for st, n in iv)
    left, upper, unit = (draw(hs.booleans(), label=what) for what in ("left", "upper", "unitriangular"))
    m, k = draw(hs.integers(1, 3), label="m"), draw(hs.integers(1, 3), label="k")
    role = draw(hs.sampled_from(["batch", "batch", "independent", "independent", "solved", "triangular"]),
                label="split on")
    if role == "triangular":
        m = total
    if role == "independent":
        k = total
    if role == "solved":
        m = total
    batch = [total] if role == "batch" else [draw(hs.integers(1, 2)) for _ in range(draw(hs.integers(0, 1)))]
    a_shape = [*batch, m, m]
    b_shape = [*batch, m, k] if left else [*batch, k, m]
    if role == "batch" and draw(hs.booleans(), label="A broadcast"):
        a_shape = [1, m, m] if draw(hs.booleans()) else [m, m]
    a_whole = torch.randn(a_shape, generator=gen, dtype=torch.float64) * 0.3
    a_whole = a_whole + torch.eye(m, dtype=torch.float64) * 2  # well away from singular
    b_whole = _randn(gen, b_shape)
    b_dim = {"batch": 0, "independent": len(b_shape) - (1 if left else 2),
             "solved": len(b_shape) - (2 if left else 1), "triangular": None}[role]
    which = draw(hs.sampled_from(["A", "B", "both"]) if role == "batch" else hs.just("B"), label="placed")
    if role == "triangular":
        which = "A"
    if role == "batch" and (a_shape[0] != total or len(a_shape) != len(b_shape)):
        which = "B"  # A broadcast along the batch: whole
    args: list[Any] = []
    if which in ("A", "both"):
        a_dim = 0 if role == "batch" else len(a_shape) - 2
        args.append(Placed(a_whole, Split(a_dim, iv)))
    else:
        args.append(a_whole)
    if which in ("B", "both") or not isinstance(args[0], Placed):
        assert b_dim is not None or isinstance(args[0], Placed)
        args.append(Placed(b_whole, Split(b_dim, iv)) if b_dim is not None else b_whole)
    else:
        args.append(b_whole)

    def op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return spelling(a, b, upper=upper, left=left, unitriangular=unit)

    return Case(op, tuple(args), tol=SUMMED, whole_tol=SUMMED)


@case("zeros_like", "ones_like", "empty_like", "full_like", count=10)
def _like(draw: Draw, spelling: Any, name: str) -> Case:
    """A tensor made like a split one (an output buffer, an initial state): each rank its slice; then combined."""
    x = _split(draw, ndim=(1, 3), replicas=True)
    dtype = draw(hs.sampled_from([None, torch.float64, torch.float32]), label="dtype")
    kwargs = {} if dtype is None else {"dtype": dtype}

    def op(t: torch.Tensor) -> torch.Tensor:
        made = spelling(t, 2.5, **kwargs) if name == "full_like" else spelling(t, **kwargs)
        if name == "empty_like":
            made = made.fill_(1.5)  # its values are whatever memory held: written before they are read
        return made * 2 + t

    return Case(op, (x,))


# -- Strided: reductions over each row (a norm over each head's features, heads merged with the rows) ---------

@case("sum", "mean", "amax", "amin", "logsumexp", "special_logsumexp", "var", "std", kind=Strided, count=12)
def _strided_reduce(draw: Draw, spelling: Any, name: str) -> Case:
    """Over other dimensions than the strided one (first, or moved last by a transpose), or over it (gathers)."""
    x, _, _ = _strided(draw, _generator(draw), replicas=True)
    n = x.whole.dim()
    moved = draw(hs.booleans(), label="strided dimension last")
    keepdim = draw(hs.booleans(), label="keepdim")
    form = draw(hs.sampled_from(["one", "list", "all"]), label="dims")
    if form == "all":
        d: Any = list(range(n))
    elif form == "one":
        d = draw(hs.integers(-n, n - 1), label="dim")
    else:
        d = sorted(set(draw(hs.lists(hs.integers(0, n - 1), min_size=1, max_size=n), label="dim list")))
    correction = name in ("var", "std") and draw(hs.booleans(), label="correction")

    def op(t: torch.Tensor) -> torch.Tensor:
        t = t.transpose(0, -1) if moved else t
        if correction:
            return spelling(t, d, correction=0, keepdim=keepdim) * 1
        return spelling(t, d, keepdim=keepdim) * 1

    return Case(op, (x,), tol=SUMMED)


# -- cross-entropy on vocabulary-split logits --------------------------------------------------------------

def _ce_case(draw: Draw, boundaries: bool = False) -> Case:
    gen = _generator(draw)
    dtype = draw(hs.sampled_from([torch.float64, torch.float32]), label="dtype")
    rows = draw(hs.integers(1, 6), label="rows")
    # (A rank may hold no class: ``test_cross_entropy_with_a_rank_holding_no_vocabulary``.)
    logits = _split(draw, shape=[rows, 1], dims=[1], gen=gen, dtype=dtype, intervals=_intervals(draw))
    vocab = logits.whole.shape[1]
    # Targets at every slice boundary (each rank's first and last class), anywhere, and ignored.
    edges = sorted({i for s, n in logits.placement.intervals if n for i in (s, s + n - 1)})
    ignore = draw(hs.sampled_from([-100, 0, vocab - 1]), label="ignore_index")
    choices = [*edges, *range(vocab), ignore]
    target = torch.tensor([draw(hs.sampled_from(choices)) for _ in range(rows)])
    reduction = draw(hs.sampled_from(["none", "sum", "mean"]), label="reduction")
    if reduction == "mean" and bool((target == ignore).all()):
        target[0] = edges[0] if edges[0] != ignore else edges[-1]
        if bool((target == ignore).all()):
            reduction = "sum"
    # The loss over the split vocabulary is a log of a sum of exponentials over every rank's slice: the same terms
    # added in another order (rank by rank), in the logits' precision (float32 for float32 logits, as the op).
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    how = draw(hs.sampled_from(["positional", "keywords"]), label="form")
    if how == "positional":
        return Case(lambda t, y: F.cross_entropy(t, y, None, None, ignore, None, reduction), (logits, target), tol=tol,
                    gathers=0)
    return Case(lambda t, y: F.cross_entropy(t, target=y, ignore_index=ignore, reduction=reduction), (logits, target),
                tol=tol, gathers=0)  # the vocabulary-parallel loss: the logits are never gathered


# -- the tests --------------------------------------------------------------------------------------------

def test_every_declared_rule_has_a_case():
    """A rule added to the table (or an op gaining a spelling of a declared name) needs a case here; a case
    without a rule is stale."""
    missing = sorted(set(DECLARED) - set(CASES))
    stale = sorted(set(CASES) - set(DECLARED))
    assert not missing, f"rules without a case in this file: {missing}"
    assert not stale, f"cases without a rule in the table: {stale}"


_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                        HealthCheck.data_too_large])


def _few(count: int) -> int:
    """``examples`` for a count below its floor (an element-wise op, one of hundreds through one rule): ``count``
    in the full suite, scaled as ``examples`` scales in the quick tier, at least 3."""
    return max(3, count * settings.default.max_examples // 100)


_BROKEN: dict[tuple[str, str], str] = {}
"""Rules that fail on every call: their property is expected to fail until the engine is fixed (strict)."""


@pytest.mark.parametrize(("name", "kind"), [
    pytest.param(n, k, id=f"{k}-{n}", marks=[pytest.mark.xfail(strict=True, reason=_BROKEN[(n, k)])]
                 if (n, k) in _BROKEN else []) for n, k in sorted(CASES)])
def test_rule_on_parts_equals_op_on_the_whole(name: str, kind: str) -> None:
    draw_case, count = CASES[(name, kind)]
    spellings = DECLARED.get((name, kind))
    if spellings is None:
        pytest.fail(f"{kind} rule of {name} is not in the table (see test_every_declared_rule_has_a_case)")

    # (A rule known broken needs to fail once, not to be shrunk to its smallest case: the tests below hold that.)
    broken = {"phases": [Phase.explicit, Phase.generate]} if (name, kind) in _BROKEN else {}

    drawn = _few(count) if count < MINIMUM else examples(count)

    @settings(max_examples=drawn, **{**_SETTINGS, **broken})  # type: ignore[arg-type]
    @given(data=hs.data())
    def prop(data: Any) -> None:
        spelling = data.draw(hs.sampled_from(spellings), label="spelling")
        check(draw_case(data.draw, spelling, name))

    prop()


def _run(op: Callable[..., Any], *args: Any, tol: float = 0.0, whole_tol: float = 0.0, gathers: int | None = None,
         seed: int | None = None) -> None:
    check(Case(op, args, tol=tol, whole_tol=whole_tol, gathers=gathers, seed=seed))


def _g(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


EVEN = ((0, 1), (1, 1))
ONE_EMPTY = ((0, 0), (0, 1))
ONE_EMPTY_OF_3 = ((0, 0), (0, 3))


# -- families: cross-entropy on vocabulary-split logits ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("intervals", [((0, 3), (3, 2)), ((0, 1), (1, 3), (4, 2), (6, 1))], ids=["2-ranks", "4-ranks"])
def test_cross_entropy_at_every_slice_boundary(intervals: Intervals, reduction: str, dtype: torch.dtype) -> None:
    """Targets at each rank's first and last class, and ignored ones: the loss (in F.cross_entropy's dtype) and
    the logits' gradient, computed without gathering the logits. An off-by-one in which rank holds a target
    counts it twice or never."""
    vocab = sum(n for _, n in intervals)
    edges = [i for s, n in intervals for i in (s, s + n - 1)]
    ignore = edges[1]  # a boundary class that is also ignored: ignore_index is a target value, not a position
    targets = torch.tensor([*edges, ignore, *edges[::-1]])
    logits = Placed((_g(len(targets), vocab) * 3).to(dtype), Split(1, intervals))
    tol = 1e-12 if dtype == torch.float64 else 2e-6  # log-sum-exp over the ranks' slices, added rank by rank
    _run(lambda t, y: F.cross_entropy(t, y, ignore_index=ignore, reduction=reduction), logits, targets, tol=tol,
         gathers=0)


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("intervals", [ONE_EMPTY, ((0, 2), (2, 0), (2, 1))], ids=["1-class", "3-classes"])
def test_cross_entropy_with_a_rank_holding_no_vocabulary(intervals: Intervals, reduction: str) -> None:
    """Logits split on the vocabulary with a rank holding no class (it once raised 'index 0 is out of bounds for
    dimension 1 with size 0' there): that rank holds no target, and its share of every sum is zero; the loss and
    each rank's slice of the gradient as the unsharded op's, no gather."""
    vocab = sum(n for _, n in intervals)
    targets = torch.tensor([vocab - 1, 0, -100])
    _run(lambda t, y: F.cross_entropy(t, y, reduction=reduction), Placed(_g(3, vocab), Split(1, intervals)), targets,
         tol=1e-12, gathers=0)


# -- families: an embedding split on the vocabulary -----------------------------------------------------------

@pytest.mark.parametrize("intervals", [((0, 3), (3, 4)), ((0, 2), (2, 0), (2, 4), (6, 1))],
                         ids=["2-ranks", "4-ranks-one-empty"])
@pytest.mark.parametrize("padding_idx", [None, 2, 3])
def test_an_embedding_split_on_the_vocabulary(intervals: Intervals, padding_idx: int | None) -> None:
    """``nn.Embedding`` with its rows split, through its registration (``ShardedEmbedding``, as ``shard_model``
    installs it): ids at every slice boundary, repeated, and the padding row; the output is whole on every
    rank, each rank's rows get their part of the whole gradient (none for the padding row)."""
    from torch import nn

    from sharded_tensor._model import parallel

    vocab = sum(n for _, n in intervals)
    ids = torch.tensor([[s for s, n in intervals if n] + [s + n - 1 for s, n in intervals if n],
                        [vocab - 1, 0, *([padding_idx or 1] * (2 * sum(1 for _, n in intervals if n) - 2))]])
    whole = nn.Embedding(vocab, 3, padding_idx=padding_idx).double()
    gen = torch.Generator().manual_seed(0)
    upstream = torch.randn(*ids.shape, 3, generator=gen, dtype=torch.float64)
    (whole(ids) * upstream).sum().backward()
    want, want_grad = whole(ids).detach(), whole.weight.grad

    def rank_fn(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, length = intervals[rank]
        module = nn.Embedding(vocab, 3, padding_idx=padding_idx).double()
        module.weight = nn.Parameter(whole.weight.detach()[start:start + length].clone())
        plan = parallel.Plan(parallel.ShardedEmbedding(), parallel.EmbeddingPlan("vocab", intervals, 0))
        parallel.install(module, plan)  # as shard_model installs an Embedding whose rows are split
        out = module(ids)
        (out * upstream).sum().backward()
        return out.detach(), module.weight.grad

    with simulated(len(intervals)) as ranks:
        results = ranks.run(rank_fn)
    for rank, (out, grad) in enumerate(results):
        start, length = intervals[rank]
        torch.testing.assert_close(out, want, rtol=0, atol=0, msg=f"rank {rank}: output")
        torch.testing.assert_close(grad, want_grad[start:start + length], rtol=0, atol=0, msg=f"rank {rank}: grad")


# -- families: writes into split buffers (a key/value cache) --------------------------------------------------

def test_a_key_value_cache_grows_and_is_written_on_split_heads() -> None:
    """transformers' caches on keys split by heads: a static cache allocated from the keys' own shape and filled
    with ``index_copy_``, written at a position with ``cache[:, :, pos] = k`` and ``copy_``, and a dynamic one
    grown by ``torch.cat`` from an empty tensor; then attention reads it. No gather until the output."""
    heads = ((0, 2), (2, 0), (2, 1))  # 3 ranks, one holding no head

    def op(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        b, h, s, d = k.shape
        static_k = torch.zeros(b, h, s + 2, d, dtype=k.dtype)
        static_k.index_copy_(2, torch.tensor([0, 2, 3]), k)
        static_v = torch.zeros(b, h, s + 2, d, dtype=v.dtype).index_copy_(2, torch.tensor([4, 0, 1]), v)
        copied = torch.empty(b, h, s, d, dtype=v.dtype)
        copied.copy_(v * 2)
        placed = torch.cat([v, v[:, :, :2]], dim=2) * 0  # a buffer made from split values is split too
        placed[:, :, 2:] = v
        placed[:, :, :1] = k[:, :, :1] * 3
        dynamic = torch.tensor([], dtype=k.dtype)
        for step in range(s):  # one position per call, as decoding appends
            dynamic = torch.cat([dynamic, k[:, :, step:step + 1]], dim=-2) if dynamic.numel() else \
                torch.cat([dynamic, k[:, :, step:step + 1]], dim=-2)
        attended = F.scaled_dot_product_attention(q, static_k, static_v)
        return attended + F.scaled_dot_product_attention(q, dynamic, dynamic) + placed[:, :, :s] + copied

    shape = (2, 3, 3, 2)
    args = [Placed(_g(*shape, seed=i), Split(1, heads)) for i in range(3)]
    _run(op, *args, tol=SUMMED, gathers=0)


def test_a_cache_sized_from_the_keys_when_one_rank_holds_every_head() -> None:
    """Keys [1, 1, 1] split on dim 1 as [(0, 0), (0, 1)]; ``torch.zeros(b, h, s + 1).index_copy_(2, [1], k)`` with
    ``h`` read off the keys: rank 1's head count equals the whole one, and it must still take the buffer for its
    slice, as rank 0 does (it once fell back on rank 1 only: wrong by 2.2)."""
    def op(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        shape[2] += 1
        return torch.zeros(shape, dtype=t.dtype).index_copy_(2, torch.tensor([1]), t)

    _run(op, Placed(_g(1, 1, 1), Split(1, ONE_EMPTY)))


@pytest.mark.parametrize("form", ["broadcast", "the split of size 1", "replicas"])
def test_a_whole_value_written_across_the_split_gets_its_whole_gradient(form: str) -> None:
    """``b[key] = w`` with w whole, needing a gradient, broadcast along the split dimension: every rank writes it
    into its slice, so each holds its slice's share of w's gradient, which the ranks sum (it was once used as it
    was: silently wrong). Also where the split's whole size is 1 (its size 1 is the split's, not a broadcast), and
    with ranks holding replicas of a slice."""
    key: Any = ...
    if form == "broadcast":
        t, w = Placed(_g(2), Split(0, EVEN)), _g(1, seed=1)
    elif form == "the split of size 1":
        t, w, key = Placed(_g(1), Split(0, ONE_EMPTY)), _g(1, seed=1), slice(None)
    else:
        t, w, key = Placed(_g(3, 2), Split(0, ((0, 2), (0, 2), (2, 1)))), _g(1, seed=1), (slice(None), slice(1, None))

    def op(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        b = t * 1.0
        b[key] = w
        return b

    _run(op, t, w, whole_tol=SUMMED, gathers=0)


def test_a_static_cache_written_by_setitem() -> None:
    """transformers' static cache where ``index_copy_`` is not supported: ``cache[:, :, positions] = k`` into
    ``torch.zeros(b, h, length, d)`` with ``h`` read off the keys (this rank's heads), as ``index_copy_`` and
    ``copy_`` take it (it once fell back and wrote the gathered keys: a shape mismatch)."""
    def op(t: torch.Tensor) -> torch.Tensor:
        b, h, s, d = t.shape
        cache = torch.zeros(b, h, s + 1, d, dtype=t.dtype)
        cache[:, :, torch.tensor([1])] = t
        return cache

    _run(op, Placed(_g(1, 2, 1, 1), Split(1, EVEN)))


@pytest.mark.parametrize("key", ["an integer position", "a new axis", "a new axis and positions",
                                 "an integer position, a broadcast value", "an integer position, a placed value"])
def test_a_write_through_a_key_that_changes_the_number_of_dimensions(key: str) -> None:
    """``b[:, :, 0] = v`` (a decoding step into a static cache), ``b[None] = v``, ``b[None, :, :, -1:] = v``: b
    [1, 2, 3] split on dim 1 as [(0, 1), (1, 1)]; the value's dimensions count from the view's, which has one less
    or one more than the buffer (once counted from the buffer's: the value cut at the wrong dimension, or the
    write refused). Values whole, broadcast (needing a gradient) and placed as the view."""
    def op(t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = t * 1.0
        if key == "a new axis":
            b[None] = v
        elif key == "a new axis and positions":
            b[None, :, :, -1:] = v
        elif key == "an integer position, a placed value":
            b[:, :, 0] = t[:, :, 1] * v
        else:
            b[:, :, 0] = v
        return b

    value = {"an integer position": _g(1, 2, seed=1), "a new axis": _g(1, 1, 2, 3, seed=1),
             "a new axis and positions": _g(1, 1, 2, 1, seed=1),
             "an integer position, a broadcast value": _g(1, seed=1),
             "an integer position, a placed value": _g(1, seed=1)}[key]
    _run(op, Placed(_g(1, 2, 3), Split(1, EVEN)), value, whole_tol=SUMMED, gathers=0)


def test_a_cache_filled_through_a_view_by_copy_() -> None:
    """``cache = torch.zeros(b, h, s + 1, d)`` (``h`` read off the keys: this rank's heads), ``cache[:, :, :s]
    .copy_(k)``, then ``cache`` used: the buffer itself holds the keys' split, not only the view written to (once
    left untagged, it was taken for a whole tensor of this rank's heads: silently wrong)."""
    def op(t: torch.Tensor) -> torch.Tensor:
        b, h, s, d = t.shape
        cache = torch.zeros(b, h, s + 1, d, dtype=t.dtype)
        cache[:, :, :s].copy_(t)
        return cache * 1 + F.pad(t, (0, 0, 0, 1))

    _run(op, Placed(_g(1, 2, 1, 1), Split(1, EVEN)))


UNEVEN_5 = ((0, 2), (2, 0), (2, 3))


@pytest.mark.parametrize("form", ["a slice, a number", "a slice with a step", "an integer", "an integer held nowhere",
                                  "a list", "a tensor of positions", "a value split otherwise", "a pending sum",
                                  "replicas"])
def test_a_write_at_positions_along_the_split_dimension(form: str) -> None:
    """``b[key] = value`` with the key picking positions along the split dimension (once refused): each rank writes
    the positions it holds, with the value's part for them; a rank holding none of them writes an empty part. The
    value (whole, or made whole) gets the sum of the ranks' shares of its gradient. No gather of the buffer (but
    where the value is a pending sum, which leads: exact on the gathered buffer)."""
    x = Placed(_g(5, 2), Split(0, UNEVEN_5))
    gathers = 0
    key: Any
    if form == "a slice, a number":
        key, args = slice(0, 1), (Placed(_g(2), Split(0, EVEN)), 7.5)
    elif form == "a slice with a step":
        key, args = slice(1, None, 2), (x, _g(2, 2, seed=1))
    elif form == "an integer":
        key, args = 3, (x, _g(2, seed=1))
    elif form == "an integer held nowhere":  # rank 1 holds nothing, rank 0 not position -1
        key, args = -1, (x, _g(1, seed=1))
    elif form == "a list":
        key, args = (slice(None), [4, 0, 2]), (Placed(_g(2, 5), Split(1, ((0, 2), (2, 3)))), _g(2, 3, seed=1))
    elif form == "a tensor of positions":
        key, args = torch.tensor([1, -1]), (x, _g(1, 2, seed=1))
    elif form == "a value split otherwise":
        key, args, gathers = slice(1, 4), (x, Placed(_g(3, 2, seed=1), Split(1, ((0, 1), (1, 0), (1, 1))))), 1
    elif form == "a pending sum":  # (the pending sum's rules lead, and have none for a write: the buffer gathered)
        a = [_g(3, 2, seed=i) for i in (1, 2, 3)]
        key, args, gathers = slice(1, 4), (x, Placed(a[0] + a[1] + a[2], Partial(), tuple(a))), 1
    else:
        key, args = slice(1, 4), (Placed(_g(5, 2), Split(0, ((0, 2), (0, 2), (2, 3)))), _g(3, 2, seed=1))

    def op(t: torch.Tensor, v: Any) -> torch.Tensor:
        b = t * 1.0
        b[key] = v
        return b

    _run(op, *args, tol=SUMMED, whole_tol=SUMMED, gathers=gathers)


@pytest.mark.parametrize("op", ["index_fill_ along the split", "strided", "pending sum written through a key"])
def test_an_in_place_op_no_rule_computes_on_the_whole_tensor(op: str) -> None:
    """An in-place op on a placed tensor that no rule computes on its part runs on the whole tensor (a split one
    gathered, a pending sum summed) and the tensor takes its part of the result, keeping its placement (this was
    refused): values and every gradient as the unsharded op's, and the ops after it too."""
    if op == "index_fill_ along the split":
        _run(lambda t: (t * 1).index_fill_(0, torch.tensor([0, 3]), 0.5) * 2, Placed(_g(4, 3), Split(0, UNEVEN_4)))
    elif op == "strided":
        _run(lambda t: (t * 1).cumsum_(0) + t, Placed(_g(6, 1, 2), Strided(0, ((0, 1), (1, 0), (1, 2)), 2)))
    else:
        a = [_g(3, 2, seed=i) for i in (1, 2)]

        def written(t: torch.Tensor) -> torch.Tensor:
            p = t * 1.0
            view = p.view(6)  # a view of the pending sum: written through p, it reads what p holds
            p[1] = 5.0
            return p * 2 + view.sum()

        _run(written, Placed(a[0] + a[1], Partial(), tuple(a)), tol=SUMMED)


UNEVEN_4 = ((0, 1), (1, 0), (1, 3))


# -- families: attention ----------------------------------------------------------------------------------

@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("mask", ["bool", "float", "per head", "causal"])
def test_attention_with_a_mask_and_grouped_key_value_heads(mask: str, groups: int) -> None:
    """q split on 6 query heads, k and v on 3 key/value heads (``enable_gqa``), over 3 uneven ranks, one with no
    head; no gather."""
    kv = ((0, 2), (2, 0), (2, 1))
    q = Placed(_g(2, 3 * groups, 4, 2, seed=1), Split(1, tuple((s * groups, n * groups) for s, n in kv)))
    k, v = (Placed(_g(2, 3, 4, 2, seed=i), Split(1, kv)) for i in (2, 3))
    kwargs: dict[str, Any] = {"enable_gqa": groups > 1}
    if mask == "causal":
        _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs), q, k, v, tol=SUMMED,
             gathers=0)
        return
    heads = 3 * groups if mask == "per head" else 1
    m = _g(2, heads, 4, 4, seed=4)
    m = m if mask == "float" else (m > 0) | torch.eye(4, dtype=torch.bool)
    _run(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m.detach(), **kwargs), q, k, v, m,
         tol=SUMMED, gathers=0)


@pytest.mark.parametrize("form", ["one head", "per-head bias", "whole keys and values", "narrowed key/value heads"])
def test_attention_with_a_learned_bias_and_a_rank_holding_no_heads(form: str) -> None:
    """A float mask that needs a gradient (a learned position bias) with a rank holding no query heads: attention
    over no heads leaves its operands out of autograd, and the ranks once hung in backward (the empty rank never
    reached the bias's all-reduce). Every operand moved before the op is tied to the empty result: each rank runs
    its backward. Also a bias per head (cut: a gather in backward), whole keys and values (multi-query: each rank
    narrows them), and key/value heads a rank narrows to the ones its query heads read (replicas)."""
    bias = _g(1, 1, 1, 1, seed=3)
    if form == "one head":
        q, k, v = (Placed(_g(1, 1, 1, 1, seed=i), Split(1, ONE_EMPTY)) for i in range(3))
    elif form == "per-head bias":
        q, k, v = (Placed(_g(1, 3, 2, 2, seed=i), Split(1, ONE_EMPTY_OF_3)) for i in range(3))
        bias = _g(1, 3, 2, 2, seed=3)
    elif form == "whole keys and values":
        q = Placed(_g(1, 2, 2, 2), Split(1, ((0, 0), (0, 2))))
        k, v = _g(1, 1, 2, 2, seed=1), _g(1, 1, 2, 2, seed=2)
    else:  # 2 key/value heads, each held by the ranks of its query head, one rank with no query head
        q = Placed(_g(1, 2, 2, 2), Split(1, ((0, 1), (1, 1), (0, 0))))
        k, v = (Placed(_g(1, 2, 2, 2, seed=i), Split(1, ((0, 1), (1, 1), (1, 1)))) for i in (1, 2))
    check(Case(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), (q, k, v, bias),
               tol=SUMMED, whole_tol=SUMMED, timeout=5.0, gathers=0))


# -- families: dropout, precision, operands split two ways -------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_draws_the_unsharded_mask(p: float) -> None:
    """With the same seed, dropout on slices (uneven, one empty, 4 ranks) equals the unsharded op exactly, then
    an element-wise op and a second dropout draw on: the generator advanced as the unsharded program's."""
    x = Placed(_g(3, 7, 5), Split(1, ((0, 3), (3, 0), (3, 1), (4, 3))))
    _run(lambda t: F.dropout(F.dropout(t, p) * 2 + 1, p), x, seed=7, gathers=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_element_wise_ops_and_norms(dtype: torch.dtype) -> None:
    """A transformer MLP's element-wise ops and both norms in float32 and bfloat16 on slices (the split on the
    batch), within a few units in the dtype's last place of the unsharded op."""
    def op(t: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = F.silu(t) * torch.sigmoid(t) + F.gelu(t, approximate="tanh") - t.exp() / 4
        return F.layer_norm(h, (5,), w, b) + F.rms_norm(torch.tanh(h), (5,), w, 1e-6)

    x = Placed(_g(4, 3, 5).to(dtype), Split(0, ((0, 1), (1, 0), (1, 3))))
    _run(op, x, _g(5, seed=1).to(dtype), _g(5, seed=2).to(dtype), tol=4 * DTYPE_ULP[dtype],
         whole_tol=summed(dtype) * 4, gathers=0)


@pytest.mark.parametrize("other", ["same dim, other slices", "other dim", "packed"])
def test_operands_split_two_ways_fall_back_exactly(other: str) -> None:
    """``x * y + y`` and ``torch.cat([x, y])`` with ``y`` split another way than ``x``: the engine gathers (it
    cannot prove a slice-by-slice result) and the values stay exact, forward and backward."""
    x = Placed(_g(4, 4), Split(0, ((0, 1), (1, 3))))
    y = {"same dim, other slices": Placed(_g(4, 4, seed=1), Split(0, ((0, 3), (3, 1)))),
         "other dim": Placed(_g(4, 4, seed=1), Split(1, ((0, 2), (2, 2)))),
         "packed": Placed(_g(4, 4, seed=1), Packed(0, (((0, 1), (2, 1)), ((1, 1), (3, 1)))))}[other]
    _run(lambda a, b: torch.cat([a * b + b, b], dim=1), x, y)


# -- families: linear attention (Qwen3-Next's gated delta net) on split heads -------------------------------

# Key heads over 2 ranks, unevenly, and the value heads they serve (2 per key head): each rank the value heads of
# its key heads, as an output split of the net's projections by key groups gives them.
KEY_HEADS, VALUE_HEADS = ((0, 2), (2, 1)), ((0, 4), (4, 2))


@pytest.mark.parametrize("form", ["chunked", "chunked from a state", "recurrent from a state"])
def test_the_gated_delta_rule_on_split_heads_without_gathers(form: str) -> None:
    """transformers' reference gated delta rule (queries and keys repeated to the value heads, padded to chunks,
    triangular solves per chunk, a state per head) on each rank's heads: exact, its final state split too."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    b, s, dk, dv = 2, 5, 3, 2
    q, k = (Placed(_g(b, s, 3, dk, seed=i), Split(2, KEY_HEADS)) for i in range(2))
    v = Placed(_g(b, s, 6, dv, seed=2), Split(2, VALUE_HEADS))
    g = Placed(-_g(b, s, 6, seed=3).abs(), Split(2, VALUE_HEADS))  # a decay in log space: at most 0
    beta = Placed(_g(b, s, 6, seed=4).sigmoid(), Split(2, VALUE_HEADS))
    state = Placed(_g(b, 6, dk, dv, seed=5), Split(1, VALUE_HEADS))

    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor) -> Any:
        initial = None if form == "chunked" else state
        if form.startswith("recurrent"):
            return qwen3_next.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial,
                                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
        return qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=initial,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)

    _run(op, q, k, v, g, beta, state, tol=1e-12, gathers=0)


def test_a_causal_convolution_over_queries_keys_and_values_packed_without_gathers() -> None:
    """The gated delta net's short convolution: queries, keys and values (each split on its heads) concatenated into
    the channels of one depthwise convolution (packed: each rank its channels of each), its causal padding, the
    cached state made from the channels' shape and updated for the next token, the channels split apart again."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    b, s, kernel, dk, dv = 2, 5, 3, 2, 1
    key_dim, value_dim = 3 * dk, 6 * dv
    q, k = (Placed(_g(b, s + 1, key_dim, seed=i), Split(2, ((0, 2 * dk), (2 * dk, dk)))) for i in range(2))
    v = Placed(_g(b, s + 1, value_dim, seed=2), Split(2, ((0, 4 * dv), (4 * dv, 2 * dv))))
    weight = _g(2 * key_dim + value_dim, kernel, seed=3)

    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> Any:
        mixed = torch.cat((q, k, v), dim=-1).transpose(1, 2)
        prompt, token = mixed[:, :, :s], mixed[:, :, s:]
        out = qwen3_next.causal_conv1d_fn(prompt, w, None, activation="silu")
        conv_state = torch.zeros((*prompt.shape[:-1], kernel), dtype=prompt.dtype)
        conv_state.copy_(prompt[..., -kernel:])
        step = qwen3_next.causal_conv1d_update(token, conv_state, w, None, "silu")
        parts = torch.split(torch.cat((out, step), -1).transpose(1, 2), [key_dim, key_dim, value_dim], dim=-1)
        return [*parts, conv_state.transpose(1, 2)]

    _run(op, q, k, v, weight, tol=SUMMED, whole_tol=SUMMED, gathers=0)


def test_a_strided_norm_reshaped_back_with_sizes_read_off_the_split() -> None:
    """The gated delta net's output norm: heads merged with the rows (``reshape(-1, head_dim)``), normalized per
    row, and reshaped back to the gate's shape read off the split gate (``z.shape``): its heads' size is this
    rank's, as the strided rows' are."""
    def op(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        shape = z.shape
        rows, gate = x.reshape(-1, x.shape[-1]), z.reshape(-1, z.shape[-1])
        normed = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6) * w * F.silu(gate)
        return normed.reshape(shape).reshape(shape[0], shape[1], -1)

    heads = ((0, 2), (2, 1))
    _run(op, Placed(_g(2, 3, 3, 2), Split(2, heads)), Placed(_g(2, 3, 3, 2, seed=1), Split(2, heads)),
         _g(2, seed=2), tol=1e-12, whole_tol=SUMMED, gathers=0)


# -- the engine's limits and faults, each the smallest case found -----------------------------------------------

@pytest.mark.parametrize("form", ["a number", "a split of 1 kept", "a split of 1 expanded"])
def test_expand_to_one_size_given_as_a_number(form: str) -> None:
    """``t.expand(2)``: sizes given as one number (once a TypeError in the rule). Where the split's whole size is 1,
    a number other than 1 expands it (every rank falls back alike: a rank of length 0 and one of 1 both read it
    whole), and 1 keeps it."""
    if form == "a number":
        _run(lambda t: t.expand(2), Placed(_g(2), Split(0, EVEN)), gathers=0)
    elif form == "a split of 1 kept":
        _run(lambda t: t.expand(1) * 2, Placed(_g(1), Split(0, ONE_EMPTY)), gathers=0)
    else:
        _run(lambda t: t.expand(0) * 2 + t.expand(3).sum(), Placed(_g(1), Split(0, ONE_EMPTY)))


def test_a_strided_split_reshaped_to_separate_its_blocks() -> None:
    """A [2, 1, 1] tensor strided as 1 block over 2 ranks, ``t.view(1, 2, 1, 1)``: an ordinary split (the rule
    once raised AttributeError on every view or reshape of a strided tensor)."""
    _run(lambda t: t.view(1, 2, 1, 1), Placed(_g(2, 1, 1), Strided(0, EVEN, 1)))


@pytest.mark.parametrize("intervals", [((0, 2), (2, 2)), ((0, 2), (2, 1)), ((0, 1), (1, 0), (1, 3))],
                         ids=["even", "uneven", "one-empty"])
def test_a_reshape_read_off_the_slice_s_own_sizes_next_to_a_new_size_1_dimension(intervals: Intervals) -> None:
    """``t.view(-1, 1, t.shape[1])`` of [1, n] split on dim 1: the size read off the split dimension stands for its
    whole size, so the call is read as the unsharded program reads it ([1, 1, n], the split on dim 2) on every
    rank. Read against the local slice ([1, 2] -> [1, 1, 2]) it once put the split on the new size-1 dimension,
    its intervals halved (silently wrong), or, with uneven slices, on different dimensions on different ranks."""
    n = sum(length for _, length in intervals)
    _run(lambda t: t.view(-1, 1, t.shape[1]), Placed(_g(1, n), Split(1, intervals)), gathers=0)


@pytest.mark.parametrize("form", ["-1", "no -1", "computed from the local length"])
def test_a_reshape_with_sizes_read_off_an_empty_slice(form: str) -> None:
    """A rank with an empty slice reads the same call as the others (it once fell back alone: a 2-d slice gathered
    where the others gathered a 3-d one). ``t.view(-1, 3, t.shape[1])`` of [3, 3] and ``t.view(1, 3,
    *t.shape[1:])`` of [3, 3, 1], split on dim 1 as [(0, 0), (0, 3)]; and sizes computed from the local length
    (``t.view(t.shape[0], t.shape[1] // 2, 2)``: a plain number, this rank's), which every rank reads against
    its own slice alike."""
    if form == "-1":
        _run(lambda t: t.view(-1, 3, t.shape[1]), Placed(_g(3, 3), Split(1, ONE_EMPTY_OF_3)), gathers=0)
    elif form == "no -1":
        _run(lambda t: t.view(1, 3, *t.shape[1:]), Placed(_g(3, 3, 1), Split(1, ONE_EMPTY_OF_3)), gathers=0)
    else:
        _run(lambda t: t.view(t.shape[0], t.shape[1] // 2, 2), Placed(_g(3, 8), Split(1, ((0, 4), (4, 0), (4, 4)))),
             gathers=0)


@pytest.mark.parametrize("intervals", [((0, 2), (2, 2)), ((0, 4), (4, 2)), ((0, 2), (2, 0), (2, 4))],
                         ids=["even", "uneven", "one-empty"])
def test_a_reshape_with_a_size_divided_off_the_split_next_to_a_size_1_dimension(intervals: Intervals) -> None:
    """Grouped attention's decode step (transformers' ``pack_gqa``): ``q.reshape(b, q.shape[1] // n_rep, n_rep, d)``
    of [b, heads, 1, d] split on the heads. The quotient is a size of the split scaled (each rank's key/value
    heads), read as the unsharded program reads it: the split on dim 1, halved. As a plain number read against
    the local slice it fit dim 1 and dim 2 alike, and the call fell back with this rank's sizes (a shape error)."""
    n = sum(length for _, length in intervals)
    _run(lambda t: t.reshape(t.shape[0], t.shape[1] // 2, 2, t.shape[-1]), Placed(_g(2, n, 1, 3), Split(1, intervals)),
         gathers=0)


@pytest.mark.parametrize("op", ["bmm", "strided baddbmm"])
def test_bmm_with_a_batch_of_one_split(op: str) -> None:
    """A batch of 1 split over 2 ranks as [(0, 0), (0, 1)] with a whole operand of batch 1: its batch is the split's
    whole size, so it is cut (it was once used whole, as a broadcast one: bmm raised "Expected size for first two
    dimensions of batch2 tensor to be: [0, 1]"). ``torch.bmm`` on a split batch, and ``baddbmm`` with one head
    over 2 ranks merged with a batch of 1 (a strided split), its bias of the whole extent."""
    if op == "bmm":
        _run(lambda a, b: torch.bmm(a, b), Placed(_g(1, 1, 1), Split(0, ONE_EMPTY)), _g(1, 1, 1), tol=SUMMED,
             whole_tol=SUMMED, gathers=0)
    else:
        _run(lambda a, b, c: torch.baddbmm(c, a, b), Placed(_g(1, 2, 3), Strided(0, ONE_EMPTY, 1)), _g(1, 3, 2),
             _g(1, 2, 2), tol=SUMMED, whole_tol=SUMMED, gathers=0)


@pytest.mark.parametrize("by", ["a whole tensor that needs a gradient", "another pending sum", "a split tensor"])
def test_in_place_scaling_of_a_pending_sum(by: str) -> None:
    """``p.mul_(w)`` on a pending sum, w needing a gradient, another pending sum, or split (once refused): the
    addends are summed first, the op runs on the sum, and p becomes an addend of the result again (the result on
    the first rank), its sum kept: the op after it reads that sum with no second all-reduce."""
    a0, a1 = _g(2, seed=1), _g(2, seed=2)
    p = Placed(a0 + a1, Partial(), (a0, a1))
    if by == "another pending sum":
        _run(lambda t: (t * 1).mul_(t * 0.5) + 1, p, tol=SUMMED)
    elif by == "a split tensor":
        _run(lambda t, s: torch.tanh((t * 1).mul_(s)), p, Placed(_g(2, seed=3), Split(0, EVEN)), tol=SUMMED)
    else:
        _run(lambda t, w: (t * 1).mul_(w).exp(), p, _g(2, seed=3), tol=SUMMED, whole_tol=SUMMED)


@pytest.mark.parametrize("other", ["same dim, other slices", "other dim", "broadcast along the split", "strided",
                                   "a pending sum"])
def test_in_place_with_an_operand_split_another_way(other: str) -> None:
    """``x.add_(y)`` with y placed otherwise than x (once refused): y is brought to x's placement (made whole,
    then cut to x's slices, or used whole where it broadcasts along x's split); a pending sum, which leads, runs
    the op on the gathered x. Values and every gradient as ``x + y``'s."""
    x = Placed(_g(2, 3), Split(0, EVEN))
    y = {"same dim, other slices": Placed(_g(2, 3, seed=1), Split(0, ((0, 2), (2, 0)))),
         "other dim": Placed(_g(2, 3, seed=1), Split(1, ((0, 1), (1, 2)))),
         "broadcast along the split": Placed(_g(1, 3, seed=1), Split(1, ((0, 3), (3, 0)))),
         "strided": Placed(_g(2, 3, seed=1), Strided(0, ((0, 1), (1, 1)), 1)),
         "a pending sum": Placed(_g(2, 3, seed=1) + _g(2, 3, seed=2), Partial(), (_g(2, 3, seed=1), _g(2, 3, seed=2)))
         }[other]
    _run(lambda t, o: (t * 1).add_(o) * 2, x, y, tol=SUMMED)


# -- pending sums (Partial): each rank holds an addend, the logical tensor is their sum ------------

def _inplace_then_pending(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q = p * 1.0
    q += w  # a whole tensor added once, in place
    q -= p * 0.5  # another pending sum, in place
    return q


def _with_another(op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``op(p, w)`` plus a pending sum made first: one all-reduce only if ``op`` keeps its result pending."""
    def both(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        other = p * 0.25  # pending, made before op sums p (if it does)
        return other + op(p, w)
    return both


PENDING_OPS: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], int]] = {
    # name: (op(p, w), forward all-reduces: the pending sums that meet add up before one)
    "add-whole": (_with_another(lambda p, w: p + w), 1),
    "whole-minus": (_with_another(lambda p, w: w - p), 1),
    "add-number": (_with_another(lambda p, w: 1.5 + p), 1),
    "number-times": (_with_another(lambda p, w: 3.0 * p - 1), 1),
    "add-pending": (lambda p, w: p + p * 0.5 + w, 1),
    "torch-add-alpha": (_with_another(lambda p, w: torch.add(w, p, alpha=2.0)), 1),
    "mul-whole-no-grad": (_with_another(lambda p, w: p * w.detach()), 1),
    "div-whole-no-grad": (_with_another(lambda p, w: p / (w.detach().abs() + 1.0)), 1),
    # A scale that needs a gradient sums p first (2 in all): scaling the addends would all-reduce its
    # gradient in backward instead.
    "mul-whole": (_with_another(lambda p, w: p * w), 2),
    "div-whole": (_with_another(lambda p, w: p / (w.abs() + 1.0)), 2),
    "neg-reshape": (lambda p, w: (-p).reshape(-1), 1),
    "transpose-getitem": (lambda p, w: p.transpose(0, -1)[..., :1], 1),
    "dropout-nothing": (_with_another(lambda p, w: F.dropout(p, 0.0, True) + w), 1),
    "norm-then-more": (lambda p, w: p * 0.25 + torch.tanh(p), 2),  # the pending p * 0.25 is summed apart
    "in-place": (_inplace_then_pending, 1),
    "sum-first": (lambda p, w: torch.tanh(p) * w + p, 1),  # the sum taken once, then used whole
    "norm": (lambda p, w: w * (p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + 1e-6)), 1),
    "mean": (lambda p, w: p.mean(-1) + 1.0, 1),
}


@hs.composite
def _pending_cases(draw: Any) -> dict[str, Any]:
    ndim = draw(hs.integers(1, 3))
    return {"world": draw(hs.integers(2, 4)), "shape": tuple(draw(hs.integers(1, 4)) for _ in range(ndim)),
            "seed": draw(hs.integers(0, 2**16))}


@pytest.mark.parametrize("name", sorted(PENDING_OPS))
@settings(max_examples=examples(12), **_SETTINGS)  # type: ignore[arg-type]
@given(case=_pending_cases())
def test_pending_sum_on_addends_equals_op_on_the_sum(name: str, case: dict[str, Any]) -> None:
    """Chains of ops on pending sums: values as the unsharded ops', and the forward all-reduces counted."""
    op, all_reduces = PENDING_OPS[name]
    gen = torch.Generator().manual_seed(case["seed"])
    world, shape = case["world"], case["shape"]
    addends = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(world)]
    w = torch.randn(shape[-1:], generator=gen, dtype=torch.float64)
    xs, ws = sum(addends).clone().requires_grad_(), w.clone().requires_grad_()
    want = op(xs, ws)
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (want * upstream).sum().backward()

    def rank_fn(rank: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        local = addends[rank].clone().requires_grad_()
        weight = w.clone().requires_grad_()
        with zone():
            out = to_whole(op(tag(local.view_as(local), Partial()), weight))
        count = ranks.local.all_reduces
        (out * upstream).sum().backward()
        return out.detach(), local.grad, weight.grad, count

    with simulated(world) as ranks:
        results = ranks.run(rank_fn)
    for rank, (out, local_grad, weight_grad, count) in enumerate(results):
        torch.testing.assert_close(out, want.detach(), rtol=SUMMED, atol=SUMMED, msg=f"output on rank {rank}")
        # The addend's gradient is the whole gradient of the sum, on every rank.
        got = local_grad if local_grad is not None else torch.zeros_like(xs.grad)
        torch.testing.assert_close(got, xs.grad, rtol=SUMMED, atol=SUMMED, msg=f"addend grad on rank {rank}")
        if ws.grad is not None:
            got_w = weight_grad if weight_grad is not None else torch.zeros_like(ws.grad)
            torch.testing.assert_close(got_w, ws.grad, rtol=SUMMED, atol=SUMMED, msg=f"weight grad on rank {rank}")
        assert count == all_reduces, f"rank {rank}: {count} forward all-reduces, want {all_reduces}"


def test_packed_slices_taken_apart_by_indexing_are_exact_without_gathers():
    """A fused q/k/v output packed by heads (Phi-3's ``qkv_proj``): ``qkv[..., a:b]`` gives q, k and v split."""
    q, kv = 4, 2  # q then k then v along the last dimension: 4 + 2 + 2 features
    pieces = (((0, 2), (4, 1), (6, 1)), ((2, 2), (5, 1), (7, 1)))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, q + 2 * kv, generator=gen, dtype=torch.float64)
    w = torch.randn(q, generator=gen, dtype=torch.float64)

    def op(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        query, key, value = t[..., :q], t[..., q:q + kv], t[..., q + kv:]
        return (query * weight).sum(-1, keepdim=True) * key + value

    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = op(xs, ws)
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (want * upstream).sum().backward()

    def rank_fn(rank: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        local = torch.cat([x.narrow(-1, s, n) for s, n in pieces[rank]], -1).requires_grad_()
        weight = w.clone().requires_grad_()
        with zone():
            out = op(tag(local.view_as(local), Packed(2, pieces)), weight)
        gathers = getattr(ranks.local, "all_gathers", 0)
        out = to_whole(out)
        (out * upstream).sum().backward()
        return out.detach(), local.grad, weight.grad, gathers

    with simulated(2) as ranks:
        results = ranks.run(rank_fn)
    for rank, (out, local_grad, weight_grad, gathers) in enumerate(results):
        assert gathers == 0, f"rank {rank}: {gathers} all-gathers inside the zone"
        torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
        want_local = torch.cat([xs.grad.narrow(-1, s, n) for s, n in pieces[rank]], -1)
        torch.testing.assert_close(local_grad, want_local, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(weight_grad, ws.grad, rtol=1e-12, atol=1e-12)


def _merged_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """BLOOM's attention: heads merged with the batch for baddbmm / bmm, the batch read back from a shape."""
    b, h, s, d = x.shape
    h = 2  # as the model knows it (a constant); x.shape[1] is this rank's share
    q = x.reshape(b * h, s, d)
    k = (x * 0.5).reshape(b * h, s, d).transpose(-1, -2)
    scores = w.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=0.3)  # w: one bias row per batch and head (ALiBi)
    probs = scores.view(b, h, s, -1).softmax(-1)
    context = torch.bmm(probs.view(b * h, s, -1), q)
    batch = context.shape[0] // h
    return context.view(batch, h, s, d).permute(0, 2, 1, 3).reshape(batch, s, h * d)


def test_merged_heads_stay_split_without_gathers() -> None:
    """BLOOM's merged heads ([2, 2 heads, 3, 2] split on the heads, an ALiBi bias [4, 1, 3]): exact, no gather."""
    _run(_merged_heads, Placed(_g(2, 2, 3, 2), Split(1, EVEN)), _g(4, 1, 3, seed=1), tol=SUMMED, whole_tol=SUMMED,
         gathers=0)
