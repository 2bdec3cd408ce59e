#!/usr/bin/env python
"""Checkpoint metadata and planning at thousands of ranks, measured without processes.

Not a test: prints one JSON document on stdout (progress goes to stderr). Nothing is
saved but the metadata file; no tensor data is allocated (the layouts are sizes only).

Workloads (FSDP-like: every tensor is split on dim 0 over every rank):

==========  =======  =======  ================  ==========================
name        ranks    tensors  tensor shape      regions (ranks x tensors)
==========  =======  =======  ================  ==========================
1024x1000   1024     1000     (4096, 1024)      1,024,000
4096x200    4096     200      (4096, 1024)      819,200
==========  =======  =======  ================  ==========================

plus smaller ones for the metadata size. For each it measures:

- ``assemble``: what ``checkpoint.save`` does on rank 0 once every rank's report has
  arrived: ``_save._assemble`` (build the metadata from the reports and validate it as a
  reader will, tiling included, and serialize it) then ``_save._commit`` (write
  ``shardkit.json``, fsync and rename). The reports are synthesized as rank 0 receives them (decoded JSON),
  one data file per rank holding one region of every tensor. Goal: < 2 s.
- ``metadata_bytes``: the size of ``shardkit.json`` and its bytes per region, at several
  scales. Goal: linear in regions (constant bytes per region).
- ``load_planning``: what ``checkpoint.load`` does per tensor to find the saved regions its
  own shard needs (``_files._plan_tensor``, on entries parsed from ``shardkit.json`` as a
  loading rank has them), for a fixed local shard of 4 rows while the saved layout has 1 to
  4096 regions per tensor. Goal: independent of the regions it does not read. The parse
  (linear in regions: every rank reads the whole file) is reported beside it.
- ``reshard_planning``: ``sharded_tensor._plan.plan_reshard`` for one rank, cold (the
  planner's per-layout cache cleared), at 1024 and 4096 ranks: dim 0 -> dim 1 (every rank
  meets every rank), and dim 0 -> the whole tensor on rank 0 (what ``gather`` and
  ``collect_state_dict`` plan).

Times are medians of ``--reps`` runs, wall clock and CPU time of the process (on a shared
machine the CPU time is the steadier of the two). Torch runs with one intra-op thread, as under ``torchrun``.

Usage::

    .venv/bin/python scripts/bench/checkpoint_scale.py            # 3 repetitions
    .venv/bin/python scripts/bench/checkpoint_scale.py --quick    # 1 repetition, smaller sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# After the repository root: bench/checkpoint.py is not the package.
sys.path.append(str(Path(__file__).resolve().parent))

# -- everything measured, in one block (the modules are being reorganized) -----------------------
import torch
from _harness import machine

import sharded_tensor as st
from checkpoint._chunks import CHUNK_BYTES, chunk_count, encode_chunks
from checkpoint._files import _plan_tensor
from checkpoint._save import _assemble, _commit, _Plan
from checkpoint._schema import METADATA_FILE, CheckpointMetadata, SavedShard, TensorEntry, parse_metadata
from checkpoint._storage import data_file_name
from sharded_tensor._plan import _REGIONS_CACHE, plan_reshard
from sharding import RemoteDevice, ShardedTensorMetadata, ShardMetadata, single_split
from sharding.layout import check_tiling

# -- workloads -------------------------------------------------------------------------------------

SHAPE = (4096, 1024)
DTYPE = torch.float32
GENERATION = "5ca1ab1e"
LARGE = [(1024, 1000), (4096, 200)]
SIZES = [(16, 1000), (128, 1000), (1024, 100), (1024, 1000), (4096, 200)]
QUICK_LARGE = [(256, 250), (1024, 50)]
QUICK_SIZES = [(16, 250), (64, 250), (256, 250), (1024, 50)]


_CPU: list[float] = []  # CPU seconds of the last _clock call (median), beside its wall time


def _clock(fn: Callable[[], Any], reps: int, before: Callable[[], None] = lambda: None) -> tuple[float, Any]:
    """Median wall seconds of ``fn`` over ``reps`` calls, and its last result (median CPU seconds in ``_CPU``)."""
    times, cpus, result = [], [], None
    for _ in range(reps):
        before()
        gc.collect()
        start, cpu = time.perf_counter(), time.process_time()
        result = fn()
        cpus.append(time.process_time() - cpu)
        times.append(time.perf_counter() - start)
    _CPU[:] = [statistics.median(cpus)]
    return statistics.median(times), result


def _rows(ranks: int) -> list[tuple[int, int]]:
    """``(offset, rows)`` of each rank's block of dim 0 (``torch.chunk``, as ``single_split`` does)."""
    chunk = -(-SHAPE[0] // ranks)
    return [(min(r * chunk, SHAPE[0]), min((r + 1) * chunk, SHAPE[0]) - min(r * chunk, SHAPE[0]))
            for r in range(ranks)]


def _save_inputs(ranks: int, tensors: int) -> tuple[Any, list[dict[str, Any]]]:
    """The plan rank 0 holds and every rank's report, as ``checkpoint.save`` has them before assembling."""
    plan = _Plan()
    size = torch.Size(SHAPE)
    names = [f"layers.{i}.weight" for i in range(tensors)]
    rows = [(o, n) for o, n in _rows(ranks) if n > 0]
    for name in names:
        plan.tensors[name] = (size, DTYPE)
        for writer, (offset, n) in enumerate(rows):
            plan.add(name, ((offset, 0), (n, SHAPE[1])), writer, None)
    reports = []
    for writer, (_, n) in enumerate(rows):
        nbytes = n * SHAPE[1] * DTYPE.itemsize
        first = 8 + 96 * tensors  # about the safetensors header of this many entries
        starts = [first + i * nbytes for i in range(tensors)]
        chunks = chunk_count(nbytes, CHUNK_BYTES)
        crcs = [(writer * 7919 + i) & 0xffffffff for i in range(tensors) for _ in range(chunks)]
        reports.append({"file": data_file_name(GENERATION, writer), "bytes": first + tensors * nbytes,
                        "start": starts, "chunk_bytes": CHUNK_BYTES, "crc32c": encode_chunks(crcs), "keys": {}})
    return plan, reports


def _assemble_case(ranks: int, tensors: int, reps: int, folder: str) -> dict[str, Any]:
    plan, reports = _save_inputs(ranks, tensors)
    regions = len(plan.regions)
    assemble_s, (metadata, text) = _clock(lambda: _assemble(plan, reports, GENERATION, ranks, folder), reps)
    assemble_cpu = _CPU[0]
    commit_s, _ = _clock(lambda: _commit(_local_fs(), folder, metadata, text), reps)
    commit_cpu = _CPU[0]
    parse_s, _ = _clock(lambda: parse_metadata(text, source="bench"), reps)
    parse_cpu = _CPU[0]
    entry = next(iter(metadata.tensors.values()))
    tiling_one_s, _ = _clock(lambda: check_tiling(entry.shards, entry.size), reps)
    written = (Path(folder) / METADATA_FILE).stat().st_size
    return {"ranks": ranks, "tensors": tensors, "regions": regions,
            "assemble_plus_commit_s": round(assemble_s + commit_s, 3),
            "assemble_plus_commit_cpu_s": round(assemble_cpu + commit_cpu, 3),
            "assemble_s": round(assemble_s, 3), "commit_s": round(commit_s, 3),
            "of_which": {"parse_metadata_s": round(parse_s, 3), "parse_metadata_cpu_s": round(parse_cpu, 3),
                         "check_tiling_one_tensor_ms": round(tiling_one_s * 1e3, 3)},
            "us_per_region": round((assemble_s + commit_s) / regions * 1e6, 2),
            "cpu_us_per_region": round((assemble_cpu + commit_cpu) / regions * 1e6, 2),
            "metadata_bytes": written, "bytes_per_region": round(written / regions, 1),
            "goal_under_2s": assemble_s + commit_s < 2.0, "goal_under_2s_cpu": assemble_cpu + commit_cpu < 2.0}


def _size_case(ranks: int, tensors: int, folder: str) -> dict[str, Any]:
    plan, reports = _save_inputs(ranks, tensors)
    _commit(_local_fs(), folder, *_assemble(plan, reports, GENERATION, ranks, folder))
    written = (Path(folder) / METADATA_FILE).stat().st_size
    regions = len(plan.regions)
    return {"ranks": ranks, "tensors": tensors, "regions": regions, "metadata_bytes": written,
            "bytes_per_region": round(written / regions, 1)}


def _local_fs() -> Any:
    import fsspec

    return fsspec.filesystem("file")


def _saved_entries(regions: int, tensors: int) -> tuple[list[TensorEntry], float]:
    """``tensors`` saved (4096, 1024) tensors split on dim 0 into ``regions`` regions, as a loading rank has them.

    That is, parsed from ``shardkit.json`` text, each with its region index; also returns the
    time per tensor of parsing and building the index.
    """
    nbytes_row = SHAPE[1] * DTYPE.itemsize
    files: dict[str, int] = {}
    shards = []
    for r, (offset, n) in enumerate(_rows(regions)):
        if n == 0:
            continue
        file = data_file_name(GENERATION, r)
        start = 8 + 96 * tensors
        files[file] = start + tensors * n * nbytes_row
        shards.append((offset, n, file, start))
    entries = {f"t{i}": TensorEntry(torch.Size(SHAPE), DTYPE, tuple(
        SavedShard((offset, 0), (n, SHAPE[1]), file, f"t{i}@{offset},0",
                   (start + i * n * nbytes_row, start + (i + 1) * n * nbytes_row), "crc32c:00000000",
                   CHUNK_BYTES, (0,) * chunk_count(n * nbytes_row, CHUNK_BYTES))
        for offset, n, file, start in shards)) for i in range(tensors)}
    text = CheckpointMetadata(entries, {}, files, GENERATION, regions).to_json()

    def parse() -> list[TensorEntry]:
        # A tensor's region index is built on its first lookup: count it with the parse.
        parsed = list(parse_metadata(text, source="bench").tensors.values())
        for entry in parsed:
            entry.overlapping(((0, 0), (1, 1)))
        return parsed

    seconds, parsed = _clock(parse, 1)
    return parsed, seconds / tensors


def _load_planning(reps: int, per_tensor: list[int], tensors: int) -> dict[str, Any]:
    """``_plan_tensor`` for a fixed local shard (rows 2048..2051, all columns) against ever finer saves."""
    local_rows, offset = 4, SHAPE[0] // 2
    shard = st.Shard(torch.empty(local_rows, SHAPE[1], dtype=DTYPE),
                     ShardMetadata((offset, 0), (local_rows, SHAPE[1]), "rank:0/cpu"))
    # A world of one holding only its own block: all _plan_tensor looks at is the local shard.
    target = st.ShardedTensor.from_local_shards([shard], SHAPE, validate=False)
    points = []
    for regions in per_tensor:
        entries, parse_s = _saved_entries(regions, tensors)

        def plan_all(entries: list[TensorEntry] = entries) -> int:
            return sum(len(_plan_tensor(f"t{i}", e, target, "/ckpt")) for i, e in enumerate(entries))

        seconds, overlaps = _clock(plan_all, reps)
        points.append({"regions_per_tensor": regions, "overlaps_read_per_tensor": overlaps // tensors,
                       "plan_us_per_tensor": round(seconds / tensors * 1e6, 1),
                       "plan_cpu_us_per_tensor": round(_CPU[0] / tensors * 1e6, 1),
                       "parse_us_per_tensor": round(parse_s * 1e6, 1)})
    first, last = points[0]["plan_us_per_tensor"], points[-1]["plan_us_per_tensor"]
    return {"local_shard": [local_rows, SHAPE[1]], "tensors": tensors, "points": points,
            "plan_ratio_most_to_fewest_regions": round(last / first, 2)}


def _reshard_planning(reps: int, worlds: list[int]) -> list[dict[str, Any]]:
    out = []
    for n in worlds:
        ranks = [f"rank:{r}/cpu" for r in range(n)]
        size = (max(SHAPE[0], n), max(SHAPE[1], n))
        dim0 = single_split(0, ranks).build_metadata(size, DTYPE, world_size=n)
        dim1 = single_split(1, ranks).build_metadata(size, DTYPE, world_size=n)
        on_rank0 = ShardedTensorMetadata([ShardMetadata((0, 0), size, RemoteDevice.of(0, "cpu"))], size, DTYPE)
        for pair, dst in (("dim0_to_dim1", dim1), ("dim0_to_rank0", on_rank0)):
            for rank in (0, n // 2 + 1):
                seconds, plan = _clock(lambda src=dim0, dst=dst, rank=rank: plan_reshard(src, dst, rank), reps,
                                       before=_REGIONS_CACHE.clear)
                pieces = (sum(len(v) for v in plan.sends.values()) + sum(len(v) for v in plan.recvs.values())
                          + len(plan.copies))
                out.append({"ranks": n, "pair": pair, "rank": rank, "pieces": pieces,
                            "ms": round(seconds * 1e3, 2), "cpu_ms": round(_CPU[0] * 1e3, 2)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repetition, smaller workloads")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per point (median reported)")
    parser.add_argument("--only", choices=["assemble", "size", "load", "reshard"], nargs="+", default=None,
                        help="run only these parts")
    args = parser.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    parts = set(args.only or ["assemble", "size", "load", "reshard"])
    torch.set_num_threads(1)
    doc: dict[str, Any] = {"benchmark": "checkpoint_scale", "machine": machine(), "repetitions": reps,
                           "statistic": "median", "torch_threads": 1, "shape": list(SHAPE), "dtype": "float32",
                           "goals": {"assemble_plus_commit_s": "< 2", "bytes_per_region": "constant",
                                     "load_planning": "independent of regions not read"}}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-scale-") as folder:
        if "assemble" in parts:
            doc["assemble"] = []
            for ranks, tensors in (QUICK_LARGE if args.quick else LARGE):
                print(f"  assemble {ranks} ranks x {tensors} tensors", file=sys.stderr, flush=True)
                doc["assemble"].append(_assemble_case(ranks, tensors, reps, folder))
        if "size" in parts:
            doc["metadata_size"] = []
            for ranks, tensors in (QUICK_SIZES if args.quick else SIZES):
                print(f"  size {ranks} ranks x {tensors} tensors", file=sys.stderr, flush=True)
                doc["metadata_size"].append(_size_case(ranks, tensors, folder))
    if "load" in parts:
        print("  load planning", file=sys.stderr, flush=True)
        doc["load_planning"] = _load_planning(reps, [1, 16, 256, 1024, 4096], 50 if args.quick else 200)
    if "reshard" in parts:
        print("  reshard planning", file=sys.stderr, flush=True)
        doc["reshard_planning"] = _reshard_planning(reps, [1024, 4096])
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
