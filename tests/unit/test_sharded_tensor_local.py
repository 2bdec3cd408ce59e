"""ShardedTensor with no process group: one process, rank 0 of a world of one.

Several shards on one rank stand in for several ranks: the planner and the executor take the
same paths (local copies instead of sends).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist

import sharded_tensor as st
from sharding import (
    DevicePlacement,
    EnumerableShardingSpec,
    ShardMetadata,
    composite,
    mesh,
    single_split,
)

R0 = "rank:0/cpu"


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not (dist.is_available() and dist.is_initialized()), "these tests run without a process group"


def region(x: torch.Tensor, md: ShardMetadata) -> torch.Tensor:
    return x[tuple(slice(o, o + n) for o, n in zip(md.offsets, md.dims))]


def assert_holds(t: st.ShardedTensor, x: torch.Tensor) -> None:
    """Every local shard equals its region of ``x``, bit for bit, and matches the metadata."""
    assert t.shape == x.shape and t.dtype == x.dtype
    shards = t.local_shards()
    assert [s.metadata for s in shards] == [m for _, m in t.sharding_metadata().shards_on(0)]
    for s in shards:
        assert s.tensor.shape == s.metadata.dims
        assert torch.equal(s.tensor, region(x, s.metadata)), s.metadata


# -- layouts used throughout ------------------------------------------------------------

LAYOUTS = [
    pytest.param(DevicePlacement(R0), id="device"),
    pytest.param(DevicePlacement("cpu"), id="replicated"),
    pytest.param(single_split(0, [R0] * 4), id="rows-4"),
    pytest.param(single_split(-1, [R0] * 3), id="cols-negative-dim"),
    pytest.param(single_split(0, [R0] * 3, [1, 0, 5]), id="uneven-with-empty"),
    pytest.param(single_split(1, [R0] * 8), id="more-shards-than-columns"),
    pytest.param(mesh([[R0, R0, R0], [R0, R0, R0]]), id="mesh-2x3"),
    pytest.param(EnumerableShardingSpec([ShardMetadata((0, 0), (6, 3), R0), ShardMetadata((0, 3), (6, 4), R0),
                                         ShardMetadata((0, 3), (6, 4), R0)]), id="enumerable-with-duplicate"),
]
SIZE = (6, 7)


def _x(dtype: torch.dtype = torch.float32, size: tuple[int, ...] = SIZE) -> torch.Tensor:
    return torch.arange(math.prod(size)).reshape(size).to(dtype)


# -- factories --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", LAYOUTS)
@pytest.mark.parametrize(("name", "make", "check"), [
    pytest.param("empty", lambda spec, **kw: st.empty(6, 7, sharding_spec=spec, **kw), None, id="empty-ints"),
    pytest.param("zeros", lambda spec, **kw: st.zeros((6, 7), sharding_spec=spec, **kw), 0, id="zeros-tuple"),
    pytest.param("ones", lambda spec, **kw: st.ones(torch.Size([6, 7]), sharding_spec=spec, **kw), 1,
                 id="ones-size"),
    pytest.param("full", lambda spec, **kw: st.full((6, 7), 2.5, spec, **kw), 2.5, id="full"),
    pytest.param("rand", lambda spec, **kw: st.rand(6, 7, sharding_spec=spec, **kw), "rand", id="rand-ints"),
    pytest.param("randn", lambda spec, **kw: st.randn([6, 7], sharding_spec=spec, **kw), "randn", id="randn-list"),
])
def test_factories(name, make, check, spec):
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = make(spec, dtype=dtype, requires_grad=True)
        assert t.shape == torch.Size(SIZE) and t.size() == torch.Size(SIZE) and t.size(1) == 7 and t.dim() == 2
        assert t.dtype == dtype and t.requires_grad
        assert t.sharding_spec() == spec
        assert t.sharding_metadata() == spec.build_metadata(SIZE, dtype, world_size=1)
        for s in t.local_shards():
            assert s.tensor.dtype == dtype and s.tensor.requires_grad and s.tensor.shape == s.metadata.dims
        full = t.full_tensor()
        assert full.shape == SIZE and full.dtype == dtype
        if isinstance(check, (int, float)):
            assert torch.equal(full, torch.full(SIZE, check, dtype=dtype))
        elif check == "rand":  # the upper bound in low precision: test_rand_stays_below_one_in_low_precision
            assert bool(((full >= 0) & (full <= 1)).all()) and full.unique().numel() > SIZE[0]
        elif check == "randn":
            assert bool(full.isfinite().all()) and full.unique().numel() > SIZE[0]
    assert not make(spec).requires_grad
    assert make(spec).dtype == torch.get_default_dtype()


@pytest.mark.parametrize("factory", [st.empty, st.zeros, st.ones, st.rand, st.randn])
@pytest.mark.parametrize(("args", "kwargs", "error", "match"), [
    pytest.param((6, 7, single_split(0, [R0])), {}, TypeError, "among the sizes.*sharding_spec=", id="spec-positional"),
    pytest.param((6, 7), {}, TypeError, "needs sharding_spec=", id="no-spec"),
    pytest.param((6, 7.0), {"sharding_spec": single_split(0, [R0])}, TypeError, "must be ints.*7.0", id="float-size"),
    pytest.param((6, 7), {"sharding_spec": composite(w=single_split(0, [R0]))}, TypeError, "CompositeShardingSpec",
                 id="composite"),
    pytest.param((6, 7), {"sharding_spec": single_split(0, [R0, "rank:1/cpu"])}, ValueError,
                 r"rank 1 .*world has 1 ranks", id="rank-beyond-world"),
    pytest.param((6, 7), {"sharding_spec": single_split(0, [R0, R0], [2, 3])}, ValueError,
                 r"shard_sizes=\[2, 3\] sum to 5 .* has 6 elements", id="sizes-do-not-sum"),
    pytest.param((6, 7), {"sharding_spec": mesh([[[R0]]])}, ValueError, r"mesh has 3 dimensions.*tensor has 2",
                 id="mesh-rank-mismatch"),
    pytest.param((6, 7), {"sharding_spec": single_split(2, [R0])}, ValueError, r"split_dimension=2 is out of range",
                 id="dim-out-of-range"),
    pytest.param((6, 7), {"sharding_spec": DevicePlacement("rank:3/cpu")}, ValueError, r"rank 3", id="device-rank"),
])
def test_factory_errors(factory, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        factory(*args, **kwargs)


def test_full_errors():
    with pytest.raises(ValueError, match=r"rank 2 .*world has 1 ranks"):
        st.full((4,), 1.0, single_split(0, [R0, "rank:2/cpu"]))
    with pytest.raises(TypeError, match="CompositeShardingSpec"):
        st.full((4,), 1.0, composite(a=R0))


def test_full_int_and_bool():
    t = st.full((5,), 7, single_split(0, [R0, R0]), dtype=torch.int64)
    assert torch.equal(t.full_tensor(), torch.full((5,), 7))
    b = st.full((2, 3), True, mesh([[R0], [R0]]), dtype=torch.bool)
    assert torch.equal(b.full_tensor(), torch.ones(2, 3, dtype=torch.bool))


@pytest.mark.parametrize("factory", [st.rand, st.randn])
def test_random_values_do_not_depend_on_layout(factory):
    """Same torch.manual_seed, different layouts: the same global tensor."""
    results = []
    for param in LAYOUTS:
        torch.manual_seed(1234)
        results.append(factory(*SIZE, sharding_spec=param.values[0]).full_tensor())
    for r, param in zip(results, LAYOUTS):
        assert torch.equal(r, results[0]), param.id
    torch.manual_seed(1234)
    again = factory(*SIZE, sharding_spec=single_split(0, [R0, R0]))
    assert torch.equal(again.full_tensor(), results[0])
    # The seed comes from torch's default generator: the next call draws another one.
    assert not torch.equal(factory(*SIZE, sharding_spec=single_split(0, [R0, R0])).full_tensor(), results[0])
    torch.manual_seed(4321)
    assert not torch.equal(factory(*SIZE, sharding_spec=single_split(0, [R0, R0])).full_tensor(), results[0])


def test_random_values_look_random():
    torch.manual_seed(0)
    u = st.rand(200, 100, sharding_spec=single_split(0, [R0] * 3), dtype=torch.float64).full_tensor()
    n = st.randn(200, 100, sharding_spec=single_split(1, [R0] * 3), dtype=torch.float64).full_tensor()
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(n.mean())) < 0.03 and abs(float(n.std()) - 1) < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rand_stays_below_one_in_low_precision(dtype):
    """Like torch.rand: values in [0, 1) for every dtype, even after rounding to it."""
    torch.manual_seed(0)
    u = st.rand(1 << 16, sharding_spec=single_split(0, [R0, R0]), dtype=dtype).full_tensor()
    assert float(u.min()) >= 0 and float(u.max()) < 1, f"max {float(u.max())} for {dtype}"


def test_random_scalar_and_empty():
    torch.manual_seed(3)
    a = st.rand(sharding_spec=DevicePlacement(R0)).full_tensor()
    assert a.shape == () and 0 <= float(a) < 1
    e = st.randn(0, 4, sharding_spec=single_split(0, [R0, R0]))
    assert e.full_tensor().shape == (0, 4)


# -- shard_tensor, reshard, gather, full_tensor -------------------------------------------


@pytest.mark.parametrize("spec", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool], ids=str)
def test_shard_tensor_reshard_gather(spec, dtype):
    x = _x(dtype) if dtype != torch.bool else _x() % 3 == 0
    t = st.shard_tensor(x, spec)
    assert_holds(t, x)
    assert t.sharding_spec() == spec
    assert torch.equal(t.full_tensor(), x) and torch.equal(t.gather(), x) and torch.equal(t.gather(dst=0), x)
    for target in LAYOUTS:
        assert t.reshard(target.values[0]) is t
        assert_holds(t, x)
        assert t.sharding_spec() == target.values[0]
        assert t.sharding_metadata() == target.values[0].build_metadata(SIZE, dtype, world_size=1)
    # The shards are copies: changing the source afterwards does not change them.
    x_before = x.clone()
    x.zero_() if dtype != torch.bool else x.fill_(False)
    assert torch.equal(t.full_tensor(), x_before)


@pytest.mark.parametrize(("x", "spec"), [
    pytest.param(torch.tensor(3.25), DevicePlacement(R0), id="0d"),
    pytest.param(torch.tensor(-1.5, dtype=torch.float64), DevicePlacement("cpu"), id="0d-replicated"),
    pytest.param(torch.arange(5.0), single_split(0, [R0] * 7), id="1d-more-shards-than-elements"),
    pytest.param(torch.arange(60).reshape(3, 4, 5), mesh([[[R0, R0]], [[R0, R0]], [[R0, R0]]]), id="3d-mesh"),
    pytest.param(torch.arange(60).reshape(3, 4, 5), single_split(-2, [R0, R0, R0]), id="3d-split"),
    pytest.param(torch.empty(0, 3), single_split(0, [R0, R0]), id="empty-tensor"),
    pytest.param(torch.arange(24.0).reshape(4, 6).t(), single_split(1, [R0, R0, R0]), id="non-contiguous"),
    pytest.param(torch.arange(24.0).reshape(4, 6)[:, ::2], mesh([[R0, R0], [R0, R0]]), id="strided-view"),
])
def test_shard_tensor_shapes(x, spec):
    t = st.shard_tensor(x, spec)
    assert_holds(t, x)
    assert torch.equal(t.full_tensor(), x)
    assert torch.equal(t.gather(0), x)
    t.reshard(DevicePlacement(R0))
    assert torch.equal(t.local_shard(), x)


def test_shard_tensor_keeps_requires_grad():
    x = torch.randn(4, 3, requires_grad=True)
    t = st.shard_tensor(x, single_split(0, [R0, R0]))
    assert t.requires_grad and all(s.tensor.requires_grad for s in t.local_shards())
    t.reshard(single_split(1, [R0, R0, R0]))
    assert t.requires_grad and all(s.tensor.requires_grad for s in t.local_shards())
    assert torch.equal(t.full_tensor(), x.detach())


@pytest.mark.parametrize(("call", "error", "match"), [
    pytest.param(lambda x: st.shard_tensor(x, single_split(0, [R0]), src_rank=1), ValueError,
                 r"src_rank=1 is outside the world of 1", id="src-rank-out-of-range"),
    pytest.param(lambda x: st.shard_tensor(x, single_split(0, [R0]), src_rank=-1), ValueError,
                 r"src_rank=-1", id="src-rank-negative"),
    pytest.param(lambda x: st.shard_tensor(None, single_split(0, [R0])), TypeError, r"src_rank 0 must pass a tensor",
                 id="no-tensor-on-src"),
    pytest.param(lambda x: st.shard_tensor(x, single_split(0, [R0, "rank:1/cpu"])), ValueError,
                 r"rank 1 .*world has 1", id="rank-beyond-world"),
    pytest.param(lambda x: st.shard_tensor(x, composite(w=R0)), TypeError, "CompositeShardingSpec", id="composite"),
    pytest.param(lambda x: st.shard_tensor(x, single_split(0, [R0, R0], [1, 1])), ValueError,
                 r"sum to 2 but dimension 0 .* has 6", id="sizes-do-not-sum"),
    pytest.param(lambda x: st.shard_tensor(x, mesh([[R0]] * 2 + [[R0]])), None, None, id="mesh-ok"),
    pytest.param(lambda x: st.shard_tensor(x, mesh([R0, R0])), ValueError, r"mesh has 1 dimensions.*tensor has 2",
                 id="mesh-rank-mismatch"),
])
def test_shard_tensor_errors(call, error, match):
    x = _x()
    if error is None:
        assert_holds(call(x), x)
        return
    with pytest.raises(error, match=match):
        call(x)


def test_gather_dst_out_of_range():
    t = st.shard_tensor(_x(), single_split(0, [R0, R0]))
    for dst in (1, -1, 5):
        with pytest.raises(ValueError, match=rf"gather\(dst={dst}\) is outside the world of 1 ranks"):
            t.gather(dst)


@pytest.mark.parametrize(("spec", "error", "match"), [
    pytest.param(single_split(0, [R0, R0], [3, 4]), ValueError, r"sum to 7 .* has 6 elements", id="sizes-do-not-sum"),
    pytest.param(single_split(1, [R0, "rank:1/cpu"]), ValueError, r"rank 1 .*world has 1 ranks",
                 id="rank-beyond-world"),
    pytest.param(mesh([[[R0]]]), ValueError, r"mesh has 3 dimensions", id="mesh-rank-mismatch"),
    pytest.param(single_split(-3, [R0]), ValueError, r"split_dimension=-3 is out of range", id="dim-out-of-range"),
    pytest.param(composite(w=R0), TypeError, "CompositeShardingSpec", id="composite"),
    pytest.param("rank:0/cpu", TypeError, "sharding_spec must be", id="string"),
    pytest.param(EnumerableShardingSpec([ShardMetadata((0, 0), (6, 3), R0)]), ValueError, "gap",
                 id="enumerable-gap"),
])
def test_reshard_to_invalid_spec_changes_nothing(spec, error, match):
    x = _x()
    old_spec = mesh([[R0, R0], [R0, R0]])
    t = st.shard_tensor(x, old_spec)
    metadata, shards = t.sharding_metadata(), [s.tensor for s in t.local_shards()]
    with pytest.raises(error, match=match):
        t.reshard(spec)
    assert t.sharding_metadata() == metadata and t.sharding_spec() == old_spec
    assert all(a is b.tensor for a, b in zip(shards, t.local_shards()))
    assert_holds(t, x)


# -- local_shard / local_shards ---------------------------------------------------------------


@pytest.mark.parametrize(("spec", "count"), [
    pytest.param(single_split(0, [R0, R0, R0]), 3, id="three"),
    pytest.param(mesh([[R0, R0]]), 2, id="mesh-two"),
    pytest.param(single_split(0, [R0, R0], [6, 0]), 2, id="one-empty"),
])
def test_local_shard_with_several_shards_says_how_many(spec, count):
    t = st.zeros(*SIZE, sharding_spec=spec)
    assert len(t.local_shards()) == count
    with pytest.raises(RuntimeError, match=rf"rank 0 holds {count}\b.*local_shards\(\)"):
        t.local_shard()


def test_local_shard_with_no_shard_says_so():
    # Every shard on another rank: only from_local_shards can build this in a world of one.
    t = st.ShardedTensor.from_local_shards([], (0, 3))
    assert t.local_shards() == []
    with pytest.raises(RuntimeError, match=r"rank 0 holds 0"):
        t.local_shard()


def test_local_shard_single():
    x = _x()
    t = st.shard_tensor(x, single_split(0, [R0]))
    assert torch.equal(t.local_shard(), x)
    assert t.local_shards()[0].metadata == ShardMetadata((0, 0), SIZE, R0)


# -- from_local_shards --------------------------------------------------------------------


def _shard(x: torch.Tensor, offsets: tuple[int, ...], dims: tuple[int, ...], device: str = R0) -> st.Shard:
    md = ShardMetadata(offsets, dims, device)
    return st.Shard(region(x, md).clone(), md)


def test_from_local_shards():
    x = _x()
    shards = [_shard(x, (0, 0), (6, 3)), _shard(x, (0, 3), (2, 4)), _shard(x, (2, 3), (4, 4)),
              _shard(x, (6, 0), (0, 7))]
    t = st.ShardedTensor.from_local_shards(shards, SIZE)
    assert_holds(t, x)
    assert all(a.tensor is b.tensor for a, b in zip(t.local_shards(), shards))  # no copy
    assert isinstance(t.sharding_spec(), EnumerableShardingSpec)
    assert torch.equal(t.full_tensor(), x)
    t.reshard(single_split(1, [R0, R0]))
    assert_holds(t, x)


@pytest.mark.parametrize(("shards", "size", "match"), [
    pytest.param(lambda x: [_shard(x, (0, 0), (6, 3))], SIZE, r"leave a gap", id="gap"),
    pytest.param(lambda x: [_shard(x, (0, 0), (6, 4)), _shard(x, (0, 3), (6, 4))], SIZE, r"overlap", id="overlap"),
    pytest.param(lambda x: [st.Shard(torch.zeros(6, 6), ShardMetadata((0, 0), (6, 7), R0))], SIZE,
                 r"shape \(6, 6\) but its metadata says dims=\(6, 7\)", id="wrong-shape"),
    pytest.param(lambda x: [_shard(x, (0, 0), (6, 3)), _shard(x.double(), (0, 3), (6, 4))], SIZE,
                 r"different dtypes", id="inconsistent-dtype"),
    pytest.param(lambda x: [_shard(x, (0, 0), (6, 7), "rank:1/cpu")], SIZE, r"rank:1/cpu.*passed on rank 0",
                 id="other-rank"),
    pytest.param(lambda x: [_shard(x, (0, 0), (6, 7))], (6, 6), r"reaches past", id="past-the-end"),
])
def test_from_local_shards_errors(shards, size, match):
    with pytest.raises(ValueError, match=match):
        st.ShardedTensor.from_local_shards(shards(_x()), size)


# -- torch.save / torch.load(weights_only=True) -------------------------------------------


def _roundtrip_bytes(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("spec", LAYOUTS)
def test_save_load_roundtrip(spec, tmp_path):
    x = _x(torch.float64)
    t = st.shard_tensor(x, spec)
    path = tmp_path / "t.pt"
    torch.save({"w": t, "step": 3}, path)
    for loaded in (_roundtrip_bytes(t), torch.load(path, weights_only=True)["w"]):
        assert isinstance(loaded, st.ShardedTensor)
        assert loaded.sharding_metadata() == t.sharding_metadata()
        assert loaded.sharding_spec() == spec
        assert loaded.dtype == torch.float64 and loaded.shape == x.shape
        assert_holds(loaded, x)
        assert torch.equal(loaded.full_tensor(), x)
        loaded.reshard(single_split(1, [R0, R0]))
        assert_holds(loaded, x)


def test_save_load_keeps_requires_grad_and_from_local_shards_layout():
    x = _x()
    t = st.ShardedTensor.from_local_shards([_shard(x, (0, 0), (3, 7)), _shard(x, (3, 0), (3, 7))], SIZE)
    t.requires_grad_()
    loaded = _roundtrip_bytes(t)
    assert loaded.requires_grad
    assert loaded.sharding_spec() == t.sharding_spec()
    assert_holds(loaded, x)
