"""Command line entry point ``python -m checkpoint`` / ``shardkit-checkpoint`` (placeholder)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__: list[str] = []


def main(argv: Sequence[str] | None = None) -> int:
    """Print help; the inspect/verify/consolidate commands are not implemented yet."""
    parser = argparse.ArgumentParser(
        prog="shardkit-checkpoint",
        description="Inspect, verify and consolidate shardkit checkpoints (not implemented yet).")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
