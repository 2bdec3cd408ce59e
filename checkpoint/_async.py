"""``checkpoint.async_save``: stage a snapshot on the training thread, write it on a background thread.

Why this shape:

- **Snapshot, then return.** ``save``'s planning runs on the caller's thread, then each region
  this rank writes is copied into a staging buffer. Only then does ``async_save`` return, so
  in-place updates that follow (an optimizer step) never reach the files. The background
  thread is started before the copy: its prepare phase (agreement, folder, lease) overlaps
  the copy, and it reads the buffers only once every region is staged (``_Feed``). If the
  copy fails, the writer gives up and every rank's save fails; the call raises the error.
- **Bounded, reused staging.** A rank stages only the regions it writes (a replica written by
  another rank is not copied), so staging never exceeds one copy of the rank's local bytes.
  Buffers are kept between saves and reused when a region keeps its shape and dtype; buffers
  of regions that disappeared are dropped, so memory does not grow across saves. With
  ``max_staging_bytes`` below the rank's share, one buffer of at most that size is filled
  and written wave after wave instead (``_Waves``).
- **One save in flight.** A second ``async_save`` waits for the first (or, with
  ``if_busy="error"``, refuses), so two saves never interleave and the staging buffers are
  never overwritten while being written. An error of a background save is raised by
  ``handle.result()``, or else by the next ``async_save``: it is never lost.
- **Its own process group.** The background thread runs ``save``'s remaining phases
  (``_save.run_plan``: prepare, write, commit, cleanup) whose collectives would
  otherwise race with the user's collectives on the default group (Gloo and NCCL match
  collectives by issue order per group). So checkpointing uses a separate Gloo group over
  the same ranks, created once, on the training thread, by the first ``async_save`` (creating
  a group is itself collective), and reused. Every wait in it has ``save``'s timeout, so a
  dead rank makes the others fail with ``CheckpointError`` instead of hanging.
- **Devices.** Non-CPU tensors are copied to pinned host memory on a side stream, and the
  stream is synchronized before returning, so the snapshot is complete when the call returns.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from _shardkit import comm as _comm
from _shardkit import teardown as _teardown

from ._dtensor import dtensor_views
from ._save import _Plan, _plan, _reduce_partials, run_plan
from ._schema import CheckpointError
from ._storage import resolve

__all__ = ["async_save", "AsyncSaveHandle"]


class AsyncSaveHandle:
    """The future of one ``async_save``: ``done()`` polls, ``result(timeout)`` waits and raises its error.

    Args:
        path: the checkpoint being written (created by ``async_save``, not by hand).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        self._finished_at: float | None = None  # time.perf_counter() at the end (benchmarks)
        self._blocked_parts: dict[str, float] = {}  # seconds of each step of the call (benchmarks)

    def done(self) -> bool:
        """Whether the background save has finished (committed or failed)."""
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint is committed; raise the save's error if it failed.

        Args:
            timeout: seconds to wait; ``None`` waits until the save ends (its own collective
                timeouts bound that).

        Raises:
            TimeoutError: still running after ``timeout`` seconds (the save goes on).
            CheckpointError: another rank failed or died; nothing was committed.
            OSError: the storage failed on this rank.

        Example:
            >>> handle = checkpoint.async_save(state, "ckpt")  # doctest: +SKIP
            >>> handle.result(timeout=60)  # doctest: +SKIP
            >>> handle.done()  # doctest: +SKIP
            True
        """
        if not self._finished.wait(timeout):
            msg = (f"async_save to {self.path!r} is still running after timeout={timeout!r} s; "
                   f"call result() again to keep waiting.")
            raise TimeoutError(msg)
        self._reported = True
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error is not None else "committed")
        return f"AsyncSaveHandle(path={self.path!r}, {state})"


class _Staging:
    """Host buffers for the regions this rank writes, reused across saves."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, Any], torch.Tensor] = {}
        self.wave: torch.Tensor | None = None  # one flat buffer when staging in waves
        self.stream: Any = None

    def nbytes(self) -> int:
        waves = 0 if self.wave is None else self.wave.numel()
        return waves + sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(self, plan: _Plan, rank: int, feed: _Feed | None = None) -> None:
        """Copy this rank's regions into the buffers, then hand them to ``feed`` (the writer)."""
        keep: dict[tuple[str, Any], torch.Tensor] = {}
        device_copies = False
        staged: list[torch.Tensor] = []
        for region in plan.regions:
            if region.writer != rank or region.tensor is None:
                continue
            source = region.tensor.detach()
            key = (region.name, region.box)
            buffer = self.buffers.pop(key, None)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = None  # a changed region: free the old buffer before allocating the new one
                pin = source.device.type != "cpu" and torch.cuda.is_available()
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
            if source.device.type == "cpu":
                buffer.copy_(source)
            else:
                device_copies = True
                if source.device.type == "cuda":
                    if self.stream is None:
                        self.stream = torch.cuda.Stream(device=source.device)
                    self.stream.wait_stream(torch.cuda.current_stream(source.device))
                    with torch.cuda.stream(self.stream):
                        buffer.copy_(source, non_blocking=True)
                else:
                    buffer.copy_(source)
            keep[key] = buffer
            region.tensor = buffer
            staged.append(buffer)
        if device_copies and self.stream is not None:
            self.stream.synchronize()
        if feed is not None:
            for index, buffer in enumerate(staged):
                feed.put(index, buffer)
        self.buffers = keep  # buffers of regions no longer saved are released here
        self.wave = None


