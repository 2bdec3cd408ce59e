#!/usr/bin/env python
"""How long survivors take to raise after a peer is SIGKILLed, per collective entry point.

Not a test: prints one JSON document on stdout (progress goes to stderr). Issue 28, item 4.

For each entry point, ``--runs`` launches of 3 Gloo ranks (spawned here, TCP on 127.0.0.1).
Every rank calls the entry point in a loop; rank 2 SIGKILLs itself after a random delay
(uniform in ``[0.3, 2.5]`` s after the loop starts), so the death falls at a random point of
a random call. No ``timeout=`` is passed and ``SHARDKIT_TIMEOUT`` is unset: the waits have
the default timeout (600 s), so what ends them is the detection of the death. Each
survivor records when it raised; the detection time is that moment minus the moment of the
kill (wall clocks of one host). The comparison is the same loop with the peer detection
off (``SHARDKIT_LIVENESS=0``), i.e. only Gloo's own connection errors, run side by side
with ``--compare`` (its runs are capped by ``--give-up`` seconds: a survivor still waiting
then counts as that bound).

Output: for each entry point, the median and the range (min-max) of the detection time over
every survivor of every run, the message of one survivor, and whether every survivor raised
``CollectiveError`` or ``CheckpointError`` naming the operation and rank 2.

    python scripts/bench/death_detection.py --runs 20            # the long form
    python scripts/bench/death_detection.py --runs 3 --entries reshard,save
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# This folder holds a checkpoint.py (a benchmark) that must not shadow the package.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

from _shardkit.launch import LaunchError, launch  # noqa: E402

WORLD = 3
VICTIM = 2
ENTRIES = ["save", "async_save", "load", "reshard", "gather", "full_tensor", "collect", "shard_model",
           "shard_tensor", "manager"]


def _ranks() -> list[str]:
    return [f"rank:{r}/cpu" for r in range(WORLD)]


def _loop(entry: str, rank: int, root: str, shape: tuple[int, int] = (96, 64)) -> tuple[Any, str]:
    """One call of ``entry`` as a function, prepared on every rank; and the operation it names."""
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    import checkpoint  # noqa: PLC0415
    import sharded_tensor as st  # noqa: PLC0415
    from sharding import composite, single_split  # noqa: PLC0415

    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) if rank == 0 else None
    rows = st.shard_tensor(full, single_split(0, _ranks()))
    state = {"w": rows, "b": torch.ones(7), "step": 0}
    if entry == "save":
        return lambda: checkpoint.save(state, f"{root}/ck"), "checkpoint.save"
    if entry == "async_save":
        return lambda: checkpoint.async_save(state, f"{root}/ck").result(), "checkpoint.async_save"
    if entry == "load":
        checkpoint.save(state, f"{root}/ck")
        target = {"w": st.zeros(*shape, sharding_spec=single_split(1, _ranks())), "b": torch.zeros(7), "step": None}
        return lambda: checkpoint.load(target, f"{root}/ck"), "checkpoint.load"
    if entry == "reshard":
        # Back and forth: each call starts from a new tensor (a tensor remembers its reshards).
        current = [rows]
        specs = [single_split(1, _ranks()), single_split(0, _ranks())]

        def reshard() -> None:
            current[0] = current[0].reshard(specs[0])
            specs.reverse()
        return reshard, "ShardedTensor.reshard"
    if entry == "gather":
        return lambda: rows.gather(dst=0), "ShardedTensor.gather"
    if entry == "full_tensor":
        return rows.full_tensor, "ShardedTensor.full_tensor"
    if entry == "collect":
        return lambda: checkpoint.collect_state_dict(state, 0), "checkpoint.collect_state_dict"
    if entry == "shard_model":
        spec = composite(**{"0.weight": single_split(0, _ranks()), "2.weight": single_split(1, _ranks())})

        def shard() -> None:
            with torch.device("meta"):
                model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32))
            st.shard_model(model, spec, seed=0)
        return shard, "st.shard_model"
    if entry == "shard_tensor":
        return lambda: st.shard_tensor(full, single_split(0, _ranks())), "st.shard_tensor"
    if entry == "manager":
        manager = checkpoint.CheckpointManager(f"{root}/run", keep_last=2)
        steps = iter(range(1, 1 << 30))

        def save_and_load() -> None:
            step = next(steps)
            manager.save(step, {**state, "step": step})
            manager.load({"w": st.zeros(*shape, sharding_spec=single_split(1, _ranks())), "b": torch.zeros(7),
                          "step": None})
        return save_and_load, "CheckpointManager|checkpoint.save|checkpoint.load"  # as its errors name it
    msg = f"entry={entry!r} is not one of {ENTRIES}"
    raise ValueError(msg)


def _rank(rank: int, world: int, entry: str, root: str, out: str, delay: float,
          shape: tuple[int, int] = (96, 64)) -> None:
    from _shardkit.comm import CollectiveError  # noqa: PLC0415
    from checkpoint import CheckpointError  # noqa: PLC0415

    call, operation = _loop(entry, rank, root, shape)
    call()  # warm: every rank has communicated once (and connected to rank 0) before the kill
    if rank == VICTIM:
        def die() -> None:
            Path(out, "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(delay, die).start()
    report: dict[str, Any] = {"rank": rank, "operation": operation}
    try:
        while True:
            call()
    except (CollectiveError, CheckpointError) as exc:
        kind = CollectiveError if isinstance(exc, CollectiveError) else CheckpointError
        report.update(raised=time.time(), type=kind.__name__, message=str(exc))
    except Exception as exc:  # reported as it is: a wrong kind of error is a finding too
        report.update(raised=time.time(), type=type(exc).__name__, message=str(exc))
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def _run_once(entry: str, detection: bool, give_up: float, rng: random.Random,
              shape: tuple[int, int]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        env = {"SHARDKIT_LIVENESS": "1" if detection else "0", "GLOO_SOCKET_IFNAME": "lo"}
        os.environ.pop("SHARDKIT_TIMEOUT", None)
        delay = rng.uniform(0.3, 2.5)
        try:
            launch(_rank, WORLD, (entry, os.path.join(tmp, "root"), out, delay, shape), timeout=give_up + 60,
                   collective_timeout=1800, grace=give_up, env=env, threads=1, capture_output=False)
        except LaunchError as exc:
            if "exited with code -9" not in str(exc):
                return [{"error": str(exc)[:3000]}]
        killed_file = Path(out, "killed")
        if not killed_file.exists():
            return [{"error": "rank 2 was not killed"}]
        killed = float(killed_file.read_text())
        found = []
        for rank in range(WORLD):
            if rank == VICTIM:
                continue
            path = Path(out, f"rank{rank}.json")
            if not path.exists():
                found.append({"rank": rank, "seconds": give_up, "type": "still waiting", "message": ""})
                continue
            report = json.loads(path.read_text())
            report["seconds"] = report.pop("raised") - killed
            found.append(report)
        return found


def _named(message: str) -> set[int]:
    """The ranks a message says did not answer."""
    found = re.search(r"no answer from ranks? ([\d, ]+)\.", message)
    return {int(r) for r in found[1].split(", ")} if found else set()


def _summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in reports if "seconds" in r]
    good = [r for r in reports if r.get("type") in ("CollectiveError", "CheckpointError")
            and any(name in r["message"] for name in r["operation"].split("|")) and VICTIM in _named(r["message"])]
    return {"survivors": len(seconds), "median_s": round(statistics.median(seconds), 3) if seconds else None,
            "min_s": round(min(seconds), 3) if seconds else None, "max_s": round(max(seconds), 3) if seconds else None,
            "named_operation_and_rank": f"{len(good)}/{len(reports)}",
            "kinds": sorted({str(r.get("type")) for r in reports}),
            "example": next((r["message"] for r in good), "")[:400],
            "not_naming_both": [r.get("message", r.get("type", ""))[:400] for r in reports if r not in good][:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="launches per entry point (20 for the long form)")
    parser.add_argument("--entries", default=",".join(ENTRIES), help="comma-separated entry points")
    parser.add_argument("--compare", action="store_true", help="also run with the peer detection off")
    parser.add_argument("--give-up", type=float, default=60.0,
                        help="seconds after which a survivor still waiting is stopped and counted as that")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", default="96x64", help="rows x columns of the fp32 tensor every entry moves")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    entries = [e for e in args.entries.split(",") if e]
    rows, _, columns = args.shape.partition("x")
    shape = (int(rows), int(columns))
    result: dict[str, Any] = {"command": " ".join(sys.argv), "world": WORLD, "runs": args.runs, "shape": shape,
                              "timeout": "default (600 s)", "entries": {}}
    for entry in entries:
        modes = [True, False] if args.compare else [True]
        row: dict[str, Any] = {}
        for detection in modes:
            reports: list[dict[str, Any]] = []
            for run in range(args.runs):
                found = _run_once(entry, detection, args.give_up, rng, shape)
                reports.extend(found)
                print(f"{entry} detection={'on' if detection else 'off'} run {run + 1}/{args.runs}: "
                      f"{[round(r['seconds'], 2) if 'seconds' in r else r for r in found]}", file=sys.stderr,
                      flush=True)
            row["shardkit" if detection else "gloo_only"] = _summary(reports)
        result["entries"][entry] = row
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
