"""shard_model / shard_parameter on real Gloo ranks, against single-process references.

Two spawns (4 ranks, then 2) run every check; each check is a plain function called on every
rank and returns what the parent compares with a reference computed here, in one process:

* layout-invariant init: a meta-built model with ``seed=`` holds bit-identical values over
  1, 2 and 4 ranks and several specs (row, column, uneven, permuted splits);
* sharded compute: a small LM (embedding, MLP blocks, layer norms, output projection) gives
  the unsharded outputs, per-shard gradients and training losses; a two-layer MLP forward
  does exactly one all-reduce (``CommCounter`` and ``CommDebugMode`` agree);
* state: state_dict / load_state_dict with ShardedTensors in other layouts and full tensors;
  optimizer state moved between layouts in memory, and through ``checkpoint.save`` on 4 ranks
  then ``checkpoint.load`` on 2 with another spec, resuming training exactly;
* refusals: specs that cannot be computed raise ValueError naming the module and why.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import checkpoint
import sharded_tensor as st
from sharded_tensor._model.record import sharded_parameters
from sharding import DevicePlacement, composite, mesh, single_split
from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed

VOCAB, DIM, HIDDEN = 37, 16, 48
STEPS_BEFORE, STEPS_AFTER = 3, 3


# -- models ----------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class XavierLinear(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)
        nn.init.constant_(self.bias, 0.25)


class TruncLinear(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.02)
        self.bias.data.normal_(0.0, 0.1)  # the Tensor method on .data, as Hugging Face code does


class KaimingNormalLinear(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.weight, mode="fan_out", nonlinearity="relu")
        nn.init.xavier_normal_(self.bias.view(1, -1))  # a view of a whole (unsplit) bias
        nn.init.zeros_(self.bias)


class InitNet(nn.Module):
    """One layer per init rule that reset_parameters uses."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=3)
        self.fc = nn.Linear(DIM, HIDDEN)
        self.xav = XavierLinear(HIDDEN, DIM)
        self.trunc = TruncLinear(DIM, HIDDEN)
        self.kn = KaimingNormalLinear(HIDDEN, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = self.xav(F.relu(self.fc(x)))
        x = self.kn(F.relu(self.trunc(x)))
        return self.head(self.ln(x))


def ranks(world: int) -> list[str]:
    return [f"rank:{r}/cpu" for r in range(world)]


def init_specs(world: int) -> dict[str, object]:
    """Specs for InitNet: rows, columns (uneven, permuted ranks) and a mix."""
    r = ranks(world)
    rev = list(reversed(r))
    uneven_d = [DIM - 3 * (world - 1)] + [3] * (world - 1)
    uneven_h = [HIDDEN - 5 * (world - 1)] + [5] * (world - 1)
    rows = composite(emb=single_split(0, r), fc=single_split(0, r), xav=single_split(0, r),
                     trunc=single_split(0, r), kn=single_split(0, r), ln="cpu", head=single_split(0, r))
    cols = composite(emb=single_split(1, rev, uneven_d),
                     fc=composite(weight=single_split(1, r, uneven_d)),
                     xav=composite(weight=single_split(1, rev, uneven_h)),
                     trunc=composite(weight=single_split(1, r)), kn=composite(weight=single_split(1, rev)),
                     head=single_split(1, rev))
    mixed = composite(**{"emb": single_split(1, r), "fc": single_split(0, rev), "xav.weight": single_split(1, r),
                         "trunc": single_split(0, r, uneven_h), "kn.weight": single_split(1, r),
                         "head": single_split(0, r)})
    return {"rows": rows, "cols": cols, "mixed": mixed}


def tp_spec(world: int, variant: int) -> object:
    """Tensor-parallel specs for TinyLM; variant 1 splits the other way where it can."""
    r = ranks(world)
    rev = list(reversed(r))
    if variant == 0:
        sizes = [HIDDEN - 4 * (world - 1)] + [4] * (world - 1)
        return composite(
            emb=single_split(0, r),                                              # vocabulary split
            blocks=composite(**{
                "0": composite(fc1=single_split(0, r), fc2=composite(weight=single_split(1, r))),
                "1": composite(fc1=single_split(0, rev, sizes),                  # uneven, permuted
                               fc2=composite(weight=single_split(1, rev, sizes), bias=single_split(0, r))),
            }),
            ln_f="cpu",
            head=single_split(1, r))                                             # input features split
    return composite(
        emb=single_split(1, rev),                                                # embedding-dim split
        **{"blocks.0.fc1.weight": single_split(0, r), "blocks.0.fc2.weight": single_split(1, r),
           "blocks.1.fc1": single_split(0, r), "blocks.1.fc2.bias": single_split(0, rev)},
        head=single_split(0, rev))                                               # output features split


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (4, 6), generator=g)
    return idx, torch.randint(0, VOCAB, (4, 6), generator=g)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    idx, target = batch(step)
    return F.cross_entropy(model(idx).reshape(-1, VOCAB), target.reshape(-1))


