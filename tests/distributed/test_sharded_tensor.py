"""ShardedTensor core on 4 real Gloo ranks: creation, scatter, validation, gather, save/load.

Spawning ranks costs more than the checks, so one spawn (a module fixture) runs every check;
each check is a plain function called on every rank and reported as its own test case
(``test_check[<name>]``, or a named test where the parent compares values with a
single-process reference). A check that raises on a rank ends the job on that rank; its
peers then fail in their next collective, so nothing waits for a timeout, and the checks not
reached are reported as such.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import sharded_tensor as st
from sharding import (
    DevicePlacement,
    ShardMetadata,
    mesh,
    single_split,
)
from tests.distributed._launch import run_distributed
from tests.unit.test_plan import held_mask

pytestmark = pytest.mark.distributed

WORLD = 4
R = [f"rank:{r}/cpu" for r in range(WORLD)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool]
# Metadata exchanges (a JSON all_gather of sizes, a seed broadcast) are not payload.
_METADATA_OPS = ("all_gather", "broadcast")


def _region(x: torch.Tensor, md: ShardMetadata) -> torch.Tensor:
    return x[tuple(slice(o, o + n) for o, n in zip(md.offsets, md.dims))]


def _tensor(size: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """The same pseudo-random tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, size, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, size, generator=g).to(dtype)
    return torch.randn(size, generator=g, dtype=torch.float64).to(dtype)


def _check_holds(t: st.ShardedTensor, x: torch.Tensor, spec: object = None) -> None:
    """This rank's shards are exactly its regions of ``x`` (bit for bit) and match the layout."""
    rank = dist.get_rank()
    md = t.sharding_metadata()
    assert t.shape == x.shape and t.dtype == x.dtype, (t, x.shape, x.dtype)
    if spec is not None:
        assert t.sharding_spec() == spec
        assert md == spec.build_metadata(tuple(x.shape), x.dtype, world_size=WORLD)
    assert [s.metadata for s in t.local_shards()] == [m for _, m in md.shards_on(rank)]
    for s in t.local_shards():
        assert s.tensor.dtype == x.dtype and s.tensor.device.type == "cpu"
        assert torch.equal(s.tensor, _region(x, s.metadata)), (rank, s.metadata)


def _payload(comm: st.CommCounter) -> int:
    return comm.bytes_sent - sum(comm.bytes_by_op.get(op, 0) for op in _METADATA_OPS)


# -- the checks, each run on every rank ---------------------------------------------------


def _rfc_row_wise(rank: int) -> None:
    """RFC: a (10, 4) tensor split by rows over 4 ranks: rows 3/3/3/1."""
    x = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    spec = single_split(0, R)
    t = st.shard_tensor(x if rank == 0 else None, spec)
    rows = [(0, 3), (3, 3), (6, 3), (9, 1)][rank]
    assert torch.equal(t.local_shard(), x[rows[0]:rows[0] + rows[1]])
    assert t.local_shards()[0].metadata == ShardMetadata((rows[0], 0), (rows[1], 4), R[rank])
    _check_holds(t, x, spec)
    assert st.empty(10, 4, sharding_spec=spec).local_shard().shape == (rows[1], 4)
    assert torch.equal(t.full_tensor(), x)


def _rfc_mesh(rank: int) -> None:
    """RFC: a 4x8 tensor on a 2x4 array of placements, all on ranks 0 and 1: 2x2 blocks."""
    x = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    spec = mesh([[R[0]] * 4, [R[1]] * 4])
    t = st.shard_tensor(x, spec, src_rank=3)
    _check_holds(t, x, spec)
    shards = t.local_shards()
    if rank < 2:
        assert [s.metadata.offsets for s in shards] == [(2 * rank, 2 * j) for j in range(4)]
        assert all(s.tensor.shape == (2, 2) for s in shards)
    else:
        assert shards == []
    with pytest.raises(RuntimeError, match=rf"rank {rank} holds {4 if rank < 2 else 0}\b"):
        t.local_shard()
    assert torch.equal(t.full_tensor(), x)
    for dst in range(WORLD):
        gathered = t.gather(dst)
        assert torch.equal(gathered, x) if rank == dst else gathered is None


