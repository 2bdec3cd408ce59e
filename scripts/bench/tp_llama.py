"""Tensor-parallel training of a transformers Llama: shardkit, DTensor's parallelize_module, and by hand.

Three sides shard the same model the same way on 2 Gloo ranks (q/k/v/gate/up split on output
features, o/down on input features, the rest replicated) and run the same training steps
(forward with labels, backward, AdamW) in the same processes, in turn (each side first in
every third step), so the ratios compare like with like on a shared machine:

* ``shardkit``: ``st.shard_model`` with a composite spec;
* ``dtensor``: ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``;
* ``plain``, the floor: no framework. Each rank builds an ordinary Llama with its share of
  the heads and of the MLP's width, loads its slices of the weights, and two tiny autograd
  functions are hooked in (identity forward, all-reduce backward on the input of attention
  and of the MLP; all-reduce forward, identity backward on o_proj's and down_proj's output):
  the fewest ops and collectives this plan allows.

With ``--local-floor`` a fourth side, ``local``, steps in turn with the others (each side
first in every fourth step): plain's model with no collectives at all (no marks hooked in;
under ``--plan full`` the embedding, the vocabulary-parallel loss and the mark on
``lm_head``'s input do their local work and skip the all-reduces). Each rank then sums only
its own heads and MLP columns, so its losses mean nothing and are reported apart, marked
not comparable; but its step is the compute one rank must do under any tensor-parallel plan
of this split. If local/DTensor is above the goal (0.85x eager, 0.9x compiled), no plan of
this split reaches it, whatever it overlaps or fuses; ``1 - local/plain`` is the share of
plain's step that communication (and waiting for the other rank) takes.

Reported per side: collectives of one forward and of one backward (shardkit's
``CommCounter`` with bytes; ``CommDebugMode`` for DTensor, which counts calls; plain counts
its own calls), the median step time of the slowest rank with its range, the CPU seconds of
a step (both ranks; steadier than wall time on a loaded machine), the bytes each rank writes
during a step (its sockets' traffic: 0 for local), the ratios between every pair of sides,
and the first and last losses of the three real sides, which must agree (``loss_spread``:
the largest difference between them). The figures are checked before they are trusted: if
the real sides' losses differ by more than 1e-4 of the loss, a real side wrote no bytes in a
step, or local wrote some, the report lists it under ``problems`` and the bench exits with
an error after printing it.

    python scripts/bench/tp_llama.py                  # hidden 1024, 4 layers, 16 heads, seq 256, batch 4
    python scripts/bench/tp_llama.py --hidden 256 --seq 64 --steps 3   # a quick look
    python scripts/bench/tp_llama.py --compile --steps 6   # every side under torch.compile (inductor)
    python scripts/bench/tp_llama.py --plan full           # the vocabulary split too, loss_parallel
    python scripts/bench/tp_llama.py --local-floor         # and the compute-only floor (any of the above)
    python scripts/bench/tp_llama.py --replica-check       # and the cost of the check of replicated parameters

With ``--replica-check`` the check shardkit runs after each optimizer step of a sharded model
(a CRC-32C of every parameter held whole on every rank, gathered over the ranks; see
``sharded_tensor/_model/drift.py``) is timed on its own after each shardkit step: the ranks
meet at a barrier, then each runs the check once more and times it (wall and CPU). Reported
under ``replica_check``: its median time per step and range, the bytes it reads per rank, and
its share of shardkit's median step time (the goal: at most 1%). shardkit's own step includes
one such check in every mode.

With ``--compile`` the models are wrapped in ``torch.compile`` (inductor) after sharding; one
untimed step per side compiles forward and backward (its time is reported as
``compile_seconds``), and the graph breaks dynamo recorded on each side are reported. The
collectives are not counted then: the compiled graphs run them outside the counters (the
bytes written per step still show each side's traffic).

``--plan full`` splits the embedding and ``lm_head`` on the vocabulary and computes the loss
on the split logits, each side at its best: shardkit ``st.tensor_parallel_spec`` with the
model's own loss inside ``st.loss_parallel()``; DTensor as torchtitan does
(``RowwiseParallel(input_layouts=Replicate())`` for the embedding,
``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` for ``lm_head``,
``F.cross_entropy`` inside ``loss_parallel()``); plain by hand (a vocabulary-split embedding
and a vocabulary-parallel cross entropy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# After the repository root: bench/checkpoint.py is not the package.
sys.path.append(str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _harness import launch, llama_tp_names, machine, wire_bytes  # noqa: E402

SIDES = ("shardkit", "dtensor", "plain")  # the real sides: the same model, the same losses
LOCAL = "local"  # opt-in (--local-floor): plain without its collectives, the compute floor
GOAL = {False: 0.85, True: 0.9}  # shardkit's step over DTensor's to reach, eager and compiled


def _sides(args: Any) -> tuple[str, ...]:
    return (*SIDES, LOCAL) if args.local_floor else SIDES


def _config(args: Any) -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads, max_position_embeddings=args.seq, use_cache=False,
                       attn_implementation="sdpa")


def _shardkit(model: Any, world: int, layers: int, plan: str) -> Any:
    import sharded_tensor as st
    from sharding import composite, single_split
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    if plan == "full":
        return st.shard_model(model, st.tensor_parallel_spec(model, ranks))
    cols, rows = llama_tp_names(layers)
    spec = composite(**{n: single_split(0, ranks) for n in cols}, **{n: single_split(1, ranks) for n in rows})
    return st.shard_model(model, spec)


def _dtensor(model: Any, world: int, layers: int, plan: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (world,))
    cols, rows = llama_tp_names(layers)
    styles = {**{n: ColwiseParallel() for n in cols}, **{n: RowwiseParallel() for n in rows}}
    if plan == "full":  # as torchtitan does: the vocabulary split, the logits left split for loss_parallel
        styles["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
        styles["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, styles)
    return model


# -- the floor: tensor parallel by hand, no framework ----------------------------------------------
# Each rank builds an ordinary Llama with its share of the heads and of the MLP's width, loads
# its slices of the weights, and marks the two places where ranks meet: the input of each
# column-parallel group (identity forward, gradient summed in backward) and the output of each
# row-parallel projection (summed in forward, identity backward). One all-reduce per group and
# direction: the fewest ops and collectives this plan allows.

_PLAIN_CALLS: dict[str, int] = {}


def _sum_over_ranks(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    if torch.compiler.is_compiling():
        from torch.distributed import _functional_collectives as funcol
        return funcol.wait_tensor(funcol.all_reduce(x, op, torch.distributed.group.WORLD))
    reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
    torch.distributed.all_reduce(x, op=reduce_op)
    _PLAIN_CALLS["all_reduce"] = _PLAIN_CALLS.get("all_reduce", 0) + 1
    return x


class _EnterParallel(torch.autograd.Function):
    """Identity forward; the gradient (a partial sum on each rank) summed over the ranks in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _sum_over_ranks(grad.contiguous())


