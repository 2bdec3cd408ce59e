"""Layout-invariant initialization of parameters materialized shard by shard.

A model built on the meta device has shapes but no values. ``shard_model`` allocates each
rank's block of every parameter and then runs the modules' own ``reset_parameters()``
inside :class:`LayoutInvariantInit`, which makes the random fills of ``torch.nn.init`` (and
``Tensor.uniform_`` / ``Tensor.normal_`` called directly) produce, for every element, the
value that the *global* tensor would hold at that element's global index:

* Values come from the counter-based generator of ``_random``: element ``i`` (row-major
  global index) of a parameter named ``name`` is a hash of ``(derive_seed(seed, name), i)``.
  A rank computes exactly its own block and nothing else, and the same model split over
  1, 2 or 4 ranks along any dimension holds bit-identical values.
* Distributions are the ones the init rule asks for, with fans from the **global** shape:
  ``_calculate_fan_in_and_fan_out`` answers for the global tensor, so ``kaiming_uniform_``,
  ``xavier_*``, ``kaiming_normal_`` and ``Linear``'s bias bound are the unsharded ones.
* Init rules that need the whole tensor at once (``orthogonal_``, ``sparse_``, ``eye_``,
  ``dirac_``) are refused for split parameters (a ``ValueError`` naming the parameter);
  on whole (replicated) parameters they run normally.
* Any other use of torch's RNG during a module's init (buffers, helper tensors) runs with
  torch's generator seeded from ``(seed, module name)``, so replicas agree on every rank.

The fills themselves are in ``sharded_tensor._fill``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn import init as _nn_init
from torch.overrides import TorchFunctionMode

from .. import _random
from .._fill import draw_uniform_, fill_normal_, fill_trunc_normal_, fill_uniform_, trunc_bounds

__all__ = ["LayoutInvariantInit"]


# -- intercepting torch.nn.init -------------------------------------------------------------------

@dataclass
class _Region:
    """A registered local block: which parameter it belongs to and where it sits."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    calls: int = field(default=0)

    @property
    def split(self) -> bool:
        return self.local_shape != self.global_shape


_WHOLE_TENSOR_RULES = ("orthogonal_", "sparse_", "eye_", "dirac_")


class _Mode(TorchFunctionMode):
    def __init__(self, owner: LayoutInvariantInit) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        handler = self.owner._handlers.get(func)
        if handler is not None:
            named = {("from_" if k == "from" else k): v for k, v in kwargs.items()}
            bound = inspect.signature(self.owner._signatures[func]).bind(*args, **named)
            tensor = next(iter(bound.arguments.values()))
            region = self.owner.lookup(tensor) if isinstance(tensor, torch.Tensor) else None
            if region is not None:
                bound.apply_defaults()
                return handler(tensor, region, bound.arguments)
        return func(*args, **kwargs)


def _tensor_uniform_(self: torch.Tensor, from_: float = 0.0, to: float = 1.0, *,  # noqa: ARG001
                     generator: torch.Generator | None = None) -> None: ...


def _tensor_normal_(self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *,  # noqa: ARG001
                    generator: torch.Generator | None = None) -> None: ...


