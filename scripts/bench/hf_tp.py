"""A pretrained Llama folder to a train-ready tensor-parallel model: shardkit against transformers' own.

A Llama folder of about 2 GiB of fp32 weights (written by transformers' ``save_pretrained``
from a seeded random model into a temporary folder, nothing downloaded) becomes a
tensor-parallel model on 2 Gloo ranks, three ways, each in fresh processes, the order
rotated from one repetition to the next:

- **shardkit**: meta model, ``st.shard_model(model, st.tensor_parallel_spec(model, ranks),
  init=False)``, ``checkpoint.load(model.state_dict(), folder)`` (the default, copying load:
  each rank reads the byte ranges of its blocks);
- **transformers_tp**: ``LlamaForCausalLM.from_pretrained(folder,
  distributed_config=DistributedConfig(tp_size=2))``, transformers 5's form of
  ``tp_plan="auto"`` (its plan also splits the embedding and ``lm_head``);
- **from_pretrained**: plain ``from_pretrained(folder)`` on every rank (the whole model each);
- **shardkit_mmap** (with ``--mmap``): shardkit with ``checkpoint.load(model.state_dict(keep_vars=True),
  folder, mmap=True)``: blocks contiguous in a file map its pages, as transformers' do;
- **floor**: no model at all, the least a copying load can cost: each rank reads exactly the
  byte ranges of the files that hold its blocks (the same plan's, planned before the clock
  starts) with ``os.preadv`` into one new buffer, both ranks at once. Its time is that of
  copying the rank's bytes from the page cache into fresh memory on this machine.

Time runs from the model's construction until every rank holds its weights (slowest rank);
memory is each rank's peak RSS growth over the same span against the bytes of the parameters
it holds. transformers leaves parameters that are views of the files' mapped pages (read
later, on first use), so every rank then reads each of its parameters once and
``seconds_with_first_touch`` compares the whole cost. Every way's logits on one batch are compared with shardkit's.

Then the training step, both sides in the same processes, alternating step by step:
shardkit's tensor-parallel model against transformers' tensor-parallel model, both loaded
from the same folder, each step forward with labels, backward and an AdamW step; the slowest
rank's time, median over the steps, and the bytes each rank put on the wire. The step runs
on the ~100 MiB model of ``--small`` (``--step-model full`` uses the loaded one: several GiB
of gradients and optimizer state per rank and side).

    python scripts/bench/hf_tp.py                   # 2 GiB, 3 repetitions, 6 steps
    python scripts/bench/hf_tp.py --small           # ~100 MiB, 2 repetitions, 4 steps
    python scripts/bench/hf_tp.py --mmap --skip-step  # the loads, with shardkit's mapped load too
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# After the repository root: scripts/bench/checkpoint.py must not shadow the package.
sys.path.append(str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    ROOT,
    MiB,
    load_and_touch,
    local_param_bytes,
    logits_sample,
    machine,
    proc_status,
    reset_peak,
    run_fresh,
    wire_bytes,
)

WAYS = ("shardkit", "transformers_tp", "from_pretrained", "floor")
GOALS = {"load_time_vs_transformers_tp": 0.4, "peak_growth_vs_shard": 1.1, "step_time_vs_transformers_tp": 0.9}


def _config(small: bool) -> Any:
    from transformers import LlamaConfig
    if small:
        return LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                           use_cache=False, tie_word_embeddings=False)
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256,
                       use_cache=False, tie_word_embeddings=False)


def _write_folder(root: Path, small: bool) -> Path:
    """A pretrained folder as ``save_pretrained`` writes it, from a seeded random model."""
    import torch
    from transformers import LlamaForCausalLM
    folder = root / ("llama-small" if small else "llama-2g")
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(small))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=total // 8 + MiB)
    return folder


def _shardkit_model(folder: Path, world: int, mmap: bool = False) -> Any:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    import checkpoint
    import sharded_tensor as st
    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(folder))
    st.shard_model(model, st.tensor_parallel_spec(model, list(range(world))), init=False)
    if mmap:  # the parameters themselves, so they can map the files' pages
        checkpoint.load(model.state_dict(keep_vars=True), folder, mmap=True)
    else:
        checkpoint.load(model.state_dict(), folder)
    return model


def _transformers_model(folder: Path, world: int, parallel: bool) -> Any:
    import torch
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig
    if parallel:
        return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                distributed_config=DistributedConfig(tp_size=world))
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _load(way: str, folder: Path, world: int) -> Any:
    if way in ("shardkit", "shardkit_mmap"):
        return _shardkit_model(folder, world, mmap=way == "shardkit_mmap")
    return _transformers_model(folder, world, parallel=way == "transformers_tp")


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _rank_ranges(folder: Path, world: int, rank: int) -> list[tuple[Path, list[tuple[int, int]]]]:
    """Per data file, the byte ranges holding this rank's blocks under ``tensor_parallel_spec``, merged.

    From the files' own headers and the spec's layouts alone (no model is materialized): a
    block of whole rows is one range, a block of columns one range per row.
    """
    import struct

    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    import sharded_tensor as st
    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(folder))
    names = [name for name, _ in model.named_parameters()]
    specs = st.tensor_parallel_spec(model, list(range(world))).resolve(names)
    out = []
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            length = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(length))
        ranges: list[tuple[int, int]] = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            shape, item = info["shape"], _DTYPE_BYTES[info["dtype"]]
            start = 8 + length + info["data_offsets"][0]
            spec = specs.get(name)
            if spec is None:
                offsets, dims = [0] * len(shape), list(shape)
            else:
                (_, shard), = spec.build_metadata(shape, world_size=world).shards_on(rank)
                offsets, dims = list(shard.offsets), list(shard.dims)
            row = math.prod(shape[1:]) * item  # bytes of one row (dim 0) of the saved tensor
            if len(shape) < 2 or dims[1:] == shape[1:]:
                ranges.append((start + offsets[0] * row, start + (offsets[0] + dims[0]) * row))
            else:
                assert len(shape) == 2, (name, shape)
                first = start + offsets[0] * row + offsets[1] * item
                ranges.extend((first + r * row, first + r * row + dims[1] * item) for r in range(dims[0]))
        merged: list[tuple[int, int]] = []
        for a, b in sorted(ranges):
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            elif b > a:
                merged.append((a, b))
        out.append((file, merged))
    return out


def _read_ranges(files: list[tuple[Path, list[tuple[int, int]]]]) -> int:
    """Read every range into one new buffer (``torch.empty``: its pages are faulted in by the reads)."""
    import torch
    total = sum(b - a for _, ranges in files for a, b in ranges)
    buffer = torch.empty(total, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    at = 0
    for file, ranges in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            for a, b in ranges:
                done = 0
                while done < b - a:
                    n = os.preadv(fd, [view[at + done:at + b - a]], a + done)
                    assert n > 0, (file, a, b, done)
                    done += n
                at += b - a
        finally:
            os.close(fd)
    view.release()
    return total


def _floor_rank(rank: int, world: int, folder: str) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    _quiet(rank)
    files = _rank_ranges(Path(folder), world, rank)  # planning, before the clock
    dist.barrier()
    before = reset_peak()
    start = time.perf_counter()
    total = _read_ranges(files)
    elapsed = time.perf_counter() - start
    peak = proc_status("VmHWM") - before
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"seconds": float(slowest[0]), "seconds_touched": float(slowest[0]), "peak_growth": peak,
            "peak_growth_touched": peak, "local_bytes": total, "logits": None,
            "ranges": sum(len(r) for _, r in files)}


def _quiet(rank: int) -> None:
    """Imports before the clock, no progress bars, and what transformers' mesh set-up reads."""
    os.environ["LOCAL_RANK"] = str(rank)
    import torch.distributed.tensor.parallel  # noqa: F401
    import transformers
    from transformers import LlamaForCausalLM  # noqa: F401
    from transformers.distributed import DistributedConfig  # noqa: F401
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    import checkpoint  # noqa: F401
    import sharded_tensor  # noqa: F401


