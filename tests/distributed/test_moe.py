"""Mixture-of-experts models sharded two ways on Gloo ranks: tensor-parallel experts and expert parallel.

One spawn per world size. Each rank builds Mixtral, Qwen2-MoE and Qwen3-MoE (transformers 5
fused experts, tiny configs, no downloads) and an unsharded copy, shards the copy with
attention split by heads and the experts split either by intermediate features or by
experts, and checks against the unsharded model, on every rank:

* logits, the loss with the router's load-balancing loss (``output_router_logits=True``) and
  the auxiliary loss itself;
* every parameter's gradient, gathered: the experts', the router's (replicated, consumed
  by every rank) and everything upstream (attention, embeddings), which the hidden states'
  gradient reaches through the experts;
* 3 AdamW steps: the losses, and every parameter after them (to 5e-5: Adam divides by the
  root of the squared gradients, which turns float noise in a near-zero gradient into a
  visible fraction of a step of 1e-2);
* the forward does one all-reduce per MoE layer for the experts;
* layouts that cannot compute are refused at shard time, saying how to split;
* on 2 ranks, Mixtral and Qwen2-MoE folders written by ``save_pretrained`` (one tensor per
  expert and matrix, Mixtral's older ``block_sparse_moe`` names) and folders holding the fused
  tensors load into meta models sharded with ``init=False``, both expert layouts: every
  parameter equals ``from_pretrained``'s of the same folder, each rank reads exactly its half
  of the experts' bytes, and a bfloat16 folder loads into float32 with ``cast=True``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

import checkpoint  # noqa: E402
import sharded_tensor as st  # noqa: E402
from sharded_tensor._model.experts import combine_bytes  # noqa: E402
from sharded_tensor._model.record import sharded_parameters  # noqa: E402
from sharding import composite, single_split  # noqa: E402
from tests.distributed._grads import gathered_grads, relative_errors  # noqa: E402
from tests.distributed._launch import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed
VOCAB, LAYERS, HIDDEN, INTER, EXPERTS, SEQ = 64, 2, 32, 16, 4, 8
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
MODES = ("tensor", "expert")


def _config(arch: str, world: int):  # type: ignore[no-untyped-def]
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=max(2, world), head_dim=8, max_position_embeddings=64, num_experts_per_tok=2,
                  use_cache=False, attention_dropout=0.0, router_aux_loss_coef=0.02)
    if arch == "mixtral":
        from transformers import MixtralConfig
        return MixtralConfig(intermediate_size=INTER, num_local_experts=EXPERTS, **common)
    if arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        return Qwen2MoeConfig(intermediate_size=INTER, moe_intermediate_size=INTER,
                              shared_expert_intermediate_size=INTER, num_experts=EXPERTS, **common)
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(intermediate_size=INTER, moe_intermediate_size=INTER, num_experts=EXPERTS,
                          norm_topk_prob=True, **common)


def _model_class(arch: str):  # type: ignore[no-untyped-def]
    import transformers
    return {"mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM,
            "qwen3_moe": transformers.Qwen3MoeForCausalLM}[arch]


def moe_spec(arch: str, world: int, mode: str, *, gate_up=None):  # type: ignore[no-untyped-def]
    """Attention split by heads (not for Qwen3-MoE: see below), experts split by features or by experts."""
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    col, row = single_split(0, ranks), single_split(1, ranks)
    parts = {}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        # Qwen3's q/k norms after a head split are the compute engine's business, not this layer's.
        if arch != "qwen3_moe":
            for name in ("q_proj", "k_proj", "v_proj"):
                parts[f"{layer}.self_attn.{name}"] = col
            parts[f"{layer}.self_attn.o_proj"] = row
        experts = f"{layer}.mlp.experts"
        if mode == "tensor":
            parts[f"{experts}.gate_up_proj"] = gate_up or single_split(1, ranks * 2)
            parts[f"{experts}.down_proj"] = single_split(2, ranks)
        else:
            parts[f"{experts}.gate_up_proj"] = gate_up or single_split(0, ranks)
            parts[f"{experts}.down_proj"] = single_split(0, ranks)
        if arch == "qwen2_moe":
            shared = f"{layer}.mlp.shared_expert"
            parts[f"{shared}.gate_proj"] = parts[f"{shared}.up_proj"] = col
            parts[f"{shared}.down_proj"] = row
    return composite(**parts)


def _pair(arch: str, world: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    cls, config = _model_class(arch), _config(arch, world)
    ref = cls(config)
    model = cls(config)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _full_params(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Every parameter whole (split ones gathered; collective)."""
    out = {}
    for mod_name, module in model.named_modules():
        sharded = sharded_parameters(module)
        for attr, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{attr}" if mod_name else attr
            out[name] = sharded[attr].wrap(param.detach(), rank).full_tensor() if attr in sharded else param.detach()
    return out


