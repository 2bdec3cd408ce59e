"""Replicated parameters that drift apart between ranks raise at the optimizer step that does it.

``sharded_tensor/_model/drift.py``: after each step of an optimizer holding parameters of a
model made by ``st.shard_model``, the ranks compare checksums of the parameters every rank
holds whole. Each case is a real tensor-parallel training loop on 2 Gloo ranks:

* torch's own ``clip_grad_norm_`` (each rank clips by the norm of its own shards): the first
  step raises, on both ranks, naming the cause and ``st.clip_grad_norm_``;
* one replicated gradient changed on one rank at step 3: steps 1 and 2 pass, step 3 raises and
  names that parameter alone;
* the same loop with ``st.clip_grad_norm_`` trains on, and its replicas are bit for bit equal;
  resumed from its checkpoint into a model made with ``init=False``, it trains on too;
* ``SHARDKIT_CHECK_REPLICAS=0`` lets the drift through (the replicas do differ);
* an optimizer of an unsharded model, stepped on one rank only, runs no collective;
* ``checkpoint.save`` of a drifted model names the same causes, and not broadcasting.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed

RANKS = ["rank:0/cpu", "rank:1/cpu"]


def _model(init: Any = None) -> Any:
    import torch.nn as nn

    import sharded_tensor as st
    from sharding import composite, single_split

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 96), nn.GELU(),
                              nn.Linear(96, 32), nn.LayerNorm(32), nn.Linear(32, 64))
    # Linear 2 split on outputs, 4 on inputs (one all-reduce); embedding, norms, biases of 4 and 6 whole.
    spec = composite(**{"2": single_split(0, RANKS), "4.weight": single_split(1, RANKS)})
    return st.shard_model(model, spec, seed=0 if init is None else None, init=init)


def _train(rank: int, world_size: int, mode: str, steps: int) -> dict[str, Any]:
    import torch.nn.functional as F

    import checkpoint
    import sharded_tensor as st

    if mode == "unchecked":
        os.environ["SHARDKIT_CHECK_REPLICAS"] = "0"
    model = _model(init=False if mode == "resumed" else None)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mode == "resumed":
        # Uninitialized blocks differ between ranks until the load fills them: neither the template's
        # zero step (get_state_dict of an optimizer with no state) nor the load is a drift.
        state = st.get_state_dict(model, optim)
        checkpoint.load(state, os.environ["CKPT"] + "st-clip")
        st.set_state_dict(model, optim, state)
    tokens = torch.arange(129) % 64
    done, error = 0, None
    for step in range(1, steps + 1):
        loss = F.cross_entropy(model(tokens[:-1]), tokens[1:])
        loss.backward()
        if mode == "torch-clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        elif mode == "unchecked":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        elif mode in ("st-clip", "resumed"):
            st.clip_grad_norm_(model, 0.1)
        elif mode == "one-rank-at-3":
            st.clip_grad_norm_(model, 0.1)
            if step == 3 and rank == 1:
                model[5].bias.grad.mul_(3.0)  # a per-rank change of one replicated gradient
        try:
            optim.step()
        except RuntimeError as exc:
            error = (step, str(exc))
            break
        optim.zero_grad()
        done = step
    whole = {name: t.clone() for name, t in model.state_dict().items() if not isinstance(t, st.ShardedTensor)}
    saved = None
    if mode in ("unchecked", "st-clip"):
        try:
            checkpoint.save(st.get_state_dict(model, optim), os.environ["CKPT"] + mode, quiet=True)
            saved = "saved"
        except ValueError as exc:
            saved = str(exc)
    # An optimizer that holds no parameter of a sharded model: its step is local, even on one rank alone.
    plain = torch.nn.Linear(4, 4)
    plain_optim = torch.optim.SGD(plain.parameters(), lr=0.1)
    if rank == 0:
        plain(torch.ones(2, 4)).sum().backward()
        plain_optim.step()
    return {"done": done, "error": error, "whole": whole, "saved": saved}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    os.environ["CKPT"] = str(tmp_path_factory.mktemp("drift") / "ckpt-")
    try:
        return {mode: run_distributed(_train, 2, mode, steps)
                for mode, steps in (("torch-clip", 4), ("one-rank-at-3", 5), ("st-clip", 5), ("resumed", 2),
                                    ("unchecked", 3))}
    finally:
        del os.environ["CKPT"]


def test_torch_clip_grad_norm_is_caught_at_the_first_step(runs: dict[str, list[dict[str, Any]]]) -> None:
    for result in runs["torch-clip"]:
        assert result["done"] == 0 and result["error"] is not None, result
        step, message = result["error"]
        assert step == 1, message
        assert "drifted apart between ranks" in message and "SGD" in message
        assert "torch.nn.utils.clip_grad_norm_" in message and "st.clip_grad_norm_(model, max_norm)" in message
        assert "'4.bias', '5.weight'] (and 3 more) of the 8 parameters that are whole on every rank" in message
        assert "now differ between rank 0 and rank 1 of the model's group" in message
    assert runs["torch-clip"][0]["error"] == runs["torch-clip"][1]["error"]  # the same error on every rank


def test_a_per_rank_update_is_caught_at_its_step_and_named(runs: dict[str, list[dict[str, Any]]]) -> None:
    for result in runs["one-rank-at-3"]:
        assert result["done"] == 2 and result["error"] is not None, result
        step, message = result["error"]
        assert step == 3
        assert "['5.bias'] of the 8 parameters that are whole on every rank" in message, message
        assert "a gradient scaled, masked or reduced per rank" in message and "SHARDKIT_CHECK_REPLICAS=0" in message


def test_global_clipping_trains_on_with_equal_replicas(runs: dict[str, list[dict[str, Any]]]) -> None:
    first, second = runs["st-clip"]
    assert first["done"] == second["done"] == 5 and first["error"] is None and second["error"] is None
    assert first["saved"] == second["saved"] == "saved"
    assert sorted(first["whole"]) == ["0.weight", "1.bias", "1.weight", "4.bias", "5.bias", "5.weight", "6.bias",
                                      "6.weight"]
    for name, value in first["whole"].items():
        assert torch.equal(value, second["whole"][name]), name


def test_switched_off_the_drift_goes_through_and_save_names_its_causes(
        runs: dict[str, list[dict[str, Any]]]) -> None:
    first, second = runs["unchecked"]
    assert first["done"] == second["done"] == 3 and first["error"] is None
    assert any(not torch.equal(first["whole"][n], second["whole"][n]) for n in first["whole"])  # drifted indeed
    for result in (first, second):
        message = result["saved"]
        assert "differ between rank 0 and rank 1" in message and "model.1.weight" in message, message
        assert "torch.nn.utils.clip_grad_norm_" in message and "st.clip_grad_norm_" in message
        assert "broadcast" not in message


def test_a_resumed_model_trains_on(runs: dict[str, list[dict[str, Any]]]) -> None:
    for result in runs["resumed"]:
        assert result["done"] == 2 and result["error"] is None, result
