"""A Hugging Face cache folder loads as it is: snapshot files are links into the same cache's ``blobs/``.

``huggingface_hub`` keeps each downloaded file once, as ``<cache>/blobs/<hash>``, and lays out
each revision as ``<cache>/snapshots/<revision>/<file>``, a relative symlink to its blob. The
layout is built here with real files and real symlinks; ``checkpoint.load`` reads it, and
every other symlink (outside the cache, into another cache, a blob that is itself a link out,
a FIFO, a link outside ``snapshots/``) is still refused, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

import checkpoint
from checkpoint import CheckpointError
from checkpoint._cli import main


def _blob(cache: Path, data: bytes) -> str:
    """Store ``data`` as a blob of ``cache``; its name (the content's hash, as the hub names blobs)."""
    name = hashlib.sha256(data).hexdigest()
    (cache / "blobs").mkdir(parents=True, exist_ok=True)
    (cache / "blobs" / name).write_bytes(data)
    return name


def _link(snapshot: Path, file: str, blob: str) -> None:
    snapshot.mkdir(parents=True, exist_ok=True)
    depth = len(Path(file).parts) - 1
    os.symlink(os.path.join(*[".."] * (2 + depth), "blobs", blob), snapshot / file)


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"embed.weight": torch.randn(10, 4), "head.weight": torch.randn(6, 4), "head.bias": torch.randn(6)}


def _cache(tmp_path: Path, *, sharded: bool) -> Path:
    """``models--org--tiny`` with one revision: one file, or two files and an index; the snapshot folder."""
    cache = tmp_path / "hub" / "models--org--tiny"
    snapshot = cache / "snapshots" / "0123abcd"
    tensors = _tensors()
    (cache / "refs").mkdir(parents=True)
    (cache / "refs" / "main").write_text("0123abcd")
    if not sharded:
        _link(snapshot, "model.safetensors", _blob(cache, safetensors.torch.save(tensors)))
    else:
        parts = {"model-00001-of-00002.safetensors": {"embed.weight": tensors["embed.weight"]},
                 "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k.startswith("head")}}
        weight_map = {}
        for file, part in parts.items():
            _link(snapshot, file, _blob(cache, safetensors.torch.save(part)))
            weight_map.update(dict.fromkeys(part, file))
        index = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
        _link(snapshot, "model.safetensors.index.json", _blob(cache, index))
    return snapshot


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "index"])
def test_a_cache_snapshot_loads_through_its_links(tmp_path: Path, sharded: bool,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = _cache(tmp_path, sharded=sharded)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    state = {name: torch.zeros_like(t) for name, t in _tensors().items()}
    checkpoint.load(state, snapshot)
    for name, t in _tensors().items():
        assert torch.equal(state[name], t), name
    # mmap: the blob itself is mapped, never anything else.
    state = {name: torch.zeros_like(t) for name, t in _tensors().items()}
    checkpoint.load(state, snapshot, mmap=True)
    assert torch.equal(state["head.bias"], _tensors()["head.bias"])
    assert main(["inspect", str(snapshot)]) == 0
    assert "head.bias" in capsys.readouterr().out
    assert main(["verify", str(snapshot)]) == 0
    if not sharded:  # the single file's own path, a link too
        state = {name: torch.zeros_like(t) for name, t in _tensors().items()}
        checkpoint.load(state, snapshot / "model.safetensors")
        assert torch.equal(state["embed.weight"], _tensors()["embed.weight"])


def _refused(snapshot: Path, match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as info:
        checkpoint.load({name: torch.zeros_like(t) for name, t in _tensors().items()}, snapshot)
    assert "model.safetensors" in str(info.value)


def test_a_link_out_of_the_cache_is_refused(tmp_path: Path) -> None:
    snapshot = _cache(tmp_path, sharded=False)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(safetensors.torch.save(_tensors()))
    (snapshot / "model.safetensors").unlink()
    os.symlink(outside, snapshot / "model.safetensors")
    _refused(snapshot, "is a symlink, not a regular file; refusing to read it. Only a link of a Hugging Face cache")


def test_a_link_into_another_caches_blobs_is_refused(tmp_path: Path) -> None:
    snapshot = _cache(tmp_path, sharded=False)
    other = tmp_path / "hub" / "models--org--other"
    blob = _blob(other, safetensors.torch.save(_tensors()))
    (snapshot / "model.safetensors").unlink()
    os.symlink(f"../../../models--org--other/blobs/{blob}", snapshot / "model.safetensors")
    assert (snapshot / "model.safetensors").is_file()  # it resolves: only the rule refuses it
    _refused(snapshot, "is a symlink, not a regular file")


def test_a_blob_that_links_out_is_refused(tmp_path: Path) -> None:
    snapshot = _cache(tmp_path, sharded=False)
    blob = next((snapshot.parent.parent / "blobs").iterdir())
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(blob.read_bytes())
    blob.unlink()
    os.symlink(outside, blob)
    _refused(snapshot, "is a symlink, not a regular file")


def test_a_blob_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    snapshot = _cache(tmp_path, sharded=False)
    blob = next((snapshot.parent.parent / "blobs").iterdir())
    blob.unlink()
    os.mkfifo(blob)
    _refused(snapshot, "is a Hugging Face cache link to .* which is not a regular file .*FIFO")


def test_links_outside_a_snapshot_are_refused(tmp_path: Path) -> None:
    """The same ../../blobs/ link in a folder that is not <cache>/snapshots/<revision> is refused."""
    snapshot = _cache(tmp_path, sharded=False)
    elsewhere = snapshot.parent.parent / "refs" / "copy"
    elsewhere.mkdir()
    os.symlink(os.readlink(snapshot / "model.safetensors"), elsewhere / "model.safetensors")
    assert (elsewhere / "model.safetensors").is_file()
    _refused(elsewhere, "is a symlink, not a regular file")
