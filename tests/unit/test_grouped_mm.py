"""The grouped matrix product of the sharded experts, and the experts' sum, eager and compiled, in one process.

``grouped_mm`` against one product per group (values and gradients, both weight layouts,
groups with no rows, rows past the counts), its operator registration as torch checks it
(``torch.library.opcheck``: schema, fake implementation, autograd), and the experts' sum
(``experts._mix``) for a rank holding all the experts or a share of them: compiled with
``fullgraph=True`` (no graph break allowed), it gives eager's output and gradients bit for
bit, and both equal a loop over the experts that picks each one's tokens with ``torch.where``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sharded_tensor._model.experts import _mix
from sharded_tensor._model.grouped_mm import grouped_mm

COUNTS = [3, 0, 4, 1]  # group 1 has no rows; rows 8 and 9 belong to no group


def _weight(linear: bool) -> torch.Tensor:
    shape = (len(COUNTS), 5, 6) if linear else (len(COUNTS), 6, 5)  # 6 inputs, 5 outputs
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _looped(x: torch.Tensor, weight: torch.Tensor, linear: bool) -> torch.Tensor:
    pieces, start = [], 0
    for group, n in enumerate(COUNTS):
        w = weight[group].T if linear else weight[group]
        pieces.append(x[start:start + n] @ w)
        start += n
    pieces.append(x[start:] @ torch.zeros_like(w))
    return torch.cat(pieces)


@pytest.mark.parametrize("linear", [True, False], ids=["out_in", "in_out"])
def test_grouped_mm_is_one_product_per_group(linear: bool) -> None:
    x = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    weight = _weight(linear)
    counts = torch.tensor(COUNTS)
    grad = torch.randn(10, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got_x, got_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    want_x, want_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    got = grouped_mm(got_x, got_w, counts, linear=linear)
    want = _looped(want_x, want_w, linear)
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_w.grad, want_w.grad, rtol=1e-12, atol=1e-12)
    assert not got[8:].any() and not got_x.grad[8:].any()  # rows of no group: zeros, and no gradient
    assert not got_w.grad[1].any()  # a group with no rows: a zero gradient, not none
    for op, args in ((torch.ops.shardkit.grouped_mm, (x, weight, counts, linear)),
                     (torch.ops.shardkit.grouped_mm_backward, (grad, x, weight, counts, linear))):
        torch.library.opcheck(op, args)


def test_grouped_mm_refuses_shapes_that_do_not_fit() -> None:
    x, weight = torch.randn(4, 6), torch.randn(2, 5, 6)
    with pytest.raises(ValueError, match=r"weight \[G, in, out\].*got x \(4, 6\).*weight \(2, 5, 6\)"):
        grouped_mm(x, weight, torch.tensor([2, 2]), linear=False)
    with pytest.raises(ValueError, match=r"counts \(3,\)"):
        grouped_mm(x, weight, torch.tensor([2, 2, 0]), linear=True)


def _experts_by_where(x, index, weights, gate_up, down, first):  # type: ignore[no-untyped-def]
    """The sum over experts ``first..`` of their weighted outputs, each expert's tokens picked by ``torch.where``."""
    out = torch.zeros_like(x)
    for local in range(gate_up.shape[0]):
        token, slot = torch.where(index == first + local)
        gate, up = F.linear(x[token], gate_up[local]).chunk(2, dim=-1)
        out = out.index_add(0, token, F.linear(F.silu(gate) * up, down[local]) * weights[token, slot, None])
    return out


@pytest.mark.parametrize(("first", "count", "experts"), [(0, 4, 4), (4, 4, 8), (6, 2, 8)],
                         ids=["every_expert", "a_share", "no_token_routed_here"])
def test_experts_compiled_equal_eager(first: int, count: int, experts: int) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, hidden, inter, k = 12, 8, 6, 2
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    if first == 6:
        logits[:, 6:] = -1e9  # no token picks experts 6 and 7: this rank's rows are none
    top = logits.softmax(-1).topk(k, dim=-1)
    gate_up = torch.randn(count, 2 * inter, hidden, generator=gen) * 0.3
    down = torch.randn(count, hidden, inter, generator=gen) * 0.3
    every = count == experts
    torch._dynamo.reset()
    compiled = torch.compile(_mix, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (_mix, compiled, _experts_by_where):
        leaves = [t.clone().requires_grad_() for t in (x, top.values, gate_up, down)]
        args = (leaves[0], top.indices, *leaves[1:], first)
        out = fn(*args, F.silu, every) if fn is not _experts_by_where else fn(*args)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), *(t.grad for t in leaves)])
    eager, traced, looped = results
    for got, want, name in zip(traced, eager, ("out", "x", "weights", "gate_up", "down")):
        assert torch.equal(got, want), name
    for got, want, name in zip(eager, looped, ("out", "x", "weights", "gate_up", "down")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    if first == 6:
        assert not eager[0].any() and not eager[3].any() and not eager[4].any()  # zeros, gradients still there
