"""Progress bars for long checkpoint operations: rank 0 only, on a terminal only, with a quiet switch.

Shared by save, load, consolidate and the CLI so they all follow one rule::

    with progress(total_bytes, "save", rank=rank, quiet=quiet) as bar:
        for chunk in ...:
            write(chunk)
            bar.update(len(chunk))

A bar is shown only when all of these hold:

- this is rank 0 (``rank=0``);
- the operation is long enough to be worth a bar: ``total`` is at least ``MIN_BYTES``
  (64 MiB);
- ``sys.stderr`` is attached to a terminal (so logs, CI and pipes stay clean);
- it is not silenced: ``quiet=True`` silences it, and with ``quiet=None`` (the default) the
  environment variable ``SHARDKIT_QUIET`` does when set to anything but ``""`` or ``"0"``.
  ``SHARDKIT_PROGRESS=1`` forces the bar even without a terminal (for tests and demos).

Otherwise ``progress`` returns a no-op with the same interface, so callers never branch.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Protocol

__all__ = ["MIN_BYTES", "Bar", "progress", "progress_enabled"]

MIN_BYTES = 64 << 20
"""Operations moving fewer bytes than this finish too fast to need a bar."""


class Bar(Protocol):
    """What ``progress`` returns: a context manager counting bytes."""

    def update(self, n: int) -> object: ...

    def __enter__(self) -> Bar: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> object: ...


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def progress_enabled(total: int, *, rank: int = 0, quiet: bool | None = None) -> bool:
    """Whether ``progress`` would show a bar for this operation (the rules in the module doc)."""
    if rank != 0 or total < MIN_BYTES:
        return False
    if quiet is None:
        quiet = _env_flag("SHARDKIT_QUIET")
    if quiet:
        return False
    if _env_flag("SHARDKIT_PROGRESS"):
        return True
    stream = sys.stderr
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


def progress(total: int, desc: str, *, rank: int = 0, quiet: bool | None = None) -> Bar:
    """A tqdm byte counter for ``total`` bytes on rank 0 of a terminal, else a no-op.

    Args:
        total: bytes the operation will move.
        desc: short label shown before the bar (``"save"``, ``"consolidate"``).
        rank: this process's rank; only rank 0 ever shows a bar.
        quiet: ``True`` never shows one; ``None`` follows ``SHARDKIT_QUIET``.
    """
    if not progress_enabled(total, rank=rank, quiet=quiet):
        return _NoBar()
    from tqdm.auto import tqdm  # noqa: PLC0415 - only when a bar is actually shown

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,  # type: ignore[no-any-return]
                dynamic_ncols=True, leave=False, file=sys.stderr)
