"""The extension point, used as a user would, on 2 Gloo ranks.

* GPT-2 (transformers' ``GPT2LMHeadModel``, tiny config) is tensor-parallel through a
  ``Conv1D`` registration written here, outside the library: ``c_attn`` holds each rank's
  heads of q, k and v (a packed split), ``c_fc`` is split on its outputs, both ``c_proj`` on
  their inputs. Logits, loss and every local gradient equal the unsharded model's, and a
  block's forward does exactly 2 all-reduces.
* ``nn.TransformerEncoderLayer`` (built-in registration of ``nn.MultiheadAttention``, the
  layer run as a zone): outputs and gradients equal, 2 all-reduces, in training and in
  eval mode (where torch would otherwise take its fused fast path).
* A ``DFunction`` on ShardedTensors: the output keeps the layout, an input in another layout
  is resharded (a copy; the caller's tensor is untouched) and the bytes show in
  ``CommCounter``; partial values are reduced before the function sees them; on plain
  tensors it is an ordinary autograd function.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sharded_tensor as st
from sharding import ShardMetadata, composite, single_split
from sharding.layout import Replicated
from tests.distributed._archs import gpt2_spec
from tests.distributed._grads import local_grad_mismatches
from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed


class ShardedConv1D(st.ShardedModule):
    """transformers' Conv1D (weight stored as (in, out)): split on outputs (dim 1) or inputs (dim 0)."""

    def plan(self, module, layouts, *, name):  # type: ignore[no-untyped-def]
        w, b = layouts.get("weight"), layouts.get("bias")
        if w is None or w.kind != "split" or w.dim not in (0, 1):
            raise ValueError(f"{name}: split the weight on dim 1 (outputs) or dim 0 (inputs)")
        if w.dim == 1:
            if b is None or (b.pieces, b.intervals) != (w.pieces, w.intervals):
                raise ValueError(f"{name}: split the bias like the weight's outputs")
            return "out", w
        if b is not None and b.kind != "replicated":
            raise ValueError(f"{name}: keep the bias whole; it is added once, after the reduction")
        return "in", w

    def activations(self, plan):  # type: ignore[no-untyped-def]
        mode, w = plan
        return (None, w) if mode == "out" else (w, None)

    def forward(self, call, module, x):  # type: ignore[no-untyped-def]
        mode, w = call.plan
        if mode == "out":
            return call.split_output(call.enter(x) @ module.weight + module.bias, w)
        return call.reduce(call.split_input(x, w.intervals) @ module.weight) + module.bias


