"""shardkit demo: shard a model's weights over several processes, reshard them, gather them back.

Run it with ``./scripts/demo.sh`` (4 CPU processes, Gloo), or directly:

    python scripts/demo.py [--nproc 4] [--out out/demo] [--device cpu|cuda]

Without torchrun's environment this script is the driver: it launches itself under
``torchrun`` (``python -m torch.distributed.run``) and reports. Each rank then:

1. declares a composite spec (one spec per parameter) for a small MLP and prints the layout;
2. shards the weights from rank 0 with ``shard_tensor`` and reports the bytes each rank holds;
3. reshards every weight to a second spec, counting the bytes with ``CommCounter`` and
   checking them against the minimum implied by the two layouts;
4. gathers every weight on rank 0 and checks it bit for bit against the original.

Every check that fails is reported and makes the demo exit non-zero.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import sharded_tensor as st
from sharding import CompositeShardingSpec, DevicePlacement, ShardedTensorMetadata, composite, single_split

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, help="number of ranks (default: 4)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "demo",
                        help="output folder (default: out/demo in the repository)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: Gloo on CPU processes; cuda: NCCL, one GPU per rank (default: cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's weights (default: 0)")
    return parser.parse_args(argv)


# -- the model ---------------------------------------------------------------------------------


class MLP(nn.Module):
    """A small MLP: embedding, two hidden layers with a layer norm, an output projection."""

    def __init__(self, vocab: int = 512, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.fc2(torch.relu(self.fc1(x)))
        return self.head(self.norm(x))


def first_spec(devices: list[str]) -> CompositeShardingSpec:
    """Split the big matrices so that each rank holds a slice; keep the layer norm everywhere."""
    rows, cols = single_split(0, devices), single_split(1, devices)
    return composite(
        embed=rows,                   # vocabulary rows
        fc1=rows,                     # output features (weight and bias)
        fc2=composite(weight=cols, bias=DevicePlacement(devices[0])),  # input features; bias whole on rank 0
        norm=DevicePlacement(devices[0].split("/", 1)[1]),  # a replica on every rank
        head=rows,
    )


def second_spec(devices: list[str]) -> CompositeShardingSpec:
    """Another layout: the same parameters split on their other dimension, unevenly for the embedding."""
    n = len(devices)
    vocab_cols = [64 // n + (1 if r < 64 % n else 0) for r in range(n)]
    return composite(
        embed=single_split(1, devices, shard_sizes=vocab_cols[::-1]),
        fc1=composite(weight=single_split(1, devices), bias=single_split(0, devices)),
        fc2=single_split(0, devices),
        norm=single_split(0, devices),
        head=composite(weight=single_split(1, devices), bias=DevicePlacement(devices[-1])),
    )


# -- helpers --------------------------------------------------------------------------------------


class Checks:
    """Collects pass/fail results so the demo can report them all and exit non-zero."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0

    def check(self, ok: bool, what: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)


def log(rank: int, text: str = "") -> None:
    if rank == 0:
        print(text, flush=True)


def show(rank: int, tensor: st.ShardedTensor) -> None:
    """``visualize_sharding``, indented under the current step."""
    text = st.visualize_sharding(tensor, file=io.StringIO())
    log(rank, "\n".join("      " + line for line in text.splitlines()))


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3f} MiB"


def local_bytes(tensors: dict[str, st.ShardedTensor]) -> int:
    return sum(s.tensor.numel() * s.tensor.element_size() for t in tensors.values() for s in t.local_shards())


def min_bytes_received(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, rank: int, element_size: int) -> int:
    """Bytes ``rank`` must receive to go from ``src`` to ``dst``: its new blocks minus what it already holds."""
    total = 0
    for _, shard in dst.shards_on(rank):
        need = shard.numel
        for held in (s for s in src.shards if s.rank == rank):
            overlap = 1
            for o1, n1, o2, n2 in zip(shard.offsets, shard.dims, held.offsets, held.dims):
                overlap *= max(0, min(o1 + n1, o2 + n2) - max(o1, o2))
            need -= overlap
        total += need
    return total * element_size


def all_ranks(value: int, device: torch.device) -> list[int]:
    """``value`` from every rank, in rank order."""
    gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([value], dtype=torch.int64, device=device))
    return [int(t.item()) for t in gathered]


# -- the job on every rank ---------------------------------------------------------------------


def run_rank(args: argparse.Namespace) -> int:
    """The SPMD part, run by every rank under torchrun. Returns the exit code."""
    use_cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        return _job(args, use_cuda)
    finally:
        dist.destroy_process_group()


