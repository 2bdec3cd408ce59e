"""Zones: the modules whose forward runs on placed activations, and how a call of one runs.

A zone's root module gets :class:`ZoneForward` as its forward. The outermost zone call on a
thread pushes :class:`dispatch.ZoneMode` (every op of the call, nested modules and nested
zones included, then goes through the engine), and hands out its outputs whole: each placed
tensor among them gathered or summed (a pending sum only, under :func:`loss_parallel`). A
sharded layer's own forward runs outside the mode, on its local tensors
(:func:`outside_propagation`).

Under ``torch.compile`` a zone is one opaque call for dynamo (:func:`_traced_zone`): AOTAutograd
runs the same engine on fake tensors, so the graph holds only the local ops and collectives the
rules chose, and their backward. The compiled graph is the fast path; eager runs every call
through the engine.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .boundary import OPAQUE
from .dispatch import ZoneMode, fresh_cache
from .placements import Partial, placement_of, to_whole
from .rules import table
from .state import STATE, outside_zone_mode

__all__ = ["ZoneForward", "loss_parallel", "outside_propagation", "in_zone", "zone", "ties"]


def in_zone() -> bool:
    """Whether sharded layers should hand out and accept placed activations."""
    return STATE.depth > 0


def outside_propagation() -> contextlib.AbstractContextManager[None]:
    """Run a sharded layer's own forward on its local tensors, unseen by the zone mode."""
    return outside_zone_mode()


@contextlib.contextmanager
def zone() -> Iterator[None]:
    """Open a zone call: the mode on for the outermost one, a frame of shared copies for each."""
    if not STATE.depth:
        STATE.ranks = {}  # groups may change between calls, never during one
        table()
        if not STATE.tracing:
            fresh_cache()
    STATE.depth += 1
    STATE.copies.append({})
    try:
        if STATE.depth == 1:
            with ZoneMode():
                yield
        else:
            yield
    finally:
        STATE.copies.pop()
        STATE.depth -= 1


def _whole(x: Any) -> Any:
    placement = placement_of(x)
    if placement is None:
        return x
    if STATE.explaining is not None:
        STATE.explaining.fallback(_whole, f"a {type(placement).__name__} output made whole as the zone hands it out",
                                  type(placement) is Partial)
    return to_whole(x)


def _whole_if_pending(x: Any) -> Any:
    return _whole(x) if type(placement_of(x)) is Partial else x


def _exit(out: Any) -> Any:
    """An outermost zone's outputs as it hands them out: whole (pending sums only under ``loss_parallel``).

    Outputs are walked as ``torch.utils._pytree`` walks them (transformers registers its
    ``ModelOutput``); any other object (a key/value cache, registered only for the compiled
    boundary, ``boundary``) is handed out as it is, placed tensors and all, for the next call
    of the zone to read.
    """
    return tree_map(_whole_if_pending if STATE.keep_split_outputs else _whole, out, is_leaf=_opaque)


def _opaque(value: Any) -> bool:
    return type(value) in OPAQUE


