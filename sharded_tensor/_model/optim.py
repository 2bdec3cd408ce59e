"""Optimizer state of sharded models, keyed by parameter name and laid out like the parameters.

``torch.optim`` keeps per-parameter state (``exp_avg``, ``momentum_buffer``, ...) with the
shape of the *local* tensor it optimizes, keyed by the parameter's position in the
optimizer. That is neither portable across world sizes nor self-describing.
``optim_state_dict`` rewrites it as::

    {"state": {"mlp.fc1.weight": {"step": 3.0, "exp_avg": ShardedTensor, "exp_avg_sq": ShardedTensor}, ...},
     "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), ..., "params": ["mlp.fc1.weight", ...]}]}

A state tensor shaped like a sharded parameter becomes a ``ShardedTensor`` with exactly the
parameter's layout (wrapping the optimizer's own tensor: no copy); state of unsharded
parameters stays a plain tensor; ``step`` becomes a plain number. The result goes straight
into ``checkpoint.save``, and ``load_optim_state_dict`` accepts it back under any layout
or world size: each ``ShardedTensor`` is resharded into the current parameter's layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from _shardkit import comm as _comm

from .._tensor import ShardedTensor
from . import drift as _drift
from .record import ShardedParameter, sharded_parameters

__all__ = ["optim_state_dict", "load_optim_state_dict"]


def _names(model: nn.Module) -> tuple[dict[int, str], dict[int, ShardedParameter]]:
    names = {id(p): n for n, p in model.named_parameters()}
    sharded: dict[int, ShardedParameter] = {}
    for _, module in model.named_modules():
        for attr, sp in sharded_parameters(module).items():
            param = module._parameters.get(attr)
            if param is not None:
                sharded[id(param)] = sp
    return names, sharded


def _name_of(names: Mapping[int, str], param: torch.Tensor, where: str) -> str:
    name = names.get(id(param))
    if name is None:
        msg = (f"{where}: the optimizer holds a parameter of shape {tuple(param.shape)} that is not a parameter of "
               f"the model; build the optimizer from model.parameters() after shard_model().")
        raise ValueError(msg)
    return name


def _plain(value: object) -> object:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _initialize(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state with one step of zero gradients at zero learning rate."""
    created = []
    saved_lr = []
    for group in optim.param_groups:
        saved_lr.append(group["lr"])
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                created.append(p)
    try:
        with torch.no_grad(), _drift.paused():  # parameters restored below: nothing to check
            snapshot = [p.detach().clone() for g in optim.param_groups for p in g["params"]]
            optim.step()
            # Weight decay at lr=0 leaves parameters as they were, but guard against exotic optimizers.
            for p, before in zip((p for g in optim.param_groups for p in g["params"]), snapshot):
                p.copy_(before)
    finally:
        for group, lr in zip(optim.param_groups, saved_lr):
            group["lr"] = lr
        for p in created:
            p.grad = None


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``optim``'s state keyed by parameter name, with ``ShardedTensor`` s for sharded parameters.

    No communication. State tensors shaped like their parameter become ``ShardedTensor`` s with
    the parameter's layout (sharing the optimizer's memory); ``step`` becomes a plain number;
    hyperparameters are kept, with ``params`` listing parameter names.

    An optimizer that has not stepped yet has no state; then the state its first step would
    create is built (one step with zero gradients and ``lr=0``, parameters restored
    afterwards) and returned as a template, and the optimizer is left without state, so the
    result can be filled by ``checkpoint.load`` and passed to
    [`load_optim_state_dict`][sharded_tensor.load_optim_state_dict].

    Raises:
        ValueError: the optimizer holds a tensor that is not a model parameter, or per-parameter
            state whose shape is neither the parameter's nor a scalar.

    Example:
        >>> state = {"model": model.state_dict(), "optim": optim_state_dict(model, optim)}  # doctest: +SKIP
        >>> sorted(state["optim"])  # as torch's optimizer state_dict, keyed by parameter name  # doctest: +SKIP
        ['param_groups', 'state']
        >>> checkpoint.save(state, path)  # doctest: +SKIP
    """
    names, sharded = _names(model)
    template = not optim.state
    if template:
        _initialize(optim)
    state: dict[str, dict[str, object]] = {}
    groups = []
    for g, group in enumerate(optim.param_groups):
        group_names = []
        for p in group["params"]:
            name = _name_of(names, p, f"optimizer param_groups[{g}]")
            group_names.append(name)
            if not optim.state.get(p):
                continue
            sp = sharded.get(id(p))
            entry: dict[str, object] = {}
            for key, value in optim.state[p].items():
                if not isinstance(value, torch.Tensor):
                    entry[key] = value
                elif key == "step":
                    entry[key] = value.item()
                elif tuple(value.shape) == tuple(p.shape) and (value.dim() > 0 or p.dim() == 0):
                    if sp is not None:
                        rank, _ = _comm.rank_and_world(sp.group)
                        entry[key] = sp.wrap(value.detach(), rank)
                    else:
                        entry[key] = value.detach()
                elif value.dim() == 0:
                    entry[key] = value.detach()
                else:
                    msg = (f"optimizer state {key!r} of parameter {name!r} has shape {tuple(value.shape)}, neither "
                           f"the parameter's local shape {tuple(p.shape)} nor a scalar; {type(optim).__name__} keeps "
                           f"state that cannot be laid out like the parameter.")
                    raise ValueError(msg)
            state[name] = entry
        hyper = {k: _plain(v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": group_names})
    if template:
        optim.state.clear()
    return {"state": state, "param_groups": groups}


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def load_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load an ``optim_state_dict`` result into ``optim``, under the current layout. Collective.

    ``state_dict`` is what [`optim_state_dict`][sharded_tensor.optim_state_dict] returned.

    ``ShardedTensor`` entries may come from any layout or world size (e.g. filled by
    ``checkpoint.load``): each is resharded into its parameter's current layout. Full tensors
    are accepted too (each rank takes its block). Every rank must call it with the same keys.

    Raises:
        ValueError: parameter names or groups that do not match the optimizer, or state with a
            wrong shape; the message names the parameter.

    Example:
        >>> state = {"optim": optim_state_dict(model, optim)}  # a template before the first step  # doctest: +SKIP
        >>> checkpoint.load(state, path, strict=False)  # the checkpoint holds "model" too  # doctest: +SKIP
        >>> load_optim_state_dict(model, optim, state["optim"])  # doctest: +SKIP
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        msg = "state_dict must be a mapping with 'state' and 'param_groups', as returned by optim_state_dict()."
        raise ValueError(msg)
    names, sharded = _names(model)
    saved_groups = list(state_dict["param_groups"])
    if len(saved_groups) != len(optim.param_groups):
        msg = (f"the state_dict has {len(saved_groups)} parameter groups but the optimizer has "
               f"{len(optim.param_groups)}; build the optimizer with the same groups.")
        raise ValueError(msg)
    index: dict[str, int] = {}
    params: dict[str, torch.Tensor] = {}
    torch_groups = []
    for g, (saved, group) in enumerate(zip(saved_groups, optim.param_groups)):
        current = [_name_of(names, p, f"optimizer param_groups[{g}]") for p in group["params"]]
        if sorted(saved["params"]) != sorted(current):
            missing = sorted(set(current) - set(saved["params"]))
            extra = sorted(set(saved["params"]) - set(current))
            msg = (f"param_groups[{g}] does not match: the optimizer has parameters the state_dict lacks "
                   f"{missing} and the state_dict has parameters the optimizer lacks {extra}.")
            raise ValueError(msg)
        ids = []
        for name, p in zip(current, group["params"]):
            index[name] = len(index)
            params[name] = p
            ids.append(index[name])
        hyper = {k: (tuple(v) if k == "betas" and isinstance(v, list) else v)
                 for k, v in saved.items() if k != "params"}
        torch_groups.append({**hyper, "params": ids})
    torch_state: dict[int, dict[str, object]] = {}
    for name in sorted(state_dict["state"]):  # same order on every rank: resharding is collective
        if name not in params:
            msg = f"the state_dict has optimizer state for {name!r}, which the optimizer does not hold."
            raise ValueError(msg)
        p = params[name]
        sp = sharded.get(id(p))
        out: dict[str, object] = {}
        for key, value in state_dict["state"][name].items():
            where = f"optimizer state {key!r} of {name!r}"
            if isinstance(value, ShardedTensor):
                if sp is not None:
                    rank, _ = _comm.rank_and_world(sp.group)
                    out[key] = sp.local_from(value, where, rank).clone()
                else:
                    out[key] = value.full_tensor()
            elif isinstance(value, torch.Tensor) and sp is not None and value.dim() > 0:
                rank, _ = _comm.rank_and_world(sp.group)
                out[key] = sp.local_from(value, where, rank).clone()
            elif key == "step" and not isinstance(value, torch.Tensor):
                out[key] = torch.tensor(float(value), dtype=_scalar_dtype())
            elif isinstance(value, torch.Tensor):
                out[key] = value.clone()
            else:
                out[key] = value
            got = out[key]
            if isinstance(got, torch.Tensor) and got.dim() > 0 and tuple(got.shape) != tuple(p.shape):
                msg = f"{where} has shape {tuple(got.shape)}, but the parameter's local shape is {tuple(p.shape)}."
                raise ValueError(msg)
        torch_state[index[name]] = out
    optim.load_state_dict({"state": torch_state, "param_groups": torch_groups})
