"""``st.fully_shard`` on real Gloo ranks, against one process training on the whole batch.

One spawn of 2 ranks and one of 3 (every split uneven, a trailing rank may hold no rows)
each run every scenario below; each scenario is its own test, reading its part of the
spawn's results (the spawn runs once per world, on first use):

* an MLP with uneven sizes (blocks fully sharded, then the root) and a tiny transformers
  Llama (each decoder layer, then the model), trained 5 steps with SGD (momentum) and with
  AdamW on a share of the batch each, give the losses and the parameters of one process
  trained on the whole batch, within 1e-6 relative; ``model.parameters()`` are the local rows;
* communication: one all-gather per unit in forward, one more per resharded unit in
  backward, one reduce-scatter per unit, with the bytes of the flat buffers; the next
  unit's gather is posted before a unit computes (prefetch); between steps no unit holds
  gathered parameters; the reduced gradients are, bit for bit, the sum of every rank's
  whole gradients in rank order over the number of ranks, and a unit's local ``.grad`` are
  views of one buffer;
* ``st.clip_grad_norm_`` gives torch's norm and clipped update on the whole model;
* gradient accumulation: 2 or 3 micro-batches, all but the last under ``st.no_sync`` (no
  reduce-scatter), give the whole batch's step; without ``no_sync`` too;
* a forward with gradients and no backward, then an optimizer step (on the gradients left
  from the step before): the next forward computes with the updated parameters, as torch does;
* a parameter no forward uses keeps ``.grad`` ``None`` (also through a ``no_sync``
  accumulation), so AdamW's weight decay leaves it as torch does;
* mixed precision: compute in bfloat16 (the layers see bfloat16 weights), master shards,
  gradients and AdamW state in float32, reduction in float32; close to the float32 run;
* from the meta device: a Llama built on meta, fully sharded, then ``shard_model(model,
  composite(), seed=7)``: no tensor near a whole parameter's size is ever created, each rank
  holds its share of the bytes (plus at most a row per parameter), the values are bit for bit
  those of the same model built whole with the same seed; it trains like it (1e-6), and a
  checkpoint of it loads into another meta-built model (``init=False``) bit for bit;
* errors, identical on every rank and leaving the group usable: a module fully sharded
  twice, a parent before its child, ranks that do not divide the world (3 ranks), that leave
  this rank out or name ranks outside it, a parameter tied across units, a forward before meta
  parameters are materialized, and an optimizer built before ``fully_shard`` (refused at
  ``step``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import sharded_tensor as st
from tests.distributed._fully_shard_models import fully_shard_llama, fully_shard_mlp, tiny_llama, uneven_mlp
from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed

BATCH, STEPS, TOL = 6, 5, 1e-6
WORLDS = [pytest.param(2, id="2ranks"), pytest.param(3, id="3ranks")]


def _llama() -> nn.Module:
    return tiny_llama(vocab=37)


def _data(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)
    tokens = torch.randint(0, 37, (BATCH, 9), generator=g)
    return tokens, tokens


def _loss(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return F.mse_loss(model(x), y)
    return model(input_ids=x, labels=y).loss  # type: ignore[no-any-return]


def _optim(name: str, params: object) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)  # type: ignore[arg-type]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||``: a few elements where Adam's ``g / (sqrt(v) + eps)`` meets a gradient near
    ``eps`` turn last-bit differences of the whole-batch sum into larger ones, element by element."""
    if not b.double().norm() > 0:
        return float((a.double() - b.double()).norm())
    return float((a.double() - b.double()).norm() / b.double().norm())


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (fully sharded ones gathered), by name."""
    from sharded_tensor._model.record import record_of

    out = {}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for name, p in model.named_parameters():
        layout = record_of(p)
        out[name] = layout.wrap(p.grad, rank).full_tensor() if layout is not None else p.grad.clone()
    return out


def _train(kind: str, model: nn.Module, optim: torch.optim.Optimizer, rows: slice, *, clip: float | None = None,
           micro: int = 1, no_sync: bool = False, deferred: list[int] | None = None
           ) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Train ``STEPS`` steps; ``deferred`` collects the reduce-scatters run inside ``no_sync`` (none, if it defers)."""
    losses, norms = [], []
    first: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        x, y = _data(kind, step)
        x, y = x[rows], y[rows]
        optim.zero_grad()
        total = 0.0
        pieces = list(zip(x.chunk(micro), y.chunk(micro)))
        for i, (xi, yi) in enumerate(pieces):
            inside = no_sync and i < len(pieces) - 1
            with st.no_sync(model) if inside else _Null(), st.CommCounter() as comm:
                loss = _loss(kind, model, xi, yi) / micro
                loss.backward()
            if inside and deferred is not None:
                deferred.append(comm.counts.get("reduce_scatter", 0))
            total += loss.item()
        if step == 0:
            first = _full_grads(model)
        if clip is not None:
            norms.append(float(st.clip_grad_norm_(model, clip)))
        optim.step()
        losses.append(total)
    return losses, norms, first


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _compare(rank: int, world: int, kind: str, optim_name: str, **kwargs: object) -> dict[str, float]:
    """Relative differences of the fully sharded run from the whole-batch run."""
    build = uneven_mlp if kind == "mlp" else _llama
    shard = fully_shard_mlp if kind == "mlp" else fully_shard_llama
    ref = build()
    ref_optim = _optim(optim_name, ref.parameters())
    clip = kwargs.pop("clip", None)
    micro = int(kwargs.pop("micro", 1))  # type: ignore[call-overload]
    no_sync = bool(kwargs.pop("no_sync", False))
    ref_losses, ref_norms = [], []
    for step in range(STEPS):
        x, y = _data(kind, step)
        ref_optim.zero_grad()
        loss = _loss(kind, ref, x, y)
        loss.backward()
        if step == 0:
            ref_first = {n: p.grad.clone() for n, p in ref.named_parameters()}
        if clip is not None:
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))  # type: ignore[arg-type]
        ref_optim.step()
        ref_losses.append(loss.item())
    model = shard(build(), **kwargs)
    optim = _optim(optim_name, model.parameters())
    per = BATCH // world
    deferred: list[int] = []
    losses, norms, first = _train(kind, model, optim, slice(rank * per, (rank + 1) * per), clip=clip,  # type: ignore[arg-type]
                                  micro=micro, no_sync=no_sync, deferred=deferred)
    # Losses are per-rank means; their average over ranks is the whole batch's.
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(mean_losses)
    out = {"loss": max(abs(a / world - b) / abs(b) for a, b in zip(mean_losses.tolist(), ref_losses))}
    if no_sync:  # the micro-batches inside no_sync ran no reduce-scatter at all
        out["reduce_scatters inside no_sync"] = float(sum(deferred)) if len(deferred) == STEPS * (micro - 1) else 1.0
    for name, grad in first.items():
        out[f"grad {name}"] = _rel(grad, ref_first[name])
    if clip is not None:
        out["norm"] = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    state, ref_state = model.state_dict(), ref.state_dict()
    for name, value in state.items():
        full = value.full_tensor() if isinstance(value, st.ShardedTensor) else value
        out[name] = _rel(full, ref_state[name])
    # The optimizer state is laid out like the parameters too.
    for name, entry in st.optim_state_dict(model, optim)["state"].items():
        ref_param = dict(ref.named_parameters())[name]
        ref_entry = ref_optim.state[ref_param]
        for key, value in entry.items():
            if isinstance(value, st.ShardedTensor):
                out[f"optim {name} {key}"] = _rel(value.full_tensor(), ref_entry[key])
    return out


