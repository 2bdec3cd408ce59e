"""Sharded models under ``torch.compile``: eager's numbers forward and backward, one graph, no break.

One spawn of 2 Gloo ranks compiles, as users call models (configs with transformers'
defaults, ``use_cache=True`` included; batches with an attention mask and ``labels``): a
plain MLP, architectures of the matrix (tests/distributed/test_arch_matrix.py), a Llama sharded
with ``st.tensor_parallel_spec`` (embedding and lm_head split on the vocabulary: the whole
model is the outermost zone; the loss computed in the forward from labels, once plainly and
once inside ``st.loss_parallel()``), mixtures of experts planned the same way (Mixtral with
both expert layouts, GPT-OSS with its experts divided among the ranks; ``SHARDKIT_COMPILE_MOE``
adds GPT-OSS's other layout and Llama 4's two), and greedy ``generate`` through a compiled
forward (the dynamic and the static cache). On every rank, for each case
(``test_compiled_matches_eager[<case>]``):

* the compiled model's logits equal the eager sharded model's (relative difference below
  ``FORWARD_TOL``: the compiled graph runs the same local ops and the same collectives);
* every parameter's gradient from the compiled forward and backward, the split ones
  gathered whole, equals the unsharded model's (``full_mismatches``: rtol 1e-4);
* dynamo records no graph break and captures one graph, the mixtures of experts included (their
  routing sorts the (token, expert) pairs into a static shape; see sharded_tensor/_model/experts.py);
* with labels, the compiled loss equals the eager sharded one bit for bit; an id past the
  vocabulary is refused in eager (``IndexError``) and by the compiled graph's assertion;
* with ``aot_eager``, the forward and backward graphs hold the collectives the layout needs
  (the matrix's count of forward all-reduces; as many in backward for the decoders, whose
  column-parallel inputs need their gradients summed; ``MOE_ALL_REDUCES`` for the mixtures of
  experts) and no copy around them: no clone feeding a functional all-reduce, no copy of its
  result (a functional collective returns a new tensor; a copy there would be paid on every step);
* generating through the compiled forward gives the unsharded model's tokens.

A case that fails today for a reason known in the compute engine is listed in
``EXPECTED_FAILURES`` with the start of its error: the test is then an expected failure only
if the run fails with that error; any other failure fails it, and a run that passes fails it
too, saying to remove the entry (a strict expected failure).

The backend is ``aot_eager`` by default: dynamo and AOTAutograd build the same graph inductor
receives (local ops, functional collectives and their backward); only the code generation is
left out, which takes minutes of C++ compilation on a 2-core machine and is torch's own.
``SHARDKIT_COMPILE_BACKEND=inductor`` runs the same checks with inductor (they pass; 220 s
for the three models at load average 16, against 57 s with ``aot_eager``);
scripts/bench/tp_llama.py --compile compiles with inductor on both sides and compares the
losses.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import sharded_tensor as st  # noqa: E402
from sharding import CompositeShardingSpec, composite, single_split  # noqa: E402
from tests.distributed._archs import BY_NAME, LAYERS, MOE_MODELS, VOCAB, inputs, loss, max_diff, objective, spec_of  # noqa: E402
from tests.distributed._grads import full_grads, full_mismatches  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BACKEND = os.environ.get("SHARDKIT_COMPILE_BACKEND", "aot_eager")
FORWARD_TOL = 1e-6  # relative to the logits' largest magnitude; measured differences are at most ~2e-7
# Architectures of the matrix compiled here: GQA + RoPE + SwiGLU; a fused (packed) Conv1D qkv with
# tied embeddings. Each costs tens of seconds of tracing on a loaded 2-core machine;
# SHARDKIT_COMPILE_ARCHS=llama,qwen3,... checks others (all 24 of the matrix pass, see docs/huggingface.md).
ARCHITECTURES = ["llama", "gpt2"]
# Llama sharded with ``st.tensor_parallel_spec``: its vocabulary-split embedding and lm_head make the
# whole model one zone, and transformers' loss in the forward runs on the split logits.
VOCAB_SPLIT = "llama_vocab_split"
# The same, compiled and called inside ``st.loss_parallel()`` (as scripts/bench/tp_llama.py --plan full does).
VOCAB_SPLIT_LOSS_PARALLEL = "llama_vocab_split_loss_parallel"
# Mixture-of-experts models planned by ``st.tensor_parallel_spec``, each expert's features split, or the experts
# divided: Mixtral (fused experts), GPT-OSS (biased, interleaved), Llama 4 (stacked); ``SHARDKIT_COMPILE_MOE`` picks.
MOE_CASES = {f"{model}_experts_{layout}": (model, layout) for model in MOE_MODELS for layout in ("tensor", "expert")}
# Compiled by default: Mixtral both ways, and GPT-OSS divided among the ranks (its biases on the rows of other ranks'
# experts, which the compiled layer keeps, a static shape). SHARDKIT_COMPILE_MOE=gpt_oss,llama4,... adds models
# (both layouts) or single cases.
MOE_DEFAULT = ["mixtral", "gpt_oss_experts_expert"]
# All-reduces per MoE layer, (forward, backward), besides the embedding's and the loss's: attention's row-parallel
# output and the experts' sum (compiled, the expert-parallel layer always all-reduces: see experts._combine), and in
# backward the gradients of attention's and the experts' inputs. Llama 4 adds its shared expert (row-parallel) to
# both, and its experts divided among the ranks gather their rows rather than sum them.
MOE_ALL_REDUCES = {("mixtral", "tensor"): (2, 2), ("mixtral", "expert"): (2, 2), ("gpt_oss", "tensor"): (2, 2),
                   ("gpt_oss", "expert"): (2, 2), ("llama4", "tensor"): (3, 3), ("llama4", "expert"): (2, 3)}
# Greedy generation through a compiled forward, with the dynamic and the static key/value cache.
GENERATE = "llama_generate"
NEW_TOKENS = 4
# Cases that fail today in the compute engine, with the start of the error each run gives (see the docstring).
EXPECTED_FAILURES: dict[str, str] = {}
# Llama called with use_cache=False (as training loops often do): no cache built, the compiled path as it works today.
NO_CACHE = "llama_use_cache_false"


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _mlp_case(world: int) -> tuple[Callable[[], torch.nn.Module], Any, dict[str, torch.Tensor]]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return _MLP()

    spec = composite(up=single_split(0, ranks), **{"down.weight": single_split(1, ranks)})
    return build, spec, {"x": torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(3))}


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


_ALL_REDUCE = "_c10d_functional.all_reduce.default"
_WAIT = "_c10d_functional.wait_tensor.default"


def _graph_stats(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Functional all-reduces in an AOT graph, and copies made around them."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    copied_in = sum(1 for n in calls if str(n.target) == "aten.clone.default"
                    and any(str(u.target) == _ALL_REDUCE for u in n.users))
    copies = ("aten.copy.default", "aten.copy_.default", "aten.clone.default")
    copied_out = sum(1 for n in calls if str(n.target) in copies
                     and any(isinstance(a, torch.fx.Node) and str(a.target) == _WAIT for a in n.args))
    return {"all_reduces": sum(1 for n in calls if str(n.target) == _ALL_REDUCE), "copies": copied_in + copied_out}


def _backend(graphs: dict[str, list[dict[str, int]]]) -> Any:
    """``BACKEND``; for ``aot_eager``, the same backend recording each graph's ``_graph_stats``."""
    if BACKEND != "aot_eager":
        return BACKEND
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def recorder(kind: str) -> Callable[..., Any]:
        def compile_graph(gm: torch.fx.GraphModule, inputs: Any) -> Any:
            graphs.setdefault(kind, []).append(_graph_stats(gm))
            return boxed_nop(gm, inputs)
        return compile_graph

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        return aot_eager(gm, inputs, fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    return backend


def _compile_one(name: str, rank: int, world: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    if name == GENERATE:
        return _generate_compiled(world)
    all_reduces = None
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    # The model's own loss from labels (compared) plus a fixed weighting of every logit is differentiated.
    grad_of: Callable[[Any], torch.Tensor] = objective
    if name == "mlp":
        build, spec, x = _mlp_case(world)
        all_reduces = (1, 0)  # the input needs no gradient: nothing to sum in backward
        grad_of = lambda out: loss(_logits(out))  # noqa: E731 - no loss of its own
    elif name in (VOCAB_SPLIT, VOCAB_SPLIT_LOSS_PARALLEL):  # the whole model is the zone
        build, x = BY_NAME["llama"].build, inputs("padded", 0)
        x["labels"] = x["input_ids"]  # transformers' loss in the forward, on the split logits
        spec = st.tensor_parallel_spec(build(), ranks)
        # Forward: the embedding's sum, the layers' row-parallel ones, the loss's three (max, sum of
        # exponentials, target logit). Backward: the column-parallel inputs' gradients, lm_head's included.
        layers = BY_NAME["llama"].all_reduces
        all_reduces = (1 + layers + 3, layers + 1)
        grad_of = lambda out: out.loss  # noqa: E731 - the split logits are gathered for a weighting
    elif name == NO_CACHE:
        arch = BY_NAME["llama"]
        build, spec, x = arch.build, spec_of(arch, world), dict(inputs(arch.inputs, 0), use_cache=False)
        all_reduces = (arch.all_reduces, arch.all_reduces)
    elif name in MOE_CASES:
        model_name, layout = MOE_CASES[name]
        build, x = MOE_MODELS[model_name], inputs("padded", 0)
        if model_name == "llama4" and layout == "expert":  # transformers has no expert-parallel plan for it
            planned = st.tensor_parallel_spec(build(), ranks).param_placement
            experts = "model.layers.*.feed_forward.experts"
            spec = CompositeShardingSpec({**planned, f"{experts}.gate_up_proj": single_split(0, ranks),
                                          f"{experts}.down_proj": single_split(0, ranks)})
        else:
            spec = st.tensor_parallel_spec(build(), ranks, experts=layout)  # type: ignore[arg-type]
        # As for the vocabulary-split Llama: the embedding's and the loss's three forward, lm_head's input backward.
        forward, backward = MOE_ALL_REDUCES[MOE_CASES[name]]
        all_reduces = (1 + forward * LAYERS + 3, backward * LAYERS + 1)
        grad_of = lambda out: out.loss  # noqa: E731
    else:
        arch = BY_NAME[name]
        if arch.register is not None:
            arch.register()
        build, spec, x = arch.build, spec_of(arch, world), inputs(arch.inputs, 0)
        all_reduces = (arch.all_reduces, arch.all_reduces + arch.extra_backward_all_reduces) \
            if arch.group == "decoders" else None
    ref, model = build(), build()
    model.load_state_dict(ref.state_dict())
    st.shard_model(model, spec, src_rank=0)
    want = ref(**x)
    grad_of(want).backward()
    with torch.no_grad():
        eager = model(**x)

    torch._dynamo.reset()
    counters.clear()
    graphs: dict[str, list[dict[str, int]]] = {}
    compiled = torch.compile(model, backend=_backend(graphs))
    with st.loss_parallel() if name == VOCAB_SPLIT_LOSS_PARALLEL else contextlib.nullcontext():
        got = compiled(**x)  # outputs leave a compiled graph whole, under loss_parallel too
        grad_of(got).backward()
    losses = (float(got.loss.detach()), float(eager.loss), float(want.loss.detach())) if "labels" in x else None
    out = {"forward": max_diff(_logits(got), _logits(eager)), "losses": losses,
           "graph_stats": {kind: list(stats) for kind, stats in graphs.items()}, "want_all_reduces": all_reduces,
           "grads": full_mismatches(full_grads(model, rank), {n: p.grad for n, p in ref.named_parameters()}),
           "graph_breaks": sum(counters["graph_break"].values()),
           "graphs": counters["stats"]["unique_graphs"], "refused": None}
    if name == VOCAB_SPLIT:  # an id past the vocabulary: refused in eager and by the compiled graph's own check
        ids = x["input_ids"].clone().fill_(model.config.vocab_size)
        bad = dict(x, input_ids=ids, labels=ids)  # the ids alias the labels, as in the first call: no retrace
        out["refused"] = (_raised(lambda: model(**bad)), _raised(lambda: compiled(**bad)))
    return out


def _generate_compiled(world: int) -> dict[str, Any]:
    """Greedy ``generate`` of a sharded Llama whose forward is compiled, with the dynamic and the static cache."""
    arch = BY_NAME["llama"]
    ref, model = arch.build(), arch.build()
    model.load_state_dict(ref.state_dict())
    st.shard_model(model, spec_of(arch, world), src_rank=0)
    ref.eval()
    model.eval()
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=_backend({}))
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    kwargs = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": NEW_TOKENS,
              "min_new_tokens": NEW_TOKENS, "do_sample": False}
    tokens = {}
    for cache in ("dynamic", "static"):
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        tokens[cache] = (model.generate(prompt, **kwargs, **extra).tolist(),
                         ref.generate(prompt, **kwargs, **extra).tolist())
    return {"generated": tokens}


