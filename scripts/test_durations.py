"""Refresh tests/durations.json, the per-file test durations the progress line estimates from.

Runs pytest (the whole suite, or the arguments given) with ``SHARDKIT_TEST_DURATIONS`` set, so
tests/conftest.py records each file's seconds and number of tests, and merges that into the
table: files that ran replace their entries, the others keep theirs. ``--from FILE`` merges a
recording made by an earlier run instead of running anything (e.g. from
``SHARDKIT_TEST_DURATIONS=/tmp/d.json ./scripts/test.sh``). Only the files' relative weights
matter to the estimate (the time left is scaled by how fast the run goes), but a table measured
in one run on a quiet machine weighs them best::

    python scripts/test_durations.py                    # the whole suite, then merge
    python scripts/test_durations.py tests/unit         # only these files' entries
    python scripts/test_durations.py --from /tmp/d.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "tests" / "durations.json"


def merge(recorded: dict[str, dict[str, float]], table_path: Path = TABLE) -> dict[str, object]:
    """The table with ``recorded``'s files replaced; written back to ``table_path``."""
    try:
        files = json.loads(table_path.read_text()).get("files", {})
    except (OSError, ValueError):
        files = {}
    files.update(recorded)
    files = {name: files[name] for name in sorted(files) if (ROOT / name).exists()}  # files since removed go
    table = {"about": "seconds and tests per test file, for the progress line's estimate (tests/_progress.py); "
                      "refreshed by scripts/test_durations.py",
             "files": files}
    table_path.write_text(json.dumps(table, indent=1) + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, help="merge this recording instead of running pytest")
    args, pytest_args = parser.parse_known_args(argv)
    status = 0
    if args.source is not None:
        recorded = json.loads(args.source.read_text())["files"]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "durations.json"
            env = {**os.environ, "SHARDKIT_TEST_DURATIONS": str(out)}
            status = subprocess.run([sys.executable, "-m", "pytest", "-q", *pytest_args], cwd=ROOT, env=env).returncode
            if not out.exists():
                print("test_durations: pytest recorded nothing; the table is unchanged", file=sys.stderr)
                return status or 1
            recorded = json.loads(out.read_text())["files"]
    table = merge(recorded)
    total = sum(e["seconds"] for e in table["files"].values())  # type: ignore[union-attr]
    print(f"test_durations: {len(recorded)} file(s) recorded; the table holds {len(table['files'])} "  # type: ignore[arg-type]
          f"files, {total:.0f} s in all")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
