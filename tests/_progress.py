"""The progress line's share of the suite done and the time left, from the files' measured durations.

pytest's own ``[ 42%]`` counts tests, but the suite's tests differ by four orders of magnitude
in time (a spec check takes a millisecond, a 4-rank training job a minute): counted that way, a
run spends most of its time under 20%. Here each test file weighs what it took when last
measured (``tests/durations.json``: seconds and number of tests per file, refreshed by
``scripts/test_durations.py``), scaled to the share of its tests selected; a file the table
does not know weighs its number of tests times the table's median seconds per test. The line
then shows the share of that expected time done, and the time left: the expected time still
to run, times how much slower or faster than the table this run has gone so far (so a busy
machine's estimate grows with it). For instance ``[ 48%, 3m10s left]``.

``SHARDKIT_TEST_DURATIONS=path`` writes this run's durations per file (setup, call and teardown
of each test, which includes module fixtures) to ``path`` as JSON, in the table's format.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

TABLE = Path(__file__).parent / "durations.json"
RECORD_ENV = "SHARDKIT_TEST_DURATIONS"


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_table(path: Path = TABLE) -> dict[str, dict[str, float]]:
    """``{file: {"seconds": s, "tests": n}}``; empty when the table is missing or unreadable."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {f: e for f, e in table.get("files", {}).items()
            if isinstance(e, dict) and e.get("seconds", -1) >= 0 and e.get("tests", 0) > 0}


def expected_seconds(selected: Counter[str], table: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each selected file's expected time: its measured time for the share of its tests selected."""
    per_test = statistics.median(e["seconds"] / e["tests"] for e in table.values()) if table else 0.01
    out = {}
    for name, count in selected.items():
        entry = table.get(name)
        out[name] = (entry["seconds"] * min(1.0, count / entry["tests"]) if entry is not None
                     else per_test * count)
    return out


def format_left(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class TimeProgress:
    """Replaces the terminal reporter's percentage by a time-weighted one with the time left."""

    def __init__(self, items: list[pytest.Item], table: dict[str, dict[str, float]]) -> None:
        self.selected = Counter(_file(item.nodeid) for item in items)
        self.expected = expected_seconds(self.selected, table)
        self.total = sum(self.expected.values()) or 1.0
        self.finished: Counter[str] = Counter()  # tests whose teardown ended, per file
        self.start = time.monotonic()
        self.durations: Counter[str] = Counter()

    def report(self, report: pytest.TestReport) -> None:
        name = _file(report.nodeid)
        self.durations[name] += report.duration
        if report.when == "teardown":
            self.finished[name] += 1

    def done(self) -> float:
        """Expected seconds of the tests finished so far."""
        return sum(self.expected[f] * min(1.0, n / self.selected[f]) for f, n in self.finished.items()
                   if f in self.selected)

    def message(self) -> str:
        done = self.done()
        share = min(100, int(100 * done / self.total))
        if done <= 0:
            return f" [{share:3d}%]"
        rate = (time.monotonic() - self.start) / done
        return f" [{share:3d}%, {format_left((self.total - done) * rate)} left]"

    def install(self, reporter: Any) -> None:
        """Use :meth:`message` for the reporter's progress (pytest's default percentage mode only)."""
        if getattr(reporter, "_show_progress_info", None) != "progress":
            return
        if not hasattr(reporter, "_get_progress_information_message"):
            return
        reporter._get_progress_information_message = self.message

        def past_edge() -> None:
            # pytest reserves room for " [100%]"; this message is longer, so reserve its own width.
            msg = self.message()
            if reporter._width_of_current_line + len(msg) + 1 >= reporter._screen_width:
                main_color, _ = reporter._get_main_color()
                reporter._tw.write(msg + "\n", **{main_color: True})

        reporter._write_progress_information_if_past_edge = past_edge

    def record(self) -> None:
        """Write this run's durations per file where ``SHARDKIT_TEST_DURATIONS`` says."""
        path = os.environ.get(RECORD_ENV)
        if not path:
            return
        files = {f: {"seconds": round(self.durations[f], 3), "tests": self.finished[f]}
                 for f in sorted(self.finished) if self.finished[f]}
        Path(path).write_text(json.dumps({"files": files}, indent=1) + "\n")
