"""``checkpoint.CheckpointManager``: one checkpoint per training step under a root folder, with retention.

Layout: ``<root>/step-<step, at least 10 digits>/`` is an ordinary checkpoint folder (any
non-negative int step: ``step-0000000042``, ``step-1000000000000000000``; the rule is
``_steps``', shared with ``consolidate`` and the command line). A committed step is never
replaced unless ``save`` is given ``overwrite=True``. A step counts
(``steps()``) only once its ``shardkit.json`` exists, which ``save`` writes last and
atomically, so a step whose save crashed midway is never listed; its folder is removed by
rank 0 when a manager is created and after each later commit, once the save lease
(``shardkit.lock``) proves that no live save writes it. Every other entry of the root (other
names, files, symbolic links) is not the manager's: it is neither listed nor deleted.

Retention runs on rank 0 after a new step commits (in the background thread for async
saves), never before: a failed save therefore never costs an older checkpoint. It never
deletes the latest committed step, the step being written, or a step this process is
loading. A step is deleted under its save lease, metadata first, so a deletion cut short
leaves no half-listed step, only a folder that the next manager removes.

The memory tier (``memory_every=``; ``_memory_tier``) keeps steps in shared memory besides,
and ``load`` then reads the newest step complete in either; ``storage_every=`` thins what goes
to the root. Without those arguments nothing here changes.
"""

from __future__ import annotations

import json
import os
import posixpath
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from _shardkit import comm as _comm
from sharded_tensor import ShardedTensor

from . import _strict_json as strict_json
from ._async import AsyncSaveHandle, _checkpoint_group, async_save
from ._lease import claim_abandoned, lease_seconds
from ._load import load as _load
from ._memory_tier import LoadReport, MemoryTier
from ._save import _Plan, run_plan
from ._save import save as _save
from ._schema import METADATA_FILE, CheckpointError
from ._steps import check_step, listed_steps, step_name, step_of
from ._storage import is_local, list_names, resolve
from ._walk import flatten_state_dict

__all__ = ["CheckpointManager"]

_test_hook: Callable[[str], None] | None = None
"""Private, for tests: called by rank 0 with "pruning" (a doomed step's metadata is removed,
its files not yet) and "pruned" (retention is done), so a test can crash at those points."""


def _hook(phase: str) -> None:
    if _test_hook is not None:
        _test_hook(phase)


