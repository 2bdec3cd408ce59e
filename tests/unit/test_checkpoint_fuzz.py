"""Random corruption of ``shardkit.json`` and of the safetensors headers never gets past the readers silently.

A small checkpoint is saved once; each example changes one thing (a value anywhere in the
metadata or in a data file's header: types, sizes, offsets, names, nesting depth, huge
numbers, unicode, a duplicated key, the header length; or one of a tensor's region columns
of format version 3: hex strings of the wrong length, with capitals or other characters,
other digits, values out of range such as a file number beyond "files" or a start beyond
the file, huge counts, grid cut points out of order or not spanning the tensor, another
chunk size, region keys) and runs every reader: ``load``
into typed targets and into ``None``, ``consolidate`` and ``verify``. Each must either
succeed with the saved tensors bit for bit, or raise ``CheckpointError``/``ValueError``
whose message names the file at fault. An audit hook on ``open`` checks that nothing
outside the checkpoint folder is opened, and peak memory must not grow by more than the
files could justify.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkpoint
import sharded_tensor as sht
from checkpoint import CheckpointError
from checkpoint.__main__ import main
from sharding import EnumerableShardingSpec, ShardMetadata, single_split
from tests import _metadata_edit as edit

R0 = "rank:0/cpu"
ORIGINAL = {"w": torch.arange(48, dtype=torch.float32).reshape(8, 6) / 4,  # a grid: split along dim 1
            "v": torch.arange(24, dtype=torch.float32).reshape(4, 6) - 7,  # a 2x2 mesh out of order: explicit blocks
            "b": torch.arange(5, dtype=torch.int64) - 2,
            "h": torch.arange(6, dtype=torch.float16).reshape(2, 3),
            "w@0,3": torch.arange(4, dtype=torch.int32).reshape(2, 2),  # named like w's second region: a "keys" entry
            "s": torch.tensor(1.5, dtype=torch.float64),  # 0-d: no offsets, no sizes
            "e": torch.zeros(0, 3, dtype=torch.int16)}  # empty: no region
_V_BLOCKS = [((2, 3), (2, 3)), ((0, 0), (2, 3)), ((2, 0), (2, 3)), ((0, 3), (2, 3))]


def _sharded(full: torch.Tensor, spec: Any) -> sht.ShardedTensor:
    t = sht.zeros(*full.shape, sharding_spec=spec, dtype=full.dtype)
    for shard in t.local_shards():
        o, n = shard.metadata.offsets, shard.metadata.dims
        shard.tensor.copy_(full[o[0]:o[0] + n[0], o[1]:o[1] + n[1]])
    return t


def _state() -> dict[str, Any]:
    v = _sharded(ORIGINAL["v"], EnumerableShardingSpec([ShardMetadata(o, d, R0) for o, d in _V_BLOCKS]))
    plain = {name: ORIGINAL[name].clone() for name in ("b", "h", "w@0,3", "s", "e")}
    return {"w": _sharded(ORIGINAL["w"], single_split(1, [R0] * 2)), "v": v, **plain, "epoch": 2, "cfg": {"lr": 0.5}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fuzz") / "ck"
    checkpoint.save(_state(), folder, quiet=True)
    md = edit.read(folder)
    # the layouts the region mutations are meant to reach
    assert "grid" in edit.regions(md, "w") and "offsets" in edit.regions(md, "v")
    assert edit.regions(md, "v")["count"] == 4 and edit.regions(md, "e")["count"] == 0
    assert edit.regions(md, "s")["dims"] == "" and edit.regions(md, "w@0,3")["keys"] == {"0": "w@0,3#1"}
    return folder


# -- the audit hook: every file opened while a reader runs ----------------------------------

_OPENED: list[str] = []
_ACTIVE = [False]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _ACTIVE[0] and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # hooks cannot be removed; this one records only while _ACTIVE


def _outside(paths: list[str], allowed: list[Path]) -> list[str]:
    roots = [os.path.realpath(a) for a in allowed]
    bad = []
    for p in paths:
        real = os.path.realpath(p)
        if any(real == r or real.startswith(r + os.sep) for r in roots):
            continue
        if real.endswith((".py", ".pyc", ".so")) or real.startswith(("/proc/", "/sys/")):
            continue  # lazy imports and the runtime's own probes, not checkpoint files
        bad.append(p)
    return bad


# -- mutations ---------------------------------------------------------------------------------

_HUGE = st.sampled_from([2**31, 2**32 + 1, 2**53 + 1, 2**63, 2**64 + 7, 10**30, -1, -(2**63)])
_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-1000, 10**6), _HUGE,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["../x", "/etc/passwd", "shardkit.json", "é\u202e\U0001f600", "", ".",
                                           "float64", "int32", "F32", "I64", "crc32c:00000000", "w@0,3"]),
)
_VALUE = st.one_of(
    _LEAF,
    st.lists(st.one_of(st.integers(-3, 2**40), _HUGE), max_size=4),
    st.dictionaries(st.text(max_size=4), _LEAF, max_size=3),
    st.integers(1, 50_000).map(lambda d: ["DEEP", d]),  # replaced by d nested lists below
)


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _paths(v, (*prefix, i))
    return out


def _dump(value: Any) -> str:
    if isinstance(value, list) and len(value) == 2 and value[0] == "DEEP":
        return "[" * value[1] + "]" * value[1]
    return json.dumps(value)


def _serialize(tree: Any, path: tuple[Any, ...], op: str, value: Any) -> str:
    """``tree`` as JSON text with the change ``op`` applied at ``path`` (``replace``, ``delete``, ``duplicate``)."""
    if not path:
        if op == "replace":
            return _dump(value)
        if op == "duplicate" and isinstance(tree, dict) and tree:
            key = next(iter(tree))
            inner = ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in tree.items())
            return "{" + inner + f",{json.dumps(key)}:{_dump(value)}" + "}"
        return json.dumps(tree)
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        parts = []
        for k, v in tree.items():
            if k == head:
                if op == "delete" and not rest:
                    continue
                parts.append(f"{json.dumps(k)}:{_serialize(v, rest, op, value)}")
            else:
                parts.append(f"{json.dumps(k)}:{json.dumps(v)}")
        return "{" + ",".join(parts) + "}"
    items = []
    for i, v in enumerate(tree):
        if i == head:
            if op == "delete" and not rest:
                continue
            items.append(_serialize(v, rest, op, value))
        else:
            items.append(json.dumps(v))
    return "[" + ",".join(items) + "]"


def _read_header(path: Path) -> tuple[dict[str, Any], int, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), n, raw[8 + n:]


def _reseal(tree: dict[str, Any], text: str) -> str:
    """``text`` with the content checksum of what it now holds, unless the edit hit the checksum itself:
    so the defences behind the checksum (every check of the content) are what is fuzzed."""
    old = tree.get("checksum")
    try:
        new = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if not isinstance(old, str) or not isinstance(new, dict) or new.get("checksum") != old:
        return text
    try:
        return text.replace(json.dumps(old), json.dumps(edit.seal(new)))
    except (ValueError, RecursionError):
        return text


def _apply(folder: Path, target: str, path_index: int, op: str, value: Any, length: int | None) -> str:
    """Mutate the copy in ``folder``; return the name of the file changed."""
    if target == "metadata":
        tree = json.loads((folder / "shardkit.json").read_text())
        paths = _paths(tree)
        text = _reseal(tree, _serialize(tree, paths[path_index % len(paths)], op, value))
        (folder / "shardkit.json").write_text(text)
        return "shardkit.json"
    data = min(folder.glob("data-*.safetensors"))
    header, n, body = _read_header(data)
    if length is not None:  # only the 8-byte header length changes
        data.write_bytes(length.to_bytes(8, "little") + data.read_bytes()[8:])
        return data.name
    paths = _paths(header)
    text = _serialize(header, paths[path_index % len(paths)], op, value).encode()
    text += b" " * (-(8 + len(text)) % 8)
    data.write_bytes(len(text).to_bytes(8, "little") + text + body)
    # Keep shardkit.json consistent with the new header size, so the header itself is what is tested.
    md = edit.read(folder)
    edit.shift_file(md, data.name, len(text) - n)
    edit.write(folder, md)
    return data.name


# -- mutations of the region columns (format version 3) -------------------------------------------

_TENSORS = st.sampled_from(["w", "w", "v", "v", "b", "h", "w@0,3", "s", "e"])
_HEX_COLUMNS = {"grid": edit.OFFSET_DIGITS, "offsets": edit.OFFSET_DIGITS, "dims": edit.OFFSET_DIGITS,
                "file": edit.FILE_DIGITS, "start": edit.OFFSET_DIGITS, "crc32c": edit.CRC_DIGITS}
_NUMBER = st.one_of(st.integers(0, 700), st.sampled_from([2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**62, 2**63 - 1,
                                                          2**63, 2**64 - 1]))
_DELTA = st.sampled_from([-8, -1, 1, 2, 8, 4096, 2**32])
_BAD_CHAR = st.sampled_from(["g", "G", "A", "F", " ", "-", "+", "x", "\u00e9", "\u0660", "\u00b2", "\x00", "\n", '"',
                             "\\"])
_ODD = st.sampled_from([-1, True, False, None, 1.5, "1", [], {}, 2**62, 2**63, 2**64 + 7, 10**30])
_REGION_EDIT = st.one_of(
    # ("digits", tensor, column, how, position, char): the hex text itself
    st.tuples(st.just("digits"), _TENSORS, st.sampled_from(list(_HEX_COLUMNS)),
              st.sampled_from(["drop", "add", "capitals", "char", "other"]), st.integers(0, 10_000), _BAD_CHAR),
    # ("value", tensor, column, index, how, number): one value of a column, set or moved
    st.tuples(st.just("value"), _TENSORS, st.sampled_from(list(_HEX_COLUMNS)), st.integers(0, 10_000),
              st.sampled_from(["set", "add"]), st.one_of(_NUMBER, _DELTA)),
    # ("start-near-end", tensor, index, delta): a region moved to end ``delta`` bytes past its file's end
    st.tuples(st.just("start-near-end"), _TENSORS, st.integers(0, 10), st.sampled_from([-8, -1, 0, 1, 8, 2**32])),
    # ("file-beyond", tensor, index, extra): a file number ``extra`` past the end of "files"
    st.tuples(st.just("file-beyond"), _TENSORS, st.integers(0, 10), st.sampled_from([0, 1, 2**31, 2**32 - 2])),
    # ("count", tensor, how, value): the region count
    st.tuples(st.just("count"), _TENSORS, st.sampled_from(["add", "set"]), st.one_of(_DELTA, _ODD)),
    # ("chunk_bytes", tensor, value)
    st.tuples(st.just("chunk_bytes"), _TENSORS, st.one_of(st.sampled_from([0, 1, 3, 4, 24, 2**30, 2**30 + 1]), _ODD)),
    # ("grid", tensor, dimension, how, position): cut points out of order, repeated, not from 0 or not to the size
    st.tuples(st.just("grid"), _TENSORS, st.integers(0, 3),
              st.sampled_from(["swap", "repeat", "first", "last", "insert", "remove", "empty", "extra-dimension"]),
              st.integers(0, 10)),
    # ("explicit", tensor): the grid written as explicit blocks (still valid)
    st.tuples(st.just("explicit"), _TENSORS),
    # ("drop-region", tensor, index)
    st.tuples(st.just("drop-region"), _TENSORS, st.integers(0, 10)),
    # ("keys", tensor, keys)
    st.tuples(st.just("keys"), _TENSORS,
              st.one_of(st.dictionaries(st.sampled_from(["0", "1", "3", "4", "01", "-1", "\u00b2", "\u0663", "1e3",
                                                         "9" * 25, " 0", ""]),
                                        st.sampled_from(["w", "w@0,0", "w@0,3", "w@0,3#1", "v@0,0", "b", "", "nope"]),
                                        max_size=2), _ODD)),
)


def _change_text(text: str, how: str, position: int, char: str) -> str:
    """One change to the characters of a hex column."""
    at = position % len(text) if text else 0
    if how == "drop":
        return text[:at] + text[at + 1:] if text else "0"
    if how == "add":
        return text[:at] + "0" + text[at:]
    if how == "capitals":
        return text.upper() if text.upper() != text else text[:at] + "A" + text[at + 1:]
    if how == "char":
        return text[:at] + char + text[at + 1:]
    digit = f"{(int(text[at], 16) + 1 + position % 15) % 16:x}" if text else "1"  # "other": another hex digit
    return text[:at] + digit + text[at + 1:]


def _hex_column(md: dict[str, Any], name: str, column: str, position: int) -> tuple[dict[str, Any] | list[str], Any]:
    """The container and key of a column's text: a grid column is one dimension's string."""
    raw = edit.regions(md, name)
    if column == "grid" and "grid" not in raw:
        column = "offsets"
    if column in ("offsets", "dims") and "grid" in raw:
        edit.explicit(md, name)
    if column == "grid":
        return raw["grid"], position % len(raw["grid"])
    return raw, column


def _edit_regions(md: dict[str, Any], change: tuple[Any, ...]) -> None:
    kind, name, *args = change
    raw = edit.regions(md, name)
    count = raw["count"]
    if kind == "digits":
        column, how, position, char = args
        holder, key = _hex_column(md, name, column, position)
        holder[key] = _change_text(holder[key], how, position, char)  # type: ignore[index]
    elif kind == "value":
        column, index, how, number = args
        digits = _HEX_COLUMNS[column]
        holder, key = _hex_column(md, name, column, index)
        values = edit.decode(holder[key], digits) or [0]  # type: ignore[index]
        at = index % len(values)
        values[at] = number if how == "set" else values[at] + number
        holder[key] = edit.encode([v % 16**digits if v < 0 else v for v in values], digits)  # type: ignore[index]
    elif kind == "start-near-end" and count:
        index, delta = args
        r = edit.region(md, name, index % count)
        file_bytes = edit.file_entry(md, r.file)["bytes"]
        edit.set_region(md, name, index % count, start=max(file_bytes - (r.end - r.start) + delta, 0))
    elif kind == "file-beyond" and count:
        index, extra = args
        edit.set_region(md, name, index % count, file=len(md["files"]) + extra)
    elif kind == "count":
        how, value = args
        raw["count"] = count + value if how == "add" and isinstance(value, int) else value
    elif kind == "chunk_bytes":
        raw["chunk_bytes"] = args[0]
    elif kind == "grid" and "grid" in raw:
        d, how, position = args
        cuts = edit.decode(raw["grid"][d % len(raw["grid"])], edit.OFFSET_DIGITS)
        k = position % (len(cuts) - 1)
        size = md["tensors"][name]["size"][d % len(raw["grid"])]
        if how == "swap":
            cuts[k], cuts[k + 1] = cuts[k + 1], cuts[k]
        elif how == "repeat":
            cuts.insert(k, cuts[k])
        elif how == "first":
            cuts[0] = 1 + position
        elif how == "last":
            cuts[-1] = size + position - 5
        elif how == "insert":
            cuts.insert(k + 1, (cuts[k] + cuts[k + 1]) // 2)
        elif how == "remove":
            del cuts[k]
        if how == "empty":
            raw["grid"][d % len(raw["grid"])] = ""
        elif how == "extra-dimension":
            raw["grid"].append(edit.encode([0, 1], edit.OFFSET_DIGITS))
        else:
            raw["grid"][d % len(raw["grid"])] = edit.encode([max(c, 0) for c in cuts], edit.OFFSET_DIGITS)
    elif kind == "explicit" and "grid" in raw:
        edit.explicit(md, name)
    elif kind == "drop-region" and count:
        edit.drop_region(md, name, args[0] % count)
    elif kind == "keys":
        raw["keys"] = args[0]


def _apply_regions(folder: Path, change: tuple[Any, ...]) -> str:
    """Apply one change to the region columns of the copy in ``folder``; return the name of the file changed."""
    md = edit.read(folder)
    _edit_regions(md, change)
    edit.write(folder, md)
    return "shardkit.json"


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _listed_files(folder: Path) -> list[Path]:
    """The data files the (changed) shardkit.json lists, as paths in ``folder``: a file renamed in
    "files" is the one a region's file number now points to, and the one an error names."""
    try:
        files = json.loads((folder / "shardkit.json").read_text()).get("files")
    except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, nested too deep
        return []
    return [folder / f["name"] for f in files if isinstance(f, dict) and isinstance(f.get("name"), str)] \
        if isinstance(files, list) else []