def _case(arch: str, mode: str, rank: int, world: int, *, planned: bool = False) -> dict[str, object]:
    out: dict[str, object] = {}
    ref, model = _pair(arch, world)
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    spec = st.tensor_parallel_spec(model, ranks, experts=mode) if planned else moe_spec(arch, world, mode)
    st.shard_model(model, spec, src_rank=0)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with st.CommCounter() as fwd:
        got = model(x, labels=x, output_router_logits=True)
    want = ref(x, labels=x, output_router_logits=True)
    out["logits"] = float((got.logits - want.logits).detach().abs().max())
    out["loss"] = (got.loss.item(), want.loss.item())
    out["aux_loss"] = (got.aux_loss.item(), want.aux_loss.item())
    out["forward_comm"] = dict(fwd.counts)
    with st.CommCounter() as bwd:
        got.loss.backward()
    want.loss.backward()
    out["backward_comm"] = dict(bwd.counts)
    grads = gathered_grads(model, rank)
    out["grad_names"] = sorted(grads) == sorted(n for n, _ in ref.named_parameters())
    out["grad_errors"] = {k: v for k, v in relative_errors(grads, ref).items() if not v < 1e-5}
    out["router_grad_nonzero"] = float(grads["model.layers.0.mlp.gate.weight"].abs().max()) > 0
    out["forward_bytes"] = dict(fwd.bytes_by_op)
    if mode == "expert":
        share = EXPERTS // world
        intervals = tuple((r * share, share) for r in range(world))
        layers = []
        for logits in want.router_logits:
            index = logits.topk(2, dim=-1).indices
            layers.append([combine_bytes(index, intervals, HIDDEN, 4, r) for r in range(world)])
        out["combine_bytes"] = [[(b.all_reduce, b.all_to_all, b.all_gather) for b in per_rank]
                                for per_rank in layers]

    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    losses, ref_losses = [], []
    for step in range(3):
        y = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(10 + step))
        for m, o, sink in ((model, opt, losses), (ref, ref_opt, ref_losses)):
            o.zero_grad()
            loss = m(y, labels=y, output_router_logits=True).loss
            loss.backward()
            o.step()
            sink.append(loss.item())
    out["train"] = (losses, ref_losses)
    ref_params = dict(ref.named_parameters())
    out["param_errors"] = {k: float((v - ref_params[k].detach()).abs().max())
                           for k, v in _full_params(model, rank).items()
                           if not torch.allclose(v, ref_params[k].detach(), rtol=0, atol=5e-5)}
    return out


def _refusals(world: int) -> dict[str, str | None]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    bad = {"contiguous": ("tensor", single_split(1, ranks)),
           "uneven": ("expert", single_split(0, ranks, [EXPERTS - world + 2, 0] + [1] * (world - 2)))}
    out: dict[str, str | None] = {}
    for key, (mode, gate_up) in bad.items():
        _, model = _pair("mixtral", world)
        try:
            st.shard_model(model, moe_spec("mixtral", world, mode, gate_up=gate_up), src_rank=0)
            out[key] = None
        except ValueError as exc:
            out[key] = str(exc)
    return out


IMPORTED = ("mixtral", "qwen2_moe")
# Every architecture and expert layout from save_pretrained's per-expert folder; the fused
# folder and the bfloat16 one (cast=True) once per architecture, the layouts alternating.
IMPORT_CASES = [(arch, "per_expert", mode) for arch in IMPORTED for mode in MODES] + [
    ("mixtral", "fused", "expert"), ("qwen2_moe", "fused", "tensor"),
    ("mixtral", "per_expert_bf16", "tensor"), ("qwen2_moe", "per_expert_bf16", "expert")]


