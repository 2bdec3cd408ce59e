#!/usr/bin/env bash
# Set up .venv if needed, lint the packages (ruff; mypy beside the tests), run the whole test suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not distributed" or
# ./scripts/test.sh tests/unit -x. SHARDKIT_SKIP_LINT=1 skips ruff and mypy.
#
# Progress: one line per test file with its share of the suite's time done and the time left
# ("[ 42%, 3m10s left]", from the files' measured durations: tests/_progress.py), the ten
# slowest tests, the skipped tests with their reasons, pytest's closing "N passed in ..." line,
# then the time of each stage.
#
# The docs test checks the site's layout in headless Chromium (scripts/screenshots.py). Where
# Chromium is missing and this runs as root with apt-get (a fresh CI machine), Debian's package
# is installed first when the run includes the docs test (no arguments, or tests/test_docs.py
# named); SHARDKIT_INSTALL_CHROMIUM=0 says not to. Elsewhere the check is skipped, and named
# with its reason in pytest's summary.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$SHARDKIT_ROOT"
start=$SECONDS
mypy_pid=""
mypy_log="$(mktemp)"
# Whatever happens, mypy does not outlive this script.
trap 'rm -f "$mypy_log"; if [ -n "$mypy_pid" ]; then kill "$mypy_pid" 2>/dev/null || true; fi' EXIT
if [ "${SHARDKIT_SKIP_LINT:-0}" != 1 ]; then
    # Settings (rules, strictness, cache in .mypy_cache) are in pyproject.toml. ruff takes a
    # second; mypy (half a minute of one core on a clean clone) runs beside the tests, so its
    # time is shared with theirs rather than added before them; its report follows theirs.
    echo "lint: ruff check; mypy runs beside the tests"
    "$SHARDKIT_PYTHON" -m ruff check sharding _shardkit sharded_tensor checkpoint scripts tests
    "$SHARDKIT_PYTHON" -m mypy > "$mypy_log" 2>&1 &
    mypy_pid=$!
fi
lint=$((SECONDS - start))
wants_docs=0
if [ $# -eq 0 ]; then wants_docs=1; fi
for arg in "$@"; do case "$arg" in *test_docs*) wants_docs=1 ;; esac; done
if [ "$wants_docs" = 1 ] && [ "${SHARDKIT_INSTALL_CHROMIUM:-1}" = 1 ] && ! command -v chromium >/dev/null 2>&1 \
        && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: installing Chromium (Debian's chromium package) for the docs' layout check" >&2
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >&2; then
        echo "test.sh: Chromium could not be installed; the layout check will be skipped (see the summary)" >&2
    fi
fi
status=0
# Default verbosity (not -q): pytest names each file as it starts and shows the progress.
"$SHARDKIT_PYTHON" -m pytest --durations=10 -rs "$@" || status=$?
tests_done=$SECONDS
if [ -n "$mypy_pid" ]; then
    mypy_status=0
    wait "$mypy_pid" || mypy_status=$?
    mypy_pid=""
    echo "lint: mypy"
    cat "$mypy_log"
    if [ "$mypy_status" != 0 ]; then status=$mypy_status; fi
fi
total=$((SECONDS - start))
printf 'test.sh: ruff %dm%02ds, tests (mypy beside them) %dm%02ds, mypy after the tests %dm%02ds, total %dm%02ds\n' \
    $((lint / 60)) $((lint % 60)) $(((tests_done - start - lint) / 60)) $(((tests_done - start - lint) % 60)) \
    $(((SECONDS - tests_done) / 60)) $(((SECONDS - tests_done) % 60)) $((total / 60)) $((total % 60)) >&2
exit "$status"
