#!/usr/bin/env python
"""Benchmark: what a large new CPU buffer costs, four ways. Prints JSON.

Not a test. Why ``_shardkit.memory`` allocates as it does: for a buffer that is about
to be filled, the memory behind it can cost more than the fill. Each way allocates
``--count`` buffers of ``--mib`` MiB one after another in a fresh process (keeping them all,
so every one is new memory) and times allocation plus one ``fill_``:

- ``faulted``: an anonymous mapping, faulted in page by page by the fill (what ``torch.empty``
  gets from glibc for a large block);
- ``huge_pages``: the same, advised ``MADV_HUGEPAGE`` (transparent huge pages);
- ``populated``: ``MAP_POPULATE``, the whole range committed by the ``mmap`` call
  (what ``empty_for_fill`` does);
- ``reused``: one buffer of the process's own, filled again (what the buffer cache gives).

``--rounds`` rounds run the ways in rotating order, each in its own process; the report
gives, per way, the median and the worst seconds per buffer, and GB/s at the median.

Usage::

    .venv/bin/python scripts/bench/memory.py                 # 8 x 256 MiB, 3 rounds
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time

WAYS = ("faulted", "huge_pages", "populated", "reused")


def _one_way(way: str, mib: int, count: int) -> list[float]:
    import torch

    torch.set_num_threads(1)
    size = mib << 20
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    kept = []
    own = None
    times = []
    for _ in range(count):
        start = time.perf_counter()
        if way == "reused":
            if own is None:
                own = mmap.mmap(-1, size, flags=flags | mmap.MAP_POPULATE)
            buffer = own
        else:
            buffer = mmap.mmap(-1, size, flags=flags | (mmap.MAP_POPULATE if way == "populated" else 0))
            if way == "huge_pages":
                buffer.madvise(mmap.MADV_HUGEPAGE)
        torch.frombuffer(buffer, dtype=torch.float32).fill_(1.0)
        times.append(time.perf_counter() - start)
        kept.append(buffer)
    if way == "reused":
        times = times[1:]  # the first one is new memory
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one way, in a child process
    args = parser.parse_args()
    if args.way:
        print(json.dumps(_one_way(args.way, args.mib, args.count)))
        return
    runs: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for way in WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]:
            out = subprocess.run([sys.executable, __file__, "--way", way, "--mib", str(args.mib),
                                  "--count", str(args.count)], check=True, capture_output=True, text=True)
            runs[way] += json.loads(out.stdout)
    gb = (args.mib << 20) / 1e9
    report = {
        "benchmark": "memory",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
                 "kernel": platform.release()},
        "buffer_mib": args.mib, "buffers_per_process": args.count, "rounds": args.rounds,
        "load_average": os.getloadavg(),
        "results": {w: {"median_s": round(statistics.median(t), 4), "worst_s": round(max(t), 4),
                        "median_gb_per_s": round(gb / statistics.median(t), 2)} for w, t in runs.items()},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
