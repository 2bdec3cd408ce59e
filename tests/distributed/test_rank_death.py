"""A rank that dies in the middle of a collective entry point never hangs the others.

One launch of 3 Gloo ranks per entry point. Rank 2 SIGKILLs itself at a chosen point inside
the call (right before its first collective, or after writing its checkpoint data); every
survivor that waits on it must raise ``CollectiveError`` or ``CheckpointError`` within the
configured timeout (a small one here, given by ``timeout=`` or ``SHARDKIT_TIMEOUT``), with a
message that names the operation, says that a peer closed its connection, and names rank 2
as the rank that did not answer. For the checkpoint writers, the checkpoint committed before
at the same path still loads bit for bit. Two more launches make rank 2 hang instead of die:
the survivors then give up after the timeout, and say so.

Every survivor reports what it saw by raising ``_Observed`` with a JSON payload (the launcher
returns nothing from the ranks of a run where one rank died), which the test then checks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import checkpoint
import sharded_tensor as st
from _shardkit import comm
from _shardkit.comm import CollectiveError
from checkpoint import CheckpointError, _save
from sharding import composite, single_split
from tests.distributed._launch import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed

WORLD = 3
VICTIM = 2
ENV_TIMEOUT = 4.0  # SHARDKIT_TIMEOUT, for the calls without a timeout= keyword
KEYWORD_TIMEOUT = 3.0  # timeout= of save and async_save: it wins over the environment
# The bound checked is the timeout plus this much: a loaded machine can be slow to schedule a
# survivor, but a survivor that waited for torch's own 30-minute timeout would be far beyond it.
MARGIN = 15.0
PREPARE_TIMEOUT = 300.0  # SHARDKIT_TIMEOUT while each case prepares its state


class _Observed(Exception):  # noqa: N818 - a report, not an error
    """What a survivor saw, as JSON, carried to the test in the rank's failure text."""


def _reference(name: str, version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * version + len(name))
    return torch.randn(12, 9, generator=g) if name == "w" else torch.randn(7, generator=g)


def _ranks() -> list[str]:
    return [f"rank:{r}/cpu" for r in range(WORLD)]


def _state(rank: int, version: int) -> dict[str, Any]:
    w = st.shard_tensor(_reference("w", version) if rank == 0 else None, single_split(0, _ranks()))
    return {"w": w, "b": _reference("b", version), "version": version}


def _empty() -> dict[str, Any]:
    return {"w": st.zeros(12, 9, sharding_spec=single_split(1, _ranks())), "b": torch.zeros(7), "version": None}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _hang() -> None:
    # Long past the survivors' timeout, then gone: the launcher need not kill it.
    time.sleep(ENV_TIMEOUT + 3.0)
    _die()


def _at_first_collective_of(operation: str, then: Callable[[], None]) -> None:
    """Make this rank run ``then`` right before its first collective inside ``operation``."""
    def hook(current: str, step: str) -> None:
        if current == operation or step.startswith(operation):
            comm._test_hook = None
            then()
    comm._test_hook = hook


def _after_writing_data(phase: str) -> None:
    if phase == "data_written":
        _die()


# Each case prepares its state on every rank (collectives included) and returns the call
# during which rank 2 dies, and the operation name the errors must carry.

def _case_save(rank: int, root: str) -> tuple[Callable[[], object], str]:
    checkpoint.save(_state(rank, 1), f"{root}/ck")
    state = _state(rank, 2)
    if rank == VICTIM:
        _save._test_hook = _after_writing_data
    return lambda: checkpoint.save(state, f"{root}/ck", timeout=KEYWORD_TIMEOUT), "checkpoint.save"


def _case_async_save(rank: int, root: str) -> tuple[Callable[[], object], str]:
    checkpoint.async_save(_state(rank, 1), f"{root}/ck").result()
    state = _state(rank, 2)
    if rank == VICTIM:
        _save._test_hook = _after_writing_data
    return (lambda: checkpoint.async_save(state, f"{root}/ck", timeout=KEYWORD_TIMEOUT).result(),
            "checkpoint.async_save")


def _case_load(rank: int, root: str) -> tuple[Callable[[], object], str]:
    checkpoint.save(_state(rank, 1), f"{root}/ck")
    target = _empty()
    if rank == VICTIM:  # after reading its share, before reporting to the others
        _at_first_collective_of("checkpoint.load", _die)
    return lambda: checkpoint.load(target, f"{root}/ck"), "checkpoint.load"


def _split_rows(rank: int) -> st.ShardedTensor:
    return st.shard_tensor(_reference("w", 1) if rank == 0 else None, single_split(0, _ranks()))