def _check_outcome(what: str, exc: BaseException | None, changed: str, listed: list[Path]) -> None:
    if exc is None:
        return
    assert isinstance(exc, (CheckpointError, ValueError)), f"{what}: {type(exc).__name__}: {exc}"
    text = str(exc)
    assert changed in text or "shardkit.json" in text or "data-" in text or any(repr(str(p)) in text for p in listed), \
        f"{what} names no file: {text}"


def _run_readers(folder: Path, out: Path, changed: str, capsys: pytest.CaptureFixture[str]) -> None:
    listed = _listed_files(folder)
    # typed targets: success means the saved values, bit for bit
    typed = {**{name: torch.zeros_like(t) for name, t in ORIGINAL.items()}, "epoch": None, "cfg": {"lr": None}}
    # The size and dtype of an empty tensor are only in shardkit.json (no bytes, no header entry):
    # nothing can tell [0, 3] from a relabelled [0], so "e" always gets a typed target.
    untyped: dict[str, Any] = {**dict.fromkeys(ORIGINAL), "e": torch.zeros(0, 3, dtype=torch.int16), "epoch": None,
                               "cfg": {"lr": None}}
    for what, sd in (("load typed", typed), ("load None", untyped)):
        exc = None
        try:
            checkpoint.load(sd, folder)
        except Exception as e:  # noqa: BLE001  # classified below
            exc = e
        _check_outcome(what, exc, changed, listed)
        if exc is None:
            for name, t in ORIGINAL.items():
                assert sd[name].dtype == t.dtype and sd[name].shape == t.shape, (what, name)
                assert _bits(sd[name]) == _bits(t), (what, name)
    exc = None
    try:
        checkpoint.consolidate(folder, out / "o.safetensors", quiet=True)
    except Exception as e:  # noqa: BLE001
        exc = e
    _check_outcome("consolidate", exc, changed, listed)
    capsys.readouterr()
    status = main(["verify", "-q", str(folder)])  # anything but a clean report escapes as an exception
    err = capsys.readouterr().err
    if status != 0:
        assert "Traceback" not in err and err.strip(), err


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(["metadata", "metadata", "header", "regions", "regions"]),
       path_index=st.integers(0, 10_000),
       op=st.sampled_from(["replace", "replace", "replace", "delete", "duplicate"]), value=_VALUE,
       length=st.one_of(st.none(), st.none(), st.none(), st.sampled_from([0, 1, 7, 2**40, 2**64 - 1, 100_000_001])),
       region_edit=_REGION_EDIT)
