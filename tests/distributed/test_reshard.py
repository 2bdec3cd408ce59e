"""reshard on real Gloo ranks: random layout pairs, bit-for-bit regions, minimal bytes, errors.

Hypothesis draws the cases in the parent (sizes, source and destination specs as
``spec.to_dict()``, dtypes); one spawn runs a whole list of cases on every rank. Mismatches
come back as data, so one run reports every failing case instead of the first one, and the
ranks never fall out of step. Shrinking is off: each attempt would cost a spawn, and the
report already names the failing case.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as hst

import sharded_tensor as st
from _shardkit.memory import wait_for_releases
from sharded_tensor._plan import plan_reshard
from sharding import DevicePlacement, mesh, single_split, spec_from_dict
from tests.distributed._cases import assert_no_problems, random_tensor, region
from tests.distributed._launch import run_distributed
from tests.unit.test_plan import minimum_elements, sizes, specs

pytestmark = pytest.mark.distributed

DTYPES = ["float32", "float64", "bfloat16", "int64", "bool"]
CASES_PER_SPAWN = 20
SPAWN_SETTINGS = settings(max_examples=2, deadline=None, phases=[Phase.explicit, Phase.generate],
                          suppress_health_check=list(HealthCheck))


@hst.composite
def cases(draw: hst.DrawFn, world: int) -> dict[str, object]:
    size = draw(sizes(max_ndim=3, max_dim=7))
    return {"size": list(size), "dtype": draw(hst.sampled_from(DTYPES)),
            "src": draw(specs(size, world)).to_dict(), "dst": draw(specs(size, world)).to_dict()}


def _invalid_specs(size: tuple[int, ...], world: int) -> list[tuple[object, str]]:
    """Specs that do not fit a tensor of ``size`` on ``world`` ranks, with the message to expect."""
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    too_deep: object = ranks[0]
    for _ in range(len(size) + 1):
        too_deep = [too_deep]
    bad = [(DevicePlacement(f"rank:{world}/cpu"), rf"rank {world}\b"),
           (single_split(0, [*ranks[1:], f"rank:{world + 1}/cpu"]),
            rf"rank {world + 1}\b" if size else "0-d tensor has no dimension to split"),
           (mesh(too_deep), rf"mesh has {len(size) + 1} dimensions")]
    if size:
        bad.append((single_split(0, ranks, [size[0] + 1] + [0] * (world - 1)), rf"sum to {size[0] + 1}\b"))
    return bad


def _run_cases(rank: int, world: int, case_list: list[dict[str, object]]) -> list[dict[str, object]]:
    out = []
    for i, case in enumerate(case_list):
        size = tuple(case["size"])  # type: ignore[arg-type]
        dtype = getattr(torch, str(case["dtype"]))
        src, dst = spec_from_dict(case["src"]), spec_from_dict(case["dst"])  # type: ignore[arg-type]
        x = random_tensor(size, dtype, seed=i)
        problems: list[str] = []
        t = st.shard_tensor(x if rank == i % world else None, src, src_rank=i % world)
        src_md = t.sharding_metadata()
        # A spec that does not fit: ValueError, and the old data and layout stay as they were.
        for spec, match in _invalid_specs(size, world) if i < 4 else []:
            before = [s.tensor for s in t.local_shards()]
            values = [b.clone() for b in before]
            try:
                t.reshard(spec)  # type: ignore[arg-type]
                problems.append(f"reshard to invalid {spec!r} did not raise")
            except ValueError as exc:
                if not re.search(match, str(exc)):
                    problems.append(f"reshard to invalid {spec!r}: message {exc} does not match {match!r}")
            if t.sharding_metadata() != src_md or t.sharding_spec() != src:
                problems.append(f"failed reshard to {spec!r} changed the layout")
            now = t.local_shards()
            if len(now) != len(before) or not all(a.tensor is b and torch.equal(b, v)
                                                  for a, b, v in zip(now, before, values)):
                problems.append(f"failed reshard to {spec!r} changed the local shards")
        with st.CommCounter() as comm:
            result = t.reshard(dst)  # type: ignore[arg-type]
        if result is not t:
            problems.append("reshard did not return self")
        dst_md = dst.build_metadata(size, dtype, world_size=world)
        if t.sharding_metadata() != dst_md:
            problems.append(f"layout after reshard {t.sharding_metadata()} != {dst_md}")
        if [s.metadata for s in t.local_shards()] != [m for _, m in dst_md.shards_on(rank)]:
            problems.append("local shards do not follow the destination layout")
        for s in t.local_shards():
            if s.tensor.dtype != dtype or not torch.equal(s.tensor, region(x, s.metadata)):
                problems.append(f"shard {s.metadata} differs from the original region")
        planned = plan_reshard(src_md, dst_md, rank=rank).elements_sent() * x.element_size()
        if comm.bytes_sent != planned:
            problems.append(f"sent {comm.bytes_sent} bytes but the plan says {planned} ({comm})")
        if not torch.equal(t.full_tensor(), x):
            problems.append("full_tensor() after reshard differs from the original")
        out.append({"bytes": comm.bytes_sent, "problems": problems})
    return out


def _check(case_list: list[dict[str, object]], world: int) -> None:
    results = run_distributed(_run_cases, world, case_list, timeout=120)
    problems = []
    for i, case in enumerate(case_list):
        size = tuple(case["size"])  # type: ignore[arg-type]
        dtype = getattr(torch, str(case["dtype"]))
        src_md = spec_from_dict(case["src"]).build_metadata(size, dtype, world_size=world)  # type: ignore[arg-type]
        dst_md = spec_from_dict(case["dst"]).build_metadata(size, dtype, world_size=world)  # type: ignore[arg-type]
        found = [f"rank {r}: {p}" for r in range(world) for p in results[r][i]["problems"]]
        total = sum(results[r][i]["bytes"] for r in range(world))
        minimum = minimum_elements(src_md, dst_md) * torch.empty((), dtype=dtype).element_size()
        if total != minimum:
            found.append(f"all ranks sent {total} bytes, the minimum is {minimum}")
        problems.append(found)
    assert_no_problems(case_list, problems)


@SPAWN_SETTINGS
@given(hst.lists(cases(4), min_size=CASES_PER_SPAWN, max_size=CASES_PER_SPAWN))
def test_reshard_random_layouts_on_4_ranks(case_list):
    _check(case_list, 4)


@SPAWN_SETTINGS
@given(hst.lists(cases(3), min_size=CASES_PER_SPAWN, max_size=CASES_PER_SPAWN))
def test_reshard_random_layouts_on_3_ranks(case_list):
    _check(case_list, 3)


R4 = [f"rank:{r}/cpu" for r in range(4)]
# The named transitions on an (8, 12) tensor, with the bytes each needs in float32.
NAMED = [
    ("dim0-to-dim1", single_split(0, R4), single_split(1, R4), 4 * 3 * 2 * 3 * 4),
    ("dim0-to-replicate", single_split(0, R4), DevicePlacement("cpu"), 4 * 3 * 24 * 4),
    ("replicate-to-dim0", DevicePlacement("cpu"), single_split(0, R4), 0),
    ("even-to-uneven", single_split(0, R4), single_split(0, R4, [1, 3, 3, 1]), 2 * 12 * 4),
    ("mesh-to-single-split", mesh([R4[:2], R4[2:]]), single_split(0, R4), 4 * 2 * 6 * 4),
    ("mesh-to-mesh-transposed", mesh([R4[:2], R4[2:]]), mesh([[R4[0], R4[2]], [R4[1], R4[3]]]), 2 * 24 * 4),
]


# Agreement payloads on either side of all_gather_json's one-round slot (504 bytes of JSON).
def _payload(rank: int) -> object:
    return ["é" * 30, "x" * (5 + 1100 * (rank % 2)), rank, {"r": rank}] if rank != 3 else "y" * 1010


def _named(rank: int, world: int) -> dict[str, object]:
    from _shardkit import comm

    gathered = comm.all_gather_json(_payload(rank))
    sent = []
    for i, (_, src, dst, _) in enumerate(NAMED):
        x = random_tensor((8, 12), torch.float32, seed=i)
        t = st.shard_tensor(x, src)
        with st.CommCounter() as counter:
            t.reshard(dst)
        for s in t.local_shards():
            assert torch.equal(s.tensor, region(x, s.metadata)), (NAMED[i][0], s.metadata)
        sent.append(counter.bytes_sent)
    # The same again on an agreement that fits in one round, after the reshards.
    short = comm.all_gather_json({"rank": rank})
    return {"sent": sent, "gathered": gathered, "short": short}


def test_named_transitions_send_the_minimum():
    results = run_distributed(_named, 4)
    for i, (name, _, _, expected) in enumerate(NAMED):
        assert sum(r["sent"][i] for r in results) == expected, name
    # Every rank learns every rank's JSON value, short or longer than the first round's slot.
    want = [json.loads(json.dumps(_payload(r))) for r in range(4)]
    for r in results:
        assert r["gathered"] == want
        assert r["short"] == [{"rank": q} for q in range(4)]


def _resident_bytes(storage: torch.UntypedStorage) -> int:
    """Bytes of ``storage`` in RAM, from the kernel's page table (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-storage.nbytes() // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(storage.data_ptr()), ctypes.c_size_t(storage.nbytes()), vector) == 0
    return sum(v & 1 for v in vector) * mmap.PAGESIZE


