"""The one rule for ``CheckpointManager``'s step folders, shared by every reader of a manager's root.

Step ``n`` (any non-negative int) lives in ``step-<n, at least 10 digits>``: ``step-0000000042``,
``step-9999999999``, ``step-10000000000``, ``step-1000000000000000000``. A name is step ``n``'s
only when it is exactly ``step_name(n)``: ``step-00000000042`` (11 digits for 42) is no step, so
two folders can never claim one step. The manager, ``consolidate`` and the command line all
read a root through ``step_of`` and ``committed_steps``, so they agree on what its steps are.
"""

from __future__ import annotations

import posixpath
import re

import fsspec

from ._schema import METADATA_FILE

__all__ = ["step_name", "step_of", "check_step", "listed_steps", "committed_steps", "MAX_STEP"]

_DIGITS = 10
_PATTERN = re.compile(r"^step-([0-9]{10,250})$")
MAX_STEP = 10**250 - 1
"""The largest step: its name, ``step-`` and 250 digits, still fits a file name (255 bytes)."""


def check_step(step: object, *, what: str = "step") -> int:
    """``step`` itself if it is a step (a non-negative int up to ``MAX_STEP``), else ``ValueError``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        msg = f"{what}={step!r} must be a non-negative int."
        raise ValueError(msg)
    if step > MAX_STEP:
        msg = f"{what} has {len(str(step))} digits; a step has at most 250 (its folder name must fit a file name)."
        raise ValueError(msg)
    return step


def step_name(step: int) -> str:
    """The folder name of step ``step``: ``step-`` and its decimal digits, zero-padded to at least 10."""
    return f"step-{step:0{_DIGITS}d}"


def step_of(name: str) -> int | None:
    """The step folder ``name`` holds, or ``None`` when it is not exactly the name of a step."""
    match = _PATTERN.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if name == step_name(step) else None  # "step-00000000042" is not step 42's name


def listed_steps(fs: fsspec.AbstractFileSystem, root: str) -> tuple[list[int], list[int]]:
    """``(committed steps, step folders without metadata)`` under ``root``, both ascending. Read-only.

    A step is a folder (never a symbolic link: deleting through it would delete what it points
    to) named exactly ``step_name(n)``; it is committed once it holds ``shardkit.json``. An
    absent root has none.
    """
    committed: list[int] = []
    partial: list[int] = []
    fs.invalidate_cache(root)  # other processes write here: a cached listing (s3fs) may be stale
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for entry in entries:
        name = posixpath.basename(str(entry["name"]).rstrip("/"))
        step = step_of(name)
        if step is None or entry.get("type") != "directory" or entry.get("islink"):
            continue
        metadata = posixpath.join(root, name, METADATA_FILE)
        fs.invalidate_cache(posixpath.dirname(metadata))
        (committed if fs.exists(metadata) else partial).append(step)
    return sorted(committed), sorted(partial)


def committed_steps(fs: fsspec.AbstractFileSystem, root: str) -> list[int]:
    """The committed steps under ``root``, ascending (see ``listed_steps``)."""
    return listed_steps(fs, root)[0]
