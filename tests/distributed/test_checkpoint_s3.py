"""Checkpoints on a real S3-protocol server (moto on loopback, started by the ``s3`` fixture) via s3fs.

Covers save/load in a world of one and on 2 Gloo ranks, read_metadata, consolidate from S3
(to a local file and to an S3 folder), and the CLI with ``--storage-option``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load, load_file

import checkpoint
import sharded_tensor as st
from checkpoint.__main__ import main
from sharding import single_split
from tests._s3 import S3, s3, s3_endpoint  # noqa: F401 - fixtures, found by name
from tests.distributed._launch import run_distributed


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(12, 8, generator=g), "b": torch.randn(8, generator=g),
            "e": torch.randn(6, 10, generator=g).to(torch.bfloat16)}


def _state_dict(rank: int, world: int, split: int) -> dict[str, Any]:
    ranks = [f"rank:{r}/cpu" for r in range(world)] * (4 // world)  # 4 shards whatever the world
    full = _full()
    return {"w": st.shard_tensor(full["w"] if rank == 0 else None, single_split(split, ranks)),
            "b": full["b"],
            "e": st.shard_tensor(full["e"] if rank == 0 else None, single_split(split, ranks)),
            "step": 9, "optim": {"lr": 0.5}}


def _empty_like(rank: int, world: int, split: int) -> dict[str, Any]:
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    full = _full()
    return {"w": st.zeros(*full["w"].shape, sharding_spec=single_split(split, ranks)),
            "b": torch.zeros(8),
            "e": st.zeros(*full["e"].shape, sharding_spec=single_split(split, ranks), dtype=torch.bfloat16),
            "step": 0, "optim": {"lr": 0.0}}


def _check_loaded(sd: dict[str, Any]) -> None:
    full = _full()
    for name in ("w", "e"):
        for shard in sd[name].local_shards():
            index = tuple(slice(o, o + n) for o, n in zip(shard.metadata.offsets, shard.metadata.dims))
            assert torch.equal(shard.tensor, full[name][index]), name
    assert torch.equal(sd["b"], full["b"])
    assert sd["step"] == 9 and sd["optim"]["lr"] == 0.5


def test_save_load_world_of_one(s3: S3) -> None:
    url = s3.url("ckpt")
    checkpoint.save(_state_dict(0, 1, 0), url, storage_options=s3.storage_options)
    names = sorted(Path(p).name for p in s3.filesystem().ls(url))
    assert "shardkit.json" in names and any(n.endswith(".safetensors") for n in names)
    md = checkpoint.read_metadata(url, storage_options=s3.storage_options)
    assert md.tensors["w"].size == torch.Size([12, 8]) and md.values["step"] == 9
    target = _empty_like(0, 1, 1)  # another layout than the saved one
    checkpoint.load(target, url, storage_options=s3.storage_options)
    _check_loaded(target)


def test_consolidate_from_s3(s3: S3, tmp_path: Path) -> None:
    url = s3.url("ckpt")
    checkpoint.save(_state_dict(0, 1, 1), url, storage_options=s3.storage_options)
    full = _full()
    # S3 -> local file.
    out = tmp_path / "model.safetensors"
    checkpoint.consolidate(url, str(out), storage_options=s3.storage_options)
    got = load_file(str(out))
    assert sorted(got) == sorted(full) and all(torch.equal(got[k], full[k]) for k in full)
    # S3 -> S3 folder (the same storage options apply to an output of the same protocol).
    folder = s3.url("hf")
    checkpoint.consolidate(url, folder, max_shard_size=400, storage_options=s3.storage_options)
    fs = s3.filesystem()
    index = json.loads(fs.cat_file(f"{folder}/model.safetensors.index.json"))
    got = {}
    for file in sorted(set(index["weight_map"].values())):
        got.update(load(fs.cat_file(f"{folder}/{file}")))
    assert sorted(got) == sorted(full) and all(torch.equal(got[k], full[k]) for k in full)


def test_cli_on_s3_and_corruption(s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    url = s3.url("ckpt")
    checkpoint.save(_state_dict(0, 1, 0), url, storage_options=s3.storage_options)
    options = ["-o", f"endpoint_url={s3.endpoint_url}", "-o", "key=testing", "-o", "secret=testing",
               "-o", "client_kwargs.region_name=eu-west-1"]
    assert main(["verify", url, *options]) == 0
    assert main(["inspect", url, "--json", *options]) == 0
    assert "OK" in capsys.readouterr().out
    # Flip one byte of a region's data in the object store.
    shard = checkpoint.read_metadata(url, storage_options=s3.storage_options).tensors["e"].shards[2]
    fs = s3.filesystem()
    key = f"{url}/{shard.file}"
    data = bytearray(fs.cat_file(key))
    data[shard.byte_range[0] + 3] ^= 0x10
    fs.pipe_file(key, bytes(data))
    assert main(["verify", url, *options]) == 1
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and shard.file in err and "'e'" in err
    with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch"):
        checkpoint.consolidate(url, s3.url("out.safetensors"), storage_options=s3.storage_options)
    assert not fs.exists(s3.url("out.safetensors"))


def _save_then_load(rank: int, world: int, url: str, options: dict[str, Any]) -> None:
    checkpoint.save(_state_dict(rank, world, 0), url, storage_options=options)
    target = _empty_like(rank, world, 1)  # each rank reads only the byte ranges of its columns
    checkpoint.load(target, url, storage_options=options)
    _check_loaded(target)


def test_two_ranks_save_load_and_consolidate(s3: S3, tmp_path: Path) -> None:
    url = s3.url("ckpt2")
    run_distributed(_save_then_load, 2, url, s3.storage_options, timeout=90)
    assert checkpoint.read_metadata(url, storage_options=s3.storage_options).world_size == 2
    out = tmp_path / "m.safetensors"
    checkpoint.consolidate(url, str(out), storage_options=s3.storage_options)
    got, full = load_file(str(out)), _full()
    assert all(torch.equal(got[k], full[k]) for k in full)


def test_manager_async_on_s3(s3: S3) -> None:
    root = s3.url("managed")
    manager = checkpoint.CheckpointManager(root, keep_last=2, storage_options=s3.storage_options)
    states = {}
    for step in (1, 2, 3):
        states[step] = {"w": torch.randn(40, 8), "step": step}
        handle = manager.save(step, states[step], async_=True)
        reference = states[step]["w"].clone()
        states[step]["w"].add_(1.0)  # after staging: never reaches S3
        states[step]["w"] = reference
        assert handle is not None
    manager.wait()
    assert manager.steps() == [2, 3] and manager.latest_step() == 3
    for step in (2, 3):
        got = manager.load({"w": torch.zeros(40, 8), "step": None}, step=step)
        assert torch.equal(got["w"], states[step]["w"]) and got["step"] == step
    # A step abandoned midway (data, no metadata) is not listed and is removed by the next manager.
    s3.filesystem().pipe_file(s3.url("managed/step-0000000009/data-00000000-r00000.safetensors")[5:], b"x")
    assert manager.steps() == [2, 3]
    assert checkpoint.CheckpointManager(root, storage_options=s3.storage_options).steps() == [2, 3]
    assert not s3.filesystem().exists(s3.url("managed/step-0000000009")[5:])
