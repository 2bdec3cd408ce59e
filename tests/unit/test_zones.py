"""Split propagation rules, checked on rank 0's slice in one process (no communication).

A tensor tagged as rank 0's slice of a split goes through one op inside a zone; the
output's tag says how the split moved, or that the op fell back to the full tensor (in a
world of one the fallback's gather returns the slice unchanged and untagged).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sharded_tensor._model.engine import placements
from sharded_tensor._model.engine.placements import Split, tag
from sharded_tensor._model.engine.state import STATE
from sharded_tensor._model.engine.zone import zone
from sharded_tensor._model.zone_plan import Endpoint, check_head_boundaries, find_zones
from sharding import layout

TWO = ((0, 4), (4, 4))  # 8 elements over 2 ranks, 4 each


def _run(fn, *tensors):  # type: ignore[no-untyped-def]
    with zone():
        return fn(*tensors)


def _tagged(shape, dim, intervals=TWO):  # type: ignore[no-untyped-def]
    return tag(torch.randn(shape), Split(dim, intervals))


def split_of(x):  # type: ignore[no-untyped-def]
    found = placements.placement_of(x)
    return found if type(found) is Split else None


@pytest.mark.parametrize(("fn", "shape", "dim", "expected"), [
    # (B, S, 2 heads x 4) -> (B, S, heads, 4): the split moves to the heads, one head per rank
    pytest.param(lambda x: x.view(2, 3, -1, 2), (2, 3, 4), 2, Split(2, ((0, 2), (2, 2))), id="view-to-heads"),
    pytest.param(lambda x: x.view(2, 3, -1, 4), (2, 3, 4), 2, Split(2, ((0, 1), (1, 1))), id="view-one-head"),
    pytest.param(lambda x: x.reshape(2, -1), (2, 4, 5), 1, Split(1, ((0, 20), (20, 20))), id="merge-outer"),
    pytest.param(lambda x: x.reshape(-1), (3, 4), 1, None, id="merge-split-inner-falls-back"),
    pytest.param(lambda x: x.transpose(1, 2), (2, 4, 3), 1, Split(2, TWO), id="transpose"),
    pytest.param(lambda x: x.permute(2, 0, 1), (2, 3, 4), 2, Split(0, TWO), id="permute"),
    pytest.param(lambda x: x[..., :1], (2, 4, 3), 1, Split(1, TWO), id="slice-other-dim"),
    pytest.param(lambda x: x[:, :2], (2, 4, 3), 1, None, id="slice-split-dim-falls-back"),
    pytest.param(lambda x: x[:, :, None], (2, 4, 3), 1, Split(1, TWO), id="new-axis"),
    pytest.param(lambda x: F.silu(x) * x + 1.0, (2, 4), 1, Split(1, TWO), id="elementwise"),
    pytest.param(lambda x: x * torch.ones(3, 1, 1), (4, 5), 0, Split(1, TWO), id="broadcast-operand"),
    pytest.param(lambda x: torch.cat((-x, x), dim=-1), (4, 3), 0, Split(0, TWO), id="cat-other-dim"),
    pytest.param(lambda x: torch.cat((x, x), dim=0), (4, 3), 0, None, id="cat-split-dim-falls-back"),
    pytest.param(lambda x: x.softmax(-1), (4, 3), 0, Split(0, TWO), id="softmax-other-dim"),
    pytest.param(lambda x: x.softmax(0), (4, 3), 0, None, id="softmax-split-dim-falls-back"),
    pytest.param(lambda x: x.pow(2).mean(-1, keepdim=True), (4, 3), 0, Split(0, TWO), id="mean-other-dim"),
    pytest.param(lambda x: x.sum(), (4, 3), 0, None, id="sum-all-falls-back"),
    pytest.param(lambda x: x @ x.transpose(-1, -2), (2, 4, 3, 5), 1, Split(1, TWO), id="batched-matmul"),
    pytest.param(lambda x: x.transpose(0, 1) @ torch.ones(4, 2), (4, 3), 0, None, id="contraction-falls-back"),
    pytest.param(lambda x: F.layer_norm(x, (3,)), (4, 3), 0, Split(0, TWO), id="layer-norm-other-dim"),
    pytest.param(lambda x: F.layer_norm(x, (4,)), (3, 4), 1, None, id="layer-norm-split-dim-falls-back"),
    pytest.param(lambda x: x[:, :, None].expand(2, 4, 3, 5).reshape(2, 12, 5), (2, 4, 5), 1,
                 Split(1, ((0, 12), (12, 12))), id="repeat-kv"),
    # arguments bound through torch's own signatures: overloads, keywords, bools that are not dims
    pytest.param(lambda x: x.std(2, True), (2, 4, 3), 1, Split(1, TWO), id="std-legacy-dim-unbiased"),
    pytest.param(lambda x: x.var(False), (2, 4, 3), 1, None, id="var-unbiased-only-reduces-all"),
    pytest.param(lambda x: x.std(dim=2, correction=0, keepdim=True), (2, 4, 3), 1, Split(1, TWO), id="std-keywords"),
    pytest.param(lambda x: torch.var(x, 0, True, True), (2, 4, 3), 1, Split(1, TWO), id="var-keepdim-positional"),
    pytest.param(lambda x: x.amax(-1, True), (2, 4, 3), 1, Split(1, TWO), id="amax-keepdim-positional"),
    pytest.param(lambda x: x.sum(dim=[]), (2, 4, 3), 1, None, id="sum-empty-dims-reduces-all"),
    pytest.param(lambda x: torch.transpose(x, dim0=1, dim1=2), (2, 4, 3), 1, Split(2, TWO), id="transpose-keywords"),
    pytest.param(lambda x: x.swapaxes(0, 1), (2, 4, 3), 1, Split(0, TWO), id="swapaxes"),
    pytest.param(lambda x: F.softmax(x, dim=-1), (2, 4, 3), 1, Split(1, TWO), id="softmax-keyword"),
    pytest.param(lambda x: torch.cat([x, x], dim=2), (2, 4, 3), 1, Split(1, TWO), id="cat-keyword"),
    pytest.param(lambda x: x.split(1, -1)[1], (2, 4, 3), 1, Split(1, TWO), id="split-positional-dim"),
    pytest.param(lambda x: torch.split(x, [1, 2], dim=2)[0], (2, 4, 3), 1, Split(1, TWO), id="split-sections"),
])
def test_split_propagation(fn, shape, dim, expected):
    out = _run(fn, _tagged(shape, dim))
    assert split_of(out) == expected


def test_sdpa_keeps_heads_split_and_matches_per_head_attention():
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    split = Split(1, ((0, 2), (2, 2)))
    local = [tag(t[:, :2].clone(), split) for t in (q, k, v)]
    out = _run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), *local)
    assert split_of(out) == split
    torch.testing.assert_close(out, full[:, :2], rtol=0, atol=1e-6)


def test_grouped_query_sdpa_accepts_kv_split_in_proportion():
    q = tag(torch.randn(1, 2, 5, 4), Split(1, ((0, 2), (2, 2))))
    kv = [tag(torch.randn(1, 1, 5, 4), Split(1, ((0, 1), (1, 1)))) for _ in range(2)]
    out = _run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, enable_gqa=True), q, *kv)
    assert split_of(out) == Split(1, ((0, 2), (2, 2)))


def test_an_op_writing_a_split_activation_as_its_out_tensor_is_refused():
    """An in-place op on a split activation runs on the gathered tensor, which the activation then takes its slice
    of (``test_split_rules``); an ``out=`` tensor is written by the op itself, at the whole tensor's shape."""
    x = _tagged((4, 3), 0)
    with pytest.raises(RuntimeError, match=r"op 'cumsum' writes into an activation split .* out= tensor"):
        _run(lambda t: torch.cumsum(torch.ones(8, 3), 0, out=t), x)


