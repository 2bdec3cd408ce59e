"""Partial values on real Gloo ranks: reduce into random layouts bit for bit, minimal bytes, errors.

Hypothesis draws the cases in the parent (size, dtype, reduction, holders, target spec); one
spawn runs a whole list on every rank and returns every mismatch as data. Values are exact
in any order of reduction: random floats on 2 ranks (a + b == b + a), integer-valued floats
(and integers) on 4 ranks, so the reference can fold in holder order while the all-reduce
picks its own. ``max`` and ``min`` are exact in any order.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as hst

import checkpoint
import sharded_tensor as st
from sharding import (
    DevicePlacement,
    PartialSpec,
    ShardMetadata,
    partial,
    single_split,
    spec_from_dict,
)
from sharding.layout import Partial
from tests.distributed._cases import assert_no_problems, random_tensor, region
from tests.distributed._launch import run_distributed
from tests.unit.test_plan import sizes, specs

pytestmark = pytest.mark.distributed

CASES_PER_SPAWN = 16
SPAWN_SETTINGS = settings(max_examples=3, deadline=None, phases=[Phase.explicit, Phase.generate],
                          suppress_health_check=list(HealthCheck))
_FOLD = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}


@hst.composite
def cases(draw: hst.DrawFn, world: int) -> dict[str, object]:
    size = draw(sizes(max_ndim=3, max_dim=7))
    op = draw(hst.sampled_from(["sum", "sum", "avg", "max", "min"]))
    dtypes = {"sum": ["float32", "float64", "bfloat16", "int64"], "avg": ["float32", "float64"],
              "max": ["float32", "int64", "bool"], "min": ["float32", "bfloat16", "bool"]}[op]
    everyone = draw(hst.booleans())
    holders = list(range(world)) if everyone else sorted(draw(hst.sets(hst.integers(0, world - 1), min_size=1)))
    return {"size": list(size), "dtype": draw(hst.sampled_from(dtypes)), "op": op, "holders": holders,
            "dst": draw(specs(size, world)).to_dict()}


def _reference(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = _FOLD[op](acc, p)
    return acc / len(parts) if op == "avg" else acc


def _partial_tensor(rank: int, parts: dict[int, torch.Tensor], op: str, size: tuple[int, ...]) -> st.ShardedTensor:
    mine = [st.Shard(parts[rank].clone(), ShardMetadata((0,) * len(size), size, f"rank:{rank}/cpu"))] \
        if rank in parts else []
    return st.ShardedTensor.from_local_shards(mine, size, reduce_op=op)


def _run_cases(rank: int, world: int, case_list: list[dict[str, object]]) -> list[list[str]]:
    out = []
    for i, case in enumerate(case_list):
        size = tuple(case["size"])  # type: ignore[arg-type]
        dtype, op, holders = getattr(torch, str(case["dtype"])), str(case["op"]), list(case["holders"])  # type: ignore[arg-type]
        parts = {h: random_tensor(size, dtype, seed=100 * i + h, small_integers=world > 2) for h in holders}
        ref = _reference([parts[h] for h in holders], op)
        problems: list[str] = []
        t = _partial_tensor(rank, parts, op, size)
        md = t.sharding_metadata()
        if md.placement != Partial(op) or t.sharding_spec() != PartialSpec([f"rank:{h}/cpu" for h in holders],
                                                                           reduce_op=op):
            problems.append(f"layout {md} / spec {t.sharding_spec()} is not partial({op}) on {holders}")
        # full_tensor and gather reduce without changing the tensor.
        if not torch.equal(t.full_tensor(), ref):
            problems.append("full_tensor() differs from the reference")
        gathered = t.gather(dst=world - 1)
        if (rank == world - 1) != (gathered is not None) or (gathered is not None and not torch.equal(gathered, ref)):
            problems.append("gather(dst) differs from the reference")
        if rank in parts and not torch.equal(t.local_shard(), parts[rank]):
            problems.append("full_tensor/gather changed the local partial values")
        # A partial value cannot become one pending another reduction; nothing changes.
        other = "max" if op != "max" else "sum"
        if dtype != torch.bool or other in ("max", "min"):
            try:
                t.reshard(partial("cpu", reduce_op=other))
                problems.append(f"partial({op}) -> partial({other}) did not raise")
            except ValueError as exc:
                if "plain layout first" not in str(exc):
                    problems.append(f"partial({op}) -> partial({other}): unclear message {exc}")
            if t.sharding_metadata() != md:
                problems.append("refused reshard changed the layout")
        # Reduce into the drawn layout.
        dst = spec_from_dict(case["dst"])  # type: ignore[arg-type]
        with st.CommCounter() as comm:
            t.reshard(dst)  # type: ignore[arg-type]
        dst_md = dst.build_metadata(size, dtype, world_size=world)
        if t.sharding_metadata() != dst_md:
            problems.append(f"layout after reshard {t.sharding_metadata()} != {dst_md}")
        for s in t.local_shards():
            if s.tensor.dtype != dtype or not torch.equal(s.tensor, region(ref, s.metadata)):
                problems.append(f"shard {s.metadata} differs from the reduced region")
        # Back into partial values (same reduction, same holders): the value is unchanged.
        if op != "avg":  # avg of copies is exact only for some counts of holders
            back = PartialSpec([f"rank:{h}/cpu" for h in holders], reduce_op=op)
            t.reshard(back)
            if t.sharding_metadata().placement != Partial(op) or not torch.equal(t.full_tensor(), ref):
                problems.append(f"{dst!r} -> partial({op}) does not reduce to the same tensor")
            if op == "sum" and world > 1 and math.prod(size) > 0:
                # For a sum one holder keeps each value and the others hold zeros there: no
                # element is non-zero on two ranks.
                mine = t.local_shard() if rank in holders else torch.zeros(size, dtype=dtype)
                mask = (mine != 0).to(torch.uint8).contiguous()
                masks = [torch.empty_like(mask) for _ in range(world)]
                dist.all_gather(masks, mask)
                if masks and (torch.stack(masks).sum(0) > 1).any():
                    problems.append("to partial(sum): an element is held non-zero by two holders")
        out.append(problems + [f"bytes={comm.bytes_sent}"])
    return out


def _check(case_list: list[dict[str, object]], world: int) -> None:
    results = run_distributed(_run_cases, world, case_list, timeout=180)
    assert_no_problems(case_list, [[f"rank {r}: {p}" for r in range(world) for p in results[r][i]
                                    if not p.startswith("bytes=")] for i in range(len(case_list))])


@SPAWN_SETTINGS
@given(hst.lists(cases(2), min_size=CASES_PER_SPAWN, max_size=CASES_PER_SPAWN))
def test_partial_reduces_into_random_layouts_on_2_ranks(case_list):
    _check(case_list, 2)


@SPAWN_SETTINGS
@given(hst.lists(cases(4), min_size=CASES_PER_SPAWN, max_size=CASES_PER_SPAWN))
def test_partial_reduces_into_random_layouts_on_4_ranks(case_list):
    _check(case_list, 4)


def _named(rank: int, world: int, tmp: str) -> dict[str, object]:
    """The common transitions on every rank: bytes, in-place all-reduce, save/load, checkpoints."""
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    size = (8, 12)
    parts = {h: random_tensor(size, torch.float32, seed=h, small_integers=True) for h in range(world)}
    ref = _reference([parts[h] for h in range(world)], "sum")
    found: dict[str, object] = {}
    targets = {"replicate": DevicePlacement("cpu"), "rows": single_split(0, ranks),
               "cols": single_split(1, ranks), "uneven": single_split(0, ranks, [1, 4, 0, 3][:world] if world == 4
                                                                       else [3, 5])}
    for name, spec in targets.items():
        t = _partial_tensor(rank, parts, "sum", size)
        with st.CommCounter() as comm:
            t.reshard(spec)
        assert all(torch.equal(s.tensor, region(ref, s.metadata)) for s in t.local_shards()), name
        found[name] = comm.bytes_sent
        found[name + "_mine"] = sum(s.metadata.numel for s in t.local_shards())
    # Partial sums on other holders: reduced onto a split over them, then spread again.
    t = _partial_tensor(rank, parts, "sum", size)
    t.reshard(partial(ranks[1:3]))
    found["other_holders"] = (t.sharding_metadata().ranks == tuple(range(1, min(3, world)))
                              and torch.equal(t.full_tensor(), ref)
                              and len(t.local_shards()) == (1 if 1 <= rank < 3 else 0))
    # All-reduce in place: the memory of the partial value is kept when nothing else refers to it.
    t = _partial_tensor(rank, parts, "sum", size)
    address = t.local_shard().data_ptr()
    t.reshard(DevicePlacement("cpu"))
    found["in_place"] = t.local_shard().data_ptr() == address
    held = _partial_tensor(rank, parts, "sum", size)
    mine = held.local_shard()
    held.reshard(DevicePlacement("cpu"))
    found["kept_reference_untouched"] = torch.equal(mine, parts[rank])
    # torch.save / torch.load(weights_only=True) keep partial values and their reduction.
    t = _partial_tensor(rank, parts, "max", size)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    found["torch_save"] = (loaded.sharding_metadata() == t.sharding_metadata()
                           and loaded.sharding_spec() == t.sharding_spec()
                           and torch.equal(loaded.local_shard(), parts[rank]))
    # visualize_sharding says what the values are.
    found["picture"] = st.visualize_sharding(t)
    # checkpoint.save refuses partial values unless asked to reduce them.
    t = _partial_tensor(rank, parts, "sum", size)
    try:
        checkpoint.save({"w": t}, f"{tmp}/refused")
        found["refused"] = None
    except ValueError as exc:
        found["refused"] = str(exc)
    checkpoint.save({"w": t, "step": 1}, f"{tmp}/reduced", reduce_partial=True)
    found["left_as_is"] = (t.sharding_metadata().placement == Partial("sum")
                           and torch.equal(t.local_shard(), parts[rank]))
    target = {"w": st.zeros(*size, sharding_spec=single_split(1, ranks)), "step": 0}
    checkpoint.load(target, f"{tmp}/reduced")
    found["loaded"] = all(torch.equal(s.tensor, region(ref, s.metadata)) for s in target["w"].local_shards())
    collected = checkpoint.collect_state_dict({"w": t})
    found["collected"] = collected is None if rank else torch.equal(collected["w"], ref)
    try:
        checkpoint.load({"w": t, "step": 0}, f"{tmp}/reduced")
        found["load_into_partial"] = None
    except ValueError as exc:
        found["load_into_partial"] = str(exc)
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_partial_named_transitions_bytes_and_checkpoints(world, tmp_path):
    results = run_distributed(_named, world, str(tmp_path), timeout=120)
    numel, itemsize = 8 * 12, 4
    for rank, found in enumerate(results):
        # All-reduce: 2 (w-1)/w of the tensor per rank; reduce-scatter: everything but its own block.
        assert found["replicate"] == 2 * (world - 1) * numel // world * itemsize
        for name in ("rows", "cols", "uneven"):
            assert found[name] == (numel - found[name + "_mine"]) * itemsize, (name, rank, found)
        assert found["in_place"] is True
        assert found["other_holders"] is True
        assert found["kept_reference_untouched"] is True
        assert found["torch_save"] is True
        assert "partial(max) rank " + ",".join(str(r) for r in range(world)) in found["picture"]
        assert found["refused"] is not None and "entry 'w' (partial(sum)) holds" in found["refused"] \
            and "reshard" in found["refused"] and "reduce_partial=True" in found["refused"]
        assert found["left_as_is"] is True and found["loaded"] is True and found["collected"] is True
        assert found["load_into_partial"] is not None and "partial values" in found["load_into_partial"]
