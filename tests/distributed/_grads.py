"""Compare a sharded model's gradients, parameters and state dicts with an unsharded reference's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from sharded_tensor import CommCounter, ShardedTensor
from sharded_tensor._model.record import sharded_parameters

__all__ = ["assert_like_unsharded", "compare_with_unsharded", "full_grads", "full_mismatches", "full_params",
           "gathered_grads", "local_grad_mismatches", "relative_error", "relative_errors", "whole_state"]


def local_grad_mismatches(model: nn.Module, ref: nn.Module, rank: int) -> list[str]:
    """Names of parameters whose local gradient differs from this rank's block of the reference's."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    bad = []
    for mod_name, module in model.named_modules():
        sharded = sharded_parameters(module)
        for attr, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{attr}" if mod_name else attr
            want = ref_params[name].grad
            if attr in sharded:
                layout = sharded[attr].layout
                want = layout.local_of(rank, want) if layout.boxes[rank] is not None else want[:0]
            scale = 1 + (float(want.abs().amax()) if want.numel() else 0.0)  # float noise grows with the values
            if not torch.allclose(param.grad, want, rtol=1e-4, atol=1e-6 * scale):
                bad.append(name)
    return bad


def _full(model: nn.Module, rank: int, grad: bool, absent_as_zero: bool = False) -> dict[str, torch.Tensor]:
    # Collective for split parameters: every rank walks the parameters in the same order.
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # a tied parameter once, under its first name (as named_parameters does)
    for mod_name, module in model.named_modules():
        sharded = sharded_parameters(module)
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{mod_name}.{attr}" if mod_name else attr
            value = param.grad if grad else param.detach()
            if value is None and absent_as_zero:
                value = torch.zeros_like(param)
            if value is None:
                msg = f"{name} has no gradient"
                raise AssertionError(msg)
            out[name] = sharded[attr].wrap(value, rank).full_tensor() if attr in sharded else value.clone()
    return out


def full_grads(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by name, split ones gathered (collective)."""
    return _full(model, rank, grad=True)


def full_params(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Every parameter's whole value by name, split ones gathered (collective)."""
    return _full(model, rank, grad=False)


def full_mismatches(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor | None]) -> dict[str, float]:
    """``{name: relative difference}`` of the tensors that differ beyond float rounding, or a missing one."""
    bad = {}
    for name in sorted(set(got) | set(want)):
        a, b = got.get(name), want.get(name)
        if a is None or b is None:
            bad[name] = float("inf")
            continue
        scale = 1 + float(b.abs().amax())  # float noise grows with the values
        if a.shape != b.shape:
            bad[name] = float("inf")
        elif not torch.allclose(a, b, rtol=1e-4, atol=1e-6 * scale):
            bad[name] = float((a - b).abs().amax() / b.abs().amax().clamp_min(1e-30))
    return bad


def gathered_grads(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Like ``full_grads``, with zeros for a parameter that got no gradient (collective)."""
    return _full(model, rank, grad=True, absent_as_zero=True)


def relative_errors(got: dict[str, torch.Tensor], ref: nn.Module) -> dict[str, float]:
    """Per parameter, ``max |got - want| / max |want|`` against ``ref``'s gradients.

    A gradient that is zero in exact arithmetic (a key bias under softmax) is float noise, so
    the scale is at least 1e-4.
    """
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    errors = {}
    for name, grad in got.items():
        want = ref_params[name].grad
        want = want if want is not None else torch.zeros_like(grad)
        errors[name] = float((grad - want).abs().max()) / max(float(want.abs().max()), 1e-4)
    return errors


def whole_state(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a ``get_state_dict`` result, gathered whole, by a dotted name.

    A non-tensor optimizer entry (a step count) becomes a float32 scalar tensor, as torch's
    optimizers keep their step counts.
    """
    out = {}
    for name, value in state["model"].items():
        out[f"model.{name}"] = value.full_tensor() if isinstance(value, ShardedTensor) else value.clone()
    for name, entry in state["optim"]["state"].items():
        for key, value in entry.items():
            if isinstance(value, ShardedTensor):
                out[f"optim.{name}.{key}"] = value.full_tensor()
            elif isinstance(value, torch.Tensor):
                out[f"optim.{name}.{key}"] = value.clone()
            else:
                out[f"optim.{name}.{key}"] = torch.tensor(float(value))
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|``."""
    return float((got - want).abs().max()) / float(want.abs().max())


def compare_with_unsharded(model: nn.Module, ref: nn.Module, rank: int, x: torch.Tensor, vocab: int, *,
                           labels: torch.Tensor | None = None) -> dict[str, Any]:
    """A sharded language model against its unsharded copy ``ref`` (same weights), on this rank.

    One forward and backward on tokens ``x``, then 3 SGD steps (lr 0.2) on seeded batches of
    ``x``'s shape. Labels are each batch's own tokens, or ``labels`` for every step (an
    encoder-decoder's target). Returns ``comm``, the collectives of the sharded forward;
    ``logits``, their ``relative_error``; ``grads``, every parameter's (``relative_errors``,
    split ones gathered: collective); ``trained``, the logits' after the steps.
    """
    with CommCounter() as comm:
        got = model(x, labels=x if labels is None else labels)
    want = ref(x, labels=x if labels is None else labels)
    out: dict[str, Any] = {"comm": dict(comm.counts),
                           "logits": relative_error(got.logits.detach(), want.logits.detach())}
    got.loss.backward()
    want.loss.backward()
    out["grads"] = relative_errors(gathered_grads(model, rank), ref)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (model, ref))
    for step in range(3):
        y = torch.randint(0, vocab, tuple(x.shape), generator=torch.Generator().manual_seed(10 + step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(y, labels=y if labels is None else labels).loss.backward()
            o.step()
    fixed = {} if labels is None else {"labels": labels}
    with torch.no_grad():
        out["trained"] = relative_error(model(x, **fixed).logits, ref(x, **fixed).logits)
    return out


def assert_like_unsharded(found: Mapping[str, Any]) -> None:
    """``compare_with_unsharded``'s figures within float rounding: the logits (1e-5), every
    gradient and the logits after training (1e-4)."""
    assert found["logits"] < 1e-5, found["logits"]
    assert {name: e for name, e in found["grads"].items() if e > 1e-4} == {}
    assert found["trained"] < 1e-4, found["trained"]