def test_a_key_value_cache_keeps_its_heads_split_and_its_length_reads_no_values(monkeypatch):
    """transformers' DynamicLayer through prefill and a decode step: the cached keys stay tagged
    slices and ``get_seq_length`` (``keys.numel()``, ``keys.shape``) gathers nothing."""
    cache_utils = pytest.importorskip("transformers.cache_utils")
    gathered = []
    real = Split.whole
    monkeypatch.setattr(Split, "whole", lambda self, t: gathered.append(t.shape) or real(self, t))
    monkeypatch.setattr(STATE, "cache", None)  # decisions made before hold the method as it was
    heads = Split(1, ((0, 1), (1, 1)))  # (batch, kv heads, seq, head_dim): one key/value head per rank
    layer = cache_utils.DynamicLayer()
    for seq in (5, 1):
        k, v = (tag(torch.randn(2, 1, seq, 4), heads) for _ in range(2))
        keys, values = _run(lambda a, b: layer.update(a, b), k, v)
        assert _run(lambda: layer.get_seq_length()) == keys.shape[2]
    assert keys.shape == (2, 1, 6, 4)
    assert split_of(layer.keys) == split_of(layer.values) == heads
    assert torch.equal(layer.keys[:, :, 5:], k)
    assert gathered == []


def test_untagged_code_is_untouched():
    x = torch.randn(3, 4)
    out = _run(lambda t: (t @ t.T).softmax(-1), x)
    assert split_of(out) is None


