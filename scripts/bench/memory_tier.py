#!/usr/bin/env python
"""Benchmark the memory tier of ``CheckpointManager``: training overhead, blocking, recovery, work lost.

Not a test: prints one JSON document. Workload: a transformers Llama (hidden 1024, 8 layers,
vocabulary 32000: 168 M parameters) trained with AdamW on 4 Gloo ranks, tensor parallel
(``st.tensor_parallel_spec``), so that each rank's checkpoint (its shards of the parameters and
of the optimizer state) is about 0.5 GiB. The ranks are two "hosts" of two ranks, each host
with its own memory folder, so every part is replicated over the network (loopback). Parts:

(a) **step time** with a memory checkpoint every step (``memory_every=1``, nothing to storage)
    against the same steps without checkpoints, in blocks of ``--steps`` steps taken in turn
    (``--reps`` blocks each), in the same processes. A step is the forward, backward and
    optimizer step plus the ``save`` call. Reported per step, and per block: a block's time,
    the wait for its last step's background work included, over its steps (the headline:
    nothing the memory tier costs is left out). The first memory steps (which map fresh
    shared memory) are a warm-up block, not counted. With ``--device-step SECONDS`` a step
    is what the host does while an accelerator computes: it waits that long (the cores free for
    the tier's background work, as they are beside a GPU) and writes one element of every
    parameter and optimizer tensor, so each step's state differs.
(b) **blocked time** per step (the ``save`` call) against one plain copy of the rank's bytes
    (the regions it writes) into buffers it already holds, measured after each step without
    checkpoints.
(c) **recovery**, from the restart of the processes (a fresh ``torchrun``-like start of 4
    spawned interpreters) to the end of the first resumed step, and the ``load`` alone: from
    memory (each rank's own host), from memory with host 1's folder gone (its ranks' parts
    come from replicas on host 0), with both hosts' folders gone (no complete step in memory:
    the memory tier falls back to storage on the local disk, as when two hosts are lost with
    one replica), from storage on a local disk (the page cache of the files dropped first with
    ``posix_fadvise(DONTNEED)``), and from storage on an S3-protocol store (moto's server, in
    this process, on loopback; the step saved there by ``checkpoint.save``).
    Every recovery's state is checked bit for bit against the saved one (timed apart: the
    check is left out of the restart's time). And the floor: the
    same restart loading nothing (``no checkpoint``: processes, model, first step), which no
    tier can shorten; each restart's time above it is what its tier costs.
(d) the same recovery by DCP: ``dcp.load`` of the same state (DTensors sharing the shards'
    memory) from a DCP checkpoint on the local disk, page cache dropped, as the anchor.
(e) **work lost per failure**: ``scripts/soak.py`` with the memory tier (every step in memory,
    storage every 10) and with storage alone every 10 steps, ``--soak-kills`` kills each; the
    steps re-done after each kill.

Figures are medians with their range; the recovery cases run ``--reps`` times each, in turn.

    python scripts/bench/memory_tier.py               # the figures in docs/benchmarks.md
    python scripts/bench/memory_tier.py --quick       # hidden 256, 2 layers: a few MiB per rank
    python scripts/bench/memory_tier.py --skip-soak   # (a) to (d) only
    python scripts/bench/memory_tier.py --case memory --case "local disk"   # some recovery cases only
    python scripts/bench/memory_tier.py --skip-recovery --skip-soak --device-step 4   # (a), (b) as beside a GPU
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# This folder's checkpoint.py (a benchmark) must not shadow the checkpoint package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if str(_HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(_HERE.parents[1]))


def _module(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_harness = _module(_HERE / "_harness.py", "_bench__harness")
ROOT, machine, MiB, GiB = _harness.ROOT, _harness.machine, _harness.MiB, _harness.GiB
WORLD, HOSTS = 4, 2
CASES = ("memory", "memory, host lost", "memory, both hosts lost", "local disk", "s3", "dcp", "no checkpoint")
FLOOR = "no checkpoint"  # a restart that loads nothing: processes, model, first step (what no tier can shorten)
LOST = {"memory, host lost": (1,), "memory, both hosts lost": (0, 1)}  # the hosts whose memory folder is gone


# -- in every rank ----------------------------------------------------------------------------------

def _host(rank: int, args: dict[str, Any]) -> None:
    """This rank's "host": its memory folder and torchrun's node number."""
    host = rank * HOSTS // WORLD
    os.environ["SHARDKIT_MEMORY_DIR"] = args["memory"][host]
    os.environ["GROUP_RANK"] = str(host)


def _build(args: dict[str, Any], world: int, *, init: bool) -> tuple[Any, Any, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import sharded_tensor as st

    config = LlamaConfig(vocab_size=args["vocab"], hidden_size=args["hidden"],
                         intermediate_size=args["hidden"] * 11 // 4, num_hidden_layers=args["layers"],
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=args["seq"],
                         use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    st.shard_model(model, st.tensor_parallel_spec(model, ranks), seed=0 if init else None, init=None if init else False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, config.vocab_size, (args["batch"], args["seq"]), generator=generator)
    return model, optim, batch


def _train_step(model: Any, optim: Any, batch: Any, device_seconds: float = 0.0) -> None:
    """One training step; with ``device_seconds``, the step an accelerator would take instead.

    On an accelerator the forward, backward and optimizer step run on the device while the
    host's cores are free for the memory tier's background work. Emulated here: the host
    waits ``device_seconds`` and the state changes as a step changes it (every parameter and
    optimizer tensor written, one element each: a cheap stand-in for the device's update).
    """
    import torch

    if not device_seconds:
        optim.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optim.step()
        return
    time.sleep(device_seconds)
    with torch.no_grad():
        for p in model.parameters():  # a sharded model's parameters are its local shards
            p.view(-1)[:1].add_(1e-3)
            for value in optim.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    value.view(-1)[:1].add_(1e-3)


def _digest(state: Any) -> str:
    """SHA-256 of this rank's share of a training state (its shards, values), in a fixed order."""
    import torch

    import sharded_tensor as st
    from checkpoint._walk import flatten_state_dict

    h = hashlib.sha256()
    for name, _, _, value in sorted(flatten_state_dict(state), key=lambda leaf: leaf[0]):
        h.update(name.encode())
        if isinstance(value, st.ShardedTensor):
            for shard in value.local_shards():
                h.update(shard.tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, torch.Tensor):
            h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(json.dumps(value).encode())
    return h.hexdigest()


def _dtensors(state: Any, mesh: Any) -> Any:
    """``state`` with every ShardedTensor as a DTensor of its layout, sharing its memory."""
    import sharded_tensor as st

    if isinstance(state, dict):
        return {k: _dtensors(v, mesh) for k, v in state.items()}
    return state.to_dtensor(mesh) if isinstance(state, st.ShardedTensor) else state


def _copy_values(state: dict[str, Any], mirror: dict[str, Any]) -> None:
    """The non-tensor values ``dcp.load`` put into ``mirror`` (DCP replaces them), back into ``state``."""
    import torch

    for key, value in mirror.items():
        if isinstance(value, dict):
            _copy_values(state[key], value)
        elif not isinstance(value, torch.Tensor):
            state[key] = value


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _train(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """(a) and (b), then the checkpoints the recoveries read: memory, local storage, DCP."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import checkpoint
    import sharded_tensor as st
    from checkpoint._save import _plan

    _host(rank, args)
    model, optim, batch = _build(args, world, init=True)
    _train_step(model, optim, batch)  # the optimizer state exists from here on

    def state(step: int) -> dict[str, Any]:
        return {**st.get_state_dict(model, optim), "step": step}

    last = 1 + args["steps"] * (2 * args["reps"] + 1) + 1
    manager = checkpoint.CheckpointManager(args["root"], keep_last=1, storage_every=last, memory_every=1,
                                           memory_replicas=1, timeout=1800)
    # (b)'s yardstick: the regions this rank writes, copied into buffers it already holds.
    mine = [r.tensor for r in _plan(state(0), rank, world).regions if r.writer == rank and r.tensor is not None]
    buffers = [torch.empty_like(t).copy_(t) for t in mine]
    rank_bytes = sum(t.numel() * t.element_size() for t in mine)

    def copy() -> float:
        start = time.perf_counter()
        for buffer, tensor in zip(buffers, mine):
            buffer.copy_(tensor)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"none": [], "memory": []}
    blocked: list[float] = []
    parts: list[dict[str, float]] = []
    copies: list[float] = []
    step = 1

    per_block: dict[str, list[float]] = {"none": [], "memory": []}

    def block(mode: str, timed: bool) -> None:
        nonlocal step
        dist.barrier()
        began = time.perf_counter()
        for _ in range(args["steps"]):
            step += 1
            dist.barrier()
            start = time.perf_counter()
            _train_step(model, optim, batch, args["device_step"])
            snapshot = state(step) if mode == "memory" else None  # the loop's own work: its state dict
            called = time.perf_counter()
            handle = manager.save(step, snapshot, async_=True) if snapshot is not None else None
            end = time.perf_counter()
            if timed:
                times[mode].append(_slowest(end - start))
                if mode == "memory":
                    blocked.append(_slowest(end - called))
                    parts.append(dict(handle._blocked_parts))
                else:
                    copies.append(_slowest(copy()))
        manager.wait()
        if timed:  # the whole block, the last step's background work included: what the run pays
            per_block[mode].append(_slowest(time.perf_counter() - began) / args["steps"])

    block("memory", timed=False)  # warm-up: fresh shared memory is mapped by the first steps
    for rep in range(args["reps"]):
        for mode in (("none", "memory") if rep % 2 == 0 else ("memory", "none")):
            block(mode, timed=True)
    step += 1
    _train_step(model, optim, batch)
    final = state(step)
    manager.save(step, final)  # in memory and in storage
    assert step == last, (step, last)
    # The same step on the S3 server, as a manager rooted there would have saved it.
    checkpoint.save(final, f"{args['s3_root']}/step-{step:010d}", storage_options=args["s3_options"], quiet=True)
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(_dtensors(final, mesh), checkpoint_id=args["dcp"])
    digest = _digest(final)
    dist.barrier()
    return {"times": times, "per_block": per_block, "blocked": blocked, "blocked_parts": parts, "copies": copies,
            "rank_bytes": rank_bytes, "step": step, "digest": digest}


def _recover(rank: int, world: int, args: dict[str, Any], case: str, started: float) -> dict[str, Any]:
    """(c), (d): one restart: build the model unfilled, load from ``case``, check, take the first step."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import checkpoint
    import sharded_tensor as st

    _host(rank, args)
    up = time.time() - started
    model, optim, batch = _build(args, world, init=False)
    state = {**st.get_state_dict(model, optim), "step": None}
    dist.barrier()
    load_start = time.perf_counter()
    report = None
    if case.startswith("memory"):
        manager = checkpoint.CheckpointManager(args["root"], memory_every=1, timeout=1800)
        manager.load(state)
        report = manager.last_load
    elif case == "local disk":
        manager = checkpoint.CheckpointManager(args["root"], timeout=1800)
        manager.load(state)
        report = manager.last_load
    elif case == "s3":
        manager = checkpoint.CheckpointManager(args["s3_root"], storage_options=args["s3_options"], timeout=1800)
        manager.load(state)
        report = manager.last_load
    elif case == "dcp":
        mesh = init_device_mesh("cpu", (world,))
        mirror = _dtensors(state, mesh)
        dcp.load(mirror, checkpoint_id=args["dcp"])
        _copy_values(state, mirror)
    load_seconds = time.perf_counter() - load_start
    # The floor loads nothing: its state is the unfilled model's, nothing to compare. The check
    # (a SHA-256 of the rank's 482 MiB, about 1 s with four ranks on two cores) is the
    # benchmark's, not the restart's: it is timed apart and left out of the restart's time.
    check_start = time.perf_counter()
    exact = case == FLOOR or _digest(state) == args["digests"][rank] and state["step"] == args["step"]
    check_seconds = time.perf_counter() - check_start
    if case == FLOOR:
        state["step"] = 0
    if case != FLOOR:
        st.set_state_dict(model, optim, state)
    _train_step(model, optim, batch)
    first_step = time.time() - started - check_seconds
    dist.barrier()
    return {"up": up, "load": load_seconds, "first_step": first_step, "check": check_seconds, "exact": exact,
            "tier": None if report is None else report.tier,
            "storage_bytes": None if report is None else report.storage_bytes,
            "peer_bytes": None if report is None else report.peer_bytes,
            "local_bytes": None if report is None else report.local_bytes}


# -- the driver ------------------------------------------------------------------------------------

def _drop_page_cache(folder: Path) -> None:
    """Evict the files of ``folder`` from the page cache (written and synced already), as after a reboot."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def _ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """Median of a over median of b, with the range of the per-pair ratios."""
    pairs = [x / y for x, y in zip(a, b) if y > 0]
    return {"median": round(statistics.median(a) / statistics.median(b), 3),
            "min": round(min(pairs), 3), "max": round(max(pairs), 3)}


def _s3_server() -> tuple[Any, str]:
    import logging

    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def _soak(memory: bool, kills: int, steps: int) -> dict[str, Any]:
    import subprocess

    argv = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--steps", str(steps), "--kills", str(kills),
            "--storage-every", "10", *(["--memory"] if memory else [])]
    done = subprocess.run(argv, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode not in (0, 1):
        msg = f"scripts/soak.py failed ({done.returncode}):\n{done.stderr[-3000:]}"
        raise RuntimeError(msg)
    report = json.loads(done.stdout)
    lost = report["steps_lost"]
    return {"steps_lost": lost, "mean": round(statistics.mean(lost), 2), "max": max(lost),
            "resume_steps": report["resume_steps"], "all_resumes_exact": report["resumes_exact"],
            "ok": report["ok"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="steps per block in (a), (b) (default 4)")
    parser.add_argument("--reps", type=int, default=3, help="blocks per mode in (a), runs per recovery case (3)")
    parser.add_argument("--quick", action="store_true", help="hidden 256, 2 layers, vocabulary 4096, 2 reps")
    parser.add_argument("--skip-soak", action="store_true", help="leave out (e)")
    parser.add_argument("--skip-recovery", action="store_true", help="leave out (c), (d): (a) and (b) only")
    parser.add_argument("--device-step", type=float, default=0.0, metavar="SECONDS",
                        help="in (a), (b): each step waits SECONDS instead of computing, as the host does while an "
                             "accelerator computes (its cores free for the tier's background work); default 0: "
                             "the real step on the CPU")
    parser.add_argument("--soak-kills", type=int, default=6, help="kills per soak in (e) (default 6)")
    parser.add_argument("--work", type=Path, default=None, help="disk folder for storage and DCP (default: a temp)")
    parser.add_argument("--case", action="append", choices=CASES, default=None,
                        help="a recovery case to run (repeat the option; default: all; memory is always run)")
    args = parser.parse_args(argv)
    cases = () if args.skip_recovery else tuple(c for c in CASES if c == "memory" or args.case is None
                                                or c in args.case)
    if args.quick:
        args.hidden, args.layers, args.vocab, args.reps = 256, 2, 4096, 2
    work = Path(tempfile.mkdtemp(prefix="shardkit-bench-memory-", dir=args.work))
    shm = Path(tempfile.mkdtemp(prefix="shardkit-bench-memory-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    server, endpoint = _s3_server()
    options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench",
               "client_kwargs": {"region_name": "eu-west-1"}}
    config = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
              "steps": args.steps, "reps": args.reps, "device_step": args.device_step,
              "root": str(work / "ckpt"), "dcp": str(work / "dcp"),
              "memory": [str(shm / f"host{h}") for h in range(HOSTS)], "s3_root": "s3://bench/ckpt",
              "s3_options": options}
    launch = _harness.launch
    try:
        print("memory tier benchmark: training, (a) and (b)", file=sys.stderr, flush=True)
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("bench")
        trained = launch(_train, WORLD, config)
        step = trained[0]["step"]
        print(json.dumps({"trained": {k: v for k, v in trained[0].items() if k != "blocked_parts"}}),
              file=sys.stderr, flush=True)  # (a) and (b), in case a later part fails
        config.update(step=step, digests=[r["digest"] for r in trained])
        runs: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
        for rep in range(args.reps if cases else 0):
            for case in cases[rep % len(cases):] + cases[:rep % len(cases)]:
                print(f"memory tier benchmark: recovery {rep + 1}/{args.reps} from {case}", file=sys.stderr,
                      flush=True)
                lost = [Path(config["memory"][host]) for host in LOST.get(case, ())]
                for folder in lost:
                    folder.rename(f"{folder}.away")
                _drop_page_cache(work)
                try:
                    results = launch(_recover, WORLD, config, case, time.time())
                finally:
                    for folder in lost:
                        shutil.rmtree(folder, ignore_errors=True)
                        Path(f"{folder}.away").rename(folder)
                print(json.dumps({"recovery": case, "ranks": results}), file=sys.stderr, flush=True)
                runs[case].append({"first_step": max(r["first_step"] for r in results),
                                   "load": max(r["load"] for r in results), "up": max(r["up"] for r in results),
                                   "exact": all(r["exact"] for r in results),
                                   "tier": [r["tier"] for r in results],
                                   "storage_bytes": [r["storage_bytes"] for r in results],
                                   "peer_bytes": [r["peer_bytes"] for r in results]})
        soak: dict[str, Any] = {}
        if not args.skip_soak:
            for memory in (True, False):
                name = "memory every step, storage every 10" if memory else "storage every 10"
                print(f"memory tier benchmark: (e) soak, {name}", file=sys.stderr, flush=True)
                try:
                    soak[name] = _soak(memory, args.soak_kills, 20 * args.soak_kills)
                except Exception as exc:  # noqa: BLE001 - the figures of (a) to (d) are still reported
                    soak[name] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    rank_bytes = [r["rank_bytes"] for r in trained]
    steps = trained[0]["times"]
    blocked, copies = trained[0]["blocked"], trained[0]["copies"]

    def recovery(case: str, key: str) -> list[float]:
        return [r[key] for r in runs[case]]

    def after_up(case: str) -> float:
        """The median time from the processes up to the first step: the restart less the interpreters starting,
        whose noise (5-8 s here, the same work in every case) would otherwise swamp the tiers' difference."""
        return statistics.median(r["first_step"] - r["up"] for r in runs[case])

    floor = after_up(FLOOR) if FLOOR in cases else None

    report = {
        "benchmark": "memory_tier", "machine": machine(), "world": WORLD, "hosts": HOSTS,
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "seq": args.seq,
                  "batch": args.batch},
        "rank_bytes": rank_bytes, "rank_mib": round(max(rank_bytes) / MiB, 1),
        "a_step_seconds": {"none": _stats(steps["none"]), "memory every step": _stats(steps["memory"])},
        "a_step_ratio_memory_over_none": _ratio(steps["memory"], steps["none"]),
        "a_block_seconds_per_step": {mode: _stats(v) for mode, v in trained[0]["per_block"].items()},
        "a_block_ratio_memory_over_none": _ratio(trained[0]["per_block"]["memory"], trained[0]["per_block"]["none"]),
        "b_blocked_seconds": _stats(blocked), "b_copy_seconds": _stats(copies),
        "b_blocked_over_copy": round(statistics.median(blocked) / statistics.median(copies), 3),
        "a_b_step": (f"emulated accelerator step: {args.device_step} s waited, the cores free" if args.device_step
                     else "the real step, computed on the CPU"),
        "b_blocked_parts_median": {k: round(statistics.median(p[k] for p in trained[0]["blocked_parts"]), 4)
                                   for k in trained[0]["blocked_parts"][0]},
        "c_restart_to_first_step_seconds": {case: _stats(recovery(case, "first_step")) for case in cases},
        "c_load_seconds": {case: _stats(recovery(case, "load")) for case in cases},
        "c_processes_up_seconds": {case: _stats(recovery(case, "up")) for case in cases},
        "c_ratios_restart_to_first_step": {f"memory / {case}": _ratio(recovery("memory", "first_step"),
                                                                      recovery(case, "first_step"))
                                           for case in cases[1:]},
        "c_ratios_load": {f"memory / {case}": _ratio(recovery("memory", "load"), recovery(case, "load"))
                          for case in cases[1:] if case != FLOOR},
        # The part of a restart a checkpoint's tier can change: from the processes up to the first step, less
        # the same part of the restart that loads nothing.
        "c_seconds_above_floor": {case: round(after_up(case) - floor, 3) for case in cases
                                  if case != FLOOR and floor is not None},
        "c_ratios_restart_above_floor": {f"memory / {case}": round((after_up("memory") - floor)
                                                                   / (after_up(case) - floor), 3)
                                         for case in cases[1:] if case != FLOOR and floor is not None},
        "c_recoveries": runs,
        "c_all_exact": all(r["exact"] for case in cases for r in runs[case]),
        "page_cache": "the disk checkpoints' pages evicted (posix_fadvise DONTNEED) before each recovery",
        "e_work_lost_per_failure": soak,
    }
    print(json.dumps(report, indent=1), flush=True)
    return 0 if report["c_all_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