def _layouts() -> list[tuple[str, object, tuple[int, ...]]]:
    return [
        ("rows", single_split(0, R), (10, 6)),
        ("cols-uneven-empty", single_split(-1, R, [0, 4, 2, 0]), (10, 6)),
        ("several-per-rank", single_split(0, [R[0], R[1], R[0], R[3], R[3]]), (10, 6)),
        ("mesh-2x2", mesh([[R[0], R[1]], [R[2], R[3]]]), (10, 6)),
        ("mesh-repeated", mesh([[R[0], R[0], R[1]], [R[2], R[3], R[3]]]), (10, 6)),
        ("replicated", DevicePlacement("cpu"), (10, 6)),
        ("one-rank", DevicePlacement(R[3]), (10, 6)),
        ("split-with-replica", single_split(0, ["cpu", R[1]]), (10, 6)),
        ("empty-tensor", single_split(0, R), (0, 6)),
        ("0d", DevicePlacement(R[2]), ()),
        ("0d-replicated", DevicePlacement("cpu"), ()),
        ("1d-more-shards-than-elements", single_split(0, R + R), (5,)),
        ("3d-mesh", mesh([[[R[0], R[1]]], [[R[2], R[3]]]]), (5, 3, 4)),
    ]


def _shard_tensor_from_any_source(rank: int) -> dict[str, int]:
    """shard_tensor from src 0 and 2: src sends exactly the other ranks' shards, no one else sends."""
    sent = {}
    for name, spec, size in _layouts():
        for dtype in DTYPES:
            x = _tensor(size, dtype, seed=len(sent))
            for src in (0, 2):
                with st.CommCounter() as comm:
                    t = st.shard_tensor(x if rank == src else None, spec, src_rank=src)
                _check_holds(t, x, spec)
                layout = t.sharding_metadata()
                others = sum(int(held_mask(layout, r).sum()) for r in range(WORLD) if r != src)
                expected = others * x.element_size() if rank == src else 0
                assert _payload(comm) == expected, (name, dtype, src, _payload(comm), expected, str(comm))
                assert comm.bytes_sent - _payload(comm) < 1024, (name, "metadata overhead", str(comm))
                sent[f"{name}/{dtype}/{src}"] = _payload(comm)
            assert torch.equal(t.full_tensor(), x), (name, dtype)
            for dst in range(WORLD):
                gathered = t.gather(dst)
                assert (torch.equal(gathered, x) if rank == dst else gathered is None), (name, dtype, dst)
    return sent


def _shard_tensor_non_contiguous(rank: int) -> None:
    base = _tensor((6, 10), torch.float32)
    for x in (base.t(), base[:, ::3], base.t()[1:, :]):
        spec = mesh([[R[0], R[1]], [R[2], R[3]]])
        t = st.shard_tensor(x if rank == 1 else None, spec, src_rank=1)
        _check_holds(t, x, spec)
        assert torch.equal(t.full_tensor(), x)


def _shard_tensor_errors(rank: int) -> None:
    x = _tensor((8, 4), torch.float32)
    with pytest.raises(ValueError, match=r"src_rank=4 is outside the world of 4 ranks"):
        st.shard_tensor(x, single_split(0, R), src_rank=4)
    with pytest.raises(ValueError, match=r"rank 4 .*world has 4 ranks"):
        st.shard_tensor(x, single_split(0, [*R, "rank:4/cpu"]))
    # src_rank passes None: every rank raises, none hangs.
    with pytest.raises(TypeError, match=r"src_rank 1 must pass a tensor"):
        st.shard_tensor(None if rank == 1 else x, single_split(0, R), src_rank=1)