def test_corrupted_metadata_and_headers_are_refused_cleanly(saved: Path, capsys: pytest.CaptureFixture[str],
                                                            target: str, path_index: int, op: str, value: Any,
                                                            length: int | None, region_edit: tuple[Any, ...]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(saved, Path(tmp) / "ck"))
        out = Path(tmp) / "out"
        out.mkdir()
        if target == "regions":
            changed = _apply_regions(folder, region_edit)
        else:
            changed = _apply(folder, target, path_index, op, value, length if target == "header" else None)
        real_bytes = sum(p.stat().st_size for p in folder.iterdir())
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        _OPENED.clear()
        _ACTIVE[0] = True
        try:
            _run_readers(folder, out, changed, capsys)
        finally:
            _ACTIVE[0] = False
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        assert _outside(_OPENED, [folder, out]) == []
        # A few times the files' size plus interpreter noise; never what a lying size would claim.
        assert grown <= 64 * 2**20 + 8 * real_bytes, f"peak memory grew by {grown} bytes"


def test_the_mutations_reach_the_readers(saved: Path, tmp_path: Path) -> None:
    """The fuzzer's plumbing works: a duplicate key and a relabelled header dtype are both produced."""
    folder = Path(shutil.copytree(saved, tmp_path / "a"))
    _apply(folder, "metadata", 0, "duplicate", 1, None)
    assert (folder / "shardkit.json").read_text().count('"format"') == 2
    folder = Path(shutil.copytree(saved, tmp_path / "b"))
    header, _, _ = _read_header(min(saved.glob("data-*.safetensors")))
    paths = _paths(header)
    index = next(i for i, p in enumerate(paths) if p and p[-1] == "dtype")
    name = _apply(folder, "header", index, "replace", "U16", None)
    new, _, _ = _read_header(folder / name)
    assert [v["dtype"] for k, v in new.items() if k != "__metadata__"].count("U16") == 1
    # shardkit.json followed the header's new length: what is refused is the relabelled dtype
    checkpoint.read_metadata(folder)
    with pytest.raises(CheckpointError, match="the header says dtype 'U16'"):
        checkpoint.load({**dict.fromkeys(ORIGINAL), "epoch": None, "cfg": {"lr": None}}, folder)