def _job(args: argparse.Namespace, use_cuda: bool) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    devices = [f"rank:{r}/cuda:{r % per_host}" if use_cuda else f"rank:{r}/cpu" for r in range(world)]
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    checks = Checks()
    backend = dist.get_backend()
    log(rank, f"shardkit demo: {world} ranks, backend {backend}, device {device.type}")

    # 1. Declare the layout: one spec per parameter.
    torch.manual_seed(args.seed)
    reference = MLP()  # the weights to shard; rank 0's copy is the source of truth
    names = [name for name, _ in reference.named_parameters()]
    spec_a = first_spec(devices).resolve(names)
    spec_b = second_spec(devices).resolve(names)
    full_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    log(rank, f"\n[1] composite spec for {len(names)} parameters ({mib(full_bytes)} in full)")
    for name, p in reference.named_parameters():
        layout = spec_a[name].build_metadata(tuple(p.shape), world_size=world)
        log(rank, f"    {name:12} {str(tuple(p.shape)):11} -> "
                  + ", ".join(f"r{s.rank}:{s.dims}" for s in layout.shards))

    # 2. Shard from rank 0: each rank receives only its shards.
    start = time.perf_counter()
    with st.CommCounter() as comm:
        weights = {name: st.shard_tensor(p.detach().to(device) if rank == 0 else None, spec_a[name])
                   for name, p in reference.named_parameters()}
    elapsed = time.perf_counter() - start
    held = all_ranks(local_bytes(weights), device)
    log(rank, f"\n[2] shard_tensor from rank 0: {elapsed:.3f} s, rank 0 sent {mib(comm.bytes_by_op['send/recv'])}")
    for r, nbytes in enumerate(held):
        log(rank, f"    rank {r} holds {mib(nbytes)} ({100 * nbytes / full_bytes:.0f}% of the model)")
    log(rank, "    fc1.weight:")
    show(rank, weights["fc1.weight"])
    checks.check(rank != 0 or comm.bytes_by_op["send/recv"] == sum(held) - held[0],
                 "rank 0 sent exactly the bytes of the other ranks' shards")

    # 3. Reshard every weight to the second layout and count the bytes.
    expected = sum(min_bytes_received(t.sharding_metadata(),
                                      spec_b[name].build_metadata(tuple(t.shape), t.dtype, world_size=world),
                                      rank, t.dtype.itemsize)
                   for name, t in weights.items())
    start = time.perf_counter()
    with st.CommCounter() as comm:
        for name, t in weights.items():
            t.reshard(spec_b[name])
    elapsed = time.perf_counter() - start
    sent = all_ranks(comm.bytes_sent, device)
    minimum = all_ranks(expected, device)
    log(rank, f"\n[3] reshard to a second layout: {elapsed:.3f} s")
    for r in range(world):
        log(rank, f"    rank {r} sent {mib(sent[r])}")
    log(rank, f"    all ranks together sent {mib(sum(sent))}; the layouts require at least {mib(sum(minimum))}")
    checks.check(sum(sent) == sum(minimum), "reshard moved exactly the minimum number of bytes")
    log(rank, "    fc1.weight:")
    show(rank, weights["fc1.weight"])

    # 4. Gather on rank 0 and compare with the original weights.
    start = time.perf_counter()
    gathered = {name: t.gather(dst=0) for name, t in weights.items()}
    elapsed = time.perf_counter() - start
    if rank == 0:
        for name, p in reference.named_parameters():
            checks.check(torch.equal(gathered[name].cpu(), p.detach()), f"gathered {name} equals the original")
    log(rank, f"\n[4] gather on rank 0: {elapsed:.3f} s; every weight compared bit for bit with the original")

    failed = all_ranks(len(checks.failed), device)
    if rank == 0:
        for what in checks.failed:
            print(f"FAILED: {what}", flush=True)
        status = "all checks passed" if sum(failed) == 0 else f"{sum(failed)} checks failed"
        print(f"\n{status} ({checks.passed} passed on rank 0)", flush=True)
    return 0 if sum(failed) == 0 else 1


# -- the driver ---------------------------------------------------------------------------------


def drive(args: argparse.Namespace) -> int:
    """Launch the job under torchrun and return its exit code."""
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        print(f"--device cuda needs {args.nproc} GPUs, found {torch.cuda.device_count()}; "
              f"pass --nproc {max(torch.cuda.device_count(), 1)} or use --device cpu.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               str(Path(__file__).resolve()), "--out", str(args.out),
               "--device", args.device, "--seed", str(args.seed)]
    print(f"$ torchrun --standalone --nproc-per-node {args.nproc} scripts/demo.py --device {args.device}", flush=True)
    start = time.perf_counter()
    code = subprocess.run(command, env=env, cwd=ROOT, check=False).returncode
    print(f"torchrun finished in {time.perf_counter() - start:.1f} s with exit code {code}", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_rank(args)
    return drive(args)


if __name__ == "__main__":
    raise SystemExit(main())