def _end(name: str, role: str, intervals: tuple[tuple[int, int], ...]) -> Endpoint:
    """A sharded layer's endpoint split along its activation's last dimension (given as dimension 0)."""
    return Endpoint(name, role, layout.Split(0, intervals))  # type: ignore[arg-type]


@pytest.mark.parametrize(("endpoints", "expected"), [
    pytest.param([_end("attn.q", "produces", TWO), _end("attn.k", "produces", ((0, 2), (2, 2))),
                  _end("attn.o", "consumes", TWO)], ["attn"], id="attention"),
    pytest.param([_end("layer.attn.self.q", "produces", TWO), _end("layer.attn.out.dense", "consumes", TWO)],
                 ["layer.attn"], id="bert-siblings"),
    pytest.param([_end("0", "produces", TWO), _end("2", "consumes", TWO)], [""], id="sequential-root"),
    pytest.param([_end("a", "produces", TWO), _end("b", "consumes", ((0, 6), (6, 2)))], [],
                 id="different-splits"),
    pytest.param([_end("m.a", "produces", ((0, 8), (8, 0))), _end("m.b", "consumes", ((0, 8), (8, 0)))],
                 [], id="a-rank-without-a-slice"),
    pytest.param([Endpoint("attn.qkv", "produces",
                           layout.Packed(0, (((0, 2), (4, 2), (8, 2)), ((2, 2), (6, 2), (10, 2))))),
                  _end("attn.o", "consumes", ((0, 2), (2, 2)))], ["attn"], id="fused-qkv-unpacked-by-heads"),
    pytest.param([Endpoint("m.a", "produces", layout.Packed(0, (((0, 2), (6, 2)), ((2, 4),)))),
                  _end("m.b", "consumes", ((0, 4), (4, 4)))], [], id="packed-not-in-equal-blocks"),
])
def test_zones_are_the_closest_common_ancestors(endpoints, expected):
    assert find_zones(endpoints) == expected


def test_head_boundaries_are_checked_where_a_head_size_is_declared():
    attn = torch.nn.Module()
    attn.head_dim = 4  # type: ignore[assignment]
    attn.q = torch.nn.Linear(8, 12)
    ok = [_end("attn.q", "produces", ((0, 8), (8, 4)))]
    check_head_boundaries("attn", attn, ok)
    bad = [_end("attn.q", "produces", ((0, 6), (6, 6)))]
    with pytest.raises(ValueError, match=r"'attn.q' is split as \[\(0, 6\), \(6, 6\)\].*head size is 4"):
        check_head_boundaries("attn", attn, bad)


def test_grouped_query_key_and_value_projections_must_split_on_heads():
    """Llama with 4 query heads and 2 key/value heads of 16: q_proj split on heads is not enough."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    attn = LlamaAttention(config, layer_idx=0)
    assert (attn.k_proj.out_features, attn.head_dim) == (32, 16)
    q = _end("attn.q_proj", "produces", ((0, 32), (32, 32)))
    o = _end("attn.o_proj", "consumes", ((0, 32), (32, 32)))
    whole_kv = ((0, 16), (16, 16))
    check_head_boundaries("attn", attn, [q, _end("attn.k_proj", "produces", whole_kv),
                                                  _end("attn.v_proj", "produces", whole_kv), o])
    cut = ((0, 8), (8, 24))
    for name in ("k_proj", "v_proj"):
        ends = [q] + [_end(f"attn.{n}", "produces", cut if n == name else whole_kv) for n in ("k_proj", "v_proj")]
        with pytest.raises(ValueError, match=rf"'attn.{name}' is split as \[\(0, 8\), \(8, 24\)\].*head size is 16"):
            check_head_boundaries("attn", attn, [*ends, o])
