"""Pretrained Hugging Face weights into a tensor-parallel model: shardkit against PyTorch's two paths.

A Llama folder of about 2 GiB of fp32 weights (8 safetensors files and an index, written once
by transformers' ``save_pretrained`` from random weights and kept in a cache folder) is
loaded onto 2 Gloo ranks with the decoder layers tensor-parallel (q/k/v/gate/up split on
output features, o/down on input features, the rest whole), four ways, each in fresh
processes:

- **shardkit**: meta model, ``st.shard_model(model, spec, init=False)``,
  ``checkpoint.load(model.state_dict(), folder)`` (each rank reads its blocks' byte ranges);
- **shardkit_mmap**: the same with ``checkpoint.load(model.state_dict(keep_vars=True), folder,
  mmap=True)``: parameters whose block is contiguous in a file map its pages (copy-on-write)
  instead of receiving a copy; the others are copied as above;
- **from_pretrained**: ``LlamaForCausalLM.from_pretrained(folder)`` on every rank, then
  ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``;
- **dcp_hf**: meta model, ``parallelize_module``, ``to_empty(device="cpu")``, then
  ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader``.

Time runs from the model's construction until every rank holds its weights (slowest rank);
memory is each rank's peak RSS growth over the same span, against the bytes of the
parameters it holds. Then every rank reads each of its parameters once: a mapped parameter
pays for its pages there, so ``seconds_with_first_touch`` compares the whole cost. Every
way's logits on one batch are compared with the first way's.

    python scripts/bench/hf_import.py                 # 2 GiB, 3 repetitions
    python scripts/bench/hf_import.py --quick         # ~100 MiB, 1 repetition
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

# After the repository root: bench/checkpoint.py is not the package.
sys.path.append(str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    ROOT,
    llama_tp_names,
    load_and_touch,
    local_param_bytes,
    logits_sample,
    machine,
    run_fresh,
)

MiB = 1 << 20
WAYS = ("shardkit", "shardkit_mmap", "from_pretrained", "dcp_hf")


def _config(quick: bool) -> Any:
    from transformers import LlamaConfig
    if quick:
        return LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
                           use_cache=False)
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=128, use_cache=False)


def _folder(quick: bool) -> Path:
    """The pretrained folder, written once."""
    import torch
    from transformers import LlamaForCausalLM
    folder = Path(os.environ.get("SHARDKIT_BENCH_CACHE", tempfile.gettempdir())) / (
        "shardkit-hf-llama-quick" if quick else "shardkit-hf-llama-2g")
    if (folder / "model.safetensors.index.json").exists():
        return folder
    config = _config(quick)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=total // 8 + (1 << 20))
    return folder


def _load(way: str, folder: Path, world: int, quick: bool) -> Any:
    import torch
    from transformers import LlamaForCausalLM
    config = _config(quick)
    cols, rows = llama_tp_names(config.num_hidden_layers)
    if way in ("shardkit", "shardkit_mmap"):
        import checkpoint
        import sharded_tensor as st
        from sharding import composite, single_split
        ranks = [f"rank:{r}/cpu" for r in range(world)]
        spec = composite(**{n: single_split(0, ranks) for n in cols}, **{n: single_split(1, ranks) for n in rows})
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        st.shard_model(model, spec, init=False)
        if way == "shardkit_mmap":  # the parameters themselves, so they can map the files' pages
            checkpoint.load(model.state_dict(keep_vars=True), folder, mmap=True)
        else:
            checkpoint.load(model.state_dict(), folder)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (world,))
    plan = {**{n: ColwiseParallel() for n in cols}, **{n: RowwiseParallel() for n in rows}}
    if way == "from_pretrained":
        model = LlamaForCausalLM.from_pretrained(folder)
        return parallelize_module(model, mesh, plan)
    import torch.distributed.checkpoint as dcp
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    parallelize_module(model, mesh, plan)
    model.to_empty(device="cpu")
    rotary = model.model.rotary_emb  # to_empty left its buffers uninitialized: recompute them
    fresh = _rotary(config)
    for name, buffer in rotary.named_buffers():
        buffer.copy_(getattr(fresh, name))
    state = model.state_dict()
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
    model.load_state_dict(state)
    return model


def _rotary(config: Any) -> Any:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    return LlamaRotaryEmbedding(config)


def _rank(rank: int, world: int, way: str, folder: str, quick: bool) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    # Imports are not what is measured: every way's modules are loaded before the clock.
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import checkpoint  # noqa: F401
    import sharded_tensor  # noqa: F401
    model, elapsed, peak, touched, _ = load_and_touch(lambda: _load(way, Path(folder), world, quick))
    dist.barrier()
    return {"seconds": elapsed, "touch_seconds": touched, "peak_growth": peak, "local_bytes": local_param_bytes(model),
            "logits": logits_sample(model)}


def main() -> None:
    import torch
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    world = 2
    folder = _folder(args.quick)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    runs: dict[str, list[list[dict[str, Any]]]] = {w: [] for w in WAYS}
    for rep in range(args.repeat):
        for way in WAYS[rep % len(WAYS):] + WAYS[:rep % len(WAYS)]:  # rotate the order
            runs[way].append(run_fresh(_rank, world, way, str(folder), args.quick, what=way))
    report: dict[str, Any] = {"benchmark": "hf_import", "machine": machine(), "world": world,
                              "folder_bytes": sum((folder / f).stat().st_size for f in files), "files": len(files)}
    reference = torch.tensor(runs["shardkit"][0][0]["logits"])
    for way in WAYS:
        walls = sorted(max(r["seconds"] for r in run) for run in runs[way])
        with_touch = sorted(max(r["seconds"] + r["touch_seconds"] for r in run) for run in runs[way])
        peaks = [max(run[i]["peak_growth"] for run in runs[way]) for i in range(world)]
        local = [runs[way][0][i]["local_bytes"] for i in range(world)]
        report[way] = {"seconds": round(statistics.median(walls), 2), "seconds_all_runs": [round(w, 2) for w in walls],
                       "seconds_with_first_touch": round(statistics.median(with_touch), 2),
                       "peak_growth_mib": [round(p / MiB) for p in peaks],
                       "local_mib": [round(b / MiB) for b in local],
                       "peak_over_local": [round(p / b, 2) for p, b in zip(peaks, local)],
                       "same_logits": all(torch.allclose(torch.tensor(run[0]["logits"]), reference, atol=1e-4)
                                          for run in runs[way])}
    faster = min(report["from_pretrained"]["seconds"], report["dcp_hf"]["seconds"])
    faster_touched = min(report["from_pretrained"]["seconds_with_first_touch"],
                         report["dcp_hf"]["seconds_with_first_touch"])
    for way in ("shardkit", "shardkit_mmap"):
        report[way]["time_ratio_vs_faster_torch_path"] = round(report[way]["seconds"] / faster, 3)
        report[way]["time_ratio_with_first_touch"] = round(report[way]["seconds_with_first_touch"] / faster_touched, 3)
    report["time_goal_met"] = {way: report[way]["time_ratio_vs_faster_torch_path"] <= 0.6
                               for way in ("shardkit", "shardkit_mmap")}
    report["memory_goal_met"] = {way: all(r <= 1.1 for r in report[way]["peak_over_local"])
                                 for way in ("shardkit", "shardkit_mmap")}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
