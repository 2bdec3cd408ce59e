"""The architecture matrix: transformers models tensor-parallel on 2 Gloo ranks, against themselves unsharded.

Each architecture is built from a tiny config with transformers' defaults (``use_cache``
included; no downloads), twice from the same seed: one copy stays whole, the other is sharded
with the hand-written layout of docs/huggingface.md (q/k/v/gate/up, or the fused projection,
split on output features; o/down split on input features; everything else whole), from rank
0's weights. Each batch carries ``labels``, so the models compute their own loss, as users
train them; what is differentiated is that loss plus a fixed weighting of every logit (so
every logit's gradient is checked too). On every rank:

* the forward's logits and loss equal the unsharded model's;
* every parameter's gradient, the split ones gathered whole, equals the unsharded model's
  (replicated parameters such as norms included: a gradient left as a per-rank partial sum
  shows here);
* 3 SGD steps give the same losses, the same parameters (gathered) and the same logits;
* the forward's collectives are counted: one all-reduce per row-parallel projection (and per
  statistic over split features, as OLMo2's norms across heads), one per layer where attention
  and MLP run in parallel (their pending sums are added before one all-reduce), and no
  all-gather (every model here has heads that divide the 2 ranks; BLOOM's merge of the batch
  with the heads keeps them split);
* decoders generate (greedy, with the key/value cache their config asks for) the unsharded
  model's tokens, and each decode step does the forward's all-reduces and no all-gather.

Every call runs through the engine; the first forward run again on the same batch must give the
first call's logits and gradients bit for bit (the engine's decisions, cached after the first
call, take the same path).

Each architecture is also imported as docs/huggingface.md does (``save_pretrained`` on rank 0,
a meta model sharded with ``init=False``, ``checkpoint.load``): the gathered parameters must
be the saved ones.

One spawn per group of architectures keeps the wall time down; a group runs lazily, so
``-k`` on one architecture spawns only its group. Architectures the engine does not handle
yet stay in the matrix as strict ``xfail``s that give the current failure: the test turns
red as soon as one of them is fixed, so the mark is removed with the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

import checkpoint  # noqa: E402
import sharded_tensor as st  # noqa: E402
from tests.distributed._archs import ARCHS, BY_NAME, Arch, inputs, max_diff, objective, spec_of  # noqa: E402
from tests.distributed._grads import full_grads, full_mismatches, full_params  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed

# The labels' cross-entropy has larger gradients than the logits' weighting alone: a rate of 0.5 makes
# some models' third step diverge (Gemma3's loss jumps from 4.7 to 10.9), which turns float rounding into
# visible differences; 0.1 keeps every model's losses close to where they start.
STEPS, LR, NEW_TOKENS = 3, 0.1, 4


# --- one rank ----------------------------------------------------------------------------------


def _check(arch: Arch, rank: int, world: int) -> dict[str, Any]:
    ref, model = arch.build(), arch.build()
    model.load_state_dict(ref.state_dict())
    st.shard_model(model, spec_of(arch, world), src_rank=0)
    out: dict[str, Any] = {}

    x = inputs(arch.inputs, 0)
    with st.CommCounter() as fwd:
        got = model(**x)
    out["forward_comm"] = dict(fwd.counts)
    want = ref(**x)
    out["logits"] = max_diff(got.logits, want.logits)
    out["loss"] = (got.loss.item(), want.loss.item())
    objective(got).backward()
    first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # The same call again (its decisions cached now): the same numbers, bit for bit.
    model.zero_grad()
    again = model(**x)
    objective(again).backward()
    out["again"] = {"logits": torch.equal(again.logits, got.logits), "grads": sorted(
        n for n, p in model.named_parameters() if (p.grad is None) != (n not in first)
        or (p.grad is not None and not torch.equal(p.grad, first[n])))}
    objective(want).backward()
    out["grads"] = full_mismatches(full_grads(model, rank), {n: p.grad for n, p in ref.named_parameters()})

    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for step in range(1, STEPS + 1):
        x = inputs(arch.inputs, step)
        pair = []
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            value = objective(m(**x))
            value.backward()
            o.step()
            pair.append(value.item())
        losses.append(tuple(pair))
    out["losses"] = losses
    out["params"] = full_mismatches(full_params(model, rank), dict(ref.named_parameters()))
    with torch.no_grad():
        x = inputs(arch.inputs, 0)
        out["trained_logits"] = max_diff(model(**x).logits, ref(**x).logits)
    if arch.generates:
        out["generate"] = _generate(model, ref)
    return out


def _generate(model: torch.nn.Module, ref: torch.nn.Module) -> dict[str, Any]:
    """Greedy ``generate`` with the config's cache: both models' tokens, and each forward's collectives."""
    model.eval()
    ref.eval()
    prompt = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(4))
    kwargs = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": NEW_TOKENS,
              "min_new_tokens": NEW_TOKENS, "do_sample": False}
    steps: list[st.CommCounter] = []

    def opened(module: Any, args: Any, kw: Any) -> None:
        steps.append(st.CommCounter().__enter__())

    def closed(module: Any, args: Any, kw: Any, output: Any) -> None:
        steps[-1].__exit__(None, None, None)

    hooks = [model.register_forward_pre_hook(opened, with_kwargs=True),
             model.register_forward_hook(closed, with_kwargs=True)]
    try:
        tokens = model.generate(prompt, **kwargs).tolist()
    finally:
        for hook in hooks:
            hook.remove()
    return {"tokens": tokens, "want": ref.generate(prompt, **kwargs).tolist(),
            "steps": [dict(c.counts) for c in steps]}