def _case_reshard(rank: int, root: str) -> tuple[Callable[[], object], str]:
    t = _split_rows(rank)
    if rank == VICTIM:
        _at_first_collective_of("ShardedTensor.reshard", _die)
    # rows -> columns: every rank receives a block from every other rank
    return lambda: t.reshard(single_split(1, _ranks())), "ShardedTensor.reshard"


def _case_reshard_hang(rank: int, root: str) -> tuple[Callable[[], object], str]:
    t = _split_rows(rank)
    if rank == VICTIM:
        _at_first_collective_of("ShardedTensor.reshard", _hang)
    return lambda: t.reshard(single_split(1, _ranks())), "ShardedTensor.reshard"


def _case_gather(rank: int, root: str) -> tuple[Callable[[], object], str]:
    t = _split_rows(rank)
    if rank == VICTIM:
        _at_first_collective_of("ShardedTensor.gather", _die)
    return lambda: t.gather(dst=0), "ShardedTensor.gather"


def _case_full_tensor(rank: int, root: str) -> tuple[Callable[[], object], str]:
    t = _split_rows(rank)
    if rank == VICTIM:
        _at_first_collective_of("ShardedTensor.full_tensor", _die)
    return t.full_tensor, "ShardedTensor.full_tensor"


def _case_collect(rank: int, root: str) -> tuple[Callable[[], object], str]:
    state = _state(rank, 1)
    if rank == VICTIM:
        _at_first_collective_of("checkpoint.collect_state_dict", _die)
    return lambda: checkpoint.collect_state_dict(state, 0), "checkpoint.collect_state_dict"


def _case_shard_model(rank: int, root: str) -> tuple[Callable[[], object], str]:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    spec = composite(**{"0.weight": single_split(0, _ranks()), "2.weight": single_split(1, _ranks())})
    if rank == VICTIM:
        _at_first_collective_of("st.shard_model", _die)
    return lambda: st.shard_model(model, spec, seed=0), "st.shard_model"


def _case_shard_tensor(rank: int, root: str) -> tuple[Callable[[], object], str]:
    x = _reference("w", 1) if rank == 0 else None
    if rank == VICTIM:
        _at_first_collective_of("st.shard_tensor", _die)
    return lambda: st.shard_tensor(x, single_split(0, _ranks())), "st.shard_tensor"


def _case_shard_tensor_hang(rank: int, root: str) -> tuple[Callable[[], object], str]:
    x = _reference("w", 1) if rank == 0 else None
    if rank == VICTIM:
        _at_first_collective_of("st.shard_tensor", _hang)
    return lambda: st.shard_tensor(x, single_split(0, _ranks())), "st.shard_tensor"


_CASES = {name.removeprefix("_case_"): fn for name, fn in dict(globals()).items() if name.startswith("_case_")}


PUBLIC = ("checkpoint.CheckpointError", "sharded_tensor.CollectiveError")


def _shown_as(exc: BaseException) -> str:
    """The class a traceback names: a user must see a public one (never a private subclass or module)."""
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def _survive(rank: int, world: int, case: str, root: str) -> None:
    # The preparation (collectives included) gets a generous timeout: on a busy machine (load
    # average 25 on 2 cores) a rank can be descheduled for seconds. Then every rank starts the
    # call together, the one during which rank 2 dies, with the short timeout under test.
    os.environ[comm.TIMEOUT_ENV] = f"{PREPARE_TIMEOUT:g}"
    call, operation = _CASES[case](rank, root)
    comm.barrier(timeout=PREPARE_TIMEOUT, what="the test's barrier before the call")
    os.environ[comm.TIMEOUT_ENV] = f"{ENV_TIMEOUT:g}"
    start = time.monotonic()
    try:
        call()
    except (CollectiveError, CheckpointError) as exc:
        kind = CheckpointError if isinstance(exc, CheckpointError) else CollectiveError
        seen = {"type": kind.__name__, "message": str(exc), "operation": operation, "class": _shown_as(exc)}
    else:
        seen = {"type": None, "message": "", "operation": operation}
    seen["elapsed"] = time.monotonic() - start
    seen["rank"] = rank
    raise _Observed(json.dumps(seen))


def _observed(info: pytest.ExceptionInfo[DistributedTestError]) -> dict[int, dict[str, Any]]:
    """Each survivor's report, checking that rank 2 died (or was killed) and nobody else failed otherwise."""
    failures = info.value.failures
    assert sorted(failures) == list(range(WORLD)), info.value
    assert "exited with code -9" in failures[VICTIM], info.value
    out = {}
    for rank in range(WORLD):
        if rank != VICTIM:
            marker = "_Observed: "
            assert marker in failures[rank], failures[rank]  # else the survivor failed otherwise
            out[rank] = json.loads(failures[rank].rsplit(marker, 1)[1].strip().splitlines()[0])
    return out