def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _load_rank(rank: int, world: int, way: str, folder: str) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    _quiet(rank)
    model, elapsed, peak, touched, peak_touched = load_and_touch(lambda: _load(way, Path(folder), world))
    slowest = torch.tensor([elapsed, elapsed + touched], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"seconds": float(slowest[0]), "seconds_touched": float(slowest[1]), "peak_growth": peak,
            "peak_growth_touched": peak_touched, "local_bytes": local_param_bytes(model),
            "logits": logits_sample(model)}


def _step_rank(rank: int, world: int, folder: str, steps: int, batch: int, seq: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    _quiet(rank)
    models = {"shardkit": _shardkit_model(Path(folder), world),
              "transformers_tp": _transformers_model(Path(folder), world, parallel=True)}
    for m in models.values():
        m.train()
    opts = {side: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False) for side, m in models.items()}
    vocab = models["shardkit"].config.vocab_size
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps + 1)]
    times: dict[str, list[float]] = {side: [] for side in models}
    sent: dict[str, list[int]] = {side: [] for side in models}
    losses: dict[str, list[float]] = {side: [] for side in models}
    # The first step of each side warms up (allocator, autograd graph, optimizer state) untimed.
    for step, tokens in enumerate(batches):
        order = tuple(models) if step % 2 == 0 else tuple(reversed(tuple(models)))
        for side in order:
            model, opt = models[side], opts[side]
            dist.barrier()
            wire = wire_bytes()
            start = time.perf_counter()
            opt.zero_grad()
            loss = model(tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            elapsed = time.perf_counter() - start
            wire = wire_bytes() - wire
            losses[side].append(float(_full(loss).detach()))
            if step > 0:
                times[side].append(elapsed)
                sent[side].append(wire)
    return {"times": times, "sent": sent, "losses": losses}


def _median_range(values: list[float], digits: int = 3) -> dict[str, Any]:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def main() -> None:
    import torch
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a ~100 MiB model instead of ~2 GiB")
    parser.add_argument("--repeat", type=int, default=None, help="load repetitions per way (3; 2 with --small)")
    parser.add_argument("--steps", type=int, default=None, help="timed training steps per side (6; 4 with --small)")
    parser.add_argument("--step-model", choices=("small", "full"), default="small",
                        help="the model of the training step: the ~100 MiB one, or the loaded one")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mmap", action="store_true",
                        help="also load with checkpoint.load(..., mmap=True), transformers' way of not copying")
    parser.add_argument("--skip-load", action="store_true", help="only the training step")
    parser.add_argument("--skip-step", action="store_true", help="only the loads")
    args = parser.parse_args()
    repeat = args.repeat or (2 if args.small else 3)
    steps = args.steps or (4 if args.small else 6)
    world = 2
    report: dict[str, Any] = {"benchmark": "hf_tp", "machine_before": machine(), "world": world}
    with tempfile.TemporaryDirectory(prefix="shardkit-hf-tp-") as tmp:
        folder = _write_folder(Path(tmp), args.small)
        files = sorted(folder.glob("*.safetensors"))
        report["folder_mib"] = round(sum(f.stat().st_size for f in files) / MiB)
        report["files"] = len(files)
        if not args.skip_load:
            ways = (*WAYS, "shardkit_mmap") if args.mmap else WAYS
            runs: dict[str, list[list[dict[str, Any]]]] = {w: [] for w in ways}
            for rep in range(repeat):
                for way in ways[rep % len(ways):] + ways[:rep % len(ways)]:  # rotate the order
                    if way == "floor":
                        runs[way].append(run_fresh(_floor_rank, world, str(folder), what=way))
                    else:
                        runs[way].append(run_fresh(_load_rank, world, way, str(folder), what=way))
            reference = torch.tensor(runs["shardkit"][0][0]["logits"])
            loads: dict[str, Any] = {}
            for way in ways:
                walls = [run[0]["seconds"] for run in runs[way]]
                touched = [run[0]["seconds_touched"] for run in runs[way]]
                peaks = [max(run[i]["peak_growth"] for run in runs[way]) for i in range(world)]
                peaks_touched = [max(run[i]["peak_growth_touched"] for run in runs[way]) for i in range(world)]
                local = [runs[way][0][i]["local_bytes"] for i in range(world)]
                loads[way] = {"seconds": _median_range(walls, 2), "seconds_all_runs": [round(w, 2) for w in walls],
                              "peak_growth_mib": [round(p / MiB) for p in peaks],
                              "local_mib": [round(b / MiB) for b in local],
                              "peak_over_local": [round(p / b, 2) for p, b in zip(peaks, local)],
                              "seconds_with_first_touch": _median_range(touched, 2),
                              "peak_over_local_with_first_touch": [round(p / b, 2)
                                                                   for p, b in zip(peaks_touched, local)],
                              "same_logits_as_shardkit": None if way == "floor" else all(
                                  torch.allclose(torch.tensor(r["logits"]), reference, atol=1e-4)
                                  for run in runs[way] for r in run)}
            loads["floor"]["ranges_per_rank"] = [r["ranges"] for r in runs["floor"][0]]
            # Ratios of the runs paired by repetition (each pair a few seconds apart), then their median.
            paired = [s[0]["seconds"] / t[0]["seconds"] for s, t in zip(runs["shardkit"], runs["transformers_tp"])]
            paired_plain = [s[0]["seconds"] / t[0]["seconds"]
                            for s, t in zip(runs["shardkit"], runs["from_pretrained"])]
            loads["time_shardkit_over_transformers_tp"] = _median_range(paired)
            loads["time_shardkit_over_from_pretrained"] = _median_range(paired_plain)
            loads["time_with_first_touch_shardkit_over_transformers_tp"] = _median_range(
                [s[0]["seconds_touched"] / t[0]["seconds_touched"]
                 for s, t in zip(runs["shardkit"], runs["transformers_tp"])])
            loads["time_shardkit_over_floor"] = _median_range(
                [s[0]["seconds"] / f[0]["seconds"] for s, f in zip(runs["shardkit"], runs["floor"])])
            loads["time_floor_over_transformers_tp"] = _median_range(
                [f[0]["seconds"] / t[0]["seconds"] for f, t in zip(runs["floor"], runs["transformers_tp"])])
            if args.mmap:
                loads["time_shardkit_mmap_over_floor"] = _median_range(
                    [s[0]["seconds"] / f[0]["seconds"] for s, f in zip(runs["shardkit_mmap"], runs["floor"])])
                loads["time_shardkit_mmap_over_transformers_tp"] = _median_range(
                    [s[0]["seconds"] / t[0]["seconds"] for s, t in zip(runs["shardkit_mmap"], runs["transformers_tp"])])
                loads["time_with_first_touch_shardkit_mmap_over_transformers_tp"] = _median_range(
                    [s[0]["seconds_touched"] / t[0]["seconds_touched"]
                     for s, t in zip(runs["shardkit_mmap"], runs["transformers_tp"])])
            loads["repetitions"] = repeat
            report["load"] = loads
            report["load_goals"] = {
                "time_met": loads["time_shardkit_over_transformers_tp"]["median"]
                <= GOALS["load_time_vs_transformers_tp"],
                "memory_met": all(r <= GOALS["peak_growth_vs_shard"] for r in loads["shardkit"]["peak_over_local"])}
        if not args.skip_step:
            step_folder = folder if args.step_model == "full" or args.small else _write_folder(Path(tmp), True)
            results = run_fresh(_step_rank, world, str(step_folder), steps, args.batch, args.seq, what="step")
            per_step = {side: [max(r["times"][side][i] for r in results) for i in range(steps)]
                        for side in ("shardkit", "transformers_tp")}
            paired = [a / b for a, b in zip(per_step["shardkit"], per_step["transformers_tp"])]
            report["step"] = {
                "model": "small" if step_folder != folder or args.small else "full",
                "batch": args.batch, "seq": args.seq, "optimizer": "AdamW", "steps": steps,
                "seconds": {side: _median_range(v) for side, v in per_step.items()},
                "time_shardkit_over_transformers_tp": _median_range(paired),
                "wire_mib_per_step_rank0": {side: round(statistics.median(results[0]["sent"][side]) / MiB, 1)
                                            for side in per_step},
                "losses_rank0": {side: [round(x, 5) for x in results[0]["losses"][side]] for side in per_step},
                "goal_met": statistics.median(paired) <= GOALS["step_time_vs_transformers_tp"]}
    report["goals"] = GOALS
    report["machine_after"] = machine()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