def _from_local_shards_valid(rank: int) -> dict[str, object]:
    x = _tensor((10, 6), torch.float64)
    layouts = {
        # one row block per rank
        "rows": {r: [((3 * r, 0), (min(3, 10 - 3 * r), 6))] for r in range(WORLD)},
        # halves replicated: rows 0-4 on ranks 0 and 2, rows 5-9 on ranks 1 and 3
        "replicas": {r: [((5 * (r % 2), 0), (5, 6))] for r in range(WORLD)},
        # several on rank 0, none on rank 2, an empty shard on rank 3
        "uneven": {0: [((0, 0), (4, 3)), ((0, 3), (4, 3))], 1: [((4, 0), (6, 2))], 2: [],
                   3: [((4, 2), (6, 4)), ((10, 0), (0, 6))]},
    }
    metadata = {}
    for name, layout in layouts.items():
        shards = [st.Shard(_region(x, ShardMetadata(o, d, R[rank])).clone(), ShardMetadata(o, d, R[rank]))
                  for o, d in layout[rank]]
        t = st.ShardedTensor.from_local_shards(shards, (10, 6))
        assert all(a.tensor is b.tensor for a, b in zip(t.local_shards(), shards)), name
        assert len(t.local_shards()) == len(shards)
        _check_holds(t, x)
        assert sorted(s.region for s in t.sharding_metadata().shards) == sorted(
            ((o, d) for r in range(WORLD) for o, d in layout[r])), name
        metadata[name] = t.sharding_metadata().to_dict()
        assert torch.equal(t.full_tensor(), x), name
        t.reshard(single_split(1, R))
        _check_holds(t, x, single_split(1, R))
    return metadata


def _from_local_shards_invalid(rank: int) -> None:
    """Each invalid layout raises ValueError on every rank, and the group still works after."""
    x = _tensor((8, 4), torch.float32)

    def rows(r: int, start: int, n: int, dtype: torch.dtype = torch.float32,
             shape: tuple[int, ...] | None = None) -> st.Shard:
        md = ShardMetadata((start, 0), (n, 4), R[r])
        tensor = _region(x, md).to(dtype) if shape is None else torch.zeros(shape, dtype=dtype)
        return st.Shard(tensor, md)

    good = {r: [rows(r, 2 * r, 2)] for r in range(WORLD)}
    cases = [
        ("gap", {**good, 3: []}, "leave a gap"),
        ("overlap", {**good, 1: [rows(1, 1, 3)]}, "overlap"),
        ("wrong-shape", {**good, 2: [rows(2, 4, 2, shape=(2, 3))]}, r"rank 2: .*shape \(2, 3\).*dims=\(2, 4\)"),
        ("inconsistent-dtype", {**good, 1: [rows(1, 2, 2, torch.float64)]}, "different dtypes"),
        ("other-rank", {**good, 3: [rows(2, 6, 2)]}, r"rank 3: .*'rank:2/cpu'"),
        ("valid-in-between", {**good, 3: [rows(3, 6, 2), st.Shard(torch.zeros(0, 4), ShardMetadata((8, 0), (0, 4),
                                                                                             "rank:3/cpu"))]},
         None),
    ]
    for _name, layout, match in cases:
        if match is None:  # a valid layout between the invalid ones: nothing is out of step
            t = st.ShardedTensor.from_local_shards(layout[rank], (8, 4))
            assert torch.equal(t.full_tensor(), x)
            continue
        with pytest.raises(ValueError, match=match):
            st.ShardedTensor.from_local_shards(layout[rank], (8, 4))
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == WORLD