def _named(message: str) -> set[int]:
    """The ranks a message says did not answer."""
    match = re.search(r"no answer from ranks? ([\d, ]+)\.", message)
    return {int(r) for r in match[1].split(", ")} if match else set()


def _check_raised(seen: dict[str, Any], timeout: float, cause: str) -> None:
    assert seen["type"] in ("CollectiveError", "CheckpointError"), seen
    assert seen["class"] in PUBLIC, seen
    message = seen["message"]
    assert seen["operation"] in message, seen
    # Rank 2 always; a live rank only if it reached the step more than a second late (a
    # loaded machine), and never the rank reporting.
    assert VICTIM in _named(message) and seen["rank"] not in _named(message), seen
    assert cause in message, seen
    assert f"timeout={timeout:g} s" in message, seen
    assert seen["elapsed"] < timeout + MARGIN, seen


def _launch(case: str, root: str, monkeypatch: pytest.MonkeyPatch) -> dict[int, dict[str, Any]]:
    monkeypatch.setenv(comm.TIMEOUT_ENV, f"{ENV_TIMEOUT:g}")
    with pytest.raises(DistributedTestError) as info:
        # The survivors must be given the time to fail on their own before being killed.
        run_distributed(_survive, WORLD, case, root, timeout=600, grace=ENV_TIMEOUT + MARGIN)
    return _observed(info)


def _assert_committed_version_1(root: str) -> None:
    md = checkpoint.read_metadata(f"{root}/ck")
    assert md.values["version"] == 1
    loaded = checkpoint.load({"w": None, "b": None, "version": None}, f"{root}/ck")
    for name in ("w", "b"):
        assert loaded[name].view(torch.int32).equal(_reference(name, 1).view(torch.int32)), name


CLOSED = "closed its connection"


@pytest.mark.parametrize(("case", "timeout"), [
    pytest.param("save", KEYWORD_TIMEOUT, id="save"),
    pytest.param("async_save", KEYWORD_TIMEOUT, id="async_save"),
    pytest.param("load", ENV_TIMEOUT, id="load"),
])
def test_checkpoint_survivors_raise_and_the_previous_checkpoint_loads(case, timeout, tmp_path, monkeypatch):
    root = str(tmp_path)
    seen = _launch(case, root, monkeypatch)
    for rank, report in seen.items():
        assert report["type"] == "CheckpointError", (rank, report)
        _check_raised(report, timeout, CLOSED)
        if case != "load":
            assert "Nothing was committed" in report["message"], report
    _assert_committed_version_1(root)


@pytest.mark.parametrize("case", ["reshard", "full_tensor", "collect", "shard_model", "shard_tensor"])
def test_survivors_raise_naming_the_operation_and_the_dead_rank(case, tmp_path, monkeypatch):
    for report in _launch(case, str(tmp_path), monkeypatch).values():
        assert report["type"] == "CollectiveError", report
        _check_raised(report, ENV_TIMEOUT, CLOSED)


def test_gather_raises_where_the_dead_rank_was_awaited(tmp_path, monkeypatch):
    seen = _launch("gather", str(tmp_path), monkeypatch)
    # dst=0 receives from rank 2 and raises.
    assert seen[0]["type"] == "CollectiveError", seen
    _check_raised(seen[0], ENV_TIMEOUT, CLOSED)
    # Rank 1 only sends, to rank 0, which is alive: its part completes unless it learns first
    # that rank 2 is gone, and then it raises naming rank 2.
    if seen[1]["type"] is not None:
        _check_raised(seen[1], ENV_TIMEOUT, CLOSED)


@pytest.mark.parametrize("case", ["reshard_hang", "shard_tensor_hang"])
def test_a_hung_rank_makes_the_others_give_up_after_the_timeout(case, tmp_path, monkeypatch):
    for report in _launch(case, str(tmp_path), monkeypatch).values():
        assert report["type"] == "CollectiveError", report
        _check_raised(report, ENV_TIMEOUT, f"no answer within timeout={ENV_TIMEOUT:g} s")
        assert CLOSED not in report["message"], report
        # It waited for the timeout, not less: a slow peer is not mistaken for a dead one.
        assert report["elapsed"] >= ENV_TIMEOUT * 0.9, report


# -- a death is seen in seconds, whatever the timeout ---------------------------------------------