def _positive(name: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        msg = f"{name}={value!r} must be a positive int or None (None keeps every step)."
        raise ValueError(msg)
    return value


class CheckpointManager:
    """Save a checkpoint every few steps, list and load them, and keep only some.

    Args:
        root: folder holding one ``step-<n>`` checkpoint per saved step (local path or fsspec URL).
        keep_last: keep the newest this many committed steps; ``None`` keeps all.
        keep_every: also keep every step divisible by this (e.g. 1000); ``None``: none extra.
        keep_best: also keep the this many steps with the best ``metric`` given to ``save``.
        best_mode: ``"min"`` (default: lower is better, a loss) or ``"max"``.
        process_group: the group saving and loading (as for ``save``).
        storage_options: passed to fsspec.
        timeout: seconds a rank waits for the others in a save, a load or a step choice;
            ``None``: ``$SHARDKIT_TIMEOUT``, else 600 s.
        storage_every: write to ``root`` only the steps divisible by this (``save`` returns at once
            for the others, unless the memory tier takes them); ``None``: every step saved.
        memory_every: keep every step divisible by this in memory too (the memory tier; see
            docs/recovery.md); ``None`` (default): no memory tier.
        memory_replicas: copies of each rank's part of a memory step kept by ranks on other
            hosts (``0``: none; at most one per other host).
        keep_last_memory: memory steps each rank keeps (one more may be being staged).
        memory_dir: the folder holding the memory tier's files; ``None``: ``$SHARDKIT_MEMORY_DIR``,
            else ``/dev/shm`` (shared memory, which outlives the process). The memory tier's first
            save or load is collective and creates a Gloo group over the ranks of
            ``process_group`` (every rank of the default group takes part, as for ``async_save``).

    Example:
        >>> manager = checkpoint.CheckpointManager("ckpts", keep_last=2)  # doctest: +SKIP
        >>> for step in range(start, 100):  # doctest: +SKIP
        ...     train_step()
        ...     if step % 10 == 0:
        ...         manager.save(step, state, async_=True)
        >>> manager.wait()  # doctest: +SKIP
        >>> manager.steps(), manager.latest_step()  # keep_last=2: older steps are removed  # doctest: +SKIP
        ([80, 90], 90)
    """

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: int | None = None,
                 best_mode: Literal["min", "max"] = "min", process_group: _comm.ProcessGroup = None,
                 storage_options: Mapping[str, Any] | None = None, timeout: float | None = None,
                 storage_every: int | None = None, memory_every: int | None = None, memory_replicas: int = 1,
                 keep_last_memory: int = 1, memory_dir: str | os.PathLike[str] | None = None) -> None:
        self.keep_last = _positive("keep_last", keep_last)
        for name, value, low, none in (("storage_every", storage_every, 1, "every step saved"),
                                       ("memory_every", memory_every, 1, "no memory tier"),
                                       ("memory_replicas", memory_replicas, 0, None),
                                       ("keep_last_memory", keep_last_memory, 1, None)):
            if (value is not None or none is None) and (isinstance(value, bool) or not isinstance(value, int)
                                                        or value < low):
                msg = f"{name}={value!r} must be an int >= {low}{f' or None ({none})' if none else ''}."
                raise ValueError(msg)
        self.storage_every = storage_every
        self.keep_every = _positive("keep_every", keep_every)
        self.keep_best = _positive("keep_best", keep_best)
        if best_mode not in ("min", "max"):
            msg = f"best_mode={best_mode!r} is not an option; use 'min' (e.g. a loss) or 'max' (e.g. an accuracy)."
            raise ValueError(msg)
        self.best_mode = best_mode
        self._group = process_group
        self._options = storage_options
        self._timeout = None if timeout is None else _comm.resolve_timeout(timeout)  # refused here, as save does
        self._fs, self._root = resolve(root, storage_options)
        self._memory = None if memory_every is None else MemoryTier(
            self._fs.unstrip_protocol(self._root), every=memory_every, replicas=memory_replicas,
            keep_last=keep_last_memory, memory_dir=memory_dir, group=process_group, timeout=self._timeout)
        self.last_load: LoadReport | None = None
        """Where the last ``load`` on this rank read its step (tier, bytes, time); ``None`` before one."""
        self._handle: AsyncSaveHandle | None = None
        self._writing: int | None = None
        self._reading: set[int] = set()
        self._lock = threading.Lock()
        if _comm.rank_and_world(process_group)[0] == 0:
            # An explicit root folder: some fsspec backends (memory://) list a folder only if
            # it was created itself, not just folders below it.
            self._fs.makedirs(self._root, exist_ok=True)
            self._remove_abandoned()

    def _path(self, step: int) -> str:
        return posixpath.join(self._root, step_name(step))

    def _url(self, step: int) -> str:
        """The step's folder as ``save`` and ``load`` take it (with the protocol, e.g. ``s3://``)."""
        path = self._path(step)
        return path if is_local(self._fs) else self._fs.unstrip_protocol(path)

    def _listed(self) -> tuple[list[int], list[int]]:
        """(committed steps, folders without metadata), both ascending."""
        return listed_steps(self._fs, self._root)

    def steps(self) -> list[int]:
        """The committed steps, ascending (a step being written or abandoned midway is not listed)."""
        return self._listed()[0]

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _metric_path(self, step: int) -> str:
        return posixpath.join(self._root, f"{step_name(step)}.metric.json")

    def _metrics(self, steps: list[int]) -> dict[int, float]:
        found = {}
        for step in steps:
            try:
                path = self._metric_path(step)
                found[step] = float(strict_json.loads(self._fs.cat_file(path), source=path)["metric"])
            except (FileNotFoundError, KeyError, ValueError, TypeError):
                continue
        return found

    def _remove(self, step: int, *, metadata_first: bool) -> None:
        """Delete step ``step``'s folder under its save lease; keep it if a live save may hold that."""
        path = self._path(step)
        lease = claim_abandoned(self._fs, path, ttl=lease_seconds())
        if lease is None:
            return
        try:
            if metadata_first:
                self._fs.rm_file(posixpath.join(path, METADATA_FILE))
                _hook("pruning")
            try:
                self._fs.rm_file(self._metric_path(step))
            except FileNotFoundError:
                pass
            try:
                self._fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
        finally:
            lease.drop()

    def _remove_abandoned(self) -> None:
        committed, partial = self._listed()
        for step in partial:
            if step != self._writing:
                self._remove(step, metadata_first=False)
        # A metric file outlives its step only when a deletion was cut short.
        known = {*committed, *partial}
        for name in list_names(self._fs, self._root):
            owner = step_of(name.removesuffix(".metric.json")) if name.endswith(".metric.json") else None
            if owner is not None and owner not in known:
                try:
                    self._fs.rm_file(self._metric_path(owner))
                except (FileNotFoundError, IsADirectoryError):
                    pass

    def _retain(self, new_step: int) -> None:
        """Rank 0, after ``new_step`` committed: delete the steps no policy keeps."""
        self._remove_abandoned_except(new_step)
        if self.keep_last is None and self.keep_best is None:
            return  # no policy limits the count: keep every step
        steps = self.steps()
        keep = {new_step, steps[-1]} | (set(steps[-self.keep_last:]) if self.keep_last is not None else set())
        if self.keep_every is not None:
            keep |= {s for s in steps if s % self.keep_every == 0}
        if self.keep_best is not None:
            metrics = self._metrics(steps)
            ranked = sorted(metrics, key=lambda s: metrics[s] if self.best_mode == "min" else -metrics[s])
            keep |= set(ranked[:self.keep_best])
        with self._lock:
            keep |= self._reading
            doomed = [s for s in steps if s not in keep]
        for step in doomed:
            self._remove(step, metadata_first=True)
        _hook("pruned")

    def _remove_abandoned_except(self, step: int) -> None:
        for partial in self._listed()[1]:
            if partial != step:
                self._remove(partial, metadata_first=False)

    def save(self, step: int, state_dict: Mapping[str, Any], *, async_: bool = False,
             metric: float | None = None, overwrite: bool = False) -> AsyncSaveHandle | None:
        """Save ``state_dict`` as step ``step``; then apply retention. Collective.

        With ``storage_every``, a step it does not divide is not written to the root. With the
        memory tier, a step ``memory_every`` divides is copied into shared memory, then
        replicated and (when due) written to the root from that copy in the background.

        Args:
            step: the training step, a non-negative int.
            state_dict: as for ``checkpoint.save``.
            async_: ``True`` returns once a snapshot is staged (``checkpoint.async_save``) and
                writes in the background; ``False`` returns once committed.
            metric: a number ranking this step for ``keep_best`` (recorded by rank 0 next to the
                step once it is committed).
            overwrite: replace step ``step`` if it is already committed; otherwise that is an
                error (two runs writing one root would replace each other's steps unnoticed).

        Returns:
            The ``AsyncSaveHandle`` when ``async_``, else ``None``.

        Raises:
            CheckpointError: step ``step`` is already committed and ``overwrite`` is not set
                (raised on every rank; nothing is written).

        Example:
            >>> manager.save(100, {"model": model.state_dict(), "step": 100}, async_=True)  # doctest: +SKIP
            >>> manager.wait()  # doctest: +SKIP
            >>> manager.latest_step()  # doctest: +SKIP
            100
        """
        check_step(step)
        if metric is not None and (isinstance(metric, bool) or not isinstance(metric, (int, float))
                                   or metric != metric):
            msg = f"metric={metric!r} must be a number (not NaN) or None."
            raise ValueError(msg)
        rank, world = _comm.rank_and_world(self._group)
        to_storage = self.storage_every is None or step % self.storage_every == 0
        to_memory = self._memory is not None and step % self._memory.every == 0
        if not (to_storage or to_memory):
            return None
        self.wait()
        if to_storage:  # a step kept in memory only replaces nothing in storage
            self._refuse_committed(step, rank, world, overwrite)
        self._writing = step if to_storage else None

        def after(group: _comm.ProcessGroup) -> None:
            # Rank 0 applies retention, then tells the others, so that once save (or wait)
            # returns on any rank, steps() is the same everywhere.
            problem = None
            try:
                if rank == 0:
                    if metric is not None:
                        self._fs.pipe_file(self._metric_path(step), json.dumps({"metric": metric}).encode())
                    elif overwrite and self._fs.exists(self._metric_path(step)):
                        self._fs.rm_file(self._metric_path(step))  # the replaced step's metric
                    self._retain(step)
            except Exception as exc:  # reported to every rank below, so none waits for rank 0
                problem = f"{type(exc).__name__}: {exc}"
            finally:
                self._writing = None
            if world > 1:
                problem = _comm.broadcast_json(problem, 0, group, timeout=self._timeout,
                                               what="CheckpointManager.save (retention on rank 0)")
            if problem is not None:
                warnings.warn(f"step {step} was committed under {self._root!r}, but deleting older steps "
                              f"failed on rank 0: {problem}; they are kept.", RuntimeWarning, stacklevel=2)

        if to_memory:
            assert self._memory is not None
            try:
                handle = self._memory.save(step, state_dict, persist=self._persist(step, after) if to_storage else None)
            except BaseException:
                self._writing = None
                raise
            if not async_:
                self.wait()
            return handle if async_ else None
        if async_:
            self._handle = async_save(state_dict, self._url(step), process_group=self._group,
                                      storage_options=self._options, timeout=self._timeout,
                                      _after=lambda: after(_checkpoint_group(self._group, self._timeout)))
            return self._handle
        try:
            _save(state_dict, self._url(step), process_group=self._group, storage_options=self._options,
                  timeout=self._timeout)
        except BaseException:
            self._writing = None
            raise
        after(self._group)
        return None

    def _persist(self, step: int, after: Callable[[_comm.ProcessGroup], None]
                 ) -> Callable[[_Plan, _comm.ProcessGroup], None]:
        """The memory tier's write of ``step`` to storage, from its staged copy, then retention (background)."""
        def persist(plan: _Plan, group: _comm.ProcessGroup) -> None:
            run_plan(plan, None, self._fs, self._path(step), process_group=group, timeout=self._timeout, quiet=True)
            after(group)
        return persist

    def _refuse_committed(self, step: int, rank: int, world: int, overwrite: bool) -> None:
        """Raise ``CheckpointError`` on every rank if ``step`` is committed and ``overwrite`` is not set."""
        if overwrite:
            return
        problem = None
        if rank == 0 and step in self.steps():
            problem = (f"step {step} is already committed under {self._root!r} ({step_name(step)}); "
                       f"CheckpointManager.save never replaces a committed step unless asked: pass "
                       f"overwrite=True to replace it, or save under another step or root (is another run "
                       f"writing to this root?).")
        if world > 1:
            problem = _comm.broadcast_json(problem, 0, self._group, timeout=self._timeout,
                                           what="CheckpointManager.save (checking the step is new)")
        if problem is not None:
            raise CheckpointError(problem)

    def wait(self) -> None:
        """Wait for an async save in flight to commit; raise its error if it failed."""
        handle, self._handle = self._handle, None
        try:
            if self._memory is not None:
                self._memory.wait()
            if handle is not None:
                handle.result()
        finally:
            if handle is not None or self._memory is not None:
                self._writing = None

    def recoverable_step(self) -> int | None:
        """The step ``load()`` would read: the newest complete in memory or committed in storage, else ``None``.

        Collective when the memory tier is on (every rank tells what its host holds), like
        ``load``; without it, ``latest_step()``.

        Example:
            >>> start = 0  # doctest: +SKIP
            >>> if manager.recoverable_step() is not None:  # doctest: +SKIP
            ...     start = manager.load(state)["step"]
        """
        if self._memory is None:
            return self.latest_step()
        self.wait()
        choice, _ = self._memory.choose(None, self.steps)
        return choice.step if choice.tier != "none" else None

    def close(self) -> None:
        """Wait for the save in flight, then remove the memory tier's files: the clean finish. Collective.

        Without the memory tier it only waits. After an error, do not call it: the memory
        tier's files are what a restarted job resumes from (``with CheckpointManager(...)``
        calls it on a clean exit only).
        """
        self.wait()
        if self._memory is not None:
            self._memory.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            self.close()

    def load(self, state_dict: Mapping[str, Any], step: int | None = None, *, strict: bool = True) -> Mapping[str, Any]:
        """Fill ``state_dict`` from step ``step`` (the latest committed one when ``None``). Collective.

        Rank 0 picks the step and tells the others, so every rank reads the same one. With the
        memory tier, the ranks agree on the newest step complete in memory or committed in
        storage (memory on a tie), and each rank reads its bytes from the cheapest place: its
        host's memory, another rank's memory (over the process group), storage.
        ``last_load`` says where.

        Raises:
            CheckpointError: there is no committed step, or ``step`` is not one of them.

        Example:
            >>> manager.load(state)  # doctest: +SKIP
        """
        self.wait()
        if self._memory is not None:
            self.last_load = self._memory.load(state_dict, step, strict=strict, storage_steps=self.steps,
                                               load_storage=lambda sd, s: self._load_step(sd, s, strict))
            return state_dict
        started = time.perf_counter()
        rank, world = _comm.rank_and_world(self._group)
        choice: dict[str, Any] = {"step": step, "error": None}
        if rank == 0:
            steps = self.steps()
            if step is None and not steps:
                choice["error"] = f"no committed checkpoint under {self._root!r}; save one first."
            elif step is None:
                choice["step"] = steps[-1]
            elif step not in steps:
                choice["error"] = (f"step={step!r} is not a committed checkpoint under {self._root!r}; "
                                   f"committed: {steps}.")
        if world > 1:
            choice = _comm.broadcast_json(choice, 0, self._group, timeout=self._timeout,
                                          what="CheckpointManager.load (choosing the step)")
        if choice["error"] is not None:
            raise CheckpointError(choice["error"])
        chosen = int(choice["step"])
        nbytes = self._load_step(state_dict, chosen, strict)
        self.last_load = LoadReport(chosen, "storage", 0, 0, nbytes, time.perf_counter() - started)
        return state_dict

    def _load_step(self, state_dict: Mapping[str, Any], step: int, strict: bool) -> int:
        """Load committed step ``step`` from storage; the bytes of tensors filled on this rank."""
        with self._lock:
            self._reading.add(step)
        try:
            _load(state_dict, self._url(step), process_group=self._group,
                  storage_options=self._options, strict=strict, timeout=self._timeout)
        finally:
            with self._lock:
                self._reading.discard(step)
        return _local_bytes(state_dict)


def _local_bytes(state_dict: Mapping[str, Any]) -> int:
    """Bytes of the tensors of ``state_dict`` held by this rank (its local shards)."""
    total = 0
    for _, _, _, value in flatten_state_dict(state_dict):
        if isinstance(value, ShardedTensor):
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total