def _raised(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the type and message are what is checked
        return f"{type(exc).__name__}: {exc}"
    return "nothing raised"


def _run(rank: int, world: int, names: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        started = time.perf_counter()
        try:
            out[name] = _compile_one(name, rank, world)
        except Exception as exc:  # noqa: BLE001 - reported per model, with the others still checked
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        out[name]["seconds"] = time.perf_counter() - started
    return out


def _cases() -> list[str]:
    archs = os.environ.get("SHARDKIT_COMPILE_ARCHS", ",".join(ARCHITECTURES)).split(",")
    moe = os.environ.get("SHARDKIT_COMPILE_MOE", ",".join(MOE_DEFAULT)).split(",")
    return ["mlp", VOCAB_SPLIT, VOCAB_SPLIT_LOSS_PARALLEL, *archs, NO_CACHE,
            *(name for name, (model, _) in MOE_CASES.items() if model in moe or name in moe), GENERATE]


@pytest.fixture(scope="module")
def compile_runs() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_run, 2, _cases(), timeout=900)


def _expected_error(name: str) -> str | None:
    """The error ``name`` fails with today: its ``EXPECTED_FAILURES`` entry."""
    return EXPECTED_FAILURES.get(name)


def _expected_failure(name: str, got: dict[str, Any]) -> None:
    """A case expected to fail that failed with its error is an expected failure; any other failure fails."""
    error, expected = got.get("error"), _expected_error(name)
    if expected is None:
        assert error is None, (name, got)
        return
    if error is not None and error.startswith(expected):
        pytest.xfail(f"{name}: {expected}")
    msg = (f"{name} is expected to fail with {expected!r}, but "
           f"{'its run failed with ' + repr(error) if error else 'its run went through'}; update EXPECTED_FAILURES")
    raise AssertionError(msg)


@pytest.mark.parametrize("name", _cases())
def test_compiled_matches_eager(compile_runs, name) -> None:
    for rank, per_model in enumerate(compile_runs):
        got = per_model[name]
        _expected_failure(name, got)
        if name == GENERATE:
            for cache, (tokens, want) in got["generated"].items():
                assert tokens == want, (rank, cache, tokens, want)
            continue
        assert got["forward"] <= FORWARD_TOL, (rank, name, got)
        assert got["grads"] == {}, (rank, name, got)
        if got["losses"] is not None:
            compiled, eager, unsharded = got["losses"]
            assert compiled == eager, (rank, name, got)
            assert abs(compiled - unsharded) <= FORWARD_TOL * abs(unsharded), (rank, name, got)
        assert got["graph_breaks"] == 0 and got["graphs"] == 1, (rank, name, got)
        if got["refused"] is not None:
            eager_error, compiled_error = got["refused"]
            bounds = f"[0, {VOCAB})"
            assert eager_error.startswith("IndexError") and bounds in eager_error, (rank, eager_error)
            assert compiled_error.startswith("RuntimeError") and bounds in compiled_error, (rank, compiled_error)
        if BACKEND != "aot_eager":
            continue
        stats = got["graph_stats"]
        assert len(stats["forward"]) == len(stats["backward"]) == 1, (rank, name, stats)
        forward, backward = stats["forward"][0], stats["backward"][0]
        assert forward["copies"] == backward["copies"] == 0, (rank, name, stats)
        if got["want_all_reduces"] is not None:
            want = tuple(got["want_all_reduces"])
            assert (forward["all_reduces"], backward["all_reduces"]) == want, (rank, name, stats)