# (region edit, what reading shardkit.json says after "tensor '<name>' regions", or None if it is
# well formed and what loading then says)
_REACH = [
    (("digits", "w", "start", "drop", 0, "g"), r" start: expected 2 x 16 lowercase hex digits", None),
    (("digits", "v", "file", "capitals", 3, "g"), r" file: expected 4 x 16 lowercase hex digits", None),
    (("digits", "w", "grid", "char", 3, "\u0660"), r" grid: expected", None),
    (("digits", "v", "offsets", "add", 0, "g"), r" offsets: expected 8 x 16", None),
    (("digits", "s", "offsets", "add", 0, "g"), r" offsets: expected 0 x 16", None),
    (("digits", "w", "dims", "char", 17, " "), r" dims: expected 4 x 16", None),  # the grid, made explicit first
    (("digits", "v", "crc32c", "other", 5, "g"), None, "checksum mismatch"),
    (("value", "v", "file", 2, "set", 1), r"\[2\] file: file number 1 is not in \"files\" \(1 listed\)", None),
    (("value", "w", "start", 1, "set", 2**63), r" start: expected 2 x 16 lowercase hex digits \(each below 2\*\*63\)",
     None),
    (("value", "v", "dims", 0, "add", 1), r"\[0\]: the block offsets=\[2, 3\], dims=\[3, 3\] lies outside", None),
    (("value", "w", "grid", 1, "set", 7), r" grid: expected", None),
    (("value", "w", "grid", 1, "set", 4), None, "the header says shape"),  # another valid grid
    (("start-near-end", "b", 0, 1), r"\[0\] start: \[\d+, \d+\) does not hold 40 bytes", None),
    (("start-near-end", "b", 0, 0), None, "the header places the data at"),
    (("file-beyond", "h", 0, 0), r"\[0\] file: file number 1 is not in", None),
    (("file-beyond", "w", 1, 2**32 - 2), r"\[1\] file: file number 4294967295 is not in", None),
    (("count", "v", "set", 2**62), r" file: expected 4611686018427387904 x 16", None),
    (("count", "w", "add", 1), r" file: expected 3 x 16", None),
    (("count", "s", "add", 2**62), r" file: expected 4611686018427387905 x 16", None),  # a 0-d tensor: no blocks
    (("count", "b", "set", "1"), r" count: expected a non-negative int", None),
    (("count", "e", "set", 10**30), r" count: expected a non-negative int", None),
    (("chunk_bytes", "h", 0), r" chunk_bytes: expected a chunk size", None),
    (("chunk_bytes", "h", 4), r" crc32c: chunk checksums must be 3 x 8", None),
    (("grid", "w", 1, "swap", 0), r" grid: expected", None),
    (("grid", "w", 1, "repeat", 1), r" grid: expected", None),
    (("grid", "w", 0, "first", 0), r" grid: expected", None),
    (("grid", "w", 1, "last", 0), r" grid: expected", None),
    (("grid", "w", 1, "insert", 0), r" grid: expected, .* with 2 cells in all", None),
    (("grid", "w", 1, "remove", 1), r" grid: expected, .* with 2 cells in all", None),
    (("grid", "w", 0, "empty", 0), r" grid: expected", None),
    (("grid", "w", 0, "extra-dimension", 0), r" grid: expected", None),
    (("drop-region", "v", 1), r": saved regions leave a gap", None),
    (("keys", "w@0,3", {"\u00b2": "w"}), r" keys: expected", None),
    (("keys", "w@0,3", {"0": "nope"}), None, "key 'nope' of tensor 'w@0,3': the header has no such entry"),
    (("explicit", "w"), None, None),  # still valid: loads
]


