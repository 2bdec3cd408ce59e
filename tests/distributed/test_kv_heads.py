"""More ranks than key/value heads, on 4 Gloo ranks: each key/value head replicated over the ranks that share it.

A Llama with 4 query heads and 2 or 1 key/value heads (grouped-query and multi-query
attention), built from a tiny config with transformers' defaults, planned by
``st.tensor_parallel_spec`` on 4 ranks and sharded from rank 0's weights. On every rank,
against the same model unsharded:

* logits, the loss from ``labels=`` and every parameter's gradient (split ones gathered whole,
  replicated key/value projections included: each replica's gradient is the sum over the
  ranks that share it) equal the unsharded model's; the forward's only all-gather is the
  returned logits' (lm_head split on the vocabulary);
* greedy ``generate`` gives the unsharded model's tokens;
* the state saved by ``checkpoint.save`` under this layout (replicas written once) loads into
  the same model laid out another way (every parameter split evenly on dimension 0, no
  replicas), and a checkpoint saved under that other layout loads back into the replica layout:
  the gathered parameters are the saved ones, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import checkpoint  # noqa: E402
import sharded_tensor as st  # noqa: E402
from sharding import composite, single_split  # noqa: E402
from tests.distributed._grads import full_grads, full_mismatches, full_params  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD, VOCAB, BATCH, SEQ, NEW_TOKENS = 4, 96, 2, 8, 4
KV_HEADS = (2, 1)


def _build(kv_heads: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[1, :2] = 0  # left padding, as generate expects
    return {"input_ids": tokens, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, -100)}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / (1 + want.abs().max()))


def _even_spec(model: torch.nn.Module, ranks: list[str]) -> Any:
    """Every parameter of 2 or more dimensions split evenly on dimension 0: a layout without replicas."""
    return composite(**{name: single_split(0, ranks) for name, p in model.named_parameters() if p.dim() >= 2})


def _check(kv_heads: int, rank: int, world: int, folder: Path) -> dict[str, Any]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    ref, model = _build(kv_heads), _build(kv_heads)
    model.load_state_dict(ref.state_dict())
    spec = st.tensor_parallel_spec(model, ranks)
    st.shard_model(model, spec, src_rank=0)
    x = _batch()
    with st.CommCounter() as comm:
        got = model(**x)
    want = ref(**x)
    got.loss.backward()
    want.loss.backward()
    out: dict[str, Any] = {
        "logits": _relative(got.logits, want.logits), "loss": (got.loss.item(), want.loss.item()),
        "grads": full_mismatches(full_grads(model, rank), {n: p.grad for n, p in ref.named_parameters()}),
        "comm": dict(comm.counts),
        "replicated": sorted(n for n, v in spec.param_placement.items() if "k_proj" in n or "v_proj" in n)}
    prompt = {k: v for k, v in x.items() if k != "labels"}
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    with torch.no_grad():
        out["generated"] = (model.generate(**prompt, **kwargs).tolist(), ref.generate(**prompt, **kwargs).tolist())

    # Saved under the replica layout, loaded under an even one; and the other way round.
    saved = {n: p.detach().clone() for n, p in ref.named_parameters()}
    checkpoint.save(model.state_dict(), folder / "replicas")
    even = _build(kv_heads)
    st.shard_model(even, _even_spec(even, ranks), init=False)
    checkpoint.load(even.state_dict(), folder / "replicas")
    loaded = full_params(even, rank)
    out["replicas_to_even"] = sorted(n for n, v in saved.items() if not torch.equal(loaded[n], v))
    checkpoint.save(even.state_dict(), folder / "even")
    back = _build(kv_heads)
    st.shard_model(back, st.tensor_parallel_spec(back, ranks), init=False)
    checkpoint.load(back.state_dict(), folder / "even")
    loaded = full_params(back, rank)
    out["even_to_replicas"] = sorted(n for n, v in saved.items() if not torch.equal(loaded[n], v))
    return out


def _run(rank: int, world: int, folder: str) -> dict[int, dict[str, Any]]:
    import warnings
    warnings.filterwarnings("ignore")
    return {kv: _check(kv, rank, world, Path(folder) / f"kv{kv}") for kv in KV_HEADS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict[str, Any]]]:
    return run_distributed(_run, WORLD, str(tmp_path_factory.mktemp("kv_heads")), timeout=600)


@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_key_value_heads_fewer_than_ranks_are_replicated_and_exact(runs, kv_heads: int) -> None:
    for rank, run in enumerate(runs):
        out = run[kv_heads]
        assert out["replicated"], out  # the plan does place the key/value projections
        assert out["logits"] < 1e-5, (rank, out["logits"])
        got, want = out["loss"]
        assert got == pytest.approx(want, rel=1e-5), (rank, got, want)
        assert out["grads"] == {}, (rank, out["grads"])
        assert out["comm"].get("all_gather", 0) == 1, (rank, out["comm"])
        tokens, expected = out["generated"]
        assert tokens == expected, (rank, tokens, expected)


@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_replicated_heads_save_and_load_in_another_layout(runs, kv_heads: int) -> None:
    for rank, run in enumerate(runs):
        out = run[kv_heads]
        assert out["replicas_to_even"] == [], (rank, out["replicas_to_even"])
        assert out["even_to_replicas"] == [], (rank, out["even_to_replicas"])
