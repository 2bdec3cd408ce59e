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

A collective operation shows the bytes of the whole operation, every rank's, not rank 0's
share: ``progress(total_of_all_ranks, "save", share=rank0_bytes)`` sizes the bar (and the
64 MiB rule) by the global total and advances it by ``total / share`` per byte rank 0
moves, so the bar reads, e.g., "3.1G/4.0G" for a 4 GB save over 4 ranks and is full when
rank 0 is done (ranks move their shares in parallel; rank 0 stands for all of them).
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


class _Share:
    """Advances a bar sized for every rank's bytes by this rank's bytes, scaled up."""

    def __init__(self, bar: Bar, total: int, share: int) -> None:
        self._bar, self._total, self._share = bar, total, share
        self._done = 0      # this rank's bytes so far
        self._shown = 0     # what the bar shows

    def update(self, n: int) -> None:
        self._done += n
        shown = min(self._total, self._done * self._total // self._share)
        self._bar.update(shown - self._shown)
        self._shown = shown

    def __getattr__(self, name: str) -> object:  # the rest of tqdm's interface (refresh, set_postfix, ...)
        return getattr(self._bar, name)

    def __enter__(self) -> _Share:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> object:
        return self._bar.__exit__(*exc)  # type: ignore[arg-type]


def progress(total: int, desc: str, *, rank: int = 0, quiet: bool | None = None, share: int | None = None) -> Bar:
    """A tqdm byte counter for ``total`` bytes on rank 0 of a terminal, else a no-op.

    Args:
        total: bytes the operation will move, on all ranks together.
        desc: short label shown before the bar (``"save"``, ``"consolidate"``).
        rank: this process's rank; only rank 0 ever shows a bar.
        quiet: ``True`` never shows one; ``None`` follows ``SHARDKIT_QUIET``.
        share: the bytes this rank moves itself when ``total`` counts every rank's (the bar
            then advances ``total / share`` per byte); ``None`` when this rank moves them all.

    Example:
        >>> with progress(4 << 30, "save", rank=0, share=1 << 30) as bar:  # doctest: +SKIP
        ...     bar.update(1 << 20)  # the bar shows 4 MiB done
    """
    if not progress_enabled(total, rank=rank, quiet=quiet) or share == 0:
        return _NoBar()
    from tqdm.auto import tqdm  # noqa: PLC0415 - only when a bar is actually shown

    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
               dynamic_ncols=True, leave=False, file=sys.stderr)
    if share is None or share == total:
        return bar  # type: ignore[no-any-return]
    return _Share(bar, total, share)