class _LeaveParallel(torch.autograd.Function):
    """Partial sums added over the ranks in forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            ctx.mark_dirty(x)  # summed in place: the projection's fresh output, saved by no backward
        return _sum_over_ranks(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _enter_kwarg(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    kwargs["hidden_states"] = _EnterParallel.apply(kwargs["hidden_states"])
    return args, kwargs


def _enter_arg(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (_EnterParallel.apply(args[0]), *args[1:])


def _leave(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    return _LeaveParallel.apply(output)


class _VocabEmbedding(torch.nn.Module):
    """This rank's rows of the embedding: ids outside them look up zeros; the ranks' rows are summed."""

    def __init__(self, weight: torch.Tensor, start: int, collectives: bool = True) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.start = start
        self.collectives = collectives

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.size(0))
        rows = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return _LeaveParallel.apply(rows) if self.collectives else rows


class _VocabParallelLoss(torch.autograd.Function):
    """Mean cross entropy of logits split on the vocabulary: three all-reduces of one number per row.

    Without ``collectives`` (the local floor) the same local work, each rank's rows unreduced.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int,
                collectives: bool = True) -> torch.Tensor:
        def reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
            return _sum_over_ranks(x, op) if collectives else x

        width = logits.size(-1)
        top = reduce(logits.detach().max(-1).values, "max")
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = reduce(exp.sum(-1))
        local = target - start
        mine = (local >= 0) & (local < width)
        index = local.clamp(0, width - 1).unsqueeze(-1)
        picked = reduce(shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0))
        valid = target != -100
        count = valid.sum()
        loss = ((total.log() - picked) * valid).sum() / count
        softmax = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine, valid, count)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, index, mine, valid, count = ctx.saved_tensors
        out = softmax.scatter_add(-1, index, -mine.unsqueeze(-1).to(softmax.dtype))
        return out * (valid.unsqueeze(-1) * (grad / count)), None, None, None


