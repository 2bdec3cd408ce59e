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
"""

from __future__ import annotations

import json
import os
import posixpath
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

from _shardkit import comm as _comm

from . import _strict_json as strict_json
from ._async import AsyncSaveHandle, _checkpoint_group, async_save
from ._lease import claim_abandoned, lease_seconds
from ._load import load as _load
from ._save import save as _save
from ._schema import METADATA_FILE, CheckpointError
from ._steps import check_step, listed_steps, step_name, step_of
from ._storage import is_local, list_names, resolve

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
                 storage_options: Mapping[str, Any] | None = None, timeout: float | None = None) -> None:
        self.keep_last = _positive("keep_last", keep_last)
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
        self.wait()
        self._refuse_committed(step, rank, world, overwrite)
        self._writing = step

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
        if handle is not None:
            try:
                handle.result()
            finally:
                self._writing = None

    def load(self, state_dict: Mapping[str, Any], step: int | None = None, *, strict: bool = True) -> Mapping[str, Any]:
        """Fill ``state_dict`` from step ``step`` (the latest committed one when ``None``). Collective.

        Rank 0 picks the step and tells the others, so every rank reads the same one.

        Raises:
            CheckpointError: there is no committed step, or ``step`` is not one of them.

        Example:
            >>> manager.load(state)  # doctest: +SKIP
        """
        self.wait()
        rank, world = _comm.rank_and_world(self._group)
        choice: dict[str, Any] = {"step": step, "error": None}
        if rank == 0:
            steps = self.steps()
            if step is None and not steps:
                choice["error"] = f"no committed checkpoint under {self._root!r}; save one first."
            elif step is None:
                choice["step"] = steps[-1]
            elif step not in steps:
                choice["error"] = f"step={step!r} is not a committed checkpoint under {self._root!r}; committed: {steps}."
        if world > 1:
            choice = _comm.broadcast_json(choice, 0, self._group, timeout=self._timeout,
                                          what="CheckpointManager.load (choosing the step)")
        if choice["error"] is not None:
            raise CheckpointError(choice["error"])
        chosen = int(choice["step"])
        with self._lock:
            self._reading.add(chosen)
        try:
            return _load(state_dict, self._url(chosen), process_group=self._group,
                         storage_options=self._options, strict=strict, timeout=self._timeout)
        finally:
            with self._lock:
                self._reading.discard(chosen)
