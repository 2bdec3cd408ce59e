#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite. Extra arguments go to pytest,
# e.g. ./scripts/test.sh -m "not distributed" or ./scripts/test.sh tests/unit -x
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$SHARDKIT_ROOT"
exec "$SHARDKIT_PYTHON" -m pytest -q "$@"
