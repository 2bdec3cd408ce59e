"""Compare a sharded model's local gradients with an unsharded reference's."""

from __future__ import annotations

import torch
from torch import nn

from sharded_tensor._model.sharder import sharded_parameters

__all__ = ["local_grad_mismatches"]


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


def gathered_grads(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (split ones gathered from all ranks; collective)."""
    out = {}
    for mod_name, module in model.named_modules():
        sharded = sharded_parameters(module)
        for attr, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{attr}" if mod_name else attr
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            out[name] = sharded[attr].wrap(grad, rank).full_tensor() if attr in sharded else grad.clone()
    return out


def relative_errors(got: dict[str, torch.Tensor], ref: nn.Module) -> dict[str, float]:
    """Per parameter, ``max |got - want| / max |want|`` against ``ref``'s gradients."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    errors = {}
    for name, grad in got.items():
        want = ref_params[name].grad
        want = want if want is not None else torch.zeros_like(grad)
        errors[name] = float((grad - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    return errors
