#!/usr/bin/env bash
# Set up .venv if needed, then run the shardkit demo (scripts/demo.py), which launches its
# job with torchrun on 4 local CPU processes (Gloo). Extra arguments go to demo.py, e.g.
#   ./scripts/demo.sh --nproc 2 --out /tmp/demo      ./scripts/demo.sh --device cuda
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$SHARDKIT_ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$SHARDKIT_PYTHON" scripts/demo.py "$@"