def _check_import(arch: Arch, rank: int, world: int, folder: str) -> dict[str, Any]:
    """Import as docs/huggingface.md does: the gathered parameters must be the saved model's.

    Rank 0 writes the model with ``save_pretrained``; every rank shards a meta model with
    ``init=False`` and fills it with ``checkpoint.load(strict=False)``, which converts names as
    ``from_pretrained`` does and refuses to leave a parameter unfilled.
    """
    ref = arch.build()
    path = f"{folder}/{arch.name}"
    if rank == 0:
        ref.save_pretrained(path, max_shard_size="50KB")
    dist.barrier()
    with torch.device("meta"):
        model = arch.build()
    st.shard_model(model, spec_of(arch, world), init=False)
    checkpoint.load(model.state_dict(), path, strict=False)
    return {"params": full_mismatches(full_params(model, rank), dict(ref.named_parameters()))}


def _guarded(check: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    try:
        return check(*args)
    except Exception as exc:  # noqa: BLE001 - the matrix records each architecture's failure
        return {"error": f"{type(exc).__name__}: {exc}"}


def _matrix(rank: int, world: int, names: list[str], folder: str) -> dict[str, dict[str, dict[str, Any]]]:
    results = {}
    for name in names:
        arch = BY_NAME[name]
        if arch.register is not None:
            arch.register()
        results[name] = {"engine": _guarded(_check, arch, rank, world),
                         "import": _guarded(_check_import, arch, rank, world, folder)}
    return results


# --- the tests ---------------------------------------------------------------------------------


# The current failure of each architecture the engine does not handle yet (strict: a fix turns the
# test red until its entry goes).
XFAIL: dict[str, str] = {
}


@pytest.fixture(scope="module")
def group_runs(tmp_path_factory) -> Callable[[str], list[dict[str, dict[str, Any]]]]:  # noqa: ANN001
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {}

    def run(group: str) -> list[dict[str, dict[str, Any]]]:
        if group not in runs:
            names = [a.name for a in ARCHS if a.group == group]
            folder = str(tmp_path_factory.mktemp(f"pretrained-{group}"))
            runs[group] = run_distributed(_matrix, 2, names, folder, timeout=600)
        return runs[group]

    return run


# Imports that do not give the saved weights (none today: Mixtral's per-expert tensors are merged
# into its fused experts as from_pretrained merges them).
IMPORT_XFAIL: dict[str, str] = {}


def _param(arch: Arch, xfail: dict[str, str]) -> Any:
    if arch.name in xfail:
        return pytest.param(arch.name, id=arch.name, marks=pytest.mark.xfail(strict=True, reason=xfail[arch.name]))
    return pytest.param(arch.name, id=arch.name)


@pytest.mark.parametrize("name", [_param(a, XFAIL) for a in ARCHS])
def test_sharded_equals_unsharded(group_runs, name):
    arch = BY_NAME[name]
    for rank, run in enumerate(group_runs(arch.group)):
        out = run[name]["engine"]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        assert out["logits"] < 1e-5, f"rank {rank}: logits differ by {out['logits']:.2e}"
        got_loss, want_loss = out["loss"]
        assert got_loss == pytest.approx(want_loss, rel=1e-5), f"rank {rank}: the labels' loss {out['loss']}"
        assert out["grads"] == {}, f"rank {rank}: gradients differ (relative): {out['grads']}"
        for got, want in out["losses"]:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), f"rank {rank}: losses {out['losses']}"
        assert out["params"] == {}, f"rank {rank}: parameters after {STEPS} SGD steps differ: {out['params']}"
        assert out["trained_logits"] < 1e-5, f"rank {rank}: trained logits differ by {out['trained_logits']:.2e}"
        assert out["forward_comm"] == {"all_reduce": arch.all_reduces}, f"rank {rank}: {out['forward_comm']}"
        assert out["again"] == {"logits": True, "grads": []}, f"rank {rank}: the same call again: {out['again']}"
        if arch.generates:
            run_ = out["generate"]
            assert run_["tokens"] == run_["want"], f"rank {rank}: generated {run_['tokens']}, not {run_['want']}"
            # the prompt, then one forward per new token: each does the forward's all-reduces, no all-gather
            assert run_["steps"] == [{"all_reduce": arch.all_reduces}] * NEW_TOKENS, f"rank {rank}: {run_['steps']}"


@pytest.mark.parametrize("name", [_param(a, IMPORT_XFAIL) for a in ARCHS])
def test_import_gives_the_saved_weights(group_runs, name):
    for rank, run in enumerate(group_runs(BY_NAME[name].group)):
        out = run[name]["import"]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        assert out["params"] == {}, f"rank {rank}: imported parameters differ from the saved ones: {out['params']}"
