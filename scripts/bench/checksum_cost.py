#!/usr/bin/env python
"""What verifying chunk checksums costs a 1 GiB ``checkpoint.load`` (one process, page cache warm).

Not a test: prints one JSON document. Saves a 1 GiB fp32 state dict (16 tensors of
4096 x 4096) from one process, then times ``checkpoint.load`` into three layouts:

- ``whole``: plain tensors (every saved region read whole);
- ``rows``: each tensor split into 3 row blocks (partial reads, one contiguous range each);
- ``cols``: each tensor split into 2 column blocks (partial reads, one run per row).

For each, the best of ``--repeat`` loads is reported with the time spent verifying inside
it: ``RegionCheck.update`` (where every checksum of a load is computed and compared) is
wrapped with a timer for the run, so ``checksum_share = checksum time / load time`` of the
same load. CRC-32C's raw speed over bytes already in memory is reported too (``crc_gbps``).

Usage::

    python scripts/bench/checksum_cost.py               # 1 GiB
    python scripts/bench/checksum_cost.py --mib 128     # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # before this folder, whose checkpoint.py would shadow the package

import crc32c
import torch

import checkpoint
import sharded_tensor as st
from checkpoint import _reader
from checkpoint._chunks import CHUNK_BYTES
from sharding import single_split

R0 = "rank:0/cpu"


def _targets(layout: str, n: int, side: int) -> dict[str, object]:
    if layout == "whole":
        return {f"t{i}": torch.zeros(side, side) for i in range(n)}
    dim, parts = (0, 3) if layout == "rows" else (1, 2)
    return {f"t{i}": st.zeros(side, side, sharding_spec=single_split(dim, [R0] * parts)) for i in range(n)}


def _best(fn, repeat: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = 16
    side = int((args.mib * (1 << 20) / n / 4) ** 0.5)
    results = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("SHARDKIT_BENCH_DIR")) as tmp:
        folder = Path(tmp) / "ck"
        checkpoint.save({f"t{i}": torch.full((side, side), float(i)) for i in range(n)}, folder, quiet=True)
        plain = Path(tmp) / "plain"
        shutil.copytree(folder, plain)
        md = json.loads((plain / "shardkit.json").read_text())
        version = md["version"]
        files = sorted(folder.glob("data-*.safetensors"))
        total = sum(p.stat().st_size for p in files)
        # CRC-32C alone, chunk by chunk, over the first data file held in memory
        data = memoryview(files[0].read_bytes())

        def crc_all() -> None:
            for i in range(0, len(data), CHUNK_BYTES):
                crc32c.crc32c(data[i:i + CHUNK_BYTES])

        crc_time, _ = _best(crc_all, args.repeat)
        crc_bytes = len(data)
        spent = [0.0]
        update = _reader.RegionCheck.update

        def timed(self, data):  # the benchmark's instrument, not part of shardkit
            t = time.perf_counter()
            try:
                return update(self, data)
            finally:
                spent[0] += time.perf_counter() - t

        _reader.RegionCheck.update = timed
        try:
            for layout in ("whole", "rows", "cols"):
                targets = _targets(layout, n, side)
                checkpoint.load(targets, folder, quiet=True)  # warm
                runs = []
                for _ in range(args.repeat):
                    spent[0] = 0.0
                    t = time.perf_counter()
                    checkpoint.load(targets, folder, quiet=True)
                    runs.append((time.perf_counter() - t, spent[0]))
                best, checking = min(runs)
                results[layout] = {"load_s": round(best, 4), "checksum_s": round(checking, 4),
                                   "all_s": [round(x, 4) for x, _ in runs], "gbps": round(total / best / 1e9, 2),
                                   "checksum_share": round(checking / best, 3)}
        finally:
            _reader.RegionCheck.update = update
    print(json.dumps({"bytes": total, "format_version": version, "chunk_bytes": CHUNK_BYTES,
                      "crc_gbps": round(crc_bytes / max(crc_time, 1e-9) / 1e9, 2),
                      "layouts": results}, indent=1))


if __name__ == "__main__":
    main()
