"""Committed checkpoints of every format version (``tests/data/v<N>``, see ``make_fixtures.py``) load bit for bit,
and each is checked by the rules of the newest version its writer could have been: a file whose fields show a
later writer than its ``"version"`` says is refused (the version was lowered to shed that version's checks), and
``verify --strict`` refuses the versions that carry no checksum of their own metadata."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

import checkpoint
import sharded_tensor as st
from checkpoint._cli import main, verify
from sharding import single_split
from tests.data.make_fixtures import (
    ONE_RANK_VALUES,
    TWO_RANK_VALUES,
    one_rank_tensors,
    two_rank_tensors,
)

DATA = Path(__file__).parent.parent / "data"
VERSIONS = ["v1", "v2", "v3", "v4"]


def _copy(name: str, tmp_path: Path, version: str) -> Path:
    """A private copy, so no test can ever change the committed files."""
    return Path(shutil.copytree(DATA / version / name, tmp_path / name))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _full(t: st.ShardedTensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype)
    for shard in t.local_shards():
        out[tuple(slice(o, o + n) for o, n in zip(shard.metadata.offsets, shard.metadata.dims))] = shard.tensor
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_fixtures_have_their_version(version: str) -> None:
    for name in ("one_rank", "two_ranks"):
        text = (DATA / version / name / "shardkit.json").read_text()
        assert f'"version":{version[1:]},' in text.replace(" ", ""), name


@pytest.mark.parametrize("version", VERSIONS)
def test_one_rank_loads_into_plain_tensors(tmp_path: Path, version: str) -> None:
    folder = _copy("one_rank", tmp_path, version)
    expected = one_rank_tensors()
    state = {name: torch.full_like(t, 0) for name, t in expected.items()}
    state.update({name: None for name in ONE_RANK_VALUES})
    checkpoint.load(state, folder)
    for name, t in expected.items():
        assert state[name].dtype == t.dtype and state[name].shape == t.shape, name
        assert torch.equal(_bits(state[name]), _bits(t)), name
    for name, v in ONE_RANK_VALUES.items():
        assert state[name] == v, name


@pytest.mark.parametrize("version", VERSIONS)
def test_one_rank_loads_into_another_layout(tmp_path: Path, version: str) -> None:
    folder = _copy("one_rank", tmp_path, version)
    expected = one_rank_tensors()
    target = st.zeros(9, 4, sharding_spec=single_split(1, ["rank:0/cpu"] * 2))
    state = {"model": {"sharded": target, "w": None}}
    checkpoint.load(state, folder, strict=False)
    assert torch.equal(_bits(_full(target)), _bits(expected["model.sharded"]))
    assert torch.equal(_bits(state["model"]["w"]), _bits(expected["model.w"]))


@pytest.mark.parametrize("version", VERSIONS)
def test_two_ranks_load_into_one_process(tmp_path: Path, version: str) -> None:
    folder = _copy("two_ranks", tmp_path, version)
    expected = two_rank_tensors()
    state: dict = {name: None for name in expected} | {"step": None}
    checkpoint.load(state, folder)
    for name, t in expected.items():
        assert torch.equal(_bits(state[name]), _bits(t)), name
    assert state["step"] == TWO_RANK_VALUES["step"]
    # column blocks of the row split and row blocks of the column split: partial reads
    rows = st.zeros(8, 6, sharding_spec=single_split(1, ["rank:0/cpu"] * 3))
    cols = st.zeros(5, 8, sharding_spec=single_split(0, ["rank:0/cpu"] * 2), dtype=torch.bfloat16)
    checkpoint.load({"rows": rows, "cols": cols}, folder, strict=False)
    assert torch.equal(_bits(_full(rows)), _bits(expected["rows"]))
    assert torch.equal(_bits(_full(cols)), _bits(expected["cols"]))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", ["one_rank", "two_ranks"])
def test_consolidate_and_verify(tmp_path: Path, name: str, version: str) -> None:
    folder = _copy(name, tmp_path, version)
    expected = one_rank_tensors() if name == "one_rank" else two_rank_tensors()
    checkpoint.consolidate(folder, tmp_path / "out.safetensors", quiet=True)
    out = safetensors.torch.load_file(tmp_path / "out.safetensors")
    assert set(out) == set(expected)
    for key, t in expected.items():
        assert torch.equal(_bits(out[key]), _bits(t)), key
    _, problems = verify(str(folder), quiet=True)
    assert problems == []


def _edit(folder: Path, change) -> None:  # type: ignore[no-untyped-def]
    path = folder / "shardkit.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _load_one_rank(folder: Path) -> dict[str, object]:
    state: dict[str, object] = {name: torch.zeros_like(t) for name, t in one_rank_tensors().items()}
    state.update({name: None for name in ONE_RANK_VALUES})
    return checkpoint.load(state, folder)  # type: ignore[return-value]


def _lowered(data: dict[str, object], *, keep_checksum: bool = True, epoch: int | None = None) -> None:
    data["version"] = 3
    if epoch is not None:
        data["values"]["epoch"] = epoch  # type: ignore[index]
    if not keep_checksum:
        del data["checksum"]


@pytest.mark.parametrize(("case", "change", "says"), [
    pytest.param("v4", lambda d: _lowered(d), "only a version-4 writer writes", id="v4-as-v3-with-its-checksum"),
    pytest.param("v4", lambda d: _lowered(d, epoch=99), "only a version-4 writer writes",
                 id="v4-as-v3-edited-with-its-checksum"),
    pytest.param("v4", lambda d: (_lowered(d), d.update(checksum="sha256:" + "0" * 64)),
                 "only a version-4 writer writes", id="v4-as-v3-with-a-wrong-checksum"),
    pytest.param("v3", lambda d: d.update(version=2), "only a version-3 writer writes", id="v3-as-v2"),
    pytest.param("v3", lambda d: d.update(version=1), "only a version-3 writer writes", id="v3-as-v1"),
    pytest.param("v2", lambda d: d.update(version=1), "only a version-2 writer writes", id="v2-as-v1"),
    pytest.param("v3", lambda d: d.update(checksum="sha256:" + "0" * 64), "only a version-4 writer writes",
                 id="v3-given-a-checksum"),
])
def test_a_file_is_checked_by_its_writers_version(tmp_path: Path, case: str, change, says: str,  # type: ignore[no-untyped-def]
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    folder = _copy("one_rank", tmp_path, case)
    _edit(folder, change)
    with pytest.raises(checkpoint.CheckpointError, match=says) as info:
        _load_one_rank(folder)
    assert "was edited or is corrupt" in str(info.value)
    assert main(["verify", str(folder)]) == 1
    assert says in capsys.readouterr().err


def test_strict_verify_refuses_the_unchecksummed_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for version in VERSIONS:
        folder = _copy("one_rank", tmp_path / version, version)
        assert main(["verify", str(folder)]) == 0
        capsys.readouterr()
        assert main(["verify", "--strict", str(folder)]) == (0 if version == "v4" else 1), version
        if version != "v4":
            err = capsys.readouterr().err
            assert f"format version {version[1:]} records no checksum of its metadata's own content" in err


def test_a_v4_file_lowered_to_v3_without_its_checksum_loads_but_strict_verify_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without the checksum nothing tells an edited version-3 file from a saved one: only --strict notices."""
    folder = _copy("one_rank", tmp_path, "v4")
    _edit(folder, lambda d: _lowered(d, keep_checksum=False, epoch=99))
    assert _load_one_rank(folder)["epoch"] == 99
    assert main(["verify", str(folder)]) == 0
    capsys.readouterr()
    assert main(["verify", "--strict", str(folder)]) == 1
    assert "strict verification refuses it" in capsys.readouterr().err
