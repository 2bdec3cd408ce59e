"""The command line: inspect, verify, consolidate, --help; in-process and as real subprocesses."""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import sharded_tensor as st
from checkpoint.__main__ import main
from sharding import single_split

ROOT = Path(__file__).resolve().parents[2]
R0 = "rank:0/cpu"


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"enc.weight": torch.randn(12, 5, generator=g), "enc.bias": torch.randn(5, generator=g),
            "head": torch.randn(4, 10, generator=g).to(torch.float16)}


def _save(path: Path) -> Path:
    full = _full()
    sd: dict[str, object] = {
        "enc.weight": st.shard_tensor(full["enc.weight"], single_split(0, [R0] * 4)),
        "enc.bias": full["enc.bias"],
        "head": st.shard_tensor(full["head"], single_split(1, [R0] * 2)),
        "epoch": 4, "sched": {"milestones": [10, 20]},
    }
    checkpoint.save(sd, str(path))
    return path


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return _save(tmp_path / "ckpt")


def _flip(path: Path, tensor: str, shard: int = 0) -> Path:
    entry = checkpoint.read_metadata(str(path)).tensors[tensor].shards[shard]
    file = path / entry.file
    data = bytearray(file.read_bytes())
    data[(entry.byte_range[0] + entry.byte_range[1]) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    return file


# -- in process ---------------------------------------------------------------------------------

def test_inspect_table(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    row = next(line for line in lines if line.startswith("enc.weight"))
    assert row.split() == ["enc.weight", "float32", "(12,", "5)", "240", "B", "4", "dim", "0:", "3", "(x4)"]
    row = next(line for line in lines if line.startswith("head"))
    assert row.split()[1:3] == ["float16", "(4,"] and row.split()[-5:] == ["2", "dim", "1:", "5,", "5"]
    assert "epoch = 4" in out and "sched.milestones = [10, 20]" in out
    assert "3 tensors, 340 bytes" in out


def test_inspect_json(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(saved), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tensors"]["enc.weight"] == {"dtype": "float32", "shape": [12, 5], "bytes": 240, "shards": 4,
                                             "layout": {"kind": "split", "dim": 0, "sizes": [3, 3, 3, 3]}}
    assert info["tensors"]["enc.bias"]["shards"] == 1
    assert info["values"] == {"epoch": 4, "sched.milestones": [10, 20]}
    assert info["tensor_bytes"] == 340
    assert info["file_bytes"] == sum(p.stat().st_size for p in saved.glob("*.safetensors"))


def test_verify_ok(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(saved)]) == 0
    assert "OK: 3 tensors, 7 saved regions" in capsys.readouterr().out


@pytest.mark.parametrize("tensor", ["enc.weight", "head", "enc.bias"])
def test_verify_flipped_byte(saved: Path, capsys: pytest.CaptureFixture[str], tensor: str) -> None:
    file = _flip(saved, tensor)
    assert main(["verify", str(saved)]) == 1
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and str(file) in err and repr(tensor) in err
    assert "INVALID, 1 problem found" in err


def test_verify_reports_every_problem(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _flip(saved, "enc.weight", 0)
    _flip(saved, "enc.weight", 3)
    assert main(["verify", str(saved)]) == 1
    assert "INVALID, 2 problems found" in capsys.readouterr().err


def test_verify_truncated_and_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = _save(tmp_path / "a")
    file = saved / checkpoint.read_metadata(str(saved)).tensors["enc.weight"].shards[0].file
    file.write_bytes(file.read_bytes()[:-10])
    assert main(["verify", str(saved)]) == 1
    err = capsys.readouterr().err
    assert "truncated" in err and str(file) in err and "'enc.weight'" in err
    file.unlink()
    assert main(["verify", str(saved)]) == 1
    err = capsys.readouterr().err
    assert "is missing" in err and str(file) in err


def test_verify_bad_metadata(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (saved / "shardkit.json").write_text("{not json")
    assert main(["verify", str(saved)]) == 1
    assert "malformed checkpoint metadata" in capsys.readouterr().err


def test_verify_incomplete(tmp_path: Path, saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (saved / "shardkit.json").unlink()
    assert main(["verify", str(saved)]) == 1
    assert "is incomplete" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nowhere")]) == 1
    assert "no shardkit checkpoint" in capsys.readouterr().err


def test_consolidate_single_and_folder(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.safetensors"
    assert main(["consolidate", str(saved), str(out), "--quiet"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    got = load_file(str(out))
    assert all(torch.equal(got[k], v) for k, v in _full().items()) and len(got) == 3
    folder = tmp_path / "hf"
    assert main(["consolidate", str(saved), str(folder), "--max-shard-size", "250B"]) == 0
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2


def test_bad_max_shard_size_is_a_usage_error(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["consolidate", str(saved), "out", "--max-shard-size", "huge"])
    assert info.value.code == 2
    assert "max_shard_size='huge'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["verify"], ["consolidate", "only-one"]])
def test_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_storage_options_nest_and_parse_json() -> None:
    from checkpoint._cli import _options, _storage_option

    pairs = [_storage_option("endpoint_url=http://127.0.0.1:9"), _storage_option("client_kwargs.region_name=x"),
             _storage_option("anon=true"), _storage_option("default_block_size=1024")]
    assert _options(pairs) == {"endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"region_name": "x"},
                               "anon": True, "default_block_size": 1024}


def test_console_script_is_declared() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    scripts = [line.strip() for line in cfg["options.entry_points"]["console_scripts"].splitlines() if line.strip()]
    assert "shardkit-checkpoint = checkpoint.__main__:main" in scripts


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["verify", "--help"],
                                  ["consolidate", "--help"]])
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardkit-checkpoint")
    if argv == ["--help"]:
        assert all(cmd in out for cmd in ("inspect", "verify", "consolidate"))
    if argv[0] == "consolidate":
        assert "--max-shard-size" in out and "--quiet" in out


def test_written_files_have_a_normal_file_mode(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """convert and consolidate write files as open() would: 0666 less the umask, like each other."""
    (tmp_path / "probe").write_text("")
    normal = (tmp_path / "probe").stat().st_mode & 0o777
    assert main(["consolidate", str(saved), str(tmp_path / "cons.safetensors"), "--quiet"]) == 0
    assert main(["convert", "--to", "dcp", str(saved), str(tmp_path / "dcp")]) == 0
    assert main(["convert", "--from", "dcp", "--to", "safetensors", str(tmp_path / "dcp"),
                 str(tmp_path / "conv.safetensors")]) == 0
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in ("cons.safetensors", "conv.safetensors")}
    assert modes == {"cons.safetensors": normal, "conv.safetensors": normal}, f"{modes}, open() gives {normal:o}"


# -- real subprocesses (started together, so the torch imports overlap) ---------------------------

def test_subprocesses(tmp_path: Path) -> None:
    good = _save(tmp_path / "good")
    bad = _save(tmp_path / "bad")
    flipped = _flip(bad, "head", 1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = Path(sys.executable).with_name("shardkit-checkpoint")
    # The console script when installed (pip install -e .), else the same entry point via -m.
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "checkpoint"]
    commands = {
        "verify-bad": [sys.executable, "-m", "checkpoint", "verify", str(bad)],
        "consolidate": [*cli, "consolidate", str(good), str(tmp_path / "hf"), "--max-shard-size", "1KB"],
    }
    procs = {name: subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, cmd in commands.items()}
    # `inspect ckpt | head -0`: the reader is gone before the first line is written.
    closed = subprocess.Popen([*cli, "inspect", str(good)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert closed.stdout is not None
    closed.stdout.close()
    assert closed.stderr is not None
    closed_err, closed_code = closed.stderr.read(), closed.wait(timeout=120)
    assert closed_err == "" and closed_code == 141, (closed_err, closed_code)  # 128 + SIGPIPE, as Unix tools end
    results = {name: (*p.communicate(timeout=120), p.returncode) for name, p in procs.items()}
    out, err, code = results["verify-bad"]
    assert code == 1, (out, err)
    assert "checksum mismatch" in err and str(flipped) in err and "'head'" in err
    out, err, code = results["consolidate"]
    assert code == 0, (out, err)
    got = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in _full().items())
