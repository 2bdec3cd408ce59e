#!/usr/bin/env bash
# Set up .venv if needed, lint and type-check the packages, then run the whole test suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not distributed" or
# ./scripts/test.sh tests/unit -x. SHARDKIT_SKIP_LINT=1 skips ruff and mypy.
#
# Progress: one line per test file with its share of the suite done ("[ 42%]"), the ten
# slowest tests, pytest's closing "N passed in ..." line, then the time of each stage.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$SHARDKIT_ROOT"
start=$SECONDS
if [ "${SHARDKIT_SKIP_LINT:-0}" != 1 ]; then
    # Settings (rules, strictness, cache in .mypy_cache) are in pyproject.toml.
    echo "lint: ruff check, then mypy"
    "$SHARDKIT_PYTHON" -m ruff check sharding _shardkit sharded_tensor checkpoint
    "$SHARDKIT_PYTHON" -m mypy
fi
lint=$((SECONDS - start))
status=0
# Default verbosity (not -q): pytest names each file as it starts and shows the running percentage.
"$SHARDKIT_PYTHON" -m pytest --durations=10 "$@" || status=$?
total=$((SECONDS - start))
printf 'test.sh: lint %dm%02ds, tests %dm%02ds, total %dm%02ds\n' \
    $((lint / 60)) $((lint % 60)) $(((total - lint) / 60)) $(((total - lint) % 60)) $((total / 60)) $((total % 60)) >&2
exit "$status"
