"""Every propagation rule proven by values, forward and backward, on ranks simulated in one process.

Hypothesis draws a shape, a split (uneven slices over 2 or 3 ranks), an op and its arguments.
Each simulated rank is a thread holding its slice; ``_shardkit.comm``'s rank, all-reduce and
all-gather are served by a shared in-process exchange, so the rules, their fallbacks and the
adjoints of every placement transition (gather, scatter, ``copy_to_ranks``) run unchanged.
Each rank then checks against the op on the whole tensor: the output (gathered) is the
unsharded output, its split input's gradient is its slice of the unsharded gradient, and every
replicated input (a weight) holds the complete unsharded gradient on every rank.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402

from _shardkit import comm as _comm  # noqa: E402
from sharded_tensor._model.engine import placements  # noqa: E402
from sharded_tensor._model.engine.placements import Packed, Partial, Split, tag, to_whole  # noqa: E402
from sharded_tensor._model.engine.zone import zone  # noqa: E402
from tests._examples import examples  # noqa: E402


class _Ranks:
    """Ranks as threads of one process, with the collectives ``_comm`` offers the engine."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=5)
        self.slots: list[Any] = [None] * world
        self.local = threading.local()

    def rank_and_world(self, group: Any = None) -> tuple[int, int]:
        return self.local.rank, self.world

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = tensor.detach().clone()
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()
        return everyone

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, *, op: str = "sum", **_: Any) -> torch.Tensor:
        self.local.all_reduces = getattr(self.local, "all_reduces", 0) + 1
        everyone = self._exchange(tensor)
        total = everyone[0].clone()
        for other in everyone[1:]:
            total = torch.maximum(total, other) if op == "max" else total + other
        with torch.no_grad():
            tensor.copy_(total)
        return tensor

    def all_gather_tensor(self, tensor: torch.Tensor, group: Any = None, **_: Any) -> list[torch.Tensor]:
        self.local.all_gathers = getattr(self.local, "all_gathers", 0) + 1
        return self._exchange(tensor)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def main(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - reported below, after every thread ends
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@contextlib.contextmanager
def _simulated(world: int) -> Iterator[_Ranks]:
    """``_comm`` serving ``world`` ranks as threads of this process, for the ``with`` block."""
    ranks = _Ranks(world)
    names = ("rank_and_world", "all_reduce", "all_gather_tensor")
    saved = {name: getattr(_comm, name) for name in names}
    for name in names:
        setattr(_comm, name, getattr(ranks, name))
    try:
        yield ranks
    finally:
        for name, value in saved.items():
            setattr(_comm, name, value)


# -- the ops: each gets the split input x and a replicated weight w, and returns one tensor ---------

def _weight_last(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[-1],)


def _merged_heads(x: torch.Tensor, w: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """BLOOM's attention: heads merged with the batch for baddbmm / bmm, the batch read back from a shape."""
    b, h, s, d = p["global"]
    q = x.reshape(b * h, s, d)
    k = (x * 0.5).reshape(b * h, s, d).transpose(-1, -2)
    scores = w.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=0.3)  # w: one bias row per batch and head (ALiBi)
    probs = scores.view(b, h, s, -1).softmax(-1)
    context = torch.bmm(probs.view(b * h, s, -1), q)
    batch = context.shape[0] // h
    return context.view(batch, h, s, d).permute(0, 2, 1, 3).reshape(batch, s, h * d)


# Ops that must run on the slices without an all-gather (before the output leaves the zone).
NO_GATHER = {"merged-heads"}

OPS: dict[str, tuple[Callable[..., torch.Tensor], Callable[[tuple[int, ...], Any], tuple[int, ...] | None]]] = {
    # name: (op(x, w, p), weight shape from (x shape, p) or None)
    "mul-weight": (lambda x, w, p: x * w, lambda s, p: _weight_last(s)),
    "add-scalar-weight": (lambda x, w, p: x + w, lambda s, p: ()),
    "silu-gate": (lambda x, w, p: F.silu(x) * x - 1.0, lambda s, p: None),
    "where": (lambda x, w, p: torch.where(x > 0, x, w), lambda s, p: _weight_last(s)),
    "rms-norm-last": (lambda x, w, p: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
                      lambda s, p: _weight_last(s)),
    "sum": (lambda x, w, p: x.sum(p["dim"], keepdim=p["keepdim"]), lambda s, p: None),
    "mean-keyword": (lambda x, w, p: x.mean(dim=p["dim"], keepdim=p["keepdim"]), lambda s, p: None),
    "amax": (lambda x, w, p: x.amax(p["dim"], p["keepdim"]), lambda s, p: None),
    "std-legacy": (lambda x, w, p: x.std(p["dim"], True), lambda s, p: None),
    "var-unbiased-only": (lambda x, w, p: x.var(False).expand(3), lambda s, p: None),
    "var-correction": (lambda x, w, p: torch.var(x, dim=p["dim"], correction=0, keepdim=p["keepdim"]),
                       lambda s, p: None),
    "softmax": (lambda x, w, p: x.softmax(p["dim"]), lambda s, p: None),
    "log-softmax-functional": (lambda x, w, p: F.log_softmax(x, dim=p["dim"]), lambda s, p: None),
    "cumsum": (lambda x, w, p: x.cumsum(p["dim"]), lambda s, p: None),
    "transpose": (lambda x, w, p: x.transpose(p["dim"], p["other"]) * 1.0, lambda s, p: None),
    "permute": (lambda x, w, p: x.permute(*p["perm"]) * 1.0, lambda s, p: None),
    "flatten": (lambda x, w, p: x.flatten(min(p["dim"], p["other"]), max(p["dim"], p["other"])),
                lambda s, p: None),
    "reshape-flat": (lambda x, w, p: x.reshape(-1), lambda s, p: None),
    "view-global-sizes": (lambda x, w, p: x.contiguous().view(p["global"]), lambda s, p: None),
    "unsqueeze-expand": (lambda x, w, p: x.unsqueeze(0).expand(2, *p["global"]), lambda s, p: None),
    "getitem-slice": (lambda x, w, p: x[..., :1], lambda s, p: None),
    "getitem-list": (lambda x, w, p: x[..., [0]], lambda s, p: None),
    "cat": (lambda x, w, p: torch.cat([x, 2 * x], dim=p["dim"]), lambda s, p: None),
    "stack": (lambda x, w, p: torch.stack([x, -x], p["dim"]), lambda s, p: None),
    "chunk": (lambda x, w, p: x.chunk(2, p["dim"])[0] * 1.0, lambda s, p: None),
    "matmul-weight": (lambda x, w, p: x @ w, lambda s, p: (s[-1], 3)),
    "linear": (lambda x, w, p: F.linear(x, w), lambda s, p: (2, s[-1])),
    "layer-norm": (lambda x, w, p: F.layer_norm(x, (p["global"][-1],), w), lambda s, p: _weight_last(s)),
    "batched-matmul-self": (lambda x, w, p: x @ x.transpose(-1, -2), lambda s, p: None),
    "sdpa": (lambda x, w, p: F.scaled_dot_product_attention(x, x * 0.5, x), lambda s, p: None),
    "merged-heads": (_merged_heads, lambda s, p: (s[0] * s[1], 1, s[2])),
}


@hs.composite
def _cases(draw: Any) -> dict[str, Any]:
    name = draw(hs.sampled_from(sorted(OPS)))
    ndim = 4 if name in ("sdpa", "merged-heads") else draw(hs.integers(2, 4))
    world = draw(hs.integers(2, 3))
    split_dim = 1 if name == "merged-heads" else draw(hs.integers(0, ndim - 3 if name == "sdpa" else ndim - 1))
    shape = [draw(hs.integers(1, 4)) for _ in range(ndim)]
    lengths = [draw(hs.integers(1, 3)) for _ in range(world)]
    shape[split_dim] = sum(lengths)
    starts = [sum(lengths[:r]) for r in range(world)]
    dim = draw(hs.integers(-ndim, ndim - 1))
    perm = draw(hs.permutations(range(ndim)))
    params = {"dim": dim, "other": draw(hs.integers(0, ndim - 1)), "keepdim": draw(hs.booleans()),
              "perm": list(perm), "global": list(shape)}
    if name == "stack":
        params["dim"] = draw(hs.integers(0, ndim))
    return {"name": name, "shape": tuple(shape), "split": split_dim, "world": world,
            "intervals": tuple(zip(starts, lengths)), "params": params, "seed": draw(hs.integers(0, 2**16))}


@settings(max_examples=examples(100), deadline=None, derandomize=True)
@given(case=_cases())
def test_rule_on_slices_equals_op_on_the_whole(case):
    op, weight_shape = OPS[case["name"]]
    p = case["params"]
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["shape"], generator=gen, dtype=torch.float64)
    wshape = weight_shape(case["shape"], p)
    w = torch.randn(wshape, generator=gen, dtype=torch.float64) if wshape is not None else torch.zeros(())
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    try:
        want = op(xs, ws, p)
    except (RuntimeError, IndexError, ValueError):
        return  # not a valid call on the whole tensor either
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (want * upstream).sum().backward()
    dim, intervals = case["split"], case["intervals"]

    def rank_fn(rank: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        start, length = intervals[rank]
        local = x.narrow(dim, start, length).clone().requires_grad_()
        weight = w.clone().requires_grad_()
        tagged = tag(local.view_as(local), Split(dim, intervals))
        with zone():
            out = op(tagged, weight, p)
        gathers = getattr(ranks.local, "all_gathers", 0)
        out = to_whole(out)  # as a zone's outputs leave it
        (out * upstream).sum().backward()
        return out.detach(), local.grad, weight.grad, gathers

    with _simulated(case["world"]) as ranks:
        results = ranks.run(rank_fn)
    for rank, (out, local_grad, weight_grad, gathers) in enumerate(results):
        if case["name"] in NO_GATHER:
            assert gathers == 0, f"rank {rank}: {gathers} all-gathers inside the zone"
        start, length = intervals[rank]
        torch.testing.assert_close(out, want.detach(), rtol=1e-9, atol=1e-9, msg=f"output on rank {rank}")
        want_local = xs.grad.narrow(dim, start, length)
        got_local = local_grad if local_grad is not None else torch.zeros_like(want_local)
        torch.testing.assert_close(got_local, want_local, rtol=1e-9, atol=1e-9, msg=f"input grad on rank {rank}")
        if wshape is not None and ws.grad is not None:
            got_w = weight_grad if weight_grad is not None else torch.zeros_like(ws.grad)
            torch.testing.assert_close(got_w, ws.grad, rtol=1e-9, atol=1e-9, msg=f"weight grad on rank {rank}")


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
    return {"name": draw(hs.sampled_from(sorted(PENDING_OPS))), "world": draw(hs.integers(2, 3)),
            "shape": tuple(draw(hs.integers(1, 4)) for _ in range(ndim)), "seed": draw(hs.integers(0, 2**16))}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=_pending_cases())
