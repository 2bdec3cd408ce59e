#!/usr/bin/env python
"""Pick the chunk size of version-2 chunk checksums: CRC-32C speed, partial-read overhead, metadata size.

Not a test: prints one JSON document. For each chunk size (256 KiB .. 8 MiB):

- ``crc_gbps``: CRC-32C throughput over a buffer already in memory, one call per chunk
  (per-call overhead included);
- ``partial_read_overhead``: reading ``--reads`` random sub-ranges of ``--range-mib`` MiB from a
  ``--file-mib`` MiB region of a file in the page cache, widened to whole chunks and verified,
  divided by the time of reading exactly the wanted bytes unverified (so 1.0 = free);
- ``extra_bytes``: mean extra bytes read per partial read (at most one chunk at each end);
- ``metadata_bytes_per_gib``: size of the chunk checksums in ``shardkit.json`` per GiB of data.

Usage::

    python scripts/bench/chunk_size.py                  # 256 MiB file, 4 MiB ranges
    python scripts/bench/chunk_size.py --range-mib 1    # smaller partial reads
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # before this folder, whose checkpoint.py would shadow the package

import crc32c

from checkpoint._chunks import chunk_checksums, plan_read, verify_chunks

MiB = 1 << 20


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file-mib", type=int, default=256)
    parser.add_argument("--range-mib", type=float, default=4.0)
    parser.add_argument("--reads", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    size = args.file_mib * MiB
    want = int(args.range_mib * MiB)
    data = os.urandom(size)
    rng = random.Random(0)
    starts = [rng.randrange(0, size - want) for _ in range(args.reads)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "region.bin")
        with open(path, "wb") as f:
            f.write(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            def exact() -> None:
                for s in starts:
                    os.pread(fd, want, s)
            exact()  # warm the page cache
            base = _best(exact, args.repeat)
            for chunk in [256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]:
                view = memoryview(data)
                crc_time = _best(lambda c=chunk: [crc32c.crc32c(view[i:i + c]) for i in range(0, size, c)],
                                 args.repeat)
                sums = chunk_checksums(data, chunk)
                plans = [plan_read(s, s + want, size, chunk) for s in starts]

                def verified(plans=plans, sums=sums, chunk=chunk) -> None:
                    for p in plans:
                        verify_chunks(os.pread(fd, p.read_end - p.read_start, p.read_start), p, sums, chunk)
                checked = _best(verified, args.repeat)
                results.append({"chunk_kib": chunk >> 10, "crc_gbps": round(size / crc_time / 1e9, 2),
                                "partial_read_overhead": round(checked / base, 2),
                                "extra_bytes": round(sum(p.extra_bytes for p in plans) / len(plans)),
                                "metadata_bytes_per_gib": 8 * ((1 << 30) // chunk)})
        finally:
            os.close(fd)
    print(json.dumps({"file_mib": args.file_mib, "range_mib": args.range_mib, "reads": args.reads,
                      "exact_read_gbps": round(want * len(starts) / base / 1e9, 2), "results": results}, indent=1))


if __name__ == "__main__":
    main()