class _Feed:
    """This rank's staged regions, handed from the training thread to the writer.

    The writer starts before staging, so its prepare phase (agreement, folder, lease) runs
    while the training thread copies; it reads a region only once the whole snapshot is
    staged. (Handing each region over as soon as it is copied, so that writing overlaps
    staging too, made the copy itself slower on a loaded machine: docs/benchmarks-history.md.)
    """

    def __init__(self, count: int) -> None:
        self._tensors: list[torch.Tensor | None] = [None] * count
        self._ready = [threading.Event() for _ in range(count)]
        self._error: BaseException | None = None

    def put(self, index: int, tensor: torch.Tensor) -> None:
        self._tensors[index] = tensor
        self._ready[index].set()

    def fail(self, error: BaseException) -> None:
        """Staging raised: the writer stops at the next region it asks for."""
        self._error = error
        for ready in self._ready:
            ready.set()

    def get(self, index: int) -> torch.Tensor:
        self._ready[index].wait()
        if self._error is not None:
            msg = f"staging the snapshot failed on this rank: {type(self._error).__name__}: {self._error}"
            raise CheckpointError(msg) from self._error
        tensor = self._tensors[index]
        assert tensor is not None
        return tensor

    def release(self, index: int) -> None:
        """Nothing to do: the buffers stay for the next save."""


class _Waves:
    """Staging in waves through one buffer of at most ``cap`` bytes (``max_staging_bytes``).

    The training thread copies wave w into the buffer once the background thread has written
    wave w - 1 (``staged``/``written`` events); the background writer takes each region from
    the buffer (``get``) and reports it written (``release``). The call returns once the last
    wave is staged, so the snapshot is still complete when it returns.
    """

    def __init__(self, regions: list[Any], cap: int, staging: _Staging, handle: AsyncSaveHandle) -> None:
        self.regions, self.handle = regions, handle
        sizes = [r.tensor.numel() * r.tensor.element_size() for r in regions]
        largest = max(sizes)
        if largest > cap:
            msg = (f"max_staging_bytes={cap} is smaller than the largest region this rank writes "
                   f"({largest} bytes, tensor {regions[sizes.index(largest)].name!r}); pass at least {largest}.")
            raise ValueError(msg)
        self.wave_of, self.offset, self.last_of_wave = [], [], set()
        wave, used = 0, 0
        for i, size in enumerate(sizes):
            if used + size > cap:
                self.last_of_wave.add(i - 1)
                wave, used = wave + 1, 0
            self.wave_of.append(wave)
            self.offset.append(used)
            used += size
        self.last_of_wave.add(len(sizes) - 1)
        self.sizes = sizes
        self.count = wave + 1
        need = max(sum(s for s, w in zip(sizes, self.wave_of) if w == k) for k in range(self.count))
        staging.buffers = {}
        if staging.wave is None or staging.wave.numel() != need:
            staging.wave = None
            staging.wave = torch.empty(need, dtype=torch.uint8)
        self.buffer = staging.wave
        self.staged = [threading.Event() for _ in range(self.count)]
        self.written = [threading.Event() for _ in range(self.count)]

    def view(self, i: int) -> torch.Tensor:
        region = self.regions[i]
        flat = self.buffer[self.offset[i]:self.offset[i] + self.sizes[i]]
        return flat.view(region.tensor.dtype).reshape(region.tensor.shape)

    def stage_all(self) -> None:
        """Training thread: copy every wave in turn; stop early if the background save ended."""
        for wave in range(self.count):
            if wave > 0:
                while not self.written[wave - 1].wait(0.05):
                    if self.handle.done():
                        return
            for i, w in enumerate(self.wave_of):
                if w == wave:
                    self.view(i).copy_(self.regions[i].tensor.detach())
            self.staged[wave].set()

    def get(self, i: int) -> torch.Tensor:
        self.staged[self.wave_of[i]].wait()
        return self.view(i)

    def release(self, i: int) -> None:
        if i in self.last_of_wave:
            self.written[self.wave_of[i]].set()