def write_folders(root: str) -> None:
    """For each imported architecture: ``save_pretrained``'s folder (per expert), in bfloat16, and a fused one."""
    from safetensors.torch import save_file
    for arch in IMPORTED:
        torch.manual_seed(5)
        model = _model_class(arch)(_config(arch, 2))
        model.save_pretrained(os.path.join(root, arch, "per_expert"))
        fused = os.path.join(root, arch, "fused")
        model.config.save_pretrained(fused)
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or
                   not model.config.tie_word_embeddings}, os.path.join(fused, "model.safetensors"))
        model.to(torch.bfloat16).save_pretrained(os.path.join(root, arch, "per_expert_bf16"))


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _expert_bytes_read(model: torch.nn.Module, folder: str, mode: str) -> int:
    """Bytes read for the experts alone: a load of them minus a load of the router's 512 bytes.

    Tensor-parallel ``down_proj`` blocks are columns, copied from mapped pages, which read
    syscalls do not count: there only ``gate_up_proj``, read by rows, is counted.
    """
    state = model.state_dict()
    experts = {k: v for k, v in state.items()
               if ".mlp.experts." in k and (mode == "expert" or k.endswith("gate_up_proj"))}
    router = {"model.layers.0.mlp.gate.weight": state["model.layers.0.mlp.gate.weight"]}
    before = _read_bytes()
    checkpoint.load(router, folder, strict=False)
    middle = _read_bytes()
    checkpoint.load(experts, folder, strict=False)
    return (_read_bytes() - middle) - (middle - before) + router["model.layers.0.mlp.gate.weight"].numel() * 4


def _imports(rank: int, world: int, root: str) -> dict[str, object]:
    """Each folder into a meta model sharded each way: parameters, and the bytes of experts read."""
    out: dict[str, object] = {}
    references: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for arch, layout, mode in IMPORT_CASES:
        cls = _model_class(arch)
        folder = os.path.join(root, arch, layout)
        if (arch, layout) not in references:
            ref = cls.from_pretrained(folder, dtype=torch.float32)
            references[arch, layout] = {k: v.detach() for k, v in ref.named_parameters()}
        want = references[arch, layout]
        with torch.device("meta"):
            model = cls(_config(arch, world))
        st.shard_model(model, moe_spec(arch, world, mode), init=False)
        checkpoint.load(model.state_dict(), folder, cast=layout.endswith("bf16"))
        got = _full_params(model, rank)
        case: dict[str, object] = {"names": sorted(got) == sorted(want),
                                   "differ": [k for k, v in got.items() if not torch.equal(v, want[k])]}
        if layout == "per_expert":
            case["expert_bytes_read"] = _expert_bytes_read(model, folder, mode)
        out[f"import/{arch}/{layout}/{mode}"] = case
    return out


def _moe(rank: int, world: int, root: str) -> dict[str, object]:
    out: dict[str, object] = {f"{arch}/{mode}": _case(arch, mode, rank, world)
                              for arch in ARCHS[:WORLD_ARCHS[world]] for mode in MODES}
    out["refusals"] = _refusals(world)
    if world == 2:  # the one-call plan (transformers' own plans, both expert layouts); imports
        for arch, mode in PLANNED:
            out[f"planned/{arch}/{mode}"] = _case(arch, mode, rank, world, planned=True)
        out.update(_imports(rank, world, root))
    return out


PLANNED = [("mixtral", "expert"), ("qwen2_moe", "tensor")]


# 4 ranks on a shared 2-core machine cost: Qwen3-MoE runs on 2 only (its experts are Qwen2-MoE's).
WORLD_ARCHS = {2: 3, 4: 2}


def _spawn(world: int, tmp_path_factory) -> list[dict[str, object]]:
    root = str(tmp_path_factory.mktemp("moe"))
    if world == 2:
        write_folders(root)
    return run_distributed(_moe, world, root, timeout=900)


@pytest.fixture(scope="module")
def moe_runs_2(tmp_path_factory) -> list[dict[str, object]]:
    return _spawn(2, tmp_path_factory)


@pytest.fixture(scope="module")
def moe_runs_4(tmp_path_factory) -> list[dict[str, object]]:
    return _spawn(4, tmp_path_factory)


@pytest.fixture
def moe_runs(request, world: int) -> list[dict[str, object]]:
    """The outputs of the module's one spawn on ``world`` ranks (made once, on first use)."""
    runs: list[dict[str, object]] = request.getfixturevalue(f"moe_runs_{world}")
    return runs


# Only the cases each world's spawn holds: 2 ranks run every architecture, 4 ranks the first two.
SHARDED_CASES = [pytest.param(world, arch, mode, id=f"{world}ranks-{arch}-{mode}") for world in sorted(WORLD_ARCHS)
                 for arch in ARCHS[:WORLD_ARCHS[world]] for mode in MODES]
WORLDS = [pytest.param(world, id=f"{world}ranks") for world in sorted(WORLD_ARCHS)]


