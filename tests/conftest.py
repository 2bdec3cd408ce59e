"""Shared pytest configuration: markers and per-directory defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

_DISTRIBUTED_DIR = Path(__file__).parent / "distributed"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: multi-process test (Gloo on CPU, spawned by _shardkit/launch.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything under tests/distributed/ as ``distributed``, so ``-m "not distributed"`` skips it."""
    for item in items:
        if _DISTRIBUTED_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.distributed)
