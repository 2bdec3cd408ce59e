"""The time shardkit's propagation engine adds per torch op, and its share of a tensor-parallel training step.

A model sharded by ``shard_model`` runs its forward under the engine
(``sharded_tensor/_model/engine``: ``dispatch.ZoneMode``, a ``TorchFunctionMode``): every torch
call the model's code makes goes through it, which reads the placements of the arguments,
takes the decision for ops on placed activations (from its cache, or from the op's rule) and
places their outputs. This bench measures what that costs, on 2 Gloo ranks, with a
transformers Llama sharded as ``tp_llama.py`` shards it (q/k/v/gate/up split on output
features, o/down on input features, the rest replicated):

* ``engine``: the sharded model's forward (with labels, as a training step calls it): the one
  eager path, every call through the engine;
* ``plain``: an unsharded Llama with this rank's local shapes (half the heads and MLP width)
  and this rank's local weights, plus the same collectives at the same places (the input of
  attention and MLP through ``copy_to_ranks``, the outputs of o/down through
  ``reduce_from_ranks``): the same local ops and communication, run without the engine.
  Its loss must equal the engine's bit for bit, or the comparison is not of one computation.
* ``floor``: the plain model under a ``TorchFunctionMode`` that only calls each op: what
  Python's dispatch to any mode costs, which the engine cannot go below.

The three run alternately, ``--iters`` forwards per measurement, ``--repeat`` times, with
gradients enabled (as in training) and under ``no_grad``. Per op: ``(engine - plain) / ops``,
``ops`` being the torch calls the model's code makes in one forward (counted by a
``TorchFunctionMode`` on the plain model, collectives aside; the engine handles all of them but
the sharded layers' own, and the number it handled is reported beside it). Times are wall and
CPU time of the calling thread (``time.thread_time``: on a shared machine it says what the
work costs whatever else competes for the cores; Gloo's own threads are not in it); medians
of the paired differences over both ranks' repeats, with their range.

With ``--tp-llama-steps N`` (default 4) the same run then runs ``tp_llama.py`` (shardkit
against DTensor, N steps) and reports the engine's share of shardkit's step: the forward
overhead measured at tp_llama's model size over its median step time.

    python scripts/bench/engine_overhead.py                       # tiny and tp_llama-sized models, then tp_llama
    python scripts/bench/engine_overhead.py --tp-llama-steps 0    # the engine alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))  # after the repository root (bench/checkpoint.py)
import torch  # noqa: E402
from _harness import launch, llama_tp_names, machine  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

# name -> (hidden, heads, kv heads, layers, seq, batch, vocab); "tp_llama" is tp_llama.py's default model.
SIZES = {"tiny": (64, 4, 2, 2, 16, 1, 128), "tp_llama": (1024, 16, 16, 4, 256, 4, 8192)}
WORLD = 2


class _PassThrough(TorchFunctionMode):
    """A mode that only calls each op: what any ``TorchFunctionMode`` costs, the engine's floor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class _Count(TorchFunctionMode):
    """Counts the torch calls made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _config(size: str, world: int) -> Any:
    from transformers import LlamaConfig
    hidden, heads, kv, layers, seq, _, vocab = SIZES[size]
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4 // world,
                       num_hidden_layers=layers, num_attention_heads=heads // world, num_key_value_heads=kv // world,
                       head_dim=hidden // heads, max_position_embeddings=seq, use_cache=False,
                       attn_implementation="sdpa")


def _models(size: str, rank: int) -> tuple[Any, Any]:
    """(plain model with this rank's local shapes and weights and the same collectives, sharded model)."""
    from transformers import LlamaForCausalLM

    import sharded_tensor as st
    from sharding import composite, single_split
    torch.manual_seed(0)
    sharded = LlamaForCausalLM(_config(size, 1))
    ranks = [f"rank:{r}/cpu" for r in range(WORLD)]
    cols, rows = llama_tp_names(SIZES[size][3])
    sharded = st.shard_model(sharded, composite(**{n: single_split(0, ranks) for n in cols},
                                                **{n: single_split(1, ranks) for n in rows}))
    plain = LlamaForCausalLM(_config(size, WORLD))
    plain.load_state_dict({n: p.detach() for n, p in sharded.named_parameters()}, strict=False)
    return plain, sharded


def _add_collectives(plain: Any) -> None:
    """The sharded model's collectives, at the same places, in the plain model."""
    from sharded_tensor._model.engine.placements import reduce_from_ranks
    for layer in plain.model.layers:
        for block in (layer.self_attn, layer.mlp):
            block.register_forward_pre_hook(_copied_input, with_kwargs=True)
        for out in (layer.self_attn.o_proj, layer.mlp.down_proj):
            out.register_forward_hook(lambda m, i, o: reduce_from_ranks(o))


def _copied_input(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    from sharded_tensor._model.engine.placements import copy_to_ranks
    if args:
        return (copy_to_ranks(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": copy_to_ranks(kwargs["hidden_states"])}


def _engine_calls(fn: Callable[[], Any]) -> int:
    """Calls the engine's ``__torch_function__`` handled during ``fn()``."""
    from sharded_tensor._model.engine.dispatch import ZoneMode
    original = ZoneMode.__torch_function__
    calls = [0]

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        calls[0] += 1
        return original(self, func, types, args, kwargs)

    ZoneMode.__torch_function__ = counted  # type: ignore[method-assign]
    try:
        fn()
    finally:
        ZoneMode.__torch_function__ = original  # type: ignore[method-assign]
    return calls[0]


def _timed(fn: Callable[[], Any], iters: int) -> tuple[float, float]:
    """(wall s, thread CPU s) per call of ``fn``, over ``iters`` calls started together on every rank."""
    torch.distributed.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - wall) / iters, (time.thread_time() - cpu) / iters


def _case(rank: int, size: str, grad: bool, iters: int, repeat: int) -> dict[str, Any]:
    import sharded_tensor as st
    plain, sharded = _models(size, rank)
    batch, seq, vocab = SIZES[size][5], SIZES[size][4], SIZES[size][6]
    x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    def floor() -> Any:
        with _PassThrough():
            return plain(x, labels=x).loss

    sides = {"plain": lambda: plain(x, labels=x).loss, "engine": lambda: sharded(x, labels=x).loss,
             "floor": floor}
    with torch.no_grad():
        counter = _Count()
        with counter:  # the model's own ops (before the collectives are added to the plain model)
            sides["plain"]()
        _add_collectives(plain)
        loss_plain = sides["plain"]()
        loss_engine = sides["engine"]()
        engine_calls = _engine_calls(sides["engine"])
        comm = {}
        for side in ("plain", "engine"):
            with st.CommCounter() as c:
                fn = sides[side]
                fn()
            comm[side] = dict(c.counts)
    per: dict[str, dict[str, list[float]]] = {s: {"wall": [], "cpu": []} for s in sides}
    with torch.set_grad_enabled(grad):
        for fn in sides.values():  # warm-up: the rule table, the decision cache, the allocator
            _timed(fn, max(2, iters // 5))
        for r in range(repeat):
            order = ("plain", "engine", "floor")
            for side in (order if r % 2 == 0 else order[::-1]):
                wall, cpu = _timed(sides[side], iters)
                per[side]["wall"].append(wall)
                per[side]["cpu"].append(cpu)
    return {"size": size, "grad": grad, "loss_equal": torch.equal(loss_plain, loss_engine), "collectives": comm,
            "ops": counter.calls, "engine_calls": engine_calls, "iters": iters, "times": per}


def _rank(rank: int, world: int, args: Any) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    cases = []
    for size in args.sizes:
        iters = args.iters if size == "tiny" else max(1, args.iters // 50)
        for grad in (True, False):
            cases.append(_case(rank, size, grad, iters, args.repeat))
    return cases


def _stats(values: list[float], scale: float, digits: int) -> dict[str, Any]:
    return {"median": round(statistics.median(values) * scale, digits),
            "range": [round(min(values) * scale, digits), round(max(values) * scale, digits)]}


def _summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One case over every rank: paired (engine - plain) differences of all ranks' repeats."""
    first = per_rank[0]
    ops = first["ops"]
    pooled: dict[str, dict[str, list[float]]] = {s: {"wall": [], "cpu": []} for s in ("plain", "engine", "floor")}
    added: dict[str, list[float]] = {"wall": [], "cpu": []}
    floor: dict[str, list[float]] = {"wall": [], "cpu": []}
    for case in per_rank:
        times = case["times"]
        for clock in ("wall", "cpu"):
            for side in pooled:
                pooled[side][clock] += times[side][clock]
            added[clock] += [e - p for e, p in zip(times["engine"][clock], times["plain"][clock])]
            floor[clock] += [f - p for f, p in zip(times["floor"][clock], times["plain"][clock])]
    return {
        "size": first["size"], "grad": first["grad"],
        "model": dict(zip(("hidden", "heads", "kv_heads", "layers", "seq", "batch", "vocab"), SIZES[first["size"]])),
        "loss_equal_every_rank": all(c["loss_equal"] for c in per_rank),
        "collectives_per_forward": first["collectives"],
        "ops_per_forward": ops, "engine_calls_per_forward": first["engine_calls"], "iters": first["iters"],
        "forward_ms": {side: {clock: _stats(v, 1e3, 3) for clock, v in d.items()} for side, d in pooled.items()},
        "engine_added_per_forward_ms": {clock: _stats(v, 1e3, 3) for clock, v in added.items()},
        "engine_added_per_op_us": {clock: _stats(v, 1e6 / ops, 2) for clock, v in added.items()},
        "pass_through_mode_added_per_op_us": {clock: _stats(v, 1e6 / ops, 2) for clock, v in floor.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--iters", type=int, default=100, help="forwards per measurement of the tiny model "
                        "(the tp_llama-sized one runs 1/50 of it)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--tp-llama-steps", type=int, default=4, help="run tp_llama.py with this many steps "
                        "after the engine cases, for the engine's share of its step (0: skip)")
    args = parser.parse_args()
    load_before = machine()["load_average"]
    results = launch(_rank, WORLD, args)
    cases = [_summary([r[i] for r in results]) for i in range(len(results[0]))]
    print(json.dumps(cases), file=sys.stderr, flush=True)  # kept should tp_llama fail
    report: dict[str, Any] = {"benchmark": "engine_overhead", "machine": machine(), "load_average_before": load_before,
                              "world": WORLD, "cases": cases}
    if args.tp_llama_steps:
        import tp_llama
        hidden, heads, _, layers, seq, batch, vocab = SIZES["tp_llama"]
        tp_args = argparse.Namespace(hidden=hidden, layers=layers, heads=heads, seq=seq, batch=batch, vocab=vocab,
                                     steps=args.tp_llama_steps, compile=False, plan="standard")
        runs = launch(tp_llama._rank, WORLD, tp_args)
        step = {side: statistics.median(max(r["times"][side][i] for r in runs) for i in range(tp_args.steps))
                for side in ("shardkit", "dtensor")}
        report["tp_llama"] = {"steps": tp_args.steps, "step_seconds_median": step,
                              "step_time_ratio_shardkit_over_dtensor": round(step["shardkit"] / step["dtensor"], 3),
                              "load_average_after": machine()["load_average"]}
        found = next((c for c in cases if c["size"] == "tp_llama" and c["grad"]), None)
        if found is not None:
            report["tp_llama"]["engine_share_of_shardkit_step"] = {
                clock: round(found["engine_added_per_forward_ms"][clock]["median"] * 1e-3 / step["shardkit"], 4)
                for clock in ("wall", "cpu")}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