@pytest.mark.parametrize(("world", "arch", "mode"), SHARDED_CASES)
def test_moe_sharded_equals_unsharded(moe_runs, arch, mode):
    for out in moe_runs:
        case = out[f"{arch}/{mode}"]
        assert case["logits"] < 1e-5
        got, want = case["loss"]
        assert got == pytest.approx(want, rel=1e-6)
        got, want = case["aux_loss"]
        assert got == pytest.approx(want, rel=1e-6)
        assert case["grad_names"]
        assert case["grad_errors"] == {}
        assert case["router_grad_nonzero"]
        losses, ref_losses = case["train"]
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert case["param_errors"] == {}


@pytest.mark.parametrize("world", [2])
@pytest.mark.parametrize(("arch", "mode"), PLANNED)
def test_moe_planned_by_tensor_parallel_spec_equals_unsharded(moe_runs, arch, mode):
    """``st.tensor_parallel_spec(model, ranks, experts=mode)``: transformers' plan, no spec written by hand."""
    for out in moe_runs:
        case = out[f"planned/{arch}/{mode}"]
        assert case["logits"] < 1e-5
        got, want = case["aux_loss"]
        assert got == pytest.approx(want, rel=1e-6)
        assert case["grad_names"] and case["grad_errors"] == {}
        losses, ref_losses = case["train"]
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert case["param_errors"] == {}


@pytest.mark.parametrize(("world", "arch", "mode"), SHARDED_CASES)
def test_moe_experts_communicate_once_per_layer(moe_runs, arch, mode):
    """Tensor-parallel experts all-reduce; expert parallel takes the all-to-all where it moves fewer bytes."""
    others = LAYERS * ((0 if arch == "qwen3_moe" else 1) + (1 if arch == "qwen2_moe" else 0))
    for out in moe_runs:
        case = out[f"{arch}/{mode}"]
        # backward: one all-reduce per layer for the experts' inputs (hidden states and routing
        # weights together), the combine's none
        assert case["backward_comm"] == {"all_reduce": LAYERS + others}
        if mode == "tensor":
            assert case["forward_comm"] == {"all_reduce": LAYERS + others}
            continue
        cheaper = [sum(b[1] for b in per_rank) < sum(b[0] for b in per_rank) for per_rank in case["combine_bytes"]]
        comm = dict(case["forward_comm"])
        assert comm.pop("all_reduce", 0) == others + cheaper.count(False)
        assert comm.pop("all_gather", 0) == cheaper.count(True)
        assert ("send/recv" in comm) == any(cheaper)


@pytest.mark.parametrize("world", WORLDS)
def test_expert_parallel_combine_bytes_are_counted(moe_runs):
    row, tokens, world = HIDDEN * 4, 2 * SEQ, len(moe_runs)
    for rank, out in enumerate(moe_runs):
        for per_rank in out["mixtral/expert"]["combine_bytes"]:
            reduce, to_all, gather = per_rank[rank]
            assert reduce == 2 * (world - 1) * tokens * row // world  # a ring all-reduce
            # the all-gather's (k-1)/k T rows, plus at most the T/k owned rows from each other rank
            gathered = (world - 1) * tokens * row // world
            assert gathered <= to_all <= gathered + (world - 1) * tokens * row // world
            assert 0 < gather <= (world - 1) * tokens * row


@pytest.mark.parametrize("world", WORLDS)
def test_bad_expert_layouts_are_refused(moe_runs):
    for out in moe_runs:
        refusals = out["refusals"]
        assert refusals["contiguous"] is not None and "single_split(1, ranks * 2)" in refusals["contiguous"]
        assert refusals["uneven"] is not None and "divisible" in refusals["uneven"]


@pytest.mark.parametrize("world", [2])
@pytest.mark.parametrize(("arch", "layout", "mode"), IMPORT_CASES)
def test_moe_import_equals_from_pretrained(moe_runs, arch, layout, mode):
    """A folder per expert (save_pretrained's) or fused loads by byte ranges into either expert layout."""
    config = _config(arch, 2)
    inter = config.intermediate_size if arch == "mixtral" else config.moe_intermediate_size
    experts_bytes = LAYERS * EXPERTS * (3 if mode == "expert" else 2) * inter * HIDDEN * 4
    for out in moe_runs:
        case = out[f"import/{arch}/{layout}/{mode}"]
        assert case["names"] and case["differ"] == []
        if layout != "per_expert":
            continue  # the layout whose byte ranges are the point (and whose reads are all counted)
        # exactly the rank's half of the experts' bytes (headers are read by both loads alike);
        # tensor-parallel: of gate_up_proj's
        assert case["expert_bytes_read"] == experts_bytes // 2, (case["expert_bytes_read"], experts_bytes)