def _factories(rank: int) -> dict[str, torch.Tensor]:
    size = (9, 5)
    specs = {"rows": single_split(0, R), "mesh": mesh([[R[0], R[1]], [R[2], R[3]], [R[0], R[0]]]),
             "replicated": DevicePlacement("cpu"), "several": single_split(1, [R[1], R[1], R[3]])}
    for name, spec in specs.items():
        for dtype in (torch.float32, torch.float64):
            made = {
                "empty": st.empty(*size, sharding_spec=spec, dtype=dtype),
                "zeros": st.zeros(size, sharding_spec=spec, dtype=dtype, requires_grad=True),
                "ones": st.ones(*size, sharding_spec=spec, dtype=dtype),
                "full": st.full(size, -3.0, spec, dtype=dtype),
            }
            for kind, t in made.items():
                assert t.sharding_metadata() == spec.build_metadata(size, dtype, world_size=WORLD), (name, kind)
                assert [s.metadata for s in t.local_shards()] == [m for _, m in t.sharding_metadata().shards_on(rank)]
                assert all(s.tensor.dtype == dtype and s.tensor.shape == s.metadata.dims for s in t.local_shards())
                assert all(s.tensor.requires_grad == (kind == "zeros") for s in t.local_shards()), (name, kind)
            assert torch.equal(made["zeros"].full_tensor(), torch.zeros(size, dtype=dtype))
            assert torch.equal(made["ones"].full_tensor(), torch.ones(size, dtype=dtype))
            assert torch.equal(made["full"].full_tensor(), torch.full(size, -3.0, dtype=dtype))
    # Random values: each rank seeded differently; the seed is rank 0's draw, so every layout
    # and every rank sees one tensor, the one a single process seeded like rank 0 makes.
    out = {}
    for kind, factory in (("rand", st.rand), ("randn", st.randn)):
        for name, spec in specs.items():
            torch.manual_seed(100 + rank)
            t = factory(*size, sharding_spec=spec, dtype=torch.float64)
            full = t.full_tensor()
            if kind in out:
                assert torch.equal(full, out[kind]), (kind, name)
            out[kind] = full
            if name == "replicated":
                out[f"{kind}-replica"] = t.local_shard()
    return out


def _save_load(rank: int, tmp: str) -> None:
    x = _tensor((7, 6), torch.bfloat16)
    layouts = [single_split(0, [R[0], R[1], R[0], R[3], R[3], R[3]]), mesh([[R[0], R[1]], [R[2], R[2]]]),
               DevicePlacement("cpu"), single_split(1, R + R)]
    for i, spec in enumerate(layouts):
        t = st.shard_tensor(x, spec, src_rank=i % WORLD)
        path = Path(tmp) / f"layout{i}-rank{rank}.pt"
        torch.save({"weight": t, "step": i}, path)
        dist.barrier()
        loaded = torch.load(path, weights_only=True)
        assert loaded["step"] == i
        w = loaded["weight"]
        assert isinstance(w, st.ShardedTensor)
        assert w.sharding_metadata() == t.sharding_metadata() and w.sharding_spec() == spec
        _check_holds(w, x, spec)
        assert torch.equal(w.full_tensor(), x)
        # Another rank's file holds that rank's shards: loading it here is refused.
        other = Path(tmp) / f"layout{i}-rank{(rank + 1) % WORLD}.pt"
        with pytest.raises(ValueError, match=rf"saved by rank {(rank + 1) % WORLD}.*loaded on rank {rank}"):
            torch.load(other, weights_only=True)
        dist.barrier()


def _requires_grad_is_global(rank: int) -> None:
    """requires_grad is a property of the whole tensor: the same on a rank that holds no shard,
    and kept by the shards a reshard brings to such a rank."""
    spec = single_split(0, [R[1], R[1]])
    for t in (st.zeros(8, 4, sharding_spec=spec, requires_grad=True),
              st.shard_tensor(torch.ones(8, 4, requires_grad=True), spec)):
        assert t.requires_grad, f"rank {rank} (holding {len(t.local_shards())} shards) says requires_grad=False"
        t.reshard(single_split(0, R))
        assert t.local_shard().requires_grad, f"rank {rank}: shard received by reshard lost requires_grad"


def _from_local_shards_inconsistent_size(rank: int) -> None:
    """Ranks passing different global sizes: a ValueError on every rank, never some ranks going on."""
    md = ShardMetadata((2 * rank, 0), (2, 4), R[rank])
    size = (8, 4) if rank != 3 else (8, 5)
    with pytest.raises(ValueError, match=r"size"):
        st.ShardedTensor.from_local_shards([st.Shard(torch.zeros(2, 4), md)], size)