def real_lm() -> TinyLM:
    torch.manual_seed(7)
    return TinyLM()


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        optim.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)  # type: ignore[arg-type]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of the state_dict as a full tensor. Collective."""
    out = {}
    for key, value in model.state_dict().items():
        out[key] = value.full_tensor() if isinstance(value, st.ShardedTensor) else value.clone()
    return out


def local_boxes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """Where each parameter's local tensor sits in the global tensor (None: not sharded)."""
    rank = dist.get_rank()
    out = {}
    for mod_name, module in model.named_modules():
        for attr, sp in sharded_parameters(module).items():
            out[f"{mod_name}.{attr}" if mod_name else attr] = sp.box(rank)
    return out


# -- checks run on every rank ------------------------------------------------------------------------

def check_init_invariance(world: int) -> dict[str, dict[str, torch.Tensor]]:
    results = {}
    for name, spec in init_specs(world).items():
        with torch.device("meta"):
            model = InitNet()
        st.shard_model(model, spec, seed=1234)
        results[name] = full_state(model)
    return results


def check_unseeded_replicas(world: int) -> dict[str, torch.Tensor]:
    """No seed: rank 0 draws one, so replicated parameters agree and shards tile consistently."""
    with torch.device("meta"):
        model = InitNet()
    st.shard_model(model, composite(fc=single_split(0, ranks(world)), ln="cpu"))
    gathered = full_state(model)
    out = {}
    for key in ("ln.weight", "fc.weight", "emb.weight"):
        mine = gathered[key]
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        out[key] = torch.stack(everyone)
    return out


def check_src_rank(world: int) -> dict[str, torch.Tensor]:
    """Rank 0 holds real weights, the others only meta: each receives its blocks."""
    if dist.get_rank() == 0:
        model = real_lm()
    else:
        with torch.device("meta"):
            model = TinyLM()
    st.shard_model(model, tp_spec(world, 0), src_rank=0)
    return full_state(model)


def check_mlp_collectives(world: int) -> dict[str, object]:
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(3)
    reference = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
    mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
    mlp.load_state_dict(reference.state_dict())
    r = ranks(world)
    st.shard_model(mlp, composite(**{"0": single_split(0, r), "2.weight": single_split(1, r)}))
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(4))
    with st.CommCounter() as counter, CommDebugMode() as debug:
        out = mlp(x)
    forward_counts = dict(counter.counts)
    c10d_counts = {str(op): n for op, n in debug.get_comm_counts().items()}
    x_grad = x.clone().requires_grad_()
    with st.CommCounter() as backward_counter:
        mlp(x_grad).sum().backward()
    direct = mlp[0](x)  # a sharded layer called on its own gathers its output
    return {"forward": forward_counts, "c10d": c10d_counts, "out": out.detach(),
            "expected": reference(x).detach(), "fwd_bwd": dict(backward_counter.counts),
            "x_grad": x_grad.grad, "direct": direct.detach(), "direct_expected": reference[0](x).detach(),
            "graph": type(mlp.forward).__name__}