class ZoneForward:
    """``forward`` of a zone's root module: the module's own forward, run on placed activations."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self._original = original
        functools.update_wrapper(self, original)  # inspect.signature(model.forward) keeps working
        self._module: torch.nn.Module = original.__self__  # type: ignore[attr-defined]
        self._ties = ties(self._module)
        self._plain = plain_attributes(self._module)
        self._none_defaults = frozenset(name for name, parameter in inspect.signature(original).parameters.items()
                                        if parameter.default is None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if STATE.tracing:  # inside a traced zone: as the enclosing one runs
            return self._original(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Outermost in the compiled region, even inside a zone opened outside it (``loss_parallel``):
            # dynamo must not trace the engine op by op, it cannot (it reads tensors' ``__dict__``).
            _guard_state(self._module, self._plain)
            # None for an argument that defaults to None is left out: nonstrict_trace takes no None
            kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in self._none_defaults}
            return _traced_zone(self._module, self._ties, *args, **kwargs)
        explaining = STATE.explaining
        if explaining is not None:
            explaining.enter(self._module)
        try:
            if STATE.depth:  # nested: every op already goes through the enclosing zone's mode
                return self._original(*args, **kwargs)
            with zone():
                out = self._original(*args, **kwargs)
            return _exit(out)
        finally:
            if explaining is not None:
                explaining.leave(self._module)


def ties(module: torch.nn.Module) -> tuple[tuple[str, ...], ...]:
    """Names under which ``module`` holds one parameter or buffer several times (tied embeddings), in order."""
    names: dict[int, list[str]] = {}
    held = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    for name, value in held:
        names.setdefault(id(value), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def _attribute(module: torch.nn.Module, name: str) -> Any:
    owner, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner), attr)


_PLAIN = (bool, int, float, str, type(None))
# What every module holds (hook flags and the like), ``training`` aside.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}


def plain_attributes(module: torch.nn.Module) -> tuple[tuple[tuple[str, ...], str], ...]:
    """Where the modules under ``module``, and the objects they hold (a model's config), keep plain values
    (numbers, strings, ``None``, flags such as ``training``): each as the path of attribute names to its
    holder, and the value's name."""
    found: list[tuple[tuple[str, ...], str]] = []
    seen: set[int] = set()
    for path, sub in module.named_modules():
        steps = tuple(path.split(".")) if path else ()
        for name, value in vars(sub).items():
            if name in _MODULE_INTERNALS:
                continue
            if type(value) in _PLAIN:
                found.append((steps, name))
            elif _holds_settings(value) and id(value) not in seen:
                seen.add(id(value))
                found.extend(((*steps, name), key) for key, held in vars(value).items()
                             if type(held) in _PLAIN and not key.startswith("__"))
    return tuple(found)


def _holds_settings(value: Any) -> bool:
    """A plain object a module reads settings from (a transformers config), not a module, tensor or function."""
    return (hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
            and not callable(value))


def _guard_state(module: torch.nn.Module, where: tuple[tuple[tuple[str, ...], str], ...]) -> None:
    """Compare each plain value ``where`` names, where dynamo sees it: dynamo then guards on it.

    The zone is one opaque call for dynamo, which guards only on what it reads itself, not on what
    the zone's forward reads inside; these comparisons make it guard on the values a forward may
    branch on (``if self.training``, a flag or config value changed between calls), so a change
    recompiles instead of replaying the path traced first.
    """
    for steps, name in where:
        owner = module
        for step in steps:
            owner = getattr(owner, step)
        value = getattr(owner, name)
        if value is None or value == "":  # the comparison is what makes dynamo guard on the value
            continue


@torch._dynamo.nonstrict_trace
def _traced_zone(module: torch.nn.Module, tied: tuple[tuple[str, ...], ...], *args: Any, **kwargs: Any) -> Any:
    """A zone's forward under ``torch.compile``: one opaque call for dynamo, traced by AOTAutograd.

    Dynamo does not step into the engine (its placements and rules are plain Python, decided
    from shapes); AOTAutograd runs it on fake tensors instead, so the graph receives only the
    local ops and the collectives each rule chose, and their backward.
    """
    return _zone_body(module, tied, *args, **kwargs)


@torch._dynamo.disable  # type: ignore[untyped-decorator]
def _zone_body(module: torch.nn.Module, tied: tuple[tuple[str, ...], ...], *args: Any, **kwargs: Any) -> Any:
    """``_traced_zone``'s work, never traced by dynamo itself.

    Where dynamo cannot take the zone as one opaque call (the model's code makes a shape that
    depends on values: a mixture of experts' routing), it breaks the graph there and runs the
    zone as it is, eagerly through the engine, rather than step into the engine op by op.

    AOTAutograd swaps each parameter for its traced value under its first name only; a tied
    parameter's other names (an ``lm_head`` tied to the embedding) would keep the real tensor,
    a constant without gradient, so they are pointed at the traced value too.
    """
    aliases = {alias: _attribute(module, group[0]) for group in tied for alias in group[1:]}
    previous = STATE.tracing, STATE.depth, STATE.cache
    STATE.tracing, STATE.depth, STATE.cache = True, 0, fresh_cache(tracing=True)
    try:
        with _without_zone_mode(), torch.nn.utils.stateless._reparametrize_module(module, aliases), zone():
            out = type(module).forward(module, *args, **kwargs)
        # Outputs leave the graph as plain tensors, where a placed one would lose its placement
        # (and pass for a whole one): they are made whole, under ``loss_parallel`` too, and so are
        # the tensors of a key/value cache handed out (``boundary``).
        return tree_map(_whole, out)
    finally:
        STATE.tracing, STATE.depth, STATE.cache = previous


@contextlib.contextmanager
def _without_zone_mode() -> Iterator[None]:
    """The torch function mode stack without the zone mode of a zone opened outside the compiled region
    (``loss_parallel``): the traced zone runs as an outermost one, its ops seen by its own mode only.
    Tracing may have pushed modes above it, so it is taken out wherever it sits."""
    modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())][::-1]
    for mode in modes:
        if not isinstance(mode, ZoneMode):
            torch._C._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        for mode in modes:
            torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Keep outputs split inside the ``with`` block: logits of a vocabulary-split ``lm_head`` stay slices.

    Inside the block, a Linear split on its output features (such as an ``lm_head`` split on
    the vocabulary) returns this rank's slice, and ``F.cross_entropy`` on such logits computes
    the loss over the whole vocabulary with three all-reduces of one number per row instead of
    gathering the logits. Any other op on the slices gathers them first, so results do not
    change; only the communication does. Call ``backward()`` inside or after the block.

    Example:
        >>> with st.loss_parallel():  # doctest: +SKIP
        ...     loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        >>> loss.backward()  # doctest: +SKIP
    """
    previous = STATE.keep_split_outputs
    STATE.keep_split_outputs = True
    try:
        with zone():
            yield
    finally:
        STATE.keep_split_outputs = previous