class _Watch:
    """Records, at each unit's forward, whether the next unit's gather was already posted."""

    def __init__(self, units: list) -> None:  # type: ignore[type-arg]
        self.units = units
        self.prefetched: list[bool] = []
        self.dtypes: list[torch.dtype] = []

    def __call__(self, module: nn.Module, args: object) -> None:
        from sharded_tensor._fsdp.unit import unit_of

        unit = unit_of(module)
        if unit in self.units:
            i = self.units.index(unit)
            if i + 1 < len(self.units):
                self.prefetched.append(self.units[i + 1].state != "sharded")
        # What the unit's modules see now: its parameters as compute gets them.
        self.dtypes.extend(getattr(owner, attr).dtype for owners in unit.owners for owner, attr in owners)


def _mechanics(rank: int, world: int) -> dict[str, object]:
    from sharded_tensor._fsdp.unit import unit_of

    out: dict[str, object] = {}
    model = fully_shard_mlp(uneven_mlp())
    units = [u for m in model.modules() if (u := unit_of(m)) is not None]
    out["local_shapes"] = [tuple(p.shape) for p in model.parameters()]
    out["param_types"] = sorted({type(p).__name__ for p in model.parameters()})
    watch = _Watch(units)
    for unit in units:
        unit.module.register_forward_pre_hook(watch)  # runs after the unit's own pre-hook
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data("mlp", 0)
    with st.CommCounter() as comm:
        F.mse_loss(model(x[:2]), y[:2]).backward()
    optim.step()
    out["counts"] = dict(comm.counts)
    out["bytes"] = dict(comm.bytes_by_op)
    out["segments"] = [u.plan.segment for u in units]
    out["prefetched"] = watch.prefetched
    out["held_after_step"] = [u.unsharded.untyped_storage().nbytes() for u in units]
    out["states_after_step"] = [u.state for u in units]
    out["grad_shapes_match"] = all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    # A forward without grad frees everything too.
    with torch.no_grad():
        model(x)
    out["held_after_no_grad"] = [u.unsharded.untyped_storage().nbytes() for u in units]

    # The reduction, bit for bit: each rank's whole gradients (of its own rows of the batch) summed
    # over the ranks in rank order, divided by their number; the local .grad are views of one
    # reduced buffer per unit, not copies.
    reduced = fully_shard_mlp(uneven_mlp())
    ref = uneven_mlp()
    rows = slice(rank * (BATCH // world), (rank + 1) * (BATCH // world))
    F.mse_loss(reduced(x[rows]), y[rows]).backward()
    F.mse_loss(ref(x[rows]), y[rows]).backward()
    mismatched = []
    got = _full_grads(reduced)
    for name, p in ref.named_parameters():
        every = [torch.empty_like(p.grad) for _ in range(world)]
        torch.distributed.all_gather(every, p.grad)
        total = every[0] + every[1]
        for g in every[2:]:
            total += g
        if not torch.equal(got[name], total / world):
            mismatched.append(name)
    out["reduced_mismatched"] = mismatched
    reduced_units = [u for m in reduced.modules() if (u := unit_of(m)) is not None]
    out["grad_buffers_per_unit"] = [len({p.grad.untyped_storage().data_ptr() for p in u.local if p.grad is not None
                                         and p.numel()}) for u in reduced_units]

    # Mixed precision: bfloat16 compute, float32 masters, gradients and optimizer state.
    mixed = fully_shard_mlp(uneven_mlp(), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed_units = [u for m in mixed.modules() if (u := unit_of(m)) is not None]
    watch = _Watch(mixed_units)
    for unit in mixed_units:
        unit.module.register_forward_pre_hook(watch)
    adam = torch.optim.AdamW(mixed.parameters(), lr=0.01)
    per = BATCH // world
    mixed_out = mixed(x[rank * per:(rank + 1) * per])
    mixed_loss = F.mse_loss(mixed_out, y[rank * per:(rank + 1) * per])
    with st.CommCounter() as comm:
        mixed_loss.backward()
    adam.step()
    ref = uneven_mlp()
    ref_loss = F.mse_loss(ref(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
    out["mixed_compute_dtypes"] = sorted({str(d) for d in watch.dtypes})
    out["mixed_output_dtype"] = str(mixed_out.dtype)
    out["mixed_loss_rel"] = abs(mixed_loss.item() - ref_loss.item()) / ref_loss.item()
    out["mixed_master_dtypes"] = sorted({str(p.dtype) for p in mixed.parameters()})
    out["mixed_grad_dtypes"] = sorted({str(p.grad.dtype) for p in mixed.parameters() if p.grad is not None})
    out["mixed_state_dtypes"] = sorted({str(v.dtype) for s in adam.state.values() for k, v in s.items()
                                        if k != "step"})
    out["mixed_reduce_bytes"] = comm.bytes_by_op["reduce_scatter"]
    out["mixed_reduce_elems"] = sum((world - 1) * u.plan.segment for u in mixed_units)
    return out


def _errors(rank: int, world: int) -> dict[str, str]:
    out: dict[str, str] = {}

    def attempt(key: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn()
        except (ValueError, TypeError, RuntimeError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
        else:
            out[key] = "no error"

    model = fully_shard_mlp(uneven_mlp())
    attempt("twice", lambda: st.fully_shard(model))
    child_after = uneven_mlp()
    st.fully_shard(child_after)
    attempt("parent_first", lambda: st.fully_shard(child_after[0]))
    if world == 3:  # a world of 2 has no uneven split into groups
        attempt("not_dividing", lambda: st.fully_shard(uneven_mlp(), [0, 1] if rank < 2 else [2]))
    attempt("not_including", lambda: st.fully_shard(uneven_mlp(), [r for r in range(world) if r != rank]))
    attempt("outside", lambda: st.fully_shard(uneven_mlp(), list(range(world + 1))))
    attempt("dtype", lambda: st.fully_shard(uneven_mlp(), param_dtype=torch.int8))
    tied = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    tied[1].weight = tied[0].weight
    st.fully_shard(tied[0])
    attempt("tied", lambda: st.fully_shard(tied))
    with torch.device("meta"):
        meta = nn.Linear(3, 4)
    attempt("meta", lambda: st.fully_shard(meta)(torch.ones(2, 3)))  # rows never materialized
    early = uneven_mlp()
    optim = torch.optim.SGD(early.parameters(), lr=0.1)
    fully_shard_mlp(early)
    F.mse_loss(early(torch.ones(2, 5)), torch.zeros(2, 3)).backward()
    attempt("optimizer_before", optim.step)
    # The group still works after all of these.
    out["after"] = str(F.mse_loss(model(torch.ones(2, 5)), torch.zeros(2, 3)).item() > 0)
    return out


class _Largest(TorchDispatchMode):
    """The most elements of any floating-point tensor an op creates (not counting agreement payloads)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta:
                self.numel = max(self.numel, t.numel())
        return out


def _meta_llama(init: object = None) -> nn.Module:
    from sharding import composite

    with torch.device("meta"):
        model = _llama()
    with _Largest() as largest:
        fully_shard_llama(model)
        st.shard_model(model, composite(), seed=7, init=init)  # type: ignore[arg-type]
    model.largest = largest.numel  # type: ignore[assignment]
    return model


def _from_meta(rank: int, world: int, root: str) -> dict[str, object]:
    """Built on meta, fully sharded, then each rank's rows allocated and initialized; trained, saved, loaded."""
    import checkpoint
    from sharding import composite

    model = _meta_llama()
    with torch.device("meta"):
        whole = _llama()
    st.shard_model(whole, composite(), seed=7)  # the same model, built whole, the same seed
    out: dict[str, object] = {"largest_created": model.largest,
                              "largest_local": max(p.numel() for p in model.parameters()),
                              "largest_whole": max(p.numel() for p in whole.parameters()),
                              "held": sum(p.numel() * p.element_size() for p in model.parameters()),
                              "total": sum(p.numel() * p.element_size() for p in whole.parameters()),
                              "pad": sum(p.shape[1:].numel() * p.element_size() for p in whole.parameters()),
                              "devices": sorted({p.device.type for p in model.parameters()})}
    state = model.state_dict()
    out["init_equal"] = [k for k, v in whole.state_dict().items()
                         if not torch.equal(state[k].full_tensor() if isinstance(state[k], st.ShardedTensor)
                                            else state[k], v)]
    optim, whole_optim = _optim("adamw", model.parameters()), _optim("adamw", whole.parameters())
    per = BATCH // world
    losses, _, _ = _train("llama", model, optim, slice(rank * per, (rank + 1) * per))
    whole_losses = []
    for step in range(STEPS):
        x, y = _data("llama", step)
        whole_optim.zero_grad()
        loss = _loss("llama", whole, x, y)
        loss.backward()
        whole_optim.step()
        whole_losses.append(loss.item())
    mean = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(mean)
    out["loss_rel"] = max(abs(a / world - b) / abs(b) for a, b in zip(mean.tolist(), whole_losses))
    trained = {k: v.full_tensor() if isinstance(v, st.ShardedTensor) else v for k, v in model.state_dict().items()}
    out["trained_rel"] = max(_rel(v, whole.state_dict()[k]) for k, v in trained.items())
    path = f"{root}/from-meta"
    checkpoint.save(st.get_state_dict(model, optim), path)
    # Built on meta again, rows allocated uninitialized, filled by the load: what was saved, bit for bit.
    again = _meta_llama(init=False)
    again_optim = _optim("adamw", again.parameters())
    again_state = st.get_state_dict(again, again_optim)
    checkpoint.load(again_state, path)
    st.set_state_dict(again, again_optim, again_state)
    loaded = {k: v.full_tensor() if isinstance(v, st.ShardedTensor) else v for k, v in again.state_dict().items()}
    out["loaded_differs"] = [k for k, v in trained.items() if not torch.equal(loaded[k], v)]
    return out


def _stale(rank: int, world: int) -> dict[str, list[float]]:
    """A forward with gradients and no backward, then an optimizer step: the next forward's loss, against torch."""
    out: dict[str, list[float]] = {}
    for kind in ("mlp", "llama"):
        losses = []
        for sharded in (False, True):
            build = uneven_mlp if kind == "mlp" else _llama
            model = build()
            if sharded:
                (fully_shard_mlp if kind == "mlp" else fully_shard_llama)(model)
            optim = _optim("adamw", model.parameters())
            x, y = _data(kind, 0)
            _loss(kind, model, x, y).backward()
            optim.step()
            _loss(kind, model, x, y)  # gradients recorded, no backward (an evaluation, a skipped batch)
            optim.step()  # on the gradients of the first step: the parameters move again
            with torch.no_grad():
                losses.append(_loss(kind, model, x, y).item())
            losses.append(_loss(kind, model, x, y).item())
        out[kind] = losses
    return out


class _Partly(nn.Module):
    """Two layers of which forward uses one: ``unused`` never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 5)
        self.unused = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)  # type: ignore[no-any-return]


def _unused(rank: int, world: int) -> dict[str, object]:
    """An unused parameter keeps no gradient, with and without a no_sync accumulation, and AdamW leaves it alone."""
    out: dict[str, object] = {}
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(5))
    for micro in (1, 2):
        ref = _Partly()
        ref_optim = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.5)
        for _ in range(micro):
            ref(x).sum().backward()
        ref_optim.step()
        model = st.fully_shard(_Partly())
        optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        for i in range(micro):
            with st.no_sync(model) if i < micro - 1 else _Null():
                model(x).sum().backward()
        out[f"none {micro}"] = [name for name, p in model.named_parameters() if p.grad is None]
        out[f"ref none {micro}"] = [name for name, p in ref.named_parameters() if p.grad is None]
        optim.step()
        state = model.state_dict()
        out[f"diff {micro}"] = {name: _rel(state[name].full_tensor(), value)
                                for name, value in ref.state_dict().items()}
    return out


_SCENARIOS = ("meta", "mlp sgd", "mlp adamw", "llama sgd", "llama adamw", "clip", "no_sync", "accumulate",
              "keep_after_forward", "stale", "unused", "mechanics", "errors")


def _check(rank: int, world: int, root: str) -> dict[str, object]:
    results: dict[str, object] = {}
    results["meta"] = _from_meta(rank, world, root)
    for kind in ("mlp", "llama"):
        for optim_name in ("sgd", "adamw"):
            results[f"{kind} {optim_name}"] = _compare(rank, world, kind, optim_name)
    results["clip"] = _compare(rank, world, "mlp", "adamw", clip=0.05)
    micro = 2 if BATCH // world % 2 == 0 else 3  # equal micro-batches: their mean is the batch's
    results["no_sync"] = _compare(rank, world, "llama", "adamw", micro=micro, no_sync=True)
    results["accumulate"] = _compare(rank, world, "mlp", "sgd", micro=micro)
    results["keep_after_forward"] = _compare(rank, world, "llama", "sgd", reshard_after_forward=False)
    results["stale"] = _stale(rank, world)
    results["unused"] = _unused(rank, world)
    results["mechanics"] = _mechanics(rank, world)
    results["errors"] = _errors(rank, world)
    return results


def _spawn(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    pytest.importorskip("transformers")
    return run_distributed(_check, world, str(tmp_path_factory.mktemp(f"fully-shard-{world}")), timeout=600)


@pytest.fixture(scope="module")
def runs_2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return _spawn(2, tmp_path_factory)


@pytest.fixture(scope="module")
def runs_3(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return _spawn(3, tmp_path_factory)


@pytest.fixture
def runs(request: pytest.FixtureRequest, world: int) -> list[dict[str, object]]:
    """Every rank's results of the module's one spawn on ``world`` ranks (made once, on first use)."""
    found: list[dict[str, object]] = request.getfixturevalue(f"runs_{world}")
    return found


def _rows(n: int, world: int) -> list[int]:
    """Rows of each rank when ``n`` rows are split like ``torch.chunk``."""
    chunk = -(-n // world)
    return [max(0, min(n, (r + 1) * chunk) - min(n, r * chunk)) for r in range(world)]


@pytest.mark.parametrize("world", WORLDS)
def test_from_meta_allocates_only_local_rows_and_trains_like_the_whole_model(runs, world: int) -> None:
    for res in runs:
        meta = res["meta"]
        # Only this rank's rows were ever allocated: no tensor near the size of the largest parameter
        # (its rows are a share of it; the agreement's small payloads are counted too).
        assert meta["largest_local"] <= meta["largest_whole"] / world + 32, meta
        # Nothing near a whole parameter: below halfway between a rank's share and the whole.
        assert meta["largest_created"] < meta["largest_whole"] * (world + 1) / (2 * world), meta
        # Bytes held: a share of the model, plus at most one row per parameter (torch.chunk rounding up).
        assert meta["held"] <= meta["total"] / world + meta["pad"], meta
        assert meta["held"] >= meta["total"] / world - meta["pad"], meta
        assert meta["devices"] == ["cpu"]
        assert meta["init_equal"] == [], meta["init_equal"]  # the values of the whole model, bit for bit
        assert meta["loss_rel"] <= TOL and meta["trained_rel"] <= TOL, meta
        assert meta["loaded_differs"] == []


def _assert_close(runs: list[dict[str, object]], key: str) -> None:
    for rank, res in enumerate(runs):
        diffs = res[key]
        assert isinstance(diffs, dict) and len(diffs) > 3
        bad = {k: v for k, v in diffs.items() if not v <= TOL}
        assert not bad, f"rank {rank} {key}: {bad}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["mlp", "llama"])
@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_trains_like_one_process_on_the_whole_batch(runs, world: int, kind: str, optim_name: str) -> None:
    _assert_close(runs, f"{kind} {optim_name}")


@pytest.mark.parametrize("world", WORLDS)
def test_clip_grad_norm_gives_torchs_norm_and_update(runs, world: int) -> None:
    _assert_close(runs, "clip")
    assert all("norm" in res["clip"] for res in runs)


@pytest.mark.parametrize("world", WORLDS)
def test_no_sync_accumulation_gives_the_whole_batchs_step(runs, world: int) -> None:
    _assert_close(runs, "no_sync")
    assert all(res["no_sync"]["reduce_scatters inside no_sync"] == 0 for res in runs)  # deferred, not just summed


@pytest.mark.parametrize("world", WORLDS)
def test_accumulation_without_no_sync_gives_the_whole_batchs_step(runs, world: int) -> None:
    _assert_close(runs, "accumulate")


@pytest.mark.parametrize("world", WORLDS)
def test_keeping_parameters_after_forward_trains_alike(runs, world: int) -> None:
    _assert_close(runs, "keep_after_forward")


@pytest.mark.parametrize("world", WORLDS)
def test_a_forward_without_backward_then_a_step_leaves_no_stale_parameters(runs, world: int) -> None:
    for res in runs:
        for kind, (ref_no_grad, ref, no_grad, grad) in res["stale"].items():
            # The parameters moved twice; the sharded model computes with them, with or without grad.
            assert no_grad == pytest.approx(ref_no_grad, rel=1e-6, abs=1e-6), kind
            assert grad == pytest.approx(ref, rel=1e-6, abs=1e-6), kind


@pytest.mark.parametrize("world", WORLDS)
def test_an_unused_parameter_keeps_no_gradient_and_adamw_leaves_it(runs, world: int) -> None:
    for res in runs:
        unused = res["unused"]
        for micro in (1, 2):
            assert unused[f"none {micro}"] == unused[f"ref none {micro}"] == ["unused.weight", "unused.bias"]
            diffs = unused[f"diff {micro}"]
            # The unused layer exactly as it was (weight decay never touched it), the used one as torch's.
            assert diffs["unused.weight"] == 0.0 and diffs["unused.bias"] == 0.0, (micro, diffs)
            assert diffs["used.weight"] <= TOL and diffs["used.bias"] <= TOL, (micro, diffs)


@pytest.mark.parametrize("world", WORLDS)
def test_communication_prefetch_reduction_and_mixed_precision(runs, world: int) -> None:
    for rank, res in enumerate(runs):
        mech = res["mechanics"]
        # (5, 7) etc. split on dim 0 like torch.chunk: each rank's rows of 7, 11 and 2 rows.
        assert mech["local_shapes"][0] == (_rows(7, world)[rank], 5)
        assert mech["local_shapes"][2] == (_rows(11, world)[rank], 7)
        assert mech["local_shapes"][4] == (_rows(11, world)[rank],)
        assert mech["local_shapes"][6] == (_rows(2, world)[rank], 11)
        assert mech["param_types"] == ["Parameter"]
        units = len(mech["segments"])
        assert units == 3
        # Forward gathers every unit, backward the two non-root units again; one reduce-scatter each.
        assert mech["counts"] == {"all_gather": 2 * units - 1, "reduce_scatter": units}, mech["counts"]
        root, *blocks = mech["segments"]
        gathered = root + 2 * sum(blocks)
        assert mech["bytes"]["all_gather"] == (world - 1) * gathered * 4
        assert mech["bytes"]["reduce_scatter"] == (world - 1) * sum(mech["segments"]) * 4
        assert mech["prefetched"] == [True] * 4, mech["prefetched"]  # two forwards, two prefetches each
        assert mech["held_after_step"] == [0, 0, 0] and mech["states_after_step"] == ["sharded"] * 3
        assert mech["held_after_no_grad"] == [0, 0, 0]
        assert mech["reduced_mismatched"] == []
        assert all(n <= 1 for n in mech["grad_buffers_per_unit"]), mech["grad_buffers_per_unit"]
        assert mech["grad_shapes_match"]
        assert mech["mixed_compute_dtypes"] == ["torch.bfloat16"]
        assert mech["mixed_output_dtype"] == "torch.bfloat16"
        assert mech["mixed_loss_rel"] < 3e-2
        assert mech["mixed_master_dtypes"] == mech["mixed_grad_dtypes"] == ["torch.float32"]
        assert mech["mixed_state_dtypes"] == ["torch.float32"]
        assert mech["mixed_reduce_bytes"] == mech["mixed_reduce_elems"] * 4


@pytest.mark.parametrize("world", WORLDS)
def test_errors_are_identical_on_every_rank_and_leave_the_group_usable(runs, world: int) -> None:
    for rank, res in enumerate(runs):
        errors = res["errors"]
        others = [r for r in range(world) if r != rank]
        expected = {
            "twice": "ValueError: this Sequential is already fully sharded",
            "parent_first": "ValueError: parameter 'weight' is already fully sharded",
            "not_including": f"ValueError: ranks={others} does not include this",
            "outside": f"ValueError: ranks={list(range(world + 1))} names ranks [{world}] outside the world of {world}",
            "dtype": "TypeError: param_dtype must be a floating-point torch.dtype",
            "tied": "ValueError: parameter '1.weight' is shared with another fully sharded Embedding",
            "meta": "ValueError: the fully sharded Linear: parameters ['weight', 'bias'] are still on the meta",
            "optimizer_before": ("RuntimeError: SGD.step(): this optimizer holds 10 parameter(s) that "
                                 "st.fully_shard replaced"),
        }
        if world == 3:
            expected["not_dividing"] = "ValueError: the data-parallel groups [[0, 1], [2]] have different sizes [1, 2]"
        for key, start in expected.items():
            assert errors[key].startswith(start), (rank, key, errors[key])
        assert errors["after"] == "True"