def _loop_until_raised(rank: int, world: int, case: str, root: str, delay: float) -> None:
    """Every rank calls the entry point in a loop; rank 2 is SIGKILLed ``delay`` s in."""
    t = _split_rows(rank)
    if case == "reshard":
        current, specs = [t], [single_split(1, _ranks()), single_split(0, _ranks())]

        def call() -> object:
            current[0] = current[0].reshard(specs[0])  # a new tensor each time: no reshard is reused
            specs.reverse()
            return None
        operation = "ShardedTensor.reshard"
    else:
        manager = checkpoint.CheckpointManager(f"{root}/run", keep_last=2)
        steps = iter(range(1, 1 << 30))

        def call() -> object:
            step = next(steps)
            manager.save(step, {**_state(rank, 1), "version": step})
            return manager.load(_empty())
        operation = "CheckpointManager"
    call()  # every rank has communicated once before the kill
    if rank == VICTIM:
        def die() -> None:
            with open(f"{root}/killed", "w") as f:
                f.write(repr(time.time()))
            _die()
        threading.Timer(delay, die).start()
    try:
        while True:
            call()
    except (CollectiveError, CheckpointError) as exc:
        kind = CheckpointError if isinstance(exc, CheckpointError) else CollectiveError
        seen = {"type": kind.__name__, "message": str(exc), "raised": time.time(), "class": _shown_as(exc)}
    seen.update(rank=rank, operation=operation)
    raise _Observed(json.dumps(seen))


@pytest.mark.parametrize(("case", "delay"), [("reshard", 0.7), ("manager", 1.3)])
def test_a_death_is_seen_in_seconds_with_the_default_timeout(case, delay, tmp_path, monkeypatch):
    # No timeout anywhere: the waits have the default 600 s, so only the detection of the
    # death can end them. Rank 2 dies at some point of some call of a loop.
    monkeypatch.delenv(comm.TIMEOUT_ENV, raising=False)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_loop_until_raised, WORLD, case, str(tmp_path), delay, timeout=600, grace=60)
    killed = float((tmp_path / "killed").read_text())
    for rank, report in _observed(info).items():
        assert report["type"] in ("CollectiveError", "CheckpointError"), (rank, report)
        assert report["class"] in PUBLIC, (rank, report)
        assert VICTIM in _named(report["message"]) or "rank 2" in report["message"], report
        assert CLOSED in report["message"], report
        assert f"timeout={comm.DEFAULT_TIMEOUT:g} s" in report["message"], report
        # A safety bound far below the timeout (the goal, 10 s, is measured by
        # scripts/bench/death_detection.py, not asserted).
        assert report["raised"] - killed < 10 + MARGIN, (rank, report["raised"] - killed, report)


# -- which timeout applies (no process group needed) ----------------------------------------------

@pytest.mark.parametrize(("env", "keyword", "scope", "expected"), [
    pytest.param(None, None, None, comm.DEFAULT_TIMEOUT, id="default"),
    pytest.param("7.5", None, None, 7.5, id="environment"),
    pytest.param("7.5", None, 3.0, 3.0, id="entry-point-keyword-over-environment"),
    pytest.param("7.5", 2.0, 3.0, 2.0, id="call-over-everything"),
    pytest.param(" 9 ", None, None, 9.0, id="environment-with-spaces"),
])
def test_timeout_resolution(env, keyword, scope, expected, monkeypatch):
    if env is None:
        monkeypatch.delenv(comm.TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(comm.TIMEOUT_ENV, env)
    with comm.operation("outer", scope), comm.operation("inner"):
        assert comm.resolve_timeout(keyword) == expected
        assert comm.operation_name() == "outer"
    assert comm.operation_name("none") == "none"


@pytest.mark.parametrize(("env", "keyword", "match"), [
    pytest.param("soon", None, r"SHARDKIT_TIMEOUT='soon' is not a timeout", id="env-not-a-number"),
    pytest.param("0", None, r"SHARDKIT_TIMEOUT=0.0 is not a timeout", id="env-zero"),
    pytest.param(None, -1, r"timeout=-1 is not a timeout; use a positive", id="negative"),
    pytest.param(None, float("inf"), r"timeout=inf is not a timeout", id="infinite"),
    pytest.param(None, True, r"timeout=True is not a timeout", id="bool"),
])
def test_bad_timeouts_are_refused(env, keyword, match, monkeypatch):
    if env is None:
        monkeypatch.delenv(comm.TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(comm.TIMEOUT_ENV, env)
    with pytest.raises(ValueError, match=match):
        comm.resolve_timeout(keyword)


def test_collective_error_says_what_happened():
    closed = CollectiveError("ShardedTensor.reshard (exchange)", "closed", [3, 2], timeout=600, elapsed=0.04)
    assert str(closed) == ("ShardedTensor.reshard (exchange) did not complete: a peer closed its connection "
                           "after 0.0 s (it crashed, was killed or exited; timeout=600 s); no answer from ranks 2, 3.")
    assert (closed.operation, closed.reason, closed.ranks) == ("ShardedTensor.reshard (exchange)", "closed", [2, 3])
    late = CollectiveError("checkpoint.load", "timeout", None, timeout=5, elapsed=5.01)
    assert "no answer within timeout=5 s" in str(late) and "which ranks did not answer is unknown" in str(late)
    assert "closed" not in str(late)
