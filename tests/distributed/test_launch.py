"""The multi-process launcher itself: results come back by rank, failures never hang."""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from _shardkit import launch as _launch
from tests.distributed._launch import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed


def _all_reduce(rank: int, world_size: int, scale: float) -> dict[str, object]:
    t = torch.full((3,), float(rank + 1) * scale)
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": t,
            "omp": os.environ.get("OMP_NUM_THREADS")}


def _fail_on_rank_1(rank: int, world_size: int, *, message: str) -> None:
    if rank == 1:
        _explode(message)
    # The other ranks wait in a collective that rank 1 never joins.
    dist.all_reduce(torch.ones(1))


def _explode(message: str) -> None:
    raise ValueError(message)


def _hang_on_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        threading.Event().wait()  # an event that never comes: stuck until the launcher kills it
    return rank


def _crash_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(7)
    return rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_returns_results_by_rank(world_size):
    results = run_distributed(_all_reduce, world_size, 10.0)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world_size"] == world_size for r in results)
    expected = 10.0 * world_size * (world_size + 1) / 2
    for r in results:
        torch.testing.assert_close(r["sum"], torch.full((3,), expected))
    if "OMP_NUM_THREADS" not in os.environ:
        assert [r["omp"] for r in results] == ["1"] * world_size
        assert "OMP_NUM_THREADS" not in os.environ  # the parent's environment is restored


def test_failing_rank_reports_its_traceback_without_hanging():
    # The launcher's timeout (600 s) is beyond pytest's per-test limit: the test can only pass
    # if rank 1's failure, not the timeout, ends the run while rank 0 waits for rank 1.
    with pytest.raises(DistributedTestError, match=r"rank 1 of 2 failed") as info:
        run_distributed(_fail_on_rank_1, 2, message="boom from rank one", timeout=600)
    text = str(info.value)
    assert "ValueError: boom from rank one" in text
    assert "Traceback (most recent call last)" in text
    assert "_explode" in text and "_fail_on_rank_1" in text  # the full stack, not just the message
    assert info.value.first_rank == 1
    assert "boom from rank one" in info.value.failures[1]
    assert "did not finish" not in text  # not a timeout


def _return_rank(rank: int, world_size: int) -> int:
    return rank


def test_hung_rank_times_out_with_its_stack():
    # The timeout includes start-up: warm the forkserver first (spawn re-imports torch each time),
    # and give the hung run a few times what that warm run took, so that on a busy machine (load
    # average 25 on 2 cores, where start-up alone can take many seconds) rank 0 is surely stuck
    # in the function, not still starting, when the deadline comes.
    started = time.monotonic()
    assert run_distributed(_return_rank, 2) == [0, 1]
    warm = time.monotonic() - started
    timeout = max(5 if _launch._START_METHOD == "forkserver" else 30, math.ceil(4 * warm))
    # Rank 1 normally finishes too; on a very slow machine start-up may keep it from doing so.
    with pytest.raises(DistributedTestError, match=r"ranks \[0(, 1)?\] of 2 did not finish") as info:
        run_distributed(_hang_on_rank_0, 2, timeout=timeout)
    assert f"within timeout={timeout} s" in str(info.value)  # the launcher's own deadline ended it
    assert info.value.first_rank is None
    assert 0 in info.value.failures
    if hasattr(signal, "SIGUSR1"):
        assert "in _hang_on_rank_0" in info.value.failures[0]  # the stack shows where it was stuck


def test_crashed_rank_is_reported():
    with pytest.raises(DistributedTestError, match=r"rank 1 exited with code 7"):
        run_distributed(_crash_on_rank_1, 2, timeout=60)


def test_local_function_is_refused_before_spawning():
    def local(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(local, 2)


def _print_and_fail_on_rank_1(rank: int, world_size: int) -> None:
    print(f"hello from rank {rank}")
    if rank == 1:
        raise RuntimeError("rank 1 gives up")


def test_rank_output_is_shown_with_the_test(capsys):
    with pytest.raises(DistributedTestError, match="rank 1 gives up"):
        run_distributed(_print_and_fail_on_rank_1, 2, timeout=60)
    out = capsys.readouterr().out
    # Each rank's own lines under its heading; the backend may log first (rank 1's exit can
    # cut a connection rank 0 is still making), so other lines may stand in between.
    sections = dict(re.findall(r"----- output of rank (\d) -----\n(.*?)(?=----- output of rank|\Z)", out, re.S))
    assert sorted(sections) == ["0", "1"], out
    for rank, text in sections.items():
        assert f"hello from rank {rank}\n" in text.splitlines(keepends=True), out


def _environment(rank: int, world_size: int, name: str) -> dict[str, object]:
    dist.barrier()
    return {"value": os.environ.get(name), "threads": torch.get_num_threads()}


def test_launch_sets_environment_and_threads_and_runs_without_a_deadline():
    results = _launch.launch(_environment, 2, ("SHARDKIT_LAUNCH_PROBE",), env={"SHARDKIT_LAUNCH_PROBE": "yes"},
                             threads=2, timeout=None, collective_timeout=77)
    assert [r["value"] for r in results] == ["yes", "yes"]
    assert [r["threads"] for r in results] == [2, 2]
    assert "SHARDKIT_LAUNCH_PROBE" not in os.environ  # the caller's environment is untouched


def _print_rank(rank: int, world_size: int) -> int:
    print(f"live line from rank {rank}")
    return rank


def test_launch_without_capture_does_not_replay_output(capsys):
    assert _launch.launch(_print_rank, 2, capture_output=False) == [0, 1]
    assert "----- output of rank" not in capsys.readouterr().out


@pytest.mark.parametrize(("options", "match"), [
    pytest.param({"threads": 0}, r"threads=0 must be a positive int", id="threads"),
    pytest.param({"start_method": "fork"}, r"start_method='fork' is not supported", id="start-method"),
])
def test_launch_refuses_bad_options_before_spawning(options, match):
    with pytest.raises(ValueError, match=match):
        _launch.launch(_return_rank, 2, **options)