def _storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _keeps_memory(rank: int, world: int) -> dict[str, object]:
    """A new shard that is a contiguous block of an old one keeps its memory, unless shared."""
    import io

    ranks = [f"rank:{r}/cpu" for r in range(world)]
    rows, cols = 4096, 1024  # 16 MiB: allocated on its own mapping, so its pages can be released
    found: dict[str, object] = {}

    # Replicate -> rows: no copy; the pages outside this rank's rows go back to the OS.
    torch.manual_seed(0)
    t = st.rand(rows, cols, sharding_spec=DevicePlacement("cpu"), requires_grad=True)
    full = t.local_shard().detach().clone()
    storage = _storage_of(t.local_shard())
    found["resident_before"] = _resident_bytes(t.local_shard().untyped_storage())
    t.reshard(single_split(0, ranks))
    mine = t.local_shard()
    wait_for_releases()  # the pages go back on a background thread
    found["resident_after"] = _resident_bytes(mine.untyped_storage())
    found["kept_storage"] = _storage_of(mine) == storage
    found["values"] = torch.equal(mine, full.chunk(world)[rank])
    found["leaf_requires_grad"] = mine.is_leaf and mine.requires_grad
    (mine * 2).sum().backward()
    found["grad"] = mine.grad is not None and torch.equal(mine.grad, torch.full_like(mine, 2.0))
    # torch.save writes this shard's own bytes, not the old replica's storage.
    buffer = io.BytesIO()
    torch.save(t, buffer)
    found["saved_bytes"] = len(buffer.getvalue())
    # Back to a replica and then a prefix of rows (uneven split): values survive every step.
    t.reshard(DevicePlacement("cpu"))
    found["round_trip"] = torch.equal(t.local_shard(), full)
    t.reshard(single_split(0, ranks, [rows // 2] + [rows // 2 // (world - 1)] * (world - 1)))
    found["uneven"] = torch.equal(t.full_tensor(), full)

    # Memory someone else still sees is copied from, never taken or released.
    u = st.rand(rows, cols, sharding_spec=DevicePlacement("cpu"))
    held = u.local_shard()
    graph_input = st.rand(rows, cols, sharding_spec=DevicePlacement("cpu"), requires_grad=True)
    saved = graph_input.local_shard() * graph_input.local_shard()  # autograd saves the input
    values = held.clone(), graph_input.local_shard().detach().clone()
    u.reshard(single_split(0, ranks))
    graph_input.reshard(single_split(0, ranks))
    found["held_unchanged"] = torch.equal(held, values[0]) and _storage_of(u.local_shard()) != _storage_of(held)
    saved.sum().backward()  # reads the saved input: it must be intact
    found["graph_unchanged"] = torch.equal(graph_input.local_shard().detach(), values[1].chunk(world)[rank])
    return found


def test_reshard_keeps_memory_of_a_contiguous_block_it_alone_holds():
    world = 2
    shard_bytes = 4096 * 1024 * 4 // world
    for rank, found in enumerate(run_distributed(_keeps_memory, world)):
        assert found["kept_storage"] and found["values"], (rank, found)
        # Of the 16 MiB replica only this rank's rows stay in RAM.
        assert found["resident_before"] == 2 * shard_bytes, (rank, found)
        assert found["resident_after"] == shard_bytes, (rank, found)
        assert found["leaf_requires_grad"] and found["grad"], (rank, found)
        assert shard_bytes < found["saved_bytes"] < shard_bytes + 64 * 1024, (rank, found)
        assert found["round_trip"] and found["uneven"], (rank, found)
        assert found["held_unchanged"] and found["graph_unchanged"], (rank, found)