class ScaledTanh(st.DFunction):
    layout_rule = "elementwise"

    @staticmethod
    def forward(ctx, x, y, scale):  # type: ignore[no-untyped-def]
        out = torch.tanh(x + y) * scale
        ctx.save_for_backward(out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (out,) = ctx.saved_tensors
        inner = grad * (ctx.scale - out * out / ctx.scale)
        return inner, inner, None


class _TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return torch.nn.functional.linear(self.emb(x), self.emb.weight)


def _extension(rank: int, world: int) -> dict[str, object]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    out: dict[str, object] = {}
    try:
        st.register_sharded_module(nn.Linear, ShardedConv1D())
    except ValueError as exc:
        out["twice"] = str(exc)
    st.register_sharded_module(Conv1D, ShardedConv1D())

    # GPT-2 through the Conv1D registration.
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref, model = GPT2LMHeadModel(config), GPT2LMHeadModel(config)
    model.load_state_dict(ref.state_dict())
    st.shard_model(model, gpt2_spec(world, 2), src_rank=0)
    x = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    with st.CommCounter() as comm:
        got = model(x, labels=x)
    want = ref(x, labels=x)
    got.loss.backward()
    want.loss.backward()
    out["gpt2"] = ((got.logits - want.logits).abs().max().item(), got.loss.item(), want.loss.item())
    out["gpt2_comm"] = dict(comm.counts)
    out["gpt2_bad_grads"] = local_grad_mismatches(model, ref, rank)

    # nn.TransformerEncoderLayer: MultiheadAttention by heads, the feed-forward split.
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    torch.manual_seed(2)
    ref = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    layer.load_state_dict(ref.state_dict())
    spec = composite(**{"self_attn.in_proj_weight": single_split(0, ranks * 3),
                        "self_attn.in_proj_bias": single_split(0, ranks * 3),
                        "self_attn.out_proj.weight": single_split(1, ranks),
                        "linear1": single_split(0, ranks), "linear2.weight": single_split(1, ranks)})
    st.shard_model(layer, spec, src_rank=0)
    h = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    with st.CommCounter() as comm:
        y = layer(h, src_key_padding_mask=pad)
    y_ref = ref(h, src_key_padding_mask=pad)
    (y * torch.arange(32.0)).sum().backward()
    (y_ref * torch.arange(32.0)).sum().backward()
    out["encoder"] = (y - y_ref).abs().max().item()
    out["encoder_comm"] = dict(comm.counts)
    out["encoder_bad_grads"] = local_grad_mismatches(layer, ref, rank)
    layer.eval()
    ref.eval()
    with torch.no_grad():
        out["encoder_eval"] = (layer(h, src_key_padding_mask=pad) - ref(h, src_key_padding_mask=pad)).abs().max().item()
    try:
        st.shard_model(nn.MultiheadAttention(32, 4), composite(in_proj_weight=single_split(0, ranks)), src_rank=0)
    except ValueError as exc:
        out["mha_refused"] = str(exc)

    # Code that reads a split parameter directly (fx cannot trace it: **kwargs) fails loudly.
    tied = _TiedHead()
    st.shard_model(tied, composite(**{"emb.weight": single_split(0, ranks)}), src_rank=0)
    try:
        tied(torch.tensor([[1, 2, 3]]))
        out["direct_use"] = None
    except RuntimeError as exc:
        out["direct_use"] = str(exc)

    # A DFunction on ShardedTensors.
    full = torch.arange(40.0).reshape(10, 4) / 10
    rows = st.shard_tensor(full if rank == 0 else None, single_split(0, ranks))
    cols = st.shard_tensor(full if rank == 0 else None, single_split(1, ranks))
    with st.CommCounter() as comm:
        result = ScaledTanh.apply(rows, cols, 2.0)
    out["dfunction"] = torch.equal(result.full_tensor(), torch.tanh(full + full) * 2.0)
    out["dfunction_layout"] = result.sharding_metadata().shards == rows.sharding_metadata().shards
    out["dfunction_comm"] = (dict(comm.counts), comm.bytes_sent)
    out["dfunction_input_untouched"] = cols.sharding_metadata().shards[0].dims == (10, 2)
    # Partial values (each rank an addend of full) are reduced before the function runs.
    addend = st.ShardedTensor.from_local_shards([st.Shard(full / 2, ShardMetadata((0, 0), (10, 4), ranks[rank]))],
                                                (10, 4), reduce_op="sum")
    summed = ScaledTanh.apply(addend, rows, 2.0)
    out["dfunction_partial"] = (torch.equal(summed.full_tensor(), torch.tanh(full + full) * 2.0),
                                summed.sharding_metadata().placement, torch.equal(addend.local_shard(), full / 2))
    return out


@pytest.fixture(scope="module")
def ext_runs() -> list[dict[str, object]]:
    pytest.importorskip("transformers")
    return run_distributed(_extension, 2, timeout=300)


def test_gpt2_through_a_user_registration(ext_runs):
    for out in ext_runs:
        diff, loss, want = out["gpt2"]
        assert diff < 1e-5
        assert loss == pytest.approx(want, rel=1e-6)
        assert out["gpt2_bad_grads"] == []
        assert out["gpt2_comm"] == {"all_reduce": 4}  # 2 blocks x (attention + MLP)


def test_registering_a_type_twice_is_refused(ext_runs):
    assert "Linear already has a sharded registration (ShardedLinear); pass replace=True" in ext_runs[0]["twice"]


def test_transformer_encoder_layer_by_heads(ext_runs):
    for out in ext_runs:
        assert out["encoder"] < 1e-5 and out["encoder_eval"] < 1e-5
        assert out["encoder_comm"] == {"all_reduce": 2}
        assert out["encoder_bad_grads"] == []
        assert "split its heads: in_proj_weight with single_split(0, ranks * 3)" in out["mha_refused"]


def test_direct_use_of_a_split_parameter_fails_loudly(ext_runs):
    for out in ext_runs:
        assert "parameter 'emb.weight' of module 'emb' (Embedding) is split across ranks, but the model's code uses " \
               "it directly in linear()" in out["direct_use"]


def test_dfunction_on_sharded_tensors(ext_runs):
    for out in ext_runs:
        assert out["dfunction"] and out["dfunction_layout"] and out["dfunction_input_untouched"]
        counts, sent = out["dfunction_comm"]
        # the column-split input is moved to rows: each rank sends the quarter it does not keep
        assert counts == {"send/recv": 1} and sent == 5 * 2 * 4
        # partial values reduced first (an all-reduce), not each rank's addend put through tanh
        assert out["dfunction_partial"] == (True, Replicated(), True)


def test_dfunction_on_plain_tensors_is_an_autograd_function():
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    ScaledTanh.apply(x, y, 2.0).sum().backward()
    expected = 2.0 * (1 - torch.tanh(x.detach() + y.detach()) ** 2)
    torch.testing.assert_close(x.grad, expected)
    torch.testing.assert_close(y.grad, expected)


def test_dfunction_without_a_rule_says_how_to_register_one():
    class NoRule(st.DFunction):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x

    t = st.zeros(4, sharding_spec=single_split(0, ["rank:0/cpu"]))
    with pytest.raises(ValueError, match=r"NoRule.layout_rule is None.*register_layout_rule\(name, rule\)"):
        NoRule.apply(t)
