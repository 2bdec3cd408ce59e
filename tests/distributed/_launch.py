"""The tests' name for the launcher in ``_shardkit.launch`` (shared with the benchmarks)."""

from __future__ import annotations

from _shardkit.launch import LaunchError, run_distributed

# The name the distributed tests catch; the same class.
DistributedTestError = LaunchError

__all__ = ["DistributedTestError", "run_distributed"]
