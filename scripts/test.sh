#!/usr/bin/env bash
# Set up .venv if needed, lint and type-check the packages, then run the whole test suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not distributed" or
# ./scripts/test.sh tests/unit -x. SHARDKIT_SKIP_LINT=1 skips ruff and mypy.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$SHARDKIT_ROOT"
if [ "${SHARDKIT_SKIP_LINT:-0}" != 1 ]; then
    # Settings (rules, strictness, cache in .mypy_cache) are in pyproject.toml.
    "$SHARDKIT_PYTHON" -m ruff check sharding _shardkit sharded_tensor checkpoint
    "$SHARDKIT_PYTHON" -m mypy
fi
exec "$SHARDKIT_PYTHON" -m pytest -q "$@"
