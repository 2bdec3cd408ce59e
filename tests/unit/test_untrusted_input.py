"""Untrusted bytes cost time linear in their size: crafted pickles and JSON are refused before they are built.

Two readers take bytes a stranger may have written: the DCP metadata unpickler (and the
``torch.save`` blobs of DCP's non-tensor entries) and every JSON reader (``shardkit.json``,
safetensors headers, ``model.safetensors.index.json``). Each case below is a crafted input of a
few hundred bytes to a few hundred kilobytes that used to hang a reader for hours, crash the
interpreter or write 2**40 values; each must now be refused, with a message of bounded
length, within a wall-time bound. The crafted pickles run in one child process (so that a
crash or a hang fails the test instead of the suite). Random structures (deep, wide,
shared, recursive) then check that the pickle scanner's measure is the built object's
own: whatever it admits is within the limits, whatever it refuses is past them.
"""

from __future__ import annotations

import io
import json
import pickle
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import CheckpointError, _strict_json

MAX_DEPTH = 100  # the limits of checkpoint._pickle_scan and checkpoint._strict_json (checked below)
MAX_ITEMS = 2**25
MAX_EXPANDED = 2 * MAX_ITEMS

BOUND = 5.0  # seconds a refusal may take on a loaded 2-core machine (the attacks took hours, or forever)
MESSAGE = 1500  # characters: a refusal quotes a bounded prefix of what it refuses, never the input whole

# -- the crafted pickles, run in a child process ----------------------------------------------------

_CHILD = textwrap.dedent('''
    import io, json, pickle, sys, time, tempfile, os
    import torch
    import checkpoint
    from checkpoint._cli import main
    from checkpoint._dcp_metadata import parse_dcp_metadata

    def shared_key(depth):
        """A dict whose key is one tuple shared twice per level, `depth` levels deep (the memo makes it small)."""
        body = b"K\\x01\\x85\\x94"  # the tuple (1,); memoize as 0
        for level in range(depth):  # drop it from the stack, push (m, m) of the memo's last; memoize
            body += b"0h" + bytes([level]) + b"h" + bytes([level]) + b"\\x86\\x94"
        return b"\\x80\\x04}" + body + b"K\\x01s."  # protocol 4: {key: 1}

    def deep(n):
        return b"\\x80\\x04})" + b"\\x85" * n + b"K\\x01s."  # {((((),),),)...: 1}, the key n deep

    def huge_global():
        name = b"x" * 5_000_000
        return b"\\x80\\x04\\x8c\\x08builtins\\x94\\x8d" + len(name).to_bytes(8, "little") + name + b"\\x93)R."

    results = {}
    def case(name, fn):
        start = time.perf_counter()
        try:
            fn()
            outcome, message = "accepted", ""
        except checkpoint.CheckpointError as exc:
            outcome, message = "CheckpointError", str(exc)
        except BaseException as exc:
            outcome, message = type(exc).__name__, str(exc)[:300]
        results[name] = {"outcome": outcome, "seconds": time.perf_counter() - start, "length": len(message),
                         "message": message[:400]}
        print(json.dumps({name: results[name]}), flush=True)

    case("shared key 64 deep", lambda: parse_dcp_metadata(shared_key(64), source="m"))
    case("shared key 25 deep", lambda: parse_dcp_metadata(shared_key(25), source="m"))
    case("nested 300000 deep", lambda: parse_dcp_metadata(deep(300_000), source="m"))
    case("nested 100000 deep", lambda: parse_dcp_metadata(deep(100_000), source="m"))
    case("global named by 5 MB", lambda: parse_dcp_metadata(huge_global(), source="m"))

    # A DCP folder whose .metadata is the 64-deep shared key: the command line's convert.
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(shared_key(64))
    case("CLI convert of a shared key", lambda: sys.exit(main(["convert", "--from", "dcp", folder,
                                                                 os.path.join(folder, "out")])))

    # A DCP folder whose non-tensor entry is a torch.save blob of a tuple shared 40 levels deep:
    # convert would write 2**40 JSON values.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    folder = tempfile.mkdtemp()
    dcp.save({"w": torch.ones(2), "blob": "placeholder"}, checkpoint_id=folder, no_dist=True)
    metadata = parse_dcp_metadata(open(os.path.join(folder, ".metadata"), "rb").read())
    value = (1,)
    for _ in range(40):
        value = (value, value)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    index = next(i for i in metadata.storage_data if i.fqn == "blob")
    info = metadata.storage_data[index]
    data_file = os.path.join(folder, info.relative_path)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(buffer.getvalue()))
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    case("convert of a shared non-tensor entry", lambda: checkpoint.convert(folder, os.path.join(folder, "out"),
                                                                             from_format="dcp"))
''')