class LayoutInvariantInit:
    """Make ``torch.nn.init`` fill registered local blocks as slices of their global tensors.

    Use as a context manager around the modules' ``reset_parameters()``; register every
    local block first. Not thread-safe (it patches ``torch.nn.init`` while active).

    With ``invariant=True`` (the default) values come from the counter-based generator: a
    block holds exactly the values of the global tensor there, whatever the layout. With
    ``invariant=False`` each block is drawn from one ordinary generator seeded from ``(seed,
    parameter name, block offsets)`` (numpy's PCG64 for uniform fills, see
    :func:`draw_uniform_`; torch's for the others): faster, identical on every replica of a
    block, with the same distributions (fans still from the global shape), but the values
    change with the layout.

    Example:
        >>> ctx = LayoutInvariantInit(seed=0)
        >>> w = torch.empty(2, 8)            # rows 2..3 of a (4, 8) weight
        >>> ctx.register(w, "fc.weight", (4, 8), (2, 0))
        >>> with ctx:
        ...     _ = torch.nn.init.kaiming_uniform_(w, a=5 ** 0.5)   # bound from fan_in = 8
    """

    def __init__(self, seed: int, *, invariant: bool = True) -> None:
        self.seed = int(seed)
        self.invariant = invariant
        self._by_id: dict[int, tuple[torch.Tensor, _Region]] = {}
        self._by_ptr: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], _Region] = {}
        self._storages: dict[int, _Region] = {}
        self._saved: dict[str, object] = {}
        self._mode: _Mode | None = None
        self._signatures: dict[object, Callable[..., object]] = {
            _nn_init.uniform_: _nn_init.uniform_, _nn_init.normal_: _nn_init.normal_,
            _nn_init.kaiming_uniform_: _nn_init.kaiming_uniform_,
            torch.Tensor.uniform_: _tensor_uniform_, torch.Tensor.normal_: _tensor_normal_,
        }
        self._handlers: dict[object, Callable[[torch.Tensor, _Region, dict[str, object]], torch.Tensor]] = {
            _nn_init.uniform_: lambda t, r, a: self._uniform(t, r, a["a"], a["b"]),
            _nn_init.normal_: lambda t, r, a: self._normal(t, r, a["mean"], a["std"]),
            _nn_init.kaiming_uniform_: self._kaiming_uniform,
            torch.Tensor.uniform_: lambda t, r, a: self._uniform(t, r, a["from_"], a["to"]),
            torch.Tensor.normal_: lambda t, r, a: self._normal(t, r, a["mean"], a["std"]),
        }

    # -- registry --------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor, name: str, global_shape: Sequence[int], offsets: Sequence[int]) -> None:
        """Declare ``tensor`` as the block at ``offsets`` of parameter ``name`` (``global_shape``)."""
        region = _Region(name, tuple(global_shape), tuple(offsets), tuple(tensor.shape))
        self._by_id[id(tensor)] = (tensor, region)
        if tensor.numel() > 0:
            self._by_ptr[(tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)] = region
            self._storages[tensor.untyped_storage().data_ptr()] = region

    def lookup(self, tensor: torch.Tensor) -> _Region | None:
        """The region of a registered tensor (or of a ``.data`` / ``.detach()`` alias of it)."""
        entry = self._by_id.get(id(tensor))
        if entry is not None and entry[0] is tensor:
            return entry[1]
        if tensor.numel() == 0 or tensor.device.type == "meta":
            return None
        return self._by_ptr.get((tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype))

    def _view_of_split(self, tensor: torch.Tensor) -> _Region | None:
        if tensor.numel() == 0 or tensor.device.type == "meta":
            return None
        region = self._storages.get(tensor.untyped_storage().data_ptr())
        return region if region is not None and region.split else None

    def _seed(self, region: _Region) -> int:
        k = region.calls
        region.calls += 1
        return _random.derive_seed(self.seed, region.name) if k == 0 else _random.derive_seed(self.seed, region.name, k)

    # -- fills -------------------------------------------------------------------------------

    def _block_seed(self, region: _Region) -> int:
        """Seed of this block's draw in the layout-dependent mode: replicas of a block agree."""
        return _random.derive_seed(self._seed(region), *region.offsets)

    def _generator(self, tensor: torch.Tensor, region: _Region) -> torch.Generator:
        return torch.Generator(device=tensor.device).manual_seed(self._block_seed(region))

    def _uniform(self, tensor: torch.Tensor, region: _Region, low: object, high: object) -> torch.Tensor:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            if not self.invariant:
                return draw_uniform_(tensor, self._block_seed(region), float(low), float(high))  # type: ignore[arg-type]
            return fill_uniform_(tensor, self._seed(region), region.offsets, region.global_shape,
                                 float(low), float(high))  # type: ignore[arg-type]

    def _normal(self, tensor: torch.Tensor, region: _Region, mean: object, std: object) -> torch.Tensor:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            if not self.invariant:
                return tensor.normal_(float(mean), float(std), generator=self._generator(tensor, region))  # type: ignore[arg-type]
            return fill_normal_(tensor, self._seed(region), region.offsets, region.global_shape,
                                float(mean), float(std))  # type: ignore[arg-type]

    def _trunc_normal(self, tensor: torch.Tensor, region: _Region, mean: float, std: float, a: float,
                      b: float) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            if not self.invariant:
                # Inverse CDF in place, so no block-sized temporary.
                low, high = trunc_bounds(mean, std, a, b)
                with torch.no_grad():
                    tensor.uniform_(low, high, generator=self._generator(tensor, region))
                    return tensor.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(a, b)
            return fill_trunc_normal_(tensor, self._seed(region), region.offsets, region.global_shape,
                                      mean, std, a, b)

    def _fans(self, region: _Region) -> tuple[int, int]:
        shape = region.global_shape
        if len(shape) < 2:
            msg = (f"fan_in and fan_out of parameter {region.name!r} cannot be computed: it has "
                   f"{len(shape)} dimension(s) (shape {shape}); they need at least 2.")
            raise ValueError(msg)
        receptive = math.prod(shape[2:])
        return shape[1] * receptive, shape[0] * receptive

    def _kaiming_uniform(self, tensor: torch.Tensor, region: _Region, args: dict[str, object]) -> torch.Tensor:
        if 0 in region.global_shape:
            return tensor
        mode = str(args["mode"]).lower()
        fan_in, fan_out = self._fans(region)
        if mode not in ("fan_in", "fan_out"):
            msg = f"kaiming_uniform_ mode={args['mode']!r} for {region.name!r}; use 'fan_in' or 'fan_out'."
            raise ValueError(msg)
        gain = _nn_init.calculate_gain(args["nonlinearity"], args["a"])  # type: ignore[arg-type]
        bound = math.sqrt(3.0) * gain / math.sqrt(fan_in if mode == "fan_in" else fan_out)
        return self._uniform(tensor, region, -bound, bound)

    # -- patches -------------------------------------------------------------------------------

    def _patched_fans(self, original: Callable[[torch.Tensor], tuple[int, int]]
                      ) -> Callable[[torch.Tensor], tuple[int, int]]:
        def fans(tensor: torch.Tensor) -> tuple[int, int]:
            region = self.lookup(tensor)
            return self._fans(region) if region is not None else original(tensor)
        return fans

    def _patched_trunc_normal(self, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def trunc_normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0,
                          b: float = 2.0, generator: torch.Generator | None = None) -> torch.Tensor:
            region = self.lookup(tensor)
            if region is None:
                self._refuse_partial(tensor, "trunc_normal_")
                return original(tensor, mean, std, a, b, generator=generator)
            return self._trunc_normal(tensor, region, float(mean), float(std), float(a), float(b))
        return trunc_normal_

    def _patched_whole(self, rule: str, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def whole(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            region = self.lookup(tensor) or self._view_of_split(tensor)
            if region is not None and region.split:
                msg = (f"torch.nn.init.{rule} needs the whole of parameter {region.name!r} (shape "
                       f"{region.global_shape}) at once, but this rank holds only the block at offsets "
                       f"{region.offsets} with shape {region.local_shape}; keep this parameter whole on every "
                       f"rank (a rankless placement such as 'cpu') or initialize it with an element-wise rule.")
                raise ValueError(msg)
            return original(tensor, *args, **kwargs)
        return whole

    def _refuse_partial(self, tensor: torch.Tensor, rule: str) -> None:
        region = self._view_of_split(tensor)
        if region is not None:
            msg = (f"{rule} on a view of part of the split parameter {region.name!r} cannot be made "
                   f"layout-invariant; initialize the whole parameter (or keep it whole on every rank).")
            raise ValueError(msg)

    def __enter__(self) -> LayoutInvariantInit:
        patches: dict[str, Callable[..., object]] = {
            "_calculate_fan_in_and_fan_out": self._patched_fans(_nn_init._calculate_fan_in_and_fan_out),
            "trunc_normal_": self._patched_trunc_normal(_nn_init.trunc_normal_),
        }
        for rule in _WHOLE_TENSOR_RULES:
            patches[rule] = self._patched_whole(rule, getattr(_nn_init, rule))
        for name, fn in patches.items():
            self._saved[name] = getattr(_nn_init, name)
            setattr(_nn_init, name, fn)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None
        for name, fn in self._saved.items():
            setattr(_nn_init, name, fn)
        self._saved.clear()

    @contextlib.contextmanager
    def module_scope(self, module_name: str) -> Iterator[None]:
        """Seed torch's own RNG from ``(seed, module_name)`` for anything not intercepted."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_random.derive_seed(self.seed, "module", module_name))
            yield
