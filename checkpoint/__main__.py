"""Command line entry point: ``python -m checkpoint`` and the ``shardkit-checkpoint`` console script.

Commands: ``inspect PATH``, ``verify PATH`` and ``consolidate PATH OUTPUT
[--max-shard-size 5GB]``; ``--help`` on each. The implementation is ``checkpoint._cli``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._cli import main as _main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shardkit-checkpoint`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    return _main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