def _plain_full_loss(model: Any, batch: torch.Tensor, collectives: bool = True) -> torch.Tensor:
    """The plain model's loss with the vocabulary split: the causal shift of transformers' loss, by hand."""
    hidden = model.model(input_ids=batch).last_hidden_state
    logits = model.lm_head(_EnterParallel.apply(hidden) if collectives else hidden)
    target = torch.nn.functional.pad(batch, (0, 1), value=-100)[:, 1:]
    return _VocabParallelLoss.apply(logits.flatten(0, 1), target.flatten(), model.vocab_start, collectives)


def _plain(base: Any, config: Any, rank: int, world: int, layers: int, plan: str = "standard",
           collectives: bool = True) -> Any:
    """An ordinary Llama holding this rank's heads and MLP columns, with the two marks hooked in.

    Without ``collectives``, the local floor: the same local model and weights, no marks (each
    would be an identity), no all-reduce anywhere.
    """
    import copy

    from transformers import LlamaForCausalLM
    local = copy.deepcopy(config)
    local.head_dim = config.hidden_size // config.num_attention_heads
    local.num_attention_heads //= world
    local.num_key_value_heads //= world
    local.intermediate_size //= world
    model = LlamaForCausalLM(local) if collectives else _local_llama(local)
    cols, rows = llama_tp_names(layers)
    state = {}
    for name, value in base.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in cols:
            value = value.chunk(world, 0)[rank]
        elif module in rows:
            value = value.chunk(world, 1)[rank]
        state[name] = value.clone()
    model.load_state_dict(state)
    for layer in model.model.layers if collectives else ():
        layer.self_attn.register_forward_pre_hook(_enter_kwarg, with_kwargs=True)
        layer.mlp.register_forward_pre_hook(_enter_arg)
        layer.self_attn.o_proj.register_forward_hook(_leave)
        layer.mlp.down_proj.register_forward_hook(_leave)
    if plan == "full":
        rows = config.vocab_size // world
        model.vocab_start = rank * rows
        model.model.embed_tokens = _VocabEmbedding(state["model.embed_tokens.weight"].chunk(world, 0)[rank].clone(),
                                                   rank * rows, collectives)
        model.lm_head = torch.nn.Linear(config.hidden_size, rows, bias=False)
        with torch.no_grad():
            model.lm_head.weight.copy_(state["lm_head.weight"].chunk(world, 0)[rank])
    return model


