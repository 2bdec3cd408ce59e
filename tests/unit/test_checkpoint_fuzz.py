"""Random corruption of ``shardkit.json`` and of the safetensors headers never gets past the readers silently.

A small checkpoint is saved once; each example changes one thing (a value anywhere in the
metadata or in a data file's header: types, sizes, offsets, names, nesting depth, huge
numbers, unicode, a duplicated key, the header length) and runs every reader: ``load``
into typed targets and into ``None``, ``consolidate`` and ``verify``. Each must either
succeed with the saved tensors bit for bit, or raise ``CheckpointError``/``ValueError``
whose message names the file at fault. An audit hook on ``open`` checks that nothing
outside the checkpoint folder is opened, and peak memory must not grow by more than the
files could justify.
"""

from __future__ import annotations

import json
import os
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
from sharding import single_split

R0 = "rank:0/cpu"
ORIGINAL = {"w": torch.arange(48, dtype=torch.float32).reshape(8, 6) / 4,
            "b": torch.arange(5, dtype=torch.int64) - 2,
            "h": torch.arange(6, dtype=torch.float16).reshape(2, 3)}


def _state() -> dict[str, Any]:
    w = sht.zeros(8, 6, sharding_spec=single_split(1, [R0] * 2))
    for shard in w.local_shards():
        o, n = shard.metadata.offsets, shard.metadata.dims
        shard.tensor.copy_(ORIGINAL["w"][o[0]:o[0] + n[0], o[1]:o[1] + n[1]])
    return {"w": w, "b": ORIGINAL["b"].clone(), "h": ORIGINAL["h"].clone(), "epoch": 2, "cfg": {"lr": 0.5}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fuzz") / "ck"
    checkpoint.save(_state(), folder, quiet=True)
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


def _apply(folder: Path, target: str, path_index: int, op: str, value: Any, length: int | None) -> str:
    """Mutate the copy in ``folder``; return the name of the file changed."""
    if target == "metadata":
        tree = json.loads((folder / "shardkit.json").read_text())
        paths = _paths(tree)
        text = _serialize(tree, paths[path_index % len(paths)], op, value)
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
    md = json.loads((folder / "shardkit.json").read_text())
    shift = len(text) - n
    md["files"][data.name]["bytes"] += shift
    for entry in md["tensors"].values():
        for shard in entry["shards"]:
            if shard["file"] == data.name:
                shard["byte_range"] = [b + shift for b in shard["byte_range"]]
    (folder / "shardkit.json").write_text(json.dumps(md))
    return data.name


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _check_outcome(what: str, exc: BaseException | None, changed: str) -> None:
    if exc is None:
        return
    assert isinstance(exc, (CheckpointError, ValueError)), f"{what}: {type(exc).__name__}: {exc}"
    text = str(exc)
    assert changed in text or "shardkit.json" in text or "data-" in text, f"{what} names no file: {text}"


def _run_readers(folder: Path, out: Path, changed: str, capsys: pytest.CaptureFixture[str]) -> None:
    # typed targets: success means the saved values, bit for bit
    typed = {"w": torch.zeros(8, 6), "b": torch.zeros(5, dtype=torch.int64), "h": torch.zeros(2, 3, dtype=torch.float16),
             "epoch": None, "cfg": {"lr": None}}
    untyped: dict[str, Any] = {"w": None, "b": None, "h": None, "epoch": None, "cfg": {"lr": None}}
    for what, sd in (("load typed", typed), ("load None", untyped)):
        exc = None
        try:
            checkpoint.load(sd, folder)
        except Exception as e:  # noqa: BLE001  # classified below
            exc = e
        _check_outcome(what, exc, changed)
        if exc is None:
            for name, t in ORIGINAL.items():
                assert sd[name].dtype == t.dtype and sd[name].shape == t.shape, (what, name)
                assert _bits(sd[name]) == _bits(t), (what, name)
    exc = None
    try:
        checkpoint.consolidate(folder, out / "o.safetensors", quiet=True)
    except Exception as e:  # noqa: BLE001
        exc = e
    _check_outcome("consolidate", exc, changed)
    capsys.readouterr()
    status = main(["verify", "-q", str(folder)])  # anything but a clean report escapes as an exception
    err = capsys.readouterr().err
    if status != 0:
        assert "Traceback" not in err and err.strip(), err


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(["metadata", "metadata", "header"]), path_index=st.integers(0, 10_000),
       op=st.sampled_from(["replace", "replace", "replace", "delete", "duplicate"]), value=_VALUE,
       length=st.one_of(st.none(), st.none(), st.none(), st.sampled_from([0, 1, 7, 2**40, 2**64 - 1, 100_000_001])))
def test_corrupted_metadata_and_headers_are_refused_cleanly(saved: Path, capsys: pytest.CaptureFixture[str],
                                                            target: str, path_index: int, op: str, value: Any,
                                                            length: int | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(saved, Path(tmp) / "ck"))
        out = Path(tmp) / "out"
        out.mkdir()
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
    name = _apply(folder, "header", index, "replace", "I32", None)
    new, _, _ = _read_header(folder / name)
    assert [v["dtype"] for k, v in new.items() if k != "__metadata__"].count("I32") == 1
