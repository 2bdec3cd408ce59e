"""Format version 3's region columns: what save writes reads back as the same regions, and malformed columns
are refused naming ``shardkit.json`` and the tensor.

A tensor's regions are a grid's cut points when they are its cells in row-major order,
otherwise explicit offsets and sizes; then each region's file number, first byte and chunk
checksums, as fixed-width hex strings (``checkpoint/_regions.py``). ``tests/_metadata_edit.py``
reads and edits those columns independently of the library's parser.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoint
import sharded_tensor as st
from checkpoint import CheckpointError, _schema
from checkpoint._regions import RegionTable
from sharding import EnumerableShardingSpec, ShardMetadata, single_split
from tests import _metadata_edit as edit

R0 = "rank:0/cpu"
MESH = [((0, 0), (3, 2)), ((0, 2), (3, 2)), ((3, 0), (3, 2)), ((3, 2), (3, 2))]  # a 2x2 mesh of (6, 4)


def _ramp(*shape: int, dtype: torch.dtype = torch.float32, shift: float = 0.0) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * 0.25 + shift).to(dtype).reshape(shape)


def _sharded(full: torch.Tensor, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> st.ShardedTensor:
    """``full`` held as these blocks, in this order (all on rank 0)."""
    spec = EnumerableShardingSpec([ShardMetadata(o, d, R0) for o, d in boxes])
    t = st.zeros(*full.shape, sharding_spec=spec, dtype=full.dtype)
    for shard in t.local_shards():
        shard.tensor.copy_(full[_slices(shard.metadata.offsets, shard.metadata.dims)])
    return t


def _slices(offsets: tuple[int, ...], dims: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, dims))


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# -- round trips ------------------------------------------------------------------------------------

LAYOUTS = {
    # name: (size, blocks in save order, written as a grid?)
    "row-split": ((10, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4)), ((8, 0), (2, 4))], True),
    "mesh-row-major": ((6, 4), MESH, True),
    "mesh-other-order": ((6, 4), [MESH[3], MESH[0], MESH[2], MESH[1]], False),
    "uneven-blocks": ((6, 4), [((0, 0), (4, 4)), ((4, 0), (2, 1)), ((4, 1), (2, 3))], False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_saved_regions_read_back_as_saved(tmp_path: Path, layout: str) -> None:
    size, boxes, is_grid = LAYOUTS[layout]
    full = _ramp(*size)
    folder = tmp_path / "ck"
    checkpoint.save({"w": _sharded(full, boxes)}, folder, quiet=True)
    data = edit.read(folder)
    raw = edit.regions(data, "w")
    assert raw["count"] == len(boxes)
    assert ("grid" in raw) is is_grid and ("offsets" in raw) is not is_grid and ("dims" in raw) is not is_grid
    if is_grid:  # one string of cut points per dimension
        assert [edit.decode(c, 16) for c in raw["grid"]] == [sorted({0, size[d], *(o[d] for o, _ in boxes)})
                                                             for d in range(len(size))]
    saved = edit.all_regions(data, "w")
    assert [(r.offsets, r.dims) for r in saved] == boxes  # in save order
    md = checkpoint.read_metadata(folder)
    shards = md.tensors["w"].shards
    assert isinstance(shards, RegionTable) and len(shards) == len(boxes)
    expected = tuple(_schema.SavedShard(r.offsets, r.dims, r.file, r.key, (r.start, r.end), "",
                                        raw["chunk_bytes"], r.crcs) for r in saved)
    assert shards == expected and list(shards) == list(expected)  # equal to a tuple of equal SavedShards
    assert [shards[i] for i in range(len(boxes))] == list(expected) and shards[-1] == expected[-1]
    assert shards[1:] == list(expected[1:])
    with pytest.raises(IndexError):
        shards[len(boxes)]
    # each region's bytes are the block of the saved tensor, its key in the file is the default
    for r in saved:
        assert r.key == f"w@{r.offsets[0]},{r.offsets[1]}"
        file_bytes = (folder / r.file).read_bytes()
        assert file_bytes[r.start:r.end] == _bytes(full[_slices(r.offsets, r.dims)])
    assert _schema.parse_metadata(md.to_json()) == md
    # and it loads, into the same layout and into another
    out = checkpoint.load({"w": torch.zeros(size)}, folder)["w"]
    assert torch.equal(out, full)
    target = st.zeros(*size, sharding_spec=single_split(1, [R0] * 3))
    checkpoint.load({"w": target}, folder)
    for shard in target.local_shards():
        assert torch.equal(shard.tensor, full[_slices(shard.metadata.offsets, shard.metadata.dims)])


def test_scalar_and_empty_tensors_read_back(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    checkpoint.save({"s": torch.tensor(2.5, dtype=torch.float64), "e": torch.zeros(0, 4, dtype=torch.int32)}, folder,
                    quiet=True)
    data = edit.read(folder)
    scalar, empty = edit.regions(data, "s"), edit.regions(data, "e")
    # a 0-d tensor: one region with no offsets and no sizes (zero values per region)
    assert scalar["count"] == 1 and scalar["offsets"] == "" and scalar["dims"] == "" and "grid" not in scalar
    # an empty tensor: no region at all
    assert empty == {"count": 0, "digits": 16, "offsets": "", "dims": "", "file": "", "start": "",
                     "chunk_bytes": empty["chunk_bytes"], "crc32c": ""}
    md = checkpoint.read_metadata(folder)
    (r,) = edit.all_regions(data, "s")
    assert md.tensors["s"].shards == (_schema.SavedShard((), (), r.file, "s", (r.start, r.start + 8), "",
                                                         scalar["chunk_bytes"], r.crcs),)
    assert len(r.crcs) == 1 and (folder / r.file).read_bytes()[r.start:r.end] == _bytes(torch.tensor(2.5).double())
    assert md.tensors["e"].shards == () and len(md.tensors["e"].shards) == 0 and list(md.tensors["e"].shards) == []
    assert md.tensors["e"].size == torch.Size([0, 4]) and md.tensors["e"].dtype == torch.int32
    assert _schema.parse_metadata(md.to_json()) == md
    out = checkpoint.load({"s": None, "e": None}, folder)
    assert out["s"].dtype == torch.float64 and out["s"].shape == () and out["s"].item() == 2.5
    assert out["e"].shape == (0, 4) and out["e"].dtype == torch.int32


def test_a_region_whose_key_is_not_the_default_is_listed_in_keys(tmp_path: Path) -> None:
    # A plain tensor named like another tensor's region key: one of the two keys in the file
    # gets a suffix, and "keys" says which.
    full, other = _ramp(6, 2), _ramp(3, 2, shift=100.0)
    folder = tmp_path / "ck"
    checkpoint.save({"w": _sharded(full, [((0, 0), (3, 2)), ((3, 0), (3, 2))]), "w@3,0": other}, folder, quiet=True)
    data = edit.read(folder)
    keys = {name: [r.key for r in edit.all_regions(data, name)] for name in data["tensors"]}
    assert keys == {"w": ["w@0,0", "w@3,0"], "w@3,0": ["w@3,0#1"]}
    assert edit.regions(data, "w@3,0")["keys"] == {"0": "w@3,0#1"} and "keys" not in edit.regions(data, "w")
    md = checkpoint.read_metadata(folder)
    assert [s.key for s in md.tensors["w"].shards] == keys["w"]
    assert [s.key for s in md.tensors["w@3,0"].shards] == keys["w@3,0"]
    assert _schema.parse_metadata(md.to_json()) == md
    out = checkpoint.load({"w": None, "w@3,0": None}, folder)
    assert torch.equal(out["w"], full) and torch.equal(out["w@3,0"], other)
    # the key is what the reader looks up in the data file's header: a name the file does not
    # have, or the entry of w's block (elsewhere in the file), is refused
    file = edit.region(data, "w", 0).file
    for key, problem in (("nope", "the header has no such entry"), ("w@3,0", "the header places the data at")):
        edit.regions(data, "w@3,0")["keys"] = {"0": key}
        edit.write(folder, data)
        assert checkpoint.read_metadata(folder).tensors["w@3,0"].shards[0].key == key
        with pytest.raises(CheckpointError, match=problem) as info:
            checkpoint.load({"w@3,0": None}, folder, strict=False)
        assert f"safetensors file '{folder / file}', key {key!r} of tensor 'w@3,0'" in str(info.value)


# -- malformed columns ---------------------------------------------------------------------------

def _saved(tmp_path: Path) -> Path:
    """``w``: a 2x2 mesh of (6, 4) saved as a grid; ``v``: the same blocks out of order, explicit."""
    folder = tmp_path / "ck"
    checkpoint.save({"w": _sharded(_ramp(6, 4), MESH), "v": _sharded(_ramp(6, 4), MESH[::-1]), "step": 1}, folder,
                    quiet=True)
    return folder


def _replace_value(text: str, i: int, digits: int, value: str) -> str:
    return text[:i * digits] + value + text[(i + 1) * digits:]


def _column(md: dict[str, Any], name: str, column: str, value: Any) -> None:
    edit.regions(md, name)[column] = value


def _grid(md: dict[str, Any], d: int, cuts: list[int]) -> None:
    edit.regions(md, "w")["grid"][d] = edit.encode(cuts, 16)


def _upper(md: dict[str, Any], name: str, column: str) -> None:
    text = edit.regions(md, name)[column]
    assert text.upper() != text, text  # it has hex letters, so capitals change it
    edit.regions(md, name)[column] = text.upper()


def _listed_twice(md: dict[str, Any]) -> None:
    # v's region 0 again in place of region 1 (columns stay well formed)
    r0 = edit.region(md, "v", 0)
    edit.set_region(md, "v", 1, offsets=r0.offsets, dims=r0.dims)


MALFORMED = {
    # id: (edit of the JSON data, tensor, what the message says after "tensor '<name>' regions")
    "start-short": (lambda m: _column(m, "w", "start", m["tensors"]["w"]["regions"]["start"][:-1]), "w",
                    r" start: expected 4 x 16 lowercase hex digits \(each below 2\*\*63\)"),
    "start-long": (lambda m: _column(m, "w", "start", m["tensors"]["w"]["regions"]["start"] + "0"), "w",
                   r" start: expected 4 x 16"),
    "start-capitals": (lambda m: _column(m, "w", "start", _replace_value(m["tensors"]["w"]["regions"]["start"], 1, 16,
                                                                         "00000000000000AB")), "w",
                       r" start: expected 4 x 16 lowercase hex digits"),
    "crc-capitals": (lambda m: _upper(m, "w", "crc32c"), "w",
                     r" crc32c: chunk checksums must be 4 x 8 lowercase hex digits"),
    "start-not-hex": (lambda m: _column(m, "w", "start", "g" + m["tensors"]["w"]["regions"]["start"][1:]), "w",
                      r" start: expected 4 x 16"),
    "start-2**63": (lambda m: _column(m, "w", "start", _replace_value(m["tensors"]["w"]["regions"]["start"], 2, 16,
                                                                      "8000000000000000")), "w",
                    r" start: expected 4 x 16 lowercase hex digits \(each below 2\*\*63\)"),
    "start-2**64-1": (lambda m: _column(m, "w", "start", _replace_value(m["tensors"]["w"]["regions"]["start"], 2, 16,
                                                                        "f" * 16)), "w", r" start: expected 4 x 16"),
    "start-in-header": (lambda m: edit.set_region(m, "w", 3, start=7), "w", r"\[3\] start: \[7, 31\) does not hold"),
    "start-past-file": (lambda m: edit.set_region(m, "w", 2, start=m["files"][0]["bytes"] - 23), "w",
                        r"\[2\] start: \[\d+, \d+\) does not hold 24 bytes .* inside file 'data-.*' of \d+ bytes"),
    "start-max": (lambda m: edit.set_region(m, "w", 2, start=2**63 - 1), "w", r"\[2\] start: .* does not hold"),
    "file-short": (lambda m: _column(m, "v", "file", "0" * 63), "v", r" file: expected 4 x 16 lowercase hex digits"),
    "file-capitals": (lambda m: _column(m, "v", "file", "000000000000000A" + "0" * 48), "v", r" file: expected 4 x 16"),
    "file-beyond-list": (lambda m: edit.set_region(m, "v", 1, file=1), "v",
                         r"\[1\] file: file number 1 is not in \"files\" \(1 listed\)"),
    "file-max": (lambda m: edit.set_region(m, "v", 3, file=2**32 - 1), "v",
                 r"\[3\] file: file number 4294967295 is not in \"files\""),
    "offsets-2**63": (lambda m: _column(m, "v", "offsets", _replace_value(m["tensors"]["v"]["regions"]["offsets"], 1,
                                                                          16, "8" + "0" * 15)), "v",
                      r" offsets: expected 8 x 16 lowercase hex digits \(each below 2\*\*63\)"),
    "dims-short": (lambda m: _column(m, "v", "dims", m["tensors"]["v"]["regions"]["dims"][:-16]), "v",
                   r" dims: expected 8 x 16"),
    "block-outside": (lambda m: edit.set_region(m, "v", 2, offsets=(3, 3)), "v",
                      r"\[2\]: the block offsets=\[3, 3\], dims=\[3, 2\] lies outside the tensor's size \[6, 4\]"),
    "listed-twice": (_listed_twice, "v", r": a region is listed twice"),
    "gap": (lambda m: edit.drop_region(m, "v", 1), "v", r": saved regions leave a gap at element \(3, 0\)"),
    "grid-not-from-0": (lambda m: _grid(m, 0, [1, 3, 6]), "w", r" grid: expected, per dimension of size \[6, 4\]"),
    "grid-not-to-size": (lambda m: _grid(m, 1, [0, 2, 5]), "w", r" grid: expected, .* from 0 to the size"),
    "grid-short-of-size": (lambda m: _grid(m, 1, [0, 2, 3]), "w", r" grid: expected"),
    "grid-out-of-order": (lambda m: _grid(m, 0, [0, 6, 3]), "w", r" grid: expected, .*strictly increasing"),
    "grid-repeated-cut": (lambda m: _grid(m, 0, [0, 3, 3, 3, 6]) or _grid(m, 1, [0, 4]), "w", r" grid: expected"),
    "grid-more-cells": (lambda m: _grid(m, 0, [0, 1, 3, 6]), "w", r" grid: expected, .* with 4 cells in all"),
    "grid-fewer-cells": (lambda m: _grid(m, 0, [0, 6]), "w", r" grid: expected, .* with 4 cells in all"),
    "grid-2**63": (lambda m: _column(m, "w", "grid", [m["tensors"]["w"]["regions"]["grid"][0], "0" * 16 + "8" * 16]),
                   "w", r" grid: expected"),
    "grid-capitals": (lambda m: _column(m, "w", "grid", [g.replace("6", "A") for g in
                                                         m["tensors"]["w"]["regions"]["grid"]]), "w",
                      r" grid: expected"),
    "grid-one-dimension": (lambda m: _column(m, "w", "grid", m["tensors"]["w"]["regions"]["grid"][:1]), "w",
                           r" grid: expected"),
    "count-huge": (lambda m: _column(m, "v", "count", 2**62), "v", r" file: expected 4611686018427387904 x 16"),
    "count-huge-grid": (lambda m: _column(m, "w", "count", 2**62), "w", r" file: expected 4611686018427387904 x 16"),
    "count-one-more": (lambda m: _column(m, "w", "count", 5), "w", r" file: expected 5 x 16"),
    "count-2**63": (lambda m: _column(m, "v", "count", 2**63), "v", r" count: expected a non-negative int"),
    "count-negative": (lambda m: _column(m, "v", "count", -1), "v", r" count: expected a non-negative int"),
    "count-bool": (lambda m: _column(m, "v", "count", True), "v", r" count: expected a non-negative int"),
    "chunk-bytes-0": (lambda m: _column(m, "v", "chunk_bytes", 0), "v", r" chunk_bytes: expected a chunk size"),
    "chunk-bytes-small": (lambda m: _column(m, "v", "chunk_bytes", 4), "v",
                          r" crc32c: chunk checksums must be 24 x 8"),
    "crc-not-hex": (lambda m: _column(m, "v", "crc32c", "-" + m["tensors"]["v"]["regions"]["crc32c"][1:]), "v",
                    r" crc32c: chunk checksums must be 4 x 8"),
    "keys-not-digits": (lambda m: _column(m, "v", "keys", {"x": "v"}), "v", r" keys: expected"),
    "keys-superscript": (lambda m: _column(m, "v", "keys", {"\u00b2": "v"}), "v", r" keys: expected"),
    "keys-arabic-digit": (lambda m: _column(m, "v", "keys", {"\u0663": "v"}), "v", r" keys: expected"),
    "keys-leading-zero": (lambda m: _column(m, "v", "keys", {"01": "v"}), "v", r" keys: expected"),
    "keys-long-number": (lambda m: _column(m, "v", "keys", {"1" + "0" * 5000: "v"}), "v", r" keys: expected"),
    "keys-beyond-count": (lambda m: _column(m, "v", "keys", {"4": "v"}), "v", r" keys: expected"),
    "keys-empty-name": (lambda m: _column(m, "v", "keys", {"0": ""}), "v", r" keys: expected"),
    "unknown-column": (lambda m: _column(m, "v", "checksum", "crc32c:00000000"), "v", r": unknown keys \['checksum'\]"),
    "digits-odd": (lambda m: _column(m, "v", "digits", 3), "v", r" digits: expected one of \[2, 4, 8, 16\], got 3"),
    "digits-wide": (lambda m: _column(m, "v", "digits", 32), "v", r" digits: expected one of \[2, 4, 8, 16\]"),
    "digits-text": (lambda m: _column(m, "v", "digits", "16"), "v", r" digits: expected one of \[2, 4, 8, 16\]"),
    "digits-bool": (lambda m: _column(m, "v", "digits", True), "v", r" digits: expected one of \[2, 4, 8, 16\]"),
    "digits-missing": (lambda m: m["tensors"]["v"]["regions"].pop("digits"), "v", r" digits: expected one of"),
    "digits-narrower": (lambda m: _column(m, "v", "digits", 8), "v", r" file: expected 4 x 8 lowercase hex digits"),
    "not-an-object": (lambda m: m["tensors"]["v"].update(regions=[]), "v",
                      r": expected an object, got list"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_columns_name_the_metadata_and_the_tensor(tmp_path: Path, case: str) -> None:
    change, name, problem = MALFORMED[case]
    folder = _saved(tmp_path)
    md = edit.read(folder)
    checkpoint.read_metadata(folder)  # well formed before the change
    before = json.dumps(md)
    change(md)
    assert json.dumps(md) != before
    edit.write(folder, md)
    source = str(folder / "shardkit.json")
    for read in (lambda: checkpoint.read_metadata(folder), lambda: checkpoint.load({"w": None, "v": None,
                                                                                    "step": None}, folder)):
        with pytest.raises(CheckpointError) as info:
            read()
        message = str(info.value)
        prefix = f"malformed checkpoint metadata {source!r}: tensor {name!r} regions"
        assert message.startswith(prefix), message
        assert re.match(problem, message[len(prefix):]), (problem, message)


def test_columns_use_as_few_digits_as_their_values_need(tmp_path: Path) -> None:
    small, large = tmp_path / "small", tmp_path / "large"
    checkpoint.save({"w": _sharded(_ramp(6, 4), [((0, 0), (3, 4)), ((3, 0), (3, 4))])}, small, quiet=True)
    # 70,000 bytes before "z" in the file: its start needs more than 4 hex digits
    checkpoint.save({"a": torch.zeros(17500), "z": torch.ones(3)}, large, quiet=True)
    raw_small = json.loads((small / "shardkit.json").read_text())["tensors"]["w"]["regions"]
    raw_large = json.loads((large / "shardkit.json").read_text())["tensors"]
    assert raw_small["digits"] == 4 and len(raw_small["start"]) == 2 * 4  # starts in [256, 65536)
    assert {raw_large["a"]["regions"]["digits"], raw_large["z"]["regions"]["digits"]} == {4, 8}
    for folder, names in ((small, ["w"]), (large, ["a", "z"])):
        state = {name: None for name in names}
        checkpoint.load(state, folder)
        for name in names:
            assert edit.all_regions(edit.read(folder), name) == edit.all_regions(
                json.loads((folder / "shardkit.json").read_text()), name)
    assert torch.equal(state["z"], torch.ones(3)) and torch.equal(state["a"], torch.zeros(17500))


def test_the_count_of_a_scalar_is_bounded_by_its_columns(tmp_path: Path) -> None:
    # A 0-d tensor's offsets and sizes are empty strings whatever the count: the per-region
    # columns must refuse a huge count before anything of that length is built.
    folder = tmp_path / "ck"
    checkpoint.save({"s": torch.tensor(1.5)}, folder, quiet=True)
    saved = edit.read(folder)
    (r,) = edit.all_regions(saved, "s")
    assert r.offsets == () and r.dims == () and edit.regions(saved, "s")["offsets"] == ""
    source = str(folder / "shardkit.json")
    for count, problem in ((2**62 + 1, r"file: expected 4611686018427387905 x 16"), (2, r"file: expected 2 x 16")):
        md = copy.deepcopy(saved)
        edit.regions(md, "s")["count"] = count
        edit.write(folder, md)
        with pytest.raises(CheckpointError, match=rf"^malformed checkpoint metadata {re.escape(repr(source))}: "
                                                  rf"tensor 's' regions {problem}"):
            checkpoint.read_metadata(folder)
    # every column doubled: a second copy of the one element, refused as such
    md = copy.deepcopy(saved)
    regions = edit.regions(md, "s")
    regions.update(count=2, file=regions["file"] * 2, start=regions["start"] * 2, crc32c=regions["crc32c"] * 2)
    edit.write(folder, md)
    with pytest.raises(CheckpointError, match=r"tensor 's' regions: a region is listed twice"):
        checkpoint.read_metadata(folder)


def test_a_bad_region_among_many_is_named() -> None:
    # 300 regions of a (600, 4) tensor, 2 rows each, listed last to first (explicit blocks).
    file = "data-ab-r00000.safetensors"
    rows = list(range(299, -1, -1))
    regions = {"count": 300, "offsets": edit.encode([v for r in rows for v in (2 * r, 0)], 16),
               "dims": edit.encode([2, 4] * 300, 16), "file": edit.encode([0] * 300, 16), "digits": 16,
               "start": edit.encode([8 + 32 * r for r in rows], 16), "chunk_bytes": 1 << 20,
               "crc32c": edit.encode([0] * 300, 8)}
    data = {"format": "shardkit-checkpoint", "version": 3, "generation": "ab", "world_size": 1,
            "files": [{"name": file, "bytes": 8 + 600 * 4 * 4}],
            "tensors": {"w": {"dtype": "float32", "size": [600, 4], "regions": regions}}, "values": {}}
    entry = _schema.parse_metadata(json.dumps(data), source="S").tensors["w"]
    assert entry.shards[120].offsets == (2 * 179, 0) and entry.shards[120].byte_range == (8 + 32 * 179, 8 + 32 * 180)
    assert [s.offsets for s, _ in entry.overlapping(((101, 0), (2, 4)))] == [(102, 0), (100, 0)]
    md = json.loads(json.dumps(data))
    edit.set_region(md, "w", 120, start=8 + 600 * 16 - 31)
    with pytest.raises(CheckpointError, match=r"'S': tensor 'w' regions\[120\] start: \[9577, 9609\) does not hold"):
        _schema.parse_metadata(json.dumps(md), source="S")
    md = json.loads(json.dumps(data))
    edit.set_region(md, "w", 121, dims=(2, 5))
    with pytest.raises(CheckpointError, match=r"'w' regions\[121\]: the block offsets=\[356, 0\], dims=\[2, 5\]"):
        _schema.parse_metadata(json.dumps(md), source="S")
    md = json.loads(json.dumps(data))
    edit.drop_region(md, "w", 292)  # rows 14 and 15
    with pytest.raises(CheckpointError, match=r"tensor 'w' regions: saved regions leave a gap at element \(14, 0\)"):
        _schema.parse_metadata(json.dumps(md), source="S")
