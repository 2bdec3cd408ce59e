"""Run a function on ``world_size`` local processes joined by a Gloo process group.

The one launcher of the distributed tests and the benchmarks (internal, not public API). A
small replacement for ``torch.testing._internal``'s multi-process test base::

    def _check_sum(rank: int, world_size: int, scale: float) -> torch.Tensor:  # module level
        t = torch.full((2,), float(rank) * scale)
        dist.all_reduce(t)
        return t

    def test_sum():
        results = run_distributed(_check_sum, 2, 10.0)      # one entry per rank
        assert all(torch.equal(r, torch.full((2,), 10.0)) for r in results)

Each rank starts from a fresh interpreter, never a fork of pytest: by default it is forked
from a ``forkserver`` that has preloaded torch (fast), or, with
``SHARDKIT_TEST_START_METHOD=spawn``, spawned from scratch. Each rank gets the parent's
``os.environ`` as it is at the call (plus ``env=``). Rendezvous goes through a ``FileStore``
in a private temporary directory, created before any rank starts: there is no port to pick,
so no other process can take it between the choice and the ranks' connection (the race of
choosing a "free" TCP port and handing it to the ranks). The parent waits on every rank's
result pipe and process sentinel, so a rank that raises, crashes or hangs is reported with
its traceback (or, when hung, its current stack) instead of stalling the test run. What the ranks print
is replayed on the parent's stdout after the run, labelled by rank (``capture_output=False``
leaves it on the inherited stdout/stderr instead, for scripts that show progress live).

``run_distributed(fn, world_size, *args, timeout=..., **kwargs)`` is the tests' form; ``launch``
takes ``args``/``kwargs`` as values and adds the options benchmarks need (no overall timeout,
threads per rank, extra environment, live output, start method).
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["LaunchError", "launch", "run_distributed"]

# After the first rank fails, wait this long for the others to finish or report their own
# error (usually a broken collective) before killing them.
_GRACE_SECONDS = 5.0
# "forkserver" forks each rank from a clean server process that has already imported torch:
# a 4-rank launch takes well under a second instead of several seconds for "spawn", where every
# rank re-imports torch. Both start from a fresh interpreter (no state inherited from pytest).
# Set SHARDKIT_TEST_START_METHOD=spawn to use plain spawn.
_START_METHOD: str = os.environ.get(
    "SHARDKIT_TEST_START_METHOD",
    "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")
_HAS_STACK_SIGNAL = hasattr(signal, "SIGUSR1")


class LaunchError(AssertionError):
    """One or more ranks failed, crashed or timed out.

    An ``AssertionError``, so a test that launches ranks reports it as a failure.

    Attributes:
        failures: rank -> full text of what went wrong there (a traceback, an exit code, or
            the stack of a rank that did not finish in time).
        first_rank: the rank whose failure was reported first (usually the root cause), or
            ``None`` for a pure timeout.
    """

    def __init__(self, message: str, failures: dict[int, str], first_rank: int | None) -> None:
        super().__init__(message)
        self.failures = failures
        self.first_rank = first_rank


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120,
                    grace: float = _GRACE_SECONDS, **kwargs: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` Gloo ranks.

    ``launch(fn, world_size, args, kwargs, timeout=timeout, grace=grace)``; see ``launch``.
    """
    return launch(fn, world_size, args, kwargs, timeout=timeout, grace=grace)