def _local_llama(config: Any) -> Any:
    """The local floor's model: a Llama whose forward is a code object of its own.

    ``torch.compile`` caches graphs on the code of the forward it enters, and dynamo does not
    guard on the hooks of submodules (``skip_nnmodule_hook_guards``): were the local model a
    plain ``LlamaForCausalLM``, the compiled plain model (the same class and shapes, only its
    layers' hooks differ) would run the local model's graph, without its all-reduces. The
    class name ends in ``ForCausalLM``: transformers picks the loss from it (a name it does not
    recognise logs a warning, a graph break under dynamo).
    """
    from transformers import LlamaForCausalLM

    class LocalLlamaForCausalLM(LlamaForCausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

    return LocalLlamaForCausalLM(config)


def _loss(side: str, plan: str, model: Any, batch: torch.Tensor) -> torch.Tensor:
    """The loss of one forward; under ``--plan full`` call it (and ``backward``) inside ``_loss_scope``."""
    if plan == "standard" or side == "shardkit":  # shardkit's loss in the forward takes the split logits
        return model(batch, labels=batch).loss  # type: ignore[no-any-return]
    if side in ("plain", LOCAL):
        return _plain_full_loss(model, batch, collectives=side == "plain")
    logits = model(batch).logits
    target = torch.nn.functional.pad(batch, (0, 1), value=-100)[:, 1:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def _loss_scope(side: str, plan: str) -> Any:
    """Where logits stay split on the vocabulary: shardkit's and DTensor's ``loss_parallel``."""
    import contextlib
    if plan == "full" and side == "shardkit":
        import sharded_tensor as st
        return st.loss_parallel()
    if plan == "full" and side == "dtensor":
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()
    return contextlib.nullcontext()


def _comm_dtensor(fn: Any) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode
    with CommDebugMode() as debug:
        fn()
    return {str(op).split(".")[-1]: n for op, n in debug.get_comm_counts().items()}


def _rank(rank: int, world: int, args: Any) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    config = _config(args)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    models = {}
    for side, shard in (("shardkit", _shardkit), ("dtensor", _dtensor)):
        m = LlamaForCausalLM(config)
        m.load_state_dict(base.state_dict())
        models[side] = shard(m, world, args.layers, args.plan)
    models["plain"] = _plain(base, config, rank, world, args.layers, args.plan)
    if args.local_floor:
        models[LOCAL] = _plain(base, config, rank, world, args.layers, args.plan, collectives=False)
    del base
    if args.compile:
        models = {side: torch.compile(m) for side, m in models.items()}
    opts = {side: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False) for side, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
               for _ in range(args.steps + 1)]
    out: dict[str, Any] = {}
    if args.compile:
        out.update(_compile_warmup(models, opts, batches[0], args.plan))
    else:
        out.update(_count_collectives(models, batches[0], args.plan))
    # Training steps, alternating sides.
    sides = _sides(args)
    times: dict[str, list[float]] = {side: [] for side in sides}
    losses: dict[str, list[float]] = {side: [] for side in sides}
    # CPU seconds of this process (Gloo's threads included): what a step costs whatever else
    # competes for the cores, a steadier figure than wall time on a loaded machine.
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    # Bytes this process writes during a step: its sockets' traffic (the step writes no file),
    # which shows, compiled too, that the local side sends nothing.
    written: dict[str, list[int]] = {side: [] for side in sides}
    checks: list[float] = []
    check_cpu: list[float] = []
    for step, batch in enumerate(batches[1:]):
        order = sides[step % len(sides):] + sides[:step % len(sides)]  # each side first in turn
        for side in order:
            model, opt = models[side], opts[side]
            torch.distributed.barrier()
            t0, c0, w0 = time.perf_counter(), time.process_time(), wire_bytes()
            opt.zero_grad()
            with _loss_scope(side, args.plan):
                loss = _loss(side, args.plan, model, batch)
                loss.backward()
            opt.step()
            elapsed = time.perf_counter() - t0
            times[side].append(elapsed)
            cpu[side].append(time.process_time() - c0)
            written[side].append(wire_bytes() - w0)
            losses[side].append(float(loss.detach()))
            if side == "shardkit" and args.replica_check:
                from sharded_tensor._model import drift
                torch.distributed.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                drift._after_step(opt, (), {})
                checks.append(time.perf_counter() - t0)
                check_cpu.append(time.process_time() - c0)
    if args.replica_check:
        from sharded_tensor._model import drift
        checked = drift._plan(opts["shardkit"])
        out["replica_check"] = {"seconds": checks, "cpu_seconds": check_cpu, "parameters": len(checked),
                                "bytes": sum(p.numel() * p.element_size() for p, _ in checked)}
    out["times"] = times
    out["cpu"] = cpu
    out["written"] = written
    out["losses"] = losses
    return out


def _compile_warmup(models: dict[str, Any], opts: dict[str, Any], x: torch.Tensor, plan: str) -> dict[str, Any]:
    """One untimed step per side, which compiles forward and backward; graph breaks and the time it took."""
    from torch._dynamo.utils import counters
    out: dict[str, Any] = {"compile_seconds": {}, "graph_breaks": {}, "graphs": {}}
    for side, model in models.items():
        counters.clear()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with _loss_scope(side, plan):
            _loss(side, plan, model, x).backward()
        opts[side].zero_grad()
        out["compile_seconds"][side] = time.perf_counter() - t0
        out["graph_breaks"][side] = sum(counters["graph_break"].values())
        out["graphs"][side] = counters["stats"]["unique_graphs"]
    return out


def _count_collectives(models: dict[str, Any], x: torch.Tensor, plan: str) -> dict[str, Any]:
    """Collectives of one forward and one backward, per side."""
    import sharded_tensor as st
    out: dict[str, Any] = {}
    m = models["shardkit"]
    with _loss_scope("shardkit", plan):
        with st.CommCounter() as fwd:
            loss = _loss("shardkit", plan, m, x)
        with st.CommCounter() as bwd:
            loss.backward()
    m.zero_grad()
    out["shardkit_forward"] = {"counts": dict(fwd.counts), "bytes": dict(fwd.bytes_by_op)}
    out["shardkit_backward"] = {"counts": dict(bwd.counts), "bytes": dict(bwd.bytes_by_op)}
    m = models["dtensor"]
    holder: dict[str, Any] = {}
    with _loss_scope("dtensor", plan):
        out["dtensor_forward"] = {"counts": _comm_dtensor(
            lambda: holder.setdefault("loss", _loss("dtensor", plan, m, x)))}
        out["dtensor_backward"] = {"counts": _comm_dtensor(lambda: holder["loss"].backward())}
    m.zero_grad()
    for side in ("plain", LOCAL) if LOCAL in models else ("plain",):  # local counts its none the same way
        m = models[side]
        _PLAIN_CALLS.clear()
        loss = _loss(side, plan, m, x)
        out[f"{side}_forward"] = {"counts": dict(_PLAIN_CALLS)}
        _PLAIN_CALLS.clear()
        loss.backward()
        out[f"{side}_backward"] = {"counts": dict(_PLAIN_CALLS)}
        m.zero_grad()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="torch.compile (inductor) every side")
    parser.add_argument("--plan", choices=("standard", "full"), default="standard",
                        help="standard: embedding and lm_head whole; full: both split on the vocabulary, "
                             "the loss computed on the split logits (loss_parallel)")
    parser.add_argument("--local-floor", action="store_true",
                        help="a fourth side: plain's local model with no collectives, the compute floor of "
                             "this split (its losses are wrong by design and not compared)")
    parser.add_argument("--replica-check", action="store_true",
                        help="time the check of replicated parameters after each shardkit step, against the step")
    args = parser.parse_args()
    sides = _sides(args)
    results = launch(_rank, 2, args)
    # The slowest rank's time per step; medians and ranges over the steps.
    slowest = {side: [max(r["times"][side][i] for r in results) for i in range(args.steps)] for side in sides}
    per_side = {side: statistics.median(t) for side, t in slowest.items()}
    # CPU seconds per step: the two ranks' sum, median over the steps.
    cpu = {side: [sum(r["cpu"][side][i] for r in results) for i in range(args.steps)] for side in sides}

    def ratio(a: str, b: str) -> dict[str, Any]:
        per_step = [x / y for x, y in zip(slowest[a], slowest[b])]
        return {"median_of_medians": round(per_side[a] / per_side[b], 4),
                "per_step_median": round(statistics.median(per_step), 4),
                "per_step_range": [round(min(per_step), 4), round(max(per_step), 4)]}

    def cpu_ratio(a: str, b: str) -> dict[str, Any]:
        per_step = [x / y for x, y in zip(cpu[a], cpu[b])]
        return {"median": round(statistics.median(per_step), 4),
                "range": [round(min(per_step), 4), round(max(per_step), 4)]}

    # Every pair of sides, the nearer to the floor first; local against each of the three.
    pairs = [("shardkit", "dtensor"), ("plain", "dtensor"), ("shardkit", "plain")]
    if args.local_floor:
        pairs += [(LOCAL, other) for other in SIDES]
    r0 = results[0]
    report = {
        "benchmark": "tp_llama", "machine": machine(), "world": 2, "compile": args.compile, "plan": args.plan,
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "seq": args.seq,
                  "batch": args.batch, "vocab": args.vocab},
        "sides": list(sides),
        **({"compile_seconds": r0["compile_seconds"], "graph_breaks": [r["graph_breaks"] for r in results],
            "graphs": r0["graphs"]} if args.compile else
           {"forward_collectives": {side: r0[f"{side}_forward"] for side in sides},
            "backward_collectives": {side: r0[f"{side}_backward"] for side in sides}}),
        "step_seconds_median": per_side,
        "step_seconds_range": {side: [min(t), max(t)] for side, t in slowest.items()},
        "step_time_ratio_shardkit_over_dtensor": per_side["shardkit"] / per_side["dtensor"],
        "step_time_ratio_range": [min(a / b for a, b in zip(slowest["shardkit"], slowest["dtensor"])),
                                  max(a / b for a, b in zip(slowest["shardkit"], slowest["dtensor"]))],
        "ratios": {f"{a}/{b}": ratio(a, b) for a, b in pairs},
        "cpu_seconds_median": {side: statistics.median(c) for side, c in cpu.items()},
        "cpu_ratios": {f"{a}/{b}": cpu_ratio(a, b) for a, b in pairs},
        # Rank by rank, median over the steps.
        "bytes_written_per_step": {side: [statistics.median(r["written"][side]) for r in results] for side in sides},
        "first_loss": {side: r0["losses"][side][0] for side in SIDES},
        # After the optimizer's steps: equal too when every side's gradients are right.
        "last_loss": {side: r0["losses"][side][-1] for side in SIDES},
        "loss_spread": {key: max(r0["losses"][side][i] for side in SIDES) - min(r0["losses"][side][i] for side in SIDES)
                        for key, i in (("first", 0), ("last", -1))},
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "steps": args.steps,
    }
    if args.replica_check:
        # The slower rank's check per step, against shardkit's median step.
        check = [max(r["replica_check"]["seconds"][i] for r in results) for i in range(args.steps)]
        report["replica_check"] = {
            "parameters": r0["replica_check"]["parameters"],
            "bytes_per_rank": r0["replica_check"]["bytes"],
            "seconds_median": statistics.median(check), "seconds_range": [min(check), max(check)],
            "cpu_seconds_median": statistics.median(c for r in results for c in r["replica_check"]["cpu_seconds"]),
            "share_of_shardkit_step": statistics.median(check) / per_side["shardkit"],
            "share_range": [min(check) / per_side["shardkit"], max(check) / per_side["shardkit"]],
            "goal": 0.01,
        }
    if args.local_floor:
        report["local_floor"] = _local_floor(slowest, cpu, r0["losses"][LOCAL], GOAL[args.compile])
    report["problems"] = _problems(report)
    print(json.dumps(report, indent=2))
    if report["problems"]:
        raise SystemExit("tp_llama: the sides did not run as planned, the figures above are not valid:\n  "
                         + "\n  ".join(report["problems"]))


