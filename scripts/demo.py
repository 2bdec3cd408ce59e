"""shardkit demo: train a sharded model, checkpoint it, resume it on fewer ranks, export it.

Run it with ``./scripts/demo.sh`` (4 CPU processes, Gloo), or directly:

    python scripts/demo.py [--nproc 4] [--out out/demo] [--device cpu|cuda] [--steps 5]

This script is its own driver: started without torchrun's environment, it runs

0. a single-process reference: the same small language model, unsharded, trained with plain
   PyTorch for 2 x ``--steps`` steps;
1. ``torchrun`` with ``--nproc`` ranks: declare a composite spec (one spec per parameter),
   shard the model straight from the meta device, train ``--steps`` steps while a
   ``CheckpointManager`` saves a sharded checkpoint (model, optimizer state, step) every few
   steps in the background, keeping the last two;
2. ``torchrun`` with half as many ranks and another spec: resume from the manager's latest
   step in the new layout, train ``--steps`` more steps, collect the full state_dict on rank 0, save the
   model's weights as a sharded checkpoint;
3. offline, in one process: consolidate those weights into a Hugging Face style safetensors
   folder and load it into a plain PyTorch model.

Every stage is checked against the reference (losses, weights, logits); any failed check
makes the demo exit non-zero. ``--device cuda`` runs the ranks on GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import checkpoint
import sharded_tensor as st
from sharding import CompositeShardingSpec, composite, single_split

ROOT = Path(__file__).resolve().parent.parent

VOCAB, DIM, HIDDEN, LAYERS = 512, 64, 256, 2
BATCH, SEQ = 16, 32
LR, MOMENTUM = 0.5, 0.9
LOSS_TOL = 1e-4    # absolute, on losses around 1..7
WEIGHT_TOL = 1e-4  # absolute, on every weight


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4,
                        help="ranks of the first run; the second uses half (default: 4)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "demo",
                        help="folder for checkpoints and the exported model (default: out/demo)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: Gloo on CPU processes; cuda: NCCL, one GPU per rank (default: cpu)")
    parser.add_argument("--steps", type=int, default=5, help="training steps in each run (default: 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    # One stage at a time, for launchers of its own (scripts/multihost.sh): "reference" and
    # "export" in one process, "train" and "resume" on every rank under torchrun.
    parser.add_argument("--phase", choices=("reference", "train", "resume", "export"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.steps < 1:
        parser.error("--nproc and --steps must be at least 1")
    return args


# -- the model and the data ---------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """A small next-token model: embedding, MLP blocks, layer norm, output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int, seed: int) -> torch.Tensor:
    """Sequences that count up by 7 modulo the vocabulary from a random start: learnable."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    return (start + 7 * torch.arange(SEQ + 1)) % VOCAB


def train_step(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def first_spec(ranks: list[str]) -> CompositeShardingSpec:
    """Megatron-style: embedding dim split, MLPs split out then in, output split on the vocabulary."""
    rows, cols = single_split(0, ranks), single_split(1, ranks)
    block = composite(fc1=rows, fc2=composite(weight=cols))  # fc2.bias and the norms: whole on every rank
    return composite(embed=cols, head=rows, **{f"blocks.{i}": block for i in range(LAYERS)})


def second_spec(ranks: list[str]) -> CompositeShardingSpec:
    """Every split turned around, and the vocabulary split unevenly."""
    n = len(ranks)
    small = VOCAB // (2 * n)
    vocab_rows = single_split(0, ranks, shard_sizes=[VOCAB - small * (n - 1)] + [small] * (n - 1))
    rows, cols = single_split(0, ranks), single_split(1, ranks)
    block = composite(fc1=composite(weight=cols), fc2=rows)
    return composite(embed=vocab_rows, head=composite(weight=cols), **{f"blocks.{i}": block for i in range(LAYERS)})


# -- reporting and checks ---------------------------------------------------------------------------


class Report:
    """Prints on rank 0 and keeps the result of every check."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.failed: list[str] = []
        self.passed = 0

    def say(self, text: str = "") -> None:
        if self.rank == 0:
            print(text, flush=True)

    def check(self, ok: bool, what: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
        self.say(f"    check: {what}: {'ok' if ok else 'FAILED'}")

    def table(self, text: str) -> None:
        self.say("\n".join("      " + line for line in text.splitlines()))


def kib(nbytes: float) -> str:
    return f"{nbytes / 1024:.1f} KiB"


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in b)