@pytest.fixture(scope="module")
def crafted_pickles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Each crafted pickle case's outcome, time and message, from one child process (a crash or hang ends it)."""
    script = tmp_path_factory.mktemp("crafted") / "child.py"
    script.write_text(_CHILD)
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90,
                              cwd=Path(__file__).parents[2])
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"the crafted pickles hung a reader for 90 s; cases done: {out}")
    results: dict[str, dict[str, object]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    if done.returncode != 0:  # killed by a signal (a crash), or an error outside the cases: say where
        results["crash"] = {"outcome": f"exit status {done.returncode}", "after": list(results),
                            "stderr": done.stderr[-2000:]}
    return results


@pytest.mark.parametrize(("case", "says"), [
    ("shared key 64 deep", "once every shared (memoized) object is counted each time it is used"),
    ("shared key 25 deep", "once every shared (memoized) object is counted each time it is used"),
    ("nested 300000 deep", f"it nests objects more than {MAX_DEPTH} levels deep"),
    ("nested 100000 deep", f"it nests objects more than {MAX_DEPTH} levels deep"),
    ("global named by 5 MB", "names the global builtins.xxxxxxxx"),
    ("CLI convert of a shared key", "SystemExit"),
    ("convert of a shared non-tensor entry", "the non-tensor entry 'blob'"),
])
def test_a_crafted_pickle_is_refused_in_bounded_time(crafted_pickles: dict[str, dict[str, object]], case: str,
                                                     says: str) -> None:
    assert "crash" not in crafted_pickles, crafted_pickles.get("crash")
    result = crafted_pickles.get(case)
    assert result is not None, f"{case}: the child never got there: {crafted_pickles}"
    if says == "SystemExit":  # the command line: exit status 1 and its message on stderr
        assert result["outcome"] == "SystemExit" and result["message"] == "1", result
    else:
        assert result["outcome"] == "CheckpointError", result
        assert says in str(result["message"]), result
    assert result["seconds"] < BOUND, result
    assert int(result["length"]) < MESSAGE, result  # type: ignore[call-overload]


# -- random structures: the scanner's measure is the object's own ---------------------------------

def _measure(value: object) -> tuple[int, int] | None:
    """(values, depth) of ``value`` with every shared container counted each time, or ``None`` if it holds itself."""
    sizes: dict[int, tuple[int, int]] = {}
    on_path: set[int] = set()

    def visit(v: object) -> tuple[int, int]:
        if not isinstance(v, (list, tuple, dict)):
            return 1, 0
        if id(v) in sizes:
            return sizes[id(v)]
        if id(v) in on_path:
            raise RecursionError
        on_path.add(id(v))
        parts = [visit(c) for c in (list(v.keys()) + list(v.values()) if isinstance(v, dict) else v)]
        on_path.discard(id(v))
        sizes[id(v)] = (1 + sum(n for n, _ in parts), 1 + max((d for _, d in parts), default=0))
        return sizes[id(v)]

    try:
        return visit(value)
    except RecursionError:
        return None


def _random_value(rng: random.Random) -> object:
    """Deep, wide, shared or recursive: containers built from a pool, earlier objects reused."""
    pool: list[object] = [rng.randint(-5, 300), "s" * rng.randint(0, 3), None, 2.5]
    shape = rng.choice(["deep", "wide", "shared", "recursive", "mixed"])
    steps = rng.randint(1, 140)
    for _ in range(steps):
        kind = rng.random()
        if shape == "deep" or (shape == "mixed" and kind < 0.3):
            pool.append((pool[-1],) if rng.random() < 0.5 else [pool[-1]])
        elif shape == "wide" or (shape == "mixed" and kind < 0.5):
            pool.append([rng.choice(pool) for _ in range(rng.randint(0, 30))])
        elif shape in ("shared", "mixed"):
            pool.append((pool[-1], pool[-1]) if rng.random() < 0.7 else {k: pool[-1] for k in range(rng.randint(1, 3))})
        else:
            inner = [rng.choice(pool)]
            inner.append(inner if rng.random() < 0.5 else [inner])
            pool.append(inner)
    return pool[-1]


def test_the_limits_are_the_documented_ones() -> None:
    from checkpoint import _pickle_scan

    assert (_pickle_scan.MAX_DEPTH, _pickle_scan.MAX_OBJECTS, _pickle_scan.MAX_EXPANDED) == (
        MAX_DEPTH, MAX_ITEMS, MAX_EXPANDED)
    assert (_strict_json.MAX_DEPTH, _strict_json.MAX_ITEMS, _strict_json.QUOTE) == (MAX_DEPTH, MAX_ITEMS, 60)


def test_random_pickles_are_measured_as_built() -> None:
    from checkpoint._pickle_scan import PickleRefused, scan

    rng = random.Random(0)
    seen = {"admitted": 0, "refused": 0}
    for trial in range(400):
        value = _random_value(rng)
        data = pickle.dumps(value, protocol=rng.choice([0, 2, 4, 5]))
        truth = _measure(value)
        start = time.perf_counter()
        try:
            cost = scan(data, what="random")
        except PickleRefused as exc:
            seen["refused"] += 1
            assert time.perf_counter() - start < BOUND
            assert len(str(exc)) < MESSAGE
            # Refused only past a limit, or for holding itself.
            assert truth is None or truth[0] > MAX_EXPANDED or truth[1] > MAX_DEPTH, (trial, str(exc), truth)
            continue
        seen["admitted"] += 1
        assert truth is not None, (trial, "a structure holding itself was admitted")
        assert (cost.expanded, cost.depth) == truth, trial
        assert pickle.loads(data) is not None or value is None
    assert seen["admitted"] > 50 and seen["refused"] > 50, seen  # both sides of the limits were drawn


def test_the_pickle_object_and_memo_counts_are_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide pickles: past the object count, or the memo reads, refused (limits lowered to keep the test small)."""
    from checkpoint import _pickle_scan
    from checkpoint._pickle_scan import PickleRefused, scan

    monkeypatch.setattr(_pickle_scan, "MAX_OBJECTS", 1000)
    assert scan(pickle.dumps(list(range(900))), what="w").objects == 901
    with pytest.raises(PickleRefused, match="it makes more than 1000 objects"):
        scan(pickle.dumps(list(range(1100))), what="w")
    shared = ["x" * 5]
    with pytest.raises(PickleRefused, match="it reads its memo more than 1000 times"):
        scan(pickle.dumps(shared * 1100, protocol=4), what="w")


# -- JSON ----------------------------------------------------------------------------------------

def _nested(depth: int, kind: str = "[]") -> str:
    return kind[0] * depth + kind[1] * depth


def test_random_json_is_measured_and_parsed_like_json_loads() -> None:
    rng = random.Random(1)
    for trial in range(300):
        depth = rng.randint(0, 2 * _strict_json.MAX_DEPTH)
        parts = []
        for _ in range(depth):
            parts.append(rng.choice(['[', '{"k\\\\":', '[1, "]\\"[", ', '{"a": 1, "b":']))
        text = "".join(parts) + json.dumps(rng.choice([1, "x]", "{", None]))
        for opener in reversed(parts):
            text += "]" if opener.startswith("[") else "}"
        assert _strict_json.measure(text.encode())[0] == depth, (trial, text[:80])
        if depth <= _strict_json.MAX_DEPTH:
            assert _strict_json.loads(text, source="t") == json.loads(text), trial
        else:
            with pytest.raises(ValueError, match=f"more than {_strict_json.MAX_DEPTH} levels deep"):
                _strict_json.loads(text, source="t")


@pytest.mark.parametrize("depth", [101, 100_000, 300_000])
def test_deep_json_is_refused_before_parsing_by_every_reader(tmp_path: Path, depth: int,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    text = '{"weight_map": ' + _nested(depth) + "}"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text(text)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "shardkit.json").write_text('{"format": "shardkit-checkpoint", "values": ' + _nested(depth) + "}")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10**6)  # what some training scripts do: the parser never gets to recurse that deep
    try:
        _refused_everywhere((hf, ours), capsys)
    finally:
        sys.setrecursionlimit(limit)


def _refused_everywhere(folders: tuple[Path, ...], capsys: pytest.CaptureFixture[str]) -> None:
    from checkpoint._cli import main

    for folder in folders:
        start = time.perf_counter()
        with pytest.raises(CheckpointError, match=f"more than {_strict_json.MAX_DEPTH} levels deep") as info:
            checkpoint.load({}, folder)
        assert time.perf_counter() - start < BOUND
        assert len(str(info.value)) < MESSAGE
        for command in ("inspect", "verify"):
            assert main([command, str(folder)]) == 1
            assert f"more than {_strict_json.MAX_DEPTH} levels deep" in capsys.readouterr().err


def test_a_duplicate_key_in_an_index_is_refused_quoting_a_bounded_prefix(tmp_path: Path) -> None:
    import safetensors.torch

    safetensors.torch.save_file({"a": torch.ones(2)}, str(tmp_path / "m-1.safetensors"))
    key = "a" * 1_000_000
    (tmp_path / "model.safetensors.index.json").write_text(
        f'{{"weight_map": {{"{key}": "m-1.safetensors", "{key}": "m-1.safetensors"}}}}')
    with pytest.raises(CheckpointError, match=r"appears twice in one object \(a duplicate key\)") as info:
        checkpoint.load({"a": torch.zeros(2)}, tmp_path)
    assert len(str(info.value)) < MESSAGE and "(1000000 characters)" in str(info.value)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "m-1.safetensors"}}')
    state = {"a": torch.zeros(2)}
    checkpoint.load(state, tmp_path)
    assert torch.equal(state["a"], torch.ones(2))


def test_json_item_count_is_a_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_strict_json, "MAX_ITEMS", 1000)
    assert _strict_json.loads("[" + ",".join(["1"] * 999) + "]", source="w") == [1] * 999
    with pytest.raises(ValueError, match="more than the 1000 a checkpoint file may hold"):
        _strict_json.loads("[" + ",".join(["[]"] * 1000) + "]", source="w")
    # The list, its string, the object and its value; the separators inside the string do not count.
    assert _strict_json.measure(b'["a,b,[", {"c": 1}]') == (2, 4)


def test_a_value_readers_would_refuse_is_never_saved(tmp_path: Path) -> None:
    """Save refuses what load would: too deep, or expanding past the value count (shared lists), in no time."""
    deep: object = 0
    for _ in range(_strict_json.MAX_DEPTH):
        deep = [deep]
    with pytest.raises(ValueError, match="levels deep"):
        checkpoint.save({"v": deep}, tmp_path / "a")
    shared: object = [1]
    for _ in range(40):
        shared = [shared, shared]
    start = time.perf_counter()
    with pytest.raises(ValueError, match="JSON values"):
        checkpoint.save({"v": shared}, tmp_path / "b")
    assert time.perf_counter() - start < BOUND
    fine: object = 0
    for _ in range(_strict_json.MAX_DEPTH - 2):
        fine = [fine]
    checkpoint.save({"v": fine}, tmp_path / "c")
    assert checkpoint.load({"v": None}, tmp_path / "c")["v"] == fine
    # The safetensors headers and the metadata of a real save are far inside the limits.
    assert _strict_json.measure((tmp_path / "c" / "shardkit.json").read_bytes())[0] == _strict_json.MAX_DEPTH


def test_saved_values_torch_save_blobs_are_scanned(tmp_path: Path) -> None:
    from checkpoint._dcp import _check_saved_value

    buffer = io.BytesIO()
    torch.save({"lr": [0.1, 0.01], "step": 3}, buffer)
    _check_saved_value(buffer.getvalue(), "entry")  # a plain value passes
    with pytest.raises(CheckpointError, match="not a torch.save archive"):
        _check_saved_value(pickle.dumps([1, 2]), "entry")


# -- each refusal of the DCP metadata and of file names, on its own ------------------------------

@pytest.fixture(scope="module")
def dcp_metadata(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    import warnings

    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(8, 4)}, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    return (folder / ".metadata").read_bytes()


def _altered(good: bytes, change) -> bytes:  # type: ignore[no-untyped-def]
    from checkpoint._dcp_metadata import parse_dcp_metadata

    metadata = parse_dcp_metadata(good)
    change(metadata)
    return pickle.dumps(metadata)


def _storage(metadata, **fields) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = _StorageInfo(**{"relative_path": info.relative_path, "offset": info.offset,
                                                   "length": info.length, **fields})


@pytest.mark.parametrize(("field", "value"), [("offset", -1), ("length", -8), ("offset", 2.5), ("length", True)])
def test_dcp_storage_offsets_and_lengths_are_checked(dcp_metadata: bytes, field: str, value: object) -> None:
    from checkpoint._dcp_metadata import parse_dcp_metadata

    with pytest.raises(CheckpointError, match=r"storage_data for 'w' has offset .*, length .*"):
        parse_dcp_metadata(_altered(dcp_metadata, lambda m: _storage(m, **{field: value})))


def test_a_dcp_tensor_of_2_63_bytes_is_refused(dcp_metadata: bytes) -> None:
    from checkpoint._dcp_metadata import parse_dcp_metadata

    def huge(metadata) -> None:  # type: ignore[no-untyped-def]
        entry = metadata.state_dict_metadata["w"]
        entry.size = torch.Size([2**61, 4])  # float32: 2**65 bytes
        entry.chunks[0].sizes = torch.Size([8, 4])

    with pytest.raises(CheckpointError, match=r"tensor 'w' of size .* is more than 2\*\*63 bytes"):
        parse_dcp_metadata(_altered(dcp_metadata, huge))


def test_a_dcp_persistent_id_is_refused(dcp_metadata: bytes) -> None:
    from checkpoint._dcp_metadata import parse_dcp_metadata

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("storage", "x" * 10_000) if isinstance(obj, torch.Size) else None

    metadata = pickle.loads(dcp_metadata)  # the test's own bytes: no stranger's
    buffer = io.BytesIO()
    _Pickler(buffer).dump(metadata)
    with pytest.raises(CheckpointError, match="holds a persistent reference") as info:
        parse_dcp_metadata(buffer.getvalue())
    assert len(str(info.value)) < MESSAGE


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\\b", "c:x", "s3://b/k", "a\x00b", "~x", " x", "x "])
def test_file_names_outside_the_folder_are_refused(tmp_path: Path, name: str) -> None:
    """Each rule of a plain file name, through the metadata of a real checkpoint (version 3: no content checksum)."""
    import shutil

    from checkpoint._schema import check_file_name

    with pytest.raises(CheckpointError, match="not a plain file name inside the checkpoint folder"):
        check_file_name(name, source="s")
    folder = Path(shutil.copytree(Path(__file__).parents[1] / "data" / "v3" / "one_rank", tmp_path / "ckpt"))
    data = json.loads((folder / "shardkit.json").read_text())
    data["files"][0]["name"] = name
    (folder / "shardkit.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="not a plain file name inside the checkpoint folder"):
        checkpoint.read_metadata(folder)


@pytest.mark.parametrize("edit", ["world_size", "generation", "file name", "size", "dtype", "tensor name"])
def test_a_crafted_metadata_value_is_quoted_not_printed_whole(tmp_path: Path, edit: str) -> None:
    """A megabyte-long value or name in shardkit.json: the refusal names it by a bounded prefix."""
    import shutil

    folder = Path(shutil.copytree(Path(__file__).parents[1] / "data" / "v3" / "one_rank", tmp_path / "ckpt"))
    data = json.loads((folder / "shardkit.json").read_text())
    big = "x" * 1_000_000
    if edit == "world_size":
        data["world_size"] = [7] * 200_000
    elif edit == "generation":
        data["generation"] = big
    elif edit == "file name":
        data["files"][0]["name"] = big + "/"
    elif edit == "size":
        data["tensors"]["model.w"]["size"] = [-1] * 200_000
    elif edit == "dtype":
        data["tensors"]["model.w"]["dtype"] = big
    else:
        data["tensors"][big] = data["tensors"]["model.w"]
        data["tensors"][big]["dtype"] = "no such dtype"
    (folder / "shardkit.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        checkpoint.read_metadata(folder)
    assert len(str(info.value)) < MESSAGE, (edit, str(info.value)[:300])
