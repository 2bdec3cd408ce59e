"""A pretrained Hugging Face folder into sharded models, trained, saved and exported back.

The folder is written by transformers' ``save_pretrained`` (several files and an index).
On 2 ranks: a meta model sharded with ``init=False`` is filled by ``checkpoint.load`` from the
folder and computes the logits ``from_pretrained`` gives; a row split reads only its own
bytes; a bfloat16 copy loads into float32 parameters with ``cast=True``. On 4 ranks with
another spec (the MLPs split, ``lm_head`` on the vocabulary): the import, 2 training steps,
``checkpoint.save``, ``consolidate`` and ``from_pretrained`` of the export give the logits of
the trained sharded model; and a meta model initialized with ``seed=`` holds the values of a
world of one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import checkpoint  # noqa: E402
import sharded_tensor as st  # noqa: E402
from sharding import composite, single_split  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402
from tests.distributed.test_hf_models import _llama_config, llama_spec  # noqa: E402

pytestmark = pytest.mark.distributed


def _mlp_spec(world: int, layers: int):  # type: ignore[no-untyped-def]
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    parts = {"lm_head": single_split(0, ranks)}
    for i in range(layers):
        parts[f"model.layers.{i}.mlp.gate_proj"] = parts[f"model.layers.{i}.mlp.up_proj"] = single_split(0, ranks)
        parts[f"model.layers.{i}.mlp.down_proj"] = single_split(1, ranks)
    return composite(**parts)


def _io_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _two_ranks(rank: int, world: int, folder: str, bf16: str) -> dict[str, object]:
    from transformers import LlamaForCausalLM
    out: dict[str, object] = {}
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama_config())
    st.shard_model(model, llama_spec(world), init=False)
    checkpoint.load(model.state_dict(), folder)
    ref = LlamaForCausalLM.from_pretrained(folder)
    out["logits"] = (model(x).logits - ref(x).logits).abs().max().item()

    # The parameters themselves, mapped: output-feature blocks map the files' pages,
    # input-feature blocks (strided in the file) are copied; the logits are the same.
    with torch.device("meta"):
        mapped = LlamaForCausalLM(_llama_config())
    st.shard_model(mapped, llama_spec(world), init=False)
    checkpoint.load(mapped.state_dict(keep_vars=True), folder, mmap=True)
    sizes = {os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors")}
    attention = mapped.model.layers[0].self_attn
    out["mapped"] = (attention.q_proj.weight.untyped_storage().nbytes() in sizes,
                     attention.o_proj.weight.untyped_storage().nbytes() in sizes)
    out["mapped_logits"] = (mapped(x).logits - ref(x).logits).abs().max().item()

    # bfloat16 file into float32 parameters.
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama_config())
    st.shard_model(model, llama_spec(world), init=False)
    checkpoint.load(model.state_dict(), bf16, cast=True)
    q = model.model.layers[0].self_attn.q_proj.weight
    want = ref.model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16).float()[rank * 32:(rank + 1) * 32]
    out["bf16"] = torch.equal(q, want)

    # A row split of the embedding reads its own rows, not the whole tensor.
    rows = {"model.embed_tokens.weight": st.empty(96, 64, sharding_spec=single_split(0, [f"rank:{r}/cpu" for r in
                                                                                          range(world)]))}
    before = _io_read()
    checkpoint.load(rows, folder, strict=False)
    out["bytes_read"] = _io_read() - before
    out["rows"] = torch.equal(rows["model.embed_tokens.weight"].local_shard(),
                              ref.model.embed_tokens.weight[rank * 48:(rank + 1) * 48])
    return out


def _four_ranks(rank: int, world: int, folder: str, work: str) -> dict[str, object]:
    from transformers import LlamaForCausalLM
    out: dict[str, object] = {}
    config = _llama_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    st.shard_model(model, _mlp_spec(world, config.num_hidden_layers), init=False)
    checkpoint.load(model.state_dict(), folder)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        y = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(20 + step))
        optim.zero_grad()
        model(y, labels=y).loss.backward()
        optim.step()
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(x).logits
    checkpoint.save(model.state_dict(), os.path.join(work, "ckpt"))
    export = os.path.join(work, "hf")
    if rank == 0:
        checkpoint.consolidate(os.path.join(work, "ckpt"), export, max_shard_size="200KB")
        config.save_pretrained(export)
    torch.distributed.barrier()
    # Every rank's logits (gathered from its slices) against the exported model's.
    again = LlamaForCausalLM.from_pretrained(export)
    with torch.no_grad():
        out["export"] = (again(x).logits - logits).abs().max().item()
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    st.shard_model(meta, _mlp_spec(world, config.num_hidden_layers), seed=0)
    out["meta_state"] = checkpoint.collect_state_dict(meta.state_dict())
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    from transformers import LlamaForCausalLM
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config())
    model.save_pretrained(root / "fp32", max_shard_size="100KB")
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    return str(root / "fp32"), str(root / "bf16"), root


def test_import_into_a_meta_model_on_two_ranks(folders):
    fp32, bf16, _ = folders
    assert len([f for f in os.listdir(fp32) if f.endswith(".safetensors")]) > 1
    embedding = 96 * 64 * 4
    for out in run_distributed(_two_ranks, 2, fp32, bf16, timeout=300):
        assert out["logits"] < 1e-5
        assert out["mapped"] == (True, False) and out["mapped_logits"] < 1e-5
        assert out["bf16"] and out["rows"]
        # its 48 rows plus headers and the index, far below the whole embedding
        assert out["bytes_read"] < embedding // 2 + 64 * 1024, out["bytes_read"]


def test_import_train_save_export_on_four_ranks(folders):
    fp32, _, root = folders
    work = root / "work"
    work.mkdir()
    runs = run_distributed(_four_ranks, 4, fp32, str(work), timeout=300)
    assert [r["export"] < 1e-5 for r in runs] == [True] * 4, [r["export"] for r in runs]
    assert [r["meta_state"] is None for r in runs[1:]] == [True] * 3  # gathered on rank 0 only
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        meta = LlamaForCausalLM(_llama_config())
    st.shard_model(meta, _mlp_spec(1, 2), seed=0)  # a world of one
    want = checkpoint.collect_state_dict(meta.state_dict())
    got = runs[0]["meta_state"]
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
