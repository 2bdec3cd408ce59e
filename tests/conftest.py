"""Shared pytest configuration: markers, per-directory defaults, and the progress line's time estimate."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest

from tests._progress import TimeProgress, load_table

_DISTRIBUTED_DIR = Path(__file__).parent / "distributed"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: multi-process test (Gloo on CPU, spawned by _shardkit/launch.py)")
    # The quick tier (-m "not slow") draws a quarter of each property test's examples
    # (tests/_examples.py); the full suite draws them all. An explicit profile wins.
    if re.search(r"\bnot\s+slow\b", config.option.markexpr or "") and not config.getoption("hypothesis_profile", None):
        from hypothesis import settings

        from tests._examples import QUICK

        settings.load_profile(QUICK)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything under tests/distributed/ as ``distributed``, so ``-m "not distributed"`` skips it."""
    for item in items:
        if _DISTRIBUTED_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.distributed)


_PROGRESS: list[TimeProgress] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Weigh the progress line by the files' measured durations (``tests/_progress.py``), and keep
    what the run imported and collected out of later garbage collections.

    Tests call ``gc.collect()`` to release memory they measure; with torch, transformers and
    a thousand collected tests on the heap, each full collection would otherwise walk all of
    it (most of a second). What exists now lives for the whole run anyway.
    """
    progress = TimeProgress(session.items, load_table())
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        progress.install(reporter)
    _PROGRESS[:] = [progress]
    gc.freeze()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _PROGRESS:
        _PROGRESS[0].report(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    del session
    if _PROGRESS:
        _PROGRESS[0].record()