def check_embedding_chain(world: int) -> dict[str, torch.Tensor]:
    """Embedding split on dim 1 feeding an out-split Linear, GELU, in-split Linear."""
    torch.manual_seed(5)
    reference = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 10))
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 10))
    model.load_state_dict(reference.state_dict())
    r = ranks(world)
    st.shard_model(model, composite(**{"0": single_split(1, r), "1": single_split(0, r),
                                       "3.weight": single_split(1, r)}))
    tokens = torch.tensor([[1, 4, 9], [0, 2, 7]])
    return {"out": model(tokens).detach(), "expected": reference(tokens).detach()}


def check_refusals(world: int) -> dict[str, str]:
    r = ranks(world)
    messages: dict[str, str] = {}

    def refused(label: str, make: object, spec: object, **kwargs: object) -> None:
        try:
            st.shard_model(make(), spec, **kwargs)  # type: ignore[operator]
        except (ValueError, TypeError) as exc:
            messages[label] = f"{type(exc).__name__}: {exc}"
        else:
            messages[label] = "accepted"

    def tied() -> nn.Module:
        class Tied(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(VOCAB, DIM)

            def forward(self, idx: torch.Tensor) -> torch.Tensor:
                return F.linear(self.emb(idx), self.emb.weight)  # reads the split weight directly
        return Tied()

    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))

    def on_meta(cls: type[nn.Module]) -> nn.Module:
        with torch.device("meta"):
            return cls()

    refused("layernorm", TinyLM, composite(ln_f=single_split(0, r)))
    refused("mesh", lambda: nn.Linear(8, 8), composite(weight=mesh([r[:2], r[2:4]]) if world == 4 else mesh([r])))
    refused("bias", lambda: nn.Linear(DIM, HIDDEN),
            composite(weight=single_split(0, r), bias=single_split(0, r, [HIDDEN - world + 1] + [1] * (world - 1))))
    refused("not_a_block", lambda: nn.Linear(8, 8), composite(weight=single_split(1, r + r)))  # packed inputs
    refused("max_norm", lambda: nn.Embedding(VOCAB, DIM, max_norm=1.0), single_split(0, r))
    refused("freq", lambda: nn.Embedding(VOCAB, DIM, scale_grad_by_freq=True), single_split(0, r))
    refused("rank", lambda: nn.Linear(8, 8), single_split(0, [*r, f"rank:{world}/cpu"]))
    refused("mha", lambda: nn.MultiheadAttention(DIM, 2), composite(**{"out_proj.weight": single_split(0, r)}))
    refused("direct", tied, composite(emb=single_split(0, r)))
    refused("unknown", TinyLM, composite(nope=single_split(0, r)))
    refused("no_reset", lambda: on_meta(NoReset), DevicePlacement("cpu"))
    refused("type", TinyLM, "rank:0/cpu")
    refused("partial", lambda: nn.Linear(8, 8), single_split(0, ["cpu", r[0]]) if world > 1 else "cpu")
    refused("different", lambda: nn.Linear(8, 8 + (dist.get_rank() > 0)), single_split(0, r))
    return messages