# -- 0. the reference, in one process ------------------------------------------------------------


def initial_weights(seed: int) -> dict[str, torch.Tensor]:
    """The model's initial weights: built on meta and initialized by shard_model in a world of one.

    The values depend only on the seed and the parameter names, so they are the ones every
    sharded run starts from, whatever its spec and world size.
    """
    with torch.device("meta"):
        model = TinyLM()
    st.shard_model(model, composite(), seed=seed)  # nothing split: every parameter whole
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def run_reference(args: argparse.Namespace) -> None:
    """Train the unsharded model with plain PyTorch; save its losses and final weights."""
    model = TinyLM()
    model.load_state_dict(initial_weights(args.seed))
    optim = make_optimizer(model)
    start = time.perf_counter()
    losses = [train_step(model, optim, batch(step, args.seed)) for step in range(2 * args.steps)]
    elapsed = time.perf_counter() - start
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out / "reference.safetensors")
    (args.out / "reference.json").write_text(json.dumps({"losses": losses}))
    print(f"[0] reference: the unsharded model trained {2 * args.steps} steps in one process in {elapsed:.2f} s; "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)


# -- 1. and 2. the sharded runs, under torchrun -------------------------------------------------------


def run_rank(args: argparse.Namespace) -> int:
    """Every rank runs this under torchrun. Returns the exit code."""
    use_cuda = args.device == "cuda"
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        ranks = [f"rank:{r}/cuda:{r % per_host}" if use_cuda else f"rank:{r}/cpu" for r in range(world)]
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        report = Report(rank)
        reference = json.loads((args.out / "reference.json").read_text())["losses"]
        if args.phase == "train":
            train_phase(args, report, ranks, device, reference)
        else:
            resume_phase(args, report, ranks, device, reference)
        failures = [0] * world
        dist.all_gather_object(failures, len(report.failed))
        # Every rank is past its last collective before any rank tears its group down, so no
        # rank's transport sees a peer vanish mid-exchange.
        dist.barrier()
        return 0 if sum(failures) == 0 else 1
    finally:
        dist.destroy_process_group()


def all_ints(value: int) -> list[int]:
    values = [0] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def build_sharded(report: Report, spec: CompositeShardingSpec, seed: int, label: str) -> nn.Module:
    """Shard a meta-device model and print what each rank holds."""
    with torch.device("meta"):
        model = TinyLM()  # no memory allocated: shapes only
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    _, elapsed = timed(lambda: st.shard_model(model, spec, seed=seed))
    held = all_ints(sum(p.numel() * p.element_size() for p in model.parameters()))
    report.say(f"    {label} in {elapsed:.2f} s; the full model is {kib(full_bytes)}, never allocated on any rank")
    for r, nbytes in enumerate(held):
        report.say(f"    rank {r} holds {kib(nbytes)} ({100 * nbytes / full_bytes:.0f}% of the model)")
    return model


def describe_spec(report: Report, model: nn.Module) -> None:
    """One line per parameter: global size and the local shape on each rank."""
    for name, value in model.state_dict().items():
        if isinstance(value, st.ShardedTensor):
            shards = value.sharding_metadata().shards
            where = "split " + ", ".join(f"r{s.rank}:{s.dims}" for s in shards)
        else:
            where = "whole on every rank"
        report.say(f"    {name:22} {str(tuple(value.shape)):10} {where}")


def train(args: argparse.Namespace, report: Report, model: nn.Module, optim: torch.optim.Optimizer,
          device: torch.device, first: int, reference: list[float],
          after_step: Callable[[int], None] | None = None) -> None:
    """Train steps ``first .. first + steps - 1`` and compare every loss with the reference."""
    worst = 0.0
    for step in range(first, first + args.steps):
        tokens = batch(step, args.seed).to(device)
        with st.CommCounter() as comm:
            loss, elapsed = timed(lambda: train_step(model, optim, tokens))
        assert isinstance(loss, float)
        worst = max(worst, abs(loss - reference[step]))
        ops = ", ".join(f"{n} {op}" for op, n in sorted(comm.counts.items()))
        report.say(f"    step {step}: loss {loss:.4f} (reference {reference[step]:.4f}) in {elapsed * 1000:.0f} ms; "
                   f"rank 0 sent {kib(comm.bytes_sent)} in {ops}")
        if after_step is not None:
            after_step(step)
    report.check(worst <= LOSS_TOL, f"losses match the reference within {LOSS_TOL} (largest difference {worst:.1e})")


