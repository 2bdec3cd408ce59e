"""Run a command on a busy machine: N busy-loop processes compete for the cores while it runs.

How the tests are checked to hold on a busy developer machine or CI runner (load average 25 on
2 cores): the loops are plain processes at normal priority, as other people's jobs would be,
started before the command and stopped after it, whatever its outcome. Prints the load
average at the start and at the end, and exits with the command's status::

    python scripts/under_load.py --loops 24 -- ./scripts/test.sh tests/distributed/test_exit.py
    python scripts/under_load.py --loops 24 --repeat 3 -- .venv/bin/python -m pytest tests/unit -q

The loops stop after ``--limit`` seconds at the latest (default one hour), so a command that
hangs cannot leave them running.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

_LOOP = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=24, help="busy-loop processes (default 24)")
    parser.add_argument("--repeat", type=int, default=1, help="run the command this many times")
    parser.add_argument("--limit", type=float, default=3600.0, help="seconds after which the loops stop anyway")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # through the finally below: the loops never outlive this script

    signal.signal(signal.SIGTERM, stop)
    loops = [subprocess.Popen([sys.executable, "-c", _LOOP.format(limit=args.limit)]) for _ in range(args.loops)]
    status = 0
    try:
        time.sleep(5)  # let the loops take the cores before the command starts
        for run in range(1, args.repeat + 1):
            start = time.monotonic()
            print(f"under_load: run {run}/{args.repeat} with {args.loops} busy loops, load average "
                  f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}: {' '.join(command)}", file=sys.stderr, flush=True)
            code = subprocess.run(command).returncode
            status = status or code
            print(f"under_load: run {run} exited {code} after {time.monotonic() - start:.0f} s, load average "
                  f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", file=sys.stderr, flush=True)
    finally:
        for loop in loops:
            loop.send_signal(signal.SIGTERM)
        for loop in loops:
            loop.wait()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