def check_adjacent_shards(world: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A spec repeating a rank on adjacent shards: one local block, still computed right."""
    torch.manual_seed(5)
    reference = nn.Linear(DIM, 2 * world + 1)
    layer = nn.Linear(DIM, 2 * world + 1)
    layer.load_state_dict(reference.state_dict())
    placement = [r for r in ranks(world) for _ in range(2)]
    st.shard_parameter(layer, "weight", single_split(0, placement))
    st.shard_parameter(layer, "bias", single_split(0, placement))
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(6))
    return layer(x).detach(), reference(x).detach(), list(layer.weight.shape)


def check_train_and_save(world: int, path: str) -> dict[str, object]:
    """4 ranks: train with AdamW, save model and optimizer state with checkpoint.save."""
    model = real_lm()  # every rank holds the same weights: each keeps its own block
    st.shard_model(model, tp_spec(world, 0))
    optim = adamw(model.parameters())
    losses = []
    for step in range(STEPS_BEFORE):
        optim.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optim.step()
        losses.append(loss.item())
    checkpoint.save({"model": model.state_dict(), "optim": st.optim_state_dict(model, optim)}, path)
    return {"losses": losses, "grads": grads, "boxes": local_boxes(model), "final": full_state(model),
            "ln": model.blocks[0].ln.weight.detach().clone()}


def check_load_and_resume(world: int, path: str) -> dict[str, object]:
    """2 ranks, another spec, built on meta: load, resume training, same losses as one process."""
    with torch.device("meta"):
        model = TinyLM()
    st.shard_model(model, tp_spec(world, 1), seed=99)
    optim = adamw(model.parameters())
    state = {"model": model.state_dict(), "optim": st.optim_state_dict(model, optim)}
    checkpoint.load(state, path)
    model.load_state_dict(state["model"])
    st.load_optim_state_dict(model, optim, state["optim"])
    losses = train(model, optim, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return {"losses": losses, "final": full_state(model)}


def check_sgd_training(world: int) -> dict[str, object]:
    """SGD with momentum on a meta-built model: losses and every local gradient vs one process."""
    model = real_lm()
    st.shard_model(model, tp_spec(world, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optim.zero_grad()
    loss_of(model, 0).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optim.zero_grad()
    losses = train(model, optim, range(4))
    return {"losses": losses, "grads": grads, "boxes": local_boxes(model),
            "ln": [model.blocks[0].ln.weight.detach().clone(), model.ln_f.bias.detach().clone()]}


def check_state_moves(world: int) -> dict[str, object]:
    """load_state_dict from another layout and from full tensors; Adam state across layouts."""
    source = real_lm()
    st.shard_model(source, tp_spec(world, 0))
    optim = torch.optim.Adam(source.parameters(), lr=0.01)
    train(source, optim, range(2))
    model_sd, optim_sd = source.state_dict(), st.optim_state_dict(source, optim)

    with torch.device("meta"):
        target = TinyLM()
    st.shard_model(target, tp_spec(world, 1), seed=5)
    target.load_state_dict(model_sd)                  # ShardedTensors in another layout: resharded
    target_optim = torch.optim.Adam(target.parameters(), lr=0.01)
    st.load_optim_state_dict(target, target_optim, optim_sd)
    train(source, optim, range(2, 4))
    train(target, target_optim, range(2, 4))
    moved = {"source": full_state(source), "target": full_state(target)}

    full = {k: v for k, v in full_state(source).items()}
    with torch.device("meta"):
        again = TinyLM()
    st.shard_model(again, tp_spec(world, 0), seed=6)
    again.load_state_dict(full)                        # full tensors: each rank takes its block
    moved["from_full"] = full_state(again)
    moved["source_after"] = full
    return moved


def _world4(rank: int, world: int, path: str) -> dict[str, object]:
    return {"init": check_init_invariance(world), "unseeded": check_unseeded_replicas(world),
            "src": check_src_rank(world), "mlp": check_mlp_collectives(world),
            "refusals": check_refusals(world), "adjacent": check_adjacent_shards(world),
            "train": check_train_and_save(world, path)}


def _world2(rank: int, world: int, path: str) -> dict[str, object]:
    return {"init": check_init_invariance(world), "resume": check_load_and_resume(world, path),
            "sgd": check_sgd_training(world), "moves": check_state_moves(world),
            "mlp": check_mlp_collectives(world), "chain": check_embedding_chain(world)}


# -- the tests -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, object]]]:
    path = str(tmp_path_factory.mktemp("ckpt") / "lm")
    four = run_distributed(_world4, 4, path, timeout=180)
    two = run_distributed(_world2, 2, path, timeout=180)
    return {4: four, 2: two}


def world_of_one_init() -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = InitNet()
    st.shard_model(model, DevicePlacement("cpu"), seed=1234)
    return {k: v.full_tensor() if isinstance(v, st.ShardedTensor) else v for k, v in model.state_dict().items()}


def reference_training(optimizer: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
    model = real_lm()
    optim = adamw(model.parameters()) if optimizer == "adamw" else torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9)
    optim.zero_grad()
    loss_of(model, 0).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optim.zero_grad()
    return train(model, optim, range(steps)), grads, model


def _block(t: torch.Tensor, box: tuple[tuple[int, ...], tuple[int, ...]] | None) -> torch.Tensor:
    if box is None:
        return t
    return t[tuple(slice(o, o + n) for o, n in zip(*box))]


@pytest.mark.parametrize("world", [4, 2])
def test_meta_init_is_bit_identical_across_world_sizes_and_specs(runs, world):
    expected = world_of_one_init()
    assert torch.equal(expected["emb.weight"][3], torch.zeros(DIM))  # padding row by global index
    bound = 1 / math.sqrt(DIM)  # kaiming_uniform_(a=sqrt(5)) on fc: fan_in from the global shape
    assert expected["fc.weight"].abs().max() <= bound and expected["fc.weight"].abs().max() > 0.9 * bound
    for rank, result in enumerate(runs[world]):
        for spec_name, state in result["init"].items():
            assert state.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(state[key], value), f"world {world}, rank {rank}, spec {spec_name}: {key}"


def test_unseeded_meta_init_agrees_across_ranks(runs):
    stacked = runs[4][0]["unseeded"]
    for key, values in stacked.items():
        for r in range(1, 4):
            assert torch.equal(values[r], values[0]), key
    assert not torch.equal(stacked["fc.weight"][0], world_of_one_init()["fc.weight"])  # a drawn seed


def test_src_rank_model_is_sharded_from_its_weights(runs):
    expected = real_lm().state_dict()
    for result in runs[4]:
        for key, value in expected.items():
            assert torch.equal(result["src"][key], value), key


@pytest.mark.parametrize("world", [4, 2])
def test_mlp_forward_does_one_all_reduce(runs, world):
    for result in runs[world]:
        mlp = result["mlp"]
        assert mlp["graph"] == "ZoneForward"
        assert mlp["forward"] == {"all_reduce": 1}
        assert list(mlp["c10d"].values()) == [1] and "allreduce" in next(iter(mlp["c10d"]))
        # backward adds one all-reduce for the input's gradient
        assert mlp["fwd_bwd"] == {"all_reduce": 2}
        torch.testing.assert_close(mlp["out"], mlp["expected"])
        torch.testing.assert_close(mlp["direct"], mlp["direct_expected"])
    torch.manual_seed(3)
    reference = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(4)).requires_grad_()
    reference(x).sum().backward()
    for result in runs[world]:
        torch.testing.assert_close(result["mlp"]["x_grad"], x.grad)


@pytest.mark.parametrize(("label", "pattern"), [
    pytest.param("layernorm", r"ValueError: module 'ln_f' \(LayerNorm\): 'weight' is split.*only in modules with a "
                              r"sharded registration: Embedding, Linear", id="layernorm-split"),
    pytest.param("mesh", r"ValueError: the root module \(Linear\): weight is split into blocks along several "
                         r"dimensions", id="linear-mesh"),
    pytest.param("bias", r"ValueError: the root module \(Linear\): the bias is split as .* but the weight's output "
                         r"features as", id="bias-split-differently"),
    pytest.param("not_a_block", r"ValueError: the root module \(Linear\): weight is split into several non-adjacent "
                                r"slices per rank along dimension 1", id="repeated-rank"),
    pytest.param("max_norm", r"ValueError: the root module \(Embedding\): max_norm=1.0", id="embedding-max-norm"),
    pytest.param("freq", r"ValueError: .*scale_grad_by_freq=True.*split the embedding dimension",
                 id="embedding-grad-by-freq"),
    pytest.param("rank", r"ValueError: parameter 'weight' \(size \(8, 8\)\): .*rank 4.*world has 4 ranks",
                 id="rank-outside-world"),
    pytest.param("mha", r"ValueError: the root module \(MultiheadAttention\): out_proj.weight split along dim 0; "
                        r"split its heads: in_proj_weight with single_split\(0, ranks \* 3\)",
                 id="attention-not-split-by-heads"),
    pytest.param("direct", r"ValueError: .*parameter 'emb.weight' is split across ranks, but the forward of "
                           r"the root module \(Tied\) uses it directly", id="direct-use-fx"),
    pytest.param("unknown", r"ValueError: CompositeShardingSpec key 'nope' matches no parameter", id="unknown-name"),
    pytest.param("no_reset", r"ValueError: the root module \(NoReset\) has parameters on the meta device and nothing "
                             r"to initialize them: no reset_parameters\(\)", id="meta-without-reset"),
    pytest.param("type", r"TypeError: sharding_spec must be a CompositeShardingSpec or a tensor spec",
                 id="not-a-spec"),
    pytest.param("partial", r"ValueError: the root module \(Linear\): weight is held by some ranks but not all",
                 id="partial-replication"),
    pytest.param("different", r"ValueError: shard_model must be called with the same model and arguments on every "
                              r"rank, but params differs between rank 0 and rank 1", id="models-differ"),
])
def test_uncomputable_specs_are_refused(runs, label, pattern):
    import re

    for result in runs[4]:
        assert re.search(pattern, result["refusals"][label], re.S), result["refusals"][label]


def test_adjacent_shards_of_one_rank_form_one_local_block(runs):
    for rank, result in enumerate(runs[4]):
        out, expected, shape = result["adjacent"]
        torch.testing.assert_close(out, expected)
        assert shape[0] == [4, 4, 1, 0][rank]  # 9 rows in 8 chunks 2/2/2/2/1/0/0/0, two per rank


def test_training_matches_one_process_and_resumes_from_checkpoint_on_another_world(runs):
    losses, grads, model = reference_training("adamw", STEPS_BEFORE + STEPS_AFTER)
    final = {k: v.detach() for k, v in model.state_dict().items()}
    for rank, result in enumerate(runs[4]):
        trained = result["train"]
        assert trained["losses"] == pytest.approx(losses[:STEPS_BEFORE], rel=1e-5)
        for name, grad in trained["grads"].items():
            torch.testing.assert_close(grad, _block(grads[name], trained["boxes"].get(name)),
                                       msg=f"rank {rank}: gradient of {name}")
        assert torch.equal(trained["ln"], runs[4][0]["train"]["ln"])  # replicas stay identical
    for result in runs[2]:
        resumed = result["resume"]
        assert resumed["losses"] == pytest.approx(losses[STEPS_BEFORE:], rel=1e-5)
        for key, value in final.items():
            torch.testing.assert_close(resumed["final"][key], value, atol=2e-6, rtol=1e-5, msg=key)


def test_sgd_momentum_training_and_gradients_match_one_process(runs):
    losses, grads, _ = reference_training("sgd", 4)
    for rank, result in enumerate(runs[2]):
        sgd = result["sgd"]
        assert sgd["losses"] == pytest.approx(losses, rel=1e-5)
        for name, grad in sgd["grads"].items():
            torch.testing.assert_close(grad, _block(grads[name], sgd["boxes"].get(name)),
                                       msg=f"rank {rank}: gradient of {name}")
    for a, b in zip(runs[2][0]["sgd"]["ln"], runs[2][1]["sgd"]["ln"]):
        assert torch.equal(a, b)


def test_state_dicts_move_between_layouts(runs):
    for result in runs[2]:
        moves = result["moves"]
        for key, value in moves["source"].items():
            torch.testing.assert_close(moves["target"][key], value, msg=key)
            assert torch.equal(moves["from_full"][key], moves["source_after"][key]), key


def test_embedding_split_on_dim_feeds_a_sharded_mlp(runs):
    for result in runs[2]:
        chain = result["chain"]
        torch.testing.assert_close(chain["out"], chain["expected"])