_lock = threading.Lock()
_inflight: AsyncSaveHandle | None = None
_staging = _Staging()
_groups: dict[tuple[int, ...], Any] = {}
# A cached group keeps its Gloo threads running; released at exit so they are joined before
# the interpreter finalizes (see _shardkit/teardown.py).
_teardown.on_exit(_groups.clear)


def _staging_bytes() -> int:
    """Private, for benchmarks and tests: bytes held by the staging buffers now."""
    return _staging.nbytes()


def _checkpoint_group(process_group: _comm.ProcessGroup, timeout: float | None) -> Any:
    """The Gloo group background saves communicate on, over the ranks of ``process_group``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    group = _groups.get(ranks)
    if group is not None and group not in dist.distributed_c10d._world.pg_map:
        group = None  # destroyed with its process group; the ranks may belong to a new one
    if group is None:
        seconds = max(_comm.resolve_timeout(timeout), 1.0)
        group = _teardown.created(dist.new_group(list(ranks), backend="gloo",
                                                 timeout=datetime.timedelta(seconds=seconds)))
        _groups[ranks] = group
    return group


def _wait_previous(if_busy: str) -> None:
    previous = _inflight
    if previous is None:
        return
    if not previous.done() and if_busy == "error":
        msg = (f"async_save: the previous save to {previous.path!r} is still being written and "
               f"if_busy='error'; call its handle's result() first, or pass if_busy='wait'.")
        raise RuntimeError(msg)
    previous._finished.wait()
    if previous._error is not None and not previous._reported:
        previous._reported = True
        msg = (f"the previous async_save to {previous.path!r} failed (nothing was committed there): "
               f"{type(previous._error).__name__}: {previous._error}")
        raise CheckpointError(msg) from previous._error


def _tell_peers(problem: Exception, fs: Any, root: str, group: Any, timeout: float) -> None:
    """Report ``problem`` (raised on this rank before writing) to the other ranks' saves, which then stop.

    The others wait in ``save``'s prepare phase on the checkpoint group; this rank joins it with
    nothing to write, so every rank gives up together. The caller raises ``problem`` itself.
    """
    with contextlib.suppress(Exception):
        run_plan(_Plan(), problem, fs, root, process_group=group, timeout=timeout, quiet=True)


@_comm.collective("checkpoint.async_save")
def async_save(state_dict: Mapping[str, Any], path: str | os.PathLike[str], *,
               process_group: _comm.ProcessGroup = None, storage_options: Mapping[str, Any] | None = None,
               timeout: float | None = None, quiet: bool | None = True,
               if_busy: Literal["wait", "error"] = "wait", max_staging_bytes: int | None = None,
               reduce_partial: bool = False, _after: Callable[[], None] | None = None) -> AsyncSaveHandle:
    """Save like ``checkpoint.save``, writing in the background. Collective.

    Returns once this rank's share of ``state_dict`` is copied into staging buffers: changes
    made to the tensors after it returns are not saved. The checkpoint has ``save``'s
    guarantees (complete or absent, checksums, replicas written once, any fsspec storage);
    it is durable once ``handle.result()`` returns.

    Args:
        state_dict: as for ``save``.
        path: the checkpoint folder, a local path or fsspec URL.
        process_group: as for ``save``; the background writing uses a separate Gloo group
            over the same ranks (created by the first call; every rank of the default group
            must make that first call).
        storage_options: passed to fsspec.
        timeout: seconds each rank waits for the others in the background phases; a rank that
            died or hangs makes ``result()`` raise ``CheckpointError`` within this time, naming
            the ranks that did not answer. ``None``: ``$SHARDKIT_TIMEOUT``, else 600 s.
        quiet: ``False`` shows ``save``'s progress bar.
        if_busy: ``"wait"`` (default) waits for a save still in flight; ``"error"`` raises
            ``RuntimeError`` instead.
        max_staging_bytes: a cap on staging memory. When this rank's share is larger, it is
            staged and written in waves through one buffer of at most this size, and the call
            returns once the last wave is staged (later than without a cap: the training
            thread waits for all but the last wave to be written). Must be at least the
            largest single region this rank writes.
        reduce_partial: as for ``save``: save the reduction of partial entries instead of
            refusing them (a collective reduction, on the training thread).

    Returns:
        An ``AsyncSaveHandle``: ``done()``, ``result(timeout=None)``.

    Raises:
        CheckpointError: the previous ``async_save`` failed and its error was not retrieved
            with ``result()`` (this save is not started).
        RuntimeError: a save is in flight and ``if_busy="error"``.
        TypeError, ValueError: as for ``save``, before anything is written.

    Example:
        >>> handle = checkpoint.async_save({"w": sharded_weight, "step": 10}, "ckpt")  # doctest: +SKIP
        >>> optimizer.step()  # safe: the snapshot is already staged  # doctest: +SKIP
        >>> handle.result()  # the checkpoint is committed  # doctest: +SKIP
        >>> handle.done()  # doctest: +SKIP
        True
    """
    global _inflight
    if if_busy not in ("wait", "error"):
        msg = f"if_busy={if_busy!r} is not an option; use 'wait' or 'error'."
        raise ValueError(msg)
    if max_staging_bytes is not None and (isinstance(max_staging_bytes, bool) or not isinstance(max_staging_bytes, int)
                                          or max_staging_bytes < 1):
        msg = f"max_staging_bytes={max_staging_bytes!r} must be a positive int (bytes) or None (no cap)."
        raise ValueError(msg)
    timeout = _comm.resolve_timeout(timeout)  # the background thread runs outside this call's scope
    called = time.perf_counter()
    with _lock:
        _wait_previous(if_busy)
        waited = time.perf_counter()
        group = _checkpoint_group(process_group, timeout)
        rank, world = _comm.rank_and_world(process_group)
        fs, root = resolve(path, storage_options)
        try:
            # As in save: DTensor entries are saved through ShardedTensor views of their data, and
            # partial values are refused unless reduce_partial asks to save their reduction.
            state_dict, _ = dtensor_views(state_dict, process_group)
            plan = _plan(state_dict, rank, world, _reduce_partials(state_dict, reduce_partial))
        except Exception as exc:
            _tell_peers(exc, fs, root, group, timeout)
            raise
        plan.values = json.loads(json.dumps(plan.values))  # a snapshot of lists and dicts too
        handle = AsyncSaveHandle(os.fspath(path))
        mine = [r for r in plan.regions if r.writer == rank and r.tensor is not None]
        total = sum(r.tensor.numel() * r.tensor.element_size() for r in mine)
        feed: _Waves | _Feed
        if max_staging_bytes is not None and total > max_staging_bytes:
            try:
                feed = _Waves(mine, max_staging_bytes, _staging, handle)
            except ValueError as exc:
                _tell_peers(exc, fs, root, group, timeout)
                raise
        else:
            feed = _Feed(len(mine))
        planned = time.perf_counter()

        def work() -> None:
            try:
                with _comm.operation("checkpoint.async_save", timeout):
                    run_plan(plan, None, fs, root, process_group=group, timeout=timeout, quiet=quiet, feed=feed)
                if _after is not None:
                    _after()
            except BaseException as exc:
                handle._error = exc
            finally:
                handle._finished_at = time.perf_counter()
                handle._finished.set()

        _inflight = handle
        threading.Thread(target=work, name="shardkit-async-save", daemon=False).start()
        started = time.perf_counter()
        if isinstance(feed, _Waves):
            feed.stage_all()
        else:
            try:
                _staging.stage(plan, rank, feed)
            except BaseException as exc:
                feed.fail(exc)  # the writer gives up: every rank's save fails, nothing is committed
                handle._reported = True  # raised here; the next call must not raise it again
                raise
        handle._blocked_parts = {"wait_previous": waited - called, "plan": planned - waited,
                                 "start_writer": started - planned, "stage": time.perf_counter() - started}
        return handle