def train_phase(args: argparse.Namespace, report: Report, ranks: list[str], device: torch.device,
                reference: list[float]) -> None:
    world = len(ranks)
    report.say(f"\n[1] a composite spec: one spec per parameter, over {world} ranks ({dist.get_backend()})")
    model = build_sharded(report, first_spec(ranks), args.seed, "shard_model from the meta device")
    describe_spec(report, model)
    report.say("    blocks.0.fc1.weight:")
    report.table(st.visualize_sharding(model.state_dict()["blocks.0.fc1.weight"], file=io.StringIO()))

    every = max(1, args.steps // 2)
    report.say(f"\n[2] train {args.steps} steps with torch.optim.SGD on the local shards; every {every} "
               f"step(s) a CheckpointManager saves (model, optimizer state, step) in the background")
    optim = make_optimizer(model)
    root = args.out / "checkpoints"
    manager = checkpoint.CheckpointManager(str(root), keep_last=2)
    blocked: list[float] = []

    def save_every(step: int) -> None:
        done = step + 1
        if done % every == 0 or done == args.steps:
            state = {**st.get_state_dict(model, optim), "step": done}
            _, seconds = timed(lambda: manager.save(done, state, async_=True))
            blocked.append(seconds)

    train(args, report, model, optim, device, 0, reference, after_step=save_every)
    _, waited = timed(manager.wait)

    path = root / f"step-{args.steps:010d}"
    report.say(f"\n[3] the manager's checkpoints under {root}: steps {manager.steps()} (keep_last=2)")
    report.say(f"    each save held training for {max(blocked) * 1000:.0f} ms at most (the snapshot); "
               f"the last one finished writing {waited:.2f} s after training ended")
    report.check(manager.latest_step() == args.steps, "the latest committed step is the last one trained")
    meta = checkpoint.read_metadata(str(path))
    report.say(f"    step {args.steps}: {len(meta.tensors)} tensors, {kib(meta.nbytes)} of data, "
               f"one file per rank (replicated tensors written once):")
    for name, nbytes in sorted(meta.files.items()):
        report.say(f"      {name}  {kib(nbytes)}")
    report.check(meta.values.get("step") == args.steps, "the checkpoint records the step")


def resume_phase(args: argparse.Namespace, report: Report, ranks: list[str], device: torch.device,
                 reference: list[float]) -> None:
    world = len(ranks)
    report.say(f"\n[4] restart on {world} ranks with another spec")
    model = build_sharded(report, second_spec(ranks), args.seed + 1, "shard_model from the meta device")
    describe_spec(report, model)
    report.say("    blocks.0.fc1.weight, now split on its other dimension:")
    report.table(st.visualize_sharding(model.state_dict()["blocks.0.fc1.weight"], file=io.StringIO()))

    manager = checkpoint.CheckpointManager(str(args.out / "checkpoints"), keep_last=2)
    latest = manager.latest_step()
    path = args.out / "checkpoints" / f"step-{latest:010d}"
    report.say(f"\n[5] resume from the manager's latest step ({latest}), saved by "
               f"{checkpoint.read_metadata(str(path)).world_size} ranks, into the new layout")
    optim = make_optimizer(model)
    state = {**st.get_state_dict(model, optim), "step": 0}
    dist.barrier()
    with st.CommCounter() as comm:
        _, elapsed = timed(lambda: manager.load(state))
        st.set_state_dict(model, optim, state)
    report.say(f"    loaded in {elapsed:.2f} s: each rank read only the byte ranges of its own blocks; "
               f"shards exchanged between ranks: {kib(comm.bytes_by_op['send/recv'])}")
    report.check(state["step"] == args.steps, f"training resumes at step {args.steps}")

    report.say(f"\n[6] train {args.steps} more steps")
    train(args, report, model, optim, device, args.steps, reference)

    report.say("\n[7] collect the full state_dict on rank 0")
    dist.barrier()
    full, elapsed = timed(lambda: checkpoint.collect_state_dict(model.state_dict()))
    if report.rank == 0:
        assert isinstance(full, dict)
        expected = load_file(args.out / "reference.safetensors")
        diff = max_diff(full, expected)
        report.say(f"    {len(full)} full CPU tensors on rank 0 in {elapsed:.2f} s; largest difference from the "
                   f"reference after {2 * args.steps} steps: {diff:.2e}")
        report.check(sorted(full) == sorted(expected) and diff <= WEIGHT_TOL,
                     f"collected weights match the single-process reference within {WEIGHT_TOL}")

    path = args.out / "model"
    report.say(f"\n[8] save the trained weights as a sharded checkpoint to {path}")
    dist.barrier()
    _, elapsed = timed(lambda: checkpoint.save(model.state_dict(), str(path), quiet=True))
    report.say(f"    saved in {elapsed:.2f} s")


# -- 3. offline export, and the driver ---------------------------------------------------------------


def export(args: argparse.Namespace, report: Report) -> None:
    """Consolidate the sharded weights into a Hugging Face style folder and check it."""
    source, output = args.out / "model", args.out / "hf-model"
    report.say(f"\n[9] consolidate {source} into a Hugging Face style folder {output} (one process, streaming)")
    _, elapsed = timed(lambda: checkpoint.consolidate(str(source), str(output), max_shard_size="256KB", quiet=True))
    index = json.loads((output / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    report.say(f"    {len(index['weight_map'])} tensors in {len(files)} files in {elapsed:.2f} s:")
    for name in files:
        report.say(f"      {name}  {kib((output / name).stat().st_size)}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(output / name))
    expected = load_file(args.out / "reference.safetensors")
    diff = max_diff(weights, expected)
    report.check(sorted(weights) == sorted(expected) and diff <= WEIGHT_TOL,
                 f"exported weights match the reference within {WEIGHT_TOL} (largest difference {diff:.2e})")

    plain, reference_model = TinyLM(), TinyLM()
    plain.load_state_dict(weights)
    reference_model.load_state_dict(expected)
    tokens = batch(10_000, args.seed)
    with torch.no_grad():
        diff = (plain(tokens) - reference_model(tokens)).abs().max().item()
    report.check(diff <= 1e-3, f"a plain TinyLM loaded from the export computes the reference's logits "
                               f"(largest difference {diff:.2e})")


def launch(args: argparse.Namespace, nproc: int, phase: str) -> int:
    """Run this script's ``phase`` on ``nproc`` ranks with torchrun; returns its exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(Path(__file__).resolve()), "--phase", phase, "--out", str(args.out), "--device", args.device,
               "--steps", str(args.steps), "--seed", str(args.seed)]
    print(f"\n$ torchrun --standalone --nproc-per-node {nproc} scripts/demo.py --phase {phase}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    code = subprocess.run(command, env=env, cwd=ROOT, check=False).returncode
    print(f"(torchrun with {nproc} ranks: {time.perf_counter() - start:.1f} s, exit code {code})", flush=True)
    return code


def drive(args: argparse.Namespace) -> int:
    first, second = args.nproc, max(1, args.nproc // 2)
    if args.device == "cuda" and torch.cuda.device_count() < first:
        print(f"--device cuda needs {first} GPUs, found {torch.cuda.device_count()}; pass "
              f"--nproc {max(torch.cuda.device_count(), 1)} or use --device cpu.", file=sys.stderr)
        return 2
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    # A fresh run: the train phase must not resume from the steps of an earlier demo.
    shutil.rmtree(args.out / "checkpoints", ignore_errors=True)
    print(f"shardkit demo: {first} ranks, then {second}, on {args.device}; output in {args.out}", flush=True)
    run_reference(args)
    for nproc, phase in ((first, "train"), (second, "resume")):
        code = launch(args, nproc, phase)
        if code != 0:
            print(f"\nthe {phase} run failed (exit code {code}); see its output above.", flush=True)
            return code
    report = Report()
    export(args, report)
    elapsed = time.perf_counter() - start
    if report.failed:
        print(f"\n{len(report.failed)} checks failed:\n" + "\n".join(f"  {f}" for f in report.failed), flush=True)
        return 1
    print(f"\nall checks passed; the whole demo took {elapsed:.0f} s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    if args.phase is None:
        return drive(args)
    if args.phase == "reference":
        args.out.mkdir(parents=True, exist_ok=True)
        run_reference(args)
        return 0
    if args.phase == "export":
        report = Report()
        export(args, report)
        return 1 if report.failed else 0
    return run_rank(args)


if __name__ == "__main__":
    raise SystemExit(main())