# In the order they run; each takes (rank, tmp) and returns what the parent checks, if anything.
CHECKS: dict[str, Callable[[int, str], object]] = {
    "rfc_row_wise": lambda rank, tmp: _rfc_row_wise(rank),
    "rfc_mesh": lambda rank, tmp: _rfc_mesh(rank),
    "shard_tensor_from_any_source": lambda rank, tmp: _shard_tensor_from_any_source(rank),
    "shard_tensor_non_contiguous": lambda rank, tmp: _shard_tensor_non_contiguous(rank),
    "shard_tensor_errors": lambda rank, tmp: _shard_tensor_errors(rank),
    "from_local_shards_valid": lambda rank, tmp: _from_local_shards_valid(rank),
    "from_local_shards_invalid": lambda rank, tmp: _from_local_shards_invalid(rank),
    "factories": lambda rank, tmp: _factories(rank),
    "save_load": _save_load,
    "requires_grad_is_global": lambda rank, tmp: _requires_grad_is_global(rank),
    # last: a failure here leaves ranks out of step
    "from_local_shards_inconsistent_size": lambda rank, tmp: _from_local_shards_inconsistent_size(rank),
}
# Checks whose values the parent compares across ranks or with a reference (tests below).
_COMPARED = ("shard_tensor_from_any_source", "from_local_shards_valid", "factories")


def _core(rank: int, world_size: int, tmp: str) -> dict[str, dict[str, object]]:
    """Every check in order, by name: ``{"error": traceback or None, "value": ...}``."""
    assert world_size == WORLD
    outcomes: dict[str, dict[str, object]] = {}
    for name, check in CHECKS.items():
        try:
            value = check(rank, tmp)
        except Exception:
            outcomes[name] = {"error": traceback.format_exc(), "value": None}
            # The ranks are out of step now. Returning tears this rank's group down, which makes
            # the peers' next collective fail at once instead of waiting for the timeout.
            break
        outcomes[name] = {"error": None, "value": value}
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, object]]]:
    """One spawn of 4 ranks for every test in this module; each rank's outcomes."""
    return run_distributed(_core, WORLD, str(tmp_path_factory.mktemp("sharded_tensor")), timeout=180)


def _values(outcomes: list[dict[str, dict[str, object]]], name: str) -> list[object]:
    """Each rank's value of check ``name``; fails the test if the check failed or was not reached."""
    failed = {r: str(o[name]["error"]) for r, o in enumerate(outcomes) if name in o and o[name]["error"]}
    if failed:
        earlier = [n for n in CHECKS if n != name and any(o.get(n, {}).get("error") for o in outcomes)]
        note = f" (checks that failed too, possibly first: {earlier})" if earlier else ""
        pytest.fail(f"check {name!r} failed on ranks {sorted(failed)}{note}:\n" + "\n".join(
            f"--- rank {r} ---\n{text}" for r, text in failed.items()), pytrace=False)
    missing = [r for r, o in enumerate(outcomes) if name not in o]
    if missing:
        pytest.fail(f"check {name!r} was not reached on ranks {missing}: an earlier check failed there.",
                    pytrace=False)
    return [o[name]["value"] for o in outcomes]


@pytest.mark.parametrize("name", [n for n in CHECKS if n not in _COMPARED])
def test_check(outcomes, name):
    """The check's own assertions held on every rank."""
    _values(outcomes, name)


def test_from_local_shards_builds_one_layout_everywhere(outcomes):
    metadata = _values(outcomes, "from_local_shards_valid")
    for other in metadata[1:]:
        assert other == metadata[0]


def test_shard_tensor_only_the_source_sends(outcomes):
    sent = _values(outcomes, "shard_tensor_from_any_source")
    for key in sent[0]:  # type: ignore[attr-defined]
        src = int(key.rsplit("/", 1)[1])
        assert all(sent[r][key] == 0 for r in range(WORLD) if r != src), key  # type: ignore[index]


def test_random_factories_match_one_process_seeded_like_rank_0(outcomes):
    random = _values(outcomes, "factories")
    size = (9, 5)
    for kind, factory in (("rand", st.rand), ("randn", st.randn)):
        torch.manual_seed(100)
        reference = factory(*size, sharding_spec=single_split(0, ["rank:0/cpu"]), dtype=torch.float64).full_tensor()
        for r in random:
            assert torch.equal(r[kind], reference), kind  # type: ignore[index]
            assert torch.equal(r[f"{kind}-replica"], reference), kind  # type: ignore[index]
    assert math.isfinite(float(reference.sum()))