def test_pending_sum_on_addends_equals_op_on_the_sum(case):

    op, all_reduces = PENDING_OPS[case["name"]]
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

    with _simulated(world) as ranks:
        results = ranks.run(rank_fn)
    for rank, (out, local_grad, weight_grad, count) in enumerate(results):
        torch.testing.assert_close(out, want.detach(), rtol=1e-9, atol=1e-9, msg=f"output on rank {rank}")
        # The addend's gradient is the whole gradient of the sum, on every rank.
        got = local_grad if local_grad is not None else torch.zeros_like(xs.grad)
        torch.testing.assert_close(got, xs.grad, rtol=1e-9, atol=1e-9, msg=f"addend grad on rank {rank}")
        if ws.grad is not None:
            got_w = weight_grad if weight_grad is not None else torch.zeros_like(ws.grad)
            torch.testing.assert_close(got_w, ws.grad, rtol=1e-9, atol=1e-9, msg=f"weight grad on rank {rank}")
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

    with _simulated(2) as ranks:
        results = ranks.run(rank_fn)
    for rank, (out, local_grad, weight_grad, gathers) in enumerate(results):
        assert gathers == 0, f"rank {rank}: {gathers} all-gathers inside the zone"
        torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
        want_local = torch.cat([xs.grad.narrow(-1, s, n) for s, n in pieces[rank]], -1)
        torch.testing.assert_close(local_grad, want_local, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(weight_grad, ws.grad, rtol=1e-12, atol=1e-12)