def launch(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (),
           kwargs: Mapping[str, Any] | None = None, *, timeout: float | None = 120,
           collective_timeout: float | None = None, env: Mapping[str, str] | None = None,
           threads: int | None = None, capture_output: bool = True,
           start_method: str | None = None, grace: float = _GRACE_SECONDS,
           preload: tuple[str, ...] = ()) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` Gloo ranks.

    ``fn`` must be a module-level function (it is pickled by name) and its return value must
    be picklable. The default process group is initialized before ``fn`` runs and destroyed
    after. ``OMP_NUM_THREADS`` is 1 in the children unless already set.

    Args:
        fn: module-level function run on every rank.
        world_size: number of processes.
        args: extra positional arguments for ``fn`` (picklable).
        kwargs: keyword arguments for ``fn`` (picklable).
        timeout: seconds for the whole run, start-up included, or ``None`` for no limit.
        collective_timeout: the process group's collective timeout in seconds; default
            ``timeout``, or ``_shardkit.comm.DEFAULT_TIMEOUT`` when that is ``None``.
        env: variables set in the ranks' environment on top of the caller's.
        threads: ``torch.set_num_threads`` (and ``OMP_NUM_THREADS``) in every rank; default
            1 unless ``OMP_NUM_THREADS`` is set.
        capture_output: replay what the ranks print on this process's stdout after the run
            (default), or leave their output on the inherited stdout/stderr, live.
        start_method: ``"forkserver"`` or ``"spawn"``; default ``SHARDKIT_TEST_START_METHOD``,
            else forkserver where available.
        grace: once a rank has failed, seconds the others get to finish or fail on their own
            before they are killed (raise it to see how the survivors of a crash react).
        preload: more modules for the forkserver to import once, besides torch (e.g.
            ``"torch._dynamo"``, which building any optimizer imports: seconds per rank on a
            busy machine, paid by every start of a job that is started many times). Takes
            effect only if this process has not started its forkserver yet.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        LaunchError: some rank raised (its traceback and message are in the error),
            exited without a result, or did not finish within ``timeout``; the remaining
            ranks are killed first, so this never hangs.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        msg = f"world_size={world_size!r} must be a positive int."
        raise ValueError(msg)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        msg = f"threads={threads!r} must be a positive int (or None for the default)."
        raise ValueError(msg)
    method = start_method or _START_METHOD
    if method not in ("forkserver", "spawn"):
        msg = f"start_method={method!r} is not supported; use 'forkserver' or 'spawn' (never fork a test runner)."
        raise ValueError(msg)
    if collective_timeout is None:
        from .comm import DEFAULT_TIMEOUT

        collective_timeout = timeout if timeout is not None else DEFAULT_TIMEOUT
    kwargs = dict(kwargs or {})
    extra_env = dict(env or {})
    if threads is not None:
        extra_env["OMP_NUM_THREADS"] = str(threads)
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname or not callable(fn):
        msg = (f"fn={fn!r} must be a module-level function so the spawned ranks can import it by "
               f"name; move it to the top level of the test module.")
        raise TypeError(msg)
    # Any: the stubs type a context chosen by a runtime string as BaseContext, without Process.
    ctx: Any = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", *preload])
    fn_name = f"{getattr(fn, '__module__', '?')}.{qualname}"

    with tempfile.TemporaryDirectory(prefix="shardkit-dist-") as tmp:
        store_path = str(Path(tmp) / "store")
        readers: list[multiprocessing.connection.Connection] = []
        procs: list[multiprocessing.process.BaseProcess] = []
        saved_omp = os.environ.get("OMP_NUM_THREADS")
        if saved_omp is None:
            # Children read it at interpreter start (torch import), so set it before spawning.
            os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker, name=f"shardkit-rank{rank}",
                    args=(rank, world_size, store_path, tmp, collective_timeout, {**os.environ, **extra_env},
                          capture_output, fn, args, kwargs, writer))
                proc.start()
                writer.close()  # the parent keeps only the read end, so a dead child gives EOF
                readers.append(reader)
                procs.append(proc)
        except BaseException:
            _kill(procs)
            raise
        finally:
            if saved_omp is None:
                del os.environ["OMP_NUM_THREADS"]
        finished = False
        try:
            results = _collect(fn_name, world_size, procs, readers, tmp, timeout, grace)
            finished = True
            return results
        finally:
            # Ranks that reported are exiting; let them (a moment), then kill whatever is left.
            _kill(procs, grace=2.0 if finished else 0.0)
            for reader in readers:
                reader.close()
            if capture_output:
                _replay_output(tmp, world_size)


def _collect(fn_name: str, world_size: int, procs: list[Any], readers: list[Any], tmp: str,
             timeout: float | None, grace: float) -> list[Any]:
    """Wait for every rank's report; raise ``LaunchError`` on any failure."""
    deadline = time.monotonic() + timeout if timeout is not None else float("inf")
    grace_deadline: float | None = None
    pending = set(range(world_size))
    results: list[Any] = [None] * world_size
    failures: dict[int, str] = {}
    failed_at: dict[int, float] = {}  # rank -> when it failed (wall clock), to find the root cause
    rank_of_reader = {id(readers[r]): r for r in range(world_size)}
    rank_of_sentinel = {procs[r].sentinel: r for r in range(world_size)}

    def read(rank: int) -> None:
        try:
            status, payload = readers[rank].recv()
        except (EOFError, OSError):
            procs[rank].join(5)
            failures[rank] = (f"rank {rank} exited with code {procs[rank].exitcode} without reporting a "
                              f"result (crashed or killed).")
        else:
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                failed_at[rank], failures[rank] = payload
        pending.discard(rank)

    while pending:
        limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
        remaining = None if limit == float("inf") else limit - time.monotonic()  # None: wait as long as it takes
        if remaining is not None and remaining <= 0:
            break
        waitables = [readers[r] for r in pending] + [procs[r].sentinel for r in pending]
        for ready in multiprocessing.connection.wait(waitables, timeout=remaining):
            is_sentinel = isinstance(ready, int)
            rank = rank_of_sentinel[ready] if is_sentinel else rank_of_reader[id(ready)]
            if rank not in pending:
                continue
            if is_sentinel and not readers[rank].poll():
                procs[rank].join(5)
                failures[rank] = (f"rank {rank} exited with code {procs[rank].exitcode} without reporting "
                                  f"a result (crashed or killed).")
                pending.discard(rank)
            else:
                read(rank)
        if failures and grace_deadline is None:
            grace_deadline = time.monotonic() + grace

    if not pending and not failures:
        return results

    stuck = sorted(pending)
    stacks = _dump_stacks(procs, stuck, tmp)
    if failures:
        order = sorted(failures, key=lambda r: failed_at.get(r, float("inf")))
        failures = {r: failures[r] for r in order}
        first = order[0]
        parts = [f"rank {first} of {world_size} failed in {fn_name}:\n{failures[first]}"]
        parts += [f"rank {r} also failed (possibly as a consequence):\n{failures[r]}"
                  for r in failures if r != first]
        if stuck:
            parts.append(f"ranks {stuck} were still running {grace:g} s after rank {first} failed "
                         f"and were killed.")
    else:
        first = None
        done = sorted(set(range(world_size)) - pending)
        parts = [f"ranks {stuck} of {world_size} did not finish {fn_name} within timeout={timeout:g} s "
                 f"(finished: {done}); they were killed. Look for a collective that not every rank "
                 f"calls, or raise timeout= for slow tests."]
    for r in stuck:
        failures.setdefault(r, f"rank {r} did not finish (killed).")
        if stacks.get(r):
            parts.append(f"stack of rank {r} when it was killed:\n{stacks[r]}")
            failures[r] += f"\nstack when killed:\n{stacks[r]}"
    raise LaunchError("\n\n".join(parts), failures, first)


def _dump_stacks(procs: list[Any], ranks: list[int], tmp: str) -> dict[int, str]:
    """Ask still-running ranks to write their Python stacks (faulthandler), then read them."""
    if not ranks or not _HAS_STACK_SIGNAL:
        return {}
    asked = []
    for r in ranks:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except OSError:
                continue
            asked.append(r)
    # Wait for the stacks to appear in their files and stop growing; the deadline only covers
    # a rank that cannot answer (gone meanwhile, or its handler blocked).
    deadline = time.monotonic() + 5.0
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        now = {r: _stack_size(tmp, r) for r in asked}
        if all(now.values()) and now == sizes:
            break
        sizes = now
        time.sleep(0.02)
    stacks = {}
    for r in ranks:
        try:
            stacks[r] = (Path(tmp) / f"stack-rank{r}.txt").read_text().strip()
        except OSError:
            stacks[r] = ""
    return stacks


def _stack_size(tmp: str, rank: int) -> int:
    try:
        return (Path(tmp) / f"stack-rank{rank}.txt").stat().st_size
    except OSError:
        return 0


def _replay_output(tmp: str, world_size: int) -> None:
    """Copy each rank's stdout/stderr to this process's stdout, labelled, so pytest shows it
    with the test that produced it (forked ranks would otherwise write to the forkserver's)."""
    for rank in range(world_size):
        try:
            text = (Path(tmp) / f"output-rank{rank}.txt").read_text(errors="replace")
        except OSError:
            continue
        if text:
            sys.stdout.write(f"----- output of rank {rank} -----\n{text}{'' if text.endswith(chr(10)) else chr(10)}")
    sys.stdout.flush()


def _kill(procs: list[Any], grace: float = 0.0) -> None:
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(10)


def _watch_parent(parent_pid: int) -> None:
    """Exit once the parent is gone, so an interrupted test run leaves no orphaned ranks."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _all_connected(store: Any, world_size: int) -> None:
    """Return once every rank has returned from ``init_process_group``.

    Gloo connects the ranks pair by pair, so one rank can return from ``init_process_group``
    while another is still connecting; if the first then finishes ``fn`` and leaves, the
    other's connecting fails ("Connection closed by peer"). A short ``fn`` raced so.
    """
    if store.add("shardkit-launch/connected", 1) == world_size:
        store.set("shardkit-launch/all-connected", "1")
    store.wait(["shardkit-launch/all-connected"])


def _worker(rank: int, world_size: int, store_path: str, tmp: str, timeout: float, environ: dict[str, str],
            capture_output: bool, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            conn: multiprocessing.connection.Connection) -> None:
    """Body of one rank: join the group, run ``fn``, send ``("ok", pickled)`` or ``("error", (time, text))``."""
    # With forkserver the OS parent is the server, which exits with the test process.
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    # A forkserver child inherits the server's environment; use the caller's, as spawn would.
    os.environ.clear()
    os.environ.update(environ)
    # fds 1 and 2 (C++ logs too) go to a file the parent replays; line-buffered so a killed
    # rank loses nothing it printed.
    sys.stdout.flush()
    sys.stderr.flush()
    if capture_output:
        output = os.open(Path(tmp) / f"output-rank{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    stack_file = None
    if _HAS_STACK_SIGNAL:
        stack_file = open(Path(tmp) / f"stack-rank{rank}.txt", "w")  # noqa: SIM115 - kept open for the handler
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    sent = False

    def report(status: str, payload: object) -> None:
        nonlocal sent
        if not sent:
            sent = True
            conn.send((status, payload))

    try:
        import torch
        import torch.distributed as dist

        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            # A forkserver child inherits the server's thread pool size; apply the caller's.
            torch.set_num_threads(int(threads))
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        _all_connected(store, world_size)
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            # Report before tearing the group down: destroying it breaks the peers' pending
            # collectives, and their errors must not look earlier than this root cause.
            report("error", (time.time(), traceback.format_exc()))
            raise
        finally:
            dist.destroy_process_group()
        try:
            payload = pickle.dumps(result)
        except Exception as exc:
            msg = (f"rank {rank}: {fn.__qualname__} returned {type(result).__name__}, which cannot be "
                   f"pickled back to the test ({exc}); return plain data or tensors.")
            raise TypeError(msg) from exc
        report("ok", payload)
    except BaseException:
        try:
            report("error", (time.time(), traceback.format_exc()))
        except OSError:
            pass
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        if stack_file is not None:
            faulthandler.unregister(signal.SIGUSR1)
            stack_file.close()