def _problems(report: dict[str, Any]) -> list[str]:
    """What would make the figures wrong: a side missing its collectives, or the real sides' losses apart."""
    problems = []
    for side, written in report["bytes_written_per_step"].items():
        if side == LOCAL and any(written):
            problems.append(f"the local side wrote {written} bytes per step (rank by rank); it must send nothing")
        if side != LOCAL and not all(written):
            problems.append(f"{side} wrote {written} bytes per step (rank by rank); its all-reduces did not run")
    # Equal on the three real sides up to float rounding (seen: 1e-6 after 6 AdamW steps).
    tolerance = 1e-4 * abs(report["first_loss"]["plain"])
    for key, spread in report["loss_spread"].items():
        if spread > tolerance:
            losses = report[f"{key}_loss"]
            problems.append(f"{key} losses differ by {spread:.3g} > {tolerance:.3g} between the real sides: {losses}")
    return problems


def _local_floor(slowest: dict[str, list[float]], cpu: dict[str, list[float]], losses: list[float],
                 goal: float) -> dict[str, Any]:
    """What the compute-only side says: the goal within reach of this split or not, communication's share."""
    def share(times: dict[str, list[float]]) -> dict[str, Any]:
        per_step = [1 - x / y for x, y in zip(times[LOCAL], times["plain"])]
        return {"from_medians": round(1 - statistics.median(times[LOCAL]) / statistics.median(times["plain"]), 4),
                "per_step_median": round(statistics.median(per_step), 4),
                "per_step_range": [round(min(per_step), 4), round(max(per_step), 4)]}

    over_dtensor = statistics.median([x / y for x, y in zip(slowest[LOCAL], slowest["dtensor"])])
    return {
        # 1 - local/plain: the part of the hand-written step that is collectives and waiting on
        # the other rank (wall), or the CPU the collectives burn (cpu).
        "plain_communication_share": {"wall": share(slowest), "cpu": share(cpu)},
        "goal_shardkit_over_dtensor": goal,
        "local_over_dtensor_per_step_median": round(over_dtensor, 4),
        # Above the goal, no plan of this split reaches it: local is the compute alone.
        "goal_within_reach_of_this_split": over_dtensor <= goal,
        "losses_comparable": False,
        "why": "each rank sums only its own heads and MLP columns (no all-reduce): not the model's loss",
        "first_loss": losses[0], "last_loss": losses[-1],
    }


if __name__ == "__main__":
    main()