@pytest.mark.parametrize(("change", "problem", "on_load"), _REACH, ids=[str(c) for c, _, _ in _REACH])
def test_the_region_mutations_reach_the_readers(saved: Path, tmp_path: Path, change: tuple[Any, ...],
                                                problem: str | None, on_load: str | None) -> None:
    """Each kind of region edit changes the column it names and is caught where that column is read."""
    folder = Path(shutil.copytree(saved, tmp_path / "ck"))
    before = edit.read(folder)
    _apply_regions(folder, change)
    after = edit.read(folder)
    name = change[1]
    assert after["tensors"][name] != before["tensors"][name]
    assert {k: v for k, v in after["tensors"].items() if k != name} == \
        {k: v for k, v in before["tensors"].items() if k != name}
    source = str(folder / "shardkit.json")
    state = {**dict.fromkeys(ORIGINAL), "epoch": None, "cfg": {"lr": None}}
    if problem is not None:
        with pytest.raises(CheckpointError) as info:
            checkpoint.read_metadata(folder)
        prefix = f"malformed checkpoint metadata {source!r}: tensor {name!r} regions"
        assert str(info.value).startswith(prefix) and re.match(problem, str(info.value)[len(prefix):]), info.value
        return
    md = checkpoint.read_metadata(folder)
    if on_load is None:
        assert "grid" not in edit.regions(after, name) and len(md.tensors[name].shards) == before["tensors"][name][
            "regions"]["count"]
        checkpoint.load(state, folder)
        assert all(_bits(state[n]) == _bits(t) for n, t in ORIGINAL.items())
        return
    with pytest.raises(CheckpointError, match=on_load) as info:
        checkpoint.load(state, folder)
    assert f"tensor {name!r}" in str(info.value) and edit.file_names(after)[0] in str(info.value)
