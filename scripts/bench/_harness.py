"""Shared plumbing for the distributed benchmarks: spawn Gloo ranks, time, count bytes.

Not a test helper: benchmarks print JSON and never assert timings. Each benchmark spawns
its ranks once per world size (``_shardkit.launch``: spawned interpreters, Gloo on 127.0.0.1,
rendezvous through a file store, no port to race for) and runs every case inside, so the
ratios it reports come from the same processes on the same (shared, noisy) machine a few
seconds apart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _shardkit.launch import LaunchError  # noqa: E402
from _shardkit.launch import launch as _launch  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


# Ranks run as long as a benchmark needs; a collective that waits this long is stuck.
COLLECTIVE_TIMEOUT = 1800.0


def launch(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned Gloo ranks; results in rank order.

    Ranks print live (progress goes to stderr); a failing rank raises ``LaunchError`` with
    its traceback after the others are stopped.
    """
    return _launch(fn, world, args, timeout=None, collective_timeout=COLLECTIVE_TIMEOUT, **rank_options(world))


def rank_options(world: int) -> dict[str, Any]:
    """``_shardkit.launch`` options shared by every benchmark."""
    # Two cores are shared by all ranks: one intra-op thread per rank unless there is room.
    return {"env": {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")},
            "threads": max(1, (os.cpu_count() or 1) // world), "capture_output": False, "start_method": "spawn"}


def timed(fn: Callable[[], Any], cpu: list[float] | None = None) -> tuple[float, int]:
    """``(seconds, wire bytes)`` of ``fn`` on this rank.

    Every rank starts ``fn`` after a common barrier and stops its clock when its own ``fn``
    returns; the seconds are the slowest rank's. (A closing barrier would add its own wake-up
    latency, several milliseconds when more ranks than cores share the machine, which swamps
    calls that take a few milliseconds.) Wire bytes (``wire_bytes``) are read around ``fn``:
    its own traffic only. With ``cpu``, the CPU seconds this process spent in ``fn`` (all its
    threads, Gloo's included) are appended to it: on a shared machine they say what the call
    costs, whatever else competes for the cores.
    """
    dist.barrier()
    start = time.perf_counter()
    sent = wire_bytes()
    cpu_start = time.process_time()
    fn()
    cpu_spent = time.process_time() - cpu_start
    elapsed = time.perf_counter() - start
    sent = wire_bytes() - sent
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if cpu is not None:
        cpu.append(cpu_spent)
    return float(slowest.item()), sent


def wire_bytes() -> int:
    """Bytes this process has handed to write-like syscalls (``wchar`` of /proc/self/io).

    Gloo's TCP transport writes its payload to sockets with ``write``/``writev``, so the
    change of this counter over a quiet interval is what the process put on the wire (plus a
    few dozen bytes of Gloo headers per message). Linux only; -1 elsewhere.
    """
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        mem = 0
    return {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
            "memory_gib": round(mem / GiB, 1), "python": platform.python_version(),
            "torch": torch.__version__, "backend": "gloo (TCP on 127.0.0.1)",
            "load_average": [round(x, 2) for x in os.getloadavg()]}


class Interleaved:
    """Several ways of doing one thing, timed on this rank in the same process, interleaved.

    ``measure(key, fn)`` times ``fn`` with ``timed`` under ``key``: its seconds go to
    ``runs[key]``, its CPU seconds to ``cpu[key]``, its wire bytes to ``wire[key]`` (the last
    call's). ``run(ways, reps)`` calls every way once to warm up (connections, caches) and
    forgets those figures, then runs ``reps`` rounds, each starting one way later than the
    last, so that machine noise hits every way alike.
    """

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self.wire: dict[str, int] = {}

    def measure(self, key: str, fn: Callable[[], Any]) -> None:
        seconds, sent = timed(fn, self.cpu.setdefault(key, []))
        self.runs.setdefault(key, []).append(seconds)
        self.wire[key] = sent

    def run(self, ways: Sequence[Callable[[], None]], reps: int) -> None:
        for way in ways:
            way()
        self.runs.clear()
        self.cpu.clear()
        for rep in range(reps):
            k = rep % len(ways)
            for way in [*ways[k:], *ways[:k]]:
                way()

    def medians(self) -> dict[str, float]:
        return {k: median(v) for k, v in self.runs.items()}

    def cpu_medians(self) -> dict[str, float]:
        return {k: median(v) for k, v in self.cpu.items()}


# -- a sweep of transitions x sizes x worlds, every case in the ranks of its world ------------------

def sweep_args(description: str, transitions: Sequence[str], reps: int) -> argparse.Namespace:
    """The command line of a sweep: ``--quick``, ``--reps``, ``--worlds``, ``--sizes``, ``--only``.

    ``sizes`` and ``reps`` come back filled in: 4096 and 8192 (4096 with ``--quick``) and
    ``reps`` repetitions per way (3 with ``--quick``).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="4096^2 only, 3 repetitions")
    parser.add_argument("--reps", type=int, default=None, help=f"timed repetitions per way (default {reps}, quick 3)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--only", nargs="+", default=list(transitions), choices=transitions)
    args = parser.parse_args()
    args.sizes = args.sizes or ([4096] if args.quick else [4096, 8192])
    args.reps = args.reps or (3 if args.quick else reps)
    return args


def sweep_cases(rank: int, world: int, case: Callable[..., dict[str, Any]], sizes: list[int], reps: int,
                names: list[str]) -> list[dict[str, Any]]:
    """``case(rank, world, n, name, reps)`` for every size ``n`` and transition ``name``, in order."""
    out = []
    for n in sizes:
        for name in names:
            if rank == 0:
                print(f"  world={world} n={n} {name}", file=sys.stderr, flush=True)
            out.append(case(rank, world, n, name, reps))
    return out


def sweep(benchmark: str, case: Callable[..., dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run ``sweep_cases`` on the ranks of each world in ``args.worlds``; the cases merged over ranks.

    A case's dict is rank 0's, with ``bytes_sent`` and ``min_bytes`` made per-rank lists, its
    ``wire_bytes`` as ``wire_bytes_per_rank`` and its ``cpu_s`` as ``cpu_s_mean_over_ranks``.
    """
    results = []
    for world in args.worlds:
        print(f"{benchmark} benchmark: {world} ranks", file=sys.stderr, flush=True)
        for cases in zip(*launch(sweep_cases, world, case, args.sizes, args.reps, args.only)):
            first = dict(cases[0])
            first["bytes_sent"] = [c["bytes_sent"] for c in cases]
            first["min_bytes"] = [c["min_bytes"] for c in cases]
            first["wire_bytes_per_rank"] = {k: [c["wire_bytes"].get(k) for c in cases] for k in cases[0]["wire_bytes"]}
            del first["wire_bytes"]
            first["cpu_s_mean_over_ranks"] = {k: sum(c["cpu_s"][k] for c in cases) / len(cases)
                                              for k in cases[0]["cpu_s"]}
            del first["cpu_s"]
            results.append(first)
    return results


# -- one way per set of fresh processes (memory figures need a process of their own) ---------------

def proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Reset ``VmHWM`` to the current resident size (Linux >= 4.0) and return that size."""
    Path("/proc/self/clear_refs").write_text("5")
    return proc_status("VmRSS")


def measured(fn: Callable[[], Any]) -> tuple[Any, float, float, int]:
    """``(fn(), wall s, CPU s, peak RSS growth in bytes)``, started together by every rank. Collective.

    The ranks meet at a barrier before and after, so the slowest rank's wall time is the
    step's; the peak is reset first, so the growth is this step's alone.
    """
    dist.barrier()
    before = reset_peak()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = proc_status("VmHWM") - before
    dist.barrier()
    return result, elapsed, cpu, peak


def load_and_touch(load: Callable[[], Any]) -> tuple[Any, float, int, float, int]:
    """``(model, seconds, peak growth, touch seconds, peak growth touched)`` of ``load()`` on this rank.

    Starts after a barrier, with the peak reset. ``load`` is timed alone, then every parameter
    is read once: a parameter that is a view of a file's mapped pages pays for its pages there,
    so the touched figures compare the whole cost of having the weights in memory.
    """
    dist.barrier()
    before = reset_peak()
    start = time.perf_counter()
    model = load()
    elapsed = time.perf_counter() - start
    peak = proc_status("VmHWM") - before
    start = time.perf_counter()
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).sum()
    touched = time.perf_counter() - start
    return model, elapsed, peak, touched, proc_status("VmHWM") - before


def logits_sample(model: Any) -> list[list[float]]:
    """A corner of a language model's logits on a fixed 16-token prompt (gathered whole if split),
    to check that every way loaded the same weights."""
    x = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(x).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return logits[0, :4, :8].tolist()  # type: ignore[no-any-return]


def local_param_bytes(model: Any) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local tensor for DTensors)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def llama_tp_names(layers: int) -> tuple[list[str], list[str]]:
    """Module names of a Llama's tensor-parallel projections: (split on outputs, split on inputs)."""
    cols, rows = [], []
    for i in range(layers):
        cols += [f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        cols += [f"model.layers.{i}.mlp.{p}" for p in ("gate_proj", "up_proj")]
        rows += [f"model.layers.{i}.self_attn.o_proj", f"model.layers.{i}.mlp.down_proj"]
    return cols, rows


def run_fresh(target: Callable[..., dict[str, Any]], world: int, *args: Any,
              what: str = "benchmark") -> list[dict[str, Any]]:
    """Run ``target(rank, world, *args)`` in ``world`` fresh spawned processes joined by Gloo.

    ``target`` returns a dict of figures; returns them in rank order, or raises
    ``LaunchError`` with the first failure (``what`` names the run in the message).
    """
    try:
        return _launch(target, world, args, timeout=None, collective_timeout=COLLECTIVE_TIMEOUT,
                       **rank_options(world))
    except LaunchError as exc:
        raise RuntimeError(f"{what} failed:\n{exc}") from exc


def fresh_runs(target: Callable[..., dict[str, Any]], world: int, methods: Sequence[str], repeat: int,
               *args: Any) -> dict[str, list[dict[str, Any]]]:
    """``repeat`` runs of every way: ``{method: [{"ranks": run_fresh(target, world, method, *args)}, ...]}``.

    The order of the ways rotates from one round to the next, so that changing load on a
    shared machine hits every way alike.
    """
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for k in range(repeat):
        for method in [*methods[k % len(methods):], *methods[:k % len(methods)]]:
            runs[method].append({"ranks": run_fresh(target, world, method, *args, what=method)})
    return runs


def summarize_fresh(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One way's ``fresh_runs`` of a model built and sharded: median over repeats of the slowest
    rank's wall time and of each rank's CPU time, each rank's worst peak growth against the goal
    (1.2 x its shard + 200 MiB), and whether every rank of every run computed finite outputs
    and drew blocks of its own.

    Each rank's figures: ``seconds``, ``cpu_seconds``, ``peak_growth``, ``shard_bytes``,
    ``output_finite`` and ``distinct_blocks`` (see ``distinct_over_ranks``).
    """
    ranks = runs[0]["ranks"]
    walls = sorted(max(r["seconds"] for r in run["ranks"]) for run in runs)
    cpus = [statistics.median(run["ranks"][i]["cpu_seconds"] for run in runs) for i in range(len(ranks))]
    peaks = [max(run["ranks"][i]["peak_growth"] for run in runs) for i in range(len(ranks))]
    return {
        "seconds": round(statistics.median(walls), 2),
        "seconds_all_runs": [round(w, 2) for w in walls],
        # CPU time of each rank: less sensitive than wall time to other load on the machine.
        "cpu_seconds": [round(c, 4) for c in cpus],
        "peak_growth_mib": [round(p / MiB) for p in peaks],
        "shard_mib": [round(r["shard_bytes"] / MiB) for r in ranks],
        "goal_mib": [round((1.2 * r["shard_bytes"] + 200 * MiB) / MiB) for r in ranks],
        "memory_goal_met": all(p <= 1.2 * r["shard_bytes"] + 200 * MiB for p, r in zip(peaks, ranks)),
        "output_finite": all(r["output_finite"] for run in runs for r in run["ranks"]),
        # False would mean every rank drew its block from the same random stream.
        "distinct_random_blocks": all(r["distinct_blocks"] for run in runs for r in run["ranks"]),
    }


def vs_torch(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Every way's wall time and mean CPU time over ``torch_parallelize_module``'s (``summarize_fresh``
    results by way); empty without that way."""
    if "torch_parallelize_module" not in results:
        return {}
    torch_seconds = results["torch_parallelize_module"]["seconds"]
    torch_cpu = statistics.mean(results["torch_parallelize_module"]["cpu_seconds"])

    def ratio(value: float, base: float) -> float | None:
        return round(value / base, 2) if base > 0 else None  # a model too small to time: no ratio

    return {m: {"wall": ratio(r["seconds"], torch_seconds), "cpu": ratio(statistics.mean(r["cpu_seconds"]), torch_cpu)}
            for m, r in results.items()}


def finish_fresh_report(report: dict[str, Any], runs: dict[str, list[dict[str, Any]]],
                        summarize: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
    """Fill ``report`` with each way's summary of its ``fresh_runs``, the load average after and
    ``vs_torch`` (when ``torch_parallelize_module`` ran), then print it (``print_report``)."""
    report["results"] = {method: summarize(method_runs) for method, method_runs in runs.items()}
    report["load_average_after"] = os.getloadavg()
    if ratios := vs_torch(report["results"]):
        report["vs_torch"] = ratios
    print_report(report)


def distinct_over_ranks(values: torch.Tensor, world: int) -> bool:
    """Whether every rank holds different ``values`` (a few elements of its block of one weight). Collective."""
    mine = values.double().contiguous()
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return len({tuple(t.tolist()) for t in everyone}) == world


def print_report(report: dict[str, Any]) -> None:
    """``report`` as indented JSON, each list of numbers on one line (per-rank lists stay readable)."""
    text = json.dumps(report, indent=2)
    print(re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text))


def raw_write(rank: int, world: int, folder: str, total: int, repeat: int) -> list[float]:
    """The disk's own speed: each rank writes ``total / world`` random bytes in 64 MiB blocks, then
    ``fsync``; seconds per repetition, between two barriers. Collective.

    What a sharded save is judged against: one stream per rank, as a save writes.
    """
    mine = total // world
    data = os.urandom(min(64 << 20, mine))
    times = []
    for i in range(repeat):
        path = Path(folder) / f"raw-{world}-{rank}-{i}.bin"
        dist.barrier()
        start = time.perf_counter()
        with open(path, "wb") as f:
            written = 0
            while written < mine:
                n = min(len(data), mine - written)
                f.write(memoryview(data)[:n])
                written += n
            f.flush()
            os.fsync(f.fileno())
        dist.barrier()
        times.append(time.perf_counter() - start)
        path.unlink()
    return times


class PeakGrowth:
    """Peak RSS growth of this process over a ``with`` block (``VmHWM`` reset first), in ``.growth``."""

    def __enter__(self) -> PeakGrowth:
        import gc

        gc.collect()
        try:
            self.before = reset_peak()
        except OSError:
            self.before = proc_status("VmRSS")
        self.growth = 0
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth = max(0, proc_status("VmHWM") - self.before)
